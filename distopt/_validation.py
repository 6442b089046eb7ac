"""Argument checks shared by the optimizers: clear errors before any state is touched."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # what the fused kernels take


def _number(x: float | Tensor) -> float:
    return float(x.item()) if isinstance(x, Tensor) else float(x)


def check_adam_hyperparameters(lr: float | Tensor, betas, eps: float, weight_decay: float) -> None:
    """Raises ValueError for a negative lr/eps/weight_decay or betas outside [0, 1)."""
    if isinstance(lr, Tensor) and lr.numel() != 1:
        raise ValueError(f"lr must be a number or a one-element tensor, got shape {tuple(lr.shape)}")
    # A GPU lr (capturable) is not read back: that would synchronise with the device every step.
    on_gpu = isinstance(lr, Tensor) and lr.device.type != "cpu"
    if not on_gpu and not _number(lr) >= 0.0:
        raise ValueError(f"Invalid learning rate: {_number(lr)} (must be >= 0)")
    if not float(eps) >= 0.0:
        raise ValueError(f"Invalid epsilon value: {eps} (must be >= 0)")
    if not float(weight_decay) >= 0.0:
        raise ValueError(f"Invalid weight_decay value: {weight_decay} (must be >= 0)")
    try:
        beta1, beta2 = betas
    except (TypeError, ValueError):
        raise ValueError(f"betas must be a pair of numbers, got {betas!r}") from None
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


def check_graph_lr(groups: list[dict], captured: list[Tensor] | None, index: int) -> None:
    """Raises if a group's lr tensor was replaced after a CUDA graph captured the step that reads it
    (the graph would keep reading the old tensor, silently)."""
    if captured is not None and groups[index]["lr"] is not captured[index]:
        raise RuntimeError(
            f"param_groups[{index}]['lr'] was replaced after a step was captured in a CUDA graph, which keeps "
            "reading the old tensor: change lr in place (group['lr'].fill_(value), as LR schedulers do)"
        )


def check_param_tensors(params: list[Tensor], owner: str) -> torch.device | None:
    """The one device all `params` are on (None for no params); raises for several devices, a dtype
    the kernels do not take, or a tensor whose elements do not fill its memory once (not dense)."""
    devices = {p.device for p in params}
    if len(devices) > 1:
        raise ValueError(f"{owner}: all params must be on one device, got {sorted(map(str, devices))}")
    for p in params:
        if p.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{owner}: params must be float32, float16 or bfloat16, got {p.dtype}")
        if not is_dense(p):
            raise ValueError(f"{owner}: params must be dense tensors (non-overlapping, no gaps)")
    return next(iter(devices)) if devices else None
