"""The reference and sdpa backends on CUDA tensors follow the same semantics (device machine only)."""

import pytest
import torch

import elsa_surgery
from oracle import naive_attention, rel_err

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2), (torch.float16, 5e-3)])
@pytest.mark.parametrize("backend", ["reference", "sdpa"])
def test_backends_on_cuda(dtype, tol, backend):
    torch.backends.cuda.matmul.allow_tf32 = False
    g = torch.Generator().manual_seed(0)
    B, Hq, Hkv, Nq, Nk, D = 2, 4, 2, 200, 333, 64
    q = torch.randn(B, Hq, Nq, D, generator=g)
    k = torch.randn(B, Hkv, Nk, D, generator=g)
    v = torch.randn(B, Hkv, Nk, D, generator=g)
    mask = torch.rand(B, 1, Nq, Nk, generator=g) < 0.8
    mask[:, :, 5] = False
    kw = dict(is_causal=True, q_lengths=[200, 150], kv_lengths=[333, 100])
    ref, _ = naive_attention(q.to(dtype), k.to(dtype), v.to(dtype), mask, **kw)
    out = elsa_surgery.attention(q.cuda().to(dtype), k.cuda().to(dtype), v.cuda().to(dtype), mask.cuda(),
                                 enable_gqa=True, backend=backend, **kw)
    assert out.dtype == dtype and not torch.isnan(out).any()
    assert rel_err(out.cpu(), ref) < tol


def test_reference_long_sequence_on_cuda_bounded_memory():
    N = 65536
    q, k, v = (torch.randn(1, 4, N, 64, device="cuda") for _ in range(3))
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = elsa_surgery.attention(q, k, v, is_causal=True, backend="reference")
    extra = torch.cuda.max_memory_allocated() - base
    assert extra < 1 << 30, f"extra memory {extra / 2**20:.0f} MiB"  # N x N would be 64 GiB
    assert torch.isfinite(out).all()
