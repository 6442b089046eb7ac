"""FusedAdam as a drop-in for torch.optim.AdamW: every AdamW keyword and param-group key, maximize,
the optimizer hooks, deepcopy and pickling, param_names through state dicts, each checked against
torch.optim's own behaviour."""

from __future__ import annotations

import copy
import inspect
import itertools
import pickle

import pytest
import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from distopt import FusedAdam

import tolerances

TORCH_ONLY_DEFAULTS = {"capturable"}  # keys whose value FusedAdam sets for the whole optimizer


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.LayerNorm(16), nn.Linear(16, 3))


def groups(model: nn.Module, **first) -> list[dict]:
    """Two param groups with different lr and weight decay; ``first`` adds keys to the first."""
    return [
        {"params": list(model[0].parameters()) + list(model[3].parameters()), "lr": 3e-3, "weight_decay": 0.05,
         **first},
        {"params": list(model[2].parameters()), "lr": 1e-2, "weight_decay": 0.0},
    ]  # fmt: skip


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int = 1) -> list[list[torch.Tensor]]:
    """``steps`` steps on random batches from ``seed``; the params after every step."""
    gen = torch.Generator().manual_seed(seed)
    history = []
    for _ in range(steps):
        x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        history.append([p.detach().clone() for p in model.parameters()])
    return history


def assert_history_close(actual, expected) -> None:
    for step, (a_params, e_params) in enumerate(zip(actual, expected, strict=True)):
        for a, e in zip(a_params, e_params, strict=True):
            try:
                tolerances.assert_close(a, e, tolerances.OPTIMIZER)
            except AssertionError as exc:
                raise AssertionError(f"step {step + 1}: {exc}") from None


def adamw_parameters() -> dict[str, inspect.Parameter]:
    return {n: p for n, p in inspect.signature(torch.optim.AdamW).parameters.items() if n != "params"}


# ----------------------------------------------------------------------------- keywords and group keys


def test_every_adamw_keyword_is_accepted_at_its_default():
    """Code that spells out all of this torch's AdamW defaults (read from its signature), plus Adam's
    decoupled_weight_decay=True, constructs a FusedAdam."""
    kwargs = {name: p.default for name, p in adamw_parameters().items()}
    assert {"amsgrad", "maximize", "foreach", "fused", "differentiable", "capturable"} <= set(kwargs)
    FusedAdam([nn.Parameter(torch.randn(3))], **kwargs, decoupled_weight_decay=True)


def test_adamw_positional_arguments_keep_their_places():
    """lr, betas, eps, weight_decay and amsgrad may be passed positionally, in AdamW's order."""
    positional = [n for n, p in adamw_parameters().items() if p.kind is p.POSITIONAL_OR_KEYWORD]
    ours = list(inspect.signature(FusedAdam).parameters)[1:]
    assert ours[: len(positional)] == positional
    opt = FusedAdam([nn.Parameter(torch.randn(3))], 2e-3, (0.8, 0.9), 1e-6, 0.0, False)
    assert opt.defaults["betas"] == (0.8, 0.9) and opt.defaults["amsgrad"] is False


def test_param_groups_have_adamw_keys_and_defaults():
    """Every key of an AdamW param group is in ours, with AdamW's default value, for every group."""
    p, q = nn.Parameter(torch.randn(3)), nn.Parameter(torch.randn(3))
    ref = torch.optim.AdamW([p]).param_groups[0]
    opt = FusedAdam([{"params": [p]}, {"params": [q], "lr": 0.5}])
    for group in opt.param_groups:
        assert set(ref) <= set(group), set(ref) - set(group)
        for key in set(ref) - {"params", "lr"} - TORCH_ONLY_DEFAULTS:
            assert group[key] == ref[key], key
        assert group["capturable"] is False and group["adam_w_mode"] is True


