"""What FusedAdam and DistributedFusedAdam share when loading a state dict: checking the saved
param groups against the optimizer's, and restoring their hyperparameters."""

from __future__ import annotations

from typing import Any

from ._validation import check_adam_hyperparameters

RESTORED = ("betas", "eps", "weight_decay", "adam_w_mode")


def check_saved_groups(groups: list[dict[str, Any]], saved_groups: Any) -> None:
    """Raises ValueError unless `saved_groups` can be loaded into `groups` (same number of groups and
    of params per group, valid hyperparameters, no amsgrad/maximize run)."""
    if not isinstance(saved_groups, list):
        raise ValueError("not an optimizer state dict: 'param_groups' must be a list")
    if len(saved_groups) != len(groups):
        raise ValueError(f"the checkpoint has {len(saved_groups)} param groups, the optimizer {len(groups)}")
    for group, saved in zip(groups, saved_groups):
        if len(saved["params"]) != len(group["params"]):
            raise ValueError(f"a saved param group has {len(saved['params'])} params, "
                             f"the optimizer's has {len(group['params'])}")
        if saved.get("amsgrad") or saved.get("maximize"):
            raise ValueError("cannot continue a run that used amsgrad or maximize")
        check_adam_hyperparameters(saved["lr"], saved["betas"], saved["eps"], saved["weight_decay"])


def restore_hyperparameters(groups: list[dict[str, Any]], saved_groups: list[dict[str, Any]]) -> None:
    """Copies lr, betas, eps, weight_decay and adam_w_mode (a torch group's decoupled_weight_decay
    sets it) from the saved groups. A tensor lr (capturable) is filled in place, so a captured CUDA
    graph keeps reading it."""
    for group, saved in zip(groups, saved_groups):
        for key in RESTORED:
            if key in saved:
                group[key] = tuple(saved[key]) if key == "betas" else saved[key]
        if "decoupled_weight_decay" in saved:
            group["adam_w_mode"] = bool(saved["decoupled_weight_decay"])
        lr = float(saved["lr"])
        if hasattr(group["lr"], "fill_"):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr
