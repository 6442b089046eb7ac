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


def assert_close(actual: torch.Tensor, expected: torch.Tensor, table: dict, dtype: torch.dtype | None = None, **kw):
    """torch.testing.assert_close with the table's tolerance for `dtype` (default: actual's dtype)."""
    tol = dict(table[dtype or actual.dtype])
    tol.update(kw)
    torch.testing.assert_close(actual.float(), expected.float(), **tol)
