"""Optimizer-state offload: device bytes per param (formula vs measured) and step time, with and without
``offload_optimizer=True``, for FusedAdam and DistributedFusedAdam on the same model in the same run.

Rows (each a pair from the same init on the same batches: resident vs offload):
  fused_fp32, fused_bf16    FusedAdam (master_weights=True: fp32 masters of bf16 params) vs
                            FusedAdam(offload_optimizer=True)
  dfa_ws1_fp32, dfa_ws1_bf16  DistributedFusedAdam(store_params=True) vs (offload_optimizer=True) at world
                            size 1 (in this process: gloo on CPU, NCCL on CUDA)
  dfa_ws2_fp32              the same on 2 forked gloo ranks (CPU only; rank 0's numbers)
The model is a stack of ``--width`` square Linear layers (+ tanh), as many as make ``--params``.

Per row and option: device and host bytes per param by formula (what the option keeps: FusedAdam 8 B
of moments, +4 of master for 16-bit params; DistributedFusedAdam (4 master + 8 moments + 4 grad shard)
/ world size; offload: none on the device, the same plus its staging on the host) and measured after
two steps (CUDA: ``torch.cuda.memory_allocated`` after the first step, grads freed, minus before the
optimizer was built, and the pinned host allocator's growth; CPU, where device and host are the same
memory: DistributedFusedAdam's ``memory_report()`` and FusedAdam's state and staging tensors, which
checks their count and sizes, not a split). Then the step alone (after an untimed forward and
backward) and the whole iteration (forward, backward, step: backward's overlap with the reductions and
copies counts), alternating A/B repetitions after warm-up: median and p10/p90, and those of the per-pair
ratios offload / resident. Afterwards each pair's params are compared: offload runs the same update
on the host (the same bits), so on CPU they must be equal bit for bit; on CUDA within fp32 rounding.

Published anchor (torchao's CPUOffloadOptimizer, ViT-giant 1.1B params, full BF16 training (bf16 Adam
state, no masters), activation checkpointing, batch 32, one RTX 4070 Ti SUPER, time per step and max
memory): no offload 1.27 s/it and 9.82 GB; torchao offload 1.52 s/it and 5.24 GB; DeepSpeed ZeRO-Offload
(untuned) 3.13 s/it and 6.85 GB (https://github.com/pytorch/ao/tree/main/torchao/optim#optimizer-cpu-offload).

    python benchmarks/bench_offload.py --device cuda --out DIR          # ~200M params
    python benchmarks/bench_offload.py --device cpu --out DIR           # ~4M params, ~1 min
    python benchmarks/bench_offload.py --device cpu --quick --out DIR   # smoke run, seconds
Writes results_offload.json and results_offload.png to --out; exits 1 if a pair disagreed.
"""

from __future__ import annotations

import argparse
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from distopt import FusedAdam  # noqa: E402
from distopt.distributed import DistributedFusedAdam  # noqa: E402

from common import plot_bars, publish, run_metadata, summarize, sync, table_row  # noqa: E402
from host_rows import alternate  # noqa: E402

LR, WEIGHT_DECAY = 1e-3, 1e-2
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
CUDA_RTOL, CUDA_ATOL = 1e-6, 1e-7  # host vs device kernel on CUDA: the same math, at most fp32 rounding
MIN_CHANGED = 0.5  # of the elements must differ from their init after the run
ALIGN = 16  # DistributedFusedAdam's shard alignment (elements): sizes that are multiples of it x world size
# leave no padding, so the formula per param is exact


@dataclass(frozen=True)
class Case:
    name: str
    optimizer: str  # FusedAdam | DistributedFusedAdam
    dtype: str
    world_size: int


CASES = (
    Case("fused_fp32", "FusedAdam", "fp32", 1),
    Case("fused_bf16", "FusedAdam", "bf16", 1),
    Case("dfa_ws1_fp32", "DistributedFusedAdam", "fp32", 1),
    Case("dfa_ws1_bf16", "DistributedFusedAdam", "bf16", 1),
    Case("dfa_ws2_fp32", "DistributedFusedAdam", "fp32", 2),  # CPU only (forked gloo ranks)
)


@dataclass(frozen=True)
class Size:
    params: int  # target count; the model has the nearest whole number of layers
    width: int
    batch: int  # rows per rank per step
    warmup: int
    reps: int


