"""DistributedFusedAdam checkpoints that resume under any world size, bucket size or init order.

Two forms, both keyed by a param's position in ``param_groups`` (torch's convention):

* ``state_dict()``: per param, the fp32 master ``param``, ``exp_avg`` and ``exp_avg_sq`` in the
  param's logical shape (on the CPU), and ``step``; plus ``param_groups``. It is torch.optim.AdamW's
  format with one more key (``param``), so it loads into AdamW and FusedAdam, and theirs load here.
  It is assembled bucket by bucket (one all-gather of the bucket's shards at a time), so the extra
  device memory stays near one bucket.
* ``save(opt, path)`` / ``load(opt, path)``: sharded through ``torch.distributed.checkpoint``: each
  rank writes only the contiguous ranges of each param it owns, in the param's memory order; on
  load each rank reads just the saved ranges that overlap its new ones.

Loading checks everything first (format, param count, shapes, coverage) and changes nothing on a
mismatch. It then rewrites the optimizer state in place (a captured CUDA graph stays valid) and the
model params from the fp32 masters, so the model must be loaded first or with the same checkpoint.
"""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException: catch it by name

from .._state_dicts import check_saved_groups, restore_hyperparameters
from ..reference import join_bf16_remainder, split_bf16_remainder
from .buckets import BucketRuntime, flat

if TYPE_CHECKING:
    from .optimizer import DistributedFusedAdam

FORMAT = "distopt.per_param.v1"
SHARDED_FORMAT = "distopt.sharded.v1"
STATE_KEYS = ("param", "exp_avg", "exp_avg_sq")
_FRAGMENT_KEY = re.compile(r"^optim\.state\.(\d+)\.(param|exp_avg|exp_avg_sq)\.(\d+)$")

# A source of saved values: (param index in param_groups, state key, first element in memory order,
# count) -> a 1-D fp32 CPU tensor, or None where the checkpoint holds nothing for that param.
Source = Callable[[int, str, int, int], Tensor | None]


def global_indices(opt: DistributedFusedAdam) -> list[int]:
    """The param_groups position (torch's state-dict index) of each trainable param."""
    positions = {p: i for i, p in enumerate(p for g in opt.param_groups for p in g["params"])}
    return [positions[p] for p in opt._params]


def _groups_out(opt: DistributedFusedAdam) -> list[dict[str, Any]]:
    out, start = [], 0
    for g in opt.param_groups:
        entry = {k: v for k, v in g.items() if k != "params"}
        entry["lr"] = float(g["lr"])
        entry["params"] = list(range(start, start + len(g["params"])))
        start += len(g["params"])
        out.append(entry)
    return out


def _step(opt: DistributedFusedAdam) -> int:
    return int(opt._step_tensor.item()) if opt.capturable else opt._step_count


def _local_masters(b: BucketRuntime, params: list[Tensor]) -> Tensor:
    """This rank's fp32 master values of bucket `b` (from the masters, remainders or params)."""
    s = b.state
    if s.master is not None:
        return s.master
    if not b.contiguous_param:
        b.gather_in(params)
    local = b.param_buffer[b.lo : b.hi]
    return join_bf16_remainder(local, s.remainders) if s.remainders is not None else local.float()


# ---------------------------------------------------------------------- full state dict


def state_dict(opt: DistributedFusedAdam, gather_on_rank0: bool = False) -> dict[str, Any] | None:
    """The per-param form, on every rank (or on rank 0 only: other ranks return None)."""
    opt.param_sync()
    keep = not gather_on_rank0 or dist.get_rank(opt.comm.process_group) == 0
    state: dict[int, dict[str, Tensor]] = {}
    if opt._layout is not None:
        flat_state = {i: {k: torch.empty(p.numel(), dtype=torch.float32) for k in STATE_KEYS}
                      for i, p in enumerate(opt._params)} if keep else {}
        for b in opt._buckets:
            local = torch.stack([_local_masters(b, opt._params), b.state.exp_avg, b.state.exp_avg_sq])
            gathered = torch.empty(opt.comm.dist_size * local.numel(), dtype=torch.float32, device=opt.device)
            opt.comm.all_gather(gathered, local.reshape(-1), b.index).wait()
            if not keep:
                continue
            whole = gathered.view(opt.comm.dist_size, 3, -1).transpose(0, 1).reshape(3, -1).cpu()
            for piece in b.spec.pieces:
                for k, key in enumerate(STATE_KEYS):
                    dst = flat_state[piece.param][key][piece.param_offset : piece.param_offset + piece.numel]
                    dst.copy_(whole[k, piece.bucket_offset : piece.bucket_offset + piece.numel])
        step = torch.tensor(float(_step(opt)))
        for i, g in enumerate(global_indices(opt)):
            if keep:
                p = opt._params[i]
                entry = {}
                for key, values in flat_state[i].items():  # memory order -> a tensor of the param's shape
                    t = torch.empty_strided(p.shape, p.stride(), dtype=torch.float32)
                    flat(t).copy_(values)
                    entry[key] = t
                state[g] = {"step": step.clone(), **entry}
    return {"state": state, "param_groups": _groups_out(opt), "format": FORMAT} if keep else None


