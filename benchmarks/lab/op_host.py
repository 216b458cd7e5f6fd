"""Host time of one attention call on each route a compiled graph can take (issue 33): session 32's H100 profile of
compiled Swin-T (fp32 and bf16, batch 8) found the converted graph doing less GPU work than native's and still 16 %
slower, host-bound. Which layer costs what, per call, at Swin-T's window shapes (masked) and ViT-B/16's:

* ``launcher``: ``kernels.launch.attention`` (the launch plan's replay);
* ``op body``: the custom op's kernel (``ops._dense_inference``: the launcher, its output allocated by the op);
* ``op``: ``torch.ops.elsa_surgery.attention_inference.default`` as Inductor's wrapper calls it (dispatch included);
* ``compiled op``: a compiled function holding only that op (the graph's own overhead);
* ``compiled elsa`` / ``compiled sdpa``: a compiled function holding only the call (``elsa_surgery.attention`` with
  ``backend="elsa"``: its guards too / PyTorch's SDPA with the same mask);
* ``eager sdpa``.

    python benchmarks/lab/op_host.py [--calls 300] [--profile 100]

Host time: the clock stops before the device sync (per call, median of 5 rounds); wall: with the sync. Under
``torch.inference_mode`` (as the compiled suite runs) and ``no_grad``. cProfile of ``--profile`` calls of the compiled
op, of the compiled op and of the compiled SDPA follows (first case). Needs a CUDA GPU.
"""

import argparse

import torch
import torch.nn.functional as F

import elsa_surgery
from elsa_surgery import benchmark

# name: (B, H, N, D, dtype, mask shape or None)
CASES = {"swin_t_stage1_fp32_masked": (512, 3, 49, 32, torch.float32, (64, 3, 49, 49)),
         "swin_t_stage1_bf16_masked": (512, 3, 49, 32, torch.bfloat16, (64, 3, 49, 49)),
         "vit_b16_bf16": (8, 12, 197, 64, torch.bfloat16, None)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--profile", type=int, default=100)
    a = ap.parse_args()
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    elsa_surgery.dispatch.kernels_module()
    from elsa_surgery.kernels import launch, ops

    op = torch.ops.elsa_surgery.attention_inference.default
    profiled = False
    for name, (B, H, N, D, dt, mshape) in CASES.items():
        q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=dt) for _ in range(3))
        mask = None if mshape is None else torch.randn(mshape, device="cuda", dtype=dt)
        bmask = None if mask is None else mask.repeat(B // mshape[0], 1, 1, 1)  # the kernels' broadcast as SDPA's
        scale = D ** -0.5
        prec = "precise" if dt == torch.float32 else ""
        fel = torch.compile(lambda q_, k_, v_, m_: elsa_surgery.attention(q_, k_, v_, attn_mask=m_, backend="elsa",
                                                                          windowed_mask=m_ is not None),
                            fullgraph=True)
        fop = torch.compile(lambda q_, k_, v_, m_: op(q_, k_, v_, m_, None, None, scale, False, prec, False)[0],
                            fullgraph=True)
        fsd = torch.compile(lambda q_, k_, v_, m_: F.scaled_dot_product_attention(q_, k_, v_, attn_mask=m_),
                            fullgraph=True)
        routes = {
            "launcher": lambda: launch.attention(q, k, v, scale=scale, mask=mask, precision=prec or None,
                                                 return_lse=False),
            "op body": lambda: ops._dense_inference(q, k, v, mask, None, None, scale, False, prec, False),
            "op": lambda: op(q, k, v, mask, None, None, scale, False, prec, False),
            "compiled op": lambda: fop(q, k, v, mask),
            "compiled elsa": lambda: fel(q, k, v, mask),
            "compiled sdpa": lambda: fsd(q, k, v, bmask),
            "eager sdpa": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bmask),
        }
        for mode_name, mode in (("inference_mode", torch.inference_mode), ("no_grad", torch.no_grad)):
            with mode():
                for fn in routes.values():  # warm: compiles, launch plans
                    for _ in range(3):
                        fn()
                cells = {r: benchmark.host_and_eager_us(fn, a.calls) for r, fn in routes.items()}
            print(f"{name} [{mode_name}] host / wall us per call: " + "; ".join(
                f"{r} {h:.1f} / {w:.1f}" for r, (h, w) in cells.items()), flush=True)
        if not profiled and a.profile:  # the first case: where the op's host time goes, alone and in a graph
            for route in ("op", "compiled op", "compiled sdpa"):
                profiled = True
                print(f"--- cProfile: {route}, {a.profile} calls, {name}")
                with torch.inference_mode():
                    benchmark.print_host_profile(routes[route], a.profile, (("tottime", 18),))

if __name__ == "__main__":
    main()
