"""One 64M-element Adam update per moment format, three times each, for Nsight Compute. Needs a GPU.

Formats: fp32, u8 (8-bit blockwise), sr (bf16 with stochastic rounding). Used for
benchmarks/results/h200-2026-11-28:

    ncu --launch-skip 2 --launch-count 1 -k regex:multi_tensor python3 tools/probes/ncu_adam_update.py u8
"""

from __future__ import annotations

import sys

import torch

from distopt import ops
from distopt.state_formats import quantize_blockwise

N = 64 * 2**20


def update(fmt: str, param: torch.Tensor, grad: torch.Tensor) -> None:
    """Three updates of ``param`` with moments in ``fmt``."""
    extra: dict = {}
    if fmt == "u8":
        (m, m_scales), (v, v_scales) = (quantize_blockwise(torch.randn(N, device="cuda"), True),
                                        quantize_blockwise(torch.rand(N, device="cuda"), False))
        extra = dict(exp_avg_scales=[m_scales], exp_avg_sq_scales=[v_scales])
    elif fmt == "sr":
        m, v = torch.randn(N, device="cuda").bfloat16(), torch.rand(N, device="cuda").bfloat16()
        extra = dict(rounding_seed=7, param_ids=[0])
    elif fmt == "fp32":
        m, v = torch.randn(N, device="cuda"), torch.rand(N, device="cuda")
    else:
        raise SystemExit(f"unknown format {fmt!r}: fp32, u8 or sr")
    for i in range(3):
        ops.adam_step_([param], [grad], [m], [v], lr=1e-3, step=i + 1, weight_decay=0.01, **extra)
    torch.cuda.synchronize()


if __name__ == "__main__":
    torch.manual_seed(0)
    p, g = torch.randn(N, device="cuda"), torch.randn(N, device="cuda")
    for name in sys.argv[1:]:
        update(name, p, g)
