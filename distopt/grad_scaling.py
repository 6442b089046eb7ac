"""Deferred gradient scaling, clipping and GradScaler bookkeeping, shared by both optimizers.

Nothing here rewrites gradients. Unscaling and clipping only multiply device scalars that the fused
update applies as ``grad_scale``, and one L2-norm pass gives both the norm and the inf/nan flag. All of
it stays on the device (no host synchronisation), so it can be captured in a CUDA graph.

With the stock ``torch.amp.GradScaler``, each of these leaves the same params as the reference
``scaler.unscale_(opt); clip_grad_norm_(...); scaler.step(opt); scaler.update()``:
  1. ``opt.unscale_grads(grad_scaler=scaler); opt.clip_grad_norm(m); scaler.step(opt)``
  2. ``scaler.step(opt)`` alone
  3. ``scaler.unscale_(opt); opt.clip_grad_norm(m); scaler.step(opt)``: where the stock ``unscale_``
     saw no ``.grad`` of ours (DistributedFusedAdam moves grads into its buckets), the optimizer
     unscales them itself, exactly once: at the clip if it knows the scaler from an earlier step,
     otherwise at ``step``, which then redoes the clip with the true scale (and writes the corrected
     norm into the tensor the clip returned).
The scaler's per-optimizer state (``_per_optimizer_states``, ``OptState``) is read and written as
the scaler itself does; it has been stable since torch 1.6.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.amp.grad_scaler import OptState

CLIP_EPS = 1e-6  # as torch.nn.utils.clip_grad_norm_
_LAST = object()  # _raw_grad_norm's default subset: the norm last computed for these grads, whichever


def count_step(steps: list[Tensor], found_inf: Tensor | None) -> None:
    """Adds one to each step counter, or nothing where ``found_inf`` (a device scalar) is set, on the
    device: no host read, so a CUDA graph can capture it. ``alpha`` selects torch's Tensor overload; a
    0-dim tensor alone matches the Scalar one first, which reads it on the host (``.item()``)."""
    if found_inf is None:
        torch._foreach_add_(steps, 1)
    else:
        torch._foreach_add_(steps, 1 - found_inf, alpha=1)


@dataclass
class ScalingState:
    """What the grad scaling knows of the current iteration, and its caches. An object of its own, not
    attributes of the optimizer: torch 2.11's Dynamo cannot trace an attribute assignment on an optimizer
    (later torch can), and a compiled training step assigns these when it clips, unscales or steps."""

    unscaled: bool = False  # a loss-scale inverse was folded in this iteration
    clips: list[tuple[float, Tensor]] = field(default_factory=list)  # (max_norm, returned norm)
    raw_norm: Tensor | None = None  # norm of the grads as stored, before the deferred factors
    raw_norm_key: Any = None  # (_grads_key(), subset) when raw_norm was computed
    norm_reduction: Any = None  # the subclass's cache of how its grads' norms combine (FusedAdam: dtensor.py)

    def __getstate__(self) -> dict[str, Any]:
        # Pickles and deep copies drop the caches: they describe the original's grads and params.
        return {**self.__dict__, "raw_norm": None, "raw_norm_key": None, "norm_reduction": None}


class GradScaling:
    """Mixin: subclasses call ``_init_grad_scaling(device)`` and implement ``_norm_sq_and_flag``,
    ``_grads_key`` and ``_norm_index``."""

    # GradScaler.step then calls our step() directly instead of unscaling .grad itself and skipping it.
    _step_supports_amp_scaling = True

    def _init_grad_scaling(self, device: torch.device) -> None:
        self._inv_scale = torch.ones((), dtype=torch.float32, device=device)  # folded loss unscale
        self._clip_coef = torch.ones((), dtype=torch.float32, device=device)  # product of clip coefficients
        self._found_inf = torch.zeros((), dtype=torch.float32, device=device)
        self._scaling = ScalingState()
        self._scaler: weakref.ref | None = None

    # Subclasses: [sum of squares, nonzero if any inf/nan] of the grads as stored, over every rank; the
    # sum over the params of `subset` only (indices into _norm_index(); None: all), the flag over all.
    def _norm_sq_and_flag(self, subset: frozenset[int] | None = None) -> Tensor:
        raise NotImplementedError

    # Subclasses: a value that changes whenever the stored grads may have changed.
    def _grads_key(self):
        raise NotImplementedError

    # Subclasses: each param the norms cover -> its index (what `subset` holds).
    def _norm_index(self) -> dict[Tensor, int]:
        raise NotImplementedError

    def _reset_grad_scaling(self) -> None:
        """Starts a new iteration (after step, or on zero_grad)."""
        self._inv_scale.fill_(1.0)
        self._clip_coef.fill_(1.0)
        state = self._scaling
        state.raw_norm = None
        state.unscaled = False
        state.clips = []

    def _raw_grad_norm(self, subset=_LAST, force: bool = False) -> Tensor:
        """The norm of the grads as stored (before the deferred factors), cached until they change: of
        the params in `subset` (None: all), or by default the last one computed for these grads, of
        whichever params (apex's cache, which a clip after ``grad_norm(parameters=...)`` relies on),
        else of all. `force` recomputes. The inf/nan flag always covers every param."""
        key = self._grads_key()
        state = self._scaling
        cached = not force and state.raw_norm is not None and state.raw_norm_key[0] == key
        if subset is _LAST:
            if cached:
                return state.raw_norm
            subset = None
        elif cached and state.raw_norm_key[1] == subset:
            return state.raw_norm
        sq_and_flag = self._norm_sq_and_flag() if subset is None else self._norm_sq_and_flag(subset)
        state.raw_norm = sq_and_flag[0].sqrt()
        state.raw_norm_key = (key, subset)
        torch.clamp(sq_and_flag[1], max=1.0, out=self._found_inf)
        return state.raw_norm

    def _norm_subset(self, parameters) -> frozenset[int] | None:
        """The indices of `parameters` (a param or an iterable of them) in ``_norm_index()``; None if
        they are all of them. Params that do not require grad are left out (they have no gradient);
        any other tensor that is not one of the optimizer's params raises (apex does too)."""
        if isinstance(parameters, Tensor):
            parameters = [parameters]
        elif isinstance(parameters, (int, float)):
            raise TypeError(f"parameters must be a param or an iterable of params, got {parameters!r} (the "
                            "signatures are apex's: grad_norm(parameters=None, norm_type=2.0, force=False), "
                            "clip_grad_norm(max_norm, parameters=None, norm_type=2.0); pass norm_type by keyword)")
        index = self._norm_index()
        chosen = set()
        for j, p in enumerate(parameters):
            i = index.get(p) if isinstance(p, Tensor) else None
            if i is not None:
                chosen.add(i)
            elif not isinstance(p, Tensor) or p.requires_grad:
                what = f"a param of shape {tuple(p.shape)}" if isinstance(p, Tensor) else f"a {type(p).__name__}"
                raise ValueError(f"parameters[{j}] is {what} that this optimizer does not update: a grad norm "
                                 "covers the optimizer's own params only")
        return None if len(chosen) == len(index) else frozenset(chosen)

    def deferred_grad_scale(self) -> Tensor:
        """The factor the next update multiplies the stored grads by (inverse loss scale x clip)."""
        return self._inv_scale * self._clip_coef

    def grad_norm(self, parameters=None, norm_type: float = 2.0, force: bool = False) -> Tensor:
        """Global L2 norm of the gradients as the next update will apply them (unscaled, clipped):
        a float32 device tensor. Also sets the inf/nan flag (of every param). Cached until the grads
        change (`force` recomputes). As apex's: `parameters` (a subset of the optimizer's params, e.g.
        without the copies a model-parallel rank holds of replicated params) limits the sum to them;
        without it, the norm last computed for these grads is returned, of whichever params, so that
        ``grad_norm(parameters=...)`` then ``clip_grad_norm(max_norm)`` clips by the subset's norm."""
        if float(norm_type) != 2.0:
            raise NotImplementedError(f"grad_norm supports the L2 norm only, got norm_type={norm_type}")
        subset = _LAST if parameters is None else self._norm_subset(parameters)
        self._catch_up_with_scaler()
        return self._raw_grad_norm(subset, force) * self.deferred_grad_scale().abs()

    def clip_grad_norm(self, max_norm: float, parameters=None, norm_type: float = 2.0) -> Tensor:
        """Like ``torch.nn.utils.clip_grad_norm_``: returns the norm before clipping and scales the
        gradients (lazily, in the update) by ``min(1, max_norm / (norm + 1e-6))``. The norm is
        ``grad_norm(parameters)``'s (apex's signature)."""
        if float(norm_type) != 2.0:
            raise NotImplementedError(f"clip_grad_norm supports the L2 norm only, got norm_type={norm_type}")
        norm = self.grad_norm(parameters)
        self._scaling.clips.append((float(max_norm), norm))
        self._clip_coef.mul_(torch.clamp(max_norm / (norm + CLIP_EPS), max=1.0))
        return norm

    def unscale_grads(self, grad_scaler=None, inv_scale: float | Tensor | None = None) -> None:
        """Folds the inverse loss scale into the update (no pass over the grads) and records whether
        any grad is inf/nan (agreed by every rank) in ``grad_scaler``'s state, which it then marks
        unscaled, as ``GradScaler.unscale_`` would."""
        if grad_scaler is not None:
            state = grad_scaler._per_optimizer_states[id(self)]
            if state["stage"] is OptState.UNSCALED:
                raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
            if state["stage"] is OptState.STEPPED:
                raise RuntimeError("unscale_() is being called after step().")
            self._remember(grad_scaler)
            self._fold_unscale(grad_scaler._scale.double().reciprocal().float())
            self._record(grad_scaler)
        elif inv_scale is not None:
            self._fold_unscale(inv_scale)
            self._raw_grad_norm()  # sets the inf/nan flag
        else:
            raise ValueError("unscale_grads needs a grad_scaler or an inv_scale")

    def _fold_unscale(self, inv: float | Tensor) -> None:
        # A number or a device tensor: never a host-to-device copy, which CUDA-graph capture forbids.
        self._inv_scale.mul_(inv)
        if self._scaling.clips:  # clipped before the scale was known: redo the clips with it
            self._redo_clips()
        self._scaling.unscaled = True

    def _redo_clips(self) -> None:
        raw = self._raw_grad_norm()
        self._clip_coef.fill_(1.0)
        for max_norm, returned in self._scaling.clips:
            norm = raw * self.deferred_grad_scale().abs()
            returned.copy_(norm)
            self._clip_coef.mul_(torch.clamp(max_norm / (norm + CLIP_EPS), max=1.0))

    def _remember(self, scaler) -> None:
        self._scaler = weakref.ref(scaler)

    def _record(self, scaler) -> None:
        """Writes our (global) inf/nan flag into the scaler's state for this optimizer."""
        self._raw_grad_norm()
        state = scaler._per_optimizer_states[id(self)]
        # A copy: the scaler reads it in update(), after our next reset may have cleared the flag.
        state["found_inf_per_device"] = {self._found_inf.device: self._found_inf.clone()}
        state["stage"] = OptState.UNSCALED
        state["distopt_recorded"] = True

    def _scaler_skipped_us(self, scaler) -> bool:
        """The stock unscale_() ran this iteration without seeing any of our grads."""
        state = scaler._per_optimizer_states.get(id(self))
        return (state is not None and state["stage"] is OptState.UNSCALED and not state.get("distopt_recorded")
                and self._inv_scale.device not in state["found_inf_per_device"])

    def _catch_up_with_scaler(self) -> None:
        """Framework style: if a known scaler's stock unscale_() skipped our grads, unscale now."""
        scaler = self._scaler() if self._scaler is not None else None
        if scaler is not None and not self._scaling.unscaled and self._scaler_skipped_us(scaler):
            self._fold_unscale(scaler._scale.double().reciprocal().float())
            self._record(scaler)

    def _settle_with_scaler(self, scaler) -> Tensor:
        """At step(grad_scaler=...): make sure the grads were unscaled exactly once and the scaler
        holds our global inf/nan flag; returns the flag."""
        self._remember(scaler)
        state = scaler._per_optimizer_states[id(self)]
        if state["stage"] is OptState.READY:
            self.unscale_grads(grad_scaler=scaler)
        elif self._scaler_skipped_us(scaler):
            self._fold_unscale(scaler._scale.double().reciprocal().float())
            self._record(scaler)
        else:
            self._record(scaler)  # the stock unscale_ handled .grad; every rank must still agree on inf
        return self._found_inf
