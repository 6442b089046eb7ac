"""The per-param state dict of DistributedFusedAdam (``opt.state_dict()`` / ``opt.load_state_dict()``).

``state_dict`` gathers every param's whole state (fp32 ``param``, ``exp_avg``, ``exp_avg_sq`` shaped
like the param, on the CPU; low-precision moments in their format: moments.py) bucket by bucket, or
hands back this rank's shard inside ``sharded_state_dicts`` (dcp_state.py). ``load_state_dict`` takes
either form, or torch.optim.AdamW's, keyed by position or by name; it checks everything, then rewrites
the shards in place (``_apply``). See the package docstring for the formats and the guarantees.
"""
from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ...state_dicts import (
    CHECKSUMS,
    check_saved_groups,
    check_state_checksums,
    restore_hyperparameters,
    state_checksums,
)
from ..buckets import BucketRuntime, flat
from . import dcp_state, moments
from .dcp_state import ShardedParamState
from .placement import local_value, param_state
from .protocol import ShardedOptimizer

FORMAT = "distopt.per_param.v1"
STATE_KEYS = ("param", "exp_avg", "exp_avg_sq")

# A source of saved values: (param index in param_groups, state key, first element in memory order,
# count) -> a 1-D fp32 CPU tensor, or None where the checkpoint holds nothing for that param.
Source = Callable[[int, str, int, int], Tensor | None]


def groups_out(opt: ShardedOptimizer) -> list[dict[str, Any]]:
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
    gathering nothing (dcp_state.py)."""
    if sharded is None:
        sharded = dcp_state.active(opt)
    if sharded:
        if gather_on_rank0:
            raise ValueError("state_dict(gather_on_rank0=True) gathers the whole state on rank 0; the sharded form "
                             "(sharded=True, or inside sharded_state_dicts) gathers nothing: choose one")
        return {"state": dcp_state.sharded_state(opt), "param_groups": groups_out(opt)}
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
        for key in moments.fp32_keys(opt, STATE_KEYS):  # low-precision moments: gather_moments
            # (an offloaded shard is on the host: the collective takes it on the device)
            opt.comm.all_gather(gathered, _local_shard(b, key, params).to(b.device), b.index, f"{key} for state_dict()"
                                ).wait()
            whole = gathered.cpu() if keep else None
            for piece in b.spec.pieces if keep else ():
                dst = flat(out[piece.param][key])[piece.param_offset : piece.param_offset + piece.numel]
                dst.copy_(whole[piece.bucket_offset : piece.bucket_offset + piece.numel])
        del gathered, whole
    moments.gather_moments(opt, out, keep)
    if not keep:
        return None
    if not buckets:
        for entry, p in zip(out, params):
            entry["param"].copy_(p.detach())
    step = float(opt.step_count)
    state = {g: {"step": torch.tensor(step), **{k: param_state(p, t) for k, t in out[i].items()}}
             for i, (g, p) in enumerate(zip(opt.checkpoint_indices(), opt.checkpoint_params()))}
    return {"state": state, "param_groups": groups_out(opt), "format": FORMAT, CHECKSUMS: state_checksums(state)}


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
    sd, exact, seeds = moments.split(opt, sd)  # low-precision moments as fp32, their bits aside
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
    dcp_state.check_covers(opt, per_param)  # this rank's part of a sharded state dict, if it is one
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
    moments.restore(opt, exact, lambda key: _position_of(key, positions), seeds)


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
