"""Benchmarks distopt's fused kernels against torch's best equivalent, measured in the same run.

    python benchmarks/bench_kernels.py --device cuda --out DIR [--sizes 1M 4M ...] [--quick]

Three sections, each at several sizes, as ONE flat tensor ("flat") and as the many varied tensors of
a GPT-like model ("list"):
  adam_step_  the fused update alone, for four dtype mixes (torch fused AdamW alongside for fp32);
  pipeline    a mixed-precision optimizer step: torch's GradScaler unscale -> clip_grad_norm_ ->
              AdamW(fused) -> copy of the fp32 masters into the model params, against distopt's
              l2norm (+ found_inf) -> clip coefficient on device -> adam_step_ (+ param_outs);
  l2norm      the multi-tensor norm against torch._foreach_norm + vector_norm(stack(...)).
On CPU (--threads, default 2) it then prints the CPU kernel targets table (cpu_targets.py).
Every configuration is first checked against float64 references (f64_reference.py; a benchmark never
reports a number for wrong output), then timed (see common.py). GB/s counts each tensor read or
written once at its dtype, the minimum traffic of the fused pass; torch rows are given the same byte
count, so their GB/s is an effective bandwidth and the ratio of the two is the speedup. "% copy"
compares with the device-copy bandwidth measured in the same run. Writes results.json and results.png to --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from distopt import ops
from distopt.reference import join_bf16_remainder, split_bf16_remainder

import f64_reference as f64
from common import (
    Series,
    TimingConfig,
    copy_bandwidth,
    cpu_model,
    gbps,
    kernels_in_use,
    plot_bandwidth,
    plot_bars,
    run_metadata,
    size_label,
    table_header,
    table_row,
    time_fn,
    torch_adamw,
    write_json,
)

LR, BETA1, BETA2, EPS, WEIGHT_DECAY = 1e-3, 0.9, 0.999, 1e-8, 0.01
STEP = 10  # the update's number: the optimizer state is nonzero, as after a few steps
LOSS_SCALE = 1024.0  # pipeline grads are loss-scaled, like a GradScaler'd backward
MAX_NORM = 1.0  # smaller than the grads' norm, so clipping is active
CLIP_EPS = 1e-6  # as torch.nn.utils.clip_grad_norm_

CUDA_SIZES = (1 << 20, 4 << 20, 16 << 20, 64 << 20)
CPU_SIZES = (64 << 10, 1 << 20)
COPY_NUMEL = {"cuda": 1 << 28, "cpu": 1 << 24}  # fp32 copy buffers: 1 GiB on a GPU, far beyond L2
LAYOUTS = ("flat", "list")

TIMING = {
    "cuda": TimingConfig(warmup=5, min_reps=20, max_reps=200, budget_s=0.3),
    "cpu": TimingConfig(warmup=2, min_reps=5, max_reps=50, budget_s=0.3),
}
QUICK_TIMING = TimingConfig(warmup=1, min_reps=3, max_reps=5, budget_s=0.02)

# Updated params may differ from float64 by a fraction of one step: Adam's m / (sqrt(v) + eps) is ill-
# conditioned where |grad| is near eps, so a last-bit difference upstream (the clip norm) moves such
# an element visibly. Among millions of random elements a few always are. 1% of lr still catches any
# wrong hyperparameter, which moves every element by a large part of lr.
PARAM_ATOL = 1e-2 * LR


@dataclass(frozen=True)
class Mix:
    """A dtype mix of the fused update: stored param, grad and model-copy (param_out) dtypes."""

    name: str
    param: torch.dtype
    grad: torch.dtype
    out: torch.dtype | None = None
    remainder: bool = False  # bf16 params + int16 remainders: fp32 masters in 4 bytes

    def describe(self) -> str:
        short = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
        text = f"p={short[self.param]}{'+i16' if self.remainder else ''} g={short[self.grad]}"
        return text + (f" out={short[self.out]}" if self.out else "")

    def update_bytes(self) -> int:
        """Bytes per element of one update: p r/w, (remainder r/w), g r, m r/w, v r/w, (p_out w)."""
        param = 2 * self.param.itemsize + (4 if self.remainder else 0)
        return param + self.grad.itemsize + 2 * 4 + 2 * 4 + (self.out.itemsize if self.out else 0)


MIXES = (
    Mix("fp32", torch.float32, torch.float32),
    Mix("bf16-mixed", torch.float32, torch.bfloat16, torch.bfloat16),
    Mix("bf16-remainder", torch.bfloat16, torch.bfloat16, remainder=True),
    Mix("fp16-mixed", torch.float32, torch.float16, torch.float16),
)
PIPELINE_MIXES = ("fp32", "bf16-mixed")
NORM_DTYPES = (torch.float32, torch.bfloat16)


@dataclass
class Row:
    """One timed measurement, as written to results.json."""

    kernel: str
    impl: str
    mix: str
    dtypes: str
    layout: str
    numel: int
    tensors: int
    ms: float
    ms_p10: float
    ms_p90: float
    reps: int
    bytes: int
    gbps: float
    pct_copy_bw: float
    speedup: float | None = None  # torch ms / distopt ms, on distopt rows
    note: str = ""


# ----------------------------------------------------------------------------------------- data


def param_sizes(total: int, layout: str, layers: int = 24) -> list[int]:
    """Element counts summing to ``total``: one tensor ("flat"), or a GPT-like model ("list"): per
    layer 2 LayerNorms, QKV, projection and two MLP matrices with biases (hidden size h a multiple of
    8), plus an embedding that takes the remainder."""
    if layout == "flat":
        return [total]
    h = max(8, int(math.sqrt(0.9 * total / (12 * layers))) // 8 * 8)  # layers take ~90%
    layer = [h, h, 3 * h * h, 3 * h, h * h, h, h, h, 4 * h * h, 4 * h, 4 * h * h, h]
    sizes = layer * layers
    rest = total - sum(sizes)
    if rest <= 0:
        raise ValueError(f"size {total} is too small for the list layout")
    return [rest, *sizes]


def _randn(sizes: Sequence[int], device: torch.device, dtype: torch.dtype = torch.float32, scale: float = 1.0):
    return [(torch.randn(n, device=device) * scale).to(dtype) for n in sizes]


@dataclass
class State:
    """Tensors of one optimizer step: fp32 masters (or bf16 + remainders), grads, moments, outs."""

    params: list[Tensor]
    grads: list[Tensor]
    exp_avgs: list[Tensor]
    exp_avg_sqs: list[Tensor]
    outs: list[Tensor]
    remainders: list[Tensor]

    def masters(self) -> list[Tensor]:
        """The fp32 master values."""
        if self.remainders:
            return [join_bf16_remainder(p, r) for p, r in zip(self.params, self.remainders, strict=True)]
        return [p.float() for p in self.params]

    def clone(self) -> State:
        return State(**{name: [t.clone() for t in tensors] for name, tensors in vars(self).items()})


def make_state(sizes: Sequence[int], mix: Mix, device: torch.device, grad_scale: float = 1.0) -> State:
    """Random state in the dtypes of ``mix``; grads are N(0, 1) times ``grad_scale``."""
    masters = _randn(sizes, device)
    params, remainders = masters, []
    if mix.remainder:
        params, remainders = map(list, zip(*(split_bf16_remainder(m) for m in masters), strict=True))
    return State(
        params=params,
        grads=_randn(sizes, device, mix.grad, grad_scale),
        exp_avgs=_randn(sizes, device, scale=0.1),
        exp_avg_sqs=[torch.rand(n, device=device) * 0.01 for n in sizes],
        outs=[m.to(mix.out) for m in masters] if mix.out else [],
        remainders=remainders,
    )


# ----------------------------------------------------------------------------- the two contenders


def distopt_update(s: State, grad_scale: Tensor | None = None, found_inf: Tensor | None = None) -> None:
    """distopt's fused update of ``s`` in place."""
    ops.adam_step_(
        s.params, s.grads, s.exp_avgs, s.exp_avg_sqs, lr=LR, step=STEP, beta1=BETA1, beta2=BETA2, eps=EPS,
        weight_decay=WEIGHT_DECAY, adam_w_mode=True, param_outs=s.outs, param_remainders=s.remainders,
        grad_scale=grad_scale, found_inf=found_inf,
    )  # fmt: skip


