"""The backends the op tests run on, as the parametrised ``backend`` fixture (conftest.py exports it).

* ``cpu``: the CPU kernels (distopt._C), on CPU tensors.
* ``cuda-emulated``: the CUDA kernels compiled as host C++ against the SIMT emulator (distopt._C_emulated,
  csrc/testing/simt), on CPU tensors: every launch also checks for barrier divergence, bad warp masks,
  deadlocks, shared-memory races and misaligned vector accesses. No GPU needed, so CI runs them.
* ``cuda``: the CUDA kernels on a GPU (the ``cuda`` marker: skipped without one).

One scenario list: an op test module requests the fixture (``pytestmark``) and is written once; its
tensors come from op_helpers' factories, which create them on the backend's device. Under
``cuda-emulated`` and ``cuda`` every ``torch.ops.distopt.*`` call is intercepted (``CrossCheck``): it runs
on the backend, and the CPU kernel runs on CPU copies of the same inputs; every mutated tensor must then
hold the CPU kernel's bits (l2norm's results: within NORM_RTOL, its summation order differs; on a GPU a
NaN matches any NaN, whose sign and payload are the hardware's), so the
whole scenario list doubles as a CPU-vs-CUDA bit-identity check, on top of its own assertions.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from distopt import ops

import op_helpers

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "csrc"))
import build_config  # noqa: E402

EMULATED_NAMESPACE = "distopt_emulated"
_emulated_lib: torch.library.Library | None = None
_emulated: Any = None


def build_emulated() -> Any:
    """distopt._C_emulated (csrc/build_config.py), built by torch's extension loader against the running
    torch and imported. It is test-only, so never installed: built here once per source change, torch and
    Python, under build/emulation/ (the first build takes a few minutes)."""
    from torch.utils import cpp_extension

    kw = build_config.emulated_extension_kwargs()
    build_dir = build_config.emulation_build_dir("_C_emulated", torch.__version__)
    build_dir.mkdir(parents=True, exist_ok=True)
    return cpp_extension.load(
        name="_C_emulated",
        sources=[str(ROOT / s) for s in kw["sources"]],
        extra_cflags=[*kw["extra_compile_args"]["cxx"], *(f"-D{k}={v}" for k, v in kw["define_macros"])],
        extra_include_paths=kw["include_dirs"],
        build_directory=str(build_dir),
        verbose=False,
    )


def load_emulated() -> Any:
    """distopt._C_emulated, whose kernels implement torch.ops.distopt_emulated.* (schemas: ops.py's)."""
    global _emulated_lib, _emulated
    if _emulated_lib is None:
        lib = torch.library.Library(EMULATED_NAMESPACE, "DEF")
        for name, schema in ops._SCHEMAS.items():
            lib.define(name + schema)
        _emulated_lib = lib
    if _emulated is None:
        _emulated = build_emulated()
    return _emulated


def emulated_or_skip() -> Any:
    """The emulated module; skips where the build leaves it out, fails where it should be there."""
    if not build_config.emulation_requested():
        pytest.skip("distopt._C_emulated is not built on this platform (DISTOPT_BUILD_EMULATED)")
    return load_emulated()


@dataclasses.dataclass(frozen=True)
class Backend:
    name: str
    device: str  # where the tests' tensors live

    def synchronize(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()


def _copy_inputs(tree: Any) -> Any:
    """CPU copies of every tensor in ``tree``; tensors viewing the same memory the same way get one copy,
    so in-place and aliased arguments (param_outs that are the params) stay aliased."""
    copies: dict[tuple, Tensor] = {}

    def copy(x: Any) -> Any:
        if not isinstance(x, Tensor):
            return x
        key = (x.device, x.data_ptr(), x.dtype, tuple(x.shape), x.stride()) if x.numel() else (id(x),)
        if key not in copies:
            copies[key] = x.detach().to("cpu", copy=True)  # keeps dense strides (channels_last)
        return copies[key]

    return tree_map(copy, tree)


class CrossCheck(TorchDispatchMode):
    """Runs distopt ops on ``backend`` and, on CPU copies, on the CPU kernel; asserts they agree."""

    def __init__(self, backend: Backend, seed: int | None = None) -> None:
        super().__init__()
        self.backend = backend
        self.seed = seed

    def backend_op(self, func, device: str):
        """What runs distopt op ``func`` (an OpOverload) on tensors of ``device``; None: not the backend's."""
        if self.backend.name == "cuda-emulated" and device == "cpu":
            return getattr(getattr(torch.ops, EMULATED_NAMESPACE), func._schema.name.split("::")[1]).default
        if self.backend.name == "cuda" and device == "cuda":
            return func
        return None  # e.g. a CPU-side computation inside a CUDA test: the CPU kernel as usual

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace != "distopt":
            return func(*args, **kwargs)
        name = func._schema.name.split("::")[1]
        device = next(x.device.type for x in tree_flatten((args, kwargs))[0] if isinstance(x, Tensor))
        run = self.backend_op(func, device)
        if run is None:
            return func(*args, **kwargs)
        cpu_args, cpu_kwargs = _copy_inputs((args, kwargs))
        result = run(*args, **kwargs)
        cpu_result = func(*cpu_args, **cpu_kwargs)  # CPU tensors, no mode inside a mode: the CPU kernel
        what = f"{self.backend.name} {name}" + (f" (scheduler seed {self.seed})" if self.seed is not None else "")
        actual, _ = tree_flatten((args, kwargs))
        expected, _ = tree_flatten((cpu_args, cpu_kwargs))
        for i, (a, e) in enumerate(zip(actual, expected)):
            if isinstance(a, Tensor):
                # A GPU makes its own NaNs (op_helpers.assert_bits_equal); the emulator runs on this CPU.
                op_helpers.assert_bits_equal(a, e, f"{what}: argument tensor #{i} vs the CPU kernel",
                                             any_nan=self.backend.name == "cuda")  # fmt: skip
        for i, (a, e) in enumerate(zip(tree_flatten(result)[0], tree_flatten(cpu_result)[0])):
            if isinstance(a, Tensor):  # l2norm's norms: fp32 sums in another order than the CPU kernel's
                torch.testing.assert_close(
                    a.cpu(), e, rtol=op_helpers.NORM_RTOL, atol=0, equal_nan=True,
                    msg=lambda m, i=i: f"{what}: result {i} vs the CPU kernel: {m}",
                )  # fmt: skip
        return result


BACKENDS = [
    pytest.param("cpu"),
    pytest.param("cuda-emulated"),
    pytest.param("cuda", marks=pytest.mark.cuda),
]


def scheduler_seed(nodeid: str) -> int:
    """$DISTOPT_SIMT_SEED, else a seed of its own per test (stable across runs), never 0 (in order)."""
    env = os.environ.get("DISTOPT_SIMT_SEED")
    return int(env, 0) if env else zlib.crc32(nodeid.encode()) | 1


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    name: str = request.param
    seed = None
    if name == "cuda-emulated":
        emulated = emulated_or_skip()
        seed = scheduler_seed(request.node.nodeid)
        emulated.set_seed(seed)
    b = Backend(name, "cuda" if name == "cuda" else "cpu")
    previous = op_helpers.set_default_device(b.device)
    try:
        if name == "cpu":
            yield b
        else:
            with CrossCheck(b, seed):
                yield b
    finally:
        op_helpers.set_default_device(previous)