@pytest.mark.parametrize(
    "kwargs",
    [dict(foreach=True), dict(foreach=False), dict(fused=True), dict(fused=False), dict(foreach=None, fused=None)],
    ids=lambda k: ",".join(f"{n}={v}" for n, v in k.items()),
)
def test_foreach_and_fused_are_accepted_and_change_nothing(kwargs):
    """They choose torch's implementation; distopt always runs its fused kernel: the same bits."""
    ref_model, model = make_model(), make_model()
    expected = train(ref_model, FusedAdam(groups(ref_model)), steps=3)
    got = train(model, FusedAdam(groups(model), **kwargs), steps=3)
    assert all(torch.equal(a, b) for ga, gb in zip(got, expected) for a, b in zip(ga, gb))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(amsgrad=True), "amsgrad=True"),
        (dict(differentiable=True), "differentiable=True"),
        (dict(foreach="yes"), "foreach must be None, True or False"),
        (dict(fused=1.5), "fused must be None, True or False"),
        (dict(maximize="no"), "maximize must be True or False"),
        (dict(adam_w_mode=True, decoupled_weight_decay=False), "adam_w_mode=True and decoupled_weight_decay=False"),
        (dict(adam_w_mode=False, decoupled_weight_decay=True), "contradict"),
    ],
)
def test_unsupported_option_values_are_refused_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FusedAdam([nn.Parameter(torch.randn(3))], **kwargs)


def test_unsupported_value_in_a_new_param_group_is_refused():
    opt = FusedAdam([nn.Parameter(torch.randn(3))])
    with pytest.raises(ValueError, match=r"param_groups\[1\]: amsgrad=True"):
        opt.add_param_group({"params": [nn.Parameter(torch.randn(2))], "amsgrad": True})
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize("mode", [True, False])
@pytest.mark.parametrize("name", ["adam_w_mode", "decoupled_weight_decay"])
def test_weight_decay_switch_under_either_name(name, mode):
    """Either name sets both keys (in the defaults and in a group that names one of them), and the
    run follows torch.optim.Adam(decoupled_weight_decay=mode)."""
    ref_model, model = make_model(), make_model()
    expected = train(ref_model, torch.optim.Adam(groups(ref_model), decoupled_weight_decay=mode), steps=5)
    opt = FusedAdam(groups(model), **{name: mode})
    assert all(g["adam_w_mode"] is mode and g["decoupled_weight_decay"] is mode for g in opt.param_groups)
    assert_history_close(train(model, opt, steps=5), expected)

    group_opt = FusedAdam([nn.Parameter(torch.randn(3))], adam_w_mode=not mode)
    group_opt.add_param_group({"params": [nn.Parameter(torch.randn(3))], name: mode})
    added = group_opt.param_groups[1]
    assert added["adam_w_mode"] is mode and added["decoupled_weight_decay"] is mode


STEP_TIME_REFUSALS = [
    ({"amsgrad": True}, "amsgrad=True"),
    ({"differentiable": True}, "differentiable=True"),
    ({"foreach": "fast"}, "foreach must be"),
    ({"maximize": 1}, "maximize must be True or False"),
    ({"decoupled_weight_decay": False}, "contradict"),  # adam_w_mode stays True
]


@pytest.mark.parametrize("first_step", [True, False], ids=["before_first_step", "mid_run"])
@pytest.mark.parametrize("change, match", STEP_TIME_REFUSALS, ids=[next(iter(c)) for c, _ in STEP_TIME_REFUSALS])
def test_group_changed_to_unsupported_value_is_refused_at_step(change, match, first_step):
    """A key set after construction to a value FusedAdam cannot honour: step() raises ValueError naming
    it, before any param, state or step counter changes (the other, valid group included)."""
    model = make_model()
    opt = FusedAdam(groups(model))
    if not first_step:
        train(model, opt, steps=2)
    model(torch.randn(4, 6)).square().sum().backward()
    params = [p.detach().clone() for p in model.parameters()]
    state = copy.deepcopy(opt.state_dict()["state"])
    opt.param_groups[1].update(change)
    with pytest.raises(ValueError, match=rf"param_groups\[1\]: .*{match}"):
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params))
    after = opt.state_dict()["state"]
    assert after.keys() == state.keys()
    assert all(torch.equal(after[k][n], v) for k, s in state.items() for n, v in s.items())


# ----------------------------------------------------------------------------- maximize


@pytest.mark.parametrize("adam_w_mode", [True, False], ids=["adamw", "adam_l2"])
def test_maximize_matches_torch(adam_w_mode):
    """FusedAdam(maximize=True) follows torch.optim.AdamW/Adam(maximize=True) for 10 steps, two groups
    with weight decay (the L2 term is added after the gradient is negated, as torch does)."""
    torch_cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    ref_model, model = make_model(), make_model()
    expected = train(ref_model, torch_cls(groups(ref_model), maximize=True), steps=10)
    got = train(model, FusedAdam(groups(model), maximize=True, adam_w_mode=adam_w_mode), steps=10)
    assert_history_close(got, expected)


