"""distopt: fused multi-tensor Adam kernels and optimizers for PyTorch."""

import torch  # noqa: F401  (torch must be loaded before the extension)

from . import ops
from .bmuf import BMUF
from .distributed import DistributedFusedAdam
from .fused_adam import FusedAdam

__all__ = ["BMUF", "DistributedFusedAdam", "FusedAdam", "ops"]
