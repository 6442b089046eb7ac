"""What FusedAdam's fused kernel sees of a param it cannot walk as it is: a complex param as its real
view, a param that is not dense in memory through a dense staging copy; and params repeated in a group.

The kernel takes real (fp32/fp16/bf16) tensors that fill their memory exactly once, every list of a
call in the same layout. ``torch.optim.AdamW`` steps a complex param as ``torch.view_as_real`` of the
param, its gradient and its moments, and keeps the moments complex, shaped like the param (that is
what its state dicts hold): FusedAdam does the same, so its numbers are AdamW's on the real view.

A param whose elements do not fill its memory once (a slice such as ``randn(10, 5, 2)[..., 0]``) has
its state in the contiguous layout, which is also the layout autograd gives its gradients. Each step
copies it into a contiguous staging tensor, runs the kernel there and copies the result back: two
copies for those params only. Params that need neither (``needs_view`` is False) go to the kernel as
they are, in calls of their own (FusedAdam buckets the two kinds apart), so they pay nothing.

A call's moments may also reach the kernel packed, each list one tensor holding every entry's moment at
``packed_offsets`` (Note [Packed moments] in csrc/binding.cpp); ``packed_views`` are its entries, and
``own_storage`` gives such an entry a storage of its own over the same memory (what the optimizer's state
holds).

Everything here takes plain tensors. For a param that wraps another (a DTensor), pass the local
tensor: that one may itself be complex or not dense, and gets the same treatment.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch
from torch import Tensor

from .validation import FLOAT_DTYPES, is_dense


def is_walkable(t: Tensor) -> bool:
    """Whether the kernel can walk `t`'s memory as it is (dense: contiguous, channels_last, any
    permutation). The C check first: the common case pays no Python loop over dimensions."""
    return t.is_contiguous() or is_dense(t)


def needs_view(p: Tensor) -> bool:
    """Whether the kernel reaches `p` through a view (complex) or a staging copy (not dense)."""
    return p.is_complex() or not (p.is_contiguous() or is_dense(p))  # is_walkable, inlined: once per param


# What FusedAdam takes for params and grads: the kernel's dtypes, and complex ones with such parts.
DTYPES = FLOAT_DTYPES + (torch.complex64, torch.complex32)


PACK_ALIGN = 16  # elements; csrc/binding.cpp's kPackAlign


def packed_offsets(numels: Sequence[int]) -> tuple[list[int], int]:
    """(each entry's first element, elements in all) of a packed moment tensor (``ops.adam_step_``) for
    entries of `numels` elements: each starts where the last ended, rounded up to ``PACK_ALIGN`` elements."""
    offsets, total = [], 0
    for n in numels:
        offsets.append(total)
        total += -(-n // PACK_ALIGN) * PACK_ALIGN
    return offsets, total


def packed_views(packed: Tensor, like: Sequence[Tensor]) -> list[Tensor]:
    """The entries of a packed moment tensor for the dense tensors `like`, each shaped and strided as its
    tensor there (its elements in that tensor's memory order)."""
    offsets, _ = packed_offsets([t.numel() for t in like])
    base = packed.storage_offset()
    return [packed.as_strided(t.shape, t.stride(), base + o) for t, o in zip(like, offsets)]


def own_storage(view: Tensor) -> Tensor:
    """`view` (its memory, shape and strides) as the first elements of a storage of its own: a slice of
    its storage, which keeps that storage alive. Such a tensor deep-copies and saves (``torch.save``) as
    one of its own, where a view past its storage's first element cannot be deep-copied once a DTensor
    wraps it (torch's ``Tensor.__deepcopy__`` takes the wrapper's nonzero data pointer for a storage), and
    saves the whole storage it views. An empty `view` gets memory of its own (none), not a slice."""
    if not view.numel():
        return torch.empty_strided(view.shape, view.stride(), dtype=view.dtype, device=view.device)
    size = view.element_size()
    span = 1 + sum((n - 1) * s for n, s in zip(view.shape, view.stride()))
    start = view.storage_offset() * size
    memory = view.untyped_storage()[start:start + span * size]
    return torch.empty(0, dtype=view.dtype, device=view.device).set_(memory, 0, view.shape, view.stride())


def state_dtype(p: Tensor) -> torch.dtype:
    """The dtype of `p`'s fp32 moments and master: complex64 (fp32 parts) for a complex param."""
    return torch.complex64 if p.is_complex() else torch.float32


def layout_strides(p: Tensor) -> tuple[int, ...]:
    """The strides of `p`'s state, of the gradients the kernel reads and of its staging copy: `p`'s
    own if it is dense, else contiguous ones (as autograd's gradients of such a param have)."""
    if is_walkable(p):
        return p.stride()
    return torch.empty(p.shape, device="meta").stride()


def state_like(p: Tensor, dtype: torch.dtype | None = None, device: torch.device | None = None) -> Tensor:
    """Uninitialised memory with `p`'s shape and layout (``layout_strides``), by default in
    ``state_dtype(p)`` on `p`'s device."""
    return torch.empty_strided(p.shape, layout_strides(p), dtype=dtype or state_dtype(p), device=device or p.device)


def in_layout(p: Tensor, t: Tensor) -> Tensor:
    """`t` (`p`'s shape, e.g. its gradient) in `p`'s layout: `t` itself if it has it, else a copy."""
    return t if t.stride() == layout_strides(p) else state_like(p, t.dtype, t.device).copy_(t)


def as_real(t: Tensor) -> Tensor:
    """`t` as the kernel takes it: the real view of a complex tensor (a trailing dimension of 2)."""
    return torch.view_as_real(t) if t.is_complex() else t


def norm_view(g: Tensor) -> Tensor:
    """A gradient as the L2-norm kernel takes it: real and dense (a copy only if it is not dense)."""
    return as_real(g if is_walkable(g) else g.contiguous())


def kernel_lists(params: Sequence[Tensor], grads: Sequence[Tensor], exp_avgs: Sequence[Tensor],
                 exp_avg_sqs: Sequence[Tensor], param_outs: Sequence[Tensor] = ()
                 ) -> tuple[dict[str, list[Tensor]], list[tuple[Tensor, Tensor]]]:
    """The kernel's lists made from a call's lists of tensors that need views (the grads already in
    ``in_layout``), and the (copy, tensor) pairs to ``write_back`` after the kernel ran. A param not
    dense in memory goes through a contiguous copy, also when it is only written (``param_outs`` of
    a master): a skipped (inf/nan) update then writes back the values it had."""
    staged: list[tuple[Tensor, Tensor]] = []

    def written(t: Tensor) -> Tensor:  # a tensor the kernel updates, as it takes it
        real = as_real(t)
        if not is_walkable(t):
            real = real.contiguous()
        elif t.is_complex() and torch.compiler.is_compiling():
            # AOT functionalization (torch 2.14) cannot replay a custom op's write through a view that
            # changes the dtype (view_as_real): under torch.compile the kernel updates a real copy.
            real = real.clone()
        else:
            return real
        staged.append((real, t))
        return real

    lists = dict(params=[written(t) for t in params], grads=[as_real(g) for g in grads],
                 exp_avgs=[written(t) for t in exp_avgs], exp_avg_sqs=[written(t) for t in exp_avg_sqs],
                 param_outs=[written(t) for t in param_outs])
    return lists, staged


def write_back(staged: list[tuple[Tensor, Tensor]]) -> None:
    """Copies each copy that ``kernel_lists`` gave the kernel back into its tensor."""
    for real, t in staged:
        t.copy_(torch.view_as_complex(real) if t.is_complex() else real)


# ---------------------------------------------------------------------- params repeated in a group

Work = list[tuple[dict, list[Tensor], list[Tensor]]]  # (group, params with a gradient, their gradients)


def rounds(work: Work) -> list[Work]:
    """`work` split so that no round holds a param twice (a kernel call must not see a tensor twice).

    torch.optim warns about a param listed twice in a group and its AdamW (for-loop and foreach)
    then updates it once per listing, in turn, counting a step each time; the rounds do the same: the
    k-th listing of a param is in the k-th round, run after the one before. One round (`work`
    itself) unless a group repeats a param; every round has an entry per group, in order."""
    if all(len(set(map(id, params))) == len(params) for _, params, _ in work):
        return [work]
    out: list[Work] = []
    for index, (_, params, grads) in enumerate(work):
        seen: dict[int, int] = defaultdict(int)
        for p, g in zip(params, grads):
            k = seen[id(p)]
            seen[id(p)] += 1
            if k == len(out):
                out.append([(group, [], []) for group, _, _ in work])
            out[k][index][1].append(p)
            out[k][index][2].append(g)
    return out
