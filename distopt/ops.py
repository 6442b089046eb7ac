"""distopt's fused multi-tensor ops: schemas, typed wrappers, fake kernels and the fallback.

The schemas are defined here (``torch.ops.distopt.*``); ``distopt._C`` registers the C++ CPU kernels for
them (csrc/registration_cpu.cpp), ``distopt._C_cuda`` the CUDA kernels (csrc/registration_cuda.cpp). Where
a module cannot be imported, or was not built, the pure-PyTorch versions in ``reference.py`` are
registered instead, with one warning, so every op keeps working (slower). Schemas state exactly which
arguments each op mutates, and every op has a fake kernel, so the ops work under torch.compile and inside
CUDA-graph capture. Kernels launch on the current CUDA stream and never synchronise with the host. An
invalid argument raises ValueError before anything is written; its message starts with "distopt: ".
(From torch 2.15 a compiled kernel's exceptions reach Python as RuntimeError; the wrappers below give
those that carry that prefix back their type. Calling ``torch.ops.distopt.*`` directly skips this.)

Conventions shared by all ops:
  * list arguments hold same-dtype tensors on one device; entries at the same index have the same
    shape and strides (any dense layout, e.g. channels_last, is walked in memory order);
  * ``grad_scale``, ``found_inf``, ``skip_if`` and ``scale`` are float32 one-element tensors on
    that device; ``lr`` and ``steps`` too, or one-element CPU tensors read when the op runs;
  * ``found_inf`` as an input means "skip": a nonzero value makes the op write nothing at all.
The wrappers call each op's overload (``torch.ops.distopt.<op>.default``) rather than the packet, whose
overload resolution converts every argument once more: a fifth of the host time of a call with
thousands of tensors.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import warnings
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from . import reference
from .kernel_views import PACK_ALIGN, packed_offsets  # noqa: F401  (the packed moments' rule, adam_step_)

_SCHEMAS = {
    "adam_step_": (
        "(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
        "Tensor(d!)[] param_outs, Tensor(e!)[] param_remainders, Tensor lr, Tensor[] steps, float beta1, "
        "float beta2, float eps, float weight_decay, bool adam_w_mode, bool maximize, Tensor? grad_scale, "
        "Tensor? found_inf, Tensor(f!)[] exp_avg_scales, Tensor(g!)[] exp_avg_sq_scales, int? rounding_seed=None, "
        "int[] param_ids=[], int[] param_offsets=[]) -> ()"
    ),
    "l2norm": "(Tensor[] tensors, Tensor(a!)? found_inf) -> (Tensor, Tensor)",
    "scale_": "(Tensor[] inputs, Tensor(a!)[] outputs, Tensor scale, Tensor(b!)? found_inf) -> ()",
    "cast_copy_": "(Tensor[] inputs, Tensor(a!)[] outputs, Tensor? skip_if) -> ()",
}

OP_NAMES = tuple(_SCHEMAS)

_lib = torch.library.Library("distopt", "DEF")
for _name, _schema in _SCHEMAS.items():
    _lib.define(_name + _schema)


# Fake kernels: shapes only, for torch.compile / FakeTensor tracing.
def _fake_nothing(*args, **kwargs) -> None:
    return None


for _name in ("adam_step_", "scale_", "cast_copy_"):
    torch.library.register_fake(f"distopt::{_name}", _fake_nothing, lib=_lib)


@torch.library.register_fake("distopt::l2norm", lib=_lib)
def _l2norm_fake(tensors: Sequence[Tensor], found_inf: Tensor | None) -> tuple[Tensor, Tensor]:
    t = tensors[0]
    return t.new_empty((), dtype=torch.float32), t.new_empty((len(tensors),), dtype=torch.float32)


def _load_extension(module: str) -> tuple[bool, str]:
    """Imports distopt.<module> (registering its kernels); returns (loaded, why not: missing or the
    loader's message). Looked up first: a plain ``from . import _C`` of a missing file reports a
    "partially initialized module ... circular import", which is not the reason."""
    name = f"{__package__}.{module}"
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError) as exc:
        return False, f"the compiled extension {name} failed to load: {exc}"
    if spec is None:
        suffixes = ", ".join(importlib.machinery.EXTENSION_SUFFIXES)
        return False, f"the compiled extension {name} is missing: no {module}{{{suffixes}}} in {here}"
    try:
        importlib.import_module(name)
    except ImportError as exc:  # also a library that is not one: too old a torch, bad ELF file
        return False, f"the compiled extension {name} failed to load from {spec.origin}: {exc}"
    return True, ""


# The CPU kernels, and the CUDA kernels in a module of their own: it links libtorch_cuda, which a
# CPU-only torch lacks (there, the CPU kernels still load).
HAS_EXTENSION, _IMPORT_ERROR = _load_extension("_C")
HAS_CUDA_EXTENSION, _CUDA_IMPORT_ERROR = (
    _load_extension("_C_cuda") if torch.version.cuda is not None else (False, "torch is not a CUDA build")
)


def has_kernel(op: str, device_type: str) -> bool:
    """Whether the compiled extension registered a kernel of ``op`` for ``device_type`` ("CPU"/"CUDA")."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"distopt::{op}", device_type.upper())


# What the compiled extension registered, read before any fallback is registered over the gaps.
COMPILED_KERNELS = frozenset(
    (op, key)
    for op in OP_NAMES
    for key, loaded in (("CPU", HAS_EXTENSION), ("CUDA", HAS_CUDA_EXTENSION))
    if loaded and has_kernel(op, key)
)


def missing_kernels(device_types: Sequence[str] = ("CPU", "CUDA")) -> list[str]:
    """``op:DEVICE`` for every op that has no compiled kernel for a device type (empty: all built)."""
    return [f"{op}:{key}" for op in OP_NAMES for key in device_types if (op, key.upper()) not in COMPILED_KERNELS]


def _register_fallbacks() -> None:
    missing = [tuple(entry.split(":")) for entry in missing_kernels()]
    for name, key in missing:
        _lib.impl(name, getattr(reference, name), key)
    if not HAS_EXTENSION:
        warnings.warn(
            f"{_IMPORT_ERROR}. distopt falls back to the pure-PyTorch reference ops (correct but slower). "
            f"Reinstall distopt (it needs torch >= 2.11; this is {torch.__version__}); in a source checkout "
            "`pip install -e .`, or `python setup.py build_ext --inplace`.",
            RuntimeWarning,
            stacklevel=3,
        )
    elif any(key == "CUDA" for _, key in missing) and torch.cuda.is_available():
        warnings.warn(
            f"distopt has no CUDA kernels ({_CUDA_IMPORT_ERROR}); CUDA tensors use the pure-PyTorch reference ops.",
            RuntimeWarning,
            stacklevel=3,
        )


_register_fallbacks()


_ARGUMENT_ERROR = "distopt: "  # the start of the kernels' invalid-argument messages (csrc/kernels.h)


def _call(op: torch._ops.OpOverload, *args: object) -> object:
    """``op(*args)``, with a compiled kernel's invalid-argument error raised as ValueError on every torch."""
    try:
        return op(*args)
    except RuntimeError as error:
        if str(error).startswith(_ARGUMENT_ERROR):
            raise ValueError(str(error)) from None
        raise


def hold_references(tensors: Iterable[Tensor]) -> object | None:
    """An object holding one C++ reference to each of ``tensors`` for as long as it lives (None if there
    are none), for callers that pass the same tensors to the ops step after step (FusedAdam's step plan).

    Why: a compiled kernel receives its tensors through torch's stable ABI as new C++ references, which
    are dropped when the call returns, with the GIL released. Where such a reference is a tensor's only
    one besides its Python object (a param or a moment usually is), dropping it makes torch take the GIL
    to release the Python object's hold: a GIL round trip per tensor, a quarter of the host time of a
    call with thousands of small tensors. Holding a reference here keeps that release out of the call.
    Tensors whose other references live in C++ already (a ``.grad``, held by its param) need none.
    """
    tensors = list(tensors)
    if not tensors:
        return None
    try:  # a list of tensors held by C++ (TorchScript's list type)
        return torch._C.ScriptList(tensors)
    except (AttributeError, RuntimeError, TypeError):  # a torch without it: the calls are only slower
        return tensors


def adam_step_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    *,
    lr: float | Tensor,
    step: int | float | Tensor | Sequence[Tensor],
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    adam_w_mode: bool = True,
    param_outs: Sequence[Tensor] = (),
    param_remainders: Sequence[Tensor] = (),
    grad_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
    maximize: bool = False,
    exp_avg_scales: Sequence[Tensor] = (),
    exp_avg_sq_scales: Sequence[Tensor] = (),
    rounding_seed: int | None = None,
    param_ids: Sequence[int] = (),
    param_offsets: Sequence[int] = (),
) -> None:
    """One fused Adam/AdamW update of every tensor, in place.

    ``g = grad * grad_scale``, negated with ``maximize`` (ascend the objective, as torch's
    ``maximize=True``); Adam (L2 decay added to g) or AdamW (decoupled decay); bias correction
    for ``step`` (this update's number, >= 1). Writes params (fp32/fp16/bf16), exp_avgs and
    exp_avg_sqs, and, if given, ``param_outs`` (a copy in any float dtype, e.g. the bf16 model
    params of fp32 masters; entries aliasing their param are skipped). With ``param_remainders``
    (int16), params are bf16 high halves of fp32 masters whose low halves are the remainders. Math is
    fp32. If ``found_inf`` is nonzero nothing is written (params, moments, scales: all keep their bits).

    ``lr`` and ``step`` are numbers (read now: an eager step) or float32 one-element tensors on the
    params' device, read by the kernel with no host sync (a capturable step: a CUDA graph that captured
    the op replays with the values they hold then). ``step`` may also be one such tensor per param (the
    same tensor may appear for many); they already count this update (the caller increments them by
    ``1 - found_inf``). A one-element CPU tensor is read now, like a number.

    Moment formats (csrc/math/state_format.h, Note [State formats]), chosen by the dtype of each list
    (one dtype per list; exp_avgs and exp_avg_sqs may differ):

    * ``torch.float32``: as is (no scales);
    * ``torch.bfloat16``: read exactly, stored rounded to nearest even (or stochastically, below);
    * ``torch.uint8``: 8-bit blockwise. Codes of bitsandbytes' dynamic map (signed for exp_avgs,
      unsigned for exp_avg_sqs) and one float32 absmax per 256 elements: ``exp_avg_scales[i]`` (resp.
      ``exp_avg_sq_scales[i]``) is a contiguous float32 tensor of ``ceil(numel / 256)`` elements, blocks
      counted from the entry's first element in memory order (the order every list is walked in: the
      logical order for contiguous entries). A value is read as ``map[code] * absmax`` and stored as
      the code nearest to ``value * (1 / absmax)`` (the new absmax: the block's largest magnitude). The
      scales lists are empty for the other formats. ``lowprec.codecs.quantize_blockwise`` and
      ``lowprec.codecs.dequantize_blockwise`` convert to and from fp32 with the kernel's arithmetic, bit for
      bit (for checkpoints); ``lowprec.codecs.dynamic_map`` is the map.

    Packed moments: with more than one param, ``exp_avgs`` (or ``exp_avg_sqs``) may instead be a list of
    one 1-D contiguous fp32 or bf16 tensor holding every entry's moment back to back, entry ``i``'s the
    ``params[i].numel()`` elements from ``packed_offsets(numels)[0][i]`` on, in ``params[i]``'s memory
    order (views of it shaped and strided like the params are the per-param moments). It saves passing
    a tensor per param, the largest host cost of a call over thousands of small params.

    An entry that is a slice of a larger param (a shard) must start at a multiple of 256 elements of the
    param for its 8-bit blocks to be the param's blocks: with 8-bit moments, ``param_offsets`` must be
    multiples of 256.

    Stochastic rounding: with ``rounding_seed`` (any int64), every store to bf16 (bf16 moments, and bf16
    params without remainders) rounds up or down with probability proportional to the distance, so the
    stored value is unbiased (8-bit codes and fp16 stores stay round-to-nearest; param_outs receive the
    param's rounded value). The random bits come from Philox4x32-10 keyed by (``rounding_seed``, step,
    ``param_ids[i]``, element index), where the element index counts from the param's first element (in
    memory order): ``param_offsets[i]`` (default 0) is the entry's first element within its param. So the bits are the
    same on CPU and CUDA, for any thread count, launch split, bucket layout or world size, and after a
    resume that restores the seed and step. ``param_ids`` (one per entry, 0 <= id < 2**32) is then
    required; a param split over several entries (shards, buckets) keeps one id. Without a seed every
    store rounds to nearest and ``param_ids``/``param_offsets`` are only checked.
    """
    if not params:
        return
    if not isinstance(lr, Tensor):
        lr = torch.scalar_tensor(float(lr), dtype=torch.float64)  # float64: the number's exact value
    if isinstance(step, Tensor):
        steps: Sequence[Tensor] = (step,)
    elif isinstance(step, (int, float)):
        steps = (torch.scalar_tensor(float(step), dtype=torch.float64),)
    else:
        steps = step
    _call(
        torch.ops.distopt.adam_step_.default,
        params, grads, exp_avgs, exp_avg_sqs, param_outs, param_remainders, lr, steps,
        beta1, beta2, eps, weight_decay, adam_w_mode, maximize, grad_scale, found_inf,
        exp_avg_scales, exp_avg_sq_scales, rounding_seed, list(param_ids), list(param_offsets),
    )  # fmt: skip


