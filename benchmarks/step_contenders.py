"""The contenders benchmarks/bench_step.py trains and times: DDP + torch's AdamW over fp32 masters,
DDP + FusedAdam, and DistributedFusedAdam with and without overlap_param_sync, each built on a copy of
the same model."""

from __future__ import annotations

import copy
import gc
import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

import distopt

from common import REPO_ROOT, torch_adamw

sys.path.insert(0, str(REPO_ROOT / "examples"))
from model import TinyGPT  # noqa: E402  (examples/model.py)

LR, BETAS, EPS, WEIGHT_DECAY = 1e-3, (0.9, 0.999), 1e-8, 0.01


@dataclass(frozen=True)
class Contender:
    name: str  # the table's label
    optimizer: str  # AdamW | FusedAdam | DistributedFusedAdam
    overlap_param_sync: bool = False
    other_kernel: bool = False  # AdamW: torch's other implementation (foreach where fused is the default)


CONTENDERS = (
    Contender("DDP + AdamW", "AdamW"),
    Contender("DDP + FusedAdam", "FusedAdam"),
    Contender("DistributedFusedAdam", "DistributedFusedAdam"),
    Contender("DistributedFusedAdam overlap_param_sync", "DistributedFusedAdam", overlap_param_sync=True),
)
REFERENCE, BASELINE = CONTENDERS[0], CONTENDERS[1]  # the correctness reference; the step-ratio baseline
# Not timed: how far two correct torch implementations drift apart, the correctness check's noise floor.
NOISE_FLOOR = Contender("DDP + AdamW, torch's other kernel", "AdamW", other_kernel=True)


class MasterAdamW:
    """torch.optim.AdamW over fp32 masters of 16-bit params (over the params themselves in fp32). Its
    step casts the grads into a transient fp32 buffer, steps, and copies the masters into the params
    (_foreach_copy_ both ways)."""

    def __init__(self, params: list[Tensor], other_kernel: bool = False) -> None:
        self.params = params
        self.mixed = params[0].dtype != torch.float32
        if self.mixed:
            self.numels = [p.numel() for p in params]
            self.master_flat = torch.cat([p.detach().float().reshape(-1) for p in params])
            self.masters = list(self.master_flat.split(self.numels))
            self.param_views = [p.detach().view(-1) for p in params]
        targets = self.masters if self.mixed else params
        self.opt, fused, self.kind = torch_adamw(targets, LR, BETAS, EPS, WEIGHT_DECAY)
        if other_kernel:  # foreach where the fused kernel is the default, else the per-param loop
            self.opt = torch.optim.AdamW(targets, LR, BETAS, EPS, WEIGHT_DECAY, foreach=fused)
            self.kind = f"AdamW(foreach={fused})"

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        if not self.mixed:
            self.opt.step()
            return
        grads = torch.empty_like(self.master_flat).split(self.numels)  # transient fp32 master grads
        torch._foreach_copy_(grads, [p.grad.view(-1) for p in self.params])
        for m, g in zip(self.masters, grads):
            m.grad = g
        self.opt.step()
        torch._foreach_copy_(self.param_views, self.masters)
        for m in self.masters:
            m.grad = None

    def state_bytes(self) -> int:
        return _state_tensor_bytes(self.opt) + (self.master_flat.nbytes if self.mixed else 0)


def _state_tensor_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(v.nbytes for s in opt.state.values() for v in s.values() if isinstance(v, Tensor))


@dataclass
class Trainer:
    """One contender: its model copy, the module called in forward (DDP-wrapped or not), its optimizer."""

    module: TinyGPT
    model: nn.Module
    opt: Any
    config: str

    def forward_backward(self, batch: tuple[Tensor, Tensor]) -> None:
        self.opt.zero_grad(set_to_none=True)
        tokens, targets = batch
        logits = self.model(tokens)
        F.cross_entropy(logits.float().flatten(0, 1), targets.flatten()).backward()

    def iteration(self, batch: tuple[Tensor, Tensor]) -> None:
        self.forward_backward(batch)
        self.opt.step()

    def finish(self) -> None:
        """Lands a deferred param all-gather (overlap_param_sync) so that the params are current."""
        if isinstance(self.opt, distopt.DistributedFusedAdam):
            self.opt.param_sync()

    def state_bytes(self) -> tuple[int, dict[str, int] | None]:
        if isinstance(self.opt, distopt.DistributedFusedAdam):
            report = self.opt.memory_report()
            return report["total"], report
        if isinstance(self.opt, MasterAdamW):
            return self.opt.state_bytes(), None
        return _state_tensor_bytes(self.opt), None


def build(c: Contender, init: TinyGPT, dtype: torch.dtype, device: torch.device) -> Trainer:
    module = copy.deepcopy(init).to(device=device, dtype=dtype)
    params = list(module.parameters())
    mixed = dtype != torch.float32
    # DDP's defaults but for broadcast_buffers: the model's one buffer is its constant causal mask.
    ddp_kw = dict(broadcast_buffers=False, device_ids=[device.index] if device.type == "cuda" else None)
    if c.optimizer == "AdamW":
        opt = MasterAdamW(params, other_kernel=c.other_kernel)
        config = f"DDP + {opt.kind}" + (" over fp32 masters" if mixed else "")
        return Trainer(module, DistributedDataParallel(module, **ddp_kw), opt, config)
    if c.optimizer == "FusedAdam":
        opt = distopt.FusedAdam(params, LR, BETAS, EPS, WEIGHT_DECAY, master_weights=mixed)
        config = f"DDP + FusedAdam(master_weights={mixed})"
        return Trainer(module, DistributedDataParallel(module, **ddp_kw), opt, config)
    opt = distopt.DistributedFusedAdam(
        params, LR, BETAS, EPS, WEIGHT_DECAY, overlap_param_sync=c.overlap_param_sync, store_params=mixed
    )
    config = f"overlap_param_sync={c.overlap_param_sync}, store_params={mixed}, bucket_cap_mb={opt.bucket_cap_mb:g}"
    return Trainer(module, module, opt, config)


def release(device: torch.device) -> None:
    """Frees a dropped contender now: DistributedFusedAdam's hooks make reference cycles (and its
    overlap_param_sync forward pre-hook is global until the optimizer is collected)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
