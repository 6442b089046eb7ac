"""tools/hot_loops.py and tools/sass_paths.py: the static hot-loop proxies of the CUDA Adam kernels.

The parser and path tests run on fixed nvdisasm-shaped text and need no toolkit. The end-to-end tests
(about a minute in all uncached, so they run by default) compile tools/probes/adam_states_probes.cu
with nvcc and read it with nvdisasm (the toolkit's, or triton's bundled copy), and skip without them:
the real sources must meet the budgets, and the kernels of commit 89b84a8 (extracted with git), or for
registers a deliberately broken probe, must fail every one of them.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


sp = _load("sass_paths")
hl = _load("hot_loops")

# A kernel shaped like nvdisasm -g -c output: a loop whose body divides (a slow path behind a call), has a
# warp collective's divergence fallback (BRA.DIV), and a Philox line; then a subroutine and the padding.
SASS = """\
//--------------------- .text.k                  --------------------------
\t.section\t.text.k,"ax",@progbits
k:
.text.k:
\t//## File "/x/csrc/math/philox.h", line 10
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
\t//## File "/x/csrc/cuda/k.cuh", line 5
        /*0010*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0020*/                   LDG.E.64 R8, desc[UR4][R2.64+0x10] ;
        /*0030*/                   FMUL R4, R4, R5 ;
        /*0040*/                   LDS R6, [R7+0x100] ;
        /*0050*/                   IADD3 R7, R7, 0x1, RZ ;
        /*0060*/                   FCHK P0, R4, R5 ;
        /*0070*/              @!P0 BRA `(.L_x_1) ;
        /*0080*/                   CALL.REL.NOINC `($__internal_0_slowpath) ;
        /*0090*/                   BRA `(.L_x_2) ;
.L_x_1:
        /*00a0*/                   FADD R4, R4, R5 ;
.L_x_2:
\t//## File "/x/csrc/math/philox.h", line 12
        /*00b0*/                   LOP3.LUT R9, R9, R10, R11, 0x96, !PT ;
        /*00c0*/                   BRA.DIV UR4, `(.L_x_3) ;
\t//## File "/x/csrc/cuda/k.cuh", line 9
        /*00d0*/                   STG.E.128 desc[UR4][R2.64], R4 ;
        /*00e0*/                   ISETP.GE.AND P1, PT, R7, 0x10, PT ;
        /*00f0*/              @!P1 BRA `(.L_x_0) ;
        /*0100*/                   EXIT ;
.L_x_3:
        /*0110*/                   SHFL.BFLY PT, R1, R1, 0x1, 0x1f ;
        /*0120*/                   BRA `(.L_x_2) ;
$__internal_0_slowpath:
        /*0130*/                   FFMA R4, R4, R5, R6 ;
        /*0140*/                   RET.REL.NODEC R16 `(k) ;
.L_x_9:
        /*0150*/                   BRA `(.L_x_9);
