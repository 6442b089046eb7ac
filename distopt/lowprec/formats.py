"""How an optimizer stores Adam's two moments: the options, the per-param rule, and fp32 conversion.

``exp_avg_dtype`` / ``exp_avg_sq_dtype`` are ``torch.float32`` (default), ``torch.bfloat16`` or
``torch.uint8`` (8-bit blockwise: uint8 codes of bitsandbytes' dynamic map, signed for exp_avg and
unsigned for exp_avg_sq, with one float32 absmax per 256 elements counted from the param's first
element; see ``codecs``). ``stochastic_rounding`` makes every rounding to bfloat16 stochastic.
FusedAdam and DistributedFusedAdam share this module: the choice per param depends only on the param's
global size, never on a shard's, so every world size stores the same bits.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from . import codecs

MOMENT_DTYPES = (torch.float32, torch.bfloat16, torch.uint8)
# Params smaller than this keep fp32 moments when 8-bit is asked for (as bitsandbytes' min_8bit_size):
# their absmax would cost more than the codes save, and they are the norms and biases 8-bit hurts most.
MIN_8BIT_NUMEL = 4096
SEED_KEY = "rounding_seed"  # the param groups' key of the stochastic-rounding seed (draw_seed)


@dataclasses.dataclass(frozen=True)
class MomentFormats:
    """The moment options of one optimizer (validated on construction: a clear error, no fallback)."""

    exp_avg_dtype: torch.dtype = torch.float32
    exp_avg_sq_dtype: torch.dtype = torch.float32
    stochastic_rounding: bool = False

    def __post_init__(self) -> None:
        for name in ("exp_avg_dtype", "exp_avg_sq_dtype"):
            dtype = getattr(self, name)
            if dtype not in MOMENT_DTYPES:
                raise ValueError(f"{name} must be one of torch.float32, torch.bfloat16, torch.uint8, got {dtype!r}")
        if not isinstance(self.stochastic_rounding, bool):
            raise TypeError(f"stochastic_rounding must be a bool, got {self.stochastic_rounding!r}")

    @property
    def plain(self) -> bool:
        """Whether this is fp32 Adam state (no format work at all)."""
        return self == MomentFormats()

    def dtypes(self, global_numel: int) -> tuple[torch.dtype, torch.dtype]:
        """(exp_avg dtype, exp_avg_sq dtype) of a param with ``global_numel`` elements."""

        def one(dtype: torch.dtype) -> torch.dtype:
            return torch.float32 if dtype == torch.uint8 and global_numel < MIN_8BIT_NUMEL else dtype

        return one(self.exp_avg_dtype), one(self.exp_avg_sq_dtype)

    def group_defaults(self) -> dict[str, int]:
        """Param-group defaults: a rounding seed (``draw_seed``) with stochastic rounding, else none."""
        return {SEED_KEY: draw_seed()} if self.stochastic_rounding else {}

    def op_arguments(self, exp_avg_scales: Sequence[Tensor], exp_avg_sq_scales: Sequence[Tensor],
                     param_ids: Sequence[int], param_offsets: Sequence[int], group: dict[str, Any]) -> dict[str, Any]:
        """``ops.adam_step_``'s moment arguments for one call (none for fp32 state): the entries' absmax
        scales and, with stochastic rounding, the group's seed and each entry's param id and element offset."""
        if self.plain:
            return {}
        out: dict[str, Any] = dict(exp_avg_scales=list(exp_avg_scales), exp_avg_sq_scales=list(exp_avg_sq_scales))
        if self.stochastic_rounding:
            out.update(rounding_seed=int(group[SEED_KEY]), param_ids=list(param_ids), param_offsets=list(param_offsets))
        return out

    def restore_seeds(self, groups: list[dict[str, Any]], seeds: list[int | None]) -> None:
        """With stochastic rounding, the saved seeds (``saved_seeds``) replace the groups' own, so a resume
        rounds on as the saved run did; without, a saved seed is dropped."""
        for group, seed in zip(groups, seeds):
            if seed is not None and self.stochastic_rounding:
                group[SEED_KEY] = seed


def num_blocks(numel: int) -> int:
    """The number of absmax scales of an 8-bit moment of ``numel`` elements."""
    return -(-numel // codecs.QUANT_BLOCK)


def absmax_shape(shape: Sequence[int]) -> tuple[int, int]:
    """The shape of the absmax scales of an 8-bit moment of a DTensor param (or a dim-0 shard of one) of
    ``shape``: one row per ``k`` dim-0 rows of the param, ``k`` the fewest rows that fill whole
    256-element blocks, so that the scales are sharded along dim 0 exactly as the param's rows are
    (``torch.chunk``'s split of the param's rows and of these rows agree whenever every shard starts on
    a block). Read flat, its first ``num_blocks(numel)`` entries are the param's blocks in order; the rest
    (where the last row covers fewer than ``k`` param rows) are zeros, never read."""
    rows = shape[0] if len(shape) else 1
    row = math.prod(shape[1:])
    if row == 0:
        return (0, 0)
    per = codecs.QUANT_BLOCK // math.gcd(row, codecs.QUANT_BLOCK)  # param rows per absmax row
    return (-(-rows // per), per * row // codecs.QUANT_BLOCK)


def block_view(scales: Tensor, codes: Tensor) -> Tensor:
    """The absmax blocks of 8-bit `codes` as the kernel takes them (one per 256 elements, 1-D): `scales`
    itself where it is exactly that, else the first blocks of its ``absmax_shape`` layout (a view)."""
    n = num_blocks(codes.numel())
    return scales if scales.dim() == 1 and scales.numel() == n else scales.view(-1)[:n]


def saved_blocks(scales: Any, codes: Tensor) -> Tensor | None:
    """A saved absmax of 8-bit `codes` (shaped like their param, or a shard of it) as 1-D blocks: the
    saved tensor flattened if it holds exactly one scale per block, or the blocks of its ``absmax_shape``
    layout (what FusedAdam keeps for DTensor params); None if it is neither (not a valid absmax)."""
    if not isinstance(scales, Tensor) or not scales.is_floating_point():
        return None
    n = num_blocks(codes.numel())
    if scales.numel() == n:
        return scales.reshape(-1)
    if tuple(scales.shape) == absmax_shape(codes.shape) and scales.numel() >= n:
        return scales.reshape(-1)[:n]
    return None


def zeros(numel: int, dtype: torch.dtype, device: torch.device, signed: bool) -> tuple[Tensor, Tensor | None]:
    """A zero moment of ``numel`` elements in ``dtype``: (values or codes, absmax scales or None)."""
    if dtype != torch.uint8:
        return torch.zeros(numel, dtype=dtype, device=device), None
    codes = torch.full((numel,), codecs.zero_code(signed), dtype=torch.uint8, device=device)
    return codes, torch.zeros(num_blocks(numel), dtype=torch.float32, device=device)


def to_float32(state: Tensor, scales: Tensor | None, signed: bool) -> Tensor:
    """The fp32 values of a stored moment (the kernel's reading of it, bit for bit)."""
    if state.dtype == torch.uint8:
        if scales is None:
            raise ValueError("an 8-bit moment needs its absmax scales")
        return codecs.dequantize_blockwise(state, scales, signed)
    return state.float()


def from_float32(values: Tensor, dtype: torch.dtype, signed: bool) -> tuple[Tensor, Tensor | None]:
    """``values`` (fp32) stored in ``dtype`` as the kernel stores them (round to nearest): (state, scales)."""
    if dtype == torch.uint8:
        return codecs.quantize_blockwise(values, signed)
    return values.to(dtype), None


def draw_seed() -> int:
    """A stochastic-rounding seed from torch's default CPU generator, so that ``torch.manual_seed`` makes
    it reproducible and optimizers built after the same seeding (FusedAdam, DistributedFusedAdam on every
    rank) round with the same bits. The optimizer keeps it in its state dict: a resume rounds as an
    uninterrupted run would. A param's rounding key is (seed, step, param id, element index), where the
    param id is the param's position in the optimizer's ``param_groups`` order (all groups, in order)
    and the element index counts from the param's first element (a shard passes its offset)."""
    return int(torch.randint(0, 2**62, (), dtype=torch.int64))


def saved_seeds(saved_groups: list[Any]) -> list[int | None]:
    """Each saved param group's rounding seed (None where it has none, e.g. torch's AdamW), checked."""
    seeds = [g.get(SEED_KEY) if isinstance(g, dict) else None for g in saved_groups]
    for seed in seeds:
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"a saved param group's {SEED_KEY!r} must be an int, got {seed!r}")
    return seeds


