"""distopt's main job: data-parallel training of a small GPT with DistributedFusedAdam (ZeRO-2),
next to DDP + torch.optim.AdamW on the same batches.

    python examples/train.py [--steps 120] [--ranks 2]          # spawns its own ranks
    torchrun --nproc-per-node 8 examples/train.py [--steps ...]  # torchrun's ranks
    python examples/train.py --bmuf [--sync-every 4]            # BMUF vs DDP (examples/bmuf_mode.py)
    torchrun --nproc-per-node 2 --max-restarts 2 examples/train.py --checkpoint-dir DIR --checkpoint-every 20
                                          # checkpoints; restarted, it resumes bit for bit (examples/resume.py)

Without a GPU it starts 2 CPU ranks over gloo; with GPUs, one rank per GPU over NCCL. The model is a
byte-level TinyGPT (examples/model.py) trained on the Python standard library's own sources
(examples/data.py): every rank takes its slice of each step's global batch. Three models start from
the same weights and see the same batches:

  distopt   the model trained with DistributedFusedAdam (no DDP wrapper);
  DDP       DDP + torch.optim.AdamW, the reference;
  control   DDP + torch.optim.AdamW whose averaged gradients are nudged by one ulp, up or down at
            random, every step: a run that differs from the reference only by last-bit rounding.

Rank 0 prints both losses (train, and validation every --val-every steps), each run's distance from
DDP's params, time per step (median, interquartile range and min-max over the steps after --warmup),
tokens/s and the optimizer memory per rank.

The verdict. distopt and DDP differ in the order gradients are summed (reduce-scatter vs
all-reduce), in how the gradient norm for clipping is summed and in how the update's arithmetic
rounds: last-bit differences, which training amplifies (Adam most of all, dividing by the square
root of tiny second moments), so the two runs drift apart with the steps. The control measures that
drift for this very model, data, schedule and machine (without its nudge it is bit-identical to
DDP). The run passes if distopt's params are within --tolerance-factor times the control's distance
of DDP's, measured as ||difference|| / ||params|| over all params, and exits with status 1
otherwise. On 2 CPU ranks the ratio comes out at about 1 (0.94 to 1.04 over seeds 0-3 at 60 and 120
steps): both runs are the reference plus a last-bit perturbation per step. The factor 10 leaves room
for larger ones (sums over many ranks in another order round differently by a few ulps), while real
mistakes stand far out: distopt with eps 1e-7 instead of 1e-8 lands 52 times the control's distance
away, without weight decay 154 times, with eps 1e-6 215 times (seed 0, 120 steps). (The largest |difference| of a single
element, also printed, is a noisier measure: it follows the few weights whose second moments are
near zero.)

The line before the verdict is a SHA-256 digest of the three models' final params: two runs that
print the same digest ended with the same bits (say, a resumed run and an uninterrupted one).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distopt import DistributedFusedAdam

# examples/data.py, model.py, resume.py (checkpoints, restarts) and lowprec_mode.py (low-precision state);
# the script's directory is on sys.path
import lowprec_mode
import resume
from data import Corpus, load_corpus, train_batch, val_batches
from model import TinyGPT

TORCHRUN = "RANK" in os.environ and "WORLD_SIZE" in os.environ


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=Formatter)
    run = parser.add_argument_group("run")
    run.add_argument("--steps", type=int, default=120, help="optimizer steps")
    run.add_argument("--ranks", type=int, default=None,
                     help="ranks to spawn (default: one per GPU, else 2 CPU ranks); refused under torchrun")
    run.add_argument("--threads", type=int, default=0,
                     help="torch CPU threads per rank (0: the machine's cores divided among the ranks)")
    run.add_argument("--seed", type=int, default=0, help="model init and batch order")
    data = parser.add_argument_group("data and model")
    data.add_argument("--batch-size", type=int, default=16, help="global batch in sequences, split over the ranks")
    data.add_argument("--seq-len", type=int, default=128, help="tokens (bytes) per sequence")
    data.add_argument("--dim", type=int, default=128, help="model width")
    data.add_argument("--layers", type=int, default=2)
    data.add_argument("--heads", type=int, default=4)
    optim = parser.add_argument_group("optimizer (both sides)")
    optim.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    optim.add_argument("--lr-warmup", type=int, default=10,
                       help="steps of linear lr warm-up, then cosine decay to lr/10")
    optim.add_argument("--weight-decay", type=float, default=0.01)
    optim.add_argument("--clip", type=float, default=1.0, help="max global gradient L2 norm (0: no clipping)")
    optim.add_argument("--bucket-cap-mb", type=float, default=0.5,
                       help="MiB of gradients per bucket (DistributedFusedAdam and DDP)")
    optim.add_argument("--overlap-grad-sync", action=argparse.BooleanOptionalAction, default=True,
                       help="start each bucket's reduce-scatter during backward")
    optim.add_argument("--overlap-param-sync", action=argparse.BooleanOptionalAction, default=True,
                       help="defer each bucket's param all-gather to the next forward")
    optim.add_argument("--offload", action="store_true",
                       help="DistributedFusedAdam(offload_optimizer=True): fp32 state and update in host memory")
    report = parser.add_argument_group("report")
    report.add_argument("--log-every", type=int, default=20, help="print the train loss (mean since the last print)")
    report.add_argument("--val-every", type=int, default=40, help="validation loss every N steps (and at the end)")
    report.add_argument("--val-batches", type=int, default=4, help="global batches in the fixed validation set")
    report.add_argument("--warmup", type=int, default=5, help="first steps left out of the timing statistics")
    report.add_argument("--tolerance-factor", type=float, default=10.0,
                        help="pass if distopt's relative L2 distance from DDP's params is at most this many times "
                             "the control's (see above)")
    import bmuf_mode  # here, not at the top: it imports this module's pieces

    bmuf_mode.add_arguments(parser)
    resume.add_arguments(parser)
    lowprec_mode.add_arguments(parser)
    args = parser.parse_args(argv)

    if TORCHRUN and args.ranks is not None:
        parser.error(f"--ranks does not apply under torchrun, which started {os.environ['WORLD_SIZE']} rank(s): "
                     "set the number of ranks with torchrun's --nproc-per-node/--nnodes instead")
    world_size = int(os.environ["WORLD_SIZE"]) if TORCHRUN else (args.ranks or default_ranks())
    for name in ("steps", "batch_size", "seq_len", "dim", "layers", "heads", "log_every", "val_every", "val_batches"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if world_size < 1:
        parser.error("--ranks must be at least 1")
    if args.batch_size % world_size:
        parser.error(f"--batch-size {args.batch_size} must be a multiple of the {world_size} ranks "
                     "(each rank takes an equal slice of the global batch)")
    if args.dim % args.heads:
        parser.error(f"--dim {args.dim} must be a multiple of --heads {args.heads}")
    if args.lr <= 0 or args.clip < 0 or args.tolerance_factor <= 0 or args.warmup < 0 or args.lr_warmup < 0:
        parser.error("--lr and --tolerance-factor must be positive, --clip, --warmup and --lr-warmup not negative")
    args.world_size = world_size
    if args.bmuf:
        bmuf_mode.check_arguments(parser, args)
    resume.check_arguments(parser, args)
    lowprec_mode.check_arguments(parser, args)
    return args


class Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    pass


def default_ranks() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 2


# ----------------------------------------------------------------------------------------- training


@dataclass
class Side:
    """One of the trained models, its optimizer and what was measured on it."""

    name: str
    model: nn.Module  # the bare model (for DDP: the wrapped module)
    forward: nn.Module  # what the step calls (for DDP: the wrapper)
    opt: torch.optim.Optimizer
    times: list[float] = field(default_factory=list)
    loss_sum: torch.Tensor | None = None  # this rank's train losses since the last print
    nudge: Nudge | None = None  # the control's comm hook state

    def train_step(self, tokens: torch.Tensor, args: argparse.Namespace, device: torch.device) -> None:
        start = time.perf_counter()
        self.opt.zero_grad()
        loss = loss_of(self.forward, tokens)
        loss.backward()
        if args.clip:
            if isinstance(self.opt, DistributedFusedAdam):
                self.opt.clip_grad_norm(args.clip)
            else:
                nn.utils.clip_grad_norm_(self.model.parameters(), args.clip)
        self.opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        self.times.append(time.perf_counter() - start)
        detached = loss.detach().double()
        self.loss_sum = detached if self.loss_sum is None else self.loss_sum + detached


def loss_of(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warm-up to --lr, then cosine decay to lr/10 at the last step (step counts from 1)."""
    if step <= args.lr_warmup:
        return args.lr * step / args.lr_warmup
    progress = (step - args.lr_warmup) / max(1, args.steps - args.lr_warmup)
    return args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