"""

LINES = {"math/philox.h": [(10, 12)]}


def test_parse_nvdisasm_keeps_lines_labels_and_predicates():
    fn = sp.parse_nvdisasm(SASS)["k"]
    assert len(fn.instrs) == 22 and fn.labels[".L_x_0"] == 1 and fn.labels["$__internal_0_slowpath"] == 19
    i = fn.instrs[7]
    assert (i.pred, i.opcode, i.target) == ("@!P0", "BRA", ".L_x_1")
    assert (fn.instrs[1].file, fn.instrs[1].line) == ("/x/csrc/cuda/k.cuh", 5)
    assert fn.instrs[0].line == 10


def test_fast_path_avoids_calls_and_divergence_fallbacks():
    """The loop's fast path: the division's inline result (not the slow-path call), the converged side
    of BRA.DIV, back to the head; its counts per class."""
    path = sp.hot_loop(sp.parse_nvdisasm(SASS)["k"])
    assert path.head_offset == 0x10 and not path.nested
    assert [i.offset for i in path.instrs] == [0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0xA0, 0xB0, 0xC0, 0xD0,
                                               0xE0, 0xF0]  # fmt: skip
    c = sp.count_path(path.instrs, LINES)
    assert (c.instructions, c.int_logic, c.fp, c.shared_loads, c.global_loads) == (13, 3, 3, 1, 2)
    assert c.loads_first and c.stored_bits == {128: 1} and c.in_lines == 2  # LOP3, BRA.DIV: line 12


def test_a_load_after_arithmetic_is_seen():
    late = SASS.replace("        /*0020*/                   LDG.E.64 R8, desc[UR4][R2.64+0x10] ;\n", "").replace(
        "        /*0050*/                   IADD3 R7, R7, 0x1, RZ ;",
        "        /*0050*/                   LDG.E.64 R8, desc[UR4][R2.64+0x10] ;",
    )
    c = sp.count_path(sp.hot_loop(sp.parse_nvdisasm(late)["k"]).instrs)
    assert c.global_loads == 2 and not c.loads_first


def test_moves_are_not_integer_work():
    parse = sp.parse_nvdisasm
    text = SASS.replace("IADD3 R7, R7, 0x1, RZ", "IMAD.MOV.U32 R7, RZ, RZ, R8")
    assert sp.count_path(sp.hot_loop(parse(text)["k"]).instrs).int_logic == 2
    text = SASS.replace("IADD3 R7, R7, 0x1, RZ", "HFMA2.MMA R7, -RZ, RZ, 1.875, 0")
    c = sp.count_path(sp.hot_loop(parse(text)["k"]).instrs)
    assert (c.int_logic, c.fp) == (2, 3)


def test_function_ranges_find_definitions_not_calls():
    source = """\
// philox_rounds( in a comment
DISTOPT_HD void philox_mulhilo(uint32_t m, uint32_t c) {
  hi = m;
}
template <typename Lanes>
DISTOPT_HD void philox_rounds(Lanes& c0,
                              const PhiloxKeys& key) {
  philox_mulhilo(kPhiloxM0, c0);
}
DISTOPT_HD Philox4 rounding_bits(const RoundingKey& key) { return philox4x32_10(key); }
void other() { const Philox4 r = rounding_bits(key); }
"""
    assert sp.function_ranges(source, hl.PHILOX_FUNCTIONS) == [(2, 4), (6, 9), (10, 10)]


def _row(variant: str, **values) -> hl.Row:
    row = hl.Row(variant, "sm_90", elements=8, registers=60, loads_first=True)
    for k, v in values.items():
        setattr(row, k, v)
    hl.check(row, next(v for v in hl.VARIANTS if v.name == variant))
    return row


@pytest.mark.parametrize(
    ("variant", "values", "needle"),
    [
        ("8-bit", {"instructions": 111}, "instructions 111.0 per element > 110"),
        ("8-bit", {"int_logic": 56}, "int logic 56.0 per element > 55"),
        ("8-bit", {"shared_loads": 4.5}, "shared loads 4.5 per element > 4"),
        ("8-bit", {"loads_first": False}, "a global load after the first floating-point instruction"),
        ("bf16+SR", {"instructions": 120}, "instructions 120.0 per element > 110"),
        ("bf16+SR", {"philox_per_call": 46}, "philox per call 46.0 per element > 45"),
        ("bf16", {"loads_first": False}, "a global load after"),
        ("fp32 moments", {"registers": 65}, "65 registers > 64"),
        ("bf16", {"local_bytes": 8}, "8 bytes of stack or spills"),
    ],
)
def test_each_budget_is_checked(variant, values, needle):
    assert _row(variant).violations == []
    row = _row(variant, **values)
    assert any(needle in v for v in row.violations), row.violations


def test_table_marks_failures():
    good, bad = _row("8-bit", instructions=90.0), _row("bf16+SR", instructions=150.0)
    text = hl.table([good, bad], ["sm_90"])
    assert "| 8-bit | 90.0 |" in text and "**FAIL**" in text


def _tools_missing() -> str | None:
    sys.path.insert(0, str(ROOT / "tools"))
    import cuda_tools

    nvcc = cuda_tools.find_nvcc()
    if nvcc is None:
        return "nvcc"
    return None if cuda_tools.find_nvdisasm(nvcc) else "nvdisasm"


def test_real_kernels_meet_the_hot_loop_budgets(tmp_path, capsys):
    """The CI check: every variant's fast path on sm_80 and sm_90 within budget (cached in build-budgets/)."""
    missing = _tools_missing()
    if missing:
        pytest.skip(f"{missing} not found")
    out = tmp_path / "rows.json"
    rc = hl.main(["--json", str(out)])
    captured = capsys.readouterr()
    rows = {(r["variant"], r["arch"]): r for r in json.loads(out.read_text())}
    assert rc == 0, captured.err
    assert len(rows) == len(hl.VARIANTS) * 2
    for arch in ("sm_80", "sm_90"):
        eight = rows[("8-bit", arch)]
        assert eight["elements"] == 8  # one 256-element block per warp: 8 per lane
        assert eight["shared_loads"] == 4  # two map reads and two bucket reads per element
        assert rows[("bf16+SR", arch)]["philox_per_call"] > 30  # the generator is found, not missed


