"""apex-style layout control: ``init_params(params, grad_sync_dtype=, param_sync_dtype=)`` on disjoint
subsets (the rest laid out at the first backward) and ``init_params_bucket``.

An fp32 model reduces the gradients of a third of its params in bf16 and all-gathers another third
in bf16 (those keep fp32 masters); it is compared with DDP + torch.optim.AdamW after every step, at
bf16 tolerance, and the buckets are checked to carry the dtypes each call asked for.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distopt import DistributedFusedAdam

import tolerances
from harness import run_ranks

STEPS = 3
BUCKET_MB = 300 * 4 / 2**20


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(m for _ in range(3) for m in (nn.Linear(12, 12), nn.Tanh())), nn.Linear(12, 4))


def thirds(model: nn.Sequential) -> tuple[list, list, list]:
    layers = [m for m in model if isinstance(m, nn.Linear)]
    return list(layers[0].parameters()), list(layers[1].parameters()), [p for m in layers[2:] for p in m.parameters()]


def mixed_sync_dtypes(rank: int, world_size: int) -> int:
    ref_model = make_model()
    ref = DDP(ref_model)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
    model = make_model()
    opt = DistributedFusedAdam(model.parameters(), lr=1e-2, bucket_cap_mb=BUCKET_MB)
    bf16_grads, bf16_params, lazy = thirds(model)
    opt.init_params(bf16_grads, grad_sync_dtype=torch.bfloat16)
    opt.init_params(bf16_params, param_sync_dtype=torch.bfloat16)
    assert opt.memory_report()["total"] == 0, "the rest is laid out lazily: nothing is allocated yet"
    checks = 0
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(8, 12, generator=gen), torch.randn(8, 4, generator=gen)
        nn.functional.mse_loss(model(x), y).backward()
        nn.functional.mse_loss(ref(x), y).backward()
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
        for p, q in zip(model.parameters(), ref_model.parameters()):
            tolerances.assert_close(p, q, tolerances.DISTRIBUTED, dtype=torch.bfloat16, scale_atol=True)
            checks += 1
    # every bucket carries what its params asked for; bf16 param sync keeps fp32 masters (fp32 params
    # synchronised in fp32 are their own masters, whatever their grads are reduced in)
    index = {p: i for i, p in enumerate(model.parameters())}
    for b in opt.shard_buckets():
        names = {i for i in b.params}
        for group, grad_dtype, param_dtype, master in ((bf16_grads, torch.bfloat16, torch.float32, False),
                                                       (bf16_params, torch.float32, torch.bfloat16, True),
                                                       (lazy, torch.float32, torch.float32, False)):
            if names & {index[p] for p in group}:
                assert names <= {index[p] for p in group}, "a bucket mixes params with different sync dtypes"
                assert (b.grad_dtype, b.param_dtype) == (grad_dtype, param_dtype)
                assert (b.state.master is not None) == master
    return checks


def test_mixed_sync_dtypes_match_ddp():
    assert all(c > 0 for c in run_ranks(mixed_sync_dtypes, 2))


def fresh_bucket(rank: int, world_size: int) -> list[int]:
    model = make_model()
    opt = DistributedFusedAdam(model.parameters(), lr=1e-2, bucket_cap_mb=BUCKET_MB)
    first, second, _ = thirds(model)
    opt.init_params(first)
    opt.init_params_bucket(second)  # a bucket of its own, though `first`'s bucket has room
    opt.init_params()  # the rest, now
    index = {p: i for i, p in enumerate(model.parameters())}
    holders = [sorted(b.params) for b in opt.shard_buckets() if b.params & {index[p] for p in second}]
    assert holders == [sorted(index[p] for p in second)], holders
    return holders[0]


def test_init_params_bucket_gives_fresh_bucket():
    run_ranks(fresh_bucket, 2)


def misuse(rank: int, world_size: int) -> list[str]:
    model = make_model()
    errors = []
    for call in (
        lambda opt: opt.init_params([nn.Parameter(torch.zeros(3))]),
        lambda opt: opt.init_params(model[0].parameters(), grad_sync_dtype=torch.int8),
    ):
        try:
            call(DistributedFusedAdam(model.parameters()))
        except ValueError as exc:
            errors.append(str(exc))
    try:
        DistributedFusedAdam(model.parameters(), store_params=False).init_params(
            model[0].parameters(), param_sync_dtype=torch.bfloat16)
    except ValueError as exc:
        errors.append(str(exc))
    opt = DistributedFusedAdam(model.parameters())
    opt.init_params()
    try:
        opt.init_params(model[0].parameters())
    except RuntimeError as exc:
        errors.append(str(exc))
    return errors


def test_init_params_misuse_is_refused_clearly():
    errors = run_ranks(misuse, 2)[0]
    assert len(errors) == 4, errors
    assert "not a trainable param of this optimizer" in errors[0]
    assert "grad_sync_dtype must be" in errors[1]
    assert "store_params=False" in errors[2]
    assert "already built" in errors[3]


@pytest.mark.parametrize("world_size", [1, 2])
def test_padding_warning_says_what_to_change(world_size):
    def tiny_cap(rank, ws):
        model = nn.Sequential(*(nn.Linear(3, 3) for _ in range(8)))
        with pytest.warns(UserWarning) as record:
            DistributedFusedAdam(model.parameters(), bucket_cap_mb=1e-6).init_params()
        return str(record[0].message)

    message = run_ranks(tiny_cap, world_size)[0]
    assert "buckets of up to" in message and "<= 0 elements" not in message
    assert "fewer than 16 elements" in message or "raise bucket_cap_mb" in message
