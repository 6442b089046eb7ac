"""DistributedFusedAdam under tensor parallelism on 4 gloo ranks (2 data-parallel x 2 tensor-parallel),
against the same model unsharded in one process on the global batch with torch.optim.AdamW and
torch.nn.utils.clip_grad_norm_, every step (tp_models.py has the models).

DTensor params (``parallelize_module`` on the "tp" dimension of a (dp, tp) mesh, process_group the "dp"
group), with the stock GradScaler (``opt.unscale_grads(grad_scaler=scaler); opt.clip_grad_norm(m);
scaler.step(opt)``) and an inf on ONE rank at two steps (a plain param's gradient, then a DTensor
shard's): each step's norm is the unsharded model's, params follow AdamW's, poisoned steps change no
byte on any rank, the norm is bitwise the same on every rank, Replicate and plain params stay bitwise
the same on both tensor-parallel ranks, the params stay DTensors. Variants: small buckets (params
split over buckets and shards); contiguous buffers with overlapped param sync and two micro-batches
under no_sync; offload. Negative control: the norm's sums not reduced over tp.

Plain tensors as Megatron-LM/NeMo train them: ``model_parallel_process_group`` the tp group, the
duplicates left out as NeMo's filter does (``grad_norm(parameters=...)`` then ``clip_grad_norm(m)``,
and ``clip_grad_norm(m, parameters=...)``). Negative controls: no model-parallel group, no filter.

Checkpoints (tp_checkpoints.py): ``opt.state_dict()`` (DTensors), torch's ``full_state_dict``,
``dcp.save`` of either form and ``checkpoint.save`` after 3 steps of 6, on 4 ranks; same-layout loads
continue bit for bit in the same run; loads at dp=1 (2 ranks, same tp) give the saved state bit for bit
and follow the uninterrupted run. Also: the refusals at construction, and a rank-agreement error for a
tp layout that differs across data-parallel ranks.
"""

from __future__ import annotations

import contextlib
import math
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

from distopt import DistributedFusedAdam, dtensor

import tolerances
from harness import run_ranks
from tp_checkpoints import load_run, save_run
from tp_models import PlainTP, batch, dtensor_tp, local, mlp, nemo_filter, reference_of, rows

DP = TP = 2
STEPS = 6
MAX_NORM = 0.05  # below every step's norm here: clipping engages
POISON = {2: ("3.weight", 3), 4: ("0.weight", 0)}  # step -> (param, the one rank whose gradient gets an inf)
TINY_BUCKET_MB = 24 * 4 / 2**20  # 24 fp32 elements: params split over buckets and shards
VARIANTS = {
    "buckets": dict(bucket_cap_mb=TINY_BUCKET_MB),
    "contiguous": dict(contiguous_grad_buffer=True, contiguous_param_buffer=True, overlap_param_sync=True),
    "offload": dict(offload_optimizer=True, bucket_cap_mb=TINY_BUCKET_MB),
}
MICRO_BATCHES = {"contiguous": 2}


def make_scaler() -> torch.amp.GradScaler:
    return torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_factor=3.0, backoff_factor=0.25, growth_interval=1)


def replicated(p: torch.Tensor) -> bool:
    """Whether every tensor-parallel rank holds the whole param (a Replicate DTensor, or a plain copy)."""
    if isinstance(p, DTensor):
        return not any(pl.is_shard() for pl in p.placements)
    return not getattr(p, "tensor_model_parallel", False)


def snapshot(model: nn.Module, opt: DistributedFusedAdam) -> list[torch.Tensor]:
    """This rank's bytes: local params and every state tensor this rank holds."""
    return [local(p).clone() for p in model.parameters()] + [
        v.clone() for entry in opt.state.values() for k, v in entry.items() if k != "step"]


def poison_hook(p: torch.Tensor):
    """A gradient hook that writes an inf into this rank's first local element of `p`'s gradient."""
    def hook(grad):
        if isinstance(grad, DTensor):
            values = grad.to_local().clone()
            values.view(-1)[0] = float("inf")
            return DTensor.from_local(values, grad.device_mesh, grad.placements, shape=grad.shape,
                                      stride=grad.stride(), run_check=False)
        grad = grad.clone()
        grad.view(-1)[0] = float("inf")
        return grad

    return p.register_hook(hook)


