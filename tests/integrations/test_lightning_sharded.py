"""FusedAdam under Lightning's sharded strategies, against torch.optim.AdamW under the same strategy, step by
step, on 2 gloo ranks in forked processes (one launch, shared by the tests).

``ModelParallelStrategy`` (FSDP2 and tensor parallelism, params as DTensors) runs on the CPU with gloo as
Lightning ships it; ``configure_optimizers`` returns FusedAdam unchanged. FSDP2 (``data_parallel_size=2``:
each rank its batches) and tensor parallelism (``tensor_parallel_size=2``: both ranks the same batches),
clipping every step (checked on the reference's norms) through Lightning's own ``clip_grad_norm_`` on the
DTensor grads, accumulating 2 batches; under ``bf16-mixed`` clipping through the DistoptGradientClipping
mixin, whose ``opt.clip_grad_norm`` counts each shard once. ``trainer.save_checkpoint`` (a DCP folder, and
a full file) then ``fit(ckpt_path=...)`` continue bit for bit as the uninterrupted run, params and
optimizer state. Negative control: AdamW with a 1% larger lr is told apart.

``FSDPStrategy`` (FSDP1) refuses a CPU accelerator, and FSDP1 itself wraps a CPU module only when given
``device_id=cpu``, which Lightning does not pass: here a subclass skips the accelerator check (Lightning
checks ``type(strategy) is FSDPStrategy``) and ``configure_model`` wraps the model itself with
``device_id=cpu`` (Lightning keeps a model the user wrapped). FusedAdam steps FSDP1's flat shards, plain
tensors (one flat param, or with ``use_orig_params`` views of it, empty on some ranks), like AdamW, with
clipping by value. Lightning refuses norm clipping under FSDP1 (a norm of the flat shards is this rank's
alone); the mixin leaves that refusal in place rather than clipping each rank by its own norm.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from torch import nn

pytest.importorskip("lightning")

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy  # noqa: E402
from lightning.pytorch.utilities.exceptions import MisconfigurationException  # noqa: E402
from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module  # noqa: E402

from distopt import FusedAdam  # noqa: E402
from distopt.integrations.lightning import DistoptGradientClipping  # noqa: E402

from harness import run_ranks  # noqa: E402
from test_lightning import BATCH, CLIP, LR, SAMPLES, WD, assert_matches, lightning_env  # noqa: E402

VALUE_CLIP = 0.01  # FSDP1 clips by value; smaller than the reference's largest gradient element (asserted)


def adamw(params, lr: float = LR):
    return torch.optim.AdamW(params, lr=lr, weight_decay=WD)


def fused(params):
    return FusedAdam(params, lr=LR, weight_decay=WD)


class CPUFSDPStrategy(FSDPStrategy):
    """Lightning's FSDPStrategy, unchanged: a subclass only to pass Lightning's GPU-accelerator check."""


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


class Net(pl.LightningModule):
    """`layout`: "fsdp2" (fully_shard per layer and root over the data-parallel mesh), "tp" (Colwise and
    Rowwise layers over the tensor-parallel mesh), "fsdp1" / "fsdp1_flat" (FSDP1 with and without
    use_orig_params)."""

    def __init__(self, make_opt, layout: str, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        self.make_opt, self.layout = make_opt, layout

    def configure_model(self) -> None:
        if self.layout == "fsdp2":
            for module in (self.net[0], self.net[2], self.net):
                fully_shard(module, mesh=self.device_mesh["data_parallel"])
        elif self.layout == "tp":
            parallelize_module(self.net, self.device_mesh["tensor_parallel"], {"0": ColwiseParallel(),
                                                                               "2": RowwiseParallel()})
        else:
            self.net = FullyShardedDataParallel(self.net, device_id=torch.device("cpu"),
                                                use_orig_params=self.layout == "fsdp1")

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x).float(), y)

    def configure_optimizers(self):
        return self.make_opt(self.parameters())


class ClippingNet(DistoptGradientClipping, Net):
    pass


class Recorder(pl.Callback):
    """The whole params after every optimizer step (gathered: a collective on every rank), the reference's
    pre-clip grad norms and largest grad elements, and at the end the optimizer's state, gathered."""

    def __init__(self) -> None:
        self.params: dict[int, list[torch.Tensor]] = {}
        self.norms: list[float] = []
        self.largest: list[float] = []
        self.state: list[torch.Tensor] = []

    def _whole(self, module) -> list[torch.Tensor]:
        if isinstance(module.net, FullyShardedDataParallel):
            with FullyShardedDataParallel.summon_full_params(module.net):
                return [p.detach().clone() for p in module.net.parameters()]
        return [full(p) for p in module.parameters()]

    def on_before_optimizer_step(self, trainer, module, optimizer) -> None:
        grads = [p.grad for p in module.parameters() if p.grad is not None]
        self.norms.append(full(torch.nn.utils.get_total_norm(grads)).item())
        self.largest.append(max(full(g).abs().max().item() for g in grads if g.numel()))

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if batch_idx % 2 == 1:  # accumulate_grad_batches=2: an optimizer step ran
            self.params[trainer.global_step] = self._whole(module)

    def on_train_end(self, trainer, module) -> None:
        opt = trainer.optimizers[0]
        self.state = [full(opt.state[p][k]) for p in module.parameters() for k in sorted(opt.state[p])]