@dataclass
class Nudge:
    """The control's DDP comm hook state: a seed, each param's position, and the step being taken."""

    seed: int
    position: dict[nn.Parameter, int]
    step: int = 0


def nudge_hook(state: Nudge, bucket):  # no annotations: DDP checks them, and they are strings here
    """A DDP comm hook: all-reduce (average) as DDP does, then move every gradient element one ulp
    up or down at random (the same on every rank): another rounding of the same sum. A param's draws
    come from (seed, step, param), not from DDP's buckets, whose layout a resumed run builds anew:
    so a resumed control nudges as the uninterrupted one did."""
    grads = bucket.buffer()
    up = torch.empty(grads.shape, dtype=torch.bool)
    for p, g in zip(bucket.parameters(), bucket.gradients()):
        seed = (state.seed * 1_000_003 + state.step) * 1_000_003 + state.position[p]
        gen = torch.Generator().manual_seed(seed % 2**63)
        start = (g.data_ptr() - grads.data_ptr()) // grads.element_size()
        up[start : start + g.numel()] = torch.rand(g.numel(), generator=gen) < 0.5

    def nudge(fut):
        reduced = fut.value()[0]
        toward = torch.where(up, math.inf, -math.inf).to(device=reduced.device, dtype=reduced.dtype)
        return reduced.copy_(torch.nextafter(reduced, toward))

    grads.div_(dist.get_world_size())
    return dist.all_reduce(grads, async_op=True).get_future().then(nudge)


