"""DistributedFusedAdam on a one-rank group: no collectives, and the same bits as FusedAdam.

At world size 1 the reduce-scatter and all-gather are the identity, so the optimizer skips them
(local copies or nothing) and updates the model params in place. The update is then FusedAdam's
exactly: the same fused kernel on the same fp32 values (grads copied, never divided; the deferred
grad scale is 1.0 or the same inverse loss scale), so params, moments and masters are compared
bit for bit, through no_sync() accumulation, a GradScaler step skipped for inf grads, checkpoint
round trips both ways and params whose storage is replaced. Clipping is compared with a tolerance:
the global norm sums the same squares in another order (per tensor vs one flat shard), so the clip
coefficient may differ in the last bit.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from test_soak import finish_step
from torch import nn

from distopt import DistributedFusedAdam, FusedAdam
from distopt.distributed import comm as comm_module

from harness import run_ranks

TINY_BUCKET_MB = 64 * 4 / 2**20  # 64 fp32 elements: params split over buckets


class Net(nn.Module):
    """A channels_last conv, two linears and a bare param of odd size."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.fc1 = nn.Linear(64, 16)
        self.fc2 = nn.Linear(16, 5)
        self.scale = nn.Parameter(torch.rand(5) + 0.5)

    skip_scale = False  # leave `scale` out of the forward (it gets no gradient)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.conv(x)).flatten(1)
        out = self.fc2(torch.tanh(self.fc1(h)))
        return out if self.skip_scale else out * self.scale


def make(dtype: torch.dtype) -> Net:
    torch.manual_seed(0)
    return Net().to(dtype=dtype, memory_format=torch.channels_last)


def data(step: int, micro: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + micro)
    x = torch.randn(8, 3, 6, 6, generator=g).to(dtype).contiguous(memory_format=torch.channels_last)
    return x, torch.randn(8, 5, generator=g)


def train(
    model: nn.Module,
    opt,
    steps: range,
    micro: int = 1,
    scaler=None,
    clip: float | None = None,
    inf_step: int | None = None,
    skip_scale: bool = False,
) -> list[float]:
    """`steps` iterations of `micro` micro-batches (no_sync() for all but the last, where the optimizer
    has it); returns the clip norms."""
    norms = []
    for step in steps:
        for m in range(micro):
            last = m == micro - 1
            ctx = opt.no_sync() if not last and hasattr(opt, "no_sync") else contextlib.nullcontext()
            with ctx:
                model.skip_scale = skip_scale and step % 2 == 1
                x, y = data(step, m, next(model.parameters()).dtype)
                loss = F.mse_loss(model(x).float(), y)
                if step == inf_step and m == 0:
                    loss = loss * math.inf  # inf/nan grads: the step must change nothing
                (scaler.scale(loss) if scaler is not None else loss).backward()
        if clip is not None:
            if scaler is not None:
                opt.unscale_grads(grad_scaler=scaler)
            norms.append(float(opt.clip_grad_norm(clip)))
        if skip_scale and not hasattr(opt, "no_sync"):  # DistributedFusedAdam's semantics: no grad is a zero grad
            for p in model.parameters():
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
        finish_step(opt, scaler)
    return norms


def pair(opts: dict, dtype: torch.dtype, lr: float = 1e-2):
    models = make(dtype), make(dtype)
    ours = DistributedFusedAdam(models[0].parameters(), lr=lr, weight_decay=0.05, **opts)
    ref = FusedAdam(models[1].parameters(), lr=1e-2, weight_decay=0.05, master_weights=dtype != torch.float32)
    return models, ours, ref


def snapshot(model: nn.Module, opt) -> dict[str, torch.Tensor]:
    """Params, and the fp32 state as a state dict holds it (masters included), keyed alike for both."""
    out = {f"model {i}": p.detach().clone() for i, p in enumerate(model.parameters())}
    for key, entry in opt.state_dict()["state"].items():
        for name in ("exp_avg", "exp_avg_sq", "param"):
            if name in entry:
                out[f"{name} {key}"] = entry[name].detach().float().reshape(-1).clone()
        out[f"step {key}"] = torch.as_tensor(float(entry["step"]))
    return out


