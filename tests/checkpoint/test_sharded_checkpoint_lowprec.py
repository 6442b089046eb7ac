"""DistributedFusedAdam's sharded checkpoints with low-precision moments, both kinds: torch's
(``sharded_state_dicts(opt)`` with ``get_optimizer_state_dict`` and ``dcp.save``/``dcp.load``) and
distopt's own crash-consistent, checksummed files (``checkpoint.save``/``load``). Each rank saves its own
bf16 values, 8-bit codes and absmax scales, nothing gathered, and saving changes no byte; saved on 2
ranks and loaded on 1, 2 and 4 with other bucket sizes, training goes on bit for bit as FusedAdam's
uninterrupted run. FusedAdam's DCP checkpoints load into the sharded form and back. distopt's files load
a checkpoint of other formats converted exactly as ``load_state_dict`` converts the same state; through
DCP another format stops at its missing keys. Incomplete states are refused and nothing changes.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

from distopt import DistributedFusedAdam, FusedAdam
from distopt import moment_formats as mf
from distopt.distributed import checkpoint
from distopt.distributed.checkpoint import dcp_state

from harness import run_ranks
from test_lowprec import (
    BF16,
    F32,
    STEPS,
    U8,
    assert_same_state,
    fused_adam_state_dict,
    make_params,
    options,
    run_steps,
    same_bits,
    snapshot,
)

FORMATS = [(U8, BF16, True), (U8, U8, False), (BF16, BF16, False)]
IDS = ["u8-bf16-sr", "u8-u8", "bf16-bf16"]
SAVED_STEPS = 2


class Holder(torch.nn.Module):
    """test_lowprec's params under names (torch's state-dict functions key the state by FQN)."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        super().__init__()
        self.ps = torch.nn.ParameterList(params)


def template(model, opt, sharded: bool = True) -> dict:
    if not sharded:
        return get_optimizer_state_dict(model, opt)
    with checkpoint.sharded_state_dicts(opt):
        sd = get_optimizer_state_dict(model, opt)
    kinds = {type(v) for e in sd["state"].values() for k, v in e.items() if k != "step"}
    assert kinds == {checkpoint.ShardedParamState}, kinds  # this rank's parts only: nothing gathered
    return sd


def dcp_load(model, opt, path: str, sharded: bool = True) -> None:
    target = {"optim": template(model, opt, sharded)}
    dcp.load(target, checkpoint_id=path)
    with torch.no_grad():  # (see test_lowprec.train_dfa)
        set_optimizer_state_dict(model, opt, target["optim"])


SAVE = {"dcp": lambda model, opt, path: dcp.save({"optim": template(model, opt)}, checkpoint_id=path),
        "files": lambda model, opt, path: checkpoint.save(opt, path)}
LOAD = {"dcp": dcp_load, "files": lambda model, opt, path: checkpoint.load(opt, path)}


def save(rank: int, world_size: int, formats, path: str, how: str) -> dict:
    params = make_params()
    model = Holder(params)
    torch.manual_seed(1)
    opt = DistributedFusedAdam(params, bucket_cap_mb=0.01, **options(formats, F32))
    run_steps(opt, params, range(SAVED_STEPS))
    before = snapshot(opt, params)
    SAVE[how](model, opt, path)
    assert snapshot(opt, params) == before  # saving changed no byte
    return {"params": [p.detach().clone() for p in params], "optim": opt.state_dict()}


def resume(rank: int, world_size: int, formats, path: str, how: str, bucket_mb: float, steps: int) -> dict:
    params = make_params()
    with torch.no_grad():
        for p in params:
            p.add_(1.0)  # the params must come from the checkpoint's masters
    model = Holder(params)
    torch.manual_seed(2)  # another rounding seed: the saved one must win
    opt = DistributedFusedAdam(params, bucket_cap_mb=bucket_mb, **options(formats, F32))
    LOAD[how](model, opt, path)
    run_steps(opt, params, range(SAVED_STEPS, SAVED_STEPS + steps))
    return {"params": [p.detach().clone() for p in params], "optim": opt.state_dict()}


