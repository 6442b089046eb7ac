"""Property-based tests of the bucket/shard planner `plan_layout` (distopt/distributed/layout.py).

What the planner promises, stated exactly (from its docstrings and code):
  * unit = world_size * align; capacity = max(unit, bucket_numel // unit * unit): the requested bucket
    size rounded down to a multiple of unit, but at least one unit.
  * Params are packed in input order; zero-sized params get no pieces. Each group key has one open
    bucket. A param starts in its group's open bucket at the next multiple of `align` after the last
    piece (start = round_up(fill, align)) if it fits there (start + numel <= capacity), or if it is
    larger than a whole bucket and that bucket still has room (numel > capacity and start < capacity):
    it then fills the room and continues in fresh buckets. Otherwise it starts a fresh bucket at 0.
  * Hence a param is split across buckets if and only if numel > capacity; it then occupies
    ceil((first_offset + numel) / capacity) consecutive buckets, every piece but the first at offset
    0 and every piece but the last filling its bucket to `capacity`.
  * Each bucket is padded to the smallest multiple of unit holding its pieces, so
    numel = world_size * shard_numel, shard_numel is a multiple of align, numel <= capacity (a
    bucket never holds more than capacity: larger params are split, never given an oversized bucket).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from distopt.distributed.layout import Fragment, Layout, Piece, plan_layout

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SMALL_SIZES = [0, 1, 2, 3, 5, 7, 11, 13, 17, 31, 61, 127, 257]  # empty, tiny and prime sizes
GROUP_KEYS = ["a", "b", None, 3]


def round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def capacity_of(world_size: int, bucket_numel: int, align: int) -> int:
    unit = world_size * align
    return max(unit, bucket_numel // unit * unit)


@st.composite
def problems(draw) -> dict:
    """Keyword arguments for plan_layout: sizes around, below and above the bucket capacity."""
    world_size = draw(st.integers(1, 8))
    align = draw(st.sampled_from([1, 8, 16]))
    bucket_numel = draw(st.one_of(st.integers(1, world_size * align),  # smaller than one unit
                                  st.integers(1, 4096)))
    cap = capacity_of(world_size, bucket_numel, align)
    size = st.one_of(st.sampled_from(SMALL_SIZES), st.integers(0, 3 * cap),
                     st.integers(max(0, cap - align), cap + align))  # just below / at / above a bucket
    numels = draw(st.lists(size, max_size=12))
    groups = draw(st.one_of(st.none(), st.lists(st.sampled_from(GROUP_KEYS), min_size=len(numels),
                                                max_size=len(numels))))
    return dict(numels=numels, world_size=world_size, bucket_numel=bucket_numel, groups=groups, align=align)


def bucket_bases(layout: Layout) -> list[int]:
    """Start of each bucket in the concatenation of all buckets (a global element address)."""
    return [0, *np.cumsum([b.numel for b in layout.buckets]).tolist()]


def owners_from_pieces(layout: Layout, numels: list[int]) -> list[np.ndarray]:
    """Per param, the global address of each element according to `param_pieces` (-1: unowned);
    asserts no element is placed twice."""
    bases = bucket_bases(layout)
    where = [np.full(n, -1, dtype=np.int64) for n in numels]
    for i, pieces in enumerate(layout.param_pieces):
        for p in pieces:
            assert p.param == i and p.numel > 0
            dst = where[i][p.param_offset : p.param_offset + p.numel]
            assert len(dst) == p.numel, f"piece {p} runs past param {i} ({numels[i]} elements)"
            assert (dst == -1).all(), f"param {i} elements placed twice ({p})"
            dst[:] = bases[p.bucket] + p.bucket_offset + np.arange(p.numel)
    return where


def owners_from_fragments(layout: Layout, numels: list[int]) -> list[np.ndarray]:
    """Per param, the global address of each element according to `fragments(rank, bucket)`."""
    bases = bucket_bases(layout)
    where = [np.full(n, -1, dtype=np.int64) for n in numels]
    for b, bucket in enumerate(layout.buckets):
        for rank in range(layout.world_size):
            frags = layout.fragments(rank, b)
            offsets = [f.shard_offset for f in frags]
            assert offsets == sorted(offsets), "fragments not in shard order"
            for f in frags:
                assert f.bucket == b and f.numel > 0
                assert 0 <= f.shard_offset and f.shard_offset + f.numel <= bucket.shard_numel
                dst = where[f.param][f.param_offset : f.param_offset + f.numel]
                assert len(dst) == f.numel
                assert (dst == -1).all(), f"param {f.param} elements owned twice ({f}, rank {rank})"
                dst[:] = bases[b] + rank * bucket.shard_numel + f.shard_offset + np.arange(f.numel)
    return where


@SETTINGS
@given(problems())
def test_every_element_owned_exactly_once_and_views_agree(kw):
    """Every param element has exactly one (bucket, rank, shard offset), the same from pieces and fragments."""
    layout = plan_layout(**kw)
    numels = kw["numels"]
    assert len(layout.param_pieces) == len(numels)
    by_pieces = owners_from_pieces(layout, numels)
    by_fragments = owners_from_fragments(layout, numels)
    total = bucket_bases(layout)[-1]
    seen = np.zeros(total, dtype=np.int64)
    for i, (a, b) in enumerate(zip(by_pieces, by_fragments)):
        assert (a >= 0).all(), f"param {i} has unowned elements"
        np.testing.assert_array_equal(a, b, err_msg=f"param {i}: pieces and fragments disagree")
        np.add.at(seen, a, 1)
    assert seen.max(initial=0) <= 1, "two param elements share a bucket element"
    assert seen.sum() == sum(numels)
    # The buckets' piece lists and the per-param piece lists are the same pieces.
    from_buckets = [p for b in layout.buckets for p in b.pieces]
    from_params = [p for ps in layout.param_pieces for p in ps]
    assert len(from_buckets) == len(from_params) and set(from_buckets) == set(from_params)


@SETTINGS
@given(problems())
def test_bucket_sizes_shards_and_alignment(kw):
    """Buckets are world_size equal align-multiple shards, at most the rounded capacity, minimally padded."""
    layout = plan_layout(**kw)
    world, align = kw["world_size"], kw["align"]
    unit = world * align
    cap = capacity_of(world, kw["bucket_numel"], align)
    assert cap % unit == 0 and cap >= unit and (cap <= kw["bucket_numel"] or cap == unit)
    assert layout.world_size == world
    for b, bucket in enumerate(layout.buckets):
        assert bucket.pieces, f"bucket {b} is empty"
        assert bucket.numel == world * bucket.shard_numel
        assert bucket.shard_numel > 0 and bucket.shard_numel % align == 0
        assert bucket.numel <= cap
        end = max(p.bucket_offset + p.numel for p in bucket.pieces)
        assert end <= bucket.numel < end + unit, "padding must be less than one unit"
        assert bucket.shard_range(world - 1)[1] == bucket.numel
        prev_end = 0
        for j, p in enumerate(bucket.pieces):
            assert p.bucket == b
            assert p.bucket_offset % align == 0
            # Tightly packed in bucket order: each piece at the first aligned offset after the previous.
            assert p.bucket_offset == (0 if j == 0 else round_up(prev_end, align))
            prev_end = p.bucket_offset + p.numel
        for rank in range(world):
            assert all(f.shard_offset % align == 0 for f in layout.fragments(rank, b)), "unaligned shard run"


@SETTINGS
@given(problems())
def test_groups_never_share_a_bucket(kw):
    """All pieces of a bucket come from params with the bucket's group key."""
    layout = plan_layout(**kw)
    groups = kw["groups"] or [None] * len(kw["numels"])
    for bucket in layout.buckets:
        assert {groups[p.param] for p in bucket.pieces} == {bucket.group}


