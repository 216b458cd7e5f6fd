"""Lab: the fp16/bf16 Gluon backward (``kernels/hopper_backward._lowp_bwd``: five products a query tile, dQ added
by TMA reduce-adds or atomics) against float64 and against cuDNN's and the row pass's backward. A one-off
investigation for issue 25's bf16 target (>= 0.9x cuDNN forward + backward), not a recipe.

    python benchmarks/lab/lowp_bwd.py [--tiles '128,64,2,8;64,64,2,4'] [--n 4096] [--shapes 16x64,16x128] [--dq tma]
        [--forms plain,overlap,ws,ws2] [--public-forms ws,ws2]

Prints, per tile configuration: the relative L2 error of dQ, dK, dV against float64 autograd on small shapes (GQA,
ragged lengths, causal with Nq != Nk) next to the row pass's; then the backward's GPU time (CUDA events, median of
``triton.testing.do_bench``) at B = 1, H heads, N = ``--n``: this kernel (dQ zero-fill and the fp32 -> bf16 cast
included; delta made once, untimed: session 60's log timed its four PyTorch ops too), the row pass (the default
``backend="elsa"`` backward), the public call with ``ELSA_BWD_DQ=gluon`` (which runs this kernel, delta included:
the comparison that counts) in each form asked for (``ELSA_BWD_LOWP``), and cuDNN's (forward + backward minus
forward).
Needs an sm_90 GPU.
"""

import argparse

import torch
import triton

from elsa_surgery import benchmark
from elsa_surgery.kernels import hopper_backward as hb

DT = {"bf16": torch.bfloat16, "fp16": torch.float16}


def reference(q, k, v, do, causal, scale):
    q64, k64, v64 = (t.double().requires_grad_(True) for t in (q, k, v))
    G = q.shape[1] // k.shape[1]
    kk, vv = k64.repeat_interleave(G, 1), v64.repeat_interleave(G, 1)
    s = (q64 @ kk.transpose(-1, -2)) * scale
    if causal:
        Nq, Nk = q.shape[2], k.shape[2]
        i = torch.arange(Nq, device=q.device)[:, None] + (Nk - Nq)
        s = s.masked_fill(torch.arange(Nk, device=q.device)[None, :] > i, float("-inf"))
    p = torch.softmax(s, -1)
    out = p @ vv
    out.backward(do.double())
    lse = torch.logsumexp(s, -1)
    return out, lse, (q64.grad, k64.grad, v64.grad)


def ours(q, k, v, do, out, lse, causal, scale, tiles, dq_tma, form="plain", delta=None, regs=None):
    """This kernel's gradients in ``form`` (``hb.LOWP_FORMS``; ``regs``: ws2's registers over D = 64,
    ``hb.WS2_WIDE_REGS``, for this call)."""
    if regs is not None:
        saved, hb.WS2_WIDE_REGS = hb.WS2_WIDE_REGS, regs
        try:
            return ours(q, k, v, do, out, lse, causal, scale, tiles, dq_tma, form, delta)
        finally:
            hb.WS2_WIDE_REGS = saved
    if delta is None:
        delta = (do.float() * out.float()).sum(-1)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    hb.lowp_backward(do, q, k, v, lse, delta, dq, dk, dv, scale=scale, is_causal=causal, tiles=tiles, dq_tma=dq_tma,
                     form=form)
    return dq.to(q.dtype), dk, dv


def variants(configs, modes, forms, wide_regs=(None, )):
    """``(label, tiles, dq_tma, form, regs)`` of every kernel configuration asked for (``regs``: ws2's at head dims
    over 64, None for the default)."""
    return [(f"{t} {'tma' if m else 'atomic'}{'' if f == 'plain' else ' ' + f}{'' if r is None else f' regs={r}'}", t,
             m, f, r) for t in configs for m in modes for f in forms for r in (wide_regs if f == "ws2" else (None, ))]


def rel(a, b):
    return ((a.double() - b).norm() / b.norm().clamp_min(1e-30)).item()