@pytest.mark.parametrize("how", ["dcp", "files"])
@pytest.mark.parametrize("formats", FORMATS, ids=IDS)
def test_saved_formats_reshard_bit_for_bit(tmp_path, formats, how):
    path = str(tmp_path / "ckpt")
    saved = run_ranks(save, 2, (formats, path, how))[0]
    assert_same_state(saved, fused_adam_state_dict(formats, SAVED_STEPS), "saved at 2 ranks vs FusedAdam")
    want = fused_adam_state_dict(formats, STEPS + 1)
    for world_size, bucket_mb in ((1, 100.0), (2, 0.03), (4, 0.01)):
        resumed = run_ranks(resume, world_size, (formats, path, how, bucket_mb, STEPS + 1 - SAVED_STEPS))[0]
        assert_same_state(resumed, want, f"resumed at {world_size} ranks")


# ---------------------------------------------------------------------- FusedAdam's DCP checkpoints


def fused_save(formats, path: str) -> None:
    params = make_params()
    torch.manual_seed(1)
    opt = FusedAdam(params, **options(formats, F32))
    run_steps(opt, params, range(SAVED_STEPS))
    dcp.save({"optim": get_optimizer_state_dict(Holder(params), opt)}, checkpoint_id=path)


def fused_resume(formats, path: str, saved_params: list) -> dict:
    params = make_params()
    torch.manual_seed(2)
    opt = FusedAdam(params, **options(formats, F32))
    dcp_load(Holder(params), opt, path, sharded=False)  # (DFA's masters: FusedAdam of fp32 params has none)
    with torch.no_grad():
        for p, q in zip(params, saved_params):
            p.copy_(q)
    run_steps(opt, params, range(SAVED_STEPS, STEPS + 1))
    return {"params": [p.detach().clone() for p in params], "optim": opt.state_dict()}


def dfa_resume_from_fused(rank: int, world_size: int, formats, path: str, saved_params: list) -> dict:
    """FusedAdam keeps no master of an fp32 param, so its checkpoint has no ``param``: the template
    leaves that key out and the params are the saved ones."""
    params = make_params()
    with torch.no_grad():
        for p, q in zip(params, saved_params):
            p.copy_(q)
    model = Holder(params)
    torch.manual_seed(2)
    opt = DistributedFusedAdam(params, bucket_cap_mb=0.03, **options(formats, F32))
    target = {"optim": template(model, opt)}
    target["optim"]["state"] = {k: {n: v for n, v in e.items() if n != "param"}
                                for k, e in target["optim"]["state"].items()}
    dcp.load(target, checkpoint_id=path)
    with torch.no_grad():
        set_optimizer_state_dict(model, opt, target["optim"])
    run_steps(opt, params, range(SAVED_STEPS, STEPS + 1))
    return {"params": [p.detach().clone() for p in params], "optim": opt.state_dict()}


def test_fused_adam_checkpoints_load_into_the_sharded_form_and_back(tmp_path):
    formats = FORMATS[0]
    want = fused_adam_state_dict(formats, STEPS + 1)
    fused_save(formats, str(tmp_path / "fused"))
    saved_params = fused_adam_state_dict(formats, SAVED_STEPS)["params"]
    resumed = run_ranks(dfa_resume_from_fused, 2, (formats, str(tmp_path / "fused"), saved_params))[0]
    assert_same_state(resumed, want, "FusedAdam's checkpoint resumed at 2 ranks")
    run_ranks(save, 4, (formats, str(tmp_path / "dfa"), "dcp"))
    assert_same_state(fused_resume(formats, str(tmp_path / "dfa"), saved_params), want,
                      "DFA's checkpoint resumed in FusedAdam")


# ---------------------------------------------------------------------- other formats, refusals


