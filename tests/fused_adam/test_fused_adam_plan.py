"""FusedAdam's step plan (distopt/fused_adam/plan.py): the steady-state step reuses its kernel lists, does
no Python work per param, and gives exactly the general step's bits through every change the plan
must notice (grads replaced, kept, missing or in another layout; groups added; hyperparameters
changed; state loaded; storage replaced; packed moments given other memory or replaced; a step count
edited in place), with complex params and
params not dense in memory among the others (distopt/kernel_views.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distopt import FusedAdam

from call_count import python_calls


def make_params() -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    conv = torch.randn(6, 3, 3, 3, generator=g).contiguous(memory_format=torch.channels_last)
    return [
        nn.Parameter(conv),
        nn.Parameter(torch.randn(7, 5, generator=g)),
        nn.Parameter(torch.randn(33, generator=g).bfloat16()),
        nn.Parameter(torch.randn(1, generator=g)),
        nn.Parameter(torch.randn(4, 6, dtype=torch.complex64, generator=g)),  # stepped as its real view
        nn.Parameter(torch.randn(5, 3, 2, generator=g)[..., 0].bfloat16()),  # not dense: a contiguous copy
    ]


def grad_for(p: torch.Tensor, step: int, i: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + i)
    # p's layout (contiguous for a param that is not dense: autograd's)
    return torch.empty_like(p, dtype=dtype or p.dtype).copy_(torch.randn(p.shape, dtype=p.dtype, generator=g))


def stepped(steps: int) -> tuple[list[nn.Parameter], FusedAdam]:
    """make_params() after `steps` steps of FusedAdam(master_weights=True) with grad_for's gradients."""
    params = make_params()
    opt = FusedAdam(params, master_weights=True)
    for step in range(steps):
        for i, p in enumerate(params):
            p.grad = grad_for(p, step, i)
        opt.step()
    return params, opt


class Counter:
    """Counts planned kernel calls (FusedAdam._run_call) of one optimizer."""

    def __init__(self, opt: FusedAdam) -> None:
        self.calls = 0
        run = opt._run_call

        def counted(*args, **kwargs):
            self.calls += 1
            return run(*args, **kwargs)

        opt._run_call = counted


def scenario(opt: FusedAdam, params: list[nn.Parameter], extra: nn.Parameter) -> list[dict[str, torch.Tensor]]:
    """Fifteen steps with a change before most; a snapshot of params and state after each."""
    snapshots, saved = [], None
    for step in range(15):
        if step == 14:  # a new param swapped into a group's list (same list, same length)
            new = nn.Parameter(params[3].detach().clone() + 1)
            opt.param_groups[1]["params"][1] = new
            params[3] = new
        if step == 2:  # packed moments (plan.pack_moments) given other memory, keeping their identity
            m = opt.state[params[0]]["exp_avg"]
            m.data = m.data * 0.5
            v = opt.state[params[1]]["exp_avg_sq"]
            v.set_(v.detach() * 2)
        if step == 7:  # a packed moment replaced by assignment
            opt.state[params[2]]["exp_avg"] = opt.state[params[2]]["exp_avg"] * 0.5
        if step == 3:  # the same grad tensors, changed in place
            for p in params:
                p.grad.mul_(0.5)
        else:
            for i, p in enumerate(params):
                p.grad = grad_for(p, step, i)
        if step == 4:
            params[1].grad = None  # a param without a gradient is skipped
        if step == 5:
            params[0].grad = params[0].grad.contiguous()  # another layout than the channels_last param
        if step == 6:
            opt.load_state_dict(saved)
        if step == 7:
            g = opt.param_groups[0]
            g.update(
                lr=3e-3,
                betas=(0.8, 0.99),
                weight_decay=0.3,
                maximize=True,
                adam_w_mode=False,
                decoupled_weight_decay=False,
            )
        if step == 8:
            opt.add_param_group({"params": [extra], "lr": 5e-3})
            params = [*params, extra]
            extra.grad = grad_for(extra, step, 99)
        if step == 9:
            params[1].data = params[1].data.clone()  # new storage, same values
            params[2].grad_dtype = None  # torch then takes a grad of another dtype
            params[2].grad = grad_for(params[2], step, 2, torch.float32)  # an fp32 grad for a bf16 param
        if step == 11:
            next(iter(opt.state.values()))["step"].add_(3)  # one step count edited in place
        if step == 12:  # a param's whole state replaced by a new dict (same keys, one moment doubled)
            old = opt.state[params[0]]
            opt.state[params[0]] = {**{k: v.clone() for k, v in old.items()}, "exp_avg_sq": old["exp_avg_sq"] * 2}
        if step == 13:  # a moment replaced by assignment, not in place
            opt.state[params[1]]["exp_avg"] = opt.state[params[1]]["exp_avg"] * 0.5
        opt.step()
        if step == 2:
            saved = opt.state_dict()
            saved = {
                "state": {
                    k: {n: v.clone() if torch.is_tensor(v) else v for n, v in s.items()}
                    for k, s in saved["state"].items()
                },
                "param_groups": saved["param_groups"],
            }
        snap = {f"param {i}": p.detach().clone() for i, p in enumerate(params)}
        for i, p in enumerate(params):
            for name, value in opt.state.get(p, {}).items():
                snap[f"{name} {i}"] = value.detach().clone()
        snapshots.append(snap)
    return snapshots


