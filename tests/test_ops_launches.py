"""How the multi-tensor ops split work into CUDA launches, on every backend (tests/backends.py): lists
that overflow a launch's metadata (tensor slots, blocks) at each kind of boundary, a tensor continuing
in the next launch, per-list alignments and offsets, empty tensors, the capturable op's step row, and
l2norm's workspace across its per-tensor launches.

The sizes come from the launch constants of the build (distopt._C_emulated.constants(), i.e.
csrc/cuda/multi_tensor_apply.cuh); under "cuda-emulated" the launch log shows the split really
happened. The CPU kernels have no launches: there these are plain correctness tests. Every op call under
cuda-emulated and cuda is also checked bit for bit against the CPU kernel (backends.CrossCheck).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from distopt import ops

from backends import Backend, load_emulated
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


@pytest.fixture(scope="module")
def limits() -> dict:
    """The launch constants of the build (the emulated module reports them)."""
    try:
        return load_emulated().constants()
    except ImportError:
        pytest.skip("distopt._C_emulated (which reports the launch constants) is not built")


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


def test_constants_match_the_tests(limits: dict) -> None:
    """The tests' chunk size (op_helpers.CHUNK, test_ops_cuda.MAX_BLOCKS_PER_LAUNCH) is the build's."""
    from test_ops_cuda import MAX_BLOCKS_PER_LAUNCH

    assert limits["chunk_size"] == CHUNK and limits["max_blocks"] == MAX_BLOCKS_PER_LAUNCH


# ----------------------------------------------------------------------------------------------------
# Metadata limits: tensor slots and blocks per launch
# ----------------------------------------------------------------------------------------------------


def split_sizes(limits: dict, depth: int) -> dict[str, list[int]]:
    """Lists that end a launch in each way multi_tensor_apply can (depth = lists per tensor)."""
    slots, blocks = limits["max_tensors_by_depth"][depth - 1], limits["max_blocks"]
    return {
        # The slots run out at a tensor's last chunk (several times over).
        "slots_full": [100 + 7 * i for i in range(2 * slots + 3)],
        # The blocks run out in the middle of a tensor in slot 2: it continues in slot 0 of the next launch.
        "tensor_continues": [3, 1000, (blocks + 1) * CHUNK + 3, 5],
        # Slots and blocks run out together, at the last chunk of the last slot's tensor.
        "both_full": [7] * (slots - 1) + [(blocks - slots + 1) * CHUNK, 5, 3],
    }


@pytest.mark.parametrize("case", ["slots_full", "tensor_continues", "both_full"])
def test_l2norm_launch_splits(backend: Backend, limits: dict, reset_log, case: str) -> None:
    """Norms are right whichever way a launch ends (bf16: the largest list takes ~40 MB)."""
    sizes = split_sizes(limits, 1)[case]
    check_l2norm_against_reference(randn_list(sizes, BF16))
    log = launch_log(backend)
    if log is not None:
        grids = log["l2norm"]
        chunks = sum(math.ceil(n / CHUNK) for n in sizes)
        assert len(grids) >= 2 and sum(grids) == chunks and max(grids) <= limits["max_blocks"]
        if case == "tensor_continues":
            assert grids[0] == limits["max_blocks"]


def test_l2norm_tensor_spanning_three_launches(backend: Backend, limits: dict, reset_log) -> None:
    """A tensor of more than two launches' worth of chunks: it continues from slot 2, then from slot 0."""
    blocks = limits["max_blocks"]
    sizes = [5, 1000, 2 * blocks * CHUNK + 3, 9]
    check_l2norm_against_reference(randn_list(sizes, FP16))
    log = launch_log(backend)
    if log is not None:
        assert log["l2norm"] == [blocks, blocks, 4]  # 2 + 318 chunks, 320, the last 3 + 1


