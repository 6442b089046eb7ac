"""DDP's buffer broadcast, for models that DistributedFusedAdam trains without a DDP wrapper.

``DistributedDataParallel(broadcast_buffers=True)`` (its default) copies rank 0's module buffers to
every rank at the start of a forward when the forward before it synchronised gradients (grad mode on,
outside ``no_sync()``), and at the first forward. Without it, each rank's BatchNorm running statistics
follow only its own batches, so evaluation on every rank but 0 differs from the same job under DDP.
The framework integrations keep a ``BufferSync`` and tell it about each forward of the model.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch import Tensor, nn


def broadcast_buffers(module: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Copies the buffers of ``module`` on the group's first rank to every rank of ``group`` (default:
    the world): one broadcast per buffer dtype and device. A no-op on one rank or without buffers."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    by_kind: dict[tuple[torch.dtype, torch.device], list[Tensor]] = defaultdict(list)
    for b in module.buffers():
        if b.numel() > 0:
            by_kind[(b.dtype, b.device)].append(b)
    src = dist.get_global_rank(group, 0) if group is not None else 0
    for buffers in by_kind.values():  # same order on every rank: module.buffers() is deterministic
        flat = torch.cat([b.detach().reshape(-1) for b in buffers])
        dist.broadcast(flat, src, group=group)
        offset = 0
        with torch.no_grad():
            for b in buffers:
                b.copy_(flat[offset : offset + b.numel()].view(b.shape))
                offset += b.numel()


class BufferSync:
    """DDP's schedule of buffer broadcasts for one module: call ``before_forward`` before each of its
    forwards (training, evaluation alike) with whether this forward's gradients will be synchronised."""

    def __init__(self, module: nn.Module, group: dist.ProcessGroup | None = None) -> None:
        self.module, self.group = module, group
        self.due = True  # DDP broadcasts at its first forward

    def before_forward(self, synchronising: bool) -> None:
        if self.due:
            broadcast_buffers(self.module, self.group)
        self.due = synchronising