def assert_bitwise(ours: dict, ref: dict) -> None:
    # Everything but "param": an fp32 model's state dict holds its params as masters in one, not the other.
    common = ours.keys() & ref.keys()
    assert {k for k in ours.keys() | ref.keys() if not k.startswith("param ")} <= common, (sorted(ours), sorted(ref))
    for key in sorted(common):
        a, b = ours[key], ref[key]
        assert a.dtype == b.dtype and a.shape == b.shape, key
        assert torch.equal(a, b), f"{key}: max difference {float((a.float() - b.float()).abs().max()):g}"


# --------------------------------------------------------------------------------- bit-identical

CONFIGS = {
    "default": (torch.float32, {}),
    "no_overlap": (torch.float32, dict(overlap_grad_sync=False)),
    "overlap_param_sync": (torch.float32, dict(overlap_param_sync=True)),
    "contiguous_buffers": (torch.float32, dict(contiguous_grad_buffer=True, contiguous_param_buffer=True)),
    "split_params": (torch.float32, dict(bucket_cap_mb=TINY_BUCKET_MB)),
    "fp32_stored_masters": (torch.float32, dict(store_params=True)),
    "bf16_masters": (torch.bfloat16, {}),
    "bf16_masters_split": (torch.bfloat16, dict(bucket_cap_mb=TINY_BUCKET_MB)),
}


def bitwise_case(rank: int, world_size: int, name: str, micro: int, lr: float) -> None:
    dtype, opts = CONFIGS[name]
    (m0, m1), ours, ref = pair(opts, dtype, lr)
    train(m0, ours, range(4), micro)
    train(m1, ref, range(4), micro)
    assert_bitwise(snapshot(m0, ours), snapshot(m1, ref))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_matches_fused_adam_bitwise(name):
    run_ranks(bitwise_case, 1, (name, 1, 1e-2))


def unused_param_case(rank: int, world_size: int, name: str) -> None:
    """A param without a gradient every other step counts as a zero gradient (and its shard, holding
    the previous step's gradient where the one-rank bucket accumulates in place, is zeroed)."""
    dtype, opts = CONFIGS[name]
    (m0, m1), ours, ref = pair(opts, dtype)
    train(m0, ours, range(5), micro=2, skip_scale=True)
    train(m1, ref, range(5), micro=2, skip_scale=True)
    assert_bitwise(snapshot(m0, ours), snapshot(m1, ref))


@pytest.mark.parametrize("name", ["default", "split_params", "contiguous_buffers"])
def test_params_without_gradients_match_bitwise(name):
    run_ranks(unused_param_case, 1, (name,))


def test_no_sync_accumulation_matches_bitwise():
    run_ranks(bitwise_case, 1, ("default", 3, 1e-2))
    run_ranks(bitwise_case, 1, ("contiguous_buffers", 3, 1e-2))


def test_negative_control_another_lr_is_caught():
    with pytest.raises(AssertionError, match="max difference"):
        run_ranks(bitwise_case, 1, ("default", 1, 1.0001e-2))


def remainders_case(rank: int, world_size: int) -> None:
    """bf16 params with int16 remainders: the fp32 masters they encode are FusedAdam's masters."""
    (m0, m1), ours, ref = pair(dict(store_param_remainders=True), torch.bfloat16)
    train(m0, ours, range(4))
    train(m1, ref, range(4))
    a, b = snapshot(m0, ours), snapshot(m1, ref)
    assert_bitwise(
        {k: v for k, v in a.items() if not k.startswith("model ")},
        {k: v for k, v in b.items() if not k.startswith("model ")},
    )
    for key in (k for k in a if k.startswith("model ")):  # the bf16 params are the masters' high halves
        assert (a[key].float() - b[key].float()).abs().le(b[key].float().abs() * 2**-7).all(), key


def test_bf16_remainders_encode_fused_adam_masters():
    run_ranks(remainders_case, 1)


