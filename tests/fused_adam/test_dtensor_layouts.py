"""FusedAdam over DTensor params against torch.optim.AdamW on the same sharded model, every step.

Layouts (dtensor_models.py): FSDP2, HSDP, tensor parallel, FSDP + TP with a layer on another mesh, TP
and FSDP layers on two meshes; uneven and zero-element local shards on 2 and 4 gloo ranks. Each run
scales the loss with the stock ``torch.amp.GradScaler``, clips, and poisons one gradient element with
inf or nan on ONE rank at scripted steps: every rank must skip those steps, leaving every local byte
of params and state as it was, and back off the scale. The returned norm is compared with a float64
norm of the gathered gradients (each element once); params, moments and step counters with AdamW's.

Patterns for FusedAdam (the reference always runs ``scaler.unscale_``, clips with the float64 norm, and
``scaler.step``: torch's ``clip_grad_norm_`` cannot mix meshes, and its inf flag is not reduced over
Replicate mesh dimensions):
  fold       ``opt.unscale_grads(grad_scaler=scaler); opt.clip_grad_norm(m); scaler.step(opt)``
  stock      ``scaler.unscale_(opt); torch.nn.utils.clip_grad_norm_(params, m); scaler.step(opt)``:
             the grads stay the DTensors FSDP2 wrote, so torch's own tools keep working on them
  step_only  ``scaler.step(opt)``, no clipping

Negative controls: norms summed without the shards of other ranks, replicas summed as if they were
shards, and an inf/nan flag not shared across ranks are each caught.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from distopt import FusedAdam, dtensor

import tolerances
from dtensor_models import LAYOUTS, batch, groups
from harness import run_ranks

STEPS = 6
MAX_NORM = 0.02  # below every finite step's norm here: clipping engages (checked)
POISON = {2: (float("inf"), -1), 4: (float("nan"), 0)}  # step -> (value, rank; -1 is the last)


def make_scaler() -> torch.amp.GradScaler:
    return torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_factor=3.0, backoff_factor=0.25, growth_interval=1)


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def oracle_norm(model: nn.Module) -> float:
    """The whole model's gradient norm in float64, from the gathered gradients; inf on every rank if any
    rank holds an inf or nan (a gather along the sharded dimensions misses one written into a replica)."""
    norm = math.sqrt(sum(float(full(p.grad).double().square().sum()) for p in model.parameters()))
    bad = torch.tensor([not math.isfinite(norm)], dtype=torch.float32)
    dist.all_reduce(bad)
    return math.inf if bad.item() else norm


def poison(models: list[nn.Module], step: int, rank: int, world_size: int) -> None:
    """Writes the step's inf/nan into the first non-empty local gradient shard of the poisoned rank."""
    value, on_rank = POISON.get(step, (None, None))
    if value is None or on_rank % world_size != rank:
        return
    for model in models:
        grad = next(local(p.grad) for p in model.parameters() if local(p.grad).numel())
        grad.view(-1)[0] = value


def snapshot(model: nn.Module, opt: FusedAdam) -> list[torch.Tensor]:
    """This rank's bytes: local shards of the params and of every state tensor."""
    return [local(p).clone() for p in model.parameters()] + [
        local(t).clone() for p in model.parameters() for t in opt.state.get(p, {}).values()]


def check_state_layout(model: nn.Module, opt: FusedAdam, context: str) -> None:
    """State tensors are DTensors laid out as their param; step counters plain float32 scalars (torch's)."""
    for p in model.parameters():
        for name, t in opt.state[p].items():
            if name == "step":
                assert type(t) is torch.Tensor and t.dtype == torch.float32 and t.shape == (), f"{context}: step"
                continue
            assert isinstance(t, DTensor), f"{context}: {name} is a {type(t).__name__}"
            assert (t.device_mesh, t.placements, t.shape, t.stride()) == (p.device_mesh, p.placements, p.shape,
                                                                           p.stride()), f"{context}: {name} layout"


def gathered(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, list[torch.Tensor]]:
    """Whole params and moments (gathered: a collective per tensor), and step counts."""
    params = list(model.parameters())
    out = {"param": [full(p) for p in params], "step": [opt.state[p]["step"] for p in params]}
    out.update((name, [full(opt.state[p][name]) for p in params]) for name in ("exp_avg", "exp_avg_sq"))
    return out


def compare(context: str, ours: dict, theirs: dict, scales: tuple[float, float], norms: tuple[float | None, float],
            before: list[torch.Tensor] | None, after: list[torch.Tensor]) -> None:
    """This rank's verdict on one step (no collectives): scale, norm, params, state; and, after a
    poisoned step (`before` given), that no local byte changed."""
    assert scales[0] == scales[1], f"{context}: scale {scales}"
    norm, oracle = norms
    if norm is not None and math.isfinite(oracle):
        assert math.isclose(norm, oracle, rel_tol=1e-5), f"{context}: norm {norm} != {oracle}"
    if before is not None:
        assert all(map(torch.equal, after, before)), f"{context}: params or state changed on a skipped step"
    for name, tensors in ours.items():
        for i, (a, b) in enumerate(zip(tensors, theirs[name])):
            tolerances.assert_close(a, b, tolerances.DISTRIBUTED, msg=lambda m, n=name, i=i: f"{context}: {n} {i}: {m}")


