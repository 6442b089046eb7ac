"""FusedAdam with low-precision moments (exp_avg_dtype, exp_avg_sq_dtype) and stochastic rounding:
options and their errors, the state (dtypes, layout, bytes), one step against a float64 Adam step on
the same dequantized state, the planned and general steps, skipped steps, state dicts (bit-exact round
trips, the seed, torch.optim.AdamW's fp32 format both ways, refused loads). Accuracy and unbiasedness:
tests/lowprec/test_lowprec_accuracy.py."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from distopt import FusedAdam
from distopt import moment_formats as mf
from distopt import state_formats as sf

BF16, U8, F32 = torch.bfloat16, torch.uint8, torch.float32
FORMATS = [(BF16, BF16), (U8, U8), (U8, BF16), (F32, U8)]


def model(dtype: torch.dtype = F32, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)  # a 4,352-element weight (8-bit), a 40-element one and biases (fp32 if 8-bit asked)
    return nn.Sequential(nn.Linear(64, 68), nn.Tanh(), nn.Linear(68, 10), nn.Linear(10, 4)).to(dtype)


def backward(m: nn.Module, step: int) -> None:
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(16, 64, generator=gen).to(next(m.parameters()).dtype)
    m(x).float().square().mean().backward()


def train(m: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        opt.zero_grad()
        backward(m, step)
        opt.step()


def states_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)


# ---------------------------------------------------------------------- options


def test_invalid_options_are_clear_errors():
    params = list(model().parameters())
    with pytest.raises(ValueError, match="exp_avg_dtype must be one of"):
        FusedAdam(params, exp_avg_dtype=torch.float16)
    with pytest.raises(ValueError, match="exp_avg_sq_dtype must be one of"):
        FusedAdam(params, exp_avg_sq_dtype=torch.int8)
    with pytest.raises(TypeError, match="stochastic_rounding must be a bool"):
        FusedAdam(params, stochastic_rounding=1)
    with pytest.raises(ValueError, match="would change nothing"):  # fp32 params, no bf16 moment: nothing rounds
        FusedAdam(params, exp_avg_dtype=U8, stochastic_rounding=True)
    with pytest.raises(ValueError, match="would change nothing"):  # bf16 params, but written from fp32 masters
        FusedAdam(model(BF16).parameters(), master_weights=True, stochastic_rounding=True)
    with pytest.raises(ValueError, match="offload_optimizer"):
        FusedAdam(params, exp_avg_dtype=BF16, offload_optimizer=True)
    with pytest.raises(TypeError, match="complex"):
        FusedAdam([torch.zeros(8, dtype=torch.complex64, requires_grad=True)], exp_avg_sq_dtype=BF16)
    bf16, fp32 = nn.Parameter(torch.ones(8, dtype=BF16)), nn.Parameter(torch.ones(8))
    opt = FusedAdam([bf16, fp32], stochastic_rounding=True)  # bf16 params without masters: fine
    fp32.grad = torch.ones(8)
    opt.step()  # also a step in which only the fp32 param has a gradient


def test_state_dtypes_layout_and_bytes():
    m = model()
    conv = nn.Conv2d(32, 16, 3).to(memory_format=torch.channels_last)  # 4,608 elements, channels_last
    params = list(m.parameters()) + list(conv.parameters())
    opt = FusedAdam(params, exp_avg_dtype=U8, exp_avg_sq_dtype=BF16)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    big = [p for p in params if p.numel() >= mf.MIN_8BIT_NUMEL]
    assert len(big) == 2
    is_big = {id(p) for p in big}
    for p in params:
        s = opt.state[p]
        assert s["exp_avg"].shape == p.shape and s["exp_avg"].stride() == p.stride()
        assert s["exp_avg"].dtype == (U8 if p.numel() >= mf.MIN_8BIT_NUMEL else F32)
        assert s["exp_avg_sq"].dtype == BF16
        assert ("exp_avg_absmax" in s) == (id(p) in is_big) and "exp_avg_sq_absmax" not in s
        if id(p) in is_big:
            assert s["exp_avg_absmax"].shape == (math.ceil(p.numel() / 256),)
    small = sum(p.numel() for p in params if id(p) not in is_big)
    n_big = sum(p.numel() for p in big)
    expected = n_big * 1 + 4 * sum(math.ceil(p.numel() / 256) for p in big) + 4 * small + 2 * (n_big + small)
    assert opt.memory_report()["moments"] == expected


@pytest.mark.parametrize("formats", FORMATS + [(F32, F32)])
def test_memory_report_matches_the_formula(formats):
    p = nn.Parameter(torch.randn(256, 64))  # 16,384 elements: whole blocks
    opt = FusedAdam([p], exp_avg_dtype=formats[0], exp_avg_sq_dtype=formats[1])
    p.grad = torch.randn_like(p)
    opt.step()
    per_element = {F32: 4, BF16: 2, U8: 1 + 4 / 256}
    assert opt.memory_report()["moments"] == p.numel() * sum(per_element[f] for f in formats)
    print(formats, opt.memory_report()["moments"] / p.numel(), "bytes per param")  # 8-bit x2: 2.03125


# ---------------------------------------------------------------------- the step


def float64_adam(p, g, m, v, step, lr, betas, eps, wd):
    """One AdamW step in float64 from the given fp32 moments: (new param, m, v) as float64."""
    b1, b2 = betas
    m = b1 * m.double() + (1 - b1) * g.double()
    v = b2 * v.double() + (1 - b2) * g.double() ** 2
    p = p.double() * (1 - lr * wd)
    p = p - lr / (1 - b1**step) * m / (v.sqrt() / math.sqrt(1 - b2**step) + eps)
    return p, m, v


@pytest.mark.parametrize("formats", FORMATS)
def test_a_step_is_float64_adam_on_the_dequantized_state(formats):
    """From a nontrivial state (3 steps in), step 4 equals float64 Adam on the dequantized moments, the
    new moments stored with state_formats' arithmetic; a wrong map (the unsigned one for exp_avg) does
    not: the negative control."""
    m = model()
    opt = FusedAdam(m.parameters(), lr=1e-2, weight_decay=0.1, exp_avg_dtype=formats[0], exp_avg_sq_dtype=formats[1])
    train(m, opt, range(3))
    p = m[0].weight
    s = opt.state[p]
    before = {k: v.clone() for k, v in s.items()}
    p0 = p.detach().clone()
    opt.zero_grad()
    backward(m, 3)
    g = p.grad.clone()
    opt.step()
    read = {name: mf.to_float32(before[name], before.get(mf.ABSMAX_KEYS[name]), mf.SIGNED[name])
            for name in ("exp_avg", "exp_avg_sq")}
    new_p, new_m, new_v = float64_adam(p0, g, read["exp_avg"], read["exp_avg_sq"], 4, 1e-2, (0.9, 0.999), 1e-8, 0.1)
    # The kernels compute in fp32, the reference in float64: stored values may differ by one code/ulp.
    torch.testing.assert_close(p.detach(), new_p.float(), rtol=1e-5, atol=1e-7)
    for name, value, dtype in (("exp_avg", new_m, formats[0]), ("exp_avg_sq", new_v, formats[1])):
        stored, scales = mf.from_float32(value.float(), dtype, mf.SIGNED[name])
        assert_within_one_step(s[name], stored)
        if scales is not None:
            torch.testing.assert_close(s[mf.ABSMAX_KEYS[name]], scales, rtol=1e-5, atol=0)
    if formats[0] == U8:  # negative control: the codes read with the wrong map give another step
        wrong = sf.dequantize_blockwise(before["exp_avg"], before["exp_avg_absmax"], signed=False)
        wrong_p, _, _ = float64_adam(p0, g, wrong, read["exp_avg_sq"], 4, 1e-2, (0.9, 0.999), 1e-8, 0.1)
        with pytest.raises(AssertionError):
            torch.testing.assert_close(p.detach(), wrong_p.float(), rtol=1e-5, atol=1e-7)


def assert_within_one_step(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Codes (uint8) or bf16 bit patterns at most one step apart, and at most 0.1% of them not equal."""
    as_int = (lambda t: t.view(torch.int16).int()) if actual.dtype == BF16 else (lambda t: t.int())
    diff = (as_int(actual) - as_int(expected)).abs()
    assert int(diff.max()) <= 1 and float((diff != 0).float().mean()) <= 1e-3, (int(diff.max()), int(diff.sum()))


