"""The low-precision state codecs in pure PyTorch, with the kernels' arithmetic bit for bit.

The fused op (``ops.adam_step_``) stores each moment as float32, bfloat16 or 8-bit blockwise codes
(csrc/math/state_format.h, Note [State formats]); this module is the same arithmetic in torch ops: the
reference of the kernel tests, and what the optimizers use to convert states (checkpoints to and from
fp32). Every function returns the bits the kernels store for the same fp32 input.

* 8-bit blockwise: uint8 codes of bitsandbytes' dynamic quantization map (``dynamic_map``: signed for
  exp_avg, unsigned for exp_avg_sq) and one float32 absmax per ``QUANT_BLOCK`` elements, blocks counted
  from the tensor's first element. ``quantize_blockwise``/``dequantize_blockwise``.
* bfloat16: round to nearest even (``Tensor.to``), or stochastically (``bf16_stochastic``) with the
  random words of ``RoundingKeys`` (Philox4x32-10, Note [Stochastic rounding bits]).
* fp32 masters of bf16 params as the params (their high halves) and int16 low halves
  (``store_param_remainders``): ``split_bf16_remainder`` / ``join_bf16_remainder``.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from torch import Tensor

QUANT_BLOCK = 256  # elements per absmax (kQuantBlock)
CODES = 256
_CANONICAL_NAN_BITS = 0x7FC00000
_INT16_MASK = 0xFFFF


def zero_code(signed: bool) -> int:
    """The code of the map's 0."""
    return 127 if signed else 0


