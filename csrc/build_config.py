"""The one description of how distopt's compiled modules are built: sources, flags, CUDA choice.

setup.py imports it; CMakeLists.txt runs ``python csrc/build_config.py --cmake FILE`` and includes the
result, so the two builds cannot drift apart; the tests build distopt._C_emulated from it.

The modules:
  distopt._C        the CPU kernels (csrc/cpu), registered for CPU tensors.
  distopt._C_cuda   the CUDA kernels (csrc/cuda), registered for CUDA tensors: a module of its own because
                    it links libtorch_cuda (the current stream), which a CPU-only torch does not have.
Both use only LibTorch's stable ABI (torch/csrc/stable, torch/headeronly: TORCH_TARGET_VERSION below) and
Python's limited API (Py_LIMITED_API, cp310), so one abi3 build loads under every torch >= TORCH_TARGET and
every CPython >= 3.10, whichever torch compiled it. The CUDA runtime is linked statically: the module does
not depend on the CUDA version of the user's torch (it needs a driver for this toolkit's CUDA version).
  distopt._C_emulated
                    test-only, never installed: the CUDA kernels built for the CPU SIMT emulator (see
                    EMULATED_* below); tests/ops/backends.py builds it on first use.

Local builds and wheel builds. The CUDA kernels take most of a build's time (minutes per GPU
architecture on a small machine), so what is compiled depends on what the build is for:
  a wheel        `pip wheel .`, `pip install .` (pip builds a wheel, then installs it), `python -m build`,
                 CI (.ci/run): a file that may run on any machine, so distopt._C_cuda is built for every
                 supported architecture, DEFAULT_CUDA_ARCHS, whether or not this machine has a GPU.
  a local build  `pip install -e .` (what `make train` and `make test` run), `python setup.py
                 build_ext --inplace`, CMake: modules for this checkout on this machine, so
                 distopt._C_cuda is built for the GPUs this machine can see (torch's own default when
                 TORCH_CUDA_ARCH_LIST is unset: each visible GPU's architecture, the newest with PTX),
                 and not at all when it sees none: the build says so in one line, and how to build them.
setup.py tells the two apart by the setuptools command that builds the modules: build_ext run in place
(``--inplace``, or in editable mode for `pip install -e .`) is a local build; any other (bdist_wheel)
builds a wheel. TORCH_CUDA_ARCH_LIST, when set, wins in both.

Both leave debug info out (SETUP_CXX_FLAGS' -g0 overrides Python's -g): it made up 20 of distopt._C's
25 MB and a third of its compile time. The CMake build follows CMAKE_BUILD_TYPE instead (Debug: -g).

Environment:
  DISTOPT_BUILD_CUDA   auto (default): build distopt._C_cuda when torch is a CUDA build and nvcc is found,
                       in a local build only if a GPU is visible or TORCH_CUDA_ARCH_LIST is set.
                       1: require it (a local build without a GPU then compiles DEFAULT_CUDA_ARCHS).
                       0: CPU kernels only.
  TORCH_CUDA_ARCH_LIST architectures to compile for, e.g. "9.0" or "8.0;9.0;10.0+PTX"; "native": the
                       visible GPUs'. Unset: DEFAULT_CUDA_ARCHS, "8.0;9.0;10.0+PTX" (A100, H100, B200,
                       and PTX that newer GPUs JIT-compile), in a wheel; the visible GPUs' in a local build.
  CUDA_HOME            the toolkit; found from nvcc or /usr/local/cuda when unset.
  DISTOPT_BUILD_EMULATED
                       auto (default): the tests build and use distopt._C_emulated on Linux x86-64 with
                       GCC. 1: require it. 0: skip it.
  MAX_JOBS             compile jobs at once (torch's extension builder; default: ninja's, the cores + 2).

``python csrc/build_config.py --plan`` prints the one line a local build starts with (the Makefile shows
it before `pip install -e .`, whose own output pip hides).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
from pathlib import Path
from typing import NamedTuple

CSRC = Path(__file__).resolve().parent
ROOT = CSRC.parent
DEFAULT_CUDA_ARCHS = "8.0;9.0;10.0+PTX"

# The oldest torch whose stable ABI the modules use: headers of a newer torch expose only what this one
# has. Raise it (and pyproject's torch>=) only for a stable-ABI piece that arrived later.
TORCH_TARGET = (2, 11)
STABLE_ABI_MACROS = [("TORCH_TARGET_VERSION", f"0x{TORCH_TARGET[0]:02x}{TORCH_TARGET[1]:02x}000000000000")]
PY_LIMITED_API = "cp310"  # the wheel tag; torch's extension builder defines Py_LIMITED_API=0x030A0000
PY_LIMITED_API_HEX = "0x030A0000"


def _sources(*patterns: str) -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for pattern in patterns for p in CSRC.glob(pattern))


# distopt._C: the binding layer, the CPU registration, the CPU kernels and their parallel_for.
CPU_SOURCES = _sources("binding.cpp", "parallel.cpp", "registration_cpu.cpp", "cpu/*.cpp")
# distopt._C_cuda: the binding layer, the CUDA registration and the CUDA kernels.
CUDA_SOURCES = _sources("binding.cpp", "registration_cuda.cpp", "cuda/*.cu")
CUDA_KERNEL_SOURCES = _sources("cuda/*.cu")

# -fno-math-errno: sqrtf needs no errno branch, so the CPU Adam loop vectorizes (same results).
# -fno-trapping-math: fp operations raise no traps the code relies on (none are enabled), so the
# compiler may compute both sides of a select, which the 16-bit conversions' loops need to vectorize;
# it changes no value (rounding, NaNs, infinities and signed zeros stay IEEE).
# -ffp-contract=off: --fmad=false's counterpart, so an FMA host (aarch64, -march=x86-64-v3) computes
# the shared math in csrc/math with the GPU's roundings instead of contracting it into FMAs.
CXX_FLAGS = [
    "-O3", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off",
    "-Wall", "-Wextra", "-Wno-unused-parameter",
]  # fmt: skip
# setup.py's builds only (after CXX_FLAGS): no debug info. Python's build flags, which the extension
# builder puts first, carry -g (nvcc gets none of them).
SETUP_CXX_FLAGS = ["-g0"]
# What the modules link: the stable ABI's C shim is in libtorch_cpu; the current CUDA stream in
# libtorch_cuda; the CUDA runtime is static (with what it needs), --exclude-libs keeping its symbols out of
# the module's exports. Nothing else of torch's (libc10 and libtorch export a few libstdc++ symbols, which
# the linker would otherwise bind there).
CPU_LIBRARIES = ["torch_cpu"]
CUDA_LIBRARIES = ["torch_cpu", "torch_cuda", "cudart_static", "rt", "dl", "pthread"]
CUDA_LINK_FLAGS = ["-Wl,--exclude-libs,ALL"]
# --fmad=false: no fused multiply-add contraction, so the shared math in csrc/math gives the same
# bits on the GPU as in the CPU kernels that the tests run (the kernels are memory bound: no cost).
NVCC_FLAGS = ["-O3", "--fmad=false", "-lineinfo", "-Xcompiler=-Wall"]


# distopt._C_emulated: the CUDA kernels (csrc/cuda/*.cu, unmodified) compiled as host C++ against the
# SIMT emulator (csrc/testing/simt/simt.h, test-only), behind the same binding layer, registered for CPU tensors as
# torch.ops.distopt_emulated.*. Each .cu is one translation unit, through a one-line wrapper generated
# in build/emulation (the extension builder hands every .cu to nvcc). The sanitizer flags make the
# compiler call hooks on every memory access, which the emulator implements (no sanitizer runtime is
# linked); -ffp-contract=off is --fmad=false's counterpart; -g1 gives its messages file:line.
EMULATION_DIR = CSRC / "testing" / "simt"
EMULATION_MODULE = str((EMULATION_DIR / "module.cpp").relative_to(ROOT))  # _C_emulated's Python module
EMULATION_RUNTIME = [s for s in _sources("testing/simt/*.cpp") if s != EMULATION_MODULE]
EMULATED_WRAPPER_DIR = ROOT / "build" / "emulation"
EMULATION_FLAGS = [
    "-O2", "-g1", "-fno-math-errno", "-ffp-contract=off",
    "-fsanitize=thread", "--param=tsan-instrument-func-entry-exit=0", "-fsanitize=alignment",
    "-Wall", "-Wextra", "-Wno-unused-parameter", "-Wno-unknown-pragmas",
    # Hidden: the __shared__ arrays of inline/template functions (block_sum's) would otherwise be
    # STB_GNU_UNIQUE symbols that the dynamic linker binds to one copy across all emulated modules,
    # outside the other modules' shared-memory range, so their accesses would go unchecked.
    "-fvisibility=hidden",
]  # fmt: skip
EMULATION_INCLUDE = str(EMULATION_DIR / "include")  # its cuda_runtime.h is the emulator: search it first


def host_compiler_is_gcc() -> bool:
    """Whether $CXX (else c++), the compiler the extension builder uses, is GCC."""
    import subprocess

    try:
        out = subprocess.run([os.environ.get("CXX", "c++"), "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return False
    return "Free Software Foundation" in out.stdout


def emulation_requested() -> bool:
    """Whether to build distopt._C_emulated (see DISTOPT_BUILD_EMULATED above); raises if 1 cannot be met."""
    import platform

    mode = os.environ.get("DISTOPT_BUILD_EMULATED", "auto").strip().lower()
    if mode not in ("auto", "0", "1"):
        raise SystemExit(f"DISTOPT_BUILD_EMULATED must be auto, 0 or 1, got {mode!r}")
    if mode == "0":
        return False
    # The hooks follow GCC's sanitizer ABI and ELF TLS; the fibers switch in x86-64 assembly (elsewhere
    # a slower ucontext fallback, which is untested: only with DISTOPT_BUILD_EMULATED=1).
    usable = sys.platform.startswith("linux") and host_compiler_is_gcc()
    if mode == "1" and not usable:
        raise SystemExit("DISTOPT_BUILD_EMULATED=1 needs Linux and GCC ($CXX)")
    return usable and (mode == "1" or platform.machine() == "x86_64")


def emulated_wrappers() -> list[str]:
    """Writes build/emulation/cuda_<name>.cpp for each csrc/cuda/<name>.cu; returns their paths."""
    EMULATED_WRAPPER_DIR.mkdir(parents=True, exist_ok=True)
    out = []
    for cu in CUDA_KERNEL_SOURCES:
        wrapper = EMULATED_WRAPPER_DIR / f"cuda_{Path(cu).stem}.cpp"
        include = os.path.relpath(ROOT / cu, EMULATED_WRAPPER_DIR)
        text = f'// Generated by csrc/build_config.py: {cu}, as host C++ for the SIMT emulator.\n#include "{include}"\n'
        if not wrapper.exists() or wrapper.read_text() != text:  # unchanged: no rebuild
            # Whole or not at all (a rename): two test runs of one checkout (CI's venvs) may write it at once.
            partial = wrapper.with_name(f"{wrapper.name}.{os.getpid()}")
            partial.write_text(text)
            os.replace(partial, wrapper)
        out.append(str(wrapper.relative_to(ROOT)))
    return out


def emulation_build_dir(name: str, torch_version: str) -> Path:
    """Where the tests build the test-only module `name` for one torch and Python: build/emulation/<name>-<tag>
    (one per version: several venvs' test runs may share a checkout, CI's at the same time)."""
    tag = f"torch{torch_version}-py{sys.version_info[0]}{sys.version_info[1]}".replace("+", "_")
    return EMULATED_WRAPPER_DIR / f"{name}-{tag}"


def emulated_extension_kwargs() -> dict:
    """Sources, include dirs, macros and flags of distopt._C_emulated (extension-builder keywords)."""
    sources = ["csrc/binding.cpp", "csrc/registration_cuda.cpp"] + EMULATION_RUNTIME + [EMULATION_MODULE]
    return {
        "sources": sources + emulated_wrappers(),
        "include_dirs": [EMULATION_INCLUDE],  # before torch's
        "define_macros": [("DISTOPT_EMULATED", "1"), *STABLE_ABI_MACROS],
        "extra_compile_args": {"cxx": list(EMULATION_FLAGS)},
    }


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


def _build_cuda_mode() -> str:
    mode = os.environ.get("DISTOPT_BUILD_CUDA", "auto").strip().lower()
    if mode not in ("auto", "0", "1"):
        raise SystemExit(f"DISTOPT_BUILD_CUDA must be auto, 0 or 1, got {mode!r}")
    return mode


def cuda_problems() -> list[str]:
    """Why the CUDA kernels cannot be built here (empty: they can)."""
    import torch

    problems = []
    if torch.version.cuda is None:
        problems.append(f"torch {torch.__version__} is not a CUDA build")
    if find_cuda_home() is None:
        problems.append("no CUDA toolkit (nvcc + headers) found: set CUDA_HOME")
    return problems


def cuda_requested() -> bool:
    """Whether the CUDA kernels may be built (see DISTOPT_BUILD_CUDA above: not 0, and a CUDA torch and
    nvcc are here); raises if 1 cannot be met. cuda_plan says whether this build compiles them."""
    mode = _build_cuda_mode()
    if mode == "0":
        return False
    problems = cuda_problems()
    if problems and mode == "1":
        raise SystemExit("DISTOPT_BUILD_CUDA=1 but the CUDA kernels cannot be built: " + "; ".join(problems))
    return not problems


def visible_gpu_archs() -> list[str]:
    """The architectures of the GPUs this process sees, as torch's extension builder picks them when
    TORCH_CUDA_ARCH_LIST is unset: each GPU's compute capability, capped at the newest torch itself was
    built for, in order, the newest also as PTX. Empty when no GPU is visible."""
    import torch

    try:
        count = torch.cuda.device_count()
    except Exception:  # noqa: BLE001 - a broken driver or runtime: no GPU to build for
        return []
    if count == 0:
        return []
    built = [int("".join(re.findall(r"\d+", a.split("_")[1]))) for a in torch.cuda.get_arch_list() if "sm_" in a]
    newest = max(((sm // 10, sm % 10) for sm in built), default=(99, 9))
    caps = sorted({min(tuple(torch.cuda.get_device_capability(i)), newest) for i in range(count)})
    archs = [f"{major}.{minor}" for major, minor in caps]
    archs[-1] += "+PTX"
    return archs


class CudaPlan(NamedTuple):  # not a dataclass: tools/gpu_budgets.py loads this file outside sys.modules
    """What one build does about distopt._C_cuda."""

    build: bool  # compile it
    arch_list: str = ""  # for these architectures (TORCH_CUDA_ARCH_LIST syntax)
    reason: str = ""  # for what (arch_list's origin), or why not


def cuda_plan(local: bool) -> CudaPlan:
    """Whether this build compiles the CUDA kernels, and for which architectures: `local` for a local
    build (see "Local builds and wheel builds" above), else a wheel."""
    mode = _build_cuda_mode()
    if mode == "0":
        return CudaPlan(False, reason="DISTOPT_BUILD_CUDA=0")
    if not cuda_requested():  # raises for DISTOPT_BUILD_CUDA=1
        return CudaPlan(False, reason="; ".join(cuda_problems()))
    asked = os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip()
    if asked and asked != "native":
        return CudaPlan(True, asked, f"TORCH_CUDA_ARCH_LIST={asked}")
    if asked == "native" or local:
        archs = ";".join(visible_gpu_archs())
        if archs:
            return CudaPlan(True, archs, f"this machine's GPUs ({archs})")
        if asked == "native":
            raise SystemExit("TORCH_CUDA_ARCH_LIST=native, but no GPU is visible")
        if mode == "auto":
            return CudaPlan(False, reason="no GPU is visible")
    return CudaPlan(True, DEFAULT_CUDA_ARCHS, f"every supported GPU ({DEFAULT_CUDA_ARCHS})")


# Rough build times on 2 otherwise idle cores (x86-64, GCC 12, nvcc 13.0), for the line a build starts
# with: distopt._C (3 CPU minutes, 2.4 of them adam_states.cpp, one core's work) and distopt._C_cuda per
# architecture (13 CPU minutes for 8.0;9.0;10.0+PTX, spread over both cores).
CPU_BUILD_MINUTES = 3
CUDA_BUILD_MINUTES_PER_ARCH = 2


def plan_line(plan: CudaPlan) -> str:
    """The one line a build starts with: what it compiles and roughly how long that takes."""
    cpu = "distopt: building the CPU kernels (distopt._C"
    if plan.build:
        n = len([a for a in re.split(r"[;\s]+", plan.arch_list) if a])
        minutes = CPU_BUILD_MINUTES + CUDA_BUILD_MINUTES_PER_ARCH * n
        return f"{cpu}) and the CUDA kernels (distopt._C_cuda) for {plan.reason}: about {minutes} min on 2 cores"
    line = f"{cpu}), about {CPU_BUILD_MINUTES} min on 2 cores; no CUDA kernels: {plan.reason}"
    if plan.reason == "no GPU is visible":
        minutes = CUDA_BUILD_MINUTES_PER_ARCH * len(DEFAULT_CUDA_ARCHS.split(";"))
        line += f" (DISTOPT_BUILD_CUDA=1 builds them for every supported GPU, {minutes} min more)"
    return line


def prepare_environment(with_cuda: bool, arch_list: str = "") -> None:
    """Sets CUDA_HOME and the arch list (`arch_list`, else TORCH_CUDA_ARCH_LIST or DEFAULT_CUDA_ARCHS)
    before torch.utils.cpp_extension reads them."""
    home = find_cuda_home()
    if home:
        # Overwrite rather than setdefault: an invalid $CUDA_HOME (find_cuda_home skipped it, e.g. the
        # /usr/local torch guesses from a wrapper nvcc) would otherwise break linking (-lcudart).
        os.environ["CUDA_HOME"] = home
    if with_cuda:
        if arch_list:
            os.environ["TORCH_CUDA_ARCH_LIST"] = arch_list
        else:
            os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_CUDA_ARCHS)
    if "torch.utils.cpp_extension" in sys.modules:
        # CUDA_HOME is read when cpp_extension is imported.
        sys.modules["torch.utils.cpp_extension"].CUDA_HOME = os.environ.get("CUDA_HOME") or None


def cpu_extension_kwargs() -> dict:
    """Keyword arguments for torch.utils.cpp_extension.CppExtension("distopt._C", ...); ``libraries`` is the
    whole list (CppExtension adds c10 and libtorch, which setup.py takes out again)."""
    return {
        "sources": list(CPU_SOURCES),
        "define_macros": list(STABLE_ABI_MACROS),
        "libraries": list(CPU_LIBRARIES),
        "extra_compile_args": {"cxx": CXX_FLAGS + SETUP_CXX_FLAGS},
        "py_limited_api": True,
    }


def cuda_extension_kwargs() -> dict:
    """Keyword arguments for torch.utils.cpp_extension.CppExtension("distopt._C_cuda", ...): a CppExtension
    (the extension builder compiles the .cu files with nvcc either way) because CUDAExtension would link
    the shared CUDA runtime of the toolkit's minor version."""
    home = os.environ.get("CUDA_HOME") or find_cuda_home()
    return {
        "sources": list(CUDA_SOURCES),
        "define_macros": list(STABLE_ABI_MACROS),
        "include_dirs": [str(Path(home) / "include")] if home else [],
        "library_dirs": [str(Path(home) / "lib64")] if home else [],
        "libraries": list(CUDA_LIBRARIES),
        "extra_compile_args": {"cxx": CXX_FLAGS + SETUP_CXX_FLAGS, "nvcc": list(NVCC_FLAGS)},
        "extra_link_args": list(CUDA_LINK_FLAGS),
        "py_limited_api": True,
    }


