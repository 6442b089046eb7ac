"""CPU tests of the fused ops (``distopt.ops``) against the pure-PyTorch oracle (``distopt.reference``).

The CPU kernels share the per-element math header with the CUDA kernels (csrc/math/adam.h), so these
tests check that math on every dtype combination; tests/test_ops_cuda.py reuses the helpers below to
run the same scenarios on a GPU. Conventions:

* inputs are random and never zero (exp_avg_sq is positive); the autouse fixture in conftest.py seeds
  torch, so every run sees the same data;
* the Adam update and the norms are compared with the per-dtype ``tolerances.KERNEL`` table (fp32
  math against the float64 reference); ``scale_`` and ``cast_copy_`` must match bit for bit;
* "bit-identical" means equal bit patterns (``assert_bits_equal`` compares integer views, so it also
  tells -0.0 from 0.0 and NaN payloads apart).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import pytest
import torch
from torch import Tensor

from distopt import ops, reference

import tolerances
from tolerances import KERNEL

FP32, FP16, BF16, INT16 = torch.float32, torch.float16, torch.bfloat16, torch.int16
FLOAT_DTYPES = (FP32, FP16, BF16)
OUT_DTYPES = (None, FP32, FP16, BF16)  # None: no param_outs list

CHUNK = 65536  # elements per CUDA block (kChunkSize in csrc/cuda/multi_tensor_apply.cuh)
# One list holding every size around a chunk edge: one call covers them all.
EDGE_SIZES = (1, 3, 7, CHUNK - 1, CHUNK, CHUNK + 1)
BIG_SIZES = (2 * CHUNK + 5, 300_007)

HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, adam_w_mode=True)
# (adam_w_mode, weight_decay): AdamW with decoupled decay and Adam with L2 decay folded into the grad.
MODES = [pytest.param(True, 0.1, id="adamw"), pytest.param(False, 0.1, id="adam_l2")]
GRAD_SCALE = 0.37  # not a power of two: the fp32 product grad * scale rounds
NORM_RTOL = 1e-5  # l2norm (fp32 squares, wider sums) against the float64 reference

GUARD = 77  # value of the elements just outside an "unaligned" view; exact in every dtype used


@pytest.fixture(autouse=True, scope="module")
def _one_intra_op_thread():
    """The CPU kernels are single-threaded loops and the reference ops here are small: intra-op threads
    buy nothing, and their spin-waits make the suite many times slower on a busy 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def dtype_id(dtype: torch.dtype | None) -> str:
    return "none" if dtype is None else str(dtype).removeprefix("torch.")


# ----------------------------------------------------------------------------------------------------
# Tensor factories
# ----------------------------------------------------------------------------------------------------


def new_tensor(shape: Sequence[int], dtype: torch.dtype, device="cpu", layout: str = "contiguous") -> Tensor:
    """An uninitialised tensor of ``shape`` with the given memory layout.

    "contiguous": plain. "unaligned": a view at element offset 1 of a buffer two elements longer, so its
    data pointer is not 16-byte aligned; the elements on either side hold ``GUARD`` (see
    ``assert_guards_intact``). "channels_last": a 4-D tensor, dense but not contiguous.
    """
    shape = tuple(shape)
    if layout == "contiguous":
        return torch.empty(shape, dtype=dtype, device=device)
    if layout == "unaligned":
        n = math.prod(shape)
        buf = torch.full((n + 2,), GUARD, dtype=dtype, device=device)
        t = buf[1 : 1 + n].view(shape)
        assert t.data_ptr() % 16 != 0
        return t
    if layout == "channels_last":
        t = torch.empty(shape, dtype=dtype, device=device, memory_format=torch.channels_last)
        assert not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last)
        return t
    raise ValueError(layout)


def assert_guards_intact(tensors: Sequence[Tensor]) -> None:
    """The elements just before and after each "unaligned" view still hold GUARD (no out-of-bounds write)."""
    for i, t in enumerate(tensors):
        base = t._base
        if base is None:
            continue
        guards = torch.stack([base[0], base[-1]])
        assert torch.equal(guards, torch.full_like(guards, GUARD)), f"[{i}]: write outside the view"


def as_shape(size: int | Sequence[int]) -> tuple[int, ...]:
    return (size,) if isinstance(size, int) else tuple(size)


def filled(values: Tensor, dtype: torch.dtype, device="cpu", layout="contiguous") -> Tensor:
    """A ``new_tensor`` holding ``values`` (generated on the CPU, so every device sees the same data)."""
    return new_tensor(values.shape, dtype, device, layout).copy_(values)


def randn(size, dtype=FP32, device="cpu", layout="contiguous", std=1.0) -> Tensor:
    return filled(torch.randn(as_shape(size)) * std, dtype, device, layout)


def rand_positive(size, dtype=FP32, device="cpu", layout="contiguous", high=0.01) -> Tensor:
    """Uniform in (0, high]: a valid, nonzero exp_avg_sq."""
    return filled(torch.rand(as_shape(size)) * high + 1e-6, dtype, device, layout)


def randn_list(sizes, dtype=FP32, device="cpu", layout="contiguous", std=1.0) -> list[Tensor]:
    return [randn(s, dtype, device, layout, std) for s in sizes]


def copy_to(t: Tensor, device="cpu", layout="contiguous") -> Tensor:
    """A copy of ``t`` on ``device`` with the given layout (same values and dtype)."""
    return new_tensor(t.shape, t.dtype, device, layout).copy_(t)


def inject(t: Tensor, value: float) -> int:
    """Writes ``value`` at a random index of the contiguous tensor ``t``; returns the index."""
    assert t.is_contiguous()
    idx = int(torch.randint(t.numel(), ()).item())
    t.view(-1)[idx] = value
    return idx


def bits(t: Tensor) -> Tensor:
    return t.view({8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()])


