"""Checks that distopt's compiled modules are what one wheel for every torch >= 2.11 needs.

Each extension module (in a wheel, or given as a .so) must
  * be named *.abi3.so (Python's limited API), in a wheel tagged abi3;
  * use nothing of torch's C++ API: no undefined c10::, at:: or torch:: (mangled) symbol, only the stable
    ABI's C shim (aoti_torch_*, torch_*), which keeps its symbols from one torch release to the next;
  * need no torch library beyond libtorch_cpu / libtorch_cuda (where the shim lives), and no shared CUDA
    runtime (the module links it statically, so it does not depend on the CUDA version of the user's torch).

    python tools/check_wheel.py dist/distopt-*.whl          # or distopt/_C.abi3.so ...
Exits 1 and lists every violation. Uses binutils' nm and readelf.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

# A mangled name in namespace c10, at or torch (function, const method, vtable, typeinfo ...).
CXX_TORCH = re.compile(r"^_Z(?:T[VIS])?N[KVrLO]*(?:3c10|2at|5torch)")
ALLOWED_TORCH_LIBS = {"libtorch_cpu.so", "libtorch_cuda.so"}
FORBIDDEN_LIBS = re.compile(r"^(?:libc10.*|libtorch.*|libcudart\.so.*|libpython.*)$")


def undefined_symbols(so: Path) -> list[str]:
    out = subprocess.run(["nm", "-D", "--undefined-only", str(so)], capture_output=True, text=True, check=True)
    return [line.split()[-1] for line in out.stdout.splitlines() if line.strip()]


def needed_libraries(so: Path) -> list[str]:
    out = subprocess.run(["readelf", "-d", str(so)], capture_output=True, text=True, check=True)
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out.stdout)


def check_module(so: Path, name: str | None = None) -> list[str]:
    """The violations of one extension module (`name`: how to call it in messages)."""
    name = name or str(so)
    problems = []
    if not so.name.endswith(".abi3.so"):
        problems.append(f"{name}: not a limited-API module (expected *.abi3.so)")
    cxx = [s for s in undefined_symbols(so) if CXX_TORCH.match(s)]
    if cxx:
        shown = ", ".join(cxx[:5]) + (" ..." if len(cxx) > 5 else "")
        problems.append(f"{name}: {len(cxx)} undefined torch C++ symbols outside the stable ABI: {shown}")
    for lib in needed_libraries(so):
        if FORBIDDEN_LIBS.match(lib) and lib not in ALLOWED_TORCH_LIBS:
            problems.append(f"{name}: needs {lib} (only libtorch_cpu/libtorch_cuda, and no shared CUDA runtime)")
    return problems


def check_wheel(wheel: Path) -> list[str]:
    """The violations of a wheel: its tag and each extension module inside."""
    problems = []
    if "-abi3-" not in wheel.name:
        problems.append(f"{wheel.name}: not tagged abi3")
    with zipfile.ZipFile(wheel) as zf, tempfile.TemporaryDirectory() as tmp:
        modules = [n for n in zf.namelist() if n.endswith(".so")]
        if not modules:
            problems.append(f"{wheel.name}: holds no compiled module")
        for member in modules:
            problems += check_module(Path(zf.extract(member, tmp)), f"{wheel.name}:{member}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+", type=Path, help="wheels (.whl) or extension modules (.so)")
    args = parser.parse_args(argv)
    problems = []
    for path in args.paths:
        problems += check_wheel(path) if path.suffix == ".whl" else check_module(path)
    for problem in problems:
        print(problem, file=sys.stderr)
    if not problems:
        print(f"ok: {', '.join(p.name for p in args.paths)} (abi3, stable ABI only, static CUDA runtime)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
