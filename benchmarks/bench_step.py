"""Benchmarks a whole optimizer step, in time and memory: DistributedFusedAdam against FusedAdam and
torch's AdamW, each with what it needs to train data-parallel, on the same model in the same run.

    python benchmarks/bench_step.py --device cuda --world-size 1 --out DIR
    python benchmarks/bench_step.py --device cpu --world-size 2 --out DIR [--quick]

The contenders (DDP + AdamW over fp32 masters, DDP + FusedAdam, DistributedFusedAdam with and without
overlap_param_sync) train examples/model.py's TinyGPT without attention projection biases (98.0M params
on CUDA, 1.32M on CPU, 167K with --quick) in bf16 (--dtype) from the same init on the same batches.
First each trains 2 steps in fp32 and in the run dtype, and its params must match DDP + AdamW's (see
agreement()): else nothing is timed, results_step.json lists the failures and the script exits 1.
Then, on rank 0: the step alone (common.time_fn, after an untimed forward and backward), whole
iterations, the optimizer state per rank and, on CUDA, the peak memory allocated.

Prints a table; writes results_step.json and results_step.png to --out. benchmarks/README.md says
what is measured and how. The issue's target: at world size 1, DistributedFusedAdam's step <= 1.1x
FusedAdam's.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from common import (
    REPO_ROOT,
    TimingConfig,
    flush_l2,
    kernels_in_use,
    plot_bars,
    run_metadata,
    summarize,
    sync,
    table_header,
    table_row,
    time_fn,
    write_json,
)

sys.path.insert(0, str(REPO_ROOT / "examples"))
from model import TinyGPT  # noqa: E402  (examples/model.py)
from step_contenders import (  # noqa: E402
    BASELINE,
    BETAS,
    CONTENDERS,
    EPS,
    LR,
    NOISE_FLOOR,
    REFERENCE,
    WEIGHT_DECAY,
    Contender,
    build,
    release,
)

TARGET_RATIO = 1.1  # the issue's target: DistributedFusedAdam's step <= 1.1x FusedAdam's at world size 1
VERIFY_STEPS = 2
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}

# Two training runs whose update kernels differ in rounding: a few fp32 ulps, which Adam amplifies in
# elements with tiny gradients (hence 1e-4, not 1e-6); 16-bit params: one rounding step of the type.
TOLERANCE = {
    torch.float32: dict(rtol=1e-4, atol=1e-5),
    torch.bfloat16: dict(rtol=2**-7, atol=1e-4),
}
MAX_OUTLIER_FRACTION = 1e-5  # of all elements may be outside TOLERANCE (see agreement()) ...
FLOOR_FACTOR = 2  # ... or twice as many as NOISE_FLOOR (torch's two kernels) has in the same run ...
OUTLIER_ATOL = 1.25 * 2 * VERIFY_STEPS * LR  # ... by at most what two runs' Adam updates can differ


@dataclass(frozen=True)
class ModelConfig:
    vocab: int
    seq: int
    d_model: int
    layers: int
    heads: int
    batch: int  # sequences per rank per step


MODELS = {
    "cuda": ModelConfig(vocab=8192, seq=512, d_model=768, layers=12, heads=12, batch=8),  # 98.0M params
    "cpu": ModelConfig(vocab=2048, seq=64, d_model=128, layers=4, heads=4, batch=4),  # 1.32M
    "quick": ModelConfig(vocab=512, seq=32, d_model=64, layers=2, heads=4, batch=2),  # 167K
}


@dataclass(frozen=True)
class Timings:
    """Runs per measurement: ``step`` for common.time_fn (min_reps == max_reps: every rank must run
    the same number of collectives), ``iter_warmup`` + ``iter_reps`` whole iterations."""

    step: TimingConfig
    iter_warmup: int
    iter_reps: int


TIMINGS = {
    "cuda": Timings(TimingConfig(warmup=5, min_reps=50, max_reps=50), iter_warmup=5, iter_reps=30),
    "cpu": Timings(TimingConfig(warmup=3, min_reps=20, max_reps=20), iter_warmup=3, iter_reps=15),
    "quick": Timings(TimingConfig(warmup=1, min_reps=3, max_reps=3), iter_warmup=1, iter_reps=3),
}


@dataclass(frozen=True)
class Spec:
    """What one run measures (handed to every rank)."""

    device: str
    world_size: int
    dtype: str
    model: ModelConfig
    timings: Timings


@dataclass
class Row:
    """One optimizer's measurements, as written to results_step.json."""

    name: str
    optimizer: str
    config: str
    world_size: int
    device: str
    dtype: str
    params: int
    step_ms: float
    step_p10_ms: float
    step_p90_ms: float
    step_reps: int
    iter_ms: float
    iter_p10_ms: float
    iter_p90_ms: float
    iter_reps: int
    state_bytes: int  # persistent optimizer bytes on this rank
    state_bytes_per_param: float
    peak_bytes: int | None  # CUDA: peak allocated over an iteration (None on CPU)
    step_ratio_vs_fused: float | None = None  # step_ms / DDP + FusedAdam's step_ms
    iter_ratio_vs_fused: float | None = None
    memory_report: dict[str, int] | None = None  # DistributedFusedAdam.memory_report()


