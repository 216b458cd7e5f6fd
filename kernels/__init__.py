"""ELSA Triton kernels (imported as ``elsa_surgery.kernels``). Knows tensors, never models."""
