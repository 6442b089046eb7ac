"""FusedAdam against torch.optim.AdamW/Adam: updates, mixed precision, GradScaler, state dicts, errors."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from distopt import FusedAdam

import tolerances

STEPS = 20


def make_model(seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(12, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 7))
    return model.to(dtype)


def two_groups(model: nn.Module) -> list[dict]:
    """Two param groups with different lr and weight decay (the LayerNorm has none)."""
    return [
        {"params": list(model[0].parameters()) + list(model[3].parameters()), "lr": 3e-3, "weight_decay": 0.05},
        {"params": list(model[2].parameters()), "lr": 1e-2, "weight_decay": 0.0},
    ]


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int = STEPS, seed: int | torch.Generator = 1):
    """Runs `steps` steps on random batches from `seed` (a seed or a generator to continue);
    returns the params after every step."""
    gen = seed if isinstance(seed, torch.Generator) else torch.Generator().manual_seed(seed)
    history = []
    for _ in range(steps):
        x = torch.randn(16, 12, generator=gen).to(next(model.parameters()).dtype)
        y = torch.randn(16, 7, generator=gen).to(x.dtype)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        history.append([p.detach().clone() for p in model.parameters()])
    return history


def assert_history_close(actual, expected, table=tolerances.OPTIMIZER, dtype=torch.float32):
    for step, (a_params, e_params) in enumerate(zip(actual, expected)):
        for a, e in zip(a_params, e_params):
            try:
                tolerances.assert_close(a, e, table, dtype=dtype)
            except AssertionError as exc:
                raise AssertionError(f"step {step + 1}: {exc}") from None


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_matches_torch_over_steps(adam_w_mode):
    """fp32: every param after every one of 20 steps, two groups, within 1e-6 relative of torch."""
    torch_cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    ref_model, model = make_model(), make_model()
    ref = train(ref_model, torch_cls(two_groups(ref_model), betas=(0.8, 0.99), eps=1e-7))
    ours = train(model, FusedAdam(two_groups(model), betas=(0.8, 0.99), eps=1e-7, adam_w_mode=adam_w_mode))
    assert_history_close(ours, ref)


def test_negative_control_wrong_beta_is_caught():
    """The comparison above must notice a one-hyperparameter difference."""
    ref_model, model = make_model(), make_model()
    ref = train(ref_model, torch.optim.AdamW(two_groups(ref_model)), steps=3)
    ours = train(model, FusedAdam(two_groups(model), betas=(0.9, 0.99)), steps=3)
    with pytest.raises(AssertionError):
        assert_history_close(ours, ref)


def test_lr_scheduler_matches_torch():
    ref_model, model = make_model(), make_model()
    ref_opt, opt = torch.optim.AdamW(two_groups(ref_model)), FusedAdam(two_groups(model))
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=3, gamma=0.5)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    for _ in range(4):
        ref, ours = train(ref_model, ref_opt, steps=2), train(model, opt, steps=2)
        ref_sched.step()
        sched.step()
        assert_history_close(ours, ref)
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in ref_opt.param_groups]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_master_weights_exact_grads(dtype):
    """16-bit params with fp32 masters, fed grads exactly representable in 16 bits: the masters
    follow torch's fp32 AdamW within fp32 tolerance and each model param is its master rounded."""
    torch.manual_seed(0)
    shapes = [(33, 17), (65,), (4, 3, 5)]
    ref_params = [torch.randn(s) for s in shapes]
    params = [p.to(dtype) for p in ref_params]
    ref_params = [p.float() for p in params]  # same starting point
    ref_opt = torch.optim.AdamW(ref_params, lr=1e-2, weight_decay=0.1)
    opt = FusedAdam(params, lr=1e-2, weight_decay=0.1, master_weights=True)
    for _ in range(STEPS):
        for p, rp in zip(params, ref_params):
            p.grad = torch.randn(p.shape).to(dtype)
            rp.grad = p.grad.float()
        ref_opt.step()
        opt.step()
        for p, rp in zip(params, ref_params):
            master = opt.state[p]["param"]
            tolerances.assert_close(master, rp, tolerances.OPTIMIZER)
            assert torch.equal(p, master.to(dtype))


def test_16bit_params_without_master_weights_update_in_place():
    """Without master weights a bf16 param is updated directly (fp32 math), state stays fp32."""
    p = torch.randn(100, dtype=torch.bfloat16)
    before = p.clone()
    opt = FusedAdam([p], lr=1e-1)
    p.grad = torch.randn(100, dtype=torch.bfloat16)
    opt.step()
    assert not torch.equal(p, before)
    assert "param" not in opt.state[p]
    assert opt.state[p]["exp_avg"].dtype == torch.float32


