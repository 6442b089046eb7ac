"""Checkpoints that resume under any world size, bucket size and init order; torch AdamW interop;
sharded save/load through torch.distributed.checkpoint (distopt's own fast path; torch's standard
API is tested in test_dcp_api.py, refusals and corruption in test_checkpoint_integrity.py).

Every run trains on the same global batch per step, split evenly over however many ranks there are,
so runs on different world sizes follow the same trajectory (up to the summation order of the
gradient reduction). A resumed run is compared with an uninterrupted one: bit for bit where both
reduce the same way (same world size and layout), within tolerance otherwise; and a checkpoint
loaded anywhere must give back exactly the state that was saved.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field

import pytest
import torch
import torch.distributed as dist
from torch import nn

from distopt import DistributedFusedAdam, FusedAdam
from distopt.distributed import checkpoint

import tolerances
from harness import hsdp_groups, run_ranks

GLOBAL_BATCH = 8
TINY_BUCKET_MB = 200 * 4 / 2**20  # params straddle buckets and shards


def make_model(dtype=torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(9, 24), nn.Tanh(), nn.Linear(24, 24), nn.Tanh(), nn.Linear(24, 5)).to(dtype)


def groups(model: nn.Module, lr_scale: float = 1.0) -> list[dict]:
    return [{"params": list(model[0].parameters()) + list(model[4].parameters()), "lr": 1e-2 * lr_scale},
            {"params": list(model[2].parameters()), "lr": 3e-3 * lr_scale, "weight_decay": 0.1}]


@dataclass(frozen=True)
class Setup:
    """How one run builds its optimizer."""

    bucket_cap_mb: float = 100.0
    reverse_init: bool = False  # init_params in reverse param order (else: first-backward order)
    lr_scale: float = 1.0  # a fresh optimizer's lr before loading (must be overwritten)
    dtype: torch.dtype = torch.float32
    opt: dict = field(default_factory=dict)
    hsdp_shard: int | None = None  # hybrid sharding over blocks of this many ranks

    def build(self, model: nn.Module) -> DistributedFusedAdam:
        extra = {}
        if self.hsdp_shard:
            extra = hsdp_groups(dist.get_rank(), dist.get_world_size(), self.hsdp_shard)
        opt = DistributedFusedAdam(groups(model, self.lr_scale), bucket_cap_mb=self.bucket_cap_mb, **self.opt,
                                   **extra)
        if self.reverse_init:
            opt.init_params(list(model.parameters())[::-1])
        return opt


def global_batch(step: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(GLOBAL_BATCH, 9, generator=gen).to(dtype), torch.randn(GLOBAL_BATCH, 5, generator=gen).to(dtype)


def train(model, opt, steps: range, rank: int, world_size: int, dtype) -> list[torch.Tensor]:
    """Steps on this rank's slice of each global batch; returns the full-batch outputs per step."""
    outputs = []
    n = GLOBAL_BATCH // world_size
    for step in steps:
        x, y = global_batch(step, dtype)
        out = model(x)
        outputs.append(out.detach().clone())
        nn.functional.mse_loss(out[rank * n : (rank + 1) * n].float(), y[rank * n : (rank + 1) * n].float()).backward()
        opt.step()
        opt.zero_grad()
    return outputs


