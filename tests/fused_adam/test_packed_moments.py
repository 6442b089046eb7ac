"""FusedAdam's packed moments (distopt/fused_adam/plan.py ``pack_moments``): the step plan keeps each kernel
call's fp32/bf16 moments in one tensor, the state holding its entries (shaped and strided as the params,
each over a storage of its own), so that a call passes two moment tensors instead of two per param. Here:
what is packed and what is not (one param, 8-bit moments, over the size bound), that the state keeps
torch's format through save and load (each moment saved alone, torch.optim.AdamW takes them), that a
repack lets the old packed tensor go, and that the steps are those of unpacked moments
(test_fused_adam_plan.py's scenario compares every change with the general step;
tests/ops/test_ops_adam_packed.py the kernel's bits); FSDP2's DTensor moments are packed too, and their
state dicts deep-copy (torch.distributed.checkpoint's do)."""

from __future__ import annotations

import gc
import io
import weakref

import pytest
import torch
from torch import nn

from distopt import FusedAdam, kernel_views, ops
from distopt.dtensor import local
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


def in_packs(opt: FusedAdam, key: str) -> list[bool]:
    """Per param (in opt.state's order): whether its `key` moment lies inside one of the plan's packed
    tensors (an empty one: whether the plan packs its list)."""
    packs = [(f.data_ptr(), f.data_ptr() + max(f.nbytes, 1)) for c in opt._plan.calls for f in c.packed.values()]
    packed_lists = {id(t) for c in opt._plan.calls for t in (c.exp_avgs if key == "exp_avg" else c.exp_avg_sqs)
                    if key in c.packed}
    return [any(a <= local(s[key]).data_ptr() < b for a, b in packs) if local(s[key]).numel()
            else id(local(s[key])) in packed_lists for s in opt.state.values()]


@pytest.mark.parametrize("moment_dtype", [torch.float32, torch.bfloat16])
def test_a_calls_moments_are_entries_of_one_tensor_at_the_ops_offsets(moment_dtype):
    params = model_params()
    opt = FusedAdam(params, exp_avg_dtype=moment_dtype, exp_avg_sq_dtype=moment_dtype)
    train(opt, params, 2)
    (call,) = opt._plan.calls
    for key in ("exp_avg", "exp_avg_sq"):
        flat = call.packed[key]
        moments = [opt.state[p][key] for p in params]
        offsets, total = ops.packed_offsets([p.numel() for p in params])
        assert flat.shape == (total,) and flat.dtype == moment_dtype
        assert [m.data_ptr() - flat.data_ptr() for m in moments] == [o * flat.element_size() for o in offsets]
        assert all(m.shape == p.shape and m.stride() == p.stride() and m.dtype == moment_dtype
                   and m.storage_offset() == 0 and m.untyped_storage().nbytes() == m.nbytes
                   for m, p in zip(moments, params))
        flat.add_(1)  # the entries alias the packed tensor
        assert torch.equal(moments[2].reshape(-1), flat[offsets[2]:offsets[2] + params[2].numel()].view_as(
            moments[2].permute(0, 2, 3, 1)).permute(0, 3, 1, 2).reshape(-1))
    assert call.packed["exp_avg"].data_ptr() != call.packed["exp_avg_sq"].data_ptr()


def test_own_storage_aliases_and_keeps_its_base_alive():
    base = torch.arange(40.0)
    view = base[8:32].view(4, 6).t()  # (6, 4), strides (1, 6)
    alone = kernel_views.own_storage(view)
    assert (alone.shape, alone.stride(), alone.storage_offset()) == (view.shape, view.stride(), 0)
    assert alone.data_ptr() == view.data_ptr() and alone.untyped_storage().nbytes() == 24 * 4
    base.add_(100)
    expected = view.clone()
    assert torch.equal(alone, expected)  # the same memory
    del base, view
    gc.collect()
    churn = [torch.full((40,), -1.0) for _ in range(64)]  # would take freed memory of base's size
    assert torch.equal(alone, expected) and len(churn) == 64
    empty = kernel_views.own_storage(torch.arange(8.0)[8:].view(0, 4))
    assert empty.shape == (0, 4) and empty.untyped_storage().nbytes() == 0  # no slice holding its base


def test_what_stays_one_tensor_per_param(monkeypatch):
    one = [nn.Parameter(torch.randn(5))]
    opt = FusedAdam(one)
    train(opt, one, 2)
    assert opt._plan.calls[0].packed == {}  # one param: nothing to save
    eight_bit = [nn.Parameter(torch.randn(4096)), nn.Parameter(torch.randn(4096))]
    opt = FusedAdam(eight_bit, exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.bfloat16)
    train(opt, eight_bit, 2)
    assert list(opt._plan.calls[0].packed) == ["exp_avg_sq"]  # 8-bit moments keep their per-param absmax
    assert in_packs(opt, "exp_avg") == [False, False] and in_packs(opt, "exp_avg_sq") == [True, True]
    monkeypatch.setattr(plan, "PACK_LIMIT", 4 * 40)  # fewer bytes than the moments of model_params()
    params = model_params()
    opt = FusedAdam(params)
    train(opt, params, 2)
    assert opt._plan.calls[0].packed == {} and not any(in_packs(opt, "exp_avg"))


