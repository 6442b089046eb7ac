"""Crash-consistent checkpoints: a save replaces the previous checkpoint on disk in one atomic step.

``replace_dir(path, write, group)`` is how ``checkpoint.save`` writes a checkpoint directory that
several ranks fill. Beside `path` (in its parent directory) it keeps:

    path             a symbolic link naming the complete checkpoint, e.g. ``ckpt -> ckpt.v-<id>``
    path.v-<id>      a complete checkpoint (normally only the one the link names)
    path.tmp-<id>    a save in progress, or what a killed one left: never read
    path.lnk-<id>    the new link, for an instant before it is renamed over `path`

1. Rank 0 checks `path` and picks a fresh id (one broadcast).
2. Every rank writes its part into ``path.tmp-<id>`` (``write(tmp)``, e.g. ``dcp.save``, which fsyncs
   every file it writes).
3. Every rank reports how that went (one all-gather). If any rank failed, rank 0 removes the
   temporary directory and every rank raises the same ``SaveFailed``: `path` was not touched.
4. Rank 0 commits: fsyncs the new directory, renames it to ``path.v-<id>``, fsyncs the parent,
   makes the link ``path.lnk-<id>`` and renames it over `path`, fsyncs the parent again; then tells
   every rank the outcome (one broadcast), and removes the previous version and any leftovers.

Why a reader always finds one complete checkpoint: the only step that changes what `path` names is
``rename(2)`` of a link over the previous link, which POSIX makes atomic ("there is no point at
which another process attempting to access newpath will find it missing"). It happens after the new
version is complete and durable and before the previous one is removed. A rank killed before it
leaves `path` naming the previous checkpoint; after it, the new one; leftovers are ignored and
removed by the next successful save. (A directory cannot be renamed over a non-empty one: that is
why `path` is a link.) ``resolve`` reads the link once, on rank 0, so that all ranks of a load read
one version even if a save switches the link meanwhile.

A real directory at `path` (written by plain ``dcp.save`` or an older distopt) is adopted at the first
save: renamed to a version and replaced by the link. Between those two renames `path` is missing
and ``resolve`` (which ``checkpoint.load`` reads through) takes the newest complete version beside
it: the previous checkpoint or the new one, both complete. Only a directory holding nothing but a
checkpoint's files is adopted; save refuses a directory with other files (which replacing it would
delete) and a symbolic link it did not make. One save at a time per `path`.

``replace_file(path, write)`` is the one-file case (an optimizer state written with ``torch.save``):
write beside it, fsync, ``os.replace``, fsync the directory.

Errors. A collective that fails (a rank died, or the process group's timeout expired) raises
``SaveInterrupted`` naming it: the checkpoint at `path` is then the previous or the new one, complete.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import shutil
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException: caught by name

# What torch.distributed.checkpoint's FileSystemWriter puts in a checkpoint directory.
_CHECKPOINT_FILE = re.compile(r"^(\.metadata|__\d+_\d+\.distcp|__\d+\.metadata)(\.tmp)?$")


class SaveFailed(RuntimeError):
    """A save failed on some rank (an exception, a full disk); every rank raises it, and the
    previous checkpoint is as it was."""


class SaveInterrupted(dist.DistBackendError):
    """A collective of a save failed: a rank died or the process group timed out. The checkpoint at
    the path is the previous one or the new one, complete."""


def _new_id() -> str:
    return f"{time.time_ns():016x}-{secrets.token_hex(4)}"


def _pattern(path: str) -> re.Pattern[str]:
    name = re.escape(os.path.basename(path))
    return re.compile(rf"^{name}\.(tmp|v|lnk)-([0-9a-f]{{16}}-[0-9a-f]{{8}})$")


def _siblings(path: str, kinds: tuple[str, ...]) -> list[str]:
    """The versions, temporaries or links of `path` beside it, oldest first."""
    parent, pattern = os.path.dirname(path) or ".", _pattern(path)
    try:
        names = os.listdir(parent)
    except FileNotFoundError:
        return []
    found = [(m.group(2), name) for name in names if (m := pattern.match(name)) and m.group(1) in kinds]
    return [os.path.join(parent, name) for _, name in sorted(found)]


def resolve(path: str | os.PathLike, group: Any = None) -> str:
    """Where the checkpoint saved at `path` is read: the version its link names (read once, so that a
    save switching the link meanwhile cannot mix two versions), a real directory at `path`, or while
    `path` is missing (a save adopting a real directory was killed between its two renames) the newest
    complete version beside it. With a process `group`: rank 0's answer, on every rank (a collective)."""
    if group is not None and dist.get_world_size(group) > 1:
        answer = [resolve(path) if dist.get_rank(group) == 0 else None]
        dist.broadcast_object_list(answer, src=dist.get_global_rank(group, 0), group=group)
        return answer[0]
    path = os.path.normpath(os.fspath(path))
    if os.path.islink(path) and _refusal(path) is None:  # a link a save made
        return os.path.join(os.path.dirname(path), os.readlink(path))
    if os.path.lexists(path):
        return path
    versions = _siblings(path, ("v",))
    return versions[-1] if versions else path


