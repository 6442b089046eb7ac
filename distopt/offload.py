"""Host memory for offloaded optimizer state, and the copies between it and the params' device.

With ``offload_optimizer=True`` the fp32 masters and both moments live in host memory (pinned when the
params are on a GPU, so copies are asynchronous DMA), gradients are copied to the host, the fused CPU
kernel updates them there, and the updated params are copied back. This module owns the host buffers
and the copies; the optimizers decide what goes where.

Ordering (Note [Offload copies]):
  * device -> host (``to_host``) runs on a side stream that first waits for everything queued on the
    current stream so far (the reduction or backward that produced the source), so it overlaps the
    work queued after it. The source is kept alive for that stream (``record_stream``); the returned
    ``Landing`` is waited on (``wait``) before the host reads the destination.
  * host -> device (``to_device``) runs on the current stream, so the kernels and collectives queued
    after it (the param all-gather, the next forward) see the new values. The host must not rewrite
    the source before the returned ``Landing`` has been waited on.
  * On a CPU "device" (tests, CPU training) both are plain copies: the same code path, run eagerly.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .kernel_views import layout_strides

HOST = torch.device("cpu")


class Landing:
    """An asynchronous copy in flight; ``wait()`` blocks the host until it has landed."""

    __slots__ = ("_event",)

    def __init__(self, event: torch.cuda.Event | None) -> None:
        self._event = event

    def wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()
            self._event = None


def _copy_now(srcs: list[Tensor], dsts: list[Tensor]) -> Landing:
    """A CPU "device": both directions are one plain multi-tensor copy, landed on return."""
    if dsts:
        torch._foreach_copy_(dsts, srcs)
    return Landing(None)


class HostTransfers:
    """Pinned host allocation and ordered asynchronous copies for the params' `device`."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pinned = device.type == "cuda"
        self._stream = torch.cuda.Stream(device) if self.pinned else None

    def empty(self, shape: tuple[int, ...] | int, dtype: torch.dtype) -> Tensor:
        """Uninitialised host memory (pinned for a GPU device)."""
        return torch.empty(shape, dtype=dtype, device=HOST, pin_memory=self.pinned)

    def zeros(self, shape: tuple[int, ...] | int, dtype: torch.dtype) -> Tensor:
        return self.empty(shape, dtype).zero_()

    def empty_like(self, t: Tensor, dtype: torch.dtype | None = None) -> Tensor:
        """Host memory with `t`'s shape and strides (channels_last stays channels_last; a `t` that is not
        dense gets contiguous ones)."""
        return torch.empty_strided(t.shape, layout_strides(t), dtype=dtype or t.dtype, device=HOST,
                                   pin_memory=self.pinned)

    def to_host(self, srcs: list[Tensor], dsts: list[Tensor]) -> Landing:
        """Starts copying device tensors `srcs` into host tensors `dsts` (same dtypes and shapes) after
        the work queued so far on the current stream; returns the copy to wait on."""
        if self._stream is None:
            return _copy_now(srcs, dsts)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            for dst, src in zip(dsts, srcs):
                dst.copy_(src, non_blocking=True)
        for src in srcs:
            src.record_stream(self._stream)  # the caching allocator must not reuse it before the copy
        event = torch.cuda.Event()
        event.record(self._stream)
        return Landing(event)

    def to_device(self, srcs: list[Tensor], dsts: list[Tensor]) -> Landing:
        """Copies host tensors `srcs` into device tensors `dsts` on the current stream (asynchronous
        from pinned memory); the result says when the host may rewrite `srcs`."""
        if self._stream is None:
            return _copy_now(srcs, dsts)
        for dst, src in zip(dsts, srcs):
            dst.copy_(src, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return Landing(event)
