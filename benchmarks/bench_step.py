"""Benchmarks a whole optimizer step, in time and memory: DistributedFusedAdam against FusedAdam and
torch's AdamW, each with what it needs to train data-parallel, on the same model in the same run.

    python benchmarks/bench_step.py --device cuda --world-size 1 --out DIR
    python benchmarks/bench_step.py --device cpu --world-size 2 --out DIR [--quick]

The model is a small GPT (token + position embeddings, pre-LayerNorm blocks of causal attention and a
4x MLP, an untied LM head; per block 2 LayerNorms, QKV, projection and 2 MLP matrices, all with biases
but QKV, whose key bias gets only rounding noise as a gradient, which Adam would amplify): 98.0M
params in 137 tensors on CUDA, 1.32M on CPU, 167K with --quick. It is trained in bf16 (--dtype; fp32
also works) with fp32 optimizer state and fp32 master weights, the usual mixed-precision recipe:
  DDP + AdamW           DDP (default settings) + torch.optim.AdamW(fused=True; foreach where torch has
                        no fused kernel: the row says which) over fp32 master copies of the 16-bit
                        params. Its step casts the grads into a transient fp32 buffer
                        (_foreach_copy_), steps, and copies the masters into the model
                        (_foreach_copy_). The reference for the correctness check.
  DDP + FusedAdam       DDP + distopt.FusedAdam(master_weights=True): one fused pass updates the
                        masters and writes the 16-bit params.
  DistributedFusedAdam  no DDP: grads are reduce-scattered in bf16 from backward hooks (default
                        options: bucket_cap_mb=100, store_params=True, grad/param sync in the param
                        dtype); its step finishes the grad sync, updates this rank's shard and
                        all-gathers the params.
  ... overlap_param_sync   the same with overlap_param_sync=True: step() leaves the all-gather to the
                        next forward's pre-hooks, so the step row excludes it and the iteration row
                        includes it.
With --dtype fp32 the params are their own masters (AdamW and FusedAdam use none, DistributedFusedAdam
gets store_params=False). All start from the same init and see the same batches (one per rank).

Measured per optimizer, on rank 0 (every rank runs the same; gloo ranks are forked processes, one
torch thread each; on CUDA one rank in-process with NCCL):
  step      opt.step() alone after a backward (zero_grad + forward + backward untimed before each
            run): common.time_fn, so CUDA events with L2 flushed before each run (the step's host
            work may overlap the end of the backward, as in training) or perf_counter on CPU.
  iter      zero_grad + forward + backward + step, perf_counter around a device synchronize.
  state     persistent optimizer bytes per rank: DistributedFusedAdam.memory_report()["total"] (shards
            of masters, moments and the fp32 grad shard); for FusedAdam the tensors in
            optimizer.state; for AdamW those plus its fp32 masters.
  peak      CUDA only: torch.cuda.max_memory_allocated over the timed iterations, minus what was
            allocated before this optimizer's model was built (model, grads, activations, state).
Median with p10/p90 over a fixed number of runs after warm-up (fixed so that every rank runs the same
collectives). Before any timing, each optimizer trains 2 steps from the same init on the same data
in fp32 and in the run dtype; its params must match DDP + AdamW's (fp32: rtol 1e-4; 16-bit: one
rounding step; at most 1e-5 of the elements may be off by up to the two runs' Adam updates, see
Agreement.failure), else nothing is timed, results_step.json lists the failures and the script exits 1.

Prints a table; writes results_step.json and results_step.png to --out. The issue's target (a
benchmark, not a test): at world size 1, DistributedFusedAdam's step <= 1.1x FusedAdam's.
"""

from __future__ import annotations

import argparse
import copy
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
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

import distopt
from distopt import ops

from common import REPO_ROOT, TimingConfig, flush_l2, run_metadata, summarize, time_fn, write_json

