"""distopt.integrations.transformers.DistoptTrainer against the stock transformers.Trainer.

Distributed runs use 2 gloo ranks in forked processes: each rank sets the variables torchrun would
(the harness's process group is already up, so the Trainer keeps it) and runs real ``Trainer.train()``
calls on a tiny GPT-2 built from a config and synthetic tokens. A callback records every param after
every optimizer step (through ``model.state_dict()``, which lands deferred all-gathers) and the
logged loss, grad_norm and learning rate. The reference is the stock Trainer: DDP + torch AdamW.
Every run clips on every step (the reference's pre-clip norms are all above CLIP, asserted) and
accumulates over 2 micro-batches. The Trainer supports fp16 only on GPUs (accelerate refuses it on
the CPU), so the CPU runs cover bf16 autocast, and the loss-scaling path is driven by a CPU
``torch.amp.GradScaler`` put into the accelerator, through the same code an fp16 run takes.
"""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from safetensors.torch import load_file  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from distopt import FusedAdam  # noqa: E402
from distopt.distributed import buffers  # noqa: E402
from distopt.distributed.atomic_replace import SaveFailed  # noqa: E402
from distopt.integrations.transformers import DistoptTrainer  # noqa: E402

import tolerances  # noqa: E402
from harness import run_ranks  # noqa: E402

STEPS, SAVE_AT, GA, BATCH = 4, 2, 2, 2
CLIP, LR, WD = 0.1, 1e-3, 0.05
OVERLAP = {"overlap_param_sync": True}  # the harder case: params are stale until the next forward


def make_model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0,
                        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config)


def make_data(world_size: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 64, (STEPS * GA * BATCH * world_size, 16), generator=g)
    return [{"input_ids": t, "labels": t} for t in tokens]


class Recorder(TrainerCallback):
    """Params after every optimizer step (all but the last with `skip_last`, which leaves any deferred
    all-gather to save_model), the logged metrics, and DistributedFusedAdam's reduce-scatters."""

    def __init__(self, skip_last: bool = False) -> None:
        self.skip_last = skip_last
        self.params: dict[int, dict[str, torch.Tensor]] = {}
        self.logs: dict[int, dict[str, float]] = {}
        self.reduce_scatters = 0

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs) -> None:
        comm = getattr(getattr(optimizer, "optimizer", None), "comm", None)  # inside accelerate's wrapper
        if comm is not None:
            comm.on_event = self._count

    def _count(self, name: str, bucket: int) -> None:
        self.reduce_scatters += name == "reduce_scatter_start"

    def on_step_end(self, args, state, control, model=None, **kwargs) -> None:
        if not (self.skip_last and state.global_step == state.max_steps):
            self.params[state.global_step] = {k: v.detach().clone() for k, v in model.state_dict().items()}

    def on_log(self, args, state, control, logs=None, **kwargs) -> None:
        if logs and "loss" in logs:
            self.logs[state.global_step] = {k: logs[k] for k in ("loss", "grad_norm", "learning_rate")}


