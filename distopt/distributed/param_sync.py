"""Parameter synchronisation: all-gathering the updated shards back into the model params.

After a step every bucket's param buffer holds this rank's updated slice. Either all buckets are
gathered at once (blocking), or, with ``overlap_param_sync``, each waits for the forward pass: one
global forward pre-hook (torch's public ``register_module_forward_pre_hook``: the optimizer needs no
model, and ``Parameter`` is not patched) gathers, before any module that owns our params runs, the
buckets holding them. Gathers are launched in descending bucket order (buckets follow backward
order, so that is forward order) with the next one prefetched, so every rank issues the same
collectives in the same order whichever module asks first.
"""

from __future__ import annotations

import weakref

from torch import Tensor, nn

from .buckets import BucketRuntime
from .comm import Comm
from .layout import Layout


class ParamSync:
    def __init__(self, comm: Comm, params: list[Tensor], layout: Layout, buckets: list[BucketRuntime],
                 overlap: bool) -> None:
        self.comm = comm
        self.params = params
        self.buckets = buckets
        self.overlap = overlap
        self.pending: list[int] = []  # buckets still to gather, with overlap
        self.skip_if: Tensor | None = None  # capturable: the step was skipped, copy nothing back
        self._hook = None
        if overlap:
            first_bucket = {p: min(piece.bucket for piece in layout.param_pieces[i]) for i, p in enumerate(params)}
            this = weakref.ref(self)

            def pre_hook(module: nn.Module, args) -> None:
                sync = this()
                if sync is None or not sync.pending:
                    return
                needed = [first_bucket[p] for p in module.parameters(recurse=False) if p in first_bucket]
                if needed and min(needed) <= max(sync.pending):
                    sync.comm.event("forward_wait", min(needed))
                    sync.gather_through(min(needed))

            self._hook = nn.modules.module.register_module_forward_pre_hook(pre_hook)

    def after_step(self, skip_if: Tensor | None) -> None:
        """The update wrote every bucket's local slice: gather now, or leave it to the next forward."""
        self.skip_if = skip_if
        if self.overlap:
            self.pending = list(range(len(self.buckets)))
            return
        for b in self.buckets:
            b.launch_gather(self.comm)
        for b in self.buckets:
            b.finish_gather(self.comm, self.params, skip_if)

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
            self.buckets[index].finish_gather(self.comm, self.params, self.skip_if)
            self.pending.remove(index)

    def close(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def __del__(self) -> None:
        self.close()
