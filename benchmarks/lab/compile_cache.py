"""Issue 33's compile time: what a warm compile of a model spends, native or converted.

One side per process. Run it twice on the same ``TORCHINDUCTOR_CACHE_DIR`` / ``TRITON_CACHE_DIR`` (fresh, then warm):
the second run shows whether Inductor's FX graph cache and AOTAutograd's cache served the graph (their hit, miss and
bypass counters, with the bypass reasons they logged), dynamo's own phase times, and the seconds of the first
compiled call. ``--profile FILE`` writes a cProfile of that call (``pstats`` format).

    python benchmarks/lab/compile_cache.py --side native|converted --workload swin_t --dtype fp32 [--profile F]

``--side both`` runs the processes itself and gives the ratio (session 41: single warm processes of Swin-T fp32 read
1.06x and 1.36x on one machine kind): each side on fresh caches of its own, ``--cold`` cold processes (fresh caches
each), then ``--warm`` warm ones, the two sides alternated (the host's drift falls on both); the summary holds every
process's seconds and the ratio of the medians, converted over native, and how many Triton cache entries each warm
process added (kernels it compiled again). ``--profile`` is not passed on (cProfile slows the call).

    python benchmarks/lab/compile_cache.py --side both --workload swin_t --dtype fp32 [--warm 3]

``--full-path`` turns the traced route off (``callcache.traced``, session 37: every traced call validated and decided
by dynamo's symbolic execution of the full path, as before it), for an A/B of the route in processes of their own.
``ELSA_COMPILE_OP=opaque`` in the environment makes the converted side trace to the opaque op instead of the inline
one (kernels/interface.py), to tell the two apart.

``--no-eager``: no eager call before the compiled one (it runs after it, for the output check), as a user who converts
with ``verify=False`` and compiles meets it: every kernel the compiled call needs, ELSA's included, is compiled in
the timed call (session 56: by default one eager call comes first, and the converted side's eager kernels, the Hopper
kernel among them, were compiled there, outside the timing).
"""

import argparse
import cProfile
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from host_profile import _bench_models  # (this directory: the script's own)


