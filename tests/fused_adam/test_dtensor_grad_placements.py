"""Gradients placed unlike their DTensor params are stepped as torch's optimizers step them, on 2 gloo ranks.

Tensor parallelism gives a ``Shard(0)`` param a ``Replicate`` gradient (torch 2.14: PyTorch's own
Transformer under its sequence-parallel plan, ``pos_embeddings.weight``), sequence parallelism gives
``Replicate`` norm weights ``Partial`` gradients; torch.optim steps each with the values of
``grad.redistribute(param's placements)``. So does FusedAdam:

- for every pair of placements below, every step is bit for bit FusedAdam's on the whole param given
  the whole gradient, and within fp32 rounding torch.optim.AdamW's on the same DTensors; ``grad_norm``
  is the whole gradient's norm; from the second step on the plan is used (no general step), and where
  a slice of the local gradient is enough (a ``Replicate`` gradient) the step does no DTensor dispatch;
- PyTorch's Transformer under ``Transformer.parallelize`` (torch.testing._internal), with and without
  sequence parallelism, trained by FusedAdam and by DistributedFusedAdam (tensor-parallel over the same
  ranks), follows torch.optim.Adam on the same model, step by step.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from distopt import DistributedFusedAdam, FusedAdam

import tolerances
from harness import run_ranks
from test_dtensor_steps import Ops

CASES = {  # (param placement, gradient placement, shape)
    "Shard(0) param, Replicate grad": (Shard(0), Replicate(), (8, 6)),
    "uneven Shard(0) param, Replicate grad": (Shard(0), Replicate(), (5, 6)),
    "Shard(1) param, Replicate grad": (Shard(1), Replicate(), (4, 6)),
    "Shard(0) param, Partial grad": (Shard(0), Partial(), (8, 6)),
    "Replicate param, Partial grad": (Replicate(), Partial(), (7,)),
    "Replicate param, Shard(0) grad": (Replicate(), Shard(0), (8, 6)),
    "Shard(0) param, Shard(1) grad": (Shard(0), Shard(1), (8, 6)),
}
STEPS = 4


def placed(full: torch.Tensor, mesh, placement, rank: int) -> DTensor:
    """`full` as a DTensor with `placement`; a Partial one holds it all on rank 0 and zeros elsewhere (an
    exact sum)."""
    if placement.is_partial():
        local = full.clone() if rank == 0 else torch.zeros_like(full)
        return DTensor.from_local(local, mesh, [placement], run_check=False)
    return distribute_tensor(full.clone(), mesh, [placement])


def like_torch(rank: int, world_size: int, case: str) -> list[str]:
    param_placement, grad_placement, shape = CASES[case]
    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    start = torch.randn(shape)
    ours = nn.Parameter(distribute_tensor(start.clone(), mesh, [param_placement]))
    theirs = nn.Parameter(distribute_tensor(start.clone(), mesh, [param_placement]))
    whole = nn.Parameter(start.clone())
    opt, ref = FusedAdam([ours], lr=1e-2), torch.optim.AdamW([theirs], lr=1e-2, foreach=False)
    whole_opt = FusedAdam([whole], lr=1e-2)
    general = []
    opt._step_group = lambda *a, _f=opt._step_group: (general.append(1), _f(*a))[1]
    problems = []
    for step in range(STEPS):
        grad = torch.randn(shape, generator=torch.Generator().manual_seed(step))
        ours.grad, theirs.grad, whole.grad = placed(grad, mesh, grad_placement, rank), \
            placed(grad, mesh, grad_placement, rank), grad.clone()
        try:  # (the whole gradient's norm, summed in another order)
            tolerances.assert_close(opt.grad_norm(), torch.linalg.vector_norm(grad), tolerances.KERNEL)
        except AssertionError as e:
            problems.append(f"step {step}: grad_norm: {e}")
        with Ops() as seen:
            opt.step()
        ref.step()
        whole_opt.step()
        if tuple(ours.grad.placements) != (grad_placement,):
            problems.append(f"step {step}: the gradient was changed")
        if step > 0 and grad_placement.is_replicate() and seen.dtensor_ops:
            problems.append(f"step {step}: DTensor ops {seen.dtensor_ops}")
        full = ours.full_tensor()
        if not torch.equal(full, whole.detach()):
            problems.append(f"step {step}: not bit for bit the whole param's update")
        try:
            tolerances.assert_close(full, theirs.full_tensor(), tolerances.OPTIMIZER)
        except AssertionError as e:
            problems.append(f"step {step}: unlike torch.optim.Adam: {e}")
    if len(general) != 1:
        problems.append(f"{len(general)} general steps (the plan should take steps 2 to {STEPS})")
    return problems


@pytest.mark.parametrize("case", list(CASES))
def test_gradient_placed_unlike_its_param_steps_as_torch(case):
    assert run_ranks(like_torch, world_size=2, args=(case,)) == [[], []]


def transformer_like_torch(rank: int, world_size: int, sequence_parallel: bool, kind: str) -> list[str]:
    from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer

    args = ModelArgs(n_layers=2, vocab_size=32, max_seq_len=16, dim=16, n_heads=4, dropout_p=0.0,
                     weight_tying=False)
    mesh = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("dp", "tp"))
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(Transformer.parallelize(Transformer(args), mesh["tp"], use_seq_parallel=sequence_parallel,
                                              local_output_for_attn=True))  # (CPU attention runs on local tensors)
    model, ref_model = models
    if kind == "FusedAdam":
        opt = FusedAdam(model.parameters(), lr=1e-2, weight_decay=0.0)
    else:
        opt = DistributedFusedAdam(model.parameters(), lr=1e-2, weight_decay=0.0, process_group=mesh["dp"].get_group())
    ref = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    problems, mismatched = [], set()
    for step in range(4):
        tokens = torch.randint(0, args.vocab_size, (4, 16), generator=torch.Generator().manual_seed(step))
        for m, o in ((model, opt), (ref_model, ref)):
            m(tokens).float().square().mean().backward()
            if m is ref_model:
                mismatched |= {n for n, p in m.named_parameters() if isinstance(p, DTensor)
                               and tuple(p.grad.placements) != tuple(p.placements)}
            o.step()
            o.zero_grad()
        for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
            a, b = (t.full_tensor() if isinstance(t, DTensor) else t for t in (p, q))
            try:
                tolerances.assert_close(a, b, tolerances.OPTIMIZER)
            except AssertionError as e:
                problems.append(f"step {step} {name}: {e}")
    if sequence_parallel and "pos_embeddings.weight" not in mismatched:
        problems.append(f"torch no longer places pos_embeddings' gradient unlike the param: {sorted(mismatched)}")
    return problems


@pytest.mark.parametrize("kind", ["FusedAdam", "DistributedFusedAdam"])
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_pytorch_transformer_parallelize_plan_steps_as_torch_adam(sequence_parallel, kind):
    assert run_ranks(transformer_like_torch, world_size=2, args=(sequence_parallel, kind)) == [[], []]


def with_first_rows(rank: int, world_size: int, case: str) -> list[str]:
    """Negative control: a conversion that gives every rank the gradient's first rows (rank 0's)."""
    from distopt import dtensor

    def first_rows(self, grad):
        return grad._local_tensor[: self.shard.shape[0]]

    dtensor.GradConversion.__call__ = first_rows
    return like_torch(rank, world_size, case)


def test_negative_control_a_wrong_slice_is_caught():
    results = run_ranks(with_first_rows, world_size=2, args=("Shard(0) param, Replicate grad",))
    assert all(any("bit for bit" in p for p in r) for r in results), results  # (the full param is wrong on both)