def build(args: argparse.Namespace, vocab: int, device: torch.device) -> tuple[Side, Side, Side]:
    def fresh() -> TinyGPT:
        torch.manual_seed(args.seed)
        return TinyGPT(vocab=vocab, dim=args.dim, heads=args.heads, layers=args.layers, seq=args.seq_len).to(device)

    model = fresh()
    opt = DistributedFusedAdam(model.parameters(), lr=args.lr, weight_decay=args.weight_decay,
                               bucket_cap_mb=args.bucket_cap_mb, overlap_grad_sync=args.overlap_grad_sync,
                               overlap_param_sync=args.overlap_param_sync, offload_optimizer=args.offload,
                               **lowprec_mode.optimizer_options(args))  # low-precision state (if asked)
    # The bucket layout now (reverse param order, as backward delivers most grads), not at the first
    # backward: a resumed run builds it when it loads, in this order, and sums the grad norm alike.
    opt.init_params()
    sides = [Side("distopt", model, model, opt)]
    for name in ("DDP", "control"):
        ddp = DDP(fresh(), bucket_cap_mb=args.bucket_cap_mb)
        nudge = None
        if name == "control":
            nudge = Nudge(10_000 + args.seed, {p: i for i, p in enumerate(ddp.parameters())})
            ddp.register_comm_hook(nudge, nudge_hook)
        sides.append(Side(name, ddp.module, ddp, torch.optim.AdamW(ddp.parameters(), lr=args.lr,
                                                                    weight_decay=args.weight_decay), nudge=nudge))
    return tuple(sides)


