"""The bucket and shard planner: a pure function from param sizes to where every element lives.

Params are packed, in the given order (the first backward's order, so buckets fill in the order
gradients arrive), into buckets of at most ``bucket_numel`` elements. Every bucket is split into
``world_size`` equal shards; rank r owns the r-th. A param starts at an ``align``-element boundary so
that every shard run the optimizer updates starts 16-byte aligned; a param larger than a bucket's
free space starts a new bucket, and one larger than a whole bucket is split across buckets. Params
with different ``group`` keys (e.g. different communication dtypes) never share a bucket. ``aligns``
may give a group a coarser alignment (8-bit optimizer state: 256-element quantisation blocks), which
then also rounds its buckets' capacity and shards, so that no aligned block straddles two shards.

Nothing here touches tensors: the layout is plain data, tested property-by-property in
tests/distributed/test_layout.py.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, replace

DEFAULT_ALIGN = 16  # elements: 64 bytes of fp32, 32 of bf16; a 16-byte vector load needs <= 8


@dataclass(frozen=True)
class Piece:
    """A contiguous range of one param's elements (in its memory order) stored in one bucket."""

    param: int  # index into the planner's input
    param_offset: int  # first element within the param
    bucket: int
    bucket_offset: int  # first element within the bucket
    numel: int


@dataclass(frozen=True)
class Fragment:
    """The part of a piece that lies in one rank's shard."""

    param: int
    param_offset: int
    bucket: int
    shard_offset: int  # first element within the shard
    numel: int


@dataclass(frozen=True)
class Bucket:
    group: Hashable
    numel: int  # padded: world_size * shard_numel
    shard_numel: int
    pieces: tuple[Piece, ...]  # in bucket order

    def shard_range(self, rank: int) -> tuple[int, int]:
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def used_numel(self) -> int:
        return sum(p.numel for p in self.pieces)


