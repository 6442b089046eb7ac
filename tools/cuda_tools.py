"""The CUDA toolchain as tools/gpu_budgets.py and tools/hot_loops.py use it: finding nvcc, cuobjdump, nvdisasm
and a demangler, the real build's nvcc command (csrc/build_config.py), ptxas's resource report, a cubin's
symbols, the per-architecture cells of their reports, and the end of a budget tool's run."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterable
from dataclasses import asdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def group_by_arch(records: Iterable[Any], key: str) -> dict[str, dict[str, Any]]:
    """Report records (each with an ``arch``) by their ``key`` attribute, then by architecture, in order."""
    grouped: dict[str, dict[str, Any]] = {}
    for r in records:
        grouped.setdefault(getattr(r, key), {})[r.arch] = r
    return grouped


def arch_cell(by_arch: dict[str, Any], archs: list[str], fmt: Callable[[Any], str]) -> str:
    """One report cell: ``fmt`` of each architecture's record, joined by ' · ' in ``archs`` order ('-' if absent)."""
    return " · ".join(fmt(by_arch[a]) if a in by_arch else "-" for a in archs)


def find_nvcc(csrc: Path | None = None) -> str | None:
    """nvcc of the toolkit build_config picks (CUDA_HOME, nvcc on PATH, /usr/local/cuda)."""
    home = load_build_config(csrc or ROOT / "csrc").find_cuda_home()
    return str(Path(home) / "bin" / "nvcc") if home else shutil.which("nvcc")


def _site_package_dirs(name: str) -> list[Path]:
    """Folders of an installed (namespace) package, found without importing it."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return []
    return [Path(p) for p in (spec.submodule_search_locations or [])] if spec else []


def find_cuobjdump(nvcc: str | None = None) -> str | None:
    """The toolkit's cuobjdump, else the pip package nvidia-cuda-cuobjdump's, else triton's bundled one."""
    nvcc = nvcc or find_nvcc()
    candidates = [Path(nvcc).parent / "cuobjdump"] if nvcc else []
    if shutil.which("cuobjdump"):
        candidates.append(Path(shutil.which("cuobjdump")))
    for d in _site_package_dirs("nvidia"):
        candidates += sorted(d.glob("*/bin/cuobjdump"))  # nvidia/cu13/bin/cuobjdump
    for d in _site_package_dirs("triton"):
        candidates.append(d / "backends" / "nvidia" / "bin" / "cuobjdump")
    return next((str(c) for c in candidates if c.is_file() and os.access(c, os.X_OK)), None)


def find_nvdisasm(nvcc: str | None = None) -> str | None:
    """nvdisasm (control flow and line tables of a cubin): next to cuobjdump wherever that was found."""
    cuobjdump = find_cuobjdump(nvcc)
    candidates = [Path(cuobjdump).with_name("nvdisasm")] if cuobjdump else []
    if shutil.which("nvdisasm"):
        candidates.append(Path(shutil.which("nvdisasm")))
    return next((str(c) for c in candidates if c.is_file() and os.access(c, os.X_OK)), None)


def find_demangler() -> str | None:
    """c++filt (binutils) or CUDA's cu++filt: both demangle these Itanium names."""
    return shutil.which("c++filt") or shutil.which("cu++filt")


def demangle(names: list[str], tool: str) -> dict[str, str]:
    """Mangled -> demangled, one subprocess for all names."""
    out = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True, check=True).stdout
    return dict(zip(names, out.splitlines()))


