"""tools/gpu_budgets.py: its parsers on fixed ptxas/cuobjdump text, and the whole check on the real sources.

The parser tests need no toolkit; the end-to-end test needs nvcc, cuobjdump (toolkit, the
nvidia-cuda-cuobjdump wheel or triton's copy) and c++filt, and skips cleanly without them.
"""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("gpu_budgets", ROOT / "tools" / "gpu_budgets.py")
gb = importlib.util.module_from_spec(_spec)
sys.modules["gpu_budgets"] = gb  # dataclasses look their module up by name
_spec.loader.exec_module(gb)

ADAM = "_ZN7distopt4cuda19multi_tensor_kernelINS0_18TensorListMetadataILi7EEENS_6AdamOpIfN3c108BFloat16EfLb0EEE"
SCALE = "_ZN7distopt4cuda19multi_tensor_kernelINS0_18TensorListMetadataILi2EEENS_7ScaleOpIffEEE"
TOTAL = "_ZN7distopt12l2norm_totalEPKflPf"

# Shaped like nvcc -Xptxas=-v (CUDA 13): the Adam kernel spills, and a non-inlined callee follows it.
PTXAS = f"""\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '{ADAM}' for 'sm_90'
ptxas info    : Function properties for {ADAM}
    8 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 64 registers, used 0 barriers, 8 bytes cumulative stack size
ptxas info    : Function properties for __internal_accurate_pow
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Compile time = 60.121 ms
ptxas info    : Compiling entry function '{SCALE}' for 'sm_90'
ptxas info    : Function properties for {SCALE}
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 32 registers, used 1 barriers
ptxas info    : Compiling entry function '{TOTAL}' for 'sm_90'
ptxas info    : Function properties for {TOTAL}
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 18 registers, used 1 barriers, 128 bytes smem
"""

# Shaped like cuobjdump -sass: the scale kernel's aligned loop (peeled once: two copies), then its tail.
SASS = f"""\
\t\tFunction : {SCALE}
\t.headerflags\t@"EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*0070*/                   LDG.E R2, desc[UR14][R2.64] ;                     /* 0x0000000e02027981 */
        /*04b0*/                   LDG.E.128 R4, desc[UR14][R4.64] ;                 /* 0x0000000e04047981 */
        /*07f0*/                   STG.E.128 desc[UR14][R12.64], R4 ;                /* 0x000000040c007986 */
        /*08e0*/              @!P0 LDG.E.128.CONSTANT R4, desc[UR14][R6.64] ;        /* 0x0000000e06047981 */
        /*0ca0*/               @P1 STG.E.128 desc[UR14][R12.64+0x10], R4 ;          /* 0x000000040c007986 */
        /*0ea0*/                   LDG.E.U16 R6, desc[UR14][R6.64] ;                 /* 0x0000000e06067981 */
        /*0f40*/                   STG.E desc[UR14][R10.64], R9 ;                    /* 0x000000090a007986 */
        /*1000*/                   LDS R9, [R10] ;                                   /* 0x000000000a097984 */
\t\tFunction : {TOTAL}
        /*0070*/                   LDG.E R2, desc[UR4][R2.64] ;                      /* 0x0000000402027981 */
"""

ELF = f"""\
.nv.info.{SCALE}
\t<0x1>
\tAttribute:\tEIATTR_MAX_THREADS
\tFormat:\tEIFMT_SVAL
\tValue:\t0x200 0x1 0x1
\t<0x2>
\tAttribute:\tEIATTR_CBANK_PARAM_SIZE
\tFormat:\tEIFMT_HVAL
\tValue:\t0xc68
.nv.info.{TOTAL}
\tAttribute:\tEIATTR_CBANK_PARAM_SIZE
\tFormat:\tEIFMT_HVAL
\tValue:\t0x18
"""

META5 = "distopt::cuda::TensorListMetadata<5, false>"
ADAM_OP = "distopt::(anonymous namespace)::AdamOp<float, c10::BFloat16, float, false, false>"
ADAM_NAME = (f"void distopt::cuda::multi_tensor_kernel<{META5}, {ADAM_OP}, distopt::(anonymous namespace)::"
             f"AdamDeviceArgs>({META5}, {ADAM_OP}, distopt::(anonymous namespace)::AdamDeviceArgs)")
REM_NAME = ADAM_NAME.replace("AdamOp<float, c10::BFloat16, float, false, false>",
                             "AdamOp<c10::BFloat16, c10::Half, distopt::NoList, true, false>")
LARGE_CAP_NAME = ADAM_NAME.replace("TensorListMetadata<5, false>", "TensorListMetadata<6, true>").replace(
    "float, false, false>", "float, false, true>")
