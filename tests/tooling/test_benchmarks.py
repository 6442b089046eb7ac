"""Smoke tests of benchmarks/bench_kernels.py, bench_host.py and bench_offload.py on CPU: they run, check their
results and write them.

No speed assertions: speed targets belong to the benchmarks, not to the tests.
"""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_kernels.py"

# What the benchmark must report, per kernel: {mix: implementations}. Written out here rather than
# imported, so that dropping a configuration from the benchmark fails this test.
EXPECTED = {
    "adam_step_": {
        "fp32": {"distopt", "torch"},
        "bf16-mixed": {"distopt"},
        "bf16-remainder": {"distopt"},
        "fp16-mixed": {"distopt"},
    },
    "pipeline": {"fp32": {"distopt", "torch"}, "bf16-mixed": {"distopt", "torch"}},
    "l2norm": {"fp32": {"distopt", "torch"}, "bf16": {"distopt", "torch"}},
}
LAYOUTS = {"flat", "list"}


def run_quick(script: Path, out: Path, results: str, *args: str, timeout: float) -> tuple[dict, list, str]:
    """Runs a benchmark script with `args` (writing to `out`), which must succeed; returns its
    results JSON's meta and rows, and what it printed."""
    proc = subprocess.run([sys.executable, str(script), *args, "--out", str(out)], capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"{script.name} failed:\n{proc.stdout}\n{proc.stderr}"
    data = json.loads((out / results).read_text())
    return data["meta"], data["rows"], proc.stdout


def test_bench_kernels_cpu_quick(tmp_path: Path) -> None:
    meta, rows, _ = run_quick(BENCH, tmp_path, "results.json", "--device", "cpu", "--quick", timeout=120)
    assert meta["device"] == "cpu" and meta["failures"] == []
    assert math.isfinite(meta["copy_bandwidth_gbps"]) and meta["copy_bandwidth_gbps"] > 0

    sizes = {row["numel"] for row in rows}
    assert len(sizes) >= 2
    found = {(r["kernel"], r["mix"], r["impl"], r["layout"], r["numel"]) for r in rows}
    for kernel, mixes in EXPECTED.items():
        for mix, impls in mixes.items():
            for impl in impls:
                for layout in LAYOUTS:
                    for numel in sizes:
                        assert (kernel, mix, impl, layout, numel) in found, (kernel, mix, impl, layout, numel)

    with_torch = {(r["kernel"], r["mix"], r["layout"], r["numel"]) for r in rows if r["impl"] == "torch"}
    for row in rows:
        for key in ("ms", "ms_p10", "ms_p90", "gbps", "pct_copy_bw"):
            assert math.isfinite(row[key]) and row[key] > 0, (key, row)
        assert row["ms_p10"] <= row["ms"] <= row["ms_p90"], row
        assert row["bytes"] > 0 and row["reps"] >= 1, row
        # A distopt row with a torch row beside it reports the speedup; no other row does.
        if row["impl"] == "distopt" and (row["kernel"], row["mix"], row["layout"], row["numel"]) in with_torch:
            assert math.isfinite(row["speedup"]) and row["speedup"] > 0, row
        else:
            assert row["speedup"] is None, row

    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "results.png").stat().st_size > 0


BENCH_HOST = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_host.py"
HOST_CASES = {"fused_small", "fused_medium", "dfa_ws1", "dfa_ws2", "fsdp2_fused", "fsdp2_foreach", "fsdp2_local",
              "fsdp2_kept", "loop_1k", "loop_1k_foreach", "loop_1k_keep", "loop_10k", "loop_10k_foreach",
              "loop_10k_keep", "loop_fsdp2_1k", "loop_fsdp2_1k_foreach", "loop_fsdp2_1k_first", "loop_dfa_1k"}


def test_bench_host_quick(tmp_path: Path) -> None:
    """bench_host.py --quick runs every case (those on 2 ranks on forked gloo ranks), checks that
    each pair of optimizers agrees, and writes its JSON (and plot). Its targets are reported, not tested."""
    meta, rows, printed = run_quick(BENCH_HOST, tmp_path, "results_host.json", "--quick", timeout=300)
    assert "thread(s)" in printed and "torch" in printed
    assert meta["threads"] == 1 and meta["torch"] and meta["device_name"]
    assert {r["case"] for r in rows} == HOST_CASES
    for row in rows:
        for key in ("distopt_ms", "distopt_p10_ms", "distopt_p90_ms", "torch_ms", "torch_p10_ms", "torch_p90_ms"):
            assert math.isfinite(row[key]) and row[key] > 0, (key, row)
        assert row["distopt_p10_ms"] <= row["distopt_ms"] <= row["distopt_p90_ms"], row
        assert row["ratio_p10"] <= row["ratio"] <= row["ratio_p90"], row
        assert row["ratio_p10"] > 0, row
        assert row["max_abs_diff"] < 1e-3 and row["reps"] >= 1, row
    assert set(meta["met"]) == HOST_CASES
    phases = meta["phases"]
    assert set(phases) == {"plan", "plan_addresses", "plan_grads", "plan_identity", "kernel", "rest", "step"}, phases
    assert phases["plan_addresses"] > 0 and phases["plan_grads"] > 0 and phases["kernel"] > 0, phases

    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "results_host.png").stat().st_size > 0


