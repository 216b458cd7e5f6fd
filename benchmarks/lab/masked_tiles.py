"""Masked attention at long rows: ELSA's masked kernel against SDPA's masked kernels (issue 33's LLaMA bf16 cell).

Session 32's H100 profile of compiled LLaMA-13B-shaped prefill (bf16, 4K) found both sides on masked attention, as
transformers builds a packed-sequence mask while tracing: cuDNN 1.03 ms a layer, ELSA's masked kernel 2.5 ms. This
times one call (``[B, H, N, D]``, a boolean mask ``[1, 1, N, N]`` unless said) for the mask shapes users' models
build, on ELSA (``backend="elsa"``, with the mask's tile ranges on and off: ``ELSA_MASK_TILES``) and on SDPA's
cuDNN and memory-efficient kernels with the same mask, and, for the causal-shaped mask, ELSA and SDPA with
``is_causal`` (no mask) as the floor:

* ``causal``: lower-triangular; ``packed``: block-diagonal causal, 4 documents (a packed-sequence mask);
* ``window``: causal sliding window of ``N / 4`` keys; ``padding``: every row sees the first ``3N / 4`` keys;
* ``random``: i.i.d. keys visible with probability 1/2 (no structure: the ranges cannot help).

    python benchmarks/lab/masked_tiles.py [--n 4096] [--shape 1x40x128] [--dtypes bf16,fp32] [--backward]

``--backward``: forward + backward (the gradients of q, k, v for a random output gradient) instead of the forward.

Each cell: CUDA-synchronised wall time per call (median of interleaved rounds, elsa_surgery.benchmark) and the
largest difference from SDPA's efficient kernel. Needs a CUDA GPU.
"""

import argparse

import torch
import torch.nn.functional as F

import elsa_surgery
from elsa_surgery import benchmark

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def masks(n, device):
    i = torch.arange(n, device=device)
    causal = i[None, :] <= i[:, None]
    doc = i // (n // 4)
    window = causal & (i[:, None] - i[None, :] < n // 4)
    g = torch.Generator(device=device).manual_seed(0)
    return {"causal": causal, "packed": causal & (doc[:, None] == doc[None, :]), "window": window,
            "padding": (i[None, :] < 3 * n // 4).expand(n, n), "random": torch.rand(n, n, device=device,
                                                                                     generator=g) < 0.5}


def sdpa_with(backend, q, k, v, **kw):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel(getattr(SDPBackend, backend)):
        return F.scaled_dot_product_attention(q, k, v, **kw)


def backward_of(fn, go, inputs):
    """``fn()``'s output after the gradients of ``inputs`` for the output gradient ``go`` were computed."""
    out = fn()
    torch.autograd.grad(out, inputs, go)
    return out.detach()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--shape", default="1x40x128", help="BxHxD")
    ap.add_argument("--dtypes", default="bf16,fp32")
    ap.add_argument("--masks", default="causal,packed,window,padding,random")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--backward", action="store_true", help="forward + backward")
    a = ap.parse_args()
    B, H, D = (int(x) for x in a.shape.split("x"))
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}  N={a.n} B={B} H={H} D={D}", flush=True)
    for dname in a.dtypes.split(","):
        dt = DTYPES[dname]
        q, k, v = (torch.randn(B, H, a.n, D, device="cuda", dtype=dt, requires_grad=a.backward) for _ in range(3))
        go = torch.randn(B, H, a.n, D, device="cuda", dtype=dt)
        for mname, m2 in masks(a.n, "cuda").items():
            if mname not in a.masks.split(","):
                continue
            mask = m2[None, None]
            ref = sdpa_with("EFFICIENT_ATTENTION", q, k, v, attn_mask=mask)

            def elsa(tiles):
                def run():  # the backward reads the knob too: inside the block
                    with benchmark.environ({"ELSA_MASK_TILES": tiles}):
                        fn = lambda: elsa_surgery.attention(q, k, v, attn_mask=mask, backend="elsa")  # noqa: E731
                        return backward_of(fn, go, (q, k, v)) if a.backward else fn()
                return run

            # with --backward, "elsa tiles" classifies the mask for both passes (ELSA_MASK_TILES=all), "elsa fwd
            # tiles" for the forward only (the default)
            fns = {"elsa tiles": elsa("all" if a.backward else "forward"), "elsa no tiles": elsa("0"),
                   **({"elsa fwd tiles": elsa("forward")} if a.backward else {}),
                   "efficient": lambda: sdpa_with("EFFICIENT_ATTENTION", q, k, v, attn_mask=mask)}
            if dt != torch.float32:
                fns["cudnn"] = lambda: sdpa_with("CUDNN_ATTENTION", q, k, v, attn_mask=mask)
            if mname == "causal":
                fns["elsa is_causal"] = lambda: elsa_surgery.attention(q, k, v, is_causal=True, backend="elsa")
                fns["flash/eff is_causal"] = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)
            if a.backward:  # each other route: forward, then the gradients of q, k, v for the output gradient go
                fns = {name: fn if name in ("elsa tiles", "elsa no tiles", "elsa fwd tiles")
                       else (lambda fn=fn: backward_of(fn, go, (q, k, v))) for name, fn in fns.items()}
            diffs = {}
            for name, fn in fns.items():
                try:
                    diffs[name] = (fn().float() - ref.float()).abs().max().item()
                except RuntimeError as e:  # a backend that refuses the call
                    diffs[name] = f"refused ({str(e).splitlines()[0][:60]})"
            live = {name: fn for name, fn in fns.items() if not isinstance(diffs[name], str)}
            ms = benchmark.interleaved_ms(live, rounds=a.rounds, calls=a.calls)
            cells = "; ".join(f"{name} {ms[name]:.3f} ms (max diff {diffs[name]:.2e})" if name in ms
                              else f"{name} {diffs[name]}" for name in fns)
            print(f"{dname} {mname}: {cells}", flush=True)


if __name__ == "__main__":
    main()
