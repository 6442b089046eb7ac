"""The CPU kernels (distopt._C on CPU tensors) give the same bits whatever the thread count and ISA.

The kernels split the elements of all tensors into ranges for torch's threads (csrc/cpu/flat.h) and
run vectorised loops compiled for SSE2, AVX2 and AVX-512, the best this CPU has chosen at run time
(csrc/cpu/isa.h; DISTOPT_CPU_ISA=baseline|avx2|avx512 forces one). Each case here runs one op on
identical inputs under torch.set_num_threads(1, 2, 3) and every ISA path this CPU supports and compares
every output bit for bit (NaN payloads included), with sizes around the vector widths (4, 8, 16
lanes), the norm's 4096-element blocks and the 32K-element parallel grain, every list at its own odd
element offset, and inf/nan injected. The conversions of Note [16-bit conversions]
(csrc/common/types.h) are checked against torch's casts. test_cpu_isa.py checks the dispatch itself.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import pytest
import torch
from torch import Tensor

from distopt import ops, state_formats

from cpu_paths import ISAS, RUNS, compiled_cpu_kernels, threads_and_isa  # noqa: F401 (a fixture)
from op_helpers import (
    BF16,
    FP16,
    FP32,
    NORM_RTOL,
    AdamState,
    assert_adam_bits_equal,
    assert_adam_close,
    assert_bits_equal,
    assert_each_bits_equal,
    bits,
    make_adam_state,
    run_adam,
    run_adam_capturable,
    run_reference_adam,
    scalar,
)

# Around the vector widths, the norm's block (4096) and the parallel grain (32768); ~290K elements in
# all, so 2 and 3 threads each get several ranges.
SIZES = (1, 3, 7, 8, 15, 16, 17, 33, 4095, 4096, 4097, 8193, 32767, 32768, 32769, 65537, 100_003, 0, 5)
# Element offset of each Adam list's tensors inside their buffers: no two lists aligned alike.
OFFSETS = {"params": 1, "grads": 3, "exp_avgs": 0, "exp_avg_sqs": 2, "param_outs": 5, "param_remainders": 7}
GUARD = 77.0


pytestmark = pytest.mark.usefixtures("compiled_cpu_kernels")


def at_offset(t: Tensor, offset: int) -> Tensor:
    """A copy of ``t`` viewed at element ``offset`` of a larger buffer whose other elements are GUARD."""
    buf = torch.full((t.numel() + offset + 3,), GUARD, dtype=t.dtype)
    view = buf[offset : offset + t.numel()].view(t.shape)
    return view.copy_(t)


def offset_state(state: AdamState) -> AdamState:
    """``state`` with each list's tensors at that list's OFFSETS."""
    return AdamState(**{name: [at_offset(t, OFFSETS[name]) for t in getattr(state, name)] for name in OFFSETS})


def guards_intact(tensors: list[Tensor]) -> None:
    for i, t in enumerate(tensors):
        base = t._base
        outside = torch.cat([base[: t.storage_offset()], base[t.storage_offset() + t.numel() :]])
        assert torch.equal(outside.float(), torch.full_like(outside.float(), GUARD)), f"[{i}]: write outside"


def poison(tensors: list[Tensor], every: int = 997) -> None:
    """Writes nan, inf and -inf at scattered places of the larger tensors."""
    for t in tensors:
        flat = t.view(-1)
        if flat.numel() > 100:
            flat[::every] = math.nan
            flat[5::every] = math.inf
            flat[11::every] = -math.inf


def run_everywhere(make: Callable[[], object], op: Callable[[object], list[Tensor]]) -> None:
    """``op`` on fresh identical inputs from ``make`` under every RUNS setting: equal bits everywhere."""
    expected = None
    for threads, isa in RUNS:
        inputs = make()
        with threads_and_isa(threads, isa):
            outputs = op(inputs)
        if expected is None:
            expected = outputs
        else:
            assert_each_bits_equal(outputs, expected, f"{threads} threads, isa={isa or 'best'} vs 1 thread baseline")


def calling_thread_share(fn: Callable[[], object], reps: int = 3) -> float:
    """CPU time of the calling thread / CPU time of the whole process while ``fn`` runs ``reps`` times
    (CPU time, so other load on the machine does not change it): ~1 when ``fn`` runs on this thread
    only, ~1/k when k threads share the work."""
    fn()
    time.sleep(0.05)  # let OpenMP workers of earlier calls stop spinning
    thread0, process0 = time.thread_time(), time.process_time()
    for _ in range(reps):
        fn()
    return (time.thread_time() - thread0) / (time.process_time() - process0)


def test_kernels_run_on_torchs_threads():
    """With 2 torch threads a big op's work is shared (at::parallel_for really splits it: without
    -fopenmp it silently runs serially); with 1 thread it all runs on the calling thread."""
    n = 1 << 23
    p, g, m, v = torch.randn(n), torch.randn(n), torch.zeros(n), torch.ones(n)
    ops_under_test = {
        "adam": lambda: ops.adam_step_(
            [p], [g], [m], [v], lr=1e-3, step=1, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, adam_w_mode=True
        ),  # fmt: skip
        "l2norm": lambda: ops.l2norm([g, p]),
        "scale_": lambda: ops.scale_([g], [m], scalar(0.5)),
    }
    for name, fn in ops_under_test.items():
        with threads_and_isa(1, None):
            single = calling_thread_share(fn)
        with threads_and_isa(2, None):
            shared = calling_thread_share(fn)
        assert single > 0.9, f"{name}: 1 thread, but the calling thread did only {single:.0%} of the work"
        assert shared < 0.9, f"{name}: 2 threads, but the calling thread did {shared:.0%} of the work"


# ----------------------------------------------------------------------------------------------------
# Adam
# ----------------------------------------------------------------------------------------------------

# (param, grad, param_out, remainders): every conversion in both directions.
ADAM_MIXES = [
    pytest.param(FP32, FP32, None, False, id="fp32"),
    pytest.param(FP32, BF16, BF16, False, id="fp32_master-bf16_grad-bf16_out"),
    pytest.param(FP32, FP16, FP16, False, id="fp32_master-fp16_grad-fp16_out"),
    pytest.param(BF16, BF16, None, True, id="bf16_remainders"),
    pytest.param(BF16, FP32, FP16, True, id="bf16_remainders-fp16_out"),
    pytest.param(FP16, FP16, FP32, False, id="fp16-fp32_out"),
    pytest.param(BF16, FP16, BF16, False, id="bf16-fp16_grad-bf16_out"),
]


@pytest.mark.parametrize("poisoned", [False, True], ids=["finite", "inf_nan"])
@pytest.mark.parametrize("param_dtype,grad_dtype,out_dtype,remainders", ADAM_MIXES)
def test_adam_bits_independent_of_threads_and_isa(param_dtype, grad_dtype, out_dtype, remainders, poisoned):
    torch.manual_seed(1)
    base = make_adam_state(SIZES, param_dtype, grad_dtype, out_dtype, remainders=remainders)
    if poisoned:
        poison(base.grads)
        poison(base.params[-3:] if param_dtype == FP32 else [])

    def make() -> AdamState:
        return offset_state(base)

    def op(state: AdamState) -> list[Tensor]:
        run_adam(state, step=7, grad_scale=scalar(0.37))
        for lst in state.written().values():
            guards_intact(lst)
        return state.all_tensors()

    run_everywhere(make, op)
    if not poisoned:  # and the shared result is right
        actual, expected = make(), base.clone()
        with threads_and_isa(3, None):
            run_adam(actual, step=7, grad_scale=scalar(0.37))
        run_reference_adam(expected, step=7, grad_scale=scalar(0.37))
        assert_adam_close(actual, expected)


def test_adam_capturable_bits_independent_of_threads_and_isa():
    """Per-tensor steps: each range computes its tensors' coefficients; cut points change nothing."""
    torch.manual_seed(2)
    base = make_adam_state(SIZES, FP32, BF16, BF16)
    steps = [scalar(float(1 + i % 4)) for i in range(len(SIZES))]

    def op(state: AdamState) -> list[Tensor]:
        run_adam_capturable(state, lr=scalar(3e-3), steps=steps, found_inf=scalar(0.0))
        return state.all_tensors()

    run_everywhere(lambda: offset_state(base), op)


