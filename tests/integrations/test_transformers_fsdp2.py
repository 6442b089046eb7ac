"""FusedAdam in the Hugging Face Trainer under FSDP2 (accelerate's ``fully_shard`` path), against the stock
Trainer with torch AdamW under the same FSDP2, step by step, on 2 gloo ranks (one launch, shared by the tests).

accelerate turns FSDP on only for accelerator devices: on the CPU a Trainer given ``fsdp_config`` silently
trains with DDP instead (its distributed type is MULTI_CPU). Here each forked rank lifts that one gate
(``fsdp_on_cpu``: the state accelerate would have built on a GPU, FSDP with the Trainer's plugin), so the
Trainer's real FSDP2 path runs on gloo: accelerate ``fully_shard``s the GPT-2 blocks and the model, swaps the
optimizer's plain params for the DTensors, clips with its DTensor-aware ``clip_grad_norm_``, and saves
and loads the sharded optimizer state through ``torch.distributed.checkpoint``.

- The stock Trainer with ``optimizer_cls_and_kwargs=(FusedAdam, {...})`` (it refuses ``optimizers=`` under
  FSDP) against ``optim="adamw_torch"``: params after every step, logged loss, grad_norm and lr.
- ``DistoptTrainer`` under FSDP2 builds FusedAdam (not DistributedFusedAdam: FSDP2 owns the data
  parallelism) and clips through ``opt.clip_grad_norm``, whose norm over the shards is the whole model's.
  A checkpoint at step SAVE_AT (SHARDED_STATE_DICT), resumed by a fresh Trainer, continues bit for bit.
  Under FSDP1 it refuses to build (its flat shards' norm is a rank's own). ``offload_optimizer``, which
  FusedAdam does not support on DTensors yet, is refused at the first step (the params it was built on
  were plain: accelerate swaps the DTensors in afterwards).
- Negative control: the reference without clipping is told apart.
Every run clips on every step (the reference's pre-clip norms, asserted) and accumulates 2 micro-batches.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

pytest.importorskip("transformers")

from accelerate.state import AcceleratorState, DistributedType, PartialState  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from transformers import Trainer, TrainingArguments  # noqa: E402

from distopt import FusedAdam  # noqa: E402
from distopt.integrations.transformers import DistoptTrainer  # noqa: E402

from harness import run_ranks  # noqa: E402
from test_transformers import (  # noqa: E402
    BATCH,
    CLIP,
    GA,
    LR,
    SAVE_AT,
    STEPS,
    WD,
    Recorder,
    assert_runs_match,
    free_port,
    make_data,
    make_model,
    torchrun_env,
)

FSDP2 = {"version": 2, "transformer_layer_cls_to_wrap": ["GPT2Block"], "state_dict_type": "SHARDED_STATE_DICT"}


def fsdp_on_cpu() -> None:
    """In this forked rank only: accelerate builds the FSDP state on the CPU as it does on a GPU, where it
    also records the distributed type in the process state (which every later AcceleratorState() re-reads)."""
    init = AcceleratorState.__init__

    def fsdp_init(self, *args, fsdp_plugin=None, **kwargs):
        init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type, self.fsdp_plugin = DistributedType.FSDP, fsdp_plugin
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP

    AcceleratorState.__init__ = fsdp_init


class WholeRecorder(Recorder):
    """The Recorder's params, gathered from their FSDP2 shards (a collective on every rank)."""

    def on_step_end(self, args, state, control, model=None, **kwargs) -> None:
        self.params[state.global_step] = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
                                          for k, v in model.state_dict().items()}


def train(out: str, trainer_cls: type = Trainer, *, resume: str | None = None, fsdp: dict = FSDP2,
          **overrides: Any) -> dict:
    args = dict(output_dir=out, use_cpu=True, ddp_backend="gloo", report_to=[], disable_tqdm=True, seed=0,
                per_device_train_batch_size=BATCH, gradient_accumulation_steps=GA, max_steps=STEPS, logging_steps=1,
                save_strategy="no", max_grad_norm=CLIP, optim="adamw_torch", learning_rate=LR, weight_decay=WD,
                lr_scheduler_type="linear", fsdp=True, fsdp_config=fsdp)
    kwargs = {k: overrides.pop(k) for k in ("optimizer_cls_and_kwargs", "distopt_kwargs") if k in overrides}
    args.update(overrides)
    recorder = WholeRecorder()
    trainer = trainer_cls(model=make_model(), args=TrainingArguments(**args), callbacks=[recorder],
                          train_dataset=make_data(int(os.environ["WORLD_SIZE"])), **kwargs)
    trainer.train(resume_from_checkpoint=resume)
    inner = trainer.optimizer.optimizer  # inside accelerate's wrapper
    return {"params": recorder.params, "logs": recorder.logs, "optimizer": type(inner).__name__,
            "wrapped": type(trainer.model_wrapped).__name__,
            "param_types": sorted({type(p).__name__ for g in inner.param_groups for p in g["params"]})}


