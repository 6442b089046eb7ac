"""DistributedFusedAdam: ZeRO-2 Adam/AdamW (sharded gradients and optimizer state) on torch.distributed.

The class holds the options and the public methods (torch.optim's, apex's) and delegates. What it shards
lives in runtime.py's ShardRuntime (params, layout, buckets, gradient and param sync, step counter),
which update.py (the fused update), state_view.py (``opt.state``) and agreement.py (the ranks' check)
take; checkpoints (checkpoint/) see this class only through its ShardedOptimizer methods below.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from ..grad_scaling import GradScaling
from ..state_dicts import load_with_hooks, state_dict_with_hooks
from ..validation import check_adam_hyperparameters, reconcile_weight_decay_switch
from . import agreement, checkpoint, torch_compat, update
from .buckets import BucketRuntime
from .comm import Comm
from .moments import ShardMoments
from .options import Storage, check_options
from .runtime import ShardRuntime
from .state_view import StateView, memory_report

# GradScaler.step passes itself to our step(grad_scaler=...) and warns that it will stop doing so; its
# replacement (attributes) cannot work for an optimizer whose grads the scaler never sees.
warnings.filterwarnings("ignore", message="GradScaler is going to stop passing itself", category=FutureWarning)


class DistributedFusedAdam(GradScaling, torch.optim.Optimizer):
    """Adam/AdamW with gradients and optimizer state sharded over data-parallel ranks (ZeRO-2).

    Use it instead of wrapping the model in DDP: every rank runs the same model on its own batch;
    gradients are averaged by reduce-scatters that overlap the backward pass, each rank updates its
    shard with one fused kernel, and the updated params are all-gathered into the model.

    On a one-rank shard group (world size 1, or hybrid sharding with shards of one rank) the
    reduce-scatter and all-gather are the identity and are skipped: gradients accumulate into the
    shard and the update writes the model params in place, bit for bit what FusedAdam computes.

    Names follow apex's DistributedFusedAdam, so apex users switch by changing an import; every
    torch.optim.AdamW argument is accepted too. Defaults:
      lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2: torch.optim.AdamW's.
      adam_w_mode=None (True): decoupled weight decay (AdamW); False adds it to the gradient (Adam).
        torch's decoupled_weight_decay is the same switch (given both, they must agree).
      maximize=False: per param group, as in torch. amsgrad=False, differentiable=False: True raises
        ValueError (so does such a param-group key changed later, at the next step(), before anything
        changes). foreach=None, fused=None: any value; they change nothing (always the fused kernel).
      dtype=torch.float32: optimizer state dtype (only fp32 is supported).
      grad_sync_dtype=None: each param's own dtype (a bf16 model reduces bf16 grads, never silently
        widened); set torch.float32 for fp32 reductions of a 16-bit model.
      param_sync_dtype=None: each param's own dtype, likewise for the param all-gather.
      process_group=None: the data-parallel group (default: the world). DTensor params of a tensor-parallel
        mesh stay DTensors, their local parts sharded over it (tensor_parallel.py; FSDP2's: use FusedAdam).
      distributed_process_group=None: shard state over this group (default: process_group).
      redundant_process_group=None: replicas of each shard (hybrid sharding): gradients are
        reduce-scattered in the distributed group and then summed across replicas.
      model_parallel_process_group=None: the other model-parallel ranks (Megatron-style tensor parallelism
        with plain tensors, pipeline stages): norms and the inf/nan verdict sum over it (tensor_parallel.py).
      average_grad_sync=True: average gradients over data-parallel ranks (as DDP); False sums them.
      overlap_grad_sync=True: start each bucket's reduce-scatter during backward, as soon as all its
        grads have arrived; False starts them all in step() (or grad_sync()).
      overlap_param_sync=False: defer each bucket's all-gather to a forward pre-hook of the first module
        that uses it, prefetching the next; False gathers at the end of step().
      bucket_cap_mb=100: MiB of gradients (in grad_sync_dtype) per bucket.
      pipeline_size=2: reduce-scatters in flight before the oldest is waited for.
      contiguous_grad_buffer=False: keep the full-size gradient buckets allocated between steps (no
        per-step allocation); under no_sync() param.grad is then a view of its bucket.
      contiguous_param_buffer=False: make every param a view of a persistent bucket buffer, so the
        all-gather writes the model params directly (needs param_sync_dtype == param dtype).
      store_params=None: keep an fp32 master copy of this rank's shard of params where one is needed:
        for params that are not fp32 or are synchronised in another dtype. An fp32 model synchronised in
        fp32 is its own master (its shard is read back from the params each step), so sharding saves
        the most. True keeps masters for every param (apex's default); False never does (16-bit params
        are then updated directly, losing updates below their precision; needs param_sync_dtype equal
        to the param dtype).
      store_param_remainders=False: for bf16 params synchronised in bf16, keep only the int16 low
        halves of the fp32 masters (the bf16 params are the high halves): fp32-exact updates for 2
        bytes per element. Other params in the same model follow store_params.
      capturable=False: True keeps lr (``group["lr"]`` becomes a float32 GPU tensor that schedulers
        update in place), the step count, the inf/nan flag and the unscale/clip factors on the GPU,
        with no host synchronisation anywhere, so a whole training step (backward with its
        reduce-scatters, unscale, clip, step, all-gather) can be captured in one CUDA graph. CUDA only.
        With overlap_param_sync the param buffers then stay allocated between steps (the graph's
        forward gathers what its step wrote).
      offload_optimizer=False: keep this rank's fp32 masters, moments and grad shard in host memory
        (pinned for GPU params), as DeepSpeed's ZeRO-Offload: each reduced grad shard is copied to the
        host as its reduce-scatter lands (overlapping the rest of backward), the fused CPU kernel
        updates the shard, and the new param slice is copied back for the all-gather. Device memory
        then holds only the model, its grads in flight and the sync buffers. Same numbers as
        store_params=True without offload (the CPU and GPU kernels compute the same bits); same state
        dicts. Not with capturable (a CUDA graph cannot hold the host update), store_params=False or
        store_param_remainders (both drop the masters the host update needs).
      exp_avg_dtype=torch.float32, exp_avg_sq_dtype=torch.float32, stochastic_rounding=False: the
        moments' storage and bf16 rounding, as FusedAdam's (bf16; torch.uint8: 8-bit blockwise, params
        under 4,096 elements keep fp32), the same bits at every world size and bucket size (moments.py).

    Loss scaling and clipping (see distopt/grad_scaling.py) are folded into the update: ``grad_norm()``,
    ``clip_grad_norm(max_norm)`` and ``unscale_grads(grad_scaler)`` never touch the gradients
    themselves. With the stock ``torch.amp.GradScaler``, ``scaler.step(opt)`` passes itself to
    ``step(grad_scaler=...)``; a step whose gradients hold inf/nan on any rank changes nothing on
    every rank, and ``scaler.update()`` backs off. (torch marks that keyword deprecated in favour of
    attributes that cannot carry the inf flag of gradients it never sees; its FutureWarning is
    silenced for this optimizer.) Without ``capturable``, a step with a scaler reads the inf flag on
    the host once.

    Unlike torch.optim.AdamW, which skips params whose .grad is None, every trainable param is
    updated each step: a param that got no gradient on any rank gets a zero gradient (weight decay
    and momentum still apply), as in FSDP and apex. Params with requires_grad=False are not updated.

    ``opt.state`` (state_view.py) is a read-only view of what this rank holds, built on access with no
    communication. Every trainable param has an entry from construction on (so torch's
    ``get_state_dict`` never takes its initialising zero-grad step): ``step`` (float32 scalar; with
    capturable, the live GPU counter) and ``exp_avg``, ``exp_avg_sq``, ``param`` (fp32 master): 1-D fp32
    tensors of this rank's elements of the param in its memory order, empty where it holds none (or
    before the layout is built); views of the shard where it holds those values, else copies (``step``; a
    param split over buckets; ``param`` of 16-bit params without stored masters). Writes that would
    change nothing raise: in place to a copy, assigning keys. Frozen params read as {}. torch.optim's
    hooks fire as on torch's optimizers. It cannot be deep-copied or pickled: use ``state_dict()``.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        adam_w_mode: bool | None = None,
        decoupled_weight_decay: bool | None = None,
        maximize: bool = False,
        foreach: bool | None = None,
        fused: bool | None = None,
        differentiable: bool = False,
        dtype: torch.dtype = torch.float32,
        grad_sync_dtype: torch.dtype | None = None,
        param_sync_dtype: torch.dtype | None = None,
        process_group=None,
        distributed_process_group=None,
        redundant_process_group=None,
        model_parallel_process_group=None,
        average_grad_sync: bool = True,
        overlap_grad_sync: bool = True,
        overlap_param_sync: bool = False,
        bucket_cap_mb: float = 100.0,
        pipeline_size: int = 2,
        contiguous_grad_buffer: bool = False,
        contiguous_param_buffer: bool = False,
        store_params: bool | None = None,
        store_param_remainders: bool = False,
        capturable: bool = False,
        offload_optimizer: bool = False,
        exp_avg_dtype: torch.dtype = torch.float32,
        exp_avg_sq_dtype: torch.dtype = torch.float32,
        stochastic_rounding: bool = False,
    ) -> None:
        check_adam_hyperparameters(lr, betas, eps, weight_decay)
        self._storage = Storage(store_params, store_param_remainders, offload_optimizer)
        check_options(dtype, grad_sync_dtype, param_sync_dtype, bucket_cap_mb, pipeline_size, self._storage, capturable)
        options = torch_compat.option_defaults(adam_w_mode, decoupled_weight_decay, maximize, amsgrad, foreach, fused,
                                                differentiable, capturable)
        self._moments = ShardMoments(exp_avg_dtype, exp_avg_sq_dtype, stochastic_rounding, offload_optimizer)
        self.exp_avg_dtype, self.exp_avg_sq_dtype, self.stochastic_rounding = self._moments.options()
        self.capturable = capturable  # add_param_group checks groups against it
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **options,
                                      **self._moments.defaults()))
        self.comm = Comm(process_group, distributed_process_group, redundant_process_group)
        self.grad_sync_dtype = grad_sync_dtype
        self.param_sync_dtype = param_sync_dtype
        self.average_grad_sync = average_grad_sync
        self.overlap_grad_sync = overlap_grad_sync
        self.overlap_param_sync = overlap_param_sync
        self.bucket_cap_mb = bucket_cap_mb
        self.pipeline_size = pipeline_size
        self.contiguous_grad_buffer = contiguous_grad_buffer
        self.contiguous_param_buffer = contiguous_param_buffer
        self.store_param_remainders = store_param_remainders
        self.store_params = store_params
        self.offload_optimizer = offload_optimizer
        self.model_parallel_process_group = model_parallel_process_group

        # The sharded state: params, layout, buckets, synchronisation, step counter (runtime.py).
        self._runtime = ShardRuntime(
            self.param_groups, self.comm, self._storage, self._moments, grad_sync_dtype=grad_sync_dtype,
            param_sync_dtype=param_sync_dtype, model_parallel_group=model_parallel_process_group,
            average_grad_sync=average_grad_sync, overlap_grad_sync=overlap_grad_sync,
            overlap_param_sync=overlap_param_sync, pipeline_size=pipeline_size,
            contiguous_grad_buffer=contiguous_grad_buffer, contiguous_param_buffer=contiguous_param_buffer,
            capturable=capturable)
        self.device = self._runtime.device
        self.state_device = self._runtime.state_device  # where the shard state lives (the host, with offload)
        self.state = StateView(self._runtime)  # replaces torch's defaultdict: see the class docstring
        if capturable:
            for g in self.param_groups:
                g["lr"] = torch.as_tensor(g["lr"], dtype=torch.float32).to(self.device)
        self._init_grad_scaling(self.device)
        self._graph_lrs: list[Tensor] | None = None  # the lr tensors a captured CUDA graph reads

    # ------------------------------------------------------------------ setup

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if hasattr(self, "_runtime"):  # set once the constructor's own groups are in
            raise RuntimeError("DistributedFusedAdam cannot add param groups after construction: "
                               "the bucket layout covers the params it was built with")
        index = len(self.param_groups)
        reconcile_weight_decay_switch(param_group, f"param group {index}: ")
        super().add_param_group(param_group)
        g = self.param_groups[-1]
        try:
            check_adam_hyperparameters(g["lr"], g["betas"], g["eps"], g["weight_decay"])
            torch_compat.check_group_options(g, self.capturable, f"param group {index}: ")
        except ValueError:
            self.param_groups.pop()
            raise

    def init_params(self, params: Iterable[Tensor] | None = None, *, grad_sync_dtype: torch.dtype | None = None,
                    param_sync_dtype: torch.dtype | None = None) -> None:
        """Lays out `params` (default: every param not laid out yet) next, in the given order: the
        order their gradients become ready, roughly reverse forward order. As apex's: callable several
        times on disjoint subsets; params already laid out are skipped; `grad_sync_dtype` and
        `param_sync_dtype` override the optimizer's for these params only (mixed-dtype models; a
        param synchronised in another dtype than its own keeps an fp32 master). The layout is built
        once every param is placed; params never named are added at the first backward's end in
        gradient order (or, with ``params=None``, now, in reverse param-group order)."""
        self._declare(params, grad_sync_dtype, param_sync_dtype, fresh=False)

    def init_params_bucket(self, params: Iterable[Tensor], *, grad_sync_dtype: torch.dtype | None = None,
                           param_sync_dtype: torch.dtype | None = None) -> None:
        """As ``init_params``, but `params` get fresh buckets of their own, one per sync dtype, large
        enough to hold them whole (apex's ``init_params_bucket``)."""
        self._declare(params, grad_sync_dtype, param_sync_dtype, fresh=True)

    def _declare(self, params: Iterable[Tensor] | None, grad_sync_dtype: torch.dtype | None,
                 param_sync_dtype: torch.dtype | None, fresh: bool) -> None:
        if self._runtime.layout is not None:
            raise RuntimeError("init_params: the bucket layout is already built (the first backward or step builds "
                               "it): lay params out before that")
        params_are_masters = self.store_params is False or self.contiguous_param_buffer
        if self._runtime.packing.declare(params, grad_sync_dtype, param_sync_dtype, fresh, params_are_masters):
            self._build_layout()

    def _build_layout(self) -> None:
        """Builds the bucket layout once every rank has the same rounding seeds and agrees it was
        constructed alike (agreement.py): its collectives assume identical buckets everywhere."""
        rt = self._runtime
        self._moments.agree_seeds(self.param_groups, self.comm, self.device)  # before agreement compares them
        agreement.check(rt, self.param_groups, {name: getattr(self, name) for name in agreement.OPTIONS})
        rt.build_layout(self.bucket_cap_mb)

    # ------------------------------------------------------------------ gradients

    def grad_sync(self) -> None:
        """Finishes gradient synchronisation: starts the reduce-scatters backward did not (in bucket
        order, with zeros for params that got no grad), then waits for all of them."""
        if self._runtime.grads.in_no_sync:
            raise RuntimeError("grad_sync() inside no_sync(): leave the no_sync() block first")
        if self._runtime.layout is None:
            self._build_layout()
        if self._runtime.grads.sync():
            self._agree_on_iteration(dropped=False)

    def no_sync(self):
        """Accumulates gradients locally (no communication) for the backward passes inside; the first
        backward after the block synchronises the sum, as DDP.no_sync()."""
        return self._runtime.grads.no_sync()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drops all gradients: model .grad, unsynchronised buckets and reduced shards."""
        if self._runtime.grads.clear():
            self._agree_on_iteration(dropped=True)
        self._reset_grad_scaling()

    def _agree_on_iteration(self, dropped: bool) -> None:
        """One tiny all-reduce per synchronising iteration (see agreement.check_iteration); none for
        one rank, or capturable steps, which must not read the device."""
        if self.comm.data_parallel_size > 1 and not self.capturable:
            agreement.check_iteration(self.comm, self.device, dropped)

    # ------------------------------------------------------------------ step

    @torch.no_grad()
    def step(self, closure=None, *, grad_scaler=None):
        """Finishes grad sync, updates this rank's shard with one fused kernel per group, then
        all-gathers the params (or leaves that to the next forward with overlap_param_sync).
        `grad_scaler` is passed by ``GradScaler.step``; inf/nan gradients skip the step everywhere."""
        rt = self._runtime
        if rt.grads.in_no_sync:
            raise RuntimeError("step() inside no_sync(): leave the no_sync() block first")
        for g in self.param_groups:  # before the closure's backward starts any reduction
            check_adam_hyperparameters(g["lr"], g["betas"], g["eps"], g["weight_decay"])
        torch_compat.check_groups(self.param_groups, self.capturable)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        rt.tensors.check(rt.layout_numels)
        self.param_sync()  # a deferred all-gather must land before the buffers are rewritten
        self._check_capture()
        self.grad_sync()
        rt.grads.zero_stale_shards()

        found_inf = None
        if grad_scaler is not None:
            found_inf = self._settle_with_scaler(grad_scaler)
        else:
            self._catch_up_with_scaler()
            if self._scaling.unscaled:
                self._raw_grad_norm()
                found_inf = self._found_inf
        grad_scale = self.deferred_grad_scale()
        if self.capturable:
            rt.step_tensor.add_(1.0 - found_inf if found_inf is not None else 1.0)
        elif found_inf is not None and found_inf.item() != 0:  # every rank reads the same flag
            self._end_step()
            return loss
        else:
            rt.steps += 1
        update.update_shards(rt, self.param_groups, grad_scale, found_inf if self.capturable else None,
                             self._graph_lrs)
        self._end_step()

        # capturable: a skipped step must write nothing back into the params
        rt.param_sync.after_step(found_inf if self.capturable else None)
        return loss

    def _end_step(self) -> None:
        self._runtime.end_step()
        self._reset_grad_scaling()

    def _check_capture(self) -> None:
        if self.capturable and torch.cuda.is_current_stream_capturing():
            if self._runtime.layout is None:
                raise RuntimeError("DistributedFusedAdam: run a few eager steps before capturing a CUDA graph: "
                                   "the first step builds the bucket layout and allocates the optimizer state")
            self._graph_lrs = [update.graph_safe_lr(self.param_groups, self._graph_lrs, i, self.device)
                               for i in range(len(self.param_groups))]
        elif torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("DistributedFusedAdam.step() is being captured in a CUDA graph: construct the "
                               "optimizer with capturable=True (the eager step reads the inf flag on the host)")

    # ------------------------------------------------------------------ norms and scaling

    def _grads_key(self) -> int:
        # Reductions still in flight (or not started) would change the shards: land them first, so
        # the count of landed reductions names the grads the norm sees.
        self.grad_sync()
        self._runtime.grads.zero_stale_shards()
        return self._runtime.grads.version

    def _norm_sq_and_flag(self, subset: frozenset[int] | None = None) -> Tensor:
        """[sum of squares, inf/nan count] of the whole model's reduced grad shards (tensor_parallel.py)."""
        return self._runtime.norm_sq_and_flag(subset)

    def _norm_index(self) -> dict[Tensor, int]:
        return self._runtime.index

    # ------------------------------------------------------------------ param sync

    def param_sync(self) -> None:
        """Finishes every deferred param all-gather (overlap_param_sync)."""
        self._runtime.param_sync.finish()

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self, gather_on_rank0: bool = False, *, sharded: bool | None = None) -> dict[str, Any] | None:
        """Per-param state (fp32 ``param``, ``exp_avg``, ``exp_avg_sq`` in each param's shape, on the
        CPU; ``step``; ``param_groups``), the same whatever the world size, bucket size or init order,
        and loadable by torch.optim.AdamW. Every rank must call it (it all-gathers bucket by bucket);
        with `gather_on_rank0` only rank 0 assembles it (the others return None). `sharded` (default:
        True inside ``checkpoint.sharded_state_dicts(self)``): each state tensor holds only this rank's
        elements, as views of its shard, for torch.distributed.checkpoint (checkpoint/dcp_state.py). Hooks fire."""
        return state_dict_with_hooks(self, lambda: checkpoint.state_dict(self, gather_on_rank0, sharded))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads either form of ``state_dict()`` (the whole one saved under any world size; the sharded
        one as ``dcp.load`` fills it) or a torch.optim.AdamW/Adam or FusedAdam state dict, keyed by param
        position or (as torch.distributed.checkpoint's ``get_state_dict`` makes them) by the names its
        param_groups list; checks everything before changing anything. Every rank must call it."""
        load_with_hooks(self, state_dict, lambda sd: checkpoint.load_state_dict(self, sd))

    def __reduce_ex__(self, protocol: int):
        raise TypeError("DistributedFusedAdam cannot be copied or pickled: it holds process groups, autograd "
                        "and module hooks, and this rank's shard of the state. Use state_dict() (or "
                        "distopt.distributed.checkpoint.save) and build a new optimizer to load it into.")

    # What checkpoints read and write, and nothing more (checkpoint/protocol.py: ShardedOptimizer).

    @property
    def step_count(self) -> int:
        """Steps taken (a skipped inf/nan step does not count); bias correction uses it."""
        return self._runtime.step_count

    @step_count.setter
    def step_count(self, value: int) -> None:
        self._runtime.step_count = value

    def checkpoint_params(self) -> list[Tensor]:
        """The trainable params; bucket fragments name them by their position in this list."""
        return self._runtime.params

    def checkpoint_tensors(self) -> list[Tensor]:
        """What the buckets hold of each trainable param: the param, or a DTensor param's local tensor."""
        return self._runtime.tensors

    def checkpoint_indices(self) -> list[int]:
        """Each trainable param's position in ``param_groups`` (its key in state dicts)."""
        return self._runtime.positions(self.param_groups)

    def shard_buckets(self, build: bool = True) -> list[BucketRuntime]:
        """This rank's buckets, with every deferred param all-gather landed; builds the whole layout
        first (``init_params()``) where there is none yet, unless `build` is False (then: [])."""
        self.param_sync()
        if self._runtime.layout is None and build:
            self.init_params()
        return self._runtime.buckets

    def publish_params(self) -> None:
        """Writes the model params from the buckets' param slices, as after a step (at once, or
        before the next forward with overlap_param_sync)."""
        self._runtime.param_sync.after_step(None, publish=True)

    # ------------------------------------------------------------------ reporting

    def memory_report(self) -> dict[str, int]:
        """This rank's persistent optimizer memory in bytes, by category (and the total)."""
        return memory_report(self._runtime.buckets, self.contiguous_grad_buffer, self.offload_optimizer)
