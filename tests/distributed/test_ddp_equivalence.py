"""DistributedFusedAdam against DDP + torch.optim.AdamW/Adam on gloo ranks, compared after every step.

Each rank trains two copies of the same model on its own batches: one wrapped in DDP with a torch
optimizer (the reference), one with DistributedFusedAdam. Every micro-batch compares outputs and
input gradients, and every step compares every param. Sixteen-bit models use DDP + FusedAdam with
fp32 master weights as the reference: torch's optimizers have no master weights, and FusedAdam is
itself checked against torch.optim.AdamW (tests/fused_adam/test_fused_adam.py), so the chain of trust holds.

DistributedFusedAdam treats a param without a gradient as having a zero gradient (see its
docstring); the reference gets the same semantics by zero-filling None grads before its step.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import pytest
import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from distopt import DistributedFusedAdam, FusedAdam

import tolerances
from harness import hsdp_groups, run_ranks

STEPS, MICRO_BATCHES = 3, 3


class Net(nn.Module):
    """Layers are created in the reverse of the order forward uses them, so the bucket layout must
    follow the backward order, not the creation order. `unused` adds a layer forward never touches;
    `rank_dependent` adds one that only rank 0 uses."""

    def __init__(self, unused: bool = False, rank_dependent: bool = False) -> None:
        super().__init__()
        self.head = nn.Linear(24, 5)
        self.body = nn.Sequential(nn.Linear(24, 24), nn.Tanh(), nn.LayerNorm(24))
        self.stem = nn.Linear(9, 24)
        self.unused = nn.Linear(5, 5) if unused else None
        self.extra = nn.Linear(24, 24) if rank_dependent else None

    def forward(self, x: torch.Tensor, rank: int = 0) -> torch.Tensor:
        # casts let the body run in another dtype than the rest (a mixed-precision model)
        h = self.body(torch.tanh(self.stem(x)).to(self.body[0].weight.dtype)).to(self.head.weight.dtype)
        if self.extra is not None and rank == 0:
            h = h + self.extra(h)
        return self.head(h)


def make_net(cfg: Config) -> Net:
    torch.manual_seed(0)
    net = Net(cfg.unused, cfg.rank_dependent).to(device=cfg.device, dtype=cfg.dtype)
    if cfg.mixed_bf16_body:
        net.body.to(torch.bfloat16)
    return net


def param_groups(model: Net) -> list[dict]:
    """Two groups with different lr and weight decay; a third for the optional layers."""
    groups = [
        {"params": [*model.stem.parameters(), *model.head.parameters()], "lr": 1e-2, "weight_decay": 0.05},
        {"params": list(model.body.parameters()), "lr": 3e-3, "weight_decay": 0.0},
    ]
    extra = [p for m in (model.unused, model.extra) if m is not None for p in m.parameters()]
    if extra:
        groups.append({"params": extra, "lr": 5e-3, "weight_decay": 0.1})
    return groups


@dataclass
class Config:
    opt: dict = field(default_factory=dict)  # DistributedFusedAdam keyword arguments
    dtype: torch.dtype = torch.float32
    sync_every_micro_batch: bool = False  # else no_sync() for all but the last micro-batch
    unused: bool = False
    rank_dependent: bool = False
    adam_w_mode: bool = True
    bf16_grad_sync: bool = False  # the reference compresses grads to bf16 like grad_sync_dtype=bf16
    steps: int = STEPS
    extra_steps_for_ours: int = 0  # negative control: ours takes more steps than the reference
    device: str = "cpu"
    ref_master_weights: bool = True  # 16-bit models: the reference FusedAdam keeps fp32 masters
    mixed_bf16_body: bool = False  # an fp32 model whose middle layers are bf16
    hsdp_shard: int | None = None  # hybrid sharding: state sharded over blocks of this many ranks
    @property
    def table_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.bf16_grad_sync or self.mixed_bf16_body else self.dtype


def reference(cfg: Config, model: Net) -> tuple[nn.Module, torch.optim.Optimizer]:
    ddp = DDP(model, find_unused_parameters=cfg.unused or cfg.rank_dependent)
    if cfg.bf16_grad_sync:
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
    groups = param_groups(model)
    if cfg.dtype != torch.float32 or cfg.mixed_bf16_body:
        return ddp, FusedAdam(groups, master_weights=cfg.ref_master_weights, adam_w_mode=cfg.adam_w_mode)
    torch_cls = torch.optim.AdamW if cfg.adam_w_mode else torch.optim.Adam
    return ddp, torch_cls(groups)


def batch(step: int, micro: int, rank: int, cfg: Config) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(10_000 * step + 100 * micro + rank)
    x = torch.randn(6, 9, generator=gen).to(device=cfg.device, dtype=cfg.dtype)
    return x.requires_grad_(), torch.randn(6, 5, generator=gen).to(device=cfg.device, dtype=cfg.dtype)


def compare(what: str, actual: torch.Tensor, expected: torch.Tensor, cfg: Config) -> None:
    try:
        tolerances.assert_close(actual, expected, tolerances.DISTRIBUTED, dtype=cfg.table_dtype,
                                scale_atol=cfg.table_dtype != torch.float32)
    except AssertionError as exc:
        raise AssertionError(f"{what}: {exc}") from None


def train_and_compare(rank: int, world_size: int, cfg: Config) -> int:
    ref_model, ref_opt = reference(cfg, make_net(cfg))
    model = make_net(cfg)
    groups = hsdp_groups(rank, world_size, cfg.hsdp_shard) if cfg.hsdp_shard else {}
    opt = DistributedFusedAdam(param_groups(model), adam_w_mode=cfg.adam_w_mode, **cfg.opt, **groups)
    deferred = cfg.opt.get("overlap_param_sync", False)
    checks = 0
    for step in range(cfg.steps + cfg.extra_steps_for_ours):
        ours_only = step >= cfg.steps
        for micro in range(MICRO_BATCHES):
            last = micro == MICRO_BATCHES - 1
            quiet = not (last or cfg.sync_every_micro_batch)
            x, y = batch(step, micro, rank, cfg)
            x_ref = x.detach().clone().requires_grad_()
            with opt.no_sync() if quiet else contextlib.nullcontext():
                out = model(x, rank)
                nn.functional.mse_loss(out.float(), y.float()).backward()
            if ours_only:
                continue
            with ref_model.no_sync() if quiet else contextlib.nullcontext():
                out_ref = ref_model(x_ref, rank)
                nn.functional.mse_loss(out_ref.float(), y.float()).backward()
            compare(f"step {step} micro-batch {micro}: output", out, out_ref, cfg)
            compare(f"step {step} micro-batch {micro}: input grad", x.grad, x_ref.grad, cfg)
            if micro == 0 and step > 0:  # by now a deferred all-gather has landed (in forward)
                for (name, p), p_ref in zip(model.named_parameters(), ref_model.module.parameters()):
                    compare(f"before step {step}: {name}", p, p_ref, cfg)
                    checks += 1
        opt.step()
        opt.zero_grad()
        if ours_only:
            continue
        for p in ref_model.parameters():
            if p.grad is None:  # same semantics as ours: no gradient means a zero gradient
                p.grad = torch.zeros_like(p)
        ref_opt.step()
        ref_opt.zero_grad()
    if deferred:
        opt.param_sync()
    for (name, p), p_ref in zip(model.named_parameters(), ref_model.module.parameters()):
        compare(f"after the last step: {name}", p, p_ref, cfg)
        checks += 1
    return checks


CONFIGS = {
    "default": Config(),
    "overlap_off": Config(opt=dict(overlap_grad_sync=False)),
    "sync_every_micro_batch": Config(sync_every_micro_batch=True),
    "tiny_buckets": Config(opt=dict(bucket_cap_mb=600 * 4 / 2**20, pipeline_size=1)),
    "contiguous_buffers": Config(opt=dict(bucket_cap_mb=600 * 4 / 2**20, contiguous_grad_buffer=True,
                                          contiguous_param_buffer=True)),
    "contiguous_sync_every": Config(opt=dict(contiguous_grad_buffer=True), sync_every_micro_batch=True),
    "overlap_param_sync": Config(opt=dict(overlap_param_sync=True, bucket_cap_mb=600 * 4 / 2**20)),
    "unused_params": Config(unused=True, rank_dependent=True),
    "adam_l2": Config(adam_w_mode=False),
    "store_params_true": Config(opt=dict(store_params=True)),  # fp32 masters of fp32 params (apex's way)
    "bf16_store_params_false": Config(dtype=torch.bfloat16, opt=dict(store_params=False), ref_master_weights=False),
    "bf16_grad_sync": Config(opt=dict(grad_sync_dtype=torch.bfloat16), bf16_grad_sync=True),
    "bf16_model": Config(dtype=torch.bfloat16),
    "fp16_model": Config(dtype=torch.float16),
    "bf16_remainders": Config(dtype=torch.bfloat16, opt=dict(store_param_remainders=True)),
    "mixed_dtypes": Config(mixed_bf16_body=True),
    "mixed_dtypes_remainders": Config(mixed_bf16_body=True, opt=dict(store_param_remainders=True)),
    "bf16_remainders_contiguous": Config(dtype=torch.bfloat16, opt=dict(store_param_remainders=True,
                                                                        contiguous_param_buffer=True)),
}

# Hybrid sharding: 2 shards x 2 replicas, and shards of one rank (plain data parallelism with fp32
# main grads: every rank holds all the state, gradients are all-reduced across all ranks).
HSDP = {
    "hsdp_2x2": Config(hsdp_shard=2, opt=dict(bucket_cap_mb=600 * 4 / 2**20)),
    "hsdp_2x2_contiguous_overlap": Config(hsdp_shard=2, opt=dict(
        contiguous_grad_buffer=True, contiguous_param_buffer=True, overlap_param_sync=True)),
    "hsdp_shard_of_one": Config(hsdp_shard=1),
}

# Every configuration on 2 ranks; the main ones on 1 and 4 too; hybrid sharding on 4 (and 2).
CASES = [(name, 2) for name in CONFIGS] + [
    (name, ws) for name in ("default", "tiny_buckets", "overlap_param_sync", "bf16_remainders") for ws in (1, 4)
] + [(name, 4) for name in HSDP] + [("hsdp_shard_of_one", 2)]
CONFIGS.update(HSDP)


@pytest.mark.parametrize("name, world_size", CASES, ids=[f"{n}-ws{w}" for n, w in CASES])
def test_matches_ddp(name, world_size):
    checks = run_ranks(train_and_compare, world_size, (CONFIGS[name],))
    assert all(c > 0 for c in checks), "nothing was compared"


def test_negative_control_one_extra_step_is_caught():
    """The comparison notices a single extra optimizer step (params differ by one update)."""
    with pytest.raises(AssertionError, match="after the last step"):
        run_ranks(train_and_compare, 2, (Config(steps=2, extra_steps_for_ours=1),))
