"""Which params are laid out next, in which order and sync dtypes: apex's ``init_params`` and
``init_params_bucket`` declarations, resolved into segments for the pure planner (layout.py).

Declarations are recorded per rank; ``segments()`` adds the params never declared (in the first
backward's gradient order) and ``agreed()`` makes every rank use rank 0's plan, so a backward order
that differs by rank never gives two layouts. Per-param sync dtypes are part of the rank-agreement
fingerprint (agreement.py), so ranks that declared differently stop with one clear error.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

from ..validation import FLOAT_DTYPES
from .comm import Comm

Segments = list[tuple[list[int], bool]]  # (param indices in packing order, fresh buckets of their own)


class Packing:
    def __init__(self, params: list[Tensor], grad_sync_dtype: torch.dtype | None,
                 param_sync_dtype: torch.dtype | None) -> None:
        self.params = params
        self.index = {p: i for i, p in enumerate(params)}
        self.grad_sync_dtype = grad_sync_dtype
        self.param_sync_dtype = param_sync_dtype
        self.grad_dtypes: dict[int, torch.dtype] = {}  # init_params overrides
        self.param_dtypes: dict[int, torch.dtype] = {}
        self.declared: Segments = []

    def grad_dtype(self, p: Tensor) -> torch.dtype:
        return self.grad_dtypes.get(self.index[p]) or self.grad_sync_dtype or p.dtype

    def param_dtype(self, p: Tensor) -> torch.dtype:
        return self.param_dtypes.get(self.index[p]) or self.param_sync_dtype or p.dtype

    def declare(self, params: Iterable[Tensor] | None, grad_sync_dtype: torch.dtype | None,
                param_sync_dtype: torch.dtype | None, fresh: bool, params_are_masters: bool) -> bool:
        """Records one init_params call (checked whole before anything is recorded); True once every
        param is declared. `params_are_masters`: store_params=False or contiguous_param_buffer, which
        need each param synchronised in its own dtype."""
        for name, value in (("grad_sync_dtype", grad_sync_dtype), ("param_sync_dtype", param_sync_dtype)):
            if value is not None and value not in FLOAT_DTYPES:
                raise ValueError(f"init_params: {name} must be float32, float16, bfloat16 or None, got {value}")
        done = {i for seg, _ in self.declared for i in seg}
        if params is None:
            indices = [i for i in reversed(range(len(self.params))) if i not in done]
        else:
            params = list(params)
            unknown = [j for j, p in enumerate(params) if p not in self.index]
            if unknown:
                raise ValueError(f"init_params: params[{unknown[0]}] is not a trainable param of this optimizer")
            indices = list(dict.fromkeys(self.index[p] for p in params if self.index[p] not in done))
        for i in indices:
            p = self.params[i]
            sync = param_sync_dtype or self.param_sync_dtype or p.dtype
            if sync != p.dtype and params_are_masters:
                raise ValueError(f"init_params: param_sync_dtype={sync} differs from param {i}'s dtype {p.dtype}, "
                                 "which store_params=False and contiguous_param_buffer do not allow")
        for i in indices:
            if grad_sync_dtype is not None:
                self.grad_dtypes[i] = grad_sync_dtype
            if param_sync_dtype is not None:
                self.param_dtypes[i] = param_sync_dtype
        if indices:
            self.declared.append((indices, fresh))
        return len(done) + len(indices) == len(self.params)

    def segments(self, arrival: list[int]) -> Segments:
        """The declared segments, then the rest: in `arrival` (gradient) order, then param order."""
        placed = {i for seg, _ in self.declared for i in seg}
        tail = [i for i in arrival if i not in placed]
        placed.update(tail)
        tail += [i for i in range(len(self.params)) if i not in placed]
        return self.declared + ([(tail, False)] if tail else [])

    @staticmethod
    def agreed(segments: Segments, comm: Comm, device: torch.device) -> Segments:
        """Rank 0's segments on every rank (one broadcast of 3 ints per param)."""
        n = sum(len(seg) for seg, _ in segments)
        plan = [i for seg, _ in segments for i in seg]
        plan += [k for k, (seg, _) in enumerate(segments) for _ in seg]
        plan += [int(fresh) for seg, fresh in segments for _ in seg]
        plan = comm.broadcast_ints(plan, device)
        out: Segments = []
        for position in range(n):
            if position == 0 or plan[n + position] != plan[n + position - 1]:
                out.append(([], bool(plan[2 * n + position])))
            out[-1][0].append(plan[position])
        return out
