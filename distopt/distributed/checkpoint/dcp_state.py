"""DistributedFusedAdam's state dict as this rank's shard, for torch.distributed.checkpoint's
standard API (``get_state_dict``/``set_state_dict``, ``dcp.save``/``dcp.load``), with nothing gathered.

torch's state-dict functions call plain ``opt.state_dict()``, whose documented result is every param's
whole state (gathered over the ranks, loadable by torch.optim.AdamW). Inside
``sharded_state_dicts(opt)`` (or with ``opt.state_dict(sharded=True)``) it is instead torch.optim's
structure with, for ``param``, ``exp_avg`` and ``exp_avg_sq``, a ``ShardedParamState`` per param: a
tensor of the param's shape that holds only this rank's elements of it, as views of the optimizer's
shard (no copy; only the fp32 masters of 16-bit params without stored ones are computed). Low-precision
moments keep their format and ``state_dict()``'s keys (``state_keys``): bf16 values, or an 8-bit
moment's codes and absmax scales, whose 256-element blocks never straddle two ranks; so dcp.load
reshards them bit for bit, and a checkpoint in another format fails at its missing keys (bf16 and fp32
values convert as DCP casts them: to nearest, as a state dict's load quantises). A shard is a
flat range of each param (distributed/layout.py), which DTensor placements cannot express; boxes.py cuts it into
boxes, and ``ShardedParamState`` hands them to torch.distributed.checkpoint through its
``_Checkpointable`` protocol, as DTensor does. dcp.save writes each rank's boxes; dcp.load reads, into
this rank's boxes, the parts of the saved ones that overlap them, whatever the world size or layout
that saved them (or whole tensors, as torch.optim.AdamW's checkpoints hold). dcp.load fills a CPU copy
of this rank's part (taken when it plans its reads), not the optimizer: ``load_state_dict`` of the
filled state dict (``set_state_dict``) checks it, then writes the shards, the step, the hyperparameters
and the model params. (``checkpoint.load`` also verifies checksums.)

A ``ShardedParamState`` is only for torch.distributed.checkpoint: every tensor operation on it
(and pickling) raises a TypeError. torch's ``full_state_dict``/``cpu_offload`` options, which cannot
be told apart from here, hand these tensors on unchanged inside ``sharded_state_dicts``: their first
use fails loudly instead of passing off a partial tensor as a whole one.
"""

from __future__ import annotations

import ctypes
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from ...lowprec import formats as mf
from ...lowprec.codecs import QUANT_BLOCK
from ..buckets import BucketRuntime
from ..layout import Fragment
from .boxes import Box, box_view, boxes, memory_order
from .placement import chunk_origin
from .protocol import ShardedOptimizer

_DEPTH: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()  # optimizer -> nesting depth


@contextmanager
def sharded_state_dicts(opt: Any) -> Iterator[Any]:
    """Within the block, ``opt.state_dict()`` (as torch's ``get_state_dict``, ``get_optimizer_state_dict``
    and ``dcp.save``/``dcp.load`` of the optimizer call it) returns this rank's shard (see the module
    docstring) instead of gathering every param's whole state. Nests; for DistributedFusedAdam only."""
    if not hasattr(opt, "shard_buckets"):
        raise TypeError(
            f"sharded_state_dicts() is for DistributedFusedAdam, not {type(opt).__name__} (whose "
            "state_dict() holds no more than what each rank has)"
        )
    _DEPTH[opt] = _DEPTH.get(opt, 0) + 1
    try:
        yield opt
    finally:
        _DEPTH[opt] -= 1
        if not _DEPTH[opt]:
            del _DEPTH[opt]


def active(opt: Any) -> bool:
    """Whether `opt` is inside ``sharded_state_dicts``."""
    return _DEPTH.get(opt, 0) > 0


