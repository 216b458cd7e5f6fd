"""Where a converted model's host time goes, by cProfile, in the two cells that session 31's H100 run found
host-bound and slower than native: ViT-B/16 bf16 batch 8 compiled (``torch.compile`` default, inference mode;
0.45x native) and its bf16-autocast training step (eager, ``auto`` taking SDPA; 0.76x native); ``bert``: BERT-base
with padding, 128 tokens, batch 8, fp32, eager under inference mode (0.81x native), with each side's GPU kernels
(``--bert-workload``/``--bert-dtype``/``--bert-batch``: session 36's bf16 batch 32 cells, 0.94x).

    python benchmarks/lab/host_profile.py [--calls 20] [--top 30] [--which compile,train,bert] \
        [--compile-workload swin_t --compile-dtype fp32]

Prints, for each, the per-call time of native and converted (interleaved, medians), dynamo's graph-break and
recompile counters (compile), and cProfile's costliest functions over ``--calls`` converted calls, by own time and by
cumulative time. Needs a CUDA GPU and timm.
"""

import argparse
import copy
import importlib.util
import pathlib

import torch

import elsa_surgery
from elsa_surgery import benchmark

_BENCH = pathlib.Path(__file__).resolve().parents[2] / "recipes" / "bench_models.py"


def _bench_models():
    spec = importlib.util.spec_from_file_location("bench_models", _BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--which", default="compile,train,bert")
    ap.add_argument("--compile-workload", default="vit_b16", help="compile: the bench_models.py workload")
    ap.add_argument("--compile-dtype", default="bf16", choices=("bf16", "fp32"))
    ap.add_argument("--bert-workload", default="bert_base_128", choices=("bert_base_128", "bert_base_512"))
    ap.add_argument("--bert-dtype", default="fp32", choices=("bf16", "fp32"))
    ap.add_argument("--bert-batch", type=int, default=8)
    ap.add_argument("--bert-native-profile", action="store_true", help="bert: cProfile the native model too")
    ap.add_argument("--compile-native-profile", action="store_true",
                    help="compile: cProfile the compiled native model too (session 47: the two compiled ViT-B/16 "
                         "bf16 steps ran the same kernels, 0.2 ms apart a call)")
    a = ap.parse_args()
    orders = (("tottime", a.top), ("cumulative", a.top))  # cProfile's rows, by own and by cumulative time
    bm = _bench_models()
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    if "compile" in a.which:
        dtype = dict(bf16=torch.bfloat16, fp32=torch.float32)[a.compile_dtype]
        native, call = bm.ab_build(a.compile_workload, dtype, 8, "cuda")
        converted = copy.deepcopy(native)
        elsa_surgery.convert(converted, verify=False)
        from torch._dynamo.utils import counters

        counters.clear()
        with torch.inference_mode():
            cc, nc = torch.compile(converted), torch.compile(native)
            for _ in range(3):
                call(cc), call(nc)
            torch.cuda.synchronize()
            print("dynamo counters after 3 calls each:",
                  {k: dict(v) for k, v in counters.items() if k in ("graph_break", "stats", "recompiles")}, flush=True)
            t = benchmark.interleaved_ms({"native": lambda: call(nc), "converted": lambda: call(cc)}, rounds=5,
                                         calls=10)
            print(f"compiled {a.compile_workload} {a.compile_dtype} b8: native {t['native']:.3f} ms, converted "
                  f"{t['converted']:.3f} ms", flush=True)
            host = {n: benchmark.per_call_ms(f, 20, host_only=True) for n, f in
                    (("native", lambda: call(nc)), ("converted", lambda: call(cc)))}
            print(f"  host only: native {host['native']:.3f} ms, converted {host['converted']:.3f} ms", flush=True)
            print("-- converted", flush=True)
            benchmark.print_host_profile(lambda: call(cc), a.calls, orders)
            if a.compile_native_profile:
                print("-- native", flush=True)
                benchmark.print_host_profile(lambda: call(nc), a.calls, orders)
        native = converted = cc = nc = None
        torch._dynamo.reset()
    if "train" in a.which:
        native, call = bm.ab_build("vit_b16", torch.float32, 8, "cuda")
        native.train()
        converted = copy.deepcopy(native)
        elsa_surgery.convert(converted, verify=False)
        steps = {side: bm.train_step(m, call, torch.optim.AdamW(m.parameters(), lr=1e-6), torch.bfloat16, "cuda")
                 for side, m in (("native", native), ("converted", converted))}
        with elsa_surgery.dispatch.record() as log:
            steps["converted"]()
        print("converted step's decisions:", benchmark.dispatch_summary(log), flush=True)
        t = benchmark.interleaved_ms(steps, rounds=5, calls=5)
        print(f"train vit_b16 bf16-autocast b8: native {t['native']:.3f} ms, converted {t['converted']:.3f} ms",
              flush=True)
        benchmark.print_host_profile(steps["converted"], max(2, a.calls // 4), orders)
    if "bert" in a.which:
        dtype = dict(bf16=torch.bfloat16, fp32=torch.float32)[a.bert_dtype]
        native, call = bm.ab_build(a.bert_workload, dtype, a.bert_batch, "cuda")
        converted = copy.deepcopy(native)
        elsa_surgery.convert(converted, verify=False)
        with torch.inference_mode():
            fns = {"native": lambda: call(native), "converted": lambda: call(converted)}
            t = benchmark.interleaved_ms(fns, rounds=5, calls=10)
            host = {n: benchmark.per_call_ms(f, 20, host_only=True) for n, f in fns.items()}
            print(f"{a.bert_workload} {a.bert_dtype} b{a.bert_batch}: native {t['native']:.3f} ms, converted {t['converted']:.3f} ms; host only "
                  f"{host['native']:.3f} / {host['converted']:.3f} ms", flush=True)
            for side, fn in fns.items():
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    for _ in range(5):
                        fn()
                    torch.cuda.synchronize()
                print(f"{side} kernels over 5 calls:")
                print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))
            with elsa_surgery.dispatch.record() as log:
                fns["converted"]()
            print("converted call's decisions:", benchmark.dispatch_summary(log), sorted({d.reason for d in log}),
                  flush=True)
            for side in (("native", "converted") if a.bert_native_profile else ("converted",)):
                print(f"===== cProfile, {side}", flush=True)
                benchmark.print_host_profile(fns[side], a.calls, orders)


if __name__ == "__main__":
    main()
