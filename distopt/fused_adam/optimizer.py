"""FusedAdam: a drop-in for ``torch.optim.AdamW`` (and ``Adam``) running distopt's fused kernel."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from .. import dtensor, ops
from .. import kernel_views as views
from ..grad_scaling import GradScaling, count_step
from ..lowprec.formats import ABSMAX_KEYS, MomentFormats, codes_keyed, saved_seeds
from ..state_dicts import convert_param_state, load_with_hooks, restore_hyperparameters, saved_state_by_param
from ..validation import (
    check_adam_hyperparameters,
    check_adamw_options,
    check_graph_lr,
    check_param_tensors,
    reconcile_weight_decay_switch,
    weight_decay_mode,
)
from . import plan
from .general_step import GeneralStep
from .host_step import STATE_TENSORS, HostStep
from .moments import MomentState
from .traced_step import TracedStep

# Attributes that pickle and deepcopy carry besides torch's (defaults, state, param_groups). Hooks are
# dropped, as torch.optim does; the GradScaler weakref and the caches are rebuilt (see __setstate__).
_PICKLED = ("master_weights", "capturable", "offload_optimizer", "_moments", "_device", "_inv_scale", "_clip_coef",
            "_found_inf", "_scaling")
_TRANSIENT = ("_scaler", "_graph_lrs", "_plan", "_host")


class FusedAdam(GradScaling, GeneralStep, TracedStep, torch.optim.Optimizer):
    """Adam/AdamW whose whole update (grad unscale, moments, bias correction, param write and the
    model-precision copy) is one fused multi-tensor pass per group of same-dtype tensors.

    Takes every ``torch.optim.AdamW`` argument, with AdamW's defaults (lr=1e-3, betas=(0.9, 0.999),
    eps=1e-8, weight_decay=1e-2, amsgrad=False, maximize=False, foreach=None, capturable=False,
    differentiable=False, fused=None), and torch.optim.Adam's ``decoupled_weight_decay``; param groups
    carry the same keys as AdamW's (plus ``adam_w_mode``), read at every ``step()``:
      maximize: ascend the objective (the kernel negates the gradient). Per group.
      adam_w_mode / decoupled_weight_decay: one switch under two names (apex's and torch's), kept equal
        in every group: True (default) decouples weight decay (AdamW); False adds it to the gradient
        (``torch.optim.Adam``). Giving both with different values raises ValueError. Per group.
      foreach, fused: accepted (None, True or False) and change nothing: the update is always
        distopt's fused multi-tensor kernel.
      amsgrad, differentiable: only False; True raises ValueError (no AMSGrad moment, no backward). A
        group whose option is changed to an unsupported value makes ``step()`` raise before anything
        changes.
      master_weights: keep fp32 master copies of fp16/bf16 params in ``state[p]["param"]``;
        the update runs on the masters and writes the model params in the same pass. Off by default:
        16-bit params are then updated directly (fp32 math, one rounding per step, as torch does).
      capturable: keep lr (as a float32 tensor in ``group["lr"]``) and each param's step on the GPU
        and never synchronise, so ``step()`` can be captured in a CUDA graph. Requires CUDA params.
        LR schedulers keep working: they update the lr tensor in place, and a graph replays with it.
        Set for the whole optimizer: ``group["capturable"]`` only mirrors it (torch.compile sets it
        to True itself for CUDA params, which changes nothing here).
      offload_optimizer: keep every param's fp32 master (``state["param"]``, fp32 params included) and
        both moments in host memory (pinned for CUDA params) and run the update there: each step
        copies the grads to the host, runs the fused CPU kernel (the same math, hence the same bits
        as ``master_weights=True`` on the device) and copies the new params back
        (distopt/fused_adam/host_step.py).
        Not with ``capturable`` (ValueError). Under torch.compile the step runs eagerly (a graph break
        at ``step``; ``fullgraph=True`` raises).
      exp_avg_dtype, exp_avg_sq_dtype: the moments' storage (Transformer Engine's names): torch.float32
        (default), torch.bfloat16, or torch.uint8: 8-bit blockwise as bitsandbytes/torchao's (dynamic-map
        codes, one fp32 absmax per 256 elements in ``state[p]["exp_avg_absmax"]``/``"exp_avg_sq_absmax"``;
        params under 4,096 elements keep fp32), not TE's uint8 (fp8 E4M3 values, one scale per tensor).
      stochastic_rounding: every store to bf16 (bf16 moments; bf16 params without master weights, which
        then train unbiasedly) rounds stochastically, keyed by ``group["rounding_seed"]`` (saved in state
        dicts): reproducible. Both: distopt/fused_adam/moments.py (DTensors; state dicts, AdamW's fp32
        format).

    The kernel's argument lists are built once and reused (distopt/fused_adam/plan.py): a steady-state
    step does no Python work per param; adding groups, loading state or changing a param's dtype rebuilds
    them.

    Under ``torch.compile`` the step runs without graph breaks and never specialises on the step
    count: lr and the steps reach the kernel as tensors, and the state is created outside the graph
    (``_init_group``). A float lr changed by a scheduler costs one recompile (Dynamo guards on every float
    in ``param_groups``); a tensor lr (``lr=torch.tensor(1e-3)``, updated in place) costs none.

    Params: float32, float16, bfloat16, and complex64/complex32, stepped as their real views as AdamW
    steps them (the same numbers). Any strides: a param that is not dense in memory (a slice such as
    ``randn(10, 5, 2)[..., 0]``) is stepped through a contiguous copy, two copies per step for such
    params only (distopt/kernel_views.py); one whose elements share memory (expanded) raises
    ValueError. float64 and complex128 params raise TypeError: the kernels compute in float32, which
    would silently round a float64 model's updates (use torch.optim.AdamW). A param listed twice in a
    group gets torch's warning and, as in AdamW's for-loop and foreach implementations, one update per
    listing (the general step then runs every step).

    State uses torch's format: ``step`` (float32 scalar tensor; on the CPU unless capturable),
    ``exp_avg`` and ``exp_avg_sq`` (fp32, complex64 for complex params; the param's shape and memory
    format; contiguous if not dense), so state dicts move between this class and ``torch.optim.AdamW``
    both ways.

    DTensor params (FSDP2, HSDP, tensor parallelism) are updated on their local shards; their state is
    DTensors laid out as they are; norms count each element once over their meshes (distopt/dtensor.py).

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
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        decoupled_weight_decay: bool | None = None,
        adam_w_mode: bool | None = None,
        master_weights: bool = False,
        offload_optimizer: bool = False,
        exp_avg_dtype: torch.dtype = torch.float32,
        exp_avg_sq_dtype: torch.dtype = torch.float32,
        stochastic_rounding: bool = False,
    ) -> None:
        if offload_optimizer and capturable:
            raise ValueError("FusedAdam: offload_optimizer=True cannot be capturable (a CUDA graph cannot "
                             "contain the update on the host)")
        check_adam_hyperparameters(lr, betas, eps, weight_decay)
        mode = weight_decay_mode(adam_w_mode, decoupled_weight_decay, "FusedAdam: ")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize,
                        foreach=foreach, capturable=capturable, differentiable=differentiable, fused=fused,
                        decoupled_weight_decay=mode, adam_w_mode=mode)
        check_adamw_options(defaults, "FusedAdam: ")
        formats = MomentFormats(exp_avg_dtype, exp_avg_sq_dtype, stochastic_rounding)  # checked: clear errors
        self._moments = MomentState(formats, offload_optimizer)  # moments.py
        defaults.update(self._moments.defaults())  # the rounding seed (param groups carry it into state dicts)
        self.master_weights = master_weights
        self.capturable = capturable
        self.offload_optimizer = bool(offload_optimizer)
        self._host: HostStep | None = None  # built at the first use (host_step.py)
        super().__init__(params, defaults)  # checks each group through add_param_group
        self._init_grad_scaling(self._device)
        self._graph_lrs: list[Tensor] | None = None  # the lr tensors a captured CUDA graph reads
        self._plan: plan.StepPlan | None = None  # the steady state's kernel lists (plan.py)
        self._plan_epoch = 0  # bumped when the plan must go: groups added, state loaded

    def _check_params(self, params: list[Tensor]) -> None:
        self._device = check_param_tensors(params, "FusedAdam", views=True) or torch.device("cpu")
        dtensor.check_params(params, "FusedAdam", self.offload_optimizer)
        self._moments.check_params(self.param_groups, master_weights=self.master_weights)
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
        index = len(self.param_groups)
        where = f"FusedAdam param_groups[{index}]: "
        reconcile_weight_decay_switch(param_group, where)
        super().add_param_group(param_group)
        self._plan_epoch = getattr(self, "_plan_epoch", 0) + 1
        group = self.param_groups[-1]
        try:
            self._check_params([p for g in self.param_groups for p in g["params"]])
            check_adam_hyperparameters(group["lr"], group["betas"], group["eps"], group["weight_decay"])
            check_adamw_options(group, where)
        except Exception:
            self.param_groups.pop()  # a rejected group leaves the optimizer as it was
            raise
        if self.capturable:
            group["lr"] = self._device_lr(group["lr"], self._device)

    # ------------------------------------------------------------------ step

    def _uses_master(self, p: Tensor) -> bool:
        return self.offload_optimizer or (self.master_weights and p.dtype != views.state_dtype(p))

    def _host_step(self) -> HostStep:
        if self._host is None:
            self._host = HostStep(self._device, self.state)
        return self._host

    def _fp32_like(self, p: Tensor) -> Tensor:
        """Uninitialised fp32 (complex: complex64) state with `p`'s shape and layout, where the state lives."""
        if self.offload_optimizer:
            return self._host_step().fp32_like(p)
        return dtensor.like_param(p, views.state_like)  # a DTensor param's: a DTensor laid out like it

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
            if self.offload_optimizer:
                state.update(self._host_step().new_state(p))
                return state
            # Made on a DTensor param's local shard (no DTensor dispatch), then wrapped like the param.
            state.update(self._moments.new_moments(p))  # in their formats (moments.py)
            if self._uses_master(p):
                state["param"] = dtensor.like_param(p, lambda t: views.state_like(t).copy_(t.detach()))
        return state

    @torch.no_grad()
    def step(self, closure=None):
        """One update of every param that has a gradient. ``closure`` re-evaluates the loss."""
        if self.offload_optimizer:
            return self._offloaded_step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()

        self._check_groups()  # everything is checked before anything (state included) is touched
        compiling = torch.compiler.is_compiling()
        planned = None if compiling else self._planned_calls()
        work = self._work() if planned is None else None

        grad_scale, found_inf = self._amp_scalars()
        if compiling:
            self._step_traced(work, grad_scale, found_inf)  # traced_step.py
            self._reset_grad_scaling()
            return loss

        if found_inf is not None and not self.capturable and found_inf.item() != 0:
            self._reset_grad_scaling()
            return loss  # an inf/nan step: nothing changes, the step counters included

        # The first planned call's grads are checked by the kernel: if it refuses them (nothing written),
        # this step goes the general way, which takes or refuses each one with the precise error.
        if planned is not None and self._run_call(*planned[0], grad_scale, found_inf, refusable=True):
            for call, grads in planned[1:]:
                self._run_call(call, grads, grad_scale, found_inf)
        else:
            work = self._work() if work is None else work
            for work_round in views.rounds(work):  # one, unless a group lists a param twice
                for index, (group, params, grads) in enumerate(work_round):
                    if params:
                        self._step_group(index, group, params, grads, grad_scale, found_inf)
            self._plan = plan.build(self._plan_key(), self.param_groups, self.state, eager=not self.capturable,
                                    previous=self._plan)
        self._reset_grad_scaling()
        return loss

    def memory_report(self) -> dict[str, int]:
        """Bytes of the per-param state by category (``master``, ``moments``, ``staging``: offload's host
        copies), with ``device`` and ``host`` totals (offload: all of it is host memory) and ``total``."""
        keys = STATE_TENSORS + tuple(ABSMAX_KEYS.values())  # moments: 8-bit ones' codes and absmax scales
        sizes = {k: sum(dtensor.local(s[k]).nbytes for s in self.state.values() if k in s) for k in keys}
        report = {"master": sizes["param"], "moments": sum(sizes[k] for k in keys if k != "param"),
                  "staging": self._host.staging_bytes() if self._host is not None else 0}
        total = sum(report.values())
        return {**report, "device": 0 if self.offload_optimizer else total,
                "host": total if self.offload_optimizer else 0, "total": total}

    def _check_groups(self) -> None:
        for index, group in enumerate(self.param_groups):
            check_adam_hyperparameters(group["lr"], group["betas"], group["eps"], group["weight_decay"])
            check_adamw_options(group, f"FusedAdam param_groups[{index}]: ")

    @torch._disable_dynamo  # the update runs on the host: under torch.compile, eagerly (a graph break)
    def _offloaded_step(self, closure):
        """step() with offload_optimizer: the same checks, skip and scalars, the update on the host."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_groups()
        work = self._work()
        grad_scale, found_inf = self._amp_scalars()
        if found_inf is None or found_inf.item() == 0:  # an inf/nan step changes nothing
            for work_round in views.rounds(work):
                self._host_step().step(work_round, self._init_state, self._hyper, grad_scale, found_inf)
        self._reset_grad_scaling()
        return loss

    # ------------------------------------------------------------------ the planned (steady-state) step

    def _plan_key(self) -> tuple:
        return plan.plan_key(self.param_groups, self.state, self._plan_epoch)

    def _planned_calls(self) -> list[tuple[plan.Call, list[Tensor]]] | None:
        if self._plan is None:
            return None
        # A capturable step counts its steps before the kernel runs: its grads are all checked first.
        return self._plan.current(self._plan_key(), self.param_groups, self.state, check_first=self.capturable)

    def _run_call(self, call: plan.Call, grads: list[Tensor], grad_scale, found_inf,
                  refusable: bool = False) -> bool:
        """One planned kernel call: the lists of _step_group, without building them. `refusable`: the
        kernel's refusal of the grads (it checks every list before writing) returns False, nothing
        having changed; otherwise it raises."""
        group = self.param_groups[call.group]
        hyper = self._hyper(group, grad_scale)
        lists = dict(params=call.params, grads=grads, **call.moment_lists(), param_outs=call.param_outs)
        staged = ()
        if call.viewed:  # complex or not dense: their views and copies, made anew (distopt/kernel_views.py)
            lists, staged = views.kernel_lists(**lists)
        _references = call.grad_references(grads)  # (kept until this call returns)
        lists.update(self._moments.call_kwargs(call.exp_avg_scales, call.exp_avg_sq_scales, call.param_ids,
                                               call.param_offsets, group))
        if self.capturable:
            lr = self._capturable_lr(call.group)
            count_step(call.steps, found_inf)
            ops.adam_step_(**lists, lr=lr, step=call.steps, found_inf=found_inf, **hyper)
        else:
            call.count_steps(1)  # every param's step (views of one tensor), counting this update
            try:  # (lr and the step: numbers read at launch)
                ops.adam_step_(**lists, lr=float(group["lr"]), step=call.steps[0], **hyper)
            except (RuntimeError, TypeError, ValueError):
                call.count_steps(-1)  # the op checks everything before writing: undo the count
                if refusable:
                    return False
                raise
        views.write_back(staged)
        return True

    def zero_grad(self, set_to_none: bool = True) -> None:
        if torch.compiler.is_compiling():
            self._zero_grad_traced(set_to_none)  # traced_step.py
        else:
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
        if self._scaling.unscaled or self._scaling.clips:
            deferred = self.deferred_grad_scale()
            grad_scale = deferred if grad_scale is None else grad_scale * deferred
        if found_inf is not None:
            found_inf = found_inf.to(device=self._device, dtype=torch.float32).reshape(())
        elif self._scaling.unscaled:
            found_inf = self._found_inf
        return grad_scale, found_inf

    def _grads_key(self):
        # A DTensor grad's shard: FSDP2 accumulates into it in place, which leaves the DTensor's version as it was.
        return tuple((id(g), g._version) for g in (dtensor.local(p.grad) for group in self.param_groups
                                                     for p in group["params"] if p.grad is not None))

    def _norm_sq_and_flag(self, subset: frozenset[int] | None = None) -> Tensor:
        """[sum of squares, inf/nan flag] of the current .grad tensors over the whole model: DTensor grads'
        shards reduced over their meshes, each element counted once (distopt/dtensor.py); the sum over
        the params of `subset` (positions in param_groups) only."""
        params = [p for group in self.param_groups for p in group["params"]]
        state = self._scaling
        sq_and_flag, state.norm_reduction = dtensor.norm_sq_and_flag(state.norm_reduction, params, self._device,
                                                                     subset)
        return sq_and_flag

    def _norm_index(self) -> dict[Tensor, int]:
        return {p: i for i, p in enumerate(p for group in self.param_groups for p in group["params"])}

    @staticmethod
    def _hyper(group: dict[str, Any], grad_scale: Tensor | None) -> dict[str, Any]:
        beta1, beta2 = group["betas"]
        return dict(beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                    adam_w_mode=group["adam_w_mode"], maximize=group["maximize"], grad_scale=grad_scale)

    def _capturable_lr(self, index: int) -> Tensor:
        """The group's lr as a device tensor (a number set after construction becomes one); remembers
        the tensors a CUDA graph captures, and refuses one replaced since."""
        check_graph_lr(self.param_groups, self._graph_lrs, index)
        group = self.param_groups[index]
        lr = group["lr"] = self._device_lr(group["lr"], self._device)
        if torch.cuda.is_current_stream_capturing() and self._graph_lrs is None:
            self._graph_lrs = [g["lr"] for g in self.param_groups]
        return lr

    # ------------------------------------------------------------------ pickling, state dicts

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()  # torch's: defaults, state and param_groups (hooks are not carried)
        state.update((k, self.__dict__[k]) for k in _PICKLED if k in self.__dict__)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Restores a pickled or deep-copied optimizer: torch's part (empty hook dicts, the step
        wrapper), then ours; attributes a pickle cannot hold (the GradScaler weakref) or that name the
        original's tensors (caches, a captured graph's lrs) start empty."""
        super().__setstate__(state)
        for key in _TRANSIENT:
            self.__dict__.setdefault(key, None)
        self.__dict__.setdefault("_plan_epoch", 0)
        self.__dict__.setdefault("_moments", MomentState(MomentFormats()))  # pickled before the formats existed

    @torch._disable_dynamo
    def state_dict(self) -> dict[str, Any]:
        """torch.optim's; an 8-bit moment's codes under a key of their own (lowprec.formats.CODES_KEYS)."""
        sd = super().state_dict()
        return {**sd, "state": {k: codes_keyed(e) for k, e in sd["state"].items()}}

    @torch._disable_dynamo
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a state dict of this class or of ``torch.optim.AdamW``/``Adam``: moments in this
        optimizer's formats, whatever format they were saved in; a missing ``param`` is taken from the
        current param. Every saved param-group key comes back as in torch.optim (``initial_lr``, user keys; a
        torch group's ``decoupled_weight_decay`` sets ``adam_w_mode``) but foreach, fused and capturable,
        which stay this optimizer's. Everything is checked before anything changes. Pre and post hooks run as in
        torch.optim: a pre hook gets a shallow copy of ``state_dict`` and may return a replacement."""
        load_with_hooks(self, state_dict, self._load_state_dict)

    def _load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = saved_state_by_param(self.param_groups, state_dict, "FusedAdam.load_state_dict")
        seeds = saved_seeds(state_dict["param_groups"])
        step_device = self._device if self.capturable else torch.device("cpu")
        # Moments saved in any format: read as fp32, stored in this optimizer's (the saved bits where they
        # are in it already), all before anything is replaced (moments.py).
        self.state = defaultdict(dict, {p: self._moments.stored(p, convert_param_state(
            p, self._moments.saved_as_float32(p, s), master=self._uses_master(p), new=self._fp32_like,
            step_device=step_device), s) for p, s in saved})
        self._plan_epoch += 1
        if self.capturable:  # a float set after construction becomes the device tensor first
            for group in self.param_groups:
                group["lr"] = self._device_lr(group["lr"], self._device)
        restore_hyperparameters(self.param_groups, state_dict["param_groups"])
        self._moments.formats.restore_seeds(self.param_groups, seeds)