class _Bypasses(logging.Handler):
    """Keeps the caches' "Bypassing ..." records (their reasons are logged at INFO, not counted). Matching any
    mention of "bypass" caught the AOTAutograd cache's key details as well (session 37's first runs)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.seen = []

    def emit(self, record):
        msg = record.getMessage()
        if "Bypassing" in msg and msg not in self.seen:
            self.seen.append(msg[:300])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--side", choices=("native", "converted", "both"), required=True)
    ap.add_argument("--warm", type=int, default=3, help="--side both: warm processes of each side")
    ap.add_argument("--cold", type=int, default=1, help="--side both: cold processes of each side, each on fresh "
                    "caches (session 55: one cold process a side read LLaMA 4K fp32 1.05x and 1.15x in two calls)")
    ap.add_argument("--workload", default="swin_t")
    ap.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--profile", default=None, help="write a cProfile of the compiled call here")
    ap.add_argument("--full-path", action="store_true", help="converted side: the traced route off")
    ap.add_argument("--no-eager", action="store_true", help="no eager call before the compiled one (module docstring)")
    a = ap.parse_args()
    if a.side == "both":
        return both_sides(a)
    import elsa_surgery
    from elsa_surgery import callcache
    from elsa_surgery.kernels import launch, replay  # (torch's analysis of ELSA's kernels, memoised; precompiles)

    if a.full_path:
        callcache.traced = lambda *args: None

    bypasses = _Bypasses()
    for name in ("torch._inductor.codecache", "torch._functorch._aot_autograd.autograd_cache",
                 "torch._inductor.compile_fx"):
        lg = logging.getLogger(name)
        lg.addHandler(bypasses)
        lg.setLevel(logging.INFO)
    bm = _bench_models()
    dtype = dict(fp32=torch.float32, bf16=torch.bfloat16)[a.dtype]
    model, call = bm.ab_build(a.workload, dtype, a.batch, "cuda")
    if a.side != "native":
        elsa_surgery.convert(model, verify=False)
    prof = cProfile.Profile() if a.profile else None
    with torch.inference_mode():
        ref, eager_s = None, None
        if not a.no_eager:
            t0 = time.perf_counter()
            ref = call(model)  # (the first eager call: the converted side compiles its kernels here, in this process)
            torch.cuda.synchronize()
            eager_s = time.perf_counter() - t0
        bm.warm_up_compiler(argparse.Namespace(compile_backend="inductor", cpu_smoke=False), "cuda")
        torch._dynamo.utils.counters.clear()
        compiled = torch.compile(model)
        t0 = time.perf_counter()
        if prof:
            prof.enable()
        out = call(compiled)
        torch.cuda.synchronize()
        if prof:
            prof.disable()
        seconds = time.perf_counter() - t0
        if ref is None:
            ref = call(model)
    if prof:
        prof.dump_stats(a.profile)
    counters = {group: dict(c) for group, c in torch._dynamo.utils.counters.items()
                if group in ("inductor", "aot_autograd", "stats", "graph_break")}
    keep = ("cache", "bypass", "calls_captured", "unique_graphs", "fxgraph")
    counters = {g: {k: v for k, v in c.items() if any(s in k for s in keep)} for g, c in counters.items()}
    print(json.dumps({"side": a.side, "full_path": a.full_path, "traced": callcache.TRACED, "workload": a.workload,
                      "ttir_memo": dict(replay.TTIR_MEMO), "precompile": dict(launch.PRECOMPILE),
                      "dtype": a.dtype, "compile_s": seconds, "first_eager_call_s": eager_s,
                      "max_abs_diff_vs_eager": float((out.float() - ref.float()).abs().max()),
                      "counters": counters, "bypass_logs": bypasses.seen[:8]}), flush=True)
    print(torch._dynamo.utils.compile_times(repr="str", aggregate=True), flush=True)
    return 0


def both_sides(a) -> int:
    """``--side both``: ``a.cold`` cold processes, then ``a.warm`` warm ones of each side, the sides alternated; each
    side's caches its own, fresh for every cold process (the warm ones start on the last cold one's)."""
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    sides = ("native", "converted")
    caches = {side: tempfile.mkdtemp(prefix=f"elsa_compile_{side}_") for side in sides}
    seconds = {(side, run): [] for side in sides for run in ("cold", "warm")}
    compiled_again = {side: [] for side in sides}  # Triton cache entries each warm process added (kernels compiled)
    try:
        for i, run in enumerate(["cold"] * max(1, a.cold) + ["warm"] * a.warm):
            for side in sides:
                if run == "cold" and i:  # (fresh caches: a cold process of its own)
                    shutil.rmtree(caches[side], ignore_errors=True)
                    caches[side] = tempfile.mkdtemp(prefix=f"elsa_compile_{side}_")
                env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(caches[side], "inductor"),
                           TRITON_CACHE_DIR=os.path.join(caches[side], "triton"))
                cmd = [sys.executable, __file__, "--side", side, "--workload", a.workload, "--dtype", a.dtype,
                       "--batch", str(a.batch), *(["--full-path"] if a.full_path else []),
                       *(["--no-eager"] if a.no_eager else [])]
                before = _triton_entries(env["TRITON_CACHE_DIR"])
                done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200, check=False)
                added = sorted(_triton_entries(env["TRITON_CACHE_DIR"]) - before)
                if run == "warm":
                    compiled_again[side].append(len(added))
                print(f"==== {side} {run}: {len(added)} Triton cache entries added "
                      f"({', '.join(sorted({name for _, name in added})[:8])})\n{done.stdout}", flush=True)
                lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
                if done.returncode or not lines:
                    print(done.stderr[-3000:], flush=True)
                    continue
                seconds[(side, run)].append(json.loads(lines[-1])["compile_s"])
    finally:
        for cache in caches.values():
            shutil.rmtree(cache, ignore_errors=True)
    summary = {f"{side}_{run}_s": [round(x, 2) for x in xs] for (side, run), xs in seconds.items()}
    summary.update({f"{side}_warm_triton_entries_added": n for side, n in compiled_again.items()})
    for run in ("cold", "warm"):
        if seconds[("native", run)] and seconds[("converted", run)]:
            summary[f"{run}_ratio_of_medians"] = round(statistics.median(seconds[("converted", run)])
                                                       / statistics.median(seconds[("native", run)]), 3)
    print("summary (compile seconds; ratio: converted / native):", json.dumps(summary), flush=True)
    return 0


def _triton_entries(cache: str) -> set:
    """``(directory, kernel name)`` of every compiled kernel in a Triton cache (a warm process that adds some compiled
    them again: session 42 found the ELSA kernels compiled again in the first warm process, another ptxas)."""
    found = set()
    if os.path.isdir(cache):
        for d in os.listdir(cache):
            path = os.path.join(cache, d)
            if os.path.isdir(path):
                found.update((d, f[:-5]) for f in os.listdir(path) if f.endswith(".json") and not f.startswith("__"))
    return found


if __name__ == "__main__":
    sys.exit(main())
