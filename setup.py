"""Builds distopt and its compiled modules distopt._C (CPU kernels) and distopt._C_cuda (CUDA kernels, when
torch is a CUDA build and nvcc is found); csrc/build_config.py describes them and its knobs.

Both use only LibTorch's stable ABI and Python's limited API, so `pip install .` and `pip wheel .` work
with pip's default build isolation: whichever torch the isolated build downloads, the result is one
cp310-abi3 wheel that loads under every torch >= 2.11 and every CPython >= 3.10.

A wheel gets the CUDA kernels for every supported GPU; a local build (`pip install -e .`, `python setup.py
build_ext --inplace`) only for the GPUs this machine sees, none without one (build_config.cuda_plan).
"""

import logging
import os
import sys
import warnings
from pathlib import Path

from setuptools import setup

# pip >= 26 shows a build backend's warnings even with -q. Two say nothing to someone installing distopt:
# torch's, in an isolated build environment without numpy, at each import (the build needs no numpy); and
# setuptools' editable install's (pip install -e .), that a folder named like the package in the working
# directory may take precedence on import (here that folder is the package itself).
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
warnings.filterwarnings("ignore", message="Editable installation")
# And without a GPU, torch's extension builder logs "No CUDA runtime is found" when imported: the build's
# own line says what it does about that.
logging.getLogger("torch.utils.cpp_extension").addFilter(lambda r: "No CUDA runtime is found" not in r.getMessage())

sys.path.insert(0, str(Path(__file__).resolve().parent / "csrc"))
import build_config  # noqa: E402

cuda_possible = build_config.cuda_requested()
build_config.prepare_environment(False)  # CUDA_HOME, before cpp_extension reads it; the arch list in run()

from torch.utils.cpp_extension import BuildExtension, CppExtension  # noqa: E402


class BuildModules(BuildExtension):
    """torch's extension builder, which decides here whether (and for which architectures) this build
    compiles the CUDA kernels, says so in one line, and gives each module's objects a folder of its own:
    both modules compile csrc/binding.cpp (with their own TORCH_EXTENSION_NAME), which would otherwise
    share one object file."""

    def run(self):
        # In place: `build_ext --inplace`; editable_mode: `pip install -e .` (setuptools' editable_wheel).
        local = bool(self.inplace or getattr(self, "editable_mode", False))
        plan = build_config.cuda_plan(local)
        build_config.prepare_environment(plan.build, plan.arch_list)
        print(build_config.plan_line(plan), file=sys.stderr)
        if not plan.build:
            self.extensions = [ext for ext in self.extensions if ext.name != "distopt._C_cuda"]
        super().run()

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


ext_modules = [extension("distopt._C", build_config.cpu_extension_kwargs())]
if cuda_possible:  # BuildModules.run drops it where this build does not compile it
    ext_modules.append(extension("distopt._C_cuda", build_config.cuda_extension_kwargs()))

setup(
    ext_modules=ext_modules,
    cmdclass={"build_ext": BuildModules},
    options={"bdist_wheel": {"py_limited_api": build_config.PY_LIMITED_API}},
)
