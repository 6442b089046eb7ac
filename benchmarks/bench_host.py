"""Host overhead on the CPU: distopt's optimizers against torch's where Python and launch costs, not
memory bandwidth, decide the time (many small params), on one thread by default.

Rows (each a pair timed in one run, alternating A/B repetitions after a warm-up, so both see the
same machine load; the ratio is the median, with the 10th and 90th percentiles, of the ratios of
each repetition's back-to-back pair, distopt's time over torch's):
  fused_small   FusedAdam.step vs torch AdamW(fused=True).step, 10,000 params x 16 fp32 elements
  fused_medium  the same, 1,000 x 4,096
  dfa_ws1       DistributedFusedAdam at world size 1 (gloo, in this process) vs FusedAdam: a whole
                iteration (forward, backward, step, zero_grad), 1,000 x 4,096
  dfa_ws2       DistributedFusedAdam at world size 2 (gloo, forked ranks) vs DDP + AdamW(fused=True):
                backward + step, 10,000 x 16 (rank 0's times, both ranks starting each run together)
  fsdp2_fused   FusedAdam.step vs AdamW(fused=True).step on the same FSDP2 model (fully_shard, 2 forked
                gloo ranks): 1,000 params x 16 elements, 8 per rank; a backward before each step makes
                new DTensor grads, as in training (rank 0's step times)
  fsdp2_foreach the same run: FusedAdam vs AdamW(foreach=True)
  fsdp2_local   the same run: FusedAdam on the FSDP2 model vs FusedAdam on plain params of the local
                shards' sizes, given the same grads (what DTensor params cost on top of plain ones)
  fsdp2_kept    then FusedAdam vs AdamW(fused=True) with the grads kept from step to step, as the
                fused_* rows time it (FusedAdam's plan then skips checking new grads)
  loop_*        the loop users run (zero_grad(), forward, backward, step; the step timed), on a stack
                of nn.Linear(16, 16) (1,000 or 10,000 params of 256 and 16 elements): plain params and
                FSDP2 against AdamW(fused=True) and AdamW(foreach=True), zero_grad(set_to_none=False),
                and DistributedFusedAdam's step; see host_loop.py. The JSON's ``phases`` splits
                FusedAdam's step in loop_1k into the plan's checks (address checks, grads, identity
                checks), the kernel call and the rest.
After timing, each pair's params are compared (they took the same steps from the same start), so a
fast wrong answer cannot pass (host_rows.py: the pairs' timing, rows, table and plot). Writes
results_host.json and results_host.png to --out.

    python benchmarks/bench_host.py --out /tmp/host            # the full tables (minutes)
    python benchmarks/bench_host.py --out /tmp/host --quick    # a smoke run (seconds)
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from distopt import FusedAdam  # noqa: E402
from distopt.distributed import DistributedFusedAdam  # noqa: E402

import host_loop  # noqa: E402
from common import publish, run_metadata  # noqa: E402
from host_rows import COLUMNS, Case, Config, Row, alternate, format_row, make_row, max_diff, plot  # noqa: E402

LR, WEIGHT_DECAY = 1e-3, 1e-2


CASES = (
    Case("fused_small", "step", 10_000, 16, "FusedAdam", "AdamW(fused=True)", 0.5),
    Case("fused_medium", "step", 1_000, 4_096, "FusedAdam", "AdamW(fused=True)", 0.8),
    Case("dfa_ws1", "iteration", 1_000, 4_096, "DistributedFusedAdam ws1", "FusedAdam", 1.2),
    Case("dfa_ws2", "backward+step", 10_000, 16, "DistributedFusedAdam ws2", "DDP + AdamW(fused=True)", 1.1),
    Case("fsdp2_fused", "step", 1_000, 16, "FusedAdam FSDP2", "AdamW(fused=True) FSDP2", 0.15),
    Case("fsdp2_foreach", "step", 1_000, 16, "FusedAdam FSDP2", "AdamW(foreach=True) FSDP2", 0.15),
    Case("fsdp2_local", "step", 1_000, 16, "FusedAdam FSDP2", "FusedAdam local-size", 1.0),
    Case("fsdp2_kept", "step (kept)", 1_000, 16, "FusedAdam FSDP2", "AdamW(fused=True) FSDP2", 0.15),
    # The loop users run (host_loop.py): Linear(16, 16) layers, 136 elements per param on average.
    Case("loop_1k", "loop", 1_000, 136, "FusedAdam", "AdamW(fused=True)", 0.5),
    Case("loop_1k_foreach", "loop", 1_000, 136, "FusedAdam", "AdamW(foreach=True)", 0.5),
    Case("loop_1k_keep", "loop, kept grads", 1_000, 136, "FusedAdam", "AdamW(fused=True)", 0.4),
    Case("loop_10k", "loop", 10_000, 136, "FusedAdam", "AdamW(fused=True)", 0.5),
    Case("loop_10k_foreach", "loop", 10_000, 136, "FusedAdam", "AdamW(foreach=True)", 0.5),
    Case("loop_10k_keep", "loop, kept grads", 10_000, 136, "FusedAdam", "AdamW(fused=True)", 0.4),
    Case("loop_fsdp2_1k", "loop, FSDP2", 1_000, 136, "FusedAdam FSDP2", "AdamW(fused=True) FSDP2", 0.15),
    Case("loop_fsdp2_1k_foreach", "loop, FSDP2", 1_000, 136, "FusedAdam FSDP2", "AdamW(foreach=True) FSDP2", 0.15),
    Case("loop_fsdp2_1k_first", "FSDP2 1st step", 1_000, 136, "FusedAdam FSDP2", "AdamW(fused=True) FSDP2", 1.0),
    Case("loop_dfa_1k", "loop, ws2 step", 1_000, 136, "DistributedFusedAdam ws2", "DDP + AdamW(fused=True)", 1.0),
)
FSDP2_CASES = ("fsdp2_fused", "fsdp2_foreach", "fsdp2_local", "fsdp2_kept")  # one run times them all
LOOP_FSDP2_CASES = ("loop_fsdp2_1k", "loop_fsdp2_1k_foreach")  # likewise
TARGETS = {c.name: c.target for c in CASES}  # ratio <= target
CONFIGS = {
    "full": Config(warmup=5, reps=30, cases=CASES),
    "quick": Config(
        warmup=1, reps=3, cases=tuple(replace(c, count=c.count // 100) for c in CASES)
    ),
}


class ParamBag(nn.Module):
    """`count` params of `numel` elements; the loss reads each once (one stack), so backward hands
    every param its own gradient and the optimizers' per-param costs show."""

    def __init__(self, count: int, numel: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.params = nn.ParameterList(nn.Parameter(torch.randn(numel, generator=g)) for _ in range(count))
        self._list = list(self.params)  # iterating a ParameterList costs a lookup per param

    def forward(self, x: Tensor) -> Tensor:
        return (torch.stack(self._list) * x).square().mean()


def batch(case: Case, rank: int, index: int) -> Tensor:
    g = torch.Generator().manual_seed(1000 * rank + index)
    return torch.randn(case.count, case.numel, generator=g)


# ------------------------------------------------------------------------------------------- cases


def step_case(case: Case, cfg: Config) -> Row:
    """FusedAdam.step vs AdamW(fused=True).step on the same params and (fixed) grads."""
    models = {name: ParamBag(case.count, case.numel) for name in ("distopt", "torch")}
    grads = [torch.randn(case.numel, generator=torch.Generator().manual_seed(i)) for i in range(case.count)]
    for m in models.values():
        for p, g in zip(m.params, grads):
            p.grad = g.clone()
    opts = {
        "distopt": FusedAdam(models["distopt"].parameters(), lr=LR, weight_decay=WEIGHT_DECAY),
        "torch": torch.optim.AdamW(models["torch"].parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True),
    }
    times = alternate({name: opt.step for name, opt in opts.items()}, cfg.warmup, cfg.reps)
    return make_row(case, times, max_diff(models["distopt"].params, models["torch"].params), models["torch"].params)


def dfa_ws1_case(case: Case, cfg: Config) -> Row:
    """A whole iteration of DistributedFusedAdam on a one-rank gloo group vs FusedAdam."""
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "store"), 1), rank=0, world_size=1)
        try:
            models = {name: ParamBag(case.count, case.numel) for name in ("distopt", "torch")}
            opts = {
                "distopt": DistributedFusedAdam(models["distopt"].parameters(), lr=LR, weight_decay=WEIGHT_DECAY),
                "torch": FusedAdam(models["torch"].parameters(), lr=LR, weight_decay=WEIGHT_DECAY),
            }
            count = {"distopt": 0, "torch": 0}

            def iteration(name: str) -> Callable[[], None]:
                def run() -> None:
                    models[name](batch(case, 0, count[name] % 4)).backward()
                    opts[name].step()
                    opts[name].zero_grad()
                    count[name] += 1

                return run

            times = alternate({name: iteration(name) for name in models}, cfg.warmup, cfg.reps)
            diff = max_diff(models["distopt"].params, models["torch"].params)
        finally:
            dist.destroy_process_group()
    return make_row(case, times, diff, models["torch"].params)