def assert_bits_equal(actual: Tensor, expected: Tensor, what: str = "") -> None:
    """Same dtype, shape and bit pattern in every element."""
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    a, e = bits(actual), bits(expected.to(actual.device))
    if not torch.equal(a, e):
        bad = (a != e).nonzero()
        first = tuple(bad[0].tolist())
        raise AssertionError(
            f"{what}: {bad.shape[0]} of {a.numel()} elements differ bitwise, first at {first}: "
            f"{actual[first].item()!r} vs {expected[first].item()!r}"
        )


def snapshot(*objs) -> list[tuple[str, Tensor, Tensor]]:
    """(name, tensor, clone) for every tensor in ``objs``: tensors, lists, dicts or AdamStates, nested.

    Names are paths such as ``grads[3]`` (AdamState fields, dict keys) or ``#1[0]`` (positional).
    """
    out = []

    def walk(o, name):
        if isinstance(o, Tensor):
            out.append((name, o, o.clone()))
        elif isinstance(o, AdamState):
            for field in dataclasses.fields(o):
                walk(getattr(o, field.name), f"{name}{field.name}")
        elif isinstance(o, dict):
            for k, v in o.items():
                walk(v, f"{name}{k}")
        elif isinstance(o, (list, tuple)):
            for i, v in enumerate(o):
                walk(v, f"{name}[{i}]")

    for i, o in enumerate(objs):
        walk(o, "" if len(objs) == 1 else f"#{i}")
    assert out, "nothing to snapshot"
    return out


def assert_unchanged(snap: list[tuple[str, Tensor, Tensor]]) -> None:
    """Every snapshotted tensor still holds its old bits."""
    for name, t, old in snap:
        assert_bits_equal(t, old, f"{name} (must be unchanged)")


# ----------------------------------------------------------------------------------------------------
# Adam helpers
# ----------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class AdamState:
    """The tensor lists of one adam_step_ call (everything but ``grads`` is written by the op)."""

    params: list[Tensor]
    grads: list[Tensor]
    exp_avgs: list[Tensor]
    exp_avg_sqs: list[Tensor]
    param_outs: list[Tensor] = dataclasses.field(default_factory=list)
    param_remainders: list[Tensor] = dataclasses.field(default_factory=list)

    def lists(self) -> tuple[list[Tensor], ...]:
        """In schema order: params, grads, exp_avgs, exp_avg_sqs, param_outs, param_remainders."""
        return (self.params, self.grads, self.exp_avgs, self.exp_avg_sqs, self.param_outs, self.param_remainders)

    def written(self) -> dict[str, list[Tensor]]:
        """Every list the op may write."""
        return {
            "params": self.params,
            "exp_avgs": self.exp_avgs,
            "exp_avg_sqs": self.exp_avg_sqs,
            "param_outs": self.param_outs,
            "param_remainders": self.param_remainders,
        }

    def map(self, fn: Callable[[Tensor], Tensor]) -> AdamState:
        return AdamState(*[[fn(t) for t in lst] for lst in self.lists()])

    def clone(self) -> AdamState:
        """Independent copies (clone keeps the strides of dense tensors, e.g. channels_last)."""
        return self.map(torch.clone)

    def to(self, device, layout="contiguous") -> AdamState:
        return self.map(lambda t: copy_to(t, device, layout))

    def select(self, idx: Sequence[int]) -> AdamState:
        """The entries ``idx`` (the same tensor objects, so the op writes through)."""
        return AdamState(*[[lst[i] for i in idx] if lst else [] for lst in self.lists()])

    def masters(self) -> list[Tensor]:
        """The fp32 master values: params joined with their remainders, or the params themselves."""
        if self.param_remainders:
            return [reference.join_bf16_remainder(p, r) for p, r in zip(self.params, self.param_remainders)]
        return list(self.params)

    def all_tensors(self) -> list[Tensor]:
        return [t for lst in self.lists() for t in lst]


def make_adam_state(
    sizes,
    param_dtype=FP32,
    grad_dtype=FP32,
    out_dtype=None,
    *,
    remainders=False,
    device="cpu",
    layout="contiguous",
) -> AdamState:
    """Random Adam inputs: params ~ N(0,1), grads ~ N(0,1), exp_avgs ~ N(0,0.01), exp_avg_sqs in (0, 0.01].

    With ``remainders`` the params are the bf16 high halves of random fp32 masters and
    ``param_remainders`` their int16 low halves. param_outs (if ``out_dtype``) start as random values.
    """
    shapes = [as_shape(s) for s in sizes]
    if remainders:
        assert param_dtype == BF16
        halves = [reference.split_bf16_remainder(torch.randn(s)) for s in shapes]
        params = [filled(hi, BF16, device, layout) for hi, _ in halves]
        rems = [filled(lo, INT16, device, layout) for _, lo in halves]
    else:
        params = randn_list(shapes, param_dtype, device, layout)
        rems = []
    return AdamState(
        params=params,
        grads=randn_list(shapes, grad_dtype, device, layout),
        exp_avgs=randn_list(shapes, FP32, device, layout, std=0.1),
        exp_avg_sqs=[rand_positive(s, FP32, device, layout) for s in shapes],
        param_outs=randn_list(shapes, out_dtype, device, layout) if out_dtype is not None else [],
        param_remainders=rems,
    )


def scalar(value: float, device="cpu", dtype=FP32) -> Tensor:
    """A one-element tensor (the form of grad_scale, found_inf, lr and steps)."""
    return torch.tensor([value], dtype=dtype, device=device)


def run_adam(state: AdamState, *, step: int, grad_scale=None, found_inf=None, **hyper) -> None:
    """The fused eager op (``ops.adam_step_``) on ``state``, in place."""
    h = {**HYPER, **hyper}
    ops.adam_step_(
        state.params, state.grads, state.exp_avgs, state.exp_avg_sqs,
        param_outs=state.param_outs, param_remainders=state.param_remainders,
        step=step, grad_scale=grad_scale, found_inf=found_inf, **h,
    )  # fmt: skip


