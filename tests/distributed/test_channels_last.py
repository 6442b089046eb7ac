"""channels_last (NHWC) conv weights with DistributedFusedAdam against DDP + AdamW.

4-D params keep their memory format: they are packed in memory order, gradients are read with the
param's strides, and the updated params (or, with contiguous_param_buffer, the views that replace
them) keep channels_last strides.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distopt import DistributedFusedAdam

import tolerances
from harness import run_ranks

CL = torch.channels_last


def convnet(mixed: bool) -> nn.Module:
    """Two convolutions; both channels_last, or (mixed) only the first."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 6, 3), nn.ReLU(), nn.Flatten(),
                          nn.Linear(6 * 4 * 4, 4))
    model[0].to(memory_format=CL)
    if not mixed:
        model[2].to(memory_format=CL)
    return model


def run(rank: int, world_size: int, mixed: bool, opt_kwargs: dict) -> int:
    ref_model, model = convnet(mixed), convnet(mixed)
    ref = DDP(ref_model)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
    opt = DistributedFusedAdam(model.parameters(), lr=1e-2, **opt_kwargs)
    layouts = [p.stride() for p in model.parameters()]
    checks = 0
    for step in range(4):
        x = torch.randn(5, 3, 8, 8, generator=torch.Generator().manual_seed(10 * step + rank)).to(memory_format=CL)
        out, out_ref = model(x), ref(x)
        tolerances.assert_close(out, out_ref, tolerances.DISTRIBUTED, msg=lambda m, s=step: f"step {s} output {m}")
        out.square().mean().backward()
        out_ref.square().mean().backward()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        opt.param_sync()
        for p, p_ref, stride in zip(model.parameters(), ref_model.parameters(), layouts):
            assert p.stride() == stride == p_ref.stride(), f"step {step}: a param changed its memory format"
            tolerances.assert_close(p, p_ref, tolerances.DISTRIBUTED, msg=lambda m, s=step: f"step {s} param {m}")
            checks += 1
    assert model[0].weight.is_contiguous(memory_format=CL)
    return checks


CASES = {
    "channels_last": (False, {}),
    "mixed_with_contiguous": (True, {}),
    "contiguous_buffers": (False, dict(contiguous_grad_buffer=True, contiguous_param_buffer=True)),
    "mixed_contiguous_buffers_tiny_buckets": (True, dict(contiguous_param_buffer=True, bucket_cap_mb=300 * 4 / 2**20)),
    "overlap_param_sync": (False, dict(overlap_param_sync=True, bucket_cap_mb=300 * 4 / 2**20)),
}


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("name", list(CASES))
def test_channels_last_matches_ddp(name, world_size):
    mixed, kwargs = CASES[name]
    assert all(c > 0 for c in run_ranks(run, world_size, (mixed, kwargs)))