SIZES = {
    "cuda": Size(params=200_000_000, width=4096, batch=2048, warmup=2, reps=7),
    "cpu": Size(params=4_000_000, width=512, batch=16, warmup=3, reps=15),
    "quick": Size(params=65_000, width=64, batch=8, warmup=1, reps=3),
}


@dataclass
class Variant:
    """One option's numbers (bytes per param of the model's params, on this rank)."""

    config: str
    device_bpp_formula: float
    device_bpp_measured: float
    host_bpp_formula: float
    host_bpp_measured: float
    step_ms: float
    step_p10_ms: float
    step_p90_ms: float
    iter_ms: float
    iter_p10_ms: float
    iter_p90_ms: float
    peak_bytes: int | None  # CUDA: max allocated over an iteration minus before the optimizer existed
    memory_report: dict[str, int] | None  # DistributedFusedAdam.memory_report()


@dataclass
class Row:
    case: str
    optimizer: str
    dtype: str
    world_size: int
    params: int
    tensors: int
    resident: Variant
    offload: Variant
    step_ratio: float  # median of the per-pair offload / resident ratios
    step_ratio_p10: float
    step_ratio_p90: float
    iter_ratio: float
    iter_ratio_p10: float
    iter_ratio_p90: float
    max_abs_diff: float  # between the two options' params after the run
    bit_exact: bool
    changed_fraction: float  # of the elements that the run moved from their init (resident)
    agree: bool  # bit_exact on CPU, within CUDA_RTOL/CUDA_ATOL on CUDA; and most elements moved
    reps: int


# ------------------------------------------------------------------------------------------ model


def make_model(size: Size, dtype: torch.dtype, device: torch.device) -> nn.Sequential:
    """The shared init (seeded, made on the device: the same values for both options): Linear + tanh."""
    layers = max(1, round(size.params / (size.width * size.width + size.width)))
    torch.manual_seed(0)
    blocks = []
    for _ in range(layers):
        blocks += [nn.Linear(size.width, size.width, device=device), nn.Tanh()]
    return nn.Sequential(*blocks).to(dtype=dtype)


def make_batch(size: Size, dtype: torch.dtype, device: torch.device, rank: int, index: int) -> Tensor:
    g = torch.Generator().manual_seed(1000 * rank + index)
    return torch.randn(size.batch, size.width, generator=g).to(device=device, dtype=dtype)


def build(case: Case, model: nn.Module, offload: bool) -> tuple[Any, str]:
    mixed = case.dtype != "fp32"
    if case.optimizer == "FusedAdam":
        opt = FusedAdam(
            model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, master_weights=mixed, offload_optimizer=offload
        )
        return opt, f"FusedAdam(master_weights={mixed}, offload_optimizer={offload})"
    opt = DistributedFusedAdam(
        model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, store_params=True, offload_optimizer=offload
    )
    return opt, f"DistributedFusedAdam(store_params=True, offload_optimizer={offload})"


# ----------------------------------------------------------------------------------------- memory


def formula(case: Case, offload: bool) -> tuple[float, float]:
    """(device, host) bytes per param of what the option keeps on this rank after a step."""
    grad = DTYPES[case.dtype].itemsize
    out16 = 0 if case.dtype == "fp32" else 2  # the host's 16-bit copy of the updated params
    if case.optimizer == "FusedAdam":
        if offload:  # master + 2 moments, and staging for the grads and 16-bit params
            return 0.0, 12.0 + grad + out16
        return (8.0 if case.dtype == "fp32" else 12.0), 0.0
    shard = 16.0 / case.world_size  # master + 2 moments + fp32 grad shard
    if offload:  # and staging for the shard's 16-bit grads and params
        return 0.0, shard + (0 if case.dtype == "fp32" else (grad + out16) / case.world_size)
    return shard, 0.0


def fused_bytes(opt: FusedAdam) -> tuple[int, int]:
    """(device, host) bytes of FusedAdam's per-param state and offload staging (its memory_report; the
    step scalars, 4 B on the CPU per tensor, are left out)."""
    report = opt.memory_report()
    return report["device"], report["host"]


def host_allocated() -> int | None:
    """Bytes of pinned host blocks handed out by torch's caching host allocator (CUDA; each rounded up to
    a power of two), or None where torch does not say."""
    try:
        return int(torch.cuda.host_memory_stats()["active_bytes.current"])
    except (AttributeError, KeyError, RuntimeError):
        return None


