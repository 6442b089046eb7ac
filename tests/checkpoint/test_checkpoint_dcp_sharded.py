"""DistributedFusedAdam's sharded state dict for torch.distributed.checkpoint (dcp_state.py, boxes.py):
what saving it costs per rank (against the gathered form), how a param's flat ranges become boxes,
params in other memory formats and of no dims, loads that fail or stop halfway, and what is refused.
The resumes through torch's standard API, in both forms, are test_dcp_api.py's."""

from __future__ import annotations

import ctypes
import gc
import io
import os
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from distopt import DistributedFusedAdam, FusedAdam
from distopt.distributed import checkpoint
from distopt.distributed.checkpoint import boxes, dcp_state

from harness import run_ranks
from test_checkpoint import (
    LOAD_SETUP,
    SAVE_SETUP,
    TINY_BUCKET_MB,
    assert_same_state,
    groups,
    make_model,
    snapshot,
    train,
)
from test_dcp_api import differences, save_through_api

# ------------------------------------------------------------------ a load that fails or stops halfway

def load_in_two_steps(rank: int, world_size: int, path: str, broken: str) -> list[str]:
    """A trained optimizer; dcp.load of a sharded template from a broken checkpoint (it fails), then
    from the good one (nothing changes until set_state_dict), then set_state_dict."""
    model = make_model()
    opt = LOAD_SETUP.build(model)
    train(model, opt, range(1), rank, world_size, torch.float32)
    before = snapshot(opt, model, None)
    with checkpoint.sharded_state_dicts(opt):
        model_sd, optim_sd = get_state_dict(model, opt)
    with pytest.raises(CheckpointException):
        dcp.load({"optim": optim_sd}, checkpoint_id=broken)
    changed = differences(snapshot(opt, model, None), before)
    dcp.load({"optim": optim_sd}, checkpoint_id=path)
    changed += differences(snapshot(opt, model, None), before)
    set_optimizer_state_dict(model, opt, optim_sd)
    return changed, opt.state_dict()


def test_dcp_load_changes_nothing_until_set_state_dict(tmp_path):
    """dcp.load fills the sharded template's own CPU copies, never the optimizer: a load that fails
    halfway (a truncated data file) or one not followed by set_state_dict leaves it as it was."""
    path, broken = tmp_path / "ckpt", tmp_path / "broken"
    sd = run_ranks(save_through_api, 2, (SAVE_SETUP, str(path), "sharded_get_state_dict"))[0]
    shutil.copytree(path, broken)
    for data in broken.glob("*.distcp"):
        data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    for changed, reloaded in run_ranks(load_in_two_steps, 2, (str(path), str(broken))):
        assert changed == [], changed
        assert_same_state(reloaded, sd)


# ------------------------------------------------------------------ memory per rank while saving


def _rss(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))


