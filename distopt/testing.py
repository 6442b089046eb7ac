"""Multi-process helpers for distopt's tests and benchmarks (and anyone testing code built on it): runs a
function on N gloo ranks in forked processes, results back, failures with the rank's traceback, a timeout
instead of a hang.

    results = run_ranks(fn, world_size=2, args=(...))   # fn(rank, world_size, *args) -> picklable

Forking is safe here (CPU only, no CUDA initialised) and takes ~0.1 s per rank, against seconds for
spawn. Each rank uses one thread (OMP_NUM_THREADS=1), joins a FileStore-backed gloo group, and
leaves it with a barrier first (avoids flaky connection resets). If a rank raises, the others are
killed and its traceback becomes the AssertionError's message. A rank killed by a signal (a crash in
native code) is named in that message with the signal, and its Python stack at the crash is on its
stderr (faulthandler), which pytest shows with the failure.

    outcomes = run_ranks_outcomes(fn, world_size=3, args=(...), pg_timeout_s=3)

is for tests in which ranks die or fail on purpose: a short process-group timeout, and each rank's
Outcome (returned, raised, or died by a signal) with the seconds it took, without stopping at the first.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import pickle
import queue as queue_module
import signal
import tempfile
import time
import traceback
from collections.abc import Callable, Collection
from datetime import timedelta
from typing import Any, NamedTuple

import torch
import torch._dynamo  # noqa: F401  (imported by the first Optimizer; 2-4 s per rank unless forked in)
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 120.0


def _rank_main(fn: Callable, rank: int, world_size: int, store_path: str, args: tuple, queue,
               pg_timeout_s: float | None = None) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    faulthandler.enable(file=2, all_threads=True)  # a fatal signal prints every thread's Python stack
    try:
        store = dist.FileStore(store_path, world_size)
        timeout = {} if pg_timeout_s is None else {"timeout": timedelta(seconds=pg_timeout_s)}
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, **timeout)
        result = fn(rank, world_size, *args)
        if pg_timeout_s is None:  # run_ranks: every rank is alive and meets the others here
            dist.barrier()
            dist.destroy_process_group()
        # Pickled here: the queue's own pickler would send tensors as shared-memory handles that
        # vanish when this process exits.
        queue.put((rank, "ok", pickle.dumps(result)))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        queue.put((rank, "error", traceback.format_exc()))


def hsdp_groups(rank: int, world_size: int, shard_size: int) -> dict:
    """Process groups for hybrid sharding: state sharded over blocks of `shard_size` consecutive ranks,
    replicated across blocks. Every rank creates every group, in the same order (torch requires it)."""
    shard_groups = [dist.new_group(list(range(s, s + shard_size))) for s in range(0, world_size, shard_size)]
    replica_groups = [dist.new_group(list(range(i, world_size, shard_size))) for i in range(shard_size)]
    return {"distributed_process_group": shard_groups[rank // shard_size],
            "redundant_process_group": replica_groups[rank % shard_size]}


def run_ranks(fn: Callable[..., Any], world_size: int, args: tuple = (), timeout: float = DEFAULT_TIMEOUT_S) -> list:
    """fn(rank, world_size, *args) on every rank; returns the results in rank order. Fails when a rank
    raises, dies by a signal, or when no rank reports for `timeout` seconds (a hang)."""
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_rank_main, args=(fn, r, world_size, store_path, args, queue), daemon=True)
                 for r in range(world_size)]
        for p in procs:
            p.start()
        try:
            last_report = time.monotonic()
            # Stops at the first error: the other ranks may then wait forever in a collective.
            while len(results) < world_size and not errors:
                try:
                    rank, status, payload = queue.get(timeout=0.1)
                except queue_module.Empty:
                    if _killed_by_signal(procs):
                        break
                    if time.monotonic() - last_report > timeout:
                        missing = sorted(set(range(world_size)) - set(results))
                        errors[-1] = f"ranks {missing} did not finish within {timeout:.0f} s (hang?)"
                    continue
                last_report = time.monotonic()
                if status == "ok":
                    results[rank] = pickle.loads(payload)
                else:
                    errors[rank] = payload
        finally:
            # Before the others are killed: a rank that crashed makes its peers fail in a collective, and
            # its signal is the first cause.
            deaths = _killed_by_signal(procs)
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join(timeout=10)
    if errors or deaths:
        raise AssertionError("".join(f"\n--- rank {r} was killed by {_signal_name(code)} (its stderr shows where)"
                                     for r, code in deaths.items())
                             + "".join(f"\n--- rank {r} raised:\n{tb}" if r >= 0 else f"\n--- {tb}"
                                       for r, tb in sorted(errors.items())))
    return [results[r] for r in range(world_size)]


def _killed_by_signal(procs: list) -> dict[int, int]:
    """{rank: exit code (minus the signal's number)} of the ranks that have died by a signal."""
    return {r: p.exitcode for r, p in enumerate(procs) if p.exitcode is not None and p.exitcode < 0}


def _signal_name(exit_code: int) -> str:
    return signal.Signals(-exit_code).name if -exit_code in signal.valid_signals() else f"signal {-exit_code}"


class Outcome(NamedTuple):
    status: str  # "ok" (value: the result), "error" (value: the traceback) or "died" (value: the exit code)
    value: Any
    seconds: float  # from the start of the ranks until the result, the error or the death was seen


def run_ranks_outcomes(fn: Callable[..., Any], world_size: int, args: tuple = (), timeout: float = DEFAULT_TIMEOUT_S,
                       pg_timeout_s: float = 3.0, wait_for: Collection[int] | None = None) -> list[Outcome]:
    """fn(rank, world_size, *args) on every rank, over a group whose collectives time out after
    `pg_timeout_s`; each rank's Outcome, in rank order. Waits for the ranks in `wait_for` (default:
    all), then kills the others (their status: "running"). A rank awaited for longer than `timeout`
    fails the test (a hang)."""
    awaited = set(range(world_size) if wait_for is None else wait_for)
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    outcomes: dict[int, Outcome] = {}
    with tempfile.TemporaryDirectory() as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_rank_main, args=(fn, r, world_size, store_path, args, queue, pg_timeout_s),
                             daemon=True) for r in range(world_size)]
        start = time.monotonic()
        for p in procs:
            p.start()
        try:
            while not awaited <= set(outcomes):
                if time.monotonic() - start > timeout:
                    missing = sorted(awaited - set(outcomes))
                    raise AssertionError(f"ranks {missing} did not finish within {timeout:.0f} s (hang?): {outcomes}")
                try:
                    rank, status, payload = queue.get(timeout=0.02)
                    value = pickle.loads(payload) if status == "ok" else payload
                    outcomes[rank] = Outcome(status, value, time.monotonic() - start)
                except queue_module.Empty:
                    for r, code in _killed_by_signal(procs).items():  # no report will come
                        if r not in outcomes:
                            outcomes[r] = Outcome("died", code, time.monotonic() - start)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join(timeout=10)
    return [outcomes.get(r, Outcome("running", None, time.monotonic() - start)) for r in range(world_size)]