# -------------------------------------------------------------------------------------- the pairs


def release(device: torch.device) -> None:
    gc.collect()  # DistributedFusedAdam's hooks make reference cycles
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_pair(case: Case, size: Size, device: torch.device, rank: int) -> dict[str, Any]:
    """Both options from the same init: memory over two untimed iterations, then alternating timed
    steps and iterations, then the params compared."""
    dtype = DTYPES[case.dtype]
    names = ("resident", "offload")
    models = {name: make_model(size, dtype, device) for name in names}
    params = list(models["resident"].parameters())
    numel = sum(p.numel() for p in params)
    init = [p.detach().clone() for p in params]
    if case.optimizer != "FusedAdam" and any(p.numel() % (ALIGN * case.world_size) for p in params):
        raise ValueError(f"--width {size.width}: param sizes must be multiples of {ALIGN * case.world_size}")
    count = dict.fromkeys(names, 0)
    opts: dict[str, Any] = {}
    out: dict[str, dict[str, Any]] = {}

    def forward_backward(name: str) -> None:
        opts[name].zero_grad(set_to_none=True)
        x = make_batch(size, dtype, device, rank, count[name] % 4)
        models[name](x).float().square().mean().backward()
        count[name] += 1

    # A forward and backward first: cuBLAS allocates its workspace once, from the caching allocator, and
    # keeps it; it must not count as the first option's state.
    models["resident"](make_batch(size, dtype, device, rank, 0)).float().square().mean().backward()
    for p in params:
        p.grad = None
    for name in names:  # memory, one option at a time
        release(device)
        before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        host_before = host_allocated() if device.type == "cuda" else None
        opts[name], config = build(case, models[name], name == "offload")
        forward_backward(name)
        opts[name].step()
        opts[name].zero_grad(set_to_none=True)
        sync(device)
        release(device)
        report = opts[name].memory_report() if case.optimizer != "FusedAdam" else None
        if report is not None:
            dev, host = report["device"], report["host"]
        else:
            dev, host = fused_bytes(opts[name])
        if device.type == "cuda":
            dev = torch.cuda.memory_allocated(device) - before
            host_now = host_allocated()
            host = host if host_now is None or host_before is None else host_now - host_before
            torch.cuda.reset_peak_memory_stats(device)
        forward_backward(name)
        opts[name].step()
        peak = torch.cuda.max_memory_allocated(device) - before if device.type == "cuda" else None
        f_dev, f_host = formula(case, name == "offload")
        out[name] = dict(
            config=config,
            device_bpp_formula=f_dev,
            device_bpp_measured=dev / numel,
            host_bpp_formula=f_host,
            host_bpp_measured=host / numel,
            peak_bytes=peak,
            memory_report=report,
        )

    def timed_step(name: str) -> Callable[[], float]:
        def run() -> float:
            forward_backward(name)
            if case.world_size > 1:
                dist.barrier()  # both ranks start the step together
            sync(device)
            start = time.perf_counter()
            opts[name].step()
            sync(device)
            return (time.perf_counter() - start) * 1e3

        return run

    def timed_iteration(name: str) -> Callable[[], float]:
        def run() -> float:
            if case.world_size > 1:
                dist.barrier()
            sync(device)
            start = time.perf_counter()
            forward_backward(name)
            opts[name].step()
            sync(device)
            return (time.perf_counter() - start) * 1e3

        return run

    steps = alternate({n: timed_step(n) for n in names}, size.warmup, size.reps)
    iters = alternate({n: timed_iteration(n) for n in names}, size.warmup, size.reps)
    for name in names:
        for what, times in (("step", steps[name]), ("iter", iters[name])):
            t = summarize(times)
            out[name].update({f"{what}_ms": t.median_ms, f"{what}_p10_ms": t.p10_ms, f"{what}_p90_ms": t.p90_ms})
    diff, exact, agree = compare(params, list(models["offload"].parameters()))
    # Two options that both left the params alone would agree too: Adam moves every element with a
    # nonzero gradient by about lr per step.
    changed = sum(int((p.detach() != p0).sum()) for p, p0 in zip(params, init)) / numel
    ratios = {what: summarize([b / a for a, b in zip(t["resident"], t["offload"])])
              for what, t in (("step", steps), ("iter", iters))}  # fmt: skip
    tensors = len(params)
    opts.clear()  # free both options' state before the next pair
    models.clear()
    params.clear()
    release(device)
    return dict(
        case=case.name, optimizer=case.optimizer, dtype=case.dtype, world_size=case.world_size, params=numel,
        tensors=tensors, resident=Variant(**out["resident"]), offload=Variant(**out["offload"]),
        step_ratio=ratios["step"].median_ms, step_ratio_p10=ratios["step"].p10_ms,
        step_ratio_p90=ratios["step"].p90_ms, iter_ratio=ratios["iter"].median_ms,
        iter_ratio_p10=ratios["iter"].p10_ms, iter_ratio_p90=ratios["iter"].p90_ms, max_abs_diff=diff,
        bit_exact=exact, changed_fraction=changed, agree=agree and changed > MIN_CHANGED, reps=size.reps,
    )  # fmt: skip


