"""bench_host's rows for the loop users run: ``zero_grad()``, forward, backward, ``step()``, timing the step.

torch's default ``zero_grad()`` sets the gradients to None, so backward makes new gradient tensors every
step; ``zero_grad(set_to_none=False)`` keeps them and zeroes them in place. The model is a stack of
``nn.Linear(16, 16)`` layers (two params each: a 256-element weight and a 16-element bias), as a user's
many-small-params model. Each contender trains its own copy from the same start on the same batches;
after timing, their params are compared (a fast wrong answer cannot pass).

Rows (``loop_<params>[_variant]``, each a pair timed in one run, alternating A/B):
  loop_1k, loop_10k                 FusedAdam vs AdamW(fused=True), zero_grad() (set_to_none=True)
  loop_1k_foreach, loop_10k_foreach FusedAdam vs AdamW(foreach=True), the same loop
  loop_1k_keep, loop_10k_keep       FusedAdam vs AdamW(fused=True), zero_grad(set_to_none=False)
  loop_fsdp2_1k, loop_fsdp2_1k_foreach
                                    FusedAdam vs AdamW(fused / foreach) on the same FSDP2 model
                                    (fully_shard, 2 forked gloo ranks, one thread each; rank 0's times)
  loop_fsdp2_1k_first               the first step of each on a new FSDP2 model (state made, the plan
                                    built; torch's DTensor dispatch plans its foreach ops the first time)
  loop_dfa_1k                       DistributedFusedAdam.step (its own buckets, the grads reduced by
                                    grad_sync() first) vs DDP + AdamW(fused=True).step, 2 forked ranks
``phases`` splits FusedAdam's step in loop_1k into the plan's checks (the packed moments' addresses, the
grads' collection, the identity checks), the kernel call and the rest (torch.optim's step wrapper, the
grad-scaler and lr bookkeeping).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from distopt import FusedAdam
from distopt.distributed import DistributedFusedAdam

LR, WEIGHT_DECAY = 1e-3, 1e-2
WIDTH = 16
PEERS = {"fused": dict(fused=True), "foreach": dict(foreach=True)}


def linear_stack(params: int) -> nn.Sequential:
    """`params` // 2 layers of nn.Linear(16, 16), the same for every seed-0 call."""
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(params // 2)])


def batch(index: int, rank: int = 0) -> torch.Tensor:
    return torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(1000 * rank + index % 4))


def make_optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "distopt":
        return FusedAdam(params, lr=LR, weight_decay=WEIGHT_DECAY)
    return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, **PEERS[name])


def timed_step(model: nn.Module, opt: torch.optim.Optimizer, set_to_none: bool, rank: int = 0,
               barrier: bool = False) -> Callable[[], float]:
    """One iteration of the loop; returns the step's milliseconds."""
    count = [0]

    def run() -> float:
        opt.zero_grad(set_to_none=set_to_none)
        model(batch(count[0], rank)).square().mean().backward()
        count[0] += 1
        if barrier:
            dist.barrier()
        start = time.perf_counter()
        opt.step()
        return (time.perf_counter() - start) * 1e3

    return run


def plain_loop(params: int, peer: str, set_to_none: bool, alternate, warmup: int, reps: int):
    """(times by contender, the two models' params) of FusedAdam against a torch AdamW in the loop."""
    models = {name: linear_stack(params) for name in ("distopt", peer)}
    fns = {name: timed_step(m, make_optimizer(name, m.parameters()), set_to_none) for name, m in models.items()}
    times = alternate(fns, warmup, reps)
    return {"distopt": times["distopt"], "torch": times[peer]}, [list(m.parameters()) for m in models.values()]