def load_build_config(csrc: Path):
    """Imports <csrc>/build_config.py (the scratch copy's own, when --csrc points at one)."""
    spec = importlib.util.spec_from_file_location(f"_build_config_{abs(hash(str(csrc)))}", csrc / "build_config.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def base_command(bc) -> list[str]:
    """nvcc flags, defines and includes exactly as build_config gives the real build (less the arch)."""
    bc.prepare_environment(True)  # sets CUDA_HOME before torch.utils.cpp_extension reads it
    import logging
    import sysconfig

    # Without a GPU cpp_extension logs "No CUDA runtime is found": expected here, and noise in CI logs.
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)

    import torch
    from torch.utils import cpp_extension as ce

    kw = bc.cuda_extension_kwargs()
    try:
        includes = ce.include_paths(device_type="cuda")
    except TypeError:  # torch < 2.5
        includes = ce.include_paths(cuda=True)
    defines = [f"{k}={v}" for k, v in kw["define_macros"]] + [
        "TORCH_EXTENSION_NAME=_C_cuda", "TORCH_API_INCLUDE_EXTENSION_H",
        f"_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]
    return [*ce.COMMON_NVCC_FLAGS, *kw["extra_compile_args"]["nvcc"], f"-std=c++{bc.cxx_standard()}",
            *(f"-D{d}" for d in defines), *(f"-I{i}" for i in [*includes, sysconfig.get_paths()["include"]])]


def tool_version(tool: str) -> str:
    return subprocess.run([tool, "--version"], capture_output=True, text=True).stdout.strip()



_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(sm_\w+)'")
_PROPS = re.compile(r"Function properties for (\S+)")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")


def parse_ptxas(text: str) -> dict[str, dict[str, int]]:
    """ptxas -v output -> {mangled entry: registers, stack_bytes, spill_stores, spill_loads, smem_bytes}.

    A non-inlined callee's frame (e.g. __internal_accurate_pow) is reported after the entry that calls
    it; its stack and spills are charged to that entry, since the entry's threads execute them.
    """
    kernels: dict[str, dict[str, int]] = {}
    entry: str | None = None
    props_of: str | None = None
    for line in text.splitlines():
        if m := _ENTRY.search(line):
            entry = m.group(1)
            kernels[entry] = {"registers": 0, "stack_bytes": 0, "spill_stores": 0, "spill_loads": 0,
                              "smem_bytes": 0}
        elif m := _PROPS.search(line):
            props_of = m.group(1)
        elif (m := _FRAME.search(line)) and entry is not None and props_of is not None:
            k = kernels[entry]
            k["stack_bytes"] += int(m.group(1))
            k["spill_stores"] += int(m.group(2))
            k["spill_loads"] += int(m.group(3))
            props_of = None
        elif (m := _USED.search(line)) and entry is not None:
            kernels[entry]["registers"] = int(m.group(1))
            if s := _SMEM.search(line):
                kernels[entry]["smem_bytes"] = int(s.group(1))
    return kernels


def elf_symbols(path: Path, contains: str) -> dict[str, bytes]:
    """{name: bytes} of a 64-bit little-endian ELF file's defined symbols whose name contains `contains`
    (a cubin's __device__ variables: their initial values)."""
    import struct

    data = Path(path).read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError(f"{path}: not a 64-bit little-endian ELF file")
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + k * shentsize) for k in range(shnum)]
    out: dict[str, bytes] = {}
    for sh in sections:
        if sh[1] != 2:  # SHT_SYMTAB
            continue
        strtab = sections[sh[6]]  # sh_link: its string table
        for off in range(sh[4], sh[4] + sh[5], 24):
            name_off, _info, _other, shndx, value, size = struct.unpack_from("<IBBHQQ", data, off)
            start = strtab[4] + name_off
            name = data[start : data.index(b"\0", start)].decode()
            if contains in name and 0 < shndx < len(sections) and size:
                base = sections[shndx][4] + value
                out[name] = data[base : base + size]
    return out


def finish(records: list, json_path: Path | None, name_of, all_good: str) -> int:
    """The end of a budget tool: every record to `json_path`, then each record's violations on stderr
    (exit status 1) or `all_good` (0). Records are dataclasses with `arch` and `violations`."""
    if json_path:
        json_path.write_text(json.dumps([asdict(r) for r in records], indent=1))
    bad = [r for r in records if r.violations]
    if not bad:
        print(f"\n{all_good}")
        return 0
    print(f"\n{sum(len(r.violations) for r in bad)} budget violation(s) in {len(bad)} row(s):", file=sys.stderr)
    for r in bad:
        for v in r.violations:
            print(f"  {r.arch} {name_of(r)}: {v}", file=sys.stderr)
    return 1
