"""Timing, copy-bandwidth, device-check and result-writing (JSON, table, plot) helpers shared by the
benchmark scripts.

Timing method: warm-up, then many timed runs, reporting the median with the 10th
and 90th percentiles. On CUDA each run is bracketed by CUDA events (GPU time, no host sync inside the
loop); on CPU by ``time.perf_counter``.

Cold caches on CUDA: before every timed run we overwrite a 256 MiB buffer (5x the H100's 50 MB L2),
as ``triton.testing.do_bench`` does. We chose this over rotating copies of the inputs because
rotation would need (2 x L2 / working set) copies of every tensor *and* of each copy's optimizer state,
which is awkward for the torch pipeline (torch.optim owns its state) and pointless at large sizes; the
flush costs a constant 256 MiB and leaves every size equally cold, like a real optimizer step that
follows the backward pass. The flush also gives the host a head start of ~0.1 ms, so launch overhead is
hidden up to that; beyond it (many tiny kernels) the events measure it, as a training step would feel it.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from distopt import ops

L2_FLUSH_BYTES = 256 * 2**20
REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class TimingConfig:
    """How many runs to make: ``warmup`` untimed, then ``min_reps``..``max_reps`` timed, as many as
    fit in ``budget_s`` (estimated from the warm-up)."""

    warmup: int = 5
    min_reps: int = 20
    max_reps: int = 200
    budget_s: float = 0.3


@dataclass(frozen=True)
class Timing:
    """Milliseconds per run: median and 10th/90th percentiles over ``reps`` runs."""

    median_ms: float
    p10_ms: float
    p90_ms: float
    reps: int


def summarize(times_ms: Sequence[float]) -> Timing:
    """Median and p10/p90 of the run times (the median is robust to the odd preempted run)."""
    if len(times_ms) < 2:
        t = float(times_ms[0])
        return Timing(t, t, t, len(times_ms))
    deciles = statistics.quantiles(times_ms, n=10, method="inclusive")
    return Timing(statistics.median(times_ms), deciles[0], deciles[-1], len(times_ms))


@functools.cache
def _flush_buffer(device: torch.device) -> torch.Tensor:
    return torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=device)


def flush_l2(device: torch.device) -> None:
    """Overwrites a buffer larger than L2 so that the next run starts with cold caches."""
    _flush_buffer(device).zero_()


def sync(device: torch.device) -> None:
    """Waits for the device's queued work (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _num_reps(fn: Callable[[], Any], setup: Callable[[], Any] | None, device: torch.device, cfg: TimingConfig) -> int:
    """Runs the warm-up and sizes the timed loop to fit the time budget."""
    sync(device)
    start = time.perf_counter()
    for _ in range(max(cfg.warmup, 1)):
        if setup is not None:
            setup()
        fn()
    sync(device)
    per_run = (time.perf_counter() - start) / max(cfg.warmup, 1)
    return int(min(cfg.max_reps, max(cfg.min_reps, cfg.budget_s / max(per_run, 1e-9))))


def time_fn(
    fn: Callable[[], Any],
    device: torch.device,
    cfg: TimingConfig = TimingConfig(),
    setup: Callable[[], Any] | None = None,
) -> Timing:
    """Times ``fn()`` on ``device``; ``setup()`` (untimed) runs before each call, e.g. to restore
    inputs that ``fn`` modifies in place."""
    reps = _num_reps(fn, setup, device, cfg)
    if device.type != "cuda":
        times = []
        for _ in range(reps):
            if setup is not None:
                setup()
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return summarize(times)

    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for start, end in zip(starts, ends, strict=True):
        if setup is not None:
            setup()
        flush_l2(device)
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize(device)
    return summarize([s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)])


def time_ab(
    fn_a: Callable[[], Any],
    fn_b: Callable[[], Any],
    reps: int,
    warmup: int = 2,
    setup_a: Callable[[], Any] | None = None,
    setup_b: Callable[[], Any] | None = None,
) -> tuple[Timing, Timing, Timing]:
    """Times two CPU functions alternately, A then B, ``reps`` times after ``warmup`` pairs, so that
    load from other work on a shared machine falls on both alike. Returns A's and B's timings and
    the summary of the per-pair ratios B/A (A's speedup over B; a Timing whose fields are ratios)."""
    times_a, times_b = [], []
    for i in range(warmup + reps):
        pair = []
        for fn, setup in ((fn_a, setup_a), (fn_b, setup_b)):
            if setup is not None:
                setup()
            start = time.perf_counter()
            fn()
            pair.append((time.perf_counter() - start) * 1e3)
        if i >= warmup:
            times_a.append(pair[0])
            times_b.append(pair[1])
    return summarize(times_a), summarize(times_b), summarize([b / a for a, b in zip(times_a, times_b)])


