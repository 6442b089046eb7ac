"""How the multi-tensor ops split work into CUDA launches, on every backend (tests/ops/backends.py): lists
that overflow a launch's metadata (tensor slots, blocks) at each kind of boundary, a tensor continuing
in the next launch, per-list alignments and offsets, empty tensors, the capturable op's step row,
l2norm's workspace across its per-tensor launches, and the launch counts for many tensors (three launches'
worth by default, 10,000 in the long version).

The sizes come from the launch constants of the build (distopt._C_emulated.constants(), i.e.
csrc/cuda/multi_tensor_apply.cuh) for the metadata size in use: 4 KiB or 32K (32,764 bytes), which the
``meta`` fixture selects by setting the emulated CUDA runtime's versions (csrc/cuda/kernel_params.cuh
decides from them). Under "cuda-emulated" the launch log shows the split really happened. The CPU
kernels have no launches: there these are plain correctness tests, and on a GPU the real runtime
decides the size. Every op call under cuda-emulated and cuda is also checked bit for bit against the
CPU kernel (backends.CrossCheck).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch
from torch import Tensor

from distopt import ops

from backends import Backend, emulated_or_skip, load_emulated
from op_helpers import (
    BF16,
    CHUNK,
    FP16,
    FP32,
    GRAD_SCALE,
    HYPER,
    assert_adam_close,
    assert_bits_equal,
    assert_each_bits_equal,
    assert_params_moved,
    check_adam_against_reference,
    check_l2norm_against_reference,
    make_adam_state,
    randn_list,
    run_adam,
    run_adam_capturable,
    run_reference_adam_capturable,
    scalar,
)

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


# What the emulated machine reports for each metadata size: (driver, runtime) CUDA versions.
RUNTIMES = {"4KiB": (12000, 12000), "32K": (13000, 13000)}


def emulated_constants(path: str) -> dict:
    """The launch constants with the emulated runtime set for ``path`` ("4KiB" or "32K")."""
    emulated = emulated_or_skip()  # (the module that reports the launch constants)
    driver, runtime = RUNTIMES[path]
    emulated.set_runtime(driver_version=driver, runtime_version=runtime)
    constants = emulated.constants()
    assert constants["large_kernel_params"] == (path == "32K")
    return constants


@pytest.fixture(params=list(RUNTIMES))
def meta(request: pytest.FixtureRequest) -> Iterator[dict]:
    """The launch constants of one metadata size, selected in the emulator for the test's duration."""
    yield emulated_constants(request.param)
    emulated_constants("32K")  # the emulator's initial machine (simt.h)


@pytest.fixture
def small_meta() -> Iterator[dict]:
    """The 4 KiB metadata's constants, selected in the emulator (for splits whose 32K sizes would take
    too long to emulate: the launch loop is the same template for both sizes)."""
    yield emulated_constants("4KiB")
    emulated_constants("32K")


def launch_log(backend: Backend) -> dict[str, list[int]] | None:
    """Kernel name -> grid sizes of the emulated launches since the last call (None on other backends)."""
    if backend.name != "cuda-emulated":
        return None
    emulated = load_emulated()
    log: dict[str, list[int]] = {}
    for name, grid, _ in emulated.launches():
        log.setdefault(name, []).append(grid[0])
    emulated.reset_stats()
    return log


@pytest.fixture
def reset_log(backend: Backend) -> Backend:
    launch_log(backend)
    return backend


def test_constants_match_the_tests(meta: dict) -> None:
    """The tests' chunk size (op_helpers.CHUNK) is the build's, and test_ops_cuda's HUGE tensor spans
    launches with either metadata size."""
    from test_ops_cuda import HUGE

    assert meta["chunk_size"] == CHUNK
    assert math.ceil(HUGE / CHUNK) > max(meta["large"]["blocks"] + meta["small"]["blocks"])


# ----------------------------------------------------------------------------------------------------
# Metadata limits: tensor slots and blocks per launch
# ----------------------------------------------------------------------------------------------------