@torch.no_grad()
def validate(side: Side, batches: list[torch.Tensor], device: torch.device) -> float:
    """Mean validation loss over every rank's slices of the validation batches."""
    if isinstance(side.opt, DistributedFusedAdam):
        side.opt.param_sync()
    side.model.eval()
    total = torch.zeros((), dtype=torch.float64, device=device)
    for tokens in batches:
        total += loss_of(side.model, tokens).double()  # the bare model: no DDP collectives
    side.model.train()
    dist.all_reduce(total)
    return total.item() / (len(batches) * dist.get_world_size())


class Distance(NamedTuple):
    relative: float  # ||a - b|| / ||b|| over all params (the verdict's measure)
    max_abs: float  # max |a - b| over all elements


def param_distance(a: nn.Module, b: nn.Module, device: torch.device) -> Distance:
    """How far a's params are from b's; the largest over the ranks (which should all hold the same)."""
    pairs = [(x.detach().double(), y.detach().double()) for x, y in zip(a.parameters(), b.parameters())]
    diff_sq = sum((x - y).square().sum() for x, y in pairs)
    norm_sq = sum(y.square().sum() for _, y in pairs)
    worst = max((x - y).abs().max() for x, y in pairs)
    t = torch.stack([(diff_sq / norm_sq).sqrt(), worst]).to(device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return Distance(*t.tolist())


def train(rank: int, world_size: int, args: argparse.Namespace, device: torch.device) -> bool:
    corpus = load_corpus()
    distopt_side, ddp_side, control = build(args, corpus.vocab_size, device)
    sides = (distopt_side, ddp_side, control)
    shown = (distopt_side, ddp_side)
    val = [b.to(device) for b in val_batches(corpus.val, args.val_batches, args.batch_size, args.seq_len, rank,
                                             world_size)]
    out = Printer(rank == 0)
    header(out, args, corpus, distopt_side.model, world_size, device)
    done, saved_first, path = resume.resume(args, sides, rank)
    if path:
        out(f"resumed from {path}: steps {done + 1} to {args.steps} follow")
    first = Distance(*saved_first.tolist()) if done else None

    val_losses: dict[str, float] = {}
    last_print = done
    for step in range(done + 1, args.steps + 1):
        tokens = train_batch(corpus.train, step, args.batch_size, args.seq_len, rank, world_size, args.seed).to(device)
        for side in sides:
            for group in side.opt.param_groups:
                group["lr"] = lr_at(step, args)
            if side.nudge is not None:
                side.nudge.step = step
            side.train_step(tokens, args, device)
        if step == 1:
            distopt_side.opt.param_sync()
            first = param_distance(distopt_side.model, ddp_side.model, device)
        validating = step % args.val_every == 0 or step == args.steps
        if step == 1 or step % args.log_every == 0 or validating:
            losses = torch.stack([s.loss_sum for s in shown]) / (step - last_print)
            dist.all_reduce(losses)
            train_losses = (losses / world_size).tolist()
            for s in sides:
                s.loss_sum = None
            last_print = step
            if validating:
                val_losses = {s.name: validate(s, val, device) for s in shown}
            distopt_side.opt.param_sync()
            gaps = [param_distance(s.model, ddp_side.model, device).relative for s in (distopt_side, control)]
            out.row(step, train_losses, [val_losses[s.name] for s in shown] if validating else None, gaps)
        if args.checkpoint_dir and step % args.checkpoint_every == 0 and step < args.steps:
            out(f"checkpoint saved: {resume.save(args, sides, rank, step, torch.tensor(first, dtype=torch.float64))}")

    distopt_side.opt.param_sync()  # overlap_param_sync leaves the last all-gather to the next forward
    ours = param_distance(distopt_side.model, ddp_side.model, device)
    noise = param_distance(control.model, ddp_side.model, device)
    timing = [step_stats(s.times, args.warmup, device) for s in shown]
    memory = (distopt_memory(distopt_side.opt), adamw_memory(ddp_side.opt, ddp_side.model))
    tolerance = args.tolerance_factor * noise.relative
    passed = ours.relative <= tolerance
    digest = resume.params_digest([s.model for s in sides])
    footer(out, args, world_size, timing, memory, first, ours, noise, tolerance, passed, digest)
    if lowprec_mode.active(args):  # the state is rounded, not only the last bits: final losses are compared
        passed = lowprec_mode.verdict(out, args, val_losses)
    return passed


# ----------------------------------------------------------------------------------------- measuring


def step_stats(times: list[float], warmup: int, device: torch.device) -> dict[str, float]:
    """Per-step wall time of the slowest rank (the one everybody waits for), after warm-up."""
    t = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    kept = t.tolist()[min(warmup, len(times) - 1):]
    q = statistics.quantiles(kept, n=4, method="inclusive") if len(kept) > 1 else [kept[0]] * 3
    return dict(median=q[1], q1=q[0], q3=q[2], min=min(kept), max=max(kept), n=len(kept))


def distopt_memory(opt: DistributedFusedAdam) -> dict[str, int]:
    report = opt.memory_report()
    parts = {"moments": report["moments"], "grad shard": report["grad_shard"], "master": report["master"],
             "remainders": report["remainders"], "buffers": report["buffers"], "staging": report["staging"]}
    return {**{k: v for k, v in parts.items() if v}, "host": report["host"], "total": report["total"]}


def adamw_memory(opt: torch.optim.Optimizer, model: nn.Module) -> dict[str, int]:
    """DDP + AdamW's persistent per-rank memory beyond the model: its state plus the full gradients."""
    state = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if torch.is_tensor(t))
    grads = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"moments": state, "grads": grads, "total": state + grads}