def _refusal(path: str) -> str | None:
    """Why `path` cannot be replaced, or None."""
    if os.path.islink(path):
        target = os.readlink(path)
        ours = _pattern(path).match(target)
        if ours and ours.group(1) == "v":
            return None
        return (f"{path} is a symbolic link to {target!r}, which checkpoint saves did not make: save to the "
                "directory it points to")
    if os.path.isdir(path):
        others = sorted(n for n in os.listdir(path) if not _CHECKPOINT_FILE.match(n))
        if others:
            return (f"{path} holds files that are not part of a checkpoint ({', '.join(others[:3])}"
                    f"{', ...' if len(others) > 3 else ''}): a save replaces the directory as a whole, which would "
                    "delete them; save to a path of its own")
        return None
    if os.path.lexists(path):
        return f"{path} is a file, not a checkpoint directory"
    return None


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as exc:  # some filesystems cannot fsync a directory: their renames are durable already
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def _remove(path: str) -> None:
    if os.path.islink(path) or not os.path.isdir(path):
        os.unlink(path)
    else:
        shutil.rmtree(path)


def describe(exc: BaseException) -> str:
    """An exception in one line: one part per failing rank for torch.distributed.checkpoint's, else its
    type and first line (the full tracebacks stay in ``__cause__``)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        return "; ".join(f"rank {r}: {describe(e)}" for r, (e, _) in sorted(failures.items()))
    return f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:300]}"


def _collective(path: str, what: str, fn: Callable[..., Any], *args: Any, first: str | None = None,
                **kwargs: Any) -> None:
    """`fn(*args, **kwargs)`, a collective; its failure becomes a SaveInterrupted naming it."""
    try:
        fn(*args, **kwargs)
    except RuntimeError as exc:
        before = f" (this rank's write had failed first: {first})" if first else ""
        raise SaveInterrupted(
            f"checkpoint save to {path}: the {what} failed{before}: {describe(exc)}. A rank died or the process "
            f"group's timeout expired; {path} holds the previous checkpoint or the new one, complete") from exc


def replace_dir(path: str | os.PathLike, write: Callable[[str], None], group: Any = None) -> None:
    """Every rank of `group` calls it; ``write(tmp)`` writes this rank's part of the new checkpoint into
    the directory `tmp` (a collective such as ``dcp.save`` is fine). Returns on every rank once `path`
    names the new checkpoint; see the module docstring for what happens otherwise."""
    path = os.path.normpath(os.fspath(path))
    group = group or dist.group.WORLD
    rank, src = dist.get_rank(group), dist.get_global_rank(group, 0)
    plan: list[Any] = [None]
    if rank == 0:
        try:
            refusal = _refusal(path)
            if refusal is None:
                os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        except OSError as exc:
            refusal = f"{path} cannot be checked: {describe(exc)}"
        plan[0] = (_new_id(), refusal)
    _collective(path, "broadcast of the save's plan (broadcast_object_list from rank 0)", dist.broadcast_object_list,
                plan, src=src, group=group)
    ident, refusal = plan[0]
    if refusal:
        raise ValueError(refusal)
    tmp = f"{path}.tmp-{ident}"

    error = cause = None
    try:
        write(tmp)
    except (Exception, CheckpointException) as exc:  # dcp's names the failing ranks itself
        error, cause = describe(exc) if isinstance(exc, CheckpointException) else f"rank {rank}: {describe(exc)}", exc
    errors: list[Any] = [None] * dist.get_world_size(group)
    _collective(path, "all-gather of every rank's write outcome (all_gather_object)", dist.all_gather_object,
                errors, error, group=group, first=error)
    failed = [r for r, e in enumerate(errors) if e is not None]
    if failed:
        if rank == 0:
            with contextlib.suppress(OSError):
                _remove(tmp)
        raise SaveFailed(f"checkpoint save to {path} failed: {errors[failed[0]]}; the previous checkpoint at {path} "
                         "is unchanged") from cause

    outcome: list[Any] = [None]
    if rank == 0:
        outcome[0] = _commit(path, tmp, ident)
    _collective(path, "broadcast of rank 0's commit (broadcast_object_list from rank 0)", dist.broadcast_object_list,
                outcome, src=src, group=group)
    if outcome[0] is not None:
        raise SaveFailed(outcome[0])
    if rank == 0:
        _remove_leftovers(path, keep=f"{path}.v-{ident}")


def _commit(path: str, tmp: str, ident: str) -> str | None:
    """Rank 0's switch to the complete `tmp` (see the module docstring); an error message, or None."""
    version, link, parent = f"{path}.v-{ident}", f"{path}.lnk-{ident}", os.path.dirname(path) or "."
    switched, adopted = False, None
    try:
        refusal = _refusal(path)  # again: files may have appeared in a real directory meanwhile
        if refusal:
            raise ValueError(refusal)
        _fsync(tmp)  # its entries; every rank's writer fsynced the files
        os.rename(tmp, version)
        _fsync(parent)
        if os.path.isdir(path) and not os.path.islink(path):
            adopted = f"{path}.v-{_new_id()}"
            os.rename(path, adopted)  # from here until the link is in place, resolve() reads it there
        os.symlink(os.path.basename(version), link)
        os.replace(link, path)  # the atomic step
        switched = True
        _fsync(parent)
    except (OSError, ValueError) as exc:
        for leftover in (tmp, version, link) if not switched else ():
            with contextlib.suppress(OSError):
                _remove(leftover)
        if adopted and not switched:
            with contextlib.suppress(OSError):
                os.rename(adopted, path)
        if switched:
            return f"checkpoint save to {path}: the new checkpoint is in place but may not be durable: {describe(exc)}"
        return f"checkpoint save to {path} failed: rank 0: {describe(exc)}; the previous checkpoint is unchanged"
    return None


def _remove_leftovers(path: str, keep: str) -> None:
    """Removes every version, temporary and link of `path` but `keep` (best effort: a warning)."""
    for other in _siblings(path, ("v", "tmp", "lnk")):
        if other != keep:
            try:
                _remove(other)
            except OSError as exc:
                warnings.warn(f"checkpoint save to {path}: could not remove {other}: {exc}", stacklevel=3)


def replace_file(path: str | os.PathLike, write: Callable[[str], None]) -> None:
    """``write(tmp)`` writes the new file (e.g. ``torch.save(obj, tmp)``), which then replaces `path` in
    one atomic step once it is on disk; a failure leaves `path` as it was. Leftovers of killed saves
    of the same path are removed first. One process."""
    path = os.path.normpath(os.fspath(path))
    for leftover in _siblings(path, ("tmp",)):
        with contextlib.suppress(OSError):
            os.unlink(leftover)
    tmp = f"{path}.tmp-{_new_id()}"
    try:
        write(tmp)
        _fsync(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync(os.path.dirname(path) or ".")
