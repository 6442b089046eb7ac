"""A checkpoint survives its next save: a rank SIGKILLed at any moment of ``checkpoint.save`` over an
existing checkpoint leaves one that loads as exactly the previous or the new state; a save that fails
on one rank raises on every rank and leaves the previous checkpoint as it was; leftovers are ignored
by load and removed by the next save.

Where a rank dies. What a killed save leaves on disk changes only at I/O calls (opening, writing,
fsyncing, renaming, linking, removing files) and what the others see changes only at collectives,
so a trial kills its victim just before the k-th of those on that rank: ``Killer`` counts them with
``sys.setprofile`` (every C call into ``os`` or ``io``, every collective of torch.distributed), and a
calibration run counts how many a save makes on each rank. Each seeded trial draws whether the previous
checkpoint is a link (distopt's) or a real directory (plain ``dcp.save``, or distopt before
crash-consistent saves, which the save adopts), then one of three ways to pick the moment, equally
often: k among all of a random rank's calls (mostly data writes), among its calls that change the
disk or meet the other ranks, or among rank 0's of those while it commits.
"""

from __future__ import annotations

import errno
import os
import random
import signal
import sys
import threading

import pytest
import torch
import torch.distributed as dist

from distopt import DistributedFusedAdam
from distopt.distributed import checkpoint
from distopt.distributed.atomic_replace import SaveFailed, replace_file, resolve

from harness import run_ranks, run_ranks_outcomes
from test_checkpoint import TINY_BUCKET_MB, groups, make_model, params_of, train

WORLD = 2
CI_TRIALS = 16
SLOW_TRIALS = 400
COLLECTIVES = {"broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list", "barrier",
               "all_reduce", "broadcast", "all_gather", "gather", "scatter", "reduce_scatter_tensor",
               "all_gather_into_tensor"}


# Calls that change what is on disk (or what the other ranks see): a kill just before each of them
# is a distinct moment, which the trials pick as often as one among all calls (mostly data writes).
BOUNDARIES = {"open", "close", "fsync", "rename", "replace", "symlink", "unlink", "rmdir", "mkdir",
              "BufferedWriter.close", "BufferedWriter.__exit__"} | COLLECTIVES


class Killer:
    """While active, counts this process's I/O calls and collectives (noting which are BOUNDARIES);
    SIGKILLs it just before the `at`-th (never, with `at` None)."""

    def __init__(self, at: int | None) -> None:
        self.at, self.count, self.boundaries = at, 0, []

    def __call__(self, frame, event, arg) -> None:
        if event == "c_call":
            owner = getattr(arg, "__self__", None)
            module = getattr(arg, "__module__", None) or type(owner).__module__
            hit, name = module in ("posix", "_io", "io"), getattr(arg, "__qualname__", "")
        elif event == "call":
            name = frame.f_code.co_name
            hit = name in COLLECTIVES and frame.f_code.co_filename.endswith("distributed_c10d.py")
        else:
            return
        if hit:
            self.count += 1
            if name in BOUNDARIES:
                self.boundaries.append((self.count, name))
            if self.count == self.at:
                os.kill(os.getpid(), signal.SIGKILL)

    def __enter__(self) -> Killer:
        sys.setprofile(self)
        threading.setprofile(self)
        return self

    def __exit__(self, *exc) -> None:
        sys.setprofile(None)
        threading.setprofile(None)


def extra_of(model, step: int) -> dict:
    return {"model": model.state_dict(), "progress": torch.tensor([step])}


def make_real_directory(path: str) -> None:
    """What plain dcp.save (or an older distopt) leaves: the checkpoint files in a directory at `path`."""
    target = os.path.join(os.path.dirname(path), os.readlink(path))
    os.unlink(path)
    os.rename(target, path)


def state_of(opt, model, step: int) -> dict:
    """Everything a load must restore (a collective: every rank calls it)."""
    return {"optim": opt.state_dict(), "params": params_of(model), "progress": step}