def run(planned: bool, unchecked_addresses: bool = False) -> tuple[list[dict[str, torch.Tensor]], int]:
    params, extra = make_params(), nn.Parameter(torch.randn(9, generator=torch.Generator().manual_seed(5)))
    opt = FusedAdam(
        [{"params": params[:2]}, {"params": params[2:], "lr": 2e-3, "weight_decay": 0.0}], lr=1e-2, master_weights=True
    )
    counter = Counter(opt)
    if not planned:  # the general step, every time
        opt.register_step_pre_hook(lambda o, args, kwargs: setattr(o, "_plan", None))
    if unchecked_addresses:  # (a negative control: the plan's check of its packed moments removed)
        def unchecked(o, args, kwargs) -> None:
            for call in o._plan.calls if o._plan else ():
                call.addresses = call.packed_ptrs.__getitem__  # the state always "at" the planned addresses

        opt.register_step_pre_hook(unchecked)
    return scenario(opt, params, extra), counter.calls


def mismatches(a: list[dict[str, torch.Tensor]], b: list[dict[str, torch.Tensor]]) -> list[str]:
    assert len(a) == len(b) and all(x.keys() == y.keys() for x, y in zip(a, b))
    return [f"step {step}: {key}" for step, (x, y) in enumerate(zip(a, b)) for key in x
            if not (x[key].dtype == y[key].dtype and torch.equal(x[key], y[key]))]


def test_planned_steps_match_the_general_step_bitwise():
    planned, calls = run(planned=True)
    general, none = run(planned=False)
    assert none == 0 and calls > 0, (calls, none)  # the plan was used, and only where enabled
    assert mismatches(planned, general) == []


def test_negative_control_packed_moments_unchecked_miss_what_the_scenario_changes():
    """Without the plan's address check of its packed moments, the moments given other memory (step 2) are
    missed: the planned steps go wrong from step 2 on."""
    wrong = mismatches(run(planned=True, unchecked_addresses=True)[0], run(planned=False)[0])
    assert wrong and min(int(w.split(":")[0].split()[1]) for w in wrong) == 2, wrong


def dtype_change_run(planned: bool, changed: int, master_weights: bool) -> list[torch.Tensor]:
    """Params and state after 5 steps of 3 fp32 params in one call, param `changed` made bf16 before step 3."""
    g = torch.Generator().manual_seed(0)
    params = [nn.Parameter(torch.randn(5, generator=g)) for _ in range(3)]
    opt = FusedAdam(params, master_weights=master_weights)
    if not planned:
        opt.register_step_pre_hook(lambda o, args, kwargs: setattr(o, "_plan", None))
    for step in range(5):
        if step == 3:
            params[changed].data = params[changed].data.bfloat16()
        for p in params:
            p.grad = torch.randn(5, generator=g).to(p.dtype)
        opt.step()
    assert params[changed].dtype == torch.bfloat16
    return [p.detach().clone() for p in params] + [v.clone() for s in opt.state.values() for v in s.values()]


