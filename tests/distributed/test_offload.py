"""DistributedFusedAdam(offload_optimizer=True) on CPU params over gloo: the whole offload path (shards
copied to host memory as reductions land, folded in, updated by the host kernel, copied back before the
all-gather) runs here with plain copies, against DDP + torch.optim.AdamW every step, and bit for bit
against the same optimizer without offload (the host kernel is the one the device path runs here)."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
from torch import nn

from distopt import DistributedFusedAdam

import test_amp
import test_checkpoint
import test_dcp_api
import tolerances
from harness import run_ranks
from test_ddp_equivalence import MICRO_BATCHES, Config, batch, make_net, param_groups, train_and_compare

SMALL = 600 * 4 / 2**20  # ~600 fp32 elements per bucket: several buckets

OFFLOAD_CONFIGS = {
    "default": Config(opt=dict(offload_optimizer=True)),
    "tiny_buckets": Config(opt=dict(offload_optimizer=True, bucket_cap_mb=SMALL, pipeline_size=1)),
    "sync_every_micro_batch": Config(opt=dict(offload_optimizer=True), sync_every_micro_batch=True),
    "overlap_off": Config(opt=dict(offload_optimizer=True, overlap_grad_sync=False)),
    "overlap_param_sync": Config(opt=dict(offload_optimizer=True, overlap_param_sync=True, bucket_cap_mb=SMALL)),
    "contiguous_buffers": Config(opt=dict(offload_optimizer=True, bucket_cap_mb=SMALL, contiguous_grad_buffer=True,
                                          contiguous_param_buffer=True)),
    "contiguous_sync_every": Config(opt=dict(offload_optimizer=True, contiguous_grad_buffer=True),
                                    sync_every_micro_batch=True),
    "unused_params": Config(opt=dict(offload_optimizer=True), unused=True, rank_dependent=True),
    "adam_l2": Config(opt=dict(offload_optimizer=True), adam_w_mode=False),
    "bf16_model": Config(dtype=torch.bfloat16, opt=dict(offload_optimizer=True)),
    "fp16_model": Config(dtype=torch.float16, opt=dict(offload_optimizer=True, bucket_cap_mb=SMALL)),
    "bf16_grad_sync": Config(opt=dict(offload_optimizer=True, grad_sync_dtype=torch.bfloat16), bf16_grad_sync=True),
    "mixed_dtypes": Config(mixed_bf16_body=True, opt=dict(offload_optimizer=True)),
    "hsdp_2x2": Config(hsdp_shard=2, opt=dict(offload_optimizer=True, bucket_cap_mb=SMALL)),
}
CASES = [(name, 2) for name in OFFLOAD_CONFIGS] + [(n, ws) for n in ("default", "tiny_buckets", "bf16_model")
                                                    for ws in (1, 3, 4)] + [("hsdp_2x2", 4)]
CASES.remove(("hsdp_2x2", 2))


@pytest.mark.parametrize("name, world_size", CASES, ids=[f"{n}-ws{w}" for n, w in CASES])
def test_offload_matches_ddp(name, world_size):
    checks = run_ranks(train_and_compare, world_size, (OFFLOAD_CONFIGS[name],))
    assert all(c > 0 for c in checks), "nothing was compared"


def _offload_vs_resident(rank: int, world_size: int, dtype: torch.dtype, opt_kwargs: dict) -> int:
    """Two copies of one model, one optimizer with offload and one without (fp32 masters kept in both):
    every param and every state tensor must be equal bit for bit after every step."""
    cfg = Config(dtype=dtype)
    models = [make_net(cfg), make_net(cfg)]
    opts = [DistributedFusedAdam(param_groups(m), bucket_cap_mb=SMALL, store_params=True, offload_optimizer=off,
                                 **opt_kwargs) for m, off in zip(models, (False, True))]
    checks = 0
    for step in range(4):
        for model, opt in zip(models, opts):
            for micro in range(MICRO_BATCHES):
                x, y = batch(step, micro, rank, cfg)
                with opt.no_sync() if micro < MICRO_BATCHES - 1 else contextlib.nullcontext():
                    nn.functional.mse_loss(model(x, rank).float(), y.float()).backward()
            opt.clip_grad_norm(0.5)
            opt.step()
            opt.zero_grad()
        for (name, a), b in zip(models[0].named_parameters(), models[1].parameters()):
            assert torch.equal(a, b), f"step {step}: {name} differs with offload"
            checks += 1
        for a, b in zip(opts[0].state.values(), opts[1].state.values()):
            for key in a:
                assert torch.equal(a[key], b[key]), f"step {step}: state {key} differs with offload"
                assert b[key].device.type == "cpu"
    return checks


BF16_SYNC = dict(grad_sync_dtype=torch.bfloat16, param_sync_dtype=torch.bfloat16)


@pytest.mark.parametrize("dtype, sync", [(torch.float32, {}), (torch.bfloat16, {}), (torch.float32, BF16_SYNC)],
                         ids=["fp32", "bf16", "fp32_model_bf16_sync"])
@pytest.mark.parametrize("world_size", [1, 2])
def test_offload_bit_identical_to_resident_masters(dtype, sync, world_size):
    assert all(c > 0 for c in run_ranks(_offload_vs_resident, world_size, (dtype, sync)))


def send_params(self) -> None:
    """A broken copy-back: the device slice gets zeros instead of the updated params."""
    self.local_param_slice().zero_()


def settle_grad(self) -> None:
    """A broken landing: the copy is waited for, but a second reduced shard is never added in."""
    if self._grad_landing is not None:
        self._grad_landing[0].wait()
        self._grad_landing = None


@pytest.mark.parametrize("broken, config", [(send_params, "default"), (settle_grad, "sync_every_micro_batch")],
                         ids=["copy_back_sends_zeros", "landing_drops_later_shards"])
def test_negative_controls_broken_offload_is_caught(monkeypatch, broken, config):
    """A copy-back that sends stale params, or a landing that drops all but the first reduced shard of
    a step, must fail the comparison with DDP."""
    from distopt.distributed import buckets

    monkeypatch.setattr(buckets.BucketRuntime, broken.__name__, broken)
    with pytest.raises(AssertionError, match=r"step \d micro-batch 0: output|before step|after the last step"):
        run_ranks(train_and_compare, 2, (OFFLOAD_CONFIGS[config],))


@pytest.mark.parametrize("kwargs", [dict(capturable=True), dict(store_params=False),
                                    dict(store_param_remainders=True)])
def test_offload_refuses_options_that_drop_host_masters(kwargs):
    with pytest.raises(ValueError, match="offload_optimizer"):
        DistributedFusedAdam([nn.Parameter(torch.randn(4))], offload_optimizer=True, **kwargs)


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("name", list(test_amp.PATTERNS))
def test_offload_scaler_and_clipping_patterns(name, world_size):
    """Every GradScaler/clipping pattern of test_amp.py with offload: the same numbers as DDP + AdamW,
    and poisoned steps leave every byte of the host state and the params unchanged."""
    pattern = dataclasses.replace(test_amp.PATTERNS[name], offload=True)
    reports = run_ranks(test_amp.run, world_size, (pattern,))
    if pattern.scaler:
        assert reports[0]["skipped"] == sorted(test_amp.POISON)


# Saved with lr 1; loaded into another layout with lr 50, which the checkpoint must overwrite.
OFFLOAD, RESIDENT = test_checkpoint.Setup(opt=dict(offload_optimizer=True)), test_checkpoint.SAVE_SETUP
LOAD_RESIDENT = test_checkpoint.LOAD_SETUP
LOAD_OFFLOAD = dataclasses.replace(LOAD_RESIDENT, opt=dict(offload_optimizer=True))


@pytest.mark.parametrize("form", ["state_dict", "dcp"])
@pytest.mark.parametrize("saved, loaded, saved_on, loaded_on", [
    (OFFLOAD, LOAD_RESIDENT, 2, 2), (RESIDENT, LOAD_OFFLOAD, 2, 2), (OFFLOAD, LOAD_OFFLOAD, 2, 1),
    (OFFLOAD, LOAD_RESIDENT, 1, 4),
], ids=["offload_to_resident", "resident_to_offload", "offload_2to1", "offload_1to4_resident"])
def test_checkpoints_move_between_offload_and_resident(tmp_path, saved, loaded, saved_on, loaded_on, form):
    """A checkpoint saved with offload loads without and back (the same format), under any world size,
    losslessly, and training continues as if uninterrupted."""
    path = str(tmp_path / "ckpt") if form == "dcp" else None
    sd, model_sd = run_ranks(test_checkpoint.first_half, saved_on, (saved, path))[0]
    results = run_ranks(test_checkpoint.second_half, loaded_on, (loaded, sd, model_sd, path))
    ref_params, ref_outputs = run_ranks(test_checkpoint.uninterrupted, loaded_on, (LOAD_RESIDENT,))[0]
    for params, outputs, reloaded in results:
        test_checkpoint.assert_same_state(reloaded, sd)
        for a, e in zip(params + outputs, ref_params + ref_outputs):
            tolerances.assert_close(a, e, tolerances.DISTRIBUTED)


@pytest.mark.parametrize("api", ["get_state_dict", "sharded_get_state_dict", "sharded_stateful"])
@pytest.mark.parametrize("saved, loaded", [(OFFLOAD, LOAD_RESIDENT), (RESIDENT, LOAD_OFFLOAD)],
                         ids=["offload_to_resident", "resident_to_offload"])
def test_torch_dcp_api_with_offload(tmp_path, saved, loaded, api):
    """torch's get_state_dict/set_state_dict and dcp.save/load, whole or sharded (the shard views are then
    views of host memory), 2 -> 4 ranks across offload and resident optimizers."""
    path = str(tmp_path / "ckpt")
    sd = run_ranks(test_dcp_api.save_through_api, 2, (saved, path, api))[0]
    results = run_ranks(test_dcp_api.load_through_api, 4, (loaded, path, api))
    ref_params, ref_outputs = run_ranks(test_checkpoint.uninterrupted, 4, (LOAD_RESIDENT,))[0]
    for params, outputs, reloaded in results:
        test_checkpoint.assert_same_state(reloaded, sd)
        for a, e in zip(params + outputs, ref_params + ref_outputs):
            tolerances.assert_close(a, e, tolerances.DISTRIBUTED)
