"""DistributedFusedAdam as a torch.optim citizen: torch.optim.AdamW's keywords (supported, no-op or
refused, at construction and when changed later), maximize against DDP + torch.optim.AdamW, torch's
optimizer hooks, refusal to be copied or pickled, and ``opt.state``, the per-param view of what each
rank holds. Real gloo ranks (harness.run_ranks); torch.distributed.checkpoint is test_dcp_api.py's.
"""

from __future__ import annotations

import copy
import inspect
import pickle

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from distopt import DistributedFusedAdam

import tolerances
from harness import run_ranks
from test_checkpoint import TINY_BUCKET_MB, assert_same_bytes, global_batch, groups, make_model, snapshot, train

# ------------------------------------------------------------------ torch.optim.AdamW's keywords


def adamw_keywords() -> dict:
    """Every keyword torch.optim.AdamW takes besides params, at its default; and torch.optim.Adam's
    decoupled_weight_decay at AdamW's value."""
    sig = inspect.signature(torch.optim.AdamW.__init__)
    kwargs = {n: p.default for n, p in sig.parameters.items() if n not in ("self", "params")}
    return {**kwargs, "decoupled_weight_decay": True}


def construct_and_step(rank: int, world_size: int, kwargs: dict, group_options: dict) -> dict:
    model = make_model()
    opt = DistributedFusedAdam([{**g, **group_options} for g in groups(model)], **kwargs)
    train(model, opt, range(1), rank, world_size, torch.float32)
    return {k: v for k, v in opt.param_groups[0].items() if k != "params"}


def test_every_adamw_keyword_accepted_at_its_default():
    kwargs = adamw_keywords()
    assert set(kwargs) <= set(inspect.signature(DistributedFusedAdam).parameters)
    group = run_ranks(construct_and_step, 1, (kwargs, {}))[0]
    for key in ("amsgrad", "maximize", "foreach", "fused", "differentiable", "capturable", "decoupled_weight_decay"):
        assert group[key] == kwargs[key], key  # param groups carry torch's keys, as AdamW's do
    assert group["adam_w_mode"] is True
    # No-op values other than the defaults, and the switch under either name, per group too.
    group = run_ranks(construct_and_step, 1, (dict(foreach=True, fused=False, decoupled_weight_decay=False), {}))[0]
    assert group["adam_w_mode"] is False and group["decoupled_weight_decay"] is False
    group = run_ranks(construct_and_step, 1, ({}, {"decoupled_weight_decay": False, "fused": True}))[0]
    assert group["adam_w_mode"] is False


def refusals(rank: int, world_size: int) -> list[str]:
    model = make_model()
    bad = [dict(amsgrad=True), dict(differentiable=True), dict(adam_w_mode=True, decoupled_weight_decay=False),
           dict(foreach="yes"), dict(maximize=1)]
    bad_groups = [{"amsgrad": True}, {"capturable": True}, {"adam_w_mode": False, "decoupled_weight_decay": True}]
    messages = []
    for kwargs in bad:
        with pytest.raises(ValueError) as info:
            DistributedFusedAdam(model.parameters(), **kwargs)
        messages.append(str(info.value))
    for options in bad_groups:
        with pytest.raises(ValueError) as info:
            DistributedFusedAdam([{**g, **options} for g in groups(model)])
        messages.append(str(info.value))
    with pytest.raises(TypeError):  # an argument torch.optim.AdamW does not have either
        DistributedFusedAdam(model.parameters(), nesterov=True)
    return messages


def test_unsupported_options_refused_at_construction():
    messages = run_ranks(refusals, 1)[0]
    for expected, m in zip(["amsgrad", "differentiable", "contradict", "foreach", "maximize", "amsgrad",
                            "capturable", "contradict"], messages):
        assert expected in m, (expected, m)


BAD_CHANGES = [("amsgrad", True), ("differentiable", True), ("decoupled_weight_decay", False),
               ("fused", "always"), ("capturable", True)]


