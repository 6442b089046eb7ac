"""Ranks that built DistributedFusedAdam differently all stop with the same clear ValueError.

Each case gives every rank its own model, param list and options; only one rank (or the params' order
on it) differs. Every rank catches the ValueError that the first step raises (the layout is built
there) and returns its message, so the parent checks that EVERY rank raised, with identical text
naming the differing entry. Without the check these cases diverge silently or abort gloo.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
import torch.distributed as dist
from torch import nn

from distopt import DistributedFusedAdam
from distopt.distributed import agreement

from harness import run_ranks


@dataclass
class Setup:
    """What one rank trains: its model, the optimizer's params (default: model.parameters()), the
    optimizer's keyword arguments, and one input batch."""

    model: nn.Module
    x: torch.Tensor
    params: list | None = None
    kwargs: dict = field(default_factory=dict)


def agreement_args(opt: DistributedFusedAdam) -> tuple:
    """What the optimizer hands agreement.check and fingerprint: its runtime, param groups and options."""
    return opt._runtime, opt.param_groups, {name: getattr(opt, name) for name in agreement.OPTIONS}


def mlp(d_in: int = 4, d_hidden: int = 6) -> nn.Module:
    torch.manual_seed(0)  # the same weights on every rank
    return nn.Sequential(nn.Linear(d_in, d_hidden), nn.Tanh(), nn.Linear(d_hidden, d_in))


def batch(d_in: int = 4) -> torch.Tensor:
    return torch.randn(3, d_in, generator=torch.Generator().manual_seed(7))


def same(rank: int) -> Setup:
    return Setup(mlp(), batch())


def reversed_params(rank: int) -> Setup:
    m = mlp()
    params = list(m.parameters())
    return Setup(m, batch(), params[::-1] if rank == 1 else params)


def other_sizes(rank: int) -> Setup:
    """Rank 1 has a wider hidden layer: the buckets' sizes differ (a gloo size-mismatch abort before)."""
    return Setup(mlp(d_hidden=8 if rank == 1 else 6), batch())


def extra_layer(rank: int) -> Setup:
    """Rank 1 has more params (rank 0's order broadcast would have aborted gloo before)."""
    m = mlp()
    if rank == 1:
        m.append(nn.Linear(4, 4))
    return Setup(m, batch())


def same_sizes_other_shapes(rank: int) -> Setup:
    """Linear(4,6)+Linear(6,4) against Linear(6,4)+Linear(4,6): same multiset of sizes, other shapes."""
    d_in, d_hidden = (6, 4) if rank == 1 else (4, 6)
    return Setup(mlp(d_in, d_hidden), batch(d_in))


def other_lr(rank: int) -> Setup:
    return Setup(mlp(), batch(), kwargs=dict(lr=0.1 if rank == 1 else 0.01))


def other_weight_decay(rank: int) -> Setup:
    m = mlp()
    groups = [{"params": list(m[0].parameters())},
              {"params": list(m[2].parameters()), "weight_decay": 0.5 if rank == 1 else 0.0}]
    return Setup(m, batch(), groups)


def other_bucket_cap(rank: int) -> Setup:
    return Setup(mlp(), batch(), kwargs=dict(bucket_cap_mb=1.0 if rank == 1 else 100.0))


def other_overlap(rank: int) -> Setup:
    return Setup(mlp(), batch(), kwargs=dict(overlap_grad_sync=rank != 1))


def channels_last_on_one_rank(rank: int) -> Setup:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4 * 3 * 3, 2))
    if rank == 1:
        m[0].to(memory_format=torch.channels_last)
    return Setup(m, torch.randn(2, 3, 5, 5, generator=torch.Generator().manual_seed(7)))


def other_grad_sync_dtype(rank: int) -> Setup:
    return Setup(mlp(), batch(), kwargs=dict(grad_sync_dtype=torch.bfloat16 if rank == 1 else None))


def one_step(rank: int, world_size: int, make: Callable[[int], Setup]) -> str | None:
    """One training step; the ValueError's message if it raised, else None."""
    s = make(rank)
    opt = DistributedFusedAdam(s.params if s.params is not None else s.model.parameters(), **s.kwargs)
    s.model(s.x).square().mean().backward()
    try:
        opt.step()
    except ValueError as exc:
        return str(exc)
    return None


