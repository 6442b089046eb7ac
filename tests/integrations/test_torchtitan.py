"""distopt.integrations.torchtitan: torchtitan's optimizer container building FusedAdam around an FSDP2 model,
against torchtitan's own container building torch AdamW, step by step on 2 gloo ranks (one launch, shared).

torchtitan's Trainer does not run here: it picks CUDA when no accelerator is found and needs a tokenizer and
datasets. What its train step does around the optimizer runs as it does there: the container built from its
Config (two param groups by FQN pattern, one optimizer), ``LRSchedulersContainer`` (warmup, linear decay),
torchtitan's ``clip_grad_norm_`` on the FSDP2 DTensor grads (every step clips: asserted), ``zero_grad`` and
``step``. Its ``CheckpointManager`` saves every SAVE_AT steps through ``torch.distributed.checkpoint`` (the
optimizer state FQN-keyed and flat, from ``optim.state_dict()`` and the groups' ``param_names``); a fresh
model and container (another init) loaded at step SAVE_AT continue bit for bit as the uninterrupted run.
The checkpoint path of torchtitan 0.2 and earlier (``get_optimizer_state_dict`` / ``set_optimizer_state_dict``
with ``flatten_optimizer_state_dict=True``, and DCP) resumes bit for bit too.
Negative controls: AdamW with a 1% larger lr, and a resume that leaves the optimizer state out, are told apart.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

pytest.importorskip("torchtitan")

import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.state_dict import (  # noqa: E402
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor  # noqa: E402
from torchtitan.components.checkpoint import CheckpointManager  # noqa: E402
from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer, ParamGroupConfig  # noqa: E402
from torchtitan.distributed import utils as dist_utils  # noqa: E402

from distopt.integrations.torchtitan import DistoptOptimizersContainer  # noqa: E402

import tolerances  # noqa: E402
from dtensor_models import batch, fsdp  # noqa: E402
from harness import run_ranks  # noqa: E402

STEPS, SAVE_AT, CLIP, LR = 6, 3, 0.05, 1e-2
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)  # what torchtitan <= 0.2's container passes


def container(name: str, model: nn.Module, lr: float = LR) -> OptimizersContainer:
    """torchtitan's Config: biases in one group, the rest in another (one optimizer for both)."""
    cls = DistoptOptimizersContainer if name == "FusedAdam" else OptimizersContainer
    common = dict(betas=(0.9, 0.95), eps=1e-8)
    return cls.Config(param_groups=[
        ParamGroupConfig(pattern=r"bias$", optimizer_name=name, optimizer_kwargs=dict(lr=lr / 3, weight_decay=0.0,
                                                                                      **common)),
        ParamGroupConfig(pattern=r".*", optimizer_name=name, optimizer_kwargs=dict(lr=lr, weight_decay=0.1, **common)),
    ]).build(model_parts=[model])


class Run:
    """An FSDP2 model with torchtitan's optimizer and LR scheduler containers and checkpoint manager."""

    def __init__(self, name: str, rank: int, world_size: int, folder: str, seed: int = 0, lr: float = LR,
                 **checkpoint) -> None:
        self.model, self.index = fsdp(seed, rank, world_size)
        self.optimizers = container(name, self.model, lr)
        self.schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=self.optimizers,
                                                                             training_steps=STEPS)
        self.checkpointer = CheckpointManager(
            CheckpointManager.Config(enable=True, folder="checkpoint", interval=SAVE_AT, keep_latest_k=0,
                                     **checkpoint),
            dataloader=None, model_parts=[self.model], optimizers=self.optimizers, lr_schedulers=self.schedulers,
            states={}, sd_adapter=None, base_folder=folder)
        self.params: dict[int, list[torch.Tensor]] = {}
        self.norms: list[float] = []

    def train(self, start: int, end: int, flat_at: str | None = None) -> dict:
        """torchtitan's train step for steps start..end; `flat_at`: save the torchtitan 0.2 way at SAVE_AT."""
        for step in range(start, end + 1):
            self.optimizers.zero_grad()
            x, y = batch(step, self.index)
            nn.functional.mse_loss(self.model(x), y).backward()
            self.norms.append(dist_utils.clip_grad_norm_(list(self.model.parameters()), CLIP, foreach=True).item())
            self.optimizers.step()
            self.schedulers.step()
            self.checkpointer.save(step)
            if flat_at is not None and step == SAVE_AT:
                dcp.save(self.flat_state(), checkpoint_id=flat_at)
            self.params[step] = [p.full_tensor() for p in self.model.parameters()]
        self.checkpointer.close()
        opt = self.optimizers.optimizers[0]
        return {"params": self.params, "norms": self.norms, "optimizers": [type(o).__name__ for o in self.optimizers],
                "state": [t.full_tensor() if isinstance(t, DTensor) else t
                          for p in self.model.parameters() for _, t in sorted(opt.state[p].items())]}

    def flat_state(self) -> dict:
        opt = self.optimizers.optimizers[0]
        return {"model": get_model_state_dict(self.model), "lr": self.schedulers.state_dict(),
                "optimizer": get_optimizer_state_dict(self.model, opt, options=FLAT)}

    def load_flat(self, path: str) -> None:
        """torchtitan 0.2's load: DCP into the live state dicts, then set_*_state_dict."""
        state = self.flat_state()
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(self.model, state["model"])
        set_optimizer_state_dict(self.model, self.optimizers.optimizers[0], state["optimizer"], options=FLAT)
        self.schedulers.load_state_dict(state["lr"])