@pytest.mark.parametrize("master_weights", [False, True])
@pytest.mark.parametrize("changed", [0, 1])
def test_a_param_whose_dtype_changed_is_stepped_as_the_general_step_steps_it(changed, master_weights):
    """The plan checks its first param's dtype; the kernel refuses a list of mixed dtypes before writing
    anything, and that step goes the general way."""
    planned, general = dtype_change_run(True, changed, master_weights), dtype_change_run(False, changed, master_weights)
    assert len(planned) == len(general)
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(planned, general))


def test_state_keeps_torchs_format():
    params, opt = stepped(3)
    for p in params:
        step = opt.state[p]["step"]
        assert step.shape == () and step.dtype == torch.float32 and step.device.type == "cpu" and float(step) == 3.0
    torch_params = [nn.Parameter(p.detach().to(torch.complex64 if p.is_complex() else torch.float32)) for p in params]
    torch_opt = torch.optim.AdamW(torch_params)
    torch_opt.load_state_dict(opt.state_dict())  # and torch.optim takes it
    assert [float(s["step"]) for s in torch_opt.state.values()] == [3.0] * len(params)


def python_calls_per_step(count: int, planned: bool = True, extra: list[nn.Parameter] = ()) -> int:
    """Python function calls made by one steady-state step of `count` params and the `extra` ones
    (`planned=False`: with the plan dropped before every step, so each takes the general way)."""
    params = [nn.Parameter(torch.randn(4)) for _ in range(count)] + list(extra)
    opt = FusedAdam(params)
    if not planned:
        opt.register_step_pre_hook(lambda o, args, kwargs: setattr(o, "_plan", None))
    for _ in range(3):
        for p in params:
            p.grad = torch.randn(p.shape, dtype=p.dtype)
        opt.step()
    return python_calls(opt.step)


def test_steady_state_does_no_python_work_per_param():
    assert python_calls_per_step(10) == python_calls_per_step(300)


def test_complex_and_non_dense_params_cost_nothing_per_dense_param():
    """With a complex param and one not dense in memory beside them (their own calls, whose lists are
    rebuilt every step), the steady state still does no Python work per ordinary param."""
    def extra():
        return [nn.Parameter(torch.randn(3, dtype=torch.complex64)), nn.Parameter(torch.randn(4, 2)[:, 0])]

    assert python_calls_per_step(10, extra=extra()) == python_calls_per_step(300, extra=extra())
    assert python_calls_per_step(10, extra=extra()) > python_calls_per_step(10)  # (they do cost their own)


def test_python_calls_leaves_out_the_garbage_collectors_callbacks():
    """A collection inside the counted call would run the gc.callbacks others registered (hypothesis does,
    and forked ranks inherit it): not the call's work, so the count leaves them out. Control: the same
    allocations with the collector on run the callback."""
    import gc

    hits: list[str] = []

    def callback(phase, info):
        hits.append(phase)

    def allocate():
        return [[] for _ in range(50 * gc.get_threshold()[0])]

    gc.callbacks.append(callback)
    try:
        assert python_calls(allocate) == 2 and hits == []  # the call and its comprehension
        allocate()
        assert "start" in hits  # control: those allocations do trigger a collection
    finally:
        gc.callbacks.remove(callback)


def test_negative_control_the_general_step_works_per_param():
    assert python_calls_per_step(300, planned=False) > python_calls_per_step(10, planned=False) + 290


