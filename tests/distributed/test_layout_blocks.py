"""The planner's per-group alignment (``aligns``): 8-bit optimizer state's 256-element blocks, counted
from each param's first element, never straddle two shards, and the layout of other groups is the
one they get without it (tests/distributed/test_layout.py states the rest of the planner's promises).
"""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st
from test_layout import SETTINGS, owners_from_fragments, owners_from_pieces, problems

from distopt.distributed.layout import plan_layout, plan_segments

BLOCK = 256


@st.composite
def blocked_problems(draw) -> dict:
    """plan_layout arguments whose groups "a" and 3 (if present) get 256-element alignment."""
    kw = draw(problems())
    kw["numels"] = [n * draw(st.sampled_from([1, 7, 40])) for n in kw["numels"]]  # some above a block
    if kw["groups"] is None:
        kw["groups"] = draw(st.lists(st.sampled_from(["a", "b", None, 3]), min_size=len(kw["numels"]),
                                     max_size=len(kw["numels"])))
    kw["aligns"] = {"a": BLOCK, 3: BLOCK}
    return kw


def block_owners(layout, numels: list[int], blocked: list[bool]) -> list[str]:
    """The blocks of blocked params that lie in more than one (bucket, rank): should be none."""
    bad = []
    for b in range(len(layout.buckets)):
        for rank in range(layout.world_size):
            for f in layout.fragments(rank, b):
                if blocked[f.param] and (f.param_offset % BLOCK or f.shard_offset % BLOCK
                                         or (f.numel % BLOCK and f.param_offset + f.numel != numels[f.param])):
                    bad.append(f"param {f.param} elements {f.param_offset}+{f.numel} at shard {rank} "
                               f"offset {f.shard_offset} of bucket {b}")
    return bad


@SETTINGS
@given(blocked_problems())
def test_blocks_of_aligned_groups_never_straddle_shards(kw):
    layout = plan_layout(**kw)
    numels, blocked = kw["numels"], [g in kw["aligns"] for g in kw["groups"]]
    assert block_owners(layout, numels, blocked) == []
    for bucket in layout.buckets:
        if bucket.group in kw["aligns"]:
            assert bucket.shard_numel % BLOCK == 0
    # Still a layout: every element owned exactly once, pieces and fragments agree.
    for i, (a, b) in enumerate(zip(owners_from_pieces(layout, numels), owners_from_fragments(layout, numels))):
        assert (a >= 0).all(), f"param {i} has unowned elements"
        np.testing.assert_array_equal(a, b)


@SETTINGS
@given(blocked_problems())
def test_groups_without_an_alignment_keep_their_layout(kw):
    """Only the aligned groups' buckets change: the others (and a layout without aligns) are as before."""
    with_aligns = plan_layout(**kw)
    plain = plan_layout(**{k: v for k, v in kw.items() if k != "aligns"})

    def others(layout) -> list:  # bucket indices shift with the aligned groups' bucket count: left out
        return [(b.group, b.numel, b.shard_numel, [(p.param, p.param_offset, p.bucket_offset, p.numel)
                                                   for p in b.pieces])
                for b in layout.buckets if b.group not in kw["aligns"]]

    assert others(with_aligns) == others(plain)
    unused = plan_layout(**{**kw, "aligns": {"never used": BLOCK}})
    assert unused == plain


@SETTINGS
@given(blocked_problems(), st.data())
def test_fresh_segments_keep_blocks_whole(kw, data):
    n = len(kw["numels"])
    cut = data.draw(st.integers(0, n))
    segments = [(list(range(cut)), False), (list(range(cut, n)), True)]
    layout = plan_segments(segments, kw["numels"], kw["groups"], kw["world_size"], kw["bucket_numel"],
                           kw["align"], kw["aligns"])
    assert block_owners(layout, kw["numels"], [g in kw["aligns"] for g in kw["groups"]]) == []


def test_negative_control_the_default_alignment_lets_blocks_straddle():
    """Without the 256-element alignment a 600-element param after a 16-element one, on 2 ranks of
    1024-element buckets, has a block cut by the shard boundary (the check above would fail)."""
    numels, groups = [16, 600], ["a", "a"]
    plain = plan_layout(numels, 2, 1024, groups)
    assert block_owners(plain, numels, [True, True]) != []
    assert block_owners(plan_layout(numels, 2, 1024, groups, aligns={"a": BLOCK}), numels, [True, True]) == []