def cxx_standard() -> int:
    """The C++ standard torch's extension builder picks (torch 2.14+ headers need C++20)."""
    import torch

    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    return 20 if (major, minor) >= (2, 14) else 17


def write_cmake(path: Path) -> None:
    """Everything CMakeLists.txt needs, as CMake `set()` lines."""
    with_emulated = emulation_requested()
    plan = cuda_plan(local=True)  # a local build (see "Local builds and wheel builds")
    with_cuda = plan.build
    prepare_environment(with_cuda, plan.arch_list)
    print(plan_line(plan), file=sys.stderr)
    import sysconfig

    import torch
    from torch.utils import cpp_extension as ce

    cpu, cuda = cpu_extension_kwargs(), cuda_extension_kwargs()
    torch_defines = ["TORCH_API_INCLUDE_EXTENSION_H", f"_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]

    def defines(kw: dict, name: str, limited_api: bool = True) -> list[str]:
        # What torch's extension builder defines (Py_LIMITED_API where py_limited_api is set).
        extra = [f"Py_LIMITED_API={PY_LIMITED_API_HEX}"] if limited_api else []
        return [f"{k}={v}" for k, v in kw["define_macros"]] + [f"TORCH_EXTENSION_NAME={name}", *torch_defines, *extra]

    # COMMON_NVCC_FLAGS and _get_cuda_arch_flags are what BuildExtension itself passes to nvcc (the
    # latter is private; present from torch 2.0 through 2.15). Each flag must stay one token: CMake
    # de-duplicates compile options, which would mangle two-token flags.
    arch = ce._get_cuda_arch_flags([]) if with_cuda else []
    nvcc = ce.COMMON_NVCC_FLAGS + cuda["extra_compile_args"]["nvcc"] + arch
    includes = ce.include_paths() + [sysconfig.get_paths()["include"]]

    def cm(values) -> str:
        """A CMake list inside a double-quoted string."""
        escaped = (str(v).replace("\\", "\\\\").replace('"', '\\"').replace("$", "\\$").replace(";", "\\;")
                   for v in values)
        return ";".join(escaped)

    lines = {
        "DISTOPT_WITH_CUDA": "ON" if with_cuda else "OFF",
        "DISTOPT_CUDA_HOME": os.environ.get("CUDA_HOME", "") if with_cuda else "",
        "DISTOPT_CXX_STANDARD": cxx_standard(),
        "DISTOPT_CXX_FLAGS": cm(CXX_FLAGS),
        "DISTOPT_INCLUDE_DIRS": cm(includes),
        "DISTOPT_LIBRARY_DIRS": cm(ce.library_paths()),
        "DISTOPT_C_SOURCES": cm(ROOT / s for s in cpu["sources"]),
        "DISTOPT_C_DEFINES": cm(defines(cpu, "_C")),
        "DISTOPT_C_LIBRARIES": cm(cpu["libraries"]),
        "DISTOPT_C_CUDA_SOURCES": cm(ROOT / s for s in cuda["sources"]),
        "DISTOPT_C_CUDA_DEFINES": cm(defines(cuda, "_C_cuda")),
        "DISTOPT_C_CUDA_INCLUDE_DIRS": cm(cuda["include_dirs"]),
        "DISTOPT_C_CUDA_LIBRARY_DIRS": cm(cuda["library_dirs"]),
        "DISTOPT_C_CUDA_LIBRARIES": cm(cuda["libraries"]),
        "DISTOPT_C_CUDA_LINK_FLAGS": cm(cuda["extra_link_args"]),
        "DISTOPT_NVCC_FLAGS": cm(nvcc),
        "DISTOPT_WITH_EMULATED": "ON" if with_emulated else "OFF",
        "DISTOPT_EXT_SUFFIX": sysconfig.get_config_var("EXT_SUFFIX"),  # _C_emulated: full API, this Python only
    }
    if with_emulated:
        emu = emulated_extension_kwargs()
        lines |= {
            "DISTOPT_EMULATED_SOURCES": cm(ROOT / s for s in emu["sources"]),
            "DISTOPT_EMULATED_FLAGS": cm(emu["extra_compile_args"]["cxx"]),
            "DISTOPT_EMULATED_DEFINES": cm(defines(emu, "_C_emulated", limited_api=False)),
            "DISTOPT_EMULATED_INCLUDE_DIRS": cm(emu["include_dirs"] + includes),
        }
    path.write_text("".join(f'set({k} "{v}")\n' for k, v in lines.items()))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--cmake", type=Path, help="write CMake settings to this file")
    what.add_argument("--plan", action="store_true", help="print what a local build here compiles, in one line")
    args = parser.parse_args()
    if args.plan:
        print(plan_line(cuda_plan(local=True)))
    else:
        write_cmake(args.cmake)
