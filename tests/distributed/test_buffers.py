"""distopt.distributed.buffers: DDP's buffer broadcast and its schedule, on real gloo groups."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from distopt.distributed.buffers import BufferSync, broadcast_buffers

from harness import run_ranks


class WithBuffers(nn.Module):
    """Buffers of two dtypes, one non-contiguous and one empty, different on every rank."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(rank)
        torch.manual_seed(rank)
        self.lin = nn.Linear(3, 3)
        self.register_buffer("stats", torch.randn(5, 4, generator=g).t())  # strides (1, 4)
        self.register_buffer("count", torch.tensor(10 + rank))
        self.register_buffer("empty", torch.empty(0))
        self.register_buffer("other", torch.randn(7, generator=g), persistent=False)


def _broadcast(rank: int, world_size: int) -> dict:
    world = WithBuffers(rank)
    broadcast_buffers(world)
    sub = WithBuffers(rank)
    group = dist.new_group([1, 2])  # every rank creates it; ranks 1 and 2 use it
    if rank in (1, 2):
        broadcast_buffers(sub, group)
    return {"world": dict(world.named_buffers()), "sub": dict(sub.named_buffers()),
            "stride": world.stats.stride(), "weight": world.lin.weight.detach().clone()}


def test_broadcast_buffers_copies_the_first_ranks_buffers() -> None:
    out = run_ranks(_broadcast, 3)
    expected = dict(WithBuffers(0).named_buffers())
    for rank, r in enumerate(out):
        for name, value in expected.items():
            assert torch.equal(r["world"][name], value), f"rank {rank}: {name}"
        assert r["stride"] == (1, 4)  # written in place: the buffer keeps its layout
        assert not torch.equal(r["weight"], out[0]["weight"]) or rank == 0  # params are not buffers
    sub_src = dict(WithBuffers(1).named_buffers())
    for name, value in sub_src.items():  # the subgroup's first rank (global rank 1) is the source
        assert torch.equal(out[2]["sub"][name], value) and torch.equal(out[1]["sub"][name], value)
    assert not torch.equal(out[0]["sub"]["stats"], sub_src["stats"])  # outside the group: untouched


def _schedule(rank: int, world_size: int, pattern: list[bool]) -> list[float]:
    model = WithBuffers(rank)
    sync = BufferSync(model)
    seen = []
    for synchronising in pattern:
        sync.before_forward(synchronising)
        seen.append(model.count.item())
        model.count += 100 + rank  # what a forward changes locally: differently on each rank
    return seen


def test_buffer_sync_follows_ddps_schedule() -> None:
    """Broadcast at the first forward and at every forward whose predecessor synchronised gradients:
    with accumulation over two micro-batches, at the first of each pair (as DDP's require_forward_param_sync)."""
    pattern = [False, True, False, True, False]  # accumulate, sync, accumulate, sync, evaluation
    seen = run_ranks(_schedule, 2, (pattern,))
    # rank 0 counts 10, 110, 210, ...; rank 1 (+101 per forward) gets rank 0's value at forwards 0, 2, 4
    assert seen[0] == [10, 110, 210, 310, 410]
    assert seen[1] == [10, 111, 210, 311, 410]
    drift = run_ranks(_schedule, 2, ([False, False, False],))  # accumulating only: one broadcast, at the start
    assert drift[1] == [10, 111, 212]
    every = run_ranks(_schedule, 2, ([True, True],))  # no accumulation: at every forward
    assert every[1] == [10, 110]
