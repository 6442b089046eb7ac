"""distopt's main job: train a small GPT on generated data with FusedAdam, then check it against
torch.optim.AdamW trained on the same data from the same start.

    python examples/train.py [--steps 30] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from distopt import FusedAdam

from model import TinyGPT, make_batch


def optimizer_state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if torch.is_tensor(t))


def train(opt_name: str, args, log: bool) -> nn.Module:
    torch.manual_seed(0)
    model = TinyGPT(seq=args.seq).to(args.device)
    params = model.parameters()
    opt = (FusedAdam(params, lr=args.lr, weight_decay=0.01) if opt_name == "distopt"
           else torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01))
    gen = torch.Generator().manual_seed(1)
    for step in range(1, args.steps + 1):
        tokens = make_batch(gen, args.batch, args.seq, 64).to(args.device)
        start = time.perf_counter()
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if args.device == "cuda":
            torch.cuda.synchronize()
        if log and (step % args.log_every == 0 or step == 1):
            print(f"step {step:4d}  loss {loss.item():.4f}  step time {1e3 * (time.perf_counter() - start):7.2f} ms"
                  f"  optimizer state {optimizer_state_bytes(opt) / 2**20:.2f} MiB", flush=True)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()

    print(f"training TinyGPT with distopt.FusedAdam on {args.device} for {args.steps} steps")
    ours = train("distopt", args, log=True)
    print("same run with torch.optim.AdamW for comparison ...")
    ref = train("torch", args, log=False)
    diff = max((a - b).abs().max().item() for a, b in zip(ours.parameters(), ref.parameters()))
    print(f"max |param difference| vs torch.optim.AdamW after {args.steps} steps: {diff:.3e}")


if __name__ == "__main__":
    main()