# ------------------------------------------------------------------------------------------ model


def initial_model(cfg: ModelConfig) -> TinyGPT:
    """The shared init (fp32, CPU, seeded): GPT-2's N(0, 0.02) weights, zero biases, unit LayerNorms."""
    torch.manual_seed(0)
    model = TinyGPT(cfg.vocab, cfg.d_model, cfg.heads, cfg.layers, cfg.seq, attn_bias=False)
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            nn.init.zeros_(p)
        elif p.dim() >= 2:
            nn.init.normal_(p, std=0.02)
    return model


def make_batches(cfg: ModelConfig, rank: int, count: int, device: torch.device) -> list[tuple[Tensor, Tensor]]:
    """``count`` (input, target) batches of random tokens for this rank (different on every rank)."""
    gen = torch.Generator().manual_seed(1000 + rank)
    batches = []
    for _ in range(count):
        tokens = torch.randint(cfg.vocab, (cfg.batch, cfg.seq + 1), generator=gen).to(device)
        batches.append((tokens[:, :-1], tokens[:, 1:]))
    return batches


# ------------------------------------------------------------------------------------ measurement


def agreement(params: Sequence[tuple[str, Tensor]], reference: Sequence[tuple[str, Tensor]], tol: dict) -> dict:
    """Elementwise against the reference: the largest |difference|, the elements outside ``tol``
    (outliers), those outside it by more than OUTLIER_ATOL (beyond_bound), the param with most outliers.

    A pass has none beyond the bound and at most MAX_OUTLIER_FRACTION outliers, or FLOOR_FACTOR times
    NOISE_FLOOR's: Adam moves an element by about lr per step whatever its gradient, so where the
    gradient is tiny (next to rounding noise) two correct runs can move it differently, and with 16-bit
    params a master that rounds the other way after the first step changes the next step's gradients
    everywhere (the first H100 run, 2026-11-26, saw 0.23% of the 98M-param model's elements outside in
    bf16, at most 70 in fp32, none beyond the bound); a real bug (wrong lr or step count, missed sync)
    moves most. NOISE_FLOOR measures that drift between two correct torch kernels in the same run."""
    result = dict(max_abs_diff=0.0, outliers=0, beyond_bound=0, worst_param="")
    most = 0
    for (name, actual), (_, expected) in zip(params, reference):
        diff = (actual.float() - expected.float()).abs()
        excess = diff - (tol["atol"] + tol["rtol"] * expected.float().abs())
        outliers = int((excess > 0).sum())
        result["max_abs_diff"] = max(result["max_abs_diff"], diff.max().item())
        result["outliers"] += outliers
        result["beyond_bound"] += int((excess > OUTLIER_ATOL).sum())
        if outliers > most:
            most, result["worst_param"] = outliers, name
    return result