def change_options_mid_run(rank: int, world_size: int, interrupt: bool) -> list:
    """4 steps; with `interrupt`, before step 2 every unsupported change is tried (after backward):
    each must raise before anything changes (the closure included), and the run then goes on."""
    model = make_model()
    opt = DistributedFusedAdam(groups(model), bucket_cap_mb=TINY_BUCKET_MB)
    n = 8 // world_size
    for step in range(4):
        x, y = global_batch(step, torch.float32)
        nn.functional.mse_loss(model(x[rank * n : (rank + 1) * n]), y[rank * n : (rank + 1) * n]).backward()
        if interrupt and step == 2:
            opt.grad_sync()  # the reductions backward started have landed: the snapshot is what step() sees
            before = snapshot(opt, model, None)
            for key, value in BAD_CHANGES:
                group = opt.param_groups[1]
                had, old = key in group, group.get(key)
                group[key] = value
                with pytest.raises(ValueError, match=key):
                    opt.step(closure=lambda: pytest.fail("the closure ran before the options were checked"))
                if had:
                    group[key] = old
                else:
                    del group[key]
                assert_same_bytes(snapshot(opt, model, None), before, f"after refusing {key}={value!r}")
        opt.step()
        opt.zero_grad()
    opt.param_sync()
    return [p.detach().clone() for p in model.parameters()]


def test_unsupported_group_change_refused_at_step_before_anything_changes():
    interrupted = run_ranks(change_options_mid_run, 2, (True,))[0]
    uninterrupted = run_ranks(change_options_mid_run, 2, (False,))[0]
    assert all(torch.equal(a, e) for a, e in zip(interrupted, uninterrupted))  # the refusals left nothing behind


# ------------------------------------------------------------------ maximize vs DDP + torch.optim


def maximize_vs_ddp(rank: int, world_size: int, decoupled: bool, steps: int = 4) -> int:
    """Group 0 maximises, group 1 minimises; compared with DDP + torch.optim.AdamW (or Adam with L2
    decay) after every step."""
    ref_model, model = make_model(), make_model()
    ref = DDP(ref_model)
    options = [{"maximize": True}, {"maximize": False}]
    ref_groups = [{**g, **o} for g, o in zip(groups(ref_model), options)]
    ref_opt = torch.optim.AdamW(ref_groups) if decoupled else torch.optim.Adam(ref_groups, weight_decay=1e-2)
    opt = DistributedFusedAdam([{**g, **o} for g, o in zip(groups(model), options)],
                               decoupled_weight_decay=decoupled)
    n, checks = 8 // world_size, 0
    for step in range(steps):
        x, y = global_batch(step, torch.float32)
        for m, o in ((ref, ref_opt), (model, opt)):
            nn.functional.mse_loss(m(x[rank * n : (rank + 1) * n]), y[rank * n : (rank + 1) * n]).backward()
            o.step()
            o.zero_grad()
        for a, e in zip(model.parameters(), ref_model.parameters()):
            tolerances.assert_close(a, e, tolerances.DISTRIBUTED)
            checks += 1
    return checks


@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam_l2"])
def test_maximize_matches_ddp_torch(decoupled):
    assert all(c > 0 for c in run_ranks(maximize_vs_ddp, 2, (decoupled,)))


def test_maximize_negative_control():
    """The comparison notices maximize being ignored: a DFA that minimises everything differs."""
    def run(rank, world_size):
        ref_model, model = make_model(), make_model()
        ref = DDP(ref_model)
        ref_opt = torch.optim.AdamW(groups(ref_model), maximize=True)
        opt = DistributedFusedAdam(groups(model))
        for m, o in ((ref, ref_opt), (model, opt)):
            x, y = global_batch(0, torch.float32)
            nn.functional.mse_loss(m(x), y).backward()
            o.step()
        return [torch.equal(a, e) or torch.allclose(a, e, **tolerances.DISTRIBUTED[torch.float32])
                for a, e in zip(model.parameters(), ref_model.parameters())]

    assert not any(run_ranks(run, 2)[0])


# ------------------------------------------------------------------ hooks, copies


def record_hooks(opt: torch.optim.Optimizer, model: nn.Module, events: list) -> None:
    """Registers every torch.optim hook; each records its call. The state-dict post hook and the
    load pre hook return modified dicts, which torch uses in place of the originals."""
    opt.register_step_pre_hook(lambda o, args, kwargs: events.append(("step_pre", o is opt, tuple(kwargs))))
    opt.register_step_post_hook(lambda o, args, kwargs: events.append(("step_post", o is opt)))
    opt.register_state_dict_pre_hook(lambda o: events.append(("state_dict_pre", o is opt)))

    def sd_post(o, sd):
        events.append(("state_dict_post", o is opt, sorted(sd)[:2]))
        return {**sd, "tag": "added by a hook"}

    opt.register_state_dict_post_hook(sd_post)

    def load_pre(o, sd):
        events.append(("load_pre", o is opt, sd.get("tag")))
        sd = copy.deepcopy({k: v for k, v in sd.items() if k != "tag"})
        sd["param_groups"][0]["lr"] = 0.5  # the loaded dict is the hook's
        return sd

    opt.register_load_state_dict_pre_hook(load_pre)
    opt.register_load_state_dict_post_hook(lambda o: events.append(("load_post", o is opt)))


