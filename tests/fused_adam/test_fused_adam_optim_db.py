"""FusedAdam through PyTorch's own optimizer test database (``torch.testing._internal.common_optimizers``):
an OptimizerInfo of FusedAdam's, built from AdamW's, gives AdamW's optim inputs (constructor kwargs,
with the foreach/fused variants) and error inputs; each optim input trains the same params with
FusedAdam and with ``torch.optim.AdamW`` and every step is compared, on dense, non-dense and complex
params, with AdamW's LR schedulers, param groups and state dicts both ways; each error input must make
FusedAdam raise (or warn) what AdamW raises.

What FusedAdam does not take is left out in one place, ``DIFFERENCES``, each entry naming the
documented difference (README, "Differences from torch.optim.AdamW") that justifies it; a test checks
that every entry still matches an input, so none outlives what it excuses.

torch's internal test API moves between releases. Used here, all present from torch 2.11 to 2.14:
``optim_db``, ``OptimizerInfo`` (keywords ``optim_inputs_func``, ``optim_error_inputs_func``,
``scheduler_inputs``, ``supported_impls``, ``supports_fused_on``, ``has_capturable_arg``),
``OptimizerInput`` (``params``, ``kwargs``, ``desc``), ``ErrorOptimizerInput`` and
``OptimizerErrorEnum``, ``_get_optim_inputs_including_global_cliquey_kwargs``. Importing the module
needs the ``expecttest`` package (a test dependency) and switches torch.backends' global flags to
context-manager-only use (``torch.backends.disable_global_flags``), which nothing in distopt sets.
"""

from __future__ import annotations

import copy
import pathlib
import re

import pytest
import torch
from torch import nn
from torch.optim.lr_scheduler import ReduceLROnPlateau

# torch's test database imports expecttest (a test extra that `make test` installs): without it, skip
# this module instead of failing the whole collection.
pytest.importorskip("expecttest", reason="torch.testing._internal needs expecttest (pip install expecttest)")
from torch.testing._internal import common_optimizers as optim_db  # noqa: E402

from distopt import FusedAdam  # noqa: E402

import tolerances

ADAMW = next(info for info in optim_db.optim_db if info.optim_cls is torch.optim.AdamW)
STEPS = 8

# Every AdamW input FusedAdam does not take as AdamW does, and why: optim inputs by the kwarg that
# selects them, error inputs by their description. Each reason is a documented difference.
DIFFERENCES = {
    "amsgrad": "amsgrad=True raises ValueError: the fused kernel keeps no AMSGrad maximum",
    "differentiable": "differentiable=True raises ValueError: the fused kernel has no backward",
    "lr as Tensor doesn't work with foreach & not capturable":
        "foreach and fused are accepted and change nothing (always the fused kernel): a Tensor lr works",
    r"betas\[0\] as a Tensor is not supported for capturable=False and foreach=True":
        "foreach and fused are accepted and change nothing (always the fused kernel): Tensor betas work",
}


def difference(optim_input) -> str | None:
    """Why FusedAdam leaves `optim_input` (an OptimizerInput or ErrorOptimizerInput) out, or None."""
    inner = getattr(optim_input, "optimizer_error_input", optim_input)
    refused = [key for key, value in inner.kwargs.items() if key in DIFFERENCES and value is True]
    return DIFFERENCES[refused[0]] if refused else DIFFERENCES.get(inner.desc)


def fused_adam_inputs(device, dtype=None):
    return [i for i in ADAMW.optim_inputs_func(device, dtype) if difference(i) is None]


def fused_adam_error_inputs(device, dtype):
    return [i for i in ADAMW.optim_error_inputs_func(device, dtype) if difference(i) is None]


FUSED_ADAM = optim_db.OptimizerInfo(
    FusedAdam,
    optim_inputs_func=fused_adam_inputs,
    optim_error_inputs_func=fused_adam_error_inputs,
    scheduler_inputs=ADAMW.scheduler_inputs,
    supported_impls=("foreach", "fused"),  # accepted, changing nothing; differentiable is refused
    supports_fused_on=("cpu", "cuda"),
    has_capturable_arg=True,
)

DEVICES = {"cpu": (), "cuda": pytest.mark.cuda}


def optim_inputs(device: str) -> list:
    """FusedAdam's optim inputs with the foreach/fused variants, as torch's test suite runs them."""
    return optim_db._get_optim_inputs_including_global_cliquey_kwargs(device, torch.float32, FUSED_ADAM)


def with_inputs(test):
    """Parametrises `test` over (device, optim input); ids are the inputs' descriptions."""
    cases = [pytest.param(device, optim_input, marks=marks, id=f"{device}-{optim_input.desc}")
             for device, marks in DEVICES.items() for optim_input in optim_inputs(device)]
    return pytest.mark.parametrize("device, optim_input", cases)(test)


