"""Lab: Does cutting the two dots of an IEEE-fp32 attention loop the way a fast GEMM cuts its K loop lift strict's rate?
Answered in docs/perf/history.md, section "Version 8". A one-off investigation, not a recipe.

The ceiling behind ``strict``'s rate: a plain IEEE-fp32 (FMA) attention loop in Triton, in every cut of its dots.

A bare Triton IEEE GEMM reaches 82 % of cuBLAS SGEMM on the H100 (``benchmarks/lab/gemm_ceiling.py``), so this script asks
whether cutting attention's two dots the way a fast GEMM cuts its K loop lifts ELSA's ``strict`` rate (35 % of
SGEMM). Non-causal, dense, N=4096, H=8 D=64 and H=32 D=128, checked against float64, timed with ``do_bench``:

* ``QK``: 0 = one dot over D; 1 = a sum of dots over KC-wide D chunks, Q's chunks reloaded from memory (L1) per
  key block; 2 = Q's chunks split once in registers (reshape/permute/split);
* ``PV``: 0 = one dot over the BN keys; 2 = P split in registers into KC-key chunks, V's rows loaded per chunk;
* tiles BM x BN, 4/8 warps, 1/2 stages.

    python benchmarks/lab/strict_variants.py            # the full sweep (~7 min on an H100)
    python benchmarks/lab/strict_variants.py quick      # every ~12th variant

This is a measurement of alternatives, not the package's kernel (``kernels/scan.py``).
"""
import itertools, time
import torch
import triton
import triton.language as tl