def test_adam_threaded_equals_per_tensor_calls():
    """One call over all tensors (ranges spanning tensors) equals one call per tensor, bit for bit."""
    torch.manual_seed(3)
    together = make_adam_state(SIZES, FP32, FP16, BF16)
    alone = together.clone()
    with threads_and_isa(3, None):
        run_adam(together, step=4)
        for i in range(len(SIZES)):
            run_adam(alone.select([i]), step=4)
    assert_adam_bits_equal(together, alone)


STATE_FORMATS = [(torch.uint8, torch.uint8), (BF16, torch.uint8), (torch.uint8, FP32), (BF16, BF16)]


@pytest.mark.parametrize("rounding", [True, False], ids=["stochastic", "nearest"])
@pytest.mark.parametrize("m_dtype,v_dtype", STATE_FORMATS, ids=lambda d: str(d).removeprefix("torch."))
def test_adam_states_bits_independent_of_threads_and_isa(m_dtype, v_dtype, rounding):
    """bf16/8-bit moments (codes, absmax and moments at odd offsets), with or without stochastic rounding of
    bf16 params: ranges are whole 256-element blocks and the Philox words depend on the element only, so
    every thread count and ISA path stores the same bits (the 8-bit read and the Philox words have
    hand-written AVX-512 versions, the read a VBMI one on the default path; bf16 moments rounded to
    nearest are converted inside the Adam loop)."""
    torch.manual_seed(5)
    base = make_adam_state(SIZES, BF16, FP32, FP16)
    poison(base.grads[-5:-3])

    def stored(values: Tensor, dtype: torch.dtype, signed: bool) -> tuple[Tensor, Tensor]:
        if dtype == torch.uint8:
            return state_formats.quantize_blockwise(values, signed)
        return values.to(dtype), torch.zeros(0)

    moments = [[stored(t, m_dtype, True) for t in base.exp_avgs], [stored(t, v_dtype, False) for t in base.exp_avg_sqs]]

    def make() -> tuple[AdamState, list[list[Tensor]]]:
        state = offset_state(base)
        state.exp_avgs, state.exp_avg_sqs = ([at_offset(x, 3) for x, _ in lst] for lst in moments)
        scales = [[at_offset(a, 1) for _, a in lst] if lst[0][0].dtype == torch.uint8 else [] for lst in moments]
        return state, scales

    def op(args) -> list[Tensor]:
        state, (m_scales, v_scales) = args
        ops.adam_step_(
            state.params, state.grads, state.exp_avgs, state.exp_avg_sqs, param_outs=state.param_outs, lr=1e-2,
            step=7, grad_scale=scalar(0.37), exp_avg_scales=m_scales, exp_avg_sq_scales=v_scales,
            rounding_seed=99 if rounding else None, param_ids=list(range(len(SIZES))),
        )  # fmt: skip
        for lst in (*state.written().values(), m_scales, v_scales):
            guards_intact(lst)
        return [*state.all_tensors(), *m_scales, *v_scales]

    run_everywhere(make, op)