def _ws2_rank(rank: int, world_size: int, case: Case, cfg: Config) -> tuple[dict[str, list[float]], float, list]:
    """One rank of dfa_ws2: backward + step of both contenders, every run started by a barrier."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    models = {name: ParamBag(case.count, case.numel) for name in ("distopt", "torch")}
    ddp = DDP(models["torch"])
    opts = {
        "distopt": DistributedFusedAdam(models["distopt"].parameters(), lr=LR, weight_decay=WEIGHT_DECAY),
        "torch": torch.optim.AdamW(models["torch"].parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True),
    }
    run_model = {"distopt": models["distopt"], "torch": ddp}
    count = {"distopt": 0, "torch": 0}

    def iteration(name: str) -> Callable[[], float]:
        def run() -> float:
            loss = run_model[name](batch(case, rank, count[name] % 4))
            dist.barrier()
            start = time.perf_counter()
            loss.backward()
            opts[name].step()
            ms = (time.perf_counter() - start) * 1e3
            opts[name].zero_grad()
            count[name] += 1
            return ms

        return run

    times = alternate({name: iteration(name) for name in models}, cfg.warmup, cfg.reps)
    reference = [p.detach() for p in models["torch"].params]
    return times, max_diff(models["distopt"].params, models["torch"].params), reference


def dfa_ws2_case(case: Case, cfg: Config, timeout: float) -> Row:
    from distopt.testing import run_ranks

    times, diff, reference = run_ranks(_ws2_rank, 2, (case, cfg), timeout=timeout)[0]
    return make_row(case, times, diff, reference)


class ShardedBag(ParamBag):
    """ParamBag read through the module (FSDP2 swaps its params for DTensors and back)."""

    def forward(self, x: Tensor) -> Tensor:
        return (torch.stack(list(self.params)) * x).square().mean()


def _fsdp2_rank(rank: int, world_size: int, case: Case, cfg: Config) -> tuple[dict[str, list[float]], dict, list]:
    """One rank of the fsdp2 rows: FusedAdam, AdamW(fused) and AdamW(foreach), each on its own FSDP2 copy
    of the model, and FusedAdam on plain params that alias a fourth copy's local shards (given that
    copy's grads as new plain tensors, so it trains exactly as the first). Each run: a backward
    (untimed: new grads, as in training), then the step, timed, both ranks starting together."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    makers = {"distopt": lambda ps: FusedAdam(ps, lr=LR, weight_decay=WEIGHT_DECAY),
              "fused": lambda ps: torch.optim.AdamW(ps, lr=LR, weight_decay=WEIGHT_DECAY, fused=True),
              "foreach": lambda ps: torch.optim.AdamW(ps, lr=LR, weight_decay=WEIGHT_DECAY, foreach=True),
              "local": lambda ps: FusedAdam(ps, lr=LR, weight_decay=WEIGHT_DECAY)}
    models, opts = {}, {}
    with torch.no_grad():
        for name, make in makers.items():
            models[name] = ShardedBag(case.count, case.numel)
            fully_shard(models[name], mesh=mesh)
            params = list(models[name].parameters())
            opts[name] = make([nn.Parameter(p.to_local()) for p in params] if name == "local" else params)
    local = opts["local"].param_groups[0]["params"]  # views of models["local"]'s shards
    count = dict.fromkeys(opts, 0)

    def run(name: str) -> Callable[[], float]:
        def step() -> float:
            models[name](batch(case, rank, count[name] % 4)).backward()
            if name == "local":
                for p, q in zip(local, models[name].parameters()):
                    p.grad = q.grad.to_local().clone()
                models[name].zero_grad()
            dist.barrier()
            start = time.perf_counter()
            opts[name].step()
            ms = (time.perf_counter() - start) * 1e3
            opts[name].zero_grad()
            count[name] += 1
            return ms

        return step

    times = alternate({name: run(name) for name in opts}, cfg.warmup, cfg.reps)
    whole = {name: [p.full_tensor() for p in m.parameters()] for name, m in models.items()}
    diffs = {f"fsdp2_{name}": max_diff(whole["distopt"], whole[name]) for name in ("fused", "foreach", "local")}

    def kept(name: str) -> Callable[[], float]:
        def step() -> float:
            dist.barrier()
            start = time.perf_counter()
            opts[name].step()
            return (time.perf_counter() - start) * 1e3

        return step

    for name in ("distopt", "fused"):  # one backward; every step then reuses its grads
        models[name](batch(case, rank, 0)).backward()
    times.update(("kept_" + k, v) for k, v in alternate({n: kept(n) for n in ("distopt", "fused")}, cfg.warmup,
                                                         cfg.reps).items())
    diffs["fsdp2_kept"] = max_diff(*([p.full_tensor() for p in models[n].parameters()] for n in ("distopt", "fused")))
    return times, diffs, whole["fused"]


