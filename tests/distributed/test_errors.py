"""Bad input to DistributedFusedAdam fails early and clearly on gloo ranks, and the harness never hangs.

Every rank checks its own error and returns normally (errors are raised symmetrically on all ranks,
so no rank is left waiting in a collective); the parent process checks what each rank saw.
"""

from __future__ import annotations

import os
import re
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from distopt import DistributedFusedAdam

from harness import run_ranks

WORLD_SIZES = [1, 2]


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)  # the same weights on every rank
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def train_step(model: nn.Module, rank: int, opt: DistributedFusedAdam | None = None) -> None:
    """Forward/backward on this rank's own random batch, then opt.step() when given."""
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(100 + rank))
    model(x).square().mean().backward()
    if opt is not None:
        opt.step()


def snapshot(params) -> list[torch.Tensor]:
    return [p.detach().clone() for p in params]


def assert_unchanged(params, before: list[torch.Tensor]) -> None:
    for p, b in zip(params, before):
        assert p.shape == b.shape
        torch.testing.assert_close(p.detach(), b, rtol=0, atol=0)


# ---------------------------------------------------------------- constructor / setup errors


def _duplicate_in_group():
    w = make_model()[0].weight
    return DistributedFusedAdam([w, w])


def _duplicate_across_groups():
    m = make_model()
    return DistributedFusedAdam([{"params": [m[0].weight]}, {"params": [m[0].bias, m[0].weight]}])


def _add_param_group_after_construction():
    m = make_model()
    opt = DistributedFusedAdam(m[0].parameters())
    groups_before = len(opt.param_groups)
    try:
        opt.add_param_group({"params": list(m[2].parameters())})
    finally:
        assert len(opt.param_groups) == groups_before, "a rejected group was still added"


# name -> (action, expected exception type, regex its message must match)
SETUP_CASES = {
    "dtype-fp16": (lambda: DistributedFusedAdam(make_model().parameters(), dtype=torch.float16),
                   ValueError, "float32"),
    "dtype-bf16": (lambda: DistributedFusedAdam(make_model().parameters(), dtype=torch.bfloat16),
                   ValueError, "float32"),
    "grad_sync_dtype-int32": (lambda: DistributedFusedAdam(make_model().parameters(), grad_sync_dtype=torch.int32),
                              ValueError, "grad_sync_dtype"),
    "grad_sync_dtype-fp64": (lambda: DistributedFusedAdam(make_model().parameters(), grad_sync_dtype=torch.float64),
                             ValueError, "grad_sync_dtype"),
    "param_sync_dtype-int8": (lambda: DistributedFusedAdam(make_model().parameters(), param_sync_dtype=torch.int8),
                              ValueError, "param_sync_dtype"),
    "negative-lr": (lambda: DistributedFusedAdam(make_model().parameters(), lr=-1e-3), ValueError, "learning rate"),
    "beta1-one": (lambda: DistributedFusedAdam(make_model().parameters(), betas=(1.0, 0.999)), ValueError, "beta"),
    "beta2-one": (lambda: DistributedFusedAdam(make_model().parameters(), betas=(0.9, 1.0)), ValueError, "beta"),
    "beta2-negative": (lambda: DistributedFusedAdam(make_model().parameters(), betas=(0.9, -0.1)),
                       ValueError, "beta"),
    "bucket_cap_mb-zero": (lambda: DistributedFusedAdam(make_model().parameters(), bucket_cap_mb=0),
                           ValueError, "bucket_cap_mb"),
    "bucket_cap_mb-negative": (lambda: DistributedFusedAdam(make_model().parameters(), bucket_cap_mb=-1.0),
                               ValueError, "bucket_cap_mb"),
    "pipeline_size-zero": (lambda: DistributedFusedAdam(make_model().parameters(), pipeline_size=0),
                           ValueError, "pipeline_size"),
    "duplicate-in-group": (_duplicate_in_group, ValueError, "more than once"),
    "duplicate-across-groups": (_duplicate_across_groups, ValueError, "more than (once|one)"),
    "meta-device": (lambda: DistributedFusedAdam(nn.Linear(8, 4, device="meta").parameters()),
                    ValueError, "communicates cpu"),
    "remainders-with-fp32": (lambda: DistributedFusedAdam(make_model().parameters(), store_param_remainders=True),
                             ValueError, "store_param_remainders"),
    "contiguous-param-buffer-sync-dtype": (
        lambda: DistributedFusedAdam(make_model().parameters(), contiguous_param_buffer=True,
                                     param_sync_dtype=torch.bfloat16),
        ValueError, "contiguous_param_buffer"),
    "no-trainable-params": (lambda: DistributedFusedAdam(make_model().requires_grad_(False).parameters()),
                            ValueError, "no trainable"),
    "capturable": (lambda: DistributedFusedAdam(make_model().parameters(), capturable=True),
                   ValueError, "capturable=True is for CUDA-graph capture"),
    "add_param_group-after-construction": (_add_param_group_after_construction, RuntimeError, "after construction"),
}


