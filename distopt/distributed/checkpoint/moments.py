"""Low-precision moments in DistributedFusedAdam's checkpoints (state_dict.py's hooks).

``state_dict()`` holds each moment in its format, as FusedAdam's does (distopt/fused_adam/moments.py),
shaped like the param: ``exp_avg``/``exp_avg_sq`` in bf16, or an 8-bit moment's uint8 codes under
``exp_avg_codes``/``exp_avg_sq_codes`` and its absmax scales under ``exp_avg_absmax``/
``exp_avg_sq_absmax``, one per 256 elements from the param's first element in its memory order;
``param`` stays fp32 and param groups carry the ``rounding_seed``. Since 8-bit blocks never straddle
shards (distributed/moments.py), these are the same bits at every world size and bucket size, and the two
optimizers' state dicts load into each other.
``lowprec.formats.float32_state_dict`` exports one to torch.optim.AdamW's fp32 format.

``load_state_dict`` takes low-precision or fp32 moments (torch.optim.AdamW's, or another format): all
are read as fp32 (and checked) before anything changes and stored in this optimizer's formats
(buckets.BucketRuntime.write_state quantises them); then, where a saved moment is already in the
param's format and layout, its saved bits replace the quantised ones, so a round trip is bit-exact (a
requantised 8-bit moment would not be: bitsandbytes' signed map has no -1).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ...lowprec import formats as mf
from ...lowprec.codecs import QUANT_BLOCK
from ...state_dicts import CHECKSUMS, check_state_checksums
from ..buckets import flat
from .dcp_state import ShardedParamState
from .protocol import ShardedOptimizer

LOW = (torch.bfloat16, torch.uint8)
# (param position in param_groups) -> {moment name: (saved state in the param's memory order, absmax)}
Exact = dict[int, dict[str, tuple[Tensor, Tensor | None]]]


def formats(opt: ShardedOptimizer) -> mf.MomentFormats:
    return mf.MomentFormats(opt.exp_avg_dtype, opt.exp_avg_sq_dtype, opt.stochastic_rounding)


def fp32_keys(opt: ShardedOptimizer, keys: tuple[str, ...]) -> tuple[str, ...]:
    """The state keys checkpoint.state_dict gathers in fp32: all, unless the moments are this module's."""
    return keys if formats(opt).plain else tuple(k for k in keys if k not in mf.SIGNED)


def gather_moments(opt: ShardedOptimizer, out: list[dict[str, Tensor]], keep: bool) -> None:
    """Fills each param's moments in their formats (and absmax scales) into `out` (CPU tensors shaped like
    the params; on ranks that `keep` them), one all-gather of each bucket's shard of each at a time."""
    if formats(opt).plain:
        return
    params = opt.checkpoint_tensors()
    if keep:
        for entry, p in zip(out, params):
            for name, dtype in zip(mf.SIGNED, formats(opt).dtypes(p.numel())):
                entry[name] = torch.zeros_like(p, dtype=dtype, device="cpu", memory_format=torch.preserve_format)
                if dtype == torch.uint8:
                    entry[mf.ABSMAX_KEYS[name]] = torch.zeros(mf.num_blocks(p.numel()), dtype=torch.float32)
    for b in opt.shard_buckets(build=False):
        for name in mf.SIGNED:
            for blocks, local in ((False, getattr(b.state, name)), (True, getattr(b.state, f"{name}_scales"))):
                if local is None:
                    continue
                wire = local.view(torch.uint8) if local.dtype == torch.bfloat16 else local  # gloo: no bf16, int16
                gathered = torch.empty(wire.numel() * opt.comm.dist_size, dtype=wire.dtype, device=b.device)
                opt.comm.all_gather(gathered, wire, b.index, f"{name} for state_dict()").wait()
                whole = gathered.cpu().view(local.dtype) if keep else None
                for piece in b.spec.pieces if keep else ():
                    if blocks:
                        dst = out[piece.param][mf.ABSMAX_KEYS[name]]
                        first, n, src = piece.param_offset // QUANT_BLOCK, mf.num_blocks(piece.numel), \
                            piece.bucket_offset // QUANT_BLOCK
                    else:
                        dst = flat(out[piece.param][name])
                        first, n, src = piece.param_offset, piece.numel, piece.bucket_offset
                    dst[first : first + n].copy_(whole[src : src + n])
    if keep:  # 8-bit codes under their own keys (lowprec.formats.CODES_KEYS), as FusedAdam's state dicts
        out[:] = [mf.codes_keyed(entry) for entry in out]