def run_adam_capturable(state: AdamState, *, lr: Tensor, steps, grad_scale=None, found_inf=None, **hyper) -> None:
    """The fused capturable op (``ops.adam_step_capturable_``) on ``state``, in place."""
    h = {**HYPER, **hyper}
    h.pop("lr")
    ops.adam_step_capturable_(
        state.params, state.grads, state.exp_avgs, state.exp_avg_sqs,
        param_outs=state.param_outs, param_remainders=state.param_remainders,
        lr=lr, steps=steps, grad_scale=grad_scale, found_inf=found_inf, **h,
    )  # fmt: skip


def run_reference_adam(state: AdamState, *, step, grad_scale=None, found_inf=None, **hyper) -> None:
    """``reference.adam_step_`` (float64 math) on ``state``, in place."""
    h = {**HYPER, **hyper}
    reference.adam_step_(
        *state.lists(), h["lr"], h["beta1"], h["beta2"], h["eps"], h["weight_decay"], step,
        h["adam_w_mode"], grad_scale, found_inf,
    )  # fmt: skip


def assert_adam_close(actual: AdamState, expected: AdamState) -> None:
    """Kernel results within ``KERNEL`` tolerances (per output dtype) of the reference results."""

    def close(a: Tensor, e: Tensor, what: str) -> None:
        tolerances.assert_close(a, e.to(a.device), KERNEL, msg=lambda m: f"{what}: {m}")

    for name in ("exp_avgs", "exp_avg_sqs", "param_outs"):
        for i, (a, e) in enumerate(zip(getattr(actual, name), getattr(expected, name))):
            close(a, e, f"{name}[{i}]")
    if actual.param_remainders:
        # The int16 low halves are the low bits of the fp32 master: compare the masters they form.
        for i, (a, e) in enumerate(zip(actual.masters(), expected.masters())):
            close(a, e, f"fp32 master (params + remainders)[{i}]")
    for i, (a, e) in enumerate(zip(actual.params, expected.params)):
        close(a, e, f"params[{i}]")


def assert_adam_bits_equal(actual: AdamState, expected: AdamState) -> None:
    for name, lst in actual.written().items():
        for i, (a, e) in enumerate(zip(lst, expected.written()[name])):
            assert_bits_equal(a, e, f"{name}[{i}]")


def assert_params_moved(before: AdamState, after: AdamState) -> None:
    """Sanity: the update changed the params (so a do-nothing kernel cannot pass by luck)."""
    assert any(not torch.equal(b, a) for b, a in zip(before.masters(), after.masters()))


def check_adam_against_reference(state: AdamState, *, step: int, grad_scale=None, **hyper) -> AdamState:
    """Runs the kernel on ``state`` and the reference on a clone; asserts they agree and that the
    inputs the schema declares read-only (grads, grad_scale) are untouched; returns the clone."""
    before = state.clone()
    expected = state.clone()
    read_only = snapshot({"grads": state.grads, "grad_scale": grad_scale})
    run_reference_adam(expected, step=step, grad_scale=grad_scale, **hyper)
    run_adam(state, step=step, grad_scale=grad_scale, **hyper)
    assert_unchanged(read_only)
    assert_adam_close(state, expected)
    assert_params_moved(before, state)
    return expected


def assert_param_outs_are_casts(state: AdamState) -> None:
    """Where the fp32 result is known exactly (fp32 params, or bf16 + remainders), param_outs are its cast."""
    exact_master = state.params[0].dtype == FP32 or bool(state.param_remainders)
    if not state.param_outs or not exact_master:
        return
    for i, (master, out) in enumerate(zip(state.masters(), state.param_outs)):
        assert_bits_equal(out, master.to(out.dtype), f"param_outs[{i}] vs cast of the fp32 result")


# ----------------------------------------------------------------------------------------------------
# The kernels under test are the compiled ones
# ----------------------------------------------------------------------------------------------------

OP_NAMES = ("adam_step_", "adam_step_capturable_", "l2norm", "scale_", "cast_copy_")


def kernel_registration(op: str, dispatch_key: str) -> str:
    """The dispatch-table line saying where distopt::op's kernel for ``dispatch_key`` was registered."""
    lines = torch._C._dispatch_dump(f"distopt::{op}").splitlines()
    return next((line for line in lines if line.startswith(f"{dispatch_key}:")), "")


@pytest.mark.parametrize("op", OP_NAMES)
def test_cpu_kernel_is_compiled(op):
    """The CPU kernels come from distopt._C, not the reference fallback (which would make every
    comparison here the oracle against itself)."""
    assert ops.HAS_EXTENSION, ops._IMPORT_ERROR
    where = kernel_registration(op, "CPU")
    assert "registration.cpp" in where, where


