"""DistributedFusedAdam's sharded state on this rank: what FSDP2's ``FSDPParamGroup`` is to ``fully_shard``.

The optimizer (optimizer.py) keeps its options and public methods and delegates; what it shards lives
here, in one object the other modules take:

* the trainable params, in param-group order (their index in ``params`` names them everywhere: layout
  pieces, fragments, hooks), what the buckets hold of each (``tensors``: a DTensor param's local tensor,
  tensor_parallel.py), each one's param group and, from the param groups, its position there (the key
  of its state in state dicts, and stochastic rounding's param id);
* the per-param sync dtypes (packing.py), the bucket layout (layout.py) and this rank's buckets with
  their shard state (buckets.py), built once, when the first backward or step needs them;
* the gradient and param synchronisation (grad_sync.py, param_sync.py), the norm over the shards
  (tensor_parallel.py), the moment formats (moments.py) and offload's host copies (distopt/offload.py);
* the step counter: a number, or with ``capturable`` a device tensor the kernel reads.

The update (update.py), ``opt.state`` (state_view.py) and the rank agreement (agreement.py) read this
object, never the optimizer's attributes; checkpoints (checkpoint/) see the optimizer only through its
``ShardedOptimizer`` methods, which read it.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import Tensor

from .. import ops
from ..offload import HOST, HostTransfers
from ..validation import check_param_tensors, check_unique_params
from .buckets import BucketRuntime, ShardState, flat
from .comm import Comm
from .grad_sync import GradSync
from .layout import DEFAULT_ALIGN, Layout, padding_advice, plan_segments
from .moments import ShardMoments
from .options import Storage, check_param_dtypes
from .packing import Packing
from .param_sync import ParamSync
from .tensor_parallel import LocalTensors, ShardNorm
from .tensor_parallel import check_params as check_tensor_parallel_params


class ShardRuntime:
    """This rank's share of one DistributedFusedAdam: its params, layout, buckets, synchronisation and
    step counter (see the module docstring). Built by the optimizer's constructor, which has checked
    the options; raises ValueError for params the options cannot step."""

    def __init__(
        self,
        param_groups: list[dict[str, Any]],
        comm: Comm,
        storage: Storage,
        moments: ShardMoments,
        *,
        grad_sync_dtype: torch.dtype | None,
        param_sync_dtype: torch.dtype | None,
        model_parallel_group: Any,
        average_grad_sync: bool,
        overlap_grad_sync: bool,
        overlap_param_sync: bool,
        pipeline_size: int,
        contiguous_grad_buffer: bool,
        contiguous_param_buffer: bool,
        capturable: bool,
    ) -> None:
        self.comm = comm
        self.storage = storage
        self.moments = moments
        self.capturable = capturable
        self.overlap_param_sync = overlap_param_sync
        self.contiguous_grad_buffer = contiguous_grad_buffer
        self.contiguous_param_buffer = contiguous_param_buffer
        self.model_parallel_group = model_parallel_group

        # The trainable params, in param-group order; their index here names them everywhere.
        self.params: list[Tensor] = [p for g in param_groups for p in g["params"] if p.requires_grad]
        self.group_of: list[int] = [i for i, g in enumerate(param_groups) for p in g["params"] if p.requires_grad]
        self.index = {p: i for i, p in enumerate(self.params)}
        self.tensors = LocalTensors(self.params)  # what the buckets hold: DTensors' local parts
        self.packing = Packing(self.params, grad_sync_dtype, param_sync_dtype)  # init_params declarations
        self.device = self._check_params(param_groups)
        check_tensor_parallel_params(self.params, comm, model_parallel_group)
        self.norm = ShardNorm(self.params, comm, model_parallel_group)
        if capturable and self.device.type != "cuda":
            raise ValueError(f"capturable=True is for CUDA-graph capture: params must be on a CUDA device, "
                             f"not {self.device}")
        self.transfers = HostTransfers(self.device) if storage.offload else None
        self.state_device = HOST if storage.offload else self.device  # where the shard state lives

        self.steps = 0  # steps taken (capturable: counted in step_tensor instead)
        self.step_tensor = torch.zeros((), dtype=torch.float32, device=self.device)  # capturable step count
        self.layout: Layout | None = None
        self.layout_numels: list[int] = []  # each param's size when the layout was built
        self.buckets: list[BucketRuntime] = []
        self.grads = GradSync(comm, self.params, overlap_grad_sync, pipeline_size, contiguous_grad_buffer,
                              average_grad_sync, self.tensors)
        # Built now, so that with overlap_param_sync it watches the first forward (see its Note).
        self.param_sync = ParamSync(comm, self.params, overlap_param_sync, self.tensors)
        if overlap_param_sync:  # check_fresh does nothing otherwise: no call per param
            self.grads.on_grad = self.param_sync.check_fresh

    def _check_params(self, param_groups: list[dict[str, Any]]) -> torch.device:
        """The params' device, after checking that the options and the process group can step them."""
        check_unique_params([p for g in param_groups for p in g["params"]])
        if not self.params:
            raise ValueError("DistributedFusedAdam got no trainable params (all have requires_grad=False)")
        device = check_param_tensors(self.tensors, "DistributedFusedAdam")
        expected = self.comm.device_type()
        if expected is not None and device.type != expected:
            raise ValueError(f"params are on {device} but the process group's backend ({self.comm.backend}) "
                             f"communicates {expected} tensors")
        dtypes = [(self.param_dtype(p), p.dtype) for p in self.params]
        check_param_dtypes(dtypes, self.storage, self.contiguous_param_buffer)
        self.moments.check_params(self.params, dtypes, self.storage)
        return device

    # ------------------------------------------------------------------ params

    def grad_dtype(self, p: Tensor) -> torch.dtype:
        """The dtype `p`'s gradients are reduced in."""
        return self.packing.grad_dtype(p)

    def param_dtype(self, p: Tensor) -> torch.dtype:
        """The dtype `p` is all-gathered in."""
        return self.packing.param_dtype(p)

    def positions(self, param_groups: list[dict[str, Any]]) -> list[int]:
        """Each trainable param's position in `param_groups` (its key in state dicts)."""
        positions = {p: i for i, p in enumerate(p for g in param_groups for p in g["params"])}
        return [positions[p] for p in self.params]

    # ------------------------------------------------------------------ step counter

    @property
    def step_count(self) -> int:
        """Steps taken (a skipped inf/nan step does not count); bias correction uses it."""
        return int(self.step_tensor.item()) if self.capturable else self.steps

    @step_count.setter
    def step_count(self, value: int) -> None:
        self.steps = int(value)
        self.step_tensor.fill_(float(value))  # in place: a captured CUDA graph keeps reading it

    # ------------------------------------------------------------------ layout and buckets

    def build_layout(self, bucket_cap_mb: float) -> None:
        """Plans the buckets from the packing declarations (rank 0's, on every rank), allocates this
        rank's buckets and their shard state, and hands them to the gradient and param sync."""
        segments = self.packing.segments(self.grads.arrival)
        # Every rank must pack identically: take rank 0's plan (backward order may differ by rank).
        segments = Packing.agreed(segments, self.comm, self.device)
        keys = [(self.grad_dtype(p), self.param_dtype(p), p.dtype, *self.moments.group_key(p)) for p in self.params]
        aligns = self.moments.aligns(keys)  # 8-bit blocks never straddle shards (moments.py)
        elem = max(torch.empty((), dtype=k[0]).element_size() for k in keys)
        bucket_numel = int(bucket_cap_mb * 2**20) // elem
        if self.contiguous_param_buffer or self.contiguous_grad_buffer:
            # Params become views of one bucket: never split one (the planner rounds capacity down
            # to whole shard units, so round the largest param up to one).
            unit = self.comm.dist_size * max([DEFAULT_ALIGN, *aligns.values()])
            bucket_numel = max(bucket_numel, -(-max(p.numel() for p in self.tensors) // unit) * unit)
        numels = [p.numel() for p in self.tensors]
        self.layout = plan_segments(segments, numels, keys, self.comm.dist_size, bucket_numel, aligns=aligns)
        self.layout_numels = numels
        if self.layout.utilization() < 0.5:
            # stacklevel: the caller of the optimizer method that built the layout
            warnings.warn(f"DistributedFusedAdam: {padding_advice(self.layout, numels, bucket_numel)}", stacklevel=4)
        self._create_buckets()

    def _create_buckets(self) -> None:
        rank = self.comm.dist_rank
        for index, spec in enumerate(self.layout.buckets):
            grad_dtype, param_dtype, model_dtype = spec.group[:3]
            b = BucketRuntime(index, spec, self.layout.fragments(rank, index), rank, self.device, grad_dtype,
                              param_dtype, self.contiguous_grad_buffer, self.contiguous_param_buffer,
                              keep_param_buffer=self.capturable and self.overlap_param_sync, local=self.comm.local,
                              transfers=self.transfers)
            b.state = ShardState.zeros(spec.shard_numel, self.device,
                                       master=self.storage.master(param_dtype, model_dtype),
                                       remainders=self.storage.remainders(param_dtype, model_dtype),
                                       host=self.transfers, moments=ShardMoments.moment_dtypes(spec.group))
            if b.state.master is not None:
                srcs = [flat(self.tensors[f.param].detach())[f.param_offset : f.param_offset + f.numel]
                        for f in b.fragments]
                dsts = [b.state.master[f.shard_offset : f.shard_offset + f.numel] for f in b.fragments]
                if self.transfers is not None:  # to the host: once, at layout time
                    for src, dst in zip(srcs, dsts):
                        dst.copy_(src)
                else:
                    ops.cast_copy_(srcs, dsts)
            if self.contiguous_param_buffer:
                b.bind_params(self.tensors)
            b.runs = self.moments.runs(b.fragments, spec.shard_numel, self.group_of)
            self.buckets.append(b)
        self.grads.attach(self.layout, self.buckets)
        self.param_sync.attach(self.layout, self.buckets)

    def end_step(self) -> None:
        """Marks every grad shard stale: the next reduction overwrites it."""
        for b in self.buckets:
            b.state.grad_valid = False

    # ------------------------------------------------------------------ norms

    def norm_sq_and_flag(self, subset: frozenset[int] | None = None) -> Tensor:
        """[sum of squares, inf/nan count] of the whole model's reduced grad shards (tensor_parallel.py)."""
        return self.norm(self.buckets, subset, self.state_device, self.device)
