"""Where the compiled gap of issue 33 comes from: ViT-B/16 bf16 b8 and DeiT3-S bf16 b64 compiled read ~4 % below
the compiled native model (session 47, ``bench_models.py --compile --processes 4``: 0.961 / 0.965) with the same
kernels on both sides (``auto`` takes SDPA in every graph).

Each process builds the workload and variants of it (``--variants``, native first), compiles each (the order
rotated from one process to the next, so that every variant compiles first, second, ... equally often) and times
them in interleaved rounds:

* ``native``: the model;
* ``copy``: a deep copy, not converted (the A/A control in the same design);
* ``converted``: a deep copy, ``elsa_surgery.convert(verify=False)``;
* ``reverted``: a deep copy converted, called once eagerly (auto's race, the kernels' load), then reverted: the
  process's ELSA state with the model's modules as native's;
* ``instance``: converted, then each patched module's forward moved from its patched class to the instance (a
  ``patching.BoundForward``, the patch mechanism before session 48, under which Dynamo traced and guarded
  ``Module._call_impl`` for each patched module);
* ``sdpa`` (``--variants``): converted with ``backend="sdpa"``: the graph's SDPA put there without auto's traced race;
* ``closure`` (``--variants``): converted, each patched class replaced by one whose ``forward`` takes the config
  from its closure instead of the module (before session 49's change: instead of the patch record, with no guards
  on the record and its shared config);
* ``subclass`` (``--variants``): a deep copy, not converted, whose modules that ``convert`` patches get a plain
  subclass of their class (the same ``forward``): the native computation in a second compiled graph of its own
  (``copy`` and ``reverted`` pass the guards of native's graph and share it), the A/A control for a second graph.

Per variant and process: the synchronised per-call time, the host time alone (``per_call_ms(host_only=True)``), the
CUDA runtime calls of one compiled call (``torch.profiler``: launches, copies, synchronisations, allocations) and the
number of synchronising operations PyTorch flags (``torch.cuda.set_sync_debug_mode``), the compiled frame's guard
check time, and cProfile's split of the host time. The ratios native / variant are summed up as geometric means
over the processes. Session 48's H200 runs: ``docs/perf/history.md``, "Session 48".

    python benchmarks/lab/compile_gap.py [--workload vit_b16] [--dtype bf16] [--batch 8] [--processes 8] \
        [--rounds 9] [--calls 10] [--variants native,copy,converted,reverted,instance] [--out gap.json]

Needs a CUDA GPU and timm (``--cpu-smoke``: the one-block models of ``bench_models.py --cpu-smoke``, to check the
script).
"""

import argparse
import copy
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import torch

VARIANTS = ("native", "copy", "converted", "reverted", "instance", "sdpa", "closure", "subclass")
DEFAULT_VARIANTS = "native,copy,converted,reverted,instance"


def runtime_calls(fn, device) -> dict:
    """``{runtime call: [count, host µs]}`` of one call of ``fn`` (the CPU-side CUDA runtime and driver events)."""
    from torch.profiler import ProfilerActivity, profile

    if device != "cuda":
        return {}
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    out = {}
    for ev in prof.key_averages():
        if ev.device_type == torch.autograd.DeviceType.CPU and ev.key.startswith(("cuda", "cu")):
            out[ev.key] = [ev.count, round(ev.self_cpu_time_total, 1)]
    return dict(sorted(out.items()))


def sync_warnings(fn, device) -> int:
    """How many synchronising operations PyTorch flags in one call of ``fn`` (``set_sync_debug_mode("warn")``)."""
    if device != "cuda":
        return 0
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return sum("synchroniz" in str(w.message) for w in got)


def unswap_classes(model) -> int:
    """Move each class-swapped module's forward to a ``BoundForward`` on the instance (the mechanism before session
    48; a lab variant, not revertible)."""
    from elsa_surgery import patching

    n = 0
    for m in model.modules():
        cls = type(m)
        if patching.BASE_CLASS_ATTR in cls.__dict__:
            m.__class__ = cls.__dict__[patching.BASE_CLASS_ATTR]
            m.__dict__["forward"] = patching.BoundForward(cls.__dict__[patching.FORWARD_FN_ATTR], m)
            n += 1
    return n


def guard_us(model, example, reps: int = 2000) -> float:
    """Median µs of one check of the guards of the compiled frame that ``model(example)`` hits (Dynamo's cache entry
    of the model's ``forward``, ``Module._call_impl`` or ``_wrapped_call_impl``, whichever holds a passing entry)."""
    import inspect
    import time

    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    fwd = type(model).forward
    params = inspect.signature(fwd).parameters  # (the frame's locals: its arguments, defaults included)
    local = {k: p.default for k, p in params.items() if p.default is not inspect.Parameter.empty}
    local.update(self=model, x=example)
    frames = ((fwd.__code__, local),
              (torch.nn.Module._call_impl.__code__, {"self": model, "args": (example,), "kwargs": {}}),
              (torch.nn.Module._wrapped_call_impl.__code__, {"self": model, "args": (example,), "kwargs": {}}))
    for code, loc in frames:
        for entry in _debug_get_cache_entry_list(code):
            gm = entry.guard_manager
            if gm.check(loc):
                ts = []
                for _ in range(9):
                    t0 = time.perf_counter()
                    for _ in range(reps):
                        gm.check(loc)
                    ts.append((time.perf_counter() - t0) / reps * 1e6)
                return statistics.median(ts)
    return float("nan")


