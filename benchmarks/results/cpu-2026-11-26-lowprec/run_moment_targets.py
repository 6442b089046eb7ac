"""The rows of benchmarks/cpu_targets.py this folder holds: bandwidth, adam fp32 vs torch, and the 8-bit and
bf16 moment rows (issue 19), 16M fp32 elements, 2 threads; results.json + cpu_targets.png to OUT.

    PYTHONPATH=. python benchmarks/results/cpu-2026-11-26-lowprec/run_moment_targets.py OUT [REPS]
"""

import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from cpu_targets import COLUMNS, Targets  # noqa: E402

from common import cpu_model, plot_bars, run_metadata, write_json  # noqa: E402

out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
n, reps, warmup = 16 << 20, int(sys.argv[2]) if len(sys.argv) > 2 else 15, 3
torch.set_num_threads(2)
torch.manual_seed(0)
names = " ".join(f"{name:<{w}}" for name, w in COLUMNS)
print(f"CPU kernel targets (low-precision moments): {n:,} elements, 2 torch threads, alternating A/B x {reps}")
print(names + "\n" + "-" * len(names))
t = Targets(n, reps, warmup)
t.bandwidth_rows()
t.adam_fp32(None)
t.adam_low_precision_moments()
rows = [dataclasses.asdict(r) for r in t.rows]
meta = run_metadata(torch.device("cpu"), threads=2, cpu_targets_numel=n, machine=cpu_model(), failures=t.failures)
write_json(out / "results.json", meta, rows)
plot_bars(out / "cpu_targets.png", [r["case"] for r in rows],
          {"ratio (see target)": ([r["ratio"] for r in rows], [(r["ratio_p10"], r["ratio_p90"]) for r in rows])},
          f"distopt low-precision moments, {meta.get('device_name', 'cpu')}, 2 threads, 16M")
print("failures:", t.failures)
