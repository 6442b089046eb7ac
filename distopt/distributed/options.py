"""DistributedFusedAdam's own options (those torch.optim.AdamW lacks, see torch_compat.py): checked
before anything is built, and what they decide about each bucket's storage."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..validation import FLOAT_DTYPES


@dataclass(frozen=True)
class Storage:
    """Which fp32 state a bucket keeps besides the moments and the grad shard."""

    store_params: bool | None
    store_param_remainders: bool
    offload: bool

    def remainders(self, param_dtype: torch.dtype, model_dtype: torch.dtype) -> bool:
        """Whether bf16 params synchronised in bf16 keep only the int16 low halves of their masters."""
        return self.store_param_remainders and param_dtype == model_dtype == torch.bfloat16

    def master(self, param_dtype: torch.dtype, model_dtype: torch.dtype) -> bool:
        """Whether a bucket of params of `model_dtype`, synchronised in `param_dtype`, keeps fp32 masters:
        always with offload (the host update needs them); never with remainders; by default only
        where the params cannot be their own masters (not fp32, or synchronised in another dtype)."""
        if self.offload:
            return True
        if self.remainders(param_dtype, model_dtype):
            return False
        if self.store_params is None:
            return not (param_dtype == model_dtype == torch.float32)
        return self.store_params


def check_options(dtype: torch.dtype, grad_sync_dtype: torch.dtype | None, param_sync_dtype: torch.dtype | None,
                  bucket_cap_mb: float, pipeline_size: int, storage: Storage, capturable: bool) -> None:
    """ValueError for an option value or combination the optimizer cannot honour."""
    if dtype != torch.float32:
        raise ValueError(f"DistributedFusedAdam keeps optimizer state in float32; dtype={dtype} is not supported")
    for name, value in (("grad_sync_dtype", grad_sync_dtype), ("param_sync_dtype", param_sync_dtype)):
        if value is not None and value not in FLOAT_DTYPES:
            raise ValueError(f"{name} must be float32, float16, bfloat16 or None, got {value}")
    if storage.offload and (capturable or storage.store_params is False or storage.store_param_remainders):
        raise ValueError("offload_optimizer=True updates fp32 masters on the host: it cannot be combined with "
                         "capturable=True, store_params=False or store_param_remainders=True")
    if bucket_cap_mb <= 0 or pipeline_size < 1:
        raise ValueError(f"bucket_cap_mb must be > 0 and pipeline_size >= 1, got {bucket_cap_mb}, {pipeline_size}")


def check_param_dtypes(dtypes: list[tuple[torch.dtype, torch.dtype]], storage: Storage,
                       contiguous_param_buffer: bool) -> None:
    """ValueError where the options do not fit the params: (param_sync dtype, param dtype) per param."""
    if storage.store_param_remainders and not any(storage.remainders(*d) for d in dtypes):
        raise ValueError("store_param_remainders applies to bfloat16 params synchronised in bfloat16; there are none")
    for param_dtype, model_dtype in dtypes:
        if storage.store_params is False and param_dtype != model_dtype:
            raise ValueError("store_params=False uses the model params as masters: param_sync_dtype must be "
                             f"the param dtype ({model_dtype})")
        if contiguous_param_buffer and param_dtype != model_dtype:
            raise ValueError("contiguous_param_buffer makes params views of the sync buffer: param_sync_dtype "
                             f"must be the param dtype ({model_dtype})")
