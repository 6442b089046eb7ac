"""What FusedAdam and DistributedFusedAdam share when loading a state dict: checking the saved
param groups against the optimizer's, restoring their hyperparameters, the per-tensor CRC-32
checksums that catch a corrupted state dict before it is loaded, and torch's per-param state
converted into FusedAdam's layout."""

from __future__ import annotations

import ctypes
import zlib
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from .dtensor import is_dtensor, placed_like
from .lowprec.formats import SEED_KEY, moments_named
from .validation import check_adam_hyperparameters

RESTORED = ("betas", "eps", "weight_decay")
# Param-group keys that stay the loading optimizer's: how it runs (its implementation switches, capturable,
# which only mirrors the optimizer's own setting), options it refuses (checked: False in the saved groups),
# and what is restored by its own rules below or elsewhere (the stochastic-rounding seed:
# lowprec.formats.MomentFormats.restore_seeds). Every other saved key comes back, as torch.optim restores
# every key (an LR scheduler's ``initial_lr``, user keys such as a group's name).
OWN_KEYS = frozenset({"params", "foreach", "fused", "capturable", "differentiable", "amsgrad", SEED_KEY,
                      "lr", "adam_w_mode", "decoupled_weight_decay", "maximize", "param_names", *RESTORED})


def _weight_decay_mode(saved: dict[str, Any]) -> bool | None:
    """The saved weight-decay switch: apex's adam_w_mode or torch's decoupled_weight_decay (None: neither)."""
    modes = {bool(saved[k]) for k in ("adam_w_mode", "decoupled_weight_decay") if saved.get(k) is not None}
    if len(modes) > 1:
        raise ValueError("a saved param group has adam_w_mode and decoupled_weight_decay that disagree")
    return modes.pop() if modes else None


def check_saved_groups(groups: list[dict[str, Any]], saved_groups: Any) -> None:
    """Raises ValueError unless `saved_groups` can be loaded into `groups` (same number of groups and
    of params per group, valid hyperparameters, no amsgrad run; a maximize run only into an optimizer
    whose groups have a ``maximize`` key, i.e. that supports it)."""
    if not isinstance(saved_groups, list):
        raise ValueError("not an optimizer state dict: 'param_groups' must be a list")
    if len(saved_groups) != len(groups):
        raise ValueError(f"the checkpoint has {len(saved_groups)} param groups, the optimizer {len(groups)}")
    for group, saved in zip(groups, saved_groups):
        missing = [k for k in ("params", "lr", "betas", "eps", "weight_decay") if not isinstance(saved, dict)
                   or k not in saved]
        if missing:
            raise ValueError(f"not an optimizer state dict: a saved param group lacks {missing}")
        if len(saved["params"]) != len(group["params"]):
            raise ValueError(f"a saved param group has {len(saved['params'])} params, "
                             f"the optimizer's has {len(group['params'])}")
        if saved.get("amsgrad"):
            raise ValueError("cannot continue a run that used amsgrad")
        if saved.get("maximize") and "maximize" not in group:
            raise ValueError("cannot continue a run that used maximize: this optimizer does not support it")
        _weight_decay_mode(saved)
        check_adam_hyperparameters(saved["lr"], saved["betas"], saved["eps"], saved["weight_decay"])


def restore_hyperparameters(groups: list[dict[str, Any]], saved_groups: list[dict[str, Any]]) -> None:
    """Gives the groups the saved groups' keys, as torch.optim does: every key but the optimizer's own
    (``OWN_KEYS``: foreach, fused, capturable, ...) as saved (an LR scheduler's ``initial_lr``, user
    keys), and one the saved group lacks removed; lr, betas, eps, weight_decay, the weight-decay switch
    (adam_w_mode, and decoupled_weight_decay where the group has that key: a torch group's sets both)
    and, into groups with that key, maximize (absent from a group saved before it existed: False); and
    ``param_names`` as torch.optim does: the saved names where there are some, else the group's own
    (if any). A tensor lr (capturable) is filled in place, so a captured CUDA graph keeps reading it."""
    for group, saved in zip(groups, saved_groups):
        for key in [k for k in group if k not in OWN_KEYS and k not in saved]:
            del group[key]
        group.update((k, v) for k, v in saved.items() if k not in OWN_KEYS)
        for key in RESTORED:
            if key in saved:
                group[key] = tuple(saved[key]) if key == "betas" else saved[key]
        if "param_names" in saved:
            group["param_names"] = list(saved["param_names"])
        mode = _weight_decay_mode(saved)
        if mode is not None:
            group["adam_w_mode"] = mode
            if "decoupled_weight_decay" in group:
                group["decoupled_weight_decay"] = mode
        if "maximize" in group:
            group["maximize"] = bool(saved.get("maximize", False))
        lr = float(saved["lr"])
        if hasattr(group["lr"], "fill_"):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr


# ---------------------------------------------------------------------- per-param state (FusedAdam)


