"""No hang when a peer dies: a rank SIGKILLed in the middle of a step (in backward's reduce-scatters,
in step's all-gathers, in a checkpoint save) makes every other rank raise an error naming the
collective that failed, well within the process group's timeout; a rank that hangs instead makes
them raise once the timeout expires. 3 gloo ranks, rank 1 the victim, a 3 s timeout.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from distopt import DistributedFusedAdam
from distopt.distributed import checkpoint

from harness import run_ranks_outcomes

PG_TIMEOUT_S = 3.0
SLACK_S = 2.0  # process start-up and scheduling on a busy 2-core machine
WORLD, VICTIM = 3, 1
TINY_BUCKET_MB = 300 * 4 / 2**20  # several buckets: the victim dies with some collectives started
EXPECTED = {
    "backward": "CollectiveFailed: DistributedFusedAdam: the reduce-scatter of bucket",
    "step": "CollectiveFailed: DistributedFusedAdam: the all-gather of bucket",
    "save": "SaveInterrupted: checkpoint save to",
}


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))


def stop(how: str) -> None:
    if how == "dies":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(600)  # hangs (the test kills it)


def one_step(model: nn.Module, opt: DistributedFusedAdam, rank: int) -> None:
    gen = torch.Generator().manual_seed(rank)
    nn.functional.mse_loss(model(torch.randn(8, 16, generator=gen)), torch.randn(8, 4, generator=gen)).backward()
    opt.step()
    opt.zero_grad()


def victim_stops(rank: int, world_size: int, moment: str, how: str, path: str) -> dict:
    """A warm-up step and a first save on every rank; then the victim stops at `moment` of the next
    step (or save). The others return what they raised and how long after the start of that step."""
    model = make_model()
    opt = DistributedFusedAdam(model.parameters(), bucket_cap_mb=TINY_BUCKET_MB)
    one_step(model, opt, rank)
    checkpoint.save(opt, path)
    if rank == VICTIM:
        if moment == "save":  # inside torch.distributed.checkpoint, as its data file is synced
            os.fsync = lambda fd: stop(how)
        else:
            event = {"backward": "reduce_scatter_start", "step": "all_gather_start"}[moment]
            opt.comm.on_event = lambda name, bucket: stop(how) if name == event and bucket == 1 else None
    dist.barrier()
    start = time.monotonic()
    try:
        if moment == "save":
            checkpoint.save(opt, path)
        else:
            one_step(model, opt, rank)
    except RuntimeError as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - start}
    return {"error": None, "seconds": time.monotonic() - start}


@pytest.mark.parametrize("moment", list(EXPECTED))
def test_every_survivor_names_the_failed_collective_when_a_rank_dies(moment, tmp_path):
    outcomes = run_ranks_outcomes(victim_stops, WORLD, (moment, "dies", str(tmp_path / "ckpt")), timeout=60,
                                  pg_timeout_s=PG_TIMEOUT_S)
    assert outcomes[VICTIM].status == "died", outcomes[VICTIM]
    for rank in set(range(WORLD)) - {VICTIM}:
        o = outcomes[rank]
        assert o.status == "ok" and o.value["error"] is not None, (rank, o)
        assert o.value["error"].startswith(EXPECTED[moment]), (rank, o.value["error"])
        assert o.value["seconds"] < PG_TIMEOUT_S + SLACK_S, (rank, o.value)
        others = [text for m, text in EXPECTED.items() if m != moment]
        assert not any(o.value["error"].startswith(text) for text in others)


def test_a_rank_that_hangs_stops_the_others_when_the_timeout_expires(tmp_path):
    outcomes = run_ranks_outcomes(victim_stops, WORLD, ("step", "hangs", str(tmp_path / "ckpt")), timeout=60,
                                  pg_timeout_s=PG_TIMEOUT_S, wait_for=[0, 2])
    assert outcomes[VICTIM].status == "running"
    for rank in (0, 2):
        value = outcomes[rank].value
        assert value["error"].startswith(EXPECTED["step"]), (rank, value)
        assert PG_TIMEOUT_S * 0.9 < value["seconds"] < PG_TIMEOUT_S + SLACK_S, (rank, value)
