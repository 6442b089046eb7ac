"""Before/after table of the runs in this folder: median of the per-run medians, and their range."""

import glob
import json
import os
import statistics

BASE = os.path.dirname(os.path.abspath(__file__))
CONTENDERS = ("torch AdamW(fused=True)", "distopt fp32", "distopt bf16", "distopt bf16 SR", "distopt 8-bit")


def span(xs: list[float], fmt: str) -> str:
    return f"{statistics.median(xs):{fmt}} ({min(xs):{fmt}}-{max(xs):{fmt}})"


runs: dict[tuple[str, str, str], list[tuple[float, float]]] = {}
for which in ("before", "after"):
    for path in sorted(glob.glob(f"{BASE}/{which}-t2-run*/lowprec_kernels.json")):
        for r in json.load(open(path))["rows"]:
            runs.setdefault((r["layout"], r["contender"], which), []).append((r["median_ms"], r["vs_fp32"]))
print("| layout | contender | before ms: median of runs (range) | after ms | after/before speed "
      "| after vs fp32 (range) | before vs fp32 |")
print("|---|---|---|---|---|---|---|")
for layout in ("flat", "list"):
    for c in CONTENDERS:
        b, a = runs[(layout, c, "before")], runs[(layout, c, "after")]
        bms, ams = [x for x, _ in b], [x for x, _ in a]
        speed = statistics.median(bms) / statistics.median(ams)
        print(f"| {layout} | {c} | {span(bms, '.1f')} | {span(ams, '.1f')} | {speed:.2f}x "
              f"| {span([y for _, y in a], '.2f')}x | {span([y for _, y in b], '.2f')}x |")