def train_step(model, opt, ref, ref_opt, step: int, dp: int, dp_size: int, clip, ref_clip, *, scalers=None,
               micros: int = 1, poison: str | None = None, poison_here: bool = False) -> tuple[float, float]:
    """One step of `model` (this data-parallel rank's rows, in `micros` micro-batches under no_sync)
    and of the unsharded `ref` on the same global batch; (our norm, the reference's). `poison` names
    the param whose gradient gets an inf in the reference, and in `model` if `poison_here`."""
    x, y = batch(step)
    scaler, ref_scaler = scalers or (None, None)
    handle = poison_hook(model.get_parameter(poison)) if poison_here else None
    for m in range(micros):
        with opt.no_sync() if m < micros - 1 else contextlib.nullcontext():
            loss = nn.functional.mse_loss(model(rows(x, dp, dp_size, m, micros)), rows(y, dp, dp_size, m, micros))
            (scaler.scale(loss) if scaler else loss).backward()
        xs = torch.cat([rows(x, r, dp_size, m, micros) for r in range(dp_size)])
        ys = torch.cat([rows(y, r, dp_size, m, micros) for r in range(dp_size)])
        ref_loss = nn.functional.mse_loss(ref(xs), ys)
        (ref_scaler.scale(ref_loss) if ref_scaler else ref_loss).backward()
    if handle is not None:
        handle.remove()
    if poison is not None:
        ref.get_parameter(poison).grad.view(-1)[0] = float("inf")
    if scaler:
        # Not the stock scaler.unscale_(opt): after the first backward (before the layout exists) it would
        # see this model's .grad, DTensors and plain tensors in one list, which torch refuses (also for AdamW).
        opt.unscale_grads(grad_scaler=scaler)
        norm = clip()
        scaler.step(opt)
        scaler.update()
        ref_scaler.unscale_(ref_opt)
        ref_norm = ref_clip()
        ref_scaler.step(ref_opt)
        ref_scaler.update()
    else:
        norm, ref_norm = clip(), ref_clip()
        opt.step()
        ref_opt.step()
    opt.zero_grad()
    ref_opt.zero_grad()
    return float(norm), float(ref_norm)


def compare_params(model, ref, context: str) -> list[str]:
    out = []
    for name, p in model.named_parameters():
        try:
            tolerances.assert_close(local(p), reference_of(model, name, ref).detach(), tolerances.DISTRIBUTED)
        except AssertionError as e:
            out.append(f"{context} {name}: {str(e).splitlines()[0]}")
    return out


def agreement(model, norm: float, tp_group) -> list[str]:
    """Collectives: whether every rank got bitwise the same norm, and the tensor-parallel ranks hold
    bitwise the same replicated params."""
    out = []
    norms = [None] * dist.get_world_size()
    dist.all_gather_object(norms, norm)
    if len({repr(n) for n in norms}) != 1:
        out.append(f"norms differ across ranks: {norms}")
    flat = torch.cat([local(p).reshape(-1) for p in model.parameters() if replicated(p)])
    copies = [torch.empty_like(flat) for _ in range(dist.get_world_size(tp_group))]
    dist.all_gather(copies, flat, group=tp_group)
    if not all(torch.equal(c, flat) for c in copies):
        out.append("replicated params differ across tensor-parallel ranks")
    return out


# ---------------------------------------------------------------------- DTensor tensor parallelism


