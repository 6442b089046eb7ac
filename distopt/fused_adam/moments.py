"""FusedAdam's low-precision moments: what ``exp_avg_dtype``, ``exp_avg_sq_dtype`` and
``stochastic_rounding`` change in its state, kernel calls and state dicts (distopt/lowprec/formats.py
holds the options and the per-param rule FusedAdam shares with DistributedFusedAdam).

State (``opt.state[p]``): ``exp_avg`` / ``exp_avg_sq`` in their format, shaped like the param and in
its memory format (as the fp32 ones); an 8-bit moment has uint8 codes there and its float32 absmax
scales, one per 256 elements counted in the param's memory order from its first element, under
``exp_avg_absmax`` / ``exp_avg_sq_absmax``; state dicts hold the codes under ``exp_avg_codes`` /
``exp_avg_sq_codes`` instead (lowprec.formats.CODES_KEYS: never taken for values). With
``stochastic_rounding`` each param group holds its ``rounding_seed`` (drawn once by
``lowprec.formats.draw_seed``; every group of one optimizer gets the same), so a state dict carries it
and a resumed run rounds as the uninterrupted one would. A param's rounding key is (seed, step, its
position in param_groups order, element index).

DTensor params: bf16 moments go as fp32 ones do. 8-bit moments and stochastic rounding count blocks
and rounding keys from the param's first element, so each rank's shard must be one contiguous range
of the param: sharded along dim 0 (FSDP2's ``Shard(0)``) over at most one mesh dimension, and for
8-bit, every rank's non-empty shard starting at a multiple of 256 elements of the param, so whole
blocks sit on one rank. FSDP2's uneven (padded) shards qualify: ``torch.chunk`` gives every shard but
the last ``ceil(rows / ranks)`` rows, so the rule is that many rows times the elements per row being a
multiple of 256 (a 50,257 x 768 embedding on 8 ranks: 6,283 rows of 768). The absmax is then a
DTensor with the param's placements laid out by the param's rows (``lowprec.formats.absmax_shape``:
e.g. (33, 2) for a (33, 512) param), which shards along dim 0 exactly as the param does at every
world size, so torch.distributed.checkpoint saves and reshards it. Anything else raises at
construction (or at the first step for params swapped in later), naming the param and the rule: never
a result that depends on the sharding.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, Shard

from .. import dtensor
from ..kernel_views import state_like
from ..lowprec import formats as mf
from ..lowprec.codecs import QUANT_BLOCK, zero_code

MOMENTS = ("exp_avg", "exp_avg_sq")


def _name(p: Tensor, where: str) -> str:
    return f"{where} (shape {tuple(p.shape)})"


def _dim0_shards(p: DTensor, where: str | None) -> tuple[int, int, list[int]] | None:
    """(mesh dim, elements per dim-0 row, every rank's dim-0 row count) of a DTensor param sharded only
    along dim 0 over one mesh dimension; None for a replicated one; for any other layout, raises (None
    if `where` is None)."""
    sharded = [(d, pl) for d, pl in enumerate(p.placements) if dtensor.is_sharded(pl)]
    if not sharded:
        return None
    if len(sharded) > 1 or type(sharded[0][1]) is not Shard or sharded[0][1].dim != 0:
        if where is None:
            return None
        raise ValueError(f"FusedAdam: 8-bit moments and stochastic rounding count from a param's first element, "
                         f"so a DTensor param must be sharded along dim 0 over one mesh dimension; {_name(p, where)} "
                         f"has placements {tuple(p.placements)}")
    if not p._local_tensor.is_contiguous():
        if where is None:
            return None
        raise ValueError(f"FusedAdam: the local shard of {_name(p, where)} must be contiguous for 8-bit moments or "
                         "stochastic rounding (blocks and rounding keys follow the param's element order)")
    mesh_dim = sharded[0][0]
    n, rows = p.device_mesh.size(mesh_dim), p.shape[0]
    chunk = -(-rows // n) if rows else 0
    counts = [max(0, min(chunk, rows - i * chunk)) for i in range(n)]  # torch.chunk's split, as DTensor's
    return mesh_dim, math.prod(p.shape[1:]), counts


def element_offset(p: Tensor) -> int:
    """The element index, within the whole param, of the first element this rank holds of `p`: 0 for a
    plain or replicated param; for a dim-0 shard, the rows before it; 0 for other layouts, which only
    formats that ignore it take (``check_param``)."""
    if not isinstance(p, DTensor):
        return 0
    layout = _dim0_shards(p, None)
    if layout is None:
        return 0
    mesh_dim, row, counts = layout
    return sum(counts[: p.device_mesh.get_coordinate()[mesh_dim]]) * row


class MomentState:
    """The moment formats of one FusedAdam and what they do to its state and kernel calls."""

    def __init__(self, formats: mf.MomentFormats, offload: bool = False) -> None:
        if not formats.plain and offload:
            raise ValueError("FusedAdam: offload_optimizer=True keeps fp32 moments; low-precision moments "
                             "(exp_avg_dtype, exp_avg_sq_dtype, stochastic_rounding) are not supported with it")
        self.formats = formats

    @property
    def plain(self) -> bool:
        return self.formats.plain

    def defaults(self) -> dict[str, Any]:
        """Param-group defaults: the rounding seed, with stochastic rounding."""
        return self.formats.group_defaults()

    # ------------------------------------------------------------------ checks (before anything changes)

    def check_param(self, p: Tensor, where: str) -> None:
        """Raises for a param these formats cannot hold (`where` names it in the message)."""
        if self.plain:
            return
        if p.is_complex():
            raise TypeError(f"FusedAdam: low-precision moments and stochastic rounding do not support complex "
                            f"params ({_name(p, where)}, {p.dtype})")
        eight_bit = torch.uint8 in self.formats.dtypes(p.numel())
        if not isinstance(p, DTensor) or not (eight_bit or self.formats.stochastic_rounding):
            return
        layout = _dim0_shards(p, where)
        if layout is None or not eight_bit:
            return
        _, row, counts = layout
        starts = [sum(counts[:i]) * row for i in range(len(counts))]
        bad = [s for s, c in zip(starts, counts) if c and s % QUANT_BLOCK]
        if bad:  # (when none is, the absmax rows split as the param's rows: lowprec.formats.absmax_shape)
            raise ValueError(f"FusedAdam: 8-bit moments keep one absmax per {QUANT_BLOCK} elements counted from the "
                             f"param's first element, so every rank's non-empty shard must start at a multiple of "
                             f"{QUANT_BLOCK} elements: the rows of a full shard (ceil(rows / ranks) = {counts[0]}) "
                             f"times the elements per row ({row}) must be a multiple of {QUANT_BLOCK}. "
                             f"{_name(p, where)} is split into dim-0 shards of {counts} rows of {row} elements "
                             f"(shards starting at elements {starts}; {bad[0]} is not a multiple of {QUANT_BLOCK}). "
                             "Use exp_avg_dtype/exp_avg_sq_dtype=torch.bfloat16 for it, or a number of ranks for "
                             "which the rule holds")

    def check_params(self, groups: list[dict[str, Any]], *, master_weights: bool | None) -> None:
        """Checks every param, and (unless `master_weights` is None: a step's params, not all of them)
        that stochastic rounding has something to round."""
        if self.plain:
            return
        for g, group in enumerate(groups):
            names = group.get("param_names")
            for i, p in enumerate(group["params"]):
                self.check_param(p, f"param {names[i]!r}" if names else f"param_groups[{g}]['params'][{i}]")
        if self.formats.stochastic_rounding and master_weights is not None:
            bf16_moments = torch.bfloat16 in (self.formats.exp_avg_dtype, self.formats.exp_avg_sq_dtype)
            bf16_params = not master_weights and any(p.dtype == torch.bfloat16 for g in groups for p in g["params"])
            if not (bf16_moments or bf16_params):
                raise ValueError("FusedAdam: stochastic_rounding=True rounds bf16 stores only (bf16 moments, and bf16 "
                                 "params without master weights); this optimizer has none, so it would change nothing")

    # ------------------------------------------------------------------ state

    def new_moments(self, p: Tensor) -> dict[str, Tensor]:
        """Zero moments of `p` (a DTensor param's: made on its shard, wrapped like it; absmax as a Shard(0)
        DTensor of the param's blocks)."""
        out = {}
        for name, dtype in zip(MOMENTS, self.formats.dtypes(p.numel())):
            signed = mf.SIGNED[name]
            if dtype != torch.uint8:  # (fp32: state_like's default, complex64 for a complex param)
                d = None if dtype == torch.float32 else dtype
                out[name] = dtensor.like_param(p, lambda t, d=d: state_like(t, d).zero_())
                continue
            zero = zero_code(signed)
            out[name] = dtensor.like_param(p, lambda t, z=zero: state_like(t, torch.uint8).fill_(z))
            out[mf.ABSMAX_KEYS[name]] = _absmax_like(p, torch.zeros(mf.num_blocks(dtensor.local(p).numel()),
                                                                    dtype=torch.float32, device=p.device))
        return out

    # ------------------------------------------------------------------ kernel calls

    @staticmethod
    def scales(states: Sequence[dict[str, Any]]) -> tuple[list[Tensor], list[Tensor]]:
        """The absmax tensors of the 8-bit moments of `states` (all of one format; empty lists for the
        others), per moment: the state's own tensors."""
        return tuple([s[mf.ABSMAX_KEYS[name]] for s in states]
                     if states and states[0][name].dtype == torch.uint8 else [] for name in MOMENTS)

    @staticmethod
    def kernel_scales(states: Sequence[dict[str, Any]]) -> tuple[list[Tensor], list[Tensor]]:
        """``scales(states)`` as the kernel takes them: local, 1-D, one per block of the local codes (a
        DTensor param's absmax rows hold zeros past its blocks: a view of the blocks)."""
        return tuple([mf.block_view(dtensor.local(s[mf.ABSMAX_KEYS[name]]), dtensor.local(s[name])) for s in states]
                     if states and states[0][name].dtype == torch.uint8 else [] for name in MOMENTS)

    def call_kwargs(self, exp_avg_scales: list[Tensor], exp_avg_sq_scales: list[Tensor], ids: Sequence[int],
                    offsets: Sequence[int], group: dict[str, Any]) -> dict[str, Any]:
        """The op's moment arguments for one call (``ids``: the params' positions in param_groups order,
        ``offsets``: ``element_offset`` of each)."""
        return self.formats.op_arguments(exp_avg_scales, exp_avg_sq_scales, ids, offsets, group)

    # ------------------------------------------------------------------ state dicts

    def saved_as_float32(self, p: Tensor, saved: Any) -> Any:
        """A saved per-param state with low-precision moments read into fp32 (a new dict; checks that an
        8-bit moment has its absmax, of the right size). Others are returned as they are."""
        if not isinstance(saved, dict) or not any(isinstance(saved.get(n), Tensor) and saved[n].dtype
                                                  in (torch.bfloat16, torch.uint8) for n in MOMENTS):
            return saved
        out = dict(saved)
        for name in MOMENTS:
            value = saved.get(name)
            if not isinstance(value, Tensor) or value.dtype not in (torch.bfloat16, torch.uint8):
                continue
            if tuple(value.shape) != tuple(p.shape):
                raise ValueError(f"loaded {name} has shape {tuple(value.shape)}, its param {tuple(p.shape)}")
            scales = saved.get(mf.ABSMAX_KEYS[name])
            if value.dtype == torch.uint8:
                local = dtensor.local(value)
                blocks = mf.saved_blocks(dtensor.local(scales) if isinstance(scales, Tensor) else None, local)
                if blocks is None:
                    raise ValueError(f"loaded 8-bit {name} of a param of shape {tuple(p.shape)} needs "
                                     f"{mf.ABSMAX_KEYS[name]!r}: {mf.num_blocks(local.numel())} float32 scales")
            out[name] = mf.map_local(lambda v, s, n=name: mf.layout_to_float32(v, s, mf.SIGNED[n]), value, scales)
        return out

    def stored(self, p: Tensor, entry: dict[str, Any], saved: dict[str, Any]) -> dict[str, Any]:
        """`entry` (a loaded state with fp32 moments) with its moments in this optimizer's formats: the saved
        bits themselves where they were saved in that format and layout, else quantized from fp32."""
        if self.plain:
            return entry
        for name, dtype in zip(MOMENTS, self.formats.dtypes(p.numel())):
            if dtype == torch.float32:
                continue
            signed, absmax_key = mf.SIGNED[name], mf.ABSMAX_KEYS[name]
            value, local_p = saved.get(name), dtensor.local(p)
            like = state_like(local_p, dtype)
            if _same_bits_layout(p, value, like):
                codes = like.copy_(dtensor.local(dtensor.placed_like(p, value, name)))  # a whole one: this rank's part
                scales = None
                if dtype == torch.uint8:  # (saved_as_float32 checked them)
                    scales = mf.saved_blocks(dtensor.local(saved[absmax_key]), dtensor.local(value))
                    scales = scales.to(p.device, torch.float32)
                    if isinstance(p, DTensor) and not isinstance(value, DTensor):  # this rank's blocks of all
                        first = element_offset(p) // QUANT_BLOCK
                        scales = scales[first : first + mf.num_blocks(local_p.numel())]
                    scales = scales.clone()
            else:
                codes, scales = mf.layout_from_float32(dtensor.local(entry[name]), like, signed)
            entry[name] = dtensor.like_param(p, lambda _t, c=codes: c)
            if scales is not None:
                entry[absmax_key] = _absmax_like(p, scales.reshape(-1))
        return entry


def _absmax_like(p: Tensor, local_scales: Tensor) -> Tensor:
    """The absmax of a param's 8-bit moment from its local blocks (1-D): those, for a DTensor param a
    DTensor with the param's placements in ``lowprec.formats.absmax_shape`` layout, the local rows holding
    the blocks then zeros (check_param saw every shard start on a block, so the rows split as the
    param's do)."""
    if not isinstance(p, DTensor):
        return local_scales
    rows, cols = mf.absmax_shape(p._local_tensor.shape)
    padded = local_scales.new_zeros(rows * cols)
    padded[: local_scales.numel()].copy_(local_scales)
    shape = mf.absmax_shape(p.shape)
    return DTensor.from_local(padded.view(rows, cols), p.device_mesh, p.placements, shape=torch.Size(shape),
                              stride=(shape[1], 1), run_check=False)


def _same_bits_layout(p: Tensor, value: Any, like: Tensor) -> bool:
    """Whether a saved moment can be copied bit for bit: `like`'s dtype, its param's layout (8-bit blocks
    follow memory order), and for a DTensor param, the param's mesh and placements, or a whole (plain)
    tensor, of which this rank takes its shard's elements and blocks."""
    if not isinstance(value, Tensor) or value.dtype != like.dtype:
        return False
    if isinstance(value, DTensor) and not isinstance(p, DTensor):
        return False
    if isinstance(p, DTensor) and not isinstance(value, DTensor):  # a whole one: sliced as the shard (check_param)
        return value.is_contiguous() and like.is_contiguous()
    if isinstance(p, DTensor) and (value.device_mesh, tuple(value.placements)) != (p.device_mesh, tuple(p.placements)):
        return False
    return dtensor.local(value).stride() == like.stride() or like.dtype != torch.uint8
