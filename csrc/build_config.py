"""The one description of how ``distopt._C`` is built: sources, flags, CUDA choice.

setup.py imports it; CMakeLists.txt runs ``python csrc/build_config.py --cmake FILE`` and includes the
result, so the two builds cannot drift apart.

Environment:
  DISTOPT_BUILD_CUDA   auto (default): build the CUDA kernels when torch is a CUDA build and nvcc is
                       found, whether or not a GPU is visible. 1: require them. 0: CPU kernels only.
  TORCH_CUDA_ARCH_LIST architectures to compile for; default "8.0;9.0+PTX" (A100, H100, and PTX that
                       newer GPUs JIT-compile). Must be set when no GPU is visible, else torch guesses.
  CUDA_HOME            the toolkit; found from nvcc or /usr/local/cuda when unset.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

CSRC = Path(__file__).resolve().parent
ROOT = CSRC.parent
DEFAULT_CUDA_ARCHS = "8.0;9.0+PTX"

# Host code: the binding layer, the registration and the CPU kernels.
CPU_SOURCES = sorted(str(p.relative_to(ROOT)) for p in [*CSRC.glob("*.cpp"), *CSRC.glob("cpu/*.cpp")])
CUDA_SOURCES = sorted(str(p.relative_to(ROOT)) for p in CSRC.glob("cuda/*.cu"))

# -fno-math-errno: sqrtf needs no errno branch, so the CPU Adam loop vectorizes (same results).
CXX_FLAGS = ["-O3", "-fno-math-errno", "-Wall", "-Wextra", "-Wno-unused-parameter"]
# --fmad=false: no fused multiply-add contraction, so the shared math in csrc/math gives the same
# bits on the GPU as in the CPU kernels that the tests run (the kernels are memory bound: no cost).
NVCC_FLAGS = ["-O3", "--fmad=false", "-lineinfo", "-Xcompiler=-Wall"]


def find_cuda_home() -> str | None:
    """The CUDA toolkit root: $CUDA_HOME/$CUDA_PATH, else the one holding nvcc's headers."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        # /usr/local/bin/nvcc may be a wrapper script: its parent is then not the toolkit.
        candidates.append(str(Path(os.path.realpath(nvcc)).parent.parent))
    candidates.append("/usr/local/cuda")
    for home in candidates:
        if home and (Path(home) / "bin" / "nvcc").exists() and (Path(home) / "include" / "cuda_runtime.h").exists():
            return home
    return None


def cuda_requested() -> bool:
    """Whether to build the CUDA kernels (see DISTOPT_BUILD_CUDA above); raises if 1 cannot be met."""
    import torch

    mode = os.environ.get("DISTOPT_BUILD_CUDA", "auto").strip().lower()
    if mode not in ("auto", "0", "1"):
        raise SystemExit(f"DISTOPT_BUILD_CUDA must be auto, 0 or 1, got {mode!r}")
    if mode == "0":
        return False
    problems = []
    if torch.version.cuda is None:
        problems.append(f"torch {torch.__version__} is not a CUDA build")
    if find_cuda_home() is None:
        problems.append("no CUDA toolkit (nvcc + headers) found: set CUDA_HOME")
    if problems and mode == "1":
        raise SystemExit("DISTOPT_BUILD_CUDA=1 but the CUDA kernels cannot be built: " + "; ".join(problems))
    return not problems


def prepare_environment(with_cuda: bool) -> None:
    """Sets CUDA_HOME and the arch list before torch.utils.cpp_extension reads them."""
    home = find_cuda_home()
    if home:
        # Overwrite rather than setdefault: an invalid $CUDA_HOME (find_cuda_home skipped it, e.g. the
        # /usr/local torch guesses from a wrapper nvcc) would otherwise break linking (-lcudart).
        os.environ["CUDA_HOME"] = home
    if with_cuda:
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_CUDA_ARCHS)
    if "torch.utils.cpp_extension" in sys.modules:
        # CUDA_HOME is read when cpp_extension is imported.
        sys.modules["torch.utils.cpp_extension"].CUDA_HOME = os.environ.get("CUDA_HOME") or None