META2 = "distopt::cuda::TensorListMetadata<2, false>"
SCALE_OP = "distopt::(anonymous namespace)::ScaleOp<float, float>"
SCALE_NAME = (f"void distopt::cuda::multi_tensor_kernel<{META2}, {SCALE_OP}, distopt::ScaleArgs>({META2}, "
              f"{SCALE_OP}, distopt::ScaleArgs)")
TOTAL_NAME = "distopt::(anonymous namespace)::l2norm_total(float const*, long, float*)"
CLEANUP = "distopt::(anonymous namespace)::CleanupMeta<{}>"
CLEANUP_NAME = (f"void distopt::(anonymous namespace)::l2norm_per_tensor<{CLEANUP} >({CLEANUP}, float const*, float*, "
                "float*)")


def kernel(demangled: str, **stats) -> "gb.Kernel":
    """A described and checked Kernel with the given ptxas/SASS figures (clean defaults)."""
    k = gb.Kernel(arch="sm_90", mangled="x", param_bytes=stats.pop("param_bytes", 3008), **stats)
    gb.describe(k, demangled)
    k.blocks_per_sm, k.occupancy = gb.occupancy(k.registers, k.smem_bytes, 512, gb.ARCH_LIMITS["sm_90"])
    gb.check(k)
    return k


def test_parse_ptxas_charges_callee_frames_to_their_entry():
    got = gb.parse_ptxas(PTXAS)
    assert got[ADAM] == {"registers": 64, "stack_bytes": 8, "spill_stores": 8, "spill_loads": 4, "smem_bytes": 0}
    assert got[SCALE]["registers"] == 32 and got[SCALE]["spill_stores"] == 0
    assert got[TOTAL]["smem_bytes"] == 128
    assert "__internal_accurate_pow" not in got


def test_parse_sass_counts_access_widths_with_predicates_and_modifiers():
    got = gb.parse_sass(SASS)
    assert got[SCALE] == {"LDG.32": 1, "LDG.128": 2, "STG.128": 2, "LDG.16": 1, "STG.32": 1}
    assert got[TOTAL] == {"LDG.32": 1}
    assert [gb.access_width(m) for m in (".E.128", ".E.64", ".E.U16", ".E.S8", ".E", ".E.128.CONSTANT")] == [
        128, 64, 16, 8, 32, 128]


def test_parse_elf_params():
    assert gb.parse_elf_params(ELF) == {SCALE: 0xC68, TOTAL: 24}


def test_describe_models_adam_dtypes():
    # fp32 params, bf16 grads, fp32 param_out: N = 8; per step p 2, g 1, m 2, v 2 loads; p, m, v, out 2 each.
    k = kernel(ADAM_NAME, registers=60, accesses={"LDG.128": 7, "STG.128": 8})
    assert k.name == "adam p=fp32 g=bf16 out=fp32" and k.op == "adam"
    assert (k.expected_ldg128, k.expected_stg128) == (7, 8)
    assert k.bytes_per_elem == 2 + 4 * 2 + 8 * 2 + 4  # grad, param r/w, m and v r/w, param_out
    assert k.violations == []
    rem = kernel(REM_NAME, registers=60, accesses={"LDG.128": 5, "STG.128": 4})
    assert rem.name == "adam p=bf16 g=fp16 out=none rem"
    assert (rem.expected_ldg128, rem.expected_stg128) == (7, 6)  # p, g, rem 1; m, v 2 each
    assert rem.bytes_per_elem == 2 + 2 * 2 + 8 * 2 + 2 * 2
    assert any("LDG.128" in v for v in rem.violations) and any("STG.128" in v for v in rem.violations)


STATES_NAME = ADAM_NAME.replace("AdamOp<float, c10::BFloat16, float, false, false>",
                               "AdamStatesOp<float, c10::BFloat16, float, false, false>")


