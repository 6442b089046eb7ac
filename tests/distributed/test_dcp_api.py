"""torch.distributed.checkpoint's standard API with DistributedFusedAdam (and FusedAdam): the
``state_dict`` module's get/set functions and ``dcp.save``/``dcp.load``, on real gloo ranks.

Saving changes nothing, byte for byte (torch initialises an optimizer whose ``opt.state`` is empty
with a zero-grad step: the negative control shows the test catches exactly that), FQN-keyed state
dicts load, a round trip is bit-exact, and a run resumed under another world size follows the
uninterrupted one (within tolerances.DISTRIBUTED, as test_checkpoint.py's resumes). The memory
test records what each save path costs per rank.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import gc
import io
import os
import shutil
from collections import defaultdict

import pytest
import torch
import torch.distributed.checkpoint as dcp
from test_checkpoint import (
    LOAD_SETUP,
    REMAINDERS,
    SAVE_SETUP,
    TINY_BUCKET_MB,
    Setup,
    assert_same_bytes,
    assert_same_state,
    groups,
    make_model,
    params_of,
    snapshot,
    train,
    uninterrupted,
)
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from distopt import DistributedFusedAdam, FusedAdam
from distopt.distributed import boxes, checkpoint, dcp_sharded

import tolerances
from harness import run_ranks

# ------------------------------------------------------------------ saving changes nothing


def differences(actual: dict, expected: dict) -> list[str]:
    """The snapshot entries that changed (empty: byte for byte the same)."""
    changed = []
    for key in sorted(set(actual) | set(expected)):
        try:
            assert_same_bytes(actual.get(key), expected.get(key), key)
        except AssertionError:
            changed.append(key)
    return changed


def save_mid_run(rank: int, world_size: int, setup: Setup, path: str, control: bool,
                 sharded: bool = False) -> tuple[list[str], list]:
    """3 steps; every state-dict getter of torch's API, three times over, and dcp.save; then 3 more steps."""
    model = make_model(setup.dtype)
    opt = setup.build(model)
    train(model, opt, range(3), rank, world_size, setup.dtype)
    if control:
        opt.state = defaultdict(dict)  # the view gone: torch's opt.state as DFA had it before
    before = snapshot(opt, model, None)
    with checkpoint.sharded_state_dicts(opt) if sharded else contextlib.nullcontext():
        for _ in range(3):
            model_sd, optim_sd = get_state_dict(model, opt)
        get_optimizer_state_dict(model, opt)
        get_optimizer_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
        dcp.save({"model": model, "optim": opt}, checkpoint_id=path + "_stateful")  # Stateful: opt.state_dict()
    changed = differences(snapshot(opt, model, None), before)
    train(model, opt, range(3, 6), rank, world_size, setup.dtype)
    opt.param_sync()
    return changed, params_of(model)


@pytest.mark.parametrize("control, sharded", [(False, False), (False, True), (True, False)],
                         ids=["dfa", "dfa_sharded", "negative_control_empty_state"])
@pytest.mark.parametrize("setup", [SAVE_SETUP, Setup(bucket_cap_mb=TINY_BUCKET_MB, **REMAINDERS)],
                         ids=["fp32", "bf16_remainders_tiny_buckets"])
def test_saving_changes_nothing(tmp_path, setup, control, sharded):
    results = run_ranks(save_mid_run, 2, (setup, str(tmp_path / "ckpt"), control, sharded))
    expected = run_ranks(uninterrupted, 2, (setup,))[0][0]
    for changed, params in results:
        same_run = all(torch.equal(a, e) for a, e in zip(params, expected))
        if not control:
            assert changed == [] and same_run, changed
        else:  # torch's initialising zero-grad steps: the step count and the moments change, training diverges
            assert "step" in changed and any("exp_avg" in k for k in changed) and not same_run, changed


# ------------------------------------------------------------------ resume through the standard API


def sharded_or_not(opt, api: str):
    """sharded_state_dicts(opt) for the "sharded" variants of an api, else nothing."""
    return checkpoint.sharded_state_dicts(opt) if api.startswith("sharded") else contextlib.nullcontext()


def assert_form(optim_sd: dict, opt) -> None:
    """Each rank's part of each state tensor inside sharded_state_dicts(opt), whole tensors outside."""
    kinds = {type(v) for entry in optim_sd["state"].values() for k, v in entry.items() if k != "step"}
    assert kinds == ({checkpoint.ShardedParamState} if dcp_sharded.active(opt) else {torch.Tensor}), kinds