# name -> (setup, what the message must quote)
CASES = {
    "reversed_param_list": (reversed_params, "param 0 (group 0, index 0) shape: rank 0 has (6, 4), rank 1 has (4,)"),
    "other_sizes": (other_sizes, "param 0 (group 0, index 0) shape: rank 0 has (6, 4), rank 1 has (8, 4)"),
    "extra_layer": (extra_layer, "param group 0 trainable params: rank 0 has 4, rank 1 has 6"),
    "same_sizes_other_shapes": (same_sizes_other_shapes,
                                "param 0 (group 0, index 0) shape: rank 0 has (6, 4), rank 1 has (4, 6)"),
    "other_lr": (other_lr, "param group 0 lr: rank 0 has 0.01, rank 1 has 0.1"),
    "other_weight_decay": (other_weight_decay, "param group 1 weight_decay: rank 0 has 0.0, rank 1 has 0.5"),
    "other_bucket_cap_mb": (other_bucket_cap, "option bucket_cap_mb: rank 0 has 100.0, rank 1 has 1.0"),
    "other_overlap_grad_sync": (other_overlap, "option overlap_grad_sync: rank 0 has True, rank 1 has False"),
    "channels_last_on_one_rank": (channels_last_on_one_rank,
                                  "param 0 (group 0, index 0) strides: rank 0 has (27, 9, 3, 1), "
                                  "rank 1 has (27, 1, 9, 3)"),
    "other_grad_sync_dtype": (other_grad_sync_dtype,
                              "option grad_sync_dtype: rank 0 has None, rank 1 has torch.bfloat16"),
}

ADVICE = "same param groups, in the same order"


def assert_same_error_everywhere(messages: list[str | None], expected: str) -> None:
    for rank, message in enumerate(messages):
        assert message is not None, f"rank {rank} raised no ValueError"
        assert message == messages[0], f"rank {rank}'s message differs from rank 0's:\n{message}\n{messages[0]}"
    assert expected in messages[0], messages[0]
    assert ADVICE in messages[0], messages[0]


@pytest.mark.parametrize("case", list(CASES))
def test_disagreeing_ranks_all_raise_the_same_error(case):
    """Each kind of disagreement makes every rank raise one identical ValueError quoting the difference."""
    make, expected = CASES[case]
    assert_same_error_everywhere(run_ranks(one_step, 2, (make,), timeout=60), expected)


def test_one_rank_of_four_differs():
    """Ranks are grouped by value in the message: the odd one out is named alone."""
    def make(rank: int) -> Setup:
        return Setup(mlp(), batch(), kwargs=dict(lr=0.1 if rank == 2 else 0.01))

    assert_same_error_everywhere(run_ranks(one_step, 4, (make,), timeout=60),
                                 "param group 0 lr: ranks 0, 1, 3 have 0.01, rank 2 has 0.1")


def _identical_setups_train(rank: int, world_size: int) -> tuple[str | None, list[list[float]]]:
    s = same(rank)
    message = one_step(rank, world_size, lambda r: s)
    return message, [p.detach().flatten().tolist() for p in s.model.parameters()]


def test_identical_setups_train():
    """Positive control: identical ranks step without error and their replicas stay identical."""
    results = run_ranks(_identical_setups_train, 2, timeout=60)
    assert [message for message, _ in results] == [None, None]
    assert results[1][1] == results[0][1]
    torch.manual_seed(0)
    assert results[0][1] != [p.flatten().tolist() for p in mlp().parameters()], "the step changed nothing"


