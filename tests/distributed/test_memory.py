"""DistributedFusedAdam.memory_report() matches the byte counts implied by the bucket layout, and
optimizer memory per rank shrinks as 1/world_size (ZeRO-2 sharding).

Expected numbers are computed here from the layout (shard and bucket sizes) and element sizes written
out below, never read back from the report.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from torch import nn

from distopt import DistributedFusedAdam

from harness import run_ranks

# Bytes per element of what the optimizer keeps.
FP32, BF16, INT16 = 4, 2, 2
BUCKET_CAP_MB = 0.005  # 5 KiB: ~1300 fp32 elements, so the ~7k-element model spans several buckets
ALIGN = 16  # the planner's default alignment (elements), used in the padding bound


def make_model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)  # same weights on every rank
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10)).to(dtype)


@dataclass(frozen=True)
class Config:
    dtype: torch.dtype  # model params
    kwargs: dict = field(default_factory=dict)  # optimizer options
    # Bytes per element this configuration must keep, by what the options promise:
    master: int = 0  # per shard element: fp32 master params
    remainders: int = 0  # per shard element: int16 low halves of bf16 params
    buffers: int = 0  # per bucket element: persistent grad buffer + param buffer
    staging: int = 0  # per shard element, offload: host copies of 16-bit reduced grads and param slices
    offload: bool = False  # the state (master, moments, grad shard) and staging are host memory


CONTIGUOUS = dict(contiguous_grad_buffer=True, contiguous_param_buffer=True)
CONFIGS = {
    "fp32-default": Config(torch.float32),  # an fp32 model synchronised in fp32 is its own master
    "fp32-store_params-True": Config(torch.float32, dict(store_params=True), master=FP32),
    "fp32-store_params-False": Config(torch.float32, dict(store_params=False)),  # the params are the masters
    "bf16-default": Config(torch.bfloat16, master=FP32),  # 16-bit params need fp32 masters by default
    "bf16-remainders": Config(torch.bfloat16, dict(store_param_remainders=True), remainders=INT16),
    "fp32-contiguous-buffers": Config(torch.float32, dict(store_params=True, **CONTIGUOUS), master=FP32,
                                      buffers=FP32 + FP32),
    # grads reduced in fp32, params gathered in bf16
    "bf16-contiguous-buffers-fp32-grads": Config(torch.bfloat16, dict(grad_sync_dtype=torch.float32, **CONTIGUOUS),
                                                 master=FP32, buffers=FP32 + BF16),
    # offload: fp32 masters always (on the host); an fp32 shard lands in the grad shard itself
    "fp32-offload": Config(torch.float32, dict(offload_optimizer=True), master=FP32, offload=True),
    "bf16-offload": Config(torch.bfloat16, dict(offload_optimizer=True), master=FP32, staging=BF16 + BF16,
                           offload=True),
    "fp32-offload-contiguous-buffers": Config(torch.float32, dict(offload_optimizer=True, **CONTIGUOUS), master=FP32,
                                              buffers=FP32 + FP32, offload=True),
}


def expected_report(config: Config, shard_numel: int, bucket_numel: int) -> dict[str, int]:
    """Bytes per category from this rank's total shard size (sum over buckets) and total bucket size."""
    expected = {
        "master": config.master * shard_numel,
        "moments": 2 * FP32 * shard_numel,  # exp_avg and exp_avg_sq, fp32
        "remainders": config.remainders * shard_numel,
        "grad_shard": FP32 * shard_numel,  # fp32 reduced-gradient shard
        "buffers": config.buffers * bucket_numel,  # transient buckets are freed after the step
        "staging": config.staging * shard_numel,
    }
    state = sum(expected[k] for k in ("master", "moments", "remainders", "grad_shard"))
    expected["device"] = expected["buffers"] + (0 if config.offload else state)
    expected["host"] = expected["staging"] + (state if config.offload else 0)
    expected["total"] = expected["device"] + expected["host"]
    return expected


def _report_rank(rank: int, world_size: int, config: str) -> dict:
    dtype, kwargs = CONFIGS[config].dtype, CONFIGS[config].kwargs
    model = make_model(dtype)
    params = list(model.parameters())
    opt = DistributedFusedAdam(params, lr=1e-2, bucket_cap_mb=BUCKET_CAP_MB, **kwargs)
    before = [p.detach().clone() for p in params]
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(100 + rank)).to(dtype)
    model(x).float().square().mean().backward()
    opt.step()
    assert all(not torch.equal(p, b) for p, b in zip(params, before)), "the step did not update every param"
    layout = opt._runtime.layout
    return dict(
        report=dict(opt.memory_report()),
        shard_numel=sum(b.shard_numel for b in layout.buckets),
        bucket_numel=sum(b.numel for b in layout.buckets),
        used_numel=sum(b.used_numel() for b in layout.buckets),
        n_buckets=len(layout.buckets),
        n_pieces=sum(len(b.pieces) for b in layout.buckets),
        model_numel=sum(p.numel() for p in params),
    )


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_memory_report_matches_layout(config, world_size):
    """After one step every category equals the bytes implied by the layout's shard and bucket sizes."""
    results = run_ranks(_report_rank, world_size, args=(config,), timeout=60)
    for rank, r in enumerate(results):
        assert r["used_numel"] == r["model_numel"], "the layout does not hold exactly the model's params"
        assert r["bucket_numel"] == world_size * r["shard_numel"]
        assert r["n_buckets"] > 1 or "contiguous" in config, "expected several buckets (small bucket_cap_mb)"
        assert r["report"] == expected_report(CONFIGS[config], r["shard_numel"], r["bucket_numel"]), f"rank {rank}"
    assert all(r["report"] == results[0]["report"] for r in results), "equal shards must cost the same on every rank"


def test_sharded_state_shrinks_with_world_size():
    """Moments, master and grad shard per rank are ~1/world_size of the single-rank size (ZeRO-2 sharding)."""
    by_world = {ws: run_ranks(_report_rank, ws, args=("fp32-store_params-True",), timeout=60)[0]
                for ws in (1, 2, 4)}
    model_numel = by_world[1]["model_numel"]
    for ws, r in by_world.items():
        report = r["report"]
        assert report["moments"] == 2 * FP32 * r["shard_numel"]
        # A rank's shard holds 1/ws of the params plus padding: the alignment gaps between pieces
        # (< ALIGN each) spread over ws ranks, and < ALIGN per bucket to round shards up.
        lower = model_numel / ws
        upper = (model_numel + (ALIGN - 1) * r["n_pieces"]) / ws + ALIGN * r["n_buckets"]
        assert lower <= r["shard_numel"] <= upper, (ws, r["shard_numel"], lower, upper)
        for category in ("moments", "master", "grad_shard"):
            ratio = report[category] / by_world[1]["report"][category]
            assert abs(ratio - 1 / ws) <= 0.05, (category, ws, ratio)  # padding is < 5% of this model
    assert by_world[4]["report"]["total"] < by_world[2]["report"]["total"] < by_world[1]["report"]["total"]