@pytest.mark.parametrize("formats", FORMATS)
@pytest.mark.parametrize("rounding", [False, True])
def test_planned_and_general_steps_give_the_same_bits(formats, rounding):
    runs = []
    for general in (False, True):
        m = model(BF16 if rounding else F32)
        opt = FusedAdam(m.parameters(), exp_avg_dtype=formats[0], exp_avg_sq_dtype=formats[1],
                        stochastic_rounding=rounding)
        if rounding:
            for group in opt.param_groups:
                group["rounding_seed"] = 1234
        for step in range(4):
            if general:
                opt._plan = None  # every step builds its lists anew
            train(m, opt, range(step, step + 1))
        assert general or opt._plan is not None
        runs.append((m, opt))
    (m1, o1), (m2, o2) = runs
    for p1, p2 in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(p1, p2)
        assert states_equal(o1.state[p1], o2.state[p2])


def test_a_skipped_step_changes_no_bit():
    m = model()
    opt = FusedAdam(m.parameters(), exp_avg_dtype=U8, exp_avg_sq_dtype=BF16)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    train(m, opt, range(2))
    before = copy.deepcopy((list(m.parameters()), {k: dict(v) for k, v in opt.state.items()}))
    opt.zero_grad()
    scaler.scale(m(torch.randn(16, 64)).square().mean()).backward()
    m[0].weight.grad[0, 0] = math.inf
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() < 2.0**4  # the scaler saw the inf: the step was skipped
    for p, q in zip(m.parameters(), before[0]):
        assert torch.equal(p, q)
    for s, t in zip(opt.state.values(), before[1].values()):
        assert states_equal(s, t)