def test_negative_control_the_kernels_before_fail_every_budget(tmp_path):
    """The kernels of commit 89b84a8 (binary search, loads late, the key schedule in every call) read by
    the same tool: each budget fails on both architectures."""
    missing = _tools_missing()
    if missing:
        pytest.skip(f"{missing} not found")
    if shutil.which("git") is None:
        pytest.skip("git not found")
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "89b84a8", "csrc"], capture_output=True)
    if archive.returncode != 0:
        pytest.skip("commit 89b84a8 is not in this clone (shallow?)")
    subprocess.run(["tar", "-x", "-C", str(tmp_path)], input=archive.stdout, check=True)
    out = tmp_path / "rows.json"
    # Its own cache: a tree extracted afresh each run would only leave stale entries in build-budgets/.
    rc = hl.main(["--csrc", str(tmp_path / "csrc"), "--json", str(out), "--cache-dir", str(tmp_path / "cache")])
    assert rc == 1
    rows = {(r["variant"], r["arch"]): r for r in json.loads(out.read_text())}
    for arch in ("sm_80", "sm_90"):
        failed = " ".join(rows[("8-bit", arch)]["violations"])
        for needle in ("instructions", "int logic", "shared loads", "global load after"):
            assert needle in failed, (arch, failed)
        failed = " ".join(rows[("bf16+SR", arch)]["violations"])
        for needle in ("instructions", "philox per call", "global load after"):
            assert needle in failed, (arch, failed)
        assert rows[("bf16", arch)]["violations"]  # its loads too
    # The local-memory budget: the old bf16-param SR kernel kept a stack frame on sm_90.
    assert any("bytes of stack or spills" in v for v in rows[("bf16+SR p=bf16", "sm_90")]["violations"])


BROKEN_PROBES = r"""
// Deliberately broken kernels: what the register and local-memory budgets exist to catch.
// No __launch_bounds__, and 24 float4 loads live at once: ptxas needs far more than 64 registers.
extern "C" __global__ void too_many_registers(const float4* __restrict__ in, float4* __restrict__ out) {
  float4 v[24];
#pragma unroll
  for (int i = 0; i < 24; ++i) v[i] = in[threadIdx.x + i * 1024];
  float t = 0.f;  // every store needs every load: all 96 values stay live until t is known
#pragma unroll
  for (int i = 0; i < 24; ++i) t += v[i].x * v[i].y + v[i].z * v[i].w;
#pragma unroll
  for (int i = 0; i < 24; ++i) {
    out[threadIdx.x + i * 1024] = make_float4(v[i].x * t, v[i].y * t, v[i].z * t, v[i].w * t);
  }
}
// A local array indexed at run time lives in off-chip local memory (a stack frame), spills or not.
extern "C" __global__ void local_array(const float* __restrict__ in, float* __restrict__ out, int k) {
  float a[64];
#pragma unroll 1
  for (int i = 0; i < 64; ++i) a[i] = in[threadIdx.x + i * 1024];  // a rolled loop: registers cannot be indexed
  out[threadIdx.x] = a[k & 63] + a[(k + 7) & 63];
}
"""