def kwargs_of(optim_input, reference: bool = False) -> dict:
    """The input's kwargs, tensors (lr, betas) copied so that two optimizers share none. `reference`:
    for torch.optim.AdamW's for-loop implementation, the reference here (FusedAdam's foreach/fused
    change nothing; torch's fused CPU kernel steps a param that is not dense in memory wrongly, 2e-3
    off its own for-loop after two steps of lr 1e-3 in torch 2.11 and 2.14)."""
    return {**copy.deepcopy(optim_input.kwargs), **({"foreach": False, "fused": False} if reference else {})}


# ---------------------------------------------------------------------------------------- training


def linear_params(device: str, dense: bool) -> list[nn.Parameter]:
    """A weight and a bias; not dense in memory (every other element of a larger tensor) if not `dense`."""
    g = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(10, 5, 2, generator=g), torch.randn(10, 2, generator=g)
    weight, bias = (weight[..., 0], bias[..., 0]) if not dense else (weight[..., 0].clone(), bias[..., 0].clone())
    return [nn.Parameter(weight.to(device)), nn.Parameter(bias.to(device))]


def fit(opt_cls, kwargs: dict, params: list[nn.Parameter], schedulers=(), groups: bool = False) -> list:
    """STEPS closure steps of ``|W x + b|^2`` (real params) or of a real function of complex params; the
    params (and lr) after each."""
    opt = opt_cls([{"params": params[:1]}, {"params": params[1:], "lr": 0.02, "weight_decay": 0.0}] if groups
                  else params, **kwargs)
    scheds = [make(opt) for make in schedulers]
    x = torch.linspace(-1, 1, params[0].shape[-1], device=params[0].device)

    def closure():
        opt.zero_grad()
        w, b = params
        if w.is_complex():  # a real loss of complex params: autograd gives conjugate Wirtinger grads
            loss = ((w * w.conj()).real * x).sum() + (b.abs() - 1).square().sum() + (w[0] * b).real.sum()
        else:
            loss = (w @ x + b).square().sum()
        loss.backward()
        return loss

    history = []
    for _ in range(STEPS):
        loss = opt.step(closure)
        for sched in scheds:
            sched.step(loss.item()) if isinstance(sched, ReduceLROnPlateau) else sched.step()
        lrs = torch.tensor([float(g["lr"]) for g in opt.param_groups])
        history.append([p.detach().clone() for p in params] + [lrs])
    return history


def assert_same_history(actual: list, expected: list) -> None:
    for step, (a_step, e_step) in enumerate(zip(actual, expected, strict=True)):
        for a, e in zip(a_step, e_step, strict=True):
            try:
                tolerances.assert_close(a.cpu(), e.cpu(), tolerances.OPTIMIZER)
            except AssertionError as exc:
                raise AssertionError(f"step {step + 1}: {exc}") from None


def compare(optim_input, make_params, **fit_kwargs) -> None:
    expected = fit(torch.optim.AdamW, kwargs_of(optim_input, reference=True), make_params(), **fit_kwargs)
    assert_same_history(fit(FusedAdam, kwargs_of(optim_input), make_params(), **fit_kwargs), expected)


@with_inputs
def test_dense_params_follow_adamw(device, optim_input):
    compare(optim_input, lambda: linear_params(device, dense=True))


@with_inputs
def test_params_not_dense_in_memory_follow_adamw(device, optim_input):
    compare(optim_input, lambda: linear_params(device, dense=False))


@with_inputs
def test_param_groups_and_schedulers_follow_adamw(device, optim_input):
    for schedulers in FUSED_ADAM.scheduler_inputs:
        compare(optim_input, lambda: linear_params(device, dense=False), schedulers=schedulers, groups=True)


@with_inputs
def test_complex_params_follow_adamw(device, optim_input):
    """A complex weight and bias, gradients from autograd (AdamW steps them as their real views)."""
    def make():
        g = torch.Generator().manual_seed(1)
        return [nn.Parameter(torch.randn(3, 4, dtype=torch.complex64, generator=g).to(device)),
                nn.Parameter(torch.randn(4, dtype=torch.complex64, generator=g).to(device))]

    compare(optim_input, make)


