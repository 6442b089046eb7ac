"""FusedAdam under torch.compile: no graph breaks in distopt's code, one compile of the step whatever
the step count (no guards on it), lr changed by a scheduler without per-step recompiles, and the same
params as eager execution.

The backends are "eager" and "aot_eager" (Dynamo's capture, and AOT functionalization of the mutating
ops); inductor compiles the same graphs but takes minutes on a 2-core machine.
"""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing
import torch._logging
from torch import nn

from distopt import FusedAdam

import tolerances

STEPS = 20


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Compiled code and its caches from other tests (the step wrapper's code is shared by every
    torch optimizer) must not be counted here."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@contextlib.contextmanager
def graph_break_locations():
    """Collects the ``file:line`` of every graph break Dynamo reports while the block runs."""
    locations: list[str] = []
    prefix = "Graph break in user code at "

    class Handler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            first = record.getMessage().splitlines()[0]
            if first.startswith(prefix):
                locations.append(first.removeprefix(prefix))

    handler = Handler()
    logger = logging.getLogger("torch._dynamo")
    torch._logging.set_logs(graph_breaks=True)
    logger.addHandler(handler)
    try:
        yield locations
    finally:
        logger.removeHandler(handler)
        torch._logging.set_logs()


def step_compiles() -> int:
    """How many compiled versions of an optimizer ``step`` Dynamo holds (the hook wrapper torch puts
    around every optimizer's step is the frame compiled when a scheduler wraps ``step``)."""
    return len(torch._dynamo.eval_frame._debug_get_cache_entry_list(FusedAdam.step.__code__))


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 4))


def run_training(lr, compile_backend: str | None, steps: int = STEPS):
    """``steps`` iterations of forward, backward, ``opt.step()``, ``opt.zero_grad()`` with a scheduler
    changing lr every step, the train step compiled with ``compile_backend`` (None: eager).
    Returns (params after every step, compile counter, optimizer)."""
    model = make_model()
    opt = FusedAdam([{"params": list(model[0].parameters()) + list(model[3].parameters()), "weight_decay": 0.05},
                     {"params": list(model[2].parameters()), "maximize": False}], lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.3 * s))

    def train_step(x, y):
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    counter = None
    if compile_backend is not None:
        counter = torch._dynamo.testing.CompileCounterWithBackend(compile_backend)
        train_step = torch.compile(train_step, backend=counter)
    gen = torch.Generator().manual_seed(1)
    history = []
    for _ in range(steps):
        train_step(torch.randn(16, 8, generator=gen), torch.randn(16, 4, generator=gen))
        sched.step()
        history.append(([p.detach().clone() for p in model.parameters()], counter.frame_count if counter else 0))
    return history, opt


@pytest.mark.parametrize(
    "lr_kind, backend, max_step_compiles",
    [
        # A tensor lr is filled in place by the scheduler: nothing Dynamo guards on changes.
        pytest.param("tensor", "aot_eager", 1, id="tensor_lr-aot_eager"),
        # A float lr: Dynamo guards on every float in param_groups (torch.optim's own optimizers too)
        # and recompiles once, with lr symbolic, when it first sees it change; never again.
        pytest.param("float", "eager", 2, id="float_lr-eager"),
    ],
)
def test_compiled_train_step_with_scheduler(lr_kind, backend, max_step_compiles):
    """torch.compile(train_step) over 20 steps with lr changing every step: no graph break in distopt,
    no recompiles after the warm-up (the step count is never specialised on), params as in eager."""
    lr = torch.tensor(3e-3) if lr_kind == "tensor" else 3e-3
    expected, _ = run_training(torch.tensor(3e-3) if lr_kind == "tensor" else 3e-3, None)
    with graph_break_locations() as breaks:
        got, opt = run_training(lr, backend)
    assert not [b for b in breaks if "distopt" in b], breaks
    frames = [f for _, f in got]
    warm = max_step_compiles - 1  # the steps after which nothing may compile any more
    assert frames[warm:] == [frames[warm]] * (STEPS - warm), frames
    assert 1 <= step_compiles() <= max_step_compiles
    assert opt.state[opt.param_groups[0]["params"][0]]["step"].item() == STEPS
    for step, ((g, _), (e, _)) in enumerate(zip(got, expected)):
        for a, b in zip(g, e):
            # The compiled step reads lr as a float32 tensor: lr differs from eager's double by < 1 ulp of fp32.
            tolerances.assert_close(a, b, tolerances.OPTIMIZER, msg=lambda m, s=step: f"step {s + 1}: {m}")


def test_negative_control_the_eager_step_under_compile_is_caught(monkeypatch):
    """The checks above fail for the step as it was: the eager path (step count read with .item())
    under torch.compile breaks the graph inside distopt and recompiles for every step number."""
    monkeypatch.setattr(FusedAdam, "_step_group_traced",
                        lambda self, group, params, grads, gs, fi: self._step_group(0, group, params, grads, gs, fi))
    with graph_break_locations() as breaks:
        got, _ = run_training(torch.tensor(3e-3), "eager", steps=4)
    assert [b for b in breaks if "distopt/fused_adam/general_step.py" in b], breaks
    frames = [f for _, f in got]
    assert frames[-1] > frames[0], frames  # a new compile per step number


