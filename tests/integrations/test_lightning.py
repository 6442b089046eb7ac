"""distopt.integrations.lightning against stock Lightning runs, on 2 gloo ranks in forked processes.

Each rank runs real ``Trainer.fit`` calls itself (LOCAL_RANK etc. set, so Lightning launches nothing;
the harness's process group is already up, so Lightning keeps it) on a tiny model and synthetic data,
and records every param after every optimizer step. The reference is ``strategy="ddp"`` with
``torch.optim.AdamW``; the runs clip on every step (checked on the reference's gradients) and
accumulate over 2 batches.
"""

from __future__ import annotations

import importlib
import os
import pickle
import subprocess
import sys
import warnings
from functools import cache
from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("lightning")

from distopt import DistributedFusedAdam, FusedAdam  # noqa: E402
from distopt.distributed import buffers  # noqa: E402
from distopt.integrations.lightning import (  # noqa: E402
    DistoptGradientClipping,
    DistributedFusedAdamStrategy,
    _RoutedClip,
    strategy_class,
)

import tolerances  # noqa: E402
from harness import run_ranks  # noqa: E402

LIGHTNING = "lightning.pytorch"
CLIP = 0.05  # the reference's pre-clip norms are all larger (asserted): every step clips
LR, WD = 1e-2, 0.05
SAMPLES, BATCH = 32, 2  # 8 batches per rank and epoch: 4 optimizer steps with accumulate_grad_batches=2


def dfa(params):
    return DistributedFusedAdam(params, lr=LR, weight_decay=WD)


def adamw(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=WD)


def fused(params):
    return FusedAdam(params, lr=LR, weight_decay=WD)


@cache
def classes(ns: str) -> dict:
    """A LightningModule and a recording Callback for one Lightning namespace."""
    pl = importlib.import_module(ns)

    class Net(pl.LightningModule):
        def __init__(self, make_opt, seed: int = 0, norm: bool = False) -> None:
            super().__init__()
            torch.manual_seed(seed)
            # BatchNorm: running statistics in buffers. The bias before it would have a zero gradient (the
            # norm removes it) made of rounding noise, which Adam turns into lr-sized steps: none.
            middle = [nn.BatchNorm1d(16)] if norm else []
            self.net = nn.Sequential(nn.Linear(8, 16, bias=not norm), *middle, nn.Tanh(), nn.Linear(16, 4))
            self.make_opt = make_opt

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self.net(x).float(), y)

        def configure_optimizers(self):
            return self.make_opt(self.parameters())  # after the strategy has set the process group up

    class ClippingNet(DistoptGradientClipping, Net):
        pass

    class Recorder(pl.Callback):
        """`sync`: land DistributedFusedAdam's deferred all-gathers (overlap_param_sync) before
        recording; `save_at`: (global step, path) of a checkpoint to save there, mid-epoch."""

        def __init__(self, sync: bool = True, save_at: tuple[int, str] | None = None) -> None:
            self.params: dict[int, list[torch.Tensor]] = {}  # by global step, after each optimizer step
            self.buffers: dict[int, list[torch.Tensor]] = {}
            self.norms: list[float] = []  # pre-clip grad norms, where grads are in .grad
            self.sync, self.save_at = sync, save_at

        def on_before_optimizer_step(self, trainer, module, optimizer) -> None:
            grads = [p.grad for p in module.parameters() if p.grad is not None]
            if grads:
                self.norms.append(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item())

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            if trainer.global_step in self.params or batch_idx % 2 == 0:
                return  # no optimizer step ran
            if self.save_at is not None and self.save_at[0] == trainer.global_step:
                trainer.save_checkpoint(self.save_at[1])  # before any explicit sync: the strategy must land it
            if self.sync:
                for opt in trainer.optimizers:
                    getattr(opt, "param_sync", lambda: None)()
            self.params[trainer.global_step] = [p.detach().clone() for p in module.parameters()]
            self.buffers[trainer.global_step] = [b.clone() for b in module.buffers()]

    return {"pl": pl, "Net": Net, "ClippingNet": ClippingNet, "Recorder": Recorder}


