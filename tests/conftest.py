"""Shared pytest setup: the `cuda` marker skips cleanly without a GPU; every test starts seeded."""

import pytest
import torch

# The op tests' shared helpers are a plain module: have pytest rewrite their asserts as it does a test module's.
pytest.register_assert_rewrite("op_helpers", "backends")

# The op tests' parametrised `backend` fixture: cpu, cuda-emulated, cuda (see backends.py).
from backends import backend  # noqa: E402, F401

HAS_GPU = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none visible)")
    for item in items:
        if "cuda" in item.keywords and not HAS_GPU:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)


@pytest.fixture(scope="module")
def one_intra_op_thread():
    """For the CPU op test modules (``pytestmark = pytest.mark.usefixtures("one_intra_op_thread")``): the
    CPU kernels are single-threaded loops and the reference ops there are small: intra-op threads buy
    nothing, and their spin-waits make the suite many times slower on a busy 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