def slots_and_blocks(limits: dict, depth: int) -> tuple[int, int]:
    """(tensor slots, blocks) of one launch at ``depth`` lists per tensor."""
    return limits["max_tensors_by_depth"][depth - 1], limits["max_blocks_by_depth"][depth - 1]


def split_sizes(limits: dict, depth: int) -> dict[str, list[int]]:
    """Lists that end a launch in each way multi_tensor_apply can (depth = lists per tensor)."""
    slots, blocks = slots_and_blocks(limits, depth)
    return {
        # The slots run out at a tensor's last chunk (several times over).
        "slots_full": [5 + (7 * i) % 300 for i in range(2 * slots + 3)],
        # The blocks run out in the middle of a tensor in slot 2: it continues in slot 0 of the next launch.
        "tensor_continues": [3, 1000, (blocks + 1) * CHUNK + 3, 5],
        # Slots and blocks run out together, at the last chunk of the last slot's tensor.
        "both_full": [7] * (slots - 1) + [(blocks - slots + 1) * CHUNK, 5, 3],
    }


def check_l2norm_split(backend: Backend, limits: dict, case: str) -> None:
    sizes = split_sizes(limits, 1)[case]
    check_l2norm_against_reference(randn_list(sizes, BF16))
    log = launch_log(backend)
    if log is not None:
        grids = log["l2norm"]
        chunks = sum(math.ceil(n / CHUNK) for n in sizes)
        blocks = slots_and_blocks(limits, 1)[1]
        assert len(grids) >= 2 and sum(grids) == chunks and max(grids) <= blocks
        if case == "tensor_continues":
            assert grids[0] == blocks


def test_l2norm_slots_full(backend: Backend, meta: dict, reset_log) -> None:
    """Norms are right when launches end for want of tensor slots, with either metadata size."""
    check_l2norm_split(backend, meta, "slots_full")


@pytest.mark.parametrize("case", ["tensor_continues", "both_full"])
def test_l2norm_launch_splits(backend: Backend, small_meta: dict, reset_log, case: str) -> None:
    """Norms are right whichever other way a launch ends (bf16: the largest list takes ~40 MB)."""
    check_l2norm_split(backend, small_meta, case)


def test_l2norm_tensor_spanning_three_launches(backend: Backend, small_meta: dict, reset_log) -> None:
    """A tensor of more than two launches' worth of chunks: it continues from slot 2, then from slot 0."""
    blocks = slots_and_blocks(small_meta, 1)[1]
    sizes = [5, 1000, 2 * blocks * CHUNK + 3, 9]
    check_l2norm_against_reference(randn_list(sizes, FP16))
    log = launch_log(backend)
    if log is not None:
        assert log["l2norm"] == [blocks, blocks, 4]  # 2 + 318 chunks, 320, the last 3 + 1


@pytest.mark.parametrize("case", ["slots_full", "tensor_continues"])
def test_scale_and_cast_copy_launch_splits(backend: Backend, small_meta: dict, case: str) -> None:
    """scale_ and cast_copy_ (two lists per tensor) across launch boundaries, bit for bit against torch."""
    sizes = split_sizes(small_meta, 2)[case]
    inputs = randn_list(sizes, BF16)
    scaled, copied = randn_list(sizes, BF16), randn_list(sizes, FP16)
    ops.scale_(inputs, scaled, scalar(GRAD_SCALE))
    ops.cast_copy_(inputs, copied)
    scale = torch.tensor(GRAD_SCALE, dtype=FP32, device=inputs[0].device)
    assert_each_bits_equal(scaled, [(x.float() * scale).to(BF16) for x in inputs], "scaled")
    assert_each_bits_equal(copied, [x.to(FP16) for x in inputs], "copied")