# ----------------------------------------------------------------------------------------------------
# scale_ / cast_copy_
# ----------------------------------------------------------------------------------------------------

DTYPES = [pytest.param(d, id=str(d).removeprefix("torch.")) for d in (FP32, BF16, FP16)]


@pytest.mark.parametrize("scaled", [True, False], ids=["scale_", "cast_copy_"])
@pytest.mark.parametrize("out_dtype", DTYPES)
@pytest.mark.parametrize("in_dtype", DTYPES)
def test_scale_bits_independent_of_threads_and_isa(in_dtype, out_dtype, scaled):
    torch.manual_seed(4)
    inputs = [(torch.randn(n) * 300).to(in_dtype) for n in SIZES]
    poison(inputs[-4:-2])

    def make() -> tuple[list[Tensor], list[Tensor], Tensor]:
        outs = [at_offset(torch.zeros(n, dtype=out_dtype), 2) for n in SIZES]
        return [at_offset(t, 1) for t in inputs], outs, scalar(0.0)

    def op(args) -> list[Tensor]:
        ins, outs, flag = args
        if scaled:
            ops.scale_(ins, outs, scalar(0.37), flag)
        else:
            ops.cast_copy_(ins, outs)
            flag = torch.tensor([float(any(not torch.isfinite(o).all() for o in outs))])
        guards_intact(outs)
        return [*outs, flag]

    run_everywhere(make, op)
    # The stored bits are the fp32 product cast to the output dtype (NaNs: the canonical one).
    ins, outs, flag = make()
    ops.scale_(ins, outs, scalar(0.37), flag)
    assert flag.item() == 1.0
    for i, (x, y) in enumerate(zip(ins, outs)):
        assert_bits_equal(y, canonical_cast(x.float() * torch.tensor(0.37), out_dtype), f"outputs[{i}]")