# ---------------------------------------------------------------------- per-param state in torch's layout
# (additions for FusedAdam: state tensors shaped like their param, in its memory format)

# The state keys of the absmax scales of an 8-bit moment, next to the moment's own key.
ABSMAX_KEYS = {"exp_avg": "exp_avg_absmax", "exp_avg_sq": "exp_avg_sq_absmax"}
SIGNED = {"exp_avg": True, "exp_avg_sq": False}  # which map each moment's codes use
# An 8-bit moment's codes in a state dict: under a key of their own, never the moment's. A loader that
# expects values under ``exp_avg`` (torch.optim.AdamW, an fp32 or bf16 optimizer, and
# torch.distributed.checkpoint, which casts whatever it reads into its template's dtype) then finds the
# key missing and says so, instead of taking the codes 0..255 for moments.
CODES_KEYS = {"exp_avg": "exp_avg_codes", "exp_avg_sq": "exp_avg_sq_codes"}


def codes_keyed(entry: Any) -> Any:
    """A per-param state (``opt.state[p]``, where 8-bit codes sit under the moment's key) as state dicts
    hold it: each 8-bit moment's codes under ``CODES_KEYS`` (a new dict; `entry` is not changed)."""
    if not isinstance(entry, dict) or not any(_is_codes(entry.get(n)) for n in CODES_KEYS):
        return entry
    return {CODES_KEYS[k] if k in CODES_KEYS and _is_codes(v) else k: v for k, v in entry.items()}


