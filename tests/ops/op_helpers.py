"""Shared helpers of the fused-op tests (``distopt.ops`` against the pure-PyTorch oracle ``distopt.reference``).

Not a test module: the op tests (test_ops_adam.py, test_ops_norm_scale.py and test_ops_launches.py, which
run on every backend of backends.py; test_ops_errors.py) and the GPU-only tests (test_ops_cuda.py) import
these constants, tensor factories, ``AdamState`` and the run_*/check_*/assert_* helpers. Conventions:

* inputs are random and never zero (exp_avg_sq is positive); the autouse fixture in conftest.py seeds
  torch, so every run sees the same data;
* the factories create tensors on the current backend's device (tests/ops/backends.py) unless given one;
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

HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, adam_w_mode=True, maximize=False)
# (adam_w_mode, weight_decay): AdamW with decoupled decay and Adam with L2 decay folded into the grad.
MODES = [pytest.param(True, 0.1, id="adamw"), pytest.param(False, 0.1, id="adam_l2")]
# maximize: False descends the objective, True ascends it (the gradient negated, as torch's maximize=True).
MAXIMIZE = [pytest.param(False, id="minimize"), pytest.param(True, id="maximize")]
GRAD_SCALE = 0.37  # not a power of two: the fp32 product grad * scale rounds
NORM_RTOL = 1e-5  # l2norm (fp32 squares, wider sums) against the float64 reference

GUARD = 77  # value of the elements just outside an "unaligned" view; exact in every dtype used

CL_SHAPES = [(2, 3, 5, 7), (4, 8, 3, 3), (1, 5, 2, 2), (2, 16, 64, 65)]  # 4-D shapes for channels_last
OP_NAMES = ("adam_step_", "l2norm", "scale_", "cast_copy_")


# Where the factories below create tensors when no device is given: the op tests' backend's device
# (tests/ops/backends.py sets it for the duration of a test; "cpu" otherwise).
_default_device = "cpu"


def set_default_device(device: str) -> str:
    """Makes ``device`` the factories' default; returns the previous default."""
    global _default_device
    previous, _default_device = _default_device, device
    return previous


def dtype_id(dtype: torch.dtype | None) -> str:
    return "none" if dtype is None else str(dtype).removeprefix("torch.")


# ----------------------------------------------------------------------------------------------------
# Tensor factories
# ----------------------------------------------------------------------------------------------------


def new_tensor(shape: Sequence[int], dtype: torch.dtype, device=None, layout: str = "contiguous") -> Tensor:
    """An uninitialised tensor of ``shape`` with the given memory layout.

    "contiguous": plain. "unaligned": a view at element offset 1 of a buffer two elements longer, so its
    data pointer is not 16-byte aligned; the elements on either side hold ``GUARD`` (see
    ``assert_guards_intact``). "channels_last": a 4-D tensor, dense but not contiguous.
    """
    shape = tuple(shape)
    device = device or _default_device
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


def filled(values: Tensor, dtype: torch.dtype, device=None, layout="contiguous") -> Tensor:
    """A ``new_tensor`` holding ``values`` (generated on the CPU, so every device sees the same data)."""
    return new_tensor(values.shape, dtype, device, layout).copy_(values)


def randn(size, dtype=FP32, device=None, layout="contiguous", std=1.0) -> Tensor:
    return filled(torch.randn(as_shape(size)) * std, dtype, device, layout)


def rand_positive(size, dtype=FP32, device=None, layout="contiguous", high=0.01) -> Tensor:
    """Uniform in (0, high]: a valid, nonzero exp_avg_sq."""
    return filled(torch.rand(as_shape(size)) * high + 1e-6, dtype, device, layout)


def randn_list(sizes, dtype=FP32, device=None, layout="contiguous", std=1.0) -> list[Tensor]:
    return [randn(s, dtype, device, layout, std) for s in sizes]


def copy_to(t: Tensor, device=None, layout="contiguous") -> Tensor:
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


def assert_bits_equal(actual: Tensor, expected: Tensor, what: str = "", any_nan: bool = False) -> None:
    """Same dtype, shape and bit pattern in every element. With ``any_nan``, a NaN matches any NaN: its
    sign and payload are the hardware's (an x86 CPU makes the negative quiet NaN, an NVIDIA GPU the
    positive canonical one), so a CPU-vs-GPU comparison cannot ask for them; every other element must
    still match bit for bit."""
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    expected = expected.to(actual.device)
    a, e = bits(actual), bits(expected)
    differ = a != e
    if any_nan and actual.is_floating_point():
        differ &= ~(actual.isnan() & expected.isnan())
    if differ.any():
        bad = differ.nonzero()
        first = tuple(bad[0].tolist())
        raise AssertionError(
            f"{what}: {bad.shape[0]} of {a.numel()} elements differ bitwise, first at {first}: "
            f"{actual[first].item()!r} vs {expected[first].item()!r}"
        )


def assert_each_bits_equal(actual: Sequence[Tensor], expected: Sequence[Tensor], what: str) -> None:
    """``assert_bits_equal`` on each pair of the two lists (zipped), messages naming ``what[i]``."""
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert_bits_equal(a, e, f"{what}[{i}]")


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
    device=None,
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


