#!/usr/bin/env python3
"""Static proxies of the CUDA Adam kernels' speed, without a GPU: the SASS of each moment format's hot loop.

The update is memory bound when its hot loop issues few enough instructions per element for the memory
time (an H200 moves 64M elements of the 8-bit update, 16 B each, in about 0.25 ms: about 140 warp
instructions per element fit in that time on 132 SMs), waits on memory once per block, and keeps its
shared-memory traffic within bounds. tools/probes/adam_states_probes.cu compiles the shipped functors with
one format pair each (fp32 params and grads); for sm_80 and sm_90 this tool reads their cubins (nvdisasm:
control flow and line tables), finds the vector loop and its fast path (tools/sass_paths.py), and reports
per element of that path: SASS instructions, of them integer/logic, floating point and shared loads,
the Philox generator's instructions per call (those compiled from csrc/math's philox and rounding_bits
functions), whether every global load precedes the first floating-point instruction, and the probe
kernel's registers and local memory. It checks BUDGETS and exits 1 listing each violation (2 when the
tools are missing). The emulator counts the shared-memory wavefronts
(tests/emulation/test_shared_wavefronts.py); tools/gpu_budgets.py checks every instantiation's registers.

    .venv/bin/python tools/hot_loops.py [--arch sm_80,sm_90] [--csrc DIR] [--json out.json]

--csrc reads another tree (tests/tooling/test_hot_loops.py's negative control: the kernels of commit 89b84a8).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cuda_tools import (  # noqa: E402
    arch_cell,
    base_command,
    find_cuobjdump,
    find_nvcc,
    find_nvdisasm,
    finish,
    group_by_arch,
    load_build_config,
    parse_ptxas,
    tool_version,
)
from sass_paths import count_path, function_ranges, hot_loop, parse_nvdisasm  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PROBES = Path(__file__).resolve().parent / "probes" / "adam_states_probes.cu"
DEFAULT_ARCHS = ("sm_80", "sm_90")
CACHE_VERSION = "1"
# The functions whose instructions are a Philox call's (csrc/math/*.h, old and new layouts).
PHILOX_FUNCTIONS = r"philox\w*|rounding_bits|rounding_stream"


@dataclass(frozen=True)
class Variant:
    name: str
    kernel: str  # the probe's extern "C" name
    vector_bytes: int  # bytes per element the loop stores with 128-bit accesses (the elements it handles)
    budget: tuple[tuple[str, float], ...] = ()  # (metric, bound): "instructions" <= bound, "loads_first" true...


# Issue 31's budgets, for the fast path with fp32 params: the 8-bit update within what the memory time
# leaves (16 B per element against 28 for fp32 moments), stochastic rounding within the same, and
# every global load of a block before its first arithmetic.
VARIANTS = (
    Variant("fp32 moments", "probe_fp32", 12),
    Variant("bf16", "probe_bf16", 8, (("loads_first", 1),)),
    Variant("bf16+SR", "probe_bf16_sr", 8, (("instructions", 110), ("philox_per_call", 45), ("loads_first", 1))),
    Variant("8-bit", "probe_8bit", 4,
            (("instructions", 110), ("int_logic", 55), ("shared_loads", 4), ("loads_first", 1))),
    Variant("bf16+SR p=bf16", "probe_bf16_sr_bf16p", 6),
    Variant("8-bit+SR p=bf16", "probe_8bit_sr_bf16p", 2),
)  # fmt: skip
MAX_REGISTERS = 64  # as tools/gpu_budgets.py, which checks every instantiation


@dataclass
class Row:
    variant: str
    arch: str
    elements: float = 0.0  # per lane and fast-path iteration
    instructions: float = 0.0  # all per element
    int_logic: float = 0.0
    fp: float = 0.0
    shared_loads: float = 0.0
    philox_per_call: float = 0.0
    loads_first: bool = False
    registers: int = 0
    local_bytes: int = 0  # stack + spill stores
    violations: list[str] = field(default_factory=list)


def philox_lines(csrc: Path) -> dict[str, list[tuple[int, int]]]:
    """{"math/<header>": line ranges} of the Philox functions in csrc/math."""
    out = {}
    for header in sorted((csrc / "math").glob("*.h")):
        ranges = function_ranges(header.read_text(), PHILOX_FUNCTIONS)
        if ranges:
            out[f"math/{header.name}"] = ranges
    return out


def compile_probes(csrc: Path, arch: str, tools: dict[str, str], cache_dir: Path) -> dict:
    """nvdisasm text and ptxas report of the probes for one arch (cached by sources, flags and tools)."""
    base = base_command(load_build_config(csrc))
    cmd = [tools["nvcc"], "-cubin", f"-gencode=arch=compute_{arch[3:]},code={arch}", "-Xptxas=-v", *base,
           f"-I{csrc}", str(PROBES)]  # fmt: skip
    digest = hashlib.sha256()
    for p in sorted([*csrc.rglob("*"), PROBES]):
        if p.is_file() and p.suffix in (".cu", ".cuh", ".h", ".py"):
            digest.update(str(p).encode() + b"\0" + p.read_bytes())
    key = hashlib.sha256(json.dumps([CACHE_VERSION, cmd, digest.hexdigest(), tool_version(tools["nvcc"]),
                                     tool_version(tools["nvdisasm"])]).encode()).hexdigest()[:20]  # fmt: skip
    # The tree's path in the name, as tools/gpu_budgets.py: the negative control's older --csrc keeps its own
    # entry instead of evicting the real sources' one (and the reverse) on every run.
    tree = hashlib.sha256(str(csrc).encode()).hexdigest()[:8]
    cached = cache_dir / f"hot-loops-{arch}-{tree}-{key}.json"
    if cached.exists():
        return json.loads(cached.read_text())
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "probes.cubin"
        proc = subprocess.run([*cmd, "-o", str(cubin)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"nvcc failed for the probes ({arch}):\n{proc.stdout}{proc.stderr}")
        sass = subprocess.run([tools["nvdisasm"], "-g", "-c", str(cubin)], capture_output=True, text=True, check=True)
    result = {"ptxas": proc.stdout + proc.stderr, "sass": sass.stdout}
    cache_dir.mkdir(parents=True, exist_ok=True)
    for stale in cache_dir.glob(f"hot-loops-{arch}-{tree}-*.json"):
        stale.unlink(missing_ok=True)
    tmp_path = cached.with_suffix(f".tmp{os.getpid()}")
    tmp_path.write_text(json.dumps(result))
    tmp_path.replace(cached)  # atomic: an interrupted run leaves no truncated entry
    return result


def measure(variant: Variant, arch: str, sass: str, ptxas: dict, lines: dict) -> Row:
    """One variant's row: its kernel's fast path counted per element, and checked."""
    row = Row(variant.name, arch)
    funcs = parse_nvdisasm(sass)
    if variant.kernel not in funcs:
        row.violations.append(f"probe kernel {variant.kernel} not in the cubin")
        return row
    counts = count_path(hot_loop(funcs[variant.kernel]).instrs, lines)
    row.elements = 16 * counts.stored_bits.get(128, 0) / variant.vector_bytes
    if row.elements == 0:
        row.violations.append("no 128-bit stores on the fast path: cannot count its elements")
        return row
    for name in ("instructions", "int_logic", "fp", "shared_loads"):
        setattr(row, name, getattr(counts, name) / row.elements)
    row.philox_per_call = counts.in_lines / row.elements
    row.loads_first = counts.loads_first
    stats = ptxas.get(variant.kernel, {})
    row.registers = stats.get("registers", 0)
    row.local_bytes = stats.get("stack_bytes", 0) + stats.get("spill_stores", 0)
    check(row, variant)
    return row


def check(row: Row, variant: Variant) -> None:
    """Appends each violation of the variant's budget (and of the register and local-memory one)."""
    for metric, bound in variant.budget:
        value = getattr(row, metric)
        if metric == "loads_first":
            if not value:
                row.violations.append("a global load after the first floating-point instruction")
        elif value > bound:
            row.violations.append(f"{metric.replace('_', ' ')} {value:.1f} per element > {bound}")
    if row.registers > MAX_REGISTERS:
        row.violations.append(f"{row.registers} registers > {MAX_REGISTERS}")
    if row.local_bytes:
        row.violations.append(f"{row.local_bytes} bytes of stack or spills")


