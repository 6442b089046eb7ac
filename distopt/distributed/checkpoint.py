"""DistributedFusedAdam checkpoints that resume under any world size, bucket size or init order.

Two forms, both keyed by a param's position in ``param_groups`` (torch's convention):

* ``state_dict()``: per param, the fp32 master ``param``, ``exp_avg`` and ``exp_avg_sq`` in the
  param's logical shape (on the CPU), and ``step``; plus ``param_groups`` and ``checksums`` (the
  CRC-32 of every state tensor). It is torch.optim.AdamW's format with one more state key
  (``param``) and two top-level keys that AdamW and FusedAdam ignore, so it loads into both, and
  theirs (which have no checksums) load here. It is assembled bucket by bucket (one all-gather of
  the bucket's shards at a time), so the extra device memory stays near one bucket; the result is
  the whole state on the CPU of every rank (of rank 0 only with ``gather_on_rank0``). It is also what
  torch.distributed.checkpoint's ``get_state_dict`` reads, which re-keys it by param name (FQN):
  loading accepts either key, matched through the saved ``param_groups`` as torch.optim does.
* ``state_dict(sharded=True)``, which plain ``state_dict()`` returns inside
  ``sharded_state_dicts(opt)`` (so that torch's ``get_state_dict`` and ``dcp.save``/``dcp.load``
  of the optimizer see it): the same structure with no ``format`` or ``checksums``, whose state
  tensors hold only this rank's elements of each param, as views of its shard (dcp_sharded.py):
  nothing is gathered or copied, and torch.distributed.checkpoint reshards it itself.
* ``save(opt, path, extra)`` / ``load(opt, path, extra)``: sharded through
  ``torch.distributed.checkpoint``: each rank writes only the contiguous ranges of each param it
  owns, in the param's memory order (low-precision moments in their format), each with its CRC-32
  under its own key, plus the CRC-32 of every tensor in `extra`; on load each rank reads just the
  saved ranges that overlap its new ones (sharded_files.py).
  Crash-consistent: written beside the path and switched in atomically (atomic_replace.py).

Loading is all or nothing. It checks the format, param count, shapes, coverage and (where the
checkpoint has them) the checksums of everything it reads, into fresh tensors, on every rank,
before changing anything: a truncated, garbled or bit-flipped checkpoint is refused with a
ValueError on every rank and the optimizer and `extra` are left exactly as they were. Only then
does it copy `extra` into the caller's tensors and rewrite the optimizer state in place (a
captured CUDA graph stays valid) and the model params from the fp32 masters, so the model must be
loaded first or with the same checkpoint. A state dict that was edited on purpose loads once its
``checksums`` entry is deleted.

Checkpoints without checksums (torch's and FusedAdam's state dicts, ``distopt.sharded.v1`` with a
warning) are accepted unverified, with every other check and the all-or-nothing load.
"""

from __future__ import annotations

import json
import math
import warnings
import zlib
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException: catch it by name
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.stateful import Stateful

from ..state_dicts import (
    CHECKSUMS,
    check_saved_groups,
    check_state_checksums,
    restore_hyperparameters,
    state_checksums,
    tensor_crc32,
)
from . import atomic_replace, dcp_sharded, moment_checkpoint, sharded_files
from .atomic_replace import describe
from .buckets import BucketRuntime, flat
from .checkpoint_extra import (
    _check_extra,
    _commit,
    _extra_checksums,
    _fresh,
    _is_plain,
    _leaves,
    _map_leaves,
    _targets,
)
from .comm import Comm, raise_together
from .dcp_sharded import ShardedParamState, sharded_state_dicts  # noqa: F401 (re-exported: the public name)
from .sharded_files import SHARDED_FORMAT
from .tensor_parallel import checkpoint_group, chunk_name, layout_text, local_value, param_state

FORMAT = "distopt.per_param.v1"
STATE_KEYS = ("param", "exp_avg", "exp_avg_sq")