LR, BETAS, EPS, WEIGHT_DECAY = 1e-3, (0.9, 0.999), 1e-8, 0.01
TARGET_RATIO = 1.1  # the issue's target: DistributedFusedAdam's step <= 1.1x FusedAdam's at world size 1
VERIFY_STEPS = 2
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}

# Two training runs whose update kernels differ in rounding: a few fp32 ulps, which Adam amplifies in
# elements with tiny gradients (hence 1e-4, not 1e-6); 16-bit params: one rounding step of the type.
TOLERANCE = {
    torch.float32: dict(rtol=1e-4, atol=1e-5),
    torch.bfloat16: dict(rtol=2**-7, atol=1e-4),
}
MAX_OUTLIER_FRACTION = 1e-5  # of all elements may be outside TOLERANCE (see Agreement.failure) ...
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
class Contender:
    name: str  # the table's label
    optimizer: str  # AdamW | FusedAdam | DistributedFusedAdam
    overlap_param_sync: bool = False


CONTENDERS = (
    Contender("DDP + AdamW", "AdamW"),
    Contender("DDP + FusedAdam", "FusedAdam"),
    Contender("DistributedFusedAdam", "DistributedFusedAdam"),
    Contender("DistributedFusedAdam overlap_param_sync", "DistributedFusedAdam", overlap_param_sync=True),
)
REFERENCE, BASELINE = CONTENDERS[0], CONTENDERS[1]  # the correctness reference; the step-ratio baseline


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


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg.d_model, cfg.heads) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def initial_model(cfg: ModelConfig) -> GPT:
    """The shared init (fp32, CPU, seeded): GPT-2's N(0, 0.02) weights, zero biases, unit LayerNorms."""
    torch.manual_seed(0)
    model = GPT(cfg)
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


# ------------------------------------------------------------------------------------- optimizers


class MasterAdamW:
    """torch.optim.AdamW over fp32 masters of 16-bit params (over the params themselves in fp32)."""

    def __init__(self, params: list[Tensor]) -> None:
        self.params = params
        self.mixed = params[0].dtype != torch.float32
        if self.mixed:
            self.numels = [p.numel() for p in params]
            self.master_flat = torch.cat([p.detach().float().reshape(-1) for p in params])
            self.masters = list(self.master_flat.split(self.numels))
            self.param_views = [p.detach().view(-1) for p in params]
        opt_params = self.masters if self.mixed else params
        try:
            self.opt = torch.optim.AdamW(opt_params, LR, BETAS, EPS, WEIGHT_DECAY, fused=True)
            self.kind = "AdamW(fused=True)"
        except RuntimeError as exc:
            self.opt = torch.optim.AdamW(opt_params, LR, BETAS, EPS, WEIGHT_DECAY, foreach=True)
            self.kind = f"AdamW(foreach=True): no fused kernel on {params[0].device.type} ({exc})"

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        if not self.mixed:
            self.opt.step()
            return
        grads = torch.empty_like(self.master_flat).split(self.numels)  # transient fp32 master grads
        torch._foreach_copy_(grads, [p.grad.view(-1) for p in self.params])
        for m, g in zip(self.masters, grads):
            m.grad = g
        self.opt.step()
        torch._foreach_copy_(self.param_views, self.masters)
        for m in self.masters:
            m.grad = None

    def state_bytes(self) -> int:
        return _state_tensor_bytes(self.opt) + (_nbytes(self.master_flat) if self.mixed else 0)


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def _state_tensor_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(_nbytes(v) for s in opt.state.values() for v in s.values() if isinstance(v, Tensor))


