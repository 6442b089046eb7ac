"""Surviving a crash in the main job (examples/train.py): checkpoints, resume, restarts, timeouts.

    torchrun --nproc-per-node 2 --max-restarts 2 examples/train.py --checkpoint-dir ckpt --checkpoint-every 20

Every --checkpoint-every steps every rank saves into ``DIR/step-<N>`` with distopt's crash-consistent
``checkpoint.save`` (a rank killed at any moment leaves the previous checkpoints intact); the two
newest are kept. Started again with the same DIR (by hand, or by torchrun after a failure), the job
loads the newest checkpoint there (an older one if the newest is refused as damaged) and goes on from
the step after it, bit for bit as if it had never stopped. What that takes, and where it is saved:

  distopt's model and DistributedFusedAdam   the optimizer's shards, ``extra["distopt"]`` (the model)
  DDP's and the control's models and AdamW   ``extra["DDP"]``, ``extra["control"]`` (torch's
                                             get_state_dict: replicated, so written once)
  the step                                   ``extra["progress"]["step"]``: the LR schedule is
                                             ``lr_at(step)``, the data ``train_batch(step)`` and the
                                             control's nudges are drawn from (seed, step, param)
  each rank's RNG state                      ``extra["rng"][rank]`` (torch's CPU and CUDA generators)
  the params' distance after step 1          ``extra["progress"]["first"]`` (printed at the end)
  the settings that shape the run            ``extra["progress"]["settings"]``: a resume with other
                                             settings (or another number of ranks) is refused

distopt's bucket layout is fixed at construction (train.build), so the resumed optimizer sums the
gradient norm in the same order as the first run. The train and validation losses printed after a
resume average the steps since the resume (the running sums are not saved).

Restarts. torchrun --max-restarts starts every worker again when one fails; in torch 2.14 the new
workers find the previous attempt's keys in the agent's TCP store (pytorch issues 135712, 167288)
and a plain ``init_process_group`` can hang or connect to dead peers. ``init_process_group`` below
joins through a ``PrefixStore`` per attempt (``TORCHELASTIC_RESTART_COUNT``). The process-group
timeout (--collective-timeout) bounds how long a rank waits for a peer that hung: then every rank
raises an error naming the collective (a peer that died is noticed at once), and torchrun restarts.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import re
import shutil
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException: caught by name
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from distopt.distributed import atomic_replace, checkpoint

KEEP = 2  # checkpoints kept in DIR
_STEP_DIR = re.compile(r"^step-(\d+)$")
_STEP_ENTRY = re.compile(r"^step-(\d+)(\.|$)")  # a checkpoint, or a version or leftover of one
# The settings a bit-exact resume needs unchanged (the rest: reporting, checkpointing, threads).
SETTINGS = ("steps", "seed", "batch_size", "seq_len", "dim", "layers", "heads", "lr", "lr_warmup", "weight_decay",
            "clip", "bucket_cap_mb", "overlap_grad_sync", "overlap_param_sync", "offload", "world_size")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("checkpoints and restarts (examples/resume.py)")
    group.add_argument("--checkpoint-dir", default=None,
                       help="save checkpoints in DIR/step-<N> (the two newest are kept) and, if DIR holds any, "
                            "resume from the newest")
    group.add_argument("--checkpoint-every", type=int, default=None, metavar="N",
                       help="save every N steps (needs --checkpoint-dir; default with it: every --val-every steps)")
    group.add_argument("--collective-timeout", type=float, default=300.0, metavar="SECONDS",
                       help="process-group timeout: a rank waiting longer for a peer in any collective raises an "
                            "error naming it, so a job with a hung rank stops (and torchrun can restart it) instead "
                            "of hanging; it must exceed the longest wait for a slower rank (a checkpoint save, say)")


def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.checkpoint_every is not None and args.checkpoint_dir is None:
        parser.error("--checkpoint-every needs --checkpoint-dir")
    if args.checkpoint_dir is not None and args.bmuf:
        parser.error("--checkpoint-dir is not supported with --bmuf")
    if args.checkpoint_dir is not None and args.checkpoint_every is None:
        args.checkpoint_every = args.val_every
    if args.checkpoint_every is not None and args.checkpoint_every < 1:
        parser.error("--checkpoint-every must be at least 1")
    if args.collective_timeout <= 0:
        parser.error("--collective-timeout must be positive")


# ----------------------------------------------------------------------------------------- process group


def init_process_group(backend: str, rank: int, world_size: int, store_path: str, timeout_s: float) -> None:
    """The job's process group: over a FileStore when this script spawned the ranks, else from
    torchrun's environment, through a store prefix of this restart attempt (see the module docstring)."""
    timeout = timedelta(seconds=timeout_s)
    if store_path:
        store = dist.FileStore(store_path, world_size)
    elif "TORCHELASTIC_RESTART_COUNT" in os.environ:
        agent_hosts_it = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                              is_master=rank == 0 and not agent_hosts_it, timeout=timeout)
        store = dist.PrefixStore(f"distopt/attempt-{os.environ['TORCHELASTIC_RESTART_COUNT']}/", store)
    else:  # RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set by another launcher
        dist.init_process_group(backend, timeout=timeout)
        return
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


