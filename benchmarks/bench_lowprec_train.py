"""The main job (examples/train.py: TinyGPT on the standard library's Python sources, its lr schedule,
clipping, batches and validation set) trained with each optimizer-state format, over several seeds:
final validation loss with its spread, optimizer state bytes and time per step.

    python benchmarks/bench_lowprec_train.py --out DIR [--seeds 0 1 2] [--steps 120] [--threads 1]

One process (world size 1: every step's global batch, as the job's ranks take it together), FusedAdam
(the formats DistributedFusedAdam shares: distopt/lowprec/formats.py; and bf16 weights without fp32
masters, rounded to nearest or stochastically) against torch.optim.AdamW and,
if installed, torchao's AdamW8bit (8-bit blockwise state, the same format as torch.uint8 here; its
update is compiled with torch.compile, also on the CPU). Each contender starts from the same init and
sees the same batches. Time per step is forward, backward, clip and step (median after --warmup steps);
with distopt's reference fallback (no compiled _C: ``kernels`` in the JSON says which ran) it times
the float64 pure-PyTorch ops, not the kernels, and says so. Writes DIR/lowprec_train.json (every run)
and prints a table of means and standard deviations over the seeds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from distopt import FusedAdam  # noqa: E402

import common  # noqa: E402
from data import load_corpus, train_batch, val_batches  # noqa: E402
from model import TinyGPT  # noqa: E402

BF16, U8, F32 = torch.bfloat16, torch.uint8, torch.float32
CONTENDERS = {
    "AdamW (torch, fp32 state)": None,
    "FusedAdam fp32/fp32": (F32, F32, False, F32),
    "FusedAdam bf16/bf16": (BF16, BF16, False, F32),
    "FusedAdam bf16/bf16 +SR": (BF16, BF16, True, F32),
    "FusedAdam 8-bit/bf16": (U8, BF16, False, F32),
    "FusedAdam 8-bit/8-bit": (U8, U8, False, F32),
    # bf16 weights without fp32 masters (fp32 moments): rounded to nearest, and stochastically
    "FusedAdam bf16 weights": (F32, F32, False, BF16),
    "FusedAdam bf16 weights +SR": (F32, F32, True, BF16),
    "torchao AdamW8bit": "torchao",
}


def make_optimizer(name: str, params, args: argparse.Namespace) -> torch.optim.Optimizer | None:
    spec = CONTENDERS[name]
    if spec is None:
        return torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)
    if spec == "torchao":
        try:
            from torchao.optim import AdamW8bit
        except ImportError:
            print("torchao is not installed: its AdamW8bit is left out")
            return None
        return AdamW8bit(params, lr=args.lr, weight_decay=args.weight_decay)
    exp_avg, exp_avg_sq, rounding, _ = spec
    return FusedAdam(params, lr=args.lr, weight_decay=args.weight_decay, exp_avg_dtype=exp_avg,
                     exp_avg_sq_dtype=exp_avg_sq, stochastic_rounding=rounding)


def state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of the moments (8-bit: codes and scales; torchao's per-tensor 256-entry map not counted)."""
    if isinstance(opt, FusedAdam):
        return opt.memory_report()["moments"]
    total = 0
    for state in opt.state.values():
        for key in ("exp_avg", "exp_avg_sq"):
            t = state[key]
            parts = (t.codes, t.scale) if hasattr(t, "codes") else (t,)
            total += sum(x.numel() * x.element_size() for x in parts)
    return total


def lr_at(step: int, args: argparse.Namespace) -> float:
    """examples/train.py's schedule: linear warm-up, then cosine decay to lr/10."""
    import math

    if step <= args.lr_warmup:
        return args.lr * step / args.lr_warmup
    progress = (step - args.lr_warmup) / max(1, args.steps - args.lr_warmup)
    return args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def loss_of(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def run(name: str, seed: int, corpus, val: list[torch.Tensor], args: argparse.Namespace) -> dict | None:
    torch.manual_seed(seed)
    model = TinyGPT(vocab=corpus.vocab_size, dim=args.dim, heads=args.heads, layers=args.layers, seq=args.seq_len)
    spec = CONTENDERS[name]
    model = model.to(spec[3] if isinstance(spec, tuple) else F32)
    opt = make_optimizer(name, model.parameters(), args)
    if opt is None:
        return None
    times, losses = [], []
    for step in range(1, args.steps + 1):
        tokens = train_batch(corpus.train, step, args.batch_size, args.seq_len, 0, 1, seed)
        for group in opt.param_groups:  # (torchao keeps lr as a tensor, changed in place)
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(lr_at(step, args))
            else:
                group["lr"] = lr_at(step, args)
        start = time.perf_counter()
        opt.zero_grad()
        loss = loss_of(model, tokens)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    with torch.no_grad():
        val_loss = sum(loss_of(model, b).item() for b in val) / len(val)
    kept = times[args.warmup:]
    return {"contender": name, "seed": seed, "val_loss": val_loss, "train_loss_last10": sum(losses[-10:]) / 10,
            "state_bytes": state_bytes(opt), "params": sum(p.numel() for p in model.parameters()),
            "step_ms_median": 1e3 * statistics.median(kept), "step_ms_min": 1e3 * min(kept)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--contenders", nargs="+", default=list(CONTENDERS), choices=list(CONTENDERS))
    # examples/train.py's defaults
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--lr-warmup", type=int, default=10)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--val-batches", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels = common.kernels_in_use(torch.device("cpu"), ["adam_step_"])
    corpus = load_corpus()
    val = val_batches(corpus.val, args.val_batches, args.batch_size, args.seq_len, 0, 1)
    rows = []
    for seed in args.seeds:
        for name in args.contenders:
            row = run(name, seed, corpus, val, args)
            if row is not None:
                rows.append(row)
                print(f"seed {seed}  {name:28s} val {row['val_loss']:.4f}  step {row['step_ms_median']:.1f} ms  "
                      f"state {row['state_bytes'] / row['params']:.3f} B/param", flush=True)
    meta = common.run_metadata(torch.device("cpu"), kernels=kernels, args={k: str(v) for k, v in vars(args).items()})
    args.out.mkdir(parents=True, exist_ok=True)
    common.write_json(args.out / "lowprec_train.json", meta, rows)
    print(f"\n{'contender':28s} {'val loss (mean +- std over seeds)':>34s} {'state B/param':>14s} {'step ms':>9s}")
    for name in args.contenders:
        mine = [r for r in rows if r["contender"] == name]
        if not mine:
            continue
        vals = [r["val_loss"] for r in mine]
        spread = statistics.stdev(vals) if len(vals) > 1 else 0.0
        print(f"{name:28s} {statistics.mean(vals):>26.4f} +- {spread:.4f} "
              f"{mine[0]['state_bytes'] / mine[0]['params']:>14.3f} "
              f"{statistics.median(r['step_ms_median'] for r in mine):>9.1f}")
    print(f"wrote {args.out / 'lowprec_train.json'}")


if __name__ == "__main__":
    main()
