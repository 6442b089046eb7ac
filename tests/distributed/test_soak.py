"""Randomised distributed soak: DistributedFusedAdam against DDP + AdamW on random scenarios.

A seed fully determines a scenario (tests/distributed/soak_models.py): 1-4 gloo ranks, a small random
model (containers, ParameterList/ParameterDict read by the parent, a Linear used functionally, tied
embedding weights, channels_last conv, unused, frozen and sometimes-used layers), 1-3 param groups,
random DistributedFusedAdam options (tiny or default buckets, overlap flags, contiguous buffers,
pipeline size, bf16 with fp32 masters or remainders) and a random recipe (micro-batches with or
without no_sync, clipping, a GradScaler with an inf injected into one rank's loss on one step, which
every rank must skip). Every micro-batch compares outputs, every step compares every param (with
overlap_param_sync: after the next forward, which must have gathered them) and the scale and norm.

The reference is DDP with torch.optim.AdamW/Adam (foreach=False) and the stock GradScaler recipe
(``scaler.unscale_; clip_grad_norm_; scaler.step; scaler.update``); bf16 models use DDP + FusedAdam
with fp32 master weights and its folded unscale/clip instead (see test_ddp_equivalence.py). None grads
of trainable params are zero-filled before the reference step: DistributedFusedAdam steps a param that
got no gradient on any rank with a zero gradient.

Seeds: the default run uses DEFAULT_SEEDS; ``DISTOPT_SOAK_SEEDS`` overrides them with a comma list
(``7,19,`` or one seed as ``1234,``), an inclusive range (``100-129``) or a count N (seeds 0..N-1).
The slow variant (``pytest -m slow tests/distributed/test_soak.py``, or DISTOPT_SOAK_SLOW=1) runs
SLOW_SEEDS. A failure's message starts with its seed, the scenario in one line and the command that
reruns it.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distopt import DistributedFusedAdam, FusedAdam

import tolerances
from harness import run_ranks
from soak_models import Scenario, batch, make_model, make_scenario, param_groups

SEEDS_ENV = "DISTOPT_SOAK_SEEDS"
# Seeds that found bugs, kept as regression cases in the default run (each runs in well under a second).
REGRESSION_SEEDS = {
    10: "overlap_param_sync: ParameterList params read by the parent's forward were stale",
    27: "overlap_param_sync: a tied embedding weight used through F.linear before the embedding ran (bf16)",
    79: "overlap_param_sync: a Linear's weight used through F.linear, the module never called",
    21: "overlap_param_sync: ParameterDict params read by the parent's forward were stale (1 rank)",
    222: "contiguous_grad_buffer + overlap_grad_sync=False: a param whose grad arrived only inside no_sync() "
         "keeps .grad (a view of its bucket); the stock scaler.unscale_ sees it and the optimizer never unscales",
    285: "pipeline_size >= buckets, every micro-batch synced: grads of a micro-batch dropped (bf16)",
    368: "pipeline_size >= buckets, every micro-batch synced: grads of a micro-batch dropped (clip norm differs)",
    377: "pipeline_size > buckets, every micro-batch synced: a bucket reduced twice, then `None.wait()`",
}
DEFAULT_SEEDS = list(range(24)) + sorted(REGRESSION_SEEDS)
SLOW_SEEDS = list(range(1000, 1300))
TIMEOUT_S = 120.0
# A bf16 forward through up to ten layers whose params may each differ from the reference's by one bf16
# rounding (their fp32 masters differ by a few ulps): a few bf16 roundings at the outputs' scale.
BF16_OUTPUT = {torch.bfloat16: dict(rtol=2**-5, atol=1e-3)}


def parse_seeds(text: str) -> list[int]:
    """``"a,b,c"`` (a trailing comma makes one seed a list), ``"a-b"`` (inclusive) or a count ``"N"``."""
    text = text.strip()
    if "," in text:
        return [int(s) for s in text.split(",") if s.strip()]
    if "-" in text:
        lo, hi = (int(s) for s in text.split("-"))
        return list(range(lo, hi + 1))
    return list(range(int(text)))


def seeds() -> list[int]:
    return parse_seeds(os.environ[SEEDS_ENV]) if os.environ.get(SEEDS_ENV) else DEFAULT_SEEDS


# ---------------------------------------------------------------------------------------------- ranks

class Checker:
    """Comparisons with the scenario's tolerances; each failure names what was compared."""

    def __init__(self, sc: Scenario, model: nn.Module, ref_model: nn.Module) -> None:
        self.sc = sc
        self.table_dtype = sc.dtype
        self.pairs = [(n, p, q) for (n, p), q in zip(model.named_parameters(), ref_model.parameters())]
        self.checks = 0

    def close(self, what: str, actual: torch.Tensor, expected: torch.Tensor, table: dict = tolerances.DISTRIBUTED,
              scale_atol: bool | None = None) -> None:
        scale_atol = self.sc.bf16 if scale_atol is None else scale_atol
        try:
            tolerances.assert_close(actual, expected, table, dtype=self.table_dtype, scale_atol=scale_atol)
        except AssertionError as exc:
            raise AssertionError(f"{what}: {exc}") from None
        self.checks += 1

    def params(self, when: str) -> None:
        for name, p, p_ref in self.pairs:
            assert p.stride() == p_ref.stride(), f"{when}: {name} strides {p.stride()}, reference {p_ref.stride()}"
            self.close(f"{when}: param {name} {tuple(p.shape)}", p.detach(), p_ref.detach())


