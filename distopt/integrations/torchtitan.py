"""torchtitan: ``DistoptOptimizersContainer``, torchtitan's ``OptimizersContainer`` that also builds
``distopt.FusedAdam``.

torchtitan (0.3) names each param group's optimizer in its config and builds it from a fixed table
(Adam, AdamW, DistMuon). This subclass adds ``optimizer_name="FusedAdam"``; everything else is
torchtitan's: FQN-keyed flat state dicts for ``torch.distributed.checkpoint`` (FusedAdam's state of an
FSDP2 or tensor-parallel model is DTensors laid out as the params, as AdamW's), ``zero_grad``, step
hooks, LR schedulers, and the trainer's ``clip_grad_norm_`` (``p.grad`` stays the DTensor FSDP2 wrote).

    optimizer=DistoptOptimizersContainer.Config(param_groups=[ParamGroupConfig(
        pattern=r".*", optimizer_name="FusedAdam",  # was: OptimizersContainer.Config(... "AdamW" ...)
        optimizer_kwargs={"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1})])

FusedAdam is always fused: the config's ``implementation`` ("fused", "foreach", "for-loop") changes
nothing for it, except ``"fused_opt_states_bf16"``, whose bf16 moments torchtitan makes only for
torch's Adam/AdamW: refused for FusedAdam rather than silently keeping fp32 moments.
Importing this module imports torchtitan (importing distopt does not).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torchtitan.components.optimizer import OptimizersContainer

from distopt import FusedAdam

__all__ = ["DistoptOptimizersContainer", "FUSED_ADAM"]

FUSED_ADAM = "FusedAdam"  # the optimizer_name of a ParamGroupConfig that builds distopt.FusedAdam

# The hook overridden below (torchtitan 0.3): without it the name would never be looked up here and
# building would fail with torchtitan's "Optimizer FusedAdam not added": refuse to load instead.
if not callable(getattr(OptimizersContainer, "_resolve_optimizer_factory", None)):
    raise ImportError("distopt.integrations.torchtitan needs torchtitan>=0.3 "
                      "(OptimizersContainer._resolve_optimizer_factory)")


class DistoptOptimizersContainer(OptimizersContainer):
    """torchtitan's ``OptimizersContainer`` with ``optimizer_name="FusedAdam"`` (see the module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):  # torchtitan's build() constructs the class declaring Config
        pass

    def __init__(self, config: Config, *, model_parts: list[torch.nn.Module]) -> None:
        if config.implementation == "fused_opt_states_bf16" and any(
                g.optimizer_name == FUSED_ADAM for g in config.param_groups):
            raise ValueError("DistoptOptimizersContainer: implementation='fused_opt_states_bf16' makes bf16 moments "
                             "for torch's Adam/AdamW only; FusedAdam would keep fp32 moments. Use 'fused'.")
        super().__init__(config, model_parts=model_parts)

    @staticmethod
    def _resolve_optimizer_factory(name: str) -> Callable[..., Any]:
        if name == FUSED_ADAM:
            return FusedAdam
        return OptimizersContainer._resolve_optimizer_factory(name)
