"""Small models whose params are DTensors, in the layouts FusedAdam supports: FSDP2 (``fully_shard`` on
a 1-D mesh), HSDP (a 2-D Replicate x Shard mesh), tensor parallelism (``parallelize_module``: Shard(0),
Shard(1) and Replicate params), FSDP + TP on a (dp, tp) mesh, whose last layer lives on the dp mesh
alone, and TP and FSDP layers on two different meshes. The layers' rows (5 or 8, 7 and 1) make uneven
shards and zero-element local shards on 2 and 4 ranks.

Each builder returns (model, batch index): ranks with the same batch index must see the same batch
(the tensor-parallel ranks of a data-parallel replica); ``batch(step, index)`` makes it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

IN, OUT = 16, 1


def mlp(seed: int, dtype: torch.dtype = torch.float32, width: int = 5) -> nn.Sequential:
    """Three layers; tensor parallelism needs `width` divisible by the tp size (the Colwise layer's
    output feeds the Rowwise layer as even shards)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, width), nn.Tanh(), nn.Linear(width, 7), nn.Tanh(), nn.Linear(7, OUT)).to(dtype)


def _fully_shard_layers(model: nn.Sequential, mesh) -> None:
    for layer in model[::2]:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _tensor_parallel(model: nn.Sequential, mesh) -> None:
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})


def fsdp(seed: int, rank: int, world_size: int, dtype: torch.dtype = torch.float32, device: str = "cpu"
         ) -> tuple[nn.Module, int]:
    model = mlp(seed, dtype).to(device)
    _fully_shard_layers(model, init_device_mesh(device, (world_size,)))
    return model, rank


def hsdp(seed: int, rank: int, world_size: int) -> tuple[nn.Module, int]:
    model = mlp(seed)
    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
    _fully_shard_layers(model, mesh)
    return model, rank


def tp(seed: int, rank: int, world_size: int) -> tuple[nn.Module, int]:
    """Colwise and Rowwise layers (Shard(0), Shard(1) and Replicate params) and a last layer replicated
    over the tp mesh: every param a DTensor."""
    model = mlp(seed, width=8)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    _tensor_parallel(model, mesh)
    distribute_module(model[4], mesh, input_fn=lambda module, inputs, mesh: tuple(
        DTensor.from_local(t, mesh, [Replicate()]) for t in inputs), output_fn=lambda module, out, mesh: out.to_local())
    return model, 0


def fsdp_tp(seed: int, rank: int, world_size: int) -> tuple[nn.Module, int]:
    """TP inside each data-parallel replica, FSDP across them: the TP layers' params are 2-D DTensors,
    the last layer's 1-D on the dp mesh (params on two meshes in one optimizer)."""
    model = mlp(seed, width=8)
    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("dp", "tp"))
    _tensor_parallel(model, mesh["tp"])
    _fully_shard_layers(model, mesh["dp"])
    return model, rank // (world_size // 2)


def two_meshes(seed: int, rank: int, world_size: int) -> tuple[nn.Module, int]:
    """TP layers on one mesh, an FSDP layer on another mesh of the same ranks."""
    model = mlp(seed, width=8)
    _tensor_parallel(model, init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",)))
    fully_shard(model[4], mesh=init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",)))
    return model, 0


LAYOUTS: dict[str, Callable[..., tuple[nn.Module, int]]] = {
    "fsdp": fsdp, "hsdp": hsdp, "tp": tp, "fsdp_tp": fsdp_tp, "two_meshes": two_meshes,
}


def batch(step: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + index)
    return torch.randn(8, IN, generator=g), torch.randn(8, OUT, generator=g)


def groups(model: nn.Module) -> list[dict]:
    """Weights and biases in two groups with different hyperparameters (each group mixes meshes and
    placements where the layout has several)."""
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if n.endswith("weight")], "lr": 1e-2},
            {"params": [p for n, p in named if n.endswith("bias")], "lr": 3e-3, "weight_decay": 0.1}]