def lightning_env(rank: int, world_size: int) -> None:
    """What LightningEnvironment reads; LOCAL_RANK tells Lightning the processes exist already."""
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="29517")
    warnings.filterwarnings("ignore", message=".*(does not have many workers|GPU available|TPU available).*")
    warnings.filterwarnings("ignore", message=".*(smaller than the logging interval|precision.*not supported).*")


def fit(ns: str, strategy, make_opt, *, devices: int = 2, precision: str | None = None, epochs: int = 1,
        seed: int = 0, mixin: bool = False, ckpt_in: str | None = None, ckpt_out: str | None = None,
        clip: float | None = CLIP, algorithm: str = "norm", sync: bool = True,
        save_at: tuple[int, str] | None = None, norm: bool = False, batch: int = BATCH) -> dict:
    """One Trainer.fit; returns the params after every optimizer step and after fit, and the
    reference's grad norms. See Recorder for `sync` and `save_at`."""
    c = classes(ns)
    pl = c["pl"]
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(SAMPLES, 8, generator=g), torch.randn(SAMPLES, 4, generator=g))
    # Another init on each rank: the strategy must start every rank from rank 0's params, as DDP does.
    model = c["ClippingNet" if mixin else "Net"](make_opt, seed + int(os.environ["LOCAL_RANK"]), norm)
    recorder = c["Recorder"](sync, save_at)
    kwargs = {}
    if precision == "16-mixed":  # Lightning turns precision="16-mixed" into bf16 on the CPU; the plugin keeps fp16
        kwargs["plugins"] = [pl.plugins.precision.MixedPrecision("16-mixed", "cpu")]
    elif precision is not None:
        kwargs["precision"] = precision
    trainer = pl.Trainer(accelerator="cpu", devices=devices, num_nodes=1, strategy=strategy, max_epochs=epochs,
                         gradient_clip_val=clip, gradient_clip_algorithm=algorithm, accumulate_grad_batches=2,
                         callbacks=[recorder], logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, **kwargs)
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=batch), ckpt_path=ckpt_in)
    final = [p.detach().clone() for p in model.parameters()]
    if ckpt_out is not None:
        trainer.save_checkpoint(ckpt_out)  # every rank: the optimizer state is gathered by a collective
    return {"params": recorder.params, "buffers": recorder.buffers, "norms": recorder.norms, "final": final}


def assert_matches(run: dict, ref: dict, precision: str | None = None) -> None:
    """The params are fp32; under autocast, params that differ in the last bits (the update kernels
    differ by ulps) can round to different 16-bit weights, so mixed precision gets the tolerance of its
    compute dtype. Seen: at most 3e-8, except up to 2e-5 with fp16 and value clipping."""
    dtype = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(precision, torch.float32)
    assert list(run["params"]) == list(ref["params"]) and ref["params"]
    for step in ref["params"]:
        for a, b in zip(run["params"][step], ref["params"][step]):
            tolerances.assert_close(a, b, tolerances.DISTRIBUTED, dtype, scale_atol=dtype != torch.float32,
                                    msg=lambda m, step=step: f"step {step}: {m}")


def assert_clipped_every_step(ref: dict) -> None:
    assert len(ref["norms"]) == len(ref["params"]) and min(ref["norms"]) > 2 * CLIP, ref["norms"]


# ---------------------------------------------------------------------------------------------- 2 ranks


def dfa_offload(params):
    return DistributedFusedAdam(params, lr=LR, weight_decay=WD, offload_optimizer=True)


def _strategy_vs_ddp(rank: int, world_size: int, ns: str, precision: str | None,
                     make_opt=dfa) -> tuple[dict, dict]:
    lightning_env(rank, world_size)
    ref = fit(ns, "ddp", adamw, precision=precision)
    no_sync, entered = DistributedFusedAdam.no_sync, []

    def counted(self):
        entered.append(1)
        return no_sync(self)

    DistributedFusedAdam.no_sync = counted  # in this forked rank only
    run = fit(ns, DistributedFusedAdamStrategy(namespace=ns), make_opt, precision=precision)
    run["no_sync"] = len(entered)
    return run, ref


@pytest.mark.parametrize("ns, precision", [(LIGHTNING, None), (LIGHTNING, "bf16-mixed"), (LIGHTNING, "16-mixed"),
                                           ("pytorch_lightning", None)])
