"""8-bit moments on FSDP2's uneven dim-0 shards (``torch.chunk``'s split, the last shard shorter or
empty), at 2, 3 and 4 gloo ranks.

A layout is served when every rank's non-empty shard starts at a multiple of 256 elements of the param
(the rows of a full shard times the elements per row is a multiple of 256): the update is then bit for
bit FusedAdam's on the unsharded model, state dicts load both ways, and torch.distributed.checkpoint
reshards the state between world sizes whose layouts are served, because the absmax is laid out by
the param's rows (``moment_formats.absmax_shape``) and shards as the param does. A layout that is not
served is refused at construction, on every rank, with the rule and the param's numbers.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard

from distopt import FusedAdam
from distopt.moment_formats import absmax_shape, num_blocks

from harness import run_ranks
from test_dtensor_lowprec import full, same_state

EIGHT_BIT = dict(exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8)
# Served at 2, 3 and 4 ranks, all uneven: (33, 512) is the (out, in) weight of nn.Linear(512, 33): shards of
# [17, 16], [11, 11, 11], [9, 9, 9, 6] rows; (95, 96): [48, 47], [32, 32, 31], [24, 24, 24, 23] rows of 96.
SHAPES = [(33, 512), (95, 96)]
# Served at 2 ranks (64 + 63 rows of 300), where its absmax (2 rows of 75) ends with one zero past its 149
# blocks; refused at 3 (43 x 300 = 12,900 elements before the second shard).
PADDED = (127, 300)


class Params(nn.Module):
    """Params of the given shapes and a loss that makes each one's gradient depend on all its elements."""

    def __init__(self, shapes: list[tuple[int, ...]]) -> None:
        super().__init__()
        self.ps = nn.ParameterList(nn.Parameter(torch.randn(s)) for s in shapes)

    def forward(self, ws: list[torch.Tensor]) -> torch.Tensor:
        return sum((p.tanh() * w).sum() + p.square().mean() for p, w in zip(self.ps, ws))


def step_like_unsharded(rank: int, world_size: int, shapes: list, options: dict) -> list[str]:
    torch.manual_seed(0)
    model, whole = Params(shapes), Params(shapes)
    whole.load_state_dict(model.state_dict())
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    torch.manual_seed(5)
    opt = FusedAdam(model.parameters(), lr=1e-2, **options)
    torch.manual_seed(5)
    whole_opt = FusedAdam(whole.parameters(), lr=1e-2, **options)
    differ = []
    for step in range(3):
        gen = torch.Generator().manual_seed(step)
        model([torch.randn(s, generator=gen) for s in shapes]).backward()
        for p, q in zip(model.parameters(), whole.parameters()):
            q.grad = p.grad.full_tensor()
        opt.step()
        whole_opt.step()
        for i, (p, q) in enumerate(zip(model.parameters(), whole.parameters())):
            pairs = [("param", p, q)] + [(k, v, whole_opt.state[q][k]) for k, v in opt.state[p].items() if k != "step"]
            differ += [f"step {step} param {i} {k}" for k, a, b in pairs if not same_state(k, a, b)]
            if step == 0 and options.get("exp_avg_dtype") == torch.uint8:
                absmax = opt.state[p]["exp_avg_absmax"]
                if tuple(absmax.shape) != absmax_shape(p.shape) or tuple(absmax.placements) != (Shard(0),):
                    differ.append(f"param {i}: absmax {tuple(absmax.shape)} {absmax.placements}")
        opt.zero_grad()
        whole_opt.zero_grad()
    # State dicts both ways: the sharded optimizer's own, and the unsharded one's whole tensors.
    for source, label in ((opt, "own"), (whole_opt, "unsharded")):
        loaded = FusedAdam(model.parameters(), lr=1e-2, **options)
        loaded.load_state_dict(source.state_dict())
        for i, p in enumerate(model.parameters()):
            differ += [f"{label} state dict: param {i} {k}" for k, v in opt.state[p].items()
                       if not torch.equal(full(loaded.state[p][k]), full(v))]
    # And the sharded state into the unsharded optimizer (gathered whole tensors, absmax in rows).
    gathered = {**opt.state_dict()}
    gathered["state"] = {k: {n: full(v) for n, v in e.items()} for k, e in gathered["state"].items()}
    back = FusedAdam(whole.parameters(), lr=1e-2, **options)
    back.load_state_dict(gathered)
    for i, q in enumerate(whole.parameters()):
        differ += [f"into unsharded: param {i} {k}" for k, v in whole_opt.state[q].items()
                   if not torch.equal(back.state[q][k], v)]
    return differ


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_uneven_shards_step_bitwise_the_unsharded(world_size):
    results = run_ranks(step_like_unsharded, world_size=world_size, args=(SHAPES, EIGHT_BIT))
    assert results == [[]] * world_size, results


