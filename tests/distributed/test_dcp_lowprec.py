"""DistributedFusedAdam's sharded state dict (``sharded_state_dicts(opt)``, torch.distributed.checkpoint's
get/set functions and dcp.save/dcp.load) with low-precision moments: each rank saves its own bf16 values,
8-bit codes and absmax scales (nothing gathered), and dcp.load reshards them bit for bit: saved on 2 ranks,
loaded on 1, 2 and 4 with other bucket sizes, training goes on as FusedAdam's uninterrupted run, bit for
bit. FusedAdam's checkpoints load into the sharded form and back. A checkpoint in another format stops at
its missing keys, a sharded state dict without the scales of its codes is refused, and nothing changes.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

from distopt import DistributedFusedAdam, FusedAdam
from distopt.distributed import checkpoint

from harness import run_ranks
from test_lowprec import (
    BF16,
    F32,
    STEPS,
    U8,
    assert_same_state,
    backward,
    fused_adam_state_dict,
    grads,
    make_params,
    options,
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


def run(opt, params, steps: range) -> None:
    for step in steps:
        opt.zero_grad()
        backward(params, grads(step, params, None))
        opt.step()


def template(model, opt, sharded: bool) -> dict:
    if not sharded:
        return get_optimizer_state_dict(model, opt)
    with checkpoint.sharded_state_dicts(opt):
        sd = get_optimizer_state_dict(model, opt)
    kinds = {type(v) for e in sd["state"].values() for k, v in e.items() if k != "step"}
    assert kinds == {checkpoint.ShardedParamState}, kinds  # this rank's parts only: nothing gathered
    return sd


def load(model, opt, path: str, sharded: bool = True) -> None:
    target = {"optim": template(model, opt, sharded)}
    dcp.load(target, checkpoint_id=path)
    with torch.no_grad():  # (see test_lowprec.train_dfa)
        set_optimizer_state_dict(model, opt, target["optim"])


def dfa_save(rank: int, world_size: int, formats, path: str) -> dict:
    params = make_params()
    model = Holder(params)
    torch.manual_seed(1)
    opt = DistributedFusedAdam(params, bucket_cap_mb=0.01, **options(formats, F32))
    run(opt, params, range(SAVED_STEPS))
    before = snapshot(opt, params)
    dcp.save({"optim": template(model, opt, sharded=True)}, checkpoint_id=path)
    assert snapshot(opt, params) == before  # saving changed no byte
    return {"params": [p.detach().clone() for p in params], "optim": opt.state_dict()}


def dfa_resume(rank: int, world_size: int, formats, path: str, bucket_mb: float) -> dict:
    params = make_params()
    with torch.no_grad():
        for p in params:
            p.add_(1.0)  # the params must come from the checkpoint's masters
    model = Holder(params)
    torch.manual_seed(2)  # another rounding seed: the saved one must win
    opt = DistributedFusedAdam(params, bucket_cap_mb=bucket_mb, **options(formats, F32))
    load(model, opt, path)
    run(opt, params, range(SAVED_STEPS, STEPS + 1))
    return {"params": [p.detach().clone() for p in params], "optim": opt.state_dict()}


@pytest.mark.parametrize("formats", FORMATS, ids=IDS)
def test_sharded_dcp_reshards_bit_for_bit(tmp_path, formats):
    path = str(tmp_path / "ckpt")
    saved = run_ranks(dfa_save, 2, (formats, path))[0]
    assert_same_state(saved, fused_adam_state_dict(formats, SAVED_STEPS), "saved at 2 ranks vs FusedAdam")
    want = fused_adam_state_dict(formats, STEPS + 1)
    for world_size, bucket_mb in ((1, 100.0), (2, 0.03), (4, 0.01)):
        resumed = run_ranks(dfa_resume, world_size, (formats, path, bucket_mb))[0]
        assert_same_state(resumed, want, f"resumed at {world_size} ranks")


def fused_save(formats, path: str) -> None:
    params = make_params()
    model = Holder(params)
    torch.manual_seed(1)
    opt = FusedAdam(params, **options(formats, F32))
    run(opt, params, range(SAVED_STEPS))
    dcp.save({"optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=path)


def fused_resume(formats, path: str, saved_params: list) -> dict:
    params = make_params()
    model = Holder(params)
    torch.manual_seed(2)
    opt = FusedAdam(params, **options(formats, F32))
    load(model, opt, path, sharded=False)  # (DFA's masters, which FusedAdam of fp32 params does not keep)
    with torch.no_grad():
        for p, q in zip(params, saved_params):
            p.copy_(q)
    run(opt, params, range(SAVED_STEPS, STEPS + 1))
    return {"params": [p.detach().clone() for p in params], "optim": opt.state_dict()}


def test_fused_adam_checkpoints_load_into_the_sharded_form_and_back(tmp_path):
    formats = FORMATS[0]
    want = fused_adam_state_dict(formats, STEPS + 1)
    fused_save(formats, str(tmp_path / "fused"))
    saved_params = fused_adam_state_dict(formats, SAVED_STEPS)["params"]
    resumed = run_ranks(dfa_resume_from_fused, 2, (formats, str(tmp_path / "fused"), saved_params))[0]
    assert_same_state(resumed, want, "FusedAdam's checkpoint resumed at 2 ranks")
    run_ranks(dfa_save, 4, (formats, str(tmp_path / "dfa")))
    assert_same_state(fused_resume(formats, str(tmp_path / "dfa"), saved_params), want,
                      "DFA's checkpoint resumed in FusedAdam")


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
    target = {"optim": template(model, opt, sharded=True)}
    target["optim"]["state"] = {k: {n: v for n, v in e.items() if n != "param"}
                                for k, e in target["optim"]["state"].items()}
    dcp.load(target, checkpoint_id=path)
    with torch.no_grad():
        set_optimizer_state_dict(model, opt, target["optim"])
    run(opt, params, range(SAVED_STEPS, STEPS + 1))
    return {"params": [p.detach().clone() for p in params], "optim": opt.state_dict()}


def refusals(rank: int, world_size: int, path: str) -> None:
    params = make_params()
    model = Holder(params)
    opt = DistributedFusedAdam(params, bucket_cap_mb=0.01, **options((U8, U8, False), F32))
    run(opt, params, range(1))
    before = snapshot(opt, params)
    with pytest.raises((RuntimeError, CheckpointException), match=r"Missing key .*exp_avg(_sq)?_codes"):
        load(model, opt, path)  # an fp32 checkpoint: no codes to read
    with checkpoint.sharded_state_dicts(opt):
        sd = get_optimizer_state_dict(model, opt)
    first = next(iter(sd["state"]))
    del sd["state"][first]["exp_avg_absmax"]
    with pytest.raises(ValueError, match="exp_avg_absmax"), torch.no_grad():
        set_optimizer_state_dict(model, opt, sd)
    with pytest.raises(NotImplementedError, match="checkpoint.save/load of low-precision"):
        checkpoint.save(opt, path + "-own")
    assert snapshot(opt, params) == before  # nothing changed


def fp32_save(rank: int, world_size: int, path: str) -> None:
    params = make_params()
    model = Holder(params)
    opt = DistributedFusedAdam(params, bucket_cap_mb=0.01, lr=1e-2)
    run(opt, params, range(1))
    dcp.save({"optim": template(model, opt, sharded=True)}, checkpoint_id=path)


def test_other_formats_and_incomplete_states_are_refused_and_change_nothing(tmp_path):
    run_ranks(fp32_save, 2, (str(tmp_path / "fp32"),))
    run_ranks(refusals, 2, (str(tmp_path / "fp32"),))
