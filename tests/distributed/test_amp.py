"""Loss scaling and clipping: DistributedFusedAdam with the stock GradScaler against DDP + AdamW.

The reference is always the documented torch recipe on a DDP model:
    scaler.scale(loss).backward(); scaler.unscale_(opt); clip_grad_norm_(...); scaler.step(opt);
    scaler.update()
(without the unscale/clip lines, or without the scaler, where the pattern has none). Gradients are
poisoned with inf or nan on ONE rank at scripted steps (a hook on a weight's grad, in both models):
every rank must skip those steps, leave every byte of optimizer state as it was, and back off the
scale; the scaler grows the scale by 3 every other step (growth_interval=1) and backs off by 0.25.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distopt import DistributedFusedAdam

import tolerances
from harness import run_ranks

STEPS = 9
MAX_NORM = 0.3
POISON = {2: (float("inf"), 0), 5: (float("nan"), -1), 6: (float("-inf"), 0)}  # step -> (value, rank)


def make_model(dtype=torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 3)).to(dtype)


def groups(model: nn.Module) -> list[dict]:
    return [{"params": list(model[0].parameters()) + list(model[4].parameters()), "lr": 1e-2},
            {"params": list(model[2].parameters()), "lr": 3e-3, "weight_decay": 0.1}]


def make_scaler() -> torch.amp.GradScaler:
    return torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_factor=3.0, backoff_factor=0.25, growth_interval=1)


def poison_hook(rank: int, world_size: int, step_of: list[int]):
    """A grad hook that writes inf/nan into one element on the scripted (step, rank)."""
    def hook(grad: torch.Tensor) -> torch.Tensor:
        value, on_rank = POISON.get(step_of[0], (None, None))
        if value is None or on_rank % world_size != rank:
            return grad
        grad = grad.clone()
        grad.view(-1)[7 + step_of[0]] = value
        return grad
    return hook


@dataclass(frozen=True)
class Pattern:
    scaler: bool
    clip: bool
    ours: str  # "unscale_grads" (pattern 1), "step" (2), "stock_unscale" (3), "plain"
    init_params: bool = False  # layout built before the first backward: the first iteration's grads are never in .grad
    offload: bool = False  # DistributedFusedAdam(offload_optimizer=True) (tests/distributed/test_offload.py)


PATTERNS = {
    "1-unscale_grads-clip": Pattern(True, True, "unscale_grads"),
    "2-scaler_step_only": Pattern(True, False, "step"),
    "3-stock_unscale-clip": Pattern(True, True, "stock_unscale"),
    "3-stock_unscale-clip-init_params": Pattern(True, True, "stock_unscale", init_params=True),
    "clip_without_scaler": Pattern(False, True, "plain"),
    "no_scaler_no_clip": Pattern(False, False, "plain"),
}


def snapshot(opt: DistributedFusedAdam) -> list[torch.Tensor]:
    out = [opt._runtime.step_tensor.clone(), torch.tensor(opt._runtime.steps)]
    for b in opt._runtime.buckets:
        s = b.state
        out += [t.clone() for t in (s.exp_avg, s.exp_avg_sq, s.master, s.remainders) if t is not None]
    return out


def run(rank: int, world_size: int, pattern: Pattern) -> dict:
    step_of = [0]
    ref_model, model = make_model(), make_model()
    if pattern.scaler:  # without a scaler nothing skips a poisoned step: torch's params turn to nan too
        for m in (ref_model, model):
            m[2].weight.register_hook(poison_hook(rank, world_size, step_of))
    ref = DDP(ref_model)
    ref_opt = torch.optim.AdamW(groups(ref_model))
    opt = DistributedFusedAdam(groups(model), bucket_cap_mb=400 * 4 / 2**20, offload_optimizer=pattern.offload)
    if pattern.init_params:
        opt.init_params()
    ref_scaler, scaler = make_scaler(), make_scaler()
    report = {"skipped": [], "clipped": 0}
    for step in range(STEPS):
        step_of[0] = step
        gen = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(8, 10, generator=gen), torch.randn(8, 3, generator=gen)
        before = snapshot(opt)
        params_before = [p.detach().clone() for p in model.parameters()]

        ref_loss = nn.functional.mse_loss(ref(x), y)
        (ref_scaler.scale(ref_loss) if pattern.scaler else ref_loss).backward()
        ref_norm = None
        if pattern.scaler and pattern.clip:
            ref_scaler.unscale_(ref_opt)
        if pattern.clip:
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
        if pattern.scaler:
            ref_scaler.step(ref_opt)
            ref_scaler.update()
        else:
            ref_opt.step()
        ref_opt.zero_grad()

        loss = nn.functional.mse_loss(model(x), y)
        (scaler.scale(loss) if pattern.scaler else loss).backward()
        norm = None
        if pattern.ours == "unscale_grads":
            opt.unscale_grads(grad_scaler=scaler)
        elif pattern.ours == "stock_unscale":
            scaler.unscale_(opt)
        if pattern.clip:
            norm = opt.clip_grad_norm(MAX_NORM)
        if pattern.scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad()

        context = f"rank {rank} step {step}"
        if pattern.scaler:
            assert scaler.get_scale() == ref_scaler.get_scale(), f"{context}: scale {scaler.get_scale()} != ref"
        if norm is not None and torch.isfinite(ref_norm):
            torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=1e-7, msg=lambda m, c=context: f"{c}: norm {m}")
            report["clipped"] += int(ref_norm > MAX_NORM)
        for p, p_ref in zip(model.parameters(), ref_model.parameters()):
            tolerances.assert_close(p, p_ref, tolerances.DISTRIBUTED, msg=lambda m, c=context: f"{c}: param {m}")
        if step in POISON and pattern.scaler:
            report["skipped"].append(step)
            for a, b in zip(snapshot(opt), before):
                assert torch.equal(a, b), f"{context}: optimizer state changed on a skipped step"
            assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params_before)), context
    return report


# The scaler patterns on 1, 2 and 4 ranks; the scaler-free ones on 2.
CASES = [(n, ws) for n, p in PATTERNS.items() for ws in ((1, 2, 4) if p.scaler else (2,))]


@pytest.mark.parametrize("name, world_size", CASES, ids=[f"{n}-ws{w}" for n, w in CASES])
def test_pattern_matches_ddp_reference(name, world_size):
    reports = run_ranks(run, world_size, (PATTERNS[name],))
    pattern = PATTERNS[name]
    if pattern.scaler:
        assert reports[0]["skipped"] == sorted(POISON)
    if pattern.clip:
        assert reports[0]["clipped"] > 0, "clipping never engaged: MAX_NORM is too large for the test"


def test_negative_control_missing_unscale_is_caught():
    """Skipping the unscale (clip on scaled grads) must make the comparison fail."""

    def wrong(rank, world_size):
        pattern = Pattern(True, True, "unscale_grads")
        original = DistributedFusedAdam.unscale_grads

        def no_fold(self, grad_scaler=None, inv_scale=None):  # records the flag but forgets the scale
            original(self, inv_scale=1.0)
            self._record(grad_scaler)

        DistributedFusedAdam.unscale_grads = no_fold
        try:
            run(rank, world_size, pattern)
        finally:
            DistributedFusedAdam.unscale_grads = original

    with pytest.raises(AssertionError, match="norm|param"):
        run_ranks(wrong, 2)


def test_grad_norm_is_cached_and_global():
    """grad_norm() equals the norm of the DDP-averaged grads on every rank and costs one pass until
    the grads change."""

    def check(rank, world_size):
        model, ref_model = make_model(), make_model()
        ref = DDP(ref_model)
        opt = DistributedFusedAdam(model.parameters())
        x = torch.randn(4, 10, generator=torch.Generator().manual_seed(rank))
        for m in (model, ref):
            m(x).square().sum().backward()
        passes = []
        original = opt._norm_sq_and_flag
        opt._norm_sq_and_flag = lambda: passes.append(1) or original()
        n1, n2 = opt.grad_norm(), opt.grad_norm()
        expected = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in ref_model.parameters()]))
        torch.testing.assert_close(n1, expected, rtol=1e-5, atol=0)
        assert n1 is n2 or torch.equal(n1, n2)
        assert len(passes) == 1
        return n1.item()

    norms = run_ranks(check, 2)
    assert norms[0] == norms[1]


def test_grad_norm_follows_new_micro_batches():
    """Syncing every micro-batch: a norm taken after the second backward covers both (the cache must
    not return the first micro-batch's norm while the second's reductions are in flight)."""

    def check(rank, world_size):
        model, ref_model = make_model(), make_model()
        ref = DDP(ref_model)
        opt = DistributedFusedAdam(model.parameters())
        norms = []
        for micro in range(2):
            x = torch.randn(4, 10, generator=torch.Generator().manual_seed(10 * micro + rank))
            model(x).square().sum().backward()
            ref(x).square().sum().backward()
            expected = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in ref_model.parameters()]))
            norms.append(opt.grad_norm().item())
            torch.testing.assert_close(opt.grad_norm(), expected, rtol=1e-5, atol=0)
        return norms

    first, second = run_ranks(check, 2)[0]
    assert first != second