def fit(layout: str, make_opt, *, strategy=None, precision: str = "32-true", epochs: int = 1, seed: int = 0,
        clip: float = CLIP, algorithm: str = "norm", mixin: bool = False, ckpt_in: str | None = None,
        ckpt_out: str | None = None) -> dict:
    """One Trainer.fit; returns the params after every optimizer step and what the Recorder saw."""
    if strategy is None:
        strategy = {"fsdp2": ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
                    "tp": ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2)}.get(layout)
    strategy = strategy or CPUFSDPStrategy()
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(SAMPLES, 8, generator=g), torch.randn(SAMPLES, 4, generator=g))
    recorder = Recorder()
    trainer = pl.Trainer(accelerator="cpu", devices=2, num_nodes=1, strategy=strategy, precision=precision,
                         max_epochs=epochs, gradient_clip_val=clip, gradient_clip_algorithm=algorithm,
                         accumulate_grad_batches=2, callbacks=[recorder], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(FSDP|fully_shard|experimental|deprecated).*")
        trainer.fit((ClippingNet if mixin else Net)(make_opt, layout, seed),
                    torch.utils.data.DataLoader(data, batch_size=BATCH), ckpt_path=ckpt_in)
        if ckpt_out is not None:
            trainer.save_checkpoint(ckpt_out)  # a collective: every rank
    return {"params": recorder.params, "norms": recorder.norms, "largest": recorder.largest,
            "state": recorder.state, "optimizer": type(trainer.optimizers[0]).__name__,
            "param_types": sorted({type(p).__name__ for p in trainer.lightning_module.parameters()})}


def _runs(rank: int, world_size: int, tmp: str) -> dict:
    lightning_env(rank, world_size)
    runs = {}
    for layout in ("fsdp2", "tp"):
        runs[layout] = {"ref": fit(layout, adamw), "run": fit(layout, fused)}
    runs["bf16"] = {"ref": fit("fsdp2", adamw, precision="bf16-mixed"),
                    "run": fit("fsdp2", fused, precision="bf16-mixed", mixin=True)}
    runs["other_lr"] = fit("fsdp2", lambda params: adamw(params, LR * 1.01))
    for layout in ("fsdp1", "fsdp1_flat"):
        value = dict(clip=VALUE_CLIP, algorithm="value")
        runs[layout] = {"ref": fit(layout, adamw, **value), "run": fit(layout, fused, mixin=True, **value)}
    # Checkpoints: 2 epochs uninterrupted; 1 epoch saved (a DCP folder; a full file), resumed from another init.
    runs["whole"] = fit("fsdp2", fused, epochs=2)
    for name, distributed in (("dcp", True), ("file", False)):
        path = f"{tmp}/{name}.ckpt"
        kw = dict(data_parallel_size=2, tensor_parallel_size=1, save_distributed_checkpoint=distributed)
        fit("fsdp2", fused, strategy=ModelParallelStrategy(**kw), ckpt_out=path)
        runs[name] = fit("fsdp2", fused, strategy=ModelParallelStrategy(**kw), epochs=2, seed=7, ckpt_in=path)
        runs[name]["saved_as"] = "folder" if os.path.isdir(path) else "file"
    try:
        fit("fsdp1", fused, mixin=True)
    except MisconfigurationException as exc:
        runs["fsdp1_norm"] = str(exc)
    return runs


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict]:
    return run_ranks(_runs, 2, (str(tmp_path_factory.mktemp("lightning_sharded")),), timeout=300)