def exact_storage(t: Tensor) -> Tensor:
    """`t` (a contiguous CPU tensor) as a tensor that aliases its memory through a storage of exactly
    its size. torch's FileSystemWriter clones a view of a larger storage (so as not to write the whole
    storage) and keeps the clone until the rank's file is closed: about this rank's share of the state.
    An exact storage is written as it is, so saving costs no memory beyond views."""
    if t.device.type != "cpu" or not t.is_contiguous() or t.numel() == 0:
        return t
    buffer = (ctypes.c_char * (t.numel() * t.element_size())).from_address(t.data_ptr())
    buffer.owner = t  # the memory stays alive as long as the alias does
    return torch.frombuffer(buffer, dtype=t.dtype)


class ShardedParamState(Tensor):
    """One state tensor of one param (the param's shape; fp32, or a moment's bf16 values or 8-bit codes;
    or a 1-D one of an 8-bit moment's absmax scales) of which this rank holds the flat ranges (in the
    param's memory order) given as ``ranges``: [(first element, 1-D values)], views of the optimizer's
    shard. For a DTensor param, the ranges are of this rank's local chunk of it (of
    ``local_shape`` and ``stride``, at offsets ``origin`` in the param's global ``shape``). Implements
    torch.distributed.checkpoint's ``_Checkpointable`` protocol; anything else raises a TypeError.

    dcp.save reads the views. dcp.load plans its reads through ``__create_chunk_list__`` (which dcp.save
    never calls): from then on the tensor holds a CPU copy of its values, which dcp.load overwrites,
    never the optimizer's own state. So a load that fails halfway, or a dcp.load not followed by
    ``set_state_dict``/``load_state_dict`` (which checks everything, then applies it), changes nothing."""

    _ranges: tuple[tuple[int, Tensor], ...]
    _local_shape: tuple[int, ...]
    _origin: tuple[int, ...]
    _stride: tuple[int, ...]
    _order: tuple[int, ...]
    _boxes: tuple[tuple[Box, Tensor], ...]
    _copied: bool

    @staticmethod
    def __new__(
        cls, shape: torch.Size, stride: tuple[int, ...], device: torch.device, ranges: list[tuple[int, Tensor]],
        local_shape: tuple[int, ...] | None = None, origin: tuple[int, ...] | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> ShardedParamState:
        self = Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device)
        self._local_shape = tuple(shape if local_shape is None else local_shape)
        self._origin = tuple(origin) if origin is not None else (0,) * len(shape)
        self._stride = tuple(stride)
        self._order = memory_order(self._local_shape, stride)
        self._copied = False
        self._hold(ranges)
        return self

    def _hold(self, ranges: Iterable[tuple[int, Tensor]]) -> None:
        self._ranges = tuple(sorted(ranges, key=lambda r: r[0]))
        self._boxes = tuple(
            (box, values[box.start - first : box.start - first + box.numel])
            for first, values in self._ranges
            for box in boxes(self._local_shape, self._stride, first, first + values.numel())
        )

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise TypeError(
            f"{func}: a ShardedParamState holds only this rank's part of a param's optimizer state, for "
            "torch.distributed.checkpoint (dcp.save/dcp.load); call torch's state-dict functions "
            "with full_state_dict, cpu_offload or async staging outside sharded_state_dicts(opt), "
            "or use opt.state_dict() for whole tensors"
        )

    def __repr__(self, *, tensor_contents=None) -> str:
        held = sum(v.numel() for _, v in self._ranges)
        return f"ShardedParamState(shape={tuple(self.shape)}, {held} of {self.numel()} elements on this rank)"

    def __reduce_ex__(self, protocol: int):
        raise TypeError(
            "a ShardedParamState (this rank's part of a param's optimizer state) cannot be pickled: save "
            "it with torch.distributed.checkpoint, or take opt.state_dict() outside sharded_state_dicts"
        )

    # ---------------------------------------------------------------- torch.distributed.checkpoint

    def __create_write_items__(self, fqn: str, object: Any) -> list[WriteItem]:
        properties = TensorProperties(dtype=self.dtype)
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(self._at(box)), i),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(chunk=chunk, properties=properties, size=self.shape),
            )
            for i, (box, chunk) in enumerate(zip((b for b, _ in self._boxes), self._chunks()))
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        """The boxes dcp.load is to fill: first, a CPU copy of the values to fill (see the class docstring)."""
        if not self._copied:
            self._hold((first, values.detach().to("cpu", copy=True)) for first, values in self._ranges)
            self._copied = True
        return self._chunks()

    def _chunks(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=torch.Size(self._at(box)), sizes=torch.Size(box.sizes))
                for box, _ in self._boxes]

    def _at(self, box: Box) -> tuple[int, ...]:
        """A box's offsets in the whole param."""
        return tuple(o + a for o, a in zip(box.offsets, self._origin))

    def __get_tensor_shard__(self, index: MetadataIndex) -> Tensor:
        """The box at ``index.offset``: a view of this rank's values (dcp.save reads it, dcp.load
        writes it)."""
        hint = index.index
        if hint is None or not (0 <= hint < len(self._boxes)) or self._at(self._boxes[hint][0]) != tuple(index.offset):
            hint = next((i for i, (b, _) in enumerate(self._boxes) if self._at(b) == tuple(index.offset or ())), None)
            if hint is None:
                raise ValueError(f"{index.fqn}: this rank holds no box at offsets {index.offset}")
        box, values = self._boxes[hint]
        return box_view(exact_storage(values), box, self._order)

    # ---------------------------------------------------------------- loading

    def values(self, offset: int, numel: int) -> Tensor | None:
        """Elements [offset, offset + numel) in memory order (1-D), or None unless all are held here."""
        pieces, at = [], offset
        for first, values in self._ranges:
            if first <= at < first + values.numel():
                take = min(offset + numel, first + values.numel()) - at
                pieces.append(values[at - first : at - first + take])
                at += take
        if at < offset + numel:
            return None
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def memory_order(self) -> tuple[int, ...]:
        return self._order

    def mapped(self, fn: Callable[[int, Tensor], Tensor], dtype: torch.dtype) -> ShardedParamState:
        """A ShardedParamState of the same param and layout, in `dtype`, whose range at `first` holds
        ``fn(first, values)`` (e.g. 8-bit codes read as fp32)."""
        return ShardedParamState(self.shape, self._stride, self.device,
                                 [(first, fn(first, values)) for first, values in self._ranges],
                                 self._local_shape, self._origin, dtype)