class NormNet(torch.nn.Module):
    """A model with buffers (BatchNorm running statistics) in the Trainer's calling convention."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16, bias=False), torch.nn.BatchNorm1d(16), torch.nn.Tanh(),
                                       torch.nn.Linear(16, 4))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": torch.nn.functional.mse_loss(self.net(x), labels)}


def make_norm_data(world_size: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    n = STEPS * GA * NORM_BATCH * world_size
    return [{"x": x, "labels": y} for x, y in zip(torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g))]


NORM_BATCH = 8  # BatchNorm over 2 samples outputs about +-1 whatever its input


def train(out: str, trainer_cls: type = Trainer, *, resume: str | None = None, skip_last: bool = False,
          scaler: torch.amp.GradScaler | None = None, make_optimizers: Callable | None = None,
          norm: bool = False, **overrides: Any) -> dict[str, Any]:
    """One Trainer.train() (+ save_model); returns what the Recorder saw and what was saved."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    kwargs = {"distopt_kwargs": overrides.pop("distopt_kwargs")} if "distopt_kwargs" in overrides else {}
    args = dict(output_dir=out, use_cpu=True, ddp_backend="gloo", report_to=[], disable_tqdm=True, seed=0,
                per_device_train_batch_size=BATCH, gradient_accumulation_steps=GA, max_steps=STEPS,
                logging_steps=1, save_strategy="no", max_grad_norm=CLIP, optim="adamw_torch", learning_rate=LR,
                weight_decay=WD, lr_scheduler_type="linear")
    if norm:
        args.update(per_device_train_batch_size=NORM_BATCH)
    args.update(overrides)
    model = NormNet() if norm else make_model()
    recorder = Recorder(skip_last)
    data = make_norm_data(world_size) if norm else make_data(world_size)
    trainer = trainer_cls(model=model, args=TrainingArguments(**args), train_dataset=data,
                          callbacks=[recorder], optimizers=make_optimizers(model) if make_optimizers else (None, None),
                          **kwargs)
    if scaler is not None:
        trainer.accelerator.scaler = scaler  # what accelerate builds for fp16 on a GPU
    trainer.train(resume_from_checkpoint=resume)
    trainer.save_model(os.path.join(out, "final"))
    inner = trainer.distopt_optimizer() if isinstance(trainer, DistoptTrainer) else None
    saved = os.path.join(out, "final", "model.safetensors") if not norm else None
    return {"params": recorder.params, "logs": recorder.logs, "reduce_scatters": recorder.reduce_scatters,
            "wrapped": type(trainer.model_wrapped).__name__,
            "optimizer": type(inner).__name__,
            "host_bytes": inner.memory_report()["host"] if inner is not None else 0,
            "saved": load_file(saved) if saved and trainer.args.should_save else None,
            "scale": scaler.get_scale() if scaler is not None else None}


def assert_runs_match(actual: dict, expected: dict, steps, exact: bool = False,
                      dtype: torch.dtype = torch.float32) -> None:
    """Every param after every step in `steps`, and the logged loss, grad_norm and lr: bit for bit, or
    within the tolerance of two runs computing in `dtype` that reduce gradients differently."""
    for step in steps:
        for name, want in expected["params"][step].items():
            got = actual["params"][step][name]
            if exact:
                assert torch.equal(got, want), f"step {step}, {name}: not bit-exact"
            else:
                tolerances.assert_close(got, want, tolerances.DISTRIBUTED, dtype,
                                        msg=lambda m, at=f"step {step}, {name}": f"{at}: {m}")
        got, want = actual["logs"][step], expected["logs"][step]
        for key in ("loss", "grad_norm", "learning_rate"):
            if exact:
                assert got[key] == want[key], f"step {step}: {key} {got[key]} != {want[key]}"
            else:
                rel = tolerances.DISTRIBUTED[dtype]["rtol"]
                assert got[key] == pytest.approx(want[key], rel=rel), f"step {step}: {key} {got[key]} vs {want[key]}"


def assert_saved_final(run: dict, expected: dict[str, torch.Tensor], exact: bool = False) -> None:
    """save_model() wrote the params after the last step (compared with `expected`, the reference's)."""
    for name, saved in run["saved"].items():
        if exact:
            assert torch.equal(saved, expected[name]), f"saved {name}: not bit-exact"
        else:
            tolerances.assert_close(saved, expected[name], tolerances.DISTRIBUTED,
                                    msg=lambda m, at=f"saved {name}": f"{at}: {m}")


