"""Where a converted BERT-base forward loses time to the native one at a host-bound shape (issue 24's batch 8, 128
tokens, bf16 cell: 0.93x on an H200 in session 39 with ``auto`` taking SDPA in every layer).

    python benchmarks/lab/bert_host_gpu.py [--batch 8] [--seq 128] [--dtype bf16] [--rounds 7] [--calls 20]

The model and inputs are ``recipes/bench_models.py``'s workload ``bert_base_<seq>`` (random BERT-base, right padding;
``--seq`` 128 or 512), built by its ``ab_build``. Prints for each side,
native and converted (``auto``), interleaved rounds (medians): the eager time per forward (host and GPU: synced
before and after) and the host time alone (the clock stops when the forward returns; the GPU queue absorbs the
kernels); then, from one profiled forward of each side, the CUDA kernels and the CUDA runtime calls that differ in
count or time (synchronisations, copies, launches). Needs a CUDA GPU.
"""

import argparse
import copy
import statistics

import torch
import transformers
from torch.profiler import ProfilerActivity, profile

import elsa_surgery
from elsa_surgery import benchmark
from host_profile import _bench_models  # (this directory: the script's own)


def table(prof):
    """name -> (count, self CUDA us, self CPU us) over the profiled events."""
    rows = {}
    for e in prof.key_averages():
        rows[e.key] = (e.count, e.self_device_time_total, e.self_cpu_time_total)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128, choices=[128, 512])
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=20)
    a = ap.parse_args()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[a.dtype]
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}  transformers {transformers.__version__}")
    native, forward = _bench_models().ab_build(f"bert_base_{a.seq}", dtype, a.batch, "cuda")
    converted = copy.deepcopy(native)
    elsa_surgery.convert(converted, verify=False)
    sides = {"native": native, "converted": converted}
    eager = {s: [] for s in sides}
    host = {s: [] for s in sides}
    with torch.no_grad():
        for m in sides.values():
            for _ in range(3):
                forward(m)
        torch.cuda.synchronize()
        for _ in range(a.rounds):
            for s, m in sides.items():
                h, e = benchmark.host_and_eager_us(lambda m=m: forward(m), a.calls, rounds=1)
                host[s].append(h)
                eager[s].append(e)
        med = {s: (statistics.median(eager[s]), statistics.median(host[s])) for s in sides}
        for s, (e, h) in med.items():
            print(f"{s:>10}: eager {e:8.1f} us/forward  host {h:8.1f} us/forward")
        print(f"ratio native/converted: eager {med['native'][0] / med['converted'][0]:.3f}  "
              f"host {med['native'][1] / med['converted'][1]:.3f}")
        tables = {}
        for s, m in sides.items():
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    forward(m)
                torch.cuda.synchronize()
            tables[s] = table(prof)
    names = sorted(set(tables["native"]) | set(tables["converted"]))
    print("\nper 5 forwards: count, self CUDA us, self CPU us (rows that differ; native | converted)")
    for n in names:
        a_, b_ = tables["native"].get(n, (0, 0, 0)), tables["converted"].get(n, (0, 0, 0))
        if a_[0] != b_[0] or abs(a_[1] - b_[1]) > 20 or abs(a_[2] - b_[2]) > 100:
            print(f"  {n[:70]:70} {a_[0]:5d} {a_[1]:9.0f} {a_[2]:9.0f} | {b_[0]:5d} {b_[1]:9.0f} {b_[2]:9.0f}")


if __name__ == "__main__":
    main()