def resumed_torch_adamw(params: list[Tensor], s: State) -> tuple[torch.optim.AdamW, bool, str]:
    """torch's AdamW (common.torch_adamw) over ``params`` (grads set) whose state is the moments of ``s``
    (used in place, not copied) and whose next step is number STEP. Returns (optimizer, fused, note)."""
    opt, fused, note = torch_adamw(params, LR, (BETA1, BETA2), EPS, WEIGHT_DECAY)
    for p, m, v in zip(params, s.exp_avgs, s.exp_avg_sqs, strict=True):
        # Fused kernels read the step count from the param's device, foreach ones from the host.
        step = torch.tensor(float(STEP - 1), device=p.device if fused else "cpu")
        opt.state[p] = {"step": step, "exp_avg": m, "exp_avg_sq": v}
    return opt, fused, note


def expected_update(s: State, grad_factor: Tensor | float = 1.0) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
    """The float64 (params, exp_avgs, exp_avg_sqs) after one update of ``s`` (left unchanged)."""
    return f64.adamw(s.masters(), s.grads, s.exp_avgs, s.exp_avg_sqs, lr=LR, betas=(BETA1, BETA2), eps=EPS,
                     weight_decay=WEIGHT_DECAY, step=STEP, grad_factor=grad_factor)  # fmt: skip


