"""FusedAdam, a drop-in for ``torch.optim.AdamW`` running distopt's fused kernel on one device (or on
the local shards of DTensor params): the optimizer (optimizer.py), its steady-state step plan
(plan.py), the offloaded host step (host_step.py), the step under torch.compile (traced_step.py) and
its low-precision moments (moments.py)."""

from .optimizer import FusedAdam

__all__ = ["FusedAdam"]
