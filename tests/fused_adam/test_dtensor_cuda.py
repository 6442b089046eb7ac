"""FusedAdam on FSDP2 params on a GPU (NCCL, world size 1, in this process), eager and capturable,
against torch AdamW(fused=True) on the same model with clipping, every step; the steady-state step
performs no DTensor dispatch there either. The same scenario runs on the CPU (gloo, one forked rank,
eager only), so that it is exercised without a GPU; the GPU tests are marked cuda."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distopt import FusedAdam

import tolerances
from dtensor_models import batch, fsdp, groups
from harness import run_ranks
from test_dtensor_steps import Ops

MAX_NORM = 0.02


def scenario(device: str, capturable: bool) -> None:
    (model, _), (ref_model, _) = fsdp(0, 0, 1, device=device), fsdp(0, 0, 1, device=device)
    opt = FusedAdam(groups(model), capturable=capturable)
    ref_opt = torch.optim.AdamW(groups(ref_model), fused=True)
    for step in range(4):
        x, y = (t.to(device) for t in batch(step, 0))
        for m in (model, ref_model):
            nn.functional.mse_loss(m(x), y).backward()
        norm = opt.clip_grad_norm(MAX_NORM)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref_model.parameters(), MAX_NORM).full_tensor()
        torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=0)
        with Ops() as seen:
            opt.step()
        if step > 0:  # the steady state
            assert seen.dtensor_ops == [] and "distopt.adam_step_.default" in seen.ops, seen.ops
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        for p, q in zip(model.parameters(), ref_model.parameters()):
            assert p.to_local().device.type == device
            tolerances.assert_close(p.full_tensor(), q.full_tensor(), tolerances.DISTRIBUTED,
                                    msg=lambda m, s=step: f"step {s}: {m}")


def test_scenario_on_cpu():
    run_ranks(lambda rank, world_size: scenario("cpu", False), 1)


@pytest.mark.cuda
@pytest.mark.parametrize("capturable", [False, True])
def test_fsdp2_on_cuda(nccl_group, capturable):
    scenario("cuda", capturable)
