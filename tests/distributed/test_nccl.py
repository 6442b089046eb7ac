"""DistributedFusedAdam on CUDA over NCCL (world size 1, in this process) against DDP + torch AdamW:
the same scenarios as test_ddp_equivalence.py. GPU tests: marked cuda, skipped without a GPU."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from test_ddp_equivalence import CONFIGS, train_and_compare

pytestmark = pytest.mark.cuda

GPU_CASES = ["default", "overlap_off", "sync_every_micro_batch", "tiny_buckets", "contiguous_buffers",
             "overlap_param_sync", "unused_params", "adam_l2", "bf16_grad_sync", "bf16_model", "fp16_model",
             "bf16_remainders", "bf16_remainders_contiguous"]


@pytest.mark.parametrize("name", GPU_CASES)
def test_matches_ddp_on_cuda(nccl_group, name):
    cfg = dataclasses.replace(CONFIGS[name], device="cuda")
    assert train_and_compare(0, 1, cfg) > 0


def test_params_stay_on_cuda_and_no_cpu_copies(nccl_group):
    """Every buffer the optimizer allocates lives on the GPU (a stray CPU tensor would mean a copy)."""
    from torch import nn

    from distopt import DistributedFusedAdam

    model = nn.Linear(64, 64).cuda()
    opt = DistributedFusedAdam(model.parameters())
    model(torch.randn(4, 64, device="cuda")).sum().backward()
    opt.step()
    buckets = opt.shard_buckets()
    assert buckets
    for b in buckets:
        # an fp32 model synchronised in fp32 keeps no masters (the params are their own): None is fine
        for t in (b.state.exp_avg, b.state.exp_avg_sq, b.state.grad, b.state.master, b.state.remainders):
            assert t is None or t.is_cuda
    assert all(p.is_cuda for p in model.parameters())
    for state in opt.state.values():  # the per-param view, too
        assert all(not isinstance(t, torch.Tensor) or t.is_cuda or t.numel() <= 1 for t in state.values())
