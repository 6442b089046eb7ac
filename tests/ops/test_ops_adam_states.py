"""Tests of the fused Adam op with low-precision moments (bf16, 8-bit blockwise) and stochastic rounding.

Two oracles, as in bitsandbytes' and Transformer Engine's tests:

* bit for bit, the composition the op promises (Note [State formats] in csrc/math/state_format.h): read
  the moments with ``state_formats`` (fp32 values), run the fp32-state op on them, store the results
  with ``state_formats`` (8-bit codes and absmax, bf16 to nearest or stochastically with the Philox
  words of ``state_formats.RoundingKeys``);
* within the kernel tolerances, ``reference.adam_step_`` (float64 update between the same exact reads
  and stores), re-synced to the kernel's state every step, with ordinary and harsh betas.

Negative controls show that a wrong map or a wrong absmax is caught. Every test runs on each backend of
tests/ops/backends.py (cpu, cuda-emulated, cuda): each has low-precision kernels. Helpers: op_helpers.py.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch import Tensor

from distopt import ops, reference
from distopt import state_formats as sf

import tolerances
from op_helpers import (
    BF16,
    CHUNK,
    FP16,
    FP32,
    GRAD_SCALE,
    HYPER,
    AdamState,
    assert_bits_equal,
    bits,
    dtype_id,
    make_adam_state,
    new_tensor,
    scalar,
)

U8 = torch.uint8
MOMENT_DTYPES = (FP32, BF16, U8)
FORMATS = [
    pytest.param(m, v, id=f"m_{dtype_id(m)}-v_{dtype_id(v)}") for m in MOMENT_DTYPES for v in MOMENT_DTYPES
]
# (param, grad, param_out dtype, remainders)
PARAM_CASES = [
    pytest.param(FP32, FP32, None, False, id="fp32"),
    pytest.param(BF16, FP16, FP32, False, id="bf16-fp16_grad-fp32_out"),
    pytest.param(FP16, BF16, BF16, False, id="fp16-bf16_grad-bf16_out"),
    pytest.param(BF16, FP32, BF16, True, id="bf16_remainders-bf16_out"),
]
Q = sf.QUANT_BLOCK
# Around the 256-element blocks, the CPU's 32K-element (128-block) parallel grain and the CUDA chunk.
SIZES = (1, 3, Q - 1, Q, Q + 1, 2 * Q + 7, 32768 - 1, 32768 + 1, CHUNK + 3, 5)
SEED = -0x1234_5678_9ABC  # a negative int64: the kernel keys with its two's complement
HARSH = dict(beta1=0.1, beta2=0.5)  # Transformer Engine's harsh betas


def _flat(t: Tensor) -> Tensor:
    """``t``'s elements in memory order (dense tensors): the order of blocks and rounding indices."""
    return t.view(-1) if t.is_contiguous() else t.as_strided((t.numel(),), (1,))


@dataclasses.dataclass
class States:
    """An adam_step_ call's tensors with moments in their formats, and its stochastic-rounding key."""

    s: AdamState
    exp_avg_scales: list[Tensor]
    exp_avg_sq_scales: list[Tensor]
    seed: int | None = None
    param_ids: list[int] = dataclasses.field(default_factory=list)
    param_offsets: list[int] = dataclasses.field(default_factory=list)

    def clone(self) -> States:
        return dataclasses.replace(
            self, s=self.s.clone(), exp_avg_scales=[t.clone() for t in self.exp_avg_scales],
            exp_avg_sq_scales=[t.clone() for t in self.exp_avg_sq_scales],
        )  # fmt: skip

    def written(self) -> dict[str, list[Tensor]]:
        return {**self.s.written(), "exp_avg_scales": self.exp_avg_scales, "exp_avg_sq_scales": self.exp_avg_sq_scales}

    def kwargs(self) -> dict:
        return dict(
            exp_avg_scales=self.exp_avg_scales, exp_avg_sq_scales=self.exp_avg_sq_scales, rounding_seed=self.seed,
            param_ids=self.param_ids, param_offsets=self.param_offsets,
        )  # fmt: skip


def encode(values: Tensor, dtype: torch.dtype, signed: bool, layout="contiguous") -> tuple[Tensor, Tensor | None]:
    """fp32 ``values`` stored to nearest in a ``dtype`` tensor of ``layout``: (tensor, absmax or None)."""
    out = new_tensor(values.shape, dtype, layout=layout)
    if dtype != U8:
        return out.copy_(values), None
    codes, absmax = sf.quantize_blockwise(_flat(values), signed)
    _flat(out).copy_(codes)
    return out, absmax


