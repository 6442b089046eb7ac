"""Collectives for DistributedFusedAdam: process groups, version shims, event tracing.

NCCL runs every async collective on its own stream, ordered after the work already queued on the
current stream, and ``Work.wait()`` makes the current stream (not the host) wait for it; gloo runs it
on a background thread and ``wait()`` blocks the host. Either way the caller overlaps compute with
communication by launching early and waiting late, which is all the optimizer does.

A collective that fails (a rank died, or the process group's timeout expired while a rank hung)
raises ``CollectiveFailed`` naming it (which bucket, what for), on waiting for an async one or at a
blocking one: so every surviving rank stops with a readable error within the process group's
timeout, and a launcher such as torchrun can restart the job from its last checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import Tensor

# torch >= 2.15 names these *_single (the *_tensor names remain as aliases, deprecated in 2.13-2.14);
# torch 2.11 only has the *_tensor names.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

EventHook = Callable[[str, int], None]


class CollectiveFailed(dist.DistBackendError):
    """A collective of DistributedFusedAdam failed; the message names it."""


@contextmanager
def named(what: str) -> Iterator[None]:
    """Re-raises the failure of the collectives inside as CollectiveFailed naming `what`."""
    try:
        yield
    except CollectiveFailed:
        raise
    except RuntimeError as exc:  # gloo's and NCCL's errors: the peer's address or a timeout, not the operation
        first = (str(exc).splitlines() or [""])[0][:300]
        raise CollectiveFailed(
            f"DistributedFusedAdam: the {what} failed: {type(exc).__name__}: {first}. If a rank died or the process "
            "group's timeout expired, restart the job from its last checkpoint (torchrun --max-restarts)") from exc


class NamedWork:
    """An async collective's handle whose ``wait()`` names the collective if it failed."""

    __slots__ = ("work", "what")

    def __init__(self, work: dist.Work, what: str) -> None:
        self.work, self.what = work, what

    def wait(self, timeout=None) -> bool:
        with named(self.what):
            return self.work.wait() if timeout is None else self.work.wait(timeout)

    def is_completed(self) -> bool:
        return self.work.is_completed()


