"""Hugging Face transformers: ``DistoptTrainer``, a ``transformers.Trainer`` that trains with distopt.

Under torchrun it builds ``DistributedFusedAdam`` and leaves the model unwrapped (the optimizer
synchronises gradients; DDP would do it twice), in one process or under FSDP2 (``fsdp=True``, whose
params FusedAdam steps as DTensors; FSDP1 is refused) ``FusedAdam``: from TrainingArguments
(learning_rate, weight_decay with the Trainer's no-decay groups, adam_beta1/2, adam_epsilon) plus
``distopt_kwargs``, or the one passed in ``optimizers=``. The Trainer's loop is unchanged; its hooks
are overridden: ``max_grad_norm`` clips through ``opt.clip_grad_norm`` (folded into the update) and
the logged ``grad_norm`` is the optimizer's, accumulation runs under ``opt.no_sync()``, every rank
takes part in saving the sharded optimizer state (written crash-consistently; a failure raises on
every rank), and ``save_model`` lands deferred all-gathers (``overlap_param_sync``) on every rank
before the saving rank reads the weights. Rank 0's buffers (BatchNorm statistics) are broadcast
before each synchronising training step, as DDP does (``ddp_broadcast_buffers=False`` turns it off).
"""

from __future__ import annotations

import inspect
import os
from typing import Any

import torch
import torch.distributed as dist
import transformers
from accelerate.optimizer import AcceleratedOptimizer
from torch import nn
from transformers import Trainer
from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME
from transformers.utils import logging

from distopt import DistributedFusedAdam, FusedAdam
from distopt.distributed.buffers import BufferSync
from distopt.distributed.checkpoint.atomic_replace import SaveFailed, describe, replace_file
from distopt.distributed.comm import raise_together

logger = logging.get_logger(__name__)

_ACCEPTED = {cls: set(inspect.signature(cls).parameters) - {"params"} for cls in (FusedAdam, DistributedFusedAdam)}

# The Trainer's private hooks overridden below (all there since transformers 5.3): without one, an
# override would silently not run (no clipping, a double gradient sync), so refuse to load instead.
_HOOKS = ("_wrap_model", "_clip_grad_norm", "_get_grad_norm", "_save_optimizer_and_scheduler", "_tune_save_checkpoint")
if any(not hasattr(Trainer, hook) for hook in _HOOKS):
    raise ImportError(f"distopt.integrations.transformers needs transformers>=5.3 (Trainer hooks {_HOOKS}); "
                      f"found {transformers.__version__}")


class _DistoptAcceleratedOptimizer(AcceleratedOptimizer):
    """accelerate's wrapper, made to report a step skipped for inf/nan gradients. distopt's optimizers
    skip it inside ``step()``; accelerate only checks that ``step()`` was called, so the Trainer would
    advance the LR schedule on a skipped step (torch's optimizers are not called at all then). A
    skipped step is the one after which ``GradScaler.update()`` backs the scale off."""

    def step(self, closure=None):
        scaler = self.scaler if self.gradient_state.sync_gradients else None
        scale = scaler.get_scale() if scaler is not None else None
        super().step(closure)
        if scaler is not None:
            self._is_overflow = scaler.get_scale() < scale