def load_state_dict(opt: DistributedFusedAdam, sd: dict[str, Any]) -> None:
    """Loads the per-param form, or a torch.optim.AdamW/Adam or FusedAdam state dict."""
    fmt = sd.get("format") if isinstance(sd, dict) else None
    if not isinstance(sd, dict) or fmt not in (FORMAT, None) or "state" not in sd or "param_groups" not in sd:
        raise ValueError(f"not an optimizer state dict this optimizer can load (format {fmt!r}; expected "
                         f"{FORMAT!r} or a torch.optim state dict with 'state' and 'param_groups')")
    check_saved_groups(opt.param_groups, sd["param_groups"])
    index = global_indices(opt)
    by_global = {g: opt._params[i] for i, g in enumerate(index)}
    per_param: dict[int, dict[str, Tensor]] = {}
    steps = set()
    for key, entry in sd["state"].items():
        g = int(key)
        if g not in by_global:
            raise ValueError(f"state for param {g}, which is not a trainable param of this optimizer")
        p = by_global[g]
        missing = [k for k in ("step", "exp_avg", "exp_avg_sq") if k not in entry]
        if missing:
            raise ValueError(f"state of param {g} lacks {missing}")
        per_param[g] = {}
        for k in STATE_KEYS:
            if k in entry:
                if tuple(entry[k].shape) != tuple(p.shape):
                    raise ValueError(f"state {k!r} of param {g} has shape {tuple(entry[k].shape)}, "
                                     f"the param {tuple(p.shape)}")
                per_param[g][k] = entry[k]
        steps.add(int(float(entry["step"])))
    if len(steps) > 1:
        warnings.warn(f"params were saved at different steps {sorted(steps)}; resuming at {max(steps)} "
                      "(this optimizer steps all params together)", stacklevel=3)

    in_memory_order: dict[tuple[int, str], Tensor] = {}  # each saved tensor laid out like its param, once

    def source(g: int, key: str, offset: int, numel: int) -> Tensor | None:
        t = per_param.get(g, {}).get(key)
        if t is None:
            return None
        if (g, key) not in in_memory_order:
            in_memory_order[g, key] = flat(torch.empty_like(by_global[g], dtype=torch.float32, device="cpu").copy_(t))
        return in_memory_order[g, key][offset : offset + numel]

    _apply(opt, source, max(steps, default=0), sd["param_groups"])


def _apply(opt: DistributedFusedAdam, source: Source, step: int, saved_groups: list[dict[str, Any]]) -> None:
    """Rewrites the shards (in place), the model params (from the masters) and the hyperparameters."""
    if opt._layout is None:
        opt.init_params()
    opt.param_sync()
    opt.zero_grad()
    index = global_indices(opt)
    for b in opt._buckets:
        s = b.state
        masters = _local_masters(b, opt._params).clone()  # params without a saved master keep theirs
        for f in b.fragments:
            dst = slice(f.shard_offset, f.shard_offset + f.numel)
            for key, target in (("param", masters), ("exp_avg", s.exp_avg), ("exp_avg_sq", s.exp_avg_sq)):
                values = source(index[f.param], key, f.param_offset, f.numel)
                if values is not None:
                    target[dst].copy_(values)
                elif key != "param":
                    target[dst].zero_()
        if s.master is not None:
            s.master.copy_(masters)
        local = b.local_param_slice()
        if s.remainders is not None:
            hi, lo = split_bf16_remainder(masters)
            local.copy_(hi)
            s.remainders.copy_(lo)
        else:
            local.copy_(masters)
    opt._param_sync.after_step(None)  # writes the params (at once, or before the next forward)
    opt._step_count = step
    opt._step_tensor.fill_(float(step))
    restore_hyperparameters(opt.param_groups, saved_groups)


# ---------------------------------------------------------------------- torch.distributed.checkpoint


def sharded_state_dict(opt: DistributedFusedAdam) -> dict[str, Any]:
    """This rank's part of the checkpoint for torch.distributed.checkpoint: each owned range of each
    param's state under ``state.<param>.<key>.<first element>``, plus what every rank shares."""
    opt.param_sync()
    index = global_indices(opt)
    if opt._layout is None:
        opt.init_params()
    out: dict[str, Any] = {}
    for b in opt._buckets:
        masters = _local_masters(b, opt._params)
        for f in b.fragments:
            dst = slice(f.shard_offset, f.shard_offset + f.numel)
            for key, src in (("param", masters), ("exp_avg", b.state.exp_avg), ("exp_avg_sq", b.state.exp_avg_sq)):
                out[f"state.{index[f.param]}.{key}.{f.param_offset}"] = src[dst].detach().cpu().clone()
    # One leaf (JSON text): torch.distributed.checkpoint would otherwise flatten the nested structure.
    out["meta"] = json.dumps({
        "format": SHARDED_FORMAT,
        "step": _step(opt),
        "param_groups": _groups_out(opt),
        "params": {index[i]: [list(p.shape), list(p.stride())] for i, p in enumerate(opt._params)},
    })
    return out