def dtensor_run(mesh, variant: str, control: bool = False) -> dict:
    """6 steps of the DTensor TP model with a GradScaler and two poisoned steps; differences found."""
    dp, _ = mesh.get_coordinate()
    model, ref = dtensor_tp(mesh["tp"]), mlp()
    layouts = {n: (p.device_mesh, tuple(p.placements)) for n, p in model.named_parameters() if isinstance(p, DTensor)}
    real = dtensor._reduction_groups
    no_tp_sums = mock.patch.object(dtensor, "_reduction_groups", lambda p: ((), real(p)[1]))
    with no_tp_sums if control else contextlib.nullcontext():
        opt = DistributedFusedAdam(model.parameters(), lr=1e-2, process_group=mesh["dp"].get_group(),
                                   **VARIANTS[variant])
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    scalers = make_scaler(), make_scaler()
    differ, skipped = [], []
    for step in range(STEPS):
        name, on_rank = POISON.get(step, (None, None))
        before, steps_before = snapshot(model, opt), opt.step_count
        norm, ref_norm = train_step(model, opt, ref, ref_opt, step, dp, DP, lambda: opt.clip_grad_norm(MAX_NORM),
                                    lambda: nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM), scalers=scalers,
                                    micros=MICRO_BATCHES.get(variant, 1), poison=name,
                                    poison_here=on_rank == dist.get_rank())
        opt.param_sync()  # overlap_param_sync: the gathers wait for the next forward
        context = f"{variant} step {step}"
        if scalers[0].get_scale() != scalers[1].get_scale():
            differ.append(f"{context}: scale {scalers[0].get_scale()} != {scalers[1].get_scale()}")
        if math.isfinite(ref_norm) and not math.isclose(norm, ref_norm, rel_tol=1e-5):
            differ.append(f"{context}: norm {norm} != {ref_norm}")
        if name is not None:
            skipped.append(step)
            if opt.step_count != steps_before or not all(map(torch.equal, snapshot(model, opt), before)):
                differ.append(f"{context}: a step with an inf on rank {on_rank} changed this rank's params or state")
        differ += compare_params(model, ref, context)
        differ += [f"{context}: {d}" for d in agreement(model, norm, mesh["tp"].get_group())]
    now = {n: (p.device_mesh, tuple(p.placements)) for n, p in model.named_parameters() if isinstance(p, DTensor)}
    if now != layouts or len(now) != 4:
        differ.append(f"{variant}: the DTensor params changed: {now}")
    return {"differ": differ, "skipped": skipped}


def dtensor_subsets(mesh) -> list[str]:
    """``grad_norm(parameters=...)`` of DTensor params: each subset's norm in the unsharded model (its
    Shard params summed over tp, Replicate and plain ones once); apex's cache and ``force``."""
    dp, _ = mesh.get_coordinate()
    model, ref = dtensor_tp(mesh["tp"]), mlp()
    opt = DistributedFusedAdam(model.parameters(), process_group=mesh["dp"].get_group(), bucket_cap_mb=TINY_BUCKET_MB)
    x, y = batch(0)
    nn.functional.mse_loss(model(rows(x, dp, DP)), rows(y, dp, DP)).backward()
    nn.functional.mse_loss(ref(x), y).backward()
    params = dict(model.named_parameters())

    def want(names) -> float:
        return math.sqrt(sum(float(ref.get_parameter(n).grad.double().square().sum()) for n in names))

    out = []
    for names in (["0.weight", "2.bias"], ["2.weight", "3.weight", "4.bias"], list(params), ["0.bias"]):
        got = float(opt.grad_norm(parameters=[params[n] for n in names]))
        if not math.isclose(got, want(names), rel_tol=1e-5):
            out.append(f"subset {names}: norm {got} != {want(names)}")
    cached, forced = float(opt.grad_norm()), float(opt.grad_norm(force=True))  # the last subset's; all
    if not (math.isclose(cached, want(["0.bias"]), rel_tol=1e-5) and math.isclose(forced, want(params), rel_tol=1e-5)):
        out.append(f"cache: {cached}, forced {forced}")
    return out


# ---------------------------------------------------------------------- Megatron-style, plain tensors


