"""distopt's own sharded checkpoint files: ``save(opt, path, extra)`` and ``load(opt, path, extra)``.

Every rank writes, through torch.distributed.checkpoint, only the ranges of each param's state it owns
(``sharded_state_dict``; what the files hold: file_format.py), with their CRC-32s and those of `extra`
(extra.py), into a directory that replaces the previous checkpoint atomically (atomic_replace.py). A
load reads the saved ranges overlapping this rank's into fresh tensors, checks everything on every
rank, and only then commits `extra` and the optimizer (through the per-param form's loader,
state_dict.py), under any world size, bucket size and moment format.
"""

from __future__ import annotations

import json
import zlib
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException: catch it by name
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.stateful import Stateful

from ...state_dicts import check_saved_groups, tensor_crc32
from ..comm import raise_together
from ..tensor_parallel import layout_text
from . import atomic_replace, dcp_state, file_format
from .atomic_replace import describe
from .extra import check_extra, commit, dcp_targets, extra_checksums, fresh_leaf, is_plain, leaves, map_leaves
from .file_format import SHARDED_FORMAT
from .placement import checkpoint_group, chunk_name
from .protocol import ShardedOptimizer
from .state_dict import groups_out, load_state_dict


def sharded_state_dict(opt: ShardedOptimizer) -> dict[str, Any]:
    """This rank's part of the checkpoint for torch.distributed.checkpoint: each owned range of each
    param's state under ``state.<param>.<key>.<first element>`` and its CRC-32 under ``checksum.<param>...``
    (<param>: placement.chunk_name; the keys: file_format.py), plus what every rank shares (``meta``)."""
    buckets = opt.shard_buckets()
    index, params, tensors = opt.checkpoint_indices(), opt.checkpoint_params(), opt.checkpoint_tensors()
    names = [chunk_name(g, p) for g, p in zip(index, params)]
    out: dict[str, Any] = {}
    for b in buckets:
        for f in b.fragments:
            # Views of the live state where it holds the values (dcp.save is synchronous), no copies:
            # only the masters of 16-bit params without stored ones are computed here. CPU views go
            # through exact storages, which dcp's file writer does not clone (dcp_state.exact_storage);
            # it copies GPU tensors to the CPU, keeping the copies until the rank's file is closed.
            for key, (first, values) in dcp_state.fragment_pieces(b, f, tensors).items():
                name = f"{names[f.param]}.{key}.{first}"
                out[f"state.{name}"] = t = dcp_state.exact_storage(values.detach())
                out[f"checksum.{name}"] = torch.tensor([tensor_crc32(t)], dtype=torch.int64)
    # One leaf (JSON text): torch.distributed.checkpoint would otherwise flatten the nested structure.
    body = json.dumps({
        "step": opt.step_count,
        "param_groups": groups_out(opt),
        "params": {index[i]: [list(p.shape), list(p.stride())] for i, p in enumerate(params)},
        "layouts": {index[i]: layout_text(p) for i, p in enumerate(params) if layout_text(p) is not None},
    })
    out["meta"] = json.dumps({"format": SHARDED_FORMAT, "crc32": zlib.crc32(body.encode()), "body": body})
    return out


def save(opt: ShardedOptimizer, checkpoint_id: str, extra: dict[str, Any] | None = None) -> None:
    """Sharded save: every rank calls it; each writes only its own ranges (and `extra`, e.g.
    ``{"model": model.state_dict()}``, deduplicated by torch.distributed.checkpoint). Crash-consistent
    (atomic_replace.py): written beside `checkpoint_id`, then switched in atomically; a rank killed at
    any moment leaves the previous checkpoint or the new one there, complete, and a failure on any rank
    raises on every rank and leaves the previous one as it was."""
    group = checkpoint_group(opt)
    targets = dcp_targets(extra)
    optim = sharded_state_dict(opt)

    def write(tmp: str) -> None:  # its collectives' failures (a rank died) are the save's: named by replace_dir
        optim["extra_checksum"] = extra_checksums(targets, group)
        dcp.save({"optim": optim, **targets}, storage_writer=dcp.FileSystemWriter(tmp, sync_files=True),
                 process_group=group)

    atomic_replace.replace_dir(checkpoint_id, write, group)