# --------------------------------------------------------------------- scaler, clip, checkpoints


def scaler_case(rank: int, world_size: int, clip: float | None) -> list[list[float]]:
    (m0, m1), ours, ref = pair({}, torch.float32)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=2) for _ in range(2)]
    before = None
    norms = []
    for model, opt, scaler in zip((m0, m1), (ours, ref), scalers):
        norms.append(train(model, opt, range(2), scaler=scaler, clip=clip))
        before = snapshot(model, opt) if opt is ours else before
        scale = scaler.get_scale()
        norms[-1] += train(model, opt, range(2, 3), scaler=scaler, clip=clip, inf_step=2)
        assert scaler.get_scale() == scale / 2  # the scaler saw the inf grads and backed off
        if opt is ours:
            assert_bitwise(snapshot(model, opt), before)  # the inf step changed nothing
        norms[-1] += train(model, opt, range(3, 5), scaler=scaler, clip=clip)
    assert scalers[0].get_scale() == scalers[1].get_scale()
    a, b = snapshot(m0, ours), snapshot(m1, ref)
    if clip is None:
        assert_bitwise(a, b)
    else:
        for key in sorted(a.keys() & b.keys()):
            torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6, msg=key)
    return norms


def test_grad_scaler_skips_inf_steps_bitwise():
    run_ranks(scaler_case, 1, (None,))


def test_grad_scaler_with_clipping_matches():
    ours, ref = run_ranks(scaler_case, 1, (0.05,))[0]
    assert len(ours) == len(ref) == 5 and ours[0] > 0.05  # the clip acts
    finite = [(a, b) for a, b in zip(ours, ref) if math.isfinite(b)]
    assert len(finite) == 4 and all(math.isclose(a, b, rel_tol=1e-5) for a, b in finite)


def checkpoint_case(rank: int, world_size: int, opts: dict) -> None:
    """Save after 2 steps; the run going on, a new DistributedFusedAdam and a FusedAdam loading it
    take the same next 2 steps, bit for bit, and a FusedAdam state dict loads back too."""
    dtype = torch.float32
    (m0, _), ours, _ = pair(opts, dtype)
    train(m0, ours, range(2))
    saved, saved_params = ours.state_dict(), [p.detach().clone() for p in m0.parameters()]
    train(m0, ours, range(2, 4))
    expected = snapshot(m0, ours)

    def fresh(cls, **kw):
        model = make(dtype)
        with torch.no_grad():
            for p, v in zip(model.parameters(), saved_params):
                p.copy_(v)
        opt = cls(model.parameters(), lr=1e-2, weight_decay=0.05, **kw)
        return model, opt

    m1, dfa = fresh(DistributedFusedAdam, **opts)
    with torch.no_grad():
        for p in m1.parameters():
            p.add_(1.0)  # the load must write the params from the saved masters
    dfa.load_state_dict(saved)
    train(m1, dfa, range(2, 4))
    assert_bitwise(snapshot(m1, dfa), expected)

    m2, fused = fresh(FusedAdam)
    fused.load_state_dict(saved)
    train(m2, fused, range(2, 4))
    assert_bitwise(snapshot(m2, fused), expected)

    m3, fused = fresh(FusedAdam)  # and back: FusedAdam's state dict into DistributedFusedAdam
    fused.load_state_dict(saved)
    m4, dfa = fresh(DistributedFusedAdam, **opts)
    dfa.load_state_dict(fused.state_dict())
    train(m4, dfa, range(2, 4))
    assert_bitwise(snapshot(m4, dfa), expected)


@pytest.mark.parametrize(
    "opts",
    [{}, dict(bucket_cap_mb=TINY_BUCKET_MB, overlap_param_sync=True), dict(contiguous_param_buffer=True)],
    ids=["default", "split_overlap", "contiguous"],
)
def test_checkpoint_round_trips_bitwise(opts):
    run_ranks(checkpoint_case, 1, (opts,))


