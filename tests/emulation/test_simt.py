"""Controls of the SIMT emulator (csrc/testing/simt): it must catch each class of kernel bug it claims to
catch, and pass a correct kernel under any schedule.

The kernels are in controls.cpp, built by the ``controls`` fixture (simt_controls.py: once per source
change, cached under build/) with the emulated build's own flags from csrc/build_config.py, against the
same emulator and the same vec.cuh, reduce.cuh and launch.cuh as distopt._C_emulated. The op tests run
the product kernels under the emulator (backend "cuda-emulated" in tests/ops/backends.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from simt_controls import BLOCK, Controls

ROOT = Path(__file__).resolve().parents[2]
SEEDS = (0, 1, 2, 3, 12345)


@pytest.fixture
def buffers() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(4 * BLOCK), torch.zeros(4 * BLOCK)


@pytest.mark.parametrize("seed", SEEDS)
def test_correct_block_reduction_passes_under_every_seed(controls: Controls, buffers, seed: int) -> None:
    """The product's block_sum (shuffles, shared memory, two barriers) passes every check under several
    schedules and always gives the same bits (the reduction order is fixed by the code, not the schedule)."""
    x, out = buffers
    controls.stats(reset=True)
    controls.run("block_sum", x, out, seed)
    expected = x.view(4, BLOCK).double().sum(1).float()
    torch.testing.assert_close(out[:4], expected, rtol=1e-5, atol=1e-5)
    first = out[:4].clone()
    controls.run("block_sum", x, out, seed + 100)
    assert torch.equal(out[:4], first)
    stats = controls.stats()
    assert stats["launches"] == 2 and stats["blocks"] == 8 and stats["threads"] == 8 * BLOCK
    assert stats["barriers"] == 8 * 2  # two per block_sum
    assert stats["warp_collectives"] == 8 * (16 + 1) * 5  # 16 warps, then warp 0 again; 5 steps each
    assert stats["shared_accesses"] == 8 * (16 + 16)  # 16 lane-0 writes, 16 reads by warp 0


def test_schedule_depends_on_the_seed(controls: Controls, buffers) -> None:
    """The scheduler runs threads in order under seed 0 and in seed-dependent, reproducible orders
    otherwise (the last of 512 unordered writes tells which thread ran last)."""
    x, out = buffers

    def last_writer(seed: int) -> int:
        controls.run("last_writer", x, out, seed)
        return int(out[0].item())

    assert last_writer(0) == BLOCK - 1
    assert len({last_writer(seed) for seed in range(1, 9)}) > 1
    assert last_writer(5) == last_writer(5)


# (control, error kind, a fragment of the details): what the emulator must report for each broken kernel.
NEGATIVE = [
    ("half_warp_mask", "warp collective mask", "with mask 0x0000ffff, which does not include its own lane"),
    ("shuffle_outside_mask", "warp collective mask", "reads lane 16"),
    ("missing_barrier", "shared-memory race", "since __syncthreads at "),
    ("misaligned_vector", "misaligned access", "requires 16-byte alignment, at cuda/vec.cuh:"),
    ("early_return", "barrier divergence", "thread(s) exited while 256 wait at __syncthreads at cuda/reduce.cuh:"),
    ("divergent_barriers", "barrier divergence", "threads wait at different barriers"),
    ("deadlock", "deadlock", "wait at __shfl_down_sync at "),
    ("uninitialised_shared", "uninitialised shared memory", "which no thread of this block has written"),
    ("huge_params", "invalid launch", "the kernel parameters take 32776 bytes, more than 32764 (emulated driver 13000"),
    ("empty_grid", "invalid launch", "empty grid (0,1,1)"),
]


@pytest.mark.parametrize("seed", [0, 7])
@pytest.mark.parametrize("name,kind,detail", NEGATIVE, ids=[n for n, _, _ in NEGATIVE])
def test_broken_kernel_is_caught(controls: Controls, buffers, name: str, kind: str, detail: str, seed: int) -> None:
    """Each broken kernel raises a RuntimeError naming the violation, the kernel and what went wrong,
    in order (seed 0) and in a random schedule."""
    x, out = buffers
    with pytest.raises(RuntimeError, match=f"^CUDA emulator: {kind}") as info:
        controls.run(name, x, out, seed)
    message = str(info.value)
    assert detail in message, message
    if name not in ("huge_params", "empty_grid"):
        assert f"in kernel '{name}' (grid " in message and f", seed {seed}, " in message, message


# (driver, runtime, compute capability major) -> whether 4,408 bytes of parameters are accepted: only
# with a CUDA >= 12.1 driver and runtime on Volta (7.0) or later, as on a GPU.
RUNTIMES = [
    ((13000, 13000, 9), True),
    ((12010, 12010, 7), True),
    ((12000, 13000, 9), False),  # a 12.0 driver (minor-version compatibility lets a 12.x build run on it)
    ((12080, 12000, 9), False),  # a 12.0 runtime
    ((12080, 12080, 6), False),  # Pascal
]


@pytest.mark.parametrize("runtime,accepted", RUNTIMES, ids=[f"{d}-{r}-sm{c}" for (d, r, c), _ in RUNTIMES])
def test_parameter_limit_follows_the_emulated_runtime(controls: Controls, buffers, runtime, accepted: bool) -> None:
    """4 KiB of kernel parameters is the limit unless the emulated machine allows 32,764 bytes; 32,776
    bytes never fit."""
    x, out = buffers
    controls.set_runtime(*runtime)
    try:
        if accepted:
            controls.run("big_params", x, out)
        else:
            with pytest.raises(RuntimeError, match="the kernel parameters take 4408 bytes, more than 4096 "):
                controls.run("big_params", x, out)
        with pytest.raises(RuntimeError, match="the kernel parameters take 32776 bytes, more than "):
            controls.run("huge_params", x, out)
    finally:
        controls.set_runtime()


def test_race_report_names_both_accesses(controls: Controls, buffers) -> None:
    """A race message gives the file:line of both conflicting accesses (from the build's line tables)."""
    x, out = buffers
    with pytest.raises(RuntimeError, match="shared-memory race") as info:
        controls.run("missing_barrier", x, out, 3)
    assert str(info.value).count("controls.cpp:") >= 2, str(info.value)


def test_emulator_recovers_after_an_error(controls: Controls, buffers) -> None:
    """A rejected launch leaves the emulator usable: the next launch runs normally."""
    x, out = buffers
    with pytest.raises(RuntimeError):
        controls.run("deadlock", x, out)
    controls.run("block_sum", x, out)
    torch.testing.assert_close(out[:4], x.view(4, BLOCK).sum(1), rtol=1e-5, atol=1e-5)


def test_every_launch_goes_through_launch_kernel() -> None:
    """No `<<<` launch outside csrc/cuda/launch.cuh, so the emulated build compiles every launch site."""
    raw = [
        f"{path.relative_to(ROOT)}:{number}"
        for path in sorted((ROOT / "csrc").rglob("*"))
        if path.suffix in (".cu", ".cuh", ".cpp", ".h") and path.name != "launch.cuh"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if "<<<" in line and not line.lstrip().startswith("//")
    ]
    assert not raw, f"launch with distopt::cuda::launch_kernel instead: {raw}"
