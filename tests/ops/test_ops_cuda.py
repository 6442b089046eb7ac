"""GPU tests of the fused ops: CUDA kernels against the reference, against the CPU kernels (bit for
bit), under CUDA-graph capture and on non-default streams.

Every test here needs a GPU (``pytest -m cuda``); conftest.py skips them cleanly without one, and
nothing at module level touches CUDA, so the file imports on any machine. The helpers (random lists,
layouts, comparisons) are the CPU tests' own, from op_helpers.py.

Why CPU and CUDA results can be compared bit for bit: both compile the same per-element fp32 math
(csrc/math/adam.h), the CUDA build uses --fmad=false (no fused multiply-add contraction) with IEEE
division and square root, the eager op's coefficients are computed in double on the host for both,
and 16-bit conversions round to nearest even on both.
"""

from __future__ import annotations

import math

import pytest
import torch

from distopt import ops, reference

from op_helpers import (
    BF16,
    BIG_SIZES,
    CAPTURABLE_CASES,
    CAPTURABLE_SIZES,
    CHUNK,
    CL_SHAPES,
    EDGE_SIZES,
    FLOAT_DTYPES,
    FP16,
    FP32,
    GRAD_SCALE,
    HYPER,
    MODES,
    NORM_RTOL,
    OP_NAMES,
    OUT_DTYPES,
    AdamState,
    assert_adam_bits_equal,
    assert_adam_close,
    assert_bits_equal,
    assert_each_bits_equal,
    assert_guards_intact,
    assert_param_outs_are_casts,
    assert_params_moved,
    assert_unchanged,
    capturable_steps,
    check_adam_against_reference,
    check_capturable_against_eager_and_reference,
    check_l2norm_against_reference,
    copy_to,
    dtype_id,
    inject,
    kernel_registration,
    make_adam_state,
    randn_list,
    run_adam,
    run_adam_capturable,
    run_eager_per_step,
    run_reference_adam,
    run_reference_adam_capturable,
    scalar,
    snapshot,
)

# Every test in this module is a GPU test (the same as decorating each with @pytest.mark.cuda).
pytestmark = pytest.mark.cuda

CUDA = "cuda"
# The most chunks one launch covers (csrc/cuda/multi_tensor_apply.cuh: 320 with 4 KiB of metadata, up to
# 1465 with 32K, at depth 1), so a tensor of more chunks continues in the next launch whichever size the
# GPU's runtime allows (test_ops_launches.py checks this against the build's constants).
MAX_BLOCKS_PER_LAUNCH = 1465
HUGE = (MAX_BLOCKS_PER_LAUNCH + 1) * CHUNK + 3  # ~96M elements: spans two launches on its own
SLEEP_CYCLES = 200_000_000  # torch.cuda._sleep: ~0.1 s of GPU time, to expose a wrong stream


def to_cuda(tensors, layout="contiguous"):
    return [copy_to(t, CUDA, layout) for t in tensors]