def save_twice(rank: int, world_size: int, path: str, victim: int | None, at: int | None, legacy: bool,
               fail: str | None = None):
    """Saves state A at `path`, trains a step, saves state B over it (rank `victim` killed at its
    `at`-th call, or failing as `fail` says). Returns (the calls on this rank: their count and the
    BOUNDARIES among them, [A, B])."""
    model = make_model()
    opt = DistributedFusedAdam(groups(model), bucket_cap_mb=TINY_BUCKET_MB)
    train(model, opt, range(2), rank, world_size, torch.float32)
    states = [state_of(opt, model, 2)]
    checkpoint.save(opt, path, extra=extra_of(model, 2))
    if legacy:
        if rank == 0:
            make_real_directory(path)
        dist.barrier()
    train(model, opt, range(2, 3), rank, world_size, torch.float32)
    states.append(state_of(opt, model, 3))
    with Killer(at if rank == victim else None) as killer, failing(fail if rank == victim else None):
        checkpoint.save(opt, path, extra=extra_of(model, 3))
    return (killer.count, killer.boundaries), states


class failing:
    """Makes this rank's save fail: "disk_full" (every fsync raises ENOSPC) or "commit" (rank 0
    cannot make the link)."""

    def __init__(self, how: str | None) -> None:
        self.how, self.saved = how, None

    def __enter__(self) -> None:
        def refuse(*args, **kwargs):
            code = errno.ENOSPC if self.how == "disk_full" else errno.EACCES
            raise OSError(code, os.strerror(code))

        name = {"disk_full": "fsync", "commit": "symlink", None: None}[self.how]
        if name:
            self.saved = (name, getattr(os, name))
            setattr(os, name, refuse)

    def __exit__(self, *exc) -> None:
        if self.saved:
            setattr(os, *self.saved)


def load_then_save(rank: int, world_size: int, path: str):
    """Loads `path` into a fresh model and optimizer (another world size and layout than the save's),
    then saves there again. Returns (the loaded state, the entries of the parent directory after the
    second save)."""
    model = make_model()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # must come from the checkpoint
    opt = DistributedFusedAdam(groups(model), bucket_cap_mb=100.0)
    extra = {"model": model.state_dict(), "progress": torch.tensor([-1])}
    checkpoint.load(opt, path, extra=extra)
    loaded = state_of(opt, model, int(extra["progress"]))
    checkpoint.save(opt, path, extra=extra)
    return loaded, sorted(os.listdir(os.path.dirname(path)))


def same(a: dict, b: dict) -> bool:
    """Bit for bit: optimizer state, hyperparameters, params and progress."""
    if a["progress"] != b["progress"] or a["optim"]["state"].keys() != b["optim"]["state"].keys():
        return False
    tensors = [(x, y) for k, entry in a["optim"]["state"].items() for name, x in entry.items()
               for y in [b["optim"]["state"][k][name]]] + list(zip(a["params"], b["params"]))
    keys = ("lr", "betas", "eps", "weight_decay", "params")
    groups_equal = [{k: g[k] for k in keys} for g in a["optim"]["param_groups"]] == \
                   [{k: g[k] for k in keys} for g in b["optim"]["param_groups"]]
    return groups_equal and all(torch.equal(x, y) for x, y in tensors)


def assert_clean(listing: list[str], name: str) -> None:
    """After a successful save: the link and the one version it names, nothing else."""
    assert len(listing) == 2 and name in listing and listing[1].startswith(f"{name}.v-"), listing


@pytest.fixture(scope="module")
def calibration(tmp_path_factory) -> dict:
    """Per kind of previous checkpoint: the calls a save makes on each rank, and states A and B."""
    out = {}
    for legacy in (False, True):
        path = str(tmp_path_factory.mktemp("calibration") / "ckpt")
        results = run_ranks(save_twice, WORLD, (path, None, None, legacy))
        counts = [calls for calls, _ in results]
        assert all(len(boundaries) > 10 for _, boundaries in counts), counts
        states = results[0][1]
        assert not same(states[0], states[1])  # the trials can tell A from B
        loaded, listing = run_ranks(load_then_save, 1, (path,))[0]
        assert same(loaded, states[1]) and not same(loaded, states[0])
        assert_clean(listing, "ckpt")
        out[legacy] = (counts, states)
    return out