def test_channels_last_param_keeps_its_layout():
    ref = torch.randn(4, 3, 5, 5).to(memory_format=torch.channels_last)
    p = ref.clone()
    ref_opt, opt = torch.optim.AdamW([ref], lr=1e-2), FusedAdam([p], lr=1e-2)
    for _ in range(5):
        g = torch.randn(4, 3, 5, 5).to(memory_format=torch.channels_last)
        ref.grad, p.grad = g.clone(), g.clone()
        ref_opt.step()
        opt.step()
    assert p.is_contiguous(memory_format=torch.channels_last)
    assert opt.state[p]["exp_avg"].is_contiguous(memory_format=torch.channels_last)
    tolerances.assert_close(p, ref, tolerances.OPTIMIZER)


def test_grad_with_other_strides_than_param():
    """A contiguous grad for a channels_last param is read in the param's memory order."""
    ref = torch.randn(2, 3, 4, 4).to(memory_format=torch.channels_last)
    p = ref.clone()
    ref_opt, opt = torch.optim.AdamW([ref], lr=1e-2), FusedAdam([p], lr=1e-2)
    g = torch.randn(2, 3, 4, 4)  # contiguous
    ref.grad, p.grad = g.clone(), g.clone()
    ref_opt.step()
    opt.step()
    tolerances.assert_close(p, ref, tolerances.OPTIMIZER)


def test_params_without_grad_are_left_alone():
    a, b = torch.randn(5), torch.randn(5)
    b_before = b.clone()
    opt = FusedAdam([a, b], lr=0.1)
    a.grad = torch.randn(5)
    opt.step()
    assert torch.equal(b, b_before) and b not in opt.state
    assert opt.state[a]["step"].item() == 1


def test_closure_is_called_and_its_loss_returned():
    model = make_model()
    opt = FusedAdam(model.parameters())
    x = torch.randn(4, 12)

    def closure():
        opt.zero_grad()
        loss = model(x).sum()
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert isinstance(loss, torch.Tensor) and all(opt.state[p]["step"].item() == 1 for p in model.parameters())


def test_zero_grad_sets_grads_to_none():
    model = make_model()
    opt = FusedAdam(model.parameters())
    model(torch.randn(2, 12)).sum().backward()
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())


# ----------------------------------------------------------------------------- GradScaler

# Steps at which a gradient is poisoned, and with what.
POISON = {2: float("inf"), 5: float("nan"), 6: float("-inf")}


def scaled_training(opt_cls, pattern: str, steps: int = 10, dtype=torch.float32, **opt_kw):
    """Trains with a CPU GradScaler (non-trivial factors, growth every step) and poisoned grads.
    pattern: "step" (scaler.step alone) or "unscale_clip" (scaler.unscale_ + clip_grad_norm_).
    Returns per step: (params, scale, optimizer state snapshot)."""
    model = make_model().to(dtype)
    opt = opt_cls(two_groups(model), **opt_kw)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_factor=3.0, backoff_factor=0.25,
                                  growth_interval=1)
    gen = torch.Generator().manual_seed(7)
    out = []
    for step in range(steps):
        x, y = torch.randn(16, 12, generator=gen).to(dtype), torch.randn(16, 7, generator=gen).to(dtype)
        opt.zero_grad()
        scaler.scale(nn.functional.mse_loss(model(x), y).float()).backward()
        index = int(torch.randint(0, 224, (1,), generator=gen))
        if step in POISON:
            model[3].weight.grad.view(-1)[index] = POISON[step]
        if pattern == "unscale_clip":
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
        elif pattern == "unscale_grads_clip":  # distopt's own calls: nothing rewrites the grads
            opt.unscale_grads(grad_scaler=scaler)
            opt.clip_grad_norm(0.5)
        elif pattern == "stock_unscale_our_clip":
            scaler.unscale_(opt)
            opt.clip_grad_norm(0.5)
        scaler.step(opt)
        scaler.update()
        snapshot = [{k: v.clone() for k, v in s.items()} for s in opt.state.values()]
        out.append(([p.detach().clone() for p in model.parameters()], scaler.get_scale(), snapshot))
    return out


def assert_scaled_runs_match(ours, ref, dtype=torch.float32):
    for step, ((r_params, r_scale, _), (o_params, o_scale, o_state)) in enumerate(zip(ref, ours)):
        assert o_scale == r_scale, f"step {step}: scale {o_scale} != {r_scale}"
        assert_history_close([o_params], [[p.to(dtype) for p in r_params]], dtype=dtype)
        if step in POISON:  # skipped: every byte of optimizer state and params as before
            prev_params, _, prev_state = ours[step - 1]
            assert len(o_state) == len(prev_state)
            for state, before in zip(o_state, prev_state):
                for name, value in state.items():
                    assert torch.equal(value, before[name]), f"step {step}: {name} changed"
            assert all(torch.equal(a, b) for a, b in zip(o_params, prev_params))
    scales = [s for _, s, _ in ours]  # backed off at poisoned steps, grown otherwise
    assert scales[2] == scales[1] * 0.25 and scales[3] == scales[2] * 3.0


