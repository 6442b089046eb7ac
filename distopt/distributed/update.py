"""The fused update of this rank's shard: the kernel's argument lists and per-group options."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from .buckets import BucketRuntime


def kernel_lists(buckets: list[BucketRuntime], params: list[Tensor],
                 contiguous_param_buffer: bool) -> dict[tuple, dict[str, list[Tensor]]]:
    """The fused kernel's argument lists: one call per (param group, bucket dtypes)."""
    calls: dict[tuple, dict[str, list[Tensor]]] = {}
    for b in buckets:
        s = b.state
        local = b.local_param_slice()
        if s.master is None and not contiguous_param_buffer:
            b.gather_in(params)  # the model params are the masters (or their high halves)
        for group, start, end in b.runs:
            c = calls.setdefault((group, b.spec.group), {"params": [], "grads": [], "exp_avgs": [],
                                                        "exp_avg_sqs": [], "param_outs": [], "param_remainders": []})
            c["params"].append((s.master if s.master is not None else local)[start:end])
            c["grads"].append(s.grad[start:end])
            c["exp_avgs"].append(s.exp_avg[start:end])
            c["exp_avg_sqs"].append(s.exp_avg_sq[start:end])
            if s.master is not None:
                c["param_outs"].append(local[start:end])
            if s.remainders is not None:
                c["param_remainders"].append(s.remainders[start:end])
    return calls


def group_hyperparameters(group: dict[str, Any], grad_scale: Tensor) -> dict[str, Any]:
    """The kernel's keyword arguments for one param group (lr and step aside)."""
    beta1, beta2 = group["betas"]
    return dict(beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                adam_w_mode=group["adam_w_mode"], maximize=group["maximize"], grad_scale=grad_scale)