def run(csrc: Path, archs: list[str], cache_dir: Path) -> list[Row]:
    nvcc = find_nvcc(csrc)
    tools = {"nvcc": nvcc, "cuobjdump": find_cuobjdump(nvcc), "nvdisasm": find_nvdisasm(nvcc)}
    missing = [t for t, path in tools.items() if path is None]
    if missing:
        raise FileNotFoundError(", ".join(missing))
    lines = philox_lines(csrc)
    rows = []
    for arch in archs:
        probes = compile_probes(csrc, arch, tools, cache_dir)
        ptxas = parse_ptxas(probes["ptxas"])
        rows += [measure(v, arch, probes["sass"], ptxas, lines) for v in VARIANTS]
    return rows


def table(rows: list[Row], archs: list[str]) -> str:
    """Markdown: one row per variant, per-arch values joined by ' · ' in `archs` order."""
    by_variant = group_by_arch(rows, "variant")

    def cell(by_arch: dict[str, Row], fmt) -> str:
        return arch_cell(by_arch, archs, fmt)

    head = [f"fast path, fp32 params ({' · '.join(archs)})", "SASS / element", "integer/logic", "FP", "shared loads",
            "Philox / call", "loads first", "registers", "local B", "budget"]  # fmt: skip
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, by_arch in by_variant.items():
        bad = any(r.violations for r in by_arch.values())
        out.append("| " + " | ".join([
            name, cell(by_arch, lambda r: f"{r.instructions:.1f}"), cell(by_arch, lambda r: f"{r.int_logic:.1f}"),
            cell(by_arch, lambda r: f"{r.fp:.1f}"), cell(by_arch, lambda r: f"{r.shared_loads:.2f}"),
            cell(by_arch, lambda r: f"{r.philox_per_call:.1f}" if r.philox_per_call else "-"),
            cell(by_arch, lambda r: "yes" if r.loads_first else "no"), cell(by_arch, lambda r: str(r.registers)),
            cell(by_arch, lambda r: str(r.local_bytes)), "**FAIL**" if bad else "ok",
        ]) + " |")  # fmt: skip
    return "\n".join(out)