def _count_checks(rank: int, world_size: int, use_init_params: bool) -> tuple[int, int]:
    """(check_ranks_agree calls over 3 steps, collectives inside one agreeing check)."""
    calls = []
    original = agreement.check_ranks_agree
    agreement.check_ranks_agree = lambda *args: calls.append(1) or original(*args)
    s = same(rank)
    opt = DistributedFusedAdam(s.model.parameters())
    if use_init_params:
        opt.init_params()
        assert len(calls) == 1, "init_params builds the layout: it should have checked"
    for _ in range(3):
        s.model(s.x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    agreement.check_ranks_agree = original

    collectives = []
    for name in ("all_gather", "all_gather_into_tensor", "all_gather_object", "all_reduce", "broadcast",
                 "broadcast_object_list", "all_to_all", "gather", "scatter"):
        fn = getattr(dist, name)
        setattr(dist, name, lambda *a, _fn=fn, _name=name, **k: collectives.append(_name) or _fn(*a, **k))
    agreement.check(*agreement_args(opt))
    return len(calls), len(collectives)


@pytest.mark.parametrize("use_init_params", [False, True], ids=["lazy-layout", "init_params"])
def test_one_check_per_layout_not_per_step(use_init_params):
    """The check runs once, when the layout is built, and costs agreeing ranks a single collective."""
    assert run_ranks(_count_checks, 2, (use_init_params,), timeout=60) == [(1, 1), (1, 1)]


def _init_params_disagreement(rank: int, world_size: int) -> str | None:
    s = other_lr(rank)
    opt = DistributedFusedAdam(s.model.parameters(), **s.kwargs)
    try:
        opt.init_params()
    except ValueError as exc:
        return str(exc)
    return None


def test_init_params_checks_too():
    """A layout built by init_params() (before any backward) is checked the same way."""
    assert_same_error_everywhere(run_ranks(_init_params_disagreement, 2, timeout=60), CASES["other_lr"][1])


def _fingerprint(rank: int, world_size: int) -> list[tuple[str, str]]:
    m = mlp()
    m[2].bias.requires_grad_(False)  # frozen: not in the fingerprint
    opt = DistributedFusedAdam([{"params": list(m[0].parameters()), "lr": 0.5, "name": "first"},
                                {"params": list(m[2].parameters())}], weight_decay=0.0)
    return agreement.fingerprint(*agreement_args(opt))


def test_fingerprint_entries():
    """The fingerprint covers sizes, options, each group's hyperparameters and each trainable param."""
    entries = dict(run_ranks(_fingerprint, 1, timeout=60)[0])
    assert entries["data-parallel group size"] == "1"
    assert entries["option bucket_cap_mb"] == "100.0" and entries["option capturable"] == "False"
    assert entries["param group 0 lr"] == "0.5" and entries["param group 1 lr"] == "0.001"
    assert entries["param group 0 betas"] == "(0.9, 0.999)"
    assert entries["param group 0 name"] == "'first'"
    assert entries["param group 0 trainable params"] == "2" and entries["param group 1 trainable params"] == "1"
    assert entries["param 2 (group 1, index 0) shape"] == "(4, 6)"
    assert entries["param 2 (group 1, index 0) strides"] == "(6, 1)"
    assert entries["param 1 (group 0, index 1) grad sync dtype"] == "torch.float32"
    assert not any(d.startswith("param 3") or "(group 1, index 1)" in d for d in entries)


def test_message_groups_ranks_and_handles_lists_out_of_step():
    """The message text, built from every rank's entries (no process group needed)."""
    a = [["x", "1"], ["y", "2"]]
    b = [["x", "1"], ["z", "3"]]
    text = agreement._disagreement([a, b, a], [0, 1, 2])
    assert "disagree on entry 1: ranks 0, 2 have y = 2, rank 1 has z = 3" in text
    text = agreement._disagreement([a, a[:1]], [0, 1])
    assert "disagree on y: rank 0 has 2, rank 1 has (none)" in text


@pytest.mark.cuda
def test_nccl_agreeing_and_gather_path(nccl_group):
    """On NCCL (one rank) the digest all-gather runs on the GPU; an optimizer on CUDA steps with the check."""
    agreement.check_ranks_agree([("x", "1")], None, torch.device("cuda"))
    model = nn.Linear(8, 8).cuda()
    opt = DistributedFusedAdam(model.parameters(), capturable=True)  # lr becomes a GPU tensor
    model(torch.randn(2, 8, device="cuda")).sum().backward()
    opt.step()
    entries = dict(agreement.fingerprint(*agreement_args(opt)))
    assert entries["param group 0 lr"] == "0.0010000000474974513"  # float32 0.001
