"""Runtime buffers of one bucket on this rank: gradient accumulation and reduce-scatter, the shard of
optimizer state, and the parameter all-gather.

A bucket's life in one iteration:
  grads:  hooks accumulate param grads into ``grad_buffer`` (full bucket, grad_sync_dtype); when all of
          its params have arrived (or at grad_sync) it is averaged and reduce-scattered; the shard is
          added into ``state.grad`` (fp32) and the buffer released (kept if contiguous).
  update: the optimizer runs the fused kernel over ``state`` and writes this rank's slice of
          ``param_buffer`` (param_sync_dtype).
  params: the slice is all-gathered into ``param_buffer`` and copied into the model params (unless the
          params are views of a contiguous buffer already).
With offload (``transfers`` given), ``state`` lives in host memory: each reduced shard is copied to the
host as its reduction lands (``_land_grad``, folded in by ``settle_grad``), the host kernel updates the
state, and ``send_params`` copies the new param slice back to the device before the all-gather.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .. import ops
from ..lowprec.codecs import join_bf16_remainder, split_bf16_remainder
from ..lowprec.formats import from_float32, to_float32, zeros
from ..offload import HostTransfers, Landing
from .comm import Comm, Handle
from .layout import Bucket, Fragment, Piece


def flat(t: Tensor) -> Tensor:
    """The elements of a dense tensor in memory order, as a 1-D view (works for channels_last)."""
    return t.as_strided((t.numel(),), (1,))


def flat_like(grad: Tensor, param: Tensor) -> Tensor:
    """`grad` flattened in `param`'s memory order (a copy only when their strides differ)."""
    if grad.stride() != param.stride():
        grad = torch.empty_like(param, dtype=grad.dtype).copy_(grad)
    return flat(grad)


@dataclass
class ShardState:
    """This rank's shard of a bucket's optimizer state (flat, ``shard_numel`` elements each). The moments
    are fp32, or in the bucket's low-precision format (distributed/moments.py): bf16, or 8-bit codes
    with one fp32 absmax per 256 shard elements in ``exp_avg_scales``/``exp_avg_sq_scales``."""

    exp_avg: Tensor
    exp_avg_sq: Tensor
    grad: Tensor  # fp32 sum of the reduced grads since the last step
    master: Tensor | None  # fp32 master params (store_params)
    remainders: Tensor | None  # int16 low halves of the masters (store_param_remainders)
    grad_valid: bool = False  # False: `grad` holds stale data, the next reduction overwrites it
    exp_avg_scales: Tensor | None = None  # 8-bit exp_avg: absmax per block of 256 shard elements
    exp_avg_sq_scales: Tensor | None = None

    @classmethod
    def zeros(cls, numel: int, device: torch.device, master: bool, remainders: bool,
              host: HostTransfers | None = None,
              moments: tuple[torch.dtype, torch.dtype] = (torch.float32, torch.float32)) -> ShardState:
        """Zeroed state on `device`, or in `host` memory (offload: fp32 moments only)."""
        def z(dtype: torch.dtype) -> Tensor:
            return host.zeros(numel, dtype) if host is not None else torch.zeros(numel, dtype=dtype, device=device)

        if host is not None:  # offload keeps fp32 moments (low-precision ones are refused at construction)
            (m, m_scales), (v, v_scales) = (z(torch.float32), None), (z(torch.float32), None)
        else:
            (m, m_scales), (v, v_scales) = (zeros(numel, dtype, device, signed)
                                            for dtype, signed in zip(moments, (True, False)))
        return cls(exp_avg=m, exp_avg_sq=v, grad=z(torch.float32),
                   master=z(torch.float32) if master else None, remainders=z(torch.int16) if remainders else None,
                   exp_avg_scales=m_scales, exp_avg_sq_scales=v_scales)