def _linspace(steps: int) -> Tensor:
    """torch.linspace(0.1, 1.0, steps) in float32 as torch's scalar CPU path computes it (its vectorised
    path rounds some points differently; see Note [State formats])."""
    k = torch.arange(steps, dtype=torch.float32)
    start, end = torch.tensor(0.1, dtype=torch.float32), torch.tensor(1.0, dtype=torch.float32)
    step = (end - start) / float(steps - 1)
    return torch.where(k < steps // 2, start + step * k, end - step * (float(steps - 1) - k))


@functools.cache
def _map(signed: bool) -> Tensor:
    # bitsandbytes' create_dynamic_map(signed, max_exponent_bits=7, total_bits=8) construction.
    data: list[float] = []
    for i in range(7):
        items = 2**i + 1 if signed else 2 ** (i + 1) + 1
        boundaries = _linspace(items)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        data += ((10 ** (-6 + i)) * means).tolist()
        if signed:
            data += (-(10 ** (-6 + i)) * means).tolist()
    data += [0.0, 1.0]
    assert len(data) == CODES
    return torch.tensor(sorted(data), dtype=torch.float32)


def dynamic_map(signed: bool, device: torch.device | str = "cpu") -> Tensor:
    """The 256 map values, ascending (float32)."""
    return _map(signed).to(device)


def thresholds(signed: bool, device: torch.device | str = "cpu") -> Tensor:
    """The 255 decision boundaries: the fp32 midpoints of neighbouring map values."""
    m = dynamic_map(signed, device)
    return (m[:-1] + m[1:]) * 0.5


def _blocks(x: Tensor) -> Tensor:
    """x flattened and zero-padded to whole blocks, as (blocks, QUANT_BLOCK)."""
    flat = x.reshape(-1)
    pad = (-flat.numel()) % QUANT_BLOCK
    return torch.nn.functional.pad(flat, (0, pad)).view(-1, QUANT_BLOCK)


def block_absmax(x: Tensor) -> Tensor:
    """Per block the largest |x| (float32), or NaN (0x7FC00000) if the block holds a NaN."""
    b = _blocks(x.float())
    nan = torch.tensor(_CANONICAL_NAN_BITS, dtype=torch.int32, device=x.device).view(torch.float32)
    finite_max = b.abs().nan_to_num(nan=0.0, posinf=float("inf")).amax(dim=1)  # an inf stays inf
    return torch.where(b.isnan().any(dim=1), nan, finite_max)


def quantize_blockwise(x: Tensor, signed: bool) -> tuple[Tensor, Tensor]:
    """(uint8 codes shaped like x, float32 absmax per block) of the fp32 values x.

    y = x * (1 / absmax) (0 for an all-zero block), then the nearest map value: the number of thresholds
    below y, a threshold equal to y counting as below only when y is negative (ties toward zero); NaN
    gets the map's 0.
    """
    x = x.float()
    absmax = block_absmax(x)
    inv = torch.where(absmax == 0, torch.zeros_like(absmax), 1.0 / absmax)
    y = (_blocks(x) * inv[:, None]).reshape(-1)[: x.numel()]
    thr = thresholds(signed, x.device)
    left = torch.searchsorted(thr, y, side="left")  # thresholds < y
    right = torch.searchsorted(thr, y, side="right")  # thresholds <= y
    codes = torch.where(y < 0, right, left)
    codes = torch.where(y.isnan(), torch.full_like(codes, zero_code(signed)), codes)
    return codes.to(torch.uint8).view(x.shape), absmax


def dequantize_blockwise(codes: Tensor, absmax: Tensor, signed: bool) -> Tensor:
    """float32 values ``map[code] * absmax`` of the codes (shaped like them)."""
    values = dynamic_map(signed, codes.device)[codes.reshape(-1).long()]
    scales = absmax.reshape(-1).float().repeat_interleave(QUANT_BLOCK)[: codes.numel()]
    return (values * scales).view(codes.shape)


# ---- bf16 stochastic rounding ------------------------------------------------------------------------


def bf16_stochastic(x: Tensor, random: Tensor) -> Tensor:
    """x (fp32) rounded to bfloat16 with the low 16 bits of ``random`` (int64 words): up in magnitude with
    probability (dropped bits) / 2^16. Infinities stay, NaN becomes 0x7FC0."""
    if random.shape != x.shape:  # one word per element in memory order (the kernels' element index)
        shaped = torch.empty_strided(x.shape, x.stride(), dtype=random.dtype, device=random.device)
        order = sorted(range(x.dim()), key=lambda d: (-x.stride(d), d))
        shaped.permute(order).view(-1).copy_(random.reshape(-1))
        random = shaped
    bits = x.float().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    rounded = (bits + (random & 0xFFFF)) >> 16
    rounded = torch.where((bits & 0x7F800000) == 0x7F800000, bits >> 16, rounded)  # inf (NaN below)
    rounded = torch.where((bits & 0x7FFFFFFF) > 0x7F800000, torch.full_like(rounded, 0x7FC0), rounded)
    rounded = torch.where(rounded >= 2**15, rounded - 2**16, rounded)
    return rounded.to(torch.int16).view(torch.bfloat16).view(x.shape)


_M0, _M1, _W0, _W1 = 0xD2511F53, 0xCD9E8D57, 0x9E3779B9, 0xBB67AE85
_MASK32 = 0xFFFFFFFF


def _mulhilo(a: Tensor, b: int) -> tuple[Tensor, Tensor]:
    """(high, low) 32-bit halves of a * b for a < 2^32 (int64 tensor), without int64 overflow."""
    t1 = a * (b >> 16)
    t2 = a * (b & 0xFFFF)
    mid = t2 + ((t1 & 0xFFFF) << 16)
    return (t1 >> 16) + (mid >> 32), mid & _MASK32


def philox4x32_10(counter: tuple[Tensor, Tensor, Tensor, Tensor], key: tuple[int, int]) -> list[Tensor]:
    """Philox4x32-10 (Salmon et al., SC'11) of int64 tensors holding 32-bit counter words: four words."""
    c0, c1, c2, c3 = (c & _MASK32 for c in counter)
    k0, k1 = key
    for _ in range(10):
        hi0, lo0 = _mulhilo(c0, _M0)
        hi1, lo1 = _mulhilo(c2, _M1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + _W0) & _MASK32, (k1 + _W1) & _MASK32
    return [c0, c1, c2, c3]


@dataclasses.dataclass(frozen=True)
class RoundingKeys:
    """Stochastic rounding's key: the seed, and per entry its param id and first element's offset."""

    seed: int
    param_ids: list[int]
    param_offsets: list[int]

    def words(self, i: int, step: float | Tensor, numel: int, device: torch.device) -> list[Tensor]:
        """The four random words (int64) of each element of entry i at ``step``: word 0 rounds the
        param, 1 the exp_avg, 2 the exp_avg_sq (Note [Stochastic rounding bits])."""
        seed = self.seed & 0xFFFFFFFFFFFFFFFF
        e = torch.arange(numel, dtype=torch.int64, device=device) + self.param_offsets[i]
        s = step.reshape(()).to(torch.float64).to(torch.int64) if isinstance(step, Tensor) else int(step)
        s = torch.as_tensor(s, dtype=torch.int64, device=device) & _MASK32
        counter = (e & _MASK32, e >> 32, torch.full_like(e, self.param_ids[i]), s.expand_as(e))
        return philox4x32_10(counter, (seed & _MASK32, seed >> 32))


# ---- bf16 params with int16 remainders -------------------------------------------------------------


def join_bf16_remainder(hi: Tensor, lo: Tensor) -> Tensor:
    """fp32 values from bf16 high halves and int16 low halves (see csrc/math/adam.h)."""
    hi_bits = hi.view(torch.int16).to(torch.int64) & _INT16_MASK
    lo64 = lo.to(torch.int64)
    hi_bits = (hi_bits - (lo64 < 0).to(torch.int64)) & _INT16_MASK
    bits = (hi_bits << 16) | (lo64 & _INT16_MASK)
    bits = torch.where(bits >= 2**31, bits - 2**32, bits)
    return bits.to(torch.int32).view(torch.float32)


def split_bf16_remainder(x: Tensor) -> tuple[Tensor, Tensor]:
    """bf16 high halves (rounded half away from zero in magnitude) and int16 low halves of fp32 x."""
    bits = x.float().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    lo = bits & _INT16_MASK
    lo_signed = torch.where(lo >= 2**15, lo - 2**16, lo)
    hi = ((bits >> 16) + (lo_signed < 0).to(torch.int64)) & _INT16_MASK
    hi_signed = torch.where(hi >= 2**15, hi - 2**16, hi)
    return hi_signed.to(torch.int16).view(torch.bfloat16), lo_signed.to(torch.int16)
