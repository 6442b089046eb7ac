"""bench_host's rows: a case timed as a pair (FusedAdam or DistributedFusedAdam against torch's best
equivalent, alternating A/B repetitions), the row it gives (medians, 10th and 90th percentiles, the
median of the pairs' ratios, the target), and the row's line in the printed table and bar in the plot.

``make_row`` refuses a pair whose params differ after the same steps by more than fp32 rounding, so a
fast wrong answer cannot pass.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from torch import Tensor

from common import plot_bars, summarize, table_row

RTOL, ATOL = 1e-4, 1e-6  # the pairs agree to fp32 rounding; a wrong update misses by orders more


@dataclass(frozen=True)
class Case:
    name: str
    what: str
    count: int  # params
    numel: int  # elements each
    distopt: str
    torch: str
    target: float  # met when the median ratio (distopt / torch) is at most this


@dataclass(frozen=True)
class Config:
    warmup: int
    reps: int
    cases: tuple[Case, ...]


@dataclass
class Row:
    case: str
    what: str
    params: int
    numel: int
    distopt: str
    torch: str
    distopt_ms: float
    distopt_p10_ms: float
    distopt_p90_ms: float
    torch_ms: float
    torch_p10_ms: float
    torch_p90_ms: float
    ratio: float  # median of the repetitions' distopt / torch ratios (each pair ran back to back)
    ratio_p10: float
    ratio_p90: float
    target: float
    max_abs_diff: float  # between the two contenders' params after the run
    reps: int


def alternate(fns: dict[str, Callable[[], float | None]], warmup: int, reps: int) -> dict[str, list[float]]:
    """Milliseconds per call of each fn, the order reversed every repetition (ABBA...). A fn may time
    a part of itself and return that (in ms) instead of None."""
    names = list(fns)
    for _ in range(warmup):
        for name in names:
            fns[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(reps):
        for name in names if rep % 2 == 0 else reversed(names):
            start = time.perf_counter()
            inner = fns[name]()
            times[name].append(inner if inner is not None else (time.perf_counter() - start) * 1e3)
    return times


def max_diff(a: Sequence[Tensor], b: Sequence[Tensor]) -> float:
    return max(float((x.detach() - y.detach()).abs().max()) for x, y in zip(a, b))


def make_row(case: Case, times: dict[str, list[float]], diff: float, reference: Sequence[Tensor]) -> Row:
    ours, theirs = summarize(times["distopt"]), summarize(times["torch"])
    pairs = summarize([a / b for a, b in zip(times["distopt"], times["torch"])])
    scale = max(float(p.detach().abs().max()) for p in reference)
    if not diff <= ATOL + RTOL * scale:
        raise AssertionError(f"{case.name}: the two optimizers' params differ by {diff:g} after the same steps")
    return Row(
        case.name,
        case.what,
        case.count,
        case.numel,
        case.distopt,
        case.torch,
        ours.median_ms,
        ours.p10_ms,
        ours.p90_ms,
        theirs.median_ms,
        theirs.p10_ms,
        theirs.p90_ms,
        pairs.median_ms,
        pairs.p10_ms,
        pairs.p90_ms,
        case.target,
        diff,
        ours.reps,
    )


COLUMNS = (
    ("case", 13),
    ("what", 14),
    ("params x elems", 15),
    ("distopt ms", 11),
    ("p10-p90", 15),
    ("torch ms", 10),
    ("p10-p90", 15),
    ("ratio (pairs p10-p90)", 21),
    ("target", 7),
    ("vs", 24),
)


def format_row(r: Row) -> str:
    return table_row(
        (
            r.case,
            r.what,
            f"{r.params} x {r.numel}",
            f"{r.distopt_ms:.4g}",
            f"{r.distopt_p10_ms:.3g}-{r.distopt_p90_ms:.3g}",
            f"{r.torch_ms:.4g}",
            f"{r.torch_p10_ms:.3g}-{r.torch_p90_ms:.3g}",
            f"{r.ratio:.2f}x ({r.ratio_p10:.2f}-{r.ratio_p90:.2f})",
            f"<={r.target}x",
            r.torch,
        ),
        COLUMNS,
    )


def plot(path: Path, rows: Sequence[Row], title: str) -> bool:
    labels = [f"{r.case}\n{r.params} x {r.numel}" for r in rows]
    panels = {
        "distopt (ms)": ([r.distopt_ms for r in rows], [(r.distopt_p10_ms, r.distopt_p90_ms) for r in rows]),
        "torch / peer (ms)": ([r.torch_ms for r in rows], [(r.torch_p10_ms, r.torch_p90_ms) for r in rows]),
        "ratio (lower is better)": ([r.ratio for r in rows], [(r.ratio_p10, r.ratio_p90) for r in rows]),
    }
    return plot_bars(path, labels, panels, title)
