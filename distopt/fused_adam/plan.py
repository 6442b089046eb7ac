"""FusedAdam's step plan: the fused kernel's argument lists, built once and reused while nothing they
depend on changes, so that a steady-state ``step()`` does no Python work per param beyond a few
whole-list passes, whether the gradients are new tensors (``zero_grad()``'s default sets them to None
and backward makes new ones) or the same ones as last step.

A plan is built after a step that went the general (per-param) way, from the params that had a gradient
then (their state exists by then). It holds, per kernel call (one per param group and combination of
dtypes), the param, moment, master and step lists, and what it expects of the gradients. Each later step
re-reads ``.grad`` and checks, with whole-list operations (``map`` over C getters, no Python loop per
param), what the kernel does not: the groups hold the planned params and the state the planned tensors
(identity checks: a param swapped into a group or a state tensor replaced by assignment would otherwise
be missed; packed moments, below, by address), the params keep their dtypes, and no unplanned param got
a gradient. The gradients themselves are checked by the kernel, which checks every list (a missing
gradient, dtype, device, layout, shape, strides; one dtype per list) before it writes anything: the
first call's gradients, and its params' dtypes beyond the first param's, are left to it (if it refuses
them, that step goes the general way, nothing having changed); later calls' are checked here before the
first call runs (missing, the planned dtype, dense, the planned strides), so that a step is never left
half done. Autograd and the ``.grad`` setter already give a gradient its param's device and shape. The
plan itself is dropped when the optimizer's structure changes: param groups added or their param lists
resized, the state loaded, replaced or given entries, the params' dtypes changed. Anything else (a
gradient in another layout, a param that gained or lost its gradient, a replaced tensor) takes the
general way for that step, which raises the precise errors and builds a new plan.

Each call's fp32/bf16 moments are packed (``pack_moments``): one tensor per moment list, whose entries
(shaped like the params, each over a storage of its own) the state holds, so that the kernel takes two
moment tensors instead of two per param (the op's packed form, Note [Packed moments] in
csrc/binding.cpp). Each step checks that the state holds tensors at the packed addresses: a moment
replaced by assignment, or given other memory by ``.data =`` or ``set_()`` (which keep its identity),
takes the general way, and the next plan packs again.

DTensor params (FSDP2, tensor parallelism) get a ``ShardedCall``: its lists hold the local shards, so
the kernel runs on plain tensors and a steady-state step does no DTensor dispatch (distopt/dtensor.py);
a gradient placed unlike its param (a ``Replicate`` gradient of a ``Shard(0)`` param) is converted as
the general step converts it (``dtensor.GradConversion``), by a slice where that is enough.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import operator
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch import Tensor

from .. import dtensor, ops
from ..kernel_views import layout_strides, needs_view, own_storage, packed_offsets, packed_views
from .moments import MomentState, element_offset

_grad = operator.attrgetter("grad")
_dtype = operator.attrgetter("dtype")
_shape = operator.attrgetter("shape")
_layout = operator.attrgetter("layout")
_stride = operator.methodcaller("stride")
_is_none = functools.partial(operator.is_, None)
_local = operator.attrgetter("_local_tensor")  # a DTensor's local shard
_spec = operator.attrgetter("_spec")
_mesh = operator.attrgetter("mesh")  # of a spec
_placements = operator.attrgetter("placements")
_data_ptr = Tensor.data_ptr

# Bytes of one call's moment list up to which the plan packs it (Note [Packed moments] in csrc/binding.cpp):
# packing copies the list once into new memory, so it is bounded; what it saves, the kernel call's cost per
# tensor, matters where there are many small params, whose moments are small.
PACK_LIMIT = 64 << 20


@dataclass
class Call:
    """One kernel call's lists (all but the grads, which are re-read every step)."""

    group: int
    model_params: list[Tensor]  # whose .grad the call reads
    params: list[Tensor]  # what the kernel updates: the model params, or their fp32 masters
    exp_avgs: list[Tensor]
    exp_avg_sqs: list[Tensor]
    param_outs: list[Tensor]  # the model params, written from the masters (else empty)
    steps: list[Tensor]  # each param's step counter (state["step"])
    param_dtype: torch.dtype
    grad_dtype: torch.dtype
    shapes: list[torch.Size]
    strides: list[tuple[int, ...]]  # the grads' (the layout of the params' state: kernel_views.py)
    viewed: bool = False  # complex or not dense params, whose kernel lists are built each step (kernel_views.py)
    entries: list[dict[str, Any]] = field(default_factory=list)  # the params' state dicts
    last_grads: list[Tensor] = field(default_factory=list)  # the grads last checked (in Python)
    # Eager steps: the call's params share one step count, and their step tensors are views of this
    # one tensor, so one add_ counts the step for all (a foreach add over 10,000 CPU scalars takes
    # longer than the update itself). Its version counter (which its views share) after the last count
    # tells whether a step count was changed in place since.
    step_storage: Tensor | None = None
    step_version: int = 0
    plain_types: bool = False  # every param a torch.Tensor or nn.Parameter (see ``grads``)
    # Low-precision moments (moments.py): 8-bit moments' absmax tensors (else empty), and
    # each param's position in param_groups order and first element (stochastic rounding's keys).
    exp_avg_scales: list[Tensor] = field(default_factory=list)
    exp_avg_sq_scales: list[Tensor] = field(default_factory=list)
    param_ids: list[int] = field(default_factory=list)
    param_offsets: list[int] = field(default_factory=list)
    # Packed moments (``pack_moments``): the one tensor a moment list is passed as, and the addresses of
    # its views, by state key.
    packed: dict[str, Tensor] = field(default_factory=dict)
    packed_ptrs: dict[str, list[int]] = field(default_factory=dict)

    def state_lists(self) -> list[tuple[str, list[Tensor]]]:
        """(state key, the planned tensors under it) for every state tensor the call uses."""
        lists = [("exp_avg", self.exp_avgs), ("exp_avg_sq", self.exp_avg_sqs), ("step", self.steps)]
        lists += [(k, t) for k, t in (("exp_avg_absmax", self.exp_avg_scales),
                                      ("exp_avg_sq_absmax", self.exp_avg_sq_scales)) if t]
        return lists + ([("param", self.params)] if self.param_outs else [])

    def moment_lists(self) -> dict[str, list[Tensor]]:
        """The kernel's ``exp_avgs`` and ``exp_avg_sqs``: each list, or its packed tensor."""
        return {"exp_avgs": [self.packed["exp_avg"]] if "exp_avg" in self.packed else self.exp_avgs,
                "exp_avg_sqs": [self.packed["exp_avg_sq"]] if "exp_avg_sq" in self.packed else self.exp_avg_sqs}

    def kernel_tensors(self) -> list[Tensor]:
        """The tensors of the call's lists that are the same every step (all but the grads)."""
        moments = self.moment_lists()
        return [*self.params, *moments["exp_avgs"], *moments["exp_avg_sqs"], *self.param_outs,
                *self.exp_avg_scales, *self.exp_avg_sq_scales, *self.steps]

    def grad_references(self, grads: list[Tensor]) -> object | None:
        """What holds `grads` in C++ for the kernel call (ops.hold_references), if they need it: a plain
        param's ``.grad`` is held by the param itself."""
        return None

    def addresses(self, name: str) -> list[int]:
        """The data pointers of the state's `name` tensors now."""
        return list(map(_data_ptr, map(operator.itemgetter(name), self.entries)))

    def dtypes(self, checked: bool) -> set[torch.dtype]:
        """The dtypes of the planned params now; unless `checked`, the first param's only (the kernel
        refuses a list of mixed dtypes before writing anything)."""
        return set(map(_dtype, self.model_params)) if checked else {self.model_params[0].dtype}

    def count_steps(self, delta: int) -> None:
        """Adds `delta` to every param's step count (eager steps)."""
        self.step_storage.add_(delta)
        self.step_version = self.step_storage._version

    def grads(self, checked: bool) -> list[Tensor] | None:
        """The current grads, or None where they are not what the plan expects; `checked`: check here what
        the kernel would (else the kernel checks them itself, before writing anything)."""
        if not self.plain_types:
            return self.checked(list(map(_grad, self.model_params)), checked)
        # An nn.Parameter's .grad getter first looks for a __torch_function__ override, which Parameter
        # disables: read with subclass overrides off, a quarter of the getter's time saved.
        with torch._C.DisableTorchFunctionSubclass():
            grads = list(map(_grad, self.model_params))
        return self.checked(grads, checked)

    def checked(self, grads: list[Tensor], checked: bool) -> list[Tensor] | None:
        """`grads` (what the kernel reads), checked (see ``grads``) unless they are those checked last step
        (accumulated in place, or never zeroed). Only checked grads are remembered: holding the others
        would keep last step's grads alive until this one, and free them inside it."""
        if not checked:
            return grads
        if len(grads) == len(self.last_grads) and all(map(operator.is_, grads, self.last_grads)):
            return grads
        if (any(map(_is_none, grads)) or set(map(_dtype, grads)) != {self.grad_dtype}
                or set(map(_layout, grads)) != {torch.strided} or list(map(_stride, grads)) != self.strides):
            return None
        self.last_grads = grads
        return grads