@dataclass
class Trainer:
    """One contender: its model copy, the module called in forward (DDP-wrapped or not), its optimizer."""

    contender: Contender
    module: GPT
    model: nn.Module
    opt: Any
    config: str

    def forward_backward(self, batch: tuple[Tensor, Tensor]) -> None:
        self.opt.zero_grad(set_to_none=True)
        tokens, targets = batch
        logits = self.model(tokens)
        F.cross_entropy(logits.float().flatten(0, 1), targets.flatten()).backward()

    def iteration(self, batch: tuple[Tensor, Tensor]) -> None:
        self.forward_backward(batch)
        self.opt.step()

    def finish(self) -> None:
        """Lands a deferred param all-gather (overlap_param_sync) so that the params are current."""
        if isinstance(self.opt, distopt.DistributedFusedAdam):
            self.opt.param_sync()

    def state_bytes(self) -> tuple[int, dict[str, int] | None]:
        if isinstance(self.opt, distopt.DistributedFusedAdam):
            report = self.opt.memory_report()
            return report["total"], report
        if isinstance(self.opt, MasterAdamW):
            return self.opt.state_bytes(), None
        return _state_tensor_bytes(self.opt), None


def build(c: Contender, init: GPT, dtype: torch.dtype, device: torch.device) -> Trainer:
    module = copy.deepcopy(init).to(device=device, dtype=dtype)
    params = list(module.parameters())
    mixed = dtype != torch.float32
    ddp_kw = dict(device_ids=[device.index]) if device.type == "cuda" else {}
    if c.optimizer == "AdamW":
        opt = MasterAdamW(params)
        config = f"DDP + {opt.kind}" + (" over fp32 masters" if mixed else "")
        return Trainer(c, module, DistributedDataParallel(module, **ddp_kw), opt, config)
    if c.optimizer == "FusedAdam":
        opt = distopt.FusedAdam(params, LR, BETAS, EPS, WEIGHT_DECAY, master_weights=mixed)
        config = f"DDP + FusedAdam(master_weights={mixed})"
        return Trainer(c, module, DistributedDataParallel(module, **ddp_kw), opt, config)
    opt = distopt.DistributedFusedAdam(
        params, LR, BETAS, EPS, WEIGHT_DECAY, overlap_param_sync=c.overlap_param_sync, store_params=mixed
    )
    config = f"overlap_param_sync={c.overlap_param_sync}, store_params={mixed}, bucket_cap_mb={opt.bucket_cap_mb:g}"
    return Trainer(c, module, module, opt, config)


