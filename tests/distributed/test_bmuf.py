"""BMUF on 2-4 gloo ranks against a float64 reference of the algorithm written here in the paper's
notation (Chen & Huo 2016: W, the model after each block; Wg, the next block's starting model; Delta,
the block momentum), compared after every step; against DDP where they must agree; bit-exact resume;
negative controls showing that the comparison catches a wrong momentum, a skipped sync and fairseq's
variant of the Nesterov step. The errors for misuse are test_bmuf_errors.py's.

Gradients are set directly: g = slope * param + noise(rank, step), so a rank that steps from wrong
params gets other gradients and drifts visibly.
"""

from __future__ import annotations

import copy
import io
from dataclasses import dataclass, replace

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distopt import BMUF, FusedAdam

from harness import run_ranks

SHAPES = [(7, 5), (13,), (3, 5, 2, 3), (1,)]  # the 4-d one is made channels_last (dense, permuted strides)


@dataclass(frozen=True)
class Cfg:
    world: int = 2
    opt: str = "sgd"  # sgd (momentum + weight decay), adamw (torch, float64), fused (FusedAdam, fp32)
    sync_every: int = 3
    block_lr: float = 1.0
    block_momentum: float = 0.5
    nesterov: bool = True
    warmup_steps: int = 0
    average_sync: bool = False
    steps: int = 10
    slope: float = 0.5
    scaler: bool = False  # grads scaled by a GradScaler, scaler.step(bmuf)
    unscale_first: bool = False  # scaler.unscale_(bmuf) before scaler.step(bmuf), as frameworks do
    inf_at: tuple[int, int] | None = None  # (rank, step): that rank's grads hold an inf there
    bucket_cap_mb: float = 64.0
    # what the reference does differently (negative controls)
    ref_block_momentum: float | None = None
    ref_sync_every: int | None = None
    ref_fairseq_nesterov: bool = False

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32 if self.opt == "fused" else torch.float64


def make_params(cfg: Cfg, rank: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """The same values on every rank, unless a warm-up is to broadcast rank 0's (then rank-dependent)."""
    gen = torch.Generator().manual_seed(7 + (rank if cfg.warmup_steps else 0))
    params = [torch.randn(s, generator=gen, dtype=torch.float64).to(dtype) for s in SHAPES]
    params[2] = params[2].contiguous(memory_format=torch.channels_last)
    return [p.requires_grad_() for p in params]


def local_optimizer(kind: str, params: list[torch.Tensor]) -> torch.optim.Optimizer:
    groups = [{"params": params[:2]}, {"params": params[2:], "lr": 0.02}]
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=0.05, momentum=0.9, weight_decay=0.01)
    if kind == "fused":
        return FusedAdam(groups, lr=0.01, weight_decay=0.01)
    return torch.optim.AdamW(groups, lr=0.01, weight_decay=0.01)