def _runs(rank: int, world_size: int, tmp: str) -> dict:
    runs = {"ref": Run("AdamW", rank, world_size, f"{tmp}/ref").train(1, STEPS),
            "other_lr": Run("AdamW", rank, world_size, f"{tmp}/other", lr=LR * 1.01).train(1, STEPS),
            "fused": Run("FusedAdam", rank, world_size, f"{tmp}/fused").train(1, STEPS, flat_at=f"{tmp}/flat")}
    for name, kw in (("resumed", {}), ("model_only", {"exclude_from_loading": ["optimizer"]})):
        run = Run("FusedAdam", rank, world_size, f"{tmp}/fused", seed=7, **kw)
        assert run.checkpointer.load(step=SAVE_AT)
        runs[name] = run.train(SAVE_AT + 1, STEPS)
    run = Run("FusedAdam", rank, world_size, f"{tmp}/flat_resumed", seed=7)
    run.load_flat(f"{tmp}/flat")
    runs["flat_resumed"] = run.train(SAVE_AT + 1, STEPS)
    runs["saved_keys"] = sorted(dcp.FileSystemReader(f"{tmp}/fused/checkpoint/step-{SAVE_AT}")
                                .read_metadata().state_dict_metadata)
    return runs


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict]:
    return run_ranks(_runs, 2, (str(tmp_path_factory.mktemp("torchtitan")),), timeout=300)


def assert_steps_match(run: dict, ref: dict, steps) -> None:
    for step in steps:
        for a, b in zip(run["params"][step], ref["params"][step], strict=True):
            tolerances.assert_close(a, b, tolerances.DISTRIBUTED, msg=lambda m, step=step: f"step {step}: {m}")


def test_container_builds_fused_adam_and_matches_adamw(runs: list[dict]) -> None:
    for rank_runs in runs:
        ref, fused = rank_runs["ref"], rank_runs["fused"]
        assert (ref["optimizers"], fused["optimizers"]) == (["AdamW"], ["FusedAdam"])
        assert min(ref["norms"]) > 2 * CLIP, ref["norms"]  # every step clips
        assert fused["norms"] == pytest.approx(ref["norms"], rel=1e-5)
        assert_steps_match(fused, ref, range(1, STEPS + 1))


def test_negative_control_other_lr_is_caught(runs: list[dict]) -> None:
    with pytest.raises(AssertionError):
        assert_steps_match(runs[0]["fused"], runs[0]["other_lr"], range(1, STEPS + 1))


@pytest.mark.parametrize("name", ["resumed", "flat_resumed"])
def test_checkpoint_resumes_bit_exact(runs: list[dict], name: str) -> None:
    """CheckpointManager (torchtitan 0.3) or get/set_optimizer_state_dict + DCP (torchtitan <= 0.2): every
    step after the load, and the final optimizer state, are the uninterrupted run's, bit for bit."""
    keys = runs[0]["saved_keys"]
    assert "optimizer.state.0.weight.exp_avg_sq" in keys and "optimizer.param_groups.0.bias.lr" in keys, keys
    for rank_runs in runs:
        whole, resumed = rank_runs["fused"], rank_runs[name]
        assert sorted(resumed["params"]) == list(range(SAVE_AT + 1, STEPS + 1))
        for step in resumed["params"]:
            assert all(map(torch.equal, resumed["params"][step], whole["params"][step])), f"step {step}"
        assert all(map(torch.equal, resumed["state"], whole["state"]))


def test_negative_control_resume_without_optimizer_state_is_caught(runs: list[dict]) -> None:
    whole, model_only = runs[0]["fused"], runs[0]["model_only"]
    assert not all(map(torch.equal, model_only["params"][STEPS], whole["params"][STEPS]))


def test_bf16_states_implementation_is_refused() -> None:
    """torchtitan makes bf16 moments for torch's Adam/AdamW only: FusedAdam would silently keep fp32 ones."""
    config = DistoptOptimizersContainer.Config(implementation="fused_opt_states_bf16", param_groups=[
        ParamGroupConfig(pattern=".*", optimizer_name="FusedAdam", optimizer_kwargs={"lr": LR})])
    with pytest.raises(ValueError, match="fused_opt_states_bf16"):
        config.build(model_parts=[nn.Linear(2, 2)])


def test_importing_distopt_does_not_import_torchtitan() -> None:
    code = ("import sys, distopt, distopt.integrations; "
            "assert 'torchtitan' not in sys.modules, 'torchtitan imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
