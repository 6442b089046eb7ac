"""Builds distopt and its extension distopt._C (see csrc/build_config.py for the knobs).

Install with `pip install --no-build-isolation -e .` so the extension links against the torch you
already have (build isolation would download a second torch).
"""

import sys
from pathlib import Path

from setuptools import setup

sys.path.insert(0, str(Path(__file__).resolve().parent / "csrc"))
import build_config  # noqa: E402

with_cuda = build_config.cuda_requested()
build_config.prepare_environment(with_cuda)

from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension  # noqa: E402

Extension = CUDAExtension if with_cuda else CppExtension
print(f"distopt: building distopt._C with {'CPU and CUDA' if with_cuda else 'CPU'} kernels", file=sys.stderr)
ext_modules = [Extension("distopt._C", **build_config.extension_kwargs(with_cuda))]
if build_config.emulation_requested():
    # The test suite's "cuda-emulated" backend: the CUDA kernels run by a SIMT emulator on the CPU.
    print("distopt: building distopt._C_emulated (CUDA kernels under the SIMT emulator)", file=sys.stderr)
    ext_modules.append(CppExtension("distopt._C_emulated", **build_config.emulated_extension_kwargs()))

setup(ext_modules=ext_modules, cmdclass={"build_ext": BuildExtension})