def save_through_api(rank: int, world_size: int, setup: Setup, path: str, api: str) -> dict:
    model = make_model(setup.dtype)
    opt = setup.build(model)
    train(model, opt, range(3), rank, world_size, setup.dtype)
    sd = opt.state_dict()  # the reference state, keyed by position
    context, api = sharded_or_not(opt, api), api.removeprefix("sharded_")
    with context:
        save_with(model, opt, path, api, rank)
    opt.param_sync()
    return sd


def save_with(model, opt, path: str, api: str, rank: int) -> None:
    if api == "stateful":
        dcp.save({"model": model, "optim": opt}, checkpoint_id=path)
    elif api == "full_rank0":  # a whole, unsharded checkpoint on rank 0 (only)
        model_sd, optim_sd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True,
                                                                                  cpu_offload=True))
        if rank == 0:
            torch.save({"model": model_sd, "optim": optim_sd}, path)
    else:
        options = StateDictOptions(flatten_optimizer_state_dict=api == "flattened")
        model_sd, optim_sd = get_state_dict(model, opt, options=options)
        if api == "get_state_dict":
            assert set(optim_sd["state"]) == {n for n, p in model.named_parameters()}  # keyed by FQN
            assert_form(optim_sd, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)


def load_through_api(rank: int, world_size: int, setup: Setup, path: str, api: str) -> tuple:
    model = make_model(setup.dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # the weights must come from the checkpoint
    opt = setup.build(model)  # fresh: no layout yet, lr 50x the saved one
    context, api = sharded_or_not(opt, api), api.removeprefix("sharded_")
    with context:
        load_with(model, opt, path, api, rank)
    reloaded = opt.state_dict()
    outputs = train(model, opt, range(3, 6), rank, world_size, setup.dtype)
    opt.param_sync()
    return params_of(model), outputs, reloaded


def load_with(model, opt, path: str, api: str, rank: int) -> None:
    if api == "stateful":
        dcp.load({"model": model, "optim": opt}, checkpoint_id=path)  # loads into opt.state_dict(), then loads it
    elif api == "full_rank0":  # rank 0 reads it and broadcasts; set_state_dict would differ by rank here
        saved = torch.load(path, weights_only=True) if rank == 0 else {"model": {}, "optim": {}}
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(model, saved["model"], options=options)
        set_optimizer_state_dict(model, opt, saved["optim"], options=options)
    else:
        options = StateDictOptions(flatten_optimizer_state_dict=api == "flattened")
        model_sd, optim_sd = get_state_dict(model, opt, options=options)  # the template dcp.load fills
        assert opt.step_count == 0  # the fresh optimizer took no initialising step
        if api == "get_state_dict":
            assert_form(optim_sd, opt)
        dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
        set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd, options=options)


RESUMES = [(2, 2, "get_state_dict"), (2, 1, "get_state_dict"), (1, 2, "get_state_dict"), (2, 4, "get_state_dict"),
           (2, 2, "stateful"), (2, 1, "stateful"), (2, 2, "flattened"), (1, 2, "flattened"), (2, 2, "full_rank0"),
           (1, 2, "full_rank0"),
           # sharded_state_dicts(opt): nothing gathered on either side, resharded by dcp itself
           (2, 2, "sharded_get_state_dict"), (2, 1, "sharded_get_state_dict"), (1, 2, "sharded_get_state_dict"),
           (2, 4, "sharded_get_state_dict"), (4, 2, "sharded_get_state_dict"), (2, 2, "sharded_stateful"),
           (2, 4, "sharded_stateful"), (2, 2, "sharded_flattened"), (4, 1, "sharded_flattened")]
# Either form on either side: dcp assembles whole tensors from shards and cuts shards from whole tensors.
MIXED = [(2, 2, "get_state_dict", "sharded_get_state_dict"), (2, 4, "sharded_get_state_dict", "get_state_dict"),
         (2, 1, "sharded_flattened", "flattened"), (2, 4, "stateful", "sharded_stateful")]


@pytest.mark.parametrize("saved_on, loaded_on, api", RESUMES, ids=[f"{a}-{n}to{m}" for n, m, a in RESUMES])
def test_resume_through_dcp(tmp_path, saved_on, loaded_on, api):
    check_resume(tmp_path, saved_on, loaded_on, api, api)


@pytest.mark.parametrize("saved_on, loaded_on, saved_by, loaded_by", MIXED,
                         ids=[f"{a}-{n}to{m}-{b}" for n, m, a, b in MIXED])