def test_bench_host_rows_refuse_params_that_differ() -> None:
    """The pair check of bench_host's rows: the ratio and target of agreeing params, and a refusal where
    the two optimizers' params differ by more than fp32 rounding after the same steps (negative control)."""
    sys.path.insert(0, str(BENCH_HOST.parent))
    from host_rows import Case, make_row

    case = Case("pair", "step", 2, 4, "FusedAdam", "AdamW(fused=True)", 0.5)
    times = {"distopt": [1.0, 1.2, 0.9], "torch": [2.0, 2.0, 2.0]}
    reference = [torch.full((4,), 3.0)]
    row = make_row(case, times, 1e-7, reference)
    assert row.ratio == 0.5 and row.target == 0.5 and row.reps == 3, row
    with pytest.raises(AssertionError, match="differ by"):
        make_row(case, times, 1e-3, reference)  # far past 1e-6 + 1e-4 * 3


BENCH_OFFLOAD = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_offload.py"
OFFLOAD_CASES = {"fused_fp32", "fused_bf16", "dfa_ws1_fp32", "dfa_ws1_bf16", "dfa_ws2_fp32"}


def test_bench_offload_quick(tmp_path: Path) -> None:
    """bench_offload.py --quick runs every pair (one on forked gloo ranks); on CPU the measured device
    bytes per param equal the formula's (none with offload), and each pair's params agree bit for bit."""
    meta, rows, _ = run_quick(BENCH_OFFLOAD, tmp_path, "results_offload.json", "--quick", timeout=300)
    assert meta["device"] == "cpu" and meta["failures"] == [] and meta["torch"]
    assert {r["case"] for r in rows} == OFFLOAD_CASES
    for row in rows:
        res, off = row["resident"], row["offload"]
        for v in (res, off):
            assert v["device_bpp_measured"] == v["device_bpp_formula"], (row["case"], v)
            assert v["host_bpp_measured"] == v["host_bpp_formula"], (row["case"], v)
            for what in ("step", "iter"):
                assert 0 < v[f"{what}_p10_ms"] <= v[f"{what}_ms"] <= v[f"{what}_p90_ms"], (what, v)
        assert off["device_bpp_measured"] == 0 and res["device_bpp_measured"] > 0, row
        assert res["host_bpp_measured"] == 0 and off["host_bpp_measured"] >= res["device_bpp_measured"], row
        assert row["bit_exact"] and row["agree"] and row["max_abs_diff"] == 0, row
        assert row["changed_fraction"] > 0.5, row
        for what in ("step", "iter"):
            assert 0 < row[f"{what}_ratio_p10"] <= row[f"{what}_ratio"] <= row[f"{what}_ratio_p90"], row
    by_case = {r["case"]: r for r in rows}
    assert by_case["dfa_ws1_fp32"]["resident"]["device_bpp_formula"] == 16  # (4 + 8 + 4) / world size
    assert by_case["dfa_ws2_fp32"]["resident"]["device_bpp_formula"] == 8
    assert by_case["fused_bf16"]["resident"]["memory_report"] is None
    assert by_case["dfa_ws1_bf16"]["offload"]["memory_report"]["device"] == 0

    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "results_offload.png").stat().st_size > 0


def test_bench_offload_compare_catches_one_ulp() -> None:
    """The pair check itself: bit-exact passes, one element one ulp off fails on CPU (negative control)."""
    sys.path.insert(0, str(BENCH_OFFLOAD.parent))
    import bench_offload

    a = [torch.randn(37), torch.randn(5, 3)]
    b = [t.clone() for t in a]
    assert bench_offload.compare(a, b) == (0.0, True, True)
    b[1][4, 2] = torch.nextafter(b[1][4, 2], torch.tensor(float("inf")))
    diff, exact, agree = bench_offload.compare(a, b)
    assert 0 < diff < 1e-6 and not exact and not agree


def test_bench_cpu_paths_quick(tmp_path: Path) -> None:
    """Every kernel on every path this CPU has, and torch's equivalents, in one quick round."""
    from distopt import _C

    paths = ["baseline", "avx2", "avx512"][: ["baseline", "avx2", "avx512"].index(_C.best_cpu_isa()) + 1]
    script = BENCH.parent / "bench_cpu_paths.py"
    meta, rows, _ = run_quick(script, tmp_path, "results_cpu_paths.json", "--rounds", "1", "--paths", *paths,
                              timeout=120)
    cases = {r["case"] for r in rows}
    assert meta["paths"] == paths and len(cases) == 5 * len(paths) + 3, cases
    assert all(f"l2norm bf16 [{p}]" in cases for p in [*paths, "torch"])
    assert all(math.isfinite(r["ns_per_element"]) and r["ns_per_element"] > 0 for r in rows)