def test_adam_slots_full(backend: Backend, meta: dict, reset_log) -> None:
    """More tensors than a launch's slots at the eager update's depth with param_outs (5 lists), each
    step matching the reference."""
    sizes = split_sizes(meta, 5)["slots_full"]
    state = make_adam_state(sizes, FP32, BF16, FP16)
    check_adam_against_reference(state, step=2, grad_scale=scalar(GRAD_SCALE))
    log = launch_log(backend)
    if log is not None:
        slots = slots_and_blocks(meta, 5)[0]
        assert log["adam"] == [slots] * (len(sizes) // slots) + [len(sizes) % slots]


def test_adam_tensor_continues_in_next_launch(backend: Backend, small_meta: dict, reset_log) -> None:
    """A ~21M-element tensor starting in slot 2 continues in the next launch: the update is right (on
    cuda-emulated and cuda: bit for bit against the CPU kernel; the float64 reference would take GBs)."""
    limits = small_meta
    sizes = split_sizes(limits, 5)["tensor_continues"]
    state = make_adam_state(sizes, BF16, BF16, remainders=True)
    before = [p.clone() for p in state.params]
    run_adam(state, step=3, grad_scale=scalar(GRAD_SCALE))
    assert all(not torch.equal(b, p) for b, p in zip(before, state.params))
    log = launch_log(backend)
    if log is not None:
        blocks = slots_and_blocks(limits, 5)[1]
        assert log["adam"] == [blocks, sum(math.ceil(n / CHUNK) for n in sizes) - blocks]


# ----------------------------------------------------------------------------------------------------
# Alignment: each list decides nothing alone; a chunk takes the vector path only if every list is aligned
# ----------------------------------------------------------------------------------------------------


def at_offset(values: Tensor, dtype: torch.dtype, offset: int) -> Tensor:
    """A copy of ``values`` as a view at element ``offset`` of a larger buffer (guard values around it)."""
    buf = torch.full((values.numel() + offset + 1,), 77, dtype=dtype, device=values.device)
    view = buf[offset : offset + values.numel()].view(values.shape)
    return view.copy_(values)


# Element offsets per list: params, grads, exp_avgs, exp_avg_sqs, param_outs.
OFFSETS = {
    "all_aligned_at_different_offsets": (8, 16, 4, 12, 8),  # multiples of 16 bytes in every dtype
    "grads_misaligned": (0, 3, 0, 0, 0),
    "param_outs_misaligned": (8, 0, 4, 4, 2),
    "each_list_its_own": (1, 2, 3, 5, 7),
}


@pytest.mark.parametrize("param_dtype,grad_dtype,out_dtype", [(FP32, BF16, FP16), (BF16, FP16, FP32)])
@pytest.mark.parametrize("case", list(OFFSETS))
def test_adam_per_list_offsets(backend: Backend, case: str, param_dtype, grad_dtype, out_dtype) -> None:
    """Lists at different offsets (aligned or not, each list its own) give the reference's update and
    write nothing outside their views."""
    offsets = OFFSETS[case]
    sizes = (CHUNK - 1, 3 * CHUNK // 2 + 5, 9)
    plain = make_adam_state(sizes, param_dtype, grad_dtype, out_dtype)
    dtypes = (param_dtype, grad_dtype, FP32, FP32, out_dtype)
    lists = [plain.params, plain.grads, plain.exp_avgs, plain.exp_avg_sqs, plain.param_outs]
    placed = [[at_offset(t, d, off) for t in lst] for lst, d, off in zip(lists, dtypes, offsets)]
    state = type(plain)(*placed)
    check_adam_against_reference(state, step=4, grad_scale=scalar(GRAD_SCALE))
    for lst in placed:
        for t in lst:
            base = t._base
            start = t.storage_offset()
            guards = torch.cat([base[:start], base[start + t.numel() :]])
            assert (guards == 77).all(), "write outside the view"


@pytest.mark.parametrize("dtype", [FP16, FP32])
def test_l2norm_and_scale_mixed_alignment_within_a_list(backend: Backend, dtype: torch.dtype) -> None:
    """One list holding aligned and unaligned tensors: each chunk takes its own path, results exact."""
    values = randn_list([CHUNK + 3, 1000, CHUNK - 1, 17], FP32)
    tensors = [at_offset(v, dtype, off) for v, off in zip(values, (0, 1, 8, 5))]
    check_l2norm_against_reference(tensors)
    outputs = [at_offset(torch.zeros_like(v), BF16, off) for v, off in zip(values, (8, 8, 3, 0))]
    ops.scale_(tensors, outputs, scalar(GRAD_SCALE))
    scale = torch.tensor(GRAD_SCALE, dtype=FP32, device=values[0].device)
    assert_each_bits_equal(outputs, [(t.float() * scale).to(BF16) for t in tensors], "outputs")


# ----------------------------------------------------------------------------------------------------
# Empty tensors, the capturable step row, l2norm's workspace
# ----------------------------------------------------------------------------------------------------


def test_empty_tensors_launch_nothing(backend: Backend, meta: dict, reset_log) -> None:
    """Lists of only empty tensors are no-ops (no launch at all for adam and scale; l2norm gives zeros),
    and empty tensors between others are skipped at launch boundaries."""
    empty = make_adam_state([0, 0, 0], FP32, FP16, BF16)
    run_adam(empty, step=1)
    ops.scale_(empty.grads, empty.param_outs, scalar(GRAD_SCALE))
    total, per_tensor = ops.l2norm(empty.params)
    assert total.item() == 0.0 and per_tensor.tolist() == [0.0, 0.0, 0.0]
    log = launch_log(backend)
    assert log is None or ("adam" not in log and "scale" not in log and "l2norm" not in log), log
    slots = slots_and_blocks(meta, 6)[0]  # params, grads, moments, param_outs, remainders
    repeats = slots // 2 + 2  # 2 * repeats non-empty tensors: 4 past the slots of a launch
    sizes = [0] + [5, 0, 0, 300] * repeats + [0]
    state = make_adam_state(sizes, BF16, FP32, FP16, remainders=True)
    check_adam_against_reference(state, step=2)
    log = launch_log(backend)
    assert log is None or log["adam"] == [slots, 2 * repeats - slots], log


def test_adam_capturable_steps_across_launches(backend: Backend, meta: dict, reset_log) -> None:
    """The capturable op's per-tensor step row travels with its tensor across launches: three launches'
    worth of tensors at its depth (params, grads, moments, param_outs, steps: 6), each with its own
    step tensor, one of them three chunks long."""
    slots = slots_and_blocks(meta, 6)[0]
    sizes = [5 + i % 200 for i in range(2 * slots + 5)]
    sizes[slots + 1] = 2 * CHUNK + 1
    state = make_adam_state(sizes, FP32, BF16, BF16)
    expected, before = state.clone(), state.clone()
    steps = [scalar(float(1 + i % 9)) for i in range(len(sizes))]
    lr = scalar(HYPER["lr"])
    run_adam_capturable(state, lr=lr, steps=steps, grad_scale=scalar(GRAD_SCALE))
    run_reference_adam_capturable(expected, lr=lr, steps=steps, grad_scale=scalar(GRAD_SCALE))
    assert_adam_close(state, expected)
    assert_params_moved(before, state)
    log = launch_log(backend)
    if log is not None:
        grids, blocks = log["adam"], slots_and_blocks(meta, 6)[1]
        assert len(grids) == 3 and sum(grids) == len(sizes) + 2 and max(grids) <= blocks, grids


def test_l2norm_workspace_across_per_tensor_launches(backend: Backend, small_meta: dict, reset_log) -> None:
    """More tensors than one per-tensor reduction launch takes (399): the chunk slots of the second
    launch's tensors are found in the workspace, multi-chunk tensors straddling the boundary included."""
    sizes = torch.randint(1, 500, (450,)).tolist()
    for i in (0, 398, 399, 400, 449):
        sizes[i] = 2 * CHUNK + 7
    tensors = randn_list(sizes, FP16)
    total, per_tensor = check_l2norm_against_reference(tensors)
    log = launch_log(backend)
    if log is not None:
        assert log["l2norm per-tensor"] == [399, 51], log
    lone = ops.l2norm([tensors[399]])  # its slots come first in a workspace of its own
    assert_bits_equal(lone[1][0], per_tensor[399], "per_tensor[399] alone vs in the list")


# ----------------------------------------------------------------------------------------------------
# Launch counts for many tensors (issue 10, item 4)
# ----------------------------------------------------------------------------------------------------

TENSORS = 10_000
# Launches for 10,000 one-chunk tensors: (Adam eager fp32, Adam eager fp32 + bf16 grads + bf16
# param_outs, Adam capturable fp32, l2norm's three kernels, scale_). Before the large metadata and the
# per-variant depth every Adam variant took 500 launches, l2norm 91 + 26 + 1 and scale_ 157.
EXPECTED_LAUNCHES = {
    "4KiB": {"adam": 205, "adam mixed": 244, "adam capturable": 244, "l2norm": (82, 26, 1), "scale": 122},
    "32K": {"adam": 15, "adam mixed": 17, "adam capturable": 17, "l2norm": (7, 3, 1), "scale": 10},
}
H100_WAVE = 132 * 2  # resident 512-thread blocks of the Adam kernel (64 registers: two per SM)
# Tensors per launch of l2norm's per-tensor pass (csrc/cuda/l2norm.cu, CleanupMeta's kTensors - 1).
PER_TENSOR_SLOTS = {"4KiB": 399, "32K": 3999}
# Depths: Adam eager fp32 (params, grads, moments), with param_outs (mixed) or a step row (capturable).
ADAM_DEPTH, ADAM_MIXED_DEPTH, ADAM_CAPTURABLE_DEPTH = 4, 5, 5


# The default run emulates "three launches' worth" of one-chunk tensors (at the op's shallowest depth two
# full launches and one more tensor; deeper variants take more launches) and checks every launch's grid:
# each full launch ends with its tensor slots full at a tensor's last chunk (with 32K metadata its blocks
# full at the same time), as every launch but the last does for 10,000 tensors, so one slot fewer or more
# per launch fails here (a launch count alone could not tell: 2 * 49 + 1 tensors take 3 launches of 48
# too). The 10,000 tensors' counts (EXPECTED_LAUNCHES, which docs/architecture.md quotes) are checked
# against the build's slots without emulating them; the long version emulates all 10,000 (here 70 s for
# this file's four cuda-emulated cases, 146 s with test_ops_states_launches.py's two).
# Marked slow, so that `-m slow` selects it (and only it) too.
LAUNCH_COUNT_SIZES = ["three_launches", pytest.param("10000_tensors", marks=pytest.mark.slow)]


def launch_count_tensors(request: pytest.FixtureRequest) -> int | None:
    """For a launch-count test's fixture parametrised by LAUNCH_COUNT_SIZES: how many tensors it emulates,
    None for three launches' worth (the test sizes them from the slots), or 10,000 (the long version:
    ``-m slow`` or DISTOPT_SLOW=1)."""
    if request.param == "three_launches":
        return None
    request.getfixturevalue("long_version")
    return TENSORS


@pytest.fixture(params=LAUNCH_COUNT_SIZES)
def n_tensors(request: pytest.FixtureRequest) -> int | None:
    return launch_count_tensors(request)


def three_launches(limits: dict, depth: int) -> int:
    """One-chunk tensors that take three launches at ``depth``: two full ones and one more tensor."""
    return 2 * slots_and_blocks(limits, depth)[0] + 1


def packed(n: int, slots: int) -> list[int]:
    """The grids of ``n`` one-chunk tensors at ``slots`` tensors a launch (their blocks never run out
    first: 4 KiB metadata has more blocks than slots, 32K as many)."""
    return [slots] * (n // slots) + ([n % slots] if n % slots else [])


def launches_of(backend: Backend, run) -> dict[str, list[int]]:
    """Kernel name -> grid sizes of the launches ``run()`` makes."""
    launch_log(backend)
    run()
    return launch_log(backend)


def expected_launches(backend: Backend, meta: dict) -> dict:
    if backend.name != "cuda-emulated":
        pytest.skip("launches are counted by the emulator")
    return EXPECTED_LAUNCHES["32K" if meta["large_kernel_params"] else "4KiB"]


def test_adam_launch_counts(n_tensors: int | None, backend: Backend, meta: dict) -> None:
    """Tensors of 4,096 elements: the Adam update's launches with either metadata size.

    The tensors here have 7 elements: a launch's tensors and blocks depend only on each tensor's chunk
    count, which is 1 for any size up to 65,536, so 4,096-element tensors give the same counts (tensors
    of k chunks need k times the blocks, and more launches where the blocks run out first). With 32K
    metadata every launch but the last carries at least one full H100 wave of blocks."""
    expected = expected_launches(backend, meta)
    depths = {"adam": ADAM_DEPTH, "adam mixed": ADAM_MIXED_DEPTH, "adam capturable": ADAM_CAPTURABLE_DEPTH}
    slots = {d: slots_and_blocks(meta, d)[0] for d in depths.values()}
    assert all(expected[k] == math.ceil(TENSORS / slots[d]) for k, d in depths.items()), (expected, slots)
    n = n_tensors or three_launches(meta, ADAM_DEPTH)
    sizes = [7] * n
    fp32 = make_adam_state(sizes, FP32, FP32)
    adam = launches_of(backend, lambda: run_adam(fp32, step=3))["adam"]
    assert adam == packed(n, slots[ADAM_DEPTH]), adam
    mixed = make_adam_state(sizes, FP32, BF16, BF16)
    mixed_grids = launches_of(backend, lambda: run_adam(mixed, step=3))["adam"]
    assert mixed_grids == packed(n, slots[ADAM_MIXED_DEPTH]), mixed_grids
    steps = [scalar(3.0)] * n
    capturable = launches_of(backend, lambda: run_adam_capturable(fp32, lr=scalar(HYPER["lr"]), steps=steps))["adam"]
    assert capturable == packed(n, slots[ADAM_CAPTURABLE_DEPTH]), capturable
    if meta["large_kernel_params"]:
        assert min(adam[:-1] + capturable[:-1]) >= H100_WAVE


def test_l2norm_and_scale_launch_counts(n_tensors: int | None, backend: Backend, meta: dict) -> None:
    """One-chunk tensors: l2norm's launches (chunk sums, per-tensor sums, total) and scale_'s, with either
    metadata size. l2norm's three launches' worth is at least one tensor more than its per-tensor pass
    takes in one launch (4,000 with 32K metadata: the emulated block reductions make this the slowest of
    these tests)."""
    expected = expected_launches(backend, meta)
    per_tensor_slots = PER_TENSOR_SLOTS["32K" if meta["large_kernel_params"] else "4KiB"]
    chunk_slots, scale_slots = slots_and_blocks(meta, 1)[0], slots_and_blocks(meta, 2)[0]
    assert expected["l2norm"] == (math.ceil(TENSORS / chunk_slots), math.ceil(TENSORS / per_tensor_slots), 1)
    assert expected["scale"] == math.ceil(TENSORS / scale_slots)
    n = n_tensors or max(three_launches(meta, 1), per_tensor_slots + 1)
    tensors = randn_list([7] * n, FP32)
    norm = launches_of(backend, lambda: ops.l2norm(tensors))
    assert norm["l2norm"] == packed(n, chunk_slots), norm["l2norm"]
    assert norm["l2norm per-tensor"] == packed(n, per_tensor_slots), norm["l2norm per-tensor"]
    assert norm["l2norm total"] == [1]
    m = n_tensors or three_launches(meta, 2)
    outputs = randn_list([7] * m, BF16)
    scale = launches_of(backend, lambda: ops.scale_(tensors[:m], outputs, scalar(GRAD_SCALE)))["scale"]
    assert scale == packed(m, scale_slots), scale
