"""DTensor params (FSDP2's ``fully_shard``, HSDP, tensor parallelism): unwrap on the hot path, wrap at
the edges.

The fused kernels are elementwise, so they run unchanged on each param's local shard
(``DTensor._local_tensor``, what ``to_local()`` returns under ``no_grad``). The step plan holds those
local tensors (distopt/fused_adam/plan.py), so a steady-state step performs no DTensor dispatch. The state
is made on the local shard and exposed as a DTensor with the param's mesh, placements, global shape
and stride (``like_param``): ``opt.state[p]["exp_avg"]`` is what torch.optim.AdamW would hold, and
torch's ``get_optimizer_state_dict``, ``set_optimizer_state_dict`` and ``torch.distributed.checkpoint``
save, load and reshard it. Step counters stay plain float32 scalars, as torch.optim.AdamW keeps them
for DTensor params.

A param and its state must agree in mesh, placements and shape; its gradient must be on the same mesh
with the same global shape, and is taken as torch's optimizers take it (``grad_shard``): where its
placements differ from the param's (tensor parallelism gives a ``Shard(0)`` param a ``Replicate``
gradient, sequence parallelism a ``Replicate`` norm weight a ``Partial`` one), the values of the param's
shard are those of ``grad.redistribute(param's placements)``, found by slicing the local gradient where
the gradient is replicated, else by the collective DTensor runs (a reduction of a ``Partial`` gradient,
a gather of a sharded one), which every rank enters in param order, as under torch's optimizers (every
rank gives a param's gradient the same placements, as one SPMD program does). Anything else raises
before anything changes, never updates with the wrong shard. Zero-element local shards (uneven
sharding, ranks that hold nothing) go through every list and every collective like any other.

Norms (``NormReduction``): the whole model's sum of squares is each param's local sum, all-reduced
over the mesh dimensions the param is sharded along (``Shard``, FSDP's ``_StridedShard``) and not over
those it is replicated along, so each element counts once. The inf/nan flag is all-reduced over all
of a param's mesh dimensions, so an inf on any rank is seen by every rank. Params are grouped by the
process groups they reduce over and each group gets one all-reduce, whatever the number of params.
Plain tensors count as local to each rank (no reduction), as for a single-process model.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from . import ops
from .kernel_views import norm_view
from .validation import is_dense

try:  # private: FSDP over a tensor-parallel dimension shards with it
    from torch.distributed.tensor.placement_types import _StridedShard
except ImportError:  # pragma: no cover - a torch without it cannot make such layouts
    _StridedShard = ()


def is_dtensor(t: Any) -> bool:
    return isinstance(t, DTensor)


def local(t: Tensor) -> Tensor:
    """The local shard of a DTensor (no dispatch, no autograd), or the tensor itself."""
    return t._local_tensor if isinstance(t, DTensor) else t


def like_param(p: Tensor, make: Callable[[Tensor], Tensor]) -> Tensor:
    """``make(p)``; for a DTensor param, ``make`` of its local shard as a DTensor with the param's mesh,
    placements, global shape and stride (no communication)."""
    if not isinstance(p, DTensor):
        return make(p)
    return DTensor.from_local(make(p._local_tensor), p.device_mesh, p.placements, shape=p.shape, stride=p.stride(),
                              run_check=False)


def _describe(t: DTensor) -> str:
    return f"placements {tuple(t.placements)} on {t.device_mesh}"


def is_sharded(placement) -> bool:
    # FSDP over a tensor-parallel dimension shards with _StridedShard, which is not is_shard() in torch 2.14.
    return placement.is_shard() or isinstance(placement, _StridedShard)


def _same_layout(a: DTensor, b: DTensor) -> bool:
    return a.device_mesh == b.device_mesh and tuple(a.placements) == tuple(b.placements) and a.shape == b.shape


def check_params(params: Sequence[Tensor], owner: str, offload: bool) -> None:
    """Raises for a DTensor param this optimizer cannot step: a ``Partial`` or unknown placement, a mesh
    this rank is not in, a local shard that is not dense, or ``offload_optimizer``."""
    for p in params:
        if not isinstance(p, DTensor):
            continue
        if offload:
            raise ValueError(f"{owner}: offload_optimizer=True does not support DTensor params (FSDP2, tensor "
                             "parallelism) yet")
        for placement in p.placements:
            if not (is_sharded(placement) or placement.is_replicate()):
                raise ValueError(f"{owner}: a DTensor param must be sharded or replicated on each mesh dimension, "
                                 f"got {_describe(p)}")
        if p.device_mesh.get_coordinate() is None:
            raise ValueError(f"{owner}: this rank is not in the mesh of a DTensor param ({p.device_mesh})")
        if not is_dense(p._local_tensor):
            raise ValueError(f"{owner}: the local shard of a DTensor param must be dense (non-overlapping, no gaps)")


def check_grad(p: DTensor, grad: Tensor, owner: str = "FusedAdam") -> None:
    """Raises unless `grad` is a DTensor on its param `p`'s mesh with its global shape (its placements
    may differ: ``grad_shard``); `owner` (the optimizer's name) starts the message."""
    if not isinstance(grad, DTensor):
        raise RuntimeError(f"{owner}: a DTensor param ({_describe(p)}) has a {type(grad).__name__} gradient; "
                           "it must be a DTensor on the param's mesh")
    if grad._spec is p._spec or (grad.device_mesh == p.device_mesh and grad.shape == p.shape):
        return
    raise RuntimeError(f"{owner}: a gradient of shape {tuple(grad.shape)} with {_describe(grad)} does not match "
                       f"its param ({tuple(p.shape)}, {_describe(p)}): it must be on the param's mesh, with its shape")


class GradConversion:
    """How a gradient laid out unlike its param (same mesh and global shape, other placements) becomes
    the values of the param's local shard, as ``grad.redistribute(param's placements)`` gives them:
    ``cut`` (per tensor dim, the (start, length) of the param's shard within the gradient's local
    tensor) where every differing mesh dimension has a ``Replicate`` gradient and a plain ``Shard``
    param (a slice, no communication), else None: DTensor's redistribution (a collective)."""

    def __init__(self, p: DTensor, grad: DTensor) -> None:
        self.mesh, self.placements = p.device_mesh, p.placements
        self.shard = p._local_tensor  # whose layout (strides) the result takes
        self.cut: tuple[tuple[int, int], ...] | None = None
        if all(gp == pp or (gp.is_replicate() and type(pp) is Shard) for gp, pp in zip(grad.placements, p.placements)):
            (mine,), (theirs,) = p.__create_chunk_list__(), grad.__create_chunk_list__()
            self.cut = tuple((a - b, n) for a, b, n in zip(mine.offsets, theirs.offsets, mine.sizes))

    def __call__(self, grad: DTensor) -> Tensor:
        if self.cut is None:
            local = grad.redistribute(self.mesh, self.placements)._local_tensor
        else:
            local = grad._local_tensor
            for dim, (start, length) in enumerate(self.cut):
                if start or length != local.shape[dim]:
                    local = local.narrow(dim, start, length)
        if local.stride() != self.shard.stride():  # (a slice along a later dim: copied into the shard's layout)
            local = torch.empty_like(self.shard, dtype=local.dtype).copy_(local)
        return local


def grad_shard(p: Tensor, grad: Tensor, owner: str = "FusedAdam") -> Tensor:
    """The gradient values of a DTensor param's local shard (checked by ``check_grad``): the gradient's
    local tensor where it is laid out as the param, else converted as torch's optimizers convert it
    (``GradConversion``). A plain param's gradient is returned as it is."""
    if not isinstance(p, DTensor):
        return grad
    check_grad(p, grad, owner)
    if grad._spec is p._spec or _same_layout(grad, p):
        return grad._local_tensor
    return GradConversion(p, grad)(grad)


def local_param_and_grad(p: Tensor, owner: str = "FusedAdam") -> tuple[Tensor, Tensor]:
    """(param, grad) as the kernel sees them: for a DTensor param, its local shard and the gradient's
    values for it (``grad_shard``; `owner` starts the error messages)."""
    grad = p.grad
    if not isinstance(p, DTensor):
        if isinstance(grad, DTensor):
            raise RuntimeError(f"{owner}: a plain param of shape {tuple(p.shape)} has a DTensor gradient "
                               f"({_describe(grad)})")
        return p, grad
    return p._local_tensor, grad_shard(p, grad, owner)


def check_states(params: Sequence[Tensor], state: dict[Tensor, dict[str, Any]]) -> None:
    """Raises unless each state tensor of a DTensor param in `params` is a DTensor laid out as it (the
    step counter aside, a plain scalar)."""
    for p in params:
        if not isinstance(p, DTensor):
            continue
        for name, value in state.get(p, {}).items():
            if name == "step" or not isinstance(value, Tensor):
                continue
            if not (isinstance(value, DTensor) and _same_layout(value, p)):
                where = _describe(value) if isinstance(value, DTensor) else f"a {type(value).__name__}"
                raise RuntimeError(f"FusedAdam: state {name!r} ({tuple(value.shape)}, {where}) does not match its "
                                   f"DTensor param ({tuple(p.shape)}, {_describe(p)})")


def local_entry(p: Tensor, grad: Tensor, state: dict[str, Any]) -> tuple[Tensor, Tensor, dict[str, Any]]:
    """A general step's (param, local grad, state) with the param and its state tensors replaced by
    their local shards (``check_states`` has checked their layouts). The step counter (a plain scalar)
    is the state's own tensor, so counting a step counts it in the state."""
    if not isinstance(p, DTensor):
        return p, grad, state
    return p._local_tensor, grad, {name: local(value) for name, value in state.items()}


def placed_like(p: Tensor, value: Tensor, name: str) -> Tensor:
    """A loaded state tensor laid out as its param `p`: a DTensor with another placement on the same
    mesh is redistributed; a plain (whole) tensor for a DTensor param gives this rank's shard of it,
    sliced locally. A DTensor for a plain param, or one on another mesh, raises."""
    if not isinstance(value, DTensor):
        if not isinstance(p, DTensor):
            return value
        return distribute_tensor(value.detach(), p.device_mesh, p.placements, src_data_rank=None)
    if not isinstance(p, DTensor):
        raise ValueError(f"loaded {name} is a DTensor ({_describe(value)}) but its param is a plain tensor: load the "
                         "state through torch.distributed.checkpoint.state_dict.set_optimizer_state_dict, or pass "
                         "full tensors")
    if value.device_mesh != p.device_mesh:
        raise ValueError(f"loaded {name} is on {value.device_mesh}, its param on {p.device_mesh}")
    if tuple(value.placements) != tuple(p.placements):
        value = value.redistribute(p.device_mesh, p.placements)
    return value


# ---------------------------------------------------------------------- norms


def _reduction_groups(p: Tensor) -> tuple[tuple, tuple]:
    """(groups the param's sum of squares is summed over, groups its inf/nan flag is reduced over):
    the process groups of its sharded mesh dimensions, and of all of them (one-rank dimensions left out)."""
    if not isinstance(p, DTensor):
        return (), ()
    mesh = p.device_mesh
    dims = [d for d in range(mesh.ndim) if mesh.size(d) > 1]
    return (tuple(mesh.get_group(d) for d in dims if is_sharded(p.placements[d])),
            tuple(mesh.get_group(d) for d in dims))


class NormReduction:
    """How the local sums of squares and inf/nan flags of `params`' shards make the whole model's.

    Params with the same reduction form a class (``class_of[i]`` is param i's); ``reduce`` takes one
    local sum and one flag per class and makes one all-reduce per process group involved, in an order
    that depends only on the params' order and layouts, so every rank enters the same collectives. Built
    from every param (not only those with a gradient), so a rank whose grads are missing still does.
    """

    def __init__(self, params: Sequence[Tensor]) -> None:
        self.params = list(params)
        keys: dict[tuple, int] = {}
        self.class_of = [keys.setdefault(_reduction_groups(p), len(keys)) for p in self.params]
        self.classes = len(keys)
        # Where to reduce which entry of [sums..., flags...]: every process group, in order of appearance,
        # known by its ranks (two meshes' groups of the same ranks are one: all its members see them alike).
        where: dict[tuple[int, ...], tuple[Any, list[int]]] = {}
        for k, (sum_groups, flag_groups) in enumerate(keys):
            for groups, entry in ((sum_groups, k), (flag_groups, self.classes + k)):
                for group in groups:
                    where.setdefault(tuple(dist.get_process_group_ranks(group)), (group, []))[1].append(entry)
        self._where = list(where.values())
        self._indices: dict[torch.device, list[Tensor]] = {}

    def holds(self, params: Sequence[Tensor]) -> bool:
        """Whether this reduction was built for exactly these param objects, in this order."""
        return len(params) == len(self.params) and all(map(operator.is_, params, self.params))

    def local_sums(self, device: torch.device, selected: frozenset[int] | None = None
                   ) -> tuple[Tensor, Tensor, str | None]:
        """(sum of squares, inf/nan flag) per class of the current gradients' local shards (one l2norm
        call per class, gradient dtype and selection), and the error of a DTensor gradient laid out
        unlike its param (None if none). `selected` (indices into the params; None: all) limits the sums;
        the flags cover every gradient. A rank with such an error still takes part in the reduction,
        with nan sums and the inf flag set, so that the others do not wait for it and skip the step; it
        raises after."""
        lists: dict[tuple[int, torch.dtype, bool], list[Tensor]] = {}
        error = None
        for i, (p, k) in enumerate(zip(self.params, self.class_of)):
            g = p.grad
            if g is None:
                continue
            if isinstance(p, DTensor):
                try:
                    check_grad(p, g)
                except RuntimeError as e:
                    error = error or str(e)
                    continue
                g = grad_shard(p, g)  # (a collective where torch's optimizers would run one: GradConversion)
            if g.is_complex() or not g.is_contiguous():
                g = norm_view(g)  # real and dense, as the L2-norm kernel takes it
            lists.setdefault((k, g.dtype, selected is None or i in selected), []).append(g)
        sums = torch.zeros(self.classes, dtype=torch.float32, device=device)
        flags = torch.zeros(self.classes, dtype=torch.float32, device=device)
        for (k, _, summed), grads in lists.items():
            total, _ = ops.l2norm(grads, found_inf=flags[k:k + 1])
            if summed:
                sums[k] += total.square()
        if error is not None:
            sums.fill_(float("nan"))
            flags.fill_(1.0)
        return sums, flags, error

    def reduce(self, sums: Tensor, flags: Tensor) -> Tensor:
        """[whole model's sum of squares, nonzero if any rank saw inf/nan] from per-class local values."""
        values = torch.cat([sums, flags])
        indices = self._indices.get(values.device)
        if indices is None:
            indices = self._indices[values.device] = [torch.tensor(i, device=values.device) for _, i in self._where]
        for (group, _), index in zip(self._where, indices):
            part = values.index_select(0, index)
            dist.all_reduce(part, group=group)
            values.index_copy_(0, index, part)
        return torch.stack([values[:self.classes].sum(), values[self.classes:].sum()])


def norm_sq_and_flag(reduction: NormReduction | None, params: Sequence[Tensor], device: torch.device,
                     selected: frozenset[int] | None = None) -> tuple[Tensor, NormReduction]:
    """([sum of squares, inf/nan flag] of `params`' gradients over the whole model, the reduction used):
    `reduction` is reused while it holds the same params (pass the last one returned); `selected`
    (indices into `params`) limits the sum, not the flag."""
    if reduction is None or not reduction.holds(params):
        reduction = NormReduction(params)
    sums, flags, error = reduction.local_sums(device, selected)
    sq_and_flag = reduction.reduce(sums, flags)
    if error is not None:
        raise RuntimeError(error)
    return sq_and_flag, reduction
