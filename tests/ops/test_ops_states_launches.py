"""The low-precision-moment update (bf16 and 8-bit moments, stochastic rounding) across CUDA launches and
chunks, on every backend (tests/ops/backends.py): quantisation blocks at chunk edges and tensor tails, lists
overflowing a launch's metadata at the variant's depth (its scales and rounding-key rows travel with
their tensor), a tensor continuing in the next launch, unaligned lists, a param split into entries at
any block boundary, the inf/nan skip, and the launch counts for many tensors (three launches' worth by
default, 10,000 in the long version).

Under "cuda-emulated" (and "cuda") every call is also checked bit for bit against the CPU kernel
(backends.CrossCheck): codes, scales, bf16 moments and stochastically rounded params included. The
float64 reference (distopt.reference, whose reads and stores are the kernels' own arithmetic) checks
the update itself; the CPU op's own tests (test_ops_adam_states.py) check its numerics in depth.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from distopt import ops, reference
from distopt import state_formats as sf

from backends import Backend
from op_helpers import BF16, CHUNK, FP16, FP32, GRAD_SCALE, HYPER, AdamState, assert_bits_equal, make_adam_state, scalar
from test_ops_launches import (
    LAUNCH_COUNT_SIZES,
    emulated_constants,
    expected_launches,
    launch_count_tensors,
    launch_log,
    packed,
    slots_and_blocks,
    three_launches,
)

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

U8 = torch.uint8
SEED = 0x1234_5678_9ABC
FORMATS = [
    pytest.param(BF16, BF16, id="bf16-bf16"),
    pytest.param(U8, U8, id="u8-u8"),
    pytest.param(U8, BF16, id="u8-bf16"),
    pytest.param(FP32, U8, id="fp32-u8"),
]


class States:
    """An AdamState whose moments are stored in ``m_dtype``/``v_dtype`` (8-bit: codes plus scales)."""

    def __init__(self, state: AdamState, m_dtype: torch.dtype, v_dtype: torch.dtype) -> None:
        self.state = state
        self.m_scales: list[Tensor] = []
        self.v_scales: list[Tensor] = []
        state.exp_avgs = [self._convert(m, m_dtype, self.m_scales, True) for m in state.exp_avgs]
        state.exp_avg_sqs = [self._convert(v, v_dtype, self.v_scales, False) for v in state.exp_avg_sqs]

    @staticmethod
    def _convert(x: Tensor, dtype: torch.dtype, scales: list[Tensor], signed: bool) -> Tensor:
        if dtype == U8:
            codes, absmax = sf.quantize_blockwise(x, signed)
            scales.append(absmax)
            return codes
        return x.to(dtype)

    def clone(self) -> States:
        other = object.__new__(States)
        other.state = self.state.clone()
        other.m_scales = [s.clone() for s in self.m_scales]
        other.v_scales = [s.clone() for s in self.v_scales]
        return other

    def tensors(self) -> dict[str, list[Tensor]]:
        return {**self.state.written(), "exp_avg_scales": self.m_scales, "exp_avg_sq_scales": self.v_scales}

    def keys(self, param_ids=None, param_offsets=()) -> dict:
        ids = list(range(len(self.state.params))) if param_ids is None else param_ids
        return dict(rounding_seed=SEED, param_ids=ids, param_offsets=param_offsets)

    def run(self, *, step=3, rounding=True, param_ids=None, param_offsets=(), lr=None, steps=None, lr_eager=None,
            **kw) -> None:
        """The op, eager (``step``; ``lr_eager`` instead of HYPER's lr) or capturable (``lr``, ``steps`` tensors)."""
        s = self.state
        h = {**HYPER, **kw}
        if lr_eager is not None:
            h["lr"] = lr_eager
        if lr is not None:
            h["lr"], step = lr, steps
        extra = self.keys(param_ids, param_offsets) if rounding else {}
        ops.adam_step_(
            s.params, s.grads, s.exp_avgs, s.exp_avg_sqs, param_outs=s.param_outs,
            param_remainders=s.param_remainders, step=step, exp_avg_scales=self.m_scales,
            exp_avg_sq_scales=self.v_scales, **extra, **h,
        )  # fmt: skip

    def run_reference(self, *, step=3, rounding=True, **kw) -> None:
        s = self.state
        h = {**HYPER, **kw}
        extra = self.keys() if rounding else {}
        reference.adam_step_(
            *s.lists(), torch.tensor(h["lr"], dtype=torch.float64), [torch.tensor(float(step), dtype=torch.float64)],
            h["beta1"], h["beta2"], h["eps"], h["weight_decay"], h["adam_w_mode"], h["maximize"],
            kw.get("grad_scale"), kw.get("found_inf"), self.m_scales, self.v_scales, **extra,
        )  # fmt: skip

    def moments(self) -> tuple[list[Tensor], list[Tensor]]:
        """The moments as fp32 values (8-bit: read back through the map)."""

        def read(xs, scales, signed):
            return [sf.dequantize_blockwise(x, scales[i], signed) if x.dtype == U8 else x.float()
                    for i, x in enumerate(xs)]  # fmt: skip

        return read(self.state.exp_avgs, self.m_scales, True), read(self.state.exp_avg_sqs, self.v_scales, False)


def assert_close_to_reference(actual: States, expected: States) -> None:
    """Params within fp32 rounding of the float64 update (one bf16 step for bf16 params); moments within
    one code step of their block (8-bit: the map's coarsest gap is < 2% of the absmax) or one bf16 ulp."""
    for a, e in zip(actual.state.masters(), expected.state.masters()):
        tol = 1e-2 if a.dtype == BF16 else 2e-3 if a.dtype == FP16 else 1e-5
        torch.testing.assert_close(a.float(), e.float(), rtol=tol, atol=tol)
    for got, want in zip(actual.moments(), expected.moments()):
        for g, w in zip(got, want):
            scale = sf.block_absmax(w).repeat_interleave(sf.QUANT_BLOCK)[: w.numel()].view(w.shape)
            assert ((g - w).abs() <= 0.02 * scale + 1e-2 * w.abs() + 1e-30).all()


def states(sizes, m_dtype, v_dtype, param_dtype=FP32, grad_dtype=FP32, out_dtype=None, remainders=False) -> States:
    return States(make_adam_state(sizes, param_dtype, grad_dtype, out_dtype, remainders=remainders), m_dtype, v_dtype)


def assert_states_bits_equal(actual: States, expected: States, what: str) -> None:
    a, e = actual.tensors(), expected.tensors()
    for name in a:
        for i, (x, y) in enumerate(zip(a[name], e[name])):
            assert_bits_equal(x, y, f"{what}: {name}[{i}]")


# ----------------------------------------------------------------------------------------------------
# Blocks at chunk edges and tails, dtypes, rounding
# ----------------------------------------------------------------------------------------------------

# Quantisation blocks at every kind of edge: shorter than a block, one block plus one, a full chunk and a
# second one ending in a short block.
EDGE_SIZES = (1, 255, 257, CHUNK + 300)


@pytest.mark.parametrize("m_dtype,v_dtype", FORMATS)
@pytest.mark.parametrize(
    "param_dtype,grad_dtype,out_dtype,remainders",
    [(FP32, FP32, None, False), (BF16, FP16, FP32, False), (BF16, BF16, BF16, True), (FP16, FP32, BF16, False)],
)
@pytest.mark.parametrize("rounding", [False, True], ids=["nearest", "stochastic"])
def test_states_update_at_block_and_chunk_edges(backend: Backend, m_dtype, v_dtype, param_dtype, grad_dtype,
                                                out_dtype, remainders, rounding) -> None:
    """Every format pair and param dtype, blocks at chunk edges and tails: the reference's update."""
    st = states(EDGE_SIZES, m_dtype, v_dtype, param_dtype, grad_dtype, out_dtype, remainders)
    expected = st.clone()
    st.run(rounding=rounding, grad_scale=scalar(GRAD_SCALE))
    expected.run_reference(rounding=rounding, grad_scale=scalar(GRAD_SCALE))
    assert_close_to_reference(st, expected)
    if param_dtype == BF16 and not remainders and rounding:  # the rounded params are the reference's bits
        for a, e in zip(st.state.params, expected.state.params):
            mismatch = (a.view(torch.int16) != e.view(torch.int16)).float().mean().item()
            assert mismatch < 1e-3, mismatch  # a float64 update may cross a rounding point, rarely


@pytest.mark.parametrize("m_dtype,v_dtype", FORMATS)
def test_split_into_entries_at_block_boundaries_gives_the_same_bits(backend: Backend, m_dtype, v_dtype) -> None:
    """A param updated whole, or as entries (shards) starting at block boundaries with their offsets in
    the param: the same bits (codes, scales, rounded params). With a wrong offset the bits differ."""
    n = CHUNK + 3 * 256 + 77
    whole = states([n], m_dtype, v_dtype, BF16, FP32, FP16)
    cuts = [0, 512, CHUNK + 256, n]

    def split(st: States) -> States:
        parts = object.__new__(States)
        s = st.state
        pieces = [(a, b) for a, b in zip(cuts, cuts[1:])]

        def cut(lst):
            return [lst[0][a:b] for a, b in pieces] if lst else []

        def cut_scales(lst):
            return [lst[0][a // 256 : math.ceil(b / 256)] for a, b in pieces] if lst else []

        parts.state = AdamState(cut(s.params), cut(s.grads), cut(s.exp_avgs), cut(s.exp_avg_sqs), cut(s.param_outs))
        parts.m_scales, parts.v_scales = cut_scales(st.m_scales), cut_scales(st.v_scales)
        return parts

    split_run, wrong = whole.clone(), whole.clone()
    whole.run(param_ids=[7])
    split(split_run).run(param_ids=[7, 7, 7], param_offsets=cuts[:-1])
    assert_states_bits_equal(split_run, whole, "split vs whole")
    split(wrong).run(param_ids=[7, 7, 7], param_offsets=[0, 0, 0])  # negative control: offsets ignored
    assert not torch.equal(wrong.state.params[0], whole.state.params[0])


@pytest.mark.parametrize("m_dtype,v_dtype", FORMATS)
@pytest.mark.parametrize("capturable", [False, True], ids=["eager", "capturable"])
def test_skipped_step_leaves_every_bit(backend: Backend, m_dtype, v_dtype, capturable) -> None:
    """found_inf set: params, codes, scales, bf16 moments and param_outs keep their bits (read on the device
    in the capturable variant); cleared, the same call moves them."""
    st = states([300, CHUNK + 5], m_dtype, v_dtype, BF16, BF16, FP32, remainders=True)
    before = st.clone()
    kw = dict(lr=scalar(HYPER["lr"]), steps=[scalar(2.0), scalar(5.0)]) if capturable else {}
    st.run(found_inf=scalar(1.0), **kw)
    assert_states_bits_equal(st, before, "skipped step")
    st.run(found_inf=scalar(0.0), **kw)
    assert not torch.equal(st.state.param_remainders[1], before.state.param_remainders[1])


@pytest.mark.parametrize("m_dtype,v_dtype", FORMATS)
def test_capturable_matches_eager(backend: Backend, m_dtype, v_dtype) -> None:
    """Device lr and per-tensor steps: the eager op's bits at each tensor's step (stochastic rounding's
    counter is the tensor's step)."""
    sizes = [CHUNK + 9, 513, 4096]
    st = states(sizes, m_dtype, v_dtype, BF16, FP32, BF16)
    eager = st.clone()
    steps = [3.0, 1.0, 8.0]
    lr = scalar(HYPER["lr"])
    lr_value = lr.item()  # the float32 lr the kernel reads, as the eager op's number
    st.run(lr=lr, steps=[scalar(s) for s in steps])
    for i, s in enumerate(steps):
        one = object.__new__(States)
        one.state = eager.state.select([i])
        one.m_scales = eager.m_scales[i : i + 1]
        one.v_scales = eager.v_scales[i : i + 1]
        one.run(step=int(s), param_ids=[i], lr_eager=lr_value)
    assert_states_bits_equal(st, eager, "capturable vs eager")


def offset_view(x: Tensor, offset: int) -> Tensor:
    buf = torch.zeros(x.numel() + offset, dtype=x.dtype, device=x.device)
    return buf[offset:].view(x.shape).copy_(x)


@pytest.mark.parametrize("m_dtype,v_dtype", [pytest.param(U8, BF16, id="u8-bf16"), pytest.param(BF16, U8, id="b-u8")])
def test_unaligned_lists_take_the_scalar_path(backend: Backend, m_dtype, v_dtype) -> None:
    """Lists that are not 16-byte (codes: 8-byte) aligned: the same bits as aligned copies."""
    st = states([CHUNK + 700, 1000], m_dtype, v_dtype, FP32, BF16, BF16)
    aligned = st.clone()
    s = st.state
    s.grads = [offset_view(g, 1) for g in s.grads]
    s.exp_avgs = [offset_view(m, 3) for m in s.exp_avgs]
    st.run()
    aligned.run()
    assert_states_bits_equal(st, aligned, "unaligned vs aligned")


# ----------------------------------------------------------------------------------------------------
# Launch splits and counts
# ----------------------------------------------------------------------------------------------------

# Rows of the eager states variant without param_outs or remainders: params, grads, two moments, two
# scales lists, param ids and offsets (csrc/cuda/adam_states_op.cuh).
EAGER_DEPTH = 8


@pytest.fixture(params=["4KiB", "32K"])
def meta(request: pytest.FixtureRequest):
    yield emulated_constants(request.param)
    emulated_constants("32K")


def test_states_slots_full_and_tensor_continues(backend: Backend, meta: dict) -> None:
    """More tensors than a launch's slots, then a tensor continuing in the next launch: each entry keeps
    its own scales and rounding key (bits against the CPU kernel; update against the reference)."""
    launch_log(backend)
    slots, blocks = slots_and_blocks(meta, EAGER_DEPTH)
    sizes = [200 + (37 * i) % 600 for i in range(slots + 3)]
    st = states(sizes, U8, BF16, BF16)
    expected = st.clone()
    st.run()
    expected.run_reference()
    assert_close_to_reference(st, expected)
    log = launch_log(backend)
    if log is not None:
        assert log["adam states"] == [slots, 3]
    if meta["large_kernel_params"]:
        return  # a tensor of more than `blocks` chunks: too slow to emulate with 32K metadata
    sizes = [3, 1000, (blocks + 1) * CHUNK + 300, 5]
    st = states(sizes, BF16, U8, BF16)
    st.run(rounding=False)  # ~21M elements: no Philox words to emulate
    log = launch_log(backend)
    if log is not None:
        assert log["adam states"] == [blocks, sum(math.ceil(n / CHUNK) for n in sizes) - blocks]


# Launches of the states variants for 10,000 one-chunk tensors (eager, depth 8; capturable, depth 9).
EXPECTED_STATES_LAUNCHES = {"4KiB": {"eager": 371, "capturable": 417}, "32K": {"eager": 25, "capturable": 27}}


@pytest.fixture(params=LAUNCH_COUNT_SIZES)
def n_tensors(request: pytest.FixtureRequest) -> int | None:
    return launch_count_tensors(request)  # three launches' worth, or 10,000 in the long version


def test_states_launch_counts(n_tensors: int | None, backend: Backend, meta: dict) -> None:
    """Small tensors with 8-bit moments: launches at the states variants' depths, eager and capturable
    (every launch's grid: the metadata's slots at those depths). Three launches' worth at the eager depth
    by default, 10,000 tensors in the long version (why: test_ops_launches, above test_adam_launch_counts);
    EXPECTED_STATES_LAUNCHES, the 10,000 tensors' counts, against the build's slots either way."""
    expected_launches(backend, meta)  # skips off the emulator
    want = EXPECTED_STATES_LAUNCHES["32K" if meta["large_kernel_params"] else "4KiB"]
    eager_slots, capturable_slots = (slots_and_blocks(meta, d)[0] for d in (EAGER_DEPTH, EAGER_DEPTH + 1))
    assert want == {"eager": math.ceil(10_000 / eager_slots), "capturable": math.ceil(10_000 / capturable_slots)}
    n = n_tensors or three_launches(meta, EAGER_DEPTH)
    st = states([7] * n, U8, U8)
    launch_log(backend)
    st.run(rounding=False)
    eager = launch_log(backend)["adam states"]
    st.run(rounding=False, lr=scalar(HYPER["lr"]), steps=[scalar(4.0)] * n)
    capturable = launch_log(backend)["adam states"]
    assert eager == packed(n, eager_slots), eager
    assert capturable == packed(n, capturable_slots), capturable