def test_negative_control_broken_probes_fail_registers_and_local_memory(tmp_path):
    """The register and local-memory budgets on real ptxas output: the kernels of 89b84a8 stay within 64
    registers (the launch bounds cap them), so a deliberately broken probe must fail each budget."""
    missing = _tools_missing()
    if missing:
        pytest.skip(f"{missing} not found")
    import cuda_tools

    source = tmp_path / "broken.cu"
    source.write_text(BROKEN_PROBES)
    cmd = [cuda_tools.find_nvcc(), "-cubin", "-gencode=arch=compute_90,code=sm_90", "-Xptxas=-v", "-O3",
           str(source), "-o", str(tmp_path / "broken.cubin")]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
    stats = cuda_tools.parse_ptxas(proc.stdout + proc.stderr)
    fp32 = next(v for v in hl.VARIANTS if v.name == "fp32 moments")
    for name, needle in (("too_many_registers", "registers > 64"), ("local_array", "bytes of stack or spills")):
        s = stats[name]
        row = hl.Row(fp32.name, "sm_90", registers=s["registers"], local_bytes=s["stack_bytes"] + s["spill_stores"],
                     loads_first=True)  # fmt: skip
        hl.check(row, fp32)
        assert any(needle in v for v in row.violations), (name, s, row.violations)


HOST_TABLES = r"""
#include <cstddef>
#include <cstdio>
#include "math/quant_tables.h"
// Each map's length in bytes (8 bytes), then its values and buckets (the start of the struct, in order,
// without padding): what the device copy must begin with.
template <typename Map>
void dump(const Map& map) {
  static_assert(offsetof(Map, buckets) == sizeof(map.values), "values, then buckets");
  const unsigned long long n = sizeof(map.values) + sizeof(map.buckets);
  std::fwrite(&n, sizeof(n), 1, stdout);
  std::fwrite(&map, n, 1, stdout);
}
int main() {
  dump(distopt::kSignedQuantMap);
  dump(distopt::kUnsignedQuantMap);
}
"""


def test_device_tables_equal_the_host_tables(tmp_path):
    """The 8-bit maps are constant expressions (math/quant_tables.h) evaluated by each compiler: nvcc's copy
    in the compiled kernels (read from the cubin) must hold the host compiler's bytes, which the CPU
    kernels and the emulated CUDA kernels use (so the tests' bit-identity covers the GPU's tables too)."""
    missing = _tools_missing()
    if missing:
        pytest.skip(f"{missing} not found")
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no host C++ compiler")
    import cuda_tools
    import torch.utils.cpp_extension as ce

    source = tmp_path / "tables.cpp"
    source.write_text(HOST_TABLES)
    binary = tmp_path / "tables"
    includes = [f"-I{ROOT / 'csrc'}", *(f"-I{i}" for i in ce.include_paths())]
    subprocess.run([cxx, "-std=c++17", "-O1", *includes, str(source), "-o", str(binary)], check=True)
    host = subprocess.run([str(binary)], capture_output=True, check=True).stdout
    cubin = tmp_path / "probes.cubin"
    base = cuda_tools.base_command(cuda_tools.load_build_config(ROOT / "csrc"))
    nvcc = [cuda_tools.find_nvcc(), "-cubin", "-gencode=arch=compute_90,code=sm_90", *base, f"-I{ROOT / 'csrc'}"]
    subprocess.run([*nvcc, str(hl.PROBES), "-o", str(cubin)], check=True, capture_output=True)
    device = cuda_tools.elf_symbols(cubin, "QuantMap")
    for name in ("kSignedQuantMap", "kUnsignedQuantMap"):
        n = int.from_bytes(host[:8], "little")
        want, host = host[8 : 8 + n], host[8 + n :]
        got = next(v for k, v in device.items() if name in k)
        assert len(got) >= n and got[:n] == want, f"{name}: the GPU's table differs from the host's"
    assert host == b""
