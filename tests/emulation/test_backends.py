"""The "cuda-emulated" op-test backend's plumbing (tests/ops/backends.py): its ops run the CUDA kernels under
the emulator, the emulator's errors surface as RuntimeError, and the cross-check against the CPU kernel
is not vacuous."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from distopt import ops

from backends import Backend, CrossCheck, emulated_or_skip
from op_helpers import BF16, GRAD_SCALE, randn_list, scalar


def test_emulated_ops_run_the_emulated_kernels() -> None:
    """torch.ops.distopt_emulated.* are distopt._C_emulated's kernels, and a call runs emulated launches."""
    emulated = emulated_or_skip()
    dump = torch._C._dispatch_dump("distopt_emulated::l2norm")
    assert any(line.startswith("CPU:") and "registration_cuda.cpp" in line for line in dump.splitlines()), dump
    emulated.reset_stats()
    torch.ops.distopt_emulated.l2norm([torch.randn(70_000), torch.randn(5)], None)
    assert [name for name, _, _ in emulated.launches()] == ["l2norm", "l2norm per-tensor", "l2norm total"]
    stats = emulated.stats()
    assert stats["launches"] == 3 and stats["blocks"] == 3 + 2 + 1 and stats["threads"] == 6 * 512
    assert stats["barriers"] == 3 * 3 + 3 * 2  # block_sum twice (+ __syncthreads_or) per pass-1 block


def test_emulator_error_surfaces_as_runtime_error() -> None:
    """A float32 tensor at an odd address (possible through numpy or from_blob; the binding layer does
    not refuse it) makes the emulated kernel fail as a GPU would: RuntimeError naming the fault."""
    emulated_or_skip()
    raw = np.zeros(4 * 1000 + 1, dtype=np.uint8)
    misaligned = torch.from_numpy(np.frombuffer(raw, dtype=np.float32, offset=1, count=1000))
    assert misaligned.data_ptr() % 4 == 1
    with pytest.raises(RuntimeError, match=r"CUDA emulator: misaligned access in kernel 'l2norm'.*cuda/l2norm\.cu:"):
        torch.ops.distopt_emulated.l2norm([misaligned], None)
    total, _ = torch.ops.distopt_emulated.l2norm([torch.ones(16)], None)  # and it keeps working
    assert total.item() == 4.0


class Perturbed(CrossCheck):
    """A backend whose kernels are off by one bit in their first output (a negative control)."""

    def backend_op(self, func, device):
        run = super().backend_op(func, device)

        def perturbed(*args, **kwargs):
            result = run(*args, **kwargs)
            out = args[1][0].view(-1).view(torch.int16)
            out[0] ^= 1
            return result

        return perturbed


def test_cross_check_catches_a_one_bit_difference() -> None:
    """The cross-check fails on a single flipped bit of one output element."""
    emulated_or_skip()
    inputs, outputs = randn_list([100, 70_000], BF16), randn_list([100, 70_000], BF16)
    with CrossCheck(Backend("cuda-emulated", "cpu")):
        ops.scale_(inputs, outputs, scalar(GRAD_SCALE))  # the real kernels agree
    message = "cuda-emulated scale_: argument tensor #2 vs the CPU kernel: 1 of 100 elements differ"
    with pytest.raises(AssertionError, match=message), Perturbed(Backend("cuda-emulated", "cpu")):
        ops.scale_(inputs, outputs, scalar(GRAD_SCALE))
