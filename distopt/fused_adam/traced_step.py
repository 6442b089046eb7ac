"""FusedAdam's step as torch.compile traces it: the state created before the graph reads it, lr and
the step counts handed to the kernel as tensors, and torch's ``zero_grad`` in a form Dynamo traces.

A mixin of FusedAdam (optimizer.py), whose ``step()`` and ``zero_grad()`` come here when
``torch.compiler.is_compiling()``; the kernel lists are FusedAdam's own (``_buckets``, ``_lists``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import kernel_views as views
from .. import ops
from ..grad_scaling import count_step


class TracedStep:
    """FusedAdam's traced step (see the module docstring)."""

    def _init_group(self) -> None:
        """Creates the state of every param that has a gradient, with the steps on the params' device.

        Dynamo runs an optimizer's ``_init_group`` as plain Python while tracing and only then builds
        its view of ``self.state``, so the state exists before the graph reads it: one compile, not one
        before and one after the first step. Hence one call for all groups, before any state is read
        (a state created after Dynamo's view was built would be created again inside the graph).
        """
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    state = self._init_state(p)
                    if state["step"].device != p.device:  # Dynamo moves them too (the op reads them there)
                        state["step"] = state["step"].to(p.device)

    def _step_traced(self, work, grad_scale: Tensor | None, found_inf: Tensor | None) -> None:
        """step()'s update of `work` ((group, params with a gradient, their gradients) per group)."""
        self._init_group()
        for work_round in views.rounds(work):  # one, unless a group lists a param twice
            for group, params, grads in work_round:
                if params:
                    self._step_group_traced(group, params, grads, grad_scale, found_inf)

    def _step_group_traced(self, group, params, grads, grad_scale, found_inf) -> None:
        """One group's update: lr and the step counts reach the kernel as tensors (the op reads them on
        the device), so the graph neither reads them back (.item() breaks it) nor guards on them."""
        hyper = self._hyper(group, grad_scale)
        lr = group["lr"]
        if isinstance(lr, Tensor):
            lr = lr.to(device=self._device, dtype=torch.float32).reshape(())
        else:  # a number: a constant, or after Dynamo has seen it change, a symbolic float
            lr = torch.full((), lr, dtype=torch.float32, device=self._device)
        for key, entries in self._buckets(params, grads, eager=False).items():
            steps = [e[2]["step"] for e in entries]
            count_step(steps, found_inf)
            lists, staged = self._lists(entries, key, group)
            ops.adam_step_(**lists, lr=lr, step=steps, found_inf=found_inf, **hyper)
            views.write_back(staged)

    def _zero_grad_traced(self, set_to_none: bool) -> None:
        """What torch.optim.Optimizer.zero_grad does (torch excludes it from tracing: a graph break)."""
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                    continue
                if p.grad.grad_fn is not None:
                    p.grad.detach_()
                else:
                    p.grad.requires_grad_(False)
                p.grad.zero_()
