"""Pure-PyTorch versions of every distopt op: the test oracle, and the fallback when ``_C`` is absent.

Signatures match the op schemas in ``ops.py``. The Adam update and the norms are computed in float64
and rounded once into each output; scaling and casting compute the same fp32 product as the kernels,
so they match them bit for bit. Low-precision moments are read and stored with the kernels' own
arithmetic (``lowprec/codecs.py``): only the update between them is float64. Nothing here synchronises
with the host: the skip flag is applied with ``torch.where``, so a skipped update rewrites every output
with its old bits.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .kernel_views import packed_offsets, packed_views
from .lowprec import codecs
from .lowprec.codecs import join_bf16_remainder, split_bf16_remainder  # (the op tests find them here too)


def _skip_mask(found_inf: Tensor | None, device: torch.device) -> Tensor:
    if found_inf is None:
        return torch.zeros((), dtype=torch.bool, device=device)
    return found_inf.reshape(()) != 0


def _write(dst: Tensor, value: Tensor, skip: Tensor) -> None:
    """dst = value (cast to dst's dtype), unless skip: then dst keeps its bits."""
    dst.copy_(torch.where(skip, dst, value.to(dst.dtype)))


def _memory_order(t: Tensor) -> Tensor:
    """``t``'s elements as a 1-D view in memory order: the order in which the kernels walk a dense tensor,
    count its 8-bit blocks and number its elements for stochastic rounding."""
    if t.is_contiguous():
        return t.view(-1)
    if not t.is_non_overlapping_and_dense():
        raise ValueError("low-precision moments and stochastic rounding need dense tensors")
    return t.as_strided((t.numel(),), (1,))


def _read_moment(x: Tensor, scales: Sequence[Tensor], i: int, signed: bool) -> Tensor:
    if x.dtype == torch.uint8:
        return codecs.dequantize_blockwise(x, scales[i], signed).double()
    return x.double()


def _write_moment(x: Tensor, scales: Sequence[Tensor], i: int, value: Tensor, signed: bool, skip: Tensor,
                  random: Tensor | None) -> None:
    """Stores the fp32 ``value`` in ``x``'s format (8-bit: codes and scales[i]), unless skip."""
    if x.dtype == torch.uint8:
        codes, absmax = codecs.quantize_blockwise(value, signed)
        _write(x, codes.view(x.shape), skip)
        _write(scales[i], absmax, skip)
    elif x.dtype == torch.bfloat16 and random is not None:
        _write(x, codecs.bf16_stochastic(value, random), skip)
    else:
        _write(x, value, skip)


def _adam(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    param_outs: Sequence[Tensor],
    param_remainders: Sequence[Tensor],
    lr: float | Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    steps: Sequence[float | Tensor],
    adam_w_mode: bool,
    grad_scale: Tensor | None,
    found_inf: Tensor | None,
    maximize: bool,
    exp_avg_scales: Sequence[Tensor] = (),
    exp_avg_sq_scales: Sequence[Tensor] = (),
    rounding: codecs.RoundingKeys | None = None,
) -> None:
    if not params:
        return
    device = params[0].device
    skip = _skip_mask(found_inf, device)
    scale = grad_scale.double().reshape(()) if grad_scale is not None else 1.0
    lr64 = lr.double().reshape(()) if isinstance(lr, Tensor) else lr
    flat = rounding is not None or any(x[0].dtype != torch.float32 for x in (exp_avgs, exp_avg_sqs))
    if flat:  # blocks and rounding indices count elements in memory order
        lists = (params, grads, exp_avgs, exp_avg_sqs, param_outs, param_remainders)
        params, grads, exp_avgs, exp_avg_sqs, param_outs, param_remainders = (
            [_memory_order(t) for t in lst] for lst in lists
        )
    for i, (p, g, m, v) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs, strict=True)):
        step = steps[i]
        step64 = step.double().reshape(()) if isinstance(step, Tensor) else float(step)
        words = rounding.words(i, step, p.numel(), p.device) if rounding is not None else None
        if param_remainders:
            p64 = join_bf16_remainder(p, param_remainders[i]).double()
        else:
            p64 = p.double()
        g64 = g.double() * scale
        if maximize:
            g64 = -g64
        if not adam_w_mode and weight_decay != 0:
            g64 = g64 + weight_decay * p64
        m64 = _read_moment(m, exp_avg_scales, i, True) * beta1 + (1 - beta1) * g64
        v64 = _read_moment(v, exp_avg_sq_scales, i, False) * beta2 + (1 - beta2) * g64 * g64
        if adam_w_mode:
            p64 = p64 * (1 - lr64 * weight_decay)
        bias_correction1 = 1 - beta1**step64
        bias_correction2 = 1 - beta2**step64
        denom = v64.sqrt() / (bias_correction2**0.5) + eps
        p64 = p64 - (lr64 / bias_correction1) * m64 / denom

        _write_moment(m, exp_avg_scales, i, m64.float(), True, skip, None if words is None else words[1])
        _write_moment(v, exp_avg_sq_scales, i, v64.float(), False, skip, None if words is None else words[2])
        if param_remainders:
            hi, lo = split_bf16_remainder(p64.float())
            _write(p, hi, skip)
            _write(param_remainders[i], lo, skip)
        elif p.dtype == torch.bfloat16 and words is not None:
            p64 = codecs.bf16_stochastic(p64.float(), words[0]).double()  # param_outs get the rounded value
            _write(p, p64, skip)
        else:
            _write(p, p64, skip)
        if param_outs and param_outs[i].data_ptr() != p.data_ptr():
            _write(param_outs[i], p64, skip)


