"""Float64 references of what bench_kernels.py times, and the check of a contender against them.

The correctness checks compare each contender with these, never one contender with the other: torch's
fp32 ``vector_norm`` of 16M random elements is 6.5e-4 off the exact norm on the benchmark machines,
while distopt's (squares summed in double) matches it, so comparing the two failed at large sizes for
torch's rounding, not for a bug. distopt's results must be within its fp32 tolerances of the float64
result; torch's, within a looser bound that its fp32 accumulation explains (a check that it does the
same work, not a grade of its rounding).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

# distopt's outputs against float64: loose enough for fp32 arithmetic and one rounding of a 16-bit
# output, far tighter than any real bug.
TOLERANCE = {
    torch.float32: dict(rtol=1e-5, atol=1e-6),
    torch.bfloat16: dict(rtol=2**-6, atol=1e-5),
    torch.float16: dict(rtol=2**-9, atol=1e-6),
}
NORM_RTOL = 1e-5  # distopt's L2 norm: fp32 squares, summed in double
# torch's outputs against float64: its norm and everything scaled by the clip coefficient drawn from
# it carry its fp32 accumulation error (6.5e-4 at 16M elements); a wrong setup (other tensors, lr,
# betas) lands far outside.
BASELINE_RTOL = 1e-2


def l2norm(tensors: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
    """(total, per_tensor) L2 norms in float64."""
    per_tensor = torch.stack([t.double().norm() for t in tensors])
    return per_tensor.norm(), per_tensor


def adamw(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    step: int,
    grad_factor: Tensor | float = 1.0,
) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
    """One AdamW step (decoupled weight decay, bias correction for ``step``) in float64 on copies:
    (params, exp_avgs, exp_avg_sqs). The gradients are ``grads * grad_factor``."""
    beta1, beta2 = betas
    out_p, out_m, out_v = [], [], []
    for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs, strict=True):
        g = g.double() * grad_factor
        m = beta1 * m.double() + (1 - beta1) * g
        v = beta2 * v.double() + (1 - beta2) * g * g
        denom = (v / (1 - beta2**step)).sqrt() + eps
        out_p.append(p.double() * (1 - lr * weight_decay) - lr * (m / (1 - beta1**step)) / denom)
        out_m.append(m)
        out_v.append(v)
    return out_p, out_m, out_v


def clip_factor(grads: Sequence[Tensor], inv_scale: float, max_norm: float, clip_eps: float) -> Tensor:
    """The unscaled, clipped gradients' factor: ``inv_scale * min(1, max_norm / (norm + clip_eps))``,
    as torch.nn.utils.clip_grad_norm_ defines it, with the norm of the unscaled gradients in float64."""
    total, _ = l2norm([g.double() * inv_scale for g in grads])
    return inv_scale * (max_norm / (total + clip_eps)).clamp(max=1.0)


def assert_close(
    actual: Sequence[Tensor],
    expected: Sequence[Tensor],
    what: str,
    atol: float = 0.0,
    rtol: float = 0.0,
    baseline: bool = False,
) -> None:
    """Elementwise comparison of a contender's results with float64 ones, at the tolerance of each
    actual tensor's dtype (atol and rtol at least those given), or the baseline's looser rtol."""
    for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
        tol = dict(TOLERANCE[a.dtype])
        tol["atol"] = max(tol["atol"], atol)
        tol["rtol"] = max(tol["rtol"], rtol, BASELINE_RTOL if baseline else 0.0)
        try:
            torch.testing.assert_close(a.double(), e.double(), **tol)
        except AssertionError as exc:
            who = "torch's" if baseline else "distopt's"
            raise AssertionError(f"{what}[{i}]: {who} result differs from float64: {exc}") from None


def assert_update(
    masters: Sequence[Tensor],
    outs: Sequence[Tensor],
    moments: Sequence[Tensor],
    expected: tuple[list[Tensor], list[Tensor], list[Tensor]],
    param_atol: float,
    baseline: bool = False,
) -> None:
    """A contender's updated masters, model-param copies (``outs``: none or one per master) and
    moments (exp_avgs + exp_avg_sqs) against ``expected``, adamw()'s result."""
    params, exp_avgs, exp_avg_sqs = expected
    assert_close(masters, params, "masters", atol=param_atol, baseline=baseline)
    assert_close(outs, params[: len(outs)], "param_outs", atol=param_atol, baseline=baseline)
    assert_close(moments, exp_avgs + exp_avg_sqs, "moments", baseline=baseline)