def agreed(check, *args) -> None:
    """Runs ``check(*args)``; if it fails on any rank, every rank raises the first failing rank's message
    (so that none waits in a collective, and the message is the same whichever rank reports first)."""
    message = None
    try:
        check(*args)
    except AssertionError as e:
        message = str(e)
    messages = [None] * dist.get_world_size()
    dist.all_gather_object(messages, message)
    failed = [m for m in messages if m is not None]
    if failed:
        raise AssertionError(failed[0])


def run(rank: int, world_size: int, layout: str, pattern: str) -> dict:
    build = LAYOUTS[layout]
    (model, index), (ref_model, _) = build(0, rank, world_size), build(0, rank, world_size)
    opt, ref_opt = FusedAdam(groups(model)), torch.optim.AdamW(groups(ref_model))
    scaler, ref_scaler = make_scaler(), make_scaler()
    report = {"skipped": [], "clipped": 0}
    for step in range(STEPS):
        x, y = batch(step, index)
        for m, s in ((model, scaler), (ref_model, ref_scaler)):
            s.scale(nn.functional.mse_loss(m(x), y.expand(8, -1))).backward()
        poison([model, ref_model], step, rank, world_size)
        oracle = oracle_norm(model) / scaler.get_scale()
        before = snapshot(model, opt)

        norm = None
        if pattern == "fold":
            opt.unscale_grads(grad_scaler=scaler)
            norm = float(opt.clip_grad_norm(MAX_NORM))
        elif pattern == "stock":
            scaler.unscale_(opt)
            norm = float(full(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()

        ref_scaler.unscale_(ref_opt)
        # torch reduces the scaler's inf flag over the non-Replicate dims of the first grad's mesh only, so
        # an inf written into one replica (or on another mesh) is missed by some ranks: the reference takes
        # the whole model's verdict, as FusedAdam does.
        for flag in ref_scaler._per_optimizer_states[id(ref_opt)]["found_inf_per_device"].values():
            flag.fill_(not math.isfinite(oracle))
        if pattern != "step_only" and math.isfinite(oracle):
            for p in ref_model.parameters():
                p.grad.mul_(min(1.0, MAX_NORM / (oracle + 1e-6)))
        ref_scaler.step(ref_opt)
        ref_scaler.update()
        ref_opt.zero_grad()

        context = f"{layout}/{pattern} rank {rank} step {step}"
        ours, theirs = gathered(model, opt), gathered(ref_model, ref_opt)  # collectives first, on every rank
        agreed(compare, context, ours, theirs, (scaler.get_scale(), ref_scaler.get_scale()), (norm, oracle),
               before if step in POISON else None, snapshot(model, opt))
        agreed(check_state_layout, model, opt, context)
        if step in POISON:
            report["skipped"].append(step)
        elif norm is not None:
            report["clipped"] += int(oracle > MAX_NORM)
    return report


CASES = {
    2: [("fsdp", "fold"), ("fsdp", "stock"), ("tp", "fold"), ("tp", "step_only"), ("two_meshes", "fold")],
    4: [("fsdp", "fold"), ("hsdp", "fold"), ("tp", "fold"), ("fsdp_tp", "fold")],
}


def run_cases(rank: int, world_size: int) -> dict:
    return {case: run(rank, world_size, *case) for case in CASES[world_size]}


@pytest.mark.parametrize("world_size", sorted(CASES))
def test_layouts_match_adamw(world_size):
    reports = run_ranks(run_cases, world_size, timeout=300)
    for (layout, pattern), report in reports[0].items():
        assert report["skipped"] == sorted(POISON), (layout, pattern)
        if pattern != "step_only":
            assert report["clipped"] == STEPS - len(POISON), (layout, pattern, "clipping did not engage")


# ------------------------------------------------------------------------------------- negative controls

WRONG_REDUCTIONS = {
    # each element once per rank that holds a shard of it: the other ranks' shards are missing
    "shards_not_summed": lambda sums, flags: ((), flags),
    # replicas summed as if they were shards: a replicated element counts once per replica
    "replicas_summed": lambda sums, flags: (flags, flags),
    # an inf/nan seen on one rank only
    "flag_not_shared": lambda sums, flags: (sums, ()),
}
CONTROLS = {"shards_not_summed": "fsdp", "replicas_summed": "hsdp", "flag_not_shared": "fsdp"}


def run_controls(rank: int, world_size: int) -> dict:
    right = dtensor._reduction_groups
    caught = {}
    for name, wrong in WRONG_REDUCTIONS.items():
        dtensor._reduction_groups = lambda p, wrong=wrong: wrong(*right(p))
        try:
            run(rank, world_size, CONTROLS[name], "fold")
            caught[name] = None
        except AssertionError as e:
            caught[name] = str(e)
        finally:
            dtensor._reduction_groups = right
    return caught


def test_negative_controls_wrong_reductions_are_caught():
    caught = run_ranks(run_controls, 4, timeout=300)[0]
    assert all(caught.values()), caught
    assert "norm" in caught["shards_not_summed"] and "norm" in caught["replicas_summed"], caught