def compare(a: Sequence[Tensor], b: Sequence[Tensor]) -> tuple[float, bool, bool]:
    """(max |a - b|, bit-exact, agree): on CPU agreement is bit-exactness; on CUDA (host kernel vs
    device kernel) fp32 rounding is allowed."""
    diff = max(float((x.detach().float() - y.detach().float()).abs().max()) for x, y in zip(a, b))
    exact = all(torch.equal(x, y) for x, y in zip(a, b))
    if a[0].device.type == "cpu":
        return diff, exact, exact
    close = all(torch.allclose(x.float(), y.float(), rtol=CUDA_RTOL, atol=CUDA_ATOL) for x, y in zip(a, b))
    return diff, exact, close


def _ws2_rank(rank: int, world_size: int, case: Case, size: Size) -> dict[str, Any]:
    return run_pair(case, size, torch.device("cpu"), rank)


def run_cases(cases: Sequence[Case], size: Size, device: torch.device, timeout: float) -> list[Row]:
    """The world-size-1 cases in this process (one group: NCCL on CUDA, gloo on CPU), then the forked."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=0, world_size=1)
        try:
            rows += [Row(**run_pair(c, size, device, 0)) for c in cases if c.world_size == 1]
        finally:
            dist.destroy_process_group()
    forked = [c for c in cases if c.world_size > 1]
    if forked:
        from distopt.testing import run_ranks

        for c in forked:
            rows.append(Row(**run_ranks(_ws2_rank, c.world_size, (c, size), timeout=timeout)[0]))
    return rows


# ------------------------------------------------------------------------------------------ output

_COLUMNS = (
    ("case", 13), ("params", 9), ("dev B/p res f/m", 15), ("dev B/p off f/m", 15), ("host B/p off f/m", 16),
    ("step ms res", 11), ("off", 9), ("x (p10-p90)", 17), ("iter ms res", 11), ("off", 9), ("x (p10-p90)", 17),
    ("params agree", 12),
)  # fmt: skip


def _format(r: Row) -> str:
    res, off = r.resident, r.offload
    cells = (
        r.case, f"{r.params / 1e6:.2f}M", f"{res.device_bpp_formula:g} / {res.device_bpp_measured:.3g}",
        f"{off.device_bpp_formula:g} / {off.device_bpp_measured:.3g}",
        f"{off.host_bpp_formula:g} / {off.host_bpp_measured:.3g}", f"{res.step_ms:.4g}", f"{off.step_ms:.4g}",
        f"{r.step_ratio:.2f}x ({r.step_ratio_p10:.2f}-{r.step_ratio_p90:.2f})", f"{res.iter_ms:.4g}",
        f"{off.iter_ms:.4g}", f"{r.iter_ratio:.2f}x ({r.iter_ratio_p10:.2f}-{r.iter_ratio_p90:.2f})",
        ("bit-exact" if r.bit_exact else f"{r.max_abs_diff:.1e}") + ("" if r.agree else " FAIL"),
    )  # fmt: skip
    return table_row(cells, _COLUMNS)


def plot(path: Path, rows: Sequence[Row], title: str) -> bool:
    """Two bars per row (resident, offload): device and host bytes per param, step and iteration ms."""
    variants = [(r, name, v) for r in rows for name, v in (("resident", r.resident), ("offload", r.offload))]
    labels = [f"{r.case}\n{name}" for r, name, _ in variants]
    panels = {
        "device B/param (measured)": ([v.device_bpp_measured for *_, v in variants], None),
        "host B/param (measured)": ([v.host_bpp_measured for *_, v in variants], None),
        "optimizer step (ms)": ([v.step_ms for *_, v in variants], [(v.step_p10_ms, v.step_p90_ms) for *_, v in
                                                                    variants]),
        "whole iteration (ms)": ([v.iter_ms for *_, v in variants], [(v.iter_p10_ms, v.iter_p90_ms) for *_, v in
                                                                     variants]),
    }  # fmt: skip
    return plot_bars(path, labels, panels, title)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--out", type=Path, required=True, help="folder for results_offload.json and .png")
    parser.add_argument("--quick", action="store_true", help="a tiny model and a few runs (smoke test)")
    parser.add_argument("--params", type=int, default=None, help="model size (default: 200M cuda, 4M cpu)")
    parser.add_argument("--width", type=int, default=None, help="Linear width, a multiple of 32")
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions per option")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: 1 on cpu)")
    parser.add_argument("--cases", nargs="*", default=None, help=f"a subset of {[c.name for c in CASES]}")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before forked ranks count as hung")
    args = parser.parse_args(argv)
    unknown = set(args.cases or ()) - {c.name for c in CASES}
    if unknown:
        parser.error(f"unknown cases {sorted(unknown)}; choose from {[c.name for c in CASES]}")
    if args.width is not None and (args.width < 32 or args.width % 32):
        parser.error(f"--width must be a positive multiple of 32 (no shard padding at world size 2), got {args.width}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device visible", file=sys.stderr)
        return 2
    base = SIZES["quick" if args.quick else args.device]
    size = Size(args.params or base.params, args.width or base.width, base.batch, base.warmup, args.reps or base.reps)
    if args.threads is not None or device.type == "cpu":
        torch.set_num_threads(args.threads or 1)
    if device.type == "cuda":
        torch.cuda.set_device(0)
        device = torch.device("cuda", 0)
    cases = [c for c in CASES if (not args.cases or c.name in args.cases)
             and not (c.world_size > 1 and device.type == "cuda")]  # fmt: skip
    rows = run_cases(cases, size, device, args.timeout)
    failures = [
        f"{r.case}: offload and resident params differ by up to {r.max_abs_diff:g} (bit-exact: {r.bit_exact}), "
        f"{r.changed_fraction:.1%} of the elements moved from their init"
        for r in rows
        if not r.agree
    ]
    meta = run_metadata(
        device, threads=torch.get_num_threads(), size=size.__dict__,
        hyperparameters=dict(lr=LR, weight_decay=WEIGHT_DECAY),
        timing="perf_counter around device syncs; alternating A/B repetitions after warm-up; median, p10, p90; "
               "ratios: per-pair offload / resident",
        memory=("CUDA: memory_allocated after one step (grads freed) minus before the optimizer; host: growth "
                "of the pinned allocator's active bytes (blocks rounded up to powers of two). CPU: "
                "DistributedFusedAdam.memory_report(), FusedAdam's state and staging tensors"),
        host_measured_by=("the pinned allocator's active bytes" if device.type == "cuda" and host_allocated()
                          is not None else "memory_report() / the state and staging tensors"),
        agreement=f"CPU: bit-exact; CUDA: rtol {CUDA_RTOL:g}, atol {CUDA_ATOL:g}; >= {MIN_CHANGED:.0%} of the "
                  "elements moved from their init",
        failures=failures,
    )  # fmt: skip
    intro = (f"{meta['device_name']}, torch {meta['torch']}, {meta['date']}, {size.reps} alternating repetitions "
             f"after {size.warmup} warm-up; B/p: bytes per param, formula / measured")  # fmt: skip
    stats = ", ".join(f"{r.case} {r.step_ratio:.2f}x" for r in rows)
    title = (
        f"offload_optimizer=True vs resident, {size.width}-wide Linear stack, {meta['device_name']}\n"
        f"step time offload/resident: {stats}; torch {meta['torch']}, {meta['git_commit'] or 'no git'}"
    )
    publish(args.out, "results_offload", meta, rows, intro, _COLUMNS, _format, plot, title)
    if failures:
        print("FAILED:\n  " + "\n  ".join(failures))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