def torch_masters(s: State) -> list[Tensor]:
    """fp32 master params for torch, with fp32 ``.grad``s holding the grads of ``s``."""
    masters = s.masters()
    for p, g in zip(masters, s.grads, strict=True):
        p.grad = g if g.dtype == torch.float32 else g.float()
    return masters


@dataclass
class Pipeline:
    """One optimizer step of each library over its own copy of the same data."""

    distopt_step: Callable[[], None]
    torch_step: Callable[[], None]
    torch_setup: Callable[[], None] | None  # restores what torch's step modifies in place
    check: Callable[[], None]
    note: str


def make_pipeline(mix: Mix, sizes: Sequence[int], device: torch.device) -> Pipeline:
    """The GradScaler + clipping + AdamW step of ``mix`` (fp32, or fp32 masters with 16-bit model
    params and grads), by torch and by distopt."""
    d = make_state(sizes, mix, device, grad_scale=LOSS_SCALE)
    t, before = d.clone(), d.clone()
    # 0-dim like GradScaler's: torch's fused AdamW subtracts found_inf from its 0-dim step counts.
    inv_scale = torch.full((), 1.0 / LOSS_SCALE, device=device)
    d_inf, t_inf = torch.zeros((), device=device), torch.zeros((), device=device)

    def distopt_step() -> None:
        d_inf.zero_()
        total, _ = ops.l2norm(d.grads, d_inf)  # of the loss-scaled grads, so unscale the norm
        clip = (MAX_NORM / (total * inv_scale + CLIP_EPS)).clamp_(max=1.0)
        distopt_update(d, grad_scale=clip * inv_scale, found_inf=d_inf)

    masters = t.params  # fp32 for both mixes
    t_grads = [g if g.dtype == torch.float32 else g.float() for g in t.grads]  # the master grads
    for p, g in zip(masters, t_grads, strict=True):
        p.grad = g
    opt, fused, note = resumed_torch_adamw(masters, t)
    if fused:
        opt.found_inf = t_inf  # what GradScaler.step passes after unscale_: a skip without a host sync
    else:
        note += "; no found_inf skip (needs a host sync)"
    pristine = [g.clone() for g in t.grads] if mix.out is None else []

    def torch_step() -> None:
        if mix.out is not None:
            torch._foreach_copy_(t_grads, t.grads)  # 16-bit model grads -> fp32 master grads
        t_inf.zero_()
        torch._amp_foreach_non_finite_check_and_unscale_(t_grads, t_inf, inv_scale)
        torch.nn.utils.clip_grad_norm_(masters, MAX_NORM, foreach=True)
        opt.step()
        if mix.out is not None:
            torch._foreach_copy_(t.outs, masters)  # fp32 masters -> 16-bit model params

    def torch_setup() -> None:
        torch._foreach_copy_(t.grads, pristine)  # unscale and clip scaled the fp32 grads in place

    def check() -> None:
        expected = expected_update(before, f64.clip_factor(before.grads, 1.0 / LOSS_SCALE, MAX_NORM, CLIP_EPS))
        distopt_step()
        torch_step()
        f64.assert_update(d.masters(), d.outs, d.exp_avgs + d.exp_avg_sqs, expected, PARAM_ATOL)
        f64.assert_update(masters, t.outs, t.exp_avgs + t.exp_avg_sqs, expected, PARAM_ATOL, baseline=True)
        assert d_inf.item() == 0 and t_inf.item() == 0, "found_inf set for finite grads"

    return Pipeline(distopt_step, torch_step, torch_setup if pristine else None, check, note)