def split(opt: ShardedOptimizer, sd: Any) -> tuple[Any, Exact, list[int | None]]:
    """(`sd` with every low-precision moment read as fp32 and no absmax keys, the saved bits worth
    keeping, the saved rounding seeds). Checks (before anything changes): the checksums of the saved
    tensors, and that each 8-bit moment has its absmax scales. `sd` itself is not changed."""
    if not isinstance(sd, dict) or not isinstance(sd.get("state"), dict) \
            or not isinstance(sd.get("param_groups"), list):
        return sd, {}, []
    seeds = mf.saved_seeds(sd["param_groups"])
    named = {key: mf.moments_named(e) for key, e in sd["state"].items()}  # codes under the moments' keys
    lowprec = any(isinstance(e, dict) and any(isinstance(e.get(n), Tensor) and e[n].dtype in LOW for n in mf.SIGNED)
                  for e in named.values())
    if not lowprec:
        return sd, {}, seeds
    if CHECKSUMS in sd:  # they describe the saved (low-precision) tensors
        check_state_checksums(sd["state"], sd[CHECKSUMS])
    out = {k: v for k, v in sd.items() if k != CHECKSUMS}
    out["state"], exact = {}, {}
    for key, entry in named.items():
        entry = dict(entry) if isinstance(entry, dict) else entry
        for name, signed in mf.SIGNED.items() if isinstance(entry, dict) else ():
            value, scales = entry.get(name), entry.pop(mf.ABSMAX_KEYS[name], None)
            if not isinstance(value, Tensor) or value.dtype not in LOW:
                continue
            if value.dtype == torch.uint8 and not isinstance(value, ShardedParamState):
                scales = mf.saved_blocks(scales, value)  # (FusedAdam's DTensor layout too: absmax_shape)
            if value.dtype == torch.uint8 and (not isinstance(scales, Tensor)
                                               or scales.numel() != mf.num_blocks(value.numel())):
                raise ValueError(f"state {name!r} of param {key!r} is 8-bit: it needs {mf.ABSMAX_KEYS[name]!r}, "
                                 f"{mf.num_blocks(value.numel())} float32 absmax scales")
            if isinstance(value, ShardedParamState):  # this rank's ranges (a sharded state dict)
                entry[name] = value.mapped(_range_reader(value, scales, signed, f"{name!r} of param {key!r}"),
                                           torch.float32)
                kept = scales.mapped(lambda _, v: v.clone(), scales.dtype) if value.dtype == torch.uint8 else None
                exact.setdefault(key, {})[name] = (value.mapped(lambda _, v: v.clone(), value.dtype), kept)
                continue  # (copies: the ranges may be views of the shards the load rewrites)
            scales = scales.float().reshape(-1).cpu() if value.dtype == torch.uint8 else None
            entry[name] = mf.layout_to_float32(value.cpu(), scales, signed)
            exact.setdefault(key, {})[name] = (value.cpu(), scales)
        out["state"][key] = entry
    return out, exact, seeds


def _range_reader(value: ShardedParamState, scales: Any, signed: bool, what: str) -> Callable[[int, Tensor], Tensor]:
    """For ``ShardedParamState.mapped``: a range of `value` (bf16 values or 8-bit codes starting on a
    block) read as fp32 with the scales of its blocks, which `scales` must hold (a ShardedParamState)."""

    def read(first: int, values: Tensor) -> Tensor:
        blocks = None
        if values.dtype == torch.uint8:
            held = scales.values(first // QUANT_BLOCK, mf.num_blocks(values.numel())) \
                if isinstance(scales, ShardedParamState) and first % QUANT_BLOCK == 0 else None
            if held is None:
                raise ValueError(f"the sharded state {what} holds 8-bit codes from element {first} without the "
                                 "absmax scales of their blocks")
            blocks = held.float()
        return mf.to_float32(values, blocks, signed)

    return read


def restore(opt: ShardedOptimizer, exact: Exact, position_of: Callable[[Any], int | None],
            seeds: list[int | None]) -> None:
    """After the fp32 load: the saved bits of each moment saved in the format and memory layout this
    optimizer stores it in, over the quantised ones; and the saved rounding seeds."""
    formats(opt).restore_seeds(opt.param_groups, seeds)
    if not exact:
        return
    by_position = {position_of(k): v for k, v in exact.items()}
    index, params = opt.checkpoint_indices(), opt.checkpoint_tensors()
    for b in opt.shard_buckets():
        for name in mf.SIGNED:
            state, scales = getattr(b.state, name), getattr(b.state, f"{name}_scales")
            for f in b.fragments:
                saved = by_position.get(index[f.param], {}).get(name)
                p = params[f.param]
                if saved is None or saved[0].dtype != state.dtype or (
                        not isinstance(saved[0], ShardedParamState) and saved[0].stride() != p.stride()):
                    continue  # quantised from fp32 by write_state (a ShardedParamState's order: check_covers)
                values, absmax = saved
                state[f.shard_offset : f.shard_offset + f.numel].copy_(_held(values, f.param_offset, f.numel))
                if scales is not None:
                    first, n = f.param_offset // QUANT_BLOCK, mf.num_blocks(f.numel)
                    scales[f.shard_offset // QUANT_BLOCK :][:n].copy_(_held(absmax, first, n))


def _held(saved: Tensor, first: int, n: int) -> Tensor:
    """Elements [first, first + n) of a saved tensor in its memory order: a whole one's, or this rank's
    (a ShardedParamState's, which split and check_covers saw it holds)."""
    return saved.values(first, n) if isinstance(saved, ShardedParamState) else flat(saved)[first : first + n]