def plain_run(groups: dict, how: str) -> list[str]:
    """6 steps of the plain-tensor TP model, clipped as `how` says; differences found."""
    dp, tp = groups["dp_rank"], groups["tp_rank"]
    model, ref = PlainTP(groups["tp"]), mlp()
    mp = None if how == "no_mp_group" else groups["tp"]
    opt = DistributedFusedAdam(model.parameters(), lr=1e-2, process_group=groups["dp"],
                               model_parallel_process_group=mp, bucket_cap_mb=TINY_BUCKET_MB)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    params = nemo_filter(model, tp)

    def clip():
        if how == "nemo":  # NeMo's clip_grad_norm_distributed_optimizer: the clip reuses the subset's norm
            opt.grad_norm(parameters=params)
            return opt.clip_grad_norm(MAX_NORM)
        return opt.clip_grad_norm(MAX_NORM, parameters=None if how == "no_filter" else params)

    differ = []
    for step in range(STEPS):
        norm, ref_norm = train_step(model, opt, ref, ref_opt, step, dp, DP, clip,
                                    lambda: nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM))
        if not math.isclose(norm, ref_norm, rel_tol=1e-5):
            differ.append(f"{how} step {step}: norm {norm} != {ref_norm}")
        differ += compare_params(model, ref, f"{how} step {step}")
        differ += [f"{how} step {step}: {d}" for d in agreement(model, norm, groups["tp"])]
    return differ


# ---------------------------------------------------------------------- errors


def refusals(mesh, groups: dict) -> dict[str, str | None]:
    """The error each bad input raises (None: none)."""
    out: dict[str, str | None] = {}

    def attempt(name: str, fn) -> None:
        try:
            fn()
            out[name] = None
        except (ValueError, TypeError, RuntimeError) as e:
            out[name] = f"{type(e).__name__}: {e}"

    dp_group = mesh["dp"].get_group()

    def fsdp2_on_dp():
        model = mlp()
        fully_shard(model, mesh=mesh["dp"])
        DistributedFusedAdam(model.parameters(), process_group=dp_group)

    def fsdp2_on_world():
        model = mlp()
        fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
        DistributedFusedAdam(model.parameters())

    attempt("fsdp2_on_dp", fsdp2_on_dp)
    attempt("fsdp2_on_world", fsdp2_on_world)
    attempt("model_parallel_overlaps_dp", lambda: DistributedFusedAdam(
        PlainTP(groups["tp"]).parameters(), process_group=groups["dp"], model_parallel_process_group=dist.group.WORLD))
    attempt("model_parallel_overlaps_mesh", lambda: DistributedFusedAdam(
        dtensor_tp(mesh["tp"]).parameters(), process_group=dp_group, model_parallel_process_group=groups["tp"]))

    model = dtensor_tp(mesh["tp"])
    opt = DistributedFusedAdam(model.parameters(), process_group=dp_group)
    attempt("foreign_param", lambda: opt.grad_norm(parameters=[nn.Parameter(torch.ones(3))]))
    attempt("norm_type_positional", lambda: opt.clip_grad_norm(1.0, 2.0))
    x, y = batch(0)
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    model.to(torch.bfloat16)  # replaces the DTensor params' local tensors
    attempt("local_tensor_replaced", opt.step)
    return out


def disagreeing_layouts(mesh) -> str | None:
    """Data-parallel row 1 leaves the row-parallel layer unsharded: the ranks of each data-parallel
    group disagree on that param's layout. Every rank must raise (None: it did not)."""
    dp, _ = mesh.get_coordinate()
    model = mlp()
    if dp == 0:
        model = dtensor_tp(mesh["tp"])
    else:
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(output_layouts=Replicate())})
    opt = DistributedFusedAdam(model.parameters(), process_group=mesh["dp"].get_group())
    x, y = batch(0)
    nn.functional.mse_loss(model(x), y).backward()
    try:
        opt.step()
    except ValueError as e:
        return str(e)
    return None


# ---------------------------------------------------------------------- the launch


