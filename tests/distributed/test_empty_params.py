"""Params with no elements (a (0, n) weight, an empty ParameterList entry) train beside the others, as
under DDP + AdamW: no bucket holds them, nothing gathers or reduces them, checkpoints carry them."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distopt import DistributedFusedAdam

import tolerances
from harness import run_ranks


class WithEmpty(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(6, 5)
        self.empty = nn.Parameter(torch.zeros(0, 5))  # read by the forward, like any weight
        self.b = nn.Linear(5, 3)
        self.scalars = nn.ParameterList([nn.Parameter(torch.zeros(0)), nn.Parameter(torch.ones(()))])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x)) + self.empty.sum(0)
        return self.b(h) * self.scalars[1] + self.scalars[0].sum()


def _train(rank: int, world_size: int, overlap: bool, contiguous: bool) -> int:
    ref_model, model = WithEmpty(), WithEmpty()
    ref = DDP(ref_model)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=0.05, weight_decay=0.01)
    opt = DistributedFusedAdam(model.parameters(), lr=0.05, weight_decay=0.01, bucket_cap_mb=1e-4,
                               overlap_param_sync=overlap, contiguous_grad_buffer=contiguous)
    gen = torch.Generator().manual_seed(10 + rank)
    checks = 0
    for step in range(4):
        for micro in range(2):  # the first backward accumulates locally
            x = torch.randn(4, 6, generator=gen)
            loss, ref_loss = model(x).square().mean(), ref(x).square().mean()
            if micro == 0:
                with opt.no_sync(), ref.no_sync():
                    loss.backward()
                    ref_loss.backward()
            else:
                loss.backward()
                ref_loss.backward()
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
        opt.param_sync()
        for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
            tolerances.assert_close(p, q, tolerances.DISTRIBUTED, msg=lambda m, n=name, s=step: f"step {s} {n}: {m}")
            checks += 1
    sd = opt.state_dict()
    fresh = DistributedFusedAdam(WithEmpty().parameters(), lr=0.05, weight_decay=0.01, bucket_cap_mb=1e-4)
    fresh.load_state_dict(sd)
    assert [tuple(e["exp_avg"].shape) for e in fresh.state_dict()["state"].values()] == \
        [tuple(p.shape) for p in model.parameters()]
    return checks


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("overlap, contiguous", [(False, False), (True, False), (False, True)])
def test_empty_params_train_like_ddp(overlap: bool, contiguous: bool, world_size: int) -> None:
    assert all(c > 0 for c in run_ranks(_train, world_size, (overlap, contiguous)))
