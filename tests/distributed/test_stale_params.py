"""overlap_param_sync never lets a forward read a stale param.

Each model below reads some param in a way a module's own forward pre-hook cannot see: through a
ParameterList/ParameterDict child, another module's weight used functionally before that module runs,
tied weights, a param outside any module, a compiled model. DistributedFusedAdam with overlapped
param sync is compared with DDP + torch.optim.AdamW after every step (outputs and params), and
``model.state_dict()`` right after ``step()`` must hold the updated params. Negative controls: with
the learning switched off the comparison (or the stale-read check) catches the stale values, and a
param read before any module runs is refused with a clear error instead of trained on.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distopt import DistributedFusedAdam
from distopt.distributed import param_sync

import tolerances
from harness import run_ranks

TINY_BUCKET_MB = 64 * 4 / 2**20  # a few params per bucket: gathers happen one bucket at a time
STEPS = 4


class ContainerNet(nn.Module):
    """The parent's forward reads params of ParameterList/ParameterDict children."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(6, 8)
        self.plist = nn.ParameterList([nn.Parameter(torch.randn(8, 8) * 0.3) for _ in range(3)])
        self.pdict = nn.ParameterDict({"scale": nn.Parameter(torch.rand(8) + 0.5)})
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.stem(x))
        for w in self.plist:
            h = torch.tanh(h @ w) * self.pdict["scale"]
        return self.head(h)


class FunctionalNet(nn.Module):
    """Uses `late.weight` functionally before `late` itself runs, and ties the output to the
    embedding (an embedding weight used by F.linear at the end)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.early = nn.Linear(8, 8)
        self.mid = nn.Linear(8, 8)
        self.late = nn.Linear(8, 8)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.early(self.embed(tokens)))
        h = torch.tanh(F.linear(h, self.late.weight))  # late's weight, long before late runs
        h = torch.tanh(self.mid(h))
        h = torch.tanh(self.late(h))
        return F.linear(h, self.embed.weight)  # tied output projection


class OutsideNet(nn.Module):
    """A param of the optimizer that no module owns, read after the model ran."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


MODELS = {"containers": ContainerNet, "functional_and_tied": FunctionalNet, "outside": OutsideNet,
          "compiled": ContainerNet}


