"""A contiguous range of a dense tensor's elements, in its memory order, as a few boxes (N-d
rectangles) of its logical shape: what torch.distributed.checkpoint stores and reshards (one chunk
per box, with offsets and sizes), for shards that are flat ranges of each param (layout.py's Fragment).

In a row-major tensor the elements [start, stop) are a partial first row, whole rows and a partial
last row, each of the partial rows again so one dim down: at most 2 * ndim - 1 boxes, each one
contiguous in memory. A tensor in another dense memory format (channels_last) is row-major in its dims
ordered by stride: its boxes are found there and permuted back to the logical dims.

Nothing here touches tensor data except ``box_view``, which only reshapes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor


@dataclass(frozen=True)
class Box:
    """Elements [start, start + numel) of a tensor in its memory order, as a box of its logical dims."""

    offsets: tuple[int, ...]  # in the logical dims
    sizes: tuple[int, ...]
    start: int
    numel: int


def memory_order(shape: Sequence[int], stride: Sequence[int]) -> tuple[int, ...]:
    """The dims from outermost to innermost in memory; ValueError unless the tensor is dense (its
    elements fill its memory once, so that memory order is row-major order of these dims)."""
    order = tuple(sorted(range(len(shape)), key=lambda d: (-stride[d], d)))
    expected = 1
    for d in reversed(order):
        if shape[d] > 1 and stride[d] != expected:
            raise ValueError(f"a tensor of shape {tuple(shape)} and strides {tuple(stride)} is not dense")
        expected *= shape[d]
    return order


def _row_major(shape: tuple[int, ...], start: int, stop: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(offsets, sizes) of the boxes of elements [start, stop) of a row-major `shape`, in memory order."""
    if start >= stop:
        return []
    if len(shape) <= 1:
        return [((start,), (stop - start,))] if shape else [((), ())]
    row = math.prod(shape[1:])
    r0, c0 = divmod(start, row)
    r1, c1 = divmod(stop, row)
    if r0 == r1:
        return [((r0, *o), (1, *s)) for o, s in _row_major(shape[1:], c0, c1)]
    out = []
    if c0:
        out += [((r0, *o), (1, *s)) for o, s in _row_major(shape[1:], c0, row)]
        r0 += 1
    if r1 > r0:
        out.append(((r0,) + (0,) * (len(shape) - 1), (r1 - r0, *shape[1:])))
    if c1:
        out += [((r1, *o), (1, *s)) for o, s in _row_major(shape[1:], 0, c1)]
    return out


def boxes(shape: Sequence[int], stride: Sequence[int], start: int, stop: int) -> list[Box]:
    """The boxes of elements [start, stop) (memory order) of a dense tensor, in memory order."""
    numel = math.prod(shape)
    if not 0 <= start <= stop <= numel:
        raise ValueError(f"elements [{start}, {stop}) are not a range of a tensor of {numel} elements")
    order = memory_order(shape, stride)
    permuted = tuple(shape[d] for d in order)
    inner = [math.prod(permuted[i + 1 :]) for i in range(len(permuted))]  # row-major strides
    out = []
    for offsets, sizes in _row_major(permuted, start, stop):
        logical_offsets, logical_sizes = [0] * len(shape), [0] * len(shape)
        for i, d in enumerate(order):
            logical_offsets[d], logical_sizes[d] = offsets[i], sizes[i]
        first = sum(o * s for o, s in zip(offsets, inner))
        out.append(Box(tuple(logical_offsets), tuple(logical_sizes), first, math.prod(sizes)))
    return out


def box_view(values: Tensor, box: Box, order: tuple[int, ...]) -> Tensor:
    """`values` (the box's elements in memory order, 1-D) as a tensor of the box's logical sizes."""
    inverse = sorted(range(len(order)), key=lambda i: order[i])
    return values.view([box.sizes[d] for d in order]).permute(inverse)