def test_packed_steps_equal_unpacked_ones(monkeypatch):
    """The same training with packing (default) and without (PACK_LIMIT 0): the same bits."""
    results = []
    for limit in (plan.PACK_LIMIT, 0):
        monkeypatch.setattr(plan, "PACK_LIMIT", limit)
        params = model_params()
        opt = FusedAdam(params, weight_decay=0.1)
        train(opt, params, 4)
        assert in_packs(opt, "exp_avg") == [bool(limit)] * len(params)
        results.append([t.clone() for p in params for t in (p.detach(), opt.state[p]["exp_avg"],
                                                             opt.state[p]["exp_avg_sq"])])
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_state_dict_saves_each_moment_alone_and_loads_bit_for_bit():
    params = model_params()
    opt = FusedAdam(params)
    train(opt, params, 3)
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    moments = sum(opt.state[p][k].nbytes for p in params for k in ("exp_avg", "exp_avg_sq"))
    assert buffer.tell() < moments + 8192  # the moments without the packing's padding, and the rest
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    clones = [nn.Parameter(p.detach().clone()) for p in params]
    resumed = FusedAdam(clones)
    resumed.load_state_dict(saved)
    torch_opt = torch.optim.AdamW([nn.Parameter(p.detach().clone()) for p in params])
    torch_opt.load_state_dict(opt.state_dict())  # torch.optim takes the packed entries as its state
    train(opt, params, 2, first=3)
    train(resumed, clones, 2, first=3)
    assert all(torch.equal(a, b) for a, b in zip(params, clones))
    assert all(torch.equal(opt.state[p][k], resumed.state[q][k]) for p, q in zip(params, clones)
               for k in ("exp_avg", "exp_avg_sq", "step"))
    assert all(in_packs(resumed, "exp_avg"))  # packed after the load


def test_a_rebuilt_plan_keeps_a_packed_list_and_a_repack_lets_the_old_one_go():
    """A plan rebuilt over the same params keeps their packed tensors. A param that stops getting a
    gradient changes its call: the others' moments are repacked, its own get their own memory, and
    nothing holds the old packed tensor any more."""
    params = model_params()
    opt = FusedAdam(params)
    train(opt, params, 2)
    packed = opt._plan.calls[0].packed["exp_avg"]
    opt._plan_epoch += 1  # (what add_param_group or a load does to the plan's key)
    train(opt, params, 1, first=2)
    assert opt._plan.calls[0].packed["exp_avg"] is packed and all(in_packs(opt, "exp_avg"))
    old = weakref.ref(packed)
    del packed
    values = [opt.state[p]["exp_avg"].clone() for p in params]
    params[3].grad = None
    for p in params[:3] + params[4:]:
        p.grad = torch.randn(p.shape)
    opt.step()
    gc.collect()
    assert old() is None
    alone = opt.state[params[3]]["exp_avg"]
    assert in_packs(opt, "exp_avg") == [True, True, True, False, True, True] and torch.equal(alone, values[3])


def fsdp2_rank(rank: int, world_size: int, views: bool) -> tuple[bool, str]:
    """FSDP2 (fully_shard per layer, 2 gloo ranks): whether every moment's local shard lies in the plan's
    packed tensors, and what deep-copying torch.distributed.checkpoint's optimizer state dict raised ('' if
    nothing). `views`: pack into plain views (a deliberately wrong packing), not tensors of their own."""
    import copy

    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from dtensor_models import batch, fsdp

    if views:
        plan.own_storage = lambda view: view
    model, index = fsdp(0, rank, world_size)
    opt = FusedAdam(model.parameters(), weight_decay=0.1)
    for step in range(3):
        x, y = batch(step, index)
        (model(x) - y).square().mean().backward()
        opt.step()
        opt.zero_grad()
    try:
        copy.deepcopy(get_optimizer_state_dict(model, opt))
        error = ""
    except RuntimeError as e:
        error = str(e)
    return all(in_packs(opt, "exp_avg") + in_packs(opt, "exp_avg_sq")), error


@pytest.mark.parametrize("views", [False, True], ids=["own_storage", "negative_control_views"])
def test_fsdp2_moments_are_packed_and_their_state_dicts_deep_copy(views):
    """A DTensor over a view past its storage's first element cannot be deep-copied (torch's
    Tensor.__deepcopy__ takes it for a tensor with storage), and DCP's state dicts are: packed entries
    each have a storage of their own. Packed into plain views (the control), the deep copy fails."""
    from harness import run_ranks

    for packed, error in run_ranks(fsdp2_rank, 2, (views,)):
        assert packed
        assert ("invalid python storage" in error) if views else error == "", error
