"""grad_scaling.count_step: the capturable step counters advance on the device, never through a host read.

The first GPU run found FusedAdam(capturable=True) synchronising at every step and failing CUDA-graph
capture: ``torch._foreach_add_(steps, 1 - found_inf)`` resolves to the Scalar overload, which reads the
0-dim tensor with ``.item()``. A host read shows on the CPU too (``aten._local_scalar_dense``), so this
is tested here, where CI runs, and the GPU tests (tests/distributed/test_cuda_graphs.py) capture it.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from distopt.grad_scaling import count_step


class HostReads(TorchDispatchMode):
    """Records the aten ops that ran; ``reads`` counts those that copy a tensor's value to the host."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))

    @property
    def reads(self) -> int:
        return sum(op.startswith("aten._local_scalar_dense") for op in self.ops)


def steps_at(values: list[float]) -> list[torch.Tensor]:
    return [torch.tensor(v, dtype=torch.float32) for v in values]


@pytest.mark.parametrize("flag", [0.0, 1.0], ids=["finite", "inf_step"])
def test_count_step_reads_nothing_on_the_host(flag):
    steps = steps_at([0.0, 3.0, 7.0])
    found_inf = torch.tensor(flag)
    with HostReads() as mode:
        count_step(steps, found_inf)
    assert mode.reads == 0, mode.ops
    assert any(op.startswith("aten._foreach_add_.Tensor") for op in mode.ops), mode.ops
    assert [s.item() for s in steps] == ([0.0, 3.0, 7.0] if flag else [1.0, 4.0, 8.0])


def test_count_step_without_a_flag():
    steps = steps_at([2.0, 5.0])
    with HostReads() as mode:
        count_step(steps, None)
    assert mode.reads == 0 and [s.item() for s in steps] == [3.0, 6.0]


def test_the_detector_catches_the_scalar_overload():
    """Negative control: the call count_step replaced is seen reading the flag on the host."""
    steps, found_inf = steps_at([0.0]), torch.tensor(0.0)
    with HostReads() as mode:
        torch._foreach_add_(steps, 1 - found_inf)
    assert mode.reads == 1, mode.ops
