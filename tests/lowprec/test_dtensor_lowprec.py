"""FusedAdam's low-precision moments on DTensor params (FSDP2's ``fully_shard``), on 2 and 4 gloo ranks:

- the sharded update is bit for bit FusedAdam's on the unsharded model given the gathered gradients,
  for bf16 and 8-bit moments and stochastic rounding (bf16 moments, and bf16 params without masters):
  blocks and rounding keys count from each param's first element, so the sharding changes no bit;
- state dicts: the sharded optimizer's own loads back bit for bit, and the unsharded optimizer's
  (whole tensors) loads into the sharded one, each rank taking its elements and its absmax blocks;
- DCP (get/set_optimizer_state_dict, dcp.save/load) reshards 8-bit state saved on 2 ranks onto 4 and 1
  bit for bit (the absmax is a Shard(0) DTensor of the param's blocks);
- layouts that cannot hold whole blocks, or whose shards are not one range of the param, are refused
  at construction on every rank, naming the param: a dim-0 shard not starting at a multiple of 256
  elements (8-bit), a Shard(1) param (8-bit or stochastic rounding); bf16 moments take any layout.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from distopt import FusedAdam

from harness import run_ranks

BF16, U8, F32 = torch.bfloat16, torch.uint8, torch.float32


def mlp(dtype: torch.dtype, misaligned: bool = False) -> nn.Sequential:
    """(64, 128) weight: 8,192 elements, 8-bit, dim-0 shards of 4,096 or 2,048 elements on 2 or 4 ranks;
    (48, 64): 3,072 elements, fp32 under 8-bit; with `misaligned`, (50, 100): 25 rows of 100 per rank."""
    torch.manual_seed(0)
    last = nn.Linear(100, 50) if misaligned else nn.Linear(48, 8)
    first = nn.Linear(8, 100) if misaligned else nn.Linear(64, 48)
    return nn.Sequential(nn.Linear(128, 64), nn.Tanh(), first, nn.Tanh(), last).to(dtype)


def sharded(dtype: torch.dtype, world_size: int, misaligned: bool = False) -> nn.Sequential:
    model = mlp(dtype, misaligned)
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model[::2]:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def backward(model: nn.Module, step: int) -> None:
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(4, 128, generator=gen).to(next(model.parameters()).dtype)
    model(x).float().square().mean().backward()


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def same_state(key: str, a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether state `a` (of a DTensor param: gathered) holds `b`'s bits (of the unsharded param). An absmax
    of a DTensor param is laid out by the param's rows (moment_formats.absmax_shape): its first entries
    must be `b`'s blocks, and the rest zeros."""
    a = full(a)
    if key.endswith("_absmax") and a.shape != b.shape:
        flat = a.reshape(-1)
        return torch.equal(flat[: b.numel()], b) and not flat[b.numel():].any()
    return torch.equal(a, b) and a.dtype == b.dtype


def like_unsharded(rank: int, world_size: int, options: dict, dtype: torch.dtype) -> list[str]:
    model, whole = sharded(dtype, world_size), mlp(dtype)
    opts = []
    for m in (model, whole):
        torch.manual_seed(5)  # the same rounding seed for both
        opts.append(FusedAdam(m.parameters(), lr=1e-2, **options))
    opt, whole_opt = opts
    differ = []
    for step in range(3):
        backward(model, step)
        for p, q in zip(model.parameters(), whole.parameters()):
            q.grad = p.grad.full_tensor()
        opt.step()
        whole_opt.step()
        for (name, p), q in zip(model.named_parameters(), whole.parameters()):
            pairs = [("param", p, q)] + [(k, v, whole_opt.state[q][k]) for k, v in opt.state[p].items() if k != "step"]
            differ += [f"step {step} {name} {k}" for k, a, b in pairs if not same_state(k, a, b)]
        opt.zero_grad()
        whole_opt.zero_grad()
    # State dicts: the sharded optimizer's own, and the unsharded one's whole tensors.
    for source, label in ((opt, "own"), (whole_opt, "unsharded")):
        loaded = FusedAdam(model.parameters(), lr=1e-2, **options)
        loaded.load_state_dict(source.state_dict())
        for name, p in model.named_parameters():
            differ += [f"{label} state dict: {name} {k}" for k, v in opt.state[p].items()
                       if not torch.equal(full(loaded.state[p][k]), full(v))]
        if options.get("stochastic_rounding"):
            seeds = [o.param_groups[0]["rounding_seed"] for o in (loaded, opt)]
            differ += [f"{label}: seed"] * (seeds[0] != seeds[1])
    return differ