def decode(x: Tensor, scales: Tensor | None, signed: bool) -> Tensor:
    """The fp32 values the kernel reads from ``x`` (same strides)."""
    out = torch.empty_like(x, dtype=FP32)
    if x.dtype == U8:
        _flat(out).copy_(sf.dequantize_blockwise(_flat(x), scales, signed))
        return out
    return out.copy_(x)


def make_states(sizes, m_dtype, v_dtype, param_dtype=FP32, grad_dtype=FP32, out_dtype=None, *, remainders=False,
                rounding=False, layout="contiguous") -> States:  # fmt: skip
    """Random inputs (never zero) with moments encoded in their formats; with ``rounding``, a seed and
    param ids 3, 4, ..."""
    s = make_adam_state(sizes, param_dtype, grad_dtype, out_dtype, remainders=remainders, layout=layout)
    m = [encode(t, m_dtype, True, layout) for t in s.exp_avgs]
    v = [encode(t, v_dtype, False, layout) for t in s.exp_avg_sqs]
    s.exp_avgs, s.exp_avg_sqs = [t for t, _ in m], [t for t, _ in v]
    st = States(s, [a for _, a in m if a is not None], [a for _, a in v if a is not None])
    if rounding:
        st.seed, st.param_ids = SEED, [3 + i for i in range(len(s.params))]
    return st


def run_states(st: States, *, step=3, lr=None, **kw) -> None:
    h = {**HYPER, **kw}
    if lr is not None:
        h["lr"] = lr
    s = st.s
    ops.adam_step_(s.params, s.grads, s.exp_avgs, s.exp_avg_sqs, param_outs=s.param_outs,
                   param_remainders=s.param_remainders, step=step, **h, **st.kwargs())  # fmt: skip


def _step_of(step, i: int):
    return step[i] if isinstance(step, (list, tuple)) else step


def composed(st: States, *, step=3, signed_maps=(True, False), **kw) -> States:
    """What the op must write, built from the fp32-state op and ``state_formats`` (see the module doc).
    ``signed_maps``: the maps' signedness for exp_avgs and exp_avg_sqs (a negative control swaps them)."""
    out = st.clone()
    s = out.s
    m_scales = iter(out.exp_avg_scales)
    v_scales = iter(out.exp_avg_sq_scales)
    ms = [decode(t, next(m_scales) if t.dtype == U8 else None, True) for t in s.exp_avgs]
    vs = [decode(t, next(v_scales) if t.dtype == U8 else None, False) for t in s.exp_avg_sqs]
    round_params = st.seed is not None and s.params[0].dtype == BF16 and not s.param_remainders
    params = [p.float() for p in s.params] if round_params else s.params
    f = AdamState(params, s.grads, ms, vs, [] if round_params else s.param_outs, s.param_remainders)
    run_states(States(f, [], []), step=step, **kw)
    keys = None if st.seed is None else sf.RoundingKeys(st.seed, st.param_ids, st.param_offsets or [0] * len(params))
    m_scales, v_scales = iter(out.exp_avg_scales), iter(out.exp_avg_sq_scales)
    for i in range(len(params)):
        words = keys.words(i, _step_of(step, i), params[i].numel(), params[i].device) if keys else None
        for dst, val, scales, signed, w in ((s.exp_avgs[i], ms[i], m_scales, signed_maps[0], 1),
                                            (s.exp_avg_sqs[i], vs[i], v_scales, signed_maps[1], 2)):  # fmt: skip
            if dst.dtype == U8:
                codes, absmax = sf.quantize_blockwise(_flat(val), signed)
                _flat(dst).copy_(codes)
                next(scales).copy_(absmax)
            elif dst.dtype == BF16 and words is not None:
                _flat(dst).copy_(sf.bf16_stochastic(_flat(val), words[w]))
            else:
                dst.copy_(val)
        if round_params:
            _flat(s.params[i]).copy_(sf.bf16_stochastic(_flat(params[i]), words[0]))
            if s.param_outs and s.param_outs[i].data_ptr() != s.params[i].data_ptr():
                ops.cast_copy_([s.params[i]], [s.param_outs[i]])  # the kernels' casts (one NaN per dtype)
    return out


def assert_states_bits_equal(actual: States, expected: States) -> None:
    for name, lst in actual.written().items():
        for i, (a, e) in enumerate(zip(lst, expected.written()[name])):
            assert_bits_equal(a, e, f"{name}[{i}]")