@dataclass
class StepPlan:
    key: tuple
    calls: list[Call]
    unplanned: list[Tensor]  # params that had no gradient when the plan was built
    params: list[Tensor]  # every group's params, in order, when the plan was built
    entries: list[dict[str, Any]]  # the state's per-param dicts, in its order, when the plan was built
    # One C++ reference to every tensor the calls pass each step, which keeps a per-tensor GIL round trip
    # out of each kernel call (ops.hold_references).
    held: object = None

    def current(self, key: tuple, groups: list[dict[str, Any]], state: Any, check_first: bool
                ) -> list[tuple[Call, list[Tensor]]] | None:
        """[(call, grads)] for this step, or None where the plan does not describe it. The first call's
        grads are checked here only with `check_first` (else by the kernel, before it writes anything)."""
        if key != self.key:
            return None
        # A param swapped into a group's list, or a state tensor replaced (opt.state[p]["exp_avg"] = ...),
        # keeps the key: the plan would update the old tensors. Identity checks, whole lists at a time.
        if not all(map(operator.is_, itertools.chain.from_iterable(g["params"] for g in groups), self.params)):
            return None
        if not all(map(operator.is_, state.values(), self.entries)):  # (no Tensor.__hash__: no Python calls)
            return None
        if not all(map(_is_none, map(_grad, self.unplanned))):
            return None
        out = []
        for index, call in enumerate(self.calls):
            checked = check_first or index > 0 or call.viewed  # (views are built before the kernel)
            if call.dtypes(checked) != {call.param_dtype}:
                return None
            try:  # (itemgetter: a third of dict.get's time; a key gone raises KeyError)
                for name, planned in call.state_lists():
                    if name not in call.packed and not all(map(operator.is_, map(operator.itemgetter(name),
                                                                                 call.entries), planned)):
                        return None
                # A packed moment is checked by address instead: the kernel updates the memory at the
                # planned addresses, which the state must hold. That catches a tensor replaced by
                # assignment and a view given other memory (``.data =``, ``set_``: it keeps its identity);
                # a tensor replaced by an alias of the same memory is updated through it.
                for name, ptrs in call.packed_ptrs.items():
                    if call.addresses(name) != ptrs:
                        return None
            except (KeyError, TypeError, AttributeError):  # (a state value replaced by another kind of value)
                return None
            if call.step_storage is not None and call.step_storage._version != call.step_version:
                return None  # a step count was changed in place: the general step takes each as it is
            grads = call.grads(checked)
            if grads is None:
                return None
            out.append((call, grads))
        return out

    def packs(self) -> dict[tuple[int, ...], Tensor]:
        """Each packed moment tensor of the plan, by the addresses of the state's tensors in it."""
        return {tuple(call.packed_ptrs[name]): flat for call in self.calls for name, flat in call.packed.items()}


