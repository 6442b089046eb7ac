"""BMUF: blockwise model-update filtering (Chen & Huo, ICASSP 2016) around any local optimizer.

Each rank runs its own optimizer on its own batches without communicating; every ``sync_every`` steps
the ranks average their models and a block-momentum update moves the global model. As fairseq's
``FairseqBMUF``: every ``step()`` call counts (one GradScaler skips for inf/nan too, so the ranks sync
at the same calls). With ``warmup_steps = W > 0``, steps 1..W are local only, then rank 0's model is
broadcast and the local optimizer's state averaged (``average_sync``) or reset to what it was when BMUF
was built; with ``W = 0`` the ranks must start alike (the first sync checks). At every step ``n > W``
with ``n % sync_every == 0``, with ``w`` the global copy (the model after the last sync, on every rank)
and ``m`` the block momentum:
    G = w - mean over ranks of the local params          (one all-reduce)
    m = block_momentum * m + block_lr * G
    w = w - m                                             (nesterov=False)
    w = w - block_lr * G - block_momentum * m             (nesterov=True)
then every rank's params become ``w`` (and with ``average_sync`` the optimizer state is averaged too).
The Nesterov form is the paper's (the next block starts from ``W(t) + block_momentum * Delta(t)``),
i.e. torch's SGD nesterov on the block gradient; fairseq's ``use_nbm`` omits taking back the previous
look-ahead. ``block_momentum=0, block_lr=1`` syncs to the plain average (all-reducing the params); with
``block_momentum=0`` fairseq ignores ``block_lr``, here it applies. One rank runs the same algorithm
without collectives (fairseq skips the syncs).

Costs: the global copy and, if ``block_momentum != 0``, the momentum (param-sized, in the weight
dtype); per sync one all-reduce of every param byte in flat one-dtype buckets of ``bucket_cap_mb``,
plus a 64-byte rank check read on the host (DDP: every gradient byte every step). The block update is torch
``_foreach`` ops per bucket: fused multi-tensor-apply kernels on CUDA, per-tensor loops on the CPU.
With ``FusedAdam(master_weights=True)`` the fp32 masters are the weights synced (16-bit params are
written from them); a warm-up reset drops them with the rest of the state (they restart from the
params, as at a first step). ``sync_every=1, block_momentum=0, block_lr=1`` equals DDP for local
updates linear in the gradient (SGD, momentum, weight decay), up to rounding; not for Adam.
"""

from __future__ import annotations

import math
from collections import OrderedDict, defaultdict
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .distributed.agreement import check_ranks_agree
from .distributed.optimizer import DistributedFusedAdam
from .fused_adam import FusedAdam
from .state_dicts import load_with_hooks, state_dict_with_hooks
from .validation import is_dense

_CHECKS = 4  # steps, averaged-state elements, L1 and L2 checksums of the global copy
_HOOKS = ("step_pre", "step_post", "state_dict_pre", "state_dict_post", "load_state_dict_pre", "load_state_dict_post")
_OPTIONS = ("sync_every", "warmup_steps", "average_sync", "block_lr", "block_momentum", "nesterov")