def load(opt: ShardedOptimizer, checkpoint_id: str, extra: dict[str, Any] | None = None) -> None:
    """Sharded load under any world size: each rank reads the saved ranges overlapping its own, and
    `extra` (e.g. ``{"model": model.state_dict()}``), into fresh tensors; once everything is checked
    on every rank, copies `extra` into the caller's tensors and loads the optimizer (in its own moment
    formats, whatever the saved ones). Every rank reads the version rank 0 finds at `checkpoint_id`;
    leftovers of killed saves beside it are ignored."""
    group = checkpoint_group(opt)
    checkpoint_id = atomic_replace.resolve(checkpoint_id, group)
    extra = {} if extra is None else extra
    targets = dcp_targets(extra)
    error = None
    try:
        md = dcp.FileSystemReader(checkpoint_id).read_metadata()
        if "optim.meta" not in md.state_dict_metadata:
            error = "no optimizer metadata ('optim.meta')"
    except Exception as exc:  # missing or garbled .metadata file
        error = f"its metadata cannot be read ({exc!r})"
    raise_together(group, error, f"{checkpoint_id}: not a readable distopt sharded checkpoint")
    meta_holder: dict[str, Any] = {"optim": {"meta": ""}}
    try:
        dcp.load(meta_holder, checkpoint_id=checkpoint_id, process_group=group)
    except CheckpointException as exc:
        raise ValueError(f"{checkpoint_id}: the optimizer metadata cannot be read ({describe(exc)})") from exc
    meta, verified = file_format.parse_meta(meta_holder["optim"]["meta"], checkpoint_id)
    check_saved_groups(opt.param_groups, meta["param_groups"])
    saved = file_format.saved_fragments(md)
    file_format.check_coverage(opt, checkpoint_id, meta, saved, md if verified else None)
    check_extra(targets, md, checkpoint_id)

    # Read everything into fresh tensors: dcp.load writes in place, and may fail halfway.
    needed: dict[str, Any] = file_format.requests(opt, saved, md, verified)
    sums: dict[str, Tensor] = {}
    for fqn, value in leaves(targets) if verified else ():
        entry = md.state_dict_metadata.get(f"optim.extra_checksum.{fqn}")
        if is_plain(value) and isinstance(entry, TensorStorageMetadata):
            sums[fqn] = torch.empty(entry.size, dtype=torch.int64)
    if sums:
        needed["extra_checksum"] = sums
    fresh = map_leaves(targets, lambda fqn, value: fresh_leaf(value, md.state_dict_metadata[fqn]))
    request = {"optim": needed, **fresh}
    try:
        dcp.load(request, checkpoint_id=checkpoint_id, process_group=group)
    except CheckpointException as exc:  # e.g. a missing, truncated or garbled data file; nothing has changed
        why = describe(exc)
        raise ValueError(f"{checkpoint_id}: the checkpoint's data cannot be read; nothing was loaded ({why})") from exc
    fresh = {k: request[k] for k in fresh}  # dcp.load replaces non-tensor leaves at the top in `request`

    bad = [f"optim.{k}" for k, t in needed.items() if k.startswith("state.") and verified
           and tensor_crc32(t) != int(needed["checksum." + k[len("state."):]][0])]
    bad += [fqn for fqn, t in leaves(fresh) if fqn in sums and tensor_crc32(t) not in sums[fqn].tolist()]
    mismatch = f"{len(bad)} saved tensor(s) do not match their checksums ({', '.join(bad[:4])})" if bad else None
    raise_together(group, mismatch, f"{checkpoint_id}: the checkpoint is corrupted; nothing was loaded")

    optim = file_format.as_state_dict(opt, needed, saved, meta)  # the sharded form, which load_state_dict takes

    # Commit: the caller's `extra` (as dcp.load would have), then the optimizer.
    with torch.no_grad():
        commit(targets, fresh)
    for k, v in extra.items():
        if isinstance(v, Stateful):
            v.load_state_dict(targets[k])
        elif targets[k] is not v:  # a non-tensor leaf at the top, replaced as dcp.load replaces it
            extra[k] = targets[k]

    load_state_dict(opt, optim)  # (checked above: formats and coverage; it converts and applies)