def fsdp2_cases(cases: Sequence[Case], cfg: Config, timeout: float) -> list[Row]:
    """The fsdp2 rows (those in `cases`) from one run on 2 forked ranks; times are rank 0's."""
    from distopt.testing import run_ranks

    times, diffs, reference = run_ranks(_fsdp2_rank, 2, (cases[0], cfg), timeout=timeout)[0]
    pairs = {"fsdp2_fused": ("distopt", "fused"), "fsdp2_foreach": ("distopt", "foreach"),
             "fsdp2_local": ("distopt", "local"), "fsdp2_kept": ("kept_distopt", "kept_fused")}
    return [make_row(c, {"distopt": times[pairs[c.name][0]], "torch": times[pairs[c.name][1]]}, diffs[c.name],
                     reference) for c in cases]


def loop_case(case: Case, cfg: Config) -> Row:
    """A loop_* row of plain params (host_loop.py)."""
    peer = "foreach" if case.name.endswith("_foreach") else "fused"
    times, (ours, theirs) = host_loop.plain_loop(case.count, peer, not case.name.endswith("_keep"), alternate,
                                                 cfg.warmup, cfg.reps)
    return make_row(case, times, max_diff(ours, theirs), theirs)


def loop_fsdp2_cases(cases: Sequence[Case], cfg: Config, timeout: float) -> list[Row]:
    """The loop_fsdp2 rows (those in `cases`) from one run on 2 forked ranks; times are rank 0's."""
    from distopt.testing import run_ranks

    times, whole = run_ranks(host_loop.fsdp2_rank, 2, (cases[0].count, cfg.warmup, cfg.reps, alternate),
                             timeout=timeout)[0]
    rows = []
    for c in cases:
        peer = "foreach" if c.name.endswith("_foreach") else "fused"
        rows.append(make_row(c, {"distopt": times["distopt"], "torch": times[peer]},
                             max_diff(whole["distopt"], whole[peer]), whole[peer]))
    return rows