def test_describe_models_the_low_precision_moment_kernels():
    """8 elements per lane: fp32 param and param_out 2 packs, bf16 grads 1, each moment's fp32 (2) and bf16
    (1) paths; the 8-bit codes one 64-bit load and store per moment, allowed there and only there; and the
    two 128-bit loads that copy the maps' bucket tables into shared memory."""
    ok = {"LDG.128": 9 + gb.STATES_TABLE_LOADS, "STG.128": 10, "LDG.64": 2, "STG.64": 2}
    k = kernel(STATES_NAME, registers=64, accesses=ok)
    assert k.name == "adam-states p=fp32 g=bf16 out=fp32" and k.op == "adam-states"
    assert (k.expected_ldg128, k.expected_stg128, k.expected_ldg64, k.expected_stg64) == (9, 10, 2, 2)
    assert k.bytes_per_elem == 4 + 2 + 1 + 1 + 4 + 1 + 1 + 4  # param r/w, grad, codes r/w, param_out
    assert k.violations == []
    # nvcc versions the loop by moment format, each version loading its formats' lists: more loads pass,
    # fewer than one step's do not.
    assert kernel(STATES_NAME, registers=64, accesses={**ok, "LDG.128": 5 * 9 + 2}).violations == []
    short = kernel(STATES_NAME, registers=64, accesses={**ok, "LDG.128": 8 + 2})
    assert any("8 LDG.128 in the aligned loop, want at least 9" in v for v in short.violations), short.violations
    split = kernel(STATES_NAME, registers=64, accesses={**ok, "LDG.64": 3})  # a pack split in two somewhere
    assert any("3 LDG.64" in v for v in split.violations)
    no_codes = kernel(STATES_NAME, registers=64, accesses={"LDG.128": 11, "STG.128": 10})
    assert any("LDG.64" in v for v in no_codes.violations) and any("STG.64" in v for v in no_codes.violations)
    plain = kernel(ADAM_NAME, registers=60, accesses={"LDG.128": 7, "STG.128": 8, "LDG.64": 2})
    assert any("64-bit" in v for v in plain.violations)  # the fp32-moment kernels read no 64-bit data


def test_large_metadata_instantiations_get_the_large_parameter_limit():
    """A 32K instantiation may take up to 32,764 B of parameters; every other kernel must fit 4 KiB (what
    runs where the runtime refuses large parameters)."""
    large = kernel(LARGE_CAP_NAME, registers=60, accesses={"LDG.128": 7, "STG.128": 8}, param_bytes=32320)
    assert large.name == "adam p=fp32 g=bf16 out=fp32 capturable 32K" and large.violations == []
    too_big = kernel(LARGE_CAP_NAME, param_bytes=32765)
    assert any("32765 B of kernel parameters > 32764" in v for v in too_big.violations)
    assert any("4100 B of kernel parameters > 4096" in v for v in kernel(ADAM_NAME, param_bytes=4100).violations)
    big_cleanup = kernel(CLEANUP_NAME.replace("{}", "true"), registers=30, param_bytes=32032)
    small_cleanup = kernel(CLEANUP_NAME.replace("{}", "false"), registers=30, param_bytes=3232)
    assert (big_cleanup.name, small_cleanup.name) == ("l2norm_per_tensor 32K", "l2norm_per_tensor")
    assert big_cleanup.violations == small_cleanup.violations == []


def test_describe_plain_kernel_and_scale():
    total = kernel(TOTAL_NAME, registers=18, smem_bytes=128, param_bytes=24)
    assert total.name == "l2norm_total" and total.expected_ldg128 is None and total.violations == []
    scale = kernel(SCALE_NAME, registers=32, accesses={"LDG.128": 2, "STG.128": 2, "LDG.32": 3})
    assert scale.name == "scale fp32->fp32" and scale.bytes_per_elem == 8 and scale.violations == []


def test_occupancy_follows_register_allocation_rules():
    lim = gb.ARCH_LIMITS["sm_90"]
    assert gb.occupancy(64, 0, 512, lim) == (2, 0.5)
    assert gb.occupancy(65, 0, 512, lim) == (1, 0.25)  # 72 regs allocated per thread: 7 warps per sub-partition
    assert gb.occupancy(32, 0, 512, lim) == (4, 1.0)
    assert gb.occupancy(34, 0, 512, lim) == (3, 0.75)
    assert gb.occupancy(32, 200 * 1024, 256, lim) == (1, 0.125)  # shared memory bound


@pytest.mark.parametrize(
    ("stats", "needle"),
    [
        ({"registers": 65}, "registers > 64"),
        ({"spill_stores": 8, "spill_loads": 8, "stack_bytes": 8}, "local memory"),
        ({"stack_bytes": 16}, "local memory"),  # a local array: no spill, still off-chip
        ({"param_bytes": 4100}, "kernel parameters"),
        ({"param_bytes": None}, "parameter size not found"),
        # a list's 16-byte pack split into two 64-bit accesses
        ({"accesses": {"LDG.128": 6, "LDG.64": 2, "STG.128": 8}}, "64-bit"),
        # a list read with 32-bit accesses (fp32 grads N=4 in one copy, 128 in another): 11 is no multiple of 7
        ({"accesses": {"LDG.128": 11, "STG.128": 16}}, "LDG.128"),
        ({"accesses": {}}, "LDG.128"),
    ],
)
def test_check_flags_each_budget_violation(stats, needle):
    base = {"registers": 60, "accesses": {"LDG.128": 7, "STG.128": 8}}
    k = kernel(ADAM_NAME, **{**base, **stats})
    assert any(needle in v for v in k.violations), k.violations