def _setup_cases_rank(rank: int, world_size: int) -> dict:
    """Runs every setup case on this rank; returns name -> (exception type, message) or None."""
    outcomes = {}
    for name, (action, _, _) in SETUP_CASES.items():
        try:
            action()
        except Exception as e:  # noqa: BLE001 - reported to the parent, which checks the type
            outcomes[name] = (type(e), str(e))
        else:
            outcomes[name] = None
    return outcomes


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda w: f"world{w}")
def setup_outcomes(request) -> list[dict]:
    """One run_ranks per world size for all setup cases (each pays gloo setup only once)."""
    return run_ranks(_setup_cases_rank, request.param, timeout=60)


@pytest.mark.parametrize("case", list(SETUP_CASES))
def test_setup_error(setup_outcomes, case):
    """Each bad constructor argument (or late add_param_group) raises the documented error on every rank."""
    _, expected_type, pattern = SETUP_CASES[case]
    for rank, outcomes in enumerate(setup_outcomes):
        outcome = outcomes[case]
        assert outcome is not None, f"rank {rank}: {case} raised nothing"
        exc_type, message = outcome
        assert issubclass(exc_type, expected_type), f"rank {rank}: {exc_type.__name__}: {message}"
        assert re.search(pattern, message), f"rank {rank}: {message!r} does not match {pattern!r}"


def test_not_initialised_raises():
    """Without torch.distributed initialised the constructor says so (no process group needed)."""
    assert not dist.is_initialized(), "a test left torch.distributed initialised in the pytest process"
    with pytest.raises(RuntimeError, match="torch.distributed"):
        DistributedFusedAdam(make_model().parameters())


# ---------------------------------------------------------------- runtime errors


def _no_sync_rank(rank: int, world_size: int) -> list[list[float]]:
    model = make_model()
    params = list(model.parameters())
    opt = DistributedFusedAdam(params, lr=1e-2)
    for layout_built in (False, True):  # the first iteration runs before the layout exists
        assert (opt._runtime.layout is not None) == layout_built
        with opt.no_sync():
            train_step(model, rank)
            before = snapshot(params)
            with pytest.raises(RuntimeError, match="no_sync"):
                opt.step()
            with pytest.raises(RuntimeError, match="no_sync"):
                opt.grad_sync()
            assert_unchanged(params, before)
        opt.step()  # outside the block the accumulated gradient is synchronised and applied
        assert any(not torch.equal(p, b) for p, b in zip(params, before)), "step after no_sync changed nothing"
    return [p.detach().flatten().tolist() for p in params]  # plain lists: see the harness note below


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_step_and_grad_sync_inside_no_sync_raise(world_size):
    """step()/grad_sync() inside no_sync() raise RuntimeError, leave params alone, and the optimizer recovers."""
    results = run_ranks(_no_sync_rank, world_size, timeout=60)
    for rank_params in results[1:]:  # replicas stay identical after the recovered steps
        assert rank_params == results[0]


class _SparseModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(10, 4, sparse=True)
        self.out = nn.Linear(4, 3)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(idx))


def _sparse_rank(rank: int, world_size: int, init_layout_first: bool) -> None:
    model = _SparseModel()
    params = list(model.parameters())
    opt = DistributedFusedAdam(params)
    if init_layout_first:
        opt.init_params()
    before = snapshot(params)
    idx = torch.randint(0, 10, (5,), generator=torch.Generator().manual_seed(rank))
    loss = model(idx).square().sum()
    if init_layout_first:  # the grad hook moves grads into buckets during backward: it rejects it there
        with pytest.raises(RuntimeError, match="sparse"):
            loss.backward()
    else:  # the first backward leaves grads in .grad; the first step builds the buckets and rejects it
        loss.backward()
        assert model.emb.weight.grad.is_sparse
        with pytest.raises(RuntimeError, match="sparse"):
            opt.step()
    assert_unchanged(params, before)