def moments_named(entry: Any) -> Any:
    """The inverse of ``codes_keyed`` for a saved per-param state (a new dict), checked: codes must be
    uint8 and not come with a moment of the same name. An entry with codes under the moment's own key
    (state dicts saved before ``CODES_KEYS``) is returned as it is."""
    if not isinstance(entry, dict) or not any(k in entry for k in CODES_KEYS.values()):
        return entry
    out = dict(entry)
    for name, key in CODES_KEYS.items():
        if key not in out:
            continue
        if name in out:
            raise ValueError(f"a saved state holds both {name!r} and {key!r}: one moment, two values")
        if not _is_codes(out[key]):
            raise ValueError(f"saved {key!r} must be a uint8 tensor of 8-bit codes, got {_describe(out[key])}")
        out[name] = out.pop(key)
    return out


def _is_codes(value: Any) -> bool:
    return isinstance(value, Tensor) and value.dtype == torch.uint8


def _describe(value: Any) -> str:
    return f"a {value.dtype} tensor" if isinstance(value, Tensor) else type(value).__name__


def _memory_flat(t: Tensor) -> Tensor:
    """A dense tensor's elements as a 1-D view in memory order (the order the kernel walks and counts
    blocks in; the logical order for a contiguous tensor)."""
    order = sorted(range(t.dim()), key=lambda d: (-t.stride(d), d))
    return t.permute(order).reshape(-1)


def layout_to_float32(state: Tensor, scales: Tensor | None, signed: bool) -> Tensor:
    """``to_float32`` of a moment shaped like its param (any dense memory format): fp32 values with the
    state's shape and strides, 8-bit blocks counted in memory order, as the kernel counts them."""
    out = torch.empty_strided(state.shape, state.stride(), dtype=torch.float32, device=state.device)
    _memory_flat(out).copy_(to_float32(_memory_flat(state), scales, signed))
    return out


def layout_from_float32(values: Tensor, like: Tensor, signed: bool) -> tuple[Tensor, Tensor | None]:
    """``from_float32`` of fp32 ``values`` into a new moment with ``like``'s dtype, shape and strides."""
    state, scales = from_float32(_memory_flat(_as_layout(values.float(), like)), like.dtype, signed)
    out = torch.empty_strided(like.shape, like.stride(), dtype=like.dtype, device=like.device)
    _memory_flat(out).copy_(state)
    return out, scales


def _as_layout(values: Tensor, like: Tensor) -> Tensor:
    """`values` (like's shape) with like's strides, so that its memory order is like's."""
    if values.stride() == like.stride():
        return values
    return torch.empty_strided(like.shape, like.stride(), dtype=values.dtype, device=values.device).copy_(values)


def float32_state_dict(state_dict: dict) -> dict:
    """A FusedAdam state dict with low-precision moments as ``torch.optim.AdamW``'s fp32 one: every
    bf16 or 8-bit moment dequantized to fp32 (its param's shape and memory format), the absmax entries
    dropped; everything else shared with ``state_dict``. Load it into ``torch.optim.AdamW``, or into
    any FusedAdam (which stores it in its own formats). The input is not changed."""
    out = dict(state_dict)
    out.pop("checksums", None)  # they describe the low-precision tensors
    out["state"] = {}
    for key, entry in state_dict["state"].items():
        entry = dict(moments_named(entry))
        for name, absmax_key in ABSMAX_KEYS.items():
            value, scales = entry.get(name), entry.pop(absmax_key, None)
            if isinstance(value, Tensor) and value.dtype in (torch.bfloat16, torch.uint8):
                entry[name] = map_local(lambda v, s, n=name: layout_to_float32(v, s, SIGNED[n]), value, scales)
        out["state"][key] = entry
    return out


def map_local(fn, value: Tensor, scales: Tensor | None) -> Tensor:
    """fn(value, scales) on a DTensor's local shards, wrapped back like `value` (plain tensors as they are)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(value, DTensor):
        return fn(value, scales.to_local() if isinstance(scales, DTensor) else scales)
    local_scales = scales.to_local() if isinstance(scales, DTensor) else scales
    return DTensor.from_local(fn(value.to_local(), local_scales), value.device_mesh, value.placements,
                              shape=value.shape, stride=value.stride(), run_check=False)