def loop_fsdp2_first_case(case: Case, cfg: Config, timeout: float) -> Row:
    """loop_fsdp2_1k_first: first steps on new FSDP2 models (host_loop.py), a few repetitions, each in
    new processes (each repetition pays a model's construction and torch's first-time dispatch)."""
    from distopt.testing import run_ranks

    times: dict[str, list[float]] = {"distopt": [], "torch": []}
    diff = 0.0
    for rep in range(min(cfg.reps, 4)):
        got, (ours, theirs) = run_ranks(host_loop.fsdp2_first_rank, 2, (case.count, rep % 2 == 1),
                                        timeout=timeout)[0]
        for name in times:
            times[name] += got[name]
        diff = max(diff, max_diff(ours, theirs))  # every repetition's pair took the same step
    return make_row(case, times, diff, theirs)


def loop_dfa_case(case: Case, cfg: Config, timeout: float) -> Row:
    from distopt.testing import run_ranks

    times, (ours, theirs) = run_ranks(host_loop.dfa_rank, 2, (case.count, cfg.warmup, cfg.reps, alternate),
                                      timeout=timeout)[0]
    return make_row(case, times, max_diff(ours, theirs), theirs)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for results_host.json and .png")
    parser.add_argument("--quick", action="store_true", help="100x fewer params, a few runs (smoke test)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1; forked ranks use 1)")
    parser.add_argument("--cases", nargs="*", default=None, help=f"a subset of {[c.name for c in CASES]}")
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions per contender")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before forked ranks count as hung")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = CONFIGS["quick" if args.quick else "full"]
    if args.reps is not None:
        cfg = Config(cfg.warmup, args.reps, cfg.cases)
    unknown = set(args.cases or ()) - {c.name for c in CASES}
    if unknown:
        print(f"unknown cases {sorted(unknown)}; choose from {[c.name for c in CASES]}")
        return 2
    torch.set_num_threads(args.threads)
    rows: list[Row] = []
    chosen = [case for case in cfg.cases if not args.cases or case.name in args.cases]
    for case in chosen:
        if case.name in FSDP2_CASES:
            if case.name == next(c.name for c in chosen if c.name in FSDP2_CASES):
                rows += fsdp2_cases([c for c in chosen if c.name in FSDP2_CASES], cfg, args.timeout)
        elif case.name in LOOP_FSDP2_CASES:
            if case.name == next(c.name for c in chosen if c.name in LOOP_FSDP2_CASES):
                rows += loop_fsdp2_cases([c for c in chosen if c.name in LOOP_FSDP2_CASES], cfg, args.timeout)
        elif case.name == "loop_dfa_1k":
            rows.append(loop_dfa_case(case, cfg, args.timeout))
        elif case.name == "loop_fsdp2_1k_first":
            rows.append(loop_fsdp2_first_case(case, cfg, args.timeout))
        elif case.name.startswith("loop_"):
            rows.append(loop_case(case, cfg))
        elif case.name == "dfa_ws2":
            rows.append(dfa_ws2_case(case, cfg, args.timeout))
        elif case.name == "dfa_ws1":
            rows.append(dfa_ws1_case(case, cfg))
        else:
            rows.append(step_case(case, cfg))
    device = torch.device("cpu")
    loop_1k = next((c for c in chosen if c.name == "loop_1k"), None)
    meta = run_metadata(
        device,
        phases=host_loop.phases(loop_1k.count, cfg.warmup, cfg.reps) if loop_1k else None,
        threads=args.threads,
        warmup=cfg.warmup,
        reps=cfg.reps,
        quick=args.quick,
        timing="perf_counter; alternating A/B repetitions after warm-up; median, p10, p90",
        targets=TARGETS,
        met={r.case: r.ratio <= r.target for r in rows},
    )
    intro = (f"{meta['device_name']}, torch {meta['torch']}, {args.threads} thread(s), {meta['date']}, "
             f"{cfg.reps} alternating repetitions after {cfg.warmup} warm-up")
    stats = ", ".join(f"{r.case} {r.ratio:.2f}x" for r in rows)
    title = (
        f"host overhead (fp32, CPU, {args.threads} thread(s)): {stats}\n"
        f"{meta['device_name']}, torch {meta['torch']}, {meta['git_commit'] or 'no git'}"
    )
    publish(args.out, "results_host", meta, rows, intro, COLUMNS, format_row, plot, title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