# ---------------------------------------------------------------------- the optimizer's side


def sharded_state(opt: ShardedOptimizer) -> dict[int, dict[str, Tensor]]:
    """The ``state`` of the sharded form: per param (keyed by its position in param_groups), ``step`` (a
    float32 scalar, as torch.optim's) and a ShardedParamState per key (``state_keys``). Builds the bucket
    layout where there is none yet (a collective: every rank calls it)."""
    buckets = opt.shard_buckets()
    params, tensors = opt.checkpoint_params(), opt.checkpoint_tensors()
    ranges: list[dict[str, list[tuple[int, Tensor]]]] = [{} for _ in params]
    for b in buckets:
        for f in b.fragments:
            for key, (first, values) in fragment_pieces(b, f, tensors).items():
                ranges[f.param].setdefault(key, []).append((first, values.detach()))
    step = float(opt.step_count)
    device = buckets[0].state.exp_avg.device if buckets else params[0].device  # the host, with offload
    state: dict[int, dict[str, Tensor]] = {}
    for g, p, t, held in zip(opt.checkpoint_indices(), params, tensors, ranges):
        state[g] = {"step": torch.tensor(step)}
        for key, dtype in state_keys(opt, p).items():
            if key in mf.ABSMAX_KEYS.values():  # one fp32 scale per 256-element block (never a DTensor's)
                blocks = torch.Size([mf.num_blocks(p.numel())])
                state[g][key] = ShardedParamState(blocks, (1,), device, held.get(key, []), dtype=dtype)
            elif p.numel() == 0:  # no rank holds any of it: a plain empty tensor, saved once
                state[g][key] = torch.zeros(p.shape, dtype=dtype)
            else:  # a DTensor param's: ranges of this rank's local chunk t, placed in the whole param
                state[g][key] = ShardedParamState(p.shape, t.stride(), device, held.get(key, []), t.shape,
                                                  chunk_origin(p), dtype)
    return state


