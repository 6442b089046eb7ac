"""Shared-memory bank conflicts, counted by the SIMT emulator (Note [Shared-memory wavefronts] in
csrc/testing/simt/simt.h): its model against accesses whose cost a GPU documents, and the 8-bit Adam
kernel's budget (at most WAVEFRONT_BUDGET wavefronts per 32 elements with both moments 8-bit), with a
negative control: the binary search the kernel used before (commit 89b84a8) exceeds it.
"""

from __future__ import annotations

import pytest
import torch
from simt_controls import Controls

from distopt import state_formats as sf

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
    """The old kernel's shared accesses per element (two map reads, two 8-step searches) on 256 random
    elements: far over the budget, because every lane's step-s probe of a search falls in one bank."""
    x, out = torch.randn(2048), torch.zeros(2048)
    counting.run("binary_search_8bit", x, out, seed=5)
    stats = counting.stats()
    fill = 2 * 2 * 256 // 32  # the maps' writes, conflict-free
    per_32 = (stats["shared_wavefronts"] - fill) / (256 / 32)
    assert per_32 > WAVEFRONT_BUDGET, per_32


def _emulated():
    import backends  # tests/: the emulated module, built on first use

    return backends.emulated_or_skip()


def test_8bit_kernel_meets_the_wavefront_budget() -> None:
    """One Adam step with both moments 8-bit on four full 64K-element chunks of random data, run by the
    CUDA kernel under the emulator: its shared-memory wavefronts (the tables' copy into shared memory
    included) per 32 elements are within the budget."""
    emulated = _emulated()
    import backends

    backends.load_emulated()
    n = 4 * 65536
    torch.manual_seed(0)
    p, g = torch.randn(n), torch.randn(n)
    m_codes, m_absmax = sf.quantize_blockwise(0.1 * torch.randn(n), True)
    v_codes, v_absmax = sf.quantize_blockwise(0.01 * torch.randn(n) ** 2, False)
    emulated.set_seed(1)
    emulated.set_bank_counting(True)
    emulated.reset_stats()
    try:
        torch.ops.distopt_emulated.adam_step_(
            [p], [g], [m_codes], [v_codes], [], [], torch.tensor(1e-3, dtype=torch.float64),
            [torch.tensor(3.0, dtype=torch.float64)], 0.9, 0.999, 1e-8, 0.01, True, False, None, None,
            [m_absmax], [v_absmax], None, [], [],
        )  # fmt: skip
        stats = emulated.stats()
    finally:
        emulated.set_bank_counting(False)
    per_32 = stats["shared_wavefronts"] / (n / 32)
    assert stats["launches"] == 1 and stats["shared_requests"] > 0
    assert per_32 <= WAVEFRONT_BUDGET, f"{per_32:.2f} shared wavefronts per 32 elements"
    # Two map reads and two bucket reads per element: at least 4 requests per 32 elements.
    assert stats["shared_requests"] >= 4 * n / 32
    print(
        f"8-bit Adam: {per_32:.2f} shared wavefronts per 32 elements "
        f"({stats['shared_wavefronts'] / stats['shared_requests']:.2f} per request)"
    )