def many_sizes(n: int, high: int = 3000) -> list[int]:
    """n varied sizes, a few of them several chunks long, so launches split on both metadata limits."""
    sizes = torch.randint(1, high, (n,)).tolist()
    for i in (7, n // 2, n - 3):
        sizes[i] = 3 * CHUNK + 11
    return sizes


def test_cuda_kernel_is_compiled():
    """The CUDA kernels come from distopt._C_cuda, not the reference fallback (else these tests would
    compare the oracle with itself)."""
    assert ops.HAS_CUDA_EXTENSION, ops._CUDA_IMPORT_ERROR
    for op in OP_NAMES:
        where = kernel_registration(op, "CUDA")
        assert "registration_cuda.cpp" in where, f"{op}: {where}"


# ----------------------------------------------------------------------------------------------------
# adam_step_ on CUDA against the reference
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("adam_w_mode,weight_decay", MODES)
@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("grad_dtype", FLOAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("param_dtype", FLOAT_DTYPES, ids=dtype_id)
def test_adam_cuda_dtype_matrix(param_dtype, grad_dtype, out_dtype, adam_w_mode, weight_decay):
    """Every params x grads x param_outs dtype combination on CUDA matches the reference (chunk-edge sizes)."""
    state = make_adam_state(EDGE_SIZES, param_dtype, grad_dtype, out_dtype, device=CUDA)
    check_adam_against_reference(
        state, step=7, grad_scale=scalar(GRAD_SCALE, CUDA), adam_w_mode=adam_w_mode, weight_decay=weight_decay
    )
    assert_param_outs_are_casts(state)


@pytest.mark.parametrize("step", [1, 7])
@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("grad_dtype", FLOAT_DTYPES, ids=dtype_id)
def test_adam_cuda_bf16_remainders(grad_dtype, out_dtype, step):
    """bf16 params + int16 remainders on CUDA track the reference's fp32 masters."""
    state = make_adam_state(EDGE_SIZES + BIG_SIZES[:1], BF16, grad_dtype, out_dtype, remainders=True, device=CUDA)
    check_adam_against_reference(state, step=step, grad_scale=scalar(GRAD_SCALE, CUDA))
    assert_param_outs_are_casts(state)


# ----------------------------------------------------------------------------------------------------
# adam_step_: CUDA kernel bit-identical to the CPU kernel
# ----------------------------------------------------------------------------------------------------


def check_cuda_matches_cpu(cpu: AdamState, layout: str = "contiguous", *, step: int = 3, **kw) -> AdamState:
    """Runs the eager op on ``cpu`` and on a CUDA copy with ``layout``; every output must match bit for bit."""
    gpu = cpu.to(CUDA, layout)
    gpu_grads = snapshot({"grads": gpu.grads})
    run_adam(cpu, step=step, grad_scale=scalar(GRAD_SCALE), **kw)
    run_adam(gpu, step=step, grad_scale=scalar(GRAD_SCALE, CUDA), **kw)
    torch.cuda.synchronize()
    assert_unchanged(gpu_grads)
    assert_adam_bits_equal(gpu, cpu)
    if layout == "unaligned":
        for lst in gpu.lists():
            assert_guards_intact(lst)
    return gpu


@pytest.mark.parametrize("adam_w_mode", [True, False], ids=["adamw", "adam_l2"])
@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("grad_dtype", FLOAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("param_dtype", FLOAT_DTYPES, ids=dtype_id)
def test_adam_cuda_bit_identical_to_cpu(param_dtype, grad_dtype, out_dtype, adam_w_mode):
    """Same inputs, same outputs, bit for bit: every dtype combination, sizes around the chunk edge."""
    cpu = make_adam_state(EDGE_SIZES, param_dtype, grad_dtype, out_dtype)
    check_cuda_matches_cpu(cpu, adam_w_mode=adam_w_mode, weight_decay=0.1)


@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("grad_dtype", FLOAT_DTYPES, ids=dtype_id)
def test_adam_cuda_remainders_bit_identical_to_cpu(grad_dtype, out_dtype):
    """bf16 + int16 remainders: CUDA and CPU kernels write the same params, remainders and states."""
    cpu = make_adam_state(EDGE_SIZES, BF16, grad_dtype, out_dtype, remainders=True)
    check_cuda_matches_cpu(cpu, step=7)


LAYOUT_CASES = [
    pytest.param(FP32, FP32, None, False, id="fp32"),
    pytest.param(FP32, FP16, BF16, False, id="fp32-fp16-bf16_out"),
    pytest.param(BF16, BF16, FP16, False, id="bf16-bf16-fp16_out"),
    pytest.param(FP16, FP32, FP32, False, id="fp16-fp32-fp32_out"),
    pytest.param(BF16, BF16, BF16, True, id="bf16_remainders-bf16-bf16_out"),
]


@pytest.mark.parametrize("layout", ["unaligned", "channels_last"])
@pytest.mark.parametrize("param_dtype,grad_dtype,out_dtype,remainders", LAYOUT_CASES)
def test_adam_cuda_layouts_bit_identical_to_cpu(param_dtype, grad_dtype, out_dtype, remainders, layout):
    """Unaligned views (the scalar path) and channels_last lists give the CPU kernel's bits, and
    unaligned views are not written outside their bounds."""
    sizes = CL_SHAPES if layout == "channels_last" else EDGE_SIZES + BIG_SIZES[:1]
    cpu = make_adam_state(sizes, param_dtype, grad_dtype, out_dtype, remainders=remainders)
    gpu = check_cuda_matches_cpu(cpu, layout)
    if layout == "channels_last":
        assert all(t.is_contiguous(memory_format=torch.channels_last) for t in gpu.all_tensors())


@pytest.mark.parametrize("param_dtype,grad_dtype,out_dtype,remainders", LAYOUT_CASES)
def test_adam_cuda_many_tensors_bit_identical_to_cpu(param_dtype, grad_dtype, out_dtype, remainders):
    """250 tensors of varied sizes: several launches with 4 KiB of metadata (at most 49 tensors each)."""
    cpu = make_adam_state(many_sizes(250), param_dtype, grad_dtype, out_dtype, remainders=remainders)
    check_cuda_matches_cpu(cpu)


def test_adam_cuda_tensor_spanning_launches_bit_identical_to_cpu():
    """A tensor of more chunks than one launch covers, starting mid-launch, continues correctly."""
    cpu = make_adam_state([3, 1000, HUGE, 5], FP32, BF16, BF16)
    check_cuda_matches_cpu(cpu)


def test_adam_cuda_large_sizes_match_reference():
    """Sizes of 2*65536+5 and ~300k elements on CUDA match the reference."""
    state = make_adam_state(BIG_SIZES, FP32, BF16, FP16, device=CUDA)
    check_adam_against_reference(state, step=2, grad_scale=scalar(GRAD_SCALE, CUDA))


def test_adam_cuda_param_out_aliasing_param():
    """param_outs aliasing the params on CUDA equals the update without param_outs."""
    state = make_adam_state(EDGE_SIZES, FP32, FP32, device=CUDA)
    aliased = state.clone()
    aliased.param_outs = list(aliased.params)
    run_adam(state, step=5)
    run_adam(aliased, step=5)
    assert_adam_bits_equal(aliased, state, ("params", "exp_avgs", "exp_avg_sqs"))


# ----------------------------------------------------------------------------------------------------
# Capturable adam on CUDA, and CUDA-graph capture and replay
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("adam_w_mode,weight_decay", MODES)
@pytest.mark.parametrize("param_dtype,grad_dtype,out_dtype,remainders", CAPTURABLE_CASES)
def test_adam_capturable_cuda_matches_eager(param_dtype, grad_dtype, out_dtype, remainders, adam_w_mode, weight_decay):
    """lr and per-tensor steps read on the device (shared and distinct step tensors) give the eager
    op's bits for each step, and match the reference.

    The capturable kernel computes the coefficients on the device (once per block), the eager op on the
    host, with the same function of IEEE basic operations only (Note [Bit-identical coefficients] in
    csrc/math/adam.h): bit-identical by construction.
    """
    state = make_adam_state(CAPTURABLE_SIZES, param_dtype, grad_dtype, out_dtype, remainders=remainders, device=CUDA)
    check_capturable_against_eager_and_reference(
        state,
        lr=scalar(3e-3, CUDA),
        steps=capturable_steps(CUDA),
        grad_scale=scalar(GRAD_SCALE, CUDA),
        adam_w_mode=adam_w_mode,
        weight_decay=weight_decay,
    )


@pytest.mark.parametrize("remainders", [False, True], ids=["fp32_master-bf16_out", "bf16_remainders"])
def test_adam_capturable_cuda_graph_replay(remainders):
    """The capturable op captured once in a CUDA graph replays with new lr values, incremented step
    tensors and new grads exactly like eager calls; a replay with found_inf = 1 writes nothing."""
    param_dtype, out_dtype = (BF16, FP16) if remainders else (FP32, BF16)
    sizes = (5, CHUNK + 1, 7, 300)
    state = make_adam_state(sizes, param_dtype, BF16, out_dtype, remainders=remainders, device=CUDA)
    initial = state.clone()
    lr = scalar(1e-3, CUDA)
    step_a, step_b = scalar(1.0, CUDA), scalar(4.0, CUDA)
    steps = [step_a, step_a, step_b, step_b]
    grad_scale, found_inf = scalar(GRAD_SCALE, CUDA), scalar(0.0, CUDA)

    def step_fn():
        run_adam_capturable(state, lr=lr, steps=steps, grad_scale=grad_scale, found_inf=found_inf)

    # Warm up on a side stream before capturing, as the torch.cuda.graphs docs require.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step_fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step_fn()
    # Undo the warm-up's updates in place (the graph holds these tensors' addresses).
    for dst, src in zip(state.all_tensors(), initial.all_tensors()):
        dst.copy_(src)

    eager = initial.clone()
    for new_lr in (1e-3, 5e-3, 2e-2):
        lr.fill_(new_lr)
        step_a.add_(1)
        step_b.add_(1)
        for g_graph, g_eager in zip(state.grads, eager.grads):
            g_eager.copy_(torch.randn(g_eager.shape, device=CUDA))
            g_graph.copy_(g_eager)
        expected = state.clone()
        graph.replay()
        run_eager_per_step(eager, lr=lr, steps=steps, grad_scale=grad_scale)
        run_reference_adam_capturable(expected, lr=lr, steps=steps, grad_scale=grad_scale)
        torch.cuda.synchronize()
        assert_adam_bits_equal(state, eager)
        assert_adam_close(state, expected)
    assert_params_moved(initial, state)

    found_inf.fill_(1.0)
    snap = snapshot(state)
    graph.replay()
    torch.cuda.synchronize()
    assert_unchanged(snap)


# ----------------------------------------------------------------------------------------------------
# found_inf on CUDA: skipped updates write nothing
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["eager", "capturable"])
@pytest.mark.parametrize("poison", [None, math.inf, math.nan], ids=["finite", "inf", "nan"])
@pytest.mark.parametrize("remainders", [False, True], ids=["fp32-bf16_out", "bf16_remainders-fp16_out"])
def test_adam_cuda_skip_writes_nothing(remainders, poison, variant):
    """found_inf = 1 on the device leaves every output bit-identical, also with inf/nan grads."""
    param_dtype, out_dtype = (BF16, FP16) if remainders else (FP32, BF16)
    state = make_adam_state(EDGE_SIZES, param_dtype, FP16, out_dtype, remainders=remainders, device=CUDA)
    if poison is not None:
        for g in state.grads[3:]:
            inject(g, poison)
    snap = snapshot(state)
    found_inf = scalar(1.0, CUDA)
    if variant == "eager":
        run_adam(state, step=2, grad_scale=scalar(GRAD_SCALE, CUDA), found_inf=found_inf)
    else:
        steps = capturable_steps(CUDA)[:1] * len(state.params)
        run_adam_capturable(state, lr=scalar(1e-2, CUDA), steps=steps, found_inf=found_inf)
    torch.cuda.synchronize()
    assert_unchanged(snap)


@pytest.mark.parametrize("poison", [None, math.inf, math.nan], ids=["finite", "inf", "nan"])
def test_cast_copy_cuda_skip_writes_nothing(poison):
    """cast_copy_ with skip_if = 1 on the device leaves every output bit-identical."""
    inputs = randn_list(EDGE_SIZES, FP32, CUDA)
    if poison is not None:
        inject(inputs[5], poison)
    outputs = randn_list(EDGE_SIZES, BF16, CUDA)
    snap = snapshot(inputs, outputs)
    ops.cast_copy_(inputs, outputs, skip_if=scalar(1.0, CUDA))
    torch.cuda.synchronize()
    assert_unchanged(snap)


# ----------------------------------------------------------------------------------------------------
# l2norm on CUDA
# ----------------------------------------------------------------------------------------------------

L2NORM_SIZE_CASES = {
    "edge_and_big": lambda: list(EDGE_SIZES + BIG_SIZES),
    "250_tensors": lambda: many_sizes(250),  # a 4 KiB launch holds at most 123 tensors of one list
    "450_tensors": lambda: many_sizes(450, high=500),  # more than one per-tensor reduction launch (399)
    "spanning_launches": lambda: [3, 1000, HUGE, 5],
}


@pytest.mark.parametrize("sizes", list(L2NORM_SIZE_CASES))
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_l2norm_cuda_matches_cpu_and_reference(dtype, sizes):
    """Per-tensor and total norms on CUDA within rtol 1e-5 of the CPU kernel and of the reference."""
    cpu = randn_list(L2NORM_SIZE_CASES[sizes](), dtype)
    gpu = to_cuda(cpu)
    total, per_tensor = check_l2norm_against_reference(gpu)
    cpu_total, cpu_per = ops.l2norm(cpu)
    torch.testing.assert_close(per_tensor.cpu(), cpu_per, rtol=NORM_RTOL, atol=0)
    torch.testing.assert_close(total.cpu(), cpu_total, rtol=NORM_RTOL, atol=0)


def test_l2norm_cuda_unaligned_and_deterministic():
    """Unaligned views give the right norms, and two runs give the same bits (no atomics)."""
    gpu = to_cuda(randn_list(EDGE_SIZES + BIG_SIZES, BF16), layout="unaligned")
    first = check_l2norm_against_reference(gpu)
    second = ops.l2norm(gpu)
    for a, b in zip(first, second):
        assert_bits_equal(a, b, "l2norm rerun")


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_l2norm_cuda_sets_found_inf(dtype, value):
    """A nonfinite element at a random place raises the device flag; finite input leaves it as it was."""
    tensors = randn_list(EDGE_SIZES + BIG_SIZES[:1], dtype, CUDA)
    found_inf = scalar(0.0, CUDA)
    ops.l2norm(tensors, found_inf)
    assert found_inf.item() == 0.0
    found_inf.fill_(1.0)
    ops.l2norm(tensors, found_inf)
    assert found_inf.item() == 1.0

    victim = int(torch.randint(len(tensors), ()).item())
    inject(tensors[victim], value)
    found_inf.zero_()
    total, per_tensor = ops.l2norm(tensors, found_inf)
    assert found_inf.item() == 1.0
    assert not math.isfinite(per_tensor[victim].item()) and not math.isfinite(total.item())


# ----------------------------------------------------------------------------------------------------
# scale_ and cast_copy_ on CUDA: bit for bit
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["contiguous", "unaligned"])
@pytest.mark.parametrize("out_dtype", FLOAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("in_dtype", FLOAT_DTYPES, ids=dtype_id)
def test_scale_and_cast_copy_cuda_bitwise(in_dtype, out_dtype, layout):
    """scale_ and cast_copy_ on CUDA equal the reference and the CPU kernels bit for bit."""
    cpu_in = randn_list(EDGE_SIZES + BIG_SIZES, in_dtype, std=5.0)
    gpu_in = to_cuda(cpu_in, layout)
    scale_cpu, scale_gpu = scalar(GRAD_SCALE), scalar(GRAD_SCALE, CUDA)
    flag = scalar(0.0, CUDA)

    cpu_out = randn_list(EDGE_SIZES + BIG_SIZES, out_dtype)
    gpu_out = to_cuda(cpu_out, layout)
    ref_out = [t.clone() for t in gpu_out]
    ops.scale_(cpu_in, cpu_out, scale_cpu)
    ops.scale_(gpu_in, gpu_out, scale_gpu, flag)
    reference.scale_(gpu_in, ref_out, scale_gpu, None)
    for i, (g, c, r) in enumerate(zip(gpu_out, cpu_out, ref_out)):
        assert_bits_equal(g, c, f"scale_ outputs[{i}] vs CPU kernel")
        assert_bits_equal(g, r, f"scale_ outputs[{i}] vs reference")
    assert flag.item() == 0.0

    copied = to_cuda(randn_list(EDGE_SIZES + BIG_SIZES, out_dtype), layout)
    ops.cast_copy_(gpu_in, copied, skip_if=scalar(0.0, CUDA))
    for i, (c, x) in enumerate(zip(copied, cpu_in)):
        assert_bits_equal(c, x.to(out_dtype), f"cast_copy_ outputs[{i}]")
    if layout == "unaligned":
        for lst in (gpu_in, gpu_out, copied):
            assert_guards_intact(lst)


def test_scale_cuda_in_place_and_many_tensors():
    """In-place scaling of 250 tensors (several launches) equals the CPU kernel bit for bit."""
    cpu = randn_list(many_sizes(250), FP16)
    gpu = to_cuda(cpu)
    ops.scale_(cpu, cpu, scalar(GRAD_SCALE))
    ops.scale_(gpu, gpu, scalar(GRAD_SCALE, CUDA))
    assert_each_bits_equal(gpu, cpu, "")


@pytest.mark.parametrize(
    "in_dtype,out_dtype,value,scale,flagged",
    [
        pytest.param(FP32, FP16, 1e5, 1.0, True, id="fp32->fp16_cast_overflow"),
        pytest.param(FP32, BF16, 1e5, 1.0, False, id="fp32->bf16_no_overflow"),
        pytest.param(FP16, FP16, 60000.0, 2.0, True, id="fp16_product_overflow"),
        pytest.param(BF16, FP32, math.inf, 0.5, True, id="bf16_inf_input"),
        pytest.param(FP16, BF16, math.nan, 1.0, True, id="fp16_nan_input"),
    ],
)
def test_scale_cuda_sets_found_inf(in_dtype, out_dtype, value, scale, flagged):
    """The device flag is raised when a stored output is nonfinite, including a cast overflow."""
    inputs = randn_list(EDGE_SIZES + BIG_SIZES[:1], in_dtype, CUDA)
    inject(inputs[int(torch.randint(len(inputs), ()).item())], value)
    outputs = randn_list(EDGE_SIZES + BIG_SIZES[:1], out_dtype, CUDA)
    found_inf = scalar(0.0, CUDA)
    ops.scale_(inputs, outputs, scalar(scale, CUDA), found_inf)
    assert found_inf.item() == float(flagged)
    for i, (x, y) in enumerate(zip(inputs, outputs)):
        expected = (x.float() * torch.tensor(scale, dtype=FP32, device=CUDA)).to(out_dtype)
        torch.testing.assert_close(y, expected, rtol=0, atol=0, equal_nan=True, msg=lambda m, i=i: f"[{i}]: {m}")


# ----------------------------------------------------------------------------------------------------
# Streams: every op runs on the current stream
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("op", [*OP_NAMES, "adam_step_-device_lr_steps"])
def test_ops_run_on_current_stream(op):
    """An op called under ``torch.cuda.stream(s)`` is ordered after the work queued before it on s:
    the input rewritten on s behind a long GPU sleep is the one it reads, and its results are complete
    once s is synchronised. (Launched on another stream it would read the old input.)"""
    sizes = (CHUNK - 1, CHUNK + 1, 7)
    state = make_adam_state(sizes, FP32, FP32, BF16, device=CUDA)
    new_grads = randn_list(sizes, FP32, CUDA, std=2.0)
    if op in ("l2norm", "scale_"):
        inject(new_grads[1], math.inf)  # only the new input is nonfinite: the flag tells which one was read
    expected = state.clone()
    expected.grads = [g.clone() for g in new_grads]
    outputs = randn_list(sizes, BF16, CUDA)
    found_inf = scalar(0.0, CUDA)
    lr, steps = scalar(HYPER["lr"], CUDA), [scalar(3.0, CUDA)] * len(sizes)
    torch.cuda.synchronize()

    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        torch.cuda._sleep(SLEEP_CYCLES)
        for g, new in zip(state.grads, new_grads):
            g.copy_(new)  # queued on s behind the sleep
        if op == "adam_step_":
            run_adam(state, step=3)
        elif op == "adam_step_-device_lr_steps":
            run_adam_capturable(state, lr=lr, steps=steps)
        elif op == "l2norm":
            total, per_tensor = ops.l2norm(state.grads, found_inf)
        elif op == "scale_":
            ops.scale_(state.grads, outputs, scalar(GRAD_SCALE, CUDA), found_inf)
        else:
            ops.cast_copy_(state.grads, outputs)
    s.synchronize()

    if op.startswith("adam"):
        run_reference_adam(expected, step=3)
        assert_adam_close(state, expected)
    elif op == "l2norm":
        assert found_inf.item() == 1.0
        assert not math.isfinite(per_tensor[1].item()) and not math.isfinite(total.item())
        _, ref_per = reference.l2norm([new_grads[0], new_grads[2]], None)
        torch.testing.assert_close(per_tensor[[0, 2]].cpu(), ref_per.cpu(), rtol=NORM_RTOL, atol=0)
    elif op == "scale_":
        assert found_inf.item() == 1.0
        assert_each_bits_equal(
            outputs, [(x * torch.tensor(GRAD_SCALE, device=CUDA)).to(BF16) for x in new_grads], "outputs"
        )
    else:
        assert_each_bits_equal(outputs, [x.to(BF16) for x in new_grads], "outputs")