def state_keys(opt: ShardedOptimizer, p: Tensor) -> dict[str, torch.dtype]:
    """A param's state keys in the sharded form and their dtypes: ``param`` (fp32) and each moment in its
    format, as in ``state_dict()``: fp32 or bf16 values under the moment's name, or an 8-bit moment's
    codes (uint8) and absmax scales (fp32) under ``lowprec.formats.CODES_KEYS`` and ``ABSMAX_KEYS``."""
    out = {"param": torch.float32}
    formats = mf.MomentFormats(opt.exp_avg_dtype, opt.exp_avg_sq_dtype, opt.stochastic_rounding)
    for name, dtype in zip(mf.SIGNED, formats.dtypes(p.numel())):
        out[mf.CODES_KEYS[name] if dtype == torch.uint8 else name] = dtype
        if dtype == torch.uint8:
            out[mf.ABSMAX_KEYS[name]] = torch.float32
    return out


def fragment_pieces(b: BucketRuntime, f: Fragment, tensors: list[Tensor]) -> dict[str, tuple[int, Tensor]]:
    """A fragment's state as ``state_keys`` names it: key -> (first element, or block, in the param; the
    shard's values there: views, but for the masters of 16-bit params without stored ones). 8-bit
    fragments start on a block (distributed/moments.py), so their scales are the param's blocks from
    ``param_offset // 256``."""
    out = {"param": (f.param_offset, b.fragment_master(f, tensors))}
    for name in mf.SIGNED:
        state, scales = getattr(b.state, name), getattr(b.state, f"{name}_scales")
        out[mf.CODES_KEYS[name] if state.dtype == torch.uint8 else name] = (
            f.param_offset, state[f.shard_offset : f.shard_offset + f.numel])
        if scales is not None:
            first = f.shard_offset // QUANT_BLOCK
            out[mf.ABSMAX_KEYS[name]] = (f.param_offset // QUANT_BLOCK, scales[first : first + mf.num_blocks(f.numel)])
    return out


def check_covers(opt: ShardedOptimizer, per_param: dict[int, dict[str, Tensor]]) -> None:
    """ValueError unless every ShardedParamState in `per_param` (param position -> key -> tensor) holds,
    in this param's memory order, every element of it this rank needs."""
    index, params = opt.checkpoint_indices(), opt.checkpoint_tensors()
    for b in opt.shard_buckets():
        for f in b.fragments:
            g = index[f.param]
            for key, t in per_param.get(g, {}).items():
                if not isinstance(t, ShardedParamState):
                    continue
                p = params[f.param]
                order = memory_order(p.shape, p.stride())
                if t.memory_order() != order:
                    raise ValueError(
                        f"state {key!r} of param {g} was made for another memory format (dims in "
                        f"memory order {t.memory_order()}, the param's {order})"
                    )
                if t.values(f.param_offset, f.numel) is None:
                    raise ValueError(
                        f"state {key!r} of param {g} is a sharded state dict that lacks elements "
                        f"{f.param_offset}..{f.param_offset + f.numel - 1} this rank holds: a sharded state dict loads "
                        "only into the optimizer (and layout) it was taken from; dcp.load it into this optimizer's "
                        "own state_dict() taken inside sharded_state_dicts(opt)"
                    )
