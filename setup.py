"""Builds distopt and its compiled modules distopt._C (CPU kernels) and distopt._C_cuda (CUDA kernels, when
torch is a CUDA build and nvcc is found); csrc/build_config.py describes them and its knobs.

Both use only LibTorch's stable ABI and Python's limited API, so `pip install .` and `pip wheel .` work
with pip's default build isolation: whichever torch the isolated build downloads, the result is one
cp310-abi3 wheel that loads under every torch >= 2.11 and every CPython >= 3.10.
"""

import os
import sys
from pathlib import Path

from setuptools import setup

sys.path.insert(0, str(Path(__file__).resolve().parent / "csrc"))
import build_config  # noqa: E402

with_cuda = build_config.cuda_requested()
build_config.prepare_environment(with_cuda)

from torch.utils.cpp_extension import BuildExtension, CppExtension  # noqa: E402


class BuildModules(BuildExtension):
    """torch's extension builder, with each module's objects in a folder of its own: both modules compile
    csrc/binding.cpp (with their own TORCH_EXTENSION_NAME), which would otherwise share one object file."""

    def build_extension(self, ext):
        base = self.build_temp
        self.build_temp = os.path.join(base, ext.name.rpartition(".")[2])
        try:
            super().build_extension(ext)
        finally:
            self.build_temp = base


def extension(name: str, kwargs: dict) -> CppExtension:
    """A CppExtension linked against build_config's libraries only (CppExtension adds c10 and libtorch)."""
    ext = CppExtension(name, **{**kwargs, "libraries": list(kwargs["libraries"])})
    ext.libraries = kwargs["libraries"]
    return ext


print(f"distopt: building distopt._C{' and distopt._C_cuda' if with_cuda else ' (no CUDA kernels)'}", file=sys.stderr)
ext_modules = [extension("distopt._C", build_config.cpu_extension_kwargs())]
if with_cuda:
    ext_modules.append(extension("distopt._C_cuda", build_config.cuda_extension_kwargs()))

setup(
    ext_modules=ext_modules,
    cmdclass={"build_ext": BuildModules},
    options={"bdist_wheel": {"py_limited_api": build_config.PY_LIMITED_API}},
)