# A source of saved values: (param index in param_groups, state key, first element in memory order,
# count) -> a 1-D fp32 CPU tensor, or None where the checkpoint holds nothing for that param.
Source = Callable[[int, str, int, int], Tensor | None]


class ShardedOptimizer(Protocol):
    """All that checkpoints use of DistributedFusedAdam (the 'checkpoints' section of its class)."""

    param_groups: list[dict[str, Any]]
    comm: Comm
    step_count: int

    def checkpoint_params(self) -> list[Tensor]: ...

    def checkpoint_tensors(self) -> list[Tensor]: ...

    def checkpoint_indices(self) -> list[int]: ...

    def shard_buckets(self, build: bool = True) -> list[BucketRuntime]: ...

    def publish_params(self) -> None: ...

    def zero_grad(self, set_to_none: bool = True) -> None: ...


def _groups_out(opt: ShardedOptimizer) -> list[dict[str, Any]]:
    out, start = [], 0
    for g in opt.param_groups:
        entry = {k: v for k, v in g.items() if k != "params"}
        entry["lr"] = float(g["lr"])
        entry["params"] = list(range(start, start + len(g["params"])))
        start += len(g["params"])
        out.append(entry)
    return out


# ---------------------------------------------------------------------- full state dict


def state_dict(opt: ShardedOptimizer, gather_on_rank0: bool = False, sharded: bool | None = None
               ) -> dict[str, Any] | None:
    """The per-param form, on every rank (or on rank 0 only: other ranks return None). Before the
    bucket layout is built it is the state a fresh optimizer starts from (step 0, zero moments, the
    params as masters), so that it can serve as the template torch.distributed.checkpoint loads into.
    `sharded` (default: whether `opt` is inside ``sharded_state_dicts``): this rank's shard instead,
    gathering nothing (dcp_sharded.py)."""
    if sharded is None:
        sharded = dcp_sharded.active(opt)
    if sharded:
        if gather_on_rank0:
            raise ValueError("state_dict(gather_on_rank0=True) gathers the whole state on rank 0; the sharded form "
                             "(sharded=True, or inside sharded_state_dicts) gathers nothing: choose one")
        return {"state": dcp_sharded.sharded_state(opt), "param_groups": _groups_out(opt)}
    keep = not gather_on_rank0 or dist.get_rank(opt.comm.process_group) == 0
    buckets = opt.shard_buckets(build=False)
    params = opt.checkpoint_tensors()  # a DTensor param's local tensor: its state is made whole below
    # One state key of one bucket at a time is gathered, and each piece goes straight into its
    # param-shaped tensor (in the param's memory order): besides the result (the whole state, on the
    # CPU), the extra memory is one bucket of fp32 (and its CPU copy; plus one shard for masters that
    # are not stored).
    out = [{key: torch.zeros_like(p, dtype=torch.float32, device="cpu", memory_format=torch.preserve_format)
            for key in STATE_KEYS} for p in params] if keep else []
    for b in buckets:
        gathered = torch.empty(b.spec.numel, dtype=torch.float32, device=b.device)
        for key in moment_checkpoint.fp32_keys(opt, STATE_KEYS):  # low-precision moments: gather_moments
            # (an offloaded shard is on the host: the collective takes it on the device)
            opt.comm.all_gather(gathered, _local_shard(b, key, params).to(b.device), b.index, f"{key} for state_dict()"
                                ).wait()
            whole = gathered.cpu() if keep else None
            for piece in b.spec.pieces if keep else ():
                dst = flat(out[piece.param][key])[piece.param_offset : piece.param_offset + piece.numel]
                dst.copy_(whole[piece.bucket_offset : piece.bucket_offset + piece.numel])
        del gathered, whole
    moment_checkpoint.gather_moments(opt, out, keep)
    if not keep:
        return None
    if not buckets:
        for entry, p in zip(out, params):
            entry["param"].copy_(p.detach())
    step = float(opt.step_count)
    state = {g: {"step": torch.tensor(step), **{k: param_state(p, t) for k, t in out[i].items()}}
             for i, (g, p) in enumerate(zip(opt.checkpoint_indices(), opt.checkpoint_params()))}
    return {"state": state, "param_groups": _groups_out(opt), "format": FORMAT, CHECKSUMS: state_checksums(state)}


