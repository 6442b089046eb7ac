"""Comparison tolerances, named per dtype in one place."""

from __future__ import annotations

import torch

# A kernel (fp32 math) against the float64 reference, per output dtype: a few fp32 ulps, or one
# rounding step of the 16-bit type (the fp32 result and the float64 result may round differently).
KERNEL = {
    torch.float32: dict(rtol=4e-6, atol=1e-6),
    torch.bfloat16: dict(rtol=2**-7, atol=1e-5),
    torch.float16: dict(rtol=2**-10, atol=1e-5),
}

# An optimizer against torch.optim over many steps, compared in fp32 (issue: fp32 within 1e-6
# relative); 16-bit params with fp32 master weights against an fp32 torch run: one 16-bit rounding.
OPTIMIZER = {
    torch.float32: dict(rtol=1e-6, atol=1e-7),
    torch.bfloat16: dict(rtol=2**-7, atol=1e-4),
    torch.float16: dict(rtol=2**-10, atol=1e-4),
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, table: dict, dtype: torch.dtype | None = None,
                 scale_atol: bool = False, **kw):
    """torch.testing.assert_close with the table's tolerance for `dtype` (default: actual's dtype);
    complex tensors are compared as their real views, with their parts' tolerance."""
    if actual.is_complex() or expected.is_complex():
        actual, expected = torch.view_as_real(actual), torch.view_as_real(expected)
    tol = dict(table[dtype or actual.dtype])
    if scale_atol and expected.numel():
        tol["atol"] = max(tol["atol"], tol["rtol"] * expected.detach().abs().max().item())
    tol.update(kw)
    torch.testing.assert_close(actual.float(), expected.float(), **tol)

# Two training runs of the same model that differ in how gradients are reduced (DDP all-reduce vs
# reduce-scatter: another summation order) and in the update kernel (a few ulps), compared through
# a few steps and a forward pass, which sums many products of those slightly different params.
# For 16-bit runs pass scale_atol=True: a 16-bit summation in another order rounds differently at
# the scale of the largest terms, so elements near zero get an absolute tolerance of one rounding
# step at the tensor's largest magnitude.
DISTRIBUTED = {
    torch.float32: dict(rtol=1e-5, atol=1e-6),
    torch.bfloat16: dict(rtol=2**-7, atol=1e-4),
    torch.float16: dict(rtol=2**-10, atol=1e-4),
}
