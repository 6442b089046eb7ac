"""Small tensor-parallel models for DistributedFusedAdam's tests (test_tensor_parallel.py), each with the
unsharded model it stands for: a column-parallel then a row-parallel Linear, a LayerNorm and a last
Linear replicated over the tensor-parallel ranks.

``dtensor_tp``: torch's ``parallelize_module`` (ColwiseParallel, RowwiseParallel) on the "tp" dimension
of a (dp, tp) mesh: Shard(0), Shard(1) and Replicate DTensor params, and plain ones.
``PlainTP``: the same layers as Megatron-LM builds them, with plain tensors and two autograd functions
around the tensor-parallel region; its sharded params carry Megatron's ``tensor_model_parallel``.

``reference_of(model, name, ref)`` is this rank's part of the unsharded model's param that `name` stands for.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

IN, HIDDEN, MID, OUT = 16, 8, 7, 1
GLOBAL_BATCH = 8


def mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, MID), nn.LayerNorm(MID),
                         nn.Linear(MID, OUT))


def batch(step: int) -> tuple[Tensor, Tensor]:
    """The global batch of a step (every data-parallel rank takes its rows: ``rows``)."""
    g = torch.Generator().manual_seed(step)
    return torch.randn(GLOBAL_BATCH, IN, generator=g), torch.randn(GLOBAL_BATCH, OUT, generator=g)


def rows(t: Tensor, dp_rank: int, dp_size: int, micro: int = 0, micros: int = 1) -> Tensor:
    """Data-parallel rank `dp_rank`'s rows of a global batch, or micro-batch `micro` of them."""
    mine = t.chunk(dp_size)[dp_rank]
    return mine.chunk(micros)[micro]


def dtensor_tp(tp_mesh, seed: int = 0) -> nn.Sequential:
    model = mlp(seed)
    parallelize_module(model, tp_mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    return model


class _CopyToTP(torch.autograd.Function):
    """Identity; the gradient, partial on each tensor-parallel rank, is summed over them."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """The sum of the tensor-parallel ranks' partial outputs; the gradient passes unchanged."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None


class PlainTP(nn.Module):
    """``mlp(seed)`` split over the tensor-parallel `group` as Megatron-LM does it, with plain tensors:
    this rank's rows of the first Linear, its columns of the second one's weight (whose bias, the
    LayerNorm and the last Linear are copies on every tensor-parallel rank)."""

    def __init__(self, group, seed: int = 0) -> None:
        super().__init__()
        whole, self.group = mlp(seed), group
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        self.w0 = nn.Parameter(whole[0].weight.detach().chunk(size, 0)[rank].clone())
        self.b0 = nn.Parameter(whole[0].bias.detach().chunk(size, 0)[rank].clone())
        self.w2 = nn.Parameter(whole[2].weight.detach().chunk(size, 1)[rank].clone())
        self.b2 = nn.Parameter(whole[2].bias.detach().clone())
        self.norm, self.last = whole[3], whole[4]
        for p in (self.w0, self.b0, self.w2):
            p.tensor_model_parallel = True  # Megatron's mark for a tensor-parallel shard
        self._slices: dict[Tensor, Callable[[nn.Module], Tensor]] = {
            self.w0: lambda ref: ref[0].weight.chunk(size, 0)[rank],
            self.b0: lambda ref: ref[0].bias.chunk(size, 0)[rank],
            self.w2: lambda ref: ref[2].weight.chunk(size, 1)[rank],
            self.b2: lambda ref: ref[2].bias,
        }
        for name, p in (("3", self.norm), ("4", self.last)):
            for attr in ("weight", "bias"):
                self._slices[getattr(p, attr)] = lambda ref, n=name, a=attr: getattr(ref.get_submodule(n), a)

    def forward(self, x: Tensor) -> Tensor:
        x = _CopyToTP.apply(x, self.group)
        h = torch.tanh(nn.functional.linear(x, self.w0, self.b0))
        h = _ReduceFromTP.apply(nn.functional.linear(h, self.w2), self.group) + self.b2
        return self.last(self.norm(h))

    def reference_of(self, p: Tensor, ref: nn.Module) -> Tensor:
        return self._slices[p](ref)


def local(t: Tensor) -> Tensor:
    """A DTensor's local part (or the tensor itself), detached."""
    return (t.to_local() if isinstance(t, DTensor) else t).detach()


def reference_of(model: nn.Module, name: str, ref: nn.Module) -> Tensor:
    """This rank's part of the unsharded `ref`'s param that `model`'s param `name` stands for."""
    if isinstance(model, PlainTP):
        return model.reference_of(model.get_parameter(name), ref)
    p, q = model.get_parameter(name), ref.get_parameter(name).detach()
    if isinstance(p, DTensor):
        return distribute_tensor(q, p.device_mesh, p.placements, src_data_rank=None).to_local()
    return q


def nemo_filter(model: nn.Module, tp_rank: int) -> list[Tensor]:
    """The params NeMo's clip_grad_norm_distributed_optimizer counts: tensor-parallel shards, and the
    copies of the others on tensor-parallel rank 0 only."""
    return [p for p in model.parameters() if getattr(p, "tensor_model_parallel", False) or tp_rank == 0]