def adam_step_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    param_outs: Sequence[Tensor],
    param_remainders: Sequence[Tensor],
    lr: Tensor,
    steps: Sequence[Tensor],
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adam_w_mode: bool,
    maximize: bool,
    grad_scale: Tensor | None,
    found_inf: Tensor | None,
    exp_avg_scales: Sequence[Tensor] = (),
    exp_avg_sq_scales: Sequence[Tensor] = (),
    rounding_seed: int | None = None,
    param_ids: Sequence[int] = (),
    param_offsets: Sequence[int] = (),
) -> None:
    if len(steps) not in (1, len(params)):
        raise ValueError(f"steps: expected one step tensor, or one per param ({len(params)}), got {len(steps)}")
    exp_avgs, exp_avg_sqs = _unpacked(exp_avgs, params, "exp_avgs"), _unpacked(exp_avg_sqs, params, "exp_avg_sqs")
    per_param = list(steps) if len(steps) == len(params) else [steps[0]] * len(params)
    rounding = None
    if rounding_seed is not None:
        if len(param_ids) != len(params):
            raise ValueError(f"stochastic rounding (a rounding seed) needs param_ids: one id per param ({len(params)})")
        rounding = codecs.RoundingKeys(rounding_seed, list(param_ids), list(param_offsets) or [0] * len(params))
    _adam(params, grads, exp_avgs, exp_avg_sqs, param_outs, param_remainders, lr, beta1, beta2, eps,
          weight_decay, per_param, adam_w_mode, grad_scale, found_inf, maximize, exp_avg_scales,
          exp_avg_sq_scales, rounding)


def _unpacked(moments: Sequence[Tensor], params: Sequence[Tensor], name: str) -> Sequence[Tensor]:
    """A packed moment list (``ops.adam_step_``) as its entries; any other list as it is."""
    if len(moments) != 1 or len(params) < 2:
        return moments
    (packed,) = moments
    total = packed_offsets([p.numel() for p in params])[1]
    if packed.dtype not in (torch.float32, torch.bfloat16) or packed.dim() != 1 or packed.numel() < total or (
            packed.numel() > 1 and packed.stride(0) != 1):
        raise ValueError(f"{name}: expected {len(params)} tensors (one per param) or one packed fp32 or bf16 "
                         f"tensor, 1-D and contiguous with at least {total} elements; got {packed.dtype} "
                         f"{tuple(packed.shape)}")
    return packed_views(packed, params)


def l2norm(tensors: Sequence[Tensor], found_inf: Tensor | None) -> tuple[Tensor, Tensor]:
    per_tensor_sq = torch.stack([t.double().square().sum() for t in tensors])
    if found_inf is not None:
        nonfinite = torch.stack([~torch.isfinite(t).all() for t in tensors]).any()
        found_inf.copy_(torch.where(nonfinite, torch.ones_like(found_inf), found_inf))
    return per_tensor_sq.sum().sqrt().float(), per_tensor_sq.sqrt().float()


def _scale_into(inputs: Sequence[Tensor], outputs: Sequence[Tensor], scale: Tensor | None) -> Tensor:
    """Writes inputs * scale (fp32 product) into outputs; returns whether any stored value is nonfinite."""
    nonfinite = torch.zeros((), dtype=torch.bool, device=inputs[0].device)
    for x, out in zip(inputs, outputs, strict=True):
        y = x.float() * scale.float().reshape(()) if scale is not None else x
        out.copy_(y.to(out.dtype))
        nonfinite = nonfinite | ~torch.isfinite(out).all()
    return nonfinite


def scale_(inputs: Sequence[Tensor], outputs: Sequence[Tensor], scale: Tensor, found_inf: Tensor | None) -> None:
    nonfinite = _scale_into(inputs, outputs, scale)
    if found_inf is not None:
        found_inf.copy_(torch.where(nonfinite, torch.ones_like(found_inf), found_inf))


def cast_copy_(inputs: Sequence[Tensor], outputs: Sequence[Tensor], skip_if: Tensor | None) -> None:
    skip = _skip_mask(skip_if, inputs[0].device)
    for x, out in zip(inputs, outputs, strict=True):
        _write(out, x, skip)
