"""Tests of the fused Adam op (``ops.adam_step_``, lr and step as numbers or device tensors) against the
pure-PyTorch oracle (``distopt.reference``): every dtype combination (descending and with ``maximize``),
bf16 + int16 remainders, chunk-edge and multi-chunk sizes, unaligned and channels_last layouts, the
capturable op, and found_inf skips.

Every test runs on each backend of tests/ops/backends.py: the CPU kernels, the CUDA kernels under the SIMT
emulator (no GPU needed; each call also compared bit for bit with the CPU kernel) and, with a GPU, the
CUDA kernels. tests/ops/test_ops_cuda.py adds what only a GPU shows (graphs, streams). Helpers and
conventions: op_helpers.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from distopt import reference

from op_helpers import (
    BF16,
    BIG_SIZES,
    CAPTURABLE_CASES,
    CAPTURABLE_SIZES,
    CL_SHAPES,
    EDGE_SIZES,
    FLOAT_DTYPES,
    FP16,
    FP32,
    GRAD_SCALE,
    HYPER,
    INT16,
    MAXIMIZE,
    MODES,
    OUT_DTYPES,
    assert_adam_bits_equal,
    assert_adam_close,
    assert_bits_equal,
    assert_guards_intact,
    assert_param_outs_are_casts,
    assert_unchanged,
    capturable_steps,
    check_adam_against_reference,
    check_capturable_against_eager_and_reference,
    dtype_id,
    inject,
    make_adam_state,
    run_adam,
    run_adam_capturable,
    run_reference_adam,
    scalar,
    snapshot,
)

# Every test runs on each backend (tests/ops/backends.py): the CPU kernels, the CUDA kernels under the SIMT
# emulator (cross-checked bit for bit against the CPU kernels) and, with a GPU, the CUDA kernels.
pytestmark = pytest.mark.usefixtures("one_intra_op_thread", "backend")


# ----------------------------------------------------------------------------------------------------
# adam_step_ against the reference
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("maximize", MAXIMIZE)
@pytest.mark.parametrize("step", [1, 7])
@pytest.mark.parametrize("use_grad_scale", [False, True], ids=["no_scale", "grad_scale"])
@pytest.mark.parametrize("adam_w_mode,weight_decay", MODES)
@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("grad_dtype", FLOAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("param_dtype", FLOAT_DTYPES, ids=dtype_id)
def test_adam_dtype_matrix(
    param_dtype, grad_dtype, out_dtype, adam_w_mode, weight_decay, use_grad_scale, step, maximize
):
    """Every params x grads x param_outs dtype combination matches the reference on chunk-edge sizes,
    descending and (maximize) ascending."""
    state = make_adam_state(EDGE_SIZES, param_dtype, grad_dtype, out_dtype)
    grad_scale = scalar(GRAD_SCALE) if use_grad_scale else None
    check_adam_against_reference(
        state, step=step, grad_scale=grad_scale, adam_w_mode=adam_w_mode, weight_decay=weight_decay, maximize=maximize
    )
    assert_param_outs_are_casts(state)


@pytest.mark.parametrize("maximize", MAXIMIZE)
@pytest.mark.parametrize("step", [1, 7])
@pytest.mark.parametrize("adam_w_mode,weight_decay", MODES)
@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("grad_dtype", FLOAT_DTYPES, ids=dtype_id)
def test_adam_bf16_remainders_matrix(grad_dtype, out_dtype, adam_w_mode, weight_decay, step, maximize):
    """bf16 params + int16 remainders (with and without param_outs) track the reference's fp32 masters."""
    state = make_adam_state(EDGE_SIZES, BF16, grad_dtype, out_dtype, remainders=True)
    check_adam_against_reference(
        state, step=step, grad_scale=scalar(GRAD_SCALE), adam_w_mode=adam_w_mode, weight_decay=weight_decay,
        maximize=maximize,
    )  # fmt: skip
    assert_param_outs_are_casts(state)