@SETTINGS
@given(problems())
def test_param_pieces_contiguous_in_bucket_order_and_split_rule(kw):
    """Pieces cover each param in order over consecutive buckets; split iff numel > capacity."""
    layout = plan_layout(**kw)
    cap = capacity_of(kw["world_size"], kw["bucket_numel"], kw["align"])
    for i, (numel, pieces) in enumerate(zip(kw["numels"], layout.param_pieces)):
        if numel == 0:
            assert pieces == ()
            continue
        assert [p.param_offset for p in pieces] == list(np.cumsum([0] + [p.numel for p in pieces[:-1]]))
        assert sum(p.numel for p in pieces) == numel
        # Increasing bucket order; the first piece may go to an older open bucket, the rest open
        # fresh buckets, so their indices are consecutive.
        buckets = [p.bucket for p in pieces]
        assert buckets == sorted(set(buckets)), f"param {i}: buckets {buckets}"
        assert buckets[1:] == list(range(buckets[-1] - len(buckets) + 2, buckets[-1] + 1)), f"param {i}: {buckets}"
        assert (len(pieces) > 1) == (numel > cap), f"param {i} ({numel} elements, capacity {cap})"
        assert len(pieces) == math.ceil((pieces[0].bucket_offset + numel) / cap)
        assert all(p.bucket_offset == 0 for p in pieces[1:])
        assert all(p.bucket_offset + p.numel == cap for p in pieces[:-1]), "a non-final piece must fill its bucket"


