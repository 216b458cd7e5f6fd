"""Question: what does one decode step of a *growing* KV cache cost on the host? HF's dynamic cache hands every
step K/V one key longer than the last (new tensors, new strides), so no two steps share a signature: the memo
(``callcache``) and the launch plans (``kernels/replay.py``) miss at every step, and ``decode_host.py``, which repeats
one call, does not see it. For each shape: a sequence of ``--steps`` steps with ``Nk + 1, Nk + 2, ...`` keys, each
step ``--layers`` calls with their own contiguous K/V of the step's length (built beforehand); host time per call
(clock stopped before the device sync) and eager time per call (after it), median and mean over the steps, for
``elsa_surgery.attention`` with ``backend="elsa"`` and ``"auto"`` and for ``F.scaled_dot_product_attention``; each
backend gets lengths no other pass used (a pass never replays another's plans). Then the same with one length
repeated (the replayed cost), and a cProfile of one growing ELSA pass. (Seen on an H200 with torch 2.11: unmasked
SDPA here takes its cuDNN kernel, which builds a new execution plan for every new key count, 36-50 ms a step.)

    python benchmarks/lab/decode_growing.py [--shapes 1x28x4x128x4096,1x40x40x128x4096] [--steps 64] [--layers 2]
"""

import argparse
import statistics
import time
import warnings

import torch
import torch.nn.functional as F

import elsa_surgery
from elsa_surgery import callcache


def _pass(fn, qs, kvs, layers):
    """Per-call host and eager µs of each step of one sequence (``layers`` calls a step, each with its own K/V of the
    step's length, as the layers of a model): ``(hosts, eagers)``, one value a step."""
    hosts, eagers = [], []
    for q, step in zip(qs, kvs):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for k, v in step:
            fn(q, k, v)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        hosts.append((t1 - t0) / layers * 1e6)
        eagers.append((t2 - t0) / layers * 1e6)
    return hosts, eagers


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="1x28x4x128x4096,1x40x40x128x4096", help="BxHqxHkvxDxNk")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--layers", type=int, default=2, help="calls a step, each with its own K/V (a model's layers)")
    ap.add_argument("--profile", type=int, default=1, help="cProfile one growing ELSA pass of the first shape")
    a = ap.parse_args()
    warnings.filterwarnings("ignore", category=UserWarning)
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    dt = torch.bfloat16
    fns = {
        "elsa": lambda q, k, v: elsa_surgery.attention(q, k, v, backend="elsa", enable_gqa=True),
        "auto": lambda q, k, v: elsa_surgery.attention(q, k, v, backend="auto", enable_gqa=True),
        "sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=q.shape[1] != k.shape[1]),
    }
    for si, shape in enumerate(a.shapes.split(",")):
        B, Hq, Hkv, D, nk = (int(x) for x in shape.split("x"))
        # lengths: pass r of backend i starts at nk + 1 + (r * len(fns) + i) * steps (fresh signatures every pass;
        # nk + 1: callcache.key_band's bands close at powers of two)
        total = (a.rounds * len(fns) + 1) * a.steps + 1
        kbuf = torch.randn(B, Hkv, nk + total, D, device="cuda", dtype=dt)
        vbuf = torch.randn_like(kbuf)
        qs = [torch.randn(B, Hq, 1, D, device="cuda", dtype=dt) for _ in range(a.steps)]

        def kv_run(start, kbuf=kbuf, vbuf=vbuf):
            return [[(kbuf[:, :, :n].contiguous(), vbuf[:, :, :n].contiguous()) for _ in range(a.layers)]
                    for n in range(start, start + a.steps)]

        res = {name: {"grow": ([], []), "same": ([], [])} for name in fns}
        for r in range(a.rounds):
            for i, (name, fn) in enumerate(fns.items()):
                kvs = kv_run(nk + 1 + (r * len(fns) + i) * a.steps)
                for got, new in zip(res[name]["grow"], _pass(fn, qs, kvs, a.layers)):
                    got.extend(new)
                same = [kvs[-1]] * a.steps
                _pass(fn, qs, same, a.layers)
                for got, new in zip(res[name]["same"], _pass(fn, qs, same, a.layers)):
                    got.extend(new)
                del kvs, same
        print(f"{shape} ({a.steps} steps x {a.layers} layers, {a.rounds} rounds; µs a call, median and mean over the "
              f"steps; kernel family routes so far {callcache.KERNEL_FAMILY}):", flush=True)
        for name in fns:
            for kind in ("grow", "same"):
                h, e = res[name][kind]
                print(f"  {name:5s} {kind:5s} host {statistics.median(h):7.1f} (mean {statistics.mean(h):8.1f})  "
                      f"eager {statistics.median(e):7.1f} (mean {statistics.mean(e):8.1f})", flush=True)
        if si == 0 and a.profile:
            import cProfile
            import pstats

            kvs = kv_run(nk + 1 + a.rounds * len(fns) * a.steps)
            prof = cProfile.Profile()
            prof.enable()
            for q, step in zip(qs, kvs):
                for k, v in step:
                    fns["elsa"](q, k, v)
            prof.disable()
            torch.cuda.synchronize()
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)
            pstats.Stats(prof).sort_stats("cumulative").print_stats(30)
        del kbuf, vbuf


if __name__ == "__main__":
    main()