def plan_key(groups: list[dict[str, Any]], state: Any, epoch: int) -> tuple:
    """What a plan depends on besides the grads and the params' dtypes, in O(groups)."""
    return (epoch, id(state), len(state), tuple((id(g["params"]), len(g["params"])) for g in groups))


def build(key: tuple, groups: list[dict[str, Any]], state: Any, eager: bool, previous: StepPlan | None = None
          ) -> StepPlan | None:
    """A plan for the params that have a gradient and a state now (None if some have a gradient but
    no state, or a group lists a param twice: the general step updates it once per listing). `eager`: one
    call per step count, whose params' step tensors become views of one tensor (same values, still
    float32 scalars: torch's format), the call's ``step_storage``, and whose moments are packed
    (``pack_moments``; `previous`, the plan this one replaces, tells which already are)."""
    params = [p for g in groups for p in g["params"]]
    if len(set(map(id, params))) != len(params):
        return None
    calls: dict[tuple, Call] = {}
    unplanned = []
    position = -1
    for index, group in enumerate(groups):
        for p in group["params"]:
            position += 1
            g = p.grad
            if g is None:
                unplanned.append(p)
                continue
            s = state.get(p)
            if not s:
                return None
            master, viewed = "param" in s, needs_view(p)
            key_ = (index, p.dtype, g.dtype, master, viewed, dtensor.is_dtensor(p), s["exp_avg"].dtype,
                    s["exp_avg_sq"].dtype)
            key_ += (float(s["step"]),) if eager else ()
            call = calls.get(key_)
            if call is None:
                call = calls[key_] = Call(index, [], [], [], [], [], [], p.dtype, g.dtype, [], [], viewed)
                call.plain_types = True
            call.entries.append(s)
            call.model_params.append(p)
            call.plain_types = call.plain_types and type(p) in (Tensor, torch.nn.Parameter)
            call.params.append(s["param"] if master else p)
            call.exp_avgs.append(s["exp_avg"])
            call.exp_avg_sqs.append(s["exp_avg_sq"])
            if master:
                call.param_outs.append(p)
            call.steps.append(s["step"])
            call.param_ids.append(position)
            call.param_offsets.append(element_offset(p))
            call.shapes.append(p.shape)
            call.strides.append(layout_strides(p) if viewed else p.stride())
    for call in calls.values():
        call.exp_avg_scales, call.exp_avg_sq_scales = MomentState.scales(call.entries)
    if eager:
        packs = previous.packs() if previous is not None else {}
        for call in calls.values():
            call.step_storage = torch.stack(call.steps).to(torch.float32)
            call.step_version = call.step_storage._version
            call.steps = list(call.step_storage.unbind())
            for s, step in zip(call.entries, call.steps):
                s["step"] = step
            pack_moments(call, packs)
        release_old_packs(state, calls.values(), packs)
    planned = [ShardedCall.of(c) if dtensor.is_dtensor(c.model_params[0]) else c for c in calls.values()]
    held = ops.hold_references(t for c in planned for t in c.kernel_tensors())
    return StepPlan(key, planned, unplanned, params, list(state.values()), held)


