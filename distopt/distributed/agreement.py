"""Checks that every rank built DistributedFusedAdam the same way, before the bucket layout is built.

The layout is planned on each rank from its own params, and rank 0's packing order is broadcast as
indices into every rank's param list; the collectives then assume identical buckets everywhere. A rank
with another param order, another model or other options would diverge silently or abort gloo with a
size mismatch. ``check(runtime, param_groups, options)`` compares a fingerprint of everything that
shapes the collectives or the update across the ranks, once per layout, and makes every rank raise the
same ValueError naming the first difference.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .comm import Comm
from .runtime import ShardRuntime
from .tensor_parallel import layout_text

Entry = tuple[str, str]

# The constructor options that shape the buckets, the collectives or the update.
OPTIONS = ("grad_sync_dtype", "param_sync_dtype", "average_grad_sync", "overlap_grad_sync", "overlap_param_sync",
           "bucket_cap_mb", "pipeline_size", "contiguous_grad_buffer", "contiguous_param_buffer", "store_params",
           "store_param_remainders", "capturable", "exp_avg_dtype", "exp_avg_sq_dtype", "stochastic_rounding")

# Group keys with a fixed place and normal form in the fingerprint; any other key follows, sorted.
_HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay", "adam_w_mode")

_ADVICE = ("Construct DistributedFusedAdam identically on every rank: pass the same model (in the same memory "
           "format) and the same param groups, in the same order, with the same hyperparameters and options.")

_DIGEST_WORDS = 4  # a sha256 digest as four int64 words


def _describe(value: Any) -> str:
    """A rank-independent text for `value`: never an object's address, a GPU tensor read once."""
    if isinstance(value, Tensor):
        if value.numel() == 1:
            return repr(value.item())
        return f"tensor of shape {tuple(value.shape)} and dtype {value.dtype}"
    if isinstance(value, list):
        return "[" + ", ".join(_describe(v) for v in value) + "]"
    if isinstance(value, tuple):  # as Python writes it: (4, 6), (4,), ()
        return "(" + ", ".join(_describe(v) for v in value) + ("," if len(value) == 1 else "") + ")"
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype)):
        return repr(value) if isinstance(value, str) else str(value)
    return f"<{type(value).__qualname__}>"  # its repr may hold an address, which differs by rank


def _float(value: Any) -> str:
    """Numbers in one form, so lr=1 and lr=1.0 (or a float32 tensor lr) compare by value."""
    return repr(value.item() if isinstance(value, Tensor) else float(value))


def fingerprint(rt: ShardRuntime, param_groups: list[dict[str, Any]], options: dict[str, Any]) -> list[Entry]:
    """(description, value) entries for what must agree across ranks: group sizes, the constructor
    `options` (``OPTIONS``: name -> value), each param group's hyperparameters and size, each trainable
    param's shape, dtype, strides and sync dtypes, and a DTensor param's layout and local shape (its
    tensor-parallel rank's part, which the buckets hold)."""
    comm = rt.comm
    mp = rt.model_parallel_group
    entries: list[Entry] = [
        ("data-parallel group size", str(dist.get_world_size(comm.process_group))),
        ("shard group size", str(comm.dist_size)),
        ("redundant group size", str(comm.redundant_size)),
        ("model-parallel group size", str(dist.get_world_size(mp) if mp is not None else 1)),
    ]
    for name in OPTIONS:
        value = options[name]
        entries.append((f"option {name}", _float(value) if name == "bucket_cap_mb" else _describe(value)))

    for gi, group in enumerate(param_groups):
        where = f"param group {gi}"
        entries += [
            (f"{where} lr", _float(group["lr"])),  # a capturable lr is a GPU tensor: one .item() per layout
            (f"{where} betas", "(" + ", ".join(_float(b) for b in group["betas"]) + ")"),
            (f"{where} eps", _float(group["eps"])),
            (f"{where} weight_decay", _float(group["weight_decay"])),
            (f"{where} adam_w_mode", str(bool(group["adam_w_mode"]))),
        ]
        for key in sorted(k for k in group if k != "params" and k not in _HYPERPARAMETERS):
            entries.append((f"{where} {key}", _describe(group[key])))
        entries.append((f"{where} trainable params", str(sum(p in rt.index for p in group["params"]))))

    # rt.params order (param-group order, trainable only), named as the user finds them in param_groups.
    for gi, group in enumerate(param_groups):
        for j, p in enumerate(group["params"]):
            if p not in rt.index:
                continue  # frozen at construction: not synchronised, so it may differ
            where = f"param {rt.index[p]} (group {gi}, index {j})"
            entries += [
                (f"{where} shape", _describe(tuple(p.shape))),
                (f"{where} dtype", str(p.dtype)),
                (f"{where} strides", _describe(p.stride())),
                (f"{where} requires_grad", str(p.requires_grad)),
                (f"{where} grad sync dtype", str(rt.grad_dtype(p))),
                (f"{where} param sync dtype", str(rt.param_dtype(p))),
            ]
            layout = layout_text(p)
            if layout is not None:
                t = rt.tensors[rt.index[p]]
                entries += [(f"{where} layout", layout), (f"{where} local shape", _describe(tuple(t.shape))),
                            (f"{where} local strides", _describe(t.stride()))]
    return entries


