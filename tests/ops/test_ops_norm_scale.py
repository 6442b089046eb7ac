"""Tests of the fused l2norm, scale_ and cast_copy_ ops against the pure-PyTorch oracle
(``distopt.reference``): norms within NORM_RTOL of the float64 reference; scale_ and cast_copy_ bit for
bit, their found_inf / skip_if flags, unaligned and channels_last layouts, many tensors.

Every test runs on each backend of tests/ops/backends.py (cpu, cuda-emulated, cuda); tests/ops/test_ops_cuda.py
adds what only a GPU shows. Helpers and conventions: op_helpers.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from distopt import ops, reference

from op_helpers import (
    BF16,
    BIG_SIZES,
    CL_SHAPES,
    EDGE_SIZES,
    FLOAT_DTYPES,
    FP16,
    FP32,
    GRAD_SCALE,
    assert_bits_equal,
    assert_each_bits_equal,
    assert_guards_intact,
    assert_unchanged,
    check_l2norm_against_reference,
    dtype_id,
    inject,
    randn_list,
    scalar,
    snapshot,
)

# Every test runs on each backend (tests/ops/backends.py): the CPU kernels, the CUDA kernels under the SIMT
# emulator (cross-checked bit for bit against the CPU kernels) and, with a GPU, the CUDA kernels.
pytestmark = pytest.mark.usefixtures("one_intra_op_thread", "backend")

# ----------------------------------------------------------------------------------------------------
# l2norm
# ----------------------------------------------------------------------------------------------------


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
    assert_each_bits_equal(outputs, expected, "outputs")
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
    assert_each_bits_equal(tensors, expected, "tensors")
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


def check_scale_and_cast_copy(inputs: list[Tensor], scaled: list[Tensor], copied: list[Tensor]) -> None:
    """scale_ by GRAD_SCALE into ``scaled`` and cast_copy_ into ``copied``: both bit for bit equal to torch's
    fp32 product and cast."""
    ops.scale_(inputs, scaled, scalar(GRAD_SCALE))
    ops.cast_copy_(inputs, copied)
    assert_each_bits_equal(scaled, [x.float() * torch.tensor(GRAD_SCALE, dtype=FP32) for x in inputs], "scaled")
    assert_each_bits_equal(copied, [x.to(c.dtype) for x, c in zip(inputs, copied)], "copied")


@pytest.mark.parametrize("layout", ["unaligned", "channels_last"])
def test_scale_and_cast_copy_layouts(layout):
    """Unaligned views and channels_last lists scale and copy bit for bit, with no stray writes."""
    sizes = CL_SHAPES if layout == "channels_last" else EDGE_SIZES
    inputs = randn_list(sizes, BF16, layout=layout)
    scaled = randn_list(sizes, FP32, layout=layout)
    copied = randn_list(sizes, FP16, layout=layout)
    check_scale_and_cast_copy(inputs, scaled, copied)
    for lst in (inputs, scaled, copied):
        assert_guards_intact(lst)


def test_scale_and_cast_copy_many_tensors():
    """250 tensors in one call (several CUDA launches' worth), one of them empty, scale and copy bit for bit."""
    sizes = torch.randint(1, 3000, (250,)).tolist()
    sizes[17] = 0
    inputs = randn_list(sizes, FP16)
    scaled = randn_list(sizes, FP32)
    copied = randn_list(sizes, BF16)
    check_scale_and_cast_copy(inputs, scaled, copied)
