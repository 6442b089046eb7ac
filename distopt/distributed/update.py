"""The fused update of this rank's shard: the kernel's argument lists and per-group options."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .. import ops
from ..validation import check_graph_lr
from .buckets import BucketRuntime, flat
from .runtime import ShardRuntime

KEYS = ("params", "grads", "exp_avgs", "exp_avg_sqs", "param_outs", "param_remainders")
WHERE = "where"  # each entry's (shard state, fragment), for the moment formats' arguments (moments.py)


def update_shards(rt: ShardRuntime, groups: list[dict[str, Any]], grad_scale: Tensor, found_inf: Tensor | None,
                  graph_lrs: list[Tensor] | None) -> None:
    """The fused update of every shard this rank holds: one kernel call per (param group, dtypes), with
    each group's hyperparameters from `groups` (the optimizer's param_groups; `graph_lrs`: the lr tensors
    a captured CUDA graph reads, see ``graph_safe_lr``). With offload the calls run on the host bucket by
    bucket, and each bucket's param slice is copied back as soon as it is updated (the copy overlaps the
    next bucket's update)."""
    if rt.transfers is None:
        _run(rt, groups, rt.buckets, grad_scale, found_inf, graph_lrs)
        return
    grad_scale = grad_scale.to(rt.state_device)
    for b in rt.buckets:
        _run(rt, groups, [b], grad_scale, None, graph_lrs)
        b.send_params()


def _run(rt: ShardRuntime, groups: list[dict[str, Any]], buckets: list[BucketRuntime], grad_scale: Tensor,
         found_inf: Tensor | None, graph_lrs: list[Tensor] | None) -> None:
    ids = None if rt.moments.plain else rt.positions(groups)  # stochastic rounding's param ids
    for (group_index, _), lists in kernel_lists(buckets, rt.tensors, rt.group_of,
                                                rt.contiguous_param_buffer, ids is not None).items():
        group = groups[group_index]
        hyper = group_hyperparameters(group, grad_scale)
        hyper.update(rt.moments.call_kwargs(lists.pop(WHERE), ids, group))
        if rt.capturable:  # the kernel reads lr and the step from the GPU
            lr = graph_safe_lr(groups, graph_lrs, group_index, rt.device)
            ops.adam_step_(**lists, lr=lr, step=rt.step_tensor, found_inf=found_inf, **hyper)
        else:
            ops.adam_step_(**lists, lr=float(group["lr"]), step=rt.steps, **hyper)


def graph_safe_lr(groups: list[dict[str, Any]], graph_lrs: list[Tensor] | None, index: int,
                  device: torch.device) -> Tensor:
    """Param group `index`'s lr as a tensor on `device` (capturable: the kernel reads it there);
    refuses one that replaced the tensor a captured CUDA graph reads (`graph_lrs`)."""
    check_graph_lr(groups, graph_lrs, index)
    lr = groups[index]["lr"]
    if not isinstance(lr, Tensor) or lr.device != device:
        lr = groups[index]["lr"] = torch.as_tensor(lr, dtype=torch.float32).to(device)
    return lr