def row_pass(q, k, v, do, causal):
    import elsa_surgery

    qq, kk, vv = (t.detach().requires_grad_(True) for t in (q, k, v))
    with benchmark.environ({"ELSA_BWD_DQ": "rows"}):
        o = elsa_surgery.attention(qq, kk, vv, is_causal=causal, backend="elsa", enable_gqa=True)
        o.backward(do)
    return qq.grad, kk.grad, vv.grad


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiles", default="128,64,2,8;64,64,2,4;64,64,1,4")
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=1, help="B of the timed calls (short calls: ViT's, BERT's)")
    ap.add_argument("--shapes", default="16x64,16x128")
    ap.add_argument("--dtypes", default="bf16")
    ap.add_argument("--dq", default="tma", help="tma (atomic where this Triton has no TMA reduce-add), atomic")
    ap.add_argument("--forms", default="plain,overlap,ws",
                    help="the kernel's forms (ELSA_BWD_LOWP): plain, overlap (_lowp_bwd's OVERLAP), ws and ws2 "
                         "(the warp-specialised _lowp_bwd_ws with one or two compute partitions; ws2 takes 128 x 64 "
                         "tiles only), each timed alone and through the public call")
    ap.add_argument("--public-forms", default=None,
                    help="the forms timed through the public call (default: --forms)")
    ap.add_argument("--wide-regs", default=None,
                    help="ws2's (compute, dQ) registers a thread over D = 64 to try, e.g. '216,80;224,64' "
                         "(default: hb.WS2_WIDE_REGS); 2 x compute + dQ <= 512")
    ap.add_argument("--skip-check", action="store_true")
    a = ap.parse_args()
    import elsa_surgery

    torch.manual_seed(0)
    dev = "cuda"
    configs = [tuple(int(x) for x in t.split(",")) for t in a.tiles.split(";")]
    modes = sorted({m == "tma" and hb.dq_tma_available() for m in a.dq.split(",")}, reverse=True)
    forms = a.forms.split(",")
    public_forms = a.public_forms.split(",") if a.public_forms else forms
    bad = [f for f in forms + public_forms if f not in hb.LOWP_FORMS]
    if bad:
        ap.error(f"--forms, --public-forms: {bad} not among {hb.LOWP_FORMS}")
    wide = ([tuple(int(x) for x in r.split(",")) for r in a.wide_regs.split(";")] if a.wide_regs else [None])
    kinds = variants(configs, modes, forms, wide)
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__,
          "TMA reduce-add available:", hb.dq_tma_available(), flush=True)
    if not a.skip_check:
        cases = [(2, 4, 2, 300, 520, 64, True), (1, 2, 2, 257, 257, 128, False), (1, 4, 1, 190, 700, 128, True),
                 (2, 2, 2, 128, 128, 64, False)]
        for dname in a.dtypes.split(","):
            dt = DT[dname]
            for B, Hq, Hkv, Nq, Nk, D, causal in cases:
                q = torch.randn(B, Hq, Nq, D, device=dev, dtype=dt)
                k, v = (torch.randn(B, Hkv, Nk, D, device=dev, dtype=dt) for _ in range(2))
                do = torch.randn(B, Hq, Nq, D, device=dev, dtype=dt)
                scale = D ** -0.5
                out64, lse64, ref = reference(q, k, v, do, causal, scale)
                out, lse = out64.to(dt), lse64.float().contiguous()
                base = row_pass(q, k, v, do, causal)
                line = f"{dname} B{B} {Hq}:{Hkv} {Nq}x{Nk} D{D} causal={int(causal)} row pass " + " ".join(
                    f"{rel(g, r):.2e}" for g, r in zip(base, ref))
                qq, kk, vv = (t.detach().requires_grad_(True) for t in (q, k, v))
                with benchmark.environ({"ELSA_BWD_DQ": "gluon"}):
                    o = elsa_surgery.attention(qq, kk, vv, is_causal=causal, backend="elsa", enable_gqa=True)
                    g = torch.autograd.grad(o, (qq, kk, vv), do)
                line += " | public gluon " + " ".join(f"{rel(x, r):.2e}" for x, r in zip(g, ref))
                for label, t, tma_, f, r in kinds:
                    try:
                        g = ours(q, k, v, do, out, lse, causal, scale, t, tma_, f, regs=r)
                        torch.cuda.synchronize()
                        errs = " ".join(f"{rel(x, r):.2e}" for x, r in zip(g, ref))
                    except Exception as e:
                        errs = f"FAILED {type(e).__name__}: {str(e)[:300]}"
                    line += f" | {label} {errs}"
                print(line, flush=True)
    for dname in a.dtypes.split(","):
        dt = DT[dname]
        for shape in a.shapes.split(","):
            H, D = (int(x) for x in shape.split("x"))
            N = a.n
            for causal in (False, True):
                q, k, v, do = (torch.randn(a.batch, H, N, D, device=dev, dtype=dt) for _ in range(4))
                scale = D ** -0.5
                qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
                res = {}
                from torch.nn.attention import SDPBackend, sdpa_kernel
                with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                    o = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=causal)
                    fwd = triton.testing.do_bench(
                        lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal))

                    def cud():
                        o = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=causal)
                        torch.autograd.grad(o, (qq, kk, vv), do)
                    res["cudnn"] = triton.testing.do_bench(cud) - fwd
                    res["cudnn fwd"] = fwd
                import elsa_surgery

                def elsa_fb():
                    o = elsa_surgery.attention(qq, kk, vv, is_causal=causal, backend="elsa")
                    torch.autograd.grad(o, (qq, kk, vv), do)
                efwd = triton.testing.do_bench(lambda: elsa_surgery.attention(q, k, v, is_causal=causal,
                                                                              backend="elsa"))
                with benchmark.environ({"ELSA_BWD_DQ": "rows"}):
                    res["row pass"] = triton.testing.do_bench(elsa_fb) - efwd
                # the public path to this kernel, in each form (its knob keys the launch plan: session 60's lab
                # patched the launcher instead, and a recorded plan replayed the first form)
                for form in public_forms:
                    with benchmark.environ({"ELSA_BWD_DQ": "gluon", "ELSA_BWD_LOWP": form}):
                        try:
                            res[f"public {form}"] = triton.testing.do_bench(elsa_fb) - efwd
                        except Exception as e:
                            res[f"public {form}"] = float("nan")
                            print("  failed public", form, type(e).__name__, str(e)[:300])
                res["elsa fwd"] = efwd
                with torch.no_grad():
                    o = o.detach()
                    s = (q.float() @ k.float().transpose(-1, -2)) * scale
                    if causal:
                        s = s.masked_fill(torch.ones(N, N, device=dev, dtype=torch.bool).triu(1), float("-inf"))
                    lse = torch.logsumexp(s, -1).contiguous()
                    del s
                    delta = (do.float() * o.float()).sum(-1)
                for label, t, tma_, f, r in kinds:  # (delta made once: the kernel, dQ's zero-fill and cast timed)
                    try:
                        res[label] = triton.testing.do_bench(
                            lambda: ours(q, k, v, do, o, lse, causal, scale, t, tma_, f, delta, r))
                    except Exception as e:
                        res[label] = float("nan")
                        print("  failed", label, type(e).__name__, str(e)[:300])
                print(f"{dname} B{a.batch} H{H} D{D} N{N} causal={int(causal)} backward ms: " + ", ".join(
                    f"{k_} {v_:.3f}" for k_, v_ in res.items()), flush=True)
                cu = res["cudnn"] + res["cudnn fwd"]
                best = min(v_ for k_, v_ in res.items() if k_.startswith("("))
                print(f"   fwd+bwd vs cuDNN: row pass {cu / (res['row pass'] + efwd):.3f}x, "
                      f"best new {cu / (best + efwd):.3f}x, " + ", ".join(
                          f"{k_} {cu / (v_ + efwd):.3f}x" for k_, v_ in res.items() if k_.startswith("public")),
                      flush=True)


if __name__ == "__main__":
    main()