# ---------------------------------------------------------------------- stochastic rounding keys


def run_sr(seed_for_init: int, steps: range, m=None, opt=None):
    if m is None:
        m = model(BF16)
        torch.manual_seed(seed_for_init)
        opt = FusedAdam(m.parameters(), lr=1e-3, exp_avg_dtype=BF16, exp_avg_sq_dtype=U8, stochastic_rounding=True)
    train(m, opt, steps)
    return m, opt


def test_rounding_is_reproducible_and_resumes_from_a_state_dict():
    m1, o1 = run_sr(7, range(4))
    m2, o2 = run_sr(7, range(4))  # the same torch seed: the same rounding seed and bits
    assert all(torch.equal(a, b) for a, b in zip(m1.parameters(), m2.parameters()))
    m3, o3 = run_sr(8, range(4))  # another seed: other bits (negative control)
    assert not all(torch.equal(a, b) for a, b in zip(m1.parameters(), m3.parameters()))
    # Stop after 2 steps, load into an optimizer seeded otherwise, go on: the uninterrupted run's bits.
    m4, o4 = run_sr(7, range(2))
    saved = copy.deepcopy(o4.state_dict())
    m5 = copy.deepcopy(m4)
    torch.manual_seed(99)
    o5 = FusedAdam(m5.parameters(), lr=1e-3, exp_avg_dtype=BF16, exp_avg_sq_dtype=U8, stochastic_rounding=True)
    o5.load_state_dict(saved)
    assert o5.param_groups[0]["rounding_seed"] == o1.param_groups[0]["rounding_seed"]
    run_sr(0, range(2, 4), m5, o5)
    assert all(torch.equal(a, b) for a, b in zip(m1.parameters(), m5.parameters()))
    for p1, p5 in zip(m1.parameters(), m5.parameters()):
        assert states_equal(o1.state[p1], o5.state[p5])