# ----------------------------------------------------------------------------------------- printing


class Printer:
    def __init__(self, active: bool) -> None:
        self.active = active

    def __call__(self, line: str = "") -> None:
        if self.active:
            print(line, flush=True)

    def row(self, step: int, train: list[float], val: list[float] | None, gaps: list[float]) -> None:
        v = "".join(f"{x:11.4f}" for x in val) if val else f"{'':22}"
        self(f"{step:6d}  {train[0]:11.4f}{train[1]:11.4f}    {v}    {gaps[0]:11.1e}{gaps[1]:11.1e}")


def header(out: Printer, args: argparse.Namespace, corpus: Corpus, model: nn.Module, world_size: int,
           device: torch.device) -> None:
    n_params = sum(p.numel() for p in model.parameters())
    per_rank = args.batch_size // world_size
    sync = ", ".join(f"{'' if on else 'no '}{name}" for name, on in
                     (("overlap_grad_sync", args.overlap_grad_sync), ("overlap_param_sync", args.overlap_param_sync)))
    out(f"distopt DistributedFusedAdam vs DDP + torch.optim.AdamW: {world_size} {device.type} rank(s) over "
        f"{dist.get_backend()}, torch {torch.__version__}")
    out(f"data:  {corpus.describe()}")
    out(f"model: TinyGPT, {n_params / 1e6:.2f}M params ({args.layers} layers, width {args.dim}, {args.heads} heads); "
        f"global batch {args.batch_size} x {args.seq_len} tokens ({per_rank} sequences per rank)")
    out(f"optim: {args.steps} steps, lr {args.lr:g} ({args.lr_warmup} warm-up steps, cosine to {args.lr / 10:g}), "
        f"weight decay {args.weight_decay:g}, clip {args.clip:g}, buckets {args.bucket_cap_mb:g} MiB, {sync}")
    if lowprec_mode.active(args):
        out(lowprec_mode.describe(args) + " (DDP+AdamW: fp32)")
    out()
    out(f"{'':6}  {'train loss':>22}    {'validation loss':>22}    {'params vs DDP (rel. L2)':>22}")
    out(f"{'step':>6}  {'distopt':>11}{'DDP+AdamW':>11}    {'distopt':>11}{'DDP+AdamW':>11}    "
        f"{'distopt':>11}{'control':>11}")


