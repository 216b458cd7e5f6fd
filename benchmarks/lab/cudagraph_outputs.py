"""Why did ``bench_models.py --compile max-autotune`` read LLaMA-13B-shaped 4K fp32 with rel 1.2 against native?
``max-autotune`` and ``reduce-overhead`` run the compiled graph as CUDA graphs (cudagraph trees): a call's output is
a buffer of the graphs' shared memory pool, which a later compiled call may overwrite. The benchmark held the native
output (``.float()`` of an fp32 tensor is the tensor itself) while it called the converted model.

This compiles the native and the converted model (``reduce-overhead``: the same CUDA graphs as ``max-autotune``
without its GEMM autotuning), then compares their outputs held as returned and copied at once, and the compiled ones
with the eager ones.

    python benchmarks/lab/cudagraph_outputs.py [reduce-overhead|max-autotune]

Needs a CUDA GPU and transformers. Session 51's H200 run: held 1.22 apart (the held native output 1.75 from the eager
one), copied 4.7e-6; compiled converted vs eager converted 4.5e-6 (native 4.7e-6): the benchmark copies since.
"""
import copy
import importlib.util
import sys
from pathlib import Path

import torch

import elsa_surgery

HERE = Path(__file__).resolve().parents[2]


def main(mode):
    spec = importlib.util.spec_from_file_location("bench_models", HERE / "recipes" / "bench_models.py")
    bm = importlib.util.module_from_spec(spec)
    sys.modules["bench_models"] = bm
    spec.loader.exec_module(bm)
    native, call = bm.ab_build("llama13b_2l_4k", torch.float32, 1, "cuda")
    conv = copy.deepcopy(native)
    elsa_surgery.convert(conv, verify=False)

    def rel(a, b):
        return float((a - b).norm() / b.norm())

    with torch.inference_mode():
        eager_n, eager_c = call(native).float().clone(), call(conv).float().clone()
        print("eager converted vs eager native", rel(eager_c, eager_n))
        cc, nc = torch.compile(conv, mode=mode), torch.compile(native, mode=mode)
        for _ in range(3):  # warm-up, capture, replay
            call(cc)
            call(nc)
        ref = call(nc).float()
        out = call(cc).float()
        try:
            print("held (no copy): out vs ref", rel(out, ref), "| ref vs eager native", rel(ref, eager_n),
                  "| same storage", ref.data_ptr() == out.data_ptr())
        except RuntimeError as e:  # (cudagraph trees may refuse to read an overwritten output)
            print("held (no copy): error", repr(e)[:300])
        ref = call(nc).float().clone()
        out = call(cc).float().clone()
        print("copied: compiled converted vs compiled native", rel(out, ref),
              "| compiled converted vs eager converted", rel(out, eager_c),
              "| compiled native vs eager native", rel(ref, eager_n))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "reduce-overhead")