def verify(spec: Spec, rank: int, device: torch.device, init: TinyGPT, log: Callable) -> tuple[list[str], dict]:
    """Trains every contender VERIFY_STEPS steps in fp32 and in the run dtype and compares its params
    with DDP + AdamW's, as does NOISE_FLOOR (which sets how many outliers are allowed). Returns
    (failures, {dtype: {contender or NOISE_FLOOR: agreement() and the allowed outliers}})."""
    batches = make_batches(spec.model, rank, VERIFY_STEPS, device)
    dtypes = dict.fromkeys([torch.float32, DTYPES[spec.dtype]])  # fp32 first, then the run dtype if another
    numel = sum(p.numel() for p in init.parameters())
    failures, report = [], {}
    for dtype in dtypes:
        tol = TOLERANCE[dtype]
        reference = None
        results = report.setdefault(str(dtype).removeprefix("torch."), {})
        for c in (REFERENCE, NOISE_FLOOR, *CONTENDERS[1:]):
            trainer = build(c, init, dtype, device)
            for batch in batches:
                trainer.iteration(batch)
            trainer.finish()
            params = [(n, p.detach().clone()) for n, p in trainer.module.named_parameters()]
            del trainer
            release(device)
            if reference is None:
                reference = params
                continue
            a = results[c.name] = agreement(params, reference, tol)
            if c is NOISE_FLOOR:
                allowed = max(int(MAX_OUTLIER_FRACTION * numel), FLOOR_FACTOR * a["outliers"])
            a["allowed_outliers"] = allowed
            if c is not NOISE_FLOOR and (a["beyond_bound"] or a["outliers"] > allowed):
                failures.append(
                    f"{c.name} ({dtype}) differs from {REFERENCE.name} (tolerance {tol}): {a['outliers']} of "
                    f"{numel} elements outside the tolerance (at most {allowed} allowed), {a['beyond_bound']} "
                    f"of them by more than {OUTLIER_ATOL:.3g}; most in {a['worst_param']}"
                )
        log(
            f"checked {VERIFY_STEPS} steps in {dtype} against {REFERENCE.name} (tolerance {tol}): "
            + ", ".join(
                f"{name}: max |diff| {r['max_abs_diff']:.2e}, {r['outliers']} outliers" for name, r in results.items()
            )
        )
    return failures, report


def measure(c: Contender, spec: Spec, device: torch.device, init: TinyGPT, batch, log) -> Row:
    """Builds the contender and times its step alone, then whole iterations."""
    start = time.perf_counter()
    baseline_bytes = 0
    if device.type == "cuda":
        flush_l2(device)  # time_fn's flush buffer is allocated (once) before the baseline is read
        baseline_bytes = torch.cuda.memory_allocated(device)
    trainer = build(c, init, DTYPES[spec.dtype], device)
    t = spec.timings
    step = time_fn(trainer.opt.step, device, t.step, setup=functools.partial(trainer.forward_backward, batch))

    for _ in range(t.iter_warmup):
        trainer.iteration(batch)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(t.iter_reps):
        sync(device)
        t0 = time.perf_counter()
        trainer.iteration(batch)
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    iters = summarize(times)
    peak = torch.cuda.max_memory_allocated(device) - baseline_bytes if device.type == "cuda" else None
    trainer.finish()
    state, report = trainer.state_bytes()
    numel = sum(p.numel() for p in trainer.module.parameters())
    row = Row(
        c.name, c.optimizer, trainer.config, spec.world_size, spec.device, spec.dtype, numel, step.median_ms,
        step.p10_ms, step.p90_ms, step.reps, iters.median_ms, iters.p10_ms, iters.p90_ms, iters.reps, state,
        state / numel, peak, memory_report=report,
    )  # fmt: skip
    del trainer
    release(device)
    elapsed = time.perf_counter() - start
    log(f"timed {c.name}: step {row.step_ms:.4g} ms, iteration {row.iter_ms:.4g} ms ({elapsed:.1f} s)")
    return row


