"""The CPU kernels' vector ISA paths and thread counts, for the tests that run the kernels under each.

Not a test module: test_cpu_kernels.py (bits equal across paths and thread counts) and test_cpu_isa.py
(the dispatch, and the paths against the documented algorithms) import these.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import pytest
import torch

from distopt import ops

try:
    from distopt import _C
except ImportError:  # compiled_cpu_kernels() reports it
    _C = None

ALL_ISAS = ("baseline", "avx2", "avx512")
# The paths this CPU (and build) can run, baseline first.
ISAS = ALL_ISAS[: ALL_ISAS.index(_C.best_cpu_isa()) + 1] if _C is not None else ("baseline",)
# (threads, ISA) runs compared with the first; None: the default (the best path).
RUNS = [(1, "baseline"), *((1, isa) for isa in ISAS[1:]), (2, None), (3, None), (2, "baseline"), (3, "baseline")]


@pytest.fixture
def compiled_cpu_kernels() -> None:
    """Fails the test unless distopt._C's CPU kernels are what the ops run."""
    missing = [op for op in ("adam_step_", "l2norm", "scale_") if (op, "CPU") not in ops.COMPILED_KERNELS]
    assert not missing, f"distopt._C has no CPU kernels for {missing}: these tests would test the reference"


@contextlib.contextmanager
def threads_and_isa(threads: int, isa: str | None) -> Iterator[None]:
    """torch's intra-op thread count and the kernels' ISA (None: the best one) for the block."""
    old_threads, old_isa = torch.get_num_threads(), os.environ.get("DISTOPT_CPU_ISA")
    torch.set_num_threads(threads)
    if isa is None:
        os.environ.pop("DISTOPT_CPU_ISA", None)
    else:
        os.environ["DISTOPT_CPU_ISA"] = isa
    try:
        yield
    finally:
        torch.set_num_threads(old_threads)
        if old_isa is None:
            os.environ.pop("DISTOPT_CPU_ISA", None)
        else:
            os.environ["DISTOPT_CPU_ISA"] = old_isa
