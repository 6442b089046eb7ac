"""Overlap is shown, not assumed: the order of communication events against backward and forward.

The optimizer reports collectives through ``opt.comm.on_event(name, bucket)``; the test adds its own
markers for the end of backward (the input's gradient is the last one autograd computes) and the
start and end of forward (hooks on the root module, which owns no params).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distopt import DistributedFusedAdam

from harness import run_ranks

TINY_BUCKET_MB = 300 * 4 / 2**20  # ~300 fp32 elements: every layer gets its own bucket(s)


def deep_mlp() -> nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(6):
        layers += [nn.Linear(16, 16), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(16, 2))


def one_iteration(model, opt, events, rank):
    events.append(("iteration", -1))
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank)).requires_grad_()
    x.register_hook(lambda g: events.append(("backward_end", -1)))
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


def record_events(rank: int, world_size: int, overlap_param_sync: bool) -> list[tuple[str, int]]:
    model = deep_mlp()
    opt = DistributedFusedAdam(model.parameters(), bucket_cap_mb=TINY_BUCKET_MB,
                               overlap_param_sync=overlap_param_sync)
    events: list[tuple[str, int]] = []
    opt.comm.on_event = lambda name, bucket: events.append((name, bucket))
    model.register_forward_pre_hook(lambda m, a: events.append(("forward_start", -1)))
    model.register_forward_hook(lambda m, a, o: events.append(("forward_end", -1)))
    one_iteration(model, opt, events, rank)  # the first iteration builds the layout: no overlap yet
    events.clear()
    one_iteration(model, opt, events, rank)
    one_iteration(model, opt, events, rank)
    return events


def iterations(events: list[tuple[str, int]]) -> list[list[tuple[str, int]]]:
    """The events split at each ("iteration", -1) marker."""
    out: list[list[tuple[str, int]]] = []
    for e in events:
        if e[0] == "iteration":
            out.append([])
        else:
            out[-1].append(e)
    return out


def index(events, name) -> int:
    return next(i for i, (n, _) in enumerate(events) if n == name)


@pytest.mark.parametrize("world_size", [1, 2])
def test_reduce_scatter_starts_during_backward(world_size):
    events = iterations(run_ranks(record_events, world_size, (False,))[0])[-1]
    backward_end = index(events, "backward_end")
    launched_before = [b for n, b in events[:backward_end] if n == "reduce_scatter_start"]
    n_buckets = len({b for n, b in events if n == "reduce_scatter_start"})
    assert n_buckets >= 4, f"the test needs several buckets, got {n_buckets}"
    assert launched_before, f"no reduce-scatter started before backward ended: {events}"
    # buckets launch in index order, most of them while backward still runs
    assert launched_before == sorted(launched_before) and len(launched_before) >= n_buckets // 2


# Not at world size 1: the update writes the params in place there and there is nothing to gather
# (tests/distributed/test_world_size_one.py).
@pytest.mark.parametrize("world_size", [2])
def test_deferred_all_gather_waits_inside_next_forward(world_size):
    previous, events = iterations(run_ranks(record_events, world_size, (True,))[0])
    step_part = previous[index(previous, "backward_end"):]
    assert not any(n.startswith("all_gather") for n, _ in step_part), f"step() gathered params: {step_part}"
    start, end = index(events, "forward_start"), index(events, "forward_end")
    first_wait = index(events, "all_gather_done")
    assert start < first_wait < end, f"first all-gather wait not inside forward: {events[start:end + 1]}"
    gathered = [b for n, b in events[start:end] if n == "all_gather_start"]
    assert gathered == sorted(gathered, reverse=True), "all-gathers must launch in descending bucket order"
    assert len(gathered) >= 4
    # prefetch: a second all-gather is in flight before the forward waits for the first
    assert sum(1 for n, _ in events[start:first_wait] if n == "all_gather_start") >= 2


def test_negative_control_no_overlap_when_disabled():
    """With overlap_grad_sync=False nothing starts before backward ends, and the first test's
    check would fail: it can tell overlap from its absence."""

    def record(rank, world_size):
        model = deep_mlp()
        opt = DistributedFusedAdam(model.parameters(), bucket_cap_mb=TINY_BUCKET_MB, overlap_grad_sync=False)
        events = []
        opt.comm.on_event = lambda name, bucket: events.append((name, bucket))
        for _ in range(2):
            one_iteration(model, opt, events, rank)
        return events

    events = iterations(run_ranks(record, 2)[0])[-1]
    backward_end = index(events, "backward_end")
    assert not [n for n, _ in events[:backward_end] if n == "reduce_scatter_start"]
    assert [n for n, _ in events[backward_end:] if n == "reduce_scatter_start"]