def test_resume_across_forms(tmp_path, saved_on, loaded_on, saved_by, loaded_by):
    check_resume(tmp_path, saved_on, loaded_on, saved_by, loaded_by)


def check_resume(tmp_path, saved_on: int, loaded_on: int, saved_by: str, loaded_by: str) -> None:
    path = str(tmp_path / "ckpt")
    sd = run_ranks(save_through_api, saved_on, (SAVE_SETUP, path, saved_by))[0]
    results = run_ranks(load_through_api, loaded_on, (LOAD_SETUP, path, loaded_by))
    ref_params, ref_outputs = run_ranks(uninterrupted, loaded_on, (LOAD_SETUP,))[0]
    for params, outputs, reloaded in results:
        assert_same_state(reloaded, sd)  # bit-exact, whatever the layouts on either side
        for a, e in zip(params + outputs, ref_params + ref_outputs):
            tolerances.assert_close(a, e, tolerances.DISTRIBUTED)


def test_resume_through_dcp_same_layout_is_bit_exact(tmp_path):
    setup = Setup(bucket_cap_mb=TINY_BUCKET_MB)
    path = str(tmp_path / "ckpt")
    run_ranks(save_through_api, 2, (setup, path, "get_state_dict"))
    params, outputs, _ = run_ranks(load_through_api, 2, (setup, path, "get_state_dict"))[0]
    ref_params, ref_outputs = run_ranks(uninterrupted, 2, (setup,))[0]
    assert all(torch.equal(a, e) for a, e in zip(params + outputs, ref_params + ref_outputs))


@pytest.mark.parametrize("api", ["get_state_dict", "sharded_get_state_dict"])
def test_bf16_remainders_masters_survive_dcp(tmp_path, api):
    save, load = Setup(**REMAINDERS), Setup(bucket_cap_mb=TINY_BUCKET_MB, reverse_init=True, **REMAINDERS)
    path = str(tmp_path / "ckpt")
    sd = run_ranks(save_through_api, 2, (save, path, api))[0]
    for _, _, reloaded in run_ranks(load_through_api, 2 if api.startswith("sharded") else 1, (load, path, api)):
        assert_same_state(reloaded, sd)  # fp32 masters, exactly, through bf16 params + int16 remainders


def test_hybrid_sharding_through_dcp(tmp_path):
    """Replicas of a shard save the same boxes: dcp writes each once; resumed on 2 plain ranks."""
    path = str(tmp_path / "ckpt")
    sd = run_ranks(save_through_api, 4, (Setup(hsdp_shard=2, bucket_cap_mb=TINY_BUCKET_MB), path,
                                         "sharded_get_state_dict"))[0]
    for _, _, reloaded in run_ranks(load_through_api, 2, (LOAD_SETUP, path, "sharded_get_state_dict")):
        assert_same_state(reloaded, sd)


def load_in_two_steps(rank: int, world_size: int, path: str, broken: str) -> list[str]:
    """A trained optimizer; dcp.load of a sharded template from a broken checkpoint (it fails), then
    from the good one (nothing changes until set_state_dict), then set_state_dict."""
    model = make_model()
    opt = LOAD_SETUP.build(model)
    train(model, opt, range(1), rank, world_size, torch.float32)
    before = snapshot(opt, model, None)
    with checkpoint.sharded_state_dicts(opt):
        model_sd, optim_sd = get_state_dict(model, opt)
    with pytest.raises(CheckpointException):
        dcp.load({"optim": optim_sd}, checkpoint_id=broken)
    changed = differences(snapshot(opt, model, None), before)
    dcp.load({"optim": optim_sd}, checkpoint_id=path)
    changed += differences(snapshot(opt, model, None), before)
    set_optimizer_state_dict(model, opt, optim_sd)
    return changed, opt.state_dict()


def test_dcp_load_changes_nothing_until_set_state_dict(tmp_path):
    """dcp.load fills the sharded template's own CPU copies, never the optimizer: a load that fails
    halfway (a truncated data file) or one not followed by set_state_dict leaves it as it was."""
    path, broken = tmp_path / "ckpt", tmp_path / "broken"
    sd = run_ranks(save_through_api, 2, (SAVE_SETUP, str(path), "sharded_get_state_dict"))[0]
    shutil.copytree(path, broken)
    for data in broken.glob("*.distcp"):
        data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    for changed, reloaded in run_ranks(load_in_two_steps, 2, (str(path), str(broken))):
        assert changed == [], changed
        assert_same_state(reloaded, sd)


