"""CPU tests of the fused ops' registration and argument checking: the kernels under test are the
compiled ones, every invalid argument raises a clear ValueError before anything is written (a wrong
dtype too: torch's stable ABI, which the kernels are built on, carries no TypeError), and
``torch.library.opcheck`` finds the schemas truthful. Helpers: op_helpers.py.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from distopt import ops, state_formats

from op_helpers import (
    BF16,
    CL_SHAPES,
    FP16,
    FP32,
    HYPER,
    INT16,
    OP_NAMES,
    assert_unchanged,
    kernel_registration,
    make_adam_state,
    randn_list,
    run_adam,
    scalar,
    snapshot,
)

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


# ----------------------------------------------------------------------------------------------------
# The kernels under test are the compiled ones
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("op", OP_NAMES)
def test_cpu_kernel_is_compiled(op):
    """The CPU kernels come from distopt._C, not the reference fallback (which would make every
    CPU comparison in the op tests the oracle against itself)."""
    assert ops.HAS_EXTENSION, ops._IMPORT_ERROR
    where = kernel_registration(op, "CPU")
    assert "registration_cpu.cpp" in where, where


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
    ("params_mixed_dtypes", _replace("params", 1, lambda t: t.half()), ValueError, r"params\[1\]: dtype"),
    ("grads_mixed_dtypes", _replace("grads", 1, lambda t: t.bfloat16()), ValueError, r"grads\[1\]: dtype"),
    ("param_outs_mixed_dtypes", _replace("param_outs", 1, lambda t: t.half()), ValueError, r"param_outs\[1\]"),
    ("exp_avg_fp16", lambda c: {**c, "exp_avgs": [t.half() for t in c["exp_avgs"]]}, ValueError,
     "exp_avgs: expected fp32, bf16 or uint8"),
    ("exp_avg_sq_int16", lambda c: {**c, "exp_avg_sqs": [t.to(INT16) for t in c["exp_avg_sqs"]]}, ValueError,
     "exp_avg_sqs: expected fp32, bf16 or uint8"),
    ("remainders_with_fp32_params",
     lambda c: {**c, "param_remainders": [torch.ones_like(p, dtype=INT16) for p in c["params"]]}, ValueError,
     "param_remainders pair with bfloat16"),
    ("remainders_not_int16",
     lambda c: {**_bf16_remainder_call(), "param_remainders": [torch.ones(5, dtype=FP16), torch.ones(3, dtype=FP16)]},
     ValueError, "param_remainders: expected int16"),
    ("grad_scale_fp64", lambda c: {**c, "grad_scale": scalar(0.5, dtype=torch.float64)}, ValueError,
     "grad_scale: expected a float32"),
    ("grad_scale_two_elements", lambda c: {**c, "grad_scale": torch.tensor([0.5, 0.5])}, ValueError,
     "grad_scale: expected one element"),
    ("found_inf_fp16", lambda c: {**c, "found_inf": scalar(0.0, dtype=FP16)}, ValueError, "found_inf"),
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


def _states_call() -> dict:
    """valid_adam_call with 8-bit exp_avgs (and their absmax), bf16 exp_avg_sqs and stochastic rounding."""
    c = valid_adam_call()
    m = [state_formats.quantize_blockwise(t, True) for t in c["exp_avgs"]]
    return {**c, "exp_avgs": [q for q, _ in m], "exp_avg_scales": [a for _, a in m],
            "exp_avg_sqs": [t.bfloat16() for t in c["exp_avg_sqs"]], "rounding_seed": 7, "param_ids": [0, 1]}


def _states(**changes) -> Callable[[dict], dict]:
    return lambda c: {**_states_call(), **changes}


BAD_STATES_CALLS = [
    ("params_uint8", lambda c: {**(s := _states_call()), "params": [p.to(torch.uint8) for p in s["params"]]},
     ValueError, "params: expected float"),
    ("param_outs_uint8", lambda c: {**(s := _states_call()), "param_outs": [p.to(torch.uint8) for p in s["params"]]},
     ValueError, "param_outs: expected float"),
    ("exp_avgs_mixed_formats", lambda c: {**(s := _states_call()), "exp_avgs": [s["exp_avgs"][0], torch.zeros(3)]},
     ValueError, r"exp_avgs\[1\]: dtype"),
    ("no_scales", _states(exp_avg_scales=[]), ValueError, "exp_avg_scales: expected one absmax tensor per entry"),
    ("scales_too_long", lambda c: {**(s := _states_call()), "exp_avg_scales": s["exp_avg_scales"] * 2}, ValueError,
     "exp_avg_scales: expected one absmax tensor per entry"),
    ("scales_wrong_numel", _states(exp_avg_scales=[torch.ones(2), torch.ones(1)]), ValueError,
     r"exp_avg_scales\[0\]: expected 1 contiguous elements"),
    ("scales_fp16", _states(exp_avg_scales=[torch.ones(1, dtype=FP16)] * 2), ValueError,
     r"exp_avg_scales\[0\]: expected float32"),
    ("scales_for_bf16_moments", _states(exp_avg_sq_scales=[torch.ones(1), torch.ones(1)]), ValueError,
     "exp_avg_sq_scales: only 8-bit"),
    ("scales_alias", lambda c: {**(s := _states_call()), "exp_avg_sqs": [torch.zeros(5, dtype=torch.uint8),
     torch.zeros(3, dtype=torch.uint8)], "exp_avg_sq_scales": s["exp_avg_scales"]}, ValueError, "must not alias"),
    ("rounding_without_param_ids", _states(param_ids=[]), ValueError, "needs param_ids"),
    ("param_ids_too_short", _states(param_ids=[0]), ValueError, "param_ids: expected one id per param"),
    ("param_id_negative", _states(param_ids=[0, -1]), ValueError, r"param_ids\[1\] must be in \[0, 2\^32\)"),
    ("param_id_too_large", _states(param_ids=[2**32, 0]), ValueError, r"param_ids\[0\] must be in"),
    ("param_offsets_too_long", _states(param_offsets=[0, 0, 0]), ValueError, "param_offsets: expected one offset"),
    ("param_offset_negative", _states(param_offsets=[0, -256]), ValueError, r"param_offsets\[1\] must be >= 0"),
    ("param_offset_inside_a_block", _states(param_offsets=[0, 100]), ValueError, "multiple of 256"),
]  # fmt: skip


@pytest.mark.parametrize("mutate,exc,match", [pytest.param(*c[1:], id=c[0]) for c in BAD_STATES_CALLS])
def test_adam_states_bad_input_raises_before_writing(mutate, exc, match):
    """Invalid low-precision moments, scales or rounding keys raise a clear error, nothing written."""
    ops.adam_step_(**_states_call())  # the valid call runs
    call = mutate(None)
    snap = snapshot(call)
    with pytest.raises(exc, match=match):
        ops.adam_step_(**call)
    assert_unchanged(snap)


def valid_capturable_call() -> dict:
    c = valid_adam_call()
    del c["step"], c["lr"]
    return {**c, "lr": scalar(1e-3), "step": [scalar(2.0), scalar(3.0)]}


BAD_CAPTURABLE_CALLS = [
    ("lr_negative_tensor", lambda c: {**c, "lr": scalar(-1e-3)}, ValueError, "lr must be >= 0"),
    ("lr_two_elements", lambda c: {**c, "lr": torch.tensor([1e-3, 1e-3])}, ValueError, "lr: expected one element"),
    ("steps_too_long", lambda c: {**c, "step": c["step"] * 2}, ValueError, "steps: expected one step tensor"),
    ("step_int64", _replace("step", 1, lambda t: torch.tensor([3])), ValueError, "steps"),
    ("step_two_elements", _replace("step", 0, lambda t: torch.tensor([2.0, 2.0])), ValueError, "steps"),
    ("one_step_tensor_0", lambda c: {**c, "step": scalar(0.0)}, ValueError, "step counts this update"),
    ("one_step_two_elements", lambda c: {**c, "step": torch.tensor([2.0, 2.0])}, ValueError, "one element"),
    ("beta2_is_1", lambda c: {**c, "beta2": 1.0}, ValueError, "betas"),
    ("grads_mixed_dtypes", _replace("grads", 0, lambda t: t.half()), ValueError, "grads"),
    ("exp_avg_fp16", lambda c: {**c, "exp_avgs": [t.half() for t in c["exp_avgs"]]}, ValueError, "exp_avgs"),
]  # fmt: skip


@pytest.mark.parametrize("mutate,exc,match", [pytest.param(*c[1:], id=c[0]) for c in BAD_CAPTURABLE_CALLS])
def test_adam_capturable_bad_input_raises_before_writing(mutate, exc, match):
    """Invalid lr/step tensors (read by the kernel, or on the CPU read now) raise a clear error and
    leave every tensor untouched."""
    call = mutate(valid_capturable_call())
    snap = snapshot(call)
    with pytest.raises(exc, match=match):
        ops.adam_step_(**call)
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
    ("outputs_mixed_dtypes", _replace("outputs", 1, lambda t: t.half()), ValueError, r"outputs\[1\]"),
    ("inputs_int32", lambda c: {**c, "inputs": [t.int() for t in c["inputs"]]}, ValueError, "inputs"),
    ("scale_fp64", lambda c: {**c, "scale": scalar(0.5, dtype=torch.float64)}, ValueError, "scale"),
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
    ("skip_if_fp64", lambda c: {**c, "skip_if": scalar(0.0, dtype=torch.float64)}, ValueError, "skip_if"),
    ("skip_if_two_elements", lambda c: {**c, "skip_if": torch.zeros(2)}, ValueError, "skip_if"),
    ("outputs_mixed_dtypes", _replace("outputs", 0, lambda t: t.float()), ValueError, r"outputs\[1\]"),
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
    ("mixed_dtypes", lambda: ([torch.randn(3), torch.randn(2, dtype=FP16)], None), ValueError, r"tensors\[1\]"),
    ("int64", lambda: ([torch.arange(3)], None), ValueError, "tensors"),
    ("found_inf_two_elements", lambda: ([torch.randn(3)], torch.zeros(2)), ValueError, "found_inf"),
    ("found_inf_fp16", lambda: ([torch.randn(3)], torch.zeros(1, dtype=FP16)), ValueError, "found_inf"),
]


@pytest.mark.parametrize("make,exc,match", [pytest.param(*c[1:], id=c[0]) for c in BAD_L2NORM_CALLS])
def test_l2norm_bad_input_raises(make, exc, match):
    """Invalid l2norm arguments raise a clear error and leave the flag untouched."""
    tensors, found_inf = make()
    snap = snapshot(tensors, found_inf)
    with pytest.raises(exc, match=match):
        ops.l2norm(tensors, found_inf)
    assert_unchanged(snap)


def test_l2norm_empty_list_raises():
    with pytest.raises(ValueError, match="at least one tensor"):
        ops.l2norm([])


# ----------------------------------------------------------------------------------------------------
# The ops release every tensor they were passed (Note [Tensor lists across the ABI] in csrc/binding.h)
# ----------------------------------------------------------------------------------------------------


def _tensors_of(call: dict) -> list[torch.Tensor]:
    out = []
    for v in call.values():
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out += [t for t in v if isinstance(t, torch.Tensor)]
    return out


REFERENCE_CALLS = [
    ("adam", lambda: (ops.adam_step_, valid_adam_call())),
    ("adam_states", lambda: (ops.adam_step_, _states_call())),
    ("adam_capturable", lambda: (ops.adam_step_, valid_capturable_call())),
    ("adam_refused_late", lambda: (ops.adam_step_, {**_states_call(), "param_ids": [0, -1]})),
    ("adam_refused_list", lambda: (ops.adam_step_, _replace("grads", 1, lambda t: t.half())(valid_adam_call()))),
    ("scale", lambda: (ops.scale_, _scale_call())),
    ("scale_refused", lambda: (ops.scale_, {**_scale_call(), "scale": torch.tensor([0.5, 0.5])})),
    ("cast_copy", lambda: (ops.cast_copy_, dict(inputs=randn_list([5, 3], FP32), outputs=randn_list([5, 3], BF16),
                                                 skip_if=scalar(0.0)))),
    ("l2norm", lambda: (ops.l2norm, dict(tensors=randn_list([5, 3], FP32), found_inf=scalar(0.0)))),
    ("l2norm_refused", lambda: (ops.l2norm, dict(tensors=[torch.randn(3), torch.arange(2)], found_inf=scalar(0.0)))),
]  # fmt: skip


@pytest.mark.parametrize("make", [pytest.param(c[1], id=c[0]) for c in REFERENCE_CALLS])
def test_ops_release_every_tensor_they_were_passed(make):
    """After a call, accepted or refused, only Python holds the tensors it was passed: the op keeps no C++
    reference (each list's handles are released with it, also when a later argument is refused). A
    reference kept alive (ops.hold_references) is seen: the negative control."""
    op, call = make()
    tensors = _tensors_of(call)
    assert len(tensors) >= 3 and all(t._use_count() == 1 for t in tensors)
    try:
        op(**call)
    except ValueError:
        pass
    counts = [t._use_count() for t in tensors]
    assert counts == [1] * len(tensors), counts
    held = ops.hold_references(tensors[:1])
    assert tensors[0]._use_count() == 2  # negative control: a C++ reference counts
    del held


def test_kernel_argument_errors_are_value_errors_on_every_torch():
    """The compiled kernel's refusal is a ValueError whose message starts with "distopt: ", whether torch
    delivers it as ValueError (up to 2.14) or as RuntimeError (2.15) ..."""
    with pytest.raises(ValueError) as info:
        ops.l2norm([torch.arange(3)])
    assert type(info.value) is ValueError and str(info.value).startswith("distopt: tensors"), info.value


def test_other_kernel_errors_keep_their_type(monkeypatch):
    """... and only that one: a RuntimeError without the prefix (a CUDA error, say) stays a RuntimeError
    (a negative control of the translation: a wrapper that turned every RuntimeError into ValueError fails)."""

    def failing(*args):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(torch.ops.distopt.l2norm, "default", failing)
    with pytest.raises(RuntimeError, match="illegal memory access") as info:
        ops.l2norm([torch.ones(3)])
    assert type(info.value) is RuntimeError


# ----------------------------------------------------------------------------------------------------
# torch.library.opcheck
# ----------------------------------------------------------------------------------------------------


def _opcheck_adam(remainders: bool, out_dtype, maximize: bool = False):
    """Positional args with lr and step as CPU float64 scalars (read when the op runs)."""
    s = make_adam_state([5, 3], BF16 if remainders else FP32, FP16, out_dtype, remainders=remainders)
    lr, steps = scalar(1e-3, dtype=torch.float64), [scalar(3.0, dtype=torch.float64)]
    return (*s.lists(), lr, steps, 0.9, 0.999, 1e-8, 0.1, True, maximize, scalar(0.5), scalar(0.0), [], [])


def _opcheck_device_scalars(maximize: bool = False):
    """Positional args with lr and one float32 step per param, read by the kernel."""
    s = make_adam_state([5, 3], FP32, BF16, FP16)
    lr, steps = scalar(1e-3), [scalar(2.0), scalar(4.0)]
    return (*s.lists(), lr, steps, 0.9, 0.999, 1e-8, 0.1, False, maximize, scalar(0.5), scalar(0.0), [], [])


def _opcheck_states(capturable: bool):
    """8-bit exp_avgs, bf16 exp_avg_sqs, stochastic rounding of bf16 params, eager or device scalars."""
    s = make_adam_state([300, 3], BF16, FP32, FP32)
    m = [state_formats.quantize_blockwise(t, True) for t in s.exp_avgs]
    s.exp_avgs, s.exp_avg_sqs = [q for q, _ in m], [t.bfloat16() for t in s.exp_avg_sqs]
    lr, steps = (scalar(1e-3), [scalar(2.0), scalar(4.0)]) if capturable else (
        scalar(1e-3, dtype=torch.float64), [scalar(3.0, dtype=torch.float64)])  # fmt: skip
    return (*s.lists(), lr, steps, 0.9, 0.999, 1e-8, 0.1, True, False, scalar(0.5), scalar(0.0),
            [a for _, a in m], [], 5, [0, 1], [0, 256])  # fmt: skip


OPCHECK_CASES = {
    "adam_step_-states": lambda: _opcheck_states(False),
    "adam_step_-states-device_scalars": lambda: _opcheck_states(True),
    "adam_step_": lambda: _opcheck_adam(False, BF16),
    "adam_step_-no_param_outs": lambda: _opcheck_adam(False, None),
    "adam_step_-remainders": lambda: _opcheck_adam(True, FP32),
    "adam_step_-maximize": lambda: _opcheck_adam(False, BF16, maximize=True),
    "adam_step_-device_scalars": _opcheck_device_scalars,
    "adam_step_-device_scalars-maximize": lambda: _opcheck_device_scalars(maximize=True),
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
