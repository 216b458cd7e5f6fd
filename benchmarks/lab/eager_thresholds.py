"""Lab: From what size should an eager call on Hopper take the Gluon kernel rather than the portable one?
Answered in docs/perf/history.md, section "Version 16". A one-off investigation, not a recipe.

Which kernel should an eager call of a given size take on Hopper: the Gluon kernel or the portable one?

    python benchmarks/lab/eager_thresholds.py                          # bf16, strict, turbo on the default shapes
    python benchmarks/lab/eager_thresholds.py --kinds bf16 --shapes 1x32x1024x128 --rounds 3 --json rows.jsonl

For each shape (``BxHxNxD``), causal or not, and dtype kind, the public call ``elsa_surgery.attention(...,
backend="elsa")`` is timed eagerly (``do_bench`` median: host-bound calls read as their host time) with
``ELSA_HOPPER=0`` (portable kernel) and ``ELSA_HOPPER=force`` (Gluon kernel), in interleaved rounds, beside
PyTorch SDPA (cuDNN for fp16/bf16, memory-efficient for fp32). Each round also times the host cost of one call of
each kernel: back-to-back calls without synchronising, divided by their number, for the launcher alone
(``kernels.launch.attention``). ``--desc-route``: also time the Gluon calls with the replay building Triton's
TensorDescriptor objects on every launch (the route before version 16) instead of encoding the TMA maps itself.

Prints a row per cell (work = B·H·N·N·D, halved when causal) with the median over rounds, and the smallest work
from which the Gluon kernel is faster in every measured cell of a kind: the eager thresholds of
``kernels/hopper.py`` (``MIN_WORK``, ``MIN_WORK_TF32``, ``MIN_WORK_FP32``). First prints the host time of one replayed
Gluon launch by descriptor route (``launch_cost``). Needs a CUDA GPU with sm_90.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics

import torch
import torch.nn.functional as F

import elsa_surgery
from elsa_surgery import benchmark
from elsa_surgery.kernels import hopper, launch, replay

KINDS = {"bf16": (torch.bfloat16, None), "fp16": (torch.float16, None), "strict": (torch.float32, "strict"),
         "turbo": (torch.float32, "turbo")}
SHAPES = ("1x8x512x64", "8x12x197x64", "1x4x1024x64", "1x8x1024x64", "1x16x1024x64", "1x2x1024x128",
          "1x8x1024x128", "1x32x1024x128", "1x8x4096x64", "1x32x2048x128")


@contextlib.contextmanager
def descriptor_route(encoded: bool):
    """The replay's host-descriptor route: encoded maps (the default) or Triton's TensorDescriptor path."""
    saved = replay._desc_module
    if not encoded:
        replay._desc_module = lambda cls: None
    replay.clear()  # a launch decides its route on its first replay
    try:
        yield
    finally:
        replay._desc_module = saved
        replay.clear()


def bench(fn):
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median") * 1e3  # µs


def host_us(fn, calls=200):
    """Host µs of one call: ``calls`` back-to-back calls, the clock stopped before synchronising."""
    return benchmark.per_call_ms(fn, calls, host_only=True) * 1e3


def launch_cost(rounds=3, calls=2000):
    """Host µs of one replayed Gluon launch (bf16 1x4x1024x128), by route: the TMA maps encoded by the replay, or
    Triton's TensorDescriptor objects expanded by its launcher; and of the whole launcher call on that route."""
    q, k, v = (torch.randn(1, 4, 1024, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    with benchmark.environ({hopper.ENV: "force"}):
        got = {"encoded": [], "tensordesc": [], "launcher_encoded": [], "launcher_tensordesc": []}
        for _ in range(rounds):
            for encoded in (True, False):
                name = "encoded" if encoded else "tensordesc"
                with descriptor_route(encoded):
                    for _ in range(2):  # recorded, then replayed (the route is chosen on the first replay)
                        launch.attention(q, k, v, scale=0.1)
                    (plan,) = replay._plans.values()
                    (one,) = plan.launches
                    slots = {"q": q, "k": k, "v": v}
                    plan.replay(slots)  # adds the outputs the plan allocates, with the recorded geometry
                    got[name].append(host_us(lambda: one(slots), calls))
                    got["launcher_" + name].append(host_us(lambda: launch.attention(q, k, v, scale=0.1), calls))
    return {n: round(statistics.median(t), 1) for n, t in got.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kinds", default="bf16,strict,turbo")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--causal", default="0,1")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--desc-route", action="store_true", help="also time Gluon calls through TensorDescriptors")
    ap.add_argument("--json", default=None, help="append rows as JSON lines to this file")
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    dev = "cuda"
    encoded = replay.encodes_descriptors(torch.empty(0, device=dev))
    print(torch.cuda.get_device_name(), "| Triton route for descriptors:",
          "encoded maps" if encoded else "TensorDescriptor (Triton's)", flush=True)
    print("one replayed Gluon launch, host µs (median of 3 rounds of 2000):", launch_cost(), flush=True)
    settings = [("portable", "0", True), ("gluon", "force", True)]
    if a.desc_route:
        settings.append(("gluon_tensordesc", "force", False))
    summary = {}
    for kind in a.kinds.split(","):
        dtype, precision = KINDS[kind]
        for shape in a.shapes.split(","):
            B, H, N, D = map(int, shape.split("x"))
            for causal in map(int, a.causal.split(",")):
                q, k, v = (torch.randn(B, H, N, D, device=dev, dtype=dtype) for _ in range(3))
                work = B * H * N * N * D * (0.5 if causal else 1.0)
                call = lambda: elsa_surgery.attention(q, k, v, is_causal=bool(causal), backend="elsa",
                                                      precision=precision)
                bare = lambda: launch.attention(q, k, v, scale=D ** -0.5, is_causal=bool(causal),
                                                precision=precision, return_lse=False)
                sdpa_backend = ("CUDNN_ATTENTION" if dtype != torch.float32 else "EFFICIENT_ATTENTION")

                def sdpa():
                    with torch.nn.attention.sdpa_kernel(getattr(torch.nn.attention.SDPBackend, sdpa_backend)):
                        return F.scaled_dot_product_attention(q, k, v, is_causal=bool(causal))

                times = {name: [] for name, _, _ in settings}
                hosts = {name: [] for name, _, _ in settings}
                bare_hosts = {name: [] for name, _, _ in settings}
                sdpa_t, sdpa_h = [], []
                ref = sdpa().float()
                for _ in range(a.rounds):
                    for name, hv, encoded in settings:
                        with benchmark.environ({hopper.ENV: hv}), descriptor_route(encoded):
                            out = call()
                            err = ((out.float() - ref).norm() / ref.norm()).item()
                            assert err < (3e-3 if kind == "turbo" else 2e-2), (kind, shape, name, err)
                            times[name].append(bench(call))
                            hosts[name].append(host_us(call))
                            bare_hosts[name].append(host_us(bare))
                    sdpa_t.append(bench(sdpa))
                    sdpa_h.append(host_us(sdpa))
                med = {n: statistics.median(t) for n, t in times.items()}
                row = dict(kind=kind, shape=shape, causal=causal, work=work, sdpa=sdpa_backend,
                           us={n: round(t, 1) for n, t in med.items()}, rounds_us=times,
                           sdpa_us=round(statistics.median(sdpa_t), 1),
                           host_us={n: round(statistics.median(t), 1) for n, t in hosts.items()},
                           launcher_host_us={n: round(statistics.median(t), 1) for n, t in bare_hosts.items()},
                           sdpa_host_us=round(statistics.median(sdpa_h), 1), gpu=torch.cuda.get_device_name())
                print(f"{kind:6s} {shape:14s} causal={causal} work {work:8.2g} | portable {med['portable']:7.1f} "
                      f"gluon {med['gluon']:7.1f}"
                      + (f" (tensordesc {med['gluon_tensordesc']:7.1f})" if a.desc_route else "")
                      + f" | SDPA {row['sdpa_us']:7.1f} us | host/call: public {row['host_us']}, launcher "
                      f"{row['launcher_host_us']}, SDPA {row['sdpa_host_us']}", flush=True)
                summary.setdefault(kind, []).append((work, med["gluon"] < med["portable"]))
                if a.json:
                    with open(a.json, "a") as f:
                        f.write(json.dumps(row) + "\n")
    for kind, cells in summary.items():
        losing = [w for w, gluon_wins in cells if not gluon_wins]
        least = min((w for w, _ in cells if all(w2 < w or gw for w2, gw in cells if w2 >= w)), default=None)
        print(f"{kind}: Gluon slower in {len(losing)} of {len(cells)} cells (work {sorted(losing)}); "
              f"faster in every cell from work {least}")


if __name__ == "__main__":
    main()