def run_trials(seeds: range, calibration: dict, root) -> dict:
    """Kills a rank in each seeded trial; asserts each reload gives exactly A or B; returns counts
    (reloads that gave A, B; trials whose save made fewer calls than drawn, so nobody was killed)."""
    tally = {"trials": 0, "not killed": 0, "previous": 0, "new": 0, "survivor raised": 0}
    for seed in seeds:
        rng = random.Random(seed)
        legacy = rng.random() < 0.5
        counts, (state_a, state_b) = calibration[legacy]
        victim, moment = rng.randrange(WORLD), rng.randrange(3)
        total, boundaries = counts[victim]
        if moment == 2:  # rank 0 committing: after the last all-gather of the outcomes
            victim, (total, boundaries) = 0, counts[0]
            last = max(i for i, (_, name) in enumerate(boundaries) if name == "all_gather_object")
            boundaries = boundaries[last + 1:]
        at = rng.randint(1, total) if moment == 0 else rng.choice(boundaries)[0]
        path = str(root / f"trial{seed}" / "ckpt")
        os.makedirs(os.path.dirname(path))
        outcomes = run_ranks_outcomes(save_twice, WORLD, (path, victim, at, legacy), timeout=60, pg_timeout_s=5)
        where = f"trial {seed} (victim rank {victim}, call {at} of {total}, legacy {legacy})"
        killed = outcomes[victim].status != "ok"
        if not killed:  # this save made fewer calls than the calibration's (by one or two)
            assert outcomes[victim].value[0][0] < at, (where, outcomes[victim])
        else:
            assert outcomes[victim].status == "died", (where, outcomes[victim])
        for rank, o in enumerate(outcomes):
            if rank != victim and o.status == "error":
                tally["survivor raised"] += 1
                assert "SaveInterrupted" in o.value and "checkpoint save to" in o.value, (where, o.value)
            else:
                assert rank == victim or o.status == "ok", (where, o)
        loaded, listing = run_ranks(load_then_save, 1, (path,))[0]
        matches = (same(loaded, state_a), same(loaded, state_b))
        assert sum(matches) == 1 and (killed or matches[1]), (where, matches)
        assert_clean(listing, "ckpt")
        tally["trials"] += 1
        tally["previous" if matches[0] else "new" if killed else "not killed"] += 1
    print(f"\nkill trials: {tally}")
    return tally


def test_a_rank_killed_during_a_save_leaves_the_previous_or_the_new_checkpoint(calibration, tmp_path):
    tally = run_trials(range(CI_TRIALS), calibration, tmp_path)
    assert tally["trials"] == CI_TRIALS


@pytest.mark.slow
def test_a_rank_killed_during_a_save_many_trials(calibration, tmp_path, long_version):
    tally = run_trials(range(1000, 1000 + SLOW_TRIALS), calibration, tmp_path)
    assert tally["previous"] > 0 and tally["new"] > 0  # the kills landed on both sides of the switch


@pytest.mark.parametrize("fail_on, how, legacy", [(1, "disk_full", False), (0, "disk_full", False),
                                                  (0, "commit", False), (0, "commit", True)])
def test_a_save_that_fails_on_one_rank_raises_on_every_rank_and_keeps_the_previous(tmp_path, fail_on, how, legacy):
    path = str(tmp_path / "ckpt")

    def run(rank, world_size):
        try:
            save_twice(rank, world_size, path, fail_on, None, legacy, how)
        except SaveFailed as exc:
            return str(exc)
        return None

    messages = run_ranks(run, WORLD)
    assert messages[0] is not None and len(set(messages)) == 1, messages
    expected = "OSError: [Errno 28] No space left" if how == "disk_full" else "PermissionError: [Errno 13]"
    assert f"failed: rank {fail_on}: {expected}" in messages[0] and "unchanged" in messages[0], messages[0]
    listing = sorted(os.listdir(tmp_path))  # as the first save left it: no temporaries
    assert listing == ["ckpt"] if legacy else (listing[0] == "ckpt" and len(listing) == 2), listing
    assert os.path.islink(path) != legacy
    loaded, listing = run_ranks(load_then_save, 1, (path,))[0]
    reference = run_ranks(save_twice, WORLD, (str(tmp_path / "ref" / "ckpt"), None, None, False))[0][1]
    assert same(loaded, reference[0]) and not same(loaded, reference[1])
    assert_clean([n for n in listing if n != "ref"], "ckpt")