def _runs(rank: int, world_size: int, port: int, tmp: str) -> dict:
    torchrun_env(rank, world_size, port)
    fsdp_on_cpu()
    fused = (FusedAdam, {"lr": LR, "betas": (0.9, 0.999), "eps": 1e-8})
    runs = {"ref": train(f"{tmp}/ref"), "unclipped": train(f"{tmp}/unclipped", max_grad_norm=0.0),
            "cls": train(f"{tmp}/cls", optimizer_cls_and_kwargs=fused)}
    common = dict(save_strategy="steps", save_steps=SAVE_AT)
    runs["distopt"] = train(f"{tmp}/distopt", DistoptTrainer, **common)
    runs["resumed"] = train(f"{tmp}/resumed", DistoptTrainer, resume=f"{tmp}/distopt/checkpoint-{SAVE_AT}", **common)
    runs["saved"] = sorted(os.listdir(f"{tmp}/distopt/checkpoint-{SAVE_AT}"))
    # FusedAdam was built on the plain params; the DTensors accelerate swapped in are checked at the first step.
    with pytest.raises(ValueError, match="offload_optimizer=True does not support DTensor params"):
        train(f"{tmp}/offload", DistoptTrainer, distopt_kwargs={"offload_optimizer": True})
    # accelerate builds no FSDP1 plugin without a GPU: an FSDP2 Trainer's plugin, switched to version 1.
    trainer = DistoptTrainer(model=make_model(), args=TrainingArguments(output_dir=f"{tmp}/fsdp1", use_cpu=True,
                                                                        fsdp=True, fsdp_config=FSDP2))
    trainer.accelerator.state.fsdp_plugin.fsdp_version = 1
    with pytest.raises(ValueError, match="not FSDP1"):
        trainer.create_optimizer()
    assert trainer.optimizer is None
    return runs


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict]:
    runs = run_ranks(_runs, 2, (free_port(), str(tmp_path_factory.mktemp("fsdp2"))), timeout=300)
    ref = runs[0]["ref"]
    assert ref["wrapped"].startswith("FSDP") and ref["param_types"] == ["DTensor"]  # FSDP2 ran, not DDP
    assert all(log["grad_norm"] > 2 * CLIP for log in ref["logs"].values())  # every step clips
    return runs


def test_stock_trainer_with_fused_adam_matches_adamw(runs: list[dict]) -> None:
    """optimizer_cls_and_kwargs=(FusedAdam, ...): accelerate swaps its plain params for the FSDP2 DTensors
    after it was built; it steps them as AdamW does (accelerate's clipping on the DTensor grads)."""
    cls = runs[0]["cls"]
    assert (cls["optimizer"], cls["param_types"]) == ("FusedAdam", ["DTensor"])
    assert_runs_match(cls, runs[0]["ref"], range(1, STEPS + 1))
    assert_runs_match(runs[1]["cls"], cls, range(1, STEPS + 1), exact=True)  # the ranks hold the same model


def test_distopt_trainer_builds_fused_adam_under_fsdp2(runs: list[dict]) -> None:
    """DistoptTrainer: FusedAdam over the DTensors, clipped and its grad_norm logged through the optimizer."""
    run = runs[0]["distopt"]
    assert (run["optimizer"], run["param_types"], run["wrapped"]) == ("FusedAdam", ["DTensor"],
                                                                       runs[0]["ref"]["wrapped"])
    assert_runs_match(run, runs[0]["ref"], range(1, STEPS + 1))


def test_distopt_trainer_checkpoint_resumes_bit_exact(runs: list[dict]) -> None:
    """The checkpoint holds the sharded optimizer state (DCP), and the resumed run continues bit for bit."""
    assert {"optimizer_0", "pytorch_model_fsdp_0"} <= set(runs[0]["saved"])
    for rank_runs in runs:
        whole, resumed = rank_runs["distopt"], rank_runs["resumed"]
        assert sorted(resumed["params"]) == list(range(SAVE_AT + 1, STEPS + 1))
        assert_runs_match(resumed, whole, range(SAVE_AT + 1, STEPS + 1), exact=True)


def test_negative_control_unclipped_run_is_caught(runs: list[dict]) -> None:
    with pytest.raises(AssertionError, match="not close"):
        assert_runs_match(runs[0]["unclipped"], runs[0]["ref"], range(1, STEPS + 1))
