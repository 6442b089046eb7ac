"""The ``extra`` dict of ``checkpoint.save/load`` (files.py) as torch.distributed.checkpoint traverses it: its
leaves, fresh tensors to load into (so a refused load changes nothing), per-leaf checksums, and the
final commit into the caller's objects."""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.stateful import Stateful

from ...state_dicts import tensor_crc32


def dcp_targets(extra: Mapping[str, Any] | None) -> dict[str, Any]:
    """`extra` with each top-level Stateful (a module, say) as its state_dict(), as dcp sees it."""
    extra = {} if extra is None else extra
    if "optim" in extra:
        raise ValueError("extra must not have an 'optim' key: the optimizer's state is saved under it")
    return {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in extra.items()}


def _is_container(value: Any) -> bool:
    """Whether dcp looks inside `value` (a mapping, or a list holding tensors or containers)."""
    if isinstance(value, Mapping):
        return True
    return isinstance(value, list) and any(isinstance(v, Tensor) or _is_container(v) for v in value)


def _items(value: Any) -> Iterator[tuple[Any, Any]]:
    return iter(value.items()) if isinstance(value, Mapping) else enumerate(value)


def leaves(value: Any, path: tuple = ()) -> Iterator[tuple[str, Any]]:
    """(fqn, leaf) of every value dcp saves as one item, with dcp's names."""
    for k, v in _items(value):
        if _is_container(v):
            yield from leaves(v, path + (k,))
        else:
            yield ".".join(map(str, path + (k,))), v


def map_leaves(value: Any, fn: Callable[[str, Any], Any], path: tuple = ()) -> Any:
    """A copy of `value`'s containers with each leaf replaced by ``fn(fqn, leaf)``."""
    out = {k: None for k in value} if isinstance(value, Mapping) else [None] * len(value)
    for k, v in _items(value):
        out[k] = map_leaves(v, fn, path + (k,)) if _is_container(v) else fn(".".join(map(str, path + (k,))), v)
    return out


def is_plain(value: Any) -> bool:
    """A tensor that dcp saves whole (not a DTensor or other sharded subclass): it has a checksum."""
    return isinstance(value, Tensor) and type(value) in (Tensor, torch.nn.Parameter)


def fresh_leaf(value: Any, saved: Any) -> Any:
    """Where dcp.load reads a leaf of `extra`: a plain tensor as it was saved (dtype included, so its
    checksum can be verified), anything else like the caller's."""
    if is_plain(value):
        return torch.empty(tuple(saved.size), dtype=saved.properties.dtype)
    return torch.empty_like(value) if isinstance(value, Tensor) else value


def extra_checksums(targets: dict[str, Any], group: Any) -> dict[str, Tensor]:
    """fqn -> the CRC-32s of a plain tensor of `extra`. Ranks may save different values under one
    key, of which dcp writes one: then every rank's CRC is kept (any of them will do on load)."""
    local = {fqn: tensor_crc32(v) for fqn, v in leaves(targets) if is_plain(v)}
    digests: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(digests, zlib.crc32(json.dumps(sorted(local.items())).encode()), group=group)
    if len(set(digests)) == 1:  # the usual case: replicated models, nothing more to exchange
        return {fqn: torch.tensor([c], dtype=torch.int64) for fqn, c in local.items()}
    everyone: list[Any] = [None] * len(digests)
    dist.all_gather_object(everyone, local, group=group)
    return {fqn: torch.tensor(sorted({m[fqn] for m in everyone if fqn in m}), dtype=torch.int64) for fqn in local}


def check_extra(targets: dict[str, Any], md: Metadata, checkpoint_id: str) -> None:
    """Every leaf of `extra` is in the checkpoint, a tensor as a tensor of the same shape."""
    for fqn, value in leaves(targets):
        saved = md.state_dict_metadata.get(fqn)
        if saved is None:
            raise ValueError(f"{checkpoint_id}: the checkpoint holds nothing for extra[{fqn!r}]")
        if isinstance(value, Tensor) != isinstance(saved, TensorStorageMetadata):
            raise ValueError(f"{checkpoint_id}: extra[{fqn!r}] is {'a' if isinstance(value, Tensor) else 'not a'} "
                             "tensor, unlike the checkpoint's")
        if isinstance(value, Tensor) and tuple(saved.size) != tuple(value.shape):
            raise ValueError(f"{checkpoint_id}: extra[{fqn!r}] has shape {tuple(value.shape)}, the checkpoint "
                             f"{tuple(saved.size)}")


def commit(dst: Any, src: Any) -> None:
    """Copies the loaded `src` into the caller's containers `dst`: tensors in place, other leaves
    replaced (as dcp.load does)."""
    for k, d in _items(dst):
        if _is_container(d):
            commit(d, src[k])
        elif isinstance(d, Tensor):
            d.copy_(src[k])
        else:
            dst[k] = src[k]
