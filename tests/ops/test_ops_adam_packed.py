"""Packed moments (``ops.adam_step_``; Note [Packed moments] in csrc/binding.cpp): a moment list given as one
1-D tensor holding every entry's moment at ``ops.packed_offsets`` gives, bit for bit, what the same moments
passed one tensor per param give, for fp32 and bf16 moments (stochastic rounding too), every param dtype,
sizes around the 16-element packing alignment and a CUDA chunk, and channels_last params; it writes nothing
between the entries, nothing at all on an inf/nan step, and a malformed packed tensor is refused before
anything is written. A negative control packs with another rule and must not match.

Every test runs on each backend of tests/ops/backends.py (cpu, cuda-emulated, cuda). Helpers: op_helpers.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from distopt import ops, reference

from op_helpers import (
    BF16,
    CHUNK,
    CL_SHAPES,
    FP16,
    FP32,
    HYPER,
    assert_bits_equal,
    assert_unchanged,
    dtype_id,
    make_adam_state,
    scalar,
    snapshot,
)

pytestmark = pytest.mark.usefixtures("one_intra_op_thread", "backend")

SIZES = (1, 15, 16, 17, 33, CHUNK + 1, 7)  # around the 16-element alignment, and a chunk edge
PAD = -3.5  # what the packed tensor holds between entries: exact in fp32 and bf16, never written
SEED = 0x5EED_1234


def packed(tensors: list[Tensor], dtype: torch.dtype, offsets: list[int] | None = None,
           total: int | None = None) -> tuple[Tensor, list[Tensor]]:
    """(packed tensor, its views shaped and strided as `tensors`) holding `tensors`' values in `dtype`, at
    ``ops.packed_offsets`` unless `offsets` (and `total`) are given; PAD elsewhere."""
    if offsets is None:
        offsets, total = ops.packed_offsets([t.numel() for t in tensors])
    flat = torch.full((total,), PAD, dtype=dtype, device=tensors[0].device)
    views = [flat.as_strided(t.shape, t.stride(), o) for t, o in zip(tensors, offsets)]
    for v, t in zip(views, tensors):
        v.copy_(t)
    return flat, views


def run(state, exp_avgs, exp_avg_sqs, *, seed=None, found_inf=None) -> None:
    ids = list(range(len(state.params))) if seed is not None else []
    ops.adam_step_(state.params, state.grads, exp_avgs, exp_avg_sqs, param_outs=state.param_outs, step=3,
                   found_inf=found_inf, rounding_seed=seed, param_ids=ids, **HYPER)


def twins(sizes, param_dtype, out_dtype, moment_dtype, layout="contiguous"):
    """(state with per-param moments, the same values with packed moments: packed tensors and views)."""
    state = make_adam_state(sizes, param_dtype, param_dtype, out_dtype, layout=layout)
    state.exp_avgs = [m.to(moment_dtype) for m in state.exp_avgs]
    state.exp_avg_sqs = [v.to(moment_dtype) for v in state.exp_avg_sqs]
    twin = state.clone()
    m_flat, twin.exp_avgs = packed(twin.exp_avgs, moment_dtype)
    v_flat, twin.exp_avg_sqs = packed(twin.exp_avg_sqs, moment_dtype)
    return state, twin, m_flat, v_flat


def assert_same_results(state, twin, m_flat: Tensor, v_flat: Tensor) -> None:
    for name in ("params", "param_outs", "exp_avgs", "exp_avg_sqs"):
        for i, (a, b) in enumerate(zip(getattr(twin, name), getattr(state, name))):
            assert_bits_equal(a, b, f"{name}[{i}]")
    for flat, views in ((m_flat, twin.exp_avgs), (v_flat, twin.exp_avg_sqs)):
        covered = torch.zeros(flat.numel(), dtype=torch.bool)
        for v in views:
            covered[v.storage_offset() : v.storage_offset() + v.numel()] = True
        assert bool((flat.cpu()[~covered] == PAD).all()), "an element between the entries was written"


@pytest.mark.parametrize("seed", [None, SEED], ids=["nearest", "stochastic"])
@pytest.mark.parametrize("moment_dtype", [FP32, BF16], ids=dtype_id)
@pytest.mark.parametrize("param_dtype,out_dtype", [(FP32, None), (BF16, None), (FP16, FP32), (BF16, FP32)],
                         ids=["fp32", "bf16", "fp16-fp32_out", "bf16-fp32_out"])
def test_packed_moments_give_the_per_param_bits(param_dtype, out_dtype, moment_dtype, seed):
    if seed is not None and moment_dtype == FP32 and param_dtype != BF16:
        pytest.skip("stochastic rounding rounds bf16 stores only: nothing to round here")
    state, twin, m_flat, v_flat = twins(SIZES, param_dtype, out_dtype, moment_dtype)
    for _ in range(2):
        run(state, state.exp_avgs, state.exp_avg_sqs, seed=seed)
        run(twin, [m_flat], [v_flat], seed=seed)
    assert_same_results(state, twin, m_flat, v_flat)


@pytest.mark.parametrize("packed_lists", ["exp_avgs", "exp_avg_sqs"])
def test_one_list_packed_and_the_other_per_param(packed_lists):
    state, twin, m_flat, v_flat = twins(SIZES, FP32, None, FP32)
    m_arg = [m_flat] if packed_lists == "exp_avgs" else twin.exp_avgs
    v_arg = [v_flat] if packed_lists == "exp_avg_sqs" else twin.exp_avg_sqs
    run(state, state.exp_avgs, state.exp_avg_sqs)
    run(twin, m_arg, v_arg)
    assert_same_results(state, twin, m_flat, v_flat)


def test_empty_entries_take_no_room():
    """An empty param (an FSDP2 rank's empty shard) between others: packed_offsets gives it the next
    entry's start, and the others' bits are unchanged."""
    state, twin, m_flat, v_flat = twins([5, 0, 17, (0, 3), 16], FP32, None, FP32)
    assert m_flat.numel() == 16 + 32 + 16
    run(state, state.exp_avgs, state.exp_avg_sqs)
    run(twin, [m_flat], [v_flat])
    assert_same_results(state, twin, m_flat, v_flat)


def test_channels_last_params_pack_in_their_memory_order():
    state, twin, m_flat, v_flat = twins(CL_SHAPES, FP32, None, FP32, layout="channels_last")
    assert not twin.exp_avgs[0].is_contiguous() and twin.exp_avgs[0].stride() == state.params[0].stride()
    run(state, state.exp_avgs, state.exp_avg_sqs)
    run(twin, [m_flat], [v_flat])
    assert_same_results(state, twin, m_flat, v_flat)


def test_an_inf_nan_step_writes_nothing():
    _, twin, m_flat, v_flat = twins(SIZES, FP32, None, BF16)
    before = snapshot(twin.params, m_flat, v_flat)
    run(twin, [m_flat], [v_flat], found_inf=scalar(1.0))
    assert_unchanged(before)


@pytest.mark.parametrize("moment_dtype", [FP32, BF16], ids=dtype_id)
def test_the_reference_takes_packed_moments_as_the_kernel_does(moment_dtype):
    """distopt.reference (the tests' oracle, and the ops' fallback without the extension) reads a packed
    list as its per-param views: the same bits as given the per-param moments; a malformed one raises."""
    state, twin, m_flat, v_flat = twins(SIZES, BF16, FP32, moment_dtype)
    for st, m, v in ((state, state.exp_avgs, state.exp_avg_sqs), (twin, [m_flat], [v_flat])):
        reference.adam_step_(st.params, st.grads, m, v, st.param_outs, [], torch.tensor(1e-2, dtype=torch.float64),
                             [torch.tensor(3.0)], 0.9, 0.999, 1e-8, 0.1, True, False, None, None)
    assert_same_results(state, twin, m_flat, v_flat)
    with pytest.raises(ValueError, match="packed"):
        reference.adam_step_(twin.params, twin.grads, [m_flat[:-1]], [v_flat], twin.param_outs, [],
                             torch.tensor(1e-2, dtype=torch.float64), [torch.tensor(3.0)], 0.9, 0.999, 1e-8, 0.1,
                             True, False, None, None)


def test_packed_offsets_rule():
    offsets, total = ops.packed_offsets([1, 15, 16, 17, 0, 33])
    assert offsets == [0, 16, 32, 48, 80, 80] and total == 128
    assert ops.packed_offsets([]) == ([], 0)


def test_negative_control_moments_packed_by_another_rule_do_not_match():
    """Entries packed back to back without the alignment (a caller's wrong rule) are read at the wrong
    places: the results differ from the per-param ones."""
    state, twin, _, _ = twins(SIZES, FP32, None, FP32)
    offsets, total = [0], 0
    for n in [m.numel() for m in twin.exp_avgs]:
        total += n
        offsets.append(total)
    m_flat, _ = packed(twin.exp_avgs, FP32, offsets[:-1], max(total, ops.packed_offsets(list(SIZES))[1]))
    v_flat, _ = packed(twin.exp_avg_sqs, FP32, offsets[:-1], max(total, ops.packed_offsets(list(SIZES))[1]))
    run(state, state.exp_avgs, state.exp_avg_sqs)
    run(twin, [m_flat], [v_flat])
    assert not all(torch.equal(a, b) for a, b in zip(twin.params, state.params))


def _bad_packed(case: str, m_flat: Tensor) -> Tensor:
    if case == "short":
        return m_flat[:-1]
    if case == "2-D":
        return m_flat.view(-1, 16)
    if case == "strided":
        return torch.zeros(2 * m_flat.numel(), dtype=m_flat.dtype, device=m_flat.device)[::2]
    if case == "uint8":
        return m_flat.to(torch.uint8)
    if case == "fp16":
        return m_flat.to(torch.float16)
    raise AssertionError(case)


@pytest.mark.parametrize("case,message", [
    ("short", "at least"), ("2-D", "1-D and contiguous"), ("strided", "1-D and contiguous"),
    ("uint8", "8-bit moments are passed one tensor per param"), ("fp16", "one packed fp32 or bf16 tensor"),
])
def test_a_malformed_packed_tensor_is_refused_before_anything_is_written(case, message):
    _, twin, m_flat, v_flat = twins(SIZES, FP32, None, FP32)
    bad = _bad_packed(case, m_flat)
    before = snapshot(twin.params, m_flat, v_flat, bad)
    with pytest.raises(ValueError, match=message):
        run(twin, [bad], [v_flat])
    assert_unchanged(before)


def test_one_param_takes_its_moment_as_is():
    """With one param a list of one tensor is that param's moment (shape checked), never a packed one."""
    state = make_adam_state([(4, 8)], FP32)
    with pytest.raises(ValueError, match="shape"):
        run(state, [state.exp_avgs[0].reshape(-1)], state.exp_avg_sqs)