class AllocatedBytes(TorchDispatchMode):
    """Counts the bytes of the storages that tensor operations create (an output whose storage is no
    input's: copies, new tensors, gathers), in this thread: where dcp's file writer runs by default."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.total += t.untyped_storage().nbytes()
                inputs.add(t.untyped_storage().data_ptr())
        return out


def save_peak(rank: int, world_size: int, path: str, how: str) -> tuple[int, int, int, int]:
    """Peak resident memory above the steady state while saving and the bytes tensor operations
    allocate, with one bucket's fp32 state (the bound) and the whole model's (what gathering costs)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(64)])  # 4.2M params: 50 MB of state, 5 buckets
    opt = DistributedFusedAdam(model.parameters(), bucket_cap_mb=4.0)
    model(torch.randn(4, 256)).square().mean().backward()
    opt.step()
    opt.zero_grad()
    for attempt in ("warm-up", "measured"):  # the first save also imports and caches: not per-save memory
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # memory freed by training counts as neither
        base = _rss("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # restart the peak (VmHWM) from here
        with AllocatedBytes() as allocated:
            save_as(model, opt, f"{path}_{attempt}", how)
        peak = _rss("VmHWM") - base
    bucket = 3 * 4 * max(b.spec.numel for b in opt.shard_buckets())  # fp32 master, exp_avg, exp_avg_sq
    return peak, allocated.total, bucket, 12 * sum(p.numel() for p in model.parameters())


def save_as(model, opt, path: str, how: str) -> None:
    if how == "distopt":
        checkpoint.save(opt, path, extra={"model": model.state_dict()})
    elif how == "sharded":
        with checkpoint.sharded_state_dicts(opt):
            model_sd, optim_sd = get_state_dict(model, opt)
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    else:  # the whole per-param state, gathered on every rank
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's /proc peak-memory reset")
def test_save_memory_per_rank(tmp_path):
    """Inside sharded_state_dicts, get_state_dict + dcp.save (and distopt's own checkpoint.save) hold no
    more than one bucket's state on top of the optimizer's own: views of the shards, written without
    copies. The negative control: outside it, torch's get_state_dict asks for each param's whole state
    (opt.state_dict()), which every rank then holds in full."""
    runs = {how: run_ranks(save_peak, 2, (str(tmp_path / how), how)) for how in ("sharded", "distopt", "gathered")}
    _, _, bucket, full = runs["sharded"][0]
    peak = {how: max(r[0] for r in results) for how, results in runs.items()}
    allocated = {how: max(r[1] for r in results) for how, results in runs.items()}
    print(f"per rank while saving, 2 ranks, MB (one bucket's state {bucket / 1e6:.1f}, the whole state "
          f"{full / 1e6:.1f}): peak extra resident / allocated by tensor operations: "
          + ", ".join(f"{how} {peak[how] / 1e6:.1f} / {allocated[how] / 1e6:.2f}" for how in runs))
    for how in ("sharded", "distopt"):
        # What tensor operations still allocate is dcp's pickled save plans (its object collectives):
        # a few hundred bytes per saved box, whatever the boxes' sizes.
        assert peak[how] < bucket and allocated[how] < bucket / 10, (how, peak[how], allocated[how])
    # The negative control: gathering is caught by either measure.
    assert min(r[0] for r in runs["gathered"]) > 0.9 * full > bucket
    assert min(r[1] for r in runs["gathered"]) > full > bucket


# ------------------------------------------------------------------ the sharded form's boxes and refusals


def test_boxes_tile_each_range_once():
    """Every flat range of a dense tensor (row-major, channels_last, permuted) is cut into at most
    2 * ndim - 1 boxes that cover it exactly once, in memory order, each a view of its elements."""
    gen = torch.Generator().manual_seed(0)
    for trial in range(2000):
        shape = torch.randint(1, 6, (trial % 5,), generator=gen).tolist()
        t = torch.randn(shape, generator=gen)
        if len(shape) >= 2 and trial % 3:
            order = torch.randperm(len(shape), generator=gen).tolist()  # a dense tensor in another memory order
            t = torch.randn([shape[d] for d in order], generator=gen).permute(sorted(range(len(order)),
                                                                                     key=order.__getitem__))
        flat = t.as_strided((t.numel(),), (1,))
        start, stop = sorted(torch.randint(0, t.numel() + 1, (2,), generator=gen).tolist())
        cut = boxes.boxes(t.shape, t.stride(), start, stop)
        assert len(cut) <= max(1, 2 * len(shape) - 1)
        hits, at = torch.zeros(t.shape, dtype=torch.int64), start
        for box in cut:
            assert box.start == at
            at += box.numel
            where = tuple(slice(o, o + n) for o, n in zip(box.offsets, box.sizes))
            view = boxes.box_view(flat[box.start : box.start + box.numel], box, boxes.memory_order(t.shape, t.stride()))
            assert torch.equal(view, t[where])
            hits[where] += 1
        assert at == stop and int(hits.sum()) == stop - start and bool((hits <= 1).all())
    with pytest.raises(ValueError, match="not dense"):
        boxes.memory_order((4, 4), (8, 1))


class ScaledConv(nn.Module):
    """Convolutions and a 0-d scale (a box with no dims), with a frozen param (no state) in between."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.frozen = nn.Parameter(torch.randn(3), requires_grad=False)
        self.convs = nn.Sequential(nn.Conv2d(3, 6, 3), nn.Tanh(), nn.Conv2d(6, 4, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.convs(x) * self.scale + self.frozen.sum()


def conv_model(channels_last: bool) -> nn.Module:
    torch.manual_seed(0)
    model = ScaledConv()
    return model.to(memory_format=torch.channels_last) if channels_last else model


def conv_run(rank: int, world_size: int, path: str, channels_last: bool, save: bool) -> dict:
    """Saves (after 2 steps) or loads through get_state_dict inside sharded_state_dicts."""
    model = conv_model(channels_last)
    opt = DistributedFusedAdam(model.parameters(), bucket_cap_mb=TINY_BUCKET_MB if save else 4 * TINY_BUCKET_MB)
    gen = torch.Generator().manual_seed(rank)
    with checkpoint.sharded_state_dicts(opt):
        if save:
            for _ in range(2):
                model(torch.randn(2, 3, 6, 6, generator=gen).to(memory_format=torch.channels_last)).square().mean() \
                    .backward()
                opt.step()
                opt.zero_grad()
        model_sd, optim_sd = get_state_dict(model, opt)
        if save:
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
        else:
            dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
            set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    return opt.state_dict()


@pytest.mark.parametrize("loaded_on, channels_last", [(1, False), (4, True), (3, False)])
def test_channels_last_params_through_dcp(tmp_path, loaded_on, channels_last):
    """Boxes are in the logical dims: a channels_last model's shards (flat ranges of its NHWC memory)
    load into a contiguous one, and back, under any world size; so does a 0-d param's state."""
    path = str(tmp_path / "ckpt")
    sd = run_ranks(conv_run, 2, (path, True, True))[0]
    for reloaded in run_ranks(conv_run, loaded_on, (path, channels_last, False)):
        assert_same_state(reloaded, sd)


def sharded_refusals(rank: int, world_size: int) -> list[str]:
    model = make_model()
    opt = DistributedFusedAdam(groups(model), bucket_cap_mb=TINY_BUCKET_MB)
    train(model, opt, range(2), rank, world_size, torch.float32)
    other_model = make_model()
    other = DistributedFusedAdam(groups(other_model))  # another layout: one bucket
    other.shard_buckets()
    sharded = opt.state_dict(sharded=True)
    before = snapshot(other, other_model, None)
    messages = []
    with pytest.raises(ValueError) as info:  # its boxes are not the ones the other layout needs
        other.load_state_dict(sharded)
    messages.append(str(info.value))
    assert differences(snapshot(other, other_model, None), before) == []
    with pytest.raises(ValueError, match="choose one"):
        opt.state_dict(gather_on_rank0=True, sharded=True)
    nhwc, nchw = (DistributedFusedAdam(conv_model(c).parameters()) for c in (True, False))  # same layouts
    with pytest.raises(ValueError, match="another memory format"):  # flat offsets would name other elements
        nchw.load_state_dict(nhwc.state_dict(sharded=True))
    with pytest.raises(TypeError, match="DistributedFusedAdam, not FusedAdam"):
        with checkpoint.sharded_state_dicts(FusedAdam(make_model().parameters())):
            pass
    with checkpoint.sharded_state_dicts(opt):
        # torch's full state dict cannot be made of shards: torch returns them as they are, and any
        # use of them (saving, arithmetic) raises instead of handing out a partial tensor.
        _, full = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
        with pytest.raises(TypeError, match="cannot be pickled"):
            torch.save(full, io.BytesIO())
        with pytest.raises(TypeError, match="only this rank's part"):
            full["state"]["0.weight"]["exp_avg"].sum()
    assert not dcp_state.active(opt)
    state = opt.state_dict()["state"]  # whole tensors again, outside the block
    assert all(type(v) is torch.Tensor for entry in state.values() for v in entry.values())
    before = snapshot(opt, model, None)
    opt.load_state_dict(sharded)  # the optimizer it was taken from loads it: its own state, unchanged
    assert differences(snapshot(opt, model, None), before) == []
    return messages


def test_sharded_state_dict_refusals():
    messages = run_ranks(sharded_refusals, 2)[0]
    assert "lacks elements" in messages[0] and "sharded_state_dicts" in messages[0], messages
