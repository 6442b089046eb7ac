"""Where a DTensor param's state sits in a checkpoint (DistributedFusedAdam under tensor parallelism,
distopt/distributed/tensor_parallel.py).

``state_dict()`` holds a DTensor param's state as DTensors laid out as the param (``param_state``;
gathered over dp only, as torch.optim.AdamW's state of the same model), which
``get_optimizer_state_dict``, ``full_state_dict`` and ``dcp.save``/``dcp.load`` handle; loading takes
them, or whole tensors, as this rank's part (``local_value``). The sharded forms (dcp_state.py,
file_format.py) place this rank's ranges inside the local chunk (``chunk_origin``, ``chunk_name``), so
tensor-parallel ranks never write over each other, and reshard over dp; distopt's own sharded files are
written by the ranks of ``checkpoint_group`` and record each param's layout (``check_saved_layout``).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from ...dtensor import local, placed_like
from ..tensor_parallel import group_ranks, layout_text
from .protocol import ShardedOptimizer


def param_state(p: Tensor, t: Tensor) -> Tensor:
    """State tensor `t` (of the shape of `p`'s local tensor) as ``state_dict()`` holds it: for a DTensor
    param, a DTensor laid out as `p` (mesh, placements, global shape and stride), on `t`'s device (a CPU
    state dict stays on the CPU, as torch's ``cpu_offload`` keeps DTensors)."""
    if not isinstance(p, DTensor):
        return t
    mesh = p.device_mesh
    on_mesh = t if t.device.type == mesh.device_type else t.to(mesh.device_type)
    out = DTensor.from_local(on_mesh, mesh, p.placements, shape=p.shape, stride=p.stride(), run_check=False)
    return out if out.device == t.device else out.to(t.device)


def local_value(p: Tensor, value: Tensor, name: str) -> Tensor:
    """A loaded state tensor as the buckets take it: for a DTensor param, this rank's part of `value` (a
    DTensor on the param's mesh, redistributed to its placements if need be, or a whole tensor, sliced
    here); a DTensor for a plain param, or on another mesh, raises ValueError."""
    if not isinstance(p, DTensor) and not isinstance(value, DTensor):
        return value
    return local(placed_like(p, value, name))


def chunk_origin(p: Tensor) -> tuple[int, ...] | None:
    """Where this rank's local chunk of a DTensor param starts in the whole param (None for a plain
    param, which is whole)."""
    if not isinstance(p, DTensor):
        return None
    (chunk,) = p.__create_chunk_list__()  # torch.distributed.checkpoint's view of the local shard
    return tuple(chunk.offsets)


def chunk_name(g: int, p: Tensor) -> str:
    """A param's name in distopt's sharded checkpoints: its position in param_groups, and for a DTensor
    param the offsets of this rank's local chunk ("3@4_0"), so that tensor-parallel ranks' ranges of it
    have names of their own."""
    origin = chunk_origin(p)
    return str(g) if origin is None else f"{g}@{'_'.join(map(str, origin))}"


def checkpoint_group(opt: ShardedOptimizer) -> Any:
    """The ranks that write and read one of `opt`'s sharded checkpoints (checkpoint.save/load): its
    data-parallel process_group, or every rank (torch.distributed.checkpoint's default group) where
    DTensor params live on other ranks too: their chunks make one checkpoint of the whole model. Parts
    of the model that are plain tensors on other model-parallel ranks are unknown to the checkpoint:
    each model-parallel rank saves its own, as Megatron-LM does."""
    data_parallel = group_ranks(opt.comm.process_group)
    for p in opt.checkpoint_params():
        if isinstance(p, DTensor) and not set(p.device_mesh.mesh.flatten().tolist()) <= data_parallel:
            return dist.group.WORLD
    return opt.comm.process_group


def check_saved_layout(g: int, p: Tensor, saved: str | None) -> None:
    """Raises ValueError unless param `g` (`p`) has the layout a sharded checkpoint recorded for it
    (``layout_text``; None for a plain tensor)."""
    if saved != layout_text(p):
        now = layout_text(p) or "a plain tensor"
        raise ValueError(f"param {g} was saved as {saved or 'a plain tensor'}, now {now}: load the per-param "
                         "state_dict() form instead")
