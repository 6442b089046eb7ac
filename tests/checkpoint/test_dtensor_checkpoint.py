"""FusedAdam's DTensor state through torch's checkpoint APIs, on FSDP2 models (dtensor_models.fsdp): an
fp32 model, and a bf16 one with ``master_weights=True`` (whose fp32 masters are DTensors too).

Every rank sees the same batch, so the gradients, and hence training, do not depend on the world size
(FSDP2 averages identical values exactly): a run saved on 2 ranks with ``torch.distributed.checkpoint``
and loaded on 1 and on 4 continues bit for bit as the uninterrupted 2-rank run, params and state alike.
On 2 ranks the same holds for torch's ``get_optimizer_state_dict``/``set_optimizer_state_dict`` (sharded
and full state dicts) and for ``opt.state_dict()``/``opt.load_state_dict()``, also with the state
saved in other placements (replicated); a FusedAdam state dict loads into torch.optim.AdamW with the
same values. Negative control: the model loaded without the
optimizer state is told apart.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor, Replicate

from distopt import FusedAdam

from dtensor_models import batch, fsdp, groups
from harness import run_ranks

SAVED_AT, MORE = 3, 3
DTYPES = (torch.float32, torch.bfloat16)
FULL = StateDictOptions(full_state_dict=True)


def make(seed: int, rank: int, world_size: int) -> list[tuple[nn.Module, FusedAdam]]:
    pairs = []
    for dtype in DTYPES:
        model, _ = fsdp(seed, rank, world_size, dtype)
        pairs.append((model, FusedAdam(groups(model), master_weights=dtype != torch.float32)))
    return pairs


def train(pairs: list[tuple[nn.Module, FusedAdam]], start: int, steps: int) -> None:
    for step in range(start, start + steps):
        x, y = batch(step, 0)  # the same batch on every rank
        for model, opt in pairs:
            dtype = next(model.parameters()).dtype
            nn.functional.mse_loss(model(x.to(dtype)), y.to(dtype)).backward()
            opt.step()
            opt.zero_grad()


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def whole(pairs: list[tuple[nn.Module, FusedAdam]]) -> list[torch.Tensor]:
    """Every param and state tensor, gathered (and a check that the state is laid out as its param)."""
    out = []
    for model, opt in pairs:
        for p in model.parameters():
            out.append(full(p))
            for name, t in sorted(opt.state[p].items()):
                if name != "step":
                    assert (t.device_mesh, t.placements, t.shape) == (p.device_mesh, p.placements, p.shape), name
                out.append(full(t))
    return out


def states(pairs, **options) -> list[dict]:
    return [{"model": get_model_state_dict(m, **options), "optim": get_optimizer_state_dict(m, o, **options)}
            for m, o in pairs]


def load(pairs, saved: list[dict], **options) -> None:
    for (model, opt), sd in zip(pairs, saved):
        set_model_state_dict(model, sd["model"], **options)
        set_optimizer_state_dict(model, opt, sd["optim"], **options)


def same(a: list[torch.Tensor], b: list[torch.Tensor], what: str) -> None:
    assert len(a) == len(b), what
    for i, (x, y) in enumerate(zip(a, b)):
        assert x.dtype == y.dtype and torch.equal(x, y), f"{what}: tensor {i} differs"


def save_and_continue(rank: int, world_size: int, path: str) -> list[torch.Tensor]:
    pairs = make(0, rank, world_size)
    train(pairs, 0, SAVED_AT)
    dcp.save({str(i): sd for i, sd in enumerate(states(pairs))}, checkpoint_id=path)
    sharded = copy.deepcopy(states(pairs))  # the original keeps training: the state dicts hold its tensors
    full_sds = copy.deepcopy(states(pairs, options=FULL))  # (the step counters are the state's own tensors)
    own = [(copy.deepcopy(m.state_dict()), copy.deepcopy(o.state_dict())) for m, o in pairs]
    for (_, opt), (_, osd) in zip(pairs, own):  # torch's AdamW takes FusedAdam's DTensor state
        torch_opt = torch.optim.AdamW(opt.param_groups[0]["params"] + opt.param_groups[1]["params"])
        torch_opt.load_state_dict({"state": osd["state"], "param_groups": [
            {**osd["param_groups"][0], "params": osd["param_groups"][0]["params"] + osd["param_groups"][1]["params"]}]})
        for p, s in torch_opt.state.items():  # (torch keeps the moments in the param's dtype)
            assert isinstance(s["exp_avg"], DTensor) and s["exp_avg"].placements == p.placements
            assert torch.equal(full(s["exp_avg"]), full(opt.state[p]["exp_avg"]).to(p.dtype))
    train(pairs, SAVED_AT, MORE)
    expected = whole(pairs)

    for how in ("sharded", "full", "optimizer.state_dict", "replicated"):
        fresh = make(1, rank, world_size)
        if how == "sharded":
            load(fresh, sharded)
        elif how == "full":
            load(fresh, full_sds, options=FULL)
        else:
            for (model, opt), (msd, osd) in zip(fresh, own):
                if how == "replicated":  # other placements on the param's mesh: redistributed as they load
                    osd = {**osd, "state": {k: {n: v.redistribute(v.device_mesh, [Replicate()])
                                                if isinstance(v, DTensor) else v for n, v in s.items()}
                                            for k, s in osd["state"].items()}}
                model.load_state_dict(msd)
                opt.load_state_dict(osd)
        train(fresh, SAVED_AT, MORE)
        same(whole(fresh), expected, how)
    return expected


def load_and_continue(rank: int, world_size: int, path: str) -> list[torch.Tensor]:
    pairs = make(1, rank, world_size)  # another init: everything must come from the checkpoint
    saved = states(pairs)  # torch initialises FusedAdam's state (a zero-lr step) for dcp to load into
    dcp.load({str(i): sd for i, sd in enumerate(saved)}, checkpoint_id=path)
    load(pairs, saved)
    train(pairs, SAVED_AT, MORE)
    return whole(pairs)


def load_model_only(rank: int, world_size: int, path: str) -> list[torch.Tensor]:
    """The negative control: the model loaded, the optimizer state not (fresh moments and step counts)."""
    pairs = make(1, rank, world_size)
    saved = [{"model": sd["model"]} for sd in states(pairs)]
    dcp.load({str(i): sd for i, sd in enumerate(saved)}, checkpoint_id=path)
    for (model, _), sd in zip(pairs, saved):
        set_model_state_dict(model, sd["model"])
    train(pairs, SAVED_AT, MORE)
    return whole(pairs)


def test_dcp_saved_on_2_ranks_continues_bit_identically_on_1_and_4(tmp_path):
    path = str(tmp_path / "checkpoint")
    expected = run_ranks(save_and_continue, 2, (path,), timeout=300)[0]
    for world_size in (1, 4):
        for rank, got in enumerate(run_ranks(load_and_continue, world_size, (path,), timeout=300)):
            same(got, expected, f"loaded on {world_size} ranks, rank {rank}")
    control = run_ranks(load_model_only, 1, (path,), timeout=300)[0]
    assert len(control) == len(expected) and any(not torch.equal(a, b) for a, b in zip(control, expected))
