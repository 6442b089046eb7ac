"""An exception raised inside backward on every rank, caught, then ``zero_grad()`` and training on,
gives exactly the params of a run that skipped that iteration: with and without params that get no
gradient, overlapped param sync on and off, the failure inside or outside ``no_sync()``.

The failure comes from a custom autograd Function in the middle of the model, so some buckets have
already started their reduce-scatter when it raises and others have not (tiny buckets). Both runs
use the same world size and layout, so they must agree bit for bit.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from distopt import DistributedFusedAdam

from harness import run_ranks

TINY_BUCKET_MB = 128 * 4 / 2**20  # 2 ranks: [c, b] and [a, unused]: an unused param shares a bucket
STEPS, FAIL_AT = 4, 2


class Boom(RuntimeError):
    pass


class FailInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fail: bool):
        ctx.fail = fail
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if ctx.fail:
            raise Boom("injected")
        return grad, None


class Net(nn.Module):
    def __init__(self, unused: bool) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 3)
        self.unused = nn.Linear(3, 3) if unused else None

    def forward(self, x: torch.Tensor, fail: bool) -> torch.Tensor:
        h = torch.tanh(self.b(torch.tanh(self.a(x))))
        return self.c(FailInBackward.apply(h, fail))  # c's grads arrive before the failure, a's and b's never


def train(rank: int, world_size: int, opts: dict, unused: bool, fail_in_no_sync: bool, skip: bool,
          micro_batches: int = 2) -> list:
    torch.manual_seed(0)
    model = Net(unused)
    opt = DistributedFusedAdam(model.parameters(), lr=0.05, bucket_cap_mb=TINY_BUCKET_MB, **opts)
    for step in range(STEPS):
        failing = step == FAIL_AT
        if failing and skip:
            continue
        try:
            for micro in range(micro_batches):
                last = micro == micro_batches - 1
                gen = torch.Generator().manual_seed(100 * step + 10 * micro + rank)
                x, y = torch.randn(5, 6, generator=gen), torch.randn(5, 3, generator=gen)
                fail = failing and (not last if fail_in_no_sync else last)
                with contextlib.nullcontext() if last else opt.no_sync():
                    nn.functional.mse_loss(model(x, fail), y).backward()
            opt.step()
        except Boom:
            assert failing
        opt.zero_grad()
    opt.param_sync()
    return [p.detach().clone() for p in model.parameters()]


CASES = {
    "default": dict(opts={}, unused=False, fail_in_no_sync=False),
    "one_micro_batch": dict(opts={}, unused=True, fail_in_no_sync=False, micro_batches=1),
    "one_micro_batch_overlap": dict(opts=dict(overlap_param_sync=True), unused=True, fail_in_no_sync=False,
                                    micro_batches=1),
    "unused_params": dict(opts={}, unused=True, fail_in_no_sync=False),
    "overlap_param_sync": dict(opts=dict(overlap_param_sync=True), unused=True, fail_in_no_sync=False),
    "overlap_grad_sync_off": dict(opts=dict(overlap_grad_sync=False), unused=True, fail_in_no_sync=False),
    "in_no_sync": dict(opts=dict(overlap_param_sync=True), unused=True, fail_in_no_sync=True),
    "contiguous_grad_buffer": dict(opts=dict(contiguous_grad_buffer=True), unused=True, fail_in_no_sync=True),
}


@pytest.mark.parametrize("name", list(CASES))
def test_caught_exception_then_zero_grad_equals_skipping_the_iteration(name):
    c = CASES[name]
    args = (c["opts"], c["unused"], c["fail_in_no_sync"])
    recovered = run_ranks(train, 2, (*args, False, c.get("micro_batches", 2)))
    skipped = run_ranks(train, 2, (*args, True, c.get("micro_batches", 2)))
    for rank, (ours, ref) in enumerate(zip(recovered, skipped)):
        for i, (p, q) in enumerate(zip(ours, ref)):
            torch.testing.assert_close(p, q, rtol=0, atol=0,
                                       msg=lambda m, i=i, rank=rank: f"rank {rank} param {i}: {m}")


def test_negative_control_a_run_that_trained_on_the_failed_iteration_differs():
    """The comparison can tell: the skipped run differs from one that never failed."""
    c = CASES["unused_params"]

    def no_failure(rank, world_size):
        global FAIL_AT
        FAIL_AT = -1
        return train(rank, world_size, c["opts"], c["unused"], False, False)

    skipped = run_ranks(train, 2, (c["opts"], c["unused"], False, True))
    full = run_ranks(no_failure, 2)
    assert any(not torch.equal(p, q) for p, q in zip(skipped[0], full[0]))


def one_rank_drops(rank: int, world_size: int, overlap_grad_sync: bool, how: str) -> str:
    """Rank 1 drops an iteration's gradients (an exception in backward, or zero_grad() without a
    step); the others step. Every rank must stop with the same error, not train on."""
    torch.manual_seed(0)
    model = Net(unused=True)
    opt = DistributedFusedAdam(model.parameters(), lr=0.05, bucket_cap_mb=TINY_BUCKET_MB,
                               overlap_grad_sync=overlap_grad_sync)
    try:
        for step in range(4):
            x, y = torch.randn(5, 6), torch.randn(5, 3)
            dropping = step == FAIL_AT and rank == 1
            try:
                nn.functional.mse_loss(model(x, dropping and how == "exception"), y).backward()
                if not dropping:
                    opt.step()
            except Boom:
                pass
            opt.zero_grad()
    except RuntimeError as exc:
        return str(exc)
    raise AssertionError("the ranks trained on out of step")


@pytest.mark.parametrize("overlap_grad_sync", [True, False], ids=["overlap", "no_overlap"])
@pytest.mark.parametrize("how", ["exception", "zero_grad_without_step"])
def test_one_rank_dropping_an_iteration_stops_every_rank(how, overlap_grad_sync):
    messages = run_ranks(one_rank_drops, 3, (overlap_grad_sync, how))
    assert len(set(messages)) == 1, messages
    assert "1 of 3 ranks dropped this iteration's gradients" in messages[0]