def host_split(fn, calls: int = 200) -> dict:
    """cProfile of ``calls`` calls: µs a call in all, in Inductor's ``call`` functions (cumulative) and in the
    module-call frames' own time (where Dynamo's cache lookup and guards are charged)."""
    import cProfile
    import pstats

    pr = cProfile.Profile()
    pr.enable()
    for _ in range(calls):
        fn()
    pr.disable()
    st = pstats.Stats(pr).stats
    total = sum(v[2] for v in st.values())
    inductor = sum(v[3] for (f, _, name), v in st.items() if name == "call" and "torchinductor" in f)
    call_impl = sum(v[2] for (f, _, name), v in st.items() if name in ("_call_impl", "_wrapped_call_impl"))
    return {k: round(v / calls * 1e6, 1) for k, v in (("total", total), ("inductor_call", inductor),
                                                       ("call_impl_own", call_impl))}


def close_configs(model) -> int:
    """Give each class-swapped module a class whose ``forward`` holds its config in a closure (a lab variant)."""
    from elsa_surgery import patching

    n = 0
    for m in model.modules():
        cls = type(m)
        if patching.BASE_CLASS_ATTR in cls.__dict__:
            fn, config = cls.__dict__[patching.FORWARD_FN_ATTR], patching.record_of(m).config

            def forward(self, *a, _fn=fn, _config=config, **kw):
                return _fn(self, *a, config=_config, **kw)

            m.__class__ = type(cls.__name__, (cls.__dict__[patching.BASE_CLASS_ATTR],), {"forward": forward})
            n += 1
    return n


def subclass_patchable(model) -> int:
    """Give each module that ``convert`` would patch a plain subclass of its class (nothing else changed)."""
    import elsa_surgery

    probe = copy.deepcopy(model)
    names = {e.name for e in elsa_surgery.convert(probe, backend="sdpa", verify=False).converted}
    del probe
    n = 0
    for name, m in model.named_modules():
        if name in names:
            cls = type(m)
            m.__class__ = type(cls.__name__, (cls,), {"__module__": cls.__module__, "__qualname__": cls.__qualname__})
            n += 1
    return n


def child(args) -> dict:
    import elsa_surgery
    from elsa_surgery import benchmark

    from host_profile import _bench_models  # (this folder's: recipes/bench_models.py loaded as a module)

    bm = _bench_models()
    device = "cpu" if args.cpu_smoke else "cuda"
    dtype, tf32 = bm.AB_DTYPES[args.dtype]
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    native, call = bm.ab_build(args.workload, dtype, args.batch, device, smoke=args.cpu_smoke)
    variants = args.variants
    models = {n: native if n == "native" else copy.deepcopy(native) for n in variants}
    rec = dict(workload=args.workload, dtype=args.dtype, batch=args.batch, index=args.index, variants=variants)
    for n in variants:
        if n not in ("native", "copy", "subclass"):
            rec[f"{n}_modules"] = elsa_surgery.convert(models[n], backend="sdpa" if n == "sdpa" else "auto",
                                                       verify=False).num_converted
    if "instance" in models:
        rec["instance_modules"] = unswap_classes(models["instance"])
    if "closure" in models:
        rec["closure_modules"] = close_configs(models["closure"])
    if "subclass" in models:
        rec["subclass_modules"] = subclass_patchable(models["subclass"])
    k = args.index % len(variants)
    order = list(variants[k:] + variants[:k])
    rec["compile_order"] = order
    compiled, rec["compile_s"] = {}, {}
    with torch.inference_mode():
        for n in variants:
            if n not in ("native", "copy", "subclass"):
                call(models[n])  # (eager: auto's race, the kernels' load)
        if "reverted" in models:
            rec["reverted_modules"] = len(elsa_surgery.revert(models["reverted"]))
        before = set(elsa_surgery.autoselect.compiled_decisions())
        for name in order:
            compiled[name], rec["compile_s"][name] = bm.compile_first_call(models[name], call, "default", args,
                                                                           device)
        rec["compiled_decisions"] = sorted({d.reason for sig, d in elsa_surgery.autoselect.compiled_decisions()
                                            .items() if sig not in before})
        ref = call(compiled["native"]).float()
        rec["rel_err"] = {n: float((call(c).float() - ref).norm() / ref.norm().clamp_min(1e-30))
                          for n, c in compiled.items()}
        del ref
        gc.collect()
        fns = {n: (lambda c=compiled[n]: call(c)) for n in order}
        rec["ms"] = benchmark.interleaved_ms(fns, rounds=args.rounds, calls=args.calls, device=device)
        host = {n: [] for n in order}
        for _ in range(args.rounds):
            for n in order:
                host[n].append(benchmark.per_call_ms(fns[n], args.calls, host_only=True, warmup=1, device=device))
        rec["host_ms"] = {n: statistics.median(t) for n, t in host.items()}
        rec["runtime_calls"] = {n: runtime_calls(fns[n], device) for n in order}
        x = getattr(call, "example", None)
        rec["guard_us"] = {n: guard_us(models[n], x) for n in order} if x is not None else {}
        rec["host_split"] = {n: host_split(fns[n]) for n in order}
        rec["sync_warnings"] = {n: sync_warnings(fns[n], device) for n in order}
    rec["ratio"] = {n: rec["ms"]["native"] / rec["ms"][n] for n in variants}
    return rec


