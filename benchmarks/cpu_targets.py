"""The CPU kernel targets table of bench_kernels.py --device cpu (issue 11, item 2).

Each row times distopt against a baseline measured in the same run, alternating A and B run by run
(``common.time_ab``) so that a machine shared with other work slows both alike; the ratio is the
median of the per-pair ratios, with its 10th-90th percentile spread:

  copy / triad / scale in place
                     dst.copy_(src), a = b + s * c and x *= s on fp32, at 1 thread and at the run's
                     thread count: the memory bandwidth (the best median), the bound the kernels are
                     held to;
  adam fp32          ops.adam_step_ vs torch.optim.AdamW(fused=True).step(): >= 0.95x its speed, and
                     28 B/element at >= 90% of the copy/triad bandwidth;
  adam bf16 master   fp32 masters + bf16 grads + bf16 param_outs in one pass, vs torch's best
                     equivalent (bf16 grads cast into fp32 grads, fused AdamW, masters copied into the
                     bf16 params): >= 1.3x;
  adam 8-bit / bf16 moments
                     ops.adam_step_ with uint8 blockwise (codes + absmax per 256) or bf16 exp_avg and
                     exp_avg_sq vs the same op with fp32 moments (issue 19): >= 1.5x and >= 1.3x its
                     speed; bytes per element 16 and 20 against 28, so 1.75x and 1.4x are the bandwidth
                     limits;
  l2norm             ops.l2norm vs torch.linalg.vector_norm: >= 1x;
  cast_copy / scale  fp32 -> bf16 cast copy and fp32 scale: >= 80% of the copy bandwidth;
  DeepSpeedCPUAdam   a peer row for adam fp32 when deepspeed's CPU Adam is importable and builds.

Every pair is first checked for correctness (no number for a wrong result). Bytes count every read
and write once, plus the write-allocate read of an output that is not read first (the cache line is
loaded before it is written): copy 12 B/element, triad 16, scale in place 8, Adam fp32 28 (p, m, v are read before
written), the bf16-master update 30, 8-bit moments 16 (absmax: 1/32 B more), bf16 moments 20, cast fp32 -> bf16 8,
out-of-place fp32 scale 12.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from distopt import ops
from distopt import state_formats as sf

from common import Timing, gbps, time_ab

LR, BETAS, EPS, WD, STEP = 1e-3, (0.9, 0.999), 1e-8, 0.01, 10


@dataclass
class TargetRow:
    """One distopt-vs-baseline pair, as written to results.json under "cpu_targets"."""

    case: str
    distopt_ms: float
    distopt_p10: float
    distopt_p90: float
    baseline: str
    baseline_ms: float
    ratio: float  # baseline time / distopt time (speedup), or achieved / reference bandwidth
    ratio_p10: float
    ratio_p90: float
    target: str
    met: bool
    gbps: float
    note: str = ""


@dataclass
class Contender:
    fn: Callable[[], object]
    setup: Callable[[], object] | None = None


def _adam_state(n: int, grad_dtype: torch.dtype) -> dict[str, Tensor]:
    return {
        "p": torch.randn(n),
        "g": torch.randn(n).to(grad_dtype),
        "m": torch.randn(n) * 0.1,
        "v": torch.rand(n) * 0.01,
    }


def _torch_adamw(p: Tensor, g32: Tensor, m: Tensor, v: Tensor) -> torch.optim.AdamW:
    p.grad = g32
    opt = torch.optim.AdamW([p], LR, BETAS, EPS, WD, fused=True)
    opt.state[p] = {"step": torch.tensor(float(STEP - 1)), "exp_avg": m, "exp_avg_sq": v}
    return opt


def _distopt_adam(s: dict[str, Tensor], outs: list[Tensor]) -> None:
    ops.adam_step_(
        [s["p"]], [s["g"]], [s["m"]], [s["v"]], lr=LR, step=STEP, beta1=BETAS[0], beta2=BETAS[1], eps=EPS,
        weight_decay=WD, adam_w_mode=True, param_outs=outs,
    )  # fmt: skip


def _close(a: Tensor, b: Tensor, what: str, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    try:
        torch.testing.assert_close(a.float(), b.float(), rtol=rtol, atol=atol)
    except AssertionError as exc:
        raise AssertionError(f"{what}: {exc}") from None


class Targets:
    """Builds and times the rows; ``rows`` collects them, ``failures`` the failed checks."""

    def __init__(self, n: int, reps: int, warmup: int) -> None:
        self.n, self.reps, self.warmup = n, reps, warmup
        self.rows: list[TargetRow] = []
        self.failures: list[str] = []
        self.bandwidth = self.copy_bandwidth = 0.0

    def _time(self, a: Contender, b: Contender) -> tuple[Timing, Timing, Timing]:
        return time_ab(a.fn, b.fn, self.reps, self.warmup, a.setup, b.setup)

    def _row(self, case, a_t, b_t, ratio_t, baseline, target, met, nbytes, note="") -> TargetRow:
        row = TargetRow(
            case, a_t.median_ms, a_t.p10_ms, a_t.p90_ms, baseline, b_t.median_ms, ratio_t.median_ms,
            ratio_t.p10_ms, ratio_t.p90_ms, target, met, gbps(nbytes, a_t.median_ms), note,
        )  # fmt: skip
        self.rows.append(row)
        print(format_row(row), flush=True)
        return row

    def _checked(self, case: str, check: Callable[[], None]) -> bool:
        try:
            check()
        except Exception as exc:  # noqa: BLE001  (report it and go on with the other rows)
            self.failures.append(f"{case}: {exc}")
            print(f"FAILED correctness check, not timed: {case}: {exc}")
            return False
        return True

    def bandwidth_rows(self) -> None:
        """copy, triad and an in-place scale (x *= s: no write-allocate), at 1 thread and at the run's
        thread count (torch's static split of these ops can lose on a shared machine); the best
        median is the bound the kernel rows are measured against."""
        n, threads = self.n, torch.get_num_threads()
        src, dst, b, c = torch.randn(n), torch.empty(n), torch.randn(n), torch.randn(n)
        copy = Contender(lambda: dst.copy_(src))
        triad = Contender(lambda: torch.add(b, c, alpha=3.0, out=dst))
        scale = Contender(lambda: b.mul_(1.0))
        best: dict[str, float] = {}
        for t in sorted({1, threads}):
            torch.set_num_threads(t)
            copy_t, triad_t, _ = self._time(copy, triad)
            scale_t, _, _ = self._time(scale, copy)
            for case, timing, per_elem in (
                ("copy", copy_t, 12),
                ("triad", triad_t, 16),
                ("scale in place", scale_t, 8),
            ):
                bw = gbps(per_elem * n, timing.median_ms)
                best[case] = max(best.get(case, 0.0), bw)
                row = self._row(f"{case} fp32, {t} thread(s)", timing, timing, Timing(bw, bw, bw, timing.reps), "-",
                                "bandwidth", True, 0, f"{bw:.1f} GB/s ({per_elem} B/element)")  # fmt: skip
                row.gbps = bw
        torch.set_num_threads(threads)
        self.copy_bandwidth, self.bandwidth = best["copy"], max(best.values())

    def adam_fp32(self, deepspeed: Callable[[list[Tensor]], Callable[[], None]] | None) -> None:
        d, t = _adam_state(self.n, torch.float32), _adam_state(self.n, torch.float32)
        for k in d:
            t[k].copy_(d[k])
        opt = _torch_adamw(t["p"], t["g"], t["m"], t["v"])

        def check() -> None:
            _distopt_adam(d, [])
            opt.step()
            _close(d["p"], t["p"], "params")
            _close(d["v"], t["v"], "exp_avg_sq")

        if not self._checked("adam fp32", check):
            return
        a_t, b_t, r_t = self._time(Contender(lambda: _distopt_adam(d, [])), Contender(opt.step))
        self._row("adam fp32", a_t, b_t, r_t, "AdamW(fused=True)", ">= 0.95x", r_t.median_ms >= 0.95, 28 * self.n)
        bw = gbps(28 * self.n, a_t.median_ms)
        frac = bw / self.bandwidth
        self._row(
            "adam fp32 bandwidth", a_t, a_t, Timing(frac, frac, frac, a_t.reps), "copy/triad GB/s", ">= 0.90",
            frac >= 0.9, 28 * self.n, f"{bw:.1f} of {self.bandwidth:.1f} GB/s (28 B/element)",
        )  # fmt: skip
        if deepspeed is not None:
            ds_state = _adam_state(self.n, torch.float32)
            ref = {k: x.clone() for k, x in ds_state.items()}
            step = deepspeed([ds_state["p"], ds_state["g"], ds_state["m"], ds_state["v"]])
            ref_opt = _torch_adamw(ref["p"], ref["g"], ref["m"], ref["v"])

            def ds_check() -> None:
                step()
                ref_opt.step()
                _close(ds_state["p"], ref["p"], "DeepSpeedCPUAdam params vs torch")
                _close(ds_state["v"], ref["v"], "DeepSpeedCPUAdam exp_avg_sq vs torch")

            if self._checked("adam fp32 vs DeepSpeedCPUAdam", ds_check):
                a_t, b_t, r_t = self._time(Contender(lambda: _distopt_adam(d, [])), Contender(step))
                self._row("adam fp32 vs DeepSpeed", a_t, b_t, r_t, "DeepSpeedCPUAdam", "peer", True, 28 * self.n)

    def adam_bf16_master(self) -> None:
        d = _adam_state(self.n, torch.bfloat16)
        d_out = [d["p"].to(torch.bfloat16)]
        masters, g16, m, v = d["p"].clone(), d["g"].clone(), d["m"].clone(), d["v"].clone()
        g32, t_out = torch.empty(self.n), d_out[0].clone()
        opt = _torch_adamw(masters, g32, m, v)

        def torch_step() -> None:
            g32.copy_(g16)  # bf16 model grads -> fp32 master grads
            opt.step()
            t_out.copy_(masters)  # fp32 masters -> bf16 model params

        def check() -> None:
            _distopt_adam(d, d_out)
            torch_step()
            _close(d["p"], masters, "masters")
            _close(d_out[0], t_out, "bf16 params", rtol=2**-7, atol=1e-5)

        if not self._checked("adam bf16 master", check):
            return
        a_t, b_t, r_t = self._time(Contender(lambda: _distopt_adam(d, d_out)), Contender(torch_step))
        self._row(
            "adam bf16 grad+fp32 master+bf16 param", a_t, b_t, r_t, "cast + AdamW(fused) + copy", ">= 1.3x",
            r_t.median_ms >= 1.3, 30 * self.n, "distopt: one pass (param_outs); torch: three",
        )  # fmt: skip

    def adam_low_precision_moments(self) -> None:
        """8-bit and bf16 moments against fp32 moments, all with fp32 params and grads (issue 19)."""
        base = _adam_state(self.n, torch.float32)
        for dtype, target, nbytes in ((torch.uint8, 1.5, 16), (torch.bfloat16, 1.3, 20)):
            name = f"adam {'8-bit' if dtype == torch.uint8 else 'bf16'} moments"
            d = {k: x.clone() for k, x in base.items()}
            scales: dict[str, list[Tensor]] = {"m": [], "v": []}
            for key, signed in (("m", True), ("v", False)):
                if dtype == torch.uint8:
                    d[key], absmax = sf.quantize_blockwise(d[key], signed)
                    scales[key] = [absmax]
                else:
                    d[key] = d[key].to(dtype)
            f = {k: x.clone() for k, x in base.items()}

            def low(d=d, scales=scales) -> None:
                ops.adam_step_(
                    [d["p"]], [d["g"]], [d["m"]], [d["v"]], lr=LR, step=STEP, beta1=BETAS[0], beta2=BETAS[1],
                    eps=EPS, weight_decay=WD, adam_w_mode=True, exp_avg_scales=scales["m"],
                    exp_avg_sq_scales=scales["v"],
                )  # fmt: skip

            def check(d=d, scales=scales, dtype=dtype, low=low) -> None:
                # Bit for bit: the fp32-moment op between state_formats' exact reads and stores.
                p = d["p"].clone()
                m, v = (sf.dequantize_blockwise(d[k], scales[k][0], k == "m") if dtype == torch.uint8
                        else d[k].float() for k in ("m", "v"))  # fmt: skip
                _distopt_adam({"p": p, "g": d["g"], "m": m, "v": v}, [])
                low()
                want = {"p": p, "m": m, "v": v}
                for k in ("m", "v"):
                    want[k] = sf.quantize_blockwise(want[k], k == "m")[0] if dtype == torch.uint8 else want[k].to(dtype)
                for k, x in want.items():
                    if not torch.equal(d[k].view(torch.uint8), x.view(torch.uint8)):
                        raise AssertionError(f"{k} differs from the fp32 op between exact reads and stores")

            if not self._checked(name, check):
                continue
            a_t, b_t, r_t = self._time(Contender(low), Contender(lambda f=f: _distopt_adam(f, [])))
            self._row(name, a_t, b_t, r_t, "adam_step_ fp32 moments", f">= {target}x", r_t.median_ms >= target,
                      nbytes * self.n, f"bandwidth limit {28 / nbytes:.2f}x ({nbytes} vs 28 B/element)")  # fmt: skip

    def l2norm(self, dtype: torch.dtype) -> None:
        x, flag = torch.randn(self.n).to(dtype), torch.zeros(1)
        name = f"l2norm {str(dtype).removeprefix('torch.')}"

        def check() -> None:
            total, _ = ops.l2norm([x], flag)
            _close(total, torch.linalg.vector_norm(x.double()).float(), name, rtol=1e-5, atol=0)

        if not self._checked(name, check):
            return
        a_t, b_t, r_t = self._time(
            Contender(lambda: ops.l2norm([x], flag)), Contender(lambda: torch.linalg.vector_norm(x))
        )
        self._row(name, a_t, b_t, r_t, "linalg.vector_norm", ">= 1x", r_t.median_ms >= 1.0, x.nbytes,
                  "distopt also sets found_inf; sums in double")  # fmt: skip

    def cast_and_scale(self) -> None:
        n = self.n
        x, y16, y32, s = torch.randn(n), torch.empty(n, dtype=torch.bfloat16), torch.empty(n), torch.tensor([0.37])
        cases = (
            ("cast_copy fp32->bf16", lambda: ops.cast_copy_([x], [y16]), lambda: y16.copy_(x), 8 * n, y16,
             lambda: x.to(torch.bfloat16)),
            ("scale fp32", lambda: ops.scale_([x], [y32], s), lambda: torch.mul(x, s, out=y32), 12 * n, y32,
             lambda: x * s),
        )  # fmt: skip
        for case, fn, base, nbytes, out, expected in cases:
            check = lambda fn=fn, out=out, expected=expected, case=case: (fn(), _close(out, expected(), case))  # noqa: E731
            if not self._checked(case, check):
                continue
            a_t, b_t, _ = self._time(Contender(fn), Contender(base))
            frac = gbps(nbytes, a_t.median_ms) / self.copy_bandwidth
            self._row(case, a_t, b_t, Timing(frac, frac, frac, a_t.reps), "copy bandwidth", ">= 0.80",
                      frac >= 0.8, nbytes, f"baseline column: torch's equivalent ({b_t.median_ms:.3g} ms)")  # fmt: skip


def deepspeed_peer() -> tuple[Callable[[list[Tensor]], Callable[[], None]] | None, str]:
    """A factory of DeepSpeedCPUAdam steps over (p, g, m, v), or None and why not."""
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception as exc:  # noqa: BLE001  (any import failure means: no peer)
        return None, f"deepspeed not importable: {type(exc).__name__}: {str(exc)[:200]}"

    def make(tensors: list[Tensor]) -> Callable[[], None]:
        p, g, m, v = tensors
        param = torch.nn.Parameter(p)  # shares p's storage
        param.grad = g
        opt = DeepSpeedCPUAdam([param], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, adamw_mode=True)
        opt.state[param] = {"step": STEP - 1, "exp_avg": m, "exp_avg_sq": v}
        return opt.step

    return make, "deepspeed importable"


COLUMNS = (
    ("case", 38), ("distopt ms (p10-p90)", 24), ("baseline", 27), ("base ms", 9), ("ratio (p10-p90)", 20),
    ("target", 10), ("met", 4), ("note", 40),
)  # fmt: skip


def format_row(r: TargetRow) -> str:
    cells = (
        r.case, f"{r.distopt_ms:.3g} ({r.distopt_p10:.3g}-{r.distopt_p90:.3g})", r.baseline,
        f"{r.baseline_ms:.3g}", f"{r.ratio:.2f} ({r.ratio_p10:.2f}-{r.ratio_p90:.2f})", r.target,
        "yes" if r.met else "NO", r.note,
    )  # fmt: skip
    return " ".join(f"{c:<{w}}" for c, (_, w) in zip(cells, COLUMNS))


def run_targets(n: int, reps: int, warmup: int, with_deepspeed: bool = True) -> tuple[list[dict], list[str], str]:
    """Prints the table; returns (rows as dicts, failures, the DeepSpeed note)."""
    names = " ".join(f"{name:<{w}}" for name, w in COLUMNS)
    print(f"\nCPU kernel targets: {n:,} elements, {torch.get_num_threads()} torch threads, alternating A/B x {reps}")
    print(names + "\n" + "-" * len(names))
    t = Targets(n, reps, warmup)
    t.bandwidth_rows()
    ds, ds_note = deepspeed_peer() if with_deepspeed else (None, "DeepSpeed peer not requested")
    t.adam_fp32(ds)
    t.adam_bf16_master()
    t.adam_low_precision_moments()
    t.l2norm(torch.float32)
    t.l2norm(torch.bfloat16)
    t.cast_and_scale()
    print(f"DeepSpeedCPUAdam: {ds_note}")
    return [dataclasses.asdict(r) for r in t.rows], t.failures, ds_note