MAXIMIZE_CASES = [
    pytest.param(FP32, FP32, None, False, id="fp32"),
    pytest.param(FP32, BF16, FP16, False, id="fp32-bf16_grad-fp16_out"),
    pytest.param(FP16, FP32, BF16, False, id="fp16-fp32_grad-bf16_out"),
    pytest.param(BF16, FP16, FP32, True, id="bf16_remainders-fp16_grad-fp32_out"),
]


@pytest.mark.parametrize("variant", ["eager", "capturable"])
@pytest.mark.parametrize("adam_w_mode,weight_decay", MODES)
@pytest.mark.parametrize("param_dtype,grad_dtype,out_dtype,remainders", MAXIMIZE_CASES)
def test_adam_maximize_is_the_update_of_the_negated_gradient(
    param_dtype, grad_dtype, out_dtype, remainders, adam_w_mode, weight_decay, variant
):
    """maximize=True writes exactly (bit for bit) what maximize=False writes for the negated grads:
    negation is exact in every dtype, so the kernel must negate g itself, before the L2 term, as
    torch does. The two runs also differ from each other (the flag is not ignored)."""
    state = make_adam_state(EDGE_SIZES, param_dtype, grad_dtype, out_dtype, remainders=remainders)
    negated = state.clone()
    negated.grads = [-g for g in state.grads]
    plain = state.clone()
    hyper = dict(grad_scale=scalar(GRAD_SCALE), adam_w_mode=adam_w_mode, weight_decay=weight_decay)
    for s, maximize in ((state, True), (negated, False), (plain, False)):
        if variant == "eager":
            run_adam(s, step=3, maximize=maximize, **hyper)
        else:
            run_adam_capturable(s, lr=scalar(3e-3), steps=[scalar(3.0)] * len(s.params), maximize=maximize, **hyper)
    assert_adam_bits_equal(state, negated)
    assert not torch.equal(state.exp_avgs[-1], plain.exp_avgs[-1])
    assert not torch.equal(state.masters()[-1], plain.masters()[-1])


def test_negative_control_maximize_ignored_is_caught():
    """A kernel run with maximize=True fails against the reference run with maximize=False."""
    state = make_adam_state(EDGE_SIZES, FP32, FP32, BF16)
    expected = state.clone()
    run_reference_adam(expected, step=3, maximize=False)
    run_adam(state, step=3, maximize=True)
    with pytest.raises(AssertionError):
        assert_adam_close(state, expected)


BIG_CASES = [
    pytest.param(FP32, FP32, None, False, id="fp32"),
    pytest.param(FP32, BF16, BF16, False, id="fp32_master-bf16_grad-bf16_out"),
    pytest.param(FP16, FP16, FP32, False, id="fp16-fp16-fp32_out"),
    pytest.param(BF16, FP32, FP16, True, id="bf16_remainders-fp32_grad-fp16_out"),
]


@pytest.mark.parametrize("param_dtype,grad_dtype,out_dtype,remainders", BIG_CASES)
def test_adam_large_sizes(param_dtype, grad_dtype, out_dtype, remainders):
    """Tensors spanning several chunks (2*65536+5 and ~300k elements) match the reference."""
    state = make_adam_state(BIG_SIZES, param_dtype, grad_dtype, out_dtype, remainders=remainders)
    check_adam_against_reference(state, step=3, grad_scale=scalar(GRAD_SCALE))
    assert_param_outs_are_casts(state)


@pytest.mark.parametrize("param_dtype,grad_dtype,out_dtype,remainders", BIG_CASES)
def test_adam_consecutive_steps(param_dtype, grad_dtype, out_dtype, remainders):
    """Steps 1..4 in a row, fresh grads each step, each step matching the reference from the same state."""
    state = make_adam_state(EDGE_SIZES[:4], param_dtype, grad_dtype, out_dtype, remainders=remainders)
    for step in range(1, 5):
        for g in state.grads:
            g.copy_(torch.randn(g.shape))
        check_adam_against_reference(state, step=step, weight_decay=0.05)


