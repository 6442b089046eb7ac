"""DistributedFusedAdam as a torch.optim optimizer: torch.optim.AdamW's options and torch's
state-dict hooks (the step hooks come with torch.optim.Optimizer's own step wrapper).

Every AdamW keyword is accepted where it is supported (``maximize``; ``decoupled_weight_decay``,
the same switch as apex's ``adam_w_mode``) or changes nothing here (``foreach`` and ``fused`` choose
torch's implementation; the update is always the fused kernel). The rest is refused with a
ValueError (distopt/_validation.py, shared with FusedAdam): at construction, and for a param-group
key changed afterwards, at the next ``step()``, before anything is touched. ``capturable`` is set
for the whole optimizer: its param-group key only mirrors it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .._validation import check_adamw_options, weight_decay_mode


def option_defaults(adam_w_mode: bool | None, decoupled_weight_decay: bool | None, maximize: bool, amsgrad: bool,
                    foreach: bool | None, fused: bool | None, differentiable: bool, capturable: bool) -> dict[str, Any]:
    """The param-group keys torch.optim.AdamW has (and apex's adam_w_mode), checked."""
    mode = weight_decay_mode(adam_w_mode, decoupled_weight_decay, "DistributedFusedAdam: ")
    options = dict(adam_w_mode=mode, decoupled_weight_decay=mode, maximize=maximize, amsgrad=amsgrad,
                   foreach=foreach, fused=fused, differentiable=differentiable, capturable=capturable)
    check_group_options(options, capturable, "DistributedFusedAdam: ")
    return options


def reconcile_group(group: dict[str, Any], index: int) -> None:
    """A param group given with either name of the weight-decay switch gets both, agreeing (not the
    optimizer's default for the other name)."""
    if not isinstance(group, dict):
        return  # torch's add_param_group refuses it
    given = (group.get("adam_w_mode"), group.get("decoupled_weight_decay"))
    if given != (None, None):
        group["adam_w_mode"] = group["decoupled_weight_decay"] = weight_decay_mode(*given, f"param group {index}: ")


def check_group_options(group: dict[str, Any], capturable: bool, where: str = "") -> None:
    """ValueError for an option value this optimizer cannot honour."""
    check_adamw_options(group, where)
    if "capturable" in group and bool(group["capturable"]) != capturable:
        raise ValueError(f"{where}capturable={group['capturable']} in a param group: capturable is set for the "
                         f"whole optimizer (constructed with capturable={capturable})")


def check_groups(groups: list[dict[str, Any]], capturable: bool) -> None:
    for i, g in enumerate(groups):
        check_group_options(g, capturable, f"param_groups[{i}]: ")


def state_dict_with_hooks(opt: torch.optim.Optimizer, make: Callable[[], dict | None]) -> dict | None:
    """``make()`` between torch's state-dict pre and post hooks, as ``Optimizer.state_dict`` runs
    them (post hooks only where there is a state dict: gather_on_rank0 gives None elsewhere)."""
    for pre_hook in opt._optimizer_state_dict_pre_hooks.values():
        pre_hook(opt)
    sd = make()
    for post_hook in opt._optimizer_state_dict_post_hooks.values() if sd is not None else ():
        result = post_hook(opt, sd)
        sd = sd if result is None else result
    return sd


def load_with_hooks(opt: torch.optim.Optimizer, state_dict: Any, load: Callable[[Any], None]) -> None:
    """``load(state_dict)`` between torch's load-state-dict pre hooks (which may replace the dict) and
    post hooks, as ``Optimizer.load_state_dict`` runs them."""
    state_dict = state_dict.copy() if isinstance(state_dict, dict) else state_dict  # hooks may edit it
    for pre_hook in opt._optimizer_load_state_dict_pre_hooks.values():
        result = pre_hook(opt, state_dict)
        state_dict = state_dict if result is None else result
    load(state_dict)
    for post_hook in opt._optimizer_load_state_dict_post_hooks.values():
        post_hook(opt)