def check_composition(st: States, *, signed_maps=(True, False), **kw) -> States:
    """Runs the op on ``st``; asserts it wrote exactly ``composed``'s bits and moved the params."""
    expected = composed(st, signed_maps=signed_maps, **kw)
    before = [p.clone() for p in st.s.params]
    run_states(st, **kw)
    assert_states_bits_equal(st, expected)
    assert any(not torch.equal(b, p) for b, p in zip(before, st.s.params))
    return expected


# ----------------------------------------------------------------------------------------------------
# The float64 reference, re-synced every step
# ----------------------------------------------------------------------------------------------------

CODE_MISMATCH_FRACTION = 1e-3  # codes whose fp32 and float64 values straddle a decision threshold


def run_reference(st: States, *, step=3, **kw) -> None:
    h = {**HYPER, **kw}
    s = st.s
    steps = [torch.tensor(float(x), dtype=torch.float64) for x in step] if isinstance(step, (list, tuple)) else [
        torch.tensor(float(step), dtype=torch.float64)]  # fmt: skip
    reference.adam_step_(
        *s.lists(), torch.tensor(h["lr"], dtype=torch.float64), steps, h["beta1"], h["beta2"], h["eps"],
        h["weight_decay"], h["adam_w_mode"], h["maximize"], h.get("grad_scale"), h.get("found_inf"),
        st.exp_avg_scales, st.exp_avg_sq_scales, st.seed, st.param_ids, st.param_offsets,
    )  # fmt: skip


def assert_close_to_reference(actual: States, expected: States) -> None:
    """Params, fp32/bf16 moments and absmax within ``tolerances.KERNEL``; 8-bit codes equal but for at most
    CODE_MISMATCH_FRACTION of them, each off by one."""
    a, e = actual.s, expected.s
    for i, (x, y) in enumerate(zip(a.masters(), e.masters())):
        tolerances.assert_close(x, y.to(x.device), tolerances.KERNEL, msg=lambda m, i=i: f"params[{i}]: {m}")
    for name in ("exp_avgs", "exp_avg_sqs", "param_outs", "exp_avg_scales", "exp_avg_sq_scales"):
        for i, (x, y) in enumerate(zip(actual.written()[name], expected.written()[name])):
            if x.dtype != U8:
                what = f"{name}[{i}]"
                tolerances.assert_close(x, y.to(x.device), tolerances.KERNEL, msg=lambda m, w=what: f"{w}: {m}")
                continue
            diff = (x.int() - y.to(x.device).int()).abs()
            assert diff.max().item() <= 1, f"{name}[{i}]: a code off by {diff.max().item()}"
            bad = int((diff != 0).sum())
            assert bad <= max(1, CODE_MISMATCH_FRACTION * x.numel()), f"{name}[{i}]: {bad} codes differ"


def check_reference_resynced(st: States, steps: int = 3, **kw) -> None:
    """``steps`` updates with fresh gradients; before each, the reference starts from the kernel's state."""
    for step in range(1, steps + 1):
        for g in st.s.grads:
            g.copy_(torch.randn(g.shape))
        expected = st.clone()
        run_reference(expected, step=step, **kw)
        run_states(st, step=step, **kw)
        assert_close_to_reference(st, expected)


# ----------------------------------------------------------------------------------------------------
# Every backend
# ----------------------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def states_backend(one_intra_op_thread, backend):
    """The backend. Every backend has low-precision kernels now, so a refusal fails the test: it used to
    skip on NotImplementedError, which would also have hidden a CUDA module that failed to load (torch
    raises NotImplementedError for an op with no CUDA kernel) behind a green `pytest -m cuda`."""
    return backend


# ----------------------------------------------------------------------------------------------------
# Bit for bit: the fp32-state op between state_formats' reads and stores
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rounding", [False, True], ids=["nearest", "stochastic"])
@pytest.mark.parametrize("param_dtype,grad_dtype,out_dtype,remainders", PARAM_CASES)
@pytest.mark.parametrize("m_dtype,v_dtype", FORMATS)
def test_states_are_the_fp32_update_between_exact_reads_and_stores(
    m_dtype, v_dtype, param_dtype, grad_dtype, out_dtype, remainders, rounding
):
    st = make_states(SIZES, m_dtype, v_dtype, param_dtype, grad_dtype, out_dtype, remainders=remainders,
                     rounding=rounding)  # fmt: skip
    check_composition(st, step=5, grad_scale=scalar(GRAD_SCALE))