def test_check_accepts_an_unrolled_aligned_loop():
    assert kernel(ADAM_NAME, registers=60, accesses={"LDG.128": 14, "STG.128": 16, "LDG.32": 9}).violations == []


def test_unknown_op_is_a_violation():
    k = kernel(SCALE_NAME.replace("ScaleOp", "NewOp"), registers=20)
    assert any("no access model" in v for v in k.violations)


def test_table_marks_failures():
    good = kernel(SCALE_NAME, registers=32, accesses={"LDG.128": 2, "STG.128": 2})
    bad = kernel(ADAM_NAME, registers=92, accesses={"LDG.128": 7, "STG.128": 8})
    text = gb.table([good, bad], ["sm_90"])
    assert "| scale fp32->fp32 | 32 |" in text and "92" in text and "**FAIL**" in text
    assert "| 8 | 2.67 | ok |" in text  # 8 B/elem: 1e9 elements at 3 TB/s


def _tools_missing() -> str | None:
    nvcc = gb.find_nvcc()
    if nvcc is None:
        return "nvcc"
    if gb.find_cuobjdump(nvcc) is None:
        return "cuobjdump"
    return None if gb.find_demangler() else "c++filt"


@pytest.mark.slow
def test_real_sources_meet_the_budgets(tmp_path, capsys):
    """The CI check: every instantiation of csrc/cuda on sm_80 and sm_90 within budget (cached in build-budgets/)."""
    missing = _tools_missing()
    if missing:
        pytest.skip(f"{missing} not found")
    out = tmp_path / "budgets.json"
    rc = gb.main(["--json", str(out)])
    captured = capsys.readouterr()
    records = json.loads(out.read_text())
    names = {r["name"] for r in records}
    assert {r["arch"] for r in records} == {"sm_80", "sm_90"}
    # 36 Adam dtype combinations plus 12 with bf16 remainders, each eager and capturable; 9 scale casts,
    # 3 norms and the per-tensor cleanup: each with 4 KiB and with 32K metadata. One total kernel.
    assert sum(n.startswith("adam ") for n in names) == 48 * 2 * 2
    assert sum(n.startswith("adam ") and n.endswith(" capturable 32K") for n in names) == 48
    # The low-precision-moment variants: the same dtype combinations, eager and capturable, both sizes.
    assert sum(n.startswith("adam-states ") for n in names) == 48 * 2 * 2
    assert sum(n.startswith("adam-states ") and n.endswith(" capturable 32K") for n in names) == 48
    assert sum(n.startswith("scale ") for n in names) == 9 * 2 and sum(n.startswith("l2norm ") for n in names) == 3 * 2
    assert {"l2norm_per_tensor", "l2norm_per_tensor 32K", "l2norm_total"} <= names
    by_name = {(r["name"], r["arch"]): r for r in records}
    assert max(r["param_bytes"] for r in records if not r["name"].endswith(" 32K")) <= gb.SMALL_PARAM_BYTES
    assert by_name[("adam p=fp32 g=fp32 out=none 32K", "sm_90")]["param_bytes"] > gb.SMALL_PARAM_BYTES
    assert rc == 0, captured.err


@pytest.mark.slow
def test_low_precision_moment_kernels_use_no_local_memory(tmp_path):
    """The local-memory budget for the adam-states kernels on its own (the check above covers it among all
    the others): their per-lane 8-element loop is the tightest fit under the 64-register cap."""
    missing = _tools_missing()
    if missing:
        pytest.skip(f"{missing} not found")
    out = tmp_path / "budgets.json"
    gb.main(["--json", str(out)])  # cached in build-budgets/: no second compile after the test above
    records = [r for r in json.loads(out.read_text()) if r["name"].startswith("adam-states ")]
    assert len(records) == 48 * 2 * 2 * 2  # both metadata sizes, eager and capturable, sm_80 and sm_90
    spilling = [(r["arch"], r["name"]) for r in records if max(r["stack_bytes"], r["spill_stores"], r["spill_loads"])]
    assert not spilling, spilling
    assert max(r["registers"] for r in records) <= gb.MAX_REGISTERS


@pytest.mark.parametrize("name", [ADAM_NAME, STATES_NAME])
def test_no_op_may_spill(name):
    """Negative control: a few bytes of spills (what the first low-precision-moment kernels had at the
    64-register cap) are a violation for every op, those kernels included."""
    assert gb.MAX_LOCAL_BYTES == 0
    k = kernel(name, registers=64, stack_bytes=8, spill_stores=4, spill_loads=4)
    assert any("local memory: 8 B stack, 4 B spill stores, 4 B spill loads" in v for v in k.violations), k.violations
