"""Eager and capturable Adam steps are bit-identical for every step count and betas, on every backend.

The eager op computes the update's coefficients on the host; the capturable op reads lr and each
tensor's step from device memory, so the CUDA kernel computes them on the device (once per block, in
shared memory). Both run the same function, math/adam.h's adam_coeffs, built only from IEEE basic
operations (Note [Bit-identical coefficients]): this checks that over steps sampled from 1..10,000 and
typical and odd betas, and, as a control that the comparison can fail, that a step off by one differs.
"""

from __future__ import annotations

import pytest
import torch

from backends import Backend
from op_helpers import (
    BF16,
    FP32,
    GRAD_SCALE,
    assert_adam_bits_equal,
    check_capturable_against_eager_and_reference,
    make_adam_state,
    run_adam,
    run_adam_capturable,
    scalar,
)

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

BETAS = [
    pytest.param(0.9, 0.999, id="0.9-0.999"),
    pytest.param(0.95, 0.98, id="0.95-0.98"),
    pytest.param(0.8765, 0.99991, id="odd"),
    pytest.param(0.5, 0.6180339887498949, id="short_memory"),
    pytest.param(0.0, 0.9999, id="no_momentum"),
]


def sampled_steps(count: int) -> list[int]:
    """Edge steps (1-12, powers of two and their neighbours, 10,000) and random ones up to 10,000."""
    edges = list(range(1, 13)) + [p + d for p in (64, 1024, 4096, 8192) for d in (-1, 0, 1)] + [9999, 10_000]
    rng = torch.Generator().manual_seed(2026)
    randoms = torch.randint(13, 10_001, (count - len(edges),), generator=rng).tolist()
    return edges + randoms


@pytest.mark.parametrize("beta1,beta2", BETAS)
def test_eager_and_capturable_bit_identical_over_steps(backend: Backend, beta1: float, beta2: float) -> None:
    """One tensor per sampled step, each with its own step tensor: the capturable op in one call gives,
    for every tensor, the bits of the eager op called with that step (and matches the float64
    reference), with fp32 params, bf16 grads and bf16 param_outs."""
    steps = sampled_steps(120)
    state = make_adam_state([37] * len(steps), FP32, BF16, BF16)
    check_capturable_against_eager_and_reference(
        state,
        lr=scalar(3e-3),
        steps=[scalar(float(s)) for s in steps],
        grad_scale=scalar(GRAD_SCALE),
        beta1=beta1,
        beta2=beta2,
    )


def test_a_step_off_by_one_is_seen(backend: Backend) -> None:
    """Control: the comparison above sees a coefficient change. Capturable at step n vs eager at n + 1
    differ for every small n (later, with beta1 = 0.9 and beta2 = 0.999, the corrections still move)."""
    steps = list(range(1, 40))
    state = make_adam_state([37] * len(steps), FP32, BF16, BF16)
    eager = state.clone()
    lr = scalar(3e-3)
    run_adam_capturable(state, lr=lr, steps=[scalar(float(s)) for s in steps])
    for i, s in enumerate(steps):
        one = eager.select([i])
        run_adam(one, lr=lr.item(), step=s + 1)
        with pytest.raises(AssertionError):
            assert_adam_bits_equal(state.select([i]), one, ["params"])