@pytest.mark.parametrize("maximize", [False, True], ids=["minimize", "maximize"])
@pytest.mark.parametrize("adam_w_mode", [True, False], ids=["adamw", "adam_l2"])
def test_states_modes(adam_w_mode, maximize):
    st = make_states(SIZES, U8, U8, BF16, FP32, FP16, rounding=True)
    check_composition(st, step=2, adam_w_mode=adam_w_mode, maximize=maximize, **HARSH)


def test_states_capturable_per_param_steps():
    """lr and per-param step tensors (read by the kernel): coefficients and rounding keys per entry."""
    st = make_states(SIZES[:4], U8, BF16, BF16, FP32, FP32, rounding=True)
    steps = [scalar(float(1 + i % 3)) for i in range(4)]
    check_composition(st, step=steps, lr=scalar(3e-3), grad_scale=scalar(GRAD_SCALE), found_inf=scalar(0.0))


@pytest.mark.parametrize("layout", ["unaligned", "channels_last"])
def test_states_layouts(layout):
    """Odd storage offsets (codes, bf16 moments, scales, params all misaligned) and channels_last (blocks
    and rounding indices in memory order): the composition's bits."""
    sizes = [(2, 16, 9, 9), (1, 3, 5, 7), (3, 5, 17, 4)] if layout == "channels_last" else SIZES
    st = make_states(sizes, U8, BF16, BF16, FP32, FP16, rounding=True, layout=layout)
    if layout == "unaligned":
        st.exp_avg_scales = [new_tensor(a.shape, FP32, layout="unaligned").copy_(a) for a in st.exp_avg_scales]
    check_composition(st, step=4)


def test_states_nonfinite_grads_without_found_inf():
    """inf/nan gradients (no skip flag): NaN absmax (canonical) and the map's 0 codes, bit for bit."""
    st = make_states(SIZES, U8, U8, BF16, FP32, BF16, rounding=True)
    for g in st.s.grads[3:]:
        g.view(-1)[:: 977] = math.nan
        g.view(-1)[5:: 1301] = math.inf
    expected = composed(st)
    run_states(st)
    assert_states_bits_equal(st, expected)  # NaN payloads aside (assert_bits_equal), so check them:
    for scales in (st.exp_avg_scales, st.exp_avg_sq_scales):
        nans = torch.cat([bits(a)[a.isnan()] for a in scales])
        assert nans.numel() > 0 and (nans == 0x7FC00000).all(), "a NaN absmax is not the canonical NaN"


@pytest.mark.parametrize("capturable", [False, True], ids=["eager", "capturable"])
def test_states_found_inf_leaves_every_bit(capturable):
    st = make_states(SIZES, U8, BF16, BF16, FP32, FP32, rounding=True)
    before = st.clone()
    kw = dict(step=[scalar(2.0)] * len(SIZES), lr=scalar(1e-3)) if capturable else dict(step=2)
    run_states(st, found_inf=scalar(1.0), grad_scale=scalar(GRAD_SCALE), **kw)
    assert_states_bits_equal(st, before)


# ----------------------------------------------------------------------------------------------------
# Against the float64 reference, re-synced every step
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("betas", [pytest.param({}, id="betas_default"), pytest.param(HARSH, id="betas_harsh")])
@pytest.mark.parametrize("param_dtype,rounding", [(FP32, False), (BF16, True)], ids=["fp32", "bf16_stochastic"])
@pytest.mark.parametrize("m_dtype,v_dtype", FORMATS)
def test_states_against_float64_reference(m_dtype, v_dtype, param_dtype, rounding, betas):
    st = make_states(SIZES, m_dtype, v_dtype, param_dtype, FP32, BF16, rounding=rounding)
    check_reference_resynced(st, grad_scale=scalar(GRAD_SCALE), **betas)


@pytest.fixture
def linear_map(monkeypatch):
    """state_formats with a linear map in place of bitsandbytes' dynamic one (a negative control)."""
    monkeypatch.setattr(sf, "_map", lambda signed: torch.linspace(-1.0 if signed else 0.0, 1.0, sf.CODES))


def test_negative_control_wrong_map_is_caught(linear_map):
    st = make_states(SIZES, U8, U8, rounding=False)
    with pytest.raises(AssertionError):
        check_reference_resynced(st, steps=1)


def test_negative_control_swapped_map_is_caught():
    st = make_states(SIZES, U8, U8)
    with pytest.raises(AssertionError):
        check_composition(st, signed_maps=(False, True))