def hook_events(opt: torch.optim.Optimizer, model: nn.Module) -> list:
    events: list = []
    record_hooks(opt, model, events)
    handles = [register_optimizer_step_pre_hook(lambda o, a, k: events.append(("global_pre",))),
               register_optimizer_step_post_hook(lambda o, a, k: events.append(("global_post",)))]
    x, y = global_batch(0, torch.float32)
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    sd = opt.state_dict()
    events.append(("returned", sd.get("tag")))
    opt.load_state_dict(sd)
    events.append(("lr after load", opt.param_groups[0]["lr"]))
    for h in handles:
        h.remove()
    return events


def test_hooks_fire_as_on_torch_optimizers():
    model = make_model()
    expected = hook_events(torch.optim.AdamW(groups(model)), model)

    def run(rank, world_size):
        model = make_model()
        return hook_events(DistributedFusedAdam(groups(model)), model)

    actual = run_ranks(run, 1)[0]
    # torch's state dict has 'param_groups' and 'state' first; ours adds 'checksums' and 'format'
    normalise = [(e[0], e[1], None) if e[0] == "state_dict_post" else e for e in actual]
    assert normalise == [(e[0], e[1], None) if e[0] == "state_dict_post" else e for e in expected], actual
    assert ("returned", "added by a hook") in actual and ("lr after load", 0.5) in actual


def copies(rank: int, world_size: int) -> list[str]:
    model = make_model()
    opt = DistributedFusedAdam(groups(model))
    train(model, opt, range(1), rank, world_size, torch.float32)
    messages = []
    for attempt in (copy.deepcopy, copy.copy, pickle.dumps, lambda o: pickle.dumps(o.state)):
        with pytest.raises(TypeError) as info:
            attempt(opt)
        messages.append(str(info.value))
    state = copy.deepcopy(opt.state)  # a plain dict of copies, like torch's
    p = max(opt.state, key=lambda q: opt.state[q]["exp_avg"].numel())  # one this rank holds elements of
    assert type(state) is dict and torch.equal(state[p]["exp_avg"], opt.state[p]["exp_avg"])
    assert state[p]["exp_avg"].data_ptr() != opt.state[p]["exp_avg"].data_ptr()
    return messages


def test_copy_and_pickle_refused():
    messages = run_ranks(copies, 2)[0]
    assert all("cannot be copied or pickled" in m for m in messages[:3]), messages
    assert "cannot be pickled" in messages[3], messages


# ------------------------------------------------------------------ opt.state


VIEW_SETUPS = {
    "fp32": dict(),
    "fp32_overlap_param_sync": dict(opt=dict(overlap_param_sync=True)),  # the read before the deferred gather
    "bf16_masters": dict(dtype=torch.bfloat16),
    "bf16_remainders": dict(dtype=torch.bfloat16, opt=dict(store_param_remainders=True)),
    "params_split_over_buckets": dict(opt=dict(bucket_cap_mb=TINY_BUCKET_MB)),
}


def view_of_state(rank: int, world_size: int, name: str) -> dict:
    setup = VIEW_SETUPS[name]
    dtype = setup.get("dtype", torch.float32)
    model = make_model(dtype)
    model[2].bias.requires_grad_(False)  # a frozen param in a param group
    opt = DistributedFusedAdam(groups(model), **setup.get("opt", {}))
    params = [p for g in opt.param_groups for p in g["params"] if p.requires_grad]  # the state dict's order
    fresh = {i: {k: (tuple(v.shape), float(v.sum())) for k, v in opt.state[p].items()} for i, p in enumerate(params)}
    assert bool(opt.state) and len(opt.state) == len(params) and model[2].bias not in opt.state
    assert opt.state[model[2].bias] == {} and opt.state.get(model[2].bias) is None
    train(model, opt, range(2), rank, world_size, dtype)
    if rank == 0:  # reading the view communicates nothing: one rank alone may look (no hang)
        assert all(len(entry) == 4 for entry in opt.state.values())
    # Where each rank's elements of each param lie (from the layout), to place the views.
    ranges = {i: sorted((f.param_offset, f.numel) for b in opt._runtime.buckets for f in b.fragments if f.param == i)
              for i in range(len(params))}
    views = {i: {k: v.clone() for k, v in opt.state[p].items()} for i, p in enumerate(params)}
    is_view = [opt.state[p]["exp_avg"]._base is not None for p in params]
    sd = opt.state_dict()
    # In place through the view reaches the optimizer (a param held in one fragment here).
    i = next(i for i, r in ranges.items() if len(r) == 1)
    opt.state[params[i]]["exp_avg"].fill_(7.0)
    filled = bool((opt.state[params[i]]["exp_avg"] == 7.0).all())
    # torch.optim code that walks opt.state (e.g. Lightning moving state to a device) runs.
    for entry in opt.state.values():
        for key, value in entry.items():
            entry[key] = value.to("cpu")
    with pytest.raises(TypeError, match="read-only"):
        opt.state[params[0]] = {}
    refusals = entry_writes_refused(opt, params + [model[2].bias])
    return dict(fresh=fresh, ranges=ranges, views=views, sd=sd, is_view=is_view, filled=filled,
                step=opt.step_count, refusals=refusals)