@pytest.mark.parametrize("pattern", ["step", "unscale_clip", "unscale_grads_clip", "stock_unscale_our_clip"])
def test_grad_scaler_matches_torch_and_skips_poisoned_steps(pattern):
    """The three AMP call patterns (and torch's own clip on FusedAdam) against torch's recipe."""
    reference = "step" if pattern == "step" else "unscale_clip"
    assert_scaled_runs_match(scaled_training(FusedAdam, pattern), scaled_training(torch.optim.AdamW, reference))


def test_clip_grad_norm_without_scaler_matches_torch():
    """opt.clip_grad_norm returns torch's norm and clips lazily to the same params."""
    ref_model, model = make_model(), make_model()
    ref_opt, opt = torch.optim.AdamW(two_groups(ref_model)), FusedAdam(two_groups(model))
    gen = torch.Generator().manual_seed(3)
    for _ in range(5):
        x, y = torch.randn(16, 12, generator=gen), torch.randn(16, 7, generator=gen)
        for m, o in ((ref_model, ref_opt), (model, opt)):
            o.zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 0.2)
        norm = opt.clip_grad_norm(0.2)
        assert ref_norm > 0.2  # clipping is active
        torch.testing.assert_close(norm, ref_norm, rtol=1e-6, atol=0)
        ref_opt.step()
        opt.step()
        assert_history_close([list(model.parameters())], [list(ref_model.parameters())])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_grad_scaler_with_master_weights(dtype):
    """A 16-bit model with fp32 masters and a torch AdamW on fp32 copies receive the same scaled
    grads through one GradScaler (poisoned at some steps): the masters follow torch's params within
    fp32 tolerance, skipped steps change nothing, and the model params are the masters rounded."""
    model = make_model().to(dtype)
    ref_params = [p.detach().float().requires_grad_() for p in model.parameters()]
    opt = FusedAdam(model.parameters(), lr=1e-2, master_weights=True)
    ref_opt = torch.optim.AdamW(ref_params, lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_factor=2.0, backoff_factor=0.25,
                                  growth_interval=1)
    gen = torch.Generator().manual_seed(3)
    for step in range(8):
        opt.zero_grad()
        x = torch.randn(8, 12, generator=gen).to(dtype)
        scaler.scale(model(x).float().square().mean()).backward()
        if step in POISON:
            model[0].weight.grad.view(-1)[int(torch.randint(0, 384, (1,), generator=gen))] = POISON[step]
        for p, rp in zip(model.parameters(), ref_params):
            rp.grad = p.grad.float()
        masters_before = [s["param"].clone() for s in opt.state.values()]
        scaler.step(opt)
        scaler.step(ref_opt)
        scaler.update()
        for p, rp in zip(model.parameters(), ref_params):
            tolerances.assert_close(opt.state[p]["param"], rp, tolerances.OPTIMIZER)
            assert torch.equal(p, opt.state[p]["param"].to(dtype))
        if step in POISON:
            assert all(torch.equal(s["param"], b) for s, b in zip(opt.state.values(), masters_before))


# ----------------------------------------------------------------------------- state dicts


def test_torch_state_dict_round_trip():
    """torch AdamW -> FusedAdam -> torch AdamW mid-run: every step matches the uninterrupted torch run."""
    ref_model = make_model()
    ref_opt = torch.optim.AdamW(two_groups(ref_model))
    train(ref_model, ref_opt, steps=5, seed=1)
    expected = train(ref_model, ref_opt, steps=10, seed=2)

    torch_model = make_model()
    torch_opt = torch.optim.AdamW(two_groups(torch_model))
    train(torch_model, torch_opt, steps=5, seed=1)
    model = copy.deepcopy(torch_model)
    opt = FusedAdam(two_groups(model), lr=123.0)  # lr comes back from the state dict
    opt.load_state_dict(torch_opt.state_dict())
    assert [g["lr"] for g in opt.param_groups] == [3e-3, 1e-2]
    batches = torch.Generator().manual_seed(2)
    ours = train(model, opt, steps=5, seed=batches)

    back_opt = torch.optim.AdamW(two_groups(model), lr=99.0)
    back_opt.load_state_dict(opt.state_dict())
    ours += train(model, back_opt, steps=5, seed=batches)
    assert_history_close(ours, expected)


def test_state_dict_round_trip_continues_identically():
    model_a = make_model()
    opt_a = FusedAdam(two_groups(model_a))
    train(model_a, opt_a, steps=3)
    model_b = copy.deepcopy(model_a)
    opt_b = FusedAdam(two_groups(model_b), lr=5.0)
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))
    hist_a = train(model_a, opt_a, steps=4, seed=9)
    hist_b = train(model_b, opt_b, steps=4, seed=9)
    for a_params, b_params in zip(hist_a, hist_b):
        assert all(torch.equal(a, b) for a, b in zip(a_params, b_params))