@SETTINGS
@given(problems())
def test_new_bucket_only_when_the_open_one_cannot_take_the_param(kw):
    """Each param goes into its group's open bucket when it fits (or overflows a bucket), else a fresh one."""
    layout = plan_layout(**kw)
    numels, align = kw["numels"], kw["align"]
    groups = kw["groups"] or [None] * len(numels)
    cap = capacity_of(kw["world_size"], kw["bucket_numel"], align)
    last_piece: dict = {}  # group -> last piece placed
    n_buckets = 0
    for i, (numel, pieces) in enumerate(zip(numels, layout.param_pieces)):
        if numel == 0:
            continue
        first, prev = pieces[0], last_piece.get(groups[i])
        if prev is None:
            stays = False
        else:
            start = round_up(prev.bucket_offset + prev.numel, align)
            stays = start + numel <= cap or (numel > cap and start < cap)
        if stays:
            assert (first.bucket, first.bucket_offset) == (prev.bucket, start), f"param {i} left a bucket with room"
        else:
            assert (first.bucket, first.bucket_offset) == (n_buckets, 0), f"param {i} should open a fresh bucket"
        n_buckets = max(n_buckets, pieces[-1].bucket + 1)
        last_piece[groups[i]] = pieces[-1]
    assert len(layout.buckets) == n_buckets


@SETTINGS
@given(problems())
def test_utilization(kw):
    """utilization() is the param elements over the bucket elements (1.0 with no buckets)."""
    layout = plan_layout(**kw)
    total = sum(b.numel for b in layout.buckets)
    expected = sum(kw["numels"]) / total if total else 1.0
    assert layout.utilization() == pytest.approx(expected, rel=1e-12)
    assert 0.0 < layout.utilization() <= 1.0


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(numels=[4], world_size=0, bucket_numel=64),
        dict(numels=[4], world_size=-1, bucket_numel=64),
        dict(numels=[4], world_size=2, bucket_numel=64, align=0),
        dict(numels=[4, -1], world_size=2, bucket_numel=64),
        dict(numels=[4, 5], world_size=2, bucket_numel=64, groups=["a"]),
        dict(numels=[4], world_size=2, bucket_numel=64, groups=["a", "b"]),
    ],
    ids=["world0", "world-1", "align0", "negative-numel", "too-few-groups", "too-many-groups"],
)
def test_bad_input_raises(kwargs):
    """Invalid world size, align, sizes or group keys raise ValueError."""
    with pytest.raises(ValueError):
        plan_layout(**kwargs)


def test_no_params_and_only_empty_params():
    """No params, or only zero-sized ones, give no buckets and utilization 1.0."""
    for numels in ([], [0, 0]):
        layout = plan_layout(numels, world_size=3, bucket_numel=100)
        assert layout.buckets == () and layout.param_pieces == tuple(() for _ in numels)
        assert layout.utilization() == 1.0


# ---------------------------------------------------------------- hand-computed examples