@pytest.mark.parametrize("check", ["composition", "reference"])
def test_negative_control_wrong_absmax_is_caught(check):
    """One absmax off by one ulp (bit for bit) or by 1% (float64 reference) fails the check."""
    st = make_states(SIZES, U8, U8)
    expected = composed(st) if check == "composition" else st.clone()
    if check == "reference":
        run_reference(expected)
    run_states(st)
    a = st.exp_avg_sq_scales[-2]
    a[1] = torch.nextafter(a[1], torch.tensor(math.inf, device=a.device)) if check == "composition" else a[1] * 1.01
    with pytest.raises(AssertionError):
        (assert_states_bits_equal if check == "composition" else assert_close_to_reference)(st, expected)


# ----------------------------------------------------------------------------------------------------
# Stochastic rounding's bits
# ----------------------------------------------------------------------------------------------------


def test_philox_known_answers():
    """state_formats' Philox4x32-10 (the kernels' bits, through the tests above) against Random123's
    published known-answer vectors (kat_vectors: counter, key -> output)."""
    cases = [
        ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
        ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
        ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
         (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
    ]  # fmt: skip
    for counter, key, want in cases:
        got = sf.philox4x32_10(tuple(torch.tensor([c], dtype=torch.int64) for c in counter), key)
        assert [int(w) for w in got] == list(want)


def test_rounding_slice_invariance():
    """A param split into entries at multiples of 256 (param_offsets, one param id) gets the whole
    param's bits: codes, absmax, bf16 moments and stochastically rounded bf16 params."""
    n, cuts = 5 * Q + 77, (0, 2 * Q, 3 * Q)
    whole = make_states([n], U8, BF16, BF16, FP32, FP32, rounding=True)
    whole.param_ids = [11]
    pieces = whole.clone()
    bounds = [*cuts, n]

    def split(t: Tensor, block: bool = False) -> list[Tensor]:
        d = Q if block else 1
        return [t[b // d : -(-e // d)] for b, e in zip(bounds, bounds[1:])]

    s = pieces.s
    pieces.s = AdamState(*[split(lst[0]) if lst else [] for lst in s.lists()])
    pieces.exp_avg_scales = split(pieces.exp_avg_scales[0], block=True)
    pieces.param_ids, pieces.param_offsets = [11] * len(cuts), list(cuts)
    run_states(whole, step=9)
    run_states(pieces, step=9)
    assert_states_bits_equal(pieces, States(
        AdamState(*[split(lst[0]) if lst else [] for lst in whole.s.lists()]),
        split(whole.exp_avg_scales[0], block=True), [],
    ))  # fmt: skip


@pytest.mark.parametrize("change", ["seed", "step", "param_id", "offset"])
def test_rounding_bits_follow_every_key_part(change):
    """Changing any part of (seed, step, param id, element offset) changes the rounded bits."""
    base = make_states([4 * Q], BF16, BF16, BF16, rounding=True)
    other = base.clone()
    step = 4
    if change == "seed":
        other.seed = SEED + 1
    elif change == "step":
        step = 5
    elif change == "param_id":
        other.param_ids = [4]
    else:
        other.param_offsets = [Q]
    run_states(base, step=4, beta1=0.0, beta2=0.0)  # beta 0: the step changes only the key, not the value
    run_states(other, step=step, beta1=0.0, beta2=0.0)
    assert not torch.equal(base.s.params[0], other.s.params[0])
    assert not torch.equal(base.s.exp_avgs[0], other.s.exp_avgs[0])


def test_stochastic_rounding_is_unbiased_where_nearest_never_moves():
    """bf16 params without masters, an update of ~1/10 of a bf16 ulp: to nearest never moves them;
    stochastic rounding moves them by the update on average (within 6 standard errors)."""
    n = 1 << 16
    ones = torch.ones(n)
    hyper = dict(lr=2**-11, weight_decay=0.0, beta1=0.0, beta2=0.0, eps=0.0)  # update = -lr * sign(g)
    results = {}
    for rounding in (False, True):
        st = make_states([n], FP32, FP32, BF16, rounding=rounding)
        st.s.params[0].copy_(ones)
        st.s.grads[0].copy_(ones)
        run_states(st, step=1, **hyper)
        results[rounding] = st.s.params[0].double().cpu()
    ulp = 2**-8  # bf16 spacing just below 1.0
    assert torch.equal(results[False], torch.ones(n, dtype=torch.float64))
    mean, want = results[True].mean().item() - 1.0, -hyper["lr"]
    stderr = ulp * math.sqrt((hyper["lr"] / ulp) * (1 - hyper["lr"] / ulp) / n)
    assert abs(mean - want) < 6 * stderr, (mean, want, stderr)