def extension_kwargs(with_cuda: bool) -> dict:
    """Keyword arguments for torch.utils.cpp_extension.CppExtension/CUDAExtension."""
    sources = CPU_SOURCES + (CUDA_SOURCES if with_cuda else [])
    macros = [("DISTOPT_WITH_CUDA", "1")] if with_cuda else []
    extra = {"cxx": list(CXX_FLAGS)}
    if with_cuda:
        extra["nvcc"] = list(NVCC_FLAGS)
    return {"sources": sources, "define_macros": macros, "extra_compile_args": extra}


def cxx_standard() -> int:
    """The C++ standard torch's extension builder picks (torch 2.14+ headers need C++20)."""
    import torch

    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    return 20 if (major, minor) >= (2, 14) else 17


def write_cmake(path: Path) -> None:
    """Everything CMakeLists.txt needs, as CMake `set()` lines."""
    with_cuda = cuda_requested()
    prepare_environment(with_cuda)
    import sysconfig

    import torch
    from torch.utils import cpp_extension as ce

    kw = extension_kwargs(with_cuda)
    device = "cuda" if with_cuda else "cpu"
    libs = ["c10", "torch", "torch_cpu", "torch_python"] + (["c10_cuda", "torch_cuda", "cudart"] if with_cuda else [])
    lib_dirs = ce.library_paths(device_type=device)
    defines = [f"{k}={v}" for k, v in kw["define_macros"]] + [
        "TORCH_EXTENSION_NAME=_C",
        "TORCH_API_INCLUDE_EXTENSION_H",
        f"_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
    ]
    # COMMON_NVCC_FLAGS and _get_cuda_arch_flags are what BuildExtension itself passes to nvcc (the
    # latter is private; present from torch 2.0 through 2.15). Each flag must stay one token: CMake
    # de-duplicates compile options, which would mangle two-token flags.
    nvcc = ce.COMMON_NVCC_FLAGS + kw["extra_compile_args"].get("nvcc", [])
    if with_cuda:
        nvcc += ce._get_cuda_arch_flags([])

    def cm(values) -> str:
        """A CMake list inside a double-quoted string."""
        escaped = (str(v).replace("\\", "\\\\").replace('"', '\\"').replace("$", "\\$").replace(";", "\\;")
                   for v in values)
        return ";".join(escaped)

    lines = {
        "DISTOPT_WITH_CUDA": "ON" if with_cuda else "OFF",
        "DISTOPT_CUDA_HOME": os.environ.get("CUDA_HOME", "") if with_cuda else "",
        "DISTOPT_CXX_STANDARD": cxx_standard(),
        "DISTOPT_CXX_SOURCES": cm(ROOT / s for s in CPU_SOURCES),
        "DISTOPT_CUDA_SOURCES": cm(ROOT / s for s in (CUDA_SOURCES if with_cuda else [])),
        "DISTOPT_CXX_FLAGS": cm(kw["extra_compile_args"]["cxx"]),
        "DISTOPT_NVCC_FLAGS": cm(nvcc),
        "DISTOPT_DEFINES": cm(defines),
        "DISTOPT_INCLUDE_DIRS": cm(ce.include_paths(device_type=device) + [sysconfig.get_paths()["include"]]),
        "DISTOPT_LIBRARY_DIRS": cm(lib_dirs),
        "DISTOPT_LIBRARIES": cm(libs),
        "DISTOPT_EXT_SUFFIX": sysconfig.get_config_var("EXT_SUFFIX"),
    }
    path.write_text("".join(f'set({k} "{v}")\n' for k, v in lines.items()))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cmake", type=Path, required=True, help="write CMake settings to this file")
    write_cmake(parser.parse_args().cmake)
