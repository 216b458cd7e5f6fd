"""Question: does a decode kernel that reads K/V through TMA tensor descriptors beat pointer loads' bandwidth?

Session 62 left the packed decode kernel (``scan.elsa_fwd`` with ``PACK``) at its tile plateau on the B = 16 GQA
cells (graph-replayed 1.02-1.11x cuDNN's time, 2.2-2.6 TB/s at 4K keys). This lab kernel is that kernel's core
alone (one query per head, a GQA group's rows in one tile, split-K partitions, no masks: whole key blocks), in two
forms: ``ptr`` (pointer loads, as the product) and ``tma`` (``tl.make_tensor_descriptor`` loads). Phase 2 runs in
torch and is not timed; the check compares the merged output with SDPA's. Graph-replayed kernel time against the
product's public call and SDPA's fastest backend, replayed the same way.

Answered (session 68, H100, Triton 3.6; docs/PERF.md, "Session 68"): no. The best ``tma`` tile read 1-3 % slower than
the best ``ptr`` tile at all three shapes (16 x 32:8 x 64 4K: 60.7 against 59.1 us; x 128 4K: 102.8 / 101.4;
16 x 32:4 x 64 32K: 187.1 / 185.4). The ``ptr`` core alone is at cuDNN's time (59.1 / 59.9, 101.4 / 101.7,
185.4 / 188.9 us) and 3-5 % ahead of the product's whole call (62.1, 105.6, 191.6), which also writes the partition
states and merges them (the fused merge): what the product loses at these cells is phase 2 and the general kernel's
extra work, not K/V's loads.

    python benchmarks/lab/decode_tma.py --shapes 16x32x8x64x4096,16x32x8x128x4096 --parts 2,3,4 --stages 2,3,4
"""

from __future__ import annotations

import argparse
import itertools
import warnings

import torch
import triton
import triton.language as tl

import elsa_surgery
from elsa_surgery import benchmark


