"""ZeRO-2 data parallelism: DistributedFusedAdam and its layout planner."""

from .layout import Layout, plan_layout
from .optimizer import DistributedFusedAdam

__all__ = ["DistributedFusedAdam", "Layout", "plan_layout"]
