"""FusedAdam's general step: every gradient checked, missing state created, and the params sorted into
kernel calls (one per dtypes, need of views, and for the eager op, step number) with their lists built
anew. A step goes this way when there is no step plan (the first step, or after the structure changed)
or when the plan does not fit the gradients (plan.py); the plan is then built from what it did.

A mixin of FusedAdam (optimizer.py), like TracedStep (traced_step.py), which builds its calls with the
same ``_buckets`` and ``_lists``.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch import Tensor

from .. import dtensor, ops
from .. import kernel_views as views
from ..grad_scaling import count_step
from .moments import MomentState, element_offset


class GeneralStep:
    """FusedAdam's general step (see the module docstring)."""

    def _work(self) -> list[tuple[dict, list[Tensor], list[Tensor]]]:
        """(group, params with a gradient, their checked gradients) per group: the general step's lists."""
        work = []
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            # Also params put into param_groups after construction (accelerate's FSDP2 preparation swaps the
            # DTensors in), which add_param_group never saw.
            dtensor.check_params(params, "FusedAdam", self.offload_optimizer)
            self._moments.check_params([dict(params=params)], master_weights=None)  # (a step's params only)
            work.append((group, params, [self._check_grad(p) for p in params]))
            dtensor.check_states(params, self.state)
        return work

    @staticmethod
    def _check_grad(p: Tensor) -> Tensor:
        p, g = dtensor.local_param_and_grad(p)  # a DTensor param's: the local shards, laid out alike
        if g.is_sparse:
            raise RuntimeError("FusedAdam does not support sparse gradients")
        if g.is_complex() != p.is_complex() or g.dtype not in views.DTYPES:
            raise RuntimeError(f"FusedAdam: gradients must be float32, float16 or bfloat16 (complex for complex "
                               f"params), got {g.dtype} for a {p.dtype} param")
        if g.shape != p.shape or g.device != p.device:
            raise RuntimeError(f"FusedAdam: a gradient of shape {tuple(g.shape)} on {g.device} does not match "
                               f"its param ({tuple(p.shape)} on {p.device})")
        if g.stride() == p.stride() and p.is_contiguous():
            return g
        return views.in_layout(p, g)  # the kernel walks every list in the param's memory order

    def _buckets(self, params, grads, eager: bool) -> dict[tuple, list[tuple]]:
        """(param, grad, state, (position in param_groups, element offset)) per kernel call: one per dtypes
        (moments' too), need of views (and eager: step number, which the eager op takes as a number)."""
        positions = {id(q): i for i, q in enumerate(q for group in self.param_groups for q in group["params"])}
        buckets: dict[tuple, list[tuple]] = defaultdict(list)
        for p, g in zip(params, grads):
            where = (positions[id(p)], element_offset(p))
            p, g, state = dtensor.local_entry(p, g, self._init_state(p))  # a DTensor param's: its local shards
            key = (p.dtype, g.dtype, "param" in state, views.needs_view(p), state["exp_avg"].dtype,
                   state["exp_avg_sq"].dtype)
            if eager:
                key += (int(state["step"].item()),)
            buckets[key].append((p, g, state, where))
        return buckets

    def _lists(self, entries: list[tuple], key: tuple, group: dict) -> tuple[dict[str, Any], list]:
        """The kernel's lists for one bucket (moment formats' arguments too), and what to write back after it."""
        has_master = key[2]
        states = [e[2] for e in entries]
        lists = dict(params=[s["param"] if has_master else e[0] for e, s in zip(entries, states)],
                     grads=[e[1] for e in entries], exp_avgs=[s["exp_avg"] for s in states],
                     exp_avg_sqs=[s["exp_avg_sq"] for s in states],
                     param_outs=[e[0] for e in entries] if has_master else ())
        lists, staged = views.kernel_lists(**lists) if key[3] else (lists, ())
        lists.update(self._moments.call_kwargs(*MomentState.kernel_scales(states), [e[3][0] for e in entries],
                                               [e[3][1] for e in entries], group))
        return lists, staged

    def _step_group(self, index: int, group, params, grads, grad_scale, found_inf) -> None:
        hyper = self._hyper(group, grad_scale)
        for key, entries in self._buckets(params, grads, eager=not self.capturable).items():
            lists, staged = self._lists(entries, key, group)
            steps = [e[2]["step"] for e in entries]
            if self.capturable:
                lr = self._capturable_lr(index)
                count_step(steps, found_inf)
                ops.adam_step_(**lists, lr=lr, step=steps, found_inf=found_inf, **hyper)
            else:
                ops.adam_step_(**lists, lr=float(group["lr"]), step=key[-1] + 1, **hyper)
                torch._foreach_add_(steps, 1)
            views.write_back(staged)
