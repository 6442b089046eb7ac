"""Fixtures of the distributed tests: a one-rank NCCL group in this process, for GPU tests."""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist


@pytest.fixture(scope="module")
def nccl_group():
    """World size 1 over NCCL on GPU 0 (the gloo tests fork their own ranks instead)."""
    with tempfile.TemporaryDirectory() as tmp:
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", store=dist.FileStore(os.path.join(tmp, "store"), 1), rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()