def replaced_storage_case(rank: int, world_size: int) -> None:
    """Params whose .data is replaced between steps (a new storage, same values) keep training."""
    (m0, m1), ours, ref = pair(dict(bucket_cap_mb=TINY_BUCKET_MB), torch.float32)
    for model, opt in ((m0, ours), (m1, ref)):
        train(model, opt, range(2))
        for p in model.parameters():
            p.data = p.data.clone()
        train(model, opt, range(2, 4))
    assert_bitwise(snapshot(m0, ours), snapshot(m1, ref))


def test_replaced_param_storage_is_followed():
    run_ranks(replaced_storage_case, 1)


# ---------------------------------------------------------------------------------- no collectives


def no_collectives_case(rank: int, world_size: int, opts: dict) -> int:
    """Steps after the first (which builds the layout and checks the ranks agree) call no collective."""
    model = make(torch.float32)
    opt = DistributedFusedAdam(model.parameters(), lr=1e-2, **opts)
    train(model, opt, range(1))
    called = []

    def refuse(name):
        def collective(*args, **kwargs):
            called.append(name)
            raise AssertionError(f"{name} called")

        return collective

    saved = {}
    for module, names in (
        (dist, ("all_reduce", "broadcast", "all_gather", "barrier", "reduce_scatter_tensor", "all_gather_into_tensor")),
        (comm_module, ("_reduce_scatter", "_all_gather")),
    ):
        for name in names:
            saved[module, name] = getattr(module, name)
            setattr(module, name, refuse(name))
    try:
        with contextlib.suppress(AssertionError):
            train(model, opt, range(1, 4), micro=2, clip=1.0)
            opt.param_sync()
    finally:
        for (module, name), fn in saved.items():
            setattr(module, name, fn)
    return len(called)


@pytest.mark.parametrize(
    "opts",
    [
        {},
        dict(overlap_param_sync=True, bucket_cap_mb=TINY_BUCKET_MB),
        dict(grad_sync_dtype=torch.bfloat16, param_sync_dtype=torch.bfloat16),
    ],
    ids=["default", "overlap_split", "bf16_sync"],
)
def test_no_collectives_at_world_size_one(opts):
    assert run_ranks(no_collectives_case, 1, (opts,)) == [0]


def test_negative_control_two_ranks_communicate():
    assert all(n > 0 for n in run_ranks(no_collectives_case, 2, ({},)))


def bf16_sync_case(rank: int, world_size: int) -> None:
    """An fp32 model synchronised in bf16 keeps the bf16 rounding at one rank too: its params are its
    masters rounded to bf16, as a gather in bf16 would leave them."""
    model = make(torch.float32)
    opt = DistributedFusedAdam(model.parameters(), lr=1e-2, param_sync_dtype=torch.bfloat16)
    train(model, opt, range(3))
    masters = opt.state_dict()["state"]
    for i, p in enumerate(model.parameters()):
        master = masters[i]["param"]
        assert not torch.equal(master, p.detach()), i  # the negative control: they differ...
        assert torch.equal(master.bfloat16().float(), p.detach()), i  # ...by the rounding only


def test_bf16_param_sync_rounds_at_world_size_one():
    run_ranks(bf16_sync_case, 1)


def replaced_storage_two_ranks(rank: int, world_size: int) -> None:
    """With two ranks, the copies between the params and the gathered buffer (whose model side is
    built once) follow params whose .data is replaced, split over buckets or not."""
    models = make(torch.float32), make(torch.float32)
    opts = [DistributedFusedAdam(m.parameters(), lr=1e-2, bucket_cap_mb=TINY_BUCKET_MB) for m in models]
    for i, (model, opt) in enumerate(zip(models, opts)):
        train(model, opt, range(2))
        if i == 0:
            for p in model.parameters():
                p.data = p.data.clone()
        train(model, opt, range(2, 4))
    assert_bitwise(snapshot(models[0], opts[0]), snapshot(models[1], opts[1]))


def test_replaced_param_storage_is_followed_on_two_ranks():
    run_ranks(replaced_storage_two_ranks, 2)
