"""FusedAdam(offload_optimizer=True): masters and moments in host memory, the update by the CPU kernel.

On CPU params the whole path runs (the host transfers are then plain copies): the same bits as
FusedAdam(master_weights=True) (fp32 params: plain FusedAdam), the float64 reference within tolerance,
GradScaler patterns with poisoned steps, checkpoints both ways, deepcopy/pickle, torch.compile, and
negative controls that break the copies or the masters. The CUDA tests (skipped without a GPU) run the
pinned-memory copies against the device kernel's bits.
"""

from __future__ import annotations

import copy
import functools
import pickle

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing
from test_fused_adam import POISON, assert_scaled_runs_match, make_model, scaled_training, train, two_groups
from torch import nn

from distopt import FusedAdam
from distopt.fused_adam.host_step import HostStep
from distopt.offload import HostTransfers, Landing

import tolerances

STEPS = 6
SHAPES = [(33, 17), (1,), (1031,), (6, 3, 3, 3), (7, 5)]  # odd sizes; the 4-d one channels_last


def make_params(dtype: torch.dtype, device: str = "cpu") -> list[nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    params = []
    for shape in SHAPES:
        t = torch.randn(shape, generator=gen).to(dtype)
        if len(shape) == 4:
            t = t.contiguous(memory_format=torch.channels_last)
        params.append(nn.Parameter(t.to(device)))
    return params


def param_groups(params: list[nn.Parameter]) -> list[dict]:
    """Three groups with different hyperparameters: AdamW, Adam (L2 decay) with maximize, no decay."""
    return [
        {"params": params[:2], "lr": 3e-3, "betas": (0.8, 0.99), "weight_decay": 0.05},
        {"params": params[2:4], "lr": 1e-2, "eps": 1e-6, "weight_decay": 0.1, "adam_w_mode": False,
         "maximize": True},
        {"params": params[4:], "lr": 5e-3, "weight_decay": 0.0},
    ]  # fmt: skip


def grads_for(params: list[torch.Tensor], step: int) -> list[torch.Tensor]:
    """Random grads in each param's dtype and memory format (exactly representable in 16 bits)."""
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=gen).to(p.dtype).to(p.device).contiguous(
        memory_format=torch.channels_last if p.dim() == 4 else torch.contiguous_format) for p in params]  # fmt: skip


def run(params: list[nn.Parameter], opt: torch.optim.Optimizer, steps: int = STEPS, first: int = 0) -> list[dict]:
    """Steps with grads_for(step); a snapshot of the params and of every state tensor after each."""
    snapshots = []
    for step in range(first, first + steps):
        for p, g in zip(params, grads_for(params, step)):
            p.grad = g
        opt.step()
        snap = {f"model {i}": p.detach().clone() for i, p in enumerate(params)}
        for i, p in enumerate(params):
            snap.update({f"{k} {i}": v.clone() for k, v in opt.state[p].items()})
        snapshots.append(snap)
    return snapshots


def assert_same_bits(actual: list[dict], expected: list[dict]) -> None:
    """Every tensor both snapshots hold, bit for bit, at every step (offload also holds fp32 masters)."""
    assert len(actual) == len(expected)
    for step, (a, e) in enumerate(zip(actual, expected)):
        for key in e.keys() & a.keys():
            assert a[key].dtype == e[key].dtype and torch.equal(a[key], e[key]), f"step {step + 1}: {key}"


def offload_and_device_runs(dtype: torch.dtype, steps: int = STEPS) -> tuple[list[dict], list[dict], FusedAdam]:
    params, ref_params = make_params(dtype), make_params(dtype)
    opt = FusedAdam(param_groups(params), offload_optimizer=True)
    ref = FusedAdam(param_groups(ref_params), master_weights=True)
    return run(params, opt, steps), run(ref_params, ref, steps), opt


# ----------------------------------------------------------------------------- numerics


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_bits_match_master_weights_without_offload(dtype):
    """Params, moments, masters and steps after every step: the bits of FusedAdam(master_weights=True)."""
    ours, ref, opt = offload_and_device_runs(dtype)
    assert_same_bits(ours, ref)
    for p in (p for g in opt.param_groups for p in g["params"]):
        state = opt.state[p]
        assert set(state) == {"step", "exp_avg", "exp_avg_sq", "param"}  # a master for fp32 params too
        for name in ("exp_avg", "exp_avg_sq", "param"):
            assert state[name].device.type == "cpu" and state[name].dtype == torch.float32
            assert state[name].stride() == p.stride()  # channels_last stays channels_last
        assert torch.equal(p, state["param"].to(dtype))
    assert opt._plan is None  # the offloaded step never goes through the device step plan


