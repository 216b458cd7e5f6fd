"""Token-range readers over what ``stream.attention`` accepts: CPU/CUDA tensors, numpy arrays and memmaps
(C-contiguous), safetensors slices (``safe_open(...).get_slice(name)``), all shaped ``[B, H, N, D]``."""

from __future__ import annotations

import numpy as np
import torch


class Source:
    """``rows(a, b)``: tokens ``a:b`` as a torch tensor ``[B, H, b - a, D]`` (a view where the storage allows)."""

    def __init__(self, x, name: str):
        self.name = name
        self.x = x
        if isinstance(x, torch.Tensor):
            self.kind, self.shape, self.dtype, self.device = "tensor", tuple(x.shape), x.dtype, x.device
        elif isinstance(x, np.ndarray):
            if not x.flags.c_contiguous:
                raise ValueError(f"{name}: a numpy array / memmap must be C-contiguous (got strides {x.strides} for "
                                 f"shape {x.shape}); pass np.ascontiguousarray or rewrite the file in [B, H, N, D] "
                                 "order")
            try:
                dtype = torch.from_numpy(np.empty(0, dtype=x.dtype)).dtype
            except TypeError as e:
                raise TypeError(f"{name}: numpy dtype {x.dtype} has no torch equivalent; use float16/float32/float64 "
                                f"(bf16 on disk: torch.from_file(..., dtype=torch.bfloat16))") from e
            self.kind, self.shape, self.dtype, self.device = "numpy", tuple(x.shape), dtype, torch.device("cpu")
        elif hasattr(x, "get_shape") and hasattr(x, "get_dtype"):
            dt = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}
            if x.get_dtype() not in dt:
                raise TypeError(f"{name}: safetensors dtype {x.get_dtype()} is not a float type")
            self.kind, self.shape, self.dtype, self.device = "safetensors", tuple(x.get_shape()), dt[x.get_dtype()], \
                torch.device("cpu")
        else:
            raise TypeError(f"{name}: expected a torch.Tensor, a numpy array/memmap or a safetensors slice, "
                            f"got {type(x).__name__}")
        if len(self.shape) != 4:
            raise ValueError(f"{name}: expected 4 dims [B, H, N, D], got shape {self.shape}")

    def rows(self, a: int, b: int) -> torch.Tensor:
        if self.kind == "tensor":
            return self.x[:, :, a:b]
        if self.kind == "numpy":
            return torch.from_numpy(self.x[:, :, a:b])
        return self.x[:, :, a:b]

    def sample_bytes(self, count: int = 16) -> bytes:
        """A few token rows, evenly spaced, as bytes (the checkpoint's content fingerprint)."""
        n = self.shape[2]
        idx = sorted({int(i) for i in np.linspace(0, max(n - 1, 0), num=min(count, n))}) if n else []
        parts = [self.rows(i, i + 1).detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes() for i in idx]
        return b"".join(parts)