CASES = {
    "bf16 moments, stochastic rounding": (dict(exp_avg_dtype=BF16, exp_avg_sq_dtype=BF16, stochastic_rounding=True),
                                          F32),
    "8-bit moments": (dict(exp_avg_dtype=U8, exp_avg_sq_dtype=U8), F32),
    "8-bit/bf16, bf16 params with masters": (dict(exp_avg_dtype=U8, exp_avg_sq_dtype=BF16, master_weights=True), BF16),
    "bf16 params without masters, stochastic rounding": (dict(stochastic_rounding=True), BF16),
}


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("case", list(CASES))
def test_sharded_update_and_state_dicts_are_bitwise_the_unsharded_ones(case, world_size):
    options, dtype = CASES[case]
    results = run_ranks(like_unsharded, world_size=world_size, args=(options, dtype))
    assert results == [[]] * world_size, results


def refusals(rank: int, world_size: int) -> list[str]:
    out = []
    model = sharded(F32, world_size, misaligned=True)
    for options in (dict(exp_avg_dtype=U8), dict(exp_avg_sq_dtype=U8)):
        try:
            FusedAdam(model.parameters(), **options)
            out.append("accepted")
        except ValueError as e:
            out.append(str(e))
    FusedAdam(model.parameters(), exp_avg_dtype=BF16, exp_avg_sq_dtype=BF16)  # bf16: any layout
    # A Shard(1) param: its shard is not one range of the param's elements.
    mesh = init_device_mesh("cpu", (world_size,))
    p = nn.Parameter(distribute_tensor(torch.randn(64, 128), mesh, [Shard(1)]))
    for options in (dict(exp_avg_dtype=U8), dict(exp_avg_sq_dtype=BF16, stochastic_rounding=True)):
        try:
            FusedAdam([p], **options)
            out.append("accepted")
        except ValueError as e:
            out.append(str(e))
    FusedAdam([p], exp_avg_dtype=BF16)
    return out


def test_layouts_without_whole_blocks_are_refused_on_every_rank():
    results = run_ranks(refusals, world_size=2)
    assert results[0] == results[1]  # every rank raises the same error
    misaligned, misaligned_sq, strided, strided_sr = results[0]
    for message in (misaligned, misaligned_sq):
        assert "param_groups[0]['params'][4]" in message and "multiple of 256" in message, message
        assert "[25, 25] rows of 100" in message, message
    for message in (strided, strided_sr):
        assert "sharded along dim 0" in message and "Shard(dim=1)" in message, message


def dcp_save(rank: int, world_size: int, path: str) -> dict:
    """Trains 3 steps on `world_size` ranks, saves through DCP; returns the full state (gathered)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    model = sharded(F32, world_size)
    torch.manual_seed(5)
    opt = FusedAdam(model.parameters(), lr=1e-2, **CASES["8-bit moments"][0])
    for step in range(3):
        backward(model, step)
        opt.step()
        opt.zero_grad()
    dcp.save({"optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=path)
    return {name: {k: full(v) for k, v in opt.state[p].items()} for name, p in model.named_parameters()}


def dcp_load(rank: int, world_size: int, path: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    model = sharded(F32, world_size)
    opt = FusedAdam(model.parameters(), lr=1e-2, **CASES["8-bit moments"][0])
    target = {"optim": get_optimizer_state_dict(model, opt)}
    dcp.load(target, checkpoint_id=path)
    set_optimizer_state_dict(model, opt, target["optim"])
    return {name: {k: full(v) for k, v in opt.state[p].items()} for name, p in model.named_parameters()}


def test_dcp_reshards_8bit_state_bit_for_bit(tmp_path):
    """Saved on 2 ranks, loaded on 4 (and 1): the codes and absmax of every block, as saved."""
    saved = run_ranks(dcp_save, world_size=2, args=(str(tmp_path),))[0]
    for world_size in (4, 1):
        loaded = run_ranks(dcp_load, world_size=world_size, args=(str(tmp_path),))[0]
        assert loaded.keys() == saved.keys()
        for name in saved:
            assert saved[name].keys() == loaded[name].keys(), name
            for k in saved[name]:
                assert torch.equal(saved[name][k], loaded[name][k]), (world_size, name, k)
        assert "exp_avg_absmax" in loaded["0.weight"]
