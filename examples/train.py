"""distopt's main job: data-parallel training of a small GPT with DistributedFusedAdam (ZeRO-2).

    python examples/train.py [--steps 60] [--ranks N]

Without a GPU it starts 2 CPU ranks over gloo; with GPUs, one rank per GPU over NCCL (under torchrun
it uses torchrun's ranks instead). Every rank trains on its own batches of generated sequences and
prints nothing; rank 0 reports loss, step time and this rank's optimizer memory per step. Alongside,
the same model is trained with DDP + torch.optim.AdamW on the same batches, and the run ends with the
largest parameter difference between the two.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distopt import DistributedFusedAdam

from model import TinyGPT, make_batch  # examples/model.py (the script's directory is on sys.path)

VOCAB = 64


def loss_of(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def adamw_bytes(opt: torch.optim.Optimizer, model: nn.Module) -> int:
    """DDP + AdamW's persistent per-rank memory beyond the model: moments plus full gradients."""
    state = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if torch.is_tensor(t))
    return state + sum(p.numel() * p.element_size() for p in model.parameters())


def train(rank: int, world_size: int, args: argparse.Namespace, device: torch.device) -> None:
    torch.manual_seed(0)
    model = TinyGPT(vocab=VOCAB, seq=args.seq).to(device)
    torch.manual_seed(0)
    ref = DDP(TinyGPT(vocab=VOCAB, seq=args.seq).to(device))
    opt = DistributedFusedAdam(model.parameters(), lr=args.lr, weight_decay=0.01, overlap_param_sync=True)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=args.lr, weight_decay=0.01)
    gen = torch.Generator().manual_seed(1000 + rank)  # each rank its own data
    n_params = sum(p.numel() for p in model.parameters())
    if rank == 0:
        print(f"TinyGPT ({n_params / 1e6:.2f}M params) on {world_size} {device.type} rank(s) over "
              f"{dist.get_backend()}, DistributedFusedAdam vs DDP + torch.optim.AdamW, {args.steps} steps", flush=True)
    for step in range(1, args.steps + 1):
        tokens = make_batch(gen, args.batch, args.seq, VOCAB).to(device)
        start = time.perf_counter()
        opt.zero_grad()
        loss = loss_of(model, tokens)
        loss.backward()
        step_start = time.perf_counter()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        end = time.perf_counter()

        ref_opt.zero_grad()
        loss_of(ref, tokens).backward()
        ref_opt.step()
        if step == 1:
            ref_bytes = adamw_bytes(ref_opt, ref.module)
            opt.param_sync()
            first_diff = max_param_diff(model, ref.module, device)

        if rank == 0 and (step == 1 or step % args.log_every == 0 or step == args.steps):
            mem = opt.memory_report()
            print(f"step {step:4d}  loss {loss.item():.4f}  iteration {1e3 * (end - start):7.1f} ms"
                  f"  (step {1e3 * (end - step_start):6.1f} ms)  optimizer state + grads {mem['total'] / 2**20:.2f}"
                  f" MiB/rank (DDP + AdamW: {ref_bytes / 2**20:.2f})", flush=True)

    opt.param_sync()  # overlap_param_sync leaves the last all-gather to the next forward
    diff = max_param_diff(model, ref.module, device)
    scale = max(p.abs().max().item() for p in ref.module.parameters())
    if rank == 0:
        print(f"max |param difference| vs DDP + torch.optim.AdamW over all ranks: {first_diff:.1e} after step 1, "
              f"{diff:.1e} after step {args.steps} (largest |param| {scale:.2f}; Adam amplifies last-bit "
              "differences in weights whose gradients are near zero)", flush=True)


def max_param_diff(model: nn.Module, ref: nn.Module, device: torch.device) -> float:
    """Largest |difference| between the two models' params, over all ranks."""
    diff = max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))
    t = torch.tensor([diff], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def rank_main(rank: int, world_size: int, args: argparse.Namespace, store_path: str) -> None:
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // world_size))
    backend = "nccl" if use_cuda else "gloo"
    if store_path:
        dist.init_process_group(backend, store=dist.FileStore(store_path, world_size), rank=rank, world_size=world_size)
    else:  # launched by torchrun: ranks and rendezvous come from the environment
        dist.init_process_group(backend)
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    try:
        train(rank, world_size, args, device)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=16, help="sequences per rank")
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--ranks", type=int, default=0, help="default: 2 on CPU, one per GPU")
    args = parser.parse_args()

    if "RANK" in os.environ:
        rank_main(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args, "")
        return
    world_size = args.ranks or (torch.cuda.device_count() if torch.cuda.is_available() else 2)
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(rank_main, args=(world_size, args, os.path.join(tmp, "store")), nprocs=world_size)


if __name__ == "__main__":
    main()
