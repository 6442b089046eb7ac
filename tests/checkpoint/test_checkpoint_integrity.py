"""distopt's checkpoints refuse what does not fit or was damaged, on every rank, and change nothing:
another model or format (state_dict() and the sharded form), and truncated, garbled, bit-flipped or
missing files, compared byte for byte before and after the refused load.
"""

from __future__ import annotations

import copy
import io
import json
import os
import re
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp

from distopt import DistributedFusedAdam
from distopt.distributed import checkpoint

from harness import run_ranks
from test_checkpoint import (
    LOAD_SETUP,
    SAVE_SETUP,
    TINY_BUCKET_MB,
    Setup,
    assert_same_bytes,
    assert_same_state,
    first_half,
    groups,
    make_model,
    params_of,
    same_bytes,
    snapshot,
    train,
)

# ------------------------------------------------------------------ mismatched checkpoints


def _refusals(rank: int, world_size: int, sd, path) -> list[str]:
    model = make_model()
    opt = DistributedFusedAdam(groups(model), bucket_cap_mb=TINY_BUCKET_MB)
    train(model, opt, range(2), rank, world_size, torch.float32)
    before, params_before = opt.state_dict(), params_of(model)
    bad_shape = copy.deepcopy(sd)
    bad_shape["state"][0]["exp_avg"] = torch.zeros(3, 3)
    too_few = copy.deepcopy(sd)
    too_few["param_groups"][0]["params"] = too_few["param_groups"][0]["params"][:-1]
    unknown = dict(sd, format="someone-else.v9")
    one_group = dict(sd, param_groups=sd["param_groups"][:1])
    messages = []
    for bad in (bad_shape, too_few, unknown, one_group, {"state": {}}):
        with pytest.raises(ValueError) as info:
            opt.load_state_dict(bad)
        messages.append(str(info.value))
    with pytest.raises(ValueError) as info:
        checkpoint.load(opt, path)
    messages.append(str(info.value))
    assert_same_state(opt.state_dict(), before)  # nothing changed
    assert all(torch.equal(a, b) for a, b in zip(params_of(model), params_before))
    return messages


def test_mismatched_checkpoints_refused_and_nothing_changes(tmp_path):
    path = str(tmp_path / "ckpt")
    sd, _ = run_ranks(first_half, 2, (SAVE_SETUP, path))[0]
    # corrupt the sharded checkpoint: drop one rank's data file
    data_files = sorted(f for f in os.listdir(path) if f.endswith(".distcp"))
    os.remove(os.path.join(path, data_files[-1]))
    messages = run_ranks(_refusals, 2, (sd, path))[0]
    for expected in ("shape", "params", "format", "param groups", "state dict", "read"):
        assert any(expected in m for m in messages), (expected, messages)


def corruption_extra(value: float) -> dict:
    return {"aux": {"t": torch.full((4,), value), "ints": [torch.arange(3) * int(value)]}, "epoch": int(value)}


def save_for_corruption(rank: int, world_size: int, path: str) -> None:
    model = make_model()
    opt = SAVE_SETUP.build(model)
    train(model, opt, range(3), rank, world_size, torch.float32)
    checkpoint.save(opt, path, extra={"model": model.state_dict(), **corruption_extra(3.0)})


def load_corrupted(rank: int, world_size: int, path: str, expect_refusal: bool) -> str:
    """Loads `path` into a run 2 steps in (another state than the checkpoint's); a refusal must change
    nothing, byte for byte, and happen on every rank."""
    model = make_model()
    opt = Setup(bucket_cap_mb=TINY_BUCKET_MB, reverse_init=True).build(model)
    train(model, opt, range(2), rank, world_size, torch.float32)
    extra = {"model": model.state_dict(), **corruption_extra(1.0)}
    before = snapshot(opt, model, extra)
    if not expect_refusal:
        checkpoint.load(opt, path, extra=extra)
        assert opt.step_count == 3 and extra["epoch"] == 3
        assert torch.equal(extra["aux"]["t"], torch.full((4,), 3.0))
        assert torch.equal(extra["aux"]["ints"][0], torch.arange(3) * 3)
        after = snapshot(opt, model, extra)
        assert not same_bytes(after["bucket 0 exp_avg"], before["bucket 0 exp_avg"])
        assert not same_bytes(after["param 0"], before["param 0"])
        return ""
    with pytest.raises(ValueError) as info:
        checkpoint.load(opt, path, extra=extra)
    assert_same_bytes(snapshot(opt, model, extra), before)
    return str(info.value)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("pristine") / "ckpt")
    run_ranks(save_for_corruption, 2, (path,))
    return path


def item_bytes(path: str, fqn: str) -> tuple[str, int, bytes]:
    """The data file holding saved item `fqn`, the item's first byte there, and the item's bytes."""
    md = dcp.FileSystemReader(path).read_metadata()
    info = next(info for index, info in md.storage_data.items() if index.fqn == fqn)
    file = os.path.join(path, info.relative_path)
    with open(file, "rb") as f:
        f.seek(info.offset)
        return file, info.offset, f.read(info.length)