# ---------------------------------------------------------------------- state dicts


@pytest.mark.parametrize("formats", FORMATS)
def test_state_dict_round_trip_is_bit_exact(formats):
    m = model()
    opt = FusedAdam(m.parameters(), exp_avg_dtype=formats[0], exp_avg_sq_dtype=formats[1])
    train(m, opt, range(3))
    saved = copy.deepcopy(opt.state_dict())
    m2 = copy.deepcopy(m)
    opt2 = FusedAdam(m2.parameters(), exp_avg_dtype=formats[0], exp_avg_sq_dtype=formats[1])
    opt2.load_state_dict(saved)
    for p, q in zip(m.parameters(), m2.parameters()):
        assert states_equal(opt.state[p], opt2.state[q])
    train(m, opt, range(3, 5))
    train(m2, opt2, range(3, 5))
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), m2.parameters()))


@pytest.mark.parametrize("formats", FORMATS)
def test_adamw_state_dicts_load_quantized_and_export_to_fp32(formats):
    m = model()
    adamw = torch.optim.AdamW(m.parameters())
    train(m, adamw, range(3))
    opt = FusedAdam(m.parameters(), exp_avg_dtype=formats[0], exp_avg_sq_dtype=formats[1])
    opt.load_state_dict(adamw.state_dict())
    for p in m.parameters():
        for name, dtype in zip(("exp_avg", "exp_avg_sq"), mf.MomentFormats(*formats).dtypes(p.numel())):
            stored, scales = mf.from_float32(adamw.state[p][name], dtype, mf.SIGNED[name])
            assert torch.equal(opt.state[p][name], stored) and opt.state[p][name].dtype == dtype
            if scales is not None:
                assert torch.equal(opt.state[p][mf.ABSMAX_KEYS[name]], scales)
    # Exported: AdamW's format (fp32 moments, no absmax), the values the kernel reads; AdamW loads it.
    exported = mf.float32_state_dict(opt.state_dict())
    back = torch.optim.AdamW(m.parameters())
    back.load_state_dict(exported)
    for p in m.parameters():
        s = opt.state[p]
        assert set(back.state[p]) == {"step", "exp_avg", "exp_avg_sq"}
        for name in ("exp_avg", "exp_avg_sq"):
            assert back.state[p][name].dtype == F32
            read = mf.to_float32(s[name], s.get(mf.ABSMAX_KEYS[name]), mf.SIGNED[name])
            assert torch.equal(back.state[p][name], read)
    saved = opt.state_dict()["state"][0]  # the export changed nothing (8-bit codes: under their own key)
    assert saved[mf.CODES_KEYS["exp_avg"] if formats[0] == U8 else "exp_avg"].dtype == formats[0]


def test_a_state_dict_in_other_formats_is_converted():
    """8-bit saved, bf16 loaded (and back to fp32): through the fp32 values the kernel reads."""
    m = model()
    opt = FusedAdam(m.parameters(), exp_avg_dtype=U8, exp_avg_sq_dtype=U8)
    train(m, opt, range(3))
    p = m[0].weight
    for target in (BF16, F32):
        other = FusedAdam(m.parameters(), exp_avg_dtype=target, exp_avg_sq_dtype=target)
        other.load_state_dict(opt.state_dict())
        for name in ("exp_avg", "exp_avg_sq"):
            read = mf.to_float32(opt.state[p][name], opt.state[p][mf.ABSMAX_KEYS[name]], mf.SIGNED[name])
            assert torch.equal(other.state[p][name], read.to(target))


