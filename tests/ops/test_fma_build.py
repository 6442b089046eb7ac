"""The CPU kernels stay bit-identical when compiled for an FMA host (Note [Host/device bit-identity]).

The GPU build runs with --fmad=false; the host build's counterpart is -ffp-contract=off
(csrc/build_config.py). This test compiles the CPU kernel sources again with -mfma added to the
project's host flags (what -march=x86-64-v3 or an aarch64 host would give), behind a small C shim
(tests/native/cpu_kernels_shim.cpp), and compares their outputs with distopt._C's bit for bit.
Negative control: the same build with -ffp-contract=fast, which lets the compiler fuse a * b + c, must
give different Adam bits, so the comparison can tell a contracted build from an uncontracted one.

The builds compile what the comparisons run, no more, each translation unit once and concurrently where
there are cores: the -mfma build every CPU kernel source but adam_states.cpp (the low-precision-moment
loops, which the shim never reaches: it passes fp32 moments only; ~85% of a full build's compile time),
the negative control adam.cpp alone, linked with the -mfma build's other objects.
"""

from __future__ import annotations

import ctypes
import os
import platform
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from torch import Tensor

from distopt import ops

from op_helpers import BF16, FP16, FP32, INT16, assert_bits_equal, make_adam_state, run_adam, scalar

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "csrc"))
import build_config  # noqa: E402

DTYPE_CODE = {FP32: 0, FP16: 1, BF16: 2, INT16: 3}  # distopt::DType
SIZES = (1, 7, 16, 17, 4097, 33_001, 70_001)
HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, adam_w_mode=True)
STEP, GRAD_SCALE = 3, 0.37

pytestmark = pytest.mark.slow  # compiles the kernels: ~30 s on 2 idle cores, ~50 s on one


def host_has_fma() -> bool:
    try:
        return " fma " in Path("/proc/cpuinfo").read_text().replace("\n", " ")
    except OSError:
        return False


def skip_reason() -> str | None:
    if platform.machine() != "x86_64":
        return f"-mfma is an x86-64 flag ({platform.machine()} hosts have FMA in every build)"
    if not host_has_fma():
        return "this CPU has no FMA: an -mfma build could not run here"
    if shutil.which("g++") is None:
        return "no g++ to compile the kernels with"
    if not all((op, "CPU") in ops.COMPILED_KERNELS for op in ("adam_step_", "l2norm", "scale_")):
        return "distopt._C has no compiled CPU kernels to compare with"
    return None


# Left out of the shim's builds (the shim stands in for its one entry point, adam_states_cpu).
STATES_SOURCE = "csrc/cpu/adam_states.cpp"
ADAM_SOURCE = "csrc/cpu/adam.cpp"  # the fp32-moment update: all the Adam math the comparison runs
SHIM_SOURCE = "tests/native/cpu_kernels_shim.cpp"


def kernel_sources() -> list[str]:
    cpu = [s for s in build_config.CPU_SOURCES if s.startswith("csrc/cpu/")]
    # Both named as the build names them: a renamed file fails here rather than going unbuilt or built twice.
    assert STATES_SOURCE in cpu and ADAM_SOURCE in cpu, cpu
    return [s for s in cpu if s != STATES_SOURCE] + [SHIM_SOURCE]


def compile_object(source: str, out: Path, extra_flags: list[str]) -> Path:
    """One translation unit with the project's host flags plus ``extra_flags``."""
    from torch.utils.cpp_extension import include_paths

    cmd = ["g++", f"-std=c++{build_config.cxx_standard()}", "-c", "-fPIC", *build_config.CXX_FLAGS, *extra_flags]
    # Hidden (and bound locally by link()), so the library cannot pick up distopt._C's kernels (same names).
    cmd += ["-fvisibility=hidden", f"-I{ROOT / 'csrc'}", *(f"-I{p}" for p in include_paths())]
    cmd += [str(ROOT / source), "-o", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stderr[-4000:]}"
    return out


def link(objects: list[Path], out: Path) -> ctypes.CDLL:
    """The objects as a shared library, its symbols bound locally. Where two objects hold the same inline
    function, the linker keeps the first one's: the negative control puts its contracted adam.o first."""
    cmd = ["g++", "-shared", "-fPIC", "-Wl,-Bsymbolic", *map(str, objects), "-o", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stderr[-4000:]}"
    return ctypes.CDLL(str(out))


@pytest.fixture(scope="module")
def libs(tmp_path_factory) -> dict[str, ctypes.CDLL]:
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    tmp = tmp_path_factory.mktemp("fma_build")
    sources = kernel_sources()
    jobs = {("fma", s): ["-mfma"] for s in sources}
    jobs[("contracted", ADAM_SOURCE)] = ["-mfma", "-ffp-contract=fast"]
    # One g++ per core, the two adam.cpp compiles (most of the time) first.
    order = sorted(jobs, key=lambda job: job[1] != ADAM_SOURCE)
    with ThreadPoolExecutor(max_workers=len(os.sched_getaffinity(0))) as pool:
        futures = {job: pool.submit(compile_object, job[1], tmp / f"{job[0]}-{Path(job[1]).stem}.o", jobs[job])
                   for job in order}  # fmt: skip
        objects = {job: future.result() for job, future in futures.items()}
    fma = [objects[("fma", s)] for s in sources]
    contracted = [objects[("contracted", ADAM_SOURCE)]] + [objects[("fma", s)] for s in sources if s != ADAM_SOURCE]
    return {"fma": link(fma, tmp / "kernels_fma.so"), "fma_contracted": link(contracted, tmp / "kernels_contract.so")}