def grads_for(params: list[torch.Tensor], cfg: Cfg, rank: int, step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    out = [cfg.slope * p.detach().double() + torch.randn(p.shape, generator=gen, dtype=torch.float64) for p in params]
    if cfg.inf_at == (rank, step):
        out[1][3] = float("inf")
    return out


def all_mean(tensors: list[torch.Tensor], world: int) -> list[torch.Tensor]:
    out = [t.clone() for t in tensors]
    for t in out:
        dist.all_reduce(t)
    return [t / world for t in out]


class Reference:
    """BMUF in float64, in the paper's notation, with its own float64 twin of the local optimizer."""

    def __init__(self, cfg: Cfg, rank: int, world: int) -> None:
        self.cfg, self.world, self.n = cfg, world, 0
        self.local = [p.detach().double().requires_grad_() for p in make_params(cfg, rank, torch.float64)]
        self.opt = local_optimizer("adamw" if cfg.opt == "fused" else cfg.opt, self.local)
        self.initial = copy.deepcopy(self.opt.state_dict()["state"])
        self.bm = cfg.block_momentum if cfg.ref_block_momentum is None else cfg.ref_block_momentum
        self.k = cfg.sync_every if cfg.ref_sync_every is None else cfg.ref_sync_every
        self._restart()

    def _restart(self) -> None:
        self.W = [p.detach().clone() for p in self.local]  # W(t)
        self.Wg = [p.detach().clone() for p in self.local]  # W_g(t): where the next block starts
        self.delta = [torch.zeros_like(p) for p in self.W]  # Delta(t)

    def _average_state(self) -> None:
        for st in self.opt.state.values():
            for key in sorted(st):
                if key != "step" and torch.is_tensor(st[key]) and st[key].dim() > 0:
                    st[key].copy_(all_mean([st[key]], self.world)[0])

    @torch.no_grad()
    def step(self, grads: list[torch.Tensor], skip: bool) -> None:
        cfg = self.cfg
        for p, g in zip(self.local, grads):
            p.grad = g.clone()
        if not skip:
            with torch.enable_grad():
                self.opt.step()
        self.n += 1
        if self.n == cfg.warmup_steps:
            for p in self.local:
                dist.broadcast(p, 0)
            if cfg.average_sync:
                self._average_state()
            else:
                groups = self.opt.state_dict()["param_groups"]
                self.opt.load_state_dict({"state": copy.deepcopy(self.initial), "param_groups": groups})
            self._restart()
        elif self.n > cfg.warmup_steps and self.n % self.k == 0:
            mean = all_mean([p.detach() for p in self.local], self.world)
            for i, p in enumerate(self.local):
                G = mean[i] - self.Wg[i]  # the block's (ascent-signed) update
                previous = self.delta[i]
                self.delta[i] = self.bm * previous + cfg.block_lr * G
                if cfg.ref_fairseq_nesterov:  # fairseq's use_nbm: the look-ahead is never taken back
                    self.W[i] = self.Wg[i] + self.delta[i]
                else:
                    self.W[i] = self.W[i] + self.delta[i]
                self.Wg[i] = self.W[i] + self.bm * self.delta[i] if cfg.nesterov else self.W[i].clone()
                p.copy_(self.Wg[i])
            if cfg.average_sync:
                self._average_state()


def make_bmuf(cfg: Cfg, params: list[torch.Tensor]) -> BMUF:
    names = ("sync_every", "block_lr", "block_momentum", "nesterov", "warmup_steps", "average_sync", "bucket_cap_mb")
    return BMUF(local_optimizer(cfg.opt, params), **{k: getattr(cfg, k) for k in names})


def run_against_reference(rank: int, world: int, cfg: Cfg) -> dict:
    """Trains BMUF and the reference side by side; returns the largest relative error per step."""
    params = make_params(cfg, rank, cfg.dtype)
    bmuf = make_bmuf(cfg, params)
    ref = Reference(cfg, rank, world)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=3) if cfg.scaler else None
    errors = []
    for step in range(1, cfg.steps + 1):
        grads = grads_for(params, cfg, rank, step)
        if scaler:
            scaler.scale(torch.ones(()))  # as scaler.scale(loss) would: the scaler starts lazily
        for p, g in zip(params, grads):
            p.grad = (g * (scaler.get_scale() if scaler else 1.0)).to(p.dtype)
        if scaler:
            if cfg.unscale_first:
                scaler.unscale_(bmuf)
            scaler.step(bmuf)
            scaler.update()
        else:
            bmuf.step()
        ref.step(grads_for(ref.local, cfg, rank, step), skip=cfg.inf_at == (rank, step))
        errors.append(max(((p.double() - r).abs().max() / r.abs().max()).item() for p, r in zip(params, ref.local)))
    state = bmuf.state_dict()["bmuf"]
    return dict(
        errors=errors,
        params=[p.detach().clone() for p in params],
        comm=dict(bmuf.comm_bytes),
        glob=[g.clone() for g in state["global"]],
        wg=ref.Wg,
        momentum=None if state["momentum"] is None else [m.clone() for m in state["momentum"]],
        delta=ref.delta,
        steps=bmuf.step_count,
    )


def tolerance(cfg: Cfg) -> float:
    return 1e-13 if cfg.dtype == torch.float64 else 1e-5


