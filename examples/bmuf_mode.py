"""examples/train.py --bmuf: the same model, data and schedule trained with BMUF (each rank runs FusedAdam
on its own slice of every batch, no gradient all-reduce; every --sync-every steps the ranks average
their models through a block-momentum update, distopt.BMUF) next to DDP + torch.optim.AdamW.

Both sides count what they hand to all-reduce (payload bytes per rank, as the collective receives it;
a ring all-reduce sends about 2 (N-1)/N times that over each rank's link): DDP through a comm hook
around its gradient buckets, BMUF through ``bmuf.comm_bytes``. The footer prints the counts per step
next to the formulas (DDP: every gradient byte every step; BMUF: every param byte, plus a 64-byte
check, every --sync-every steps).

BMUF is another algorithm, so its params are not DDP's; the verdict compares where training got: PASS
if BMUF's final validation loss is within --bmuf-tolerance (relative) of DDP's. BMUF's validation
loss is each rank's model on its slice of the validation set; the run ends on a sync when --steps is a
multiple of --sync-every, and then every rank holds the same model.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

# examples/train.py's pieces (importing it runs nothing) and its data and model modules
from train import Printer, Side, lr_at, param_distance, step_stats, validate

from distopt import BMUF, FusedAdam

from data import load_corpus, train_batch, val_batches
from model import TinyGPT

CHECK_BYTES = 64  # BMUF's per-sync agreement check: 8 float64 numbers


def counting_hook(counter: list[int]):
    """A DDP comm hook doing what DDP's default does (average, then all-reduce) and counting the bytes."""

    def hook(state, bucket):  # no annotations: DDP checks them, and they are strings here
        grads = bucket.buffer()
        counter[0] += grads.numel() * grads.element_size()
        grads.div_(dist.get_world_size())
        return dist.all_reduce(grads, async_op=True).get_future().then(lambda fut: fut.value()[0])

    return hook