def backward(out: torch.Tensor, y: torch.Tensor, poison: bool, scaler: torch.amp.GradScaler | None) -> None:
    loss = nn.functional.mse_loss(out.float(), y)
    if poison:
        loss = loss * float("inf")
    (scaler.scale(loss) if scaler is not None else loss).backward()


def reference_optimizer(sc: Scenario, model: nn.Module) -> torch.optim.Optimizer:
    if sc.bf16:
        return FusedAdam(param_groups(model), master_weights=True, adam_w_mode=sc.adam_w_mode)
    cls = torch.optim.AdamW if sc.adam_w_mode else torch.optim.Adam
    return cls(param_groups(model), foreach=False)


def reference_step(sc: Scenario, ref_model: nn.Module, opt: torch.optim.Optimizer,
                   scaler: torch.amp.GradScaler | None) -> torch.Tensor | None:
    """The documented torch recipe; None grads of trainable params become zeros first."""
    for p in ref_model.parameters():
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)
    norm = None
    if sc.clip is not None:
        if scaler is not None:
            opt.unscale_grads(grad_scaler=scaler) if sc.bf16 else scaler.unscale_(opt)
        norm = opt.clip_grad_norm(sc.clip) if sc.bf16 else torch.nn.utils.clip_grad_norm_(ref_model.parameters(),
                                                                                           sc.clip)
    finish_step(opt, scaler)
    return norm


def finish_step(opt: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None) -> None:
    """The step both runs end with: through the scaler when there is one, then zero_grad."""
    if scaler is not None:
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()
    opt.zero_grad()


def our_step(sc: Scenario, opt: DistributedFusedAdam, scaler: torch.amp.GradScaler | None) -> torch.Tensor | None:
    """README's patterns: 1 unscale_grads (+ clip), 2 scaler.step alone, 3 stock unscale_ + clip."""
    norm = None
    if scaler is not None and sc.amp_pattern == 1:
        opt.unscale_grads(grad_scaler=scaler)
    elif scaler is not None and sc.amp_pattern == 3:
        scaler.unscale_(opt)
    if sc.clip is not None:
        norm = opt.clip_grad_norm(sc.clip)
    finish_step(opt, scaler)
    return norm


def train(rank: int, world_size: int, sc: Scenario) -> dict:
    """Both runs on this rank, compared every micro-batch and step."""
    warnings.filterwarnings("ignore", message="DistributedFusedAdam: buckets are ")  # tiny buckets pad
    ref_model, model = make_model(sc), make_model(sc)
    ddp = DDP(ref_model, find_unused_parameters=sc.find_unused)
    ref_opt = reference_optimizer(sc, ref_model)
    opt = DistributedFusedAdam(param_groups(model), adam_w_mode=sc.adam_w_mode, **sc.opt)
    ref_scaler, scaler = ((torch.amp.GradScaler("cpu", **sc.scaler), torch.amp.GradScaler("cpu", **sc.scaler))
                          if sc.scaler is not None else (None, None))
    deferred = sc.opt["overlap_param_sync"]
    check = Checker(sc, model, ref_model)
    report = {"skipped": []}
    for step in range(sc.steps):
        for micro in range(sc.micro_batches):
            x, tokens, y = batch(sc, step, micro, rank)
            use = sc.sometimes[step][micro] if sc.sometimes else False
            poison = sc.inject == (step, micro, rank)
            quiet = sc.no_sync[micro]
            with opt.no_sync() if quiet else contextlib.nullcontext():
                out = model(x, tokens, use)
                backward(out, y, poison, scaler)
            with ddp.no_sync() if quiet else contextlib.nullcontext():
                out_ref = ddp(x, tokens, use)
                backward(out_ref, y, poison, ref_scaler)
            check.close(f"step {step} micro-batch {micro}: forward output", out.detach(), out_ref.detach(),
                        BF16_OUTPUT if sc.bf16 else tolerances.DISTRIBUTED)
            if deferred and step > 0 and micro == 0:
                check.params(f"after step {step - 1} (read after step {step}'s first forward: overlap_param_sync)")
        skip_expected = sc.inject is not None and sc.inject[0] == step
        if skip_expected and deferred:
            opt.param_sync()  # what step() does first anyway: lands the gathers the forward left pending
        before = [p.detach().clone() for p in model.parameters()]
        ref_scale = ref_scaler.get_scale() if ref_scaler is not None else None
        ref_norm = reference_step(sc, ref_model, ref_opt, ref_scaler)
        norm = our_step(sc, opt, scaler)

        if scaler is not None:
            assert scaler.get_scale() == ref_scaler.get_scale(), (
                f"step {step}: loss scale {scaler.get_scale()}, the reference's {ref_scaler.get_scale()}")
            assert (ref_scaler.get_scale() < ref_scale) == skip_expected, (
                f"step {step}: the reference {'did not skip' if skip_expected else 'skipped'} the step (scale "
                f"{ref_scale} -> {ref_scaler.get_scale()}): the scenario's inf injection is broken")
        if skip_expected:
            report["skipped"].append(step)
            for (name, p), q in zip(model.named_parameters(), before):
                assert torch.equal(p.detach(), q), f"step {step} (inf injected: must be skipped): {name} changed"
        if ref_norm is not None and torch.isfinite(ref_norm):
            table = tolerances.DISTRIBUTED if sc.bf16 else {torch.float32: dict(rtol=1e-5, atol=1e-7)}
            check.close(f"step {step}: clip_grad_norm's norm", norm, ref_norm, table, scale_atol=False)
        if not deferred:
            check.params(f"after step {step}")
    if deferred:
        opt.param_sync()
        check.params(f"after the last step ({sc.steps - 1}, after opt.param_sync())")
    report["checks"] = check.checks
    return report


