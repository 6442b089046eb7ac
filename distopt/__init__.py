"""distopt: fused multi-tensor Adam kernels and optimizers for PyTorch."""

import torch  # noqa: F401  (torch must be loaded before the extension)

from . import ops
from .distributed import DistributedFusedAdam
from .fused_adam import FusedAdam

__all__ = ["DistributedFusedAdam", "FusedAdam", "ops"]