def entry_writes_refused(opt: DistributedFusedAdam, params: list) -> list[str]:
    """Every write that would reach nothing raises: assigning or deleting keys of an entry (also of a
    frozen param's empty one), and in-place writes to the entries' copies (not views of the shard).
    Returns what went wrong (empty: all refused)."""
    wrong = []
    for i, p in enumerate(params):
        entry = opt.state[p]
        for name, write in [("assign", lambda e: e.__setitem__("exp_avg", torch.zeros(3))),
                            ("del", lambda e: e.__delitem__("step")), ("update", lambda e: e.update(step=1)),
                            ("pop", lambda e: e.pop("step")), ("setdefault", lambda e: e.setdefault("x", 1)),
                            ("clear", lambda e: e.clear())]:  # fmt: skip
            try:
                write(entry)
                wrong.append(f"param {i}: {name} passed")
            except TypeError as exc:
                if "would change nothing" not in str(exc):
                    wrong.append(f"param {i}: {name}: {exc}")
        for key, value in entry.items():
            is_copy = value._base is None  # not a view of the shard (or of the model param)
            try:
                value.add_(0.0)
                if is_copy:
                    wrong.append(f"param {i}: in-place write to the copy {key!r} passed")
            except RuntimeError as exc:
                if not is_copy or "inference tensor" not in str(exc):
                    wrong.append(f"param {i}: {key!r}: {exc}")
    return wrong


@pytest.mark.parametrize("name", list(VIEW_SETUPS))
def test_state_view_holds_this_ranks_part(name):
    results = run_ranks(view_of_state, 2, (name,))
    sd = results[0]["sd"]
    keys = sorted(sd["state"])  # positions in param_groups of the trainable params, in order
    for r in results:
        assert all(entry["step"] == ((), 0.0) and entry["exp_avg"] == ((0,), 0.0) for entry in r["fresh"].values())
        assert r["filled"] and r["refusals"] == [], r["refusals"]
        for i, g in enumerate(keys):
            assert r["views"][i]["step"].item() == r["step"] == 2
            for key in ("exp_avg", "exp_avg_sq", "param"):
                full = sd["state"][g][key].reshape(-1)
                expected = torch.cat([full[o : o + n] for o, n in r["ranges"][i]]) if r["ranges"][i] else full[:0]
                assert torch.equal(r["views"][i][key], expected), (name, i, key)
    for i in range(len(keys)):  # the ranks' parts cover every element exactly once
        covered = sorted(rng for r in results for rng in r["ranges"][i])
        assert covered[0][0] == 0 and sum(n for _, n in covered) == sd["state"][keys[i]]["exp_avg"].numel()
        assert all(o + n == o2 for (o, n), (o2, _) in zip(covered, covered[1:]))
    if name == "fp32":
        assert all(any(r["is_view"]) for r in results)


def test_state_view_reads_communicate_nothing():
    """A fresh optimizer's view is non-empty (torch's get_state_dict then takes no zero-grad step) and
    reading it needs no process group call: it works between collectives on one rank only."""
    def run(rank, world_size):
        model = make_model()
        opt = DistributedFusedAdam(groups(model))
        entries = [dict(opt.state[p]) for p in model.parameters()] if rank == 1 else []
        dist.barrier()
        return [(float(e["step"]), e["param"].numel()) for e in entries]

    assert run_ranks(run, 2)[1] == [(0.0, 0)] * 6
