"""Smoke tests of benchmarks/bench_step.py on CPU: it runs on 2 gloo ranks, checks the optimizers
agree before timing them, and writes its results; and its correctness check catches a wrong optimizer.

No speed assertions: speed targets belong to the benchmarks, not to the tests.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks" / "bench_step.py"
from harness import run_ranks  # noqa: E402
from test_benchmarks import run_quick  # noqa: E402

# Written out here rather than imported, so that dropping a contender from the benchmark fails this test.
EXPECTED = {
    "DDP + AdamW": "AdamW",
    "DDP + FusedAdam": "FusedAdam",
    "DistributedFusedAdam": "DistributedFusedAdam",
    "DistributedFusedAdam overlap_param_sync": "DistributedFusedAdam",
}


def test_bench_step_cpu_quick(tmp_path: Path) -> None:
    meta, rows, _ = run_quick(BENCH, tmp_path, "results_step.json", "--device", "cpu", "--world-size", "2",
                              "--quick", timeout=120)
    assert meta["device"] == "cpu" and meta["world_size"] == 2 and meta["failures"] == []
    agreement = meta["verification"]["agreement"]
    assert set(agreement) == {"float32", "bfloat16"}, agreement
    for per_dtype in agreement.values():
        # all but the reference, and the noise floor (torch's other AdamW kernel)
        assert set(per_dtype) == set(EXPECTED) - {"DDP + AdamW"} | {"DDP + AdamW, torch's other kernel"}, per_dtype
        assert all(a["outliers"] <= a["allowed_outliers"] for a in per_dtype.values()), per_dtype

    by_name = {r["name"]: r for r in rows}
    assert len(by_name) == len(rows) and {n: r["optimizer"] for n, r in by_name.items()} == EXPECTED
    for row in rows:
        assert row["world_size"] == 2 and row["device"] == "cpu" and row["dtype"] == "bf16", row
        for key in ("step_ms", "step_p10_ms", "step_p90_ms", "iter_ms", "iter_p10_ms", "iter_p90_ms",
                    "step_ratio_vs_fused", "iter_ratio_vs_fused", "state_bytes_per_param"):  # fmt: skip
            assert math.isfinite(row[key]) and row[key] > 0, (key, row)
        assert row["step_p10_ms"] <= row["step_ms"] <= row["step_p90_ms"], row
        assert row["iter_p10_ms"] <= row["iter_ms"] <= row["iter_p90_ms"], row
        assert row["state_bytes"] > 0 and row["params"] > 0 and row["peak_bytes"] is None, row
    assert by_name["DDP + FusedAdam"]["step_ratio_vs_fused"] == 1.0
    assert (
        "AdamW(fused=True)" in by_name["DDP + AdamW"]["config"]
        or "AdamW(foreach=True)" in by_name["DDP + AdamW"]["config"]
    )

    # ZeRO-2 on 2 ranks: each holds half the masters and moments (plus half an fp32 grad shard), against
    # FusedAdam's full masters and moments: 8 bytes per param against 12.
    fused = by_name["DDP + FusedAdam"]["state_bytes"]
    assert by_name["DDP + AdamW"]["state_bytes"] == fused  # fp32 masters + moments, both
    for name in ("DistributedFusedAdam", "DistributedFusedAdam overlap_param_sync"):
        row = by_name[name]
        assert row["state_bytes"] < 0.75 * fused, (row["state_bytes"], fused)
        assert row["memory_report"]["total"] == row["state_bytes"], row

    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "results_step.png").stat().st_size > 0


def _verify_with_a_wrong_lr(rank: int, world_size: int) -> list[str]:
    """The benchmark's correctness check, with DistributedFusedAdam's lr 10% too high."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_step

    build = bench_step.build

    def wrong_build(c, init, dtype, device):
        trainer = build(c, init, dtype, device)
        if c.optimizer == "DistributedFusedAdam" and not c.overlap_param_sync:
            for group in trainer.opt.param_groups:
                group["lr"] *= 1.1
        return trainer

    bench_step.build = wrong_build
    spec = bench_step.Spec("cpu", world_size, "bf16", bench_step.MODELS["quick"], bench_step.TIMINGS["quick"])
    init = bench_step.initial_model(spec.model)
    failures, _ = bench_step.verify(spec, rank, torch.device("cpu"), init, lambda *args: None)
    return failures


def test_bench_step_refuses_a_wrong_optimizer() -> None:
    failures = run_ranks(_verify_with_a_wrong_lr, world_size=2)[0]
    assert len(failures) == 2, failures  # fp32 and bf16, the wrong contender only
    assert all(f.startswith("DistributedFusedAdam (torch.") for f in failures), failures
