"""The CPU kernels' cost per element on each vector ISA path, with the data in cache.

    python benchmarks/bench_cpu_paths.py --out DIR [--paths baseline avx2 avx512] [--rounds 5]

bench_kernels.py measures the kernels against memory bandwidth; this measures what each loop costs the
core when memory is not the limit (131,072 elements, L2-resident, one thread): a loop that costs more
per element than the memory system needs per element cannot reach the bandwidth bound on a CPU with
slow or shared cores, however it is threaded. Each round times every kernel on every path (forced
with DISTOPT_CPU_ISA; "default": the library's own choice, e.g. for a build that predates the
variable's other values) and torch's equivalent, one after the other, so that load on the machine
falls on all alike; the result is the median over rounds of each round's median, with the min-max.
Writes DIR/results_cpu_paths.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from distopt import ops

from common import cpu_model, run_metadata, write_json

N = 1 << 17
REPS = 200  # timed calls per kernel, path and round


def cases() -> tuple[dict[str, Callable[[], object]], dict[str, Callable[[], object]]]:
    """(distopt's kernels, torch's equivalents) by case name."""
    x, flag = torch.randn(N), torch.zeros(1)
    xb, y16 = x.bfloat16(), torch.empty(N, dtype=torch.bfloat16)
    p, g, m, v = torch.randn(N), torch.randn(N), torch.randn(N) * 0.1, torch.rand(N) * 0.01
    gb, out = g.bfloat16(), p.bfloat16()

    def adam(grad: torch.Tensor, outs: list[torch.Tensor]) -> None:
        ops.adam_step_([p], [grad], [m], [v], lr=1e-3, step=10, weight_decay=0.01, param_outs=outs)

    distopt = {
        "cast_copy fp32->bf16": lambda: ops.cast_copy_([x], [y16]),
        "l2norm fp32": lambda: ops.l2norm([x], flag),
        "l2norm bf16": lambda: ops.l2norm([xb], flag),
        "adam fp32": lambda: adam(g, []),
        "adam bf16 grad + fp32 master + bf16 param": lambda: adam(gb, [out]),
    }
    baseline = {
        "cast_copy fp32->bf16": lambda: y16.copy_(x),
        "l2norm fp32": lambda: torch.linalg.vector_norm(x),
        "l2norm bf16": lambda: torch.linalg.vector_norm(xb),
    }
    return distopt, baseline


def ns_per_element(fn: Callable[[], object]) -> float:
    fn()
    fn()
    times = []
    for _ in range(REPS):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e9 / N


def set_path(path: str) -> None:
    if path == "default":
        os.environ.pop("DISTOPT_CPU_ISA", None)
    else:
        os.environ["DISTOPT_CPU_ISA"] = path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--paths", nargs="+", default=["baseline", "avx2", "avx512"])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    distopt, baseline = cases()
    runs: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for case, fn in distopt.items():
            for path in args.paths:
                set_path(path)
                runs.setdefault(f"{case} [{path}]", []).append(ns_per_element(fn))
            if case in baseline:
                runs.setdefault(f"{case} [torch]", []).append(ns_per_element(baseline[case]))
    set_path("default")
    rows = [dict(case=k, ns_per_element=statistics.median(v), min=min(v), max=max(v), rounds=v)
            for k, v in runs.items()]
    print(f"{cpu_model()}, 1 thread, {N:,} elements in cache, median of {args.rounds} rounds (min-max)")
    for r in rows:
        print(f"{r['case']:<55} {r['ns_per_element']:.3f} ns/element ({r['min']:.3f}-{r['max']:.3f})")
    args.out.mkdir(parents=True, exist_ok=True)
    library = str(Path(ops.__file__).parent)  # which distopt ran (an older checkout's, to compare)
    meta = run_metadata(torch.device("cpu"), machine=cpu_model(), numel=N, threads=1, paths=args.paths, distopt=library)
    write_json(args.out / "results_cpu_paths.json", meta, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
