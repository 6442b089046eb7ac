"""Argument checks shared by the optimizers: clear errors before any state is touched."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # what the fused kernels take


def _number(x: float | Tensor) -> float:
    return float(x.item()) if isinstance(x, Tensor) else float(x)


def check_adam_hyperparameters(lr: float | Tensor, betas, eps: float, weight_decay: float) -> None:
    """Raises ValueError for a negative lr/eps/weight_decay or betas outside [0, 1)."""
    compiling = torch.compiler.is_compiling()
    if isinstance(lr, Tensor):
        if lr.numel() != 1:
            raise ValueError(f"Tensor lr must be 1-element (or lr a number), got shape {tuple(lr.shape)}")
        # Not read back on a GPU (capturable: that would synchronise every step) nor under torch.compile
        # (.item() breaks the graph).
        if lr.device.type == "cpu" and not compiling and not lr.item() >= 0.0:
            raise ValueError(f"Invalid learning rate: {lr.item()} (must be >= 0)")
    # Under torch.compile a float lr may be symbolic: compared as it is, float() would specialise on it.
    elif not (lr if compiling else float(lr)) >= 0.0:
        raise ValueError(f"Invalid learning rate: {lr} (must be >= 0)")
    if not float(eps) >= 0.0:
        raise ValueError(f"Invalid epsilon value: {eps} (must be >= 0)")
    if not float(weight_decay) >= 0.0:
        raise ValueError(f"Invalid weight_decay value: {weight_decay} (must be >= 0)")
    try:
        beta1, beta2 = betas
    except (TypeError, ValueError):
        raise ValueError(f"betas must be a pair of numbers, got {betas!r}") from None
    if isinstance(beta1, Tensor) != isinstance(beta2, Tensor):
        raise ValueError("betas must be either both floats or both Tensors")  # as torch.optim.Adam(W)
    for i, beta in enumerate((beta1, beta2)):
        if not 0.0 <= _number(beta) < 1.0:
            raise ValueError(f"Invalid beta parameter at index {i}: {_number(beta)} (must be in [0, 1))")


def check_unique_params(params: Iterable[Tensor]) -> None:
    """Raises ValueError if a tensor appears twice (in one group or across groups)."""
    seen: set[int] = set()
    for p in params:
        if not isinstance(p, Tensor):
            raise TypeError(f"params must be tensors, got {type(p).__name__}")
        if id(p) in seen:
            raise ValueError("a parameter appears more than once in the optimizer's param groups")
        seen.add(id(p))


def is_dense(t: Tensor) -> bool:
    """Whether t's elements fill its memory exactly once in some dimension order (contiguous,
    channels_last, any permutation): the layouts a kernel can walk as one flat array."""
    dims = sorted((s, n) for s, n in zip(t.stride(), t.shape) if n != 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def overlaps(t: Tensor) -> bool:
    """Whether elements of `t` share memory (an expanded tensor: a stride that does not step past
    what the dimensions with smaller strides span)."""
    span = 0
    for stride, size in sorted((s, n) for s, n in zip(t.stride(), t.shape) if n > 1):
        if stride <= span:
            return t.numel() > 0
        span += stride * (size - 1)
    return False


def check_graph_lr(groups: list[dict], captured: list[Tensor] | None, index: int) -> None:
    """Raises if a group's lr tensor was replaced after a CUDA graph captured the step that reads it
    (the graph would keep reading the old tensor, silently)."""
    if captured is not None and groups[index]["lr"] is not captured[index]:
        raise RuntimeError(
            f"param_groups[{index}]['lr'] was replaced after a step was captured in a CUDA graph, which keeps "
            "reading the old tensor: change lr in place (group['lr'].fill_(value), as LR schedulers do)"
        )


def check_param_tensors(params: list[Tensor], owner: str, views: bool = False) -> torch.device | None:
    """The one device all `params` are on (None for no params); raises for several devices, a dtype
    the kernels do not take, or a tensor whose elements do not fill its memory once (not dense).
    `views` (FusedAdam, distopt/kernel_views.py): complex params whose real parts have a kernel
    dtype, and params with gaps in memory, are taken too (not ones whose elements share memory)."""
    devices = {p.device for p in params}
    if len(devices) > 1:
        raise ValueError(f"{owner}: all params must be on one device, got {sorted(map(str, devices))}")
    for p in params:
        dtype = p.dtype.to_real() if views and p.is_complex() else p.dtype
        if dtype in (torch.float64, torch.complex128):
            raise TypeError(f"{owner}: {p.dtype} params are not supported: the fused kernels compute in float32, "
                            "which would silently round a float64 model's updates (torch.optim.AdamW steps them "
                            "in float64)")
        if dtype not in FLOAT_DTYPES:
            kinds = "float32, float16 or bfloat16" + (" (or complex64, complex32)" if views else "")
            raise TypeError(f"{owner}: params must be {kinds}, got {p.dtype}")
        if views and overlaps(p):
            raise ValueError(f"{owner}: params must not overlap in memory (e.g. an expanded tensor): elements "
                             "that share memory cannot be updated apart")
        if not views and not is_dense(p):
            raise ValueError(f"{owner}: params must be dense tensors (non-overlapping, no gaps)")
    return next(iter(devices)) if devices else None


# ---------------------------------------------------------------------- torch.optim.AdamW's options

# Refused when true: the fused kernel has no AMSGrad moment and no autograd formula.
REFUSED_OPTIONS = {
    "amsgrad": "amsgrad=True (AMSGrad keeps a max of the second moments, which the fused kernel does not have)",
    "differentiable": "differentiable=True (autograd through the update: the fused kernel has no backward)",
}
# None, True or False, all honoured alike: they pick torch's implementation; distopt always runs its fused kernel.
IMPLEMENTATION_OPTIONS = ("foreach", "fused")


def weight_decay_mode(adam_w_mode: bool | None, decoupled_weight_decay: bool | None, where: str = "") -> bool:
    """The one switch set by apex's ``adam_w_mode`` and torch's ``decoupled_weight_decay`` (True: AdamW's
    decoupled decay; False: Adam's L2 added to the gradient); True if neither is given."""
    given = {bool(v) for v in (adam_w_mode, decoupled_weight_decay) if v is not None}
    if len(given) > 1:
        raise ValueError(f"{where}adam_w_mode={adam_w_mode} and decoupled_weight_decay={decoupled_weight_decay} "
                         "contradict each other: they are one switch (True: AdamW, False: Adam with L2); set one")
    return given.pop() if given else True


def check_adamw_options(group: dict, where: str = "") -> None:
    """Raises ValueError for a torch.optim.AdamW option value (in a param group or the defaults) that the
    fused update cannot honour; ``where`` starts the message (e.g. ``"FusedAdam param_groups[1]: "``)."""
    for key, what in REFUSED_OPTIONS.items():
        if group.get(key):
            raise ValueError(f"{where}{what} is not supported")
    for key in IMPLEMENTATION_OPTIONS:
        if group.get(key) not in (None, True, False):
            raise ValueError(f"{where}{key} must be None, True or False, got {group[key]!r}")
    if not isinstance(group.get("maximize", False), bool):
        raise ValueError(f"{where}maximize must be True or False, got {group['maximize']!r}")
    weight_decay_mode(group.get("adam_w_mode"), group.get("decoupled_weight_decay"), where)


def reconcile_weight_decay_switch(group: Any, where: str = "") -> None:
    """A param group given with either name of the weight-decay switch (adam_w_mode,
    decoupled_weight_decay) gets both, agreeing (not the optimizer's default for the other name)."""
    if not isinstance(group, dict):
        return  # torch's add_param_group refuses it
    given = (group.get("adam_w_mode"), group.get("decoupled_weight_decay"))
    if given != (None, None):
        group["adam_w_mode"] = group["decoupled_weight_decay"] = weight_decay_mode(*given, where)