def test_negative_control_maximize_ignored_is_caught():
    """The comparison above fails for a run that descends where torch ascends."""
    ref_model, model = make_model(), make_model()
    expected = train(ref_model, torch.optim.AdamW(groups(ref_model), maximize=True), steps=2)
    got = train(model, FusedAdam(groups(model)), steps=2)
    with pytest.raises(AssertionError):
        assert_history_close(got, expected)


def test_maximize_set_on_a_group_later_is_honoured():
    """group["maximize"] = True after some steps (one group only) takes effect at the next step, as in torch."""
    ref_model, model = make_model(), make_model()
    ref_opt, opt = torch.optim.AdamW(groups(ref_model)), FusedAdam(groups(model))
    assert_history_close(train(model, opt, steps=3), train(ref_model, ref_opt, steps=3))
    ref_opt.param_groups[0]["maximize"] = opt.param_groups[0]["maximize"] = True
    assert_history_close(train(model, opt, steps=4, seed=2), train(ref_model, ref_opt, steps=4, seed=2))
    ref_opt.param_groups[0]["maximize"] = opt.param_groups[0]["maximize"] = False
    assert_history_close(train(model, opt, steps=2, seed=3), train(ref_model, ref_opt, steps=2, seed=3))


def test_maximize_survives_state_dicts_both_ways():
    """maximize travels in the param groups: FusedAdam -> torch AdamW and torch AdamW -> FusedAdam."""
    model = make_model()
    opt = FusedAdam(groups(model, maximize=True))
    train(model, opt, steps=2)
    to_torch = torch.optim.AdamW(groups(make_model()))
    to_torch.load_state_dict(opt.state_dict())
    assert [g["maximize"] for g in to_torch.param_groups] == [True, False]
    back = FusedAdam(groups(make_model()))
    back.load_state_dict(to_torch.state_dict())
    assert [g["maximize"] for g in back.param_groups] == [True, False]


# ----------------------------------------------------------------------------- hooks


def record_hooks(opt: torch.optim.Optimizer, log: list) -> list:
    """Registers one hook of every kind on ``opt``; each appends (kind, argument kinds) to ``log``.
    Returns the handles."""

    def kinds(args) -> tuple[str, ...]:
        return tuple("optimizer" if a is opt else type(a).__name__ for a in args)

    def hook(kind):
        return lambda *args: log.append((kind, kinds(args)))

    return [
        opt.register_step_pre_hook(hook("step_pre")),
        opt.register_step_post_hook(hook("step_post")),
        opt.register_state_dict_pre_hook(hook("state_dict_pre")),
        opt.register_state_dict_post_hook(hook("state_dict_post")),
        opt.register_load_state_dict_pre_hook(hook("load_state_dict_pre")),
        opt.register_load_state_dict_post_hook(hook("load_state_dict_post")),
        register_optimizer_step_pre_hook(hook("global_step_pre")),
        register_optimizer_step_post_hook(hook("global_step_post")),
    ]


def exercise(opt_cls) -> list:
    """Two steps (one with a closure), a state dict and its reload; the hook log."""
    model = make_model()
    opt = opt_cls(groups(model))
    log: list = []
    handles = record_hooks(opt, log)
    try:
        model(torch.randn(2, 6)).sum().backward()
        opt.step()
        opt.step(lambda: torch.tensor(0.0))
        opt.load_state_dict(opt.state_dict())
    finally:
        for h in handles:
            h.remove()
    return log


def test_every_hook_fires_as_in_torch():
    """Same hooks, same order, same number of calls, same kinds of arguments as torch.optim.AdamW."""
    expected = exercise(torch.optim.AdamW)
    assert {kind for kind, _ in expected} >= {"step_pre", "state_dict_post", "load_state_dict_pre", "global_step_post"}
    assert exercise(FusedAdam) == expected


def test_hook_results_are_used_as_in_torch():
    """A load pre hook's returned dict is what is loaded; a state-dict post hook's return is what
    state_dict() gives; a step pre hook's (args, kwargs) reach step()."""
    model = make_model()
    opt = FusedAdam(groups(model))
    train(model, opt, steps=1)

    def halve_lr(optimizer, state_dict):
        sd = copy.deepcopy(state_dict)
        for g in sd["param_groups"]:
            g["lr"] /= 2
        return sd

    opt.register_load_state_dict_pre_hook(halve_lr)
    opt.register_state_dict_post_hook(lambda optimizer, sd: {**sd, "extra": 1})
    sd = opt.state_dict()
    assert sd["extra"] == 1
    opt.load_state_dict(sd)
    assert [g["lr"] for g in opt.param_groups] == [1.5e-3, 5e-3]
    calls = []
    opt.register_step_pre_hook(lambda optimizer, args, kwargs: (args, {"closure": lambda: calls.append(1)}))
    opt.step()
    assert calls == [1]