@triton.jit
def _decode_part(Q, K, V, PM, PS, PW, Nk, part_len, n_bh, qk_scale,
                 GROUPS: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 TMA: tl.constexpr, STAGES: tl.constexpr):
    bh = tl.program_id(0)  # (batch, K/V head); Q is [B, Hq, 1, D], K/V [B, Hkv, Nk, D], all contiguous
    part = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    row_ok = rows < GROUPS
    q = tl.load(Q + (bh * GROUPS + rows[:, None]).to(tl.int64) * D + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    lo = part * part_len
    hi = tl.minimum(lo + part_len, Nk)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    base = bh.to(tl.int64) * Nk
    if TMA:
        kd = tl.make_tensor_descriptor(K, shape=[n_bh * Nk, D], strides=[D, 1], block_shape=[BLOCK_N, D])
        vd = tl.make_tensor_descriptor(V, shape=[n_bh * Nk, D], strides=[D, 1], block_shape=[BLOCK_N, D])
    for start in tl.range(lo, hi, BLOCK_N, num_stages=STAGES):
        if TMA:
            k = kd.load([(base + start).to(tl.int32), 0])
            v = vd.load([(base + start).to(tl.int32), 0])
        else:
            kv_off = (base + start + offs_n[:, None]) * D + offs_d[None, :]
            k = tl.load(K + kv_off)
            v = tl.load(V + kv_off)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    srow = (part * n_bh + bh).to(tl.int64) * GROUPS + rows
    tl.store(PM + srow, m_i, mask=row_ok)
    tl.store(PS + srow, l_i, mask=row_ok)
    tl.store(PW + srow[:, None] * D + offs_d[None, :], acc, mask=row_ok[:, None])


def _alloc(size: int, alignment: int, stream):
    return torch.empty(size, device="cuda", dtype=torch.int8)


def make_call(q, k, v, parts: int, block_n: int, stages: int, tma: bool, warps: int = 4):
    B, Hq, _, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    groups = Hq // Hkv
    n_bh = B * Hkv
    part_len = triton.cdiv(triton.cdiv(Nk, parts), block_n) * block_n
    parts = triton.cdiv(Nk, part_len)
    pm = torch.empty(parts, n_bh, groups, device=q.device, dtype=torch.float32)
    ps = torch.empty_like(pm)
    pw = torch.empty(parts, n_bh, groups, D, device=q.device, dtype=torch.float32)
    scale = D ** -0.5 * 1.4426950408889634

    def run():
        _decode_part[(n_bh, parts)](q, k, v, pm, ps, pw, Nk, part_len, n_bh, scale, GROUPS=groups, D=D,
                                    BLOCK_M=max(16, triton.next_power_of_2(groups)), BLOCK_N=block_n, TMA=tma,
                                    STAGES=stages, num_warps=warps)
        return pm, ps, pw

    def merged():
        run()
        m = pm.amax(0)
        w = torch.exp2(pm - m)
        out = (pw * w[..., None]).sum(0) / (ps * w).sum(0)[..., None]
        return out.reshape(B, Hq, 1, D)

    return run, merged


def graph_us(fn):
    import triton.testing

    return 1e3 * triton.testing.do_bench(benchmark.cuda_graph(fn), warmup=25, rep=200, return_mode="median")


def decompose(q, k, v, res, parts):
    """The product's call at each partition count in ``parts`` against the lab core's best ``ptr`` tile at that count
    (``res``: main's timings), graph-replayed."""
    from elsa_surgery.kernels import launch

    for p in map(int, parts.split(",")):
        launch.replay.clear()
        with benchmark.environ({"ELSA_NUM_PARTITIONS": str(p)}):
            t = graph_us(lambda: elsa_surgery.attention(q, k, v, backend="elsa", enable_gqa=True))
        launch.replay.clear()
        core = min((r for r in res if r[1] == p), default=None)
        core_s = f"{core[0]:.1f} us (bn={core[2]} stages={core[3]})" if core else "not timed"
        print(f"  partitions={p}: product {t:.1f} us, lab core {core_s}", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="16x32x8x64x4096,16x32x8x128x4096", help="BxHqxHkvxDxNk list (one query)")
    ap.add_argument("--parts", default="1,2,3,4,6")
    ap.add_argument("--bn", default="64,128")
    ap.add_argument("--stages", default="2,3,4")
    ap.add_argument("--warps", default="4")
    ap.add_argument("--top", type=int, default=4)
    ap.add_argument("--decompose", action="store_true",
                    help="also, at each of --parts: the product at that partition count (ELSA_NUM_PARTITIONS; 1: no "
                         "phase 2) against the lab's ptr core at its best tile there, phase 2 untimed (what phase 2 "
                         "and the general kernel's extra work cost)")
    a = ap.parse_args(argv)
    warnings.filterwarnings("ignore", category=UserWarning)
    triton.set_allocator(_alloc)
    print(f"GPU: {torch.cuda.get_device_name()}  triton {triton.__version__}", flush=True)
    for shape in a.shapes.split(","):
        B, Hq, Hkv, D, nk = (int(x) for x in shape.split("x"))
        q = torch.randn(B, Hq, 1, D, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(B, Hkv, nk, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), enable_gqa=True)
        kv_bytes = 2 * k.numel() * k.element_size()
        product = graph_us(lambda: elsa_surgery.attention(q, k, v, backend="elsa", enable_gqa=True))
        sdpa = {n: graph_us(r) for n, r in benchmark.sdpa_backends(q, k, v, enable_gqa=True)[0].items()}
        best = min(sdpa, key=sdpa.get)
        print(f"{shape}: product {product:.1f} us ({kv_bytes / product / 1e6:.2f} TB/s), SDPA "
              + " ".join(f"{n}={t:.1f}" for n, t in sdpa.items()), flush=True)
        for form in ("ptr", "tma"):
            res = []
            for parts, bn, st, w in itertools.product(*(map(int, x.split(",")) for x in (a.parts, a.bn, a.stages,
                                                                                          a.warps))):
                try:
                    run, merged = make_call(q, k, v, parts, bn, st, form == "tma", w)
                    err = ((merged().double() - ref).norm() / ref.norm()).item()
                    res.append((graph_us(run), parts, bn, st, w, err))
                except Exception as exc:  # a tile that does not fit, or a form this Triton lacks
                    print(f"  {form} parts={parts} bn={bn} stages={st} warps={w}: {str(exc).splitlines()[0][:120]}")
            res.sort()
            for t, parts, bn, st, w, err in res[:a.top]:
                print(f"  {form} {t:7.1f} us ({kv_bytes / t / 1e6:.2f} TB/s) parts={parts} bn={bn} stages={st} "
                      f"warps={w} err={err:.1e}", flush=True)
            if a.decompose and form == "ptr":
                decompose(q, k, v, res, a.parts)
            if res:
                print(f"SUMMARY {shape} {form} best={res[0][0]:.1f} product={product:.1f} {best}={sdpa[best]:.1f} "
                      f"x_product={product / res[0][0]:.3f} x_sdpa={sdpa[best] / res[0][0]:.3f}", flush=True)


if __name__ == "__main__":
    main()