def test_adam_many_tensors():
    """250 tensors of varied sizes in one call (far more than one CUDA launch's 20-tensor metadata)."""
    sizes = torch.randint(1, 3000, (250,)).tolist()
    state = make_adam_state(sizes, FP32, FP16, BF16)
    check_adam_against_reference(state, step=2, grad_scale=scalar(GRAD_SCALE))
    assert_param_outs_are_casts(state)


@pytest.mark.parametrize("variant", ["eager", "capturable"])
def test_adam_accepts_zero_element_tensors(variant):
    """A zero-element param among others is a no-op for that entry while the others update normally
    (torch.optim.AdamW accepts empty params, so a drop-in FusedAdam meets them)."""
    state = make_adam_state([5, 0, 3], FP32, FP32, BF16)
    if variant == "eager":
        check_adam_against_reference(state, step=1)
        return
    expected = state.clone()
    lr = scalar(HYPER["lr"])
    run_reference_adam(expected, step=2, lr=lr.item())
    run_adam_capturable(state, lr=lr, steps=[scalar(2.0)] * 3)
    assert_adam_close(state, expected)


@pytest.mark.parametrize(
    "param_dtype,grad_dtype,out_dtype,remainders",
    [
        pytest.param(FP32, FP32, BF16, False, id="fp32-fp32-bf16_out"),
        pytest.param(BF16, BF16, FP16, False, id="bf16-bf16-fp16_out"),
        pytest.param(FP16, FP32, None, False, id="fp16-fp32"),
        pytest.param(BF16, BF16, BF16, True, id="bf16_remainders-bf16-bf16_out"),
    ],
)
def test_adam_unaligned_views(param_dtype, grad_dtype, out_dtype, remainders):
    """Every list a view at offset 1 of a larger buffer (not 16-byte aligned): correct, no stray writes."""
    state = make_adam_state(EDGE_SIZES, param_dtype, grad_dtype, out_dtype, remainders=remainders, layout="unaligned")
    check_adam_against_reference(state, step=4, grad_scale=scalar(GRAD_SCALE))
    assert_param_outs_are_casts(state)
    for lst in state.lists():
        assert_guards_intact(lst)


@pytest.mark.parametrize("remainders", [False, True], ids=["fp32", "bf16_remainders"])
def test_adam_channels_last(remainders):
    """channels_last lists (all sharing strides) match the reference and the same update on contiguous copies."""
    param_dtype = BF16 if remainders else FP32
    state = make_adam_state(CL_SHAPES, param_dtype, FP16, BF16, remainders=remainders, layout="channels_last")
    contiguous = state.to(state.params[0].device, "contiguous")  # the same backend, another layout
    check_adam_against_reference(state, step=2, grad_scale=scalar(GRAD_SCALE))
    run_adam(contiguous, step=2, grad_scale=scalar(GRAD_SCALE))
    for t in state.all_tensors():
        assert t.is_contiguous(memory_format=torch.channels_last)
    assert_adam_bits_equal(state, contiguous)  # elementwise: layout must not change any value


def test_adam_found_inf_zero_is_a_normal_step():
    """found_inf present but 0 gives exactly the update without a flag."""
    state = make_adam_state(EDGE_SIZES, FP32, BF16, FP16)
    flagged = state.clone()
    run_adam(state, step=3)
    run_adam(flagged, step=3, found_inf=scalar(0.0))
    assert_adam_bits_equal(flagged, state)


@pytest.mark.parametrize("param_dtype", [FP32, BF16], ids=dtype_id)
def test_adam_param_out_aliasing_param(param_dtype):
    """param_outs[i] being params[i] itself is accepted and equals the update without param_outs."""
    state = make_adam_state(EDGE_SIZES, param_dtype, FP32)
    aliased = state.clone()
    aliased.param_outs = list(aliased.params)
    check_adam_against_reference(state, step=5)
    run_adam(aliased, step=5)
    assert all(out is p for out, p in zip(aliased.param_outs, aliased.params))
    assert_adam_bits_equal(aliased, state, ("params", "exp_avgs", "exp_avg_sqs"))


