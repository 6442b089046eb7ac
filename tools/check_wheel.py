"""Checks that distopt's compiled modules are what one wheel for every torch >= 2.11 needs.

Each extension module (in a wheel, or given as a .so) must
  * be named *.abi3.so (Python's limited API), in a wheel tagged abi3;
  * use nothing of torch's C++ API: no undefined c10::, at:: or torch:: (mangled) symbol, only the stable
    ABI's C shim (aoti_torch_*, torch_*), which keeps its symbols from one torch release to the next;
  * need no torch library beyond libtorch_cpu / libtorch_cuda (where the shim lives), and no shared CUDA
    runtime (the module links it statically, so it does not depend on the CUDA version of the user's torch).
With --require-cuda, a wheel must also hold distopt._C_cuda with code for every architecture of
--cuda-archs (default: a wheel's, csrc/build_config.py's DEFAULT_CUDA_ARCHS): a cubin for each, and PTX
for "+PTX", read from the module's .nv_fatbin section.

    python tools/check_wheel.py [--require-cuda [--cuda-archs ARCHS]] dist/distopt-*.whl   # or distopt/_C.abi3.so ...
Exits 1 and lists every violation. Uses binutils' nm and readelf.
"""

from __future__ import annotations

import argparse
import re
import struct
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "csrc"))
from build_config import DEFAULT_CUDA_ARCHS  # noqa: E402

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


def cuda_code(so: Path) -> set[str]:
    """The GPU code in a module's .nv_fatbin section: "sm_90" for a cubin, "compute_90" for PTX. The
    section is a run of fatbins (header: magic 0xBA55ED50, u16 version, u16 header size, u64 payload
    size), each a run of entries (u16 kind, 1 PTX or 2 cubin; u16; u32 header size; u64 payload size;
    ...; u32 architecture at byte 28, e.g. 90)."""
    out = subprocess.run(["readelf", "-S", "-W", str(so)], capture_output=True, text=True, check=True)
    match = re.search(r"\s\.nv_fatbin\s+\S+\s+[0-9a-f]+\s+([0-9a-f]+)\s+([0-9a-f]+)", out.stdout)
    if not match:
        return set()
    offset, size = (int(x, 16) for x in match.groups())
    with open(so, "rb") as f:
        f.seek(offset)
        data = f.read(size)
    code, pos = set(), 0
    while pos + 16 <= len(data):
        magic, _, header, payload = struct.unpack_from("<IHHQ", data, pos)
        if magic != 0xBA55ED50:  # padding between fatbins
            pos += 8
            continue
        entry, end = pos + header, pos + header + payload
        while entry + 32 <= end:
            kind, _, entry_header, entry_payload = struct.unpack_from("<HHIQ", data, entry)
            (arch,) = struct.unpack_from("<I", data, entry + 28)
            if kind in (1, 2):
                code.add(f"{'compute' if kind == 1 else 'sm'}_{arch}")
            entry += entry_header + entry_payload
        pos = end
    return code


def expected_cuda_code(arch_list: str) -> set[str]:
    """TORCH_CUDA_ARCH_LIST syntax ("8.0;9.0;10.0+PTX") as cuda_code's names."""
    code = set()
    for arch in filter(None, re.split(r"[;\s]+", arch_list)):
        number = arch.removesuffix("+PTX").replace(".", "")
        code.add(f"sm_{number}")
        if arch.endswith("+PTX"):
            code.add(f"compute_{number}")
    return code


def check_cuda_code(so: Path, arch_list: str, name: str | None = None) -> list[str]:
    """The architectures of `arch_list` that the module has no code for."""
    missing = sorted(expected_cuda_code(arch_list) - cuda_code(so))
    return [f"{name or so}: no GPU code for {', '.join(missing)} (expected {arch_list})"] if missing else []


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


def check_wheel(wheel: Path, cuda_archs: str | None = None) -> list[str]:
    """The violations of a wheel: its tag and each extension module inside; with `cuda_archs`, also
    distopt._C_cuda's absence or missing architectures."""
    problems = []
    if "-abi3-" not in wheel.name:
        problems.append(f"{wheel.name}: not tagged abi3")
    with zipfile.ZipFile(wheel) as zf, tempfile.TemporaryDirectory() as tmp:
        modules = [n for n in zf.namelist() if n.endswith(".so")]
        if not modules:
            problems.append(f"{wheel.name}: holds no compiled module")
        for member in modules:
            problems += check_module(Path(zf.extract(member, tmp)), f"{wheel.name}:{member}")
        if cuda_archs is not None:
            cuda = [m for m in modules if Path(m).name.startswith("_C_cuda.")]
            if not cuda:
                problems.append(f"{wheel.name}: holds no distopt._C_cuda (the CUDA kernels)")
            for member in cuda:
                problems += check_cuda_code(Path(tmp) / member, cuda_archs, f"{wheel.name}:{member}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+", type=Path, help="wheels (.whl) or extension modules (.so)")
    parser.add_argument("--require-cuda", action="store_true", help="a wheel must hold distopt._C_cuda with code "
                        "for every architecture of --cuda-archs")
    parser.add_argument("--cuda-archs", default=DEFAULT_CUDA_ARCHS, metavar="ARCHS",
                        help=f"TORCH_CUDA_ARCH_LIST syntax (default: the wheel's, {DEFAULT_CUDA_ARCHS})")
    args = parser.parse_args(argv)
    cuda_archs = args.cuda_archs if args.require_cuda else None
    problems = []
    for path in args.paths:
        problems += check_wheel(path, cuda_archs) if path.suffix == ".whl" else check_module(path)
    for problem in problems:
        print(problem, file=sys.stderr)
    if not problems:
        cuda = f", GPU code for {cuda_archs}" if cuda_archs else ""
        print(f"ok: {', '.join(p.name for p in args.paths)} (abi3, stable ABI only, static CUDA runtime{cuda})")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