CASES = {
    "sgd-nesterov-2": Cfg(),
    "sgd-classical-warmup-3": Cfg(
        world=3, sync_every=2, block_momentum=0.6, block_lr=0.8, nesterov=False, warmup_steps=3
    ),
    "adamw-average-sync-warmup-4": Cfg(
        world=4, opt="adamw", sync_every=4, block_momentum=0.75, warmup_steps=2, average_sync=True, steps=13
    ),
    "sgd-plain-average-2": Cfg(sync_every=2, block_momentum=0.0),
    "sgd-block-lr-no-momentum-2": Cfg(block_momentum=0.0, block_lr=0.5),
    "fused-average-sync-3": Cfg(world=3, opt="fused", sync_every=2, average_sync=True),
    "fused-scaler-inf-2": Cfg(opt="fused", scaler=True, inf_at=(1, 4), warmup_steps=2),
    "sgd-scaler-inf-2": Cfg(scaler=True, inf_at=(0, 5), average_sync=True),
    "fused-unscale-first-inf-2": Cfg(opt="fused", scaler=True, unscale_first=True, inf_at=(0, 3)),
    "sgd-unscale-first-inf-2": Cfg(scaler=True, unscale_first=True, inf_at=(1, 2)),
    "sgd-one-rank": Cfg(world=1, sync_every=2),
}


@pytest.mark.parametrize("name", CASES)
def test_matches_the_reference_after_every_step(name):
    cfg = CASES[name]
    results = run_ranks(run_against_reference, cfg.world, args=(cfg,))
    tol = tolerance(cfg)
    for rank, r in enumerate(results):
        assert max(r["errors"]) < tol, (rank, r["errors"])
        for g, wg in zip(r["glob"], r["wg"]):
            torch.testing.assert_close(g.double(), wg, rtol=tol, atol=tol)
        if cfg.block_momentum:  # our momentum is -Delta (a descent-signed buffer)
            for m, d in zip(r["momentum"], r["delta"]):
                torch.testing.assert_close(-m.double(), d, rtol=tol, atol=tol)
        assert r["steps"] == cfg.steps
    syncs = [s for s in range(1, cfg.steps + 1) if s > cfg.warmup_steps and s % cfg.sync_every == 0]
    if cfg.world > 1 and cfg.warmup_steps <= cfg.steps:
        # every rank holds the same params right after a sync; the run ends on one unless stated otherwise
        if cfg.steps in syncs:
            for r in results[1:]:
                assert all(torch.equal(a, b) for a, b in zip(r["params"], results[0]["params"]))
        assert results[0]["comm"]["all_reduce"] > 0
    else:
        assert results[0]["comm"] == {"all_reduce": 0, "broadcast": 0}


@pytest.mark.parametrize("control", ["wrong block momentum", "skipped sync", "fairseq nesterov"])
def test_negative_controls_are_caught(control):
    """The reference with one thing changed: the comparison must see it (errors far above tolerance)."""
    cfg = Cfg(sync_every=2, steps=8)
    change = {
        "wrong block momentum": dict(ref_block_momentum=0.55),
        "skipped sync": dict(ref_sync_every=4),
        "fairseq nesterov": dict(ref_fairseq_nesterov=True),
    }[control]
    results = run_ranks(run_against_reference, 2, args=(replace(cfg, **change),))
    assert max(results[0]["errors"]) > 1e3 * tolerance(cfg), results[0]["errors"]


def test_buckets_do_not_change_the_result_and_comm_is_counted():
    cfg = Cfg(sync_every=2, steps=6)
    whole = run_ranks(run_against_reference, 2, args=(cfg,))
    tiny = run_ranks(run_against_reference, 2, args=(replace(cfg, bucket_cap_mb=1e-4),))  # 104 bytes: 13 doubles
    for a, b in zip(whole, tiny):
        assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))
    param_bytes = sum(torch.Size(s).numel() for s in SHAPES) * 8
    assert whole[0]["comm"] == {"all_reduce": 3 * (param_bytes + 64), "broadcast": 0}  # 3 syncs + their checks


# ---------------------------------------------------------------------------- DDP equivalence


