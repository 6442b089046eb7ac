"""DistributedFusedAdam(offload_optimizer=True) with CUDA params over NCCL (world size 1, in this
process): the real device<->host copies (pinned memory, the side stream, events). GPU tests: marked
cuda, skipped without a GPU; the same logic runs on CPU params in test_offload.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from distopt import DistributedFusedAdam

from test_ddp_equivalence import train_and_compare
from test_offload import OFFLOAD_CONFIGS

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("name", ["default", "tiny_buckets", "sync_every_micro_batch", "overlap_param_sync",
                                  "contiguous_buffers", "bf16_model", "fp16_model", "bf16_grad_sync"])
def test_offload_matches_ddp_on_cuda(nccl_group, name):
    cfg = dataclasses.replace(OFFLOAD_CONFIGS[name], device="cuda")
    assert train_and_compare(0, 1, cfg) > 0


def _train(opt: DistributedFusedAdam, model: nn.Module, steps: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    dtype = next(model.parameters()).dtype
    for _ in range(steps):
        for _ in range(2):  # two synchronising backwards: the second shard is folded into the first
            x = torch.randn(16, 256, device="cuda", generator=gen).to(dtype)
            model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_is_pinned_host_memory_and_matches_resident(nccl_group, dtype):
    """The shard state is pinned host memory, the device holds none of it, and the numbers equal the
    resident optimizer's with fp32 masters (the CPU and GPU kernels compute the same bits)."""
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256)).cuda().to(dtype) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    opts = [DistributedFusedAdam(m.parameters(), bucket_cap_mb=0.25, store_params=True, offload_optimizer=off)
            for m, off in zip(models, (False, True))]
    for m, o in zip(models, opts):
        _train(o, m, 3)
    for b in opts[1].shard_buckets():
        for t in (b.state.exp_avg, b.state.exp_avg_sq, b.state.grad, b.state.master):
            assert t.device.type == "cpu" and t.is_pinned()
    report = opts[1].memory_report()
    assert report["host"] >= report["master"] + report["moments"] + report["grad_shard"] > 0
    assert report["device"] == report["buffers"] == 0
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        assert a.is_cuda and torch.equal(a, b)
    for a, b in zip(opts[0].state.values(), opts[1].state.values()):
        for key in ("param", "exp_avg", "exp_avg_sq"):
            assert torch.equal(a[key].cpu(), b[key])


def test_inf_step_changes_nothing(nccl_group):
    model = nn.Linear(64, 64).cuda()
    opt = DistributedFusedAdam(model.parameters(), offload_optimizer=True)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**10)
    scaler.scale(model(torch.randn(4, 64, device="cuda")).sum()).backward()  # a finite step: the state exists
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    before = [p.detach().clone() for p in model.parameters()] + [t.clone() for s in opt.state.values()
                                                                 for t in s.values()]
    scaler.scale(model(torch.full((4, 64), float("inf"), device="cuda")).sum()).backward()
    scaler.step(opt)
    scaler.update()
    after = [p.detach() for p in model.parameters()] + [t for s in opt.state.values() for t in s.values()]
    assert all(torch.equal(a, b) for a, b in zip(after, before))
    assert scaler.get_scale() == 2.0**9
