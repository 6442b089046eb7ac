"""The checkpoint scenarios of test_tensor_parallel.py: DistributedFusedAdam over the DTensor
tensor-parallel model (tp_models.dtensor_tp) saved at dp=2 x tp=2 in every form (``opt.state_dict()``,
torch's ``full_state_dict``, ``dcp.save`` of the whole and the sharded state dict, distopt's
``checkpoint.save``), loaded at the same layout in the same run and at dp=1 x tp=2 in another.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    get_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from distopt import DistributedFusedAdam
from distopt.distributed import checkpoint

from tp_models import batch, dtensor_tp, local, rows

DP = 2
SAVED_AT, STEPS = 3, 6
MAX_NORM = 0.05
TINY_BUCKET_MB = 24 * 4 / 2**20  # 24 fp32 elements: params split over buckets and shards


def plain_step(model, opt, step: int, dp: int, dp_size: int) -> None:
    x, y = batch(step)
    nn.functional.mse_loss(model(rows(x, dp, dp_size)), rows(y, dp, dp_size)).backward()
    opt.clip_grad_norm(MAX_NORM)
    opt.step()
    opt.zero_grad()


def whole_state(opt) -> dict:
    """``opt.state_dict()``'s state with every DTensor made whole (a collective: every rank calls it)."""
    sd = opt.state_dict()
    return {g: {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in entry.items()}
            for g, entry in sd["state"].items()}


def save_run(mesh, path: str) -> dict:
    """Trains SAVED_AT steps, saves in every form, continues to STEPS with two twins loaded in memory (the
    state_dict() form, torch's full_state_dict form): (saved state, final params, differences)."""
    dp, _ = mesh.get_coordinate()

    def build(seed: int):
        model = dtensor_tp(mesh["tp"], seed)
        return model, DistributedFusedAdam(model.parameters(), lr=1e-2, process_group=mesh["dp"].get_group(),
                                           bucket_cap_mb=TINY_BUCKET_MB)

    model, opt = build(0)
    for step in range(SAVED_AT):
        plain_step(model, opt, step, dp, DP)
    sd = opt.state_dict()
    kinds = {(type(v).__name__, isinstance(v, DTensor) and tuple(v.placements) == tuple(p.placements))
             for p, entry in zip(model.parameters(), sd["state"].values()) for k, v in entry.items()
             if k != "step" and isinstance(p, DTensor)}
    saved = whole_state(opt)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=f"{path}/whole")
    with checkpoint.sharded_state_dicts(opt):
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=f"{path}/sharded")
    checkpoint.save(opt, f"{path}/distopt", extra={"model": model})
    full = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))

    twins = {"state_dict": build(1), "full_state_dict": build(1)}
    for twin, _ in twins.values():
        twin.load_state_dict(model.state_dict())
    twins["state_dict"][1].load_state_dict(sd)
    set_optimizer_state_dict(*twins["full_state_dict"], full, options=StateDictOptions(full_state_dict=True))
    differ = []
    for step in range(SAVED_AT, STEPS):
        for m, o in [(model, opt), *twins.values()]:
            plain_step(m, o, step, dp, DP)
        for name, (twin, _) in twins.items():
            if not all(torch.equal(local(p), local(q)) for p, q in zip(model.parameters(), twin.parameters())):
                differ.append(f"{name} twin at step {step}")
    final = {n: p.full_tensor() if isinstance(p, DTensor) else p.detach() for n, p in model.named_parameters()}
    return {"saved": saved, "final": final, "differ": differ, "kinds": kinds}


def load_run(rank: int, world_size: int, path: str) -> dict:
    """At dp=1, same tp: each saved form loaded into a fresh optimizer (other params, other buckets),
    then the steps after SAVED_AT on the whole global batch: (state as loaded, final params) per form."""
    mesh = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("dp", "tp"))
    out = {}
    for form in ("whole", "sharded", "distopt"):
        model = dtensor_tp(mesh["tp"], seed=1)
        opt = DistributedFusedAdam(model.parameters(), lr=1e-2, process_group=mesh["dp"].get_group(),
                                   bucket_cap_mb=3 * TINY_BUCKET_MB)
        if form == "distopt":
            checkpoint.load(opt, f"{path}/distopt", extra={"model": model})
        else:
            with checkpoint.sharded_state_dicts(opt) if form == "sharded" else contextlib.nullcontext():
                model_sd, optim_sd = get_state_dict(model, opt)
                dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=f"{path}/{form}")
                set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
        loaded = whole_state(opt)
        for step in range(SAVED_AT, STEPS):
            plain_step(model, opt, step, 0, 1)
        final = {n: p.full_tensor() if isinstance(p, DTensor) else p.detach() for n, p in model.named_parameters()}
        out[form] = {"loaded": loaded, "final": final}
    return out
