"""FusedAdam's offloaded step (``offload_optimizer=True``): the update runs on the host.

Every param's fp32 master (``state["param"]``, for fp32 params too: the host kernel needs the values
there) and both moments live in host memory (pinned for CUDA params), with the param's shape and
strides. A step copies the gradients into per-param host staging, runs the fused CPU kernel on the
host lists (the same math as the GPU kernel, Note [Host/device bit-identity] in csrc/math/adam.h, so
the bits are those of ``FusedAdam(master_weights=True)`` on the device), and copies the updated values
back into the params: the masters themselves for fp32 params, a staging copy in the param dtype (the
kernel's ``param_outs``) for 16-bit ones. The copies and their ordering are distopt/offload.py's.

The staging is allocated once per param and reused while the param's shape, strides and dtypes stay
(a changed one is reallocated); it is no part of the state, never pickled, and rebuilt lazily. The
kernel lists are built every step: the copies cost far more than the Python work per param.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from .. import ops
from ..kernel_views import as_real, state_dtype
from ..offload import HOST, HostTransfers, Landing

STATE_TENSORS = ("exp_avg", "exp_avg_sq", "param")


class HostStep:
    """The host memory, staging and copies of one offloading FusedAdam whose params are on `device`."""

    def __init__(self, device: torch.device, state: dict[Tensor, dict[str, Any]]) -> None:
        self.transfers = HostTransfers(device)
        self._staging: dict[Tensor, tuple] = {}  # param -> (its dtypes and layout, grad, 16-bit param out)
        self._copy_back = Landing(None)  # the last step's host -> device copies, which read the staging
        self.adopt(state)

    def fp32_like(self, p: Tensor) -> Tensor:
        """Uninitialised fp32 (complex: complex64) host memory with `p`'s shape and layout."""
        return self.transfers.empty_like(p, state_dtype(p))

    def new_state(self, p: Tensor) -> dict[str, Tensor]:
        """A param's first state: zero moments and its fp32 master, in host memory."""
        return dict(
            exp_avg=self.fp32_like(p).zero_(),
            exp_avg_sq=self.fp32_like(p).zero_(),
            param=self.fp32_like(p).copy_(p.detach()),
        )

    def adopt(self, state: dict[Tensor, dict[str, Any]]) -> None:
        """Moves state tensors that are not in this step's host memory there (a deep copy's or an
        unpickled optimizer's state is in ordinary memory, or on the device if loaded there)."""
        for entry in state.values():
            for name in STATE_TENSORS:
                t = entry.get(name)
                if isinstance(t, Tensor) and (t.device != HOST or (self.transfers.pinned and not t.is_pinned())):
                    entry[name] = self.transfers.empty_like(t).copy_(t)

    def _staging_for(self, p: Tensor, grad_dtype: torch.dtype) -> tuple[Tensor, Tensor | None]:
        """(grad staging, 16-bit param staging or None) for `p`: last step's if they still fit."""
        key = (grad_dtype, p.dtype, p.shape, p.stride())
        staged = self._staging.get(p)
        if staged is None or staged[0] != key:
            out = self.transfers.empty_like(p) if p.dtype != state_dtype(p) else None
            staged = self._staging[p] = (key, self.transfers.empty_like(p, grad_dtype), out)
        return staged[1], staged[2]

    def staging_bytes(self) -> int:
        """Bytes of the staging buffers allocated so far (grads, and 16-bit params' outputs)."""
        return sum(t.nbytes for _, grad, out in self._staging.values() for t in (grad, out) if t is not None)

    def _prune(self, groups: list[dict[str, Any]]) -> None:
        """Drops the staging of params no group holds any more."""
        if len(self._staging) > sum(len(g["params"]) for g in groups):
            live = {p for g in groups for p in g["params"]}
            self._staging = {p: bufs for p, bufs in self._staging.items() if p in live}

    def step(
        self,
        work: list[tuple[dict, list[Tensor], list[Tensor]]],
        init_state: Callable[[Tensor], dict],
        hyper: Callable[[dict, Tensor | None], dict],
        grad_scale: Tensor | None,
        found_inf: Tensor | None,
    ) -> None:
        """One update of `work` ((group, params with a gradient, their checked gradients) per group, as
        FusedAdam._work gives it); `grad_scale` and `found_inf` are device scalars (or None)."""
        self._prune([group for group, _, _ in work])
        entries = []  # (group index, param, state, grad staging, 16-bit staging)
        for index, (_, params, grads) in enumerate(work):
            for p, g in zip(params, grads):
                entries.append((index, p, init_state(p), *self._staging_for(p, g.dtype)))
        grads = [g for _, _, gs in work for g in gs]
        landed = self.transfers.to_host(grads, [e[3] for e in entries])
        # The host kernel reads its scalars as CPU tensors (found_inf is zero here: FusedAdam skipped
        # an inf/nan step before; it is passed on so that the kernel would skip one all the same).
        grad_scale = None if grad_scale is None else grad_scale.to(HOST)
        found_inf = None if found_inf is None else found_inf.to(HOST)
        buckets: dict[tuple, list[tuple]] = defaultdict(list)  # one kernel call per group, dtypes and step
        for entry, g in zip(entries, grads):
            index, p, state = entry[:3]
            buckets[(index, p.dtype, g.dtype, int(state["step"].item()))].append(entry)
        self._copy_back.wait()  # the last copies back have read the masters and the 16-bit staging
        landed.wait()
        srcs, dsts = [], []
        try:
            for (index, _, _, step), bucket in buckets.items():
                group = work[index][0]
                states = [e[2] for e in bucket]
                ops.adam_step_(  # complex params as their real views (distopt/kernel_views.py)
                    [as_real(s["param"]) for s in states],
                    [as_real(e[3]) for e in bucket],
                    [as_real(s["exp_avg"]) for s in states],
                    [as_real(s["exp_avg_sq"]) for s in states],
                    lr=float(group["lr"]),
                    step=step + 1,
                    param_outs=[as_real(e[4]) for e in bucket if e[4] is not None],
                    found_inf=found_inf,
                    **hyper(group, grad_scale),
                )
                torch._foreach_add_([s["step"] for s in states], 1)
                srcs += [s["param"] if e[4] is None else e[4] for e, s in zip(bucket, states)]
                dsts += [e[1] for e in bucket]
        finally:  # what was updated reaches the params even if a later call raised
            self._copy_back = self.transfers.to_device(srcs, dsts)