# ----------------------------------------------------------------------------------------------------
# adam_step_ against the reference
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("step", [1, 7])
@pytest.mark.parametrize("use_grad_scale", [False, True], ids=["no_scale", "grad_scale"])
@pytest.mark.parametrize("adam_w_mode,weight_decay", MODES)
@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("grad_dtype", FLOAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("param_dtype", FLOAT_DTYPES, ids=dtype_id)
def test_adam_dtype_matrix(param_dtype, grad_dtype, out_dtype, adam_w_mode, weight_decay, use_grad_scale, step):
    """Every params x grads x param_outs dtype combination matches the reference on chunk-edge sizes."""
    state = make_adam_state(EDGE_SIZES, param_dtype, grad_dtype, out_dtype)
    grad_scale = scalar(GRAD_SCALE) if use_grad_scale else None
    check_adam_against_reference(
        state, step=step, grad_scale=grad_scale, adam_w_mode=adam_w_mode, weight_decay=weight_decay
    )
    assert_param_outs_are_casts(state)


@pytest.mark.parametrize("step", [1, 7])
@pytest.mark.parametrize("adam_w_mode,weight_decay", MODES)
@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("grad_dtype", FLOAT_DTYPES, ids=dtype_id)
def test_adam_bf16_remainders_matrix(grad_dtype, out_dtype, adam_w_mode, weight_decay, step):
    """bf16 params + int16 remainders (with and without param_outs) track the reference's fp32 masters."""
    state = make_adam_state(EDGE_SIZES, BF16, grad_dtype, out_dtype, remainders=True)
    check_adam_against_reference(
        state, step=step, grad_scale=scalar(GRAD_SCALE), adam_w_mode=adam_w_mode, weight_decay=weight_decay
    )
    assert_param_outs_are_casts(state)


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


CL_SHAPES = [(2, 3, 5, 7), (4, 8, 3, 3), (1, 5, 2, 2), (2, 16, 64, 65)]


@pytest.mark.parametrize("remainders", [False, True], ids=["fp32", "bf16_remainders"])
def test_adam_channels_last(remainders):
    """channels_last lists (all sharing strides) match the reference and the same update on contiguous copies."""
    param_dtype = BF16 if remainders else FP32
    state = make_adam_state(CL_SHAPES, param_dtype, FP16, BF16, remainders=remainders, layout="channels_last")
    contiguous = state.to("cpu", "contiguous")
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
    for name in ("params", "exp_avgs", "exp_avg_sqs"):
        for i, (a, e) in enumerate(zip(getattr(aliased, name), getattr(state, name))):
            assert_bits_equal(a, e, f"{name}[{i}]")


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
    for name in ("exp_avgs", "exp_avg_sqs", "param_outs"):
        for i, (a, e) in enumerate(zip(getattr(split, name), getattr(fp32, name))):
            assert_bits_equal(a, e, f"{name}[{i}]")


# ----------------------------------------------------------------------------------------------------
# adam_step_capturable_
# ----------------------------------------------------------------------------------------------------

# Every dtype combination, as for the eager op: (param_dtype, grad_dtype, out_dtype, remainders).
CAPTURABLE_CASES = [
    pytest.param(p, g, o, False, id=f"{dtype_id(p)}-{dtype_id(g)}-{dtype_id(o)}_out")
    for p in FLOAT_DTYPES
    for g in FLOAT_DTYPES
    for o in OUT_DTYPES
] + [
    pytest.param(BF16, g, o, True, id=f"bf16_remainders-{dtype_id(g)}-{dtype_id(o)}_out")
    for g in FLOAT_DTYPES
    for o in OUT_DTYPES
]
CAPTURABLE_SIZES = (5, CHUNK + 1, 7, 1, 300, 3)


def capturable_steps(device="cpu") -> list[Tensor]:
    """Per-entry steps for CAPTURABLE_SIZES: one tensor object shared by entries 0, 1, 3, another by
    2 and 4, a third for entry 5."""
    s5, s1, s12 = scalar(5.0, device), scalar(1.0, device), scalar(12.0, device)
    return [s5, s5, s1, s5, s1, s12]


def run_eager_per_step(state: AdamState, *, lr: Tensor, steps: Sequence[Tensor], **kw) -> None:
    """The eager op called once per distinct step tensor, on the entries that share it."""
    distinct = {id(s): s for s in steps}
    for s in distinct.values():
        idx = [i for i, t in enumerate(steps) if t is s]
        run_adam(state.select(idx), lr=lr.item(), step=int(s.item()), **kw)


@pytest.mark.parametrize("adam_w_mode,weight_decay", MODES)
@pytest.mark.parametrize("param_dtype,grad_dtype,out_dtype,remainders", CAPTURABLE_CASES)
def test_adam_capturable_matches_eager_and_reference(
    param_dtype, grad_dtype, out_dtype, remainders, adam_w_mode, weight_decay
):
    """lr and per-tensor steps (shared and distinct step tensors) read from tensors give exactly the
    eager op's result for each step (both compute the coefficients in double on the host), and match
    the reference."""
    state = make_adam_state(CAPTURABLE_SIZES, param_dtype, grad_dtype, out_dtype, remainders=remainders)
    lr = scalar(3e-3)  # 3e-3 is not exact in fp32: the eager op must be given the fp32 value
    steps = capturable_steps()
    kw = dict(grad_scale=scalar(GRAD_SCALE), adam_w_mode=adam_w_mode, weight_decay=weight_decay)
    eager, expected, before = state.clone(), state.clone(), state.clone()
    inputs = snapshot({"lr": lr, "steps": steps})

    run_adam_capturable(state, lr=lr, steps=steps, **kw)
    run_eager_per_step(eager, lr=lr, steps=steps, **kw)
    reference.adam_step_capturable_(
        *expected.lists(), lr, HYPER["beta1"], HYPER["beta2"], HYPER["eps"], kw["weight_decay"], steps,
        adam_w_mode, kw["grad_scale"], None,
    )  # fmt: skip

    assert_adam_bits_equal(state, eager)
    assert_adam_close(state, expected)
    assert_params_moved(before, state)
    assert_unchanged(inputs)  # lr and steps are read, never written (the caller increments steps)


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


@pytest.mark.parametrize("poison", [None, math.inf, math.nan], ids=["finite", "inf", "nan"])
@pytest.mark.parametrize("in_dtype,out_dtype", [(FP32, BF16), (BF16, FP32), (FP16, FP16)], ids=dtype_id)
def test_cast_copy_skip_writes_nothing(in_dtype, out_dtype, poison):
    """cast_copy_ with skip_if = 1 leaves every output bit-identical."""
    inputs = randn_list(EDGE_SIZES, in_dtype)
    if poison is not None:
        inject(inputs[4], poison)
    outputs = randn_list(EDGE_SIZES, out_dtype)
    snap = snapshot(inputs, outputs)
    ops.cast_copy_(inputs, outputs, skip_if=scalar(1.0))
    assert_unchanged(snap)


# ----------------------------------------------------------------------------------------------------
# l2norm
# ----------------------------------------------------------------------------------------------------


def check_l2norm_against_reference(tensors: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
    total, per_tensor = ops.l2norm(tensors)
    ref_total, ref_per = reference.l2norm([t.cpu() for t in tensors], None)
    assert total.dtype == per_tensor.dtype == FP32
    assert total.shape == () and per_tensor.shape == (len(tensors),)
    torch.testing.assert_close(per_tensor.cpu(), ref_per, rtol=NORM_RTOL, atol=0)
    torch.testing.assert_close(total.cpu(), ref_total, rtol=NORM_RTOL, atol=0)
    return total, per_tensor


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_l2norm_matches_reference(dtype):
    """Per-tensor and total norms match the float64 reference (rtol 1e-5) on edge and large sizes."""
    check_l2norm_against_reference(randn_list(EDGE_SIZES + BIG_SIZES, dtype, std=3.0))


@pytest.mark.parametrize("layout", ["unaligned", "channels_last"])
def test_l2norm_layouts(layout):
    """Unaligned views and channels_last tensors give the norms of their values."""
    sizes = CL_SHAPES if layout == "channels_last" else EDGE_SIZES
    tensors = randn_list(sizes, BF16, layout=layout)
    check_l2norm_against_reference(tensors)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_l2norm_many_tensors(dtype):
    """250 tensors of varied sizes (more than one CUDA launch's 110-tensor metadata) and one empty one."""
    sizes = torch.randint(1, 5000, (250,)).tolist()
    sizes[17] = 0
    _, per_tensor = check_l2norm_against_reference(randn_list(sizes, dtype))
    assert per_tensor[17].item() == 0.0


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_l2norm_sets_found_inf(dtype, value):
    """A nonfinite element at a random place raises found_inf to 1; finite inputs leave the flag as it was."""
    tensors = randn_list(EDGE_SIZES, dtype)
    found_inf = scalar(0.0)
    ops.l2norm(tensors, found_inf)
    assert found_inf.item() == 0.0, "finite input must leave the flag at 0"

    found_inf = scalar(1.0)
    ops.l2norm(tensors, found_inf)
    assert found_inf.item() == 1.0, "a flag already set stays set"

    victim = int(torch.randint(len(tensors), ()).item())
    inject(tensors[victim], value)
    found_inf = scalar(0.0)
    snap = snapshot(tensors)
    total, per_tensor = ops.l2norm(tensors, found_inf)
    assert found_inf.item() == 1.0
    assert not math.isfinite(total.item()) and not math.isfinite(per_tensor[victim].item())
    assert_unchanged(snap)  # the inputs are only read


def test_l2norm_empty_list_raises():
    with pytest.raises(ValueError, match="at least one tensor"):
        ops.l2norm([])


# ----------------------------------------------------------------------------------------------------
# scale_ and cast_copy_: bit for bit against the reference
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("out_dtype", FLOAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("in_dtype", FLOAT_DTYPES, ids=dtype_id)
def test_scale_matches_reference_bitwise(in_dtype, out_dtype):
    """outputs = inputs * scale (fp32 product, cast) bit for bit; a finite result leaves found_inf at 0."""
    inputs = randn_list(EDGE_SIZES, in_dtype, std=5.0)
    outputs = randn_list(EDGE_SIZES, out_dtype)
    scale, found_inf = scalar(GRAD_SCALE), scalar(0.0)
    expected = [t.clone() for t in outputs]
    reference.scale_(inputs, expected, scale, None)
    snap = snapshot({"inputs": inputs, "scale": scale})
    ops.scale_(inputs, outputs, scale, found_inf)
    for i, (a, e) in enumerate(zip(outputs, expected)):
        assert_bits_equal(a, e, f"outputs[{i}]")
    assert found_inf.item() == 0.0
    assert_unchanged(snap)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_scale_in_place_matches_reference_bitwise(dtype):
    """outputs being the inputs themselves (in place) gives the same bits as out of place."""
    tensors = randn_list(EDGE_SIZES, dtype, std=5.0)
    originals = [t.clone() for t in tensors]
    expected = [t.clone() for t in tensors]
    reference.scale_(expected, expected, scalar(GRAD_SCALE), None)
    ops.scale_(tensors, tensors, scalar(GRAD_SCALE))
    for i, (a, e) in enumerate(zip(tensors, expected)):
        assert_bits_equal(a, e, f"tensors[{i}]")
    assert not torch.equal(tensors[4], originals[4]), "scale 0.37 must change the values"


@pytest.mark.parametrize(
    "in_dtype,out_dtype,value,scale,flagged",
    [
        pytest.param(FP32, FP16, 1e5, 1.0, True, id="fp32->fp16_cast_overflow"),
        pytest.param(FP32, BF16, 1e5, 1.0, False, id="fp32->bf16_no_overflow"),
        pytest.param(FP16, FP16, 60000.0, 2.0, True, id="fp16_product_overflow"),
        pytest.param(FP32, FP32, 1e30, 1e10, True, id="fp32_product_overflow"),
        pytest.param(BF16, FP32, math.inf, 0.5, True, id="bf16_inf_input"),
        pytest.param(FP16, BF16, math.nan, 1.0, True, id="fp16_nan_input"),
        pytest.param(FP32, FP32, -math.inf, GRAD_SCALE, True, id="fp32_-inf_input"),
    ],
)
def test_scale_sets_found_inf(in_dtype, out_dtype, value, scale, flagged):
    """found_inf is raised when a stored output is nonfinite, including an overflow of the cast."""
    inputs = randn_list(EDGE_SIZES, in_dtype)
    inject(inputs[int(torch.randint(len(inputs), ()).item())], value)
    outputs = randn_list(EDGE_SIZES, out_dtype)
    expected = [t.clone() for t in outputs]
    found_inf, expected_flag = scalar(0.0), scalar(0.0)
    ops.scale_(inputs, outputs, scalar(scale), found_inf)
    reference.scale_(inputs, expected, scalar(scale), expected_flag)
    assert found_inf.item() == expected_flag.item() == float(flagged)
    for i, (a, e) in enumerate(zip(outputs, expected)):
        torch.testing.assert_close(a, e, rtol=0, atol=0, equal_nan=True, msg=lambda m, i=i: f"outputs[{i}]: {m}")


def test_scale_flag_already_set_stays_set():
    inputs = randn_list(EDGE_SIZES, FP32)
    outputs = randn_list(EDGE_SIZES, BF16)
    found_inf = scalar(1.0)
    ops.scale_(inputs, outputs, scalar(0.5), found_inf)
    assert found_inf.item() == 1.0
    assert_bits_equal(outputs[2], (inputs[2] * 0.5).to(BF16))


@pytest.mark.parametrize("use_skip_flag", [False, True], ids=["no_flag", "skip_if_0"])
@pytest.mark.parametrize("out_dtype", FLOAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("in_dtype", FLOAT_DTYPES, ids=dtype_id)
def test_cast_copy_matches_reference_bitwise(in_dtype, out_dtype, use_skip_flag):
    """outputs = inputs cast to the output dtype, bit for bit (skip_if absent or 0)."""
    inputs = randn_list(EDGE_SIZES + BIG_SIZES[:1], in_dtype, std=100.0)
    outputs = randn_list(EDGE_SIZES + BIG_SIZES[:1], out_dtype)
    skip_if = scalar(0.0) if use_skip_flag else None
    expected = [t.clone() for t in outputs]
    reference.cast_copy_(inputs, expected, skip_if)
    ops.cast_copy_(inputs, outputs, skip_if)
    for i, (a, e) in enumerate(zip(outputs, expected)):
        assert_bits_equal(a, e, f"outputs[{i}]")
        assert_bits_equal(a, inputs[i].to(out_dtype), f"outputs[{i}] vs torch cast")


@pytest.mark.parametrize("layout", ["unaligned", "channels_last"])
def test_scale_and_cast_copy_layouts(layout):
    """Unaligned views and channels_last lists scale and copy bit for bit, with no stray writes."""
    sizes = CL_SHAPES if layout == "channels_last" else EDGE_SIZES
    inputs = randn_list(sizes, BF16, layout=layout)
    scaled = randn_list(sizes, FP32, layout=layout)
    copied = randn_list(sizes, FP16, layout=layout)
    ops.scale_(inputs, scaled, scalar(GRAD_SCALE))
    ops.cast_copy_(inputs, copied)
    for i, x in enumerate(inputs):
        assert_bits_equal(scaled[i], x.float() * torch.tensor(GRAD_SCALE, dtype=FP32), f"scaled[{i}]")
        assert_bits_equal(copied[i], x.to(FP16), f"copied[{i}]")
    for lst in (inputs, scaled, copied):
        assert_guards_intact(lst)


def test_scale_and_cast_copy_many_tensors():
    """250 tensors in one call (several CUDA launches' worth), one of them empty, scale and copy bit for bit."""
    sizes = torch.randint(1, 3000, (250,)).tolist()
    sizes[17] = 0
    inputs = randn_list(sizes, FP16)
    scaled = randn_list(sizes, FP32)
    copied = randn_list(sizes, BF16)
    ops.scale_(inputs, scaled, scalar(GRAD_SCALE))
    ops.cast_copy_(inputs, copied)
    for i, x in enumerate(inputs):
        assert_bits_equal(scaled[i], x.float() * torch.tensor(GRAD_SCALE, dtype=FP32), f"scaled[{i}]")
        assert_bits_equal(copied[i], x.to(BF16), f"copied[{i}]")


# ----------------------------------------------------------------------------------------------------
# Bad input: a clear error before anything is written
# ----------------------------------------------------------------------------------------------------


def valid_adam_call() -> dict:
    """kwargs of a valid ops.adam_step_ call (fp32 params, bf16 param_outs, grad_scale, found_inf = 0)."""
    s = make_adam_state([5, 3], FP32, FP32, BF16)
    return dict(
        params=s.params, grads=s.grads, exp_avgs=s.exp_avgs, exp_avg_sqs=s.exp_avg_sqs,
        param_outs=s.param_outs, param_remainders=[], step=3, grad_scale=scalar(0.5), found_inf=scalar(0.0),
        **HYPER,
    )  # fmt: skip


def _bf16_remainder_call() -> dict:
    s = make_adam_state([5, 3], BF16, FP32, remainders=True)
    c = valid_adam_call()
    c.update(params=s.params, param_remainders=s.param_remainders, param_outs=[])
    return c


def _param_out_alias_case(c: dict) -> dict:
    """bf16 params whose param_outs are the same memory viewed as fp16."""
    s = make_adam_state([5, 3], BF16, FP32)
    return {**c, "params": s.params, "param_outs": [p.view(FP16) for p in s.params]}


def _replace(key: str, index: int, fn) -> Callable[[dict], dict]:
    """A case that replaces c[key][index] with fn(old)."""

    def mutate(c: dict) -> dict:
        lst = list(c[key])
        lst[index] = fn(lst[index])
        return {**c, key: lst}

    return mutate


BAD_ADAM_CALLS = [
    # (id, mutation of valid_adam_call(), exception, message regex)
    ("grads_too_short", lambda c: {**c, "grads": c["grads"][:1]}, ValueError, "grads: expected 2 tensors, got 1"),
    ("exp_avgs_too_long", lambda c: {**c, "exp_avgs": c["exp_avgs"] + [torch.zeros(2)]}, ValueError, "exp_avgs"),
    ("exp_avg_sqs_too_short", lambda c: {**c, "exp_avg_sqs": c["exp_avg_sqs"][:1]}, ValueError, "exp_avg_sqs"),
    ("param_outs_too_short", lambda c: {**c, "param_outs": c["param_outs"][:1]}, ValueError, "param_outs"),
    ("params_mixed_dtypes", _replace("params", 1, lambda t: t.half()), TypeError, r"params\[1\]: dtype"),
    ("grads_mixed_dtypes", _replace("grads", 1, lambda t: t.bfloat16()), TypeError, r"grads\[1\]: dtype"),
    ("param_outs_mixed_dtypes", _replace("param_outs", 1, lambda t: t.half()), TypeError, r"param_outs\[1\]"),
    ("exp_avg_fp16", lambda c: {**c, "exp_avgs": [t.half() for t in c["exp_avgs"]]}, TypeError,
     "exp_avgs: expected fp32"),
    ("exp_avg_sq_bf16", lambda c: {**c, "exp_avg_sqs": [t.bfloat16() for t in c["exp_avg_sqs"]]}, TypeError,
     "exp_avg_sqs: expected fp32"),
    ("remainders_with_fp32_params",
     lambda c: {**c, "param_remainders": [torch.ones_like(p, dtype=INT16) for p in c["params"]]}, TypeError,
     "param_remainders pair with bfloat16"),
    ("remainders_not_int16",
     lambda c: {**_bf16_remainder_call(), "param_remainders": [torch.ones(5, dtype=FP16), torch.ones(3, dtype=FP16)]},
     TypeError, "param_remainders: expected int16"),
    ("grad_scale_fp64", lambda c: {**c, "grad_scale": scalar(0.5, dtype=torch.float64)}, TypeError,
     "grad_scale: expected a float32"),
    ("grad_scale_two_elements", lambda c: {**c, "grad_scale": torch.tensor([0.5, 0.5])}, ValueError,
     "grad_scale: expected one element"),
    ("found_inf_fp16", lambda c: {**c, "found_inf": scalar(0.0, dtype=FP16)}, TypeError, "found_inf"),
    ("negative_lr", lambda c: {**c, "lr": -1e-3}, ValueError, "lr must be >= 0"),
    ("beta1_is_1", lambda c: {**c, "beta1": 1.0}, ValueError, r"betas must be in \[0, 1\)"),
    ("beta1_negative", lambda c: {**c, "beta1": -0.1}, ValueError, r"betas must be in \[0, 1\)"),
    ("beta2_above_1", lambda c: {**c, "beta2": 1.5}, ValueError, r"betas must be in \[0, 1\)"),
    ("step_0", lambda c: {**c, "step": 0}, ValueError, "step"),
    ("negative_eps", lambda c: {**c, "eps": -1e-8}, ValueError, "eps"),
    ("negative_weight_decay", lambda c: {**c, "weight_decay": -0.1}, ValueError, "weight_decay"),
    ("grad_shape_mismatch", _replace("grads", 1, lambda t: torch.randn(4)), ValueError, r"grads\[1\]: shape"),
    ("grad_same_numel_other_shape", _replace("grads", 0, lambda t: torch.randn(1, 5)), ValueError, "shape"),
    ("exp_avg_aliases_param", lambda c: {**c, "exp_avgs": [c["params"][0], c["exp_avgs"][1]]}, ValueError, "alias"),
    ("param_out_aliases_param_as_other_dtype", _param_out_alias_case, ValueError, "aliases"),
]  # fmt: skip


@pytest.mark.parametrize("mutate,exc,match", [pytest.param(*c[1:], id=c[0]) for c in BAD_ADAM_CALLS])
def test_adam_bad_input_raises_before_writing(mutate, exc, match):
    """Invalid arguments raise a clear error and leave every tensor untouched."""
    call = mutate(valid_adam_call())
    snap = snapshot(call)
    with pytest.raises(exc, match=match):
        ops.adam_step_(**call)
    assert_unchanged(snap)


def valid_capturable_call() -> dict:
    c = valid_adam_call()
    del c["step"], c["lr"]
    return {**c, "lr": scalar(1e-3), "steps": [scalar(2.0), scalar(3.0)]}


BAD_CAPTURABLE_CALLS = [
    ("lr_fp64", lambda c: {**c, "lr": scalar(1e-3, dtype=torch.float64)}, TypeError, "lr: expected a float32"),
    ("lr_two_elements", lambda c: {**c, "lr": torch.tensor([1e-3, 1e-3])}, ValueError, "lr: expected one element"),
    ("steps_too_short", lambda c: {**c, "steps": c["steps"][:1]}, ValueError, "steps"),
    ("step_int64", _replace("steps", 1, lambda t: torch.tensor([3])), TypeError, "steps"),
    ("step_two_elements", _replace("steps", 0, lambda t: torch.tensor([2.0, 2.0])), ValueError, "steps"),
    ("beta2_is_1", lambda c: {**c, "beta2": 1.0}, ValueError, "betas"),
    ("grads_mixed_dtypes", _replace("grads", 0, lambda t: t.half()), TypeError, "grads"),
    ("exp_avg_fp16", lambda c: {**c, "exp_avgs": [t.half() for t in c["exp_avgs"]]}, TypeError, "exp_avgs"),
]  # fmt: skip


@pytest.mark.parametrize("mutate,exc,match", [pytest.param(*c[1:], id=c[0]) for c in BAD_CAPTURABLE_CALLS])
def test_adam_capturable_bad_input_raises_before_writing(mutate, exc, match):
    """Invalid arguments of the capturable op raise a clear error and leave every tensor untouched."""
    call = mutate(valid_capturable_call())
    snap = snapshot(call)
    with pytest.raises(exc, match=match):
        ops.adam_step_capturable_(**call)
    assert_unchanged(snap)


@pytest.mark.parametrize("list_name", ["grads", "exp_avgs", "exp_avg_sqs", "param_outs", "param_remainders"])
def test_adam_mismatched_strides_raise_before_writing(list_name):
    """channels_last params with one contiguous partner list: ValueError, nothing written."""
    state = make_adam_state(CL_SHAPES[:2], BF16, FP32, FP16, remainders=True, layout="channels_last")
    lst = getattr(state, list_name)
    lst[1] = lst[1].contiguous()
    snap = snapshot(state)
    with pytest.raises(ValueError, match="same strides"):
        run_adam(state, step=1)
    assert_unchanged(snap)


def test_adam_transposed_partner_raises():
    """A partner with the same shape but transposed (non-dense-order) strides is refused."""
    state = make_adam_state([(6, 4)], FP32, FP32)
    state.grads[0] = torch.randn(4, 6).t()
    snap = snapshot(state)
    with pytest.raises(ValueError, match=r"grads\[0\]"):
        run_adam(state, step=1)
    assert_unchanged(snap)


def _scale_call() -> dict:
    return dict(inputs=randn_list([5, 3], FP32), outputs=randn_list([5, 3], BF16), scale=scalar(0.5),
                found_inf=scalar(0.0))  # fmt: skip


BAD_SCALE_CALLS = [
    ("outputs_too_short", lambda c: {**c, "outputs": c["outputs"][:1]}, ValueError, "outputs: expected 2"),
    ("outputs_mixed_dtypes", _replace("outputs", 1, lambda t: t.half()), TypeError, r"outputs\[1\]"),
    ("inputs_int32", lambda c: {**c, "inputs": [t.int() for t in c["inputs"]]}, TypeError, "inputs"),
    ("scale_fp64", lambda c: {**c, "scale": scalar(0.5, dtype=torch.float64)}, TypeError, "scale"),
    ("scale_two_elements", lambda c: {**c, "scale": torch.tensor([0.5, 0.5])}, ValueError, "scale"),
    ("found_inf_two_elements", lambda c: {**c, "found_inf": torch.zeros(2)}, ValueError, "found_inf"),
    ("shape_mismatch", _replace("outputs", 0, lambda t: torch.randn(6, dtype=BF16)), ValueError, "shape"),
    ("stride_mismatch",
     lambda c: {**c, "inputs": randn_list(CL_SHAPES[:1], FP32, layout="channels_last"),
                "outputs": randn_list(CL_SHAPES[:1], BF16)},
     ValueError, "same strides"),
    ("partial_overlap",
     lambda c: (lambda buf: {**c, "inputs": [buf[:5], c["inputs"][1]], "outputs": [buf[2:7], c["outputs"][1].float()]})(
         torch.randn(8)),
     ValueError, "partially overlaps"),
]  # fmt: skip


@pytest.mark.parametrize("mutate,exc,match", [pytest.param(*c[1:], id=c[0]) for c in BAD_SCALE_CALLS])
def test_scale_bad_input_raises_before_writing(mutate, exc, match):
    """Invalid scale_ arguments raise a clear error and leave every tensor untouched."""
    call = mutate(_scale_call())
    snap = snapshot(call)
    with pytest.raises(exc, match=match):
        ops.scale_(**call)
    assert_unchanged(snap)


BAD_CAST_CALLS = [
    ("outputs_too_long", lambda c: {**c, "outputs": c["outputs"] + [torch.zeros(1)]}, ValueError, "outputs"),
    ("skip_if_fp64", lambda c: {**c, "skip_if": scalar(0.0, dtype=torch.float64)}, TypeError, "skip_if"),
    ("skip_if_two_elements", lambda c: {**c, "skip_if": torch.zeros(2)}, ValueError, "skip_if"),
    ("outputs_mixed_dtypes", _replace("outputs", 0, lambda t: t.float()), TypeError, r"outputs\[1\]"),
]  # fmt: skip


@pytest.mark.parametrize("mutate,exc,match", [pytest.param(*c[1:], id=c[0]) for c in BAD_CAST_CALLS])
def test_cast_copy_bad_input_raises_before_writing(mutate, exc, match):
    """Invalid cast_copy_ arguments raise a clear error and leave every tensor untouched."""
    c = _scale_call()
    call = mutate(dict(inputs=c["inputs"], outputs=c["outputs"], skip_if=scalar(0.0)))
    snap = snapshot(call)
    with pytest.raises(exc, match=match):
        ops.cast_copy_(**call)
    assert_unchanged(snap)


BAD_L2NORM_CALLS = [
    ("mixed_dtypes", lambda: ([torch.randn(3), torch.randn(2, dtype=FP16)], None), TypeError, r"tensors\[1\]"),
    ("int64", lambda: ([torch.arange(3)], None), TypeError, "tensors"),
    ("found_inf_two_elements", lambda: ([torch.randn(3)], torch.zeros(2)), ValueError, "found_inf"),
    ("found_inf_fp16", lambda: ([torch.randn(3)], torch.zeros(1, dtype=FP16)), TypeError, "found_inf"),
]


@pytest.mark.parametrize("make,exc,match", [pytest.param(*c[1:], id=c[0]) for c in BAD_L2NORM_CALLS])
def test_l2norm_bad_input_raises(make, exc, match):
    """Invalid l2norm arguments raise a clear error and leave the flag untouched."""
    tensors, found_inf = make()
    snap = snapshot(tensors, found_inf)
    with pytest.raises(exc, match=match):
        ops.l2norm(tensors, found_inf)
    assert_unchanged(snap)


# ----------------------------------------------------------------------------------------------------
# torch.library.opcheck
# ----------------------------------------------------------------------------------------------------


def _opcheck_adam(remainders: bool, out_dtype):
    s = make_adam_state([5, 3], BF16 if remainders else FP32, FP16, out_dtype, remainders=remainders)
    return (*s.lists(), 1e-3, 0.9, 0.999, 1e-8, 0.1, 3, True, scalar(0.5), scalar(0.0))


def _opcheck_capturable():
    s = make_adam_state([5, 3], FP32, BF16, FP16)
    lr, steps = scalar(1e-3), [scalar(2.0), scalar(4.0)]
    return (*s.lists(), lr, 0.9, 0.999, 1e-8, 0.1, steps, False, scalar(0.5), scalar(0.0))


OPCHECK_CASES = {
    "adam_step_": lambda: _opcheck_adam(False, BF16),
    "adam_step_-no_param_outs": lambda: _opcheck_adam(False, None),
    "adam_step_-remainders": lambda: _opcheck_adam(True, FP32),
    "adam_step_capturable_": _opcheck_capturable,
    "l2norm": lambda: (randn_list([5, 3], BF16), scalar(0.0)),
    "l2norm-no_flag": lambda: (randn_list([5, 3], FP32), None),
    "scale_": lambda: (randn_list([5, 3], FP16), randn_list([5, 3], FP32), scalar(0.5), scalar(0.0)),
    "cast_copy_": lambda: (randn_list([5, 3], FP32), randn_list([5, 3], BF16), scalar(0.0)),
}


@pytest.mark.parametrize("case", list(OPCHECK_CASES))
def test_opcheck(case):
    """Schemas tell the truth about mutation, fake kernels and AOT dispatch work (default test_utils)."""
    op = getattr(torch.ops.distopt, case.split("-")[0])
    torch.library.opcheck(op, OPCHECK_CASES[case]())
