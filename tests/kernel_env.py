"""What the tests that run the Triton kernels share: the device and the skip marker (CPU runs need the interpreter,
which tests/conftest.py turns on when there is no GPU)."""

import os

import pytest
import torch

DEV = "cuda" if torch.cuda.is_available() else "cpu"

needs_kernels = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET", "") in ("", "0") and not torch.cuda.is_available(),
    reason="needs CUDA or TRITON_INTERPRET=1",
)