def footer(out: Printer, args: argparse.Namespace, world_size: int, timing: list[dict], memory: tuple[dict, dict],
           first: Distance, ours: Distance, noise: Distance, tolerance: float,
           passed: bool, digest: str) -> None:
    tokens = args.batch_size * args.seq_len
    mib = 2.0**-20
    out()
    out(f"{'':34}{'distopt':>24}{'DDP+AdamW':>24}")
    n = timing[0]["n"]

    def span(lo: str, hi: str) -> str:
        return "".join(f"{f'{1e3 * t[lo]:.1f} - {1e3 * t[hi]:.1f}':>21} ms" for t in timing)

    out(f"{f'time per step, median ({n} steps)':34}" + "".join(f"{1e3 * t['median']:>21.1f} ms" for t in timing))
    out(f"{'  interquartile range':34}" + span("q1", "q3"))
    out(f"{'  min - max':34}" + span("min", "max"))
    out(f"{'tokens/s (median step)':34}" + "".join(f"{tokens / t['median']:>24,.0f}" for t in timing))
    out(f"{'optimizer memory per rank':34}" + "".join(f"{m['total'] * mib:>20.2f} MiB" for m in memory))
    for i, m in enumerate(memory):
        parts = " + ".join(f"{k} {v * mib:.2f}" for k, v in m.items() if k not in ("total", "host"))
        out(f"  {('distopt', 'DDP+AdamW')[i]}: {parts} MiB")
        if m.get("host"):
            out(f"  distopt (--offload): {m['host'] * mib:.2f} MiB of it in host memory, "
                f"{(m['total'] - m['host']) * mib:.2f} MiB on the device")
    out("  (persistent between steps, the same on every rank)")
    out(f"time per step: forward, backward, clip and step, on the slowest of the {world_size} rank(s) at each step")
    out()
    out(f"params after step {args.steps}, distopt vs DDP+AdamW: relative L2 difference {ours.relative:.1e}, "
        f"max |difference| {ours.max_abs:.1e} (after step 1: {first.relative:.1e}, {first.max_abs:.1e})")
    out(f"control, DDP+AdamW with its averaged gradients moved 1 ulp at random every step, vs DDP+AdamW: relative L2 "
        f"{noise.relative:.1e}, max {noise.max_abs:.1e}")
    out(f"params digest: {digest}")
    if lowprec_mode.active(args):
        return
    if passed:
        out(f"PASS: distopt's params agree with DDP+AdamW's: relative L2 difference {ours.relative:.1e} <= "
            f"{tolerance:.1e} = {args.tolerance_factor:g} x the control's (last-bit rounding as {args.steps} steps "
            "of this run amplify it)")
    else:
        out(f"FAIL: distopt's params differ from DDP+AdamW's: relative L2 difference {ours.relative:.1e} > "
            f"{tolerance:.1e} = {args.tolerance_factor:g} x the control's (last-bit rounding as {args.steps} steps "
            "of this run amplify it)")


# ----------------------------------------------------------------------------------------- processes


def rank_main(rank: int, world_size: int, args: argparse.Namespace, store_path: str) -> None:
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
    else:
        torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 2) // world_size))
    resume.init_process_group("nccl" if use_cuda else "gloo", rank, world_size, store_path, args.collective_timeout)
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    try:
        if args.bmuf:
            from bmuf_mode import train_bmuf

            passed = train_bmuf(rank, world_size, args, device)
        else:
            passed = train(rank, world_size, args, device)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    if not passed:
        sys.exit(1)


def main() -> None:
    args = parse_args()
    start = time.perf_counter()
    if TORCHRUN:
        rank_main(int(os.environ["RANK"]), args.world_size, args, "")
        return
    with tempfile.TemporaryDirectory() as tmp:
        try:
            mp.spawn(rank_main, args=(args.world_size, args, os.path.join(tmp, "store")), nprocs=args.world_size)
        except mp.ProcessExitedException as e:
            sys.exit(e.exit_code or 1)
    print(f"wall time {time.perf_counter() - start:.1f} s (from spawning the ranks to the end)", flush=True)


if __name__ == "__main__":
    main()