def test_fp32_bits_match_plain_fused_adam():
    params, ref_params = make_params(torch.float32), make_params(torch.float32)
    ours = run(params, FusedAdam(param_groups(params), offload_optimizer=True))
    assert_same_bits(ours, run(ref_params, FusedAdam(param_groups(ref_params))))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_float64_torch_reference(dtype):
    """The masters follow torch.optim.Adam in float64 (same 16-bit grads, per-group Adam/AdamW and
    maximize) within fp32 tolerance; each model param is its master rounded to the param dtype."""
    params = make_params(dtype)
    ref_params = [nn.Parameter(p.detach().double()) for p in params]
    opt = FusedAdam(param_groups(params), offload_optimizer=True)
    ref_groups = param_groups(ref_params)
    for g in ref_groups:
        g["decoupled_weight_decay"] = g.pop("adam_w_mode", True)
    ref = torch.optim.Adam(ref_groups)
    for step in range(STEPS):
        for p, rp, g in zip(params, ref_params, grads_for(params, step)):
            p.grad, rp.grad = g, g.double()
        opt.step()
        ref.step()
        for p, rp in zip(params, ref_params):
            tolerances.assert_close(opt.state[p]["param"], rp, tolerances.OPTIMIZER, dtype=torch.float32)
            tolerances.assert_close(p, rp, tolerances.OPTIMIZER, dtype=dtype)


def test_grad_in_other_strides_and_dtype_and_params_without_grad():
    """A contiguous grad for the channels_last param, an fp32 grad for a bf16 param, a param without
    a grad: as without offload, and the staging follows (reallocated only when a dtype changes)."""

    def scenario(params, opt):
        out = []
        for step in range(4):
            for p, g in zip(params, grads_for(params, step)):
                p.grad = g
            params[3].grad = params[3].grad.contiguous()
            if step >= 2:
                params[0].grad_dtype = None  # torch then takes a grad of another dtype
                params[0].grad = params[0].grad.float()
            params[1].grad = None if step == 1 else params[1].grad
            opt.step()
            out.append({f"model {i}": p.detach().clone() for i, p in enumerate(params)})
        return out

    params, ref_params = make_params(torch.bfloat16), make_params(torch.bfloat16)
    opt = FusedAdam(param_groups(params), offload_optimizer=True)
    assert_same_bits(
        scenario(params, opt), scenario(ref_params, FusedAdam(param_groups(ref_params), master_weights=True))
    )
    _, grad_staging, out_staging = opt._host._staging[params[0]]
    assert grad_staging.dtype == torch.float32 and out_staging.dtype == torch.bfloat16
    assert opt.state[params[1]]["step"].item() == 3


def test_staging_is_reused_and_follows_group_changes():
    """The staging is allocated once and reused; a group added mid-run is stepped (bits as without
    offload), and a param dropped from the groups loses its staging."""
    params, ref_params = make_params(torch.bfloat16), make_params(torch.bfloat16)
    opt = FusedAdam(param_groups(params)[:2], offload_optimizer=True)
    ref = FusedAdam(param_groups(ref_params)[:2], master_weights=True)
    run(params[:4], opt, steps=2)
    run(ref_params[:4], ref, steps=2)
    staging = {p: tuple(t.data_ptr() for t in bufs[1:]) for p, bufs in opt._host._staging.items()}
    run(params[:4], opt, steps=1, first=2)
    assert {p: tuple(t.data_ptr() for t in bufs[1:]) for p, bufs in opt._host._staging.items()} == staging
    assert not any(
        t is s
        for bufs in opt._host._staging.values()
        for t in bufs[1:]
        for s in (v for st in opt.state.values() for v in st.values())
    )  # staging is no part of the state
    run(ref_params[:4], ref, steps=1, first=2)
    opt.add_param_group(param_groups(params)[2])
    ref.add_param_group(param_groups(ref_params)[2])
    assert_same_bits(run(params, opt, steps=3, first=3), run(ref_params, ref, steps=3, first=3))
    opt.param_groups[0]["params"].pop(0)
    params[0].grad = None
    run(params[1:], opt, steps=1, first=6)
    assert params[0] not in opt._host._staging and len(opt._host._staging) == len(params) - 1