def load_in_memory(rank: int, world_size: int, formats, sd: dict) -> dict:
    params = make_params()
    opt = DistributedFusedAdam(params, bucket_cap_mb=0.03, **options(formats, F32))
    with torch.no_grad():  # (see test_lowprec.train_dfa)
        opt.load_state_dict(sd)
    return opt.state_dict()


CONVERSIONS = [((U8, U8, False), (F32, F32, False)), ((F32, F32, False), (U8, U8, False)),
               ((BF16, BF16, False), (U8, BF16, False)), ((U8, BF16, False), (BF16, U8, False))]


@pytest.mark.parametrize("saved_formats, loaded_formats", CONVERSIONS,
                         ids=["u8-to-f32", "f32-to-u8", "bf16-to-u8bf16", "u8bf16-to-bf16u8"])
def test_files_of_other_formats_load_as_through_load_state_dict(tmp_path, saved_formats, loaded_formats):
    path = str(tmp_path / "ckpt")
    saved = run_ranks(save, 2, (saved_formats, path, "files"))[0]
    got = run_ranks(resume, 2, (loaded_formats, path, "files", 0.03, 0))[0]["optim"]
    want = run_ranks(load_in_memory, 2, (loaded_formats, saved["optim"]))[0]
    for key, entry in want["state"].items():
        assert got["state"][key].keys() == entry.keys()
        for name, value in entry.items():
            assert same_bits(got["state"][key][name], value), f"{name} of param {key} differs"
    assert got["param_groups"][0]["lr"] == saved["optim"]["param_groups"][0]["lr"]
    formats = mf.MomentFormats(*loaded_formats[:2])
    for i, p in enumerate(make_params()):  # stored in the loader's formats, not the saved ones
        for name, dtype in zip(mf.SIGNED, formats.dtypes(p.numel())):
            assert got["state"][i][mf.CODES_KEYS[name] if dtype == U8 else name].dtype == dtype, (i, name)


def save_without_scales(rank: int, world_size: int, path: str) -> None:
    pieces = dcp_state.fragment_pieces
    dcp_state.fragment_pieces = lambda *a: {k: v for k, v in pieces(*a).items() if "absmax" not in k}
    try:
        save(rank, world_size, (U8, U8, False), path, "files")
    finally:
        dcp_state.fragment_pieces = pieces


def refusals(rank: int, world_size: int, fp32_path: str, unscaled_path: str) -> str:
    params = make_params()
    model = Holder(params)
    opt = DistributedFusedAdam(params, bucket_cap_mb=0.01, **options((U8, U8, False), F32))
    run_steps(opt, params, range(1))
    before = snapshot(opt, params)
    with pytest.raises((RuntimeError, CheckpointException), match=r"Missing key .*exp_avg(_sq)?_codes"):
        dcp_load(model, opt, fp32_path)  # an fp32 checkpoint through DCP: no codes to read
    sd = template(model, opt)
    del sd["state"][next(iter(sd["state"]))]["exp_avg_absmax"]
    with pytest.raises(ValueError, match="exp_avg_absmax"), torch.no_grad():
        set_optimizer_state_dict(model, opt, sd)
    with pytest.raises(ValueError) as files_error:
        checkpoint.load(opt, unscaled_path)  # distopt's files: codes saved without their scales
    assert snapshot(opt, params) == before  # nothing changed
    return str(files_error.value)


def test_other_formats_through_dcp_and_incomplete_states_are_refused_and_change_nothing(tmp_path):
    run_ranks(save, 2, ((F32, F32, False), str(tmp_path / "fp32"), "dcp"))
    run_ranks(save_without_scales, 2, (str(tmp_path / "unscaled"),))
    messages = run_ranks(refusals, 2, (str(tmp_path / "fp32"), str(tmp_path / "unscaled")))
    assert len(set(messages)) == 1 and "exp_avg" in messages[0] and "absmax" in messages[0], messages