def fqn_refusals(rank: int, world_size: int) -> list[str]:
    model = make_model()
    opt = DistributedFusedAdam(groups(model))
    train(model, opt, range(1), rank, world_size, torch.float32)
    optim_sd = get_optimizer_state_dict(model, opt)
    before = snapshot(opt, model, None)
    unknown = {**optim_sd, "state": {**optim_sd["state"], "no.such.weight": optim_sd["state"]["0.weight"]}}
    messages = []
    with pytest.raises(ValueError) as info:
        opt.load_state_dict(unknown)
    messages.append(str(info.value))
    missing = {**optim_sd, "state": {k: v for k, v in optim_sd["state"].items() if k != "0.weight"}}
    with pytest.raises(RuntimeError, match="0.weight"):  # torch's own check, before ours
        set_optimizer_state_dict(model, opt, missing)
    assert differences(snapshot(opt, model, None), before) == []
    opt.load_state_dict(optim_sd)  # the genuine one loads, directly
    set_optimizer_state_dict(model, opt, optim_sd)  # and through torch's API
    assert differences(snapshot(opt, model, None), before) == []  # it is the optimizer's own state
    return messages


def test_unknown_fqn_refused():
    messages = run_ranks(fqn_refusals, 2)[0]
    assert "'no.such.weight'" in messages[0] and "param_groups" in messages[0], messages


# ------------------------------------------------------------------ FusedAdam, one process group of replicas


def fused_run(rank: int, world_size: int, path: str, phase: str) -> tuple:
    """FusedAdam on every rank without DDP (replicas: each rank steps on the whole global batch)."""
    model = make_model()
    opt = FusedAdam(groups(model, lr_scale=50.0 if phase == "load" else 1.0))
    if phase == "load":
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
        set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
        reloaded = copy.deepcopy(opt.state_dict())  # torch's state_dict() holds the live tensors
        train(model, opt, range(3, 6), 0, 1, torch.float32)
        return params_of(model), reloaded, []
    train(model, opt, range(3), 0, 1, torch.float32)
    before = {"params": params_of(model), "state": {k: {n: v.clone() for n, v in s.items()}
                                                    for k, s in opt.state_dict()["state"].items()}}
    assert len(before["state"]) == 6
    if phase == "save":
        for _ in range(3):
            model_sd, optim_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    after = {"params": params_of(model), "state": opt.state_dict()["state"]}
    changed = [k for k in before["state"] for n in before["state"][k]
               if not torch.equal(before["state"][k][n], after["state"][k][n])]
    changed += ["params"] * (not all(torch.equal(a, e) for a, e in zip(before["params"], after["params"])))
    train(model, opt, range(3, 6), 0, 1, torch.float32)
    return params_of(model), before["state"], changed


@pytest.mark.parametrize("world_size", [1, 2])
def test_fused_adam_through_dcp(tmp_path, world_size):
    path = str(tmp_path / "ckpt")
    saved = run_ranks(fused_run, world_size, (path, "save"))
    reference = run_ranks(fused_run, 1, (path, "uninterrupted"))[0][0]
    for params, _, changed in saved:
        assert changed == [] and all(torch.equal(a, e) for a, e in zip(params, reference)), changed
    for params, reloaded, _ in run_ranks(fused_run, 1, (path, "load")):
        assert all(torch.equal(a, e) for a, e in zip(params, reference))  # one process's math each time
        assert reloaded["state"].keys() == saved[0][1].keys()
        assert all(torch.equal(reloaded["state"][k][n], v) for k, s in saved[0][1].items() for n, v in s.items())


# ------------------------------------------------------------------ memory per rank while saving


def _rss(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))