def gbps(nbytes: int, ms: float) -> float:
    """Bandwidth in GB/s (1e9 bytes per second)."""
    return nbytes / (ms * 1e-3) / 1e9


def copy_bandwidth(device: torch.device, numel: int, cfg: TimingConfig = TimingConfig()) -> tuple[float, Timing]:
    """Measured ``dst.copy_(src)`` bandwidth of an fp32 buffer of ``numel`` elements, in GB/s counting
    the bytes read plus the bytes written: the practical ceiling for a memory-bound kernel."""
    src = torch.randn(numel, device=device)
    dst = torch.empty_like(src)
    timing = time_fn(lambda: dst.copy_(src), device, cfg)
    return gbps(2 * src.nbytes, timing.median_ms), timing


def torch_adamw(params: Sequence[torch.Tensor], *args: Any) -> tuple[torch.optim.AdamW, bool, str]:
    """torch.optim.AdamW(params, *args), fused where torch has a fused kernel for the params' device, else
    foreach: (optimizer, fused, a note naming which)."""
    try:
        return torch.optim.AdamW(params, *args, fused=True), True, "AdamW(fused=True)"
    except RuntimeError as exc:
        note = f"AdamW(foreach=True): no fused kernel on {params[0].device.type} ({exc})"
        return torch.optim.AdamW(params, *args, foreach=True), False, note


def kernels_in_use(device: torch.device, op_names: Sequence[str]) -> str | None:
    """'compiled' if distopt._C has kernels of ``op_names`` for the device, else 'reference' (the pure
    PyTorch fallback would be timed: a warning on CPU). None, after printing why, where the benchmark
    cannot run: no CUDA device visible, or no compiled CUDA kernels."""
    if device.type == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device visible", file=sys.stderr)
        return None
    if all((op, device.type.upper()) in ops.COMPILED_KERNELS for op in op_names):
        return "compiled"
    message = f"distopt._C has no {device.type} kernels: the pure-PyTorch reference ops would be timed"
    if device.type == "cuda":
        print(f"error: {message}; build the extension first", file=sys.stderr)
        return None
    print(f"warning: {message}")
    return "reference"


def git_commit() -> str | None:
    """HEAD's hash with a ``-dirty`` suffix if the tree has changes; None outside a git checkout."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT, capture_output=True, text=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("-dirty" if dirty else "")


def cpu_model() -> str:
    """The CPU's model name (Linux /proc/cpuinfo), else what platform knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_name(device: torch.device) -> str:
    """Human-readable name of the device the benchmark ran on."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{cpu_model()}, {os.cpu_count()} CPUs ({torch.get_num_threads()} torch threads)"


def run_metadata(device: torch.device, **extra: Any) -> dict[str, Any]:
    """Where and when the results were measured, for results.json."""
    return {
        "device": device.type,
        "device_name": device_name(device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "git_commit": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        **extra,
    }


def write_json(path: Path, meta: dict[str, Any], rows: Sequence[Any]) -> None:
    """Writes ``{"meta": ..., "rows": [...]}``; rows may be dataclasses or dicts."""
    data = {"meta": meta, "rows": [asdict(r) if hasattr(r, "__dataclass_fields__") else r for r in rows]}
    path.write_text(json.dumps(data, indent=2) + "\n")


def publish(out: Path, name: str, meta: dict[str, Any], rows: Sequence[Any], intro: str,
            columns: Sequence[tuple[str, int]], format_row: Callable[[Any], str],
            plot: Callable[[Path, Sequence[Any], str], bool], title: str) -> None:
    """Prints `intro` and the rows as a table, then writes OUT/NAME.json and OUT/NAME.png."""
    print(intro)
    print(table_header(columns))
    for r in rows:
        print(format_row(r))
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / f"{name}.json", meta, rows)
    plot(out / f"{name}.png", rows, title)
    print(f"wrote {out}/{name}.json")


def table_header(columns: Sequence[tuple[str, int]]) -> str:
    """The column names of a text table of (name, width) columns, underlined."""
    names = table_row([name for name, _ in columns], columns)
    return names + "\n" + "-" * len(names)


def table_row(cells: Sequence[str], columns: Sequence[tuple[str, int]]) -> str:
    """One line of a text table: each cell left-aligned to its column's width."""
    return " ".join(f"{cell:<{width}}" for cell, (_, width) in zip(cells, columns, strict=True))