def test_channels_last_blocks_follow_memory_order():
    conv = nn.Conv2d(32, 16, 3).to(memory_format=torch.channels_last)
    opt = FusedAdam(conv.parameters(), exp_avg_dtype=U8, exp_avg_sq_dtype=U8)
    for _ in range(2):
        conv.weight.grad = torch.randn_like(conv.weight)
        conv.bias.grad = torch.randn_like(conv.bias)
        opt.step()
    s = opt.state[conv.weight]
    codes = s["exp_avg"].permute(0, 2, 3, 1).reshape(-1)  # memory order
    flat = sf.dequantize_blockwise(codes, s["exp_avg_absmax"], signed=True)
    exported = mf.float32_state_dict(opt.state_dict())["state"][0]["exp_avg"]
    assert torch.equal(exported.permute(0, 2, 3, 1).reshape(-1), flat)
    logical = sf.dequantize_blockwise(s["exp_avg"].contiguous(), s["exp_avg_absmax"], signed=True)
    assert not torch.equal(exported, logical)  # negative control: logical-order blocks read other scales


def test_a_refused_load_changes_nothing():
    m = model()
    opt = FusedAdam(m.parameters(), exp_avg_dtype=U8, exp_avg_sq_dtype=BF16, stochastic_rounding=False)
    train(m, opt, range(2))
    before = {k: dict(v) for k, v in copy.deepcopy(opt.state).items()}
    groups = copy.deepcopy(opt.param_groups)
    bad = copy.deepcopy(opt.state_dict())
    del bad["state"][0]["exp_avg_absmax"]  # 8-bit codes without their scales
    with pytest.raises(ValueError, match="exp_avg_absmax"):
        opt.load_state_dict(bad)
    bad = copy.deepcopy(opt.state_dict())
    bad["state"][0]["exp_avg_absmax"] = bad["state"][0]["exp_avg_absmax"][:-1]
    with pytest.raises(ValueError, match="scales"):
        opt.load_state_dict(bad)
    bad = copy.deepcopy(opt.state_dict())
    bad["param_groups"][0]["rounding_seed"] = "seven"
    with pytest.raises(ValueError, match="rounding_seed"):
        opt.load_state_dict(bad)
    for s, t in zip(opt.state.values(), before.values()):
        assert states_equal(s, t)
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in groups]


def test_dcp_round_trip_through_get_and_set_optimizer_state_dict(tmp_path):
    """torch.distributed.checkpoint (one process) saves and loads the codes, scales, bf16 moments and the
    rounding seed as they are: the loaded optimizer holds the same bits and goes on with the same steps."""
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    kwargs = dict(exp_avg_dtype=U8, exp_avg_sq_dtype=BF16, stochastic_rounding=True)
    m = model(BF16)
    opt = FusedAdam(m.parameters(), **kwargs)
    train(m, opt, range(2))
    dcp.save({"optim": get_optimizer_state_dict(m, opt)}, checkpoint_id=str(tmp_path))
    m2 = copy.deepcopy(m)
    opt2 = FusedAdam(m2.parameters(), **kwargs)  # another seed (drawn anew)
    target = {"optim": get_optimizer_state_dict(m2, opt2)}
    dcp.load(target, checkpoint_id=str(tmp_path))
    set_optimizer_state_dict(m2, opt2, target["optim"])
    assert opt2.param_groups[0]["rounding_seed"] == opt.param_groups[0]["rounding_seed"]
    for p, q in zip(m.parameters(), m2.parameters()):
        assert states_equal(opt.state[p], opt2.state[q])
    train(m, opt, range(2, 4))
    train(m2, opt2, range(2, 4))
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), m2.parameters()))


def test_compiled_step_is_the_eager_step():
    """torch.compile (fullgraph) traces the step with its codes, scales and rounding keys: the same bits."""
    runs = []
    for compiled in (False, True):
        m = model(BF16)
        torch.manual_seed(3)
        opt = FusedAdam(m.parameters(), exp_avg_dtype=U8, exp_avg_sq_dtype=BF16, stochastic_rounding=True)
        step = torch.compile(opt.step, backend="aot_eager", fullgraph=True) if compiled else opt.step
        for i in range(3):
            opt.zero_grad()
            backward(m, i)
            step()
        runs.append((m, opt))
    (m1, o1), (m2, o2) = runs
    for p, q in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(p, q) and states_equal(o1.state[p], o2.state[q])
