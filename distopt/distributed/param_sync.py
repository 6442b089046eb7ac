"""Parameter synchronisation: all-gathering the updated shards back into the model params.

After a step every bucket's param buffer holds this rank's updated slice. Either all buckets are
gathered at once (blocking), or, with ``overlap_param_sync``, each waits for the forward pass: one
global forward pre-hook (torch's public ``register_module_forward_pre_hook``: the optimizer needs no
model, and ``Parameter`` is not patched) gathers, before a module runs, the buckets holding the
params it owns. Gathers are launched in descending bucket order (buckets follow backward order, so
that is forward order) with the next one prefetched, so every rank issues the same collectives in the
same order whichever module asks first.

Note [no stale reads with overlap_param_sync]
A forward must never read a param whose updated value has not been gathered yet. Before a module
runs, the buckets holding the params it *needs* are gathered (with every bucket above them: forward
order). What a module needs is learnt once, by watching the first forward after the optimizer is
built: while a module's forward runs (from its pre-hook to its post-hook, children excluded), a
TorchFunctionMode records the params that torch functions receive, so a module needs its own params,
those of parameter containers below it (``nn.ParameterList``/``nn.ParameterDict``, whose forward
never runs) and whatever its own code reads functionally, such as another module's weight in
``F.linear(x, other.weight)``. A read in a parent's code between two children is the parent's need,
not the earlier child's: a later forward that skips that child (a layer used on some iterations
only) still gathers it in time. A
compiled module (``torch.compile(model)`` returns a wrapper; inside the traced code our hooks do
nothing) needs everything beneath it; a whole compiled training step reads params the same way, so
call ``opt.param_sync()`` before it.

Params that get a gradient but were never seen (read outside any module, before or after it) are
*orphans*: ``step()`` gathers their buckets at once, with the buckets above them, since gathers
always go in descending order; that keeps every rank's collectives in one order whatever each rank
learnt. If a gradient arrives for a param whose bucket was not gathered since the last step, the
forward provably read a stale value (a dynamic model, a model compiled in place): that raises,
naming the param and the remedy. A gather that lands after a read bumps the param's version counter,
so autograd refuses a backward through a stale value it saved ("modified by an inplace operation").
Only a read that saves nothing for backward (an addition), made by a module's code that did not run in
the watched forward, whose gather lands later in the same forward, escapes all three.

A state-dict pre-hook on every module holding our params finishes the pending gathers, so
``model.state_dict()`` right after ``step()`` holds the updated params.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from torch.overrides import TorchFunctionMode

from .buckets import BucketRuntime
from .comm import Comm
from .layout import Layout

try:  # the wrapper torch.compile(module) returns
    from torch._dynamo.eval_frame import OptimizedModule
except ImportError:  # pragma: no cover - torch without dynamo
    OptimizedModule = ()

_CONTAINERS = (nn.ParameterList, nn.ParameterDict)


def _owned(module: nn.Module) -> Iterator[Tensor]:
    """The params that must be current before `module` runs (see the Note)."""
    if isinstance(module, OptimizedModule):
        yield from module.parameters()
        return
    yield from module.parameters(recurse=False)
    for child in module.children():
        if isinstance(child, _CONTAINERS):
            yield from _owned(child)


class StaleParamError(RuntimeError):
    """A forward read a param before its updated value was gathered (overlap_param_sync)."""


class _UseRecorder(TorchFunctionMode):
    """Reports every param that a torch function receives (the observed forward only)."""

    def __init__(self, sync: ParamSync) -> None:
        super().__init__()
        self.sync = sync

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for a in (*args, *kwargs.values()):
            for t in (a if isinstance(a, (list, tuple)) else (a,)):
                if isinstance(t, Tensor):
                    self.sync._used(t)
        return func(*args, **kwargs)


class ParamSync:
    def __init__(self, comm: Comm, params: list[Tensor], overlap: bool, tensors: list[Tensor] | None = None) -> None:
        self.comm = comm
        self.params = params
        self.tensors = params if tensors is None else tensors  # what the gathers write (tensor_parallel.py)
        self.index = {p: i for i, p in enumerate(params)}
        self.overlap = overlap
        self.buckets: list[BucketRuntime] = []
        self.first_bucket: list[int] = []  # per param: the first bucket holding it (-1: no elements)
        self.pending: list[int] = []  # buckets still to gather, with overlap
        self._in_place_params: list[Tensor] | None = None  # the params of in_place buckets
        self.skip_if: Tensor | None = None  # capturable: the step was skipped, copy nothing back
        self.seen: set[int] = set()  # params some module needs (see the Note)
        self.orphans: set[int] = set()  # params that got a grad without being seen
        self._orphan_bucket: int | None = None  # lowest bucket holding an orphan
        self._needs: weakref.WeakKeyDictionary[nn.Module, set[int]] = weakref.WeakKeyDictionary()
        self._observe = overlap  # the next forward is watched
        self._recorder: _UseRecorder | None = None
        self._observed_root: nn.Module | None = None
        self._current: set[int] | None = None  # the needs of the module running now (observed forward)
        self._running: list[set[int]] = []  # the needs of the modules whose forward runs, outermost first
        self._observed_ours = False  # the watched forward touched our params
        self._handles: list[Any] = []
        # Without overlap the hooks stay only until a module holding our params runs (the DDP check).
        this = weakref.ref(self)

        # Inside a region torch.compile traces, the hooks do nothing (and break no graph): the
        # compiled module's own wrapper gathered everything before it ran (see the Note).
        def pre_hook(module: nn.Module, args) -> None:
            sync = this()
            if sync is not None and not torch.compiler.is_compiling():
                sync._before_forward(module)

        def post_hook(module: nn.Module, args, output) -> None:
            sync = this()
            if sync is not None and sync._recorder is not None and not torch.compiler.is_compiling():
                sync._after_forward(module)

        self._handles.append(nn.modules.module.register_module_forward_pre_hook(pre_hook))
        self._handles.append(nn.modules.module.register_module_forward_hook(post_hook, always_call=True))

    def attach(self, layout: Layout, buckets: list[BucketRuntime]) -> None:
        self.buckets = buckets
        self.first_bucket = [min((piece.bucket for piece in pieces), default=-1) for pieces in layout.param_pieces]
        self._update_orphan_bucket()

    # ------------------------------------------------------------------ forward hooks

    def _before_forward(self, module: nn.Module) -> None:
        needs = self._needs.get(module)
        if needs is None:
            needs = self._first_sight(module)
        if not self.overlap:
            return
        if self._observe and self._recorder is None and not isinstance(module, OptimizedModule):
            self.finish()  # the watched forward learns what each module needs: it must read current params
            self._observed_root = module
            self._recorder = _UseRecorder(self)
            self._recorder.__enter__()
        if self._recorder is not None:
            self._running.append(needs)
            self._current = needs
            self._observed_ours = self._observed_ours or bool(needs)
        if not self.pending:
            return
        first = [self.first_bucket[i] for i in needs if self.first_bucket and self.first_bucket[i] >= 0]
        if first:
            self._gather_for(min(first), "forward_wait")

    def _used(self, t: Tensor) -> None:
        i = self.index.get(t)
        if i is not None and self._current is not None and i not in self._current:
            self._current.add(i)
            self.seen.add(i)
            self._observed_ours = True

    def _after_forward(self, module: nn.Module) -> None:
        """The watched forward: a module returned, so what runs next is its parent's code."""
        if module is self._observed_root:
            self._stop_observing()
        elif self._running:
            self._running.pop()
            self._current = self._running[-1] if self._running else None

    def _stop_observing(self) -> None:
        recorder, self._recorder, self._observed_root, self._current = self._recorder, None, None, None
        self._running.clear()
        self._observe = not self._observed_ours  # a forward of another model: watch the next one
        recorder.__exit__(None, None, None)

    def _first_sight(self, module: nn.Module) -> set[int]:
        needs = {self.index[p] for p in _owned(module) if p in self.index}
        ours = [self.index[p] for p in module.parameters() if p in self.index]
        if ours and isinstance(module, DistributedDataParallel):  # refused at every call, never remembered
            raise ValueError(
                f"param {ours[0]} of DistributedFusedAdam is inside a DistributedDataParallel module: the optimizer "
                "reduce-scatters gradients itself, so DDP would reduce them twice (and torch's clip_grad_norm_ "
                "would see no .grad). Train the bare model (ddp.module), without the DDP wrapper.")
        self._needs[module] = needs
        self.seen.update(needs)
        if ours and not self.overlap:
            self.close()  # the model runs: nothing more to check
        elif ours:
            this = weakref.ref(self)

            def finish_first(*args, **kwargs) -> None:
                sync = this()
                if sync is not None:
                    sync.finish()

            # Saving must see the updated params, and loading must not be overwritten by a gather
            # landing later. A compiled wrapper's inner modules never run eagerly: hook the module it
            # wraps too.
            for m in (module, *module.children()) if isinstance(module, OptimizedModule) else (module,):
                self._handles.append(m.register_state_dict_pre_hook(finish_first))
                self._handles.append(m.register_load_state_dict_pre_hook(finish_first))
        return needs

    def _gather_for(self, bucket: int, event: str) -> None:
        if bucket <= max(self.pending):
            self.comm.event(event, bucket)
            self.gather_through(bucket)

    def check_fresh(self, i: int) -> None:
        """Called as param `i`'s gradient arrives: learns orphans, refuses a gradient computed from a
        stale value (see the Note)."""
        if not self.overlap:
            return
        if self.first_bucket and self.first_bucket[i] in self.pending:
            p = self.params[i]
            raise StaleParamError(
                f"DistributedFusedAdam(overlap_param_sync=True): param {i} (shape {tuple(p.shape)}, {p.dtype}) got a "
                "gradient from a forward that read it before its updated value was gathered after the last step(), "
                "so that forward used the stale pre-step value. This happens when a param is read before any "
                "module runs, when the forward differs from the first one watched (a dynamic model), or with a "
                "model compiled in place (module.compile()). Call opt.param_sync() before such a forward, or "
                "construct the optimizer with overlap_param_sync=False."
            )
        if i not in self.seen and i not in self.orphans:
            self.orphans.add(i)
            self._update_orphan_bucket()

    def _update_orphan_bucket(self) -> None:
        first = [self.first_bucket[i] for i in self.orphans if self.first_bucket and self.first_bucket[i] >= 0]
        if first:
            self._orphan_bucket = min(first)

    # ------------------------------------------------------------------ gathers

    def after_step(self, skip_if: Tensor | None, publish: bool = False) -> None:
        """The update wrote every bucket's local slice: gather now, or leave it to the next forward.
        Buckets the update left current (``in_place``: one rank) need nothing but the version bump a
        gather gives, unless `publish` (a checkpoint load wrote their param slices, not the params)."""
        self.skip_if = skip_if
        gather = [b.index for b in self.buckets if publish or not b.in_place]
        if len(gather) < len(self.buckets):
            if self._in_place_params is None:
                self._in_place_params = [self.params[i] for b in self.buckets if b.in_place for i in sorted(b.params)]
            torch.autograd.graph.increment_version(self._in_place_params)
        if self.overlap:
            self.pending = gather
            if self._orphan_bucket is not None and gather:  # read with no module to wait in: gather now
                self._gather_for(self._orphan_bucket, "step_gathers_orphans")
            return
        for index in gather:
            self.buckets[index].launch_gather(self.comm)
        for index in gather:
            self._finish(self.buckets[index])

    def finish(self) -> None:
        """Completes every deferred gather."""
        self.gather_through(0)

    def gather_through(self, last: int) -> None:
        """Launches pending gathers in descending order down to bucket `last` plus one prefetch, then
        finishes those >= `last`."""
        if not self.pending:
            return
        prefetch_to = max(last - 1, 0)
        for index in sorted(self.pending, reverse=True):
            b = self.buckets[index]
            if index >= prefetch_to and not b.gathering:
                b.launch_gather(self.comm)
        for index in sorted(self.pending, reverse=True):
            if index < last:
                break
            self._finish(self.buckets[index])
            self.pending.remove(index)

    def _finish(self, bucket: BucketRuntime) -> None:
        """Lands a gather in the params and bumps their version counters, as an in-place update by a
        torch optimizer does: autograd then refuses a backward through a value read before it landed."""
        bucket.finish_gather(self.comm, self.tensors, self.skip_if)
        torch.autograd.graph.increment_version([self.params[i] for i in sorted(bucket.params)])

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def __del__(self) -> None:
        self.close()
