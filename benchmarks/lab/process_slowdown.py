"""Does using ELSA slow down the rest of the process? Session 32's H100 runs of ``bench_models.py --compile`` timed
the *native* compiled model 23-60 % slower in processes that had converted, raced and compiled a copy (ViT-B/16 bf16
batch 8: 3.46 ms) than in the A/A control processes on the same machine (2.17 ms), where nothing was converted.

This times the compiled native model (ViT-B/16, bf16, batch 8, inference mode: a host-bound call) in one process
before and after each step a converted copy takes: importing the package and its kernels, ``convert``, eager calls
(auto's race, the kernels' first compile), compiling the copy and calling it, a ``gc.collect()``.

    python benchmarks/lab/process_slowdown.py [--calls 20] [--rounds 7] [--second converted|native]

``--second native`` is the control: the copy is not converted (and the package not imported) but compiled all the
same, through a function of its own so that Dynamo traces and Inductor compiles it anew rather than reusing the
first model's graph.

Prints the native model's per-call time (CUDA-synchronised wall time, median of ``--rounds`` rounds of ``--calls``
calls) after each step. Needs a CUDA GPU and timm. Session 33's H100 run: the native model slowed from 3.30 to
3.98 ms per call once the converted copy was compiled (3.62 after a gc.collect()); every earlier step left it alone.
"""

import argparse
import copy
import gc
import statistics
import time

import torch


def per_call_ms(fn, calls, rounds):  # not elsa_surgery.benchmark's: the baseline runs before the package is imported
    times = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / calls * 1e3)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--second", choices=("converted", "native"), default="converted")
    a = ap.parse_args()
    import timm

    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    torch.manual_seed(0)
    native = timm.create_model("vit_base_patch16_224", pretrained=False).to("cuda", torch.bfloat16).eval()
    x = torch.randn(8, 3, 224, 224, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        compiled_native = torch.compile(native)
        for _ in range(3):
            compiled_native(x)

        def report(step):
            ms = per_call_ms(lambda: compiled_native(x), a.calls, a.rounds)
            print(f"{step:<40} native compiled {ms:.3f} ms per call", flush=True)

        report("baseline")
        second = copy.deepcopy(native)
        if a.second == "converted":
            import elsa_surgery

            elsa_surgery.dispatch.kernels_module()
            report("after import + kernels load")
            elsa_surgery.convert(second, verify=False)
            report("after convert (no call)")
        for _ in range(3):
            second(x)
        report(f"after 3 eager {a.second} calls")
        compiled_second = torch.compile(lambda t: second(t))  # a frame of its own: traced and compiled anew
        for _ in range(3):
            compiled_second(x)
        report(f"after compiling the {a.second} copy")
        ms = per_call_ms(lambda: compiled_second(x), a.calls, a.rounds)
        print(f"{'(the ' + a.second + ' copy, compiled)':<40} {ms:.3f} ms per call", flush=True)
        gc.collect()
        report("after gc.collect()")


if __name__ == "__main__":
    main()