@pytest.mark.parametrize("layout", ["fsdp2", "tp"])
def test_model_parallel_matches_adamw(runs: list[dict], layout: str) -> None:
    """ModelParallelStrategy + FusedAdam as is, against AdamW: clipping every step, accumulation."""
    for rank_runs in runs:
        ref, run = rank_runs[layout]["ref"], rank_runs[layout]["run"]
        assert run["optimizer"] == "FusedAdam" and run["param_types"] == ["DTensor"]
        assert min(ref["norms"]) > 2 * CLIP, ref["norms"]  # every step clips
        assert list(ref["params"]) == list(range(1, len(ref["params"]) + 1)) and len(ref["params"]) >= 4
        assert_matches(run, ref)
    rank0, rank1 = (r[layout]["run"]["params"] for r in runs)
    assert all(map(torch.equal, rank0[4], rank1[4]))  # the ranks hold the same model


def test_model_parallel_bf16_mixin_clips_dtensors(runs: list[dict]) -> None:
    """bf16-mixed: Lightning refuses clipping for FusedAdam (it unscales in step()); the mixin clips through
    opt.clip_grad_norm, whose norm over the DTensor shards is the whole model's."""
    for rank_runs in runs:
        ref, run = rank_runs["bf16"]["ref"], rank_runs["bf16"]["run"]
        assert min(ref["norms"]) > 2 * CLIP, ref["norms"]
        assert_matches(run, ref, "bf16-mixed")


def test_negative_control_other_lr_is_caught(runs: list[dict]) -> None:
    for rank_runs in runs:
        with pytest.raises(AssertionError):
            assert_matches(rank_runs["fsdp2"]["run"], rank_runs["other_lr"])


@pytest.mark.parametrize("name", ["dcp", "file"])
def test_model_parallel_checkpoint_resumes_bit_exact(runs: list[dict], name: str) -> None:
    """save_checkpoint after epoch 1 (save_distributed_checkpoint=True: a DCP folder; False: one file), then
    fit(ckpt_path=...) from another init: every later step and the final optimizer state are the
    uninterrupted run's, bit for bit (the Adam moments and step counts came back: a fresh state would differ)."""
    for rank_runs in runs:
        whole, resumed = rank_runs["whole"], rank_runs[name]
        assert resumed["saved_as"] == {"dcp": "folder", "file": "file"}[name]
        steps = sorted(resumed["params"])
        assert steps == list(range(5, 9)) and sorted(whole["params"]) == list(range(1, 9))
        for step in steps:
            assert all(map(torch.equal, resumed["params"][step], whole["params"][step])), f"step {step}"
        assert len(resumed["state"]) == len(whole["state"]) > 0
        assert all(map(torch.equal, resumed["state"], whole["state"]))


@pytest.mark.parametrize("layout", ["fsdp1", "fsdp1_flat"])
def test_fsdp1_matches_adamw(runs: list[dict], layout: str) -> None:
    """FSDPStrategy: FusedAdam steps FSDP1's flat shards (plain tensors) as AdamW does, clipping by value."""
    for rank_runs in runs:
        ref, run = rank_runs[layout]["ref"], rank_runs[layout]["run"]
        assert run["optimizer"] == "FusedAdam" and run["param_types"] == ["Parameter"]
        assert min(ref["largest"]) > 2 * VALUE_CLIP, ref["largest"]  # every step clips some elements
        assert_matches(run, ref)


def test_fsdp1_norm_clipping_left_to_lightning(runs: list[dict]) -> None:
    """With the mixin, norm clipping under FSDP1 meets Lightning's refusal (as for any optimizer) instead of
    clipping each rank by the norm of its own flat shard."""
    for rank_runs in runs:
        assert "gradient_clip_algorithm='norm'` is currently not supported" in rank_runs["fsdp1_norm"]