def pack_moments(call: Call, previous: dict[tuple[int, ...], Tensor]) -> None:
    """Packs each of the call's fp32 or bf16 moment lists into one tensor (Note [Packed moments] in
    csrc/binding.cpp), whose entries, shaped and strided as the moments were and each over a storage of its
    own (``own_storage``: DTensors over them deep-copy, and each saves alone), become the state's (DTensor
    params' wrapped as before): the kernel call then passes two tensors instead of two per param. Values
    are copied once; a list that `previous` (a former plan's ``StepPlan.packs``) packed at the same
    addresses keeps its packed tensor. 8-bit moments, a list over ``PACK_LIMIT`` bytes and the lists of a
    call of views stay one tensor per param."""
    if call.viewed or len(call.params) < 2:
        return
    for name, attr in (("exp_avg", "exp_avgs"), ("exp_avg_sq", "exp_avg_sqs")):
        tensors = getattr(call, attr)
        shards = list(map(dtensor.local, tensors))
        first = shards[0]
        _, total = packed_offsets(list(map(Tensor.numel, shards)))
        if (first.dtype not in (torch.float32, torch.bfloat16) or not total
                or total * first.element_size() > PACK_LIMIT):
            continue  # (all empty: nothing to pack, and every address 0)
        ptrs = tuple(map(_data_ptr, shards))
        flat = previous.get(ptrs)
        if flat is None or flat.dtype != first.dtype:
            flat = torch.zeros(total, dtype=first.dtype, device=first.device)
            views = list(map(own_storage, packed_views(flat, shards)))
            torch._foreach_copy_(views, shards)
            tensors = [dtensor.like_param(t, lambda _, v=v: v) for t, v in zip(tensors, views)]
            for entry, t in zip(call.entries, tensors):
                entry[name] = t
            setattr(call, attr, tensors)
            ptrs = tuple(map(_data_ptr, views))
        call.packed[name] = flat
        call.packed_ptrs[name] = list(ptrs)


def release_old_packs(state: Any, calls: Any, previous: dict[tuple[int, ...], Tensor]) -> None:
    """Gives its own memory to each state moment left in a packed tensor of `previous` that no call packs
    now (a param without a gradient when the plan was rebuilt), so that it does not keep that whole tensor
    alive."""
    live = {flat.data_ptr() for call in calls for flat in call.packed.values()}
    dead = sorted((f.data_ptr(), f.data_ptr() + f.nbytes) for f in previous.values() if f.data_ptr() not in live)
    if not dead:
        return
    starts = [start for start, _ in dead]
    for entry in state.values():
        for name in ("exp_avg", "exp_avg_sq"):
            t = entry.get(name)
            if isinstance(t, Tensor):
                address = dtensor.local(t).data_ptr()
                i = bisect.bisect_right(starts, address) - 1  # the last dead pack starting at or before it
                if i >= 0 and address < dead[i][1]:
                    entry[name] = dtensor.like_param(t, torch.clone)  # (preserve_format: its param's strides)


