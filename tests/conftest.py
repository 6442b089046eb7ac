"""Shared pytest setup: the `cuda` marker skips cleanly without a GPU; tests that fork gloo ranks get the
`ranks` marker; every test starts seeded; the long versions of tests run only when asked for
(`long_version`); a one-rank NCCL group for GPU tests (`nccl_group`).

The tests are grouped by the component they test (ops, fused_adam, distributed, checkpoint, lowprec,
integrations, emulation, tooling); how a test runs is a marker. Their shared helpers (tests/helpers/, and
the op tests' here) and test modules import each other by module name: pyproject.toml's pytest
``pythonpath`` puts every folder on sys.path.
"""

import os
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist

# The op tests' shared helpers are a plain module: have pytest rewrite their asserts as it does a test module's.
pytest.register_assert_rewrite("op_helpers", "backends")

# The op tests' parametrised `backend` fixture: cpu, cuda-emulated, cuda (see backends.py).
from backends import backend  # noqa: E402, F401

HAS_GPU = torch.cuda.is_available()

# The distributed tests fork their ranks (tests/helpers/harness.py). torch's autograd engine decides
# once, at a process's first backward, whether to start device threads (which make a forked child's
# backward fail); it counts every registered device type, and FakeTensor use (torch.library.opcheck,
# torch.compile) before that first backward makes it count one. A first backward now, before any test,
# keeps the test process forkable whatever order the test files run in.
_x = torch.ones(1, requires_grad=True)
(_x * 2).sum().backward()
del _x


def _forks_ranks(module, runners: tuple) -> bool:
    """Whether a test module forks gloo ranks: it holds one of distopt.testing's rank `runners` (harness.py
    re-exports them). Cheap and conservative: every test of such a module is marked."""
    return any(value is runner for value in vars(module).values() for runner in runners)


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none visible)")
    testing = sys.modules.get("distopt.testing")  # a module holding its runners has imported it
    runners = (testing.run_ranks, testing.run_ranks_outcomes) if testing is not None else ()
    forks: dict[str, bool] = {}
    for item in items:
        if "cuda" in item.keywords and not HAS_GPU:
            item.add_marker(skip)
        module = getattr(item, "module", None)
        if module is not None:
            if module.__name__ not in forks:
                forks[module.__name__] = _forks_ranks(module, runners)
            if forks[module.__name__]:
                item.add_marker(pytest.mark.ranks)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)


@pytest.fixture(scope="module")
def one_intra_op_thread():
    """For the CPU op test modules (``pytestmark = pytest.mark.usefixtures("one_intra_op_thread")``): their
    tensors are small, so intra-op threads buy nothing there, and their spin-waits make the suite many
    times slower on a busy 2-core machine (test_cpu_kernels.py tests the kernels' threading)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def long_version(request):
    """For the long (``slow``) version of a test whose short version runs by default: it skips unless the
    run selects `slow` (``pytest -m slow``) or sets DISTOPT_SLOW=1 (plain ``pytest`` deselects nothing)."""
    expr = request.config.getoption("markexpr") or ""
    if not (os.environ.get("DISTOPT_SLOW") or ("slow" in expr and "not slow" not in expr)):
        pytest.skip("long version: select it with -m slow or DISTOPT_SLOW=1")


@pytest.fixture(scope="module")
def nccl_group():
    """World size 1 over NCCL on GPU 0, in this process (the gloo tests fork their own ranks instead)."""
    with tempfile.TemporaryDirectory() as tmp:
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", store=dist.FileStore(os.path.join(tmp, "store"), 1), rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()
