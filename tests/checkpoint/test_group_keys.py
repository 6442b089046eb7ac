"""Every saved param-group key survives a load, as in torch.optim: an LR scheduler's ``initial_lr`` and
user keys (a group's "name") included, on FusedAdam (each moment format) and DistributedFusedAdam, in
every state-dict form (per-param, sharded, torch.distributed.checkpoint, distopt's own files), on 2 gloo
ranks. torch.optim.AdamW loading the same saved groups is the oracle, key for key; and the standard
resume ``LambdaLR(opt, fn, last_epoch=...)`` then works and sets the same lrs as on AdamW.

Through torch.distributed.checkpoint a load fills the template it is given, for torch.optim too: the
fresh optimizer there gets its scheduler before loading (so the template holds ``initial_lr``), and is
built with another lr, so the saved ``initial_lr`` and the saved (changed) user keys must win.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.optim.lr_scheduler import LambdaLR

from distopt import DistributedFusedAdam, FusedAdam
from distopt.distributed import checkpoint

from harness import run_ranks

FORMATS = {
    "fp32": {},
    "bf16": dict(exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16),
    "8-bit": dict(exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8),
    "bf16, stochastic rounding": dict(exp_avg_dtype=torch.bfloat16, stochastic_rounding=True),
}
FORMS = {FusedAdam: ("state_dict", "dcp"), DistributedFusedAdam: ("state_dict", "sharded", "dcp", "files")}


def decay(epoch: int) -> float:
    return 0.5**epoch


def model_and_groups(kind: type) -> tuple[nn.Module, list[dict]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))  # a 4,096-element weight: 8-bit
    groups = [{"params": [model[0].weight, model[2].weight], "name": "decay"},
              {"params": [model[0].bias, model[2].bias], "weight_decay": 0.0, "name": "no_decay", "note": [1, "a"]}]
    return model, groups


def build(kind: type, options: dict, lr: float = 1e-2) -> tuple[nn.Module, torch.optim.Optimizer]:
    model, groups = model_and_groups(kind)
    extra = dict(bucket_cap_mb=0.01) if kind is DistributedFusedAdam else {}
    return model, kind(groups, lr=lr, **options, **extra)


def train(model: nn.Module, opt: torch.optim.Optimizer, scheduler: LambdaLR, rank: int) -> None:
    for step in range(3):
        gen = torch.Generator().manual_seed(10 * step + rank)
        model(torch.randn(8, 64, generator=gen)).square().mean().backward()
        opt.step()
        scheduler.step()
        opt.zero_grad()
    opt.param_groups[1]["note"] = ["trained", 3]  # a user key changed during the run


def save_and_load(form: str, kind: type, model, opt, fresh_model, fresh, path: str) -> None:
    if form == "state_dict":
        fresh.load_state_dict(opt.state_dict())
    elif form == "sharded":  # (it loads into the optimizer and layout it was taken from: `fresh` is `opt`)
        sd = opt.state_dict(sharded=True)
        for group in opt.param_groups:
            group.pop("initial_lr")
            group["note"] = "changed after saving"
        opt.load_state_dict(sd)
    elif form == "files":
        checkpoint.save(opt, path)
        checkpoint.load(fresh, path)
    else:  # torch.distributed.checkpoint, through torch's state-dict API (DFA: its sharded form)
        inside = checkpoint.sharded_state_dicts if kind is DistributedFusedAdam else lambda _: contextlib.nullcontext()
        with inside(opt):
            dcp.save({"optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=path)
        with inside(fresh):
            target = {"optim": get_optimizer_state_dict(fresh_model, fresh)}
            dcp.load(target, checkpoint_id=path)
            set_optimizer_state_dict(fresh_model, fresh, target["optim"])


def groups_without_params(opt: torch.optim.Optimizer) -> list[dict]:
    return [{k: float(v) if k == "lr" else v for k, v in g.items() if k != "params"} for g in opt.param_groups]


def adamw_loading(sd: dict, kind: type) -> torch.optim.AdamW:
    oracle = torch.optim.AdamW(model_and_groups(kind)[1], lr=1e-2)
    oracle.load_state_dict(sd)
    return oracle


def resume(rank: int, world_size: int, kind: type, options: dict, path: str) -> list[str]:
    model, opt = build(kind, options)
    train(model, opt, LambdaLR(opt, decay), rank)
    sd = opt.state_dict()  # (DFA: every rank takes part)
    expected = groups_without_params(adamw_loading(sd, kind))
    expected_lrs = LambdaLR(adamw_loading(sd, kind), decay, last_epoch=2).get_last_lr()
    problems = []
    if not all("initial_lr" in g for g in expected) or expected[0]["name"] != "decay":
        problems.append(f"the saved groups lack the keys under test: {expected}")
    for form in FORMS[kind]:
        fresh_model, fresh = (model, opt) if form == "sharded" else build(kind, options, lr=5e-3)
        if form == "dcp":
            LambdaLR(fresh, decay)  # the template then holds initial_lr (5e-3, which the load must replace)
        save_and_load(form, kind, model, opt, fresh_model, fresh, f"{path}/{form}")
        if groups_without_params(fresh) != expected:
            problems.append(f"{form}: {groups_without_params(fresh)} != AdamW's {expected}")
        try:  # the standard resume line, as on the oracle
            lrs = LambdaLR(fresh, decay, last_epoch=2).get_last_lr()
        except KeyError as e:
            problems.append(f"{form}: LambdaLR(last_epoch=2) raised KeyError {e}")
            continue
        if lrs != expected_lrs:
            problems.append(f"{form}: the resumed scheduler set {lrs}, AdamW's {expected_lrs}")
    return problems


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("kind", [FusedAdam, DistributedFusedAdam], ids=lambda k: k.__name__)
def test_every_saved_group_key_survives_a_load(kind, fmt, tmp_path):
    results = run_ranks(resume, world_size=2, args=(kind, FORMATS[fmt], str(tmp_path)))
    assert results == [[], []], results


def dropped(rank: int, world_size: int, path: str) -> list[str]:
    """Negative control: with the old restore (a fixed list of hyperparameters), initial_lr is lost and
    the resume line raises, as the issue reported: the test above would see it."""
    from distopt import state_dicts

    own = state_dicts.OWN_KEYS
    state_dicts.OWN_KEYS = frozenset({"initial_lr", "name", "note"}) | own
    try:
        return resume(rank, world_size, FusedAdam, {}, path)
    finally:
        state_dicts.OWN_KEYS = own


def test_negative_control_a_restore_that_drops_keys_is_caught(tmp_path):
    problems = run_ranks(dropped, world_size=2, args=(str(tmp_path),))[0]
    assert any("KeyError" in p and "initial_lr" in p for p in problems), problems