def _pyplot(path: Path):
    """matplotlib.pyplot on the Agg backend, or None (after saying that the plot ``path`` is skipped)
    when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: skipping the plot {path}")
        return None
    return plt


def _save_figure(fig, path: Path, title: str, **title_kw: Any) -> None:
    """Titles, lays out, writes (120 dpi) and closes ``fig``."""
    fig.suptitle(title, **title_kw)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    import matplotlib.pyplot as plt  # there is a figure, so there is matplotlib

    plt.close(fig)


def size_label(numel: float) -> str:
    """64K, 16M, ... for element counts (powers of two)."""
    for suffix, unit in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if numel >= unit:
            return f"{numel / unit:g}{suffix}"
    return f"{numel:g}"


Series = dict[tuple[str, str], list[tuple[int, float]]]  # (impl, variant) -> [(numel, GB/s), ...]


def plot_bandwidth(path: Path, panels: dict[str, Series], copy_gbps: float, title: str) -> bool:
    """One panel per kernel of GB/s vs size (log x): a line per (impl, variant), one colour per variant,
    torch dashed, and the measured copy bandwidth dotted. Returns False (and says why) when
    matplotlib is missing."""
    plt = _pyplot(path)
    if plt is None:
        return False
    from matplotlib.ticker import FuncFormatter

    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    for ax, (kernel, series) in zip(axes[0], panels.items(), strict=True):
        variants = sorted({variant for _, variant in series})
        for (impl, variant), points in sorted(series.items()):
            xs, ys = zip(*sorted(points), strict=True)
            style = "--" if impl == "torch" else "-"
            color = f"C{variants.index(variant) % 10}"
            ax.plot(xs, ys, style, color=color, marker="o", label=f"{impl} {variant}")
        ax.axhline(copy_gbps, color="black", linestyle=":", label=f"copy {copy_gbps:.0f} GB/s")
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: size_label(x)))
        ax.set(title=kernel, xlabel="elements", ylabel="GB/s (bytes of the fused pass)")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=6)
    _save_figure(fig, path, title)
    return True


Bars = dict[str, tuple[list[float], list[tuple[float, float]] | None]]  # panel -> (values, (p10, p90)s or None)


def plot_bars(path: Path, labels: Sequence[str], panels: Bars, title: str) -> bool:
    """Side by side, a panel of horizontal bars (one per label, values written beside them) per entry of
    ``panels``: ``{panel title: (values, [(p10, p90) per value] or None)}``, the ranges drawn as whiskers.
    Returns False (and says why) when matplotlib is missing."""
    plt = _pyplot(path)
    if plt is None:
        return False
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4.8), squeeze=False)
    ys = range(len(labels))
    for ax, (name, (values, ranges)) in zip(axes[0], panels.items(), strict=True):
        xerr = None
        if ranges is not None:
            xerr = [[v - lo for v, (lo, _) in zip(values, ranges)], [hi - v for v, (_, hi) in zip(values, ranges)]]
        ax.barh(ys, values, xerr=xerr, color=[f"C{i}" for i in ys], capsize=3)
        for y, v, (_, hi) in zip(ys, values, ranges or zip(values, values)):
            ax.text(hi, y, f" {v:.3g}", va="center", fontsize=7)
        ax.margins(x=0.2)
        ax.set_yticks(list(ys), labels if ax is axes[0][0] else [""] * len(labels), fontsize=7)
        ax.invert_yaxis()
        ax.set(title=name)
        ax.grid(True, axis="x", alpha=0.3)
    _save_figure(fig, path, title, fontsize=9)
    return True
