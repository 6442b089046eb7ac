"""apex's ``grad_norm(parameters=..., force=...)`` and ``clip_grad_norm(max_norm, parameters=...)`` on
FusedAdam (distopt/grad_scaling.py; DistributedFusedAdam's, with a model-parallel group, are in
tests/distributed/test_tensor_parallel.py): the sum covers the subset, the inf/nan verdict every param;
a norm computed for a subset is what a later ``grad_norm()`` / ``clip_grad_norm(m)`` uses until the
gradients change (NeMo's pattern), unless ``force``; bad subsets are refused.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from distopt import FusedAdam


def model_with_grads(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    model(torch.randn(4, 6)).square().sum().backward()
    return model


def norm64(params) -> float:
    return math.sqrt(sum(float(p.grad.double().square().sum()) for p in params))


def test_subset_norm_is_the_subsets_and_is_cached_until_the_grads_change():
    model = model_with_grads()
    opt = FusedAdam(model.parameters())
    weights = [model[0].weight, model[2].weight]
    assert math.isclose(float(opt.grad_norm(parameters=weights)), norm64(weights), rel_tol=1e-6)
    assert math.isclose(float(opt.grad_norm()), norm64(weights), rel_tol=1e-6)  # the cached subset's (apex)
    whole = norm64(model.parameters())
    assert not math.isclose(whole, norm64(weights), rel_tol=1e-3)  # the two differ: the checks above can fail
    assert math.isclose(float(opt.grad_norm(force=True)), whole, rel_tol=1e-6)
    assert math.isclose(float(opt.grad_norm(parameters=model[0].bias)), norm64([model[0].bias]), rel_tol=1e-6)
    assert math.isclose(float(opt.grad_norm(parameters=list(model.parameters()))), whole, rel_tol=1e-6)
    model(torch.randn(4, 6)).sum().backward()  # new gradients: the cache is dropped
    assert math.isclose(float(opt.grad_norm()), norm64(model.parameters()), rel_tol=1e-6)


def test_clip_after_a_subset_norm_clips_by_it():
    """NeMo: ``grad_norm(parameters=S)`` then ``clip_grad_norm(m)`` steps as torch does when clipping by S's norm."""
    model, ref = model_with_grads(), model_with_grads()
    opt, ref_opt = FusedAdam(model.parameters(), lr=0.1), torch.optim.AdamW(ref.parameters(), lr=0.1)
    subset, ref_subset = [model[2].weight], [ref[2].weight]
    opt.grad_norm(parameters=subset)
    returned = opt.clip_grad_norm(0.5)
    coef = min(1.0, 0.5 / (norm64(ref_subset) + 1e-6))
    assert math.isclose(float(returned), norm64(ref_subset), rel_tol=1e-6) and coef < 1
    for p in ref.parameters():
        p.grad.mul_(coef)
    opt.step()
    ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_the_inf_verdict_covers_params_outside_the_subset():
    model = model_with_grads()
    model.zero_grad()
    before = [p.detach().clone() for p in model.parameters()]
    opt = FusedAdam(model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scaler.scale(model(torch.randn(4, 6)).square().sum()).backward()
    model[0].bias.grad[0] = float("inf")
    opt.unscale_grads(grad_scaler=scaler)
    norm = opt.clip_grad_norm(1.0, parameters=[model[2].weight])
    assert math.isfinite(float(norm))  # the subset is finite ...
    scaler.step(opt)  # ... but the step is skipped
    scaler.update()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert scaler.get_scale() < 4.0


def test_bad_subsets_are_refused():
    model = model_with_grads()
    frozen = nn.Parameter(torch.ones(2), requires_grad=False)
    opt = FusedAdam(model.parameters())
    with pytest.raises(ValueError, match=r"parameters\[1\] is a param of shape \(7,\) that this optimizer does not"):
        opt.grad_norm(parameters=[model[0].weight, nn.Parameter(torch.ones(7))])
    with pytest.raises(TypeError, match="pass norm_type by keyword"):
        opt.clip_grad_norm(1.0, 2.0)
    with pytest.raises(NotImplementedError):
        opt.grad_norm(norm_type=1.0)
    # A param without a gradient to give (frozen) is left out, as torch's clip_grad_norm_ leaves it.
    assert math.isclose(float(opt.grad_norm(parameters=[model[0].weight, frozen])), norm64([model[0].weight]),
                        rel_tol=1e-6)