def test_strategy_matches_ddp_adamw(ns: str, precision: str | None) -> None:
    """Clipping every step, accumulation over 2 batches, under each precision and both namespaces."""
    if ns == "pytorch_lightning":
        pytest.importorskip("pytorch_lightning")
    for run, ref in run_ranks(_strategy_vs_ddp, 2, (ns, precision)):
        assert_clipped_every_step(ref)
        assert list(ref["params"]) == list(range(1, SAMPLES // 2 // BATCH // 2 + 1))
        assert run["no_sync"] == len(ref["params"])  # the accumulating backward of every step communicated nothing
        assert_matches(run, ref, precision)


@pytest.mark.parametrize("precision", [None, "bf16-mixed"])
def test_strategy_with_offload_matches_ddp_adamw(precision: str | None) -> None:
    """The same with the optimizer state offloaded to host memory (offload_optimizer=True)."""
    for run, ref in run_ranks(_strategy_vs_ddp, 2, (LIGHTNING, precision, dfa_offload)):
        assert_clipped_every_step(ref)
        assert run["no_sync"] == len(ref["params"])
        assert_matches(run, ref, precision)


def _buffers_vs_ddp(rank: int, world_size: int, broadcast: bool) -> tuple[dict, dict]:
    lightning_env(rank, world_size)
    # Batches of 8 (BatchNorm over 2 samples outputs about +-1 whatever its input); 1 step per epoch.
    kw = dict(norm=True, batch=8, epochs=4)
    ref = fit(LIGHTNING, "ddp", adamw, **kw)
    if not broadcast:  # negative control, in this forked rank only
        buffers.broadcast_buffers = lambda module, group=None: None
    return fit(LIGHTNING, DistributedFusedAdamStrategy(namespace=LIGHTNING), dfa, **kw), ref


@pytest.mark.parametrize("broadcast", [True, False], ids=["strategy", "negative_control_no_broadcast"])
def test_strategy_broadcasts_buffers_like_ddp(broadcast: bool) -> None:
    """BatchNorm running statistics on every rank after every step are DDP's (rank 0's, broadcast at the
    forward after a synchronising one, as DDP does): evaluation on any rank is DDP's."""
    def close(a: list, b: list) -> bool:
        return all(torch.allclose(x, y, **tolerances.DISTRIBUTED[torch.float32]) for x, y in zip(a, b, strict=True))

    for rank, (run, ref) in enumerate(run_ranks(_buffers_vs_ddp, 2, (broadcast,))):
        assert list(run["params"]) == list(ref["params"]) == list(ref["buffers"]) and ref["params"]
        assert all(close(run["params"][step], ref["params"][step]) for step in ref["params"])
        same = all(close(run["buffers"][step], ref["buffers"][step]) for step in ref["buffers"])
        assert same == (broadcast or rank == 0), f"rank {rank}: buffers {'differ' if broadcast else 'agree'}"


def _dfa_under_ddp(rank: int, world_size: int) -> str:
    lightning_env(rank, world_size)
    try:
        fit(LIGHTNING, "ddp", dfa)
    except ValueError as exc:
        return str(exc)
    raise AssertionError("DistributedFusedAdam trained under strategy='ddp'")


def test_dfa_under_stock_ddp_is_refused() -> None:
    """The reported bug: DistributedFusedAdam under strategy='ddp' + gradient_clip_val trained silently
    wrong (torch's clip_grad_norm_ finds no .grad). The optimizer now refuses a DDP-wrapped model."""
    for message in run_ranks(_dfa_under_ddp, 2):
        assert "inside a DistributedDataParallel module" in message


def _strategy_vs_ddp_other_lr(rank: int, world_size: int) -> tuple[dict, dict]:
    lightning_env(rank, world_size)

    def adamw_1pc(params):  # a 1% larger lr (a clip value would not do: Adam is invariant to grad scale)
        return torch.optim.AdamW(params, lr=LR * 1.01, weight_decay=WD, foreach=False)

    return fit(LIGHTNING, DistributedFusedAdamStrategy(namespace=LIGHTNING), dfa), fit(LIGHTNING, "ddp", adamw_1pc)


def test_negative_control_other_lr_is_caught() -> None:
    """The comparison can fail: the reference with a 1% larger lr is told apart."""
    for run, ref in run_ranks(_strategy_vs_ddp_other_lr, 2):
        with pytest.raises(AssertionError):
            assert_matches(run, ref)


def _resume(rank: int, world_size: int, path: str) -> tuple[dict, dict, dict]:
    lightning_env(rank, world_size)

    def opt(params):  # deferred all-gathers: checkpoints and fit() must still give the stepped params
        return DistributedFusedAdam(params, lr=LR, weight_decay=WD, overlap_param_sync=True)

    def run(**kw) -> dict:
        return fit(LIGHTNING, DistributedFusedAdamStrategy(namespace=LIGHTNING), opt, precision="bf16-mixed", **kw)

    whole = run(epochs=2)
    part = run(epochs=1, sync=False, save_at=(2, f"{path}/mid.ckpt"), ckpt_out=f"{path}/end.ckpt")
    resumed = run(epochs=2, seed=7, ckpt_in=f"{path}/end.ckpt")  # another init: all must come from the file
    return whole, part, resumed


def test_checkpoint_resume_equals_uninterrupted(tmp_path: Path) -> None:
    """trainer.save_checkpoint after epoch 1, fit(ckpt_path=...) for epoch 2: bit-identical params. With
    overlap_param_sync, a checkpoint mid-epoch and the model after fit() hold the stepped params."""
    steps = SAMPLES // 2 // BATCH // 2  # per epoch
    for whole, part, resumed in run_ranks(_resume, 2, (str(tmp_path),)):
        assert list(whole["params"]) == list(range(1, 2 * steps + 1))
        assert list(resumed["params"]) == list(range(steps + 1, 2 * steps + 1))
        for step, params in resumed["params"].items():
            for a, b in zip(params, whole["params"][step]):
                assert torch.equal(a, b), f"step {step}: max diff {(a - b).abs().max().item():.3g}"
        assert all(map(torch.equal, part["final"], whole["params"][steps])), "fit() returned stale params"
    mid, end = (torch.load(tmp_path / name, weights_only=False) for name in ("mid.ckpt", "end.ckpt"))
    assert all(map(torch.equal, mid["state_dict"].values(), whole["params"][2])), "checkpoint with stale params"
    saved = end["optimizer_states"][0]
    assert len(saved["state"]) == 4 and saved["state"][0]["step"] == steps  # the whole state, gathered
    torch.optim.AdamW(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).parameters()).load_state_dict(saved)


def _refusals(rank: int, world_size: int) -> None:
    lightning_env(rank, world_size)
    with pytest.raises(TypeError, match="DistributedFusedAdam optimizers only"):
        fit(LIGHTNING, DistributedFusedAdamStrategy(namespace=LIGHTNING), adamw)
    with pytest.raises(NotImplementedError, match="clips by norm only"):
        fit(LIGHTNING, DistributedFusedAdamStrategy(namespace=LIGHTNING), dfa, algorithm="value")


def test_strategy_refusals() -> None:
    """Without DDP nothing would average an AdamW's gradients, and sharded gradients cannot be clipped
    by value: both refused, not silently diverging."""
    run_ranks(_refusals, 2)


# --------------------------------------------------------------------------------------------- 1 process


def _fused_single(rank: int, world_size: int, precision: str, algorithm: str) -> tuple[dict, dict]:
    lightning_env(rank, world_size)
    kw = dict(devices=1, precision=precision, algorithm=algorithm)
    with pytest.raises(RuntimeError, match="does not allow for gradient clipping"):  # the report, unfixed
        fit(LIGHTNING, "auto", fused, **kw)
    ref = fit(LIGHTNING, "auto", adamw, **kw)
    run = fit(LIGHTNING, "auto", fused, mixin=True, **kw)
    return run, ref


@pytest.mark.parametrize("precision, algorithm", [("bf16-mixed", "norm"), ("16-mixed", "norm"), ("16-mixed", "value")])
def test_fused_adam_clips_under_mixed_precision(precision: str, algorithm: str) -> None:
    """FusedAdam + gradient_clip_val under the stock strategy: Lightning refuses it; with the mixin
    it trains like torch.optim.AdamW."""
    run, ref = run_ranks(_fused_single, 1, (precision, algorithm))[0]
    assert_clipped_every_step(ref)
    assert_matches(run, ref, precision)


@pytest.mark.slow
def test_lightning_launches_the_ranks(tmp_path: Path) -> None:
    """As a user runs it (~30 s): Lightning starts the second rank and the process group itself, and the
    strategy finds the namespace alone."""
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_PORT")}
    script = Path(__file__).with_name("lightning_launch.py")
    subprocess.run([sys.executable, str(script), str(tmp_path)], check=True, timeout=300,
                   env={**env, "OMP_NUM_THREADS": "1"})
    for rank in range(2):
        saved = torch.load(tmp_path / f"rank{rank}.pt")
        assert_matches({"params": {1: saved["run"]}}, {"params": {1: saved["ref"]}})


# ------------------------------------------------------------------------------------------------ no Trainer


def test_namespaces() -> None:
    pl = pytest.importorskip("pytorch_lightning")
    import lightning.pytorch as lp

    a = DistributedFusedAdamStrategy(namespace="lightning")
    b = DistributedFusedAdamStrategy(namespace="pytorch_lightning")
    assert isinstance(a, lp.strategies.DDPStrategy) and not isinstance(a, pl.strategies.DDPStrategy)
    assert isinstance(b, pl.strategies.DDPStrategy) and not isinstance(b, lp.strategies.DDPStrategy)
    assert isinstance(a, DistributedFusedAdamStrategy) and isinstance(b, DistributedFusedAdamStrategy)
    assert strategy_class("lightning") is strategy_class("lightning.pytorch") is type(a)
    with pytest.raises(ValueError, match="both lightning and pytorch_lightning"):
        DistributedFusedAdamStrategy()  # both are imported here: which one is the Trainer's?


def test_fresh_process_imports_and_unpickles() -> None:
    """Importing distopt (and the adapter) imports no Lightning; a pickled strategy (as spawn launchers
    send it, after setup patched its precision plugin) loads in a fresh process."""
    strategy = DistributedFusedAdamStrategy(namespace="lightning")
    strategy.precision_plugin = importlib.import_module(LIGHTNING).plugins.precision.MixedPrecision("bf16-mixed", "cpu")
    strategy.precision_plugin.clip_gradients = _RoutedClip(strategy.precision_plugin)
    code = ("import pickle, sys, distopt, distopt.integrations.lightning as dl; "
            "assert not {'lightning', 'pytorch_lightning'} & set(sys.modules), 'lightning imported'; "
            "s = pickle.load(sys.stdin.buffer); p = s.precision_plugin; "
            "assert isinstance(s, dl.DistributedFusedAdamStrategy) and p.clip_gradients.plugin is p")
    subprocess.run([sys.executable, "-c", code], input=pickle.dumps(strategy), check=True, timeout=120)


def _teardown_with_state_on_another_device(rank: int, world_size: int) -> dict:
    """Lightning's teardown moves optimizer state by assigning opt.state[p][key]; on a GPU run that is a
    move to another device (emulated here: "meta"), which DistributedFusedAdam's view refuses."""
    import lightning.fabric.utilities.optimizer as lopt
    import lightning.pytorch.strategies.strategy as lstrategy
    from lightning.fabric.plugins.environments import LightningEnvironment
    from lightning.pytorch.accelerators import CPUAccelerator

    model = nn.Linear(4, 2)
    opt = dfa(model.parameters())
    try:
        lopt._optimizer_to_device(opt, torch.device("meta"))
        refused = ""
    except TypeError as exc:  # the view: the write would change nothing
        refused = str(exc)
    moved = []

    def to_other_device(optimizers, device):
        for o in optimizers:
            moved.append(type(o).__name__)
            lopt._optimizer_to_device(o, torch.device("meta"))

    original = lstrategy._optimizers_to_device
    lstrategy._optimizers_to_device = to_other_device
    try:
        env = LightningEnvironment()
        strategy = strategy_class(LIGHTNING)(accelerator=CPUAccelerator(), cluster_environment=env)
        strategy.optimizers = [opt]
        strategy.teardown()
    finally:
        lstrategy._optimizers_to_device = original
    return dict(refused=refused, moved=moved, kept=strategy.optimizers == [opt])


def test_teardown_leaves_the_state_view_alone() -> None:
    result = run_ranks(_teardown_with_state_on_another_device, 1)[0]
    assert "would change nothing" in result["refused"]  # what stock teardown would hit on a GPU
    assert result["moved"] == [] and result["kept"]
