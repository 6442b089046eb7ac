"""torch.distributed.checkpoint's standard API with DistributedFusedAdam's state on the GPU (NCCL, world
size 1, in this process): inside sharded_state_dicts the state dict is views of the device shards, so
saving allocates no device memory; the round trip is bit-exact. GPU tests: marked cuda, skipped
without a GPU (the gloo tests of the same paths are test_dcp_api.py's)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from distopt import DistributedFusedAdam
from distopt.distributed import checkpoint

pytestmark = pytest.mark.cuda


def build() -> tuple[nn.Module, DistributedFusedAdam]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(128, 128) for _ in range(8)]).cuda()
    return model, DistributedFusedAdam(model.parameters(), bucket_cap_mb=0.25)


def test_sharded_save_on_cuda_allocates_no_device_memory_and_round_trips(nccl_group, tmp_path):
    model, opt = build()
    for _ in range(2):
        model(torch.randn(4, 128, device="cuda")).square().mean().backward()
        opt.step()
        opt.zero_grad()
    expected = opt.state_dict()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with checkpoint.sharded_state_dicts(opt):
        model_sd, optim_sd = get_state_dict(model, opt)
        assert all(v.is_cuda for entry in optim_sd["state"].values() for k, v in entry.items() if k != "step")
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp_path / "ckpt"))
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    bucket = 3 * 4 * max(b.spec.numel for b in opt.shard_buckets())
    assert extra < bucket, (extra, bucket)  # views of the shards: nothing gathered on the device

    model, opt = build()  # fresh, with other weights than the checkpoint's
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    with checkpoint.sharded_state_dicts(opt):
        model_sd, optim_sd = get_state_dict(model, opt)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp_path / "ckpt"))
    set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    reloaded = opt.state_dict()
    for k, entry in expected["state"].items():
        for name, value in entry.items():
            assert torch.equal(reloaded["state"][k][name], value), (k, name)