def torchrun_env(rank: int, world_size: int, port: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------- 2 gloo ranks


def _reference_and_control(rank: int, world_size: int, port: int, tmp: str) -> dict:
    torchrun_env(rank, world_size, port)
    return {"ddp": train(f"{tmp}/ddp"), "unclipped": train(f"{tmp}/unclipped", max_grad_norm=0.0)}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """The stock Trainer (DDP + torch AdamW), and the same without clipping (negative control)."""
    runs = run_ranks(_reference_and_control, 2, (free_port(), str(tmp_path_factory.mktemp("ref"))))
    assert runs[0]["ddp"]["wrapped"] == "DistributedDataParallel"
    assert all(log["grad_norm"] > 2 * CLIP for log in runs[0]["ddp"]["logs"].values())  # every step clips
    return runs[0]


def _dfa_run(rank: int, world_size: int, port: int, tmp: str) -> dict:
    torchrun_env(rank, world_size, port)
    return train(f"{tmp}/dfa", DistoptTrainer, skip_last=True, distopt_kwargs=OVERLAP)


def test_dfa_matches_ddp_adamw(reference: dict, tmp_path: Path) -> None:
    """No DDP wrap, clipping through the optimizer, the logged grad_norm, accumulation under no_sync,
    and save_model() holding the final params although their all-gather was deferred."""
    runs = run_ranks(_dfa_run, 2, (free_port(), str(tmp_path)))
    dfa = runs[0]
    assert (dfa["wrapped"], dfa["optimizer"]) == ("GPT2LMHeadModel", "DistributedFusedAdam")
    assert dfa["reduce_scatters"] == STEPS  # one bucket, reduced once per step: not per micro-batch
    assert_runs_match(dfa, reference["ddp"], range(1, STEPS))
    assert_saved_final(dfa, reference["ddp"]["params"][STEPS])
    assert_runs_match(runs[1], dfa, range(1, STEPS), exact=True)  # the ranks hold the same model


def _dfa_offload_run(rank: int, world_size: int, port: int, tmp: str) -> dict:
    torchrun_env(rank, world_size, port)
    return train(f"{tmp}/dfa", DistoptTrainer, distopt_kwargs={**OVERLAP, "offload_optimizer": True})


def test_dfa_offload_matches_ddp_adamw(reference: dict, tmp_path: Path) -> None:
    """The same with the optimizer state offloaded to host memory (offload_optimizer=True)."""
    runs = run_ranks(_dfa_offload_run, 2, (free_port(), str(tmp_path)))
    assert runs[0]["host_bytes"] > 0 and runs[0]["optimizer"] == "DistributedFusedAdam"
    assert_runs_match(runs[0], reference["ddp"], range(1, STEPS + 1))
    assert_runs_match(runs[1], runs[0], range(1, STEPS + 1), exact=True)


def test_negative_control_unclipped_run_is_caught(reference: dict) -> None:
    """The comparison above sees a run that did not clip (what the stock Trainer does with DFA, whose
    grads are not in .grad), although Adam's first step is the same at any gradient scale."""
    with pytest.raises(AssertionError, match="not close"):
        assert_runs_match(reference["unclipped"], reference["ddp"], range(1, STEPS + 1))


def _checkpoint_and_resume(rank: int, world_size: int, port: int, tmp: str) -> dict:
    torchrun_env(rank, world_size, port)
    common = dict(save_strategy="steps", save_steps=SAVE_AT, distopt_kwargs=OVERLAP)
    whole = train(f"{tmp}/whole", DistoptTrainer, **common)
    resumed = train(f"{tmp}/resumed", DistoptTrainer, resume=f"{tmp}/whole/checkpoint-{SAVE_AT}", **common)
    optim = [torch.load(f"{tmp}/{run}/checkpoint-{STEPS}/optimizer.pt", weights_only=True) if rank == 0 else None
             for run in ("whole", "resumed")]
    return {"whole": whole, "resumed": resumed, "optim": optim}


def test_checkpoint_resume_is_bit_exact(reference: dict, tmp_path: Path) -> None:
    """A checkpoint at step SAVE_AT (every rank gathers the optimizer state, rank 0 writes it), resumed
    by a fresh Trainer: every later step, the final checkpoint and save_model() as the run that went on."""
    run = run_ranks(_checkpoint_and_resume, 2, (free_port(), str(tmp_path)))[0]
    whole, resumed = run["whole"], run["resumed"]
    assert_runs_match(whole, reference["ddp"], range(1, STEPS + 1))
    assert sorted(resumed["params"]) == list(range(SAVE_AT + 1, STEPS + 1))
    assert_runs_match(resumed, whole, range(SAVE_AT + 1, STEPS + 1), exact=True)
    assert_saved_final(resumed, whole["params"][STEPS], exact=True)
    saved_whole, saved_resumed = run["optim"]
    assert saved_whole["format"] == "distopt.per_param.v1"
    assert saved_whole["checksums"] == saved_resumed["checksums"]  # CRC-32 of every state tensor


def _disk_full_at_save(rank: int, world_size: int, port: int, tmp: str) -> tuple[str, list[str] | None]:
    """Rank 0 cannot write optimizer.pt (ENOSPC halfway through): every rank must stop at that save."""
    torchrun_env(rank, world_size, port)
    real_save = torch.save

    def save(obj, f, *args, **kwargs):
        if "optimizer.pt" in str(f):
            real_save(obj, f, *args, **kwargs)  # the bytes are written: the disk fills up as it closes
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_save(obj, f, *args, **kwargs)

    if rank == 0:
        torch.save = save
    with pytest.raises(SaveFailed) as info:
        train(f"{tmp}/run", DistoptTrainer, save_strategy="steps", save_steps=SAVE_AT, distopt_kwargs=OVERLAP)
    return str(info.value), sorted(os.listdir(f"{tmp}/run/checkpoint-{SAVE_AT}")) if rank == 0 else None


def test_a_failed_optimizer_state_save_stops_every_rank_and_leaves_no_partial_file(tmp_path: Path) -> None:
    (message, files), (message1, _) = run_ranks(_disk_full_at_save, 2, (free_port(), str(tmp_path)))
    assert message == message1 and "rank 0: OSError: [Errno 28] No space left on device" in message, message
    assert not any(f.startswith("optimizer.pt") for f in files), files  # neither the file nor its temporary


def _buffers(rank: int, world_size: int, port: int, tmp: str, broadcast: bool) -> dict:
    torchrun_env(rank, world_size, port)
    ddp = train(f"{tmp}/ddp", norm=True)
    if not broadcast:  # negative control, in this forked rank only
        buffers.broadcast_buffers = lambda module, group=None: None
    return {"ddp": ddp, "dfa": train(f"{tmp}/dfa", DistoptTrainer, norm=True)}


@pytest.mark.parametrize("broadcast", [True, False], ids=["trainer", "negative_control_no_broadcast"])
def test_buffers_follow_ddp(tmp_path: Path, broadcast: bool) -> None:
    """Every rank's BatchNorm statistics after every step are those of the stock Trainer's DDP (rank 0's,
    broadcast at the forward after a synchronising one), with accumulation over GA micro-batches."""
    for rank, run in enumerate(run_ranks(_buffers, 2, (free_port(), str(tmp_path), broadcast))):
        keys = [k for k in run["ddp"]["params"][1] if "running" in k]
        assert keys, "the model has no running statistics"
        tol = tolerances.DISTRIBUTED[torch.float32]
        same = all(torch.allclose(run["dfa"]["params"][step][k], run["ddp"]["params"][step][k], **tol)
                   for step in range(1, STEPS + 1) for k in keys)
        assert same == (broadcast or rank == 0), f"rank {rank}: buffers {'differ' if broadcast else 'agree'}"
        if broadcast:
            assert_runs_match(run["dfa"], run["ddp"], range(1, STEPS + 1))


def _bf16(rank: int, world_size: int, port: int, tmp: str) -> dict:
    torchrun_env(rank, world_size, port)
    return {"ddp": train(f"{tmp}/ddp", bf16=True), "dfa": train(f"{tmp}/dfa", DistoptTrainer, bf16=True)}


def test_bf16_autocast_matches_ddp(tmp_path: Path) -> None:
    runs = run_ranks(_bf16, 2, (free_port(), str(tmp_path)))[0]
    assert_runs_match(runs["dfa"], runs["ddp"], range(1, STEPS + 1), dtype=torch.bfloat16)


def _scaled(rank: int, world_size: int, port: int, tmp: str) -> dict:
    torchrun_env(rank, world_size, port)

    def overflowing() -> torch.amp.GradScaler:
        # The first scaled loss overflows (nan grads: a skipped step), then it backs off far enough to train.
        return torch.amp.GradScaler("cpu", init_scale=2.0**127, backoff_factor=2.0**-75, growth_interval=2)

    # A large eps makes the update depend on the gradient scale (Adam's is otherwise invariant to it), so a
    # missed unscale shows in the params. No clipping against the stock Trainer: accelerate unscales only
    # when it runs fp16 itself, so with a scaler put in by hand the stock Trainer would clip scaled grads.
    common = dict(adam_epsilon=1e-4, distopt_kwargs=OVERLAP)
    return {"ddp": train(f"{tmp}/ddp", scaler=overflowing(), max_grad_norm=0.0, adam_epsilon=1e-4),
            "dfa": train(f"{tmp}/dfa", DistoptTrainer, scaler=overflowing(), max_grad_norm=0.0, **common),
            "clip": train(f"{tmp}/clip", DistoptTrainer, **common),
            "clip_scaled": train(f"{tmp}/clip_scaled", DistoptTrainer, scaler=torch.amp.GradScaler("cpu", 2.0**20),
                                 **common)}


def test_grad_scaler_skips_steps_like_torch(tmp_path: Path) -> None:
    """The fp16 path: loss scaled in backward, unscale folded into the update, inf/nan steps skipped
    on every rank without advancing the LR schedule, the scale backed off and grown as torch's; and
    with clipping, the same steps and logged grad_norm as without a scaler."""
    runs = run_ranks(_scaled, 2, (free_port(), str(tmp_path)))[0]
    ddp, dfa = runs["ddp"], runs["dfa"]
    lrs = [ddp["logs"][s]["learning_rate"] for s in range(1, STEPS + 1)]
    assert lrs[0] == lrs[1] == LR > lrs[2]  # the first step was skipped (the lr stayed), the others were not
    assert [dfa["logs"][s]["learning_rate"] for s in range(1, STEPS + 1)] == lrs
    assert dfa["scale"] == ddp["scale"]
    for step in range(1, STEPS + 1):
        for name, want in ddp["params"][step].items():
            tolerances.assert_close(dfa["params"][step][name], want, tolerances.DISTRIBUTED)
    assert_runs_match(runs["clip_scaled"], runs["clip"], range(1, STEPS + 1), exact=True)


# ---------------------------------------------------------------------- one process


def _single(rank: int, world_size: int, tmp: str) -> dict:
    # the harness's 1-rank group: DistoptTrainer must still pick FusedAdam (world size 1)
    def passed(cls: type) -> Callable:
        def make(model: torch.nn.Module) -> tuple:
            opt = cls(model.parameters(), lr=LR, weight_decay=WD)
            return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 - step / (2 * STEPS))
        return make

    return {
        "adamw": train(f"{tmp}/adamw"),
        "distopt": train(f"{tmp}/distopt", DistoptTrainer, distopt_kwargs=OVERLAP),  # DFA-only keys are dropped
        "passed_adamw": train(f"{tmp}/passed_adamw", make_optimizers=passed(torch.optim.AdamW)),
        "passed_fused": train(f"{tmp}/passed_fused", make_optimizers=passed(FusedAdam)),
    }