def test_plan_holds_a_cpp_reference_to_what_it_passes_and_lets_go_with_the_optimizer():
    """The plan keeps one C++ reference to each param and state tensor it passes (ops.hold_references: a
    kernel call then drops no tensor's last C++ reference, which would take the GIL once per tensor);
    they are released with the optimizer, and the params can be freed."""
    import gc
    import weakref

    params, opt = stepped(3)
    dense = [p for p in params if p.is_floating_point() and p.is_contiguous()]
    # What the calls pass: the params (or masters), the moments (packed or one per param), the steps.
    passed = [t for call in opt._plan.calls for t in call.kernel_tensors()]
    assert all(any(t is p for t in passed) for p in dense)
    counts = [t._use_count() for t in passed]
    assert len(counts) > len(dense) and min(counts) >= 2, counts
    unheld = [t._use_count() for t in (torch.randn(3), dense[0].detach().clone())]
    assert unheld == [1, 1]  # negative control: a tensor that only Python holds counts one
    refs = [weakref.ref(p) for p in params]
    del params, dense, passed, opt
    gc.collect()
    alive = sum(r() is not None for r in refs)
    assert alive == 0, alive


def test_hold_references():
    from distopt import ops

    assert ops.hold_references([]) is None
    t = torch.randn(3)
    holder = ops.hold_references(iter([t, t]))
    assert t._use_count() == 3
    del holder
    assert t._use_count() == 1


def test_bad_grad_in_the_steady_state_is_refused_before_anything_changes():
    params, opt = stepped(3)
    before = [p.detach().clone() for p in params], {k: v.clone() for k, v in opt.state[params[0]].items()}
    params[1].grad = torch.randn(7, 5).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()
    assert all(torch.equal(a, p) for a, p in zip(before[0], params))
    assert all(torch.equal(v, opt.state[params[0]][k]) for k, v in before[1].items())


@pytest.mark.cuda
@pytest.mark.parametrize("capturable", [False, True])
def test_planned_steps_match_the_general_step_on_cuda(capturable):
    def train(planned: bool) -> list[torch.Tensor]:
        params = [nn.Parameter(p.detach().cuda()) for p in make_params()]
        opt = FusedAdam(params, master_weights=True, capturable=capturable)
        if not planned:
            opt.register_step_pre_hook(lambda o, args, kwargs: setattr(o, "_plan", None))
        for step in range(5):
            for i, p in enumerate(params):
                p.grad = grad_for(p.cpu(), step, i).cuda()
            opt.step()
        return [p.detach().cpu() for p in params] + [s["exp_avg_sq"].cpu() for s in opt.state.values()]

    for a, b in zip(train(True), train(False)):
        assert torch.equal(a, b)


def sharded_grad_references(rank: int, world_size: int) -> dict[str, list[int]]:
    """C++ use counts of an FSDP2 model's grad shards during the planned kernel call and after the step."""
    from distopt import ops

    from dtensor_models import batch, fsdp

    model, _ = fsdp(0, rank, world_size)
    opt = FusedAdam(model.parameters())
    counts: dict[str, list[int]] = {}
    op = ops.adam_step_

    def counting(params, grads, *args, **kwargs):
        counts["during"] = [g._use_count() for g in grads]
        return op(params, grads, *args, **kwargs)

    for step in range(3):
        opt.zero_grad()
        x, y = batch(step, rank)
        nn.functional.mse_loss(model(x), y.expand(8, -1)).backward()
        if step == 2:  # planned
            ops.adam_step_ = counting
            counts["before"] = [p.grad._local_tensor._use_count() for p in model.parameters()]
        try:
            opt.step()
        finally:
            ops.adam_step_ = op
    counts["after"] = [p.grad._local_tensor._use_count() for p in model.parameters()]
    return counts


def test_sharded_grads_are_held_for_the_kernel_call_only():
    """A DTensor grad's local shard is held by Python only: the planned call holds it in C++ while the
    kernel runs (see ops.hold_references) and lets go after, so zero_grad() still frees it."""
    from harness import run_ranks

    for counts in run_ranks(sharded_grad_references, 2, timeout=120):
        before, during, after = counts["before"], counts["during"], counts["after"]
        assert len(before) == len(during) > 0 and all(d >= b + 1 for b, d in zip(before, during)), counts
        assert after == before, counts  # (and the negative control of the above)