class LocalWork:
    """The handle of a collective over one rank, done locally before it is returned: a one-rank
    group's reduce-scatter, all-gather or all-reduce is a copy (or nothing), and gloo's takes tens of
    milliseconds of fixed cost for it."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


_DONE = LocalWork()
Handle = NamedWork | LocalWork  # what the async collectives below return


class Comm:
    """The optimizer's view of its process groups.

    ``dist_group`` shards the optimizer state (size ``dist_size``, this rank's index ``dist_rank``);
    ``redundant_group`` (optional) holds the ranks with the same shard, whose gradients are summed
    after the reduce-scatter (hybrid sharding). A group of one rank communicates nothing: its
    collectives are local copies (``local``, ``LocalWork``), the same bits gloo or NCCL would give.
    ``on_event(name, bucket)``, when set, is called as
    collectives start and finish: tests use it to prove overlap.
    """

    def __init__(self, process_group=None, distributed_process_group=None, redundant_process_group=None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "DistributedFusedAdam needs torch.distributed initialised (dist.init_process_group, or torchrun)"
            )
        self.process_group = process_group or dist.group.WORLD
        self.dist_group = distributed_process_group or self.process_group
        self.redundant_group = redundant_process_group
        self.dist_size = dist.get_world_size(self.dist_group)
        self.dist_rank = dist.get_rank(self.dist_group)
        self.redundant_size = dist.get_world_size(self.redundant_group) if self.redundant_group is not None else 1
        world = self.world_size = dist.get_world_size(self.process_group)
        if self.dist_size * self.redundant_size != world:
            raise ValueError(
                f"distributed_process_group ({self.dist_size} ranks) x redundant_process_group "
                f"({self.redundant_size} ranks) must cover process_group ({world} ranks)"
            )
        self.backend = dist.get_backend(self.dist_group)
        self.on_event: EventHook | None = None

    @property
    def local(self) -> bool:
        """The shard group is this rank alone: reduce-scatters and all-gathers are local copies."""
        return self.dist_size == 1

    @property
    def data_parallel_size(self) -> int:
        return self.dist_size * self.redundant_size

    def device_type(self) -> str | None:
        """The device type the backend communicates (None when it accepts several)."""
        return {"nccl": "cuda", "gloo": "cpu"}.get(str(self.backend))

    def event(self, name: str, bucket: int = -1) -> None:
        if self.on_event is not None:
            self.on_event(name, bucket)

    def reduce_scatter(self, shard: Tensor, bucket: Tensor, index: int) -> Handle:
        """Async sum of `bucket` over the shard group; this rank's shard lands in `shard`."""
        self.event("reduce_scatter_start", index)
        if self.local:
            if shard.data_ptr() != bucket.data_ptr():
                shard.copy_(bucket)
            return _DONE
        what = f"reduce-scatter of bucket {index}'s gradients"
        with named(what):
            work = _reduce_scatter(shard, bucket, op=dist.ReduceOp.SUM, group=self.dist_group, async_op=True)
        return NamedWork(work, what)

    def all_reduce_redundant(self, shard: Tensor, index: int) -> NamedWork | None:
        """Async sum of a reduced shard over its replicas (hybrid sharding); None without replicas."""
        if self.redundant_size == 1:
            return None
        self.event("all_reduce_redundant_start", index)
        what = f"all-reduce of bucket {index}'s gradient shard over its replicas"
        with named(what):
            work = dist.all_reduce(shard, op=dist.ReduceOp.SUM, group=self.redundant_group, async_op=True)
        return NamedWork(work, what)

    def all_gather(self, bucket: Tensor, shard: Tensor, index: int, of: str = "params") -> Handle:
        """Async gather of every rank's shard into `bucket` (`shard` may be this rank's slice of it);
        `of` says what it gathers (for an error message)."""
        self.event("all_gather_start", index)
        if self.local:
            if shard.data_ptr() != bucket.data_ptr():
                bucket.copy_(shard)
            return _DONE
        what = f"all-gather of bucket {index}'s {of}"
        with named(what):
            work = _all_gather(bucket, shard, group=self.dist_group, async_op=True)
        return NamedWork(work, what)

    def all_reduce_sum(self, tensor: Tensor) -> None:
        """Blocking (stream-ordered on GPU) sum over the shard group, for norms and inf flags."""
        if self.local:
            return
        with named("all-reduce of the gradient norm and inf/nan count"):
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.dist_group)

    def count_ranks(self, flag: bool, device: torch.device) -> int:
        """How many ranks of the data-parallel group pass a true `flag` (blocking, reads the result)."""
        if self.world_size == 1:
            return int(flag)
        t = torch.tensor([float(flag)], device=device)
        with named("all-reduce that checks every rank is at the same iteration"):
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.process_group)
        return int(t.item())

    def broadcast_ints(self, values: list[int], device: torch.device) -> list[int]:
        """Rank 0's list of `len(values)` ints (of the data-parallel group) on every rank."""
        if self.world_size == 1:
            return [int(v) for v in values]
        t = torch.tensor(values, dtype=torch.int64, device=device)
        with named("broadcast of rank 0's bucket layout"):
            dist.broadcast(t, src=dist.get_global_rank(self.process_group, 0), group=self.process_group)
        return t.tolist()


def raise_together(group: dist.ProcessGroup | None, error: str | None, headline: str,
                   kind: type[Exception] = ValueError) -> None:
    """Raises the same `kind` of error on every rank of `group` if any rank found an error (a collective)."""
    errors: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(errors, error, group=group)
    failed = [r for r, e in enumerate(errors) if e is not None]
    if failed:
        raise kind(f"{headline}: {errors[failed[0]]} (found on rank(s) {failed} of the process group)")