def plain_groups(rank: int) -> dict:
    """Megatron's groups on 4 ranks: tensor-parallel pairs of consecutive ranks, data-parallel across them.
    Every rank creates every group, in the same order."""
    tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    return {"tp": tp_groups[rank // TP], "dp": dp_groups[rank % TP], "tp_rank": rank % TP, "dp_rank": rank // TP}


def four_ranks(rank: int, world_size: int, path: str) -> dict:
    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    groups = plain_groups(rank)
    return {
        "dtensor": {v: dtensor_run(mesh, v) for v in VARIANTS},
        "dtensor_control": dtensor_run(mesh, "buckets", control=True),
        "dtensor_subsets": dtensor_subsets(mesh),
        "plain": {how: plain_run(groups, how) for how in ("nemo", "subset", "no_mp_group", "no_filter")},
        "refusals": refusals(mesh, groups),
        "disagreement": disagreeing_layouts(mesh),
        "checkpoint": save_run(mesh, path),
    }


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("tp_ckpt"))


@pytest.fixture(scope="module")
def results(ckpt_dir) -> list[dict]:
    return run_ranks(four_ranks, DP * TP, (ckpt_dir,), timeout=600)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_dtensor_tp_follows_the_unsharded_model(results, variant):
    for r in results:
        run = r["dtensor"][variant]
        assert run["differ"] == [], run["differ"][:5]
        assert run["skipped"] == sorted(POISON)


def test_dtensor_norm_without_the_tp_reduction_is_caught(results):
    differ = results[0]["dtensor_control"]["differ"]
    assert any("norm" in d for d in differ), differ[:5]


def test_dtensor_subset_norms(results):
    for r in results:
        assert r["dtensor_subsets"] == [], r["dtensor_subsets"]


@pytest.mark.parametrize("how", ["nemo", "subset"])
def test_plain_tp_with_nemo_filter_follows_the_unsharded_model(results, how):
    for r in results:
        assert r["plain"][how] == [], r["plain"][how][:5]


@pytest.mark.parametrize("how", ["no_mp_group", "no_filter"])
def test_plain_tp_negative_controls_are_caught(results, how):
    assert any("norm" in d for d in results[0]["plain"][how]), results[0]["plain"][how][:5]


@pytest.mark.parametrize("case, match", [
    ("fsdp2_on_dp", "ValueError: .*sharded .*data-parallel.*FusedAdam"),
    ("fsdp2_on_world", "ValueError: .*sharded .*data-parallel.*FusedAdam"),
    ("model_parallel_overlaps_dp", "ValueError: .*model_parallel_process_group .* shares ranks with the data-parallel"),
    ("model_parallel_overlaps_mesh", "ValueError: .*shares ranks with model_parallel_process_group"),
    ("foreign_param", "ValueError: parameters\\[0\\] is a param of shape \\(3,\\) that this optimizer does not"),
    ("norm_type_positional", "TypeError: parameters must be a param or an iterable"),
    ("local_tensor_replaced", "RuntimeError: .*local tensor was replaced"),
])
def test_refusals(results, case, match):
    import re

    messages = [r["refusals"][case] for r in results]
    assert None not in messages, messages  # every rank raises (each naming its own groups' ranks)
    assert all(re.search(match, m) for m in messages), messages


def test_ranks_disagreeing_on_the_tp_layout_all_raise(results):
    messages = [r["disagreement"] for r in results]
    assert None not in messages, messages
    assert all("layout" in m for m in messages), messages


def test_state_dict_holds_dtensors_laid_out_as_their_params(results):
    for r in results:
        assert r["checkpoint"]["kinds"] == {("DTensor", True)}, r["checkpoint"]["kinds"]


def test_same_layout_loads_continue_bit_for_bit(results):
    for r in results:
        assert r["checkpoint"]["differ"] == [], r["checkpoint"]["differ"]


def test_checkpoints_reshard_over_dp(results, ckpt_dir):
    saved, uninterrupted = results[0]["checkpoint"]["saved"], results[0]["checkpoint"]["final"]
    for r in run_ranks(load_run, TP, (ckpt_dir,)):
        for form, got in r.items():
            for g, entry in saved.items():
                for k, v in entry.items():
                    assert torch.equal(got["loaded"][g][k], v), (form, g, k)  # the state, exactly
            for name, p in uninterrupted.items():
                where = f"{form} {name}"
                tolerances.assert_close(got["final"][name], p, tolerances.DISTRIBUTED,
                                        msg=lambda m, w=where: f"{w}: {m}")