def refusals(rank: int, world_size: int, root: str) -> list[str]:
    model = make_model()
    opt = DistributedFusedAdam(groups(model), bucket_cap_mb=TINY_BUCKET_MB)
    train(model, opt, range(1), rank, world_size, torch.float32)
    messages = []
    for name in ("run_dir", "foreign_link", "a_file"):
        with pytest.raises(ValueError) as info:
            checkpoint.save(opt, os.path.join(root, name))
        messages.append(str(info.value))
    return messages


def test_save_refuses_to_replace_what_is_not_a_checkpoint(tmp_path):
    (tmp_path / "run_dir").mkdir()
    (tmp_path / "run_dir" / "notes.txt").write_text("mine")
    (tmp_path / "elsewhere").mkdir()
    os.symlink("elsewhere", tmp_path / "foreign_link")
    (tmp_path / "a_file").write_text("x")
    before = sorted(os.listdir(tmp_path))
    messages = run_ranks(refusals, WORLD, (str(tmp_path),))
    assert messages[0] == messages[1]
    assert "not part of a checkpoint (notes.txt)" in messages[0][0]
    assert "symbolic link to 'elsewhere'" in messages[0][1] and "is a file" in messages[0][2]
    assert sorted(os.listdir(tmp_path)) == before and (tmp_path / "run_dir" / "notes.txt").read_text() == "mine"


def test_load_reads_the_newest_complete_version_while_the_path_is_missing(tmp_path):
    """The instant between adopting a real directory and linking the new version: resolve() takes the
    newest complete version and ignores temporaries; with the link in place, the version it names."""
    path = str(tmp_path / "ckpt")
    assert resolve(path) == path  # nothing there: load's own error names the path
    for name in ("ckpt.v-0000000000000001-00000000", "ckpt.v-0000000000000002-00000000",
                 "ckpt.tmp-0000000000000003-00000000", "ckpt.v-notanid", "other.v-0000000000000009-00000000"):
        (tmp_path / name).mkdir()
    assert resolve(path) == str(tmp_path / "ckpt.v-0000000000000002-00000000")
    os.symlink("ckpt.v-0000000000000001-00000000", path)  # the version the link names, read once
    assert resolve(path) == str(tmp_path / "ckpt.v-0000000000000001-00000000")


def in_place_save_twice(rank: int, world_size: int, path: str, victim: int, at: int):
    """save_twice with saves written straight into `path`, as before crash-consistent saves."""
    from distopt.distributed.checkpoint import atomic_replace

    atomic_replace.replace_dir = lambda path, write, group=None: write(path)
    return save_twice(rank, world_size, path, victim, at, False)


def test_negative_control_a_save_in_place_killed_midway_is_caught(calibration, tmp_path):
    """The trials can fail: killed halfway through its data, a save written in place leaves a
    checkpoint that is neither A nor B, and the reload refuses it."""
    path = str(tmp_path / "ckpt")
    total, boundaries = calibration[False][0][1]
    at = next(i for i, name in boundaries if name == "open") + total // 10  # rank 1, inside its data file
    outcomes = run_ranks_outcomes(in_place_save_twice, WORLD, (path, 1, at), timeout=60, pg_timeout_s=5)
    assert outcomes[1].status == "died" and outcomes[0].status == "error", outcomes
    with pytest.raises(AssertionError, match="ValueError: .*ckpt: the checkpoint.* nothing was loaded"):
        run_ranks(load_then_save, 1, (path,))


def test_replace_file_keeps_the_previous_file_until_the_new_one_is_complete(tmp_path):
    """The one-file case (the transformers integration's optimizer.pt): a write that fails halfway leaves
    the previous file and no temporary; a killed write's temporary is removed by the next one."""
    path = tmp_path / "optimizer.pt"
    replace_file(path, lambda tmp: torch.save({"v": 1}, tmp))

    def half_then_full_disk(tmp: str) -> None:
        with open(tmp, "wb") as f:
            f.write(b"partial")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.raises(OSError, match="No space left"):
        replace_file(path, half_then_full_disk)
    assert os.listdir(tmp_path) == ["optimizer.pt"] and torch.load(path) == {"v": 1}
    (tmp_path / "optimizer.pt.tmp-0000000000000001-00000000").write_bytes(b"left by a killed save")
    replace_file(path, lambda tmp: torch.save({"v": 2}, tmp))
    assert os.listdir(tmp_path) == ["optimizer.pt"] and torch.load(path) == {"v": 2}