@dataclass
class ShardedCall(Call):
    """A call over DTensor params (distopt/dtensor.py): the kernel's lists hold the local shards of the
    params and their state. ``held`` keeps what the state holds (the DTensors, and the plain step
    counters), which the identity checks compare. Each step checks that the params still wrap the
    planned shards and that the grads are laid out as when the plan was built (FSDP2 gives a grad the
    param's own spec object; tensor parallelism a new spec each step, compared by mesh, placements and
    shape, with C-level comparisons: meshes by identity with the mesh objects last seen, which DTensor's
    sharding cache may share between equal meshes, compared by value once when they change), unwraps
    them, and converts those placed unlike their params (``conversions``, as the general step does)."""

    held: list[tuple[str, list[Tensor]]] = field(default_factory=list)
    param_shards: list[Tensor] = field(default_factory=list)
    specs: list[Any] = field(default_factory=list)  # the grads' specs last seen
    meshes: list[Any] = field(default_factory=list)  # the params'
    grad_placements: list[tuple] = field(default_factory=list)  # the grads', when the plan was built
    global_shapes: list[torch.Size] = field(default_factory=list)
    grad_meshes: list[Any] = field(default_factory=list)  # the grads' last mesh objects, each equal to its param's
    conversions: list[tuple[int, dtensor.GradConversion]] = field(default_factory=list)

    @classmethod
    def of(cls, call: Call) -> ShardedCall:
        sharded = cls(**{f.name: getattr(call, f.name) for f in fields(Call)})
        sharded.held = call.state_lists()
        for name in ("params", "exp_avgs", "exp_avg_sqs", "param_outs"):
            setattr(sharded, name, [dtensor.local(t) for t in getattr(call, name)])
        sharded.exp_avg_scales, sharded.exp_avg_sq_scales = MomentState.kernel_scales(call.entries)
        sharded.param_shards = list(map(_local, call.model_params))
        sharded.shapes = list(map(_shape, sharded.param_shards))
        sharded.strides = list(map(_stride, sharded.param_shards))
        grads = list(map(_grad, call.model_params))  # (the general step has just taken them)
        sharded.specs = list(map(_spec, grads))
        sharded.meshes = list(map(_mesh, map(_spec, call.model_params)))
        sharded.grad_placements = list(map(_placements, sharded.specs))
        sharded.global_shapes = list(map(_shape, call.model_params))
        sharded.grad_meshes = sharded.meshes
        sharded.conversions = [(i, dtensor.GradConversion(p, g)) for i, (p, g) in enumerate(zip(call.model_params,
                                                                                                 grads))
                               if g._spec is not p._spec and tuple(g.placements) != tuple(p.placements)]
        return sharded

    def state_lists(self) -> list[tuple[str, list[Tensor]]]:
        return self.held

    def addresses(self, name: str) -> list[int]:
        return list(map(_data_ptr, map(_local, map(operator.itemgetter(name), self.entries))))

    def grad_references(self, grads: list[Tensor]) -> object | None:
        # The grads' local shards are held by their DTensors' Python objects only: held for the call
        # (not longer, which would keep zero_grad()'s freed grads alive), it saves a GIL round trip each.
        return ops.hold_references(grads)

    def dtypes(self, checked: bool) -> set[torch.dtype]:
        # (the shards': a DTensor's own getters cost twice a plain tensor's)
        return set(map(_dtype, self.param_shards)) if checked else {self.param_shards[0].dtype}

    def grads(self, checked: bool) -> list[Tensor] | None:
        if not all(map(operator.is_, map(_local, self.model_params), self.param_shards)):
            return None  # a param's shard was replaced (FSDP2 does on model.to(), load_state_dict(assign=True))
        # A DTensor's .grad getter first looks for a __torch_function__ override (a few microseconds a
        # param); DTensor has none that applies to it, so it is read with subclass overrides disabled.
        with torch._C.DisableTorchFunctionSubclass():
            grads = list(map(_grad, self.model_params))
        try:
            specs = list(map(_spec, grads))
        except AttributeError:
            return None  # a grad is missing, or not a DTensor
        if not all(map(operator.is_, specs, self.specs)):
            meshes = list(map(_mesh, specs))
            if not all(map(operator.is_, meshes, self.grad_meshes)):
                if not all(map(operator.eq, meshes, self.meshes)):
                    return None  # the general step checks each grad and raises the precise error
                self.grad_meshes = meshes
            if not (all(map(operator.eq, map(_placements, specs), self.grad_placements))
                    and list(map(_shape, grads)) == self.global_shapes):
                return None
            self.specs = specs
        shards = list(map(_local, grads))
        for i, convert in self.conversions:
            shards[i] = convert(grads[i])
        return self.checked(shards, checked)