@pytest.mark.parametrize("case", ["slots_full", "tensor_continues"])
def test_scale_and_cast_copy_launch_splits(backend: Backend, limits: dict, case: str) -> None:
    """scale_ and cast_copy_ (two lists per tensor) across launch boundaries, bit for bit against torch."""
    sizes = split_sizes(limits, 2)[case]
    inputs = randn_list(sizes, BF16)
    scaled, copied = randn_list(sizes, BF16), randn_list(sizes, FP16)
    ops.scale_(inputs, scaled, scalar(GRAD_SCALE))
    ops.cast_copy_(inputs, copied)
    scale = torch.tensor(GRAD_SCALE, dtype=FP32, device=inputs[0].device)
    assert_each_bits_equal(scaled, [(x.float() * scale).to(BF16) for x in inputs], "scaled")
    assert_each_bits_equal(copied, [x.to(FP16) for x in inputs], "copied")


def test_adam_slots_full(backend: Backend, limits: dict, reset_log) -> None:
    """More tensors than a launch's slots at the Adam update's depth, each step matching the reference."""
    sizes = split_sizes(limits, 7)["slots_full"]
    state = make_adam_state(sizes, FP32, BF16, FP16)
    check_adam_against_reference(state, step=2, grad_scale=scalar(GRAD_SCALE))
    log = launch_log(backend)
    if log is not None:
        slots = limits["max_tensors_by_depth"][6]
        assert log["adam"] == [slots] * (len(sizes) // slots) + [len(sizes) % slots]


def test_adam_tensor_continues_in_next_launch(backend: Backend, limits: dict, reset_log) -> None:
    """A ~21M-element tensor starting in slot 2 continues in the next launch: the update is right (on
    cuda-emulated and cuda: bit for bit against the CPU kernel; the float64 reference would take GBs)."""
    sizes = split_sizes(limits, 7)["tensor_continues"]
    state = make_adam_state(sizes, BF16, BF16, remainders=True)
    before = [p.clone() for p in state.params]
    run_adam(state, step=3, grad_scale=scalar(GRAD_SCALE))
    assert all(not torch.equal(b, p) for b, p in zip(before, state.params))
    log = launch_log(backend)
    if log is not None:
        assert log["adam"] == [limits["max_blocks"], sum(math.ceil(n / CHUNK) for n in sizes) - limits["max_blocks"]]


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


def test_empty_tensors_launch_nothing(backend: Backend, reset_log) -> None:
    """Lists of only empty tensors are no-ops (no launch at all for adam and scale; l2norm gives zeros),
    and empty tensors between others are skipped at launch boundaries."""
    empty = make_adam_state([0, 0, 0], FP32, FP16, BF16)
    run_adam(empty, step=1)
    ops.scale_(empty.grads, empty.param_outs, scalar(GRAD_SCALE))
    total, per_tensor = ops.l2norm(empty.params)
    assert total.item() == 0.0 and per_tensor.tolist() == [0.0, 0.0, 0.0]
    log = launch_log(backend)
    assert log is None or ("adam" not in log and "scale" not in log and "l2norm" not in log), log
    sizes = [0] + [5, 0, 0, 300] * 12 + [0]  # 24 non-empty tensors: past the 20 slots of an adam launch
    state = make_adam_state(sizes, BF16, FP32, FP16, remainders=True)
    check_adam_against_reference(state, step=2)
    log = launch_log(backend)
    assert log is None or log["adam"] == [20, 4], log


def test_adam_capturable_steps_across_launches(backend: Backend, limits: dict) -> None:
    """The capturable op's per-tensor step row travels with its tensor across launches: 45 tensors
    (three launches at depth 7), each with its own step tensor, one of them three chunks long."""
    sizes = [100 + i for i in range(45)]
    sizes[21] = 2 * CHUNK + 1
    state = make_adam_state(sizes, FP32, BF16, BF16)
    expected, before = state.clone(), state.clone()
    steps = [scalar(float(1 + i % 9)) for i in range(len(sizes))]
    lr = scalar(HYPER["lr"])
    run_adam_capturable(state, lr=lr, steps=steps, grad_scale=scalar(GRAD_SCALE))
    run_reference_adam_capturable(expected, lr=lr, steps=steps, grad_scale=scalar(GRAD_SCALE))
    assert_adam_close(state, expected)
    assert_params_moved(before, state)


def test_l2norm_workspace_across_per_tensor_launches(backend: Backend, reset_log) -> None:
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
