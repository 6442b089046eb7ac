"""Low-precision optimizer state, shared by FusedAdam and DistributedFusedAdam: ``codecs`` (the kernels'
bit arithmetic in torch ops: 8-bit blockwise codes, bf16 rounding, bf16-param remainders) and
``formats`` (the moment options, the per-param rule, and conversion of state dicts to fp32)."""

from . import codecs, formats

__all__ = ["codecs", "formats"]