def l2norm(tensors: Sequence[Tensor], found_inf: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(total, per_tensor) L2 norms as float32 tensors, squares in fp32, sums at least in fp32.

    In the same pass, ``found_inf`` (if given) is set to 1 when any element is inf or nan; it is left
    as it was otherwise, so one flag can collect several calls.
    """
    if not tensors:
        raise ValueError("l2norm needs at least one tensor")
    return _call(torch.ops.distopt.l2norm.default, tensors, found_inf)  # type: ignore[return-value]


def scale_(inputs: Sequence[Tensor], outputs: Sequence[Tensor], scale: Tensor, found_inf: Tensor | None = None) -> None:
    """``outputs[i] = inputs[i] * scale`` (fp32 product, cast to the output dtype).

    ``found_inf`` (if given) is set to 1 when any stored output is inf/nan (a cast overflow counts).
    An output may be its input (in place); partial overlaps are refused.
    """
    if inputs:
        _call(torch.ops.distopt.scale_.default, inputs, outputs, scale, found_inf)


def cast_copy_(inputs: Sequence[Tensor], outputs: Sequence[Tensor], skip_if: Tensor | None = None) -> None:
    """``outputs[i] = inputs[i]`` cast to the output dtype, unless ``skip_if`` is nonzero."""
    if inputs:
        _call(torch.ops.distopt.cast_copy_.default, inputs, outputs, skip_if)
