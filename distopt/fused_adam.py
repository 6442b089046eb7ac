"""FusedAdam: a drop-in for ``torch.optim.AdamW`` (and ``Adam``) running distopt's fused kernel."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from . import ops
from ._state_dicts import check_saved_groups, restore_hyperparameters
from ._validation import (
    FLOAT_DTYPES,
    check_adam_hyperparameters,
    check_graph_lr,
    check_param_tensors,
    check_unique_params,
)
from .grad_scaling import GradScaling


class FusedAdam(GradScaling, torch.optim.Optimizer):
    """Adam/AdamW whose whole update (grad unscale, moments, bias correction, param write and the
    model-precision copy) is one fused multi-tensor pass per group of same-dtype tensors.

    Args mirror ``torch.optim.AdamW``; defaults are AdamW's (lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
    weight_decay=1e-2):
      adam_w_mode: True (default) decouples weight decay (AdamW); False adds it to the gradient
        (``torch.optim.Adam``). Stored per param group, so groups may differ.
      master_weights: keep fp32 master copies of fp16/bf16 params in ``state[p]["param"]``;
        the update runs on the masters and writes the model params in the same pass. Off by default:
        16-bit params are then updated directly (fp32 math, one rounding per step, as torch does).
      capturable: keep lr (as a float32 tensor in ``group["lr"]``) and each param's step on the GPU
        and never synchronise, so ``step()`` can be captured in a CUDA graph. Requires CUDA params.
        LR schedulers keep working: they update the lr tensor in place, and a graph replays with it.

    State uses torch's format: ``step`` (float32 scalar tensor; on the CPU unless capturable),
    ``exp_avg`` and ``exp_avg_sq`` (fp32, the param's shape and memory format), so state dicts move
    between this class and ``torch.optim.AdamW`` both ways.

    Works with the stock ``torch.amp.GradScaler``: ``scaler.step(opt)`` hands over the scale and the
    inf flag; the unscale is folded into the update and a step with inf/nan grads changes nothing.
    Without ``capturable`` that costs one read of the flag on the host (the same synchronisation the
    scaler makes for any optimizer); with ``capturable`` there is none. ``unscale_grads``,
    ``grad_norm`` and ``clip_grad_norm`` (distopt/grad_scaling.py) fold unscaling and clipping into
    the update too, instead of rewriting the gradients.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float | Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        adam_w_mode: bool = True,
        master_weights: bool = False,
        capturable: bool = False,
    ) -> None:
        check_adam_hyperparameters(lr, betas, eps, weight_decay)
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, adam_w_mode=adam_w_mode)
        self.master_weights = master_weights
        self.capturable = capturable
        super().__init__(params, defaults)  # checks each group through add_param_group
        self._init_grad_scaling(self._device)
        self._graph_lrs: list[Tensor] | None = None  # the lr tensors a captured CUDA graph reads

    def _check_params(self, params: list[Tensor]) -> None:
        self._device = check_param_tensors(params, "FusedAdam") or torch.device("cpu")
        if self.capturable and self._device.type != "cuda":
            raise ValueError(
                f"FusedAdam(capturable=True) needs CUDA params (CUDA-graph capture), got params on {self._device}"
            )

    @staticmethod
    def _device_lr(lr: float | Tensor, device: torch.device) -> Tensor:
        if isinstance(lr, Tensor):
            if lr.device == device and lr.dtype == torch.float32:
                return lr
            return lr.detach().to(device=device, dtype=torch.float32)
        return torch.tensor(float(lr), dtype=torch.float32, device=device)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            all_params = [p for g in self.param_groups for p in g["params"]]
            check_unique_params(all_params)
            self._check_params(all_params)
            check_adam_hyperparameters(group["lr"], group["betas"], group["eps"], group["weight_decay"])
        except Exception:
            self.param_groups.pop()  # a rejected group leaves the optimizer as it was
            raise
        if self.capturable:
            group["lr"] = self._device_lr(group["lr"], self._device)

    # ------------------------------------------------------------------ step

    def _uses_master(self, p: Tensor) -> bool:
        return self.master_weights and p.dtype != torch.float32

    def _init_state(self, p: Tensor) -> dict[str, Any]:
        state = self.state[p]
        if not state:
            if self.capturable and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    "FusedAdam: optimizer state is created by the first step; run one eager step "
                    "before capturing step() in a CUDA graph"
                )
            step_device = p.device if self.capturable else torch.device("cpu")
            state["step"] = torch.zeros((), dtype=torch.float32, device=step_device)
            state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
            if self._uses_master(p):
                state["param"] = p.detach().float()
        return state

    @staticmethod
    def _check_grad(p: Tensor) -> Tensor:
        g = p.grad
        if g.is_sparse:
            raise RuntimeError("FusedAdam does not support sparse gradients")
        if g.is_complex() or g.dtype not in FLOAT_DTYPES:
            raise RuntimeError(f"FusedAdam: gradients must be float32, float16 or bfloat16, got {g.dtype}")
        if g.shape != p.shape or g.device != p.device:
            raise RuntimeError(f"FusedAdam: a gradient of shape {tuple(g.shape)} on {g.device} does not match "
                               f"its param ({tuple(p.shape)} on {p.device})")
        if g.stride() != p.stride():
            # The kernel walks every list in the param's memory order.
            g = torch.empty_like(p, dtype=g.dtype).copy_(g)
        return g

    @torch.no_grad()
    def step(self, closure=None):
        """One update of every param that has a gradient. ``closure`` re-evaluates the loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()

        # Everything is checked before anything (state included) is touched.
        work = []
        for group in self.param_groups:
            check_adam_hyperparameters(group["lr"], group["betas"], group["eps"], group["weight_decay"])
            params = [p for p in group["params"] if p.grad is not None]
            work.append((group, params, [self._check_grad(p) for p in params]))

        grad_scale, found_inf = self._amp_scalars()
        if found_inf is not None and not self.capturable and found_inf.item() != 0:
            self._reset_grad_scaling()
            return loss  # an inf/nan step: nothing changes, the step counters included

        for index, (group, params, grads) in enumerate(work):
            if params:
                self._step_group(index, group, params, grads, grad_scale, found_inf)
        self._reset_grad_scaling()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        self._reset_grad_scaling()

    def _amp_scalars(self) -> tuple[Tensor | None, Tensor | None]:
        """(grad scale, found_inf) for the update: the inverse of the scale ``GradScaler.step`` hands
        over through attributes, times what unscale_grads/clip_grad_norm folded in."""
        self._catch_up_with_scaler()
        scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        grad_scale = None
        if scale is not None:
            # In double, as GradScaler.unscale_ does, so both paths multiply by the same float.
            grad_scale = scale.double().reciprocal().float().to(self._device)
        if self._unscaled or self._clips:
            deferred = self.deferred_grad_scale()
            grad_scale = deferred if grad_scale is None else grad_scale * deferred
        if found_inf is not None:
            found_inf = found_inf.to(device=self._device, dtype=torch.float32).reshape(())
        elif self._unscaled:
            found_inf = self._found_inf
        return grad_scale, found_inf

    def _grads_key(self):
        return tuple((id(p.grad), p.grad._version) for g in self.param_groups for p in g["params"]
                     if p.grad is not None)

    def _norm_sq_and_flag(self) -> Tensor:
        """[sum of squares, inf/nan flag] of the current .grad tensors (one l2norm call per dtype)."""
        by_dtype: dict[torch.dtype, list[Tensor]] = defaultdict(list)
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    by_dtype[p.grad.dtype].append(p.grad)
        flag = torch.zeros(1, dtype=torch.float32, device=self._device)
        sq = torch.zeros(1, dtype=torch.float32, device=self._device)
        for grads in by_dtype.values():
            total, _ = ops.l2norm(grads, found_inf=flag)
            sq = sq + total.square()
        return torch.cat([sq, flag])

    def _step_group(self, index: int, group, params, grads, grad_scale, found_inf) -> None:
        beta1, beta2 = group["betas"]
        hyper = dict(beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                     adam_w_mode=group["adam_w_mode"], grad_scale=grad_scale)
        # One kernel call per combination of dtypes (and of step number, in eager mode).
        buckets: dict[tuple, list[tuple[Tensor, Tensor, dict]]] = defaultdict(list)
        for p, g in zip(params, grads):
            state = self._init_state(p)
            master = state.get("param")
            key = (p.dtype, g.dtype, master is not None)
            if not self.capturable:
                key += (int(state["step"].item()),)
            buckets[key].append((p, g, state))

        for key, entries in buckets.items():
            has_master = key[2]
            states = [s for _, _, s in entries]
            lists = dict(
                params=[s["param"] if has_master else p for p, _, s in entries],
                grads=[g for _, g, _ in entries],
                exp_avgs=[s["exp_avg"] for s in states],
                exp_avg_sqs=[s["exp_avg_sq"] for s in states],
                param_outs=[p for p, _, _ in entries] if has_master else (),
            )
            steps = [s["step"] for s in states]
            if self.capturable:
                check_graph_lr(self.param_groups, self._graph_lrs, index)
                lr = group["lr"] = self._device_lr(group["lr"], self._device)  # a number set after construction
                if torch.cuda.is_current_stream_capturing() and self._graph_lrs is None:
                    self._graph_lrs = [g["lr"] for g in self.param_groups]
                torch._foreach_add_(steps, 1 if found_inf is None else 1 - found_inf)
                ops.adam_step_capturable_(**lists, lr=lr, steps=steps, found_inf=found_inf, **hyper)
            else:
                ops.adam_step_(**lists, lr=float(group["lr"]), step=key[3] + 1, **hyper)
                torch._foreach_add_(steps, 1)

    # ------------------------------------------------------------------ state dicts

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a state dict of this class or of ``torch.optim.AdamW``/``Adam``.

        Moments are kept in fp32 whatever dtype they were saved in (torch saves them in the param
        dtype); a missing ``param`` is taken from the current param. A torch group's
        ``decoupled_weight_decay`` sets ``adam_w_mode``. Everything is checked before anything changes.
        """
        saved_groups = state_dict.get("param_groups")
        saved_state = state_dict.get("state")
        if not isinstance(saved_state, dict):
            raise ValueError("FusedAdam.load_state_dict: expected a dict with 'state' and 'param_groups'")
        check_saved_groups(self.param_groups, saved_groups)
        id_map: dict[Any, Tensor] = {}
        for group, saved in zip(self.param_groups, saved_groups):
            id_map.update(zip(saved["params"], group["params"]))

        new_state: dict[Tensor, dict[str, Any]] = {}
        for key, saved in saved_state.items():
            if key not in id_map:
                raise ValueError(f"loaded state refers to param {key!r}, which no param group holds")
            p = id_map[key]
            new_state[p] = self._convert_state(p, saved)

        self.state = defaultdict(dict, new_state)
        if self.capturable:  # a float set after construction becomes the device tensor first
            for group in self.param_groups:
                group["lr"] = self._device_lr(group["lr"], self._device)
        restore_hyperparameters(self.param_groups, saved_groups)

    def _convert_state(self, p: Tensor, saved: dict[str, Any]) -> dict[str, Any]:
        """One param's saved state in this optimizer's layout (fp32, param's device and strides)."""
        for name in ("step", "exp_avg", "exp_avg_sq"):
            if name not in saved:
                raise ValueError(f"loaded state for a param of shape {tuple(p.shape)} lacks {name!r}")
        out: dict[str, Any] = {}
        for name in ("exp_avg", "exp_avg_sq", "param"):
            value = saved.get(name)
            if value is None:
                continue
            if tuple(value.shape) != tuple(p.shape):
                raise ValueError(f"loaded {name} has shape {tuple(value.shape)}, its param {tuple(p.shape)}")
            out[name] = torch.empty_like(p, dtype=torch.float32).copy_(value)
        if self._uses_master(p) and "param" not in out:
            out["param"] = p.detach().float()
        if not self._uses_master(p):
            out.pop("param", None)
        step = saved["step"]
        step_value = float(step.item() if isinstance(step, Tensor) else step)
        step_device = p.device if self.capturable else torch.device("cpu")
        out["step"] = torch.tensor(step_value, dtype=torch.float32, device=step_device)
        return out