# --------------------------------------------------------------------------------------- sections


@dataclass(frozen=True)
class Config:
    """What one pair of rows measures."""

    kernel: str
    mix: str
    dtypes: str
    layout: str
    sizes: tuple[int, ...]
    nbytes: int  # the fused pass's minimum traffic


class Bench:
    """Runs the measurements of one device, printing each row as it is made."""

    def __init__(self, device: torch.device, timing: TimingConfig, copy_gbps: float) -> None:
        self.device, self.timing, self.copy_gbps = device, timing, copy_gbps
        self.rows: list[Row] = []
        self.failures: list[str] = []
        print(table_header(_COLUMNS))

    def measure(
        self,
        cfg: Config,
        impl: str,
        fn: Callable[[], object],
        setup: Callable[[], object] | None = None,
        note: str = "",
        baseline: Row | None = None,
    ) -> Row:
        """Times ``fn`` and records the row; ``baseline`` (torch's row) gives the speedup."""
        t = time_fn(fn, self.device, self.timing, setup)
        bw = gbps(cfg.nbytes, t.median_ms)
        row = Row(
            cfg.kernel, impl, cfg.mix, cfg.dtypes, cfg.layout, sum(cfg.sizes), len(cfg.sizes), t.median_ms,
            t.p10_ms, t.p90_ms, t.reps, cfg.nbytes, bw, 100 * bw / self.copy_gbps, note=note,
        )  # fmt: skip
        if baseline is not None:
            row.speedup = baseline.ms / row.ms
        self.rows.append(row)
        print(_format(row))
        return row

    def checked(self, cfg: Config, check: Callable[[], None]) -> bool:
        """Runs a correctness check; a failure is reported and its configuration not timed."""
        try:
            check()
        except Exception as exc:  # noqa: BLE001  (report it, keep benchmarking the others)
            what = f"{cfg.kernel} {cfg.mix} {cfg.layout} {size_label(sum(cfg.sizes))}"
            self.failures.append(f"{what}: {exc}")
            print(f"FAILED correctness check, not timed: {what}: {exc}")
            return False
        return True

    def adam(self, mix: Mix, layout: str, total: int) -> None:
        """The fused update alone; for fp32 also torch's fused AdamW step (the same work)."""
        sizes = param_sizes(total, layout)
        cfg = Config("adam_step_", mix.name, mix.describe(), layout, tuple(sizes), total * mix.update_bytes())
        s = make_state(sizes, mix, self.device)
        t = s.clone()
        masters = torch_masters(t)
        opt, _, note = resumed_torch_adamw(masters, t)

        def check() -> None:
            expected = expected_update(s)
            distopt_update(s)
            opt.step()
            f64.assert_update(s.masters(), s.outs, s.exp_avgs + s.exp_avg_sqs, expected, PARAM_ATOL)
            f64.assert_update(masters, [], t.exp_avgs + t.exp_avg_sqs, expected, PARAM_ATOL, baseline=True)

        if not self.checked(cfg, check):
            return
        baseline = self.measure(cfg, "torch", opt.step, note=note) if mix.name == "fp32" else None
        self.measure(cfg, "distopt", lambda: distopt_update(s), baseline=baseline)

    def pipeline(self, mix: Mix, layout: str, total: int) -> None:
        """unscale + clip + AdamW + cast copy: torch's best pipeline against distopt's two passes."""
        sizes = param_sizes(total, layout)
        nbytes = total * (mix.grad.itemsize + mix.update_bytes())  # the norm pass reads g, then the update
        cfg = Config("pipeline", mix.name, mix.describe(), layout, tuple(sizes), nbytes)
        p = make_pipeline(mix, sizes, self.device)
        if not self.checked(cfg, p.check):
            return
        baseline = self.measure(cfg, "torch", p.torch_step, p.torch_setup, p.note)
        note = "l2norm(found_inf) + adam_step_(grad_scale, found_inf)"
        self.measure(cfg, "distopt", p.distopt_step, note=note, baseline=baseline)

    def l2norm(self, dtype: torch.dtype, layout: str, total: int) -> None:
        """distopt.ops.l2norm against torch._foreach_norm + vector_norm(stack(...))."""
        sizes = param_sizes(total, layout)
        name = {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]
        cfg = Config("l2norm", name, f"g={name}", layout, tuple(sizes), total * dtype.itemsize)
        grads = _randn(sizes, self.device, dtype)
        found_inf = torch.zeros(1, device=self.device)

        def torch_norm() -> tuple[Tensor, list[Tensor]]:
            # fp32 per-tensor norms (clip_grad_norm_ would keep the grad dtype, less accurate for bf16).
            per_tensor = torch._foreach_norm(grads, 2, dtype=torch.float32)
            return torch.linalg.vector_norm(torch.stack(per_tensor)), per_tensor

        torch_error = 0.0

        def check() -> None:
            nonlocal torch_error
            expected = f64.l2norm(grads)
            total_t, per_t = torch_norm()
            f64.assert_close(ops.l2norm(grads, found_inf), expected, "l2norm (total, per-tensor)", rtol=f64.NORM_RTOL)
            f64.assert_close((total_t, torch.stack(per_t)), expected, "l2norm (total, per-tensor)", baseline=True)
            torch_error = abs(total_t.item() / expected[0].item() - 1)
            assert found_inf.item() == 0, "found_inf set for finite grads"

        if not self.checked(cfg, check):
            return
        note = f"_foreach_norm(dtype=fp32) + vector_norm(stack); {torch_error:.1e} off float64"
        baseline = self.measure(cfg, "torch", torch_norm, note=note)
        self.measure(cfg, "distopt", lambda: ops.l2norm(grads, found_inf), note="also sets found_inf",
                     baseline=baseline)  # fmt: skip