# ----------------------------------------------------------------------------- negative controls


def test_negative_control_no_copy_back_leaves_params_stale(monkeypatch):
    """Without the host -> device copy the params stay as they were: the comparison catches it."""
    monkeypatch.setattr(HostTransfers, "to_device", lambda self, srcs, dsts: Landing(None))
    params = make_params(torch.bfloat16)
    before = [p.detach().clone() for p in params]
    ours = run(params, FusedAdam(param_groups(params), offload_optimizer=True), steps=2)
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    _, ref, _ = offload_and_device_runs(torch.bfloat16, steps=2)
    with pytest.raises(AssertionError, match="model"):
        assert_same_bits(ours, ref)


def test_negative_control_stale_grads_are_caught(monkeypatch):
    """Without the device -> host grad copy the kernel reads stale staging: caught."""
    monkeypatch.setattr(HostTransfers, "to_host", lambda self, srcs, dsts: Landing(None))
    monkeypatch.setattr(HostTransfers, "empty_like", lambda self, t, dtype=None: torch.zeros_like(t, dtype=dtype))
    params = make_params(torch.float32)
    ours = run(params, FusedAdam(param_groups(params), offload_optimizer=True), steps=2)
    _, ref, _ = offload_and_device_runs(torch.float32, steps=2)
    with pytest.raises(AssertionError):
        assert_same_bits(ours, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_negative_control_wrong_master_init_is_caught(monkeypatch, dtype):
    """Masters initialised one fp32 ulp off the params: the bit comparison catches it."""
    new_state = HostStep.new_state

    def off_by_one_ulp(self, p):
        state = new_state(self, p)
        state["param"] = torch.nextafter(state["param"], torch.full_like(state["param"], float("inf")))
        return state

    monkeypatch.setattr(HostStep, "new_state", off_by_one_ulp)
    ours, ref, _ = offload_and_device_runs(dtype, steps=2)
    with pytest.raises(AssertionError):
        assert_same_bits(ours, ref)


# ----------------------------------------------------------------------------- GradScaler, clipping


@pytest.mark.parametrize("pattern", ["step", "unscale_clip", "unscale_grads_clip", "stock_unscale_our_clip"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grad_scaler_patterns_and_poisoned_steps(pattern, dtype):
    """Every AMP pattern (inf/nan injected at some steps) gives the bits of the device optimizer; a
    poisoned step changes no byte of params or state and the scaler backs off (checked against
    torch's recipe by assert_scaled_runs_match)."""
    offload = functools.partial(FusedAdam, offload_optimizer=True)
    ours = scaled_training(offload, pattern, dtype=dtype)
    ref = scaled_training(FusedAdam, pattern, dtype=dtype, master_weights=True)
    for step, ((o_params, o_scale, o_state), (r_params, r_scale, r_state)) in enumerate(zip(ours, ref)):
        assert o_scale == r_scale
        assert all(torch.equal(a, b) for a, b in zip(o_params, r_params)), f"step {step}"
        for o, r in zip(o_state, r_state):
            assert all(torch.equal(o[k], r[k]) for k in r), f"step {step}"
    if dtype == torch.float32:
        reference = "step" if pattern == "step" else "unscale_clip"
        assert_scaled_runs_match(ours, scaled_training(torch.optim.AdamW, reference))
    for step in POISON:
        assert all(torch.equal(a, b) for a, b in zip(ours[step][0], ours[step - 1][0]))
        for state, before in zip(ours[step][2], ours[step - 1][2]):
            assert all(torch.equal(v, before[k]) for k, v in state.items()), f"step {step}"


def test_clip_grad_norm_reads_the_device_grads():
    """opt.clip_grad_norm returns torch's norm of the grads; the deferred clip reaches the host kernel."""
    ref_model, model = make_model(), make_model()
    ref, opt = FusedAdam(two_groups(ref_model)), FusedAdam(two_groups(model), offload_optimizer=True)
    gen = torch.Generator().manual_seed(3)
    for _ in range(4):
        x, y = torch.randn(16, 12, generator=gen), torch.randn(16, 7, generator=gen)
        for m, o in ((ref_model, ref), (model, opt)):
            o.zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
        norm = opt.clip_grad_norm(0.2)
        torch.testing.assert_close(norm, torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))
        assert norm > 0.2  # clipping is active
        assert torch.equal(norm, ref.clip_grad_norm(0.2))
        ref.step()
        opt.step()
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref_model.parameters()))