def rank_main(rank: int, world_size: int, spec: Spec) -> dict[str, Any] | None:
    """Everything one rank does (the process group is up); rank 0 returns the results."""
    device = torch.device("cuda", torch.cuda.current_device()) if spec.device == "cuda" else torch.device("cpu")
    log = print if rank == 0 else (lambda *a, **k: None)
    init = initial_model(spec.model)
    # release() collects after every contender; without this, each full collection walks every object
    # torch has made (~0.2 s).
    gc.freeze()
    params = list(init.parameters())
    numel = sum(p.numel() for p in params)
    log(
        f"model: GPT d_model={spec.model.d_model} layers={spec.model.layers} vocab={spec.model.vocab} "
        f"seq={spec.model.seq}, {numel / 1e6:.2f}M params in {len(params)} tensors, {spec.dtype}; batch "
        f"{spec.model.batch}x{spec.model.seq} tokens per rank; world size {world_size} ({dist.get_backend()})"
    )
    start = time.perf_counter()
    failures, agreements = verify(spec, rank, device, init, log)
    log(f"correctness check: {time.perf_counter() - start:.1f} s")
    result = dict(rows=[], failures=failures, agreement=agreements, params=numel, tensors=len(params))
    if failures:
        log("FAILED the correctness check, nothing timed:\n  " + "\n  ".join(failures))
        return result if rank == 0 else None

    batch = make_batches(spec.model, rank, 1, device)[0]
    rows = [measure(c, spec, device, init, batch, log) for c in CONTENDERS]
    base = next(r for r in rows if r.name == BASELINE.name)
    for r in rows:
        r.step_ratio_vs_fused = r.step_ms / base.step_ms
        r.iter_ratio_vs_fused = r.iter_ms / base.iter_ms
    result["rows"] = rows
    return result if rank == 0 else None


# --------------------------------------------------------------------------------------- launchers


def run_in_process(spec: Spec) -> dict[str, Any]:
    """World size 1 in this process: NCCL on the GPU, gloo on the CPU, over a FileStore."""
    backend = "nccl" if spec.device == "cuda" else "gloo"
    if spec.device == "cuda":
        torch.cuda.set_device(0)
    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        dist.init_process_group(backend, store=store, rank=0, world_size=1)
        try:
            return rank_main(0, 1, spec)
        finally:
            dist.destroy_process_group()


def run_forked(spec: Spec, timeout: float) -> dict[str, Any]:
    """Gloo ranks in forked processes (distopt.testing): rank 0's results."""
    from distopt.testing import run_ranks

    return run_ranks(rank_main, spec.world_size, (spec,), timeout=timeout)[0]


# ------------------------------------------------------------------------------------------ output

_COLUMNS = (
    ("optimizer", 40), ("step ms", 9), ("p10-p90", 15), ("x Fused", 7), ("iter ms", 9), ("x Fused", 7),
    ("state MiB", 9), ("B/param", 7), ("peak MiB", 8),
)  # fmt: skip


def _format(row: Row) -> str:
    def ratio(x: float | None) -> str:
        return "" if x is None else f"{x:.2f}x"

    cells = (
        row.name, f"{row.step_ms:.4g}", f"{row.step_p10_ms:.4g}-{row.step_p90_ms:.4g}", ratio(row.step_ratio_vs_fused),
        f"{row.iter_ms:.4g}", ratio(row.iter_ratio_vs_fused), f"{row.state_bytes / 2**20:.2f}",
        f"{row.state_bytes_per_param:.2f}", "" if row.peak_bytes is None else f"{row.peak_bytes / 2**20:.0f}",
    )  # fmt: skip
    return table_row(cells, _COLUMNS)


def plot(path: Path, rows: Sequence[Row], title: str) -> bool:
    """Bar charts: step ms (p10-p90 whiskers), iteration ms, state MiB per rank, peak MiB (CUDA)."""
    panels = {
        "optimizer step (ms)": ([r.step_ms for r in rows], [(r.step_p10_ms, r.step_p90_ms) for r in rows]),
        "whole iteration (ms)": ([r.iter_ms for r in rows], [(r.iter_p10_ms, r.iter_p90_ms) for r in rows]),
        "optimizer state per rank (MiB)": ([r.state_bytes / 2**20 for r in rows], None),
    }
    if all(r.peak_bytes is not None for r in rows):
        panels["peak allocated, iteration (MiB)"] = ([r.peak_bytes / 2**20 for r in rows], None)
    labels = [r.name.replace(" overlap_param_sync", "\n+overlap_param_sync") for r in rows]
    return plot_bars(path, labels, panels, title)