def kernel_lists(buckets: list[BucketRuntime], params: list[Tensor], group_of: list[int],
                 contiguous_param_buffer: bool, per_fragment: bool = False) -> dict[tuple, dict[str, list[Tensor]]]:
    """The fused kernel's argument lists: one call per (param group, bucket dtypes); under WHERE, each
    entry's (shard state, fragment) where `per_fragment` (else None)."""
    calls: dict[tuple, dict[str, list[Tensor]]] = {}
    for b in buckets:
        s = b.state
        if b.in_place and not contiguous_param_buffer:
            for key, lists in direct_entries(b, params, group_of).items():
                c = calls.setdefault(key, {k: [] for k in (*KEYS, WHERE)})
                for k in (*KEYS, WHERE):
                    c[k].extend(lists[k])
            continue
        if b.transfers is not None:  # offload: host masters, moments and grads; host param outputs
            outs = b.update_outputs()
            for group, start, end in b.runs:
                c = calls.setdefault((group, b.spec.group), {k: [] for k in (*KEYS, WHERE)})
                for k, t in zip(KEYS, (s.master, s.grad, s.exp_avg, s.exp_avg_sq, outs)):
                    if t is not None:
                        c[k].append(t[start:end])
            continue
        local = b.local_param_slice()
        if s.master is None and not contiguous_param_buffer:
            b.gather_in(params)  # the model params are the masters (or their high halves)
        # per_fragment (moments.py): each run is one fragment, starting at it
        fragment_at = {f.shard_offset: f for f in b.fragments} if per_fragment else {}
        for group, start, end in b.runs:
            c = calls.setdefault((group, b.spec.group), {k: [] for k in (*KEYS, WHERE)})
            c[WHERE].append((s, fragment_at.get(start)))
            c["params"].append((s.master if s.master is not None else local)[start:end])
            c["grads"].append(s.grad[start:end])
            c["exp_avgs"].append(s.exp_avg[start:end])
            c["exp_avg_sqs"].append(s.exp_avg_sq[start:end])
            if s.master is not None:
                c["param_outs"].append(local[start:end])
            if s.remainders is not None:
                c["param_remainders"].append(s.remainders[start:end])
    return calls


def direct_entries(b: BucketRuntime, params: list[Tensor], group_of: list[int]) -> dict[tuple, dict[str, list]]:
    """A one-rank bucket's kernel lists, one entry per fragment, updating the model params themselves
    (or, with masters, writing them from the masters in the same pass) instead of a param buffer
    that would be copied in and out: the same values, two passes and no Python work per param
    fewer. The padding between fragments holds zero grads, so leaving it out changes nothing.

    Built once and reused: the shard state never moves, and a param held whole is passed as itself
    (the state as views of its shape and strides), so replacing its ``.data`` is followed (a new
    shape or strides makes the op refuse the mismatch). Only a param split over buckets is passed
    as a view of its data, so the lists are rebuilt when such a param's storage moves."""
    b.param_buffer = b.param_buffer if b.keep_param_buffer else None  # a checkpoint read may have left one
    if b.direct_cache is not None:
        split, key, calls = b.direct_cache
        if key == tuple(params[i].data_ptr() for i in split):
            return calls
    split = [f.param for f in b.fragments if f.numel != params[f.param].numel()]
    s = b.state
    calls: dict[tuple, dict[str, list]] = {}
    for f in b.fragments:
        c = calls.setdefault((group_of[f.param], b.spec.group), {k: [] for k in (*KEYS, WHERE)})
        c[WHERE].append((s, f))
        p = params[f.param]
        if f.numel == p.numel():
            model, shape, stride = p, p.shape, p.stride()
        else:
            model, shape, stride = flat(p.detach())[f.param_offset : f.param_offset + f.numel], (f.numel,), (1,)

        def view(t: Tensor, f=f, shape=shape, stride=stride) -> Tensor:
            return t.as_strided(shape, stride, t.storage_offset() + f.shard_offset)

        c["params"].append(view(s.master) if s.master is not None else model)
        c["grads"].append(view(s.grad))
        c["exp_avgs"].append(view(s.exp_avg))
        c["exp_avg_sqs"].append(view(s.exp_avg_sq))
        if s.master is not None:
            c["param_outs"].append(model)
        if s.remainders is not None:
            c["param_remainders"].append(view(s.remainders))
    b.direct_cache = (split, tuple(params[i].data_ptr() for i in split), calls)
    return calls


def group_hyperparameters(group: dict[str, Any], grad_scale: Tensor) -> dict[str, Any]:
    """The kernel's keyword arguments for one param group (lr and step aside)."""
    beta1, beta2 = group["betas"]
    return dict(beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                adam_w_mode=group["adam_w_mode"], maximize=group["maximize"], grad_scale=grad_scale)