# ----------------------------------------------------------------------------- checkpoints, copies


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_checkpoint_offload_to_device_and_back_continues_bit_exactly(dtype):
    """offload -> FusedAdam(master_weights=True) -> offload, 3 steps each, through state dicts: the
    bits of one uninterrupted offloaded run; the format is the non-offloaded one (plus fp32 masters)."""
    params = make_params(dtype)
    expected = run(params, FusedAdam(param_groups(params), offload_optimizer=True), steps=9)

    params = make_params(dtype)
    opt = FusedAdam(param_groups(params), offload_optimizer=True)
    got = run(params, opt, steps=3)
    sd = opt.state_dict()
    device_sd = FusedAdam(param_groups(make_params(dtype)), master_weights=True)
    device_sd.load_state_dict(copy.deepcopy(sd))
    assert {k: set(s) for k, s in device_sd.state_dict()["state"].items()} == {
        k: set(s) - ({"param"} if dtype == torch.float32 else set()) for k, s in sd["state"].items()
    }
    opt = FusedAdam(param_groups(params), lr=99.0, master_weights=True)
    opt.load_state_dict(copy.deepcopy(sd))
    got += run(params, opt, steps=3, first=3)
    opt_back = FusedAdam(param_groups(params), lr=99.0, offload_optimizer=True)
    opt_back.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert all(t.device.type == "cpu" for s in opt_back.state.values() for t in s.values())
    got += run(params, opt_back, steps=3, first=6)
    assert_same_bits(got, expected)


def test_checkpoint_from_torch_adamw_and_back():
    """A torch.optim.AdamW state dict loads into an offloaded FusedAdam (masters from the params),
    which continues with the device FusedAdam's bits; its state dict loads back into AdamW."""
    model = make_model()
    torch_opt = torch.optim.AdamW(two_groups(model))
    train(model, torch_opt, steps=3)
    runs = []
    for offload in (True, False):
        m = copy.deepcopy(model)
        opt = FusedAdam(two_groups(m), lr=5.0, offload_optimizer=offload)
        opt.load_state_dict(copy.deepcopy(torch_opt.state_dict()))
        runs.append((m, opt, train(m, opt, steps=3, seed=2)))
    (m, opt, ours), (_, _, ref) = runs
    assert all(torch.equal(a, b) for step_a, step_b in zip(ours, ref) for a, b in zip(step_a, step_b))
    back = torch.optim.AdamW(two_groups(m), lr=7.0)
    back.load_state_dict(opt.state_dict())
    assert [g["lr"] for g in back.param_groups] == [3e-3, 1e-2]
    assert torch.equal(back.state[m[0].weight]["exp_avg"], opt.state[m[0].weight]["exp_avg"])


def test_deepcopy_and_pickle_continue_identically():
    """Deep copies and pickles carry the state, not the staging (rebuilt at the next step)."""
    params = make_params(torch.bfloat16)
    opt = FusedAdam(param_groups(params), offload_optimizer=True)
    run(params, opt, steps=2)
    assert opt._host is not None and "_host" not in opt.__getstate__()
    twins = [copy.deepcopy((params, opt)), pickle.loads(pickle.dumps((params, opt)))]
    expected = run(params, opt, steps=3, first=2)
    for twin_params, twin in twins:
        assert twin._host is None and twin.offload_optimizer
        assert_same_bits(run(twin_params, twin, steps=3, first=2), expected)


def test_capturable_with_offload_is_refused():
    with pytest.raises(ValueError, match="offload_optimizer=True cannot be capturable"):
        FusedAdam([nn.Parameter(torch.randn(3))], capturable=True, offload_optimizer=True)