class BMUF(torch.optim.Optimizer):
    """``BMUF(optimizer, process_group=None, sync_every=50, block_lr=1.0, block_momentum=0.875,
    nesterov=True, warmup_steps=0, average_sync=False, bucket_cap_mb=64)`` (fairseq's defaults).

    Use it in place of ``optimizer`` (no DDP wrapper, no ``no_sync``): ``param_groups`` and ``state``
    are the local optimizer's, so LR schedulers and ``scaler.step(bmuf)`` work as with it.
    ``state_dict()`` is the local optimizer's plus a ``"bmuf"`` entry (step count, global copy,
    momentum); every rank saves its own and resumes bit-exactly under the same world size. Like
    torch.optim's, it holds references to live tensors: save (or clone) it before training on.
    ``comm_bytes`` counts the bytes this rank has all-reduced and broadcast.
    """

    _step_supports_amp_scaling = True  # GradScaler calls step() on every rank, even with inf/nan grads

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        process_group: dist.ProcessGroup | None = None,
        sync_every: int = 50,
        block_lr: float = 1.0,
        block_momentum: float = 0.875,
        nesterov: bool = True,
        warmup_steps: int = 0,
        average_sync: bool = False,
        *,
        bucket_cap_mb: float = 64.0,
    ) -> None:
        nested = isinstance(optimizer, (BMUF, DistributedFusedAdam))
        if not isinstance(optimizer, torch.optim.Optimizer) or nested:
            raise TypeError(
                f"BMUF wraps a local torch.optim.Optimizer, got {type(optimizer).__name__}"
                + nested * " (already data parallel)"
            )
        for name, value, low in (("sync_every", sync_every, 1), ("warmup_steps", warmup_steps, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"BMUF: {name} must be an integer >= {low}, got {value!r}")
        if not 0.0 <= float(block_momentum) < 1.0:
            raise ValueError(f"BMUF: block_momentum must be in [0, 1), got {block_momentum}")
        if not 0.0 < float(block_lr) < math.inf:
            raise ValueError(f"BMUF: block_lr must be positive and finite, got {block_lr}")
        if not float(bucket_cap_mb) > 0.0:
            raise ValueError(f"BMUF: bucket_cap_mb must be positive, got {bucket_cap_mb}")
        if getattr(optimizer, "offload_optimizer", False):
            # Its masters (the weights it updates, fp32 ones included) live in host memory, where a sync
            # would neither read nor write them: the next local step would undo the block update.
            raise ValueError("BMUF does not wrap an optimizer with offload_optimizer=True: its fp32 masters live "
                             "in host memory, outside what BMUF synchronises")
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("BMUF needs torch.distributed initialised (init_process_group) before it is built")
        params = self._params_of(optimizer)
        self._device = self._check_params(params)

        self.optimizer = optimizer
        self.defaults = optimizer.defaults
        for hooks in _HOOKS:
            setattr(self, f"_optimizer_{hooks}_hooks", OrderedDict())
        self._patch_step_function()  # step() fires torch's step hooks, as any optimizer's does
        self.sync_every, self.warmup_steps, self.average_sync = sync_every, warmup_steps, bool(average_sync)
        self.block_lr, self.block_momentum, self.nesterov = float(block_lr), float(block_momentum), bool(nesterov)
        self.bucket_bytes = int(float(bucket_cap_mb) * 2**20)
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        backend = dist.get_backend(process_group)  # where the small check tensors live
        self._check_device = torch.device("cpu") if backend == "gloo" else self._device
        self.comm_bytes = {"all_reduce": 0, "broadcast": 0}
        self._steps = 0
        self._params: list[Tensor] = []
        self._global: list[Tensor] = []
        self._momentum: list[Tensor] | None = [] if self.block_momentum else None
        self._track(params)
        # What a warm-up reset restores (fairseq: the local optimizer's state when BMUF was built).
        needs_reset = warmup_steps > 0 and not self.average_sync
        self._initial_state = _clone(optimizer.state_dict()["state"]) if needs_reset else None
        self._agree_on_construction()

    # ------------------------------------------------------------------ the torch.optim surface

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> dict:
        return self.optimizer.state

    @property
    def step_count(self) -> int:
        """step() calls so far (restored by load_state_dict)."""
        return self._steps

    def __repr__(self) -> str:
        options = ", ".join(f"{k}={getattr(self, k)}" for k in (*_OPTIONS, "world_size"))
        return f"BMUF({options}, optimizer={self.optimizer!r})"

    def memory_report(self) -> dict[str, int]:
        """Bytes of BMUF's own state on this rank: the global copy and the block momentum."""
        sizes = {
            k: sum(t.numel() * t.element_size() for t in ts or ())
            for k, ts in (("global", self._global), ("momentum", self._momentum))
        }
        return {**sizes, "total": sum(sizes.values())}

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("BMUF does not pickle or deep-copy (it holds a process group): save its state_dict()")

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise RuntimeError("BMUF: give the local optimizer all its param groups before building BMUF")

    def step(self, closure=None):
        """The local step, then (at the warm-up's end or a block boundary) the sync."""
        if [id(p) for p in self._params] != [id(p) for p in self._params_of(self.optimizer)]:
            raise RuntimeError(
                "BMUF: the local optimizer's params changed after BMUF was built (add groups before building it)"
            )
        loss = self._local_step(closure)
        self._steps += 1
        if self._steps == self.warmup_steps:
            self._warmup_sync()
        elif self._steps > self.warmup_steps and self._steps % self.sync_every == 0:
            self._block_sync()
        return loss

    def _local_step(self, closure):
        """The local optimizer's step, honouring what GradScaler.step handed us (grad_scale, found_inf)."""
        scale, found_inf = self.__dict__.get("grad_scale"), self.__dict__.get("found_inf")
        inner = self.optimizer
        if scale is None and found_inf is None:
            return inner.step(closure)
        if getattr(inner, "_step_supports_amp_scaling", False):  # FusedAdam, torch's fused Adam: they unscale
            inner.grad_scale, inner.found_inf = scale, found_inf
            try:
                return inner.step(closure)
            finally:
                del inner.grad_scale, inner.found_inf
        if found_inf is not None and found_inf.item() != 0:
            return None  # this rank's grads hold inf/nan: no local update (GradScaler would skip it too)
        if scale is not None:
            inv = scale.double().reciprocal().float()  # in double, as GradScaler.unscale_ does
            for grads in _by_dtype([p.grad for p in self._params if p.grad is not None]).values():
                torch._foreach_mul_(grads, inv.to(grads[0].device))
        return inner.step(closure)

    # ------------------------------------------------------------------ syncs

    @torch.no_grad()
    def _warmup_sync(self) -> None:
        state = self._state_tensors() if self.average_sync else []
        self._agree(state, check_global=False)  # warm-up: the ranks' global copies may still differ
        weights, writeback = self._weights()
        for flat, views in self._buckets(weights):
            torch._foreach_copy_(list(views.values()), _at(weights, views))
            if self.world_size > 1:
                dist.broadcast(flat, dist.get_global_rank(self._pg(), 0), group=self.process_group)
                self.comm_bytes["broadcast"] += flat.numel() * flat.element_size()
            torch._foreach_copy_(_at(weights, views), list(views.values()))
        _write_back(writeback)
        if self.average_sync:
            self._average(state)
        else:  # back to the state the local optimizer had when BMUF was built; hyperparameters stay as now
            groups = self.optimizer.state_dict()["param_groups"]
            self.optimizer.load_state_dict({"state": self._initial_state or {}, "param_groups": groups})
        self._initial_state = None
        weights, _ = self._weights()  # a reset may have dropped FusedAdam's masters
        torch._foreach_copy_(self._global, weights)
        if self._momentum is not None:
            torch._foreach_zero_(self._momentum)

    @torch.no_grad()
    def _block_sync(self) -> None:
        state = self._state_tensors() if self.average_sync else []
        self._agree(state, check_global=True)
        weights, writeback = self._weights()
        if self.block_momentum == 0.0 and self.block_lr == 1.0:  # the plain average of the params
            self._average(weights)
            torch._foreach_copy_(self._global, weights)
        else:
            for flat, views in self._buckets(self._global):
                index = list(views.keys())
                glob, G = [self._global[i] for i in index], list(views.values())
                torch._foreach_copy_(G, glob)
                torch._foreach_sub_(G, [weights[i] for i in index])  # G = w - local params
                self._all_reduce(flat)
                flat.div_(self.world_size)  # G = w - mean of the local params
                if self._momentum is None:
                    torch._foreach_add_(glob, G, alpha=-self.block_lr)
                else:
                    m = [self._momentum[i] for i in index]
                    torch._foreach_mul_(m, self.block_momentum)
                    torch._foreach_add_(m, G, alpha=self.block_lr)
                    if self.nesterov:
                        torch._foreach_add_(glob, G, alpha=-self.block_lr)
                        torch._foreach_add_(glob, m, alpha=-self.block_momentum)
                    else:
                        torch._foreach_sub_(glob, m)
            torch._foreach_copy_(weights, self._global)
        _write_back(writeback)
        if self.average_sync:
            self._average(state)

    def _average(self, tensors: list[Tensor]) -> None:
        """Every tensor becomes its mean over the ranks (one flat all-reduce per bucket)."""
        for flat, views in self._buckets(tensors):
            torch._foreach_copy_(list(views.values()), _at(tensors, views))
            self._all_reduce(flat)
            flat.div_(self.world_size)
            torch._foreach_copy_(_at(tensors, views), list(views.values()))

    def _all_reduce(self, flat: Tensor) -> None:
        if self.world_size > 1:
            dist.all_reduce(flat, group=self.process_group)
            self.comm_bytes["all_reduce"] += flat.numel() * flat.element_size()

    def _buckets(self, tensors: list[Tensor]):
        """(flat buffer, {index: view}) per bucket: tensors of one dtype, at most bucket_cap_mb (a larger
        tensor alone); each view has its tensor's shape and strides, so the _foreach ops run on like layouts."""
        by_dtype: dict[torch.dtype, list[int]] = defaultdict(list)
        for i, t in enumerate(tensors):
            by_dtype[t.dtype].append(i)
        for dtype, indices in by_dtype.items():
            size = torch.tensor([], dtype=dtype).element_size()
            start = 0
            while start < len(indices):
                end, total = start + 1, tensors[indices[start]].numel()
                while end < len(indices) and (total + tensors[indices[end]].numel()) * size <= self.bucket_bytes:
                    total += tensors[indices[end]].numel()
                    end += 1
                flat = torch.empty(total, dtype=dtype, device=self._device)
                views, offset = {}, 0
                for i in indices[start:end]:
                    views[i] = flat.as_strided(tensors[i].shape, tensors[i].stride(), offset)
                    offset += tensors[i].numel()
                yield flat, views
                start = end

    def _agree(self, state: list[Tensor], check_global: bool) -> None:
        """One small all-reduce before anything changes: the ranks must be at the same step, average states
        of the same size and (after warm-up) hold the same global copy; otherwise every rank raises."""
        if self.world_size == 1:
            return
        mine = torch.zeros(_CHECKS, dtype=torch.float64, device=self._check_device)
        mine[0], mine[1] = self._steps, sum(t.numel() for t in state)
        if check_global and self._global:
            for k, order in ((2, 1), (3, 2)):
                norms = [
                    torch._foreach_norm(ts, order, dtype=_at_least_fp32(ts)) for ts in _by_dtype(self._global).values()
                ]
                mine[k] = torch.stack([n.double() for ns in norms for n in ns]).sum().to(self._check_device)
        both = torch.cat([mine, -mine])
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.process_group)
        self.comm_bytes["all_reduce"] += both.numel() * both.element_size()
        high, low = both[:_CHECKS].tolist(), (-both[_CHECKS:]).tolist()
        if high[0] != low[0]:
            raise RuntimeError(
                f"BMUF: the ranks are at different steps at this sync ({low[0]:.0f} to {high[0]:.0f}): resumed "
                "from different checkpoints, or calling step() different numbers of times"
            )
        if high[1] != low[1]:
            raise RuntimeError("BMUF: the ranks' optimizer states to average differ in size (state on some ranks only)")
        if high[2:] != low[2:]:
            raise RuntimeError(
                "BMUF: the ranks' global model copies differ: with warmup_steps=0 they must start from the same params"
            )

    # ------------------------------------------------------------------ params, weights, state

    @staticmethod
    def _params_of(optimizer: torch.optim.Optimizer) -> list[Tensor]:
        seen: dict[int, Tensor] = {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                seen.setdefault(id(p), p)
        return list(seen.values())

    @staticmethod
    def _check_params(params: list[Tensor]) -> torch.device:
        devices = {p.device for p in params}
        if len(devices) != 1:
            raise ValueError(f"BMUF: all params must be on one device, got {sorted(map(str, devices)) or 'none'}")
        for p in params:
            if p.is_sparse or not p.is_floating_point() or not is_dense(p):
                raise ValueError(f"BMUF: params must be dense float tensors, got {p.dtype} {p.layout} {p.stride()}")
        return devices.pop()

    def _master_dtype(self, p: Tensor) -> torch.dtype:
        inner = self.optimizer
        return torch.float32 if isinstance(inner, FusedAdam) and inner._uses_master(p) else p.dtype

    def _track(self, params: list[Tensor]) -> None:
        for p in params:
            w = torch.empty_like(p, dtype=self._master_dtype(p), memory_format=torch.preserve_format)
            self._params.append(p)
            self._global.append(w.copy_(p.detach()))
            if self._momentum is not None:
                self._momentum.append(torch.zeros_like(w))

    def _weights(self) -> tuple[list[Tensor], list[tuple[Tensor, Tensor]]]:
        """The tensors the local optimizer updates (FusedAdam's fp32 masters, else the params) and the
        (param, master) pairs to copy back after a sync (a missing master: an fp32 copy of the param)."""
        weights, writeback = [], []
        for p, g in zip(self._params, self._global):
            if g.dtype == p.dtype:
                weights.append(p.detach())
                continue
            master = self.optimizer.state.get(p, {}).get("param")
            w = master if master is not None else torch.empty_like(g).copy_(p.detach())
            weights.append(w)
            writeback.append((p.detach(), w))
        return weights, writeback

    def _state_tensors(self) -> list[Tensor]:
        """The local optimizer's per-param floating-point state that average_sync averages (moments,
        momentum buffers): tensors of the param's shape, neither step counters nor FusedAdam masters."""
        out = []
        for p in self._params:
            entry = self.optimizer.state.get(p, {})
            tensors = [entry[k] for k in sorted(entry) if k not in ("step", "param") and isinstance(entry[k], Tensor)]
            out += [t for t in tensors if t.is_floating_point() and t.shape == p.shape]
        return out

    def _pg(self) -> dist.ProcessGroup:
        return self.process_group or dist.group.WORLD

    def _agree_on_construction(self) -> None:
        if self.world_size == 1:
            return
        entries = [("group size", str(self.world_size)), ("local optimizer", type(self.optimizer).__name__)]
        entries += [(name, repr(getattr(self, name))) for name in (*_OPTIONS, "bucket_bytes")]
        entries.append(("params", str(len(self._params))))
        for i, (p, g) in enumerate(zip(self._params, self._global)):
            entries.append(
                (
                    f"param {i} (shape, dtype, strides, weight dtype)",
                    f"{tuple(p.shape)} {p.dtype} {p.stride()} {g.dtype}",
                )
            )
        try:
            check_ranks_agree(entries, self.process_group, self._check_device)
        except ValueError as e:  # its text names DistributedFusedAdam, whose check it was written for
            detail = str(e).removeprefix("DistributedFusedAdam: ").split(". Construct DistributedFusedAdam")[0]
            raise ValueError(f"BMUF: {detail}. Build the model, optimizer and BMUF alike on every rank.") from None

    # ------------------------------------------------------------------ state dicts

    def state_dict(self) -> dict[str, Any]:
        return state_dict_with_hooks(self, self._make_state_dict)

    def _make_state_dict(self) -> dict[str, Any]:
        sd = self.optimizer.state_dict()
        sd["bmuf"] = {
            "steps": self._steps,
            "world_size": self.world_size,
            "global": list(self._global),
            "momentum": None if self._momentum is None else list(self._momentum),
            "initial_state": self._initial_state,
            **{k: getattr(self, k) for k in _OPTIONS},
        }
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads this rank's own state dict, saved under the same world size. BMUF's options are the
        constructor's (a checkpoint without momentum starts it at zero). Everything is checked, and the
        local optimizer loaded (it checks its part), before BMUF's state changes."""
        load_with_hooks(self, state_dict, self._load_state_dict)

    def _load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict.get("bmuf") if isinstance(state_dict, dict) else None
        if not isinstance(saved, dict):
            raise ValueError("BMUF.load_state_dict: no 'bmuf' entry (load a local optimizer's own into bmuf.optimizer)")
        if saved.get("world_size") != self.world_size:
            raise ValueError(
                f"BMUF.load_state_dict: saved under {saved.get('world_size')} ranks, loading under "
                f"{self.world_size} (each rank's state is its own)"
            )
        steps = saved.get("steps")
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"BMUF.load_state_dict: bad step count {steps!r}")
        new_global = self._converted(saved.get("global"), "global")
        new_momentum = None
        if self._momentum is not None:
            momentum = saved.get("momentum")
            new_momentum = self._converted(momentum, "momentum") if momentum is not None else None
        initial = None
        if steps < self.warmup_steps and not self.average_sync:
            initial = saved.get("initial_state") or {}
        self.optimizer.load_state_dict({k: v for k, v in state_dict.items() if k != "bmuf"})
        self._steps, self._global, self._initial_state = steps, new_global, _clone(initial)
        if self._momentum is not None:
            self._momentum = new_momentum or [torch.zeros_like(g) for g in new_global]

    def _converted(self, tensors: Any, name: str) -> list[Tensor]:
        """New tensors in our layout (device, dtype, strides) from saved ones, after checking their shapes."""
        if not isinstance(tensors, (list, tuple)) or len(tensors) != len(self._global):
            raise ValueError(f"BMUF.load_state_dict: '{name}' must hold {len(self._global)} tensors, one per param")
        out = []
        for i, (t, g) in enumerate(zip(tensors, self._global)):
            if not isinstance(t, Tensor) or t.shape != g.shape or not t.is_floating_point():
                got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
                raise ValueError(
                    f"BMUF.load_state_dict: '{name}' {i} must be a float tensor of shape {tuple(g.shape)}, got {got}"
                )
            out.append(torch.empty_like(g).copy_(t))
        return out


def _by_dtype(tensors: list[Tensor]) -> dict[torch.dtype, list[Tensor]]:
    out: dict[torch.dtype, list[Tensor]] = defaultdict(list)
    for t in tensors:
        out[t.dtype].append(t)
    return out


def _at_least_fp32(tensors: list[Tensor]) -> torch.dtype | None:
    return torch.float32 if tensors[0].element_size() < 4 else None  # norms of 16-bit tensors in fp32


def _at(tensors: list[Tensor], views: dict[int, Tensor]) -> list[Tensor]:
    return [tensors[i] for i in views]


def _write_back(pairs: list[tuple[Tensor, Tensor]]) -> None:
    """16-bit params from their fp32 masters (one rounding, as FusedAdam's own step writes them)."""
    if pairs:
        torch._foreach_copy_([p for p, _ in pairs], [w for _, w in pairs])


def _clone(state: Any) -> Any:
    """A deep copy of an optimizer's state (tensors cloned), or None."""
    if state is None:
        return None
    return {k: {n: v.clone() if isinstance(v, Tensor) else v for n, v in entry.items()} for k, entry in state.items()}
