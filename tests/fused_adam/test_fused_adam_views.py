"""FusedAdam on params its kernel cannot walk as they are (distopt/kernel_views.py): a complex param is
stepped as its real view, a param that is not dense in memory through a contiguous copy. Each gives
the bits FusedAdam gives on the equivalent plain params (the real view as a real param; a contiguous
clone), on the general, planned and offloaded paths, with 16-bit params and fp32 masters; what a
non-dense param shares its memory with stays untouched. (Against torch.optim.AdamW itself:
tests/fused_adam/test_fused_adam_optim_db.py.)"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import distopt.kernel_views as views
from distopt import FusedAdam

import tolerances

STEPS = 5
OPTIONS = {"plain": {}, "master_weights": {"master_weights": True}, "offload": {"offload_optimizer": True}}


def gradients(shapes_dtypes, steps: int = STEPS, device: str = "cpu") -> list[list[torch.Tensor]]:
    """Per step, one random gradient per (shape, dtype), contiguous."""
    g = torch.Generator().manual_seed(7)
    return [[torch.randn(shape, generator=g, dtype=torch.complex64 if dtype.is_complex else torch.float32)
             .to(device=device, dtype=dtype) for shape, dtype in shapes_dtypes] for _ in range(steps)]


def train(params: list[nn.Parameter], grads: list[list[torch.Tensor]], **options) -> tuple[list, FusedAdam, int]:
    """FusedAdam(params) over `grads`; (params after each step, the optimizer, planned kernel calls)."""
    opt = FusedAdam([{"params": params[:1]}, {"params": params[1:], "lr": 3e-2}], lr=1e-2, weight_decay=0.1,
                    **options)
    planned, run_call = [0], opt._run_call

    def counted(*args, **kwargs):
        planned[0] += 1
        return run_call(*args, **kwargs)

    opt._run_call = counted
    history = []
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        opt.step()
        history.append([p.detach().clone() for p in params])
    return history, opt, planned[0]


def assert_bitwise(actual: list, expected: list, as_expected=lambda t: t) -> None:
    for step, (a_step, e_step) in enumerate(zip(actual, expected, strict=True)):
        for i, (a, e) in enumerate(zip(a_step, e_step, strict=True)):
            assert torch.equal(as_expected(a), e), f"step {step + 1}, param {i}"


# ---------------------------------------------------------------------------------------- complex


def complex_params(half: bool) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(3)
    dtype = torch.complex32 if half else torch.complex64
    return [nn.Parameter(torch.randn(3, 5, dtype=torch.complex64, generator=g).to(dtype)),
            nn.Parameter(torch.randn(7, dtype=torch.complex64, generator=g).to(dtype)),
            nn.Parameter(torch.randn(4, generator=g).to(torch.float16 if half else torch.float32))]


COMPLEX_HALF = pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")


@COMPLEX_HALF
@pytest.mark.parametrize("half", [False, True], ids=["complex64", "complex32"])
@pytest.mark.parametrize("option", list(OPTIONS))
def test_complex_params_step_as_their_real_views(option, half):
    """Bit for bit the run of the real views as real params, state included (complex, shaped like the
    param, as torch keeps it; complex64 whatever the param's precision, as FusedAdam's fp32 moments)."""
    params = complex_params(half)
    grads = gradients([(p.shape, p.dtype) for p in params])
    history, opt, planned = train(params, grads, **OPTIONS[option])
    real = [nn.Parameter(views.as_real(p.detach()).clone()) for p in complex_params(half)]
    expected, ref_opt, _ = train(real, [[views.as_real(g) for g in step] for step in grads], **OPTIONS[option])
    assert_bitwise(history, expected, views.as_real)
    assert planned > 0 or option == "offload"  # the planned path took part (offload has none)
    for p, r in zip(params, real):
        state, ref_state = opt.state[p], ref_opt.state[r]
        assert state.keys() == ref_state.keys()
        for key in ("exp_avg", "exp_avg_sq", "param"):
            if key in state:
                assert state[key].dtype == views.state_dtype(p) and state[key].shape == p.shape, key
                assert torch.equal(views.as_real(state[key]), ref_state[key]), key


def test_negative_control_updates_lost_in_a_copy_are_caught(monkeypatch):
    """A real view that is a copy (the kernel's writes never reach the param) fails the comparison."""
    params = complex_params(half=False)
    grads = gradients([(p.shape, p.dtype) for p in params])
    monkeypatch.setattr(views, "as_real", lambda t: torch.view_as_real(t).clone() if t.is_complex() else t)
    history, _, _ = train(params, grads)
    monkeypatch.undo()
    real = [nn.Parameter(views.as_real(p.detach()).clone()) for p in complex_params(half=False)]
    expected, _, _ = train(real, [[views.as_real(g) for g in step] for step in grads])
    with pytest.raises(AssertionError):
        assert_bitwise(history, expected, views.as_real)


@COMPLEX_HALF
def test_complex_params_follow_adamw_with_16bit_masters():
    """complex32 params with fp32 masters against AdamW on complex64 copies: one fp16 rounding apart,
    the masters within fp32 tolerance (AdamW keeps complex32 moments, FusedAdam complex64 ones)."""
    params = complex_params(half=True)[:2]
    ref = [nn.Parameter(p.detach().to(torch.complex64)) for p in params]
    opt, ref_opt = FusedAdam(params, master_weights=True), torch.optim.AdamW(ref)
    for step_grads in gradients([(p.shape, p.dtype) for p in params]):
        for p, r, g in zip(params, ref, step_grads):
            p.grad, r.grad = g, g.to(torch.complex64)
        opt.step()
        ref_opt.step()
        for p, r in zip(params, ref):
            tolerances.assert_close(opt.state[p]["param"], r, tolerances.OPTIMIZER)
            tolerances.assert_close(p, r, tolerances.OPTIMIZER, dtype=torch.float16)


# ---------------------------------------------------------------------------------------- not dense


# Views that are not dense in memory: every other element, a transposed slice, a strided complex slice.
VIEWS = [lambda b: b[..., 0], lambda b: b[..., 0].t(), lambda b: b[:, ::2]]


def strided_params(dtype: torch.dtype) -> tuple[list[nn.Parameter], list[torch.Tensor]]:
    """Params that are VIEWS of larger tensors, and a dense one; and the tensors the VIEWS are of."""
    g = torch.Generator().manual_seed(4)
    bases = [torch.randn(6, 4, 2, generator=g).to(dtype), torch.randn(5, 3, 2, generator=g).to(dtype),
             torch.randn(4, 6, dtype=torch.complex64, generator=g)]
    params = [nn.Parameter(view(base)) for view, base in zip(VIEWS, bases)]
    return params + [nn.Parameter(torch.randn(5, generator=g).to(dtype))], bases


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("option", list(OPTIONS))
def test_params_not_dense_in_memory_step_as_contiguous_copies(option, dtype):
    """Bit for bit the run of contiguous clones; each param stays the same view of the same memory
    (its strides too), the rest of that memory is untouched, its state is contiguous."""
    params, bases = strided_params(dtype)
    views_before = [(p.data_ptr(), p.stride()) for p in params]
    others_before = [b.clone() for b in bases]
    grads = gradients([(p.shape, p.dtype) for p in params])
    history, opt, planned = train(params, grads, **OPTIONS[option])
    expected, _, _ = train([nn.Parameter(p.detach().clone(memory_format=torch.contiguous_format))
                            for p in strided_params(dtype)[0]], grads, **OPTIONS[option])
    assert_bitwise(history, expected)
    assert planned > 0 or option == "offload"
    assert [(p.data_ptr(), p.stride()) for p in params] == views_before
    for view, base, before in zip(VIEWS, bases, others_before):
        untouched = torch.ones_like(base, dtype=torch.bool)
        view(untouched).fill_(False)  # where the param lives
        assert torch.equal(base[untouched], before[untouched])
    for p in params[:3]:
        assert all(t.is_contiguous() for k, t in opt.state[p].items() if k != "step")


def test_negative_control_copies_not_written_back_are_caught(monkeypatch):
    params, _ = strided_params(torch.float32)
    grads = gradients([(p.shape, p.dtype) for p in params])
    monkeypatch.setattr(views, "write_back", lambda staged: None)
    history, _, _ = train(params, grads)
    monkeypatch.undo()
    expected, _, _ = train([nn.Parameter(p.detach().contiguous()) for p in strided_params(torch.float32)[0]], grads)
    with pytest.raises(AssertionError):
        assert_bitwise(history, expected)


def test_a_gradient_not_dense_in_memory_is_read_as_it_is():
    """A hand-set gradient with gaps, for dense and non-dense params: the same bits as its contiguous
    copy, and grad_norm/clip_grad_norm as torch.nn.utils.clip_grad_norm_ computes them."""
    params, _ = strided_params(torch.float32)
    gappy = [g[..., 0] for g in gradients([((*p.shape, 2), p.dtype) for p in params], steps=1)[0]]
    assert not any(views.is_walkable(g) for g in gappy)
    ref = [nn.Parameter(p.detach().clone()) for p in params]
    opt, ref_opt = FusedAdam(params), torch.optim.AdamW(ref)
    for p, r, g in zip(params, ref, gappy):
        p.grad, r.grad = g, g.contiguous()
    norm = opt.clip_grad_norm(0.5)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref, 0.5)
    tolerances.assert_close(norm, ref_norm, tolerances.OPTIMIZER)
    opt.step()
    ref_opt.step()
    for p, r in zip(params, ref):
        tolerances.assert_close(p, r, tolerances.OPTIMIZER)