def test_compiled_step_runs_eagerly():
    """Under torch.compile the offloaded step runs eagerly: the same bits; fullgraph=True raises."""
    torch._dynamo.reset()
    try:
        params, ref_params = make_params(torch.bfloat16), make_params(torch.bfloat16)
        opt = FusedAdam(param_groups(params), offload_optimizer=True)
        ref = FusedAdam(param_groups(ref_params), offload_optimizer=True)
        counter = torch._dynamo.testing.CompileCounter()
        opt.step = torch.compile(opt.step, backend=counter)
        assert_same_bits(run(params, opt, steps=3), run(ref_params, ref, steps=3))
        step = torch.compile(ref.step, fullgraph=True, backend="eager")
        with pytest.raises(torch._dynamo.exc.Unsupported, match="_offloaded_step"):
            step()
    finally:
        torch._dynamo.reset()


# ----------------------------------------------------------------------------- CUDA


def cuda_model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 33), nn.GELU(), nn.LayerNorm(33), nn.Linear(33, 7)).to("cuda", dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_state_is_pinned_host_memory_and_bits_match_the_device(dtype):
    """CUDA params: the state is in pinned host memory, and over several training steps (each forward
    right after the asynchronous copy back) the params and state have the device kernel's bits."""
    model, ref_model = cuda_model(dtype), cuda_model(dtype)
    opt = FusedAdam(two_groups(model), offload_optimizer=True)
    ref = FusedAdam(two_groups(ref_model), master_weights=True)
    gen = torch.Generator().manual_seed(1)
    for step in range(8):
        x = torch.randn(16, 12, generator=gen).to("cuda", dtype)
        for m, o in ((model, opt), (ref_model, ref)):
            o.zero_grad()
            m(x).float().square().mean().backward()
            o.step()
        for p, r in zip(model.parameters(), ref_model.parameters()):
            assert torch.equal(p, r), f"step {step + 1}"
            state, ref_state = opt.state[p], ref.state[r]
            for name in ("exp_avg", "exp_avg_sq", "param"):
                assert state[name].device.type == "cpu" and state[name].is_pinned()
                if name in ref_state:
                    assert torch.equal(state[name], ref_state[name].cpu()), f"step {step + 1}: {name}"
    assert all(t.is_pinned() for bufs in opt._host._staging.values() for t in bufs[1:] if t is not None)
    clone = copy.deepcopy(opt)  # the copy's state goes back to pinned memory at its first step
    clone._host_step()
    assert all(s[n].is_pinned() for s in clone.state.values() for n in ("exp_avg", "exp_avg_sq", "param"))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_cuda_inf_step_changes_nothing(dtype):
    """A CUDA GradScaler with an inf in one grad: no byte of the device params or host state changes.
    fp16, not bf16: the stock scaler's inf check has no bf16 CUDA kernel in torch 2.11."""
    model = cuda_model(dtype)
    opt = FusedAdam(two_groups(model), offload_optimizer=True)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**10)
    for step in range(3):
        opt.zero_grad()
        scaler.scale(model(torch.randn(4, 12, device="cuda", dtype=dtype)).float().square().mean()).backward()
        if step == 2:
            model[3].weight.grad.view(-1)[5] = float("inf")
            params = [p.detach().clone() for p in model.parameters()]
            state = [{k: v.clone() for k, v in s.items()} for s in opt.state.values()]
        scale = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
    assert scaler.get_scale() == scale * 0.5
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), params))
    for s, before in zip(opt.state.values(), state):
        assert all(torch.equal(v, before[k]) for k, v in s.items())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_memory_report_counts_where_the_state_lives(dtype):
    """Bytes per element, written out: resident moments (+ masters for 16-bit) on the device; with
    offload masters, moments and staging (the grad, and a 16-bit output) in host memory."""
    n = 1000 + 37
    reports = []
    for offload in (False, True):
        p = torch.nn.Parameter(torch.randn(n).to(dtype))
        opt = FusedAdam([p], master_weights=True, offload_optimizer=offload)
        p.grad = torch.randn(n).to(dtype)
        opt.step()
        reports.append(opt.memory_report())
    sixteen = dtype != torch.float32
    resident, offloaded = reports
    assert resident == {"master": 4 * n * sixteen, "moments": 8 * n, "staging": 0, "device": (8 + 4 * sixteen) * n,
                        "host": 0, "total": (8 + 4 * sixteen) * n}
    staging = (2 + 2) * n if sixteen else 4 * n
    assert offloaded == {"master": 4 * n, "moments": 8 * n, "staging": staging, "device": 0,
                         "host": 12 * n + staging, "total": 12 * n + staging}