@pytest.mark.parametrize("world_size", [1, 2])
def test_padded_absmax_rows(world_size):
    """(127, 300): the last absmax row covers fewer param rows than it could; one 8-bit moment and one
    bf16 with stochastic rounding (which counts rounding keys from the shard's first element too)."""
    options = dict(exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.bfloat16, stochastic_rounding=True)
    results = run_ranks(step_like_unsharded, world_size=world_size, args=([PADDED, (33, 512)], options))
    assert results == [[]] * world_size, results


def refused(rank: int, world_size: int) -> str:
    torch.manual_seed(0)
    model = Params([(33, 512), PADDED])
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    try:
        FusedAdam(model.parameters(), **EIGHT_BIT)
    except ValueError as e:
        return str(e)
    return "accepted"


def test_unserved_layout_names_the_rule_and_the_numbers():
    messages = run_ranks(refused, world_size=3)
    assert len(set(messages)) == 1, messages  # every rank raises the same error
    message = messages[0]
    assert "param_groups[0]['params'][1]" in message and "(127, 300)" in message, message
    assert "ceil(rows / ranks) = 43" in message and "[43, 43, 41] rows of 300" in message, message
    assert "12900 is not a multiple of 256" in message, message


def dcp_save(rank: int, world_size: int, path: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    torch.manual_seed(0)
    model = Params(SHAPES)
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    opt = FusedAdam(model.parameters(), lr=1e-2, **EIGHT_BIT)
    for step in range(2):
        gen = torch.Generator().manual_seed(step)
        model([torch.randn(s, generator=gen) for s in SHAPES]).backward()
        opt.step()
        opt.zero_grad()
    dcp.save({"optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=path)
    return [{k: full(v) for k, v in opt.state[p].items()} for p in model.parameters()]


def dcp_load(rank: int, world_size: int, path: str) -> list:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    torch.manual_seed(0)
    model = Params(SHAPES)
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    opt = FusedAdam(model.parameters(), lr=1e-2, **EIGHT_BIT)
    target = {"optim": get_optimizer_state_dict(model, opt)}
    dcp.load(target, checkpoint_id=path)
    set_optimizer_state_dict(model, opt, target["optim"])
    return [{k: full(v) for k, v in opt.state[p].items()} for p in model.parameters()]


def test_dcp_reshards_uneven_8bit_state_bit_for_bit(tmp_path):
    """Saved on 3 ranks (shards of 11 and 32 rows), loaded on 2, 4 and 1: every code and scale as saved."""
    saved = run_ranks(dcp_save, world_size=3, args=(str(tmp_path),))[0]
    for world_size in (2, 4, 1):
        loaded = run_ranks(dcp_load, world_size=world_size, args=(str(tmp_path),))[0]
        for i, (a, b) in enumerate(zip(saved, loaded)):
            assert a.keys() == b.keys() and "exp_avg_absmax" in a, (world_size, i)
            for k in a:
                assert torch.equal(a[k], b[k]), (world_size, i, k)


VOCAB = (50257, 768)


def vocab_embedding(rank: int, world_size: int) -> list[str]:
    """nn.Embedding(50257, 768) (GPT-2's token embedding) on 8 ranks: shards of 6,283 rows (the last 6,276),
    each starting at a multiple of 256 elements. Every rank checks its rows, codes and blocks against the
    unsharded update of the whole embedding (the same gradient on every rank: no reduction involved)."""
    torch.manual_seed(0)
    whole = nn.Embedding(*VOCAB)
    model = nn.Embedding(*VOCAB)
    model.load_state_dict(whole.state_dict())
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    p, q = model.weight, whole.weight
    opt, whole_opt = FusedAdam([p], lr=1e-2, **EIGHT_BIT), FusedAdam([q], lr=1e-2, **EIGHT_BIT)
    rows = p.to_local().shape[0]
    first = rank * -(-VOCAB[0] // world_size)
    differ = []
    for step in range(2):
        q.grad = torch.randn(VOCAB, generator=torch.Generator().manual_seed(step))
        p.grad = DTensor.from_local(q.grad[first : first + rows].clone(), p.device_mesh, p.placements,
                                    shape=p.shape, stride=p.stride(), run_check=False)
        opt.step()
        whole_opt.step()
        local, ref = opt.state[p], whole_opt.state[q]
        block, blocks = first * VOCAB[1] // 256, num_blocks(rows * VOCAB[1])
        pairs = [("param", p.to_local(), q.detach()[first : first + rows])]
        pairs += [(k, local[k].to_local(), ref[k][first : first + rows]) for k in ("exp_avg", "exp_avg_sq")]
        pairs += [(k, local[k].to_local().reshape(-1)[:blocks], ref[k][block : block + blocks])
                  for k in ("exp_avg_absmax", "exp_avg_sq_absmax")]
        differ += [f"rank {rank} step {step} {k}" for k, a, b in pairs if not torch.equal(a, b)]
    return differ


@pytest.mark.slow
def test_large_vocabulary_embedding_on_8_ranks():
    results = run_ranks(vocab_embedding, world_size=8, timeout=600)
    assert results == [[]] * 8, results