def phases(params: int, warmup: int, reps: int) -> dict[str, float]:
    """Median milliseconds of FusedAdam's step in the loop (set_to_none=True) by phase: ``plan`` (the
    step plan's checks and the grads' collection), itself split into ``plan_addresses`` (the packed
    moments' address checks), ``plan_grads`` (reading the ``.grad`` of every param) and ``plan_identity``
    (the rest: the identity checks of the params, the state and the step counts); ``kernel`` (the fused
    op, with its own checks of every list); ``rest`` (the remainder of step(): torch.optim's wrapper, the
    grad scaler's and lr's handling)."""
    import statistics

    import distopt.fused_adam.optimizer as fused_adam
    from distopt.fused_adam import plan

    model = linear_stack(params)
    opt = FusedAdam(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    spent: dict[str, float] = {}

    def timed(name: str, fn: Callable) -> Callable:
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] = spent.get(name, 0.0) + (time.perf_counter() - start) * 1e3

        return wrapper

    opt._planned_calls = timed("plan", opt._planned_calls)
    op, addresses, grads = fused_adam.ops.adam_step_, plan.Call.addresses, plan.Call.grads
    fused_adam.ops.adam_step_ = timed("kernel", op)
    plan.Call.addresses = timed("plan_addresses", addresses)
    plan.Call.grads = timed("plan_grads", grads)
    try:
        step = timed_step(model, opt, set_to_none=True)
        names = ("plan", "plan_addresses", "plan_grads", "kernel")
        samples: dict[str, list[float]] = {name: [] for name in (*names, "plan_identity", "rest", "step")}
        for i in range(warmup + reps):
            spent.clear()
            total = step()
            if i >= warmup:
                got = {name: spent.get(name, 0.0) for name in names}
                for name in names:
                    samples[name].append(got[name])
                samples["plan_identity"].append(got["plan"] - got["plan_addresses"] - got["plan_grads"])
                samples["rest"].append(total - got["plan"] - got["kernel"])
                samples["step"].append(total)
    finally:
        fused_adam.ops.adam_step_, plan.Call.addresses, plan.Call.grads = op, addresses, grads
    return {name: statistics.median(v) for name, v in samples.items()}


def fsdp2_rank(rank: int, world_size: int, params: int, warmup: int, reps: int, alternate):
    """One rank of the loop_fsdp2 rows: FusedAdam, AdamW(fused) and AdamW(foreach), each on its own
    FSDP2 copy (fully_shard of the whole stack), the step timed after a barrier."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    fns, models = {}, {}
    for name in ("distopt", "fused", "foreach"):
        models[name] = linear_stack(params)
        fully_shard(models[name], mesh=mesh)
        fns[name] = timed_step(models[name], make_optimizer(name, models[name].parameters()), True, rank, True)
    times = alternate(fns, warmup, reps)
    whole = {name: [p.full_tensor() for p in m.parameters()] for name, m in models.items()}
    return times, whole


def fsdp2_first_rank(rank: int, world_size: int, params: int, torch_first: bool):
    """One rank of a loop_fsdp2_1k_first repetition, in new processes (torch's DTensor dispatch caches
    how it shards an op once per process): the first step of FusedAdam and of AdamW(fused=True), each on
    a new FSDP2 model (a backward first, the step timed after a barrier). Returns (times by contender,
    both models' params)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    times: dict[str, list[float]] = {}
    models = {}
    for name in ("torch", "distopt") if torch_first else ("distopt", "torch"):
        models[name] = linear_stack(params)
        fully_shard(models[name], mesh=mesh)
        opt = make_optimizer("distopt" if name == "distopt" else "fused", models[name].parameters())
        times[name] = [timed_step(models[name], opt, True, rank, True)()]
    return times, [[p.full_tensor() for p in models[name].parameters()] for name in ("distopt", "torch")]


def dfa_rank(rank: int, world_size: int, params: int, warmup: int, reps: int, alternate):
    """One rank of loop_dfa_1k: DistributedFusedAdam against DDP + AdamW(fused=True); the reduction is
    finished before the clock starts (grad_sync(); DDP's happens in backward)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    models = {"distopt": linear_stack(params), "torch": linear_stack(params)}
    run_models = {"distopt": models["distopt"], "torch": DDP(models["torch"])}
    opts = {"distopt": DistributedFusedAdam(models["distopt"].parameters(), lr=LR, weight_decay=WEIGHT_DECAY),
            "torch": make_optimizer("fused", models["torch"].parameters())}
    count = {name: 0 for name in models}

    def iteration(name: str) -> Callable[[], float]:
        def run() -> float:
            opts[name].zero_grad()
            run_models[name](batch(count[name], rank)).square().mean().backward()
            count[name] += 1
            if name == "distopt":
                opts[name].grad_sync()
            dist.barrier()
            start = time.perf_counter()
            opts[name].step()
            return (time.perf_counter() - start) * 1e3

        return run

    times = alternate({name: iteration(name) for name in models}, warmup, reps)
    return times, [list(m.parameters()) for m in models.values()]