def check_ranks_agree(entries: list[Entry], group: dist.ProcessGroup | None, device: torch.device) -> None:
    """Returns quietly when every rank of `group` has the same `entries`; otherwise every rank raises the
    same ValueError naming the first differing entry and each rank's value.

    Cost: one all-gather of a fixed-size digest (sha256 of the entries, plus their encoded length) per
    call, which is all that agreeing ranks pay; all_gather_object would pickle and move every entry and
    take two collectives (sizes, then data) even then. Only when the digests differ does a second
    all-gather bring every rank's entries to every rank, which all then build the message from the same
    data, so its text is identical everywhere. Tensors live on `device` (CPU for gloo, CUDA for NCCL).
    """
    group = group or dist.group.WORLD
    size = dist.get_world_size(group)
    payload = json.dumps(entries).encode()  # JSON, not pickle: nothing from a peer gets executed
    digest = hashlib.sha256(payload).digest()
    words = [int.from_bytes(digest[8 * i : 8 * i + 8], "little", signed=True) for i in range(_DIGEST_WORDS)]
    mine = torch.tensor([*words, len(payload)], dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(gathered, mine, group=group)
    rows = [t.tolist() for t in gathered]
    if all(row == rows[0] for row in rows):
        return

    # Ranks differ: fetch everyone's entries (padded to the longest) and describe the first difference.
    longest = max(row[_DIGEST_WORDS] for row in rows)
    buffer = torch.zeros(longest, dtype=torch.uint8, device=device)
    buffer[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
    buffers = [torch.empty_like(buffer) for _ in range(size)]
    dist.all_gather(buffers, buffer, group=group)
    by_rank = [json.loads(b[: row[_DIGEST_WORDS]].cpu().numpy().tobytes().decode()) for b, row in zip(buffers, rows)]
    ranks = [dist.get_global_rank(group, r) for r in range(size)]
    raise ValueError(_disagreement(by_rank, ranks))


def _disagreement(by_rank: list[list[list[str]]], ranks: list[int]) -> str:
    """The error text for the first entry where the ranks' lists differ (JSON makes the pairs lists)."""
    missing = ["(no such entry)", "(none)"]
    for index in range(max(len(entries) for entries in by_rank)):
        at = [tuple(entries[index]) if index < len(entries) else tuple(missing) for entries in by_rank]
        if all(a == at[0] for a in at):
            continue
        descriptions = {d for d, _ in at if d != missing[0]}
        if len(descriptions) == 1:  # the usual case: one entry, different values
            what = descriptions.pop()
            detail = _by_value([v for _, v in at], ranks)
        else:  # the lists went out of step (e.g. a group key only some ranks have): show each rank's entry
            what = f"entry {index}"
            detail = _by_value([f"{d} = {v}" for d, v in at], ranks)
        return f"DistributedFusedAdam: the ranks disagree on {what}: {detail}. {_ADVICE}"
    # Equal entries behind different digests: only a hash collision or corrupted data gets here.
    return f"DistributedFusedAdam: the ranks' fingerprints differ but no entry does. {_ADVICE}"


def _by_value(values: list[str], ranks: list[int]) -> str:
    """'rank 0 has A, ranks 1, 2 have B': ranks grouped by value, in order of the lowest rank."""
    holders: dict[str, list[int]] = {}
    for value, rank in zip(values, ranks):
        holders.setdefault(value, []).append(rank)
    parts = []
    for value, who in sorted(holders.items(), key=lambda item: min(item[1])):
        names = ", ".join(str(r) for r in who)
        parts.append(f"rank {names} has {value}" if len(who) == 1 else f"ranks {names} have {value}")
    return ", ".join(parts)


def check(rt: ShardRuntime, param_groups: list[dict[str, Any]], options: dict[str, Any]) -> None:
    """check_ranks_agree(fingerprint(...)) over the optimizer's data-parallel group, on its device."""
    check_ranks_agree(fingerprint(rt, param_groups, options), rt.comm.process_group, rt.device)


def check_iteration(comm: Comm, device: torch.device, dropped: bool) -> None:
    """Counts the ranks that dropped this iteration's gradients (zero_grad() after an exception in
    backward, or without a step); if some but not all did, every rank raises the same error instead
    of pairing the collectives of different iterations (see grad_sync.py)."""
    n = comm.count_ranks(dropped, device)
    if 0 < n < comm.data_parallel_size:
        raise RuntimeError(
            f"DistributedFusedAdam: {n} of {comm.data_parallel_size} ranks dropped this iteration's gradients "
            "(zero_grad() after an exception in backward, or without step()) while the others synchronised them "
            "for a step: the ranks are no longer in step. Restart from a checkpoint (as with DDP), and make every "
            "rank skip an iteration together.")