class AllocatedBytes(TorchDispatchMode):
    """Counts the bytes of the storages that tensor operations create (an output whose storage is no
    input's: copies, new tensors, gathers), in this thread: where dcp's file writer runs by default."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.total += t.untyped_storage().nbytes()
                inputs.add(t.untyped_storage().data_ptr())
        return out


def save_peak(rank: int, world_size: int, path: str, how: str) -> tuple[int, int, int, int]:
    """Peak resident memory above the steady state while saving and the bytes tensor operations
    allocate, with one bucket's fp32 state (the bound) and the whole model's (what gathering costs)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(64)])  # 4.2M params: 50 MB of state, 5 buckets
    opt = DistributedFusedAdam(model.parameters(), bucket_cap_mb=4.0)
    model(torch.randn(4, 256)).square().mean().backward()
    opt.step()
    opt.zero_grad()
    for attempt in ("warm-up", "measured"):  # the first save also imports and caches: not per-save memory
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # memory freed by training counts as neither
        base = _rss("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # restart the peak (VmHWM) from here
        with AllocatedBytes() as allocated:
            save_as(model, opt, f"{path}_{attempt}", how)
        peak = _rss("VmHWM") - base
    bucket = 3 * 4 * max(b.spec.numel for b in opt.shard_buckets())  # fp32 master, exp_avg, exp_avg_sq
    return peak, allocated.total, bucket, 12 * sum(p.numel() for p in model.parameters())


def save_as(model, opt, path: str, how: str) -> None:
    if how == "distopt":
        checkpoint.save(opt, path, extra={"model": model.state_dict()})
    elif how == "sharded":
        with checkpoint.sharded_state_dicts(opt):
            model_sd, optim_sd = get_state_dict(model, opt)
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    else:  # the whole per-param state, gathered on every rank
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's /proc peak-memory reset")
def test_save_memory_per_rank(tmp_path):
    """Inside sharded_state_dicts, get_state_dict + dcp.save (and distopt's own checkpoint.save) hold no
    more than one bucket's state on top of the optimizer's own: views of the shards, written without
    copies. The negative control: outside it, torch's get_state_dict asks for each param's whole state
    (opt.state_dict()), which every rank then holds in full."""
    runs = {how: run_ranks(save_peak, 2, (str(tmp_path / how), how)) for how in ("sharded", "distopt", "gathered")}
    _, _, bucket, full = runs["sharded"][0]
    peak = {how: max(r[0] for r in results) for how, results in runs.items()}
    allocated = {how: max(r[1] for r in results) for how, results in runs.items()}
    print(f"per rank while saving, 2 ranks, MB (one bucket's state {bucket / 1e6:.1f}, the whole state "
          f"{full / 1e6:.1f}): peak extra resident / allocated by tensor operations: "
          + ", ".join(f"{how} {peak[how] / 1e6:.1f} / {allocated[how] / 1e6:.2f}" for how in runs))
    for how in ("sharded", "distopt"):
        # What tensor operations still allocate is dcp's pickled save plans (its object collectives):
        # a few hundred bytes per saved box, whatever the boxes' sizes.
        assert peak[how] < bucket and allocated[how] < bucket / 10, (how, peak[how], allocated[how])
    # The negative control: gathering is caught by either measure.
    assert min(r[0] for r in runs["gathered"]) > 0.9 * full > bucket
    assert min(r[1] for r in runs["gathered"]) > full > bucket


# ------------------------------------------------------------------ the sharded form's boxes and refusals


def test_boxes_tile_each_range_once():
    """Every flat range of a dense tensor (row-major, channels_last, permuted) is cut into at most
    2 * ndim - 1 boxes that cover it exactly once, in memory order, each a view of its elements."""
    gen = torch.Generator().manual_seed(0)
    for trial in range(2000):
        shape = torch.randint(1, 6, (trial % 5,), generator=gen).tolist()
        t = torch.randn(shape, generator=gen)
        if len(shape) >= 2 and trial % 3:
            order = torch.randperm(len(shape), generator=gen).tolist()  # a dense tensor in another memory order
            t = torch.randn([shape[d] for d in order], generator=gen).permute(sorted(range(len(order)),
                                                                                     key=order.__getitem__))
        flat = t.as_strided((t.numel(),), (1,))
        start, stop = sorted(torch.randint(0, t.numel() + 1, (2,), generator=gen).tolist())
        cut = boxes.boxes(t.shape, t.stride(), start, stop)
        assert len(cut) <= max(1, 2 * len(shape) - 1)
        hits, at = torch.zeros(t.shape, dtype=torch.int64), start
        for box in cut:
            assert box.start == at
            at += box.numel
            where = tuple(slice(o, o + n) for o, n in zip(box.offsets, box.sizes))
            view = boxes.box_view(flat[box.start : box.start + box.numel], box, boxes.memory_order(t.shape, t.stride()))
            assert torch.equal(view, t[where])
            hits[where] += 1
        assert at == stop and int(hits.sum()) == stop - start and bool((hits <= 1).all())
    with pytest.raises(ValueError, match="not dense"):
        boxes.memory_order((4, 4), (8, 1))


class ScaledConv(nn.Module):
    """Convolutions and a 0-d scale (a box with no dims), with a frozen param (no state) in between."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.frozen = nn.Parameter(torch.randn(3), requires_grad=False)
        self.convs = nn.Sequential(nn.Conv2d(3, 6, 3), nn.Tanh(), nn.Conv2d(6, 4, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.convs(x) * self.scale + self.frozen.sum()


def conv_model(channels_last: bool) -> nn.Module:
    torch.manual_seed(0)
    model = ScaledConv()
    return model.to(memory_format=torch.channels_last) if channels_last else model


def conv_run(rank: int, world_size: int, path: str, channels_last: bool, save: bool) -> dict:
    """Saves (after 2 steps) or loads through get_state_dict inside sharded_state_dicts."""
    model = conv_model(channels_last)
    opt = DistributedFusedAdam(model.parameters(), bucket_cap_mb=TINY_BUCKET_MB if save else 4 * TINY_BUCKET_MB)
    gen = torch.Generator().manual_seed(rank)
    with checkpoint.sharded_state_dicts(opt):
        if save:
            for _ in range(2):
                model(torch.randn(2, 3, 6, 6, generator=gen).to(memory_format=torch.channels_last)).square().mean() \
                    .backward()
                opt.step()
                opt.zero_grad()
        model_sd, optim_sd = get_state_dict(model, opt)
        if save:
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
        else:
            dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
            set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    return opt.state_dict()


@pytest.mark.parametrize("loaded_on, channels_last", [(1, False), (4, True), (3, False)])
def test_channels_last_params_through_dcp(tmp_path, loaded_on, channels_last):
    """Boxes are in the logical dims: a channels_last model's shards (flat ranges of its NHWC memory)
    load into a contiguous one, and back, under any world size; so does a 0-d param's state."""
    path = str(tmp_path / "ckpt")
    sd = run_ranks(conv_run, 2, (path, True, True))[0]
    for reloaded in run_ranks(conv_run, loaded_on, (path, channels_last, False)):
        assert_same_state(reloaded, sd)


def sharded_refusals(rank: int, world_size: int) -> list[str]:
    model = make_model()
    opt = DistributedFusedAdam(groups(model), bucket_cap_mb=TINY_BUCKET_MB)
    train(model, opt, range(2), rank, world_size, torch.float32)
    other_model = make_model()
    other = DistributedFusedAdam(groups(other_model))  # another layout: one bucket
    other.shard_buckets()
    sharded = opt.state_dict(sharded=True)
    before = snapshot(other, other_model, None)
    messages = []
    with pytest.raises(ValueError) as info:  # its boxes are not the ones the other layout needs
        other.load_state_dict(sharded)
    messages.append(str(info.value))
    assert differences(snapshot(other, other_model, None), before) == []
    with pytest.raises(ValueError, match="choose one"):
        opt.state_dict(gather_on_rank0=True, sharded=True)
    nhwc, nchw = (DistributedFusedAdam(conv_model(c).parameters()) for c in (True, False))  # same layouts
    with pytest.raises(ValueError, match="another memory format"):  # flat offsets would name other elements
        nchw.load_state_dict(nhwc.state_dict(sharded=True))
    with pytest.raises(TypeError, match="DistributedFusedAdam, not FusedAdam"):
        with checkpoint.sharded_state_dicts(FusedAdam(make_model().parameters())):
            pass
    with checkpoint.sharded_state_dicts(opt):
        # torch's full state dict cannot be made of shards: torch returns them as they are, and any
        # use of them (saving, arithmetic) raises instead of handing out a partial tensor.
        _, full = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
        with pytest.raises(TypeError, match="cannot be pickled"):
            torch.save(full, io.BytesIO())
        with pytest.raises(TypeError, match="only this rank's part"):
            full["state"]["0.weight"]["exp_avg"].sum()
    assert not dcp_sharded.active(opt)
    state = opt.state_dict()["state"]  # whole tensors again, outside the block
    assert all(type(v) is torch.Tensor for entry in state.values() for v in entry.values())
    before = snapshot(opt, model, None)
    opt.load_state_dict(sharded)  # the optimizer it was taken from loads it: its own state, unchanged
    assert differences(snapshot(opt, model, None), before) == []
    return messages


def test_sharded_state_dict_refusals():
    messages = run_ranks(sharded_refusals, 2)[0]
    assert "lacks elements" in messages[0] and "sharded_state_dicts" in messages[0], messages
