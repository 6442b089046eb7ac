"""tools/check_wheel.py, the CI gate on the wheel: it passes the modules built from this checkout and
catches a module that uses torch's C++ API, needs libc10 or is not named for the limited API (negative
controls, built here from a few lines of C++)."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from torch.utils import cpp_extension

import distopt

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import check_wheel  # noqa: E402

pytestmark = pytest.mark.skipif(
    not all(shutil.which(tool) for tool in ("g++", "nm", "readelf")), reason="needs g++ and binutils"
)

# Calls c10's C++ API (an undefined mangled c10:: symbol), the way a full-API binding would.
BAD_SOURCE = """
namespace c10 { int get_thread_count(int); }
extern "C" int uses_cxx(int x) { return c10::get_thread_count(x); }
"""
GOOD_SOURCE = """
extern "C" int aoti_torch_get_numel(void*, long*);
extern "C" long uses_shim(void* t) { long n = 0; aoti_torch_get_numel(t, &n); return n; }
"""


def build_so(tmp_path: Path, name: str, source: str, *libs: str) -> Path:
    src = tmp_path / f"{name}.cpp"
    src.write_text(source)
    out = tmp_path / name
    lib_dirs = [f"-L{d}" for d in cpp_extension.library_paths()]
    subprocess.run(["g++", "-shared", "-fPIC", str(src), "-o", str(out), *lib_dirs, *libs], check=True)
    return out


def test_the_built_modules_pass():
    modules = sorted(Path(distopt.__file__).parent.glob("_C*.so"))
    modules = [m for m in modules if "_C_emulated" not in m.name]  # test-only, full C++ API on purpose
    if not modules:
        pytest.skip("distopt has no compiled module here")
    assert check_wheel.main([str(m) for m in modules]) == 0


def test_a_stable_abi_module_passes(tmp_path):
    so = build_so(tmp_path, "_C.abi3.so", GOOD_SOURCE, "-ltorch_cpu")
    assert check_wheel.check_module(so) == []


def test_cxx_symbols_are_caught(tmp_path):
    so = build_so(tmp_path, "_C.abi3.so", BAD_SOURCE)
    problems = check_wheel.check_module(so)
    assert len(problems) == 1 and "torch C++ symbols" in problems[0] and "get_thread_count" in problems[0]


def test_libc10_and_a_versioned_name_are_caught(tmp_path):
    so = build_so(tmp_path, "_C.cpython-311-x86_64-linux-gnu.so", GOOD_SOURCE, "-Wl,--no-as-needed", "-lc10")
    problems = check_wheel.check_module(so)
    assert any("expected *.abi3.so" in p for p in problems), problems
    assert any("needs libc10.so" in p for p in problems), problems


def test_a_wheel_without_the_abi3_tag_is_caught(tmp_path, capsys):
    so = build_so(tmp_path, "_C.abi3.so", BAD_SOURCE)
    wheel = tmp_path / "distopt-0.1.0-cp311-cp311-linux_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.write(so, "distopt/_C.abi3.so")
    assert check_wheel.main([str(wheel)]) == 1
    err = capsys.readouterr().err
    assert "not tagged abi3" in err and "distopt/_C.abi3.so: 1 undefined torch C++ symbols" in err


def nvcc_module(tmp_path: Path, name: str, *gencode: str) -> Path:
    """A shared library holding a one-line kernel compiled for the given -gencode targets."""
    import build_config  # on sys.path through check_wheel

    home = build_config.find_cuda_home()
    if home is None:
        pytest.skip("needs nvcc")
    src = tmp_path / "k.cu"
    src.write_text("__global__ void k(float* x) { x[threadIdx.x] *= 2.f; }\n")
    out = tmp_path / name
    flags = ["-shared", "-Xcompiler=-fPIC", *(f"-gencode={g}" for g in gencode)]
    subprocess.run([f"{home}/bin/nvcc", *flags, str(src), "-o", str(out)], check=True)
    return out


def test_gpu_code_is_read_from_the_fatbin(tmp_path):
    so = nvcc_module(tmp_path, "_C_cuda.abi3.so",
                     "arch=compute_80,code=sm_80", "arch=compute_90,code=[sm_90,compute_90]")
    assert check_wheel.cuda_code(so) == {"sm_80", "sm_90", "compute_90"}
    assert check_wheel.check_cuda_code(so, "8.0;9.0+PTX") == []
    problems = check_wheel.check_cuda_code(so, "8.0;9.0;10.0+PTX")
    assert len(problems) == 1 and "no GPU code for compute_100, sm_100" in problems[0], problems


def test_require_cuda_catches_a_wheel_short_of_architectures(tmp_path, capsys):
    so = nvcc_module(tmp_path, "_C_cuda.abi3.so", "arch=compute_90,code=sm_90")
    wheel = tmp_path / "distopt-0.1.0-cp310-abi3-linux_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.write(so, "distopt/_C_cuda.abi3.so")
    assert check_wheel.main(["--require-cuda", "--cuda-archs", "9.0", str(wheel)]) == 0
    assert check_wheel.main(["--require-cuda", str(wheel)]) == 1
    expected = f"no GPU code for compute_100, sm_100, sm_80 (expected {check_wheel.DEFAULT_CUDA_ARCHS})"
    assert expected in capsys.readouterr().err


def test_require_cuda_catches_a_wheel_without_cuda_kernels(tmp_path, capsys):
    so = build_so(tmp_path, "_C.abi3.so", GOOD_SOURCE, "-ltorch_cpu")
    wheel = tmp_path / "distopt-0.1.0-cp310-abi3-linux_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.write(so, "distopt/_C.abi3.so")
    assert check_wheel.main([str(wheel)]) == 0
    assert check_wheel.main(["--require-cuda", str(wheel)]) == 1
    assert "holds no distopt._C_cuda" in capsys.readouterr().err