def test_load_state_dict_rejects_mismatch_and_changes_nothing():
    model = make_model()
    opt = FusedAdam(two_groups(model))
    train(model, opt, steps=2)
    before = copy.deepcopy(opt.state_dict())
    bad = copy.deepcopy(before)
    bad["state"][0]["exp_avg"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match="shape"):
        opt.load_state_dict(bad)
    bad = copy.deepcopy(before)
    bad["param_groups"] = bad["param_groups"][:1]
    with pytest.raises(ValueError, match="param groups"):
        opt.load_state_dict(bad)
    after = opt.state_dict()
    for key, state in before["state"].items():
        assert all(torch.equal(v, after["state"][key][k]) for k, v in state.items())
    assert before["param_groups"] == after["param_groups"]


def test_master_weights_state_dict_carries_masters():
    model = make_model().to(torch.bfloat16)
    opt = FusedAdam(model.parameters(), master_weights=True)
    train(model, opt, steps=2)
    sd = opt.state_dict()
    assert all("param" in s and s["param"].dtype == torch.float32 for s in sd["state"].values())
    model2 = copy.deepcopy(model)
    opt2 = FusedAdam(model2.parameters(), master_weights=True)
    opt2.load_state_dict(sd)
    for p, p2 in zip(model.parameters(), model2.parameters()):
        assert torch.equal(opt.state[p]["param"], opt2.state[p2]["param"])


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(lr=-1e-3), "learning rate"),
        (dict(eps=-1.0), "epsilon"),
        (dict(betas=(1.0, 0.999)), "beta"),
        (dict(betas=(0.9, -0.1)), "beta"),
        (dict(weight_decay=-0.1), "weight_decay"),
    ],
)
def test_bad_hyperparameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FusedAdam([torch.randn(3, requires_grad=True)], **kwargs)


@pytest.mark.parametrize("options", [{}, {"offload_optimizer": True}], ids=str)
def test_param_listed_twice_in_a_group_warns_and_steps_as_adamw(options):
    """torch's warning, and one update per listing, as AdamW's for-loop (its default on the CPU):
    the same params and step counts after every step; across groups, torch's ValueError."""
    def run(opt_cls, **kwargs):
        torch.manual_seed(0)
        p, q, r = nn.Parameter(torch.randn(3)), nn.Parameter(torch.randn(2)), nn.Parameter(torch.randn(4))
        with pytest.warns(UserWarning, match="a parameter group with duplicate parameters"):
            opt = opt_cls([{"params": [p, q, p, p]}, {"params": [r], "lr": 0.1}], lr=0.05, weight_decay=0.1, **kwargs)
        history = []
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            for t in (p, q, r):
                t.grad = torch.randn(t.shape, generator=g)
            opt.step()
            history.append([t.detach().clone() for t in (p, q, r)] + [opt.state[t]["step"] for t in (p, q, r)])
        return history

    expected = run(torch.optim.AdamW, foreach=False)
    for got, ref in zip(run(FusedAdam, **options), expected):
        for a, e in zip(got, ref):
            tolerances.assert_close(a, e, tolerances.OPTIMIZER)
    p = nn.Parameter(torch.randn(3))
    with pytest.raises(ValueError, match="more than one parameter group"):
        FusedAdam([{"params": [p]}, {"params": [p]}])


def test_mixed_devices_rejected():
    with pytest.raises(ValueError, match="one device"):
        FusedAdam([torch.randn(3, requires_grad=True), torch.randn(3, device="meta", requires_grad=True)])


def test_capturable_on_cpu_rejected():
    with pytest.raises(ValueError, match="CUDA"):
        FusedAdam([torch.randn(3, requires_grad=True)], capturable=True)


def test_rejected_param_group_leaves_optimizer_unchanged():
    p = nn.Parameter(torch.randn(3))
    opt = FusedAdam([p])
    with pytest.raises(ValueError, match="learning rate"):
        opt.add_param_group({"params": [nn.Parameter(torch.randn(2))], "lr": -1.0})
    assert len(opt.param_groups) == 1


def test_sparse_grad_rejected_before_anything_changes():
    good = nn.Parameter(torch.randn(4, 3))
    emb = nn.Embedding(10, 3, sparse=True)
    emb(torch.tensor([1, 2])).sum().backward()
    good.grad = torch.randn(4, 3)
    opt = FusedAdam([{"params": [good]}, {"params": [emb.weight]}])
    before = good.detach().clone()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()
    assert torch.equal(good, before) and len(opt.state) == 0


def test_integer_params_rejected():
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        FusedAdam([torch.zeros(3, dtype=torch.int32)])