class DistoptTrainer(Trainer):
    """``transformers.Trainer`` with distopt's optimizers; takes the Trainer's arguments plus
    `distopt_kwargs` (e.g. ``{"overlap_param_sync": True, "bucket_cap_mb": 25}``), passed to the
    optimizer it builds (keys only DistributedFusedAdam takes are dropped for a one-process run)."""

    def __init__(self, *args: Any, distopt_kwargs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        self.distopt_kwargs = dict(distopt_kwargs or {})
        self._buffer_sync: BufferSync | None = None
        unknown = set(self.distopt_kwargs) - _ACCEPTED[FusedAdam] - _ACCEPTED[DistributedFusedAdam]
        if unknown:
            raise TypeError(f"distopt_kwargs: unknown arguments {sorted(unknown)}")
        super().__init__(*args, **kwargs)

    # ------------------------------------------------------------------ optimizer

    def distopt_optimizer(self) -> FusedAdam | DistributedFusedAdam | None:
        """The distopt optimizer inside accelerate's wrapper, or None when training with another."""
        opt = self.optimizer
        while isinstance(opt, AcceleratedOptimizer):
            opt = opt.optimizer
        return opt if isinstance(opt, (FusedAdam, DistributedFusedAdam)) else None

    def _sharded(self) -> DistributedFusedAdam | None:
        opt = self.distopt_optimizer()
        return opt if isinstance(opt, DistributedFusedAdam) else None

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        """Builds (Distributed)FusedAdam unless one was passed, in accelerate's wrapper."""
        if self.optimizer is None and self.optimizer_cls_and_kwargs is None:
            self.optimizer = self._build_optimizer(self.model if model is None else model)
        super().create_optimizer(model)  # a passed optimizer (or optimizer_cls_and_kwargs) as the Trainer does
        inner = self.distopt_optimizer()
        if inner is not None and not isinstance(self.optimizer, AcceleratedOptimizer):
            if isinstance(inner, DistributedFusedAdam):
                self._check_sharded_setup()
            # Wrapped here rather than by accelerator.prepare: without device placement, whose
            # state_dict/load_state_dict round trip would all-gather and fix DFA's layout early.
            wrapped = _DistoptAcceleratedOptimizer(inner, device_placement=False, scaler=self.accelerator.scaler)
            wrapped._is_accelerate_prepared = True  # accelerator.prepare() registers it and keeps it as is
            self.optimizer = self.accelerator.prepare_optimizer(wrapped)
        return self.optimizer

    def _build_optimizer(self, model: nn.Module) -> FusedAdam | DistributedFusedAdam:
        args = self.args
        if self.is_fsdp_enabled and getattr(self.accelerator.state.fsdp_plugin, "fsdp_version", 1) != 2:
            # FSDP1 hands the optimizer each rank's flat shards as plain tensors: the update would be right,
            # but a norm of them is this rank's alone, and clipping goes through the optimizer here.
            raise ValueError("DistoptTrainer supports FSDP2 (fsdp_config={'version': 2}), not FSDP1; under FSDP1 "
                             "pass optimizer_cls_and_kwargs=(FusedAdam, {...}) to the stock Trainer, which clips "
                             "through FSDP1's clip_grad_norm_")
        if "adamw" not in str(getattr(args.optim, "value", args.optim)):
            logger.warning(f"DistoptTrainer trains with (Distributed)FusedAdam: optim={args.optim} is ignored")
        decay = set(self.get_decay_parameter_names(model))
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        groups = [{"params": [p for n, p in named if n in decay], "weight_decay": args.weight_decay},
                  {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]
        groups = [g for g in groups if g["params"]]
        # Under FSDP2 the data parallelism is FSDP's, and FusedAdam steps the shards it leaves.
        sharded = not self.is_fsdp_enabled and dist.is_available() and dist.is_initialized() \
            and dist.get_world_size() > 1
        if sharded:
            self._check_sharded_setup()
        cls = DistributedFusedAdam if sharded else FusedAdam
        kwargs = dict(lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon)
        kwargs.update({k: v for k, v in self.distopt_kwargs.items() if k in _ACCEPTED[cls]})
        opt = cls(groups, **kwargs)
        if sharded:
            # Fix the bucket layout now, in reverse registration order (backward order for most models,
            # as DDP's first buckets), instead of at the first backward: a run resumed from a
            # checkpoint builds it at the load, so only a layout fixed in advance is the same in both
            # and the resumed run continues bit for bit (the clipping norm sums in layout order).
            opt.init_params(reversed([p for p in model.parameters() if p.requires_grad]))
        return opt

    def _check_sharded_setup(self) -> None:
        other = [name for name, on in (("DeepSpeed", self.is_deepspeed_enabled), ("FSDP", self.is_fsdp_enabled),
                                       ("XLA FSDP", self.is_fsdp_xla_enabled), ("DataParallel", self.args.n_gpu > 1))
                 if on]
        if other:
            raise ValueError(f"DistributedFusedAdam is data parallelism in itself; it cannot run under {other[0]}. "
                             "Launch one process per device with torchrun and no DeepSpeed/FSDP config.")

    # ------------------------------------------------------------------ model and backward

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader=None) -> nn.Module:
        if training and self._sharded() is not None:
            # No DDP: the optimizer synchronises gradients. Prepared (autocast, compile) in evaluation
            # mode, which never wraps; accelerator.prepare() then keeps the model as it is.
            return self.accelerator.prepare_model(model, evaluation_mode=True)
        return super()._wrap_model(model, training, dataloader)

    def training_step(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch=None) -> torch.Tensor:
        """The Trainer's, under ``opt.no_sync()`` for micro-batches that do not end an accumulation window."""
        opt = self._sharded()
        # The Trainer marks them in sync_gradients and enters model.no_sync(), which the unwrapped model lacks.
        synchronising = opt is None or self.accelerator.sync_gradients \
            or self.accelerator.gradient_state.plugin_kwargs.get("sync_each_batch", False)
        if opt is not None and self.args.ddp_broadcast_buffers is not False:
            # Rank 0's buffers (BatchNorm statistics) when DDP would broadcast them: at the forward after
            # a synchronising one (the Trainer's evaluation never runs through DDP).
            if self._buffer_sync is None or self._buffer_sync.module is not model:
                self._buffer_sync = BufferSync(model)
            self._buffer_sync.before_forward(synchronising)
        if synchronising:
            return super().training_step(model, inputs, num_items_in_batch)
        with opt.no_sync():
            return super().training_step(model, inputs, num_items_in_batch)

    # ------------------------------------------------------------------ clipping and the logged norm

    def _unscale(self, opt: FusedAdam | DistributedFusedAdam) -> None:
        # accelerate calls the optimizer's step() through a wrapper whose signature hides the
        # grad_scaler keyword, and DFA cannot read the scale from attributes: fold the unscale in
        # here, which every optimizer step passes first (clip or norm).
        if self.accelerator.scaler is not None:
            opt.unscale_grads(grad_scaler=self.accelerator.scaler)

    def _clip_grad_norm(self, model: nn.Module) -> torch.Tensor:
        opt = self.distopt_optimizer()
        if opt is None:
            return super()._clip_grad_norm(model)
        self._unscale(opt)
        return opt.clip_grad_norm(self.args.max_grad_norm)  # DFA's grads are in its buckets, not in .grad

    def _get_grad_norm(self, model: nn.Module, grad_norm: torch.Tensor | float | None = None):
        opt = self.distopt_optimizer()
        if opt is None or grad_norm is not None:
            return super()._get_grad_norm(model, grad_norm)
        self._unscale(opt)
        return opt.grad_norm()

    # ------------------------------------------------------------------ checkpoints

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The Trainer's; call it on every rank, as the Trainer's docs say."""
        opt = self._sharded()
        if opt is not None:
            # Deferred all-gathers (overlap_param_sync) are collectives: land them on every rank, or
            # the saving rank's state_dict() would start them alone.
            opt.param_sync()
        super().save_model(output_dir, _internal_call)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        opt = self._sharded()
        if opt is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        # The stock method calls state_dict() on the saving rank only; DFA's gathers the shards.
        state = opt.state_dict(gather_on_rank0=not self.args.save_on_each_node)
        error = None
        if self.args.should_save:
            try:  # each file written beside its path and renamed over it: complete, or the previous one
                scheduler = self.lr_scheduler.state_dict()
                replace_file(os.path.join(output_dir, OPTIMIZER_NAME), lambda tmp: torch.save(state, tmp))
                replace_file(os.path.join(output_dir, SCHEDULER_NAME), lambda tmp: torch.save(scheduler, tmp))
            except Exception as exc:  # a full disk, say: every rank stops, not only the writer
                error = f"rank {self.args.process_index}: {describe(exc)}"
        raise_together(opt.comm.process_group, error, f"saving the optimizer state in {output_dir} failed", SaveFailed)
        # Loading needs no override: the Trainer loads the optimizer state on every rank.

    def _tune_save_checkpoint(self, checkpoint_dir: str) -> None:
        if self._sharded() is not None:  # it reads the optimizer state on the saving rank only: a hang
            raise NotImplementedError("Ray Tune trial checkpoints are not supported with DistributedFusedAdam")
        super()._tune_save_checkpoint(checkpoint_dir)
