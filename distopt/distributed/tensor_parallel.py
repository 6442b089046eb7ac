"""DistributedFusedAdam under tensor parallelism: DTensor params of a tensor-parallel mesh, and
Megatron/NeMo-style model parallelism with plain tensors.

DTensor params (``parallelize_module`` on the "tp" dimension of a (dp, tp) DeviceMesh, with the
optimizer's ``process_group`` the "dp" group): the buckets hold each param's local tensor, the part its
tensor-parallel rank owns (``LocalTensors``), sharded over the data-parallel group like any plain param.
Gradients arrive as DTensors laid out as their params (``local_grad`` checks it) and their local tensors
are reduce-scattered over dp; the update and the all-gather write the local tensors in place, so the
params stay the DTensors the model holds. A param sharded over the data-parallel group itself (FSDP2's
``fully_shard``) is refused: the optimizer would shard it a second time (FusedAdam steps those).

Norms (``ShardNorm``): each rank's reduced gradient shards hold 1/dp of its local tensors' gradients.
Their sums of squares, per class of params reduced alike (distopt/dtensor.py's ``NormReduction``), are
all-reduced over the data-parallel shard group (one all-reduce, after which each class holds its local
tensors' sums), then over the mesh dimensions each class is sharded along (one small all-reduce per
tensor-parallel group): each element of the model counts once, a Replicate or plain param once. The
inf/nan flag of a rank (all its params) is shared over every one of these groups, so an inf or nan
anywhere skips the step everywhere; every rank computes the same norm and clip coefficient.

Plain tensors (Megatron-style tensor parallelism, pipeline stages): the optimizer cannot tell shards
from copies, so ``model_parallel_process_group`` (the ranks holding the other parts of the model) sums
the norm and the flag over that group too, and the caller leaves the copies out of the sum with apex's
``grad_norm(parameters=...)`` / ``clip_grad_norm(max_norm, parameters=...)``, as NeMo's
``clip_grad_norm_distributed_optimizer`` does (replicated params on tensor-parallel rank 0 only).

Checkpoints hold a DTensor param's state laid out as the param (checkpoint/placement.py); a sharded
checkpoint records each param's ``layout_text`` and must be loaded into the same layout.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from .. import ops
from ..dtensor import NormReduction, is_sharded, like_param, local, local_param_and_grad
from ..dtensor import check_params as check_dtensor_params
from .buckets import BucketRuntime
from .comm import Comm

OWNER = "DistributedFusedAdam"


def group_ranks(group: Any) -> frozenset[int]:
    """The global ranks of a process group."""
    return frozenset(dist.get_process_group_ranks(group))


def check_params(params: list[Tensor], comm: Comm, model_parallel_group: Any) -> None:
    """Raises ValueError for DTensor params this optimizer cannot step (see dtensor.check_params), for one
    sharded along a mesh dimension that holds other ranks of the data-parallel group (FSDP2: sharded
    twice; replicated along one is fine), for a `model_parallel_group` that shares ranks with that group,
    and for a mesh dimension that shares ranks with `model_parallel_group` (the norm would count it twice)."""
    check_dtensor_params(params, OWNER, offload=False)
    data_parallel = group_ranks(comm.process_group)
    model_parallel = group_ranks(model_parallel_group) if model_parallel_group is not None else frozenset()
    if len(data_parallel & model_parallel) > 1:
        raise ValueError(f"{OWNER}: model_parallel_process_group (ranks {sorted(model_parallel)}) shares ranks with "
                         f"the data-parallel process_group ({sorted(data_parallel)}): it must hold the ranks with the "
                         "other parts of the model, each of the same data-parallel replica")
    seen: dict[tuple[int, int], frozenset[int]] = {}  # (mesh id, dim) -> its ranks
    for i, p in enumerate(params):
        if not isinstance(p, DTensor):
            continue
        mesh = p.device_mesh
        for d in range(mesh.ndim):
            ranks = seen.get((id(mesh), d))
            if ranks is None:
                ranks = seen[id(mesh), d] = group_ranks(mesh.get_group(d)) if mesh.size(d) > 1 else frozenset()
            if is_sharded(p.placements[d]) and len(ranks & data_parallel) > 1:
                raise ValueError(
                    f"{OWNER}: param {i} is a DTensor sharded ({p.placements[d]}) along mesh dimension {d}, whose "
                    f"ranks {sorted(ranks)} are data-parallel for this optimizer (process_group): the optimizer "
                    "shards over those itself. For FSDP2 (fully_shard) models use distopt.FusedAdam; for tensor "
                    "parallelism pass the data-parallel mesh dimension's group as process_group")
            if len(ranks & model_parallel) > 1:
                raise ValueError(
                    f"{OWNER}: param {i} is a DTensor over mesh dimension {d} (ranks {sorted(ranks)}), which shares "
                    f"ranks with model_parallel_process_group ({sorted(model_parallel)}): DTensor params are reduced "
                    "over their meshes already; give model_parallel_process_group only the other model-parallel "
                    "ranks (e.g. pipeline stages)")


class LocalTensors(list):
    """What the buckets hold for each of `params`, in order: a DTensor param's local tensor (the very
    ``_local_tensor`` object, written in place), a plain param itself."""

    def __init__(self, params: list[Tensor]) -> None:
        super().__init__(local(p) for p in params)
        self._dtensors = [p for p in params if isinstance(p, DTensor)]
        self._locals = [local(p) for p in self._dtensors]

    def check(self, numels: list[int]) -> None:
        """Raises if a param's size changed since the bucket layout was built for `numels` (one whole-list
        comparison; none before the layout), or a DTensor param's local tensor was replaced since the
        optimizer was built (``module.to()``, ``torch.utils.swap_tensors``): the buckets would update the old one."""
        if numels and list(map(Tensor.numel, self)) != numels:
            for i, (t, numel) in enumerate(zip(self, numels)):
                if t.numel() != numel:
                    raise RuntimeError(f"param {i} changed size after the bucket layout was built "
                                       f"({t.numel()} elements now, {numel} in the layout)")
        current = map(operator.attrgetter("_local_tensor"), self._dtensors)
        if not all(map(operator.is_, current, self._locals)):
            raise RuntimeError(f"{OWNER}: a DTensor param's local tensor was replaced after the optimizer was built "
                               "(module.to(), swap_tensors): build the optimizer after moving or converting the model")


def local_grad(p: Tensor) -> Tensor:
    """``p.grad`` as the buckets take it: a DTensor param's local gradient, after checking that the
    gradient is laid out as the param (a ``Partial`` one, an unreduced sum, raises)."""
    return local_param_and_grad(p, OWNER)[1]


def as_grad(p: Tensor, view: Tensor) -> Tensor:
    """A view of a bucket (the param's local elements) as ``p.grad``: for a DTensor param, a DTensor
    laid out as it, whose in-place accumulation writes the bucket."""
    return like_param(p, lambda t: view.as_strided(t.shape, t.stride()))


class ShardNorm:
    """[sum of squares, inf/nan flag] of the whole model's gradients from this rank's reduced gradient
    shards (see the module docstring), over the params of a subset or all of them."""

    def __init__(self, params: list[Tensor], comm: Comm, model_parallel_group: Any) -> None:
        self.params = params
        self.reduction = NormReduction(params)
        self.comm = comm
        mp = model_parallel_group
        self.model_parallel_group = mp if mp is not None and dist.get_world_size(mp) > 1 else None
        self.plain = not any(isinstance(p, DTensor) for p in params)  # whole shards, one l2norm call
        self._lists: dict[frozenset[int] | None, list[tuple[list[Tensor], list[Tensor]]]] = {}

    def __call__(self, buckets: list[BucketRuntime], subset: frozenset[int] | None, state_device: torch.device,
                 device: torch.device) -> Tensor:
        """The norm's [sum of squares, flag] on `device`, from the shards on `state_device` (the host,
        with offload)."""
        if self.plain and subset is None:
            flag = torch.zeros(1, dtype=torch.float32, device=state_device)
            total, _ = ops.l2norm([b.state.grad for b in buckets], found_inf=flag)
            result = torch.cat([total.square().reshape(1), flag]).to(device)
            self.comm.all_reduce_sum(result)
        else:
            classes = self.reduction.classes
            sums = torch.zeros(classes, dtype=torch.float32, device=state_device)
            flags = torch.zeros_like(sums)
            for k, (summed, flagged) in enumerate(self._class_lists(buckets, subset)):
                if summed:
                    total, _ = ops.l2norm(summed, found_inf=flags[k:k + 1])
                    sums[k] = total.square()
                if flagged:
                    ops.l2norm(flagged, found_inf=flags[k:k + 1])
            flags.copy_(flags.amax().expand(classes))  # this rank's verdict, shared over every class's groups
            values = torch.cat([sums, flags]).to(device)
            self.comm.all_reduce_sum(values)
            result = self.reduction.reduce(values[:classes], values[classes:])
            # A replicated param's sum is its own rank's, inf or nan included: where any rank saw one, every
            # rank's norm is nan alike.
            result[0].masked_fill_(result[1] > 0, float("nan"))
        if self.model_parallel_group is not None:
            dist.all_reduce(result, group=self.model_parallel_group)
        return result

    def _class_lists(self, buckets: list[BucketRuntime], subset: frozenset[int] | None
                     ) -> list[tuple[list[Tensor], list[Tensor]]]:
        """Per class: (gradient-shard ranges summed, ranges only checked for inf/nan). Adjacent
        fragments alike make one range (the padding between them holds zeros). Made once per subset."""
        lists = self._lists.get(subset)
        if lists is not None:
            return lists
        if len(self._lists) >= 8:  # subsets that change every call: do not keep them all
            self._lists.clear()
        lists = self._lists[subset] = [([], []) for _ in range(self.reduction.classes)]
        for b in buckets:
            run: list[Any] = []  # [class, summed, start, end]
            for f in sorted(b.fragments, key=operator.attrgetter("shard_offset")):
                kind = (self.reduction.class_of[f.param], subset is None or f.param in subset)
                if run and (run[0], run[1]) == kind:
                    run[3] = f.shard_offset + f.numel
                    continue
                if run:
                    lists[run[0]][0 if run[1] else 1].append(b.state.grad[run[2]:run[3]])
                run = [*kind, f.shard_offset, f.shard_offset + f.numel]
            if run:
                lists[run[0]][0 if run[1] else 1].append(b.state.grad[run[2]:run[3]])
        return lists


def layout_text(p: Tensor) -> str | None:
    """A DTensor param's layout (placements and mesh shape), which a sharded checkpoint must match."""
    if not isinstance(p, DTensor):
        return None
    return f"placements {tuple(p.placements)} on a mesh of shape {tuple(p.device_mesh.shape)}"