def scalar(value: float, device=None, dtype=FP32) -> Tensor:
    """A one-element tensor (the form of grad_scale, found_inf, lr and steps)."""
    return torch.tensor([value], dtype=dtype, device=device or _default_device)


def run_adam(state: AdamState, *, step: int, grad_scale=None, found_inf=None, **hyper) -> None:
    """The fused op (``ops.adam_step_``) on ``state``, in place, with lr and step as numbers (eager)."""
    h = {**HYPER, **hyper}
    ops.adam_step_(
        state.params, state.grads, state.exp_avgs, state.exp_avg_sqs,
        param_outs=state.param_outs, param_remainders=state.param_remainders,
        step=step, grad_scale=grad_scale, found_inf=found_inf, **h,
    )  # fmt: skip


def run_adam_capturable(state: AdamState, *, lr: Tensor, steps, grad_scale=None, found_inf=None, **hyper) -> None:
    """The fused op on ``state``, in place, with lr and steps as device tensors the kernel reads."""
    h = {**HYPER, **hyper}
    h.pop("lr")
    ops.adam_step_(
        state.params, state.grads, state.exp_avgs, state.exp_avg_sqs,
        param_outs=state.param_outs, param_remainders=state.param_remainders,
        lr=lr, step=steps, grad_scale=grad_scale, found_inf=found_inf, **h,
    )  # fmt: skip


def _scalar(x) -> Tensor:
    return x if isinstance(x, Tensor) else torch.tensor(float(x), dtype=torch.float64)


def run_reference_adam(state: AdamState, *, step, grad_scale=None, found_inf=None, **hyper) -> None:
    """``reference.adam_step_`` (float64 math) on ``state``, in place, lr and step as numbers."""
    h = {**HYPER, **hyper}
    reference.adam_step_(
        *state.lists(), _scalar(h["lr"]), [_scalar(step)], h["beta1"], h["beta2"], h["eps"], h["weight_decay"],
        h["adam_w_mode"], h["maximize"], grad_scale, found_inf,
    )  # fmt: skip


def run_reference_adam_capturable(state: AdamState, *, lr, steps, grad_scale=None, found_inf=None, **hyper) -> None:
    """``reference.adam_step_`` (float64 math) on ``state``, in place, lr and steps as tensors."""
    h = {**HYPER, **hyper}
    reference.adam_step_(
        *state.lists(), lr, steps, h["beta1"], h["beta2"], h["eps"], h["weight_decay"],
        h["adam_w_mode"], h["maximize"], grad_scale, found_inf,
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


def assert_adam_bits_equal(actual: AdamState, expected: AdamState, names: Sequence[str] | None = None) -> None:
    """The lists ``names`` (default: every list the op may write) hold the same bits in both states."""
    for name in names or actual.written():
        assert_each_bits_equal(getattr(actual, name), getattr(expected, name), name)


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


def kernel_registration(op: str, dispatch_key: str) -> str:
    """The dispatch-table line saying where distopt::op's kernel for ``dispatch_key`` was registered."""
    lines = torch._C._dispatch_dump(f"distopt::{op}").splitlines()
    return next((line for line in lines if line.startswith(f"{dispatch_key}:")), "")


# ----------------------------------------------------------------------------------------------------
# adam_step_ with lr and steps as device tensors (capturable)
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


def capturable_steps(device=None) -> list[Tensor]:
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


def check_capturable_against_eager_and_reference(
    state: AdamState, *, lr: Tensor, steps: Sequence[Tensor], **kw
) -> None:
    """Runs the capturable op on ``state``; asserts it gives the eager op's bits for each step
    (``run_eager_per_step``), matches the reference, moves the params and never writes lr or steps
    (they are read; the caller increments steps)."""
    eager, expected, before = state.clone(), state.clone(), state.clone()
    inputs = snapshot({"lr": lr, "steps": steps})
    run_adam_capturable(state, lr=lr, steps=steps, **kw)
    run_eager_per_step(eager, lr=lr, steps=steps, **kw)
    run_reference_adam_capturable(expected, lr=lr, steps=steps, **kw)
    assert_adam_bits_equal(state, eager)
    assert_adam_close(state, expected)
    assert_params_moved(before, state)
    assert_unchanged(inputs)


# ----------------------------------------------------------------------------------------------------
# l2norm
# ----------------------------------------------------------------------------------------------------


def check_l2norm_against_reference(tensors: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
    """ops.l2norm of ``tensors`` (no flag): fp32 per-tensor and total norms within NORM_RTOL of the reference."""
    total, per_tensor = ops.l2norm(tensors)
    ref_total, ref_per = reference.l2norm([t.cpu() for t in tensors], None)
    assert total.dtype == per_tensor.dtype == FP32
    assert total.shape == () and per_tensor.shape == (len(tensors),)
    torch.testing.assert_close(per_tensor.cpu(), ref_per, rtol=NORM_RTOL, atol=0)
    torch.testing.assert_close(total.cpu(), ref_total, rtol=NORM_RTOL, atol=0)
    return total, per_tensor
