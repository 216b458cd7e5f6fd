"""Lab: the tiles of strict's Gluon backward (kernels/hopper_backward.py) on a Hopper GPU, and where it stands.

For each shape (B = 1, fp32): the forward's ``lse`` and ``delta`` once, then ``hopper_backward.backward`` timed
(``triton.testing.do_bench``, ms) for each kv-pass tile with the dQ pass at its default, and each dQ-pass tile with the
kv pass at its default; every configuration's gradients against float64 (relative L2, the worst of dQ, dK, dV).
With atomic dQ (``ELSA_BWD_DQ=atomic``): the kv pass alone at its default tile and at ``--atomic-tiles``.
Beside them: the public backward on the Gluon passes and on the portable ones (``ELSA_HOPPER=0``), and ME-SDPA's
backward (autograd.grad of one saved forward, timed alone). TFLOP/s counts the seven products (kv pass four, dQ
pass three; five with atomic dQ), halved when causal::

    python benchmarks/lab/strict_bwd_tiles.py [--shapes 16x4096x64,16x4096x128] [--quick]
"""

import argparse
import json
import sys

import torch
from triton.testing import do_bench

import elsa_surgery
from elsa_surgery import benchmark
from elsa_surgery.kernels import hopper_backward as hb

KV_TILES = [(64, 64, 2, 4), (64, 64, 2, 8), (32, 64, 2, 4), (64, 32, 2, 4), (64, 32, 2, 8), (128, 32, 2, 8),
            (32, 32, 2, 4), (128, 64, 1, 8)]
DQ_TILES = [(64, 64, 2, 4), (64, 64, 2, 8), (32, 64, 2, 4), (64, 32, 2, 4), (64, 32, 2, 8), (128, 32, 2, 8),
            (32, 32, 2, 4), (128, 64, 1, 8)]


def _err(g, ref):
    return max(float((a.double() - r).norm() / r.norm()) for a, r in zip(g, ref))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="16x4096x64,16x4096x128")
    p.add_argument("--causal", default="0,1")
    p.add_argument("--quick", action="store_true", help="default tiles only")
    p.add_argument("--portable", action="store_true", help="also time the portable passes (slow)")
    p.add_argument("--kv-tiles", help="kv-pass tiles to sweep, 'BN,BM,STAGES,WARPS;...' (default: KV_TILES)")
    p.add_argument("--dq-tiles", help="dQ-pass tiles to sweep, 'BM,BN,STAGES,WARPS;...' (default: DQ_TILES)")
    p.add_argument("--atomic-tiles", help="kv-pass tiles to time with atomic dQ, as --kv-tiles")
    p.add_argument("--fix-kv", help="the kv pass's tile while the dQ tiles are swept (default: hopper_backward's)")
    p.add_argument("--fix-dq", help="the dQ pass's tile while the kv tiles are swept (default: hopper_backward's)")
    args = p.parse_args(argv)

    def tiles_of(text, default):
        return [tuple(int(x) for x in t.split(",")) for t in text.split(";")] if text else default

    kv_tiles, dq_tiles = tiles_of(args.kv_tiles, KV_TILES), tiles_of(args.dq_tiles, DQ_TILES)
    fix_kv = tiles_of(args.fix_kv, [None])[0]
    fix_dq = tiles_of(args.fix_dq, [None])[0]
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    for shape in args.shapes.split(","):
        H, N, D = (int(x) for x in shape.split("x"))
        for causal in (bool(int(c)) for c in args.causal.split(",")):
            torch.manual_seed(0)
            q, k, v = (torch.randn(1, H, N, D, device="cuda", requires_grad=True) for _ in range(3))
            go = torch.randn(1, H, N, D, device="cuda")
            exact = [t.detach().double().requires_grad_() for t in (q, k, v)]
            ref = torch.autograd.grad(torch.nn.functional.scaled_dot_product_attention(*exact, is_causal=causal),
                                      exact, go.double())
            del exact
            scale = D ** -0.5
            with torch.no_grad():
                out, lse = elsa_surgery.attention(q, k, v, is_causal=causal, backend="elsa", precision="strict",
                                                  return_lse=True)
            delta = (go * out).sum(-1).contiguous()
            lse = lse.contiguous()
            work = 7 * 2 * H * N * N * D * (0.5 if causal else 1.0)
            rows = []

            def direct(kv=None, dq=None, atomic=False):
                dq_, dk_, dv_ = (torch.empty_like(t) for t in (q, k, v))

                def fn():
                    if atomic:  # (the launcher's dQ is zero-filled)
                        dq_.zero_()
                    return hb.backward(go, q.detach(), k.detach(), v.detach(), lse, delta, dq_, dk_, dv_,
                                       scale=scale, is_causal=causal, atomic=atomic, kv_tiles=kv, dq_tiles=dq)

                try:
                    g = fn()
                    torch.cuda.synchronize()
                except Exception as e:
                    return dict(error=f"{type(e).__name__}: {str(e).splitlines()[0][:100]}")
                err = _err(g, ref)
                ms = do_bench(fn, warmup=5, rep=50)
                done = work * (5 / 7 if atomic else 1)  # atomic dQ: the kv pass's five products alone
                return dict(ms=round(ms, 3), tflops=round(done / ms * 1e-9, 1), err=f"{err:.1e}")

            auto_kv, auto_dq = hb.tiles(D, D)
            rows.append(dict(what="gluon default", kv=auto_kv, dq=auto_dq, **direct()))
            rows.append(dict(what="gluon atomic dQ", kv=auto_kv, **direct(atomic=True)))
            for t in tiles_of(args.atomic_tiles, []):
                rows.append(dict(what="gluon atomic dQ", kv=t, **direct(kv=t, atomic=True)))
            if not args.quick:
                for t in kv_tiles:
                    if t != auto_kv or fix_dq:
                        rows.append(dict(what="kv tile", kv=t, dq=fix_dq or auto_dq, **direct(kv=t, dq=fix_dq)))
                for t in dq_tiles:
                    if t != auto_dq or fix_kv:
                        rows.append(dict(what="dq tile", kv=fix_kv or auto_kv, dq=t, **direct(kv=fix_kv, dq=t)))
            # public backward: Gluon, portable, ME-SDPA (autograd.grad of one saved forward each)
            for name, env, sdpa in (("public gluon", {"ELSA_HOPPER": "1"}, False),
                                    ("public portable", {"ELSA_HOPPER": "0"}, False), ("ME-SDPA", {}, True)):
                if name == "public portable" and not args.portable:
                    continue
                with benchmark.environ(env):
                    if sdpa:
                        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION):
                            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
                    else:
                        o = elsa_surgery.attention(q, k, v, is_causal=causal, backend="elsa", precision="strict")
                    fn = lambda o=o: torch.autograd.grad(o, (q, k, v), go, retain_graph=True)  # noqa: E731
                    err = _err(fn(), ref)
                    ms = do_bench(fn, warmup=3, rep=50 if not sdpa else 100)
                rows.append(dict(what=name, ms=round(ms, 3), tflops=round(work / ms * 1e-9, 1), err=f"{err:.1e}"))
            for r in rows:
                print(json.dumps(dict(H=H, N=N, D=D, causal=causal, **r)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