# -------------------------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--world-size", type=int, default=None, help="ranks (default: 1 on cuda, 2 on cpu)")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bf16", help="model param dtype (default bf16)")
    parser.add_argument("--out", type=Path, required=True, help="folder for results_step.json and .png")
    parser.add_argument("--quick", action="store_true", help="tiny model, a few runs (CPU smoke test)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before forked ranks count as hung")
    args = parser.parse_args(argv)
    args.world_size = args.world_size or (1 if args.device == "cuda" else 2)
    if args.world_size < 1:
        parser.error(f"--world-size must be >= 1, got {args.world_size}")
    if args.device == "cuda" and args.world_size != 1:
        parser.error("--device cuda runs world size 1 (one rank in this process); use torchrun-style launches")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    world_size = args.world_size
    device = torch.device(args.device)
    kernels = kernels_in_use(device, ("adam_step_",))
    if kernels is None:
        return 2
    size = "quick" if args.quick else args.device
    spec = Spec(args.device, world_size, args.dtype, MODELS[size], TIMINGS[size])

    if world_size == 1:
        if args.device == "cpu":
            torch.set_num_threads(1)  # like each forked rank, and like distopt's CPU kernels
        result = run_in_process(spec)
    else:
        result = run_forked(spec, args.timeout)

    rows: list[Row] = result["rows"]
    args.out.mkdir(parents=True, exist_ok=True)
    meta = run_metadata(
        device,
        kernels=kernels,
        world_size=world_size,
        backend="nccl" if args.device == "cuda" else "gloo",
        torch_threads_per_rank=1 if args.device == "cpu" else torch.get_num_threads(),
        dtype=args.dtype,
        model={**dataclasses.asdict(spec.model), "params": result["params"], "tensors": result["tensors"]},
        hyperparameters=dict(lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY),
        timing={**dataclasses.asdict(spec.timings),
                "method": "step: common.time_fn (CUDA events, L2 flushed; perf_counter on CPU), after an untimed "
                          "zero_grad+forward+backward; iter: perf_counter around device syncs"},
        verification=dict(steps=VERIFY_STEPS, reference=REFERENCE.name, agreement=result["agreement"],
                          tolerance={str(k).removeprefix("torch."): v for k, v in TOLERANCE.items()},
                          max_outlier_fraction=MAX_OUTLIER_FRACTION, outlier_atol=OUTLIER_ATOL),
        failures=result["failures"],
    )  # fmt: skip
    if rows:
        ratio = next(r.step_ratio_vs_fused for r in rows if r.name == "DistributedFusedAdam")
        meta["target"] = dict(
            what=f"world size 1: DistributedFusedAdam step <= {TARGET_RATIO}x DDP + FusedAdam step",
            ratio=ratio,
            met=(ratio <= TARGET_RATIO) if world_size == 1 else None,
        )
        print("\n" + table_header(_COLUMNS))
        for row in rows:
            print(_format(row))
    write_json(args.out / "results_step.json", meta, rows)
    if result["failures"]:
        count = len(result["failures"])
        print(f"\n{count} correctness FAILURES: no timings reported; wrote {args.out}/results_step.json")
        return 1

    note = "" if world_size == 1 else f" (the target is for world size 1; this is world size {world_size})"
    print(
        f"\nDistributedFusedAdam step / FusedAdam step = {meta['target']['ratio']:.2f}x "
        f"(target <= {TARGET_RATIO}x{note})"
    )
    title = (
        f"optimizer step, {result['params'] / 1e6:.1f}M-param GPT ({args.dtype}), world size {world_size}, "
        f"{meta['device_name']}{' (timed with 1 per rank)' if args.device == 'cpu' else ''}\n"
        f"torch {meta['torch']}, {meta['git_commit'] or 'no git'}"
    )
    plot(args.out / "results_step.png", rows, title)
    print(f"wrote {args.out}/results_step.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