# ----------------------------------------------------------------------------------------------------
# l2norm
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_l2norm_bits_independent_of_threads_and_isa(dtype):
    """The norm's guarantee (csrc/cpu/l2norm.cpp): fixed blocks and lanes, so the same bits for any
    thread count and ISA, and within NORM_RTOL of the float64 norm."""
    torch.manual_seed(5)
    tensors = [torch.randn(n).to(dtype) for n in SIZES]

    def op(ts: list[Tensor]) -> list[Tensor]:
        flag = scalar(0.0)
        total, per_tensor = ops.l2norm(ts, flag)
        return [total, per_tensor, flag]

    run_everywhere(lambda: [at_offset(t, 3) for t in tensors], op)
    total, per_tensor, flag = op(tensors)
    assert flag.item() == 0.0
    expected = torch.stack([t.double().norm() for t in tensors])
    torch.testing.assert_close(per_tensor.double(), expected, rtol=NORM_RTOL, atol=0)
    torch.testing.assert_close(total.double(), expected.norm(), rtol=NORM_RTOL, atol=0)


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("where", [0, 4095, 4096, 100_002], ids=lambda w: f"at{w}")
def test_l2norm_flags_nonfinite_in_any_lane_and_block(where, value):
    """found_inf catches one nonfinite element wherever it falls (lane, block, tail), on any thread."""
    x = torch.randn(100_003)
    x[where] = value
    for threads, isa in RUNS:
        flag = scalar(0.0)
        with threads_and_isa(threads, isa):
            total, per_tensor = ops.l2norm([torch.randn(5), x], flag)
        assert flag.item() == 1.0 and not math.isfinite(total.item()), (threads, isa)
        assert math.isfinite(per_tensor[0].item()) and not math.isfinite(per_tensor[1].item())


# ----------------------------------------------------------------------------------------------------
# Conversions (Note [16-bit conversions])
# ----------------------------------------------------------------------------------------------------

CANONICAL_NAN = {BF16: 0x7FC0, FP16: 0x7E00}


def canonical_cast(x: Tensor, dtype: torch.dtype) -> Tensor:
    """torch's cast (round to nearest even) with every NaN replaced by the format's one NaN."""
    y = x.to(dtype)
    if dtype in CANONICAL_NAN:
        nan = torch.tensor(CANONICAL_NAN[dtype], dtype=torch.int16).view(dtype)
        y = torch.where(torch.isnan(x), nan, y)
    return y


def float_patterns() -> Tensor:
    """fp32 bit patterns: every high half with low halves around both formats' rounding points
    (ties, one below and above, all ones) and random ones; both signs, subnormals, inf and NaNs."""
    lows = [0x0000, 0x0001, 0x0FFF, 0x1000, 0x1001, 0x1FFF, 0x2000, 0x3000, 0x7FFF, 0x8000, 0x8001, 0xFFFF]
    lows += torch.randint(0, 2**16, (8,)).tolist()
    highs = torch.arange(2**16, dtype=torch.int64)
    pattern = (highs[:, None] << 16) | torch.tensor(lows, dtype=torch.int64)[None, :]
    pattern = pattern.reshape(-1)
    return (pattern - (pattern >= 2**31).long() * 2**32).to(torch.int32).view(FP32)


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
def test_narrowing_rounds_to_nearest_even_with_one_nan(dtype):
    x = float_patterns()
    for threads, isa in [(2, None), *((1, isa) for isa in ISAS)]:
        out = torch.empty(x.shape, dtype=dtype)
        with threads_and_isa(threads, isa):
            ops.cast_copy_([x], [out])
        assert_bits_equal(out, canonical_cast(x, dtype), f"fp32 -> {dtype}, isa={isa or 'best'}")
    nans = bits(out)[torch.isnan(x)]
    assert nans.numel() > 1000 and (nans == CANONICAL_NAN[dtype]).all()


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
def test_widening_is_exact_and_keeps_nan_payloads(dtype):
    h = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    for threads, isa in [(2, None), *((1, isa) for isa in ISAS)]:
        out = torch.empty(h.shape, dtype=FP32)
        with threads_and_isa(threads, isa):
            ops.cast_copy_([h], [out])
        finite = ~torch.isnan(h)
        assert_bits_equal(out[finite], h[finite].float(), f"{dtype} -> fp32, isa={isa or 'best'}")
        # NaN: sign, exponent all ones, the payload shifted into place (the quiet bit as it was).
        shift = 16 if dtype == BF16 else 13
        raw = bits(h).to(torch.int64) & 0xFFFF
        mantissa = raw & (0x7F if dtype == BF16 else 0x3FF)
        expected = ((raw >> 15) << 31) | 0x7F800000 | (mantissa << shift)
        got = bits(out).to(torch.int64) & 0xFFFFFFFF
        assert torch.equal(got[~finite], expected[~finite]), "NaN payloads"


def test_conversion_check_catches_a_wrong_nan():
    """Negative control: torch's own fp16 cast keeps a NaN's sign, which the check above rejects."""
    x = torch.tensor([-math.nan, math.nan])
    assert bits(x.to(FP16))[0].item() != CANONICAL_NAN[FP16]
    with pytest.raises(AssertionError):
        assert_bits_equal(x.to(FP16), canonical_cast(x, FP16))