def build(args: argparse.Namespace, vocab: int, device: torch.device, ddp_bytes: list[int]) -> tuple[Side, Side]:
    def fresh() -> TinyGPT:
        torch.manual_seed(args.seed)
        return TinyGPT(vocab=vocab, dim=args.dim, heads=args.heads, layers=args.layers, seq=args.seq_len).to(device)

    model = fresh()
    local = FusedAdam(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    bmuf = BMUF(
        local,
        sync_every=args.sync_every,
        block_lr=args.block_lr,
        block_momentum=args.block_momentum,
        nesterov=True,
        warmup_steps=args.bmuf_warmup,
    )
    ddp = DDP(fresh(), bucket_cap_mb=args.bucket_cap_mb)
    ddp.register_comm_hook(None, counting_hook(ddp_bytes))
    adamw = torch.optim.AdamW(ddp.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    return Side("BMUF", model, model, bmuf), Side("DDP", ddp.module, ddp, adamw)


def train_bmuf(rank: int, world_size: int, args: argparse.Namespace, device: torch.device) -> bool:
    corpus = load_corpus()
    ddp_bytes = [0]
    ours, ref = build(args, corpus.vocab_size, device, ddp_bytes)
    val = [
        b.to(device) for b in val_batches(corpus.val, args.val_batches, args.batch_size, args.seq_len, rank, world_size)
    ]
    out = Printer(rank == 0)
    n_params = sum(p.numel() for p in ours.model.parameters())
    out(
        f"distopt BMUF(FusedAdam) vs DDP + torch.optim.AdamW: {world_size} {device.type} rank(s) over "
        f"{dist.get_backend()}, torch {torch.__version__}"
    )
    out(
        f"model: TinyGPT, {n_params / 1e6:.2f}M params; global batch {args.batch_size} x {args.seq_len} tokens; "
        f"{args.steps} steps, lr {args.lr:g}, clip {args.clip:g} (BMUF: each rank's own gradients)"
    )
    out(
        f"BMUF: sync every {args.sync_every} steps, block momentum {args.block_momentum:g} (Nesterov), block lr "
        f"{args.block_lr:g}, warm-up {args.bmuf_warmup} steps"
    )
    out()
    out(f"{'':6}  {'train loss':>22}    {'validation loss':>22}    {'BMUF params':>11}")
    out(f"{'step':>6}  {'BMUF':>11}{'DDP+AdamW':>11}    {'BMUF':>11}{'DDP+AdamW':>11}    {'vs DDP':>11}")

    last_print, val_losses = 0, {}
    for step in range(1, args.steps + 1):
        tokens = train_batch(corpus.train, step, args.batch_size, args.seq_len, rank, world_size, args.seed).to(device)
        for side in (ours, ref):
            for group in side.opt.param_groups:
                group["lr"] = lr_at(step, args)
            side.train_step(tokens, args, device)
        validating = step % args.val_every == 0 or step == args.steps
        if step == 1 or step % args.log_every == 0 or validating:
            losses = torch.stack([s.loss_sum for s in (ours, ref)]) / (step - last_print)
            dist.all_reduce(losses)
            train_losses = (losses / world_size).tolist()
            ours.loss_sum = ref.loss_sum = None
            last_print = step
            if validating:
                val_losses = {s.name: validate(s, val, device) for s in (ours, ref)}
            v = "".join(f"{val_losses[s.name]:11.4f}" for s in (ours, ref)) if validating else f"{'':22}"
            gap = param_distance(ours.model, ref.model, device).relative
            out(f"{step:6d}  {train_losses[0]:11.4f}{train_losses[1]:11.4f}    {v}    {gap:11.1e}")

    bmuf: BMUF = ours.opt
    counted = torch.tensor([sum(bmuf.comm_bytes.values()), ddp_bytes[0]], dtype=torch.float64, device=device)
    dist.all_reduce(counted, op=dist.ReduceOp.MAX)  # the same on every rank; the largest, to be safe
    syncs = sum(1 for s in range(1, args.steps + 1) if s > args.bmuf_warmup and s % args.sync_every == 0)
    param_bytes = sum(p.numel() * p.element_size() for p in ours.model.parameters())
    warmup = param_bytes + CHECK_BYTES if 0 < args.bmuf_warmup <= args.steps else 0  # the broadcast and its check
    formula = (syncs * (param_bytes + CHECK_BYTES) + warmup, args.steps * param_bytes)
    timing = [step_stats(s.times, args.warmup, device) for s in (ours, ref)]
    gap = (val_losses["BMUF"] - val_losses["DDP"]) / val_losses["DDP"]
    passed = abs(gap) <= args.bmuf_tolerance

    kib = 1 / 1024
    out()
    out(f"{'':40}{'BMUF':>20}{'DDP+AdamW':>20}")
    out(
        f"{'all-reduced per step and rank, counted':40}"
        + "".join(f"{c / args.steps * kib:>16.1f} KiB" for c in counted.tolist())
    )
    out(f"{'  formula':40}" + "".join(f"{f / args.steps * kib:>16.1f} KiB" for f in formula))
    out(f"{'  ratio DDP / BMUF':40}{counted[1].item() / max(counted[0].item(), 1):>20.1f}")
    n = timing[0]["n"]
    out(f"{f'time per step, median ({n} steps)':40}" + "".join(f"{1e3 * t['median']:>17.1f} ms" for t in timing))
    spans = [f"{1e3 * t['q1']:.1f} - {1e3 * t['q3']:.1f}" for t in timing]
    out(f"{'  interquartile range':40}" + "".join(f"{s:>17} ms" for s in spans))
    extra = bmuf.memory_report()["total"]
    out(f"BMUF's own memory per rank (global copy and block momentum): {extra / 2**20:.2f} MiB")
    out()
    verdict = (
        f"BMUF's final validation loss {val_losses['BMUF']:.4f} vs DDP+AdamW's {val_losses['DDP']:.4f}: "
        f"{100 * gap:+.1f}%, tolerance {100 * args.bmuf_tolerance:g}%"
    )
    out(("PASS: " if passed else "FAIL: ") + verdict)
    return passed


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("BMUF mode (--bmuf)")
    group.add_argument(
        "--bmuf",
        action="store_true",
        help="train with distopt.BMUF(FusedAdam) instead of DistributedFusedAdam, next to DDP",
    )
    group.add_argument("--sync-every", type=int, default=4, help="BMUF: steps between block syncs")
    group.add_argument(
        "--block-momentum",
        type=float,
        default=None,
        help="BMUF: block momentum (default: 1 - 1/ranks, Chen & Huo's rule)",
    )
    group.add_argument("--block-lr", type=float, default=1.0, help="BMUF: block learning rate")
    group.add_argument(
        "--bmuf-warmup",
        type=int,
        default=0,
        help="BMUF: local steps before rank 0's model is broadcast (0: none, the ranks start alike)",
    )
    group.add_argument(
        "--bmuf-tolerance",
        type=float,
        default=0.05,
        help="BMUF: pass if the final validation loss is within this fraction of DDP's",
    )


def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.block_momentum is None:
        args.block_momentum = 1.0 - 1.0 / args.world_size
    if args.sync_every < 1 or args.bmuf_warmup < 0 or not 0 <= args.block_momentum < 1 or args.block_lr <= 0:
        parser.error(
            "--sync-every must be at least 1, --bmuf-warmup not negative, --block-momentum in [0, 1) "
            "and --block-lr positive"
        )
    if args.bmuf_tolerance <= 0:
        parser.error("--bmuf-tolerance must be positive")