def parent(args) -> dict:
    runs = []
    for i in range(args.processes):
        fd, out = tempfile.mkstemp(prefix="elsa_compile_gap_", suffix=".json")
        os.close(fd)
        cmd = [sys.executable, __file__, "--child", str(i), "--out", out, "--workload", args.workload,
               "--dtype", args.dtype, "--batch", str(args.batch), "--rounds", str(args.rounds),
               "--calls", str(args.calls), "--variants", ",".join(args.variants),
               *(["--cpu-smoke"] if args.cpu_smoke else [])]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        text = Path(out).read_text()
        os.unlink(out)
        if done.returncode or not text:
            lines = (done.stderr or done.stdout).strip().splitlines() or [""]
            raise RuntimeError(f"process {i} failed ({done.returncode}): {lines[-1][-400:]}")
        rec = json.loads(text)
        runs.append(rec)
        print(f"process {i} (compiled {' > '.join(rec['compile_order'])}): "
              + ", ".join(f"{n} {rec['ms'][n]:.3f} ms / host {rec['host_ms'][n]:.3f} ({rec['ratio'][n]:.3f})"
                          for n in args.variants), flush=True)
    names = args.variants
    summary = {n: statistics.geometric_mean([r["ratio"][n] for r in runs]) for n in names}
    host = {n: statistics.geometric_mean([r["host_ms"]["native"] / r["host_ms"][n] for r in runs]) for n in names}
    print("geometric means of native / variant over the processes, wall: "
          + ", ".join(f"{n} {v:.3f}" for n, v in summary.items()) + "; host alone: "
          + ", ".join(f"{n} {v:.3f}" for n, v in host.items()), flush=True)
    if runs[0].get("guard_us"):
        vals = {n: statistics.median([r["guard_us"][n] for r in runs]) for n in names}
        print("medians of guard_us: " + ", ".join(f"{n} {v:.1f}" for n, v in vals.items()), flush=True)
    split = {n: {k: statistics.median([r["host_split"][n][k] for r in runs]) for k in runs[0]["host_split"][n]}
             for n in args.variants}
    print("medians of cProfile's µs a call (total, Inductor's call, module-call frames' own): "
          + "; ".join(f"{n} {v['total']:.0f} / {v['inductor_call']:.0f} / {v['call_impl_own']:.0f}"
                      for n, v in split.items()), flush=True)
    first = runs[0]
    for n in args.variants:
        print(f"  {n}: runtime calls of one call {first['runtime_calls'][n]}; sync warnings "
              f"{first['sync_warnings'][n]}", flush=True)
    print(f"  compiled decisions: {first['compiled_decisions']}", flush=True)
    return dict(runs=runs, wall=summary, host=host)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="vit_b16")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--processes", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--variants", default=DEFAULT_VARIANTS,
                    help=f"comma-separated, native first, of {', '.join(VARIANTS)} (default {DEFAULT_VARIANTS})")
    ap.add_argument("--out", default=None)
    ap.add_argument("--cpu-smoke", action="store_true")
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.compile_backend = "inductor"
    args.variants = tuple(v.strip() for v in args.variants.split(",") if v.strip())
    bad = [v for v in args.variants if v not in VARIANTS]
    if bad or args.variants[:1] != ("native",) or len(set(args.variants)) != len(args.variants):
        ap.error(f"--variants: distinct names of {', '.join(VARIANTS)}, native first; got {','.join(args.variants)}")
    if args.child is not None:
        args.index = args.child
        rec = child(args)
        Path(args.out).write_text(json.dumps(rec))
        return 0
    if not args.cpu_smoke and not torch.cuda.is_available():
        print("compile_gap.py needs a CUDA GPU (or --cpu-smoke)", file=sys.stderr)
        return 2
    res = parent(args)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