def test_example_packing_and_fragments():
    """[5, 20, 3], world 2, bucket 64, align 8: unit 16, capacity 64; params at 0, 8, 32; 35 -> 48 padded."""
    layout = plan_layout([5, 20, 3], world_size=2, bucket_numel=64, align=8)
    p0, p1, p2 = Piece(0, 0, 0, 0, 5), Piece(1, 0, 0, 8, 20), Piece(2, 0, 0, 32, 3)
    assert layout.param_pieces == ((p0,), (p1,), (p2,))
    (bucket,) = layout.buckets
    assert (bucket.numel, bucket.shard_numel, bucket.pieces, bucket.group) == (48, 24, (p0, p1, p2), None)
    # Rank 0 owns bucket elements [0, 24): all of param 0, param 1's first 16 elements.
    assert layout.fragments(0, 0) == (Fragment(0, 0, 0, 0, 5), Fragment(1, 0, 0, 8, 16))
    # Rank 1 owns [24, 48): param 1's last 4 elements, then param 2 at bucket offset 32 = shard offset 8.
    assert layout.fragments(1, 0) == (Fragment(1, 16, 0, 0, 4), Fragment(2, 0, 0, 8, 3))
    assert layout.utilization() == 28 / 48


def test_example_large_param_fills_the_room_then_splits():
    """[10, 100], world 2, bucket 64, align 8: param 1 (> capacity) fills bucket 0 from 16, rest in bucket 1."""
    layout = plan_layout([10, 100], world_size=2, bucket_numel=64, align=8)
    assert layout.param_pieces == (
        (Piece(0, 0, 0, 0, 10),),
        (Piece(1, 0, 0, 16, 48), Piece(1, 48, 1, 0, 52)),
    )
    assert [(b.numel, b.shard_numel) for b in layout.buckets] == [(64, 32), (64, 32)]
    assert layout.fragments(1, 0) == (Fragment(1, 16, 0, 0, 32),)


def test_example_param_that_fits_a_bucket_moves_rather_than_splits():
    """[40, 30], world 2, bucket 64, align 8: 40 + 30 > 64 and 30 <= 64, so param 1 opens bucket 1."""
    layout = plan_layout([40, 30], world_size=2, bucket_numel=64, align=8)
    assert layout.param_pieces == ((Piece(0, 0, 0, 0, 40),), (Piece(1, 0, 1, 0, 30),))
    assert [(b.numel, b.shard_numel) for b in layout.buckets] == [(48, 24), (32, 16)]


def test_example_large_param_after_a_full_bucket():
    """[9, 40], world 1, bucket 16, align 8: param 1 would start at 16 = capacity, so it opens new buckets."""
    layout = plan_layout([9, 40], world_size=1, bucket_numel=16, align=8)
    assert layout.param_pieces == (
        (Piece(0, 0, 0, 0, 9),),
        (Piece(1, 0, 1, 0, 16), Piece(1, 16, 2, 0, 16), Piece(1, 32, 3, 0, 8)),
    )
    assert [b.numel for b in layout.buckets] == [16, 16, 16, 8]


def test_example_bucket_smaller_than_one_unit():
    """bucket_numel 5 with world 4, align 16 rounds up to one unit (64): [100] -> 64 + 36 (padded to 64)."""
    layout = plan_layout([100], world_size=4, bucket_numel=5, align=16)
    assert layout.param_pieces == ((Piece(0, 0, 0, 0, 64), Piece(0, 64, 1, 0, 36)),)
    assert [(b.numel, b.shard_numel) for b in layout.buckets] == [(64, 16), (64, 16)]
    # Rank 2 owns bucket 1 elements [32, 48): param elements 96..99 then padding.
    assert layout.fragments(2, 1) == (Fragment(0, 96, 1, 0, 4),)
    assert layout.fragments(3, 1) == ()


def test_example_groups_and_empty_params():
    """[3, 0, 3, 3] in groups a, a, b, a (world 1, align 1): the b param gets its own bucket; 0 gets none."""
    layout = plan_layout([3, 0, 3, 3], world_size=1, bucket_numel=100, groups=["a", "a", "b", "a"], align=1)
    assert layout.param_pieces == (
        (Piece(0, 0, 0, 0, 3),),
        (),
        (Piece(2, 0, 1, 0, 3),),
        (Piece(3, 0, 0, 3, 3),),
    )
    assert [(b.group, b.numel) for b in layout.buckets] == [("a", 6), ("b", 3)]