def train_against_ddp(rank: int, world: int, kind: str, sync_every: int) -> list[float]:
    def net() -> nn.Module:
        torch.manual_seed(3)
        return nn.Sequential(nn.Linear(6, 9), nn.Tanh(), nn.Linear(9, 3)).double()

    def opt(model: nn.Module) -> torch.optim.Optimizer:
        if kind == "adamw":
            return torch.optim.AdamW(model.parameters(), lr=0.01)
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)

    ours, ddp = net(), DDP(net())
    bmuf, ddp_opt = BMUF(opt(ours), sync_every=sync_every, block_momentum=0.0, block_lr=1.0), opt(ddp)
    errors = []
    for step in range(8):
        gen = torch.Generator().manual_seed(100 * step + rank)
        x, y = (
            torch.randn(5, 6, generator=gen, dtype=torch.float64),
            torch.randn(5, 3, generator=gen, dtype=torch.float64),
        )
        for model, o in ((ours, bmuf), (ddp, ddp_opt)):
            o.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            o.step()
        errors.append(
            max(
                ((a - b).abs().max() / b.abs().max()).item() for a, b in zip(ours.parameters(), ddp.module.parameters())
            )
        )
    return errors


def test_sync_every_step_without_block_momentum_is_ddp():
    for errors in run_ranks(train_against_ddp, 3, args=("sgd", 1)):
        assert max(errors) < 1e-13, errors


@pytest.mark.parametrize("kind, sync_every", [("sgd", 2), ("adamw", 1)])
def test_ddp_equivalence_control(kind, sync_every):
    """Syncing every other step, or a local optimizer that is not linear in the gradient (Adam), is not DDP."""
    errors = run_ranks(train_against_ddp, 2, args=(kind, sync_every))[0]
    assert max(errors) > 1e-6, errors


# ---------------------------------------------------------------------------- resume, masters, errors


def resume_run(rank: int, world: int, cfg: Cfg, save_at: int | None) -> dict:
    """cfg.steps steps with an LR scheduler and a GradScaler; with save_at, the run saves everything after
    that step (through torch.save), builds fresh objects from other params, loads and goes on."""

    def build(params):
        bmuf = make_bmuf(cfg, params)
        sched = torch.optim.lr_scheduler.LambdaLR(bmuf, lambda s: 1.0 / (1 + 0.1 * s))
        return bmuf, sched, torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2)

    params = make_params(cfg, rank, cfg.dtype)
    bmuf, sched, scaler = build(params)
    for step in range(1, cfg.steps + 1):
        scaler.scale(torch.ones(()))
        for p, g in zip(params, grads_for(params, cfg, rank, step)):
            p.grad = (g * scaler.get_scale()).to(p.dtype)
        scaler.step(bmuf)
        scaler.update()
        sched.step()
        if step == save_at:
            buffer = io.BytesIO()
            torch.save(
                {
                    "params": params,
                    "bmuf": bmuf.state_dict(),
                    "sched": sched.state_dict(),
                    "scaler": scaler.state_dict(),
                },
                buffer,
            )
            buffer.seek(0)
            saved = torch.load(buffer, weights_only=True)
            params = [torch.zeros_like(p).requires_grad_() for p in params]  # a fresh model...
            bmuf, sched, scaler = build(params)  # ...and optimizer, then everything loaded
            with torch.no_grad():
                for p, s in zip(params, saved["params"]):
                    p.copy_(s)
            bmuf.load_state_dict(saved["bmuf"])
            sched.load_state_dict(saved["sched"])
            scaler.load_state_dict(saved["scaler"])
    state = bmuf.state_dict()
    return dict(params=[p.detach().clone() for p in params], bmuf=copy.deepcopy(state), lr=bmuf.param_groups[1]["lr"])


RESUME = {
    "fused-warmup-reset": Cfg(opt="fused", sync_every=3, warmup_steps=4, inf_at=(1, 6), steps=11),
    "sgd-average-sync": Cfg(sync_every=3, nesterov=False, average_sync=True, steps=11),
}


@pytest.mark.parametrize("name, save_at", [(n, s) for n in RESUME for s in (2, 5, 6)])
def test_resume_is_bit_exact(name, save_at):
    """Saved before the warm-up's end (its reset state travels), mid-block and at a block boundary."""
    cfg = RESUME[name]
    straight = run_ranks(resume_run, 2, args=(cfg, None))
    resumed = run_ranks(resume_run, 2, args=(cfg, save_at))
    for a, b in zip(straight, resumed):
        assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))
        assert a["lr"] == b["lr"] < 0.02  # the scheduler drove the local optimizer's lr
        sa, sb = a["bmuf"], b["bmuf"]
        assert sa["bmuf"]["steps"] == sb["bmuf"]["steps"] == cfg.steps
        for key in ("global", "momentum"):
            assert all(torch.equal(x, y) for x, y in zip(sa["bmuf"][key] or [], sb["bmuf"][key] or []))
        for i, entry in sa["state"].items():
            assert all(torch.equal(v, sb["state"][i][k]) for k, v in entry.items())
    assert not all(torch.equal(x, y) for x, y in zip(straight[0]["params"], straight[1]["params"]))  # mid-block