def budgets_text() -> str:
    def one(metric: str, bound: float) -> str:
        return "every global load first" if metric == "loads_first" else f"{metric.replace('_', ' ')} <= {bound}"

    return "; ".join(f"{v.name}: " + ", ".join(one(m, b) for m, b in v.budget) for v in VARIANTS if v.budget)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default=",".join(DEFAULT_ARCHS), help="comma-separated, e.g. sm_80,sm_90")
    parser.add_argument("--csrc", type=Path, default=ROOT / "csrc", help="the csrc/ folder to read")
    parser.add_argument("--cache-dir", type=Path, default=ROOT / "build-budgets", help="compiled-result cache")
    parser.add_argument("--json", type=Path, help="also write every row here")
    args = parser.parse_args(argv)
    archs = [a.strip() for a in args.arch.split(",") if a.strip()]
    try:
        rows = run(args.csrc.resolve(), archs, args.cache_dir)
    except FileNotFoundError as e:
        print(f"hot_loops: not found: {e} (the CUDA toolkit, or triton's bundled cuobjdump and nvdisasm)",
              file=sys.stderr)  # fmt: skip
        return 2
    except (RuntimeError, subprocess.CalledProcessError) as e:
        print(f"hot_loops: {e}", file=sys.stderr)
        return 2
    print(
        f"Hot loops per element (budgets, per element: {budgets_text()}; registers <= {MAX_REGISTERS}, "
        "no local memory)\n"
    )
    print(table(rows, archs))
    return finish(rows, args.json, lambda r: r.variant, "all hot loops within budget")


if __name__ == "__main__":
    sys.exit(main())