@pytest.mark.parametrize("init_layout_first", [False, True], ids=["lazy-layout", "init_params"])
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_sparse_gradients_raise(world_size, init_layout_first):
    """nn.Embedding(sparse=True) gradients raise a RuntimeError naming sparse gradients; params untouched."""
    run_ranks(_sparse_rank, world_size, args=(init_layout_first,), timeout=60)


def _resize_rank(rank: int, world_size: int) -> None:
    model = make_model()
    params = list(model.parameters())
    opt = DistributedFusedAdam(params, lr=1e-2)
    train_step(model, rank, opt)  # builds the layout
    train_step(model, rank)
    model[0].weight.data = torch.randn(17, 8)  # was 16 x 8
    before = snapshot(params)
    with pytest.raises(RuntimeError, match="changed size"):
        opt.step()
    assert_unchanged(params, before)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_param_resized_after_layout_raises(world_size):
    """A param whose size changed after the layout was built makes step() raise before any param changes."""
    run_ranks(_resize_rank, world_size, timeout=60)


# ---------------------------------------------------------------- the harness contract

_MARKER = "rank-1-failed-before-the-all_reduce"


def _one_rank_raises(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError(_MARKER)
    dist.all_reduce(torch.ones(3))  # rank 0 waits here for a rank that will never come


def test_harness_reports_a_failing_rank_instead_of_hanging():
    """A rank raising while another waits in a collective gives an AssertionError with its traceback, fast."""
    timeout = 20
    start = time.monotonic()
    with pytest.raises(AssertionError) as info:
        run_ranks(_one_rank_raises, 2, timeout=timeout)
    elapsed = time.monotonic() - start
    text = str(info.value)
    assert "rank 1 raised" in text and "Traceback" in text
    assert f"ValueError: {_MARKER}" in text and "_one_rank_raises" in text
    assert elapsed < timeout, f"took {elapsed:.1f} s: the harness waited for the blocked rank"


def _one_rank_stalls(rank: int, world_size: int) -> None:
    if rank == 1:
        time.sleep(120)  # never reaches the collective; killed by the harness
    dist.all_reduce(torch.ones(3))


def test_harness_times_out_instead_of_hanging():
    """Ranks that never finish (no exception anywhere) end in an AssertionError after the timeout."""
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"did not finish within 2 s"):
        run_ranks(_one_rank_stalls, 2, timeout=2)
    assert time.monotonic() - start < 30


def _one_rank_crashes(rank: int, world_size: int) -> None:
    if rank == 0:
        os.abort()  # as a crash in native code: no exception, no report, SIGABRT
    dist.all_reduce(torch.ones(3))  # rank 1 waits here (the group's timeout is minutes)


def test_harness_names_a_rank_killed_by_a_signal(capfd):
    """A rank dying by a signal while the other waits in a collective fails the test fast, with the rank
    and the signal named and the dead rank's Python stack on stderr (where pytest shows it)."""
    timeout = 60
    start = time.monotonic()
    with pytest.raises(AssertionError) as info:
        run_ranks(_one_rank_crashes, 2, timeout=timeout)
    assert time.monotonic() - start < timeout / 2, "the harness waited for the rank blocked in the collective"
    assert "rank 0 was killed by SIGABRT" in str(info.value)
    stderr = capfd.readouterr().err
    assert "Fatal Python error: Aborted" in stderr and "_one_rank_crashes" in stderr, stderr


def _return_tensor(rank: int, world_size: int) -> torch.Tensor:
    return torch.full((3,), float(rank))


def test_harness_returns_tensor_results():
    """run_ranks returns each rank's tensor result (fn's contract is 'picklable', which tensors are)."""
    results = run_ranks(_return_tensor, 2, timeout=30)
    assert [r.tolist() for r in results] == [[0.0] * 3, [1.0] * 3]


def _step_under_pretended_capture(rank: int, world_size: int) -> str:
    model = make_model()
    opt = DistributedFusedAdam(model.parameters())
    model(torch.randn(3, model[0].in_features)).sum().backward()
    opt.step()  # builds the layout
    model(torch.randn(3, model[0].in_features)).sum().backward()
    torch.cuda.is_available = lambda: True  # this forked rank only: pretend to be capturing a graph
    torch.cuda.is_current_stream_capturing = lambda: True
    try:
        opt.step()
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def test_eager_step_refuses_cuda_graph_capture():
    """A non-capturable step inside a CUDA-graph capture raises (its inf check would sync the host)."""
    messages = run_ranks(_step_under_pretended_capture, 1)
    assert "capturable=True" in messages[0]