# ---------------------------------------------------------------------------------------------- tests

def run_seed(seed: int) -> None:
    """Runs one seed's scenario; any failure's message starts with the seed and how to rerun it."""
    sc = make_scenario(seed)
    try:
        reports = run_ranks(train, sc.world_size, (sc,), timeout=TIMEOUT_S)
        assert all(r["checks"] > 0 for r in reports), "nothing was compared"
        if sc.inject is not None:
            assert reports[0]["skipped"] == [sc.inject[0]], f"skipped steps {reports[0]['skipped']}"
    except AssertionError as exc:
        rerun = f"{SEEDS_ENV}={seed}, pytest tests/distributed/test_soak.py"
        raise AssertionError(f"seed {seed}: {sc.describe()}\n  rerun: {rerun}   (the comma: a seed, not a count)\n"
                             f"{exc}") from None


@pytest.mark.parametrize("seed", seeds(), ids=lambda s: f"seed{s}")
def test_soak(seed: int) -> None:
    run_seed(seed)


def _slow_selected(config: pytest.Config) -> bool:
    expr = config.getoption("markexpr") or ""
    return bool(os.environ.get("DISTOPT_SOAK_SLOW")) or ("slow" in expr and "not slow" not in expr)


@pytest.mark.slow
@pytest.mark.parametrize("seed", SLOW_SEEDS, ids=lambda s: f"seed{s}")
def test_soak_slow(seed: int, request: pytest.FixtureRequest) -> None:
    """More seeds; runs only when asked for (the suite's plain `pytest` does not deselect `slow`)."""
    if not _slow_selected(request.config):
        pytest.skip("slow soak: select with -m slow or DISTOPT_SOAK_SLOW=1")
    run_seed(seed)


def test_scenarios_cover_the_menu() -> None:
    """The default seeds exercise every part and option at least once (a generator regression shows here)."""
    scs = [make_scenario(s) for s in DEFAULT_SEEDS]
    parts = {p.rstrip("0123456789") for sc in scs for p in sc.parts}
    assert parts >= {"linear", "conv", "plist", "pdict", "fn", "tied", "frozen", "sometimes"}, parts
    assert {sc.world_size for sc in scs} >= {1, 2, 4}
    for key in ("overlap_grad_sync", "overlap_param_sync", "contiguous_grad_buffer", "contiguous_param_buffer"):
        assert {bool(sc.opt[key]) for sc in scs} == {True, False}, key
    assert any("bucket_cap_mb" in sc.opt for sc in scs) and any(sc.bf16 for sc in scs)
    assert {bool(sc.opt.get("offload_optimizer")) for sc in scs} == {True, False}
    assert any(sc.inject for sc in scs) and any(sc.clip for sc in scs) and any(sc.unused for sc in scs)
    assert any(any(sc.no_sync) for sc in scs)


def test_negative_control_a_wrong_update_names_the_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A slightly wrong optimizer (lr 1% high on its first group) fails, and the message leads with the seed."""
    real_step = our_step

    def wrong_step(sc: Scenario, opt: DistributedFusedAdam, scaler):
        opt.param_groups[0]["lr"] *= 1.01
        return real_step(sc, opt, scaler)

    monkeypatch.setattr(sys.modules[__name__], "our_step", wrong_step)  # the forked ranks inherit the patch
    with pytest.raises(AssertionError) as info:
        run_seed(2)
    assert str(info.value).startswith("seed 2: ws=")
    assert f"{SEEDS_ENV}=2, pytest tests/distributed/test_soak.py" in str(info.value)
