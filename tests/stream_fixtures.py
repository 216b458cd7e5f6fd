"""Shared by tests/test_stream.py and tests/test_stream_dist.py (imported there; pytest picks up the autouse fixture
from the import). Not used by tests/test_stream_gpu.py."""

import pytest
import torch


@pytest.fixture(autouse=True)
def cpu_stream(monkeypatch):
    """These tests are the CPU path: stream.attention picks CUDA when it is available, so hide it (on a GPU machine
    too; the forked children of test_stream_dist.py then never touch CUDA). Tiny matmuls run on one thread (2 shared
    cores: oversubscription made them ~10x slower)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)
