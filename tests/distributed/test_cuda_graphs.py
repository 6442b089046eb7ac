"""Capturable steps on a GPU: a whole training step captured once in a CUDA graph and replayed gives
the same params as eager execution, step for step, and the eager capturable step never synchronises.

Two copies of a model train on the same batches: one eagerly for every step, one eagerly until
CAPTURE_AT and then by replaying a graph captured there (zero_grad, forward, backward with its
reduce-scatters, unscale, clip, step, all-gather). Between replays the lr changes through the
tensor in group["lr"], and one replayed batch holds an inf so that step must be skipped. GPU tests:
marked cuda, skipped without a GPU.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distopt import DistributedFusedAdam, FusedAdam

pytestmark = pytest.mark.cuda

STEPS, CAPTURE_AT, LR_CHANGE_AT, INF_AT = 16, 5, 9, 12
MAX_NORM = 0.5


class MLP(nn.Module):
    """Three linear layers; with `mixed` the middle one holds bf16 params (a mixed-dtype model)."""

    def __init__(self, mixed: bool) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(32, 64), nn.Linear(64, 64), nn.Linear(64, 8)
        if mixed:
            self.b.to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = nn.functional.gelu(self.a(x))
        h = nn.functional.gelu(self.b(h.to(self.b.weight.dtype))).float()
        return self.c(h)


def make_model(mixed: bool = False) -> nn.Module:
    torch.manual_seed(0)
    return MLP(mixed).cuda()


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(step)
    x = torch.randn(16, 32, device="cuda", generator=gen)
    if step == INF_AT:
        x[3, 5] = float("inf")
    return x, torch.randn(16, 8, device="cuda", generator=gen)


def make_optimizer(kind: str, model: nn.Module, **kwargs):
    if kind == "fused":
        return FusedAdam(model.parameters(), lr=1e-2, capturable=True)
    return DistributedFusedAdam(model.parameters(), lr=1e-2, capturable=True, **kwargs)


def train_step(model, opt, scaler, x, y) -> None:
    opt.zero_grad(set_to_none=True)
    loss = nn.functional.mse_loss(model(x), y)
    if scaler is None:
        loss.backward()
        opt.unscale_grads(inv_scale=1.0)  # sets the inf flag, so the poisoned step is skipped
        opt.clip_grad_norm(MAX_NORM)
        opt.step()
    else:
        scaler.scale(loss).backward()
        opt.unscale_grads(grad_scaler=scaler)
        opt.clip_grad_norm(MAX_NORM)
        scaler.step(opt)
        scaler.update()


def set_lr(opt, value: float) -> None:
    for group in opt.param_groups:
        group["lr"].fill_(value)  # a capturable lr is a GPU tensor: the graph reads it at replay


def run_eager_and_graph(kind: str, use_scaler: bool, mixed: bool = False, **kwargs) -> None:
    models = [make_model(mixed), make_model(mixed)]
    opts = [make_optimizer(kind, m, **kwargs) for m in models]
    scalers = [torch.amp.GradScaler("cuda", init_scale=2.0**8, growth_interval=2) if use_scaler else None
               for _ in models]
    static_x, static_y = batch(0)
    static_x, static_y = static_x.clone(), static_y.clone()
    graph = None
    side = torch.cuda.Stream()
    for step in range(STEPS):
        x, y = batch(step)
        if step == LR_CHANGE_AT:
            for opt in opts:
                set_lr(opt, 3e-3)
        before = [p.detach().clone() for p in models[1].parameters()]
        sync_check = torch.cuda.set_sync_debug_mode if step >= 2 else (lambda mode: None)
        sync_check("error")  # the eager capturable step must not synchronise either
        try:
            train_step(models[0], opts[0], scalers[0], x, y)
        finally:
            sync_check("default")
        static_x.copy_(x)
        static_y.copy_(y)
        if step < CAPTURE_AT:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up on a side stream, as torch's graph docs require
                train_step(models[1], opts[1], scalers[1], static_x, static_y)
            torch.cuda.current_stream().wait_stream(side)
        else:
            if graph is None:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    train_step(models[1], opts[1], scalers[1], static_x, static_y)
            graph.replay()
        torch.cuda.synchronize()
        for p, q in zip(models[1].parameters(), models[0].parameters()):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=lambda m, s=step: f"step {s}: {m}")
        if step == INF_AT:
            assert all(torch.equal(p, b) for p, b in zip(models[1].parameters(), before)), "inf step not skipped"
        if use_scaler:
            assert scalers[0].get_scale() == scalers[1].get_scale()
    assert graph is not None


@pytest.mark.parametrize("use_scaler", [False, True], ids=["no_scaler", "grad_scaler"])
def test_fused_adam_graph_replay_matches_eager(use_scaler):
    run_eager_and_graph("fused", use_scaler)


@pytest.mark.parametrize("use_scaler", [False, True], ids=["no_scaler", "grad_scaler"])
@pytest.mark.parametrize("kwargs", [{}, dict(contiguous_grad_buffer=True, contiguous_param_buffer=True),
                                    dict(bucket_cap_mb=0.01, overlap_param_sync=True)],
                         ids=["default", "contiguous", "tiny_buckets_overlap"])
def test_distributed_graph_replay_matches_eager(nccl_group, kwargs, use_scaler):
    run_eager_and_graph("distributed", use_scaler, **kwargs)


@pytest.mark.parametrize("kwargs", [{}, dict(store_param_remainders=True)], ids=["masters", "bf16_remainders"])
def test_distributed_graph_with_mixed_dtypes(nccl_group, kwargs):
    """Capturable mode on a model mixing fp32 and bf16 params, with fp32 masters or with bf16
    remainders for the bf16 ones (apex's capturable mode excludes both)."""
    run_eager_and_graph("distributed", True, mixed=True, **kwargs)


# The refusals are checked with the capture query patched rather than inside a real capture: an
# exception there aborts the capture and torch.cuda.graph's exit may raise over it.


def test_capture_before_first_step_is_refused(nccl_group, monkeypatch):
    model = make_model()
    opt = DistributedFusedAdam(model.parameters(), capturable=True)
    model(torch.randn(4, 32, device="cuda")).sum().backward()
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="eager steps before capturing"):
        opt.step()


def test_non_capturable_step_refuses_capture(nccl_group, monkeypatch):
    model = make_model()
    opt = DistributedFusedAdam(model.parameters())
    x = torch.randn(4, 32, device="cuda")
    model(x).sum().backward()
    opt.step()
    model(x).sum().backward()
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="capturable=True"):
        opt.step()


@pytest.mark.parametrize("kind", ["fused", "distributed"])
def test_replacing_lr_after_capture_is_refused(nccl_group, kind):
    """After a capture, a new lr object would be ignored by the graph: the next eager step says so."""
    model = make_model()
    opt = make_optimizer(kind, model)
    x, y = batch(0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            train_step(model, opt, None, x, y)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        train_step(model, opt, None, x, y)
    graph.replay()
    opt.param_groups[0]["lr"] = 1e-3  # should have been opt.param_groups[0]["lr"].fill_(1e-3)
    with pytest.raises(RuntimeError, match="fill_"):
        train_step(model, opt, None, x, y)
