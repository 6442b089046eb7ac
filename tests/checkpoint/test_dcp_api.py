"""torch.distributed.checkpoint's standard API with DistributedFusedAdam (and FusedAdam): the
``state_dict`` module's get/set functions and ``dcp.save``/``dcp.load``, on real gloo ranks.

Saving changes nothing, byte for byte (torch initialises an optimizer whose ``opt.state`` is empty
with a zero-grad step: the negative control shows the test catches exactly that), FQN-keyed state
dicts load, a round trip is bit-exact, and a run resumed under another world size follows the
uninterrupted one (within tolerances.DISTRIBUTED, as test_checkpoint.py's resumes); all of it also
inside ``sharded_state_dicts(opt)``, where nothing is gathered, and across the two forms. What each
save path costs per rank, and the sharded form's own cases, are test_checkpoint_dcp_sharded.py's.
"""

from __future__ import annotations

import contextlib
import copy
from collections import defaultdict

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

from distopt import DistributedFusedAdam, FusedAdam
from distopt.distributed import checkpoint
from distopt.distributed.checkpoint import dcp_state

import tolerances
from harness import run_ranks
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
    assert kinds == ({checkpoint.ShardedParamState} if dcp_state.active(opt) else {torch.Tensor}), kinds


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