def flip_bit_in_tensor(path: str, fqn: str) -> None:
    """Flips one bit in the middle of the saved tensor's values; torch alone reads it back silently."""
    file, offset, item = item_bytes(path, fqn)
    saved = torch.load(io.BytesIO(item), weights_only=True)
    at = offset + item.index(saved.numpy().tobytes()) + saved.numel() * saved.element_size() // 2
    with open(file, "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x10]))
    _, _, item = item_bytes(path, fqn)
    assert not torch.equal(torch.load(io.BytesIO(item), weights_only=True), saved)


def largest_exp_avg_fragment(path: str) -> str:
    md = dcp.FileSystemReader(path).read_metadata()
    names = [k for k in md.state_dict_metadata if re.fullmatch(r"optim\.state\.\d+\.exp_avg\.\d+", k)]
    return max(names, key=lambda k: md.state_dict_metadata[k].size[0])


def corrupt(path: str, how: str) -> None:
    data_files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".distcp"))
    if how == "missing file":
        os.remove(data_files[-1])
    elif how == "truncated file":
        largest = max(data_files, key=os.path.getsize)
        os.truncate(largest, os.path.getsize(largest) // 2)
    elif how == "garbled item":  # the start of exp_avg's item (its zip header) overwritten
        file, offset, item = item_bytes(path, largest_exp_avg_fragment(path))
        with open(file, "r+b") as f:
            f.seek(offset)
            f.write(bytes(range(0, 256, 3))[: len(item) // 2])
    elif how == "flipped bit in exp_avg":
        flip_bit_in_tensor(path, largest_exp_avg_fragment(path))
    elif how == "flipped bit in a model weight":
        flip_bit_in_tensor(path, "model.2.weight")
    elif how == "truncated metadata":
        metadata = os.path.join(path, ".metadata")
        os.truncate(metadata, os.path.getsize(metadata) // 2)
    elif how != "none":
        raise ValueError(how)


CORRUPTIONS = ["missing file", "truncated file", "garbled item", "flipped bit in exp_avg",
               "flipped bit in a model weight", "truncated metadata"]


@pytest.mark.parametrize("how", ["none", *CORRUPTIONS])
def test_corrupted_sharded_checkpoint_refused_and_nothing_changes(tmp_path, pristine, how):
    path = str(tmp_path / "ckpt")
    shutil.copytree(pristine, path)
    corrupt(path, how)
    messages = run_ranks(load_corrupted, 2, (path, how != "none"))
    if how == "none":  # the control: the same load without corruption succeeds and changes everything
        return
    for m in messages:  # every rank refuses, with a message that says why
        assert path in m and ("corrupted" in m or "cannot be read" in m or "not a readable" in m), m
    if how.startswith("flipped bit"):
        assert all("checksum" in m for m in messages), messages


def load_v1_checkpoint(rank: int, world_size: int, path: str) -> None:
    model = make_model()
    opt = SAVE_SETUP.build(model)
    train(model, opt, range(3), rank, world_size, torch.float32)
    sd = {k: v for k, v in checkpoint.sharded_state_dict(opt).items() if not k.startswith("checksum.")}
    sd["meta"] = json.dumps({"format": "distopt.sharded.v1", **json.loads(json.loads(sd["meta"])["body"])})
    dcp.save({"optim": sd, "model": model.state_dict()}, checkpoint_id=path)
    expected = opt.state_dict()
    model = make_model()
    opt = LOAD_SETUP.build(model)
    with pytest.warns(UserWarning, match="without checksums"):
        checkpoint.load(opt, path, extra={"model": model.state_dict()})
    assert_same_state(opt.state_dict(), expected)


def test_checkpoint_without_checksums_loads_unverified(tmp_path):
    """distopt.sharded.v1 (before checksums) is still accepted, with a warning."""
    run_ranks(load_v1_checkpoint, 2, (str(tmp_path / "ckpt"),))


def load_state_dict_refusals(rank: int, world_size: int, sd: dict, flipped: dict) -> list[str]:
    model = make_model()
    opt = Setup(bucket_cap_mb=TINY_BUCKET_MB).build(model)
    train(model, opt, range(2), rank, world_size, torch.float32)
    before = snapshot(opt, model, None)
    bad_shape = copy.deepcopy(sd)
    bad_shape["state"][4]["exp_avg_sq"] = torch.zeros(2, 2)  # a late param: earlier ones pass their checks
    no_checksum = copy.deepcopy(sd)
    del no_checksum["checksums"]["2"]["exp_avg"]
    messages = []
    for bad in (flipped, bad_shape, no_checksum):
        with pytest.raises(ValueError) as info:
            opt.load_state_dict(bad)
        messages.append(str(info.value))
        assert_same_bytes(snapshot(opt, model, None), before)
    # Without its checksums (as torch's state dicts come), the flipped dict loads: nothing to verify.
    opt.load_state_dict({k: v for k, v in flipped.items() if k != "checksums"})
    assert not same_bytes(snapshot(opt, model, None)["bucket 0 exp_avg"], before["bucket 0 exp_avg"])
    return messages


def test_corrupted_state_dict_refused_and_nothing_changes():
    sd, _ = run_ranks(first_half, 2, (SAVE_SETUP, None))[0]
    assert "checksums" in sd
    # A single bit flipped in a torch.save'd file: torch.load reads it back without complaint.
    buffer = io.BytesIO()
    torch.save(sd, buffer)
    data = bytearray(buffer.getvalue())
    values = sd["state"][3]["exp_avg"]
    data[data.index(values.numpy().tobytes()) + 5] ^= 0x01
    flipped = torch.load(io.BytesIO(bytes(data)), weights_only=True)
    assert not torch.equal(flipped["state"][3]["exp_avg"], values)
    messages = run_ranks(load_state_dict_refusals, 2, (sd, flipped))[0]
    assert "checksum" in messages[0] and "param 3" in messages[0], messages
    assert "shape" in messages[1] and "no recorded checksum" in messages[2], messages