def inputs(name: str, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    if name == "functional_and_tied":
        return torch.randint(0, 11, (5,), generator=gen), torch.randn(5, 11, generator=gen)
    return torch.randn(5, 6, generator=gen), torch.randn(5, 3, generator=gen)


def build(name: str) -> tuple[nn.Module, list[nn.Parameter]]:
    torch.manual_seed(0)
    model = MODELS[name]()
    extra = [nn.Parameter(torch.randn(3) * 0.1)] if name == "outside" else []
    return model, extra


def loss_of(name: str, model: nn.Module, extra: list[nn.Parameter], x, y) -> torch.Tensor:
    out = model(x)
    if extra:
        out = out + extra[0]  # read after the model ran, outside any module
    return F.mse_loss(out, y)


def train(rank: int, world_size: int, name: str, learn: bool = True, overlap: bool = True) -> int:
    if not learn:  # negative control: nothing is learnt from watching the forward
        param_sync._UseRecorder.__torch_function__ = lambda self, func, types, args=(), kwargs=None: func(
            *args, **(kwargs or {}))
    ref_model, ref_extra = build(name)
    ref = DDP(ref_model)
    ref_opt = torch.optim.AdamW([*ref_model.parameters(), *ref_extra], lr=0.05, weight_decay=0.01)
    model, extra = build(name)
    opt = DistributedFusedAdam([*model.parameters(), *extra], lr=0.05, weight_decay=0.01,
                               bucket_cap_mb=TINY_BUCKET_MB, overlap_param_sync=overlap)
    run = torch.compile(model, backend="eager") if name == "compiled" else model
    checks = 0
    for step in range(STEPS):
        x, y = inputs(name, step, rank)
        loss = loss_of(name, run, extra, x, y)
        ref_loss = loss_of(name, ref, ref_extra, x, y)
        tolerances.assert_close(loss, ref_loss, tolerances.DISTRIBUTED,
                                msg=lambda m, step=step: f"step {step} loss: {m}")
        loss.backward()
        ref_loss.backward()
        for p in ref_extra:  # outside DDP's model: average its gradient by hand
            dist.all_reduce(p.grad)
            p.grad /= world_size
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
        checks += 1
    # state_dict() right after step() holds the updated params (no forward has gathered them yet;
    # only here, since it gathers everything and the forwards above must run with gathers pending)
    state, ref_state = model.state_dict(), ref_model.state_dict()
    for key, value in ref_state.items():
        tolerances.assert_close(state[key], value, tolerances.DISTRIBUTED,
                                msg=lambda m, key=key: f"after the last step, state_dict()[{key!r}]: {m}")
    opt.param_sync()
    for p, p_ref in zip(extra, ref_extra):
        tolerances.assert_close(p, p_ref, tolerances.DISTRIBUTED)
    return checks


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("name", list(MODELS))
def test_overlap_param_sync_matches_ddp(name, world_size):
    if name == "compiled" and world_size == 1:
        pytest.skip("one world size is enough for the compiled model")
    assert all(c > 0 for c in run_ranks(train, world_size, (name,), timeout=300))


def test_compiled_model_without_overlap_matches_ddp():
    """torch.compile(model) with the blocking all-gather at step(): the same per-step comparison."""
    assert all(c > 0 for c in run_ranks(train, 2, ("compiled", True, False), timeout=300))


def test_negative_control_without_learning_stale_reads_are_caught():
    """With the watched forward learning nothing, FunctionalNet reads late.weight before its bucket's
    gather lands: the step-1 loss comparison sees the stale value (and were it not compared, the
    gather's version bump makes autograd refuse the backward through it)."""
    with pytest.raises(AssertionError, match="step 1 loss: Scalars are not close"):
        run_ranks(train, 2, ("functional_and_tied", False))  # one rank has nothing to gather: no stale read


def read_before_any_module(rank: int, world_size: int, overlap: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    scale = nn.Parameter(torch.ones(4))
    opt = DistributedFusedAdam([*model.parameters(), scale], lr=0.1, overlap_param_sync=overlap,
                               bucket_cap_mb=TINY_BUCKET_MB)
    for step in range(4):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * step + rank))
        model(x * scale).sum().backward()  # `scale` is read before any module runs
        opt.step()
        opt.zero_grad()
    opt.param_sync()
    return [p.detach().clone() for p in (*model.parameters(), scale)]


def test_param_read_before_any_module_is_gathered_at_step():
    """A param no module owns, read before the model runs, is an orphan: step() gathers it at once."""
    for ours, expected in zip(*(run_ranks(read_before_any_module, 2, (overlap,)) for overlap in (True, False))):
        for p, q in zip(ours, expected):
            torch.testing.assert_close(p, q, rtol=0, atol=0)


def dynamic_model_reads_stale(rank: int, world_size: int) -> str:
    """The watched forward never touches `b`; a later one reads b.weight functionally after `a` ran,
    and nothing gathers b's bucket (laid out first: the lowest) before backward."""
    torch.manual_seed(0)
    a, b = nn.Linear(8, 8), nn.Linear(8, 8)  # 64-element weights: a bucket each
    opt = DistributedFusedAdam([*a.parameters(), *b.parameters()], lr=0.1, overlap_param_sync=True,
                               bucket_cap_mb=TINY_BUCKET_MB)
    opt.init_params([b.weight, b.bias, a.weight, a.bias])
    for step in range(3):
        x = torch.randn(3, 8)
        out = a(x)
        if step > 0:
            out = out + x @ b.weight.T
        try:
            out.sum().backward()
        except param_sync.StaleParamError as exc:
            assert step == 1, f"refused at step {step}"
            return str(exc)
        opt.step()
        opt.zero_grad()
    raise AssertionError("a stale read was trained on")


