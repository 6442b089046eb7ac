"""FusedAdam's packed moments (distopt/fused_adam/plan.py ``pack_moments``): the step plan keeps each kernel
call's fp32/bf16 moments in one tensor, the state holding views of it shaped and strided as the params, so
that a call passes two moment tensors instead of two per param. Here: what is packed and what is not (one
param, 8-bit moments, over the size bound), that the state keeps torch's format through save and load
(one storage saved once, torch.optim.AdamW takes it), that a repack lets the old moments go, and that the
steps are those of unpacked moments (test_fused_adam_plan.py's scenario compares every change with the
general step; tests/ops/test_ops_adam_packed.py the kernel's bits); DTensor params' moments stay apart."""

from __future__ import annotations

import gc
import io
import weakref

import pytest
import torch
from torch import nn

from distopt import FusedAdam, ops
from distopt.fused_adam import plan


def model_params(count: int = 6) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    shapes = [(3, 5), (17,), (2, 4, 3, 3), (1,), (16,), (9, 2)][:count]
    params = [nn.Parameter(torch.randn(s, generator=g)) for s in shapes]
    if count > 2:
        params[2] = nn.Parameter(params[2].detach().contiguous(memory_format=torch.channels_last))
    return params


def train(opt: torch.optim.Optimizer, params: list[nn.Parameter], steps: int, first: int = 0) -> None:
    for step in range(first, first + steps):
        for i, p in enumerate(params):
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(100 * step + i)).to(p.dtype)
        opt.step()


def storages(opt: FusedAdam, key: str) -> set[int]:
    return {s[key].untyped_storage().data_ptr() for s in opt.state.values()}


@pytest.mark.parametrize("moment_dtype", [torch.float32, torch.bfloat16])
def test_a_calls_moments_are_views_of_one_tensor_at_the_ops_offsets(moment_dtype):
    params = model_params()
    opt = FusedAdam(params, exp_avg_dtype=moment_dtype, exp_avg_sq_dtype=moment_dtype)
    train(opt, params, 2)
    for key in ("exp_avg", "exp_avg_sq"):
        views = [opt.state[p][key] for p in params]
        assert len(storages(opt, key)) == 1
        offsets, _ = ops.packed_offsets([p.numel() for p in params])
        assert [v.storage_offset() - views[0].storage_offset() for v in views] == offsets
        assert all(v.shape == p.shape and v.stride() == p.stride() and v.dtype == moment_dtype
                   for v, p in zip(views, params))
    assert storages(opt, "exp_avg") != storages(opt, "exp_avg_sq")


def test_what_stays_one_tensor_per_param(monkeypatch):
    one = [nn.Parameter(torch.randn(5))]
    opt = FusedAdam(one)
    train(opt, one, 2)
    assert opt._plan.calls[0].packed == {}  # one param: nothing to save
    eight_bit = [nn.Parameter(torch.randn(4096)), nn.Parameter(torch.randn(4096))]
    opt = FusedAdam(eight_bit, exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.bfloat16)
    train(opt, eight_bit, 2)
    assert list(opt._plan.calls[0].packed) == ["exp_avg_sq"]  # 8-bit moments keep their per-param absmax
    assert len(storages(opt, "exp_avg")) == 2 and len(storages(opt, "exp_avg_sq")) == 1
    monkeypatch.setattr(plan, "PACK_LIMIT", 4 * 40)  # fewer bytes than the moments of model_params()
    params = model_params()
    opt = FusedAdam(params)
    train(opt, params, 2)
    assert opt._plan.calls[0].packed == {} and len(storages(opt, "exp_avg")) == len(params)