@dataclass(frozen=True)
class Layout:
    world_size: int
    buckets: tuple[Bucket, ...]
    param_pieces: tuple[tuple[Piece, ...], ...]  # per param, in param order

    def fragments(self, rank: int, bucket: int) -> tuple[Fragment, ...]:
        """The pieces of `bucket` that lie in `rank`'s shard, clipped to it, in shard order."""
        b = self.buckets[bucket]
        lo, hi = b.shard_range(rank)
        out = []
        for p in b.pieces:
            start, end = max(p.bucket_offset, lo), min(p.bucket_offset + p.numel, hi)
            if start < end:
                out.append(Fragment(p.param, p.param_offset + start - p.bucket_offset, bucket, start - lo, end - start))
        return tuple(out)

    def utilization(self) -> float:
        """Param elements / bucket elements (1.0: no padding)."""
        total = sum(b.numel for b in self.buckets)
        return sum(b.used_numel() for b in self.buckets) / total if total else 1.0


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def plan_layout(
    numels: Sequence[int],
    world_size: int,
    bucket_numel: int,
    groups: Sequence[Hashable] | None = None,
    align: int = DEFAULT_ALIGN,
    aligns: Mapping[Hashable, int] | None = None,
) -> Layout:
    """Packs params of the given sizes (in order) into buckets; see the module docstring.

    ``bucket_numel`` is rounded down to a multiple of ``world_size * align`` (at least one such unit)
    so shards stay aligned; each bucket is padded up to such a multiple. ``aligns[group]``, where
    given, replaces ``align`` for that group's params and buckets.
    """
    aligns = dict(aligns or {})
    if world_size < 1 or align < 1 or any(a < 1 for a in aligns.values()):
        raise ValueError(f"world_size and align must be >= 1, got {world_size}, {align}, {aligns}")
    if any(n < 0 for n in numels):
        raise ValueError("param sizes must be >= 0")
    groups = [None] * len(numels) if groups is None else list(groups)
    if len(groups) != len(numels):
        raise ValueError(f"{len(groups)} group keys for {len(numels)} params")

    def unit_of(group: Hashable) -> int:
        return world_size * aligns.get(group, align)

    def capacity_of(group: Hashable) -> int:
        return max(unit_of(group), bucket_numel // unit_of(group) * unit_of(group))

    buckets: list[dict] = []  # mutable drafts: group, pieces, fill
    open_bucket: dict[Hashable, int] = {}  # group -> index of its bucket being filled
    param_pieces: list[list[Piece]] = [[] for _ in numels]

    def new_bucket(group: Hashable) -> int:
        buckets.append({"group": group, "pieces": [], "fill": 0})
        open_bucket[group] = len(buckets) - 1
        return len(buckets) - 1

    for index, (numel, group) in enumerate(zip(numels, groups)):
        if numel == 0:
            continue
        b = open_bucket.get(group)
        if b is None:
            b = new_bucket(group)
        capacity = capacity_of(group)
        start = _round_up(buckets[b]["fill"], aligns.get(group, align))
        if start + numel > capacity and buckets[b]["fill"] > 0 and (numel <= capacity or start >= capacity):
            # Start afresh rather than split a param that fits a bucket of its own (or when
            # nothing fits here any more).
            b, start = new_bucket(group), 0
        done = 0
        while done < numel:
            take = min(numel - done, capacity - start)
            piece = Piece(index, done, b, start, take)
            buckets[b]["pieces"].append(piece)
            param_pieces[index].append(piece)
            buckets[b]["fill"] = start + take
            done += take
            if done < numel:
                b, start = new_bucket(group), 0

    final = tuple(
        Bucket(d["group"], _round_up(d["fill"], unit_of(d["group"])),
               _round_up(d["fill"], unit_of(d["group"])) // world_size, tuple(d["pieces"]))
        for d in buckets
    )
    return Layout(world_size, final, tuple(tuple(p) for p in param_pieces))


def plan_segments(
    segments: Sequence[tuple[Sequence[int], bool]],
    numels: Sequence[int],
    groups: Sequence[Hashable],
    world_size: int,
    bucket_numel: int,
    align: int = DEFAULT_ALIGN,
    aligns: Mapping[Hashable, int] | None = None,
) -> Layout:
    """Plans params given as segments of indices into `numels`/`groups`, packed in segment order.

    Consecutive segments marked ``False`` share buckets (``plan_layout`` over their concatenation); a
    segment marked ``True`` gets fresh buckets of its own, large enough to hold it whole (one bucket
    per group key, as apex's ``init_params_bucket``). Pieces name params by their index, so the
    result is a layout of all ``len(numels)`` params (those in no segment get no pieces).
    """
    buckets: list[Bucket] = []
    per_param: list[tuple[Piece, ...]] = [()] * len(numels)

    def add(indices: Sequence[int], capacity: int) -> None:
        if not indices:
            return
        part = plan_layout([numels[i] for i in indices], world_size, capacity, [groups[i] for i in indices], align,
                           aligns)
        shift = len(buckets)

        def move(p: Piece) -> Piece:
            return replace(p, param=indices[p.param], bucket=p.bucket + shift)

        buckets.extend(replace(b, pieces=tuple(move(p) for p in b.pieces)) for b in part.buckets)
        for position, pieces in enumerate(part.param_pieces):
            per_param[indices[position]] = tuple(move(p) for p in pieces)

    shared: list[int] = []
    for indices, fresh in segments:
        if not fresh:
            shared.extend(indices)
            continue
        add(shared, bucket_numel)
        shared = []
        coarsest = max((aligns or {}).get(groups[i], align) for i in indices) if indices else align
        whole = sum(_round_up(numels[i], coarsest) for i in indices)
        add(list(indices), max(bucket_numel, _round_up(whole, world_size * coarsest)))
    add(shared, bucket_numel)
    return Layout(world_size, tuple(buckets), tuple(per_param))


def padding_advice(layout: Layout, numels: Sequence[int], bucket_numel: int, align: int = DEFAULT_ALIGN) -> str:
    """Where a layout's padding comes from, in numbers, and what would reduce it."""
    unit = layout.world_size * align
    capacity = max(unit, bucket_numel // unit * unit)
    total = sum(b.numel for b in layout.buckets)
    used = sum(numels)
    small = [n for n in numels if 0 < n < align]
    align_pad = sum(_round_up(n, align) - n for n in numels if n > 0)
    end_pad = total - used - align_pad
    text = (f"buckets are {100 * used / max(total, 1):.0f}% params ({used} param elements in {len(layout.buckets)} "
            f"buckets of up to {capacity} elements, {total} in all): {align_pad} elements align params to "
            f"{align}-element boundaries, {end_pad} pad bucket ends to a multiple of {unit} "
            f"({layout.world_size} shards x {align})")
    if align_pad >= end_pad:
        return text + (f"; {len(small)} of {len(numels)} params have fewer than {align} elements: merging them "
                       "(e.g. one tensor for many biases) removes most of it")
    if bucket_numel < unit or end_pad > used:
        return text + (f"; the bucket capacity is too small for these params: raise bucket_cap_mb so a bucket "
                       f"holds several params (the largest has {max(numels, default=0)} elements)")
    return text + "; raising bucket_cap_mb gives fewer, fuller buckets"