def test_negative_control_wrong_beta2_is_caught():
    """The comparison machinery is not vacuous: a kernel run with beta2=0.99 fails against beta2=0.999."""
    state = make_adam_state(EDGE_SIZES, FP32, FP32, BF16)
    expected = state.clone()
    run_reference_adam(expected, step=3, beta2=0.999)
    run_adam(state, step=3, beta2=0.99)
    with pytest.raises(AssertionError):
        assert_adam_close(state, expected)


# ----------------------------------------------------------------------------------------------------
# bf16 + int16 remainders
# ----------------------------------------------------------------------------------------------------


def interesting_fp32(n: int) -> Tensor:
    """Random fp32 values of both signs from denormal to huge magnitude, every special value, and
    random bit patterns (NaN payloads included)."""
    exponents = torch.randint(-45, 39, (n,)).double()
    scaled = (torch.randn(n, dtype=torch.float64) * 10.0**exponents).float()
    specials = torch.tensor(
        [0.0, -0.0, 1e-45, -1e-45, 1e-40, -3e-39, torch.finfo(FP32).tiny, torch.finfo(FP32).max,
         -torch.finfo(FP32).max, math.inf, -math.inf, math.nan, 1.0, -1.0, 65504.0],
        dtype=FP32,
    )  # fmt: skip
    random_bits = torch.randint(-(2**31), 2**31, (n,), dtype=torch.int64).to(torch.int32).view(FP32)
    # Low half exactly 0x8000: the rounding ties of the split.
    tie_bits = ((torch.randint(0, 2**16, (n,), dtype=torch.int64) << 16) | 0x8000).to(torch.int32).view(FP32)
    return torch.cat([scaled, specials, random_bits, tie_bits])


def test_split_join_bf16_remainder_round_trip():
    """reference.split/join_bf16_remainder reconstruct every fp32 bit pattern exactly."""
    x = interesting_fp32(50_000)
    hi, lo = reference.split_bf16_remainder(x)
    assert hi.dtype == BF16 and lo.dtype == INT16
    assert_bits_equal(reference.join_bf16_remainder(hi, lo), x, "join(split(x))")


def test_split_bf16_high_half_is_rounded_to_nearest():
    """The bf16 high half is x rounded to nearest (ties away from zero), so it is a usable model param."""
    x = interesting_fp32(50_000)
    hi, lo = reference.split_bf16_remainder(x)
    rne = x.to(BF16)
    finite = torch.isfinite(x) & torch.isfinite(rne)
    tie = lo == -(2**15)
    assert tie.sum() > 1000 and (finite & ~tie).sum() > 10_000
    assert_bits_equal(hi[finite & ~tie], rne[finite & ~tie], "non-tie high halves vs torch's bf16 cast")
    at_tie = finite & tie & (hi.float().abs() < math.inf)
    assert (hi[at_tie].float().abs() > x[at_tie].abs()).all(), "ties round away from zero"


@pytest.mark.parametrize("step", [1, 7])
@pytest.mark.parametrize("adam_w_mode,weight_decay", MODES)
@pytest.mark.parametrize("out_dtype", (None, FP32, BF16), ids=dtype_id)
@pytest.mark.parametrize("grad_dtype", FLOAT_DTYPES, ids=dtype_id)
def test_adam_remainders_bit_identical_to_fp32_params(grad_dtype, out_dtype, adam_w_mode, weight_decay, step):
    """The kernel with bf16 params + int16 remainders is bit-identical to the kernel on fp32 params.

    The kernel joins the exact fp32 master, runs the same fp32 math and splits the exact fp32 result,
    so keeping the master as bf16 + int16 changes nothing: not merely close, but the same bits.
    """
    split = make_adam_state(EDGE_SIZES, BF16, grad_dtype, out_dtype, remainders=True)
    fp32 = split.clone()
    fp32.params, fp32.param_remainders = split.masters(), []
    hyper = dict(step=step, grad_scale=scalar(GRAD_SCALE), adam_w_mode=adam_w_mode, weight_decay=weight_decay)
    run_adam(split, **hyper)
    run_adam(fp32, **hyper)
    for i, (joined, master) in enumerate(zip(split.masters(), fp32.params)):
        assert_bits_equal(joined, master, f"joined master[{i}] vs fp32-param kernel")
        hi, lo = reference.split_bf16_remainder(master)
        assert_bits_equal(split.params[i], hi, f"params[{i}] vs reference split")
        assert_bits_equal(split.param_remainders[i], lo, f"param_remainders[{i}] vs reference split")
    assert_adam_bits_equal(split, fp32, ("exp_avgs", "exp_avg_sqs", "param_outs"))