def saved_state_by_param(groups: list[dict[str, Any]], state_dict: Any, where: str) -> list[tuple[Tensor, Any]]:
    """(param, its saved state) for every entry of a torch-format state dict (``state`` keyed by the
    saved groups' param ids), after checking the saved groups against `groups`; 8-bit codes saved under
    their own keys are back under their moment's (``lowprec.formats.moments_named``)."""
    if not isinstance(state_dict, dict):
        raise ValueError(f"{where}: expected a dict, got {type(state_dict).__name__}")
    saved_groups = state_dict.get("param_groups")
    saved_state = state_dict.get("state")
    if not isinstance(saved_state, dict):
        raise ValueError(f"{where}: expected a dict with 'state' and 'param_groups'")
    check_saved_groups(groups, saved_groups)
    id_map: dict[Any, Tensor] = {}
    for group, saved in zip(groups, saved_groups):
        id_map.update(zip(saved["params"], group["params"]))
    missing = [key for key in saved_state if key not in id_map]
    if missing:
        raise ValueError(f"loaded state refers to param {missing[0]!r}, which no param group holds")
    return [(id_map[key], moments_named(saved)) for key, saved in saved_state.items()]


def convert_param_state(p: Tensor, saved: Any, *, master: bool, new: Callable[[Tensor], Tensor],
                        step_device: torch.device) -> dict[str, Any]:
    """One param's saved state as FusedAdam holds it: moments (and, with `master`, the fp32 master,
    taken from `p` if not saved; without, a saved one is dropped) in new fp32 tensors from ``new(p)``
    (`p`'s shape and strides, where the state lives), whatever dtype they were saved in; ``step`` a
    float32 scalar on `step_device`."""
    if not isinstance(saved, dict):
        raise ValueError(f"loaded state for a param of shape {tuple(p.shape)} is not a dict")
    for name in ("step", "exp_avg", "exp_avg_sq"):
        if name not in saved:
            raise ValueError(f"loaded state for a param of shape {tuple(p.shape)} lacks {name!r}")
    out: dict[str, Any] = {}
    for name in ("exp_avg", "exp_avg_sq", "param") if master else ("exp_avg", "exp_avg_sq"):
        value = saved.get(name)
        if value is None:
            continue
        if tuple(value.shape) != tuple(p.shape):
            raise ValueError(f"loaded {name} has shape {tuple(value.shape)}, its param {tuple(p.shape)}")
        out[name] = new(p).copy_(placed_like(p, value, name))  # a DTensor param's: on its mesh and placements
    if master and "param" not in out:
        out["param"] = new(p).copy_(p.detach())
    step = saved["step"]
    step_value = float(step.item() if isinstance(step, Tensor) else step)
    out["step"] = torch.tensor(step_value, dtype=torch.float32, device=step_device)
    return out


# ---------------------------------------------------------------------- checksums

CHECKSUMS = "checksums"  # the state dict's top-level key; torch.optim and FusedAdam ignore it


def tensor_crc32(t: Tensor) -> int:
    """CRC-32 of a tensor's bytes in row-major (logical) order: the same for a tensor and any copy
    of it in another memory format or on another device, different after any change of 1 to 32
    bits (and, for random damage, with probability 1 - 2**-32)."""
    t = t.detach().resolve_conj().resolve_neg().to("cpu").contiguous()
    if t.numel() == 0:
        return 0
    # A view of the tensor's memory as a buffer (no copy and no numpy needed).
    return zlib.crc32((ctypes.c_char * (t.numel() * t.element_size())).from_address(t.data_ptr()))


def state_checksums(state: dict[Any, dict[str, Any]]) -> dict[str, dict[str, int]]:
    """{str(param key): {state key: crc32}} for every plain tensor in an optimizer's per-param state.
    Keyed by text: torch.distributed.checkpoint loads a nested non-tensor value back under ``str(key)``
    (a template's int keys would keep the template's checksums). DTensors (of tensor-parallel params)
    have none: their local values differ by rank, and torch.distributed.checkpoint keeps one rank's
    copy of this dict."""
    return {str(k): {name: tensor_crc32(v) for name, v in entry.items() if _checksummed(v)}
            for k, entry in state.items()}


def _checksummed(value: Any) -> bool:
    return isinstance(value, Tensor) and not is_dtensor(value)


def check_state_checksums(state: dict[Any, dict[str, Any]], checksums: Any) -> None:
    """Raises ValueError unless every tensor of `state` has its recorded checksum (written by
    ``state_checksums`` when the state dict was made)."""
    hint = "(if it was changed on purpose, delete the state dict's 'checksums' entry)"
    if not isinstance(checksums, dict):
        raise ValueError(f"the state dict's 'checksums' entry is a {type(checksums).__name__}, not a dict")
    for k, entry in state.items():
        recorded = checksums.get(str(k), checksums.get(k))  # text keys since checksums were keyed by text
        for name, value in entry.items():
            if not _checksummed(value):
                continue
            expected = recorded.get(name) if isinstance(recorded, dict) else None
            if expected is None:
                raise ValueError(f"state {name!r} of param {k} has no recorded checksum {hint}")
            if tensor_crc32(value) != expected:
                raise ValueError(f"state {name!r} of param {k} does not match its checksum: the state dict "
                                 f"is corrupted {hint}")


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