def test_single_process_fused_adam(tmp_path: Path) -> None:
    """One process: DistoptTrainer builds FusedAdam, and plain Trainer(optimizers=(FusedAdam(...),
    sched)) keeps working; each against its torch AdamW twin, step by step."""
    runs = run_ranks(_single, 1, (str(tmp_path),))[0]
    assert runs["distopt"]["optimizer"] == "FusedAdam"
    assert runs["distopt"]["wrapped"] == "GPT2LMHeadModel"
    assert all(log["grad_norm"] > 2 * CLIP for log in runs["adamw"]["logs"].values())
    assert_runs_match(runs["distopt"], runs["adamw"], range(1, STEPS + 1))
    assert_saved_final(runs["distopt"], runs["adamw"]["params"][STEPS])
    assert_runs_match(runs["passed_fused"], runs["passed_adamw"], range(1, STEPS + 1))


def test_unknown_distopt_kwargs_raise() -> None:
    with pytest.raises(TypeError, match="bucket_cap"):
        DistoptTrainer(model=make_model(), distopt_kwargs={"bucket_cap": 25})


def test_importing_distopt_does_not_import_transformers() -> None:
    code = ("import sys, distopt, distopt.integrations; "
            "assert not {'transformers', 'accelerate'} & set(sys.modules), 'framework imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)

