"""DistributedFusedAdam as a torch.optim optimizer: torch.optim.AdamW's options (torch's state-dict
hooks run through distopt/state_dicts.py, shared with FusedAdam; the step hooks come with
torch.optim.Optimizer's own step wrapper).

Every AdamW keyword is accepted where it is supported (``maximize``; ``decoupled_weight_decay``,
the same switch as apex's ``adam_w_mode``) or changes nothing here (``foreach`` and ``fused`` choose
torch's implementation; the update is always the fused kernel). The rest is refused with a
ValueError (distopt/validation.py, shared with FusedAdam): at construction, and for a param-group
key changed afterwards, at the next ``step()``, before anything is touched. ``capturable`` is set
for the whole optimizer: its param-group key only mirrors it.
"""

from __future__ import annotations

from typing import Any

from ..validation import check_adamw_options, weight_decay_mode


def option_defaults(adam_w_mode: bool | None, decoupled_weight_decay: bool | None, maximize: bool, amsgrad: bool,
                    foreach: bool | None, fused: bool | None, differentiable: bool, capturable: bool) -> dict[str, Any]:
    """The param-group keys torch.optim.AdamW has (and apex's adam_w_mode), checked."""
    mode = weight_decay_mode(adam_w_mode, decoupled_weight_decay, "DistributedFusedAdam: ")
    options = dict(adam_w_mode=mode, decoupled_weight_decay=mode, maximize=maximize, amsgrad=amsgrad,
                   foreach=foreach, fused=fused, differentiable=differentiable, capturable=capturable)
    check_group_options(options, capturable, "DistributedFusedAdam: ")
    return options


def check_group_options(group: dict[str, Any], capturable: bool, where: str = "") -> None:
    """ValueError for an option value this optimizer cannot honour."""
    check_adamw_options(group, where)
    if "capturable" in group and bool(group["capturable"]) != capturable:
        raise ValueError(f"{where}capturable={group['capturable']} in a param group: capturable is set for the "
                         f"whole optimizer (constructed with capturable={capturable})")


def check_groups(groups: list[dict[str, Any]], capturable: bool) -> None:
    for i, g in enumerate(groups):
        check_group_options(g, capturable, f"param_groups[{i}]: ")