# ------------------------------------------------------------------------------------------ output

_COLUMNS = (
    ("kernel", 10), ("impl", 7), ("dtypes", 22), ("layout", 6), ("size", 5), ("#t", 4), ("ms", 9),
    ("p10-p90 ms", 17), ("GB/s", 8), ("%copy", 6), ("speedup", 7),
)  # fmt: skip


def _format(row: Row) -> str:
    speedup = f"{row.speedup:.2f}x" if row.speedup is not None else ""
    cells = (
        row.kernel, row.impl, row.dtypes, row.layout, size_label(row.numel), str(row.tensors), f"{row.ms:.4g}",
        f"{row.ms_p10:.4g}-{row.ms_p90:.4g}", f"{row.gbps:.1f}", f"{row.pct_copy_bw:.0f}", speedup,
    )  # fmt: skip
    return table_row(cells, _COLUMNS)


def parse_size(text: str) -> int:
    """'64K' -> 65536, '16M' -> 16777216, '1000' -> 1000 (K and M are powers of two)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper()
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def _panels(rows: Sequence[Row]) -> dict[str, Series]:
    panels: dict[str, Series] = {}
    for r in rows:
        panels.setdefault(r.kernel, {}).setdefault((r.impl, f"{r.mix} {r.layout}"), []).append((r.numel, r.gbps))
    return panels


# -------------------------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--out", type=Path, required=True, help="folder for results.json and results.png")
    parser.add_argument("--sizes", nargs="+", type=parse_size, help="total elements, e.g. 1M 4M 16M 64M")
    parser.add_argument("--quick", action="store_true", help="a few runs per measurement (smoke test)")
    parser.add_argument("--threads", type=int, default=2, help="CPU: torch threads (default 2)")
    parser.add_argument("--target-size", type=parse_size, help="CPU targets table: elements (default 16M)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    kernels = kernels_in_use(device, ("adam_step_", "l2norm"))
    if kernels is None:
        return 2
    sizes = args.sizes or (CUDA_SIZES if device.type == "cuda" else CPU_SIZES)
    timing = QUICK_TIMING if args.quick else TIMING[device.type]
    if device.type == "cpu":
        torch.set_num_threads(args.threads)  # distopt's CPU kernels and torch's share torch's threads
    torch.manual_seed(0)

    copy_gbps, copy_timing = copy_bandwidth(device, COPY_NUMEL[device.type] >> (2 if args.quick else 0), timing)
    print(
        f"device: {device.type} ({run_metadata(device)['device_name']}), kernels: {kernels}, "
        f"copy bandwidth: {copy_gbps:.1f} GB/s (read + write, median {copy_timing.median_ms:.3f} ms)\n"
    )
    bench = Bench(device, timing, copy_gbps)
    mixes = {m.name: m for m in MIXES}
    for total in sizes:
        for layout in LAYOUTS:
            for mix in MIXES:
                bench.adam(mix, layout, total)
            for name in PIPELINE_MIXES:
                bench.pipeline(mixes[name], layout, total)
            for dtype in NORM_DTYPES:
                bench.l2norm(dtype, layout, total)

    targets: dict = {}
    if device.type == "cpu":
        from cpu_targets import run_targets  # the CPU kernel targets table (issue 11, item 2)

        n = args.target_size or (1 << 20 if args.quick else 16 << 20)
        rows, failures, ds_note = run_targets(n, 3 if args.quick else 15, 1 if args.quick else 3, not args.quick)
        bench.failures += failures
        targets = {"cpu_targets": rows, "cpu_targets_numel": n, "deepspeed": ds_note, "machine": cpu_model()}

    args.out.mkdir(parents=True, exist_ok=True)
    method = "CUDA events, L2 flushed before each run" if device.type == "cuda" else "time.perf_counter"
    meta = run_metadata(
        device,
        kernels=kernels,
        copy_bandwidth_gbps=copy_gbps,
        timing={**dataclasses.asdict(timing), "method": method},
        failures=bench.failures,
        threads=torch.get_num_threads(),
        **targets,
    )
    write_json(args.out / "results.json", meta, bench.rows)
    title = f"distopt kernels on {meta['device_name']} (torch {meta['torch']}, {meta['git_commit'] or 'no git'})"
    plot_bandwidth(args.out / "results.png", _panels(bench.rows), copy_gbps, title)
    if targets:
        rows = targets["cpu_targets"]
        ratios = ([r["ratio"] for r in rows], [(r["ratio_p10"], r["ratio_p90"]) for r in rows])
        plot_bars(
            args.out / "cpu_targets.png",
            [r["case"] for r in rows],
            {"ratio (see target)": ratios},
            f"{title}, {torch.get_num_threads()} threads, {size_label(targets['cpu_targets_numel'])}",
        )
    print(
        f"\nwrote {args.out}/results.json" + (f"; {len(bench.failures)} correctness FAILURES" if bench.failures else "")
    )
    return 1 if bench.failures else 0


if __name__ == "__main__":
    sys.exit(main())