@triton.jit
def _halves(x):
    """x [M, W] -> (x[:, :W/2], x[:, W/2:])"""
    M: tl.constexpr = x.shape[0]
    W: tl.constexpr = x.shape[1]
    y = tl.permute(tl.reshape(x, [M, 2, W // 2]), (0, 2, 1))
    return tl.split(y)


@triton.jit
def _dot1(a, b_ptrs, acc):
    return tl.dot(a, tl.load(b_ptrs), acc, input_precision="ieee")


@triton.jit
def _dot2(a, b_ptrs, stride_bk, acc, KC: tl.constexpr):
    """acc += a @ B for a [M, 2*KC]: a's halves against B's first and second KC rows."""
    a0, a1 = _halves(a)
    return _dot1(a1, b_ptrs + KC * stride_bk, _dot1(a0, b_ptrs, acc))


@triton.jit
def _dot4(a, b_ptrs, stride_bk, acc, KC: tl.constexpr):
    a0, a1 = _halves(a)
    return _dot2(a1, b_ptrs + 2 * KC * stride_bk, stride_bk, _dot2(a0, b_ptrs, stride_bk, acc, KC), KC)


@triton.jit
def _dot8(a, b_ptrs, stride_bk, acc, KC: tl.constexpr):
    a0, a1 = _halves(a)
    return _dot4(a1, b_ptrs + 4 * KC * stride_bk, stride_bk, _dot4(a0, b_ptrs, stride_bk, acc, KC), KC)


@triton.jit
def _dot_chunks(a, b_ptrs, stride_bk, acc, NCH: tl.constexpr, KC: tl.constexpr):
    """acc += a @ B where a [M, NCH*KC] in registers is split into NCH chunks, B's rows loaded per chunk."""
    if NCH == 1:
        acc = _dot1(a, b_ptrs, acc)
    elif NCH == 2:
        acc = _dot2(a, b_ptrs, stride_bk, acc, KC)
    elif NCH == 4:
        acc = _dot4(a, b_ptrs, stride_bk, acc, KC)
    else:  # 8
        acc = _dot8(a, b_ptrs, stride_bk, acc, KC)
    return acc


@triton.jit
def attn(Q, K, V, O, N, scale, sqh, sqn, skh, skn, svh, svn, soh, son,
         D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, KC: tl.constexpr, QK: tl.constexpr, PV: tl.constexpr):
    pid_m = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = tl.arange(0, BN)
    offs_d = tl.arange(0, D)
    offs_c = tl.arange(0, KC)
    qb = Q + h * sqh
    kb = K + h * skh
    vb = V + h * svh
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    if QK != 1:
        q = tl.load(qb + offs_m[:, None] * sqn + offs_d[None, :])
    for start in range(0, N, BN):
        s = tl.zeros([BM, BN], tl.float32)
        # K^T chunk [KC, BN]: rows = head dims
        kt_ptrs = kb + (start + offs_n[None, :]) * skn + offs_c[:, None]
        if QK == 0:
            kt = tl.load(kb + (start + offs_n[None, :]) * skn + offs_d[:, None])
            s = tl.dot(q, kt, s, input_precision="ieee")
        elif QK == 1:
            for c in tl.static_range(D // KC):
                qc = tl.load(qb + offs_m[:, None] * sqn + (c * KC + offs_c[None, :]))
                s = tl.dot(qc, tl.load(kt_ptrs + c * KC), s, input_precision="ieee")
        else:
            s = _dot_chunks(q, kt_ptrs, 1, s, D // KC, KC)
        s = s * scale
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        m_i = m_new
        if PV == 0:
            v = tl.load(vb + (start + offs_n[:, None]) * svn + offs_d[None, :])
            acc = tl.dot(p, v, acc, input_precision="ieee")
        else:
            v_ptrs = vb + (start + offs_c[:, None]) * svn + offs_d[None, :]
            acc = _dot_chunks(p, v_ptrs, svn, acc, BN // KC, KC)
    out = acc / l_i[:, None]
    tl.store(O + h * soh + offs_m[:, None] * son + offs_d[None, :], out)


def run(q, k, v, o, cfg):
    bm, bn, kc, qk, pv, w, s = cfg
    H, N, D = q.shape
    attn[(N // bm, H)](q, k, v, o, N, D ** -0.5 * 1.4426950408889634, q.stride(0), q.stride(1), k.stride(0),
                       k.stride(1), v.stride(0), v.stride(1), o.stride(0), o.stride(1),
                       D=D, BM=bm, BN=bn, KC=kc, QK=qk, PV=pv, num_warps=w, num_stages=s)


def main():
    import argparse

    ap = argparse.ArgumentParser(description="IEEE-fp32 attention loop variants against float64, timed on a GPU")
    ap.add_argument("quick", nargs="?", help="any value: every ~12th variant only")
    quick = ap.parse_args().quick is not None
    print(torch.cuda.get_device_name(), triton.__version__, flush=True)
    for H, D in ((8, 64), (32, 128)):
        N = 4096
        q, k, v = (torch.randn(H, N, D, device="cuda") for _ in range(3))
        o = torch.empty_like(q)
        ref = torch.softmax((q.double() @ k.double().transpose(1, 2)) * D ** -0.5, -1) @ v.double()
        flops = 4.0 * H * N * N * D
        space = []
        for qk, pv in ((2, 2), (1, 2), (2, 0), (1, 0), (0, 2), (0, 0)):
            for bm, bn, w in itertools.product([64, 128, 32], [64, 32, 128], [4, 8]):
                if bm * bn > 8192 or (bm == 32 and w == 8):
                    continue
                space.append((bm, bn, 16, qk, pv, w, 2))
        space += [(64, 64, 32, 2, 2, 4, 2), (64, 64, 16, 2, 2, 4, 1), (64, 128, 32, 2, 2, 4, 2), (64, 64, 32, 1, 2, 4, 2)]
        if quick:
            space = space[:: max(1, len(space) // 12)]
        res = []
        t0 = time.time()
        for cfg in space:
            if time.time() - t0 > 230:
                print("time budget reached", flush=True)
                break
            try:
                run(q, k, v, o, cfg)
                torch.cuda.synchronize()
                err = ((o.double() - ref).abs().max() / ref.abs().max()).item()
                ms = triton.testing.do_bench(lambda: run(q, k, v, o, cfg), warmup=3, rep=20)
            except Exception as exc:
                print(f"H={H} D={D} {cfg}: {type(exc).__name__} {str(exc)[:80]}", flush=True)
                continue
            res.append((ms, cfg, err))
            print(f"H={H} D={D} bm,bn,kc,qk,pv,w,s={cfg}: {ms:.3f} ms {flops / ms / 1e9:.1f} TFLOP/s err {err:.1e}",
                  flush=True)
        res.sort()
        for ms, cfg, err in res[:8]:
            print(f"BEST H={H} D={D} {cfg}: {ms:.3f} ms {flops / ms / 1e9:.1f} TFLOP/s err {err:.1e}", flush=True)


if __name__ == "__main__":
    main()
