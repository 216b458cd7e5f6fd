"""Shared by tests/test_stream*.py (imported there; pytest picks up the autouse fixture from the import)."""

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny matmuls: one thread each (2 shared cores; oversubscription made them ~10x slower)."""
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)
