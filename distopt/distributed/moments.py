"""DistributedFusedAdam's low-precision moments: ``exp_avg_dtype``, ``exp_avg_sq_dtype`` and
``stochastic_rounding`` (distopt/lowprec/formats.py holds the options and the per-param rule it shares
with FusedAdam).

Sharding invariance. A param's moment formats are decided on its global size and are part of its
bucket's group key, so one bucket holds one format. 8-bit moments count 256-element blocks from each
param's first element: their buckets place params at 256-element boundaries and make shards multiples
of 256 elements (layout.py's ``aligns``), so a param's fragment on any rank starts at a multiple of
256 of the param and its codes and absmax scales are the param's own blocks, whatever the world size,
bucket size or shard boundaries. Each fragment is then one kernel entry carrying its param id (the
param's position in ``param_groups`` order) and its first element's offset in the param: stochastic
rounding's key (seed, step, param id, element index) does not depend on the sharding either. Without
low-precision moments or stochastic rounding nothing here changes the fp32 layout or kernel calls.

The rounding seed is ``group["rounding_seed"]`` (as FusedAdam's, drawn by ``lowprec.formats.draw_seed``
at construction and saved in state dicts); when the layout is built every rank takes rank 0's.

``state_dict()``/``load_state_dict()`` (checkpoint/moments.py), the sharded form for
torch.distributed.checkpoint (``state_dict(sharded=True)``, checkpoint/dcp_state.py) and distopt's own
sharded files (``checkpoint.save``/``load``, checkpoint/file_format.py) hold the moments in their formats.
``opt.state`` shows the stored moments (bf16 values, or 8-bit codes: their absmax scales are in the
state dict).

Not supported, a ValueError at construction: ``offload_optimizer`` (its host update keeps fp32
moments) and DTensor params (their local tensors' blocks and element indices would count from the
local tensor, not the param). BMUF does not take DistributedFusedAdam as its local optimizer.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from ..lowprec.codecs import QUANT_BLOCK
from ..lowprec.formats import SEED_KEY, MomentFormats, num_blocks
from .buckets import shard_runs
from .comm import Comm
from .layout import DEFAULT_ALIGN, Fragment
from .options import Storage

# A kernel entry of one fragment: the bucket's shard state and the fragment (see ``call_kwargs``).
Where = tuple[Any, Fragment]


class ShardMoments:
    """The moment formats of one DistributedFusedAdam: its layout keys, shard state and kernel arguments."""

    def __init__(self, exp_avg_dtype: torch.dtype, exp_avg_sq_dtype: torch.dtype, stochastic_rounding: bool,
                 offload: bool) -> None:
        self.formats = MomentFormats(exp_avg_dtype, exp_avg_sq_dtype, stochastic_rounding)  # clear errors
        if offload and not self.plain:
            raise ValueError("DistributedFusedAdam: offload_optimizer=True updates fp32 moments on the host; "
                             "low-precision moments (exp_avg_dtype, exp_avg_sq_dtype, stochastic_rounding) "
                             "are not supported with it")

    @property
    def plain(self) -> bool:
        """fp32 moments and round-to-nearest: the fp32 layout and kernel calls, untouched."""
        return self.formats.plain

    def defaults(self) -> dict[str, Any]:
        """Param-group defaults: the rounding seed, with stochastic rounding."""
        return self.formats.group_defaults()

    def options(self) -> tuple[torch.dtype, torch.dtype, bool]:
        """exp_avg_dtype, exp_avg_sq_dtype, stochastic_rounding (agreement.py compares them across ranks)."""
        f = self.formats
        return f.exp_avg_dtype, f.exp_avg_sq_dtype, f.stochastic_rounding

    def check_params(self, params: Sequence[Tensor], dtypes: Sequence[tuple[torch.dtype, torch.dtype]],
                     storage: Storage) -> None:
        """Raises for params these formats cannot hold, or stochastic rounding that rounds nothing
        (`dtypes`: each param's (param sync dtype, dtype), which with `storage` tell whether some bf16
        params are updated in place, without masters or remainders)."""
        if self.plain:
            return
        bf16_params_rounded = any(d[1] == torch.bfloat16 and not storage.master(*d) and not storage.remainders(*d)
                                  for d in dtypes)
        for i, p in enumerate(params):
            if isinstance(p, DTensor):
                raise ValueError(f"DistributedFusedAdam: low-precision moments and stochastic rounding count "
                                 f"blocks and rounding keys from a param's first element; DTensor params (param "
                                 f"{i}, shape {tuple(p.shape)}) are not supported with them")
        f = self.formats
        if f.stochastic_rounding and torch.bfloat16 not in (f.exp_avg_dtype, f.exp_avg_sq_dtype) \
                and not bf16_params_rounded:
            raise ValueError("DistributedFusedAdam: stochastic_rounding=True rounds bf16 stores only (bf16 "
                             "moments, and bf16 params updated without masters: store_params=False); this "
                             "optimizer has none, so it would change nothing")

    # ------------------------------------------------------------------ layout

    def group_key(self, p: Tensor) -> tuple[torch.dtype, ...]:
        """What a param's moments add to its bucket group key: their dtypes (by its global size)."""
        return () if self.plain else self.formats.dtypes(p.numel())

    @staticmethod
    def moment_dtypes(key: Hashable) -> tuple[torch.dtype, torch.dtype]:
        """The moment dtypes of a bucket group key (grad, param and model dtypes, then the moments')."""
        return tuple(key[3:5]) if len(key) >= 5 else (torch.float32, torch.float32)

    def aligns(self, keys: Iterable[Hashable]) -> dict[Hashable, int]:
        """Per group key, the alignment of buckets with 8-bit moments (a block: no block straddles shards)."""
        return {k: max(DEFAULT_ALIGN, QUANT_BLOCK) for k in keys if torch.uint8 in self.moment_dtypes(k)}

    def agree_seeds(self, groups: list[dict[str, Any]], comm: Comm, device: torch.device) -> None:
        """Rank 0's rounding seeds on every rank (one broadcast; nothing without stochastic rounding)."""
        if self.formats.stochastic_rounding:
            seeds = comm.broadcast_ints([int(g[SEED_KEY]) for g in groups], device)
            for g, seed in zip(groups, seeds):
                g[SEED_KEY] = seed

    def runs(self, fragments: tuple[Fragment, ...], shard_numel: int, group_of: list[int]
             ) -> list[tuple[int, int, int]]:
        """The (param group, start, end) kernel runs of a shard: fp32's (buckets.shard_runs), or else one
        per fragment (its own param id, offset and blocks)."""
        if self.plain:
            return shard_runs(fragments, shard_numel, group_of)
        return [(group_of[f.param], f.shard_offset, f.shard_offset + f.numel) for f in fragments]

    # ------------------------------------------------------------------ kernel calls

    def call_kwargs(self, where: Sequence[Where], param_ids: Sequence[int], group: dict[str, Any]) -> dict[str, Any]:
        """The op's moment arguments for entries (state, fragment); `param_ids` maps a trainable param's
        index to its position in param_groups order."""
        if self.plain:
            return {}

        def blocks(scales: Tensor | None, f: Fragment) -> list[Tensor]:
            first = f.shard_offset // QUANT_BLOCK
            return [] if scales is None else [scales[first : first + num_blocks(f.numel)]]

        return self.formats.op_arguments([b for s, f in where for b in blocks(s.exp_avg_scales, f)],
                                         [b for s, f in where for b in blocks(s.exp_avg_sq_scales, f)],
                                         [param_ids[f.param] for _, f in where], [f.param_offset for _, f in where],
                                         group)