# ----------------------------------------------------------------------------------------------------
# adam_step_ with lr and steps as device tensors (capturable)
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("maximize", MAXIMIZE)
@pytest.mark.parametrize("adam_w_mode,weight_decay", MODES)
@pytest.mark.parametrize("param_dtype,grad_dtype,out_dtype,remainders", CAPTURABLE_CASES)
def test_adam_capturable_matches_eager_and_reference(
    param_dtype, grad_dtype, out_dtype, remainders, adam_w_mode, weight_decay, maximize
):
    """lr and per-tensor steps (shared and distinct step tensors) read from tensors give exactly the
    eager op's result for each step (both compute the coefficients in double on the host), and match
    the reference."""
    state = make_adam_state(CAPTURABLE_SIZES, param_dtype, grad_dtype, out_dtype, remainders=remainders)
    lr = scalar(3e-3)  # 3e-3 is not exact in fp32: the eager op must be given the fp32 value
    check_capturable_against_eager_and_reference(
        state,
        lr=lr,
        steps=capturable_steps(),
        grad_scale=scalar(GRAD_SCALE),
        adam_w_mode=adam_w_mode,
        weight_decay=weight_decay,
        maximize=maximize,
    )


def test_adam_capturable_steps_matter():
    """Entries with different step tensors really get different bias corrections (not one shared step)."""
    state = make_adam_state([1000, 1000], FP32, FP32)
    state.params[1].copy_(state.params[0])
    state.grads[1].copy_(state.grads[0])
    state.exp_avgs[1].copy_(state.exp_avgs[0])
    state.exp_avg_sqs[1].copy_(state.exp_avg_sqs[0])
    run_adam_capturable(state, lr=scalar(1e-2), steps=[scalar(1.0), scalar(9.0)])
    assert torch.equal(state.exp_avgs[0], state.exp_avgs[1])
    assert not torch.equal(state.params[0], state.params[1])


# ----------------------------------------------------------------------------------------------------
# found_inf: a nonzero flag makes adam / capturable adam / cast_copy write nothing
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["eager", "capturable"])
@pytest.mark.parametrize("poison", [None, math.inf, -math.inf, math.nan], ids=["finite", "inf", "-inf", "nan"])
@pytest.mark.parametrize(
    "param_dtype,grad_dtype,out_dtype,remainders",
    [
        pytest.param(FP32, FP16, BF16, False, id="fp32-fp16-bf16_out"),
        pytest.param(BF16, BF16, FP32, True, id="bf16_remainders-bf16-fp32_out"),
        pytest.param(FP16, FP32, FP16, False, id="fp16-fp32-fp16_out"),
    ],
)
def test_adam_skip_writes_nothing(param_dtype, grad_dtype, out_dtype, remainders, poison, variant):
    """found_inf = 1 leaves params, exp_avgs, exp_avg_sqs, param_outs and remainders bit-identical,
    also when the grads themselves hold inf/nan."""
    state = make_adam_state(EDGE_SIZES, param_dtype, grad_dtype, out_dtype, remainders=remainders)
    if poison is not None:
        for g in state.grads[3:]:
            inject(g, poison)
    snap = snapshot(state)
    found_inf = scalar(1.0)
    if variant == "eager":
        run_adam(state, step=3, grad_scale=scalar(GRAD_SCALE), found_inf=found_inf)
    else:
        steps = [scalar(3.0)] * len(state.params)
        run_adam_capturable(state, lr=scalar(1e-2), steps=steps, grad_scale=scalar(GRAD_SCALE), found_inf=found_inf)
    assert_unchanged(snap)
    assert found_inf.item() == 1.0