# ----------------------------------------------------------------------------- deepcopy and pickle


def test_deepcopy_gives_a_working_optimizer_that_continues_identically():
    """copy.deepcopy(opt) copies the params with it (state keyed by the copies, masters included) and
    its zero_grad/step work and match the original's when fed the same gradients; hooks are not
    copied, as in torch.optim."""
    model = make_model()
    opt = FusedAdam(groups(model, maximize=True), master_weights=True)
    train(model, opt, steps=2)
    opt.register_step_post_hook(lambda *a: None)
    opt_copy = copy.deepcopy(opt)
    originals = [p for g in opt.param_groups for p in g["params"]]
    copies = [p for g in opt_copy.param_groups for p in g["params"]]
    assert all(c is not p and torch.equal(c, p) for c, p in zip(copies, originals))
    assert all(torch.equal(opt_copy.state[c]["exp_avg"], opt.state[p]["exp_avg"]) for c, p in zip(copies, originals))
    assert len(opt_copy._optimizer_step_post_hooks) == 0
    gen = torch.Generator().manual_seed(5)
    for _ in range(3):
        grads = [torch.randn(p.shape, generator=gen) for p in originals]
        for params, o in ((originals, opt), (copies, opt_copy)):
            o.zero_grad()
            for p, g in zip(params, grads):
                p.grad = g.clone()
            o.step()
        assert all(torch.equal(c, p) for c, p in zip(copies, originals))


def test_pickled_model_and_optimizer_continue_identically():
    """pickle.loads(pickle.dumps((model, opt))): the optimizer steps the unpickled model's params
    (zero_grad, clip_grad_norm and step all work) and matches the original step for step."""
    model = make_model()
    opt = FusedAdam(groups(model), weight_decay=0.1)
    train(model, opt, steps=3)
    model2, opt2 = pickle.loads(pickle.dumps((model, opt)))
    assert opt2.param_groups[0]["params"][0] is model2[0].weight
    gen = torch.Generator().manual_seed(4)
    for _ in range(3):
        x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)
        for m, o in ((model, opt), (model2, opt2)):
            o.zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
            o.clip_grad_norm(0.05)
            o.step()
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))


# ----------------------------------------------------------------------------- param_names


@pytest.mark.parametrize("named_save, named_load", list(itertools.product([False, True], repeat=2)))
def test_param_names_kept_through_loads_as_adamw(named_save, named_load):
    """A state dict from an optimizer built on ``named_parameters()`` (or not) loaded into one built on
    ``named_parameters()`` (or not): the later state dicts carry the same ``param_names`` as AdamW's
    (the saved names, else the loading optimizer's own), and training continues as AdamW's."""
    def run(opt_cls) -> tuple[list, list]:
        model = make_model()
        clone = copy.deepcopy(model)

        def params(m, named):
            return list(m.named_parameters()) if named else list(m.parameters())

        opt = opt_cls(params(model, named_save), lr=0.01)
        train(model, opt, steps=1)
        loaded = opt_cls(params(clone, named_load), lr=0.01)
        loaded.load_state_dict(copy.deepcopy(opt.state_dict()))
        history = train(clone, loaded, steps=2, seed=2)
        groups = [{k: g[k] for k in ("params", "param_names") if k in g} for g in loaded.state_dict()["param_groups"]]
        return groups, history

    (groups, history), (ref_groups, ref_history) = run(FusedAdam), run(torch.optim.AdamW)
    assert groups == ref_groups
    assert ("param_names" in ref_groups[0]) == (named_save or named_load)  # the case is the one intended
    assert_history_close(history, ref_history)


def test_negative_control_names_dropped_by_a_load_are_caught(monkeypatch):
    import distopt.fused_adam.optimizer as fused_adam
    import distopt.state_dicts as state_dicts

    def forgetful(groups, saved_groups):
        state_dicts.restore_hyperparameters(groups, [{k: v for k, v in g.items() if k != "param_names"}
                                                     for g in saved_groups])

    monkeypatch.setattr(fused_adam, "restore_hyperparameters", forgetful)
    with pytest.raises(AssertionError):
        test_param_names_kept_through_loads_as_adamw(named_save=True, named_load=False)
