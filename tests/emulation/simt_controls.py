"""ctypes access to the SIMT emulator's controls (controls.cpp), built with the emulated build's flags."""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import pytest
import torch
from torch.utils import cpp_extension

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "csrc"))
import build_config  # noqa: E402

NAME = "distopt_simt_controls"
BLOCK = 512  # kBlockSize
DEFAULT_RUNTIME = (13000, 13000, 9)  # the emulator's initial machine: CUDA 13.0 on an H100 (simt.h)


class Controls:
    """ctypes access to controls.cpp's entry points."""

    def __init__(self, path: Path) -> None:
        self.lib = ctypes.CDLL(str(path))
        self.lib.distopt_simt_control.restype = ctypes.c_int
        self.lib.distopt_simt_control.argtypes = [
            ctypes.c_char_p, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t,
        ]  # fmt: skip
        self.lib.distopt_simt_stats.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_int]
        self.lib.distopt_simt_set_runtime.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
        self.lib.distopt_simt_set_bank_counting.argtypes = [ctypes.c_int]

    def run(self, name: str, x: torch.Tensor, out: torch.Tensor, seed: int = 1) -> None:
        """Runs control ``name``; raises RuntimeError with the emulator's message if it rejects it."""
        err = ctypes.create_string_buffer(8192)
        rc = self.lib.distopt_simt_control(name.encode(), seed, x.data_ptr(), out.data_ptr(), err, len(err))
        if rc == 2:
            raise ValueError(f"no control named {name!r}")
        if rc != 0:
            raise RuntimeError(err.value.decode())

    def set_runtime(
        self, driver: int = DEFAULT_RUNTIME[0], runtime: int = DEFAULT_RUNTIME[1], cc_major: int = DEFAULT_RUNTIME[2]
    ) -> None:
        """What the emulated machine reports (CUDA versions as 1000 * major + 10 * minor)."""
        self.lib.distopt_simt_set_runtime(driver, runtime, cc_major)

    def set_bank_counting(self, on: bool) -> None:
        """Counts shared-memory requests and wavefronts from the next launch on (Note [Shared-memory
        wavefronts] in csrc/testing/simt/simt.h)."""
        self.lib.distopt_simt_set_bank_counting(int(on))

    def stats(self, reset: bool = False) -> dict[str, int]:
        values = (ctypes.c_uint64 * 8)()
        self.lib.distopt_simt_stats(values, int(reset))
        keys = (
            "launches",
            "blocks",
            "threads",
            "barriers",
            "warp_collectives",
            "shared_accesses",
            "shared_requests",
            "shared_wavefronts",
        )
        return dict(zip(keys, values))


def build_controls() -> Controls:
    """controls.cpp built (once per source change, torch and Python, under build/) and loaded; skips where
    the emulator is not built."""
    if not build_config.emulation_requested():
        pytest.skip("the SIMT emulator is not built on this platform (DISTOPT_BUILD_EMULATED)")
    build_dir = build_config.emulation_build_dir(NAME, torch.__version__)
    build_dir.mkdir(parents=True, exist_ok=True)
    sources = [str(Path(__file__).with_name("controls.cpp"))] + [str(ROOT / s) for s in build_config.EMULATION_RUNTIME]
    cpp_extension.load(
        name=NAME,
        sources=sources,
        extra_cflags=build_config.EMULATION_FLAGS,
        extra_include_paths=[build_config.EMULATION_INCLUDE],
        build_directory=str(build_dir),
        is_python_module=False,
        verbose=False,
    )
    return Controls(build_dir / f"{NAME}.so")