def release(device: torch.device) -> None:
    """Frees a dropped contender now: DistributedFusedAdam's hooks make reference cycles (and its
    overlap_param_sync forward pre-hook is global until the optimizer is collected)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------ measurement


@dataclass
class Agreement:
    """How one contender's params after VERIFY_STEPS steps compare with the reference's."""

    max_abs_diff: float = 0.0
    outliers: int = 0  # elements outside TOLERANCE
    beyond_bound: int = 0  # elements outside TOLERANCE widened by OUTLIER_ATOL: impossible for a correct run
    worst_param: str = ""  # the param with the most outliers

    def failure(self, numel: int) -> str | None:
        """Why this is not a pass, or None. A few elements (MAX_OUTLIER_FRACTION) may be outside the
        tolerance by up to OUTLIER_ATOL: Adam moves an element by at most about lr per step whatever
        its gradient, so where the gradient is tiny (next to rounding noise) two correct runs can move
        it differently. A real bug (a wrong lr or step count, a missed sync or gather) moves most."""
        allowed = int(MAX_OUTLIER_FRACTION * numel)
        if self.beyond_bound:
            return (
                f"{self.beyond_bound} elements differ by more than two runs' updates can "
                f"(> {OUTLIER_ATOL:.3g} beyond the tolerance; most in {self.worst_param})"
            )
        if self.outliers > allowed:
            return (
                f"{self.outliers} of {numel} elements outside the tolerance (at most {allowed} allowed; "
                f"most in {self.worst_param})"
            )
        return None


def compare(params: Sequence[tuple[str, Tensor]], reference: Sequence[tuple[str, Tensor]], tol: dict) -> Agreement:
    a = Agreement()
    most = 0
    for (name, actual), (_, expected) in zip(params, reference):
        diff = (actual.float() - expected.float()).abs()
        allowed = tol["atol"] + tol["rtol"] * expected.float().abs()
        count = int((diff > allowed).sum())
        a.max_abs_diff = max(a.max_abs_diff, diff.max().item())
        a.outliers += count
        a.beyond_bound += int((diff > allowed + OUTLIER_ATOL).sum())
        if count > most:
            most, a.worst_param = count, name
    return a


def verify(spec: Spec, rank: int, device: torch.device, init: GPT, log: Callable) -> tuple[list[str], dict]:
    """Trains every contender VERIFY_STEPS steps in fp32 and in the run dtype and compares its params
    with DDP + AdamW's. Returns (failures, {dtype: {contender: Agreement as a dict}})."""
    batches = make_batches(spec.model, rank, VERIFY_STEPS, device)
    dtypes = [torch.float32] + ([DTYPES[spec.dtype]] if DTYPES[spec.dtype] != torch.float32 else [])
    numel = sum(p.numel() for p in init.parameters())
    failures, report = [], {}
    for dtype in dtypes:
        tol = TOLERANCE[dtype]
        reference = None
        results = report.setdefault(str(dtype).removeprefix("torch."), {})
        for c in CONTENDERS:
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
            agreement = compare(params, reference, tol)
            results[c.name] = dataclasses.asdict(agreement)
            why = agreement.failure(numel)
            if why is not None:
                failures.append(f"{c.name} ({dtype}) differs from {REFERENCE.name} (tolerance {tol}): {why}")
        log(
            f"checked {VERIFY_STEPS} steps in {dtype} against {REFERENCE.name} (tolerance {tol}): "
            + ", ".join(
                f"{name}: max |diff| {r['max_abs_diff']:.2e}, {r['outliers']} outliers" for name, r in results.items()
            )
        )
    return failures, report


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(c: Contender, spec: Spec, device: torch.device, init: GPT, batch, log) -> Row:
    """Builds the contender and times its step alone, then whole iterations."""
    start = time.perf_counter()
    dtype = DTYPES[spec.dtype]
    baseline_bytes = 0
    if device.type == "cuda":
        flush_l2(device)  # time_fn's flush buffer is allocated (once) before the baseline is read
        baseline_bytes = torch.cuda.memory_allocated(device)
    trainer = build(c, init, dtype, device)
    t = spec.timings
    step = time_fn(trainer.opt.step, device, t.step, setup=functools.partial(trainer.forward_backward, batch))

    for _ in range(t.iter_warmup):
        trainer.iteration(batch)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(t.iter_reps):
        _sync(device)
        t0 = time.perf_counter()
        trainer.iteration(batch)
        _sync(device)
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
    failures, agreement = verify(spec, rank, device, init, log)
    log(f"correctness check: {time.perf_counter() - start:.1f} s")
    result = dict(rows=[], failures=failures, agreement=agreement, params=numel, tensors=len(params))
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
    """Gloo ranks in forked processes (tests/distributed/harness.py): rank 0's results."""
    sys.path.insert(0, str(REPO_ROOT / "tests" / "distributed"))
    from harness import run_ranks

    return run_ranks(rank_main, spec.world_size, (spec,), timeout=timeout)[0]


# ------------------------------------------------------------------------------------------ output

_COLUMNS = (
    ("optimizer", 40), ("step ms", 9), ("p10-p90", 15), ("x Fused", 7), ("iter ms", 9), ("x Fused", 7),
    ("state MiB", 9), ("B/param", 7), ("peak MiB", 8),
)  # fmt: skip


def _header() -> str:
    names = " ".join(f"{name:<{width}}" for name, width in _COLUMNS)
    return names + "\n" + "-" * len(names)