def pointers(tensors: list[Tensor]):
    return (ctypes.c_void_p * max(len(tensors), 1))(*[t.data_ptr() for t in tensors])


def numels(tensors: list[Tensor]):
    return (ctypes.c_int64 * len(tensors))(*[t.numel() for t in tensors])


def shim_adam(lib: ctypes.CDLL, state) -> None:
    lists = state.lists()
    arrays = (ctypes.POINTER(ctypes.c_void_p) * 6)(
        *[ctypes.cast(pointers(lst), ctypes.POINTER(ctypes.c_void_p)) if lst else None for lst in lists]
    )
    dtypes = (ctypes.c_int * 6)(*[DTYPE_CODE[lst[0].dtype] if lst else 0 for lst in lists])
    scale = scalar(GRAD_SCALE)
    h = HYPER
    lib.shim_adam(
        arrays, dtypes, numels(state.params), ctypes.c_int64(len(state.params)), ctypes.c_double(h["lr"]),
        ctypes.c_double(h["beta1"]), ctypes.c_double(h["beta2"]), ctypes.c_double(h["eps"]),
        ctypes.c_double(h["weight_decay"]), ctypes.c_int(int(h["adam_w_mode"])), ctypes.c_double(STEP),
        ctypes.c_void_p(scale.data_ptr()),
    )  # fmt: skip


ADAM_MIXES = [
    pytest.param(FP32, FP32, None, False, id="fp32"),
    pytest.param(FP32, BF16, BF16, False, id="fp32_master-bf16"),
    pytest.param(FP32, FP16, FP16, False, id="fp32_master-fp16"),
    pytest.param(BF16, BF16, FP16, True, id="bf16_remainders"),
]


@pytest.mark.parametrize("param_dtype,grad_dtype,out_dtype,remainders", ADAM_MIXES)
def test_adam_fma_build_is_bit_identical(libs, param_dtype, grad_dtype, out_dtype, remainders):
    torch.manual_seed(0)
    state = make_adam_state(SIZES, param_dtype, grad_dtype, out_dtype, remainders=remainders)
    expected, fma, contracted = state.clone(), state.clone(), state.clone()
    run_adam(expected, step=STEP, grad_scale=scalar(GRAD_SCALE), maximize=False, **HYPER)
    shim_adam(libs["fma"], fma)
    shim_adam(libs["fma_contracted"], contracted)
    for name, lst in expected.written().items():
        for i, (a, e) in enumerate(zip(getattr(fma, name), lst)):
            assert_bits_equal(a, e, f"-mfma build: {name}[{i}]")
    # Negative control: contraction changes the exp_avg_sq and param bits somewhere.
    differs = any(not torch.equal(a, e) for a, e in zip(contracted.all_tensors(), expected.all_tensors()))
    assert differs, "an -ffp-contract=fast build gave the same bits: the comparison proves nothing"


@pytest.mark.parametrize("in_dtype,out_dtype", [(FP32, BF16), (FP16, FP32), (BF16, FP16), (FP32, FP32)])
def test_scale_fma_build_is_bit_identical(libs, in_dtype, out_dtype):
    torch.manual_seed(1)
    inputs = [(torch.randn(n) * 1e3).to(in_dtype) for n in SIZES]
    inputs[-1][::101] = float("nan")
    expected = [torch.zeros(n, dtype=out_dtype) for n in SIZES]
    got = [torch.zeros(n, dtype=out_dtype) for n in SIZES]
    flag, got_flag = scalar(0.0), scalar(0.0)
    ops.scale_(inputs, expected, scalar(GRAD_SCALE), flag)
    scale = scalar(GRAD_SCALE)
    libs["fma"].shim_scale(
        pointers(inputs), DTYPE_CODE[in_dtype], pointers(got), DTYPE_CODE[out_dtype], numels(inputs),
        ctypes.c_int64(len(inputs)), ctypes.c_void_p(scale.data_ptr()), ctypes.c_void_p(got_flag.data_ptr()),
    )  # fmt: skip
    for i, (a, e) in enumerate(zip(got, expected)):
        assert_bits_equal(a, e, f"-mfma build: outputs[{i}]")
    assert got_flag.item() == flag.item() == 1.0


@pytest.mark.parametrize("dtype", [FP32, BF16, FP16])
def test_l2norm_fma_build_is_bit_identical(libs, dtype):
    torch.manual_seed(2)
    tensors = [torch.randn(n).to(dtype) for n in SIZES]
    total, per_tensor = ops.l2norm(tensors)
    got_total, got_per, flag = torch.zeros(1), torch.zeros(len(tensors)), scalar(0.0)
    libs["fma"].shim_l2norm(
        pointers(tensors), DTYPE_CODE[dtype], numels(tensors), ctypes.c_int64(len(tensors)),
        ctypes.c_void_p(got_total.data_ptr()), ctypes.c_void_p(got_per.data_ptr()), ctypes.c_void_p(flag.data_ptr()),
    )  # fmt: skip
    assert_bits_equal(got_per, per_tensor, "-mfma build: per-tensor norms")
    assert_bits_equal(got_total[0], total.reshape(()), "-mfma build: total norm")
    assert flag.item() == 0.0