def twin_optimizers():
    """Two identical optimizers over identical params: fp32 and bf16 (fp32 masters), a tensor lr,
    maximize in one group."""
    def params():
        torch.manual_seed(0)
        return [nn.Parameter(torch.randn(33, 5)), nn.Parameter(torch.randn(7, dtype=torch.bfloat16)),
                nn.Parameter(torch.randn(4, 3))]

    def opt(ps):
        return FusedAdam([{"params": ps[:2]}, {"params": ps[2:], "maximize": True, "adam_w_mode": False}],
                         lr=torch.tensor(1e-2), weight_decay=0.1, master_weights=True)

    a, b = params(), params()
    return (a, opt(a)), (b, opt(b))


@pytest.mark.parametrize("set_to_none", [True, False])
def test_step_and_zero_grad_compile_with_fullgraph_once(set_to_none):
    """opt.step and opt.zero_grad each compile as one graph (fullgraph=True: any graph break raises),
    once for all 6 steps while lr changes, and give the eager optimizer's bits (master weights,
    maximize, L2 mode included)."""
    (params, opt), (ref_params, ref_opt) = twin_optimizers()
    counter = torch._dynamo.testing.CompileCounter()
    step = torch.compile(opt.step, fullgraph=True, backend=counter)
    zero_grad = torch.compile(lambda: opt.zero_grad(set_to_none), fullgraph=True, backend=counter)
    gen = torch.Generator().manual_seed(2)
    for i in range(6):
        for p, r in zip(params, ref_params):
            g = torch.randn(p.shape, generator=gen).to(p.dtype)
            p.grad, r.grad = g.clone(), g.clone()
        step()
        ref_opt.step()
        assert all(torch.equal(p, r) for p, r in zip(params, ref_params)), f"step {i + 1}"
        zero_grad()
        ref_opt.zero_grad(set_to_none)
        assert all((p.grad is None) == (r.grad is None) for p, r in zip(params, ref_params))
        for o in (opt, ref_opt):
            for g in o.param_groups:
                g["lr"].fill_(1e-2 / (i + 2))
    assert counter.frame_count == 2
    masters = [(opt.state[p]["param"], ref_opt.state[r]["param"]) for p, r in zip(params, ref_params)
               if p.dtype == torch.bfloat16]
    assert masters and all(torch.equal(m, r) for m, r in masters)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_complex_and_non_dense_params_compile_with_fullgraph(backend):
    """A complex param (its real view), one not dense in memory (a contiguous copy) and a plain one:
    opt.step compiles as one graph and gives the eager optimizer's bits (AOT functionalization too,
    where the kernel updates copies of the complex tensors: distopt/kernel_views.py)."""
    def params():
        torch.manual_seed(0)
        return [nn.Parameter(torch.randn(3, 4, dtype=torch.complex64)), nn.Parameter(torch.randn(5, 3, 2)[..., 0]),
                nn.Parameter(torch.randn(6))]

    params_, ref_params = params(), params()
    opt, ref_opt = FusedAdam(params_, weight_decay=0.1), FusedAdam(ref_params, weight_decay=0.1)
    counter = torch._dynamo.testing.CompileCounterWithBackend(backend)
    step = torch.compile(opt.step, fullgraph=True, backend=counter)
    gen = torch.Generator().manual_seed(3)
    for i in range(3):
        for p, r in zip(params_, ref_params):
            g = torch.randn(p.shape, dtype=p.dtype, generator=gen)
            p.grad, r.grad = g.clone(), g.clone()
        step()
        ref_opt.step()
        assert all(torch.equal(p, r) for p, r in zip(params_, ref_params)), f"step {i + 1}"
    assert counter.frame_count == 1
    assert params_[1].stride() == (6, 2)  # still the view it was


def run_clipped(compile_backend: str | None, max_norm: float | None, steps: int = 5) -> list[torch.Tensor]:
    """``steps`` iterations of forward, backward, ``opt.clip_grad_norm(max_norm)`` (None: no clip),
    ``opt.step()``, ``opt.zero_grad()``, compiled with ``compile_backend`` (None: eager); the params after."""
    model = make_model()
    opt = FusedAdam(model.parameters(), lr=torch.tensor(1e-2))

    def train_step(x, y):
        nn.functional.mse_loss(model(x), y).backward()
        if max_norm is not None:
            opt.clip_grad_norm(max_norm)
        opt.step()
        opt.zero_grad()

    if compile_backend is not None:
        train_step = torch.compile(train_step, backend=compile_backend)
    gen = torch.Generator().manual_seed(2)
    for _ in range(steps):
        train_step(torch.randn(16, 8, generator=gen), torch.randn(16, 4, generator=gen))
    return [p.detach().clone() for p in model.parameters()]


def test_compiled_step_with_clipping_matches_eager():
    """Clipping inside the compiled step (the norm, its cache and the clip record are assigned there, which
    torch 2.11's Dynamo refuses on an optimizer's own attributes) gives eager's params; the clip is active
    (negative control: without it the params differ)."""
    eager = run_clipped(None, 0.05)
    with graph_break_locations() as breaks:
        compiled = run_clipped("aot_eager", 0.05)
    assert not [b for b in breaks if "distopt" in b], breaks
    for a, b in zip(compiled, eager):
        tolerances.assert_close(a, b, tolerances.OPTIMIZER)
    unclipped = run_clipped(None, None)
    assert any((a - b).abs().max() > 1e-4 for a, b in zip(unclipped, eager))
