"""The CPU kernels' vector ISA paths (csrc/cpu/isa.h): dispatch, and each path against the spec.

test_cpu_kernels.py shows that every path and thread count gives the same bits. Here: the default path
is the best the CPU's flags allow, a forced path (DISTOPT_CPU_ISA) runs its own compiled copy and no
other (the extension counts the ranges each copy runs), bad settings raise; the found_inf flag of
scale_ is right at each format's overflow edge; and l2norm's bits are those of the algorithm its
source documents (fixed blocks, 16 double lanes, a pairwise tree), computed here in float64 numpy on
inputs built so that a different lane grouping changes the output bits (the negative control).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from distopt import ops

from cpu_paths import _C, ALL_ISAS, ISAS, RUNS, compiled_cpu_kernels, threads_and_isa  # noqa: F401 (a fixture)
from op_helpers import BF16, FP16, FP32, scalar

pytestmark = pytest.mark.usefixtures("compiled_cpu_kernels")
DTYPES = [pytest.param(d, id=str(d).removeprefix("torch.")) for d in (FP32, BF16, FP16)]


def cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux reports them (an oracle independent of the extension's check)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def one_call_of_each_op() -> dict[str, Callable[[], object]]:
    n = 70_001  # a few parallel ranges
    p, g, m, v, out = torch.randn(n), torch.randn(n), torch.zeros(n), torch.ones(n), torch.empty(n, dtype=BF16)
    return {
        "adam_step_": lambda: ops.adam_step_([p], [g], [m], [v], lr=1e-3, step=1, param_outs=[out]),
        "l2norm": lambda: ops.l2norm([g.bfloat16(), p.bfloat16()]),
        "scale_": lambda: ops.scale_([g], [m], scalar(0.5)),
        "cast_copy_": lambda: ops.cast_copy_([g], [out]),
    }


@pytest.mark.skipif(not cpu_flags() or os.uname().machine != "x86_64", reason="needs x86-64 Linux /proc/cpuinfo")
def test_default_isa_is_the_best_the_cpu_flags_allow():
    flags = cpu_flags()
    expected = "baseline"
    if "avx2" in flags:
        expected = "avx2"
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        expected = "avx512"
    assert _C.best_cpu_isa() == expected
    with threads_and_isa(1, None):
        assert _C.cpu_isa() == expected
    with threads_and_isa(1, "auto"):
        assert _C.cpu_isa() == expected


def test_vbmi_8bit_read_on_the_default_path_only():
    """The default path reads 8-bit moments with AVX512-VBMI where the CPU has it; a forced avx512 leaves
    it out, so the ISA comparisons of test_cpu_kernels.py run both versions of that read."""
    with threads_and_isa(1, None):
        assert _C.cpu_vbmi() == ("avx512vbmi" in cpu_flags() and _C.best_cpu_isa() == "avx512")
    for isa in ISAS:
        with threads_and_isa(1, isa):
            assert not _C.cpu_vbmi(), isa


@pytest.mark.parametrize("isa", [None, *ALL_ISAS], ids=lambda i: i or "default")
def test_each_isa_runs_its_own_compiled_copy(isa):
    """Forcing a path makes every op's ranges run in that path's copy and no other (the counts the
    extension keeps per copy); the default runs the best one. The counts of the paths not chosen are
    the negative control: a dispatch that ignored the choice would move them."""
    if isa is not None and isa not in ISAS:
        pytest.skip(f"this CPU has no {isa} path (best: {_C.best_cpu_isa()})")
    expected = isa or _C.best_cpu_isa()
    for name, call in one_call_of_each_op().items():
        with threads_and_isa(2, isa):
            assert _C.cpu_isa() == expected
            before = _C.cpu_isa_runs()
            call()
            after = _C.cpu_isa_runs()
        ran = {path: after[path] - before[path] for path in ALL_ISAS}
        assert ran[expected] >= 1 and sum(ran.values()) == ran[expected], (name, isa, ran)


def test_forcing_an_unknown_isa_raises_before_writing():
    out = torch.zeros(10, dtype=BF16)
    with threads_and_isa(1, "avx1024"), pytest.raises(ValueError, match="expected auto, baseline, avx2 or avx512"):
        ops.cast_copy_([torch.ones(10)], [out])
    assert torch.equal(out, torch.zeros(10, dtype=BF16))


@pytest.mark.skipif(ISAS == ALL_ISAS, reason="this CPU has every path: none to refuse")
def test_forcing_a_path_the_cpu_lacks_raises():
    missing = ALL_ISAS[len(ISAS)]
    with threads_and_isa(1, missing), pytest.raises(ValueError, match=f"no {missing} path"):
        ops.l2norm([torch.ones(10)])


# The fp32 magnitudes around which a cast starts storing inf: bf16 rounds 0x7f7f8000 (halfway to inf)
# up, fp16 rounds 65520 (0x477ff000) up; plus fp32's inf and NaN.
EDGE_BITS = {
    BF16: (0x7F7F7FFF, 0x7F7F8000, 0x7F7F8001, 0x7F7FFFFF),
    FP16: (0x477FEFFF, 0x477FF000, 0x477FF001, 0x477FFFFF, 0x47800000),
    FP32: (0x7F7FFFFF,),
}


@pytest.mark.parametrize("out_dtype", DTYPES)
def test_scale_flags_exactly_the_outputs_that_overflow(out_dtype):
    """found_inf is raised iff a stored output is inf/nan, also right at each format's overflow edge
    (the kernels decide it from the fp32 value, before narrowing), on every path."""
    patterns = [*EDGE_BITS[out_dtype], 0x7F800000, 0x7FC00000, 0x3F800000]
    signed = [b - 2**32 if b >= 2**31 else b for p in patterns for b in (p, p | 0x80000000)]
    outcomes = set()
    for isa in ISAS:
        for pattern in signed:
            x = torch.randn(40_000)  # the edge value inside a vectorised loop, not only in a tail
            x.view(torch.int32)[12_345] = pattern
            out, flag = torch.empty(x.shape, dtype=out_dtype), scalar(0.0)
            with threads_and_isa(1, isa):
                ops.scale_([x], [out], scalar(1.0), flag)
            stored_nonfinite = not torch.isfinite(out[12_345]).item()
            assert flag.item() == float(stored_nonfinite), (isa, hex(pattern & 0xFFFFFFFF), out_dtype)
            outcomes.add(stored_nonfinite)
    assert outcomes == {True, False}  # the edges were met from both sides


@pytest.mark.parametrize("dtype", [FP32, BF16], ids=["float32", "bfloat16"])
def test_l2norm_flag_ignores_finite_elements_whose_square_overflows(dtype):
    """A finite element whose fp32 square overflows makes the norm inf without raising found_inf (as
    the reference); an inf/nan elsewhere still raises it. On every path and thread count."""
    x = torch.randn(100_003).to(dtype)
    x[5000] = 1e30
    for threads, isa in RUNS:
        flag = scalar(0.0)
        with threads_and_isa(threads, isa):
            total, _ = ops.l2norm([x], flag)
        assert flag.item() == 0.0 and math.isinf(total.item()), (threads, isa)
        y = x.clone()
        y[90_000] = math.nan
        with threads_and_isa(threads, isa):
            ops.l2norm([y], flag)
        assert flag.item() == 1.0, (threads, isa)


# ----------------------------------------------------------------------------------------------------
# l2norm against its documented algorithm (csrc/cpu/l2norm.cpp)
# ----------------------------------------------------------------------------------------------------

BLOCK, LANES = 4096, 16


def block_sum(squares: np.ndarray, lanes: int = LANES) -> np.float64:
    """One block: element j's square into lane j % lanes, each lane summed in element order (float64),
    then the lanes in the pairwise tree (k += k + width, width 8, 4, 2, 1). ``lanes=32`` is a plausible
    bug (a loop unrolled into two accumulators whose lanes k and k+16 are added first)."""
    rows = np.concatenate([squares, np.zeros((-len(squares)) % lanes)]).reshape(-1, lanes)
    acc = list(np.add.accumulate(rows, axis=0)[-1])  # accumulate adds row after row, in order
    if lanes == 2 * LANES:
        acc = [acc[k] + acc[k + LANES] for k in range(LANES)]
    width = LANES // 2
    while width:
        for k in range(width):
            acc[k] = acc[k] + acc[k + width]
        width //= 2
    return acc[0]


def spec_l2norm(tensors: list[torch.Tensor], lanes: int = LANES) -> tuple[np.float32, list[np.float32]]:
    """(total, per_tensor): fp32 squares; per tensor the block sums in order; per_tensor =
    fp32(sqrt(sum)); total = fp32(sqrt(sum of the fp32-rounded per-tensor sums, in order))."""
    total, per = np.float64(0.0), []
    for t in tensors:
        x = t.float().numpy()
        squares = (x * x).astype(np.float64)  # the fp32 product, widened
        s = np.float64(0.0)
        for b in range(0, len(squares), BLOCK):
            s = s + block_sum(squares[b : b + BLOCK], lanes)
        per.append(np.float32(np.sqrt(s)))
        total = total + np.float64(np.float32(s))
    return np.float32(np.sqrt(total)), per


def grouping_sensitive_inputs() -> list[torch.Tensor]:
    """Lane 0 gets 1, then eight squares of 2^-54 that a sequential lane loses (each is a quarter of
    1's double ulp) but a regrouped sum keeps; lane 1 gets 2^-24, which puts the per-tensor sum on an
    fp32 rounding tie; the second tensor (searched once) puts the total where that tie decides its
    last bit."""
    a = torch.zeros(200)
    a[0], a[1] = 1.0, 2.0**-12
    a[16::16][:8] = 2.0**-27
    b = torch.tensor([float.fromhex("0x1.1f77b8p-1")])
    return [a, b]


def assert_l2norm_is_spec(tensors: list[torch.Tensor]) -> None:
    total, per = spec_l2norm(tensors)
    for threads, isa in RUNS:
        with threads_and_isa(threads, isa):
            got_total, got_per = ops.l2norm(tensors)
        assert got_total.item() == total, (threads, isa)
        assert got_per.numpy().tolist() == [float(p) for p in per], (threads, isa)


def test_l2norm_bits_are_the_documented_grouping():
    tensors = grouping_sensitive_inputs()
    # Negative control: these inputs tell the documented grouping from a regrouped one.
    assert spec_l2norm(tensors, lanes=2 * LANES)[0] != spec_l2norm(tensors)[0]
    assert_l2norm_is_spec(tensors)


@pytest.mark.parametrize("dtype", [FP32, BF16], ids=["float32", "bfloat16"])
def test_l2norm_bits_are_the_documented_algorithm(dtype):
    """Random values over a wide range, sizes around the lanes and blocks."""
    torch.manual_seed(6)
    sizes = (1, 15, 16, 17, 4095, 4096, 4097, 40_000)
    assert_l2norm_is_spec([(torch.randn(n) * torch.rand(n).pow(8) * 1e3).to(dtype) for n in sizes])