def test_packed_steps_equal_unpacked_ones(monkeypatch):
    """The same training with packing (default) and without (PACK_LIMIT 0): the same bits."""
    results = []
    for limit in (plan.PACK_LIMIT, 0):
        monkeypatch.setattr(plan, "PACK_LIMIT", limit)
        params = model_params()
        opt = FusedAdam(params, weight_decay=0.1)
        train(opt, params, 4)
        assert len(storages(opt, "exp_avg")) == (1 if limit else len(params))
        results.append([t.clone() for p in params for t in (p.detach(), opt.state[p]["exp_avg"],
                                                             opt.state[p]["exp_avg_sq"])])
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_state_dict_saves_the_packed_storage_once_and_loads_bit_for_bit():
    params = model_params()
    opt = FusedAdam(params)
    train(opt, params, 3)
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    moments = sum(opt.state[p][k].nbytes for p in params for k in ("exp_avg", "exp_avg_sq"))
    assert buffer.tell() < moments + 16 * 4 * 2 * len(params) + 8192  # the moments, their padding, the rest
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    clones = [nn.Parameter(p.detach().clone()) for p in params]
    resumed = FusedAdam(clones)
    resumed.load_state_dict(saved)
    torch_opt = torch.optim.AdamW([nn.Parameter(p.detach().clone()) for p in params])
    torch_opt.load_state_dict(opt.state_dict())  # torch.optim takes the views as its state
    train(opt, params, 2, first=3)
    train(resumed, clones, 2, first=3)
    assert all(torch.equal(a, b) for a, b in zip(params, clones))
    assert all(torch.equal(opt.state[p][k], resumed.state[q][k]) for p, q in zip(params, clones)
               for k in ("exp_avg", "exp_avg_sq", "step"))
    assert len(storages(resumed, "exp_avg")) == 1  # repacked after the load


def test_a_repack_lets_the_old_moments_go():
    """A param that stops getting a gradient changes its call: the others' moments are repacked, its own
    get their own memory, and nothing holds the old packed tensor any more (the old plan is dropped
    before the new one is built)."""
    params = model_params()
    opt = FusedAdam(params)
    train(opt, params, 2)
    old = weakref.ref(opt._plan.calls[0].packed["exp_avg"])
    (old_storage,) = storages(opt, "exp_avg")
    values = [opt.state[p]["exp_avg"].clone() for p in params]
    params[3].grad = None
    for p in params[:3] + params[4:]:
        p.grad = torch.randn(p.shape)
    opt.step()
    gc.collect()
    assert old() is None and old_storage not in storages(opt, "exp_avg")
    alone = opt.state[params[3]]["exp_avg"]
    assert alone.untyped_storage().nbytes() == alone.nbytes and torch.equal(alone, values[3])
    assert len(storages(opt, "exp_avg")) == 2  # the new packed tensor, and params[3]'s own


def fsdp2_rank(rank: int, world_size: int) -> int:
    """FSDP2 (fully_shard per layer, 2 gloo ranks): returns the number of storages of the moments' local
    shards, after checking that torch.distributed.checkpoint's optimizer state dict deep-copies."""
    import copy

    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from dtensor_models import batch, fsdp

    model, index = fsdp(0, rank, world_size)
    opt = FusedAdam(model.parameters(), weight_decay=0.1)
    for step in range(3):
        x, y = batch(step, index)
        (model(x) - y).square().mean().backward()
        opt.step()
        opt.zero_grad()
    copy.deepcopy(get_optimizer_state_dict(model, opt))
    return len({opt.state[p]["exp_avg"]._local_tensor.untyped_storage().data_ptr() for p in model.parameters()
                if p._local_tensor.numel()})


def test_dtensor_moments_stay_one_tensor_per_param():
    """A DTensor over a view past its storage's first element cannot be deep-copied (torch's
    Tensor.__deepcopy__ takes it for a tensor with storage), and DCP's state dicts are: FSDP2's moments
    are not packed."""
    from harness import run_ranks

    for rank, storages_ in enumerate(run_ranks(fsdp2_rank, 2)):
        assert storages_ == (6 if rank == 0 else 4), storages_  # one per non-empty shard