def masters_run(rank: int, world: int) -> list[float]:
    """bf16 params with FusedAdam's fp32 masters against the float64 reference; the params must always be
    their masters rounded to bf16, and the masters track the reference at fp32 accuracy."""
    cfg = Cfg(opt="fused", sync_every=2, slope=0.0, steps=8)
    params = [p.to(torch.bfloat16).detach().requires_grad_() for p in make_params(cfg, rank, torch.float32)]
    inner = FusedAdam(
        [{"params": params[:2]}, {"params": params[2:], "lr": 0.02}], lr=0.01, weight_decay=0.01, master_weights=True
    )
    bmuf = BMUF(inner, sync_every=2, block_momentum=0.5)
    ref = Reference(cfg, rank, world)
    ref.local = [p.detach().to(torch.bfloat16).double().requires_grad_() for p in ref.local]  # start where we do
    ref.opt = local_optimizer("adamw", ref.local)
    ref._restart()
    errors = []
    for step in range(1, cfg.steps + 1):
        for p, g in zip(params, grads_for(params, cfg, rank, step)):
            p.grad = g.to(torch.bfloat16)
        bmuf.step()
        ref.step([g.to(torch.bfloat16).double() for g in grads_for(ref.local, cfg, rank, step)], skip=False)
        masters = [inner.state[p]["param"] for p in params]
        assert all(torch.equal(p, m.to(torch.bfloat16)) for p, m in zip(params, masters))
        errors.append(max(((m.double() - r).abs().max() / r.abs().max()).item() for m, r in zip(masters, ref.local)))
    assert all(g.dtype == torch.float32 for g in bmuf.state_dict()["bmuf"]["global"])
    return errors


def test_fp32_master_weights_are_what_bmuf_syncs():
    for errors in run_ranks(masters_run, 2):
        assert max(errors) < 1e-5, errors


@pytest.mark.cuda
def test_block_update_on_cuda_matches_the_cpu(nccl_group):
    """The _foreach block update and the master write-back on CUDA (fused multi-tensor kernels) against the
    same BMUF on the CPU, in one process (a group of one: no collectives, the same algorithm)."""
    results = {}
    for device in ("cpu", "cuda"):
        torch.manual_seed(0)
        # made on the CPU and moved: the CUDA generator would draw other numbers
        params = [torch.randn(s).to(device).requires_grad_() for s in [(257, 3), (1000,), (5,)]]
        inner = FusedAdam(params, lr=0.01)
        bmuf = BMUF(inner, sync_every=2, block_momentum=0.7, block_lr=0.9)
        for step in range(6):
            gen = torch.Generator().manual_seed(step)
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen).to(device)
            bmuf.step()
        results[device] = [p.detach().cpu() for p in params] + [g.cpu() for g in bmuf.state_dict()["bmuf"]["global"]]
    for a, b in zip(results["cpu"], results["cuda"]):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def subgroups_run(rank: int, world: int) -> list[torch.Tensor]:
    """Ranks {0, 1} and {2, 3} run two independent BMUFs: the warm-up broadcasts from each group's first
    rank (global ranks 0 and 2), and syncs average within the group only."""
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    cfg = Cfg(warmup_steps=1)
    params = make_params(cfg, rank, torch.float64)  # rank-dependent values
    bmuf = BMUF(local_optimizer("sgd", params), process_group=groups[rank // 2], sync_every=2, warmup_steps=1)
    for step in range(1, 5):
        for p, g in zip(params, grads_for(params, cfg, rank, step)):
            p.grad = g
        bmuf.step()
    assert bmuf.world_size == 2
    return [p.detach().clone() for p in params]


def test_process_group_subsets_sync_within_their_group():
    out = run_ranks(subgroups_run, 4)
    same = [all(torch.equal(a, b) for a, b in zip(out[i], out[j])) for i, j in ((0, 1), (2, 3), (0, 2))]
    assert same == [True, True, False]
