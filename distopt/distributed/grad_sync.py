"""Gradient synchronisation: from backward's hooks into the buckets and through the reduce-scatters.

Every param has a post-accumulate-grad hook that moves its fresh ``.grad`` into its bucket(s) and
frees it. Until the layout exists (the first backward) the hooks only record the order in which
grads arrive, which the layout then follows.

A synchronising backward (outside ``no_sync()``, with overlap on) is one *round*: buckets start their
reduce-scatter in index order as soon as all their params have delivered, and the round is closed
when backward ends (an autograd end-of-backward callback, as DDP uses) by starting the rest, with
zeros for params that got no grad. Every rank therefore issues the same collectives in the same
order, whatever its data. At most ``pipeline_size`` reductions are in flight; the oldest is waited
for before another starts.

A backward that raises never runs its end-of-backward callback, so its round stays open. Both ways
out close it by launching the buckets it had not launched, so every rank still issues the same
collectives whichever point its backward reached: ``zero_grad()`` (the caught exception is dropped
with its partial gradients: the next step is the one a run that skipped the iteration would take),
or the next ``sync()`` when training goes on without ``zero_grad()`` (the partial gradients stay
accumulated, as torch leaves them in ``.grad``).

Every synchronising iteration ends with the same collectives on every rank: ``sync()`` reports that
it closed one (the optimizer then confirms with one tiny all-reduce that no rank dropped its grads),
and ``clear()`` that it dropped one (an exception in backward, or ``zero_grad()`` without a step): it
still runs the iteration's reductions, and the optimizer reports the drop in the same all-reduce. If
only some ranks dropped theirs, every rank thus stops with the same error instead of pairing the
collectives of different iterations; as with DDP, the job must then restart.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch
from torch import Tensor

from .buckets import BucketRuntime, flat_like
from .comm import Comm
from .layout import Layout
from .tensor_parallel import as_grad, local_grad


class GradSync:
    def __init__(self, comm: Comm, params: list[Tensor], overlap: bool, pipeline_size: int,
                 contiguous_grad_buffer: bool, average: bool, tensors: list[Tensor] | None = None) -> None:
        self.comm = comm
        self.params = params
        self.tensors = params if tensors is None else tensors  # what the buckets hold (tensor_parallel.py)
        self.index = {p: i for i, p in enumerate(params)}
        self.overlap = overlap
        self.pipeline_size = pipeline_size
        self.contiguous = contiguous_grad_buffer
        self.divide_by = comm.data_parallel_size if average else 1
        self.layout: Layout | None = None
        self.buckets: list[BucketRuntime] = []
        self.arrival: list[int] = []  # first-backward order, recorded until the layout exists
        self._arrived: set[int] = set()
        self.version = 0  # bumped whenever a reduction lands in the grad shards
        self.in_no_sync = False
        self._next_launch = 0  # buckets launch strictly in index order on every rank
        self._round_open = False  # a synchronising backward is running (its round not yet closed)
        # Grads were accumulated outside a round (no_sync, overlap off, the first backward), so
        # sync() must run one. Depends only on the program's structure, so every rank agrees.
        self._needs_round = False
        self._in_flight: list[BucketRuntime] = []
        self._grad_views: set[int] = set()  # params whose .grad is a view of a contiguous grad buffer
        self.on_grad: Callable[[int], None] | None = None  # told of each param's grad before it is taken
        self._drop_queued = False  # a callback will take the grad views away at the end of backward
        self._iteration_open = False  # a synchronising backward ran since the last sync() / clear()
        # Each hook knows its param's index (a dict lookup would hash the tensor in Python, per param).
        self._hooks = [p.register_post_accumulate_grad_hook(functools.partial(self._hook, i))
                       for i, p in enumerate(params)]

    def attach(self, layout: Layout, buckets: list[BucketRuntime]) -> None:
        """The layout is built: move the first backward's grads (still in .grad) into the buckets."""
        self.layout, self.buckets = layout, buckets
        for i in self.arrival:
            if self.params[i].grad is not None:
                self._accumulate(i, self.params[i], syncing=False)
        self._needs_round = True

    def set_arrival(self, order: list[int]) -> None:
        self.arrival, self._arrived = list(order), set(order)

    # ------------------------------------------------------------------ backward

    def _hook(self, i: int, p: Tensor) -> None:
        if self.on_grad is not None:
            self.on_grad(i)
        if self.layout is None:
            if i not in self._arrived:
                self._arrived.add(i)
                self.arrival.append(i)
            return  # first backward: .grad stays until the layout is built
        if not self.in_no_sync and self._grad_views and not self._drop_queued:
            # a synchronising backward: when it ends, .grad must no longer expose the unreduced sums
            self._drop_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._drop_grad_views)
        self._iteration_open = self._iteration_open or not self.in_no_sync
        syncing = self.overlap and not self.in_no_sync
        if syncing and not self._round_open:
            self._round_open = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        self._accumulate(i, p, syncing)
        if not syncing:
            self._needs_round = True
            return
        while self._next_launch < len(self.buckets) and self.buckets[self._next_launch].ready():
            self._launch(self.buckets[self._next_launch])

    def _end_of_backward(self) -> None:
        """Closes the round: launches the buckets still waiting (missing grads count as zero)."""
        self._round_open = False
        self._launch_remaining()

    def _accumulate(self, i: int, p: Tensor, syncing: bool) -> None:
        """Moves p.grad into its bucket(s) and frees it (or leaves it a view of the bucket)."""
        grad = local_grad(p)  # a DTensor param's: its local part, laid out as the param's
        if grad.is_sparse:
            raise RuntimeError("DistributedFusedAdam does not support sparse gradients")
        if grad.requires_grad:  # backward(create_graph=True): the buckets take values, not history
            grad = grad.detach()
        pieces = self.layout.param_pieces[i]
        t = self.tensors[i]
        src = flat_like(grad, t) if len(pieces) > 1 else None  # one piece is the whole param
        was_view = i in self._grad_views
        for piece in pieces:
            bucket = self.buckets[piece.bucket]
            if bucket.launched:  # still reducing the previous micro-batch: finish it first
                self._in_flight.remove(bucket)
                self._finish(bucket)
            if was_view and flat_like(grad, t).data_ptr() != bucket.grad_view(piece).data_ptr():
                bucket.written.discard(i)  # autograd replaced our view by view + new grad: copy the sum
            if src is None:
                bucket.accumulate_param(piece, grad, t)
            else:
                bucket.accumulate(piece, src)
            if syncing:
                bucket.synced.add(i)
        if self.contiguous and self.in_no_sync and self.layout.param_pieces[i]:  # (none: no elements)
            piece = self.layout.param_pieces[i][0]  # contiguous buffers never split a param
            p.grad = as_grad(p, self.buckets[piece.bucket].grad_view(piece))
            self._grad_views.add(i)
        else:
            p.grad = None
            self._grad_views.discard(i)

    # ------------------------------------------------------------------ reductions

    def _launch(self, bucket: BucketRuntime) -> None:
        if bucket.launched:  # still reducing the previous round (no grad for it this round): land it first
            self._in_flight.remove(bucket)
            self._finish(bucket)
        while len(self._in_flight) >= self.pipeline_size:
            self._finish(self._in_flight.pop(0))
        for i in bucket.params:
            if i in self._grad_views:  # the buffer is about to be reduced: no more in-place accumulation
                self.params[i].grad = None
                self._grad_views.discard(i)
        bucket.launch_reduce_scatter(self.comm, self.divide_by)
        self._in_flight.append(bucket)
        self._next_launch += 1

    def _launch_remaining(self) -> None:
        while self._next_launch < len(self.buckets):
            self._launch(self.buckets[self._next_launch])
        self._next_launch = 0
        self._needs_round = False

    def _finish(self, bucket: BucketRuntime) -> None:
        bucket.finish_reduce_scatter(self.comm)
        self.version += 1

    def _drop_grad_views(self) -> None:
        """Takes away the .grad views of the contiguous buffer given out under no_sync(): outside it
        the sums are the optimizer's (the stock GradScaler.unscale_ would otherwise rescale them)."""
        self._drop_queued = False
        for i in self._grad_views:
            self.params[i].grad = None
        self._grad_views.clear()

    def sync(self) -> bool:
        """Starts the reduce-scatters backward did not (in bucket order) and waits for all. True if
        this closed a synchronising iteration."""
        self._drop_grad_views()
        if self._needs_round or self._round_open:  # open: a backward raised and its round was never closed
            self._round_open = False
            self._launch_remaining()
        while self._in_flight:
            self._finish(self._in_flight.pop(0))
        for b in self.buckets:  # offload: the shards' copies to the host have landed
            b.settle_grad()
        closed, self._iteration_open = self._iteration_open, False
        return closed

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        previous, self.in_no_sync = self.in_no_sync, True
        try:
            yield
        finally:
            self.in_no_sync = previous

    def clear(self) -> bool:
        """Drops every gradient: in flight (finished first: collectives cannot be cancelled),
        accumulated in buckets, reduced into shards, and in .grad. A synchronising iteration that was
        not synced yet (its backward raised, or no step follows it) still runs its reductions, so every
        rank issues the same collectives; True if it dropped one."""
        dropped = self._iteration_open and self.layout is not None
        if dropped:
            self.sync()
        while self._in_flight:
            self._finish(self._in_flight.pop(0))
        for b in self.buckets:
            b.settle_grad()  # offload: nothing may land in the host shard after it is dropped
            b.end_window()
            b.state.grad_valid = False
        self._next_launch = 0
        self._needs_round = False
        self._grad_views.clear()
        self._drop_queued = False
        for p in self.params:
            p.grad = None
        return dropped

    def zero_stale_shards(self) -> None:
        """Shards that received no reduction since the last step hold old data: zero them."""
        for b in self.buckets:
            if not b.state.grad_valid:
                b.state.grad.zero_()
                b.state.grad_valid = True
                self.version += 1