@with_inputs
def test_state_dicts_move_between_fused_adam_and_adamw(device, optim_input):
    """Trained a few steps by one, continued by the other from its state dict, on complex and non-dense
    params: the same as one AdamW run throughout."""
    def make():
        g = torch.Generator().manual_seed(2)
        return [nn.Parameter(torch.randn(4, 3, 2, generator=g)[..., 0].to(device)),
                nn.Parameter(torch.randn(3, dtype=torch.complex64, generator=g).to(device))]

    grads = [[torch.randn(p.shape, dtype=p.dtype, generator=torch.Generator().manual_seed(10 * s + i)).to(device)
              for i, p in enumerate(make())] for s in range(2 * STEPS)]

    def steps(opt, params, first: int) -> list:
        out = []
        for s in range(first, first + STEPS):
            for p, g in zip(params, grads[s]):
                p.grad = g.clone()
            opt.step()
            out.append([p.detach().clone() for p in params])
        return out

    ref_params = make()
    ref_opt = torch.optim.AdamW(ref_params, **kwargs_of(optim_input, reference=True))
    expected = steps(ref_opt, ref_params, 0) + steps(ref_opt, ref_params, STEPS)
    for first_cls, second_cls in ((FusedAdam, torch.optim.AdamW), (torch.optim.AdamW, FusedAdam)):
        params = make()
        first = first_cls(params, **kwargs_of(optim_input, reference=first_cls is torch.optim.AdamW))
        history = steps(first, params, 0)
        second = second_cls(params, **kwargs_of(optim_input, reference=second_cls is torch.optim.AdamW))
        saved = copy.deepcopy(first.state_dict())
        if second_cls is torch.optim.AdamW:  # loaded groups keep their foreach/fused: keep the reference's
            for group in saved["param_groups"]:
                group.update(foreach=False, fused=False)
        second.load_state_dict(saved)
        assert_same_history(history + steps(second, params, STEPS), expected)


# ---------------------------------------------------------------------------------------- error inputs


def error_cases() -> list:
    inputs = FUSED_ADAM.optim_error_inputs_func("cpu", torch.float32)
    return [pytest.param(e, id=e.optimizer_error_input.desc) for e in inputs]


def check_error_input(error_input, opt_cls) -> None:
    """`opt_cls` raises (or warns) as `error_input` says: at construction or at the first step."""
    optim_input = error_input.optimizer_error_input
    params = optim_input.params if optim_input.params is not None else [nn.Parameter(torch.randn(2, 2))]
    expectation = (pytest.warns if issubclass(error_input.error_type, Warning) else pytest.raises)(
        error_input.error_type, match=error_input.error_regex)
    if error_input.error_on == optim_db.OptimizerErrorEnum.CONSTRUCTION_ERROR:
        with expectation:
            opt_cls(params, **optim_input.kwargs)
        return
    opt = opt_cls(params, **optim_input.kwargs)
    for p in opt.param_groups[0]["params"]:
        p.grad = torch.randn_like(p)
    with expectation:
        opt.step()


@pytest.mark.parametrize("error_input", error_cases())
def test_error_inputs_raise_as_adamw(error_input):
    check_error_input(error_input, torch.optim.AdamW)  # first: the input is still an error in this torch
    check_error_input(error_input, FusedAdam)


def test_every_difference_still_excuses_an_input():
    """An entry of DIFFERENCES that no AdamW input of this torch matches any more must go (or its match
    is broken): each excuses at least one of AdamW's inputs as torch's suite runs them (with the
    foreach/fused/differentiable variants; the error inputs are the CPU ones, as above: torch builds
    its CUDA ones on a GPU). The refused options are refused as documented."""
    inputs = (optim_db._get_optim_inputs_including_global_cliquey_kwargs("cuda", torch.float32, ADAMW)
              + ADAMW.optim_error_inputs_func("cpu", torch.float32))
    assert {difference(i) for i in inputs} >= set(DIFFERENCES.values())
    for option in ("amsgrad", "differentiable"):
        with pytest.raises(ValueError, match=f"{option}=True"):
            FusedAdam([nn.Parameter(torch.randn(2))], **{option: True})


def test_negative_control_a_wrong_setting_is_caught():
    """The comparison above catches an lr off by 0.1%, and the error check an error input that
    FusedAdam accepts (one that DIFFERENCES excuses)."""
    optim_input = optim_inputs("cpu")[0]
    make = lambda: linear_params("cpu", dense=False)  # noqa: E731
    expected = fit(torch.optim.AdamW, kwargs_of(optim_input, reference=True), make())
    with pytest.raises(AssertionError):
        assert_same_history(fit(FusedAdam, {**optim_input.kwargs, "lr": 1.001e-3}, make()), expected)
    excused = next(e for e in ADAMW.optim_error_inputs_func("cpu", torch.float32) if difference(e) is not None)
    check_error_input(excused, torch.optim.AdamW)
    with pytest.raises(pytest.fail.Exception, match="DID NOT RAISE"):
        check_error_input(excused, FusedAdam)


def test_the_differences_are_documented():
    """What DIFFERENCES excuses is in the README's list of differences from AdamW."""
    readme = (pathlib.Path(__file__).parents[2] / "README.md").read_text()
    section = readme.split("### Differences from torch.optim.AdamW", 1)[1].split("\n#", 1)[0]
    for key in ("amsgrad=True", "differentiable=True", "`foreach` and `fused`", "Tensor lr"):
        assert re.search(re.escape(key), section), key
