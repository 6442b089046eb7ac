"""Shared-memory bank conflicts, counted by the SIMT emulator (Note [Shared-memory wavefronts] in
csrc/testing/simt/simt.h): its model against accesses whose cost a GPU documents, and the budget of the
8-bit Adam kernel (at most WAVEFRONT_BUDGET wavefronts per 32 elements with both moments 8-bit), which
the binary search the kernel uses exceeds.
"""

from __future__ import annotations

import pytest
import torch
from simt_controls import Controls

WAVEFRONT_BUDGET = 16  # per 32 elements, both moments 8-bit (issue 31)
FILL = 32  # the bank controls' 32 conflict-free row writes (controls.cpp's banks_kernel)


@pytest.fixture
def counting(controls: Controls):
    controls.set_bank_counting(True)
    controls.stats(reset=True)
    yield controls
    controls.set_bank_counting(False)


# (control, wavefronts of its one access): the CUDA programming guide's rules for 32 four-byte banks.
ACCESSES = [
    ("banks_consecutive", 1),
    ("banks_broadcast", 1),
    ("banks_one_bank", 32),
    ("banks_stride2", 2),
    ("banks_four_words", 4),
    ("banks_vector16", 4),
    ("banks_vector8", 2),
]


@pytest.mark.parametrize("name,wavefronts", ACCESSES, ids=[n for n, _ in ACCESSES])
def test_wavefront_model(counting: Controls, name: str, wavefronts: int) -> None:
    x, out = torch.randn(2048), torch.zeros(2048)
    counting.run(name, x, out, seed=3)  # a random schedule: the grouping must not depend on it
    stats = counting.stats()
    assert stats["shared_requests"] == FILL + 1
    assert stats["shared_wavefronts"] - FILL == wavefronts


def test_counting_is_off_by_default(controls: Controls) -> None:
    x, out = torch.randn(2048), torch.zeros(2048)
    controls.stats(reset=True)
    controls.run("banks_one_bank", x, out)
    assert controls.stats()["shared_wavefronts"] == 0


def test_negative_control_binary_search_exceeds_the_budget(counting: Controls) -> None:
    """The 8-bit kernel's shared accesses per element (two map reads, two 8-step searches) on 256 random
    elements: far over the budget, because every lane's step-s probe of a search falls in one bank."""
    x, out = torch.randn(2048), torch.zeros(2048)
    counting.run("binary_search_8bit", x, out, seed=5)
    stats = counting.stats()
    fill = 2 * 2 * 256 // 32  # the maps' writes, conflict-free
    per_32 = (stats["shared_wavefronts"] - fill) / (256 / 32)
    assert per_32 > WAVEFRONT_BUDGET, per_32