# ----------------------------------------------------------------------------------------- what is saved


class Replicated:
    """A DDP side (its bare model and torch AdamW) as torch.distributed.checkpoint's Stateful."""

    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        self.model, self.opt = model, opt

    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.opt)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        set_state_dict(self.model, self.opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


def settings(args: argparse.Namespace) -> str:
    return json.dumps({name: getattr(args, name) for name in SETTINGS}, sort_keys=True)


def _extra(sides: tuple, rank: int, step: int, first: torch.Tensor, args: argparse.Namespace) -> dict[str, Any]:
    distopt_side, ddp_side, control = sides
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    return {"distopt": distopt_side.model, "DDP": Replicated(ddp_side.model, ddp_side.opt),
            "control": Replicated(control.model, control.opt), "rng": {str(rank): rng},
            "progress": {"step": torch.tensor(step), "first": first, "settings": settings(args)}}


def _checkpoints(directory: str) -> list[tuple[int, str]]:
    """(step, path) of the complete checkpoints in `directory`, newest first (leftovers of killed saves
    are named step-<N>.<something> and ignored)."""
    if not os.path.isdir(directory):
        return []
    found = [(int(m.group(1)), os.path.join(directory, name)) for name in os.listdir(directory)
             if (m := _STEP_DIR.match(name))]
    return sorted(found, reverse=True)


def save(args: argparse.Namespace, sides: tuple, rank: int, step: int, first: torch.Tensor) -> str:
    """Every rank: saves step `step`'s checkpoint, then (rank 0) removes all but the KEEP newest."""
    distopt_side = sides[0]
    distopt_side.opt.param_sync()  # the model's state_dict reads the params
    path = os.path.join(args.checkpoint_dir, f"step-{step}")
    checkpoint.save(distopt_side.opt, path, extra=_extra(sides, rank, step, first, args))
    if rank == 0:
        kept = {s for s, _ in _checkpoints(args.checkpoint_dir)[:KEEP]}
        for name in os.listdir(args.checkpoint_dir):
            m = _STEP_ENTRY.match(name)
            if m and int(m.group(1)) not in kept:
                target = os.path.join(args.checkpoint_dir, name)
                if os.path.isdir(target) and not os.path.islink(target):
                    shutil.rmtree(target)
                else:
                    os.unlink(target)
    return path


def resume(args: argparse.Namespace, sides: tuple, rank: int) -> tuple[int, torch.Tensor, str]:
    """Every rank: loads the newest checkpoint of --checkpoint-dir that loads (an older one if it is
    refused); returns (its step, the params' distance after step 1, its path), or (0, _, "") where
    there is none. Never trains over checkpoints that all fail to load: it stops instead."""
    first = torch.full((2,), float("nan"), dtype=torch.float64)
    found = _checkpoints(args.checkpoint_dir) if args.checkpoint_dir else []
    for step, path in found:
        _check_settings(path, args)
        extra = _extra(sides, rank, step, first.clone(), args)
        try:
            checkpoint.load(sides[0].opt, path, extra=extra)
        except ValueError as exc:  # the same on every rank; nothing was loaded
            if rank == 0:
                print(f"resume: {path} cannot be loaded ({exc}); trying an older checkpoint", flush=True)
            continue
        progress = extra["progress"]
        torch.set_rng_state(extra["rng"][str(rank)]["cpu"])
        if "cuda" in extra["rng"][str(rank)]:
            torch.cuda.set_rng_state(extra["rng"][str(rank)]["cuda"])
        return int(progress["step"]), progress["first"], path
    if found:
        raise SystemExit(f"resume: none of the checkpoints in {args.checkpoint_dir} can be loaded (see above); "
                         "not training over them: move them away to start afresh")
    return 0, first, ""


def _check_settings(path: str, args: argparse.Namespace) -> None:
    """Stops if the checkpoint at `path` was saved with other settings (every rank reads them; settings
    that cannot be read are left to checkpoint.load, which says why)."""
    holder: dict[str, Any] = {"progress": {"settings": ""}}
    try:
        dcp.load(holder, checkpoint_id=atomic_replace.resolve(path, dist.group.WORLD))
    except (Exception, CheckpointException):  # a damaged checkpoint: checkpoint.load refuses it with the reason
        return
    saved, now = json.loads(holder["progress"]["settings"]), json.loads(settings(args))
    diff = [f"{saved[k]} ranks (now {now[k]})" if k == "world_size" else f"--{k.replace('_', '-')} {saved[k]} "
            f"(now {now[k]})" for k in SETTINGS if saved.get(k) != now[k]]
    if diff:
        raise SystemExit(f"resume: {path} was saved by a run with {', '.join(diff)}: a bit-exact resume needs the "
                         "same settings; pass them, or another --checkpoint-dir")


def params_digest(models: list[nn.Module]) -> str:
    """SHA-256 of the params' bytes, model after model, in parameters() order: equal digests, equal runs."""
    h = hashlib.sha256()
    for model in models:
        for p in model.parameters():
            t = p.detach().to("cpu", copy=True).contiguous()
            h.update(ctypes.string_at(t.data_ptr(), t.numel() * t.element_size()))
    return h.hexdigest()