def _format(row: Row) -> str:
    def ratio(x: float | None) -> str:
        return "" if x is None else f"{x:.2f}x"

    cells = (
        row.name, f"{row.step_ms:.4g}", f"{row.step_p10_ms:.4g}-{row.step_p90_ms:.4g}", ratio(row.step_ratio_vs_fused),
        f"{row.iter_ms:.4g}", ratio(row.iter_ratio_vs_fused), f"{row.state_bytes / 2**20:.2f}",
        f"{row.state_bytes_per_param:.2f}", "" if row.peak_bytes is None else f"{row.peak_bytes / 2**20:.0f}",
    )  # fmt: skip
    return " ".join(f"{cell:<{width}}" for cell, (_, width) in zip(cells, _COLUMNS))


def plot(path: Path, rows: Sequence[Row], title: str) -> bool:
    """Bar charts: step ms (p10-p90 whiskers), iteration ms, state MiB per rank, peak MiB (CUDA)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: skipping the plot {path}")
        return False
    step_err = [(r.step_ms - r.step_p10_ms, r.step_p90_ms - r.step_ms) for r in rows]
    iter_err = [(r.iter_ms - r.iter_p10_ms, r.iter_p90_ms - r.iter_ms) for r in rows]
    panels = [
        ("optimizer step (ms)", [r.step_ms for r in rows], step_err),
        ("whole iteration (ms)", [r.iter_ms for r in rows], iter_err),
        ("optimizer state per rank (MiB)", [r.state_bytes / 2**20 for r in rows], None),
    ]
    if all(r.peak_bytes is not None for r in rows):
        panels.append(("peak allocated, iteration (MiB)", [r.peak_bytes / 2**20 for r in rows], None))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4.8), squeeze=False)
    labels = [r.name.replace(" overlap_param_sync", "\n+overlap_param_sync") for r in rows]
    ys = range(len(rows))
    for ax, (name, values, errors) in zip(axes[0], panels):
        xerr = list(zip(*errors)) if errors else None
        ax.barh(ys, values, xerr=xerr, color=[f"C{i}" for i in ys], capsize=3)
        for y, v, e in zip(ys, values, errors or [(0, 0)] * len(rows)):
            ax.text(v + e[1], y, f" {v:.3g}", va="center", fontsize=7)
        ax.margins(x=0.2)
        ax.set_yticks(list(ys), labels if ax is axes[0][0] else [""] * len(rows), fontsize=7)
        ax.invert_yaxis()
        ax.set(title=name)
        ax.grid(True, axis="x", alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# -------------------------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--world-size", type=int, default=None, help="ranks (default: 1 on cuda, 2 on cpu)")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bf16", help="model param dtype (default bf16)")
    parser.add_argument("--out", type=Path, required=True, help="folder for results_step.json and .png")
    parser.add_argument("--quick", action="store_true", help="tiny model, a few runs (CPU smoke test)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before forked ranks count as hung")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    world_size = args.world_size or (1 if args.device == "cuda" else 2)
    if args.device == "cuda":
        if not torch.cuda.is_available():
            print("--device cuda: no CUDA device visible", file=sys.stderr)
            return 2
        if world_size != 1:
            print(
                "--device cuda runs world size 1 (one rank in this process); use torchrun-style launches for more GPUs",
                file=sys.stderr,
            )
            return 2
    if world_size < 1:
        print(f"--world-size must be >= 1, got {world_size}", file=sys.stderr)
        return 2
    kernels = "compiled" if ("adam_step_", args.device.upper()) in ops.COMPILED_KERNELS else "reference"
    if kernels != "compiled":
        message = f"distopt._C has no {args.device} kernels: the pure-PyTorch reference ops would be timed"
        if args.device == "cuda":
            print(f"error: {message}; build the extension first", file=sys.stderr)
            return 2
        print(f"warning: {message}")
    size = "quick" if args.quick else args.device
    spec = Spec(args.device, world_size, args.dtype, MODELS[size], TIMINGS[size])
    device = torch.device(args.device)

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
    write_json(args.out / "results_step.json", meta, rows)
    if rows:
        print("\n" + _header())
        for row in rows:
            print(_format(row))
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