def test_gradient_from_a_stale_read_is_refused_with_the_remedy():
    messages = run_ranks(dynamic_model_reads_stale, 2)
    assert messages[0] == messages[1]
    assert "param 2 (shape (8, 8)" in messages[0] and "opt.param_sync()" in messages[0]


class SometimesNet(nn.Module):
    """`sometimes` runs on some iterations only; after it, the parent's own code reads `other.bias` in
    an addition (which saves nothing for backward, so autograd could not catch a stale value)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.sometimes, self.other, self.head = (nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: torch.Tensor, use: bool) -> torch.Tensor:
        h = torch.tanh(self.stem(x))
        if use:
            h = torch.tanh(self.sometimes(h))
        return self.head(h + self.other.bias)


def sometimes_run(rank: int, world_size: int, overlap: bool, old_attribution: bool = False) -> list[torch.Tensor]:
    if old_attribution:  # negative control: a read after a child returns counts as the child's need
        param_sync.ParamSync._after_forward = lambda self, module: (
            self._stop_observing() if module is self._observed_root else None)
    torch.manual_seed(0)
    model = SometimesNet()
    opt = DistributedFusedAdam(model.parameters(), lr=0.1, overlap_param_sync=overlap, bucket_cap_mb=TINY_BUCKET_MB)
    opt.init_params([*model.head.parameters(), *model.other.parameters(), *model.sometimes.parameters(),
                     *model.stem.parameters()])  # backward order: other's bucket is gathered after sometimes'
    losses = []
    for step, use in enumerate([True, False, True, False, False]):  # the watched forward runs `sometimes`
        x = torch.randn(3, 8, generator=torch.Generator().manual_seed(10 * step + rank))
        loss = model(x, use).square().mean()
        losses.append(loss.detach().clone())
        loss.backward()
        opt.step()
        opt.zero_grad()
    opt.param_sync()
    return losses + [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("old_attribution", [False, True], ids=["parent_needs_it", "negative_control_child_needs_it"])
def test_read_in_parent_code_after_a_dynamic_child_is_gathered_in_time(old_attribution):
    """Gathers overlapped with the forward give bit for bit the numbers of gathers at step() although the
    forward after the watched one skips the child the read follows; attributing the read to that child
    instead (the control) trains silently on a stale bias."""
    expected = run_ranks(sometimes_run, 2, (False,))
    actual = run_ranks(sometimes_run, 2, (True, old_attribution))
    same = all(torch.equal(a, e) for r_a, r_e in zip(actual, expected) for a, e in zip(r_a, r_e))
    assert same != old_attribution


def ddp_wrapped(rank: int, world_size: int) -> str:
    model = nn.Linear(4, 2)
    opt = DistributedFusedAdam(model.parameters())
    ddp = DDP(model)
    messages = []
    for _ in range(2):  # refused every time, not only the first
        try:
            ddp(torch.randn(3, 4)).sum().backward()
        except ValueError as exc:
            messages.append(str(exc))
            continue
        opt.step()
        raise AssertionError("a DDP-wrapped model trained under DistributedFusedAdam")
    assert messages[0] == messages[1]
    return messages[0]


def test_model_wrapped_in_ddp_is_refused():
    """An optimizer that synchronises gradients itself must never also be wrapped in DDP."""
    messages = run_ranks(ddp_wrapped, 2)
    assert all("inside a DistributedDataParallel module" in m and "ddp.module" in m for m in messages)


def load_after_step(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    opt = DistributedFusedAdam(model.parameters(), lr=0.1, overlap_param_sync=True, bucket_cap_mb=TINY_BUCKET_MB)
    for _ in range(2):
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    model.load_state_dict(saved)  # the pending gathers land first, not over the loaded weights
    opt.param_sync()
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, saved[key], rtol=0, atol=0)


def test_model_load_after_step_is_not_overwritten_by_pending_gathers():
    run_ranks(load_after_step, 2)