def params_of(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def uninterrupted(rank: int, world_size: int, setup: Setup) -> tuple[list, list]:
    model = make_model(setup.dtype)
    opt = dataclasses.replace(setup, lr_scale=1.0).build(model)  # the lr the checkpoint restores
    outputs = train(model, opt, range(6), rank, world_size, setup.dtype)
    opt.param_sync()
    return params_of(model), outputs[3:]


def first_half(rank: int, world_size: int, setup: Setup, path: str | None):
    model = make_model(setup.dtype)
    opt = setup.build(model)
    train(model, opt, range(3), rank, world_size, setup.dtype)
    sd = opt.state_dict()
    if path is not None:
        checkpoint.save(opt, path, extra={"model": model.state_dict()})
    opt.param_sync()
    return sd, copy.deepcopy(model.state_dict())


def second_half(rank: int, world_size: int, setup: Setup, sd, model_sd, path: str | None):
    model = make_model(setup.dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # the fresh model's weights must come from the checkpoint
    opt = setup.build(model)
    if path is None:
        model.load_state_dict(model_sd)
        opt.load_state_dict(sd)
    else:
        checkpoint.load(opt, path, extra={"model": model.state_dict()})
    reloaded = opt.state_dict()
    outputs = train(model, opt, range(3, 6), rank, world_size, setup.dtype)
    opt.param_sync()
    return params_of(model), outputs, reloaded


def assert_same_state(actual: dict, expected: dict) -> None:
    """The per-param state dicts are equal bit for bit, and so are the hyperparameters."""
    assert actual["state"].keys() == expected["state"].keys()
    for k, entry in expected["state"].items():
        for name, value in entry.items():
            assert torch.equal(actual["state"][k][name], value), f"param {k}: {name} differs after reload"
    for a, e in zip(actual["param_groups"], expected["param_groups"]):
        assert {k: a[k] for k in ("lr", "betas", "eps", "weight_decay", "params")} == \
               {k: e[k] for k in ("lr", "betas", "eps", "weight_decay", "params")}


SAVE_SETUP = Setup()
LOAD_SETUP = Setup(bucket_cap_mb=TINY_BUCKET_MB, reverse_init=True, lr_scale=50.0)
REMAINDERS = dict(dtype=torch.bfloat16, opt=dict(store_param_remainders=True))
PAIRS = [(1, 1), (2, 2), (1, 2), (2, 1), (1, 4), (4, 1), (2, 4), (4, 2)]


@pytest.mark.parametrize("form", ["state_dict", "dcp"])
@pytest.mark.parametrize("saved_on, loaded_on", PAIRS, ids=[f"{n}to{m}" for n, m in PAIRS])
def test_resume_under_another_world_size(tmp_path, saved_on, loaded_on, form):
    path = str(tmp_path / "ckpt") if form == "dcp" else None
    sd, model_sd = run_ranks(first_half, saved_on, (SAVE_SETUP, path))[0]
    results = run_ranks(second_half, loaded_on, (LOAD_SETUP, sd, model_sd, path))
    ref_params, ref_outputs = run_ranks(uninterrupted, loaded_on, (LOAD_SETUP,))[0]
    for params, outputs, reloaded in results:
        assert_same_state(reloaded, sd)  # lossless, whatever the layouts on either side
        for a, e in zip(params + outputs, ref_params + ref_outputs):
            tolerances.assert_close(a, e, tolerances.DISTRIBUTED)


def test_resume_same_layout_is_bit_exact(tmp_path):
    """Same world size and layout before and after: the resumed run IS the uninterrupted one."""
    setup = Setup(bucket_cap_mb=TINY_BUCKET_MB)
    sd, model_sd = run_ranks(first_half, 2, (setup, None))[0]
    params, outputs, _ = run_ranks(second_half, 2, (setup, sd, model_sd, None))[0]
    ref_params, ref_outputs = run_ranks(uninterrupted, 2, (setup,))[0]
    assert all(torch.equal(a, e) for a, e in zip(params + outputs, ref_params + ref_outputs))


BF16_PAIRS = [(2, 2), (2, 1), (1, 4), (4, 2)]


@pytest.mark.parametrize("form", ["state_dict", "dcp"])
@pytest.mark.parametrize("saved_on, loaded_on", BF16_PAIRS, ids=[f"{n}to{m}" for n, m in BF16_PAIRS])
def test_resume_bf16_remainders(tmp_path, saved_on, loaded_on, form):
    path = str(tmp_path / "ckpt") if form == "dcp" else None
    save_setup, load_setup = Setup(**REMAINDERS), Setup(bucket_cap_mb=TINY_BUCKET_MB, reverse_init=True, **REMAINDERS)
    sd, model_sd = run_ranks(first_half, saved_on, (save_setup, path))[0]
    params, outputs, reloaded = run_ranks(second_half, loaded_on, (load_setup, sd, model_sd, path))[0]
    ref_params, ref_outputs = run_ranks(uninterrupted, loaded_on, (load_setup,))[0]
    assert_same_state(reloaded, sd)  # fp32 masters survive exactly through bf16 + remainders
    # On another world size the bf16 gradients round differently from the first step on, and Adam
    # can turn a near-zero gradient's rounding into a full step: allow 2 x lr per resumed step there.
    extra = {} if saved_on == loaded_on else dict(atol=2 * 3 * 1e-2)
    for a, e in zip(params + outputs, ref_params + ref_outputs):
        tolerances.assert_close(a, e, tolerances.DISTRIBUTED, dtype=torch.bfloat16, scale_atol=True, **extra)


@pytest.mark.parametrize("form", ["state_dict", "dcp"])
def test_hybrid_sharded_checkpoint_resumes_on_one_rank(tmp_path, form):
    """Saved from 2 shards x 2 replicas (replicas write their shared ranges once), resumed on 1 rank."""
    path = str(tmp_path / "ckpt") if form == "dcp" else None
    sd, model_sd = run_ranks(first_half, 4, (Setup(hsdp_shard=2), path))[0]
    params, outputs, reloaded = run_ranks(second_half, 1, (LOAD_SETUP, sd, model_sd, path))[0]
    ref_params, ref_outputs = run_ranks(uninterrupted, 1, (LOAD_SETUP,))[0]
    assert_same_state(reloaded, sd)
    for a, e in zip(params + outputs, ref_params + ref_outputs):
        tolerances.assert_close(a, e, tolerances.DISTRIBUTED)


def test_state_dict_only_on_rank0(tmp_path):
    def run(rank, world_size):
        model = make_model()
        opt = DistributedFusedAdam(model.parameters())
        train(model, opt, range(2), rank, world_size, torch.float32)
        return opt.state_dict(gather_on_rank0=True), opt.state_dict()

    (root, full), (other, _) = run_ranks(run, 2)
    assert other is None
    assert_same_state(root, full)


# ------------------------------------------------------------------ torch AdamW interop


def torch_adamw_run(steps: range, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    for step in steps:
        x, y = global_batch(step, torch.float32)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def test_torch_adamw_state_dict_loads_and_training_continues():
    """AdamW (one process, the global batch) 3 steps -> DistributedFusedAdam on 2 ranks 3 steps ==
    AdamW 6 steps; and DistributedFusedAdam 3 steps -> AdamW 3 steps == DistributedFusedAdam 6 steps."""
    model = make_model()
    adamw = torch.optim.AdamW(groups(model))
    torch_adamw_run(range(3), model, adamw)
    sd_in, model_sd = copy.deepcopy(adamw.state_dict()), copy.deepcopy(model.state_dict())
    torch_adamw_run(range(3, 6), model, adamw)
    expected = params_of(model)

    def resume(rank, world_size):
        m = make_model()
        m.load_state_dict(model_sd)
        opt = DistributedFusedAdam(groups(m, lr_scale=7.0))
        opt.load_state_dict(sd_in)
        train(m, opt, range(3, 6), rank, world_size, torch.float32)
        opt.param_sync()
        return params_of(m)

    for a, e in zip(run_ranks(resume, 2)[0], expected):
        tolerances.assert_close(a, e, tolerances.DISTRIBUTED)

    sd_out, model_sd_out = run_ranks(first_half, 2, (SAVE_SETUP, None))[0]
    ref_params, _ = run_ranks(uninterrupted, 2, (SAVE_SETUP,))[0]
    model = make_model()
    model.load_state_dict(model_sd_out)
    adamw = torch.optim.AdamW(groups(model, lr_scale=3.0))
    adamw.load_state_dict(sd_out)
    assert [g["lr"] for g in adamw.param_groups] == [1e-2, 3e-3]
    torch_adamw_run(range(3, 6), model, adamw)
    for a, e in zip(params_of(model), ref_params):
        tolerances.assert_close(a, e, tolerances.DISTRIBUTED)


def test_fused_adam_and_distributed_checkpoints_interchange():
    """FusedAdam(master_weights) <-> DistributedFusedAdam share the 'param' master key."""
    sd, model_sd = run_ranks(first_half, 2, (Setup(dtype=torch.bfloat16), None))[0]
    model = make_model(torch.bfloat16)
    model.load_state_dict(model_sd)
    opt = FusedAdam(groups(model), master_weights=True)
    opt.load_state_dict(sd)
    for i, p in enumerate(q for g in opt.param_groups for q in g["params"]):  # state-dict order
        assert torch.equal(opt.state[p]["param"], sd["state"][i]["param"])
        assert torch.equal(p, sd["state"][i]["param"].to(torch.bfloat16))


# ------------------------------------------------------------------ byte-for-byte snapshots (shared)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal byte for byte (unlike torch.equal, which also passes -0.0 == 0.0 and fails NaN == NaN)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.detach().reshape(-1).view(torch.uint8), b.detach().reshape(-1).view(torch.uint8))


def snapshot(opt: DistributedFusedAdam, model: nn.Module, extra: dict | None) -> dict:
    """Copies of every byte of the optimizer's shards and buffers, its step and hyperparameters, the
    model params and `extra`."""
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    out = {"step": opt.step_count, "groups": copy.deepcopy(groups), "extra": copy.deepcopy(extra)}
    for b in opt.shard_buckets(build=False):
        for f in dataclasses.fields(b.state):
            value = getattr(b.state, f.name)
            if isinstance(value, torch.Tensor):
                out[f"bucket {b.index} {f.name}"] = value.clone()
        if b.param_buffer is not None:
            out[f"bucket {b.index} param_buffer"] = b.param_buffer.clone()
    for i, p in enumerate(model.parameters()):
        out[f"param {i}"] = p.detach().clone()
    return out


def assert_same_bytes(actual, expected, where: str = "") -> None:
    if isinstance(expected, torch.Tensor):
        assert same_bytes(actual, expected), f"{where} changed"
    elif isinstance(expected, (dict, list)):
        assert type(actual) is type(expected) and len(actual) == len(expected), f"{where} changed"
        for k in expected.keys() if isinstance(expected, dict) else range(len(expected)):
            assert_same_bytes(actual[k], expected[k], f"{where}/{k}")
    else:
        assert actual == expected, f"{where} changed"


# ------------------------------------------------------------------ extra: Stateful and rank-dependent values


def save_stateful_and_per_rank(rank: int, world_size: int, path: str) -> list[torch.Tensor]:
    model = make_model()
    opt = SAVE_SETUP.build(model)
    train(model, opt, range(2), rank, world_size, torch.float32)
    # The model itself (a Stateful), and a value that differs by rank under one key (dcp writes one).
    checkpoint.save(opt, path, extra={"net": model, "per_rank": torch.full((3,), float(rank))})
    opt.param_sync()
    return params_of(model)


def load_stateful_and_per_rank(rank: int, world_size: int, path: str) -> tuple[list[torch.Tensor], torch.Tensor]:
    model = make_model()
    opt = LOAD_SETUP.build(model)
    extra = {"net": model, "per_rank": torch.full((3,), -1.0)}
    checkpoint.load(opt, path, extra=extra)
    return params_of(model), extra["per_rank"]


def test_stateful_and_rank_dependent_extra(tmp_path):
    path = str(tmp_path / "ckpt")
    saved = run_ranks(save_stateful_and_per_rank, 2, (path,))[0]
    for params, per_rank in run_ranks(load_stateful_and_per_rank, 2, (path,)):
        assert all(torch.equal(a, e) for a, e in zip(params, saved))
        assert per_rank.unique().tolist() in ([0.0], [1.0])  # one rank's value, whole, verified