def _local_shard(b: BucketRuntime, key: str, params: list[Tensor]) -> Tensor:
    """This rank's shard of one state key of bucket `b` (fp32, ``shard_numel``; padding zero where
    it is assembled here). Only the masters of buckets without stored ones are a new tensor."""
    if key != "param":
        return getattr(b.state, key)
    if b.state.master is not None:
        return b.state.master
    shard = torch.zeros(b.spec.shard_numel, dtype=torch.float32, device=b.device)
    for f in b.fragments:
        shard[f.shard_offset : f.shard_offset + f.numel] = b.fragment_master(f, params)
    return shard


def load_state_dict(opt: ShardedOptimizer, sd: dict[str, Any]) -> None:
    """Loads the per-param form, or a torch.optim.AdamW/Adam or FusedAdam state dict. State keys name
    params as the saved param_groups list them, by position (torch.optim) or by name (the FQNs of
    torch.distributed.checkpoint's ``get_state_dict``), matched in order with this optimizer's."""
    sd, exact, seeds = moment_checkpoint.split(opt, sd)  # low-precision moments as fp32, their bits aside
    fmt = sd.get("format") if isinstance(sd, dict) else None
    if not isinstance(sd, dict) or fmt not in (FORMAT, None) or not isinstance(sd.get("state"), dict) \
            or "param_groups" not in sd:
        raise ValueError(f"not an optimizer state dict this optimizer can load (format {fmt!r}; expected "
                         f"{FORMAT!r} or a torch.optim state dict with 'state' and 'param_groups')")
    check_saved_groups(opt.param_groups, sd["param_groups"])
    params, tensors = opt.checkpoint_params(), opt.checkpoint_tensors()
    by_global = {g: (params[i], tensors[i]) for i, g in enumerate(opt.checkpoint_indices())}
    positions = _saved_positions(sd["param_groups"])
    per_param: dict[int, dict[str, Tensor]] = {}
    steps = set()
    for key, entry in sd["state"].items():
        g = _position_of(key, positions)
        if g is None:
            raise ValueError(f"state for param {key!r}, which the state dict's param_groups do not list (state "
                             "keys must be the param positions or names listed there)")
        if g not in by_global:
            raise ValueError(f"state for param {key!r}, which is not a trainable param of this optimizer")
        missing = [k for k in ("step", "exp_avg", "exp_avg_sq") if not isinstance(entry, dict) or k not in entry]
        if missing:
            raise ValueError(f"state of param {key!r} lacks {missing}")
        p = by_global[g][0]
        per_param[g] = {}
        for k in STATE_KEYS:
            if k in entry:
                t = entry[k]
                if not isinstance(t, Tensor) or not t.is_floating_point():
                    raise ValueError(f"state {k!r} of param {key!r} is not a floating-point tensor")
                if tuple(t.shape) != tuple(p.shape):
                    raise ValueError(f"state {k!r} of param {key!r} has shape {tuple(t.shape)}, "
                                     f"the param {tuple(p.shape)}")
                per_param[g][k] = t if isinstance(t, ShardedParamState) else local_value(p, t, f"state {k!r}")
        steps.add(_step_of(entry["step"], key))
    if CHECKSUMS in sd:  # absent in torch's and FusedAdam's state dicts: nothing to verify there
        check_state_checksums(sd["state"], sd[CHECKSUMS])
    dcp_sharded.check_covers(opt, per_param)  # this rank's part of a sharded state dict, if it is one
    if len(steps) > 1:
        warnings.warn(f"params were saved at different steps {sorted(steps)}; resuming at {max(steps)} "
                      "(this optimizer steps all params together)", stacklevel=3)

    in_memory_order: dict[tuple[int, str], Tensor] = {}  # each saved tensor laid out like its param, once

    def source(g: int, key: str, offset: int, numel: int) -> Tensor | None:
        t = per_param.get(g, {}).get(key)
        if t is None:
            return None
        if isinstance(t, ShardedParamState):  # this rank's elements, checked by check_covers
            return t.values(offset, numel)
        if (g, key) not in in_memory_order:
            like = torch.empty_like(by_global[g][1], dtype=torch.float32, device="cpu")  # a DTensor's local chunk
            in_memory_order[g, key] = flat(like.copy_(t))
        return in_memory_order[g, key][offset : offset + numel]

    _apply(opt, source, max(steps, default=0), sd["param_groups"])
    moment_checkpoint.restore(opt, exact, lambda key: _position_of(key, positions), seeds)


