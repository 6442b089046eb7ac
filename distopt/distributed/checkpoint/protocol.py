"""What checkpoints use of an optimizer: the ``ShardedOptimizer`` protocol.

The checkpoint package depends on DistributedFusedAdam only through these members (the "checkpoints"
section of its class), never on its module or its private attributes: the optimizer imports the
checkpoint package, not the reverse. Anything with these members can be saved and loaded.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import Tensor

from ..buckets import BucketRuntime
from ..comm import Comm


class ShardedOptimizer(Protocol):
    """All that checkpoints use of DistributedFusedAdam."""

    param_groups: list[dict[str, Any]]
    comm: Comm  # its process groups: checkpoints gather over the shard group and agree over the others
    step_count: int  # read by saves, set by loads
    # The moment formats (FusedAdam's names): a state dict holds each moment in its format.
    exp_avg_dtype: torch.dtype
    exp_avg_sq_dtype: torch.dtype
    stochastic_rounding: bool

    def checkpoint_params(self) -> list[Tensor]:
        """The trainable params; bucket fragments name them by their position in this list."""
        ...

    def checkpoint_tensors(self) -> list[Tensor]:
        """What the buckets hold of each trainable param: the param, or a DTensor param's local tensor."""
        ...

    def checkpoint_indices(self) -> list[int]:
        """Each trainable param's position in ``param_groups`` (its key in state dicts)."""
        ...

    def shard_buckets(self, build: bool = True) -> list[BucketRuntime]:
        """This rank's buckets, current (no param all-gather pending); built first unless `build` is False."""
        ...

    def publish_params(self) -> None:
        """Writes the model params from the buckets' param slices, as after a step."""
        ...

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drops every gradient (a load starts the next iteration afresh)."""
        ...