# ---------------------------------------------------------------------------------------- refused


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128], ids=str)
def test_float64_params_are_refused_with_the_reason(dtype):
    with pytest.raises(TypeError, match=r"float64|complex128.*compute in float32.*torch.optim.AdamW"):
        FusedAdam([nn.Parameter(torch.randn(3, dtype=dtype))])


def test_params_whose_elements_share_memory_are_refused():
    """An expanded tensor: AdamW fails at its first step; FusedAdam says why at construction."""
    with pytest.raises(ValueError, match="must not overlap in memory"):
        FusedAdam([nn.Parameter(torch.randn(3, 1).expand(3, 4))])
    taken = [nn.Parameter(torch.randn(3, 0)), nn.Parameter(torch.randn(3, 4, 2)[..., 1])]  # empty; gaps
    opt = FusedAdam(taken)
    for p in taken:
        p.grad = torch.ones(p.shape)
    opt.step()
    assert [float(s["step"]) for s in opt.state.values()] == [1.0, 1.0]


def test_a_real_gradient_for_a_complex_param_is_refused_before_anything_changes():
    p, q = nn.Parameter(torch.randn(3, dtype=torch.complex64)), nn.Parameter(torch.randn(2))
    opt = FusedAdam([q, p])
    p.grad_dtype = None  # torch >= 2.9 refuses the assignment otherwise
    p.grad, q.grad = torch.randn(3), torch.randn(2)
    before = q.detach().clone()
    with pytest.raises(RuntimeError, match="complex for complex params"):
        opt.step()
    assert torch.equal(q, before) and not opt.state


@pytest.mark.cuda
@pytest.mark.parametrize("capturable", [False, True])
def test_complex_and_non_dense_params_on_cuda(capturable):
    """On the GPU, eager and capturable: the bits of the real views / contiguous clones."""
    params = [nn.Parameter(p.detach().cuda()) for p in complex_params(half=False)]
    params.append(nn.Parameter(torch.randn(6, 4, 2, device="cuda")[..., 0]))
    plain = [nn.Parameter(views.as_real(p.detach()).clone(memory_format=torch.contiguous_format)) for p in params]
    grads = gradients([(p.shape, p.dtype) for p in params], device="cuda")
    history, _, _ = train(params, grads, capturable=capturable)
    expected, _, _ = train(plain, [[views.as_real(g) for g in step] for step in grads], capturable=capturable)
    assert_bitwise(history, expected, views.as_real)
