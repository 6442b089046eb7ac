"""What this rank holds: ``DistributedFusedAdam.state`` (a read-only per-param view) and its memory report.

torch.optim code treats ``opt.state`` as "the optimizer's per-param state": torch's
``distributed.checkpoint.state_dict`` steps an optimizer whose state is empty (zero grads, lr 0) to
create it, so an always-empty mapping made every ``get_state_dict`` call take a hidden step; tools
log or move its tensors. The view answers without any communication (only some ranks may look),
from the buckets' shard state, and is never stored: every access builds fresh entries.

So no write to the view may pass silently, since it would reach nothing: assigning an entry or a key
of one raises (``StateEntry``), except writing back the very tensor that is there (torch.optim
utilities, e.g. Lightning's state-to-device loop, do that); and the tensors that are copies rather
than views of the shard (``step``; ``param`` of 16-bit params without stored masters; any tensor of a
param split over buckets) are inference tensors, on which torch refuses in-place writes outside
``torch.inference_mode()``. Views of the shard stay ordinary tensors: in-place writes reach it.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import Tensor

from .buckets import BucketRuntime
from .layout import Fragment
from .runtime import ShardRuntime

STATE_KEYS = ("exp_avg", "exp_avg_sq", "param")
_ENTRY_WRITE = (
    "DistributedFusedAdam.state[p] is a read-only view of this rank's shard, built afresh on each access: "
    "{what} would change nothing. Change a view's values in place (exp_avg, exp_avg_sq, and param where "
    "the shard holds fp32 masters, e.g. opt.state[p]['exp_avg'].copy_(x)), or use load_state_dict()"
)


class StateEntry(dict):
    """One param's entry of the view: a dict that refuses every write, which would reach nothing.
    Writing back the very object that a key holds is accepted: it changes nothing, as intended."""

    def __setitem__(self, key: Any, value: Any) -> None:
        if not (key in self and dict.__getitem__(self, key) is value):
            raise TypeError(_ENTRY_WRITE.format(what=f"assigning {key!r}"))

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(_ENTRY_WRITE.format(what="changing its keys"))

    __delitem__ = update = pop = popitem = clear = setdefault = __ior__ = _refuse

    def __copy__(self) -> dict[str, Tensor]:
        return dict(self)

    def __deepcopy__(self, memo: dict) -> dict[str, Tensor]:
        return {k: v.clone() for k, v in self.items()}

    def __reduce_ex__(self, protocol: int):
        return (dict, (dict(self),))  # unpickles as a plain dict


class StateView(Mapping):
    """Maps each trainable param to ``{"step", "exp_avg", "exp_avg_sq", "param"}``: ``step`` a float32
    scalar tensor (the optimizer's step count), the others fp32 1-D tensors of this rank's elements of
    the param, in its memory order (empty where the rank holds none, or before the bucket layout is
    built). See DistributedFusedAdam's docstring. Params that are not trainable read as ``{}``, as
    from torch's ``defaultdict``, without being added."""

    def __init__(self, rt: ShardRuntime) -> None:
        # A weak reference: the view must not keep the optimizer's sharded state (and through its hooks,
        # process groups) alive once the optimizer is gone.
        self._rt = weakref.ref(rt)
        self._fragments: dict[int, list[tuple[BucketRuntime, Fragment]]] | None = None

    def _owner(self) -> ShardRuntime:
        rt = self._rt()
        if rt is None:
            raise ReferenceError("the optimizer of this state view no longer exists")
        return rt

    def __len__(self) -> int:
        return len(self._owner().params)

    def __iter__(self) -> Iterator[Tensor]:
        return iter(list(self._owner().params))

    def __contains__(self, key: object) -> bool:
        return isinstance(key, Tensor) and key in self._owner().index

    def get(self, key: Any, default: Any = None) -> Any:
        return self[key] if key in self else default

    def __getitem__(self, key: Any) -> StateEntry:
        rt = self._owner()
        index = rt.index.get(key) if isinstance(key, Tensor) else None
        if index is None:
            return StateEntry()
        # Inference mode: the copies made here are inference tensors, which refuse in-place writes
        # outside it; views of ordinary tensors made here stay ordinary (writes reach the shard).
        with torch.inference_mode():
            if rt.capturable:
                step = rt.step_tensor  # the live counter, on the GPU: reading it would synchronise
            else:
                step = torch.tensor(float(rt.steps))
            entry = {"step": step}
            parts = self._fragments_of(rt).get(index, [])
            pending = set(rt.param_sync.pending)
            for key_name in STATE_KEYS:
                pieces = [self._piece(rt, b, f, key_name, b.index in pending) for b, f in parts]
                if not pieces:
                    entry[key_name] = torch.empty(0, dtype=torch.float32, device=rt.state_device)
                else:  # a param larger than a bucket has one fragment per bucket here: then a copy
                    entry[key_name] = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        return StateEntry(entry)

    @staticmethod
    def _piece(rt: ShardRuntime, b: BucketRuntime, f: Fragment, key: str, pending: bool) -> Tensor:
        if key == "param":
            return b.fragment_master(f, rt.tensors, pending)
        return getattr(b.state, key)[f.shard_offset : f.shard_offset + f.numel]

    def _fragments_of(self, rt: ShardRuntime) -> dict[int, list[tuple[BucketRuntime, Fragment]]]:
        if self._fragments is None and rt.buckets:  # the layout is built once, never changed
            out: dict[int, list[tuple[BucketRuntime, Fragment]]] = {}
            for b in rt.buckets:
                for f in b.fragments:
                    out.setdefault(f.param, []).append((b, f))
            for parts in out.values():
                parts.sort(key=lambda bf: bf[1].param_offset)
            self._fragments = out
        return self._fragments or {}

    def __setitem__(self, key: Any, value: Any) -> None:
        raise TypeError("DistributedFusedAdam.state is a read-only view of the sharded state: change the shard's "
                        "views in place (see StateEntry), or use load_state_dict()")

    __delitem__ = __setitem__

    def __repr__(self) -> str:
        return f"<DistributedFusedAdam state view: {len(self)} params>"

    def __copy__(self) -> dict[Tensor, dict[str, Tensor]]:
        return dict(self.items())

    def __deepcopy__(self, memo: dict) -> dict[Tensor, dict[str, Tensor]]:
        """A plain dict of copies of the entries (keyed by the params themselves). Cloned, not
        deep-copied: a deep copy of a view copies the whole shard it views."""
        return {p: {k: v.clone() for k, v in entry.items()} for p, entry in self.items()}

    def __reduce_ex__(self, protocol: int):
        raise TypeError("DistributedFusedAdam.state is a view of a live optimizer and cannot be pickled: pickle "
                        "dict(opt.state) or opt.state_dict()")


def memory_report(buckets: list[BucketRuntime], contiguous_grad_buffer: bool, offload: bool = False) -> dict[str, int]:
    """This rank's persistent optimizer memory in bytes, by category, with ``device`` and ``host``
    totals (offload: the state and its staging buffers are host memory) and their sum, ``total``."""
    def nbytes(t: Tensor | None) -> int:
        return 0 if t is None else t.numel() * t.element_size()

    report = {"master": 0, "moments": 0, "remainders": 0, "grad_shard": 0, "buffers": 0, "staging": 0}
    for b in buckets:
        report["staging"] += b.host_staging_bytes()
        s = b.state
        report["master"] += nbytes(s.master)
        report["moments"] += nbytes(s.exp_avg) + nbytes(s.exp_avg_sq)  # 8-bit: codes and absmax scales
        report["moments"] += nbytes(s.exp_avg_scales) + nbytes(s.exp_avg_sq_scales)
        report["remainders"] += nbytes(s.remainders)
        report["grad_shard"] += nbytes(s.grad)
        if contiguous_grad_buffer:
            report["buffers"] += nbytes(b.grad_buffer)
        if b.keep_param_buffer:  # contiguous, or kept for a captured graph (allocated at the first step)
            report["buffers"] += nbytes(b.param_buffer)
    state = sum(report[k] for k in ("master", "moments", "remainders", "grad_shard"))
    report["device"] = report["buffers"] + (0 if offload else state)
    report["host"] = report["staging"] + (state if offload else 0)
    report["total"] = report["device"] + report["host"]
    return report
