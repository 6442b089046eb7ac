#!/usr/bin/env python3
"""Static GPU budgets of the CUDA kernels, checked without a GPU.

Compiles every csrc/cuda/*.cu with the project's real nvcc flags (csrc/build_config.py) to a cubin per
architecture, reads ptxas's resource report (registers, spills, shared memory), the cubin's kernel
parameter sizes (cuobjdump -elf) and its SASS global accesses (cuobjdump -sass), and checks every kernel
instantiation against the budgets below. Prints a markdown table (instantiation, registers, spills,
occupancy, 128-bit accesses, bytes per element, bandwidth-bound time), optionally writes JSON, and
exits 1 listing each violation (2 when the tools are missing).

    .venv/bin/python tools/gpu_budgets.py [--arch sm_80,sm_90] [--json out.json] [--cache-dir DIR]

Compiled results are cached under --cache-dir, keyed by the compile command, the toolchain versions
and the contents of csrc/, so a rerun with unchanged sources compiles nothing.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

# ---- Budgets ---------------------------------------------------------------------------------------
# At most 64 registers per thread: 65536 registers / 64 = 1024 resident threads, i.e. two 512-thread
# blocks per SM (50% of the 2048 thread slots). These kernels stream memory; a second resident block
# keeps loads in flight while the other block starts up (metadata, coefficients) or drains its tail.
MAX_REGISTERS = 64
# No local memory at all, for every kernel: spills and stack frames live in off-chip local memory, adding
# traffic to a kernel whose speed is its memory traffic.
MAX_LOCAL_BYTES = 0
# Kernel parameters: 4 KiB, or 32,764 B with CUDA >= 12.1 on Volta+ (csrc/cuda/kernel_params.cuh). Only
# the large-metadata instantiations (TensorListMetadata<d, true>, CleanupMeta<true>) may exceed 4 KiB:
# every other kernel is what runs where large parameters are refused.
SMALL_PARAM_BYTES = 4096
LARGE_PARAM_BYTES = 32764
_LARGE_META = re.compile(r"(?:TensorListMetadata<\d+, true>|CleanupMeta<true>)")
# The low-precision-moment kernels' 8-bit codes: one 64-bit load and store per 8-bit moment and aligned
# step (a lane's 8 codes), exp_avg's and exp_avg_sq's.
STATES_CODE_ACCESSES = (2, 2)
# ... and, once per chunk, the 128-bit loads that copy the 8-bit maps' bucket tables into shared memory
# (one per map: csrc/cuda/states_lanes.cuh's copy_map), outside the aligned loop.
STATES_TABLE_LOADS = 2
# Bandwidth-bound time: bytes moved for PARAMS elements at the H100's measured HBM bandwidth.
HBM_BYTES_PER_S = 3.0e12
PARAMS = 1e9
DEFAULT_ARCHS = ("sm_80", "sm_90")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from cuda_tools import (  # noqa: E402  (re-exported: the tests use them through this module)
    arch_cell,
    base_command,
    demangle,
    find_cuobjdump,
    find_demangler,
    find_nvcc,
    finish,
    group_by_arch,
    load_build_config,
    parse_ptxas,
    tool_version,
)

CACHE_VERSION = "1"  # bump when the cached summary's layout changes


@dataclass(frozen=True)
class ArchLimits:
    """Per-SM limits of an architecture (CUDA programming guide, compute capability table)."""

    smem_per_sm: int  # largest shared-memory carve-out, bytes
    regs_per_sm: int = 65536
    threads_per_sm: int = 2048
    blocks_per_sm: int = 32
    sub_partitions: int = 4  # registers are allocated per sub-partition (cuda_occupancy.h)
    reg_unit: int = 256  # registers are allocated to a warp in units of 256
    smem_reserved_per_block: int = 1024  # the runtime reserves 1 KiB of shared memory per block


ARCH_LIMITS = {"sm_80": ArchLimits(smem_per_sm=167936), "sm_90": ArchLimits(smem_per_sm=233472)}

# Element types as they appear in demangled names: (short name, bytes).
TYPES = {"float": ("fp32", 4), "c10::Half": ("fp16", 2), "c10::BFloat16": ("bf16", 2),
         "distopt::NoList": ("none", 0), "short": ("int16", 2)}


@dataclass
class Kernel:
    """One kernel instantiation on one architecture: what ptxas and cuobjdump report, plus the model."""

    arch: str
    mangled: str
    name: str = ""  # readable instantiation, e.g. "adam p=bf16 g=fp32 out=none rem"
    op: str = ""  # adam, scale, l2norm, or the plain kernel name
    registers: int = 0
    stack_bytes: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    smem_bytes: int = 0
    param_bytes: int | None = None
    param_limit: int = SMALL_PARAM_BYTES  # LARGE_PARAM_BYTES for the large-metadata instantiations
    accesses: dict[str, int] = field(default_factory=dict)  # "LDG.128" -> count in the SASS
    expected_ldg128: int | None = None  # 128-bit loads of one aligned-loop step, every list
    expected_stg128: int | None = None
    expected_ldg64: int | None = None  # 64-bit loads/stores of one aligned step (the 8-bit codes); None: none allowed
    expected_stg64: int | None = None
    extra_ldg128: int = 0  # 128-bit loads outside the aligned loop (the low-precision kernels' table copies)
    loads_versioned: bool = False  # the aligned loop's loads are in per-format versions: at least one step's
    bytes_per_elem: int | None = None
    blocks_per_sm: int = 0
    occupancy: float = 0.0
    violations: list[str] = field(default_factory=list)


# ---- Compiling --------------------------------------------------------------------------------------
def sources_digest(csrc: Path) -> str:
    """Hash of everything under csrc/ a .cu can include (headers are not tracked one by one)."""
    h = hashlib.sha256()
    for p in sorted(csrc.rglob("*")):
        if p.is_file() and p.suffix in (".cu", ".cuh", ".h", ".hpp", ".py"):
            h.update(str(p.relative_to(csrc)).encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def analyse_source(src: Path, arch: str, base: list[str], tools: dict[str, str], cache_dir: Path,
                   key_parts: list[str]) -> dict:
    """Compiles one .cu for one arch (or loads the cached result): ptxas report, SASS accesses, param sizes."""
    cmd = [tools["nvcc"], "-cubin", f"-gencode=arch=compute_{arch[3:]},code={arch}", "-Xptxas=-v", *base, str(src)]
    key = hashlib.sha256(json.dumps([CACHE_VERSION, cmd, *key_parts]).encode()).hexdigest()[:20]
    tree = hashlib.sha256(str(src.parent).encode()).hexdigest()[:8]  # a scratch --csrc keeps its own entries
    cached = cache_dir / f"{src.stem}-{arch}-{tree}-{key}.json"
    if cached.exists():
        return json.loads(cached.read_text())
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / f"{src.stem}.cubin"
        proc = subprocess.run([*cmd, "-o", str(cubin)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"nvcc failed for {src.name} ({arch}):\n{proc.stdout}{proc.stderr}")
        sass = subprocess.run([tools["cuobjdump"], "-sass", str(cubin)], capture_output=True, text=True, check=True)
        elf = subprocess.run([tools["cuobjdump"], "-elf", str(cubin)], capture_output=True, text=True, check=True)
    result = {"source": src.name, "arch": arch, "ptxas": proc.stdout + proc.stderr,
              "accesses": parse_sass(sass.stdout), "params": parse_elf_params(elf.stdout)}
    cache_dir.mkdir(parents=True, exist_ok=True)
    for stale in cache_dir.glob(f"{src.stem}-{arch}-{tree}-*.json"):  # older sources or flags: keep it small
        stale.unlink(missing_ok=True)
    tmp_path = cached.with_suffix(f".tmp{os.getpid()}")
    tmp_path.write_text(json.dumps(result))
    tmp_path.replace(cached)  # atomic: an interrupted run leaves no truncated entry
    return result


# ---- Parsing ----------------------------------------------------------------------------------------
_SASS_FUNC = re.compile(r"^\s*Function : (\S+)")
_SASS_MEM = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?(LDG|STG)((?:\.\w+)*)\s")


def access_width(modifiers: str) -> int:
    """Bits moved by one LDG/STG from its modifiers (.E.128, .E.64, .E.U16, .E.128.CONSTANT, ...)."""
    mods = set(modifiers.strip(".").split("."))
    for bits, names in ((128, {"128"}), (64, {"64"}), (16, {"U16", "S16"}), (8, {"U8", "S8"})):
        if mods & names:
            return bits
    return 32


def parse_sass(text: str) -> dict[str, dict[str, int]]:
    """cuobjdump -sass output -> {mangled function: {"LDG.128": n, "STG.32": n, ...}}."""
    out: dict[str, Counter] = {}
    current: Counter | None = None
    for line in text.splitlines():
        if m := _SASS_FUNC.match(line):
            current = out.setdefault(m.group(1), Counter())
        elif current is not None and (m := _SASS_MEM.match(line)):
            current[f"{m.group(1)}.{access_width(m.group(2))}"] += 1
    return {k: dict(v) for k, v in out.items()}


def parse_elf_params(text: str) -> dict[str, int]:
    """cuobjdump -elf output -> {mangled function: kernel parameter bytes} (EIATTR_CBANK_PARAM_SIZE)."""
    params: dict[str, int] = {}
    func: str | None = None
    want = False
    for line in text.splitlines():
        if line.startswith(".nv.info."):
            func, want = line[len(".nv.info."):].strip(), False
        elif "EIATTR_CBANK_PARAM_SIZE" in line:
            want = True
        elif want and func and (m := re.search(r"Value:\s*(0x[0-9a-fA-F]+)", line)):
            params[func] = int(m.group(1), 16)
            want = False
    return params


# ---- The model of each op's aligned loop ------------------------------------------------------------
def _size(t: str) -> int:
    return TYPES[t][1] if t in TYPES else 0


def _short(t: str) -> str:
    return TYPES[t][0] if t in TYPES else t


def op_model(op: str, args: list[str]) -> tuple[str, list[str], list[str], list[str]] | None:
    """(name, loaded list types, stored list types, types that set N) of an op's aligned loop, per
    csrc/cuda/<op>.cu: N = 16 / narrowest type, each list moves N elements per step."""
    if op == "AdamOp":
        p, g, o, rem, cap = args
        has_out, has_rem = o != "distopt::NoList", rem == "true"
        loads = [p, g, "float", "float"] + (["short"] if has_rem else [])
        stores = [p, "float", "float"] + (["short"] if has_rem else []) + ([o] if has_out else [])
        vec = [p, g, o if has_out else "float", "short" if has_rem else "float"]
        name = f"adam p={_short(p)} g={_short(g)} out={_short(o)}" + (" rem" if has_rem else "")
        name += " capturable" if cap == "true" else ""
        return name, loads, stores, vec
    if op == "AdamStatesOp":
        # Low-precision moments (csrc/cuda/adam_states_op.cuh): a lane moves 8 elements of every list per
        # step; the moment formats are launch arguments, so each moment's fp32 (two packs) and bf16 (one)
        # paths are both in the kernel (their 8-bit codes: 64-bit accesses, see STATES_CODE_ACCESSES).
        p, g, o, rem, cap = args
        has_out, has_rem = o != "distopt::NoList", rem == "true"
        moments = ["float", "c10::BFloat16"] * 2
        loads = [p, g] + moments + (["short"] if has_rem else [])
        stores = [p] + moments + (["short"] if has_rem else []) + ([o] if has_out else [])
        name = f"adam-states p={_short(p)} g={_short(g)} out={_short(o)}" + (" rem" if has_rem else "")
        name += " capturable" if cap == "true" else ""
        return name, loads, stores, ["c10::BFloat16"]
    if op == "ScaleOp":
        i, o = args
        return f"scale {_short(i)}->{_short(o)}", [i], [o], [i, o]
    if op == "L2NormOp":
        (t,) = args
        return f"l2norm {_short(t)}", [t], [], [t]
    return None


_OP = re.compile(r"::(\w+Op)<([^<>]*)>")


def describe(kernel: Kernel, demangled: str) -> None:
    """Fills name (" 32K" at the end: large metadata), op, parameter limit, expected 128-bit accesses
    and bytes per element from the demangled name."""
    large = bool(_LARGE_META.search(demangled))
    kernel.param_limit = LARGE_PARAM_BYTES if large else SMALL_PARAM_BYTES
    _describe_op(kernel, demangled)
    if large:
        kernel.name += " 32K"


def _describe_op(kernel: Kernel, demangled: str) -> None:
    if m := _OP.search(demangled):
        model = op_model(m.group(1), [a.strip() for a in m.group(2).split(",")])
        if model is None:
            kernel.name, kernel.op = m.group(0).lstrip(":"), m.group(1)
            kernel.violations.append(f"no access model for {m.group(1)}: add it to op_model()")
            return
        kernel.name, loads, stores, vec = model
        kernel.op = kernel.name.split()[0]
        n = 16 // min(_size(t) for t in vec)
        kernel.expected_ldg128 = sum(n * _size(t) // 16 for t in loads)
        kernel.expected_stg128 = sum(n * _size(t) // 16 for t in stores)
        kernel.bytes_per_elem = sum(_size(t) for t in loads + stores)
        if kernel.op == "adam-states":  # bytes moved with both moments 8-bit: one code each way per moment
            kernel.expected_ldg64, kernel.expected_stg64 = STATES_CODE_ACCESSES
            kernel.extra_ldg128 = STATES_TABLE_LOADS
            kernel.loads_versioned = True
            kernel.bytes_per_elem -= 2 * sum(_size(t) for t in ("float", "c10::BFloat16")) * 2 - 4
    else:  # a plain __global__ function: its unqualified name
        plain = re.sub(r"\(.*$", "", demangled.replace("(anonymous namespace)", "{anon}"))  # drop the arguments
        plain = re.sub(r"<.*$", "", plain)  # and the template arguments
        kernel.name = kernel.op = plain.split("::")[-1]


def occupancy(registers: int, smem: int, block: int, lim: ArchLimits) -> tuple[int, float]:
    """Resident blocks per SM and the fraction of thread slots they fill (cuda_occupancy.h's rules)."""
    warps = math.ceil(block / 32)
    limits = [lim.blocks_per_sm, lim.threads_per_sm // (warps * 32)]
    if registers:
        per_warp = math.ceil(registers * 32 / lim.reg_unit) * lim.reg_unit
        warps_per_sub = (lim.regs_per_sm // lim.sub_partitions) // per_warp
        limits.append(warps_per_sub * lim.sub_partitions // warps)
    if smem:
        limits.append(lim.smem_per_sm // (math.ceil((smem + lim.smem_reserved_per_block) / 128) * 128))
    blocks = max(0, min(limits))
    return blocks, blocks * warps * 32 / lim.threads_per_sm


def check(kernel: Kernel) -> None:
    """Appends every budget violation of one kernel to kernel.violations."""
    v = kernel.violations
    if kernel.registers > MAX_REGISTERS:
        v.append(f"{kernel.registers} registers > {MAX_REGISTERS} ({kernel.blocks_per_sm} block(s)/SM)")
    if max(kernel.stack_bytes, kernel.spill_stores, kernel.spill_loads) > MAX_LOCAL_BYTES:
        v.append(f"local memory: {kernel.stack_bytes} B stack, {kernel.spill_stores} B spill stores, "
                 f"{kernel.spill_loads} B spill loads")
    if kernel.param_bytes is None:
        v.append("kernel parameter size not found in the cubin")
    elif kernel.param_bytes > kernel.param_limit:
        v.append(f"{kernel.param_bytes} B of kernel parameters > {kernel.param_limit}")
    if kernel.expected_ldg128 is None:
        return
    a = kernel.accesses
    wide = {k: n for k, n in a.items() if k.endswith(".64")}
    if kernel.expected_ldg64 is None and wide:  # no 64-bit data: a .64 access is a 16-byte pack split in two
        v.append(f"64-bit global accesses {wide}: a list's aligned access is not 128-bit")
    for kind, want in (("LDG", kernel.expected_ldg64), ("STG", kernel.expected_stg64)):
        got = a.get(f"{kind}.64", 0)
        if want and (got < want or got % want):
            v.append(f"{got} {kind}.64, want a nonzero multiple of {want} (one per lane's 8 codes of an 8-bit moment)")
    # Each copy of the aligned loop body (the compiler may unroll or peel it) moves every list in
    # 128-bit packs: the counts must be a nonzero multiple of one step's packs.
    # The low-precision kernels branch on their moment formats (launch arguments) around the loop's loads,
    # and nvcc versions the loop by them, each version loading its formats' lists: their loads must come
    # to at least one step's packs (tools/hot_loops.py reads each format's loop on its own).
    for kind, want in (("LDG", kernel.expected_ldg128), ("STG", kernel.expected_stg128)):
        got = a.get(f"{kind}.128", 0) - (kernel.extra_ldg128 if kind == "LDG" else 0)
        if kind == "LDG" and kernel.loads_versioned:
            if got < want:
                v.append(f"{got} {kind}.128 in the aligned loop, want at least {want} (one per 16 B of every list)")
            continue
        if want and (got < want or got % want):
            v.append(f"{got} {kind}.128, want a nonzero multiple of {want} (one per 16 B of every list)")
        if not want and got:
            v.append(f"{got} unexpected {kind}.128")


def collect(results: list[dict], demangler: str, block: int) -> list[Kernel]:
    """Kernel records from the per-(source, arch) results, described, sized and checked."""
    kernels: list[Kernel] = []
    for r in results:
        for mangled, stats in parse_ptxas(r["ptxas"]).items():
            kernels.append(Kernel(arch=r["arch"], mangled=mangled, param_bytes=r["params"].get(mangled),
                                  accesses=r["accesses"].get(mangled, {}), **stats))
    names = demangle(sorted({k.mangled for k in kernels}), demangler)
    for k in kernels:
        describe(k, names[k.mangled])
        k.blocks_per_sm, k.occupancy = occupancy(k.registers, k.smem_bytes, block, ARCH_LIMITS[k.arch])
        check(k)
    return sorted(kernels, key=lambda k: (k.op, k.name, k.arch))


def block_size(csrc: Path) -> int:
    """kBlockSize, the block size every kernel is launched with (csrc/cuda/multi_tensor_apply.cuh today)."""
    for header in sorted((csrc / "cuda").glob("*.cuh")):
        if m := re.search(r"constexpr\s+int\s+kBlockSize\s*=\s*(\d+)\s*;", header.read_text()):
            return int(m.group(1))
    raise SystemExit("gpu_budgets: kBlockSize not found in csrc/cuda/*.cuh")


# ---- Report -----------------------------------------------------------------------------------------
def table(kernels: list[Kernel], archs: list[str]) -> str:
    """Markdown table: one row per instantiation, per-arch values joined by ' · ' in `archs` order."""
    rows = group_by_arch(kernels, "name")

    def per_arch(by_arch: dict[str, Kernel], fmt) -> str:
        return arch_cell(by_arch, archs, fmt)

    params = f"{PARAMS:.0e}".replace("e+0", "e")
    head = [f"instantiation ({' · '.join(archs)})", "registers", "spill B", "occupancy", "128-bit ld/st (per step)",
            "params B", "B/elem", f"ms for {params} @ {HBM_BYTES_PER_S / 1e12:.1f} TB/s", "budget"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, by_arch in rows.items():
        k0 = next(iter(by_arch.values()))
        vec = "-"
        if k0.expected_ldg128 is not None:
            found = per_arch(by_arch, lambda k: f"{k.accesses.get('LDG.128', 0)}/{k.accesses.get('STG.128', 0)}")
            vec = f"{found} ({k0.expected_ldg128}/{k0.expected_stg128})"
        ms = "-" if k0.bytes_per_elem is None else f"{k0.bytes_per_elem * PARAMS / HBM_BYTES_PER_S * 1e3:.2f}"
        ok = "ok" if not any(k.violations for k in by_arch.values()) else "**FAIL**"
        lines.append("| " + " | ".join([
            name, per_arch(by_arch, lambda k: str(k.registers)),
            per_arch(by_arch, lambda k: str(max(k.spill_stores, k.stack_bytes))),
            per_arch(by_arch, lambda k: f"{k.occupancy:.0%}"), vec,
            per_arch(by_arch, lambda k: str(k.param_bytes)), str(k0.bytes_per_elem or "-"), ms, ok]) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default=",".join(DEFAULT_ARCHS), help="comma-separated, e.g. sm_80,sm_90")
    parser.add_argument("--csrc", type=Path, default=ROOT / "csrc", help="the csrc/ folder to check")
    parser.add_argument("--cache-dir", type=Path, default=ROOT / "build-budgets", help="compiled-result cache")
    parser.add_argument("--json", type=Path, help="also write every kernel's record here")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="parallel nvcc runs")
    args = parser.parse_args(argv)

    archs = [a.strip() for a in args.arch.split(",") if a.strip()]
    unknown = [a for a in archs if a not in ARCH_LIMITS]
    if unknown:
        parser.error(f"unknown arch {unknown}; known: {sorted(ARCH_LIMITS)}")
    csrc = args.csrc.resolve()
    nvcc = find_nvcc(csrc)
    tools = {"nvcc": nvcc, "cuobjdump": find_cuobjdump(nvcc), "demangler": find_demangler()}
    missing = [t for t, path in tools.items() if path is None]
    if missing:
        print(f"gpu_budgets: not found: {', '.join(missing)} (cuobjdump: CUDA toolkit, "
              "`pip install nvidia-cuda-cuobjdump`, or triton's bundled copy)", file=sys.stderr)
        return 2

    bc = load_build_config(csrc)
    base = base_command(bc)
    import torch

    key_parts = [tool_version(tools["nvcc"]), tool_version(tools["cuobjdump"]), torch.__version__,
                 sources_digest(csrc)]
    sources = [bc.ROOT / s for s in bc.CUDA_KERNEL_SOURCES]
    jobs = [(src, arch) for src in sources for arch in archs]
    try:
        with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            results = list(pool.map(lambda j: analyse_source(*j, base, tools, args.cache_dir, key_parts), jobs))
    except (RuntimeError, subprocess.CalledProcessError) as e:
        print(f"gpu_budgets: {e}", file=sys.stderr)
        return 2

    kernels = collect(results, tools["demangler"], block_size(csrc))
    print(f"GPU budgets: registers <= {MAX_REGISTERS}, local memory <= {MAX_LOCAL_BYTES} B, kernel params <= "
          f"{SMALL_PARAM_BYTES} B ({LARGE_PARAM_BYTES} B for the \"32K\" large-metadata instantiations), "
          f"aligned loops 128-bit for every list; block size {block_size(csrc)}\n")
    print(table(kernels, archs))
    return finish(kernels, args.json, lambda k: k.name, f"all {len(kernels)} kernels within budget")


if __name__ == "__main__":
    sys.exit(main())