def save(opt: DistributedFusedAdam, checkpoint_id: str, extra: dict[str, Any] | None = None) -> None:
    """Sharded save: every rank calls it; each writes only its own ranges (and `extra`, e.g.
    ``{"model": model.state_dict()}``, deduplicated by torch.distributed.checkpoint)."""
    dcp.save({"optim": sharded_state_dict(opt), **(extra or {})}, checkpoint_id=checkpoint_id,
             process_group=opt.comm.process_group)


def load(opt: DistributedFusedAdam, checkpoint_id: str, extra: dict[str, Any] | None = None) -> None:
    """Sharded load under any world size: each rank reads the saved ranges overlapping its own, and
    `extra` (e.g. ``{"model": model.state_dict()}``) in place, in the same read, after the checks."""
    group = opt.comm.process_group
    meta_holder: dict[str, Any] = {"optim": {"meta": ""}}
    try:
        dcp.load(meta_holder, checkpoint_id=checkpoint_id, process_group=group)
        meta = json.loads(meta_holder["optim"]["meta"])
    except (Exception, CheckpointException) as exc:  # missing key, unreadable: not our checkpoint
        raise ValueError(f"{checkpoint_id}: not a readable distopt sharded checkpoint ({exc})") from exc
    if meta.get("format") != SHARDED_FORMAT:
        raise ValueError(f"{checkpoint_id}: not a distopt sharded checkpoint (format {meta.get('format')!r})")
    check_saved_groups(opt.param_groups, meta["param_groups"])
    saved = _saved_fragments(checkpoint_id, opt)
    index = global_indices(opt)
    for i, p in enumerate(opt._params):
        shape, stride = (tuple(x) for x in meta["params"].get(str(index[i]), ((), ())))
        if shape != tuple(p.shape):
            raise ValueError(f"param {index[i]} has shape {tuple(p.shape)}, the checkpoint {shape}")
        if stride != tuple(p.stride()):
            raise ValueError(f"param {index[i]} was saved in another memory format (strides {stride}, now "
                             f"{tuple(p.stride())}): load the per-param state_dict() form instead")
        for key in STATE_KEYS:
            covered = sum(n for start, n in saved.get((index[i], key), []))
            if covered != p.numel():
                raise ValueError(f"{checkpoint_id}: {key} of param {index[i]} covers {covered} of {p.numel()} elements")

    if opt._layout is None:
        opt.init_params()
    needed: dict[str, Tensor] = {}
    for b in opt._buckets:
        for f in b.fragments:
            for key in STATE_KEYS:
                for start, n in _overlapping(saved[(index[f.param], key)], f.param_offset, f.numel):
                    needed[f"state.{index[f.param]}.{key}.{start}"] = torch.empty(n, dtype=torch.float32)
    try:
        dcp.load({"optim": needed, **(extra or {})}, checkpoint_id=checkpoint_id, process_group=group)
    except CheckpointException as exc:  # e.g. a missing data file; nothing has changed yet
        raise ValueError(f"{checkpoint_id}: the saved optimizer state cannot be read ({exc})") from exc

    def source(g: int, key: str, offset: int, numel: int) -> Tensor:
        out = torch.empty(numel, dtype=torch.float32)
        for start, n in _overlapping(saved[(g, key)], offset, numel):
            lo, hi = max(start, offset), min(start + n, offset + numel)
            out[lo - offset : hi - offset] = needed[f"state.{g}.{key}.{start}"][lo - start : hi - start]
        return out

    _apply(opt, source, int(meta["step"]), meta["param_groups"])


def _saved_fragments(checkpoint_id: str, opt: DistributedFusedAdam) -> dict[tuple[int, str], list[tuple[int, int]]]:
    """(param, key) -> [(first element, count)] of every range in the checkpoint."""
    metadata = dcp.FileSystemReader(checkpoint_id).read_metadata()
    out: dict[tuple[int, str], list[tuple[int, int]]] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        m = _FRAGMENT_KEY.match(fqn)
        if m:
            out.setdefault((int(m.group(1)), m.group(2)), []).append((int(m.group(3)), int(md.size[0])))
    return out


def _overlapping(ranges: list[tuple[int, int]], offset: int, numel: int) -> list[tuple[int, int]]:
    return [(start, n) for start, n in ranges if start < offset + numel and offset < start + n]