class BucketRuntime:
    def __init__(
        self,
        index: int,
        spec: Bucket,
        fragments: tuple[Fragment, ...],
        rank: int,
        device: torch.device,
        grad_dtype: torch.dtype,
        param_dtype: torch.dtype,
        contiguous_grad_buffer: bool,
        contiguous_param_buffer: bool,
        keep_param_buffer: bool = False,
        local: bool = False,
        transfers: HostTransfers | None = None,
    ) -> None:
        self.index = index
        self.spec = spec
        self.fragments = fragments
        self.lo, self.hi = spec.shard_range(rank)
        self.device = device
        self.grad_dtype = grad_dtype
        self.param_dtype = param_dtype
        self.contiguous_grad = contiguous_grad_buffer
        self.contiguous_param = contiguous_param_buffer
        # A CUDA graph that gathers in the next forward reads the buffer its step wrote: it must stay.
        self.keep_param_buffer = contiguous_param_buffer or keep_param_buffer
        self.params = frozenset(p.param for p in spec.pieces)
        # One rank holds the whole bucket (its shard is the bucket): reductions are the identity, and
        # the update can write the model params themselves (see ``in_place``).
        self.local = local
        self.state: ShardState | None = None
        self.runs: list[tuple[int, int, int]] = []  # (param group, start, end) in the shard
        self.direct_cache: tuple | None = None  # in_place buckets' kernel lists (update.direct_entries)
        # Offload: the state is in host memory; the copies to and from it (see the module docstring).
        self.transfers = transfers
        self._grad_landing: tuple[Landing, Tensor | None, bool] | None = None  # (copy, staging, add?)
        self._grad_staging: Tensor | None = None  # host copy of a reduced shard not in fp32
        self.host_out: Tensor | None = None  # host param slice in param_sync_dtype (16-bit)
        self._params_sent: Landing | None = None  # the last copy of the param slice to the device

        self.grad_buffer: Tensor | None = None
        self.written: set[int] = set()  # params accumulated into grad_buffer in this window
        self.synced: set[int] = set()  # params that arrived in the current synchronising backward
        self.fresh = True  # grad_buffer must be zeroed before the next accumulation
        self.launched = False  # reduce-scatter started in this window
        self._rs_work: Handle | None = None
        self._rs_out: Tensor | None = None

        self.param_buffer: Tensor | None = None
        self._copy_plans: dict[str, tuple] = {}  # copy_lists' model sides and buffer geometry
        self._ag_work: Handle | None = None
        self._grad_offset = 0  # grad_buffer's storage offset (accumulate_param views it by offset)
        self._shard_views: dict[int, Tensor] = {}  # accumulate_param's views of state.grad, by param
        if contiguous_grad_buffer:
            self.grad_buffer = torch.zeros(spec.numel, dtype=grad_dtype, device=device)
        if contiguous_param_buffer:
            self.param_buffer = torch.zeros(spec.numel, dtype=param_dtype, device=device)

    # ------------------------------------------------------------------ gradients

    def grad_view(self, piece: Piece) -> Tensor:
        return self.grad_buffer[piece.bucket_offset : piece.bucket_offset + piece.numel]

    def _open_window(self) -> None:
        """A zeroed grad buffer for a new accumulation window: params that send nothing, and the
        padding, reduce as zeros. A one-rank bucket whose fp32 grad shard holds no reduced grads yet
        accumulates straight into that shard (its reduction is the identity: no buffer, no copy)."""
        if self._grad_landing is not None:  # offload: the last round's copy to the host may still read it
            self.settle_grad()
        if self.grad_buffer is None and self.local and self.grad_dtype == torch.float32 and not self.state.grad_valid \
                and self.transfers is None:
            # Not zeroed: a param's first grad is copied in, its padding is zero (nothing else
            # writes there), and the params that deliver none are zeroed at the launch.
            self.grad_buffer = self.state.grad
            self._grad_offset = self.grad_buffer.storage_offset()
        elif self.grad_buffer is None:
            self.grad_buffer = torch.zeros(self.spec.numel, dtype=self.grad_dtype, device=self.device)
            self._grad_offset = 0
        elif self.fresh:
            self.grad_buffer.zero_()
        self.fresh = False

    def accumulate(self, piece: Piece, flat_grad: Tensor) -> None:
        """Adds one piece of a param's grad (flat, memory order) into the bucket."""
        assert not self.launched, "finish the bucket's reduce-scatter before accumulating into it"
        self._open_window()
        src = flat_grad[piece.param_offset : piece.param_offset + piece.numel]
        view = self.grad_view(piece)
        if view.data_ptr() == src.data_ptr():
            pass  # the grad is already this view (contiguous_grad_buffer, accumulated in place)
        elif piece.param in self.written:
            view.add_(src)
        else:
            view.copy_(src)
        self.written.add(piece.param)

    def accumulate_param(self, piece: Piece, grad: Tensor, param: Tensor) -> None:
        """``accumulate`` for a piece that is the whole param: one strided copy (or add) of `grad`, in
        whatever layout autograd made it, into the param's elements in memory order (no flattening,
        no slicing: the per-param cost of every backward)."""
        assert not self.launched, "finish the bucket's reduce-scatter before accumulating into it"
        self._open_window()
        if self.grad_buffer is self.state.grad:  # a persistent buffer: its views are made once
            view = self._shard_views.get(piece.param)
            if view is None:
                view = self._shard_views[piece.param] = self.grad_buffer.as_strided(
                    param.shape, param.stride(), self._grad_offset + piece.bucket_offset)
        else:
            view = self.grad_buffer.as_strided(param.shape, param.stride(), self._grad_offset + piece.bucket_offset)
        if self.contiguous_grad and view.data_ptr() == grad.data_ptr():
            pass  # the grad is already this view (accumulated in place under no_sync)
        elif piece.param in self.written:
            view.add_(grad)
        else:
            view.copy_(grad)
        self.written.add(piece.param)

    def ready(self) -> bool:
        """Every param of the bucket has delivered its grad in this synchronising backward (and the
        bucket is not reducing an earlier one: a launch forgets who delivered, see below)."""
        return not self.launched and self.synced >= self.params

    def launch_reduce_scatter(self, comm: Comm, divide_by: int) -> None:
        """Averages (divides by the data-parallel size, as DDP does, before summing) and starts the
        reduce-scatter. Params that sent no grad count as zero (the buffer was zeroed)."""
        self._open_window()
        if divide_by != 1:
            self.grad_buffer.div_(divide_by)
        state = self.state
        if self.grad_buffer is state.grad:  # accumulated in place (see _open_window)
            for piece in self.spec.pieces if len(self.written) < len(self.params) else ():
                if piece.param not in self.written:
                    self.grad_view(piece).zero_()
        if self.local:
            self._rs_out = self.grad_buffer  # one rank: the reduce-scatter returns its input
        elif not state.grad_valid and self.grad_dtype == torch.float32 and self.transfers is None:
            self._rs_out = state.grad  # reduce straight into the fp32 grad shard
        else:
            self._rs_out = torch.empty(self.spec.shard_numel, dtype=self.grad_dtype, device=self.device)
        self._rs_work = comm.reduce_scatter(self._rs_out, self.grad_buffer, self.index)
        self.launched = True
        # The next synchronising backward must deliver every param again before this bucket is ready:
        # with reductions still in flight when it starts, stale arrivals would launch it early.
        self.synced.clear()

    def finish_reduce_scatter(self, comm: Comm) -> None:
        """Waits for the reduction, folds it into the fp32 grad shard, releases the buffer."""
        self._rs_work.wait()
        redundant = comm.all_reduce_redundant(self._rs_out, self.index)
        if redundant is not None:
            redundant.wait()
        comm.event("reduce_scatter_done", self.index)
        state = self.state
        if self.transfers is not None:
            self._land_grad(self._rs_out)
        elif self._rs_out is not state.grad:
            if state.grad_valid:
                state.grad.add_(self._rs_out)
            else:
                state.grad.copy_(self._rs_out)
        state.grad_valid = True
        self._rs_work = self._rs_out = None
        self.end_window()

    def _land_grad(self, shard: Tensor) -> None:
        """Offload: starts copying a reduced shard (on the device) to the host. An fp32 shard that is
        the first since the last step goes straight into the host grad shard; any other lands in
        staging and is folded in (added, or cast) by ``settle_grad``."""
        self.settle_grad()
        state = self.state
        if shard.dtype == torch.float32 and not state.grad_valid:
            self._grad_landing = (self.transfers.to_host([shard], [state.grad]), None, False)
        else:
            if self._grad_staging is None:
                self._grad_staging = self.transfers.empty(self.spec.shard_numel, shard.dtype)
            landing = self.transfers.to_host([shard], [self._grad_staging])
            self._grad_landing = (landing, self._grad_staging, state.grad_valid)

    def settle_grad(self) -> None:
        """Offload: waits for the shard copy in flight and folds it into the host grad shard. Every
        reader of ``state.grad`` runs after this (``GradSync.sync`` and ``clear`` call it)."""
        if self._grad_landing is None:
            return
        landing, staging, add = self._grad_landing
        self._grad_landing = None
        landing.wait()
        if staging is not None and add:
            self.state.grad.add_(staging)
        elif staging is not None:
            self.state.grad.copy_(staging)

    def update_outputs(self) -> Tensor | None:
        """Offload: the host buffer the update writes the param slice into (None where the slice is
        the fp32 masters themselves), once the last copy out of it has been read."""
        if self._params_sent is not None:
            self._params_sent.wait()
            self._params_sent = None
        if self.param_dtype == torch.float32:
            return None
        if self.host_out is None:
            self.host_out = self.transfers.empty(self.spec.shard_numel, self.param_dtype)
        return self.host_out

    def host_staging_bytes(self) -> int:
        """Offload: bytes of the host staging buffers allocated so far (16-bit grads and params)."""
        return sum(t.numel() * t.element_size() for t in (self._grad_staging, self.host_out) if t is not None)

    def send_params(self) -> None:
        """Offload: copies the updated param slice from the host to this rank's slice of the
        device param buffer (before its all-gather, which is queued after it on the same stream)."""
        src = self.host_out if self.param_dtype != torch.float32 else self.state.master
        self._params_sent = self.transfers.to_device([src], [self.local_param_slice()])

    def end_window(self) -> None:
        """Forgets this accumulation window (after its reduction, or on zero_grad)."""
        self.written.clear()
        self.synced.clear()
        self.launched = False
        self.fresh = True
        if not self.contiguous_grad:
            self.grad_buffer = None

    # ------------------------------------------------------------------ parameters

    @property
    def in_place(self) -> bool:
        """The update leaves the model params current, so there is nothing to gather: one rank whose
        params are the buffer (contiguous_param_buffer), or whose kernel writes them directly (their
        own masters, or written from the masters in their own dtype, as the gather would have)."""
        if self.transfers is not None:
            return False  # offload: the update runs on the host and its result comes back through the buffer
        return self.local and (self.contiguous_param or self.param_dtype == self.spec.group[2])

    def local_param_slice(self) -> Tensor:
        """This rank's slice of the param buffer, allocating the buffer if it is transient."""
        if self.param_buffer is None:
            self.param_buffer = torch.empty(self.spec.numel, dtype=self.param_dtype, device=self.device)
        return self.param_buffer[self.lo : self.hi]

    def gather_in(self, params: list[Tensor]) -> None:
        """Copies this rank's part of the model params into its param-buffer slice (padding zeroed)."""
        self.local_param_slice().zero_()
        ops.cast_copy_(*self.copy_lists("gather_in", params))

    def copy_lists(self, which: str, params: list[Tensor]) -> tuple[list[Tensor], list[Tensor]]:
        """(sources, destinations) of the copies between the model params and the param buffer:
        "gather_in" (this rank's fragments into its slice) or "scatter_out" (every piece out of the
        gathered buffer). A param held whole is passed as itself (the buffer as a view of its shape
        and strides), so the model side is built once; a param split over buckets is passed as a view
        of its data, rebuilt when its storage moves. The buffer is transient: its views are made here,
        one call per piece."""
        plan = self._copy_plans.get(which)
        if plan is None or plan[1] != tuple(params[i].data_ptr() for i in plan[0]):
            if which == "gather_in":
                places = [(f.param, f.param_offset, self.lo + f.shard_offset, f.numel) for f in self.fragments]
            else:
                places = [(p.param, p.param_offset, p.bucket_offset, p.numel) for p in self.spec.pieces]
            model, geometry, split = [], [], []
            for i, param_offset, offset, numel in places:
                p = params[i]
                if numel == p.numel():
                    model.append(p)
                    geometry.append((p.shape, p.stride(), offset))
                else:
                    split.append(i)
                    model.append(flat(p.detach())[param_offset : param_offset + numel])
                    geometry.append(((numel,), (1,), offset))
            plan = self._copy_plans[which] = (split, tuple(params[i].data_ptr() for i in split), model, geometry)
        model, geometry = plan[2], plan[3]
        base = self.param_buffer.storage_offset()
        views = [self.param_buffer.as_strided(shape, stride, base + offset) for shape, stride, offset in geometry]
        return (model, views) if which == "gather_in" else (views, model)

    def launch_gather(self, comm: Comm) -> None:
        self._ag_work = comm.all_gather(self.param_buffer, self.param_buffer[self.lo : self.hi], self.index)

    @property
    def gathering(self) -> bool:
        return self._ag_work is not None

    def finish_gather(self, comm: Comm, params: list[Tensor], skip_if: Tensor | None) -> None:
        """Waits for the all-gather and writes the model params (nothing if `skip_if` is set)."""
        self._ag_work.wait()
        self._ag_work = None
        comm.event("all_gather_done", self.index)
        if not self.contiguous_param:
            ops.cast_copy_(*self.copy_lists("scatter_out", params), skip_if=skip_if)
            if not self.keep_param_buffer:
                self.param_buffer = None

    def bind_params(self, params: list[Tensor]) -> None:
        """contiguous_param_buffer: makes each param a view of the buffer (values copied in first)."""
        for piece in self.spec.pieces:
            p = params[piece.param]
            view = self.param_buffer[piece.bucket_offset : piece.bucket_offset + piece.numel]
            view.copy_(flat(p.detach()))
            p.data = view.as_strided(p.shape, p.stride())


    # ------------------------------------------------------------------ checkpoints

    def read_state(self, params: list[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        """This rank's fp32 masters, exp_avg and exp_avg_sq (flat, ``shard_numel`` each). The masters
        are the stored ones, or else the param slice (read from `params` unless they are views of
        the buffer) joined with the remainders. The results may alias the state: copy before changing.
        Low-precision moments are read as fp32 (8-bit: the shard's blocks are its params' blocks)."""
        s = self.state
        m, v = to_float32(s.exp_avg, s.exp_avg_scales, True), to_float32(s.exp_avg_sq, s.exp_avg_sq_scales, False)
        if s.master is not None:
            return s.master, m, v
        if not self.contiguous_param:
            self.gather_in(params)
        local = self.param_buffer[self.lo : self.hi]
        masters = join_bf16_remainder(local, s.remainders) if s.remainders is not None else local.float()
        return masters, m, v

    def fragment_master(self, f: Fragment, params: list[Tensor], pending: bool = False) -> Tensor:
        """The fp32 master values of fragment `f` of this bucket (1-D, the param's memory order): a view of
        the stored master, of an fp32 model param that is its own master, or of this rank's slice of the
        param buffer; a fresh tensor where a 16-bit param is widened or joined with its remainders.
        `pending`: the bucket's updated slice has not been all-gathered into the model yet
        (overlap_param_sync), so the param buffer, not the model param, holds the current value."""
        s = self.state
        if s.master is not None:
            return s.master[f.shard_offset : f.shard_offset + f.numel]
        if pending and self.param_buffer is not None:
            values = self.param_buffer[self.lo + f.shard_offset : self.lo + f.shard_offset + f.numel]
        else:
            values = flat(params[f.param].detach())[f.param_offset : f.param_offset + f.numel]
        if s.remainders is not None:
            return join_bf16_remainder(values, s.remainders[f.shard_offset : f.shard_offset + f.numel])
        return values.float()  # no copy for fp32

    def write_state(self, masters: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor) -> None:
        """Replaces this rank's shard state and its param-buffer slice (16-bit params and remainders
        from the fp32 `masters`), in place, so a captured CUDA graph stays valid. The model params
        change when the slice is next gathered (``ParamSync.after_step``). Low-precision moments are
        stored from the fp32 values as the kernel stores them (8-bit: quantised block by block)."""
        s = self.state
        local = self.local_param_slice()
        if self._params_sent is not None:  # offload: the masters are being copied out; let that finish
            self._params_sent.wait()
            self._params_sent = None
        if s.remainders is not None:
            hi, lo = split_bf16_remainder(masters)
            local.copy_(hi)
            s.remainders.copy_(lo)
        else:
            local.copy_(masters)
        if s.master is not None:
            s.master.copy_(masters)
        for state, scales, values, signed in ((s.exp_avg, s.exp_avg_scales, exp_avg, True),
                                              (s.exp_avg_sq, s.exp_avg_sq_scales, exp_avg_sq, False)):
            stored, new_scales = from_float32(values, state.dtype, signed)
            state.copy_(stored)
            if scales is not None:
                scales.copy_(new_scales)


def shard_runs(fragments: tuple[Fragment, ...], shard_numel: int, group_of: list[int]) -> list[tuple[int, int, int]]:
    """Splits a shard into (param group, start, end) runs for the update kernel: maximal stretches of
    one group's params, each extended over the padding after it (padding is zero in every list, so
    updating it changes nothing) and starting at a param start or the shard start (aligned)."""
    runs: list[list[int]] = []
    for f in fragments:
        g = group_of[f.param]
        if runs and runs[-1][0] == g:
            continue
        if runs:
            runs[-1][2] = f.shard_offset
        runs.append([g, 0 if not runs else f.shard_offset, shard_numel])
    return [tuple(r) for r in runs]