def _saved_positions(saved_groups: list[dict[str, Any]]) -> dict[Any, int]:
    """Each key the saved param groups list -> its position (torch.optim's order of params)."""
    keys = [k for group in saved_groups for k in group["params"]]
    try:
        positions = {k: i for i, k in enumerate(keys)}
    except TypeError as exc:  # an unhashable entry
        raise ValueError(f"the saved param_groups list something that is not a param key ({exc})") from None
    if len(positions) != len(keys):
        raise ValueError("the saved param_groups list a param key more than once")
    return positions


def _position_of(key: Any, positions: dict[Any, int]) -> int | None:
    try:
        if key in positions:
            return positions[key]
    except TypeError:
        return None
    if isinstance(key, str) and key.isdigit():  # a position as text (e.g. through JSON)
        return positions.get(int(key))
    return None


def _step_of(value: Any, g: Any) -> int:
    try:
        step = float(value)
    except (TypeError, ValueError, RuntimeError) as exc:  # e.g. a tensor of several elements
        raise ValueError(f"the step of param {g} is not a number ({exc})") from exc
    if not math.isfinite(step) or step < 0 or step != int(step):
        raise ValueError(f"the step of param {g} is {step}, not a count of steps")
    return int(step)


def _apply(opt: ShardedOptimizer, source: Source, step: int, saved_groups: list[dict[str, Any]]) -> None:
    """Rewrites the shards (in place), the model params (from the masters) and the hyperparameters."""
    buckets = opt.shard_buckets()
    opt.zero_grad()
    index, params = opt.checkpoint_indices(), opt.checkpoint_tensors()
    for b in buckets:
        # Copies: padding stays as it is, and params without a saved master keep theirs.
        new = dict(zip(STATE_KEYS, (t.clone() for t in b.read_state(params))))
        for f in b.fragments:
            dst = slice(f.shard_offset, f.shard_offset + f.numel)
            for key, target in new.items():
                values = source(index[f.param], key, f.param_offset, f.numel)
                if values is not None:
                    target[dst].copy_(values)
                elif key != "param":
                    target[dst].zero_()
        b.write_state(*new.values())
    opt.publish_params()
    opt.step_count = step
    restore_hyperparameters(opt.param_groups, saved_groups)


# ---------------------------------------------------------------------- torch.distributed.checkpoint


