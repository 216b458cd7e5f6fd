"""ELSA kernels vs PyTorch SDPA backends (math, efficient, flash, cudnn) and compiled FlexAttention.

One process, same inputs, CUDA-event timing (``triton.testing.do_bench``, median). Prints ms,
TFLOP/s (``4·B·H·Nq·Nk·D``, halved for causal), peak extra memory, the ratio of every baseline's
time to ELSA's (>1 = ELSA faster), and the GPU's measured IEEE SGEMM rate.

Examples::

    python recipes/bench_attention.py                                   # the full grid (long)
    python recipes/bench_attention.py --dtypes bf16,fp16 --n 4096,16384 --shapes 8x64
    python recipes/bench_attention.py --dtypes fp32-precise --n 16384 --sweep   # tile sweep
    python recipes/bench_attention.py --varlen-only
    python recipes/bench_attention.py --backward --dtypes bf16,fp32-precise --n 4096 --shapes 16x64,16x128
    python recipes/bench_attention.py --backward --sweep --dtypes bf16 --n 4096 --shapes 16x64 --causal 1 \
        --space 'bm=32,64,128;bn=32,64,128;w=4,8;s=1,2,3' --baselines flash,cudnn      # backward tile sweep
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch
import torch.nn.functional as F

import elsa_surgery
from elsa_surgery import benchmark
from elsa_surgery.kernels import knobs, launch, occupancy

DTYPES = {"fp32-strict": (torch.float32, "strict"), "fp32-precise": (torch.float32, "precise"),
          "fp32-turbo": (torch.float32, "turbo"), "fp16": (torch.float16, None), "bf16": (torch.bfloat16, None)}
MATH_LIMIT_BYTES = 12 << 30  # skip math SDPA when its score matrix alone would exceed this


def bench(fn, warmup=25, rep=100):
    import triton.testing

    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def peak_extra(fn):
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak / 2**20


def sgemm_tflops(n=8192):
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    a, b = torch.randn(n, n, device="cuda"), torch.randn(n, n, device="cuda")
    ms = bench(lambda: a @ b, rep=200)
    torch.backends.cuda.matmul.allow_tf32 = old
    return 2 * n**3 / ms / 1e9


def sdpa_fn(backend, q, k, v, causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    be = {"math": SDPBackend.MATH, "efficient": SDPBackend.EFFICIENT_ATTENTION,
          "flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]

    def run():
        with sdpa_kernel([be]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return run


_flex_cache = {}


def flex_fn(q, k, v, causal):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if "fn" not in _flex_cache:
        _flex_cache["fn"] = torch.compile(flex_attention, dynamic=False)
    B, H, N, _ = q.shape
    bm = None
    if causal:
        bm = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, N, N, device="cuda")
    fn = _flex_cache["fn"]
    return lambda: fn(q, k, v, block_mask=bm)


def elsa_fn(q, k, v, causal, precision):
    return lambda: elsa_surgery.attention(q, k, v, is_causal=causal, backend="elsa", precision=precision)


GRAPH = False


def graph_ms(fn):
    """Kernel time without Python launch overhead: the call captured in a CUDA graph, replays timed."""
    return bench(benchmark.cuda_graph(fn))


def lean_tradeoff(dname="bf16", H=8, D=128, nq=128, nk=65536):
    """ELSA-Lean: time and partition-state memory vs eta (decode-like: few query rows, long keys)."""
    dtype, prec = DTYPES[dname]
    q = torch.randn(1, H, nq, D, device="cuda", dtype=dtype)
    k, v = (torch.randn(1, H, nk, D, device="cuda", dtype=dtype) for _ in range(2))
    for eta in (0.0, 1.0, 4.0, 16.0, None):
        fn = lambda: launch.attention(q, k, v, scale=D ** -0.5, precision=prec, return_lse=False, eta=eta)
        fn()
        ms = bench(fn)
        mem = peak_extra(fn)
        out_mb = q.numel() * q.element_size() / 2**20
        print(f"LEAN {dname} H={H} D={D} Nq={nq} Nk={nk} eta={eta}: {ms:.3f} ms, peak extra {mem:.2f} MB "
              f"(output {out_mb:.2f} MB)", flush=True)


def rel(x, ref):
    return float((x.double() - ref.double()).norm() / ref.double().norm())


def dense_cell(dname, H, D, N, causal, baselines, B=1):
    dtype, prec = DTYPES[dname]
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=dtype, generator=g) for _ in range(3))
    flops = 4 * B * H * N * N * D * (0.5 if causal else 1.0)
    row = {"dtype": dname, "B": B, "H": H, "D": D, "N": N, "causal": causal}
    fe = elsa_fn(q, k, v, causal, prec)
    out = fe()
    # accuracy vs an fp32-math reference on a slice of the heads (cheap sanity check of the timed kernel)
    hs = slice(0, 1)
    if N <= 4096:
        ref = elsa_surgery.attention(q[:, hs].double(), k[:, hs].double(), v[:, hs].double(), is_causal=causal,
                                     backend="reference")
        row["rel_err"] = rel(out[:, hs], ref)
    row["elsa_ms"] = bench(fe)
    if GRAPH:
        row["elsa_graph_ms"] = graph_ms(fe)
    row["elsa_tflops"] = flops / row["elsa_ms"] / 1e9
    row["elsa_mem_mb"] = peak_extra(fe)
    for name in baselines:
        if name == "math" and B * H * N * N * 4 * 3 > MATH_LIMIT_BYTES:
            row[f"{name}_ms"] = None
            continue
        if name in ("flash", "cudnn") and dtype == torch.float32:
            continue
        try:
            fn = flex_fn(q, k, v, causal) if name == "flex" else sdpa_fn(name, q, k, v, causal)
            fn()
            row[f"{name}_ms"] = bench(fn)
            row[f"{name}_mem_mb"] = peak_extra(fn)
            row[f"ratio_{name}"] = row[f"{name}_ms"] / row["elsa_ms"]
            if GRAPH and name != "flex":  # kernel against kernel: both replayed from CUDA graphs
                try:
                    row[f"{name}_graph_ms"] = graph_ms(fn)
                    row[f"gratio_{name}"] = row[f"{name}_graph_ms"] / row["elsa_graph_ms"]
                except Exception as exc:  # a backend that cannot be captured
                    row[f"{name}_graph_err"] = str(exc).splitlines()[0][:120]
        except Exception as exc:  # a backend that cannot run this case
            row[f"{name}_ms"] = None
            row[f"{name}_err"] = str(exc).splitlines()[0][:120]
        torch.cuda.empty_cache()
    return row


def _unpacked(fn):
    """``fn`` run on the ordinary (unpacked) tiles: the packing rule off, launch plans cleared around it."""
    def run():
        keep = occupancy.DECODE_MAX_ROWS
        occupancy.DECODE_MAX_ROWS = 0
        launch.replay.clear()
        try:
            return fn()
        finally:
            occupancy.DECODE_MAX_ROWS = keep
            launch.replay.clear()
    return run


def decode_cell(dname, B, Hq, Hkv, D, nq, nk, rounds=5, calls=50):
    """One decode / short-query call: ``nq`` queries against ``nk`` cached keys, GQA ``Hq/Hkv``.

    Eager (the headline): ELSA (backend="elsa") and each SDPA backend timed back to back in interleaved rounds,
    host and GPU time per call (``benchmark.per_call_ms``), median over the rounds. Graph-replayed kernel time
    beside it, and ELSA's unpacked tiles (graph-replayed) to show what the packing gains."""
    dtype, prec = DTYPES[dname]
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, Hq, nq, D, device="cuda", dtype=dtype, generator=g)
    k, v = (torch.randn(B, Hkv, nk, D, device="cuda", dtype=dtype, generator=g) for _ in range(2))
    row = {"dtype": dname, "B": B, "Hq": Hq, "Hkv": Hkv, "H": Hq, "D": D, "Nq": nq, "Nk": nk, "N": nk,
           "causal": False}
    fns = {"elsa": lambda: elsa_surgery.attention(q, k, v, backend="elsa", precision=prec, enable_gqa=True)}
    names = ("efficient", "math") if dtype == torch.float32 else ("efficient", "flash", "cudnn", "math")
    backends, errors = benchmark.sdpa_backends(q, k, v, names, enable_gqa=Hq != Hkv)
    fns.update(backends)
    row.update({f"{name}_err": why for name, why in errors.items()})
    ref = elsa_surgery.attention(q[:1, :Hq // Hkv].double(), k[:1, :1].double(), v[:1, :1].double(),
                                 backend="reference", enable_gqa=True)
    row["rel_err"] = rel(fns["elsa"]()[:1, :Hq // Hkv], ref)
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(benchmark.per_call_ms(fn, calls))
    for name, ts in times.items():
        row[f"{name}_ms"] = sorted(ts)[len(ts) // 2]
    for name in fns:
        if name != "elsa":
            row[f"ratio_{name}"] = row[f"{name}_ms"] / row["elsa_ms"]
    sdpa_names = [n for n in fns if n != "elsa"]
    if sdpa_names:
        best = min(sdpa_names, key=lambda n: row[f"{n}_ms"])
        row["fastest_sdpa"] = best
        row["ratio_fastest"] = row[f"{best}_ms"] / row["elsa_ms"]
    row["elsa_graph_ms"] = graph_ms(fns["elsa"])
    row["elsa_unpacked_graph_ms"] = graph_ms(_unpacked(fns["elsa"]))
    for name in sdpa_names:
        try:
            row[f"{name}_graph_ms"] = graph_ms(fns[name])
            row[f"gratio_{name}"] = row[f"{name}_graph_ms"] / row["elsa_graph_ms"]
        except Exception as exc:  # a backend that cannot be captured
            row[f"{name}_graph_err"] = str(exc).splitlines()[0][:120]
    bytes_kv = 2 * B * Hkv * nk * D * q.element_size()
    row["elsa_graph_tbps"] = bytes_kv / row["elsa_graph_ms"] / 1e9
    return row


def varlen_cell(dname, H, D, causal, seed=0):
    """8 sequences of random length in [256, 1792]: packed ELSA, padded ELSA (lengths, zero-copy),
    padded SDPA (efficient, key-padding mask) incl. pad/unpad, and unpad -> flash varlen -> repad."""
    dtype, prec = DTYPES[dname]
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(256, 1793, (8,), generator=gen)
    cu = torch.zeros(9, dtype=torch.int32)
    cu[1:] = lens.cumsum(0)
    cu = cu.cuda()
    total, maxn = int(lens.sum()), int(lens.max())
    q, k, v = (torch.randn(total, H, D, device="cuda", dtype=dtype) for _ in range(3))
    row = {"dtype": dname, "H": H, "D": D, "causal": causal, "lens": lens.tolist(), "varlen": True}
    flops = sum(4 * H * int(n) ** 2 * D * (0.5 if causal else 1.0) for n in lens)
    fe = lambda: elsa_surgery.attention_varlen(q, k, v, cu, cu, maxn, maxn, is_causal=causal, backend="elsa",
                                               precision=prec)
    row["elsa_packed_ms"] = bench(fe)
    row["elsa_tflops"] = flops / row["elsa_packed_ms"] / 1e9
    # padded layout [8, H, maxn, D] built once (the caller's data is padded already in this scenario)
    idx_b = torch.repeat_interleave(torch.arange(8), lens).cuda()
    idx_t = torch.cat([torch.arange(int(n)) for n in lens]).cuda()
    qp, kp, vp = (torch.zeros(8, maxn, H, D, device="cuda", dtype=dtype) for _ in range(3))
    for src, dst in ((q, qp), (k, kp), (v, vp)):
        dst[idx_b, idx_t] = src
    qp, kp, vp = (t.transpose(1, 2) for t in (qp, kp, vp))
    lens_c = lens.to(torch.int32).cuda()
    fpad = lambda: elsa_surgery.attention(qp, kp, vp, is_causal=causal, backend="elsa", precision=prec,
                                          q_lengths=lens_c, kv_lengths=lens_c)
    row["elsa_padded_ms"] = bench(fpad)
    keymask = (torch.arange(maxn, device="cuda")[None, :] < lens_c[:, None])[:, None, None, :]
    if causal:
        keymask = keymask & torch.ones(maxn, maxn, dtype=torch.bool, device="cuda").tril()[None, None]

    from torch.nn.attention import SDPBackend, sdpa_kernel

    def padded_sdpa():  # pack -> pad, SDPA with a key-padding mask, unpad (end to end from packed data)
        pads = []
        for src in (q, k, v):
            dst = torch.zeros(8, maxn, H, D, device="cuda", dtype=dtype)
            dst[idx_b, idx_t] = src
            pads.append(dst.transpose(1, 2))
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
            o = F.scaled_dot_product_attention(*pads, attn_mask=keymask)
        return o.transpose(1, 2)[idx_b, idx_t]

    try:
        padded_sdpa()
        row["sdpa_padded_ms"] = bench(padded_sdpa)
    except Exception as exc:
        row["sdpa_padded_err"] = str(exc).splitlines()[0][:120]

    def unpad_flash_repad():  # padded data -> unpad -> flash varlen -> repad
        qu, ku, vu = (t.transpose(1, 2)[idx_b, idx_t] for t in (qp, kp, vp))
        o = torch.ops.aten._flash_attention_forward(qu, ku, vu, cu, cu, maxn, maxn, 0.0, causal, False)[0]
        res = torch.zeros(8, maxn, H, D, device="cuda", dtype=dtype)
        res[idx_b, idx_t] = o
        return res

    if dtype != torch.float32:
        try:
            unpad_flash_repad()
            row["unpad_flash_repad_ms"] = bench(unpad_flash_repad)
        except Exception as exc:
            row["unpad_flash_repad_err"] = str(exc).splitlines()[0][:160]
    for key in ("sdpa_padded_ms", "unpad_flash_repad_ms"):
        if row.get(key):
            row["ratio_" + key[:-3]] = row[key] / row["elsa_packed_ms"]
    return row


def sweep(dname, H, D, N, causal, space, graph=False):
    dtype, prec = DTYPES[dname]
    q, k, v = (torch.randn(1, H, N, D, device="cuda", dtype=dtype) for _ in range(3))
    res = []
    for bm, bn, w, s in itertools.product(space["bm"], space["bn"], space["w"], space["s"]):
        occupancy.set_config_override(occupancy.TileConfig(bm, bn, w, s))
        try:
            fn = lambda: launch.attention(q, k, v, scale=D ** -0.5, is_causal=causal, precision=prec,
                                          return_lse=False)
            fn()
            ms = graph_ms(fn) if graph else bench(fn, warmup=10, rep=40)
            res.append((ms, bm, bn, w, s))
            print(f"  sweep {dname} H={H} D={D} N={N} causal={causal} bm={bm} bn={bn} w={w} s={s}: {ms:.3f} ms",
                  flush=True)
        except Exception as exc:
            print(f"  sweep bm={bm} bn={bn} w={w} s={s}: failed ({str(exc).splitlines()[0][:80]})", flush=True)
    occupancy.set_config_override(None)
    res.sort()
    return res[:5]


def fmt(row):
    keys = [k for k in row if k.endswith("_ms") and row[k] is not None]
    parts = [f"{row['dtype']:>12} " + (f"H={row['H']} D={row['D']} N={row.get('N', 'var')} "
                                        f"{'causal' if row['causal'] else 'full  '}")]
    parts += [f"{k[:-3]}={row[k]:.3f}" for k in keys]
    if "elsa_tflops" in row:
        parts.append(f"TF/s={row['elsa_tflops']:.1f}")
    parts += [f"x{k[6:]}={row[k]:.2f}" for k in row if k.startswith("ratio_")]
    parts += [f"gx{k[7:]}={row[k]:.2f}" for k in row if k.startswith("gratio_")]  # graph-replayed, both sides
    if "rel_err" in row:
        parts.append(f"err={row['rel_err']:.1e}")
    if "elsa_mem_mb" in row:
        parts.append(f"mem={row['elsa_mem_mb']:.0f}MB(eff={row.get('efficient_mem_mb', float('nan')):.0f})")
    return " ".join(parts)


def backward_cell(dname, H, D, N, causal, baselines, B=1):
    """``--backward``: forward + backward time of ELSA (the kernels' backward, issue 25) against the SDPA backends,
    same inputs and output gradient; ratios ``x<backend>`` = backend ms / ELSA ms (>1: ELSA faster), peak extra
    memory of each, and ELSA's gradients' rel. error against the first baseline that runs."""
    dtype, precision = DTYPES[dname]
    q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    go = torch.randn(B, H, N, D, device="cuda", dtype=dtype)

    def fwd_bwd(run):
        return lambda: torch.autograd.grad(run(), (q, k, v), go)

    elsa = fwd_bwd(lambda: elsa_surgery.attention(q, k, v, is_causal=causal, backend="elsa", precision=precision))
    row = dict(kind="backward", dtype=dname, H=H, D=D, N=N, causal=causal, elsa_ms=bench(elsa),
               elsa_mb=peak_extra(elsa))
    ref = None
    for name in baselines:
        if name == "flex" or (name == "math" and B * H * N * N * 4 * 3 > MATH_LIMIT_BYTES):
            continue
        fn = fwd_bwd(sdpa_fn(name, q, k, v, causal))
        try:
            grads = fn()
        except RuntimeError as exc:  # backend unavailable for this dtype/shape
            row[f"{name}_skipped"] = str(exc).splitlines()[0][:80]
            continue
        ref = grads if ref is None else ref
        ms = bench(fn)
        row[f"{name}_ms"], row[f"{name}_mb"], row[f"x{name}"] = ms, peak_extra(fn), ms / row["elsa_ms"]
    if ref is not None:
        row["grad_rel_err"] = max(rel(a, b) for a, b in zip(elsa(), ref))
    flops = 10 * B * H * N * N * D * (0.5 if causal else 1.0)  # 2 forward + 3 backward matmuls (plus recompute)
    row["elsa_tflops"] = flops / row["elsa_ms"] / 1e9
    return row


def backward_sweep(dname, H, D, N, causal, space, baselines, B=1, head_groups=("auto",), row_tiles=("same",),
                   dq_modes=("rows", "atomic")):
    """``--backward --sweep``: the backward alone (one forward, its graph kept; ``torch.autograd.grad`` timed) for
    every tile configuration of ``space`` (``kernels/backward_launch.set_tiles_override``), with dQ by each of
    ``dq_modes`` (``ELSA_BWD_DQ``: the deterministic row pass, atomic adds), ``bwd_kv`` rows-major and keys-major,
    against the SDPA backends' backward on the same inputs. Every configuration's gradients, and the baselines', are
    measured against float64 gradients (SDPA's math kernel on float64 copies): a configuration more than 1.5x further
    from them than the worst baseline (fp16/bf16; fp32: 1e-4, turbo 1e-2) is reported WRONG, not ranked (session 28:
    two configurations differed from the others by 5e-3 where the rest agreed within 7e-5; against the first
    configuration alone, that could not tell which was wrong). ``head_groups``: causal launches' head groups to try
    (``auto``: the rule of ``occupancy.causal_head_group``; an integer forces ``ELSA_CAUSAL_HEAD_GROUP``; 1 = each
    head's blocks heaviest first, one head after another: session 29's A/B question). ``row_tiles``: the row pass with
    the same tile as ``bwd_kv`` (``same``) or transposed (``swapped``: ``set_tiles_override(row_swap=True)``). Each
    line gives the wall-clock median and the kernels' own GPU time (``benchmark.kernel_ms``); the five fastest by
    kernel time are returned as ``(kernel ms, wall ms, configuration)``."""
    from elsa_surgery.kernels import backward_launch

    dtype, prec = DTYPES[dname]
    q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    go = torch.randn(B, H, N, D, device="cuda", dtype=dtype)

    def backward_of(out):
        return lambda: torch.autograd.grad(out, (q, k, v), go, retain_graph=True)

    if B * H * N * N * 8 * 3 > MATH_LIMIT_BYTES:
        gib = B * H * N * N * 24 / 2**30
        raise SystemExit(f"--backward --sweep: the float64 reference's scores would take {gib:.0f} GiB (limit "
                         f"{MATH_LIMIT_BYTES >> 30} GiB); sweep at fewer heads or tokens")
    exact = [t.detach().double().requires_grad_() for t in (q, k, v)]
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        ref = torch.autograd.grad(F.scaled_dot_product_attention(*exact, is_causal=bool(causal)), exact, go.double())
    del exact
    worst = 0.0
    for name in baselines:
        if name in ("flex", "math"):
            continue
        try:
            fn = backward_of(sdpa_fn(name, q, k, v, causal)())
            err = max(rel(a, b) for a, b in zip(fn(), ref))
            worst = max(worst, err)
        except RuntimeError as exc:
            print(f"  {name}: skipped ({str(exc).splitlines()[0][:80]})", flush=True)
            continue
        print(f"  baseline {name} backward {dname} H={H} D={D} N={N} causal={causal}: {bench(fn):.3f} ms"
              f" (kernels {benchmark.kernel_ms(fn):.3f} ms; grads vs float64: {err:.1e})", flush=True)
    if dtype in (torch.float16, torch.bfloat16):
        bound = 1.5 * worst if worst else 1e-2
    else:
        bound = 1e-2 if prec == "turbo" else 1e-4
    out = elsa_surgery.attention(q, k, v, is_causal=causal, backend="elsa", precision=prec)
    res = []
    saved = torch.are_deterministic_algorithms_enabled()
    split_only = prec in ("precise", "turbo") and knobs.get(knobs.BWD_SPLIT) == "f16"
    try:
        for bm, bn, w, st, dq, km, hg, rt in itertools.product(space["bm"], space["bn"], space["w"], space["s"],
                                                                dq_modes, (False, True), head_groups, row_tiles):
            det = dq == "rows"
            if rt == "swapped" and (not det or bm == bn):  # no row pass (atomic dQ), or the same tile
                continue
            if not km and bn >= 4 * bm:  # runs keys-major (backward_launch._keys_major): timed on its keys-major line
                continue
            if split_only and not (det and km):  # the fp16 split runs keys-major with dQ by rows
                continue
            backward_launch.set_tiles_override(occupancy.TileConfig(bm, bn, w, st), keys_major=km,
                                               row_swap=rt == "swapped")
            torch.use_deterministic_algorithms(det, warn_only=True)
            tag = (f"bm={bm} bn={bn} w={w} s={st} dq={dq} "
                   f"kv={'keys-major' if km else 'rows-major'}" + (f" hg={hg}" if len(head_groups) > 1 else "")
                   + (f" row={rt}" if len(row_tiles) > 1 else ""))
            env = {"ELSA_BWD_DQ": dq,
                   "ELSA_CAUSAL_HEAD_GROUP": None if hg == "auto" else str(hg)}
            try:
                with benchmark.environ(env):
                    fn = backward_of(out)
                    err = max(rel(a, b) for a, b in zip(fn(), ref))
                    ms = bench(fn, warmup=5, rep=30)
                    kms = benchmark.kernel_ms(fn)
            except Exception as exc:
                print(f"  sweep {tag}: failed ({str(exc).splitlines()[0][:80]})", flush=True)
                continue
            ok = err <= bound
            print(f"  sweep backward {dname} H={H} D={D} N={N} causal={causal} {tag}: {ms:.3f} ms"
                  f" (kernels {kms:.3f} ms; grads vs float64: {err:.1e}{'' if ok else f' WRONG: over {bound:.1e}'})",
                  flush=True)
            if ok:
                res.append((kms, ms, tag))
    finally:
        backward_launch.set_tiles_override(None)
        torch.use_deterministic_algorithms(saved)
    res.sort()
    return res[:5]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", default=",".join(DTYPES))
    ap.add_argument("--n", default="1024,4096,16384,65536")
    ap.add_argument("--shapes", default="8x64,32x128", help="HxD list")
    ap.add_argument("--causal", default="0,1")
    ap.add_argument("--baselines", default="math,efficient,flash,cudnn,flex")
    ap.add_argument("--no-varlen", action="store_true")
    ap.add_argument("--varlen-only", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="tile-config sweep instead of the comparison")
    ap.add_argument("--space", default="bm=64,128;bn=32,64,128;w=4,8;s=2,3",
                    help="sweep space, e.g. 'bm=32,64;bn=16,32;w=4;s=1,2'")
    ap.add_argument("--bwd-head-groups", default="auto",
                    help="--backward --sweep: causal head groups to try, e.g. 'auto,1' (1: one head after another)")
    ap.add_argument("--bwd-row-tiles", default="same",
                    help="--backward --sweep: the row pass's tile, 'same' as bwd_kv's and/or 'swapped' (transposed)")
    ap.add_argument("--bwd-dq", default="rows,atomic",
                    help="--backward --sweep: dQ modes to try (ELSA_BWD_DQ: rows, atomic)")
    ap.add_argument("--graph", action="store_true",
                    help="also time ELSA and the SDPA baselines replayed from CUDA graphs (ratios gx*: kernel "
                         "against kernel, no launch overhead); with --sweep: time every tile that way")
    ap.add_argument("--lean", action="store_true", help="ELSA-Lean eta trade-off only")
    ap.add_argument("--json", default=None, help="append rows as JSON lines to this file")
    ap.add_argument("--decode", action="store_true",
                    help="decode / short-query calls instead: --queries against --keys cached keys, GQA --gqa "
                         "(Hq:Hkv list), --batch, head dims from --shapes' D")
    ap.add_argument("--queries", default="1,8")
    ap.add_argument("--keys", default="4096,32768,131072")
    ap.add_argument("--batch", default="1,16")
    ap.add_argument("--gqa", default="32:4,32:8,32:32")
    ap.add_argument("--backward", action="store_true", help="forward + backward time (backward_cell) instead")
    a = ap.parse_args(argv)
    dnames = a.dtypes.split(",")
    ns = [int(x) for x in a.n.split(",")]
    shapes = [tuple(int(y) for y in s.split("x")) for s in a.shapes.split(",")]
    causals = [bool(int(c)) for c in a.causal.split(",")]
    baselines = [b for b in a.baselines.split(",") if b]
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    import triton

    print(f"triton {triton.__version__}; IEEE SGEMM: {sgemm_tflops():.1f} TFLOP/s", flush=True)
    global GRAPH
    GRAPH = a.graph
    sink = open(a.json, "a") if a.json else None
    # warm the clocks up before the first timed cell
    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    for _ in range(200):
        x @ x
    torch.cuda.synchronize()
    if a.lean:
        for dname in dnames:
            lean_tradeoff(dname)
        return
    if a.decode:
        heads = [tuple(int(y) for y in s.split(":")) for s in a.gqa.split(",")]
        for dname, D, (Hq, Hkv), B, nq, nk in itertools.product(
                dnames, sorted({d for _, d in shapes}), heads, [int(x) for x in a.batch.split(",")],
                [int(x) for x in a.queries.split(",")], [int(x) for x in a.keys.split(",")]):
            try:
                row = decode_cell(dname, B, Hq, Hkv, D, nq, nk)
            except torch.cuda.OutOfMemoryError as exc:
                print(f"DECODE {dname} B={B} {Hq}:{Hkv} D={D} Nq={nq} Nk={nk}: OOM ({exc})", flush=True)
                torch.cuda.empty_cache()
                continue
            ms = " ".join(f"{k[:-3]}={row[k]:.4f}" for k in row if k.endswith("_ms"))
            print(f"DECODE {dname} B={B} {Hq}:{Hkv} D={D} Nq={nq} Nk={nk} {ms} fastest={row.get('fastest_sdpa')} "
                  f"x_fastest={row.get('ratio_fastest', float('nan')):.2f} "
                  f"x_eff={row.get('ratio_efficient', float('nan')):.2f} "
                  f"g_TB/s={row['elsa_graph_tbps']:.2f} err={row['rel_err']:.1e}", flush=True)
            if sink:
                sink.write(json.dumps(row) + "\n")
                sink.flush()
            torch.cuda.empty_cache()
        return
    space = ({kv.split("=")[0]: [int(x) for x in kv.split("=")[1].split(",")] for kv in a.space.split(";")}
             if a.sweep else None)
    if a.backward and a.sweep:
        for dname, (H, D), N, c in itertools.product(dnames, shapes, ns, causals):
            best = backward_sweep(dname, H, D, N, c, space, baselines,
                                  head_groups=tuple(a.bwd_head_groups.split(",")),
                                  row_tiles=tuple(a.bwd_row_tiles.split(",")),
                                  dq_modes=tuple(a.bwd_dq.split(",")))
            print(f"BEST backward {dname} H={H} D={D} N={N} causal={c}: {best}", flush=True)
        return
    if a.backward:
        for (H, D), dname, N, c in itertools.product(shapes, dnames, ns, causals):
            row = backward_cell(dname, H, D, N, c, baselines)
            shown = {k: (float(f"{v:.4g}") if isinstance(v, float) else v) for k, v in row.items()}  # (errors too)
            print(json.dumps(shown), flush=True)
            if sink:
                sink.write(json.dumps(row) + "\n")
            torch.cuda.empty_cache()
        return
    if a.sweep:
        for dname, (H, D), N, c in itertools.product(dnames, shapes, ns, causals):
            best = sweep(dname, H, D, N, c, space, graph=a.graph)
            print(f"BEST {dname} H={H} D={D} N={N} causal={c}: {best}", flush=True)
        return
    if not a.varlen_only:
        for (H, D), dname, N, c in itertools.product(shapes, dnames, ns, causals):
            try:
                row = dense_cell(dname, H, D, N, c, baselines)
            except torch.cuda.OutOfMemoryError as exc:
                print(f"{dname} H={H} D={D} N={N} causal={c}: OOM ({exc})", flush=True)
                torch.cuda.empty_cache()
                continue
            print(fmt(row), flush=True)
            if sink:
                sink.write(json.dumps(row) + "\n")
                sink.flush()
            torch.cuda.empty_cache()
    if not a.no_varlen:
        for dname, c in itertools.product([d for d in dnames if d in ("bf16", "fp16", "fp32-precise")], causals):
            row = varlen_cell(dname, 16, 128, c)
            print(fmt(row) + f" padded_elsa={row['elsa_padded_ms']:.3f}", flush=True)
            if sink:
                sink.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    sys.exit(main())