def sharded_state_dict(opt: ShardedOptimizer) -> dict[str, Any]:
    """This rank's part of the checkpoint for torch.distributed.checkpoint: each owned range of each
    param's state under ``state.<param>.<key>.<first element>`` and its CRC-32 under ``checksum.<param>...``
    (<param>: tensor_parallel.chunk_name; the keys: sharded_files.py), plus what every rank shares (``meta``)."""
    buckets = opt.shard_buckets()
    index, params, tensors = opt.checkpoint_indices(), opt.checkpoint_params(), opt.checkpoint_tensors()
    names = [chunk_name(g, p) for g, p in zip(index, params)]
    out: dict[str, Any] = {}
    for b in buckets:
        for f in b.fragments:
            # Views of the live state where it holds the values (dcp.save is synchronous), no copies:
            # only the masters of 16-bit params without stored ones are computed here. CPU views go
            # through exact storages, which dcp's file writer does not clone (dcp_sharded.exact_storage);
            # it copies GPU tensors to the CPU, keeping the copies until the rank's file is closed.
            for key, (first, values) in dcp_sharded.fragment_pieces(b, f, tensors).items():
                name = f"{names[f.param]}.{key}.{first}"
                out[f"state.{name}"] = t = dcp_sharded.exact_storage(values.detach())
                out[f"checksum.{name}"] = torch.tensor([tensor_crc32(t)], dtype=torch.int64)
    # One leaf (JSON text): torch.distributed.checkpoint would otherwise flatten the nested structure.
    body = json.dumps({
        "step": opt.step_count,
        "param_groups": _groups_out(opt),
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
    targets = _targets(extra)
    optim = sharded_state_dict(opt)

    def write(tmp: str) -> None:  # its collectives' failures (a rank died) are the save's: named by replace_dir
        optim["extra_checksum"] = _extra_checksums(targets, group)
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
    targets = _targets(extra)
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
    meta, verified = sharded_files.parse_meta(meta_holder["optim"]["meta"], checkpoint_id)
    check_saved_groups(opt.param_groups, meta["param_groups"])
    saved = sharded_files.saved_fragments(md)
    sharded_files.check_coverage(opt, checkpoint_id, meta, saved, md if verified else None)
    _check_extra(targets, md, checkpoint_id)

    # Read everything into fresh tensors: dcp.load writes in place, and may fail halfway.
    needed: dict[str, Any] = sharded_files.requests(opt, saved, md, verified)
    sums: dict[str, Tensor] = {}
    for fqn, value in _leaves(targets) if verified else ():
        entry = md.state_dict_metadata.get(f"optim.extra_checksum.{fqn}")
        if _is_plain(value) and isinstance(entry, TensorStorageMetadata):
            sums[fqn] = torch.empty(entry.size, dtype=torch.int64)
    if sums:
        needed["extra_checksum"] = sums
    fresh = _map_leaves(targets, lambda fqn, value: _fresh(value, md.state_dict_metadata[fqn]))
    request = {"optim": needed, **fresh}
    try:
        dcp.load(request, checkpoint_id=checkpoint_id, process_group=group)
    except CheckpointException as exc:  # e.g. a missing, truncated or garbled data file; nothing has changed
        why = describe(exc)
        raise ValueError(f"{checkpoint_id}: the checkpoint's data cannot be read; nothing was loaded ({why})") from exc
    fresh = {k: request[k] for k in fresh}  # dcp.load replaces non-tensor leaves at the top in `request`

    bad = [f"optim.{k}" for k, t in needed.items() if k.startswith("state.") and verified
           and tensor_crc32(t) != int(needed["checksum." + k[len("state."):]][0])]
    bad += [fqn for fqn, t in _leaves(fresh) if fqn in sums and tensor_crc32(t) not in sums[fqn].tolist()]
    mismatch = f"{len(bad)} saved tensor(s) do not match their checksums ({', '.join(bad[:4])})" if bad else None
    raise_together(group, mismatch, f"{checkpoint_id}: the checkpoint is corrupted; nothing was loaded")

    optim = sharded_files.as_state_dict(opt, needed, saved, meta)  # the sharded form, which load_state_dict takes

    # Commit: the caller's `extra` (as dcp.load would have), then the optimizer.
    with torch.no_grad():
        _commit(targets, fresh)
    for k, v in extra.items():
        if isinstance(v, Stateful):
            v.load_state_dict(targets[k])
        elif targets[k] is not v:  # a non-tensor leaf at the top, replaced as dcp.load replaces it
            extra[k] = targets[k]

    load_state_dict(opt, optim)  # (checked above: formats and coverage; it converts and applies)
