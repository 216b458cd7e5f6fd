"""Issue 33's compile time: a prototype that keeps ELSA's Python out of dynamo's bytecode tracing.

Session 36 found the converted model's extra compile time in dynamo symbolically executing the Python of every ELSA
call (~400 source lines a call: the adapter's call into ``elsa_surgery.attention``, validation, dispatch, knobs; Swin-T
fp32: 3.96 s of a 10.5 s warm compile for 12 calls). This prototype puts a ``torch.compiler.nonstrict_trace`` boundary
at the public call: dynamo records one node and runs the function on fake tensors for its outputs, and AOTAutograd
traces it by running the Python as Python. Inside, ``torch.compiler._is_compiling_flag`` is held True so that the
library's traced branches run (torch 2.14 holds it for a whole compile session; this prints what this torch does).

    python benchmarks/lab/compile_boundary.py --side native|converted|boundary --workload swin_t --dtype fp32

Result (session 36, H200, torch 2.11.0+cu130, Swin-T fp32 batch 8, fresh caches then warm): native 30.4 / 2.48 s,
converted 30.0 / 7.03 s, converted with this boundary 29.8 / **8.33 s**: no gain (the same machine's earlier run:
native 27.6 / 3.22, converted 32.2 / 6.20). On a CPU (torch 2.14.1, 12 calls, TRITON_INTERPRET=1, dynamo alone) the
boundary halved dynamo's bytecode tracing (4.53 -> 2.54 s, SDPA 0.22 s, a loaded host), but on the GPU the function
then runs twice on fake tensors (dynamo's output metadata, AOTAutograd's trace), each through the inline op's
``wrap_triton`` launches. Kept as the measured negative result. torch 2.11 has no ``torch.compiler.nonstrict_trace``
(``torch._dynamo.nonstrict_trace`` only) and takes no None or str argument across the boundary (codes here); its
``torch.compiler.is_compiling()`` reads ``_is_compiling_flag`` as 2.14 does.

One side per process (run it with fresh ``TORCHINDUCTOR_CACHE_DIR`` / ``TRITON_CACHE_DIR``, then again on them for a
warm compile). Prints JSON: the first compiled call's seconds, and the compiled output's max |difference| from the
same model's eager output. A prototype, not the library's behaviour (only calls without lengths or ``return_lse`` and
with plain tensors cross the boundary; the traced race of unmasked calls would run on fake tensors).
"""

import argparse
import importlib
import inspect
import json
import pathlib
import time

import torch
from host_profile import _bench_models  # (this directory: the script's own)


def install_boundary() -> dict:
    import elsa_surgery
    from elsa_surgery import api

    orig = api.attention
    seen = {}
    # nonstrict_trace takes tensors, ints, floats and bools (no None, no str): the options go as codes
    backends, precisions = ("auto", "elsa", "reference", "sdpa"), (None, "strict", "precise", "turbo")

    def run(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, backend, precision, windowed_mask):
        flag = torch.compiler._is_compiling_flag
        torch.compiler._is_compiling_flag = True
        try:
            seen.setdefault("is_compiling_inside", torch.compiler.is_compiling())
            return orig(q, k, v, attn_mask, dropout_p, is_causal, None if scale < 0 else scale, enable_gqa,
                        backend=backends[backend], precision=precisions[precision], windowed_mask=windowed_mask)
        finally:
            torch.compiler._is_compiling_flag = flag

    nonstrict = getattr(torch.compiler, "nonstrict_trace", None) or torch._dynamo.nonstrict_trace  # (torch 2.11)
    masked = nonstrict(lambda q, k, v, m, *rest: run(q, k, v, m, *rest))
    plain = nonstrict(lambda q, k, v, *rest: run(q, k, v, None, *rest))

    def attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, *,
                  backend="auto", precision=None, return_lse=False, q_lengths=None, kv_lengths=None,
                  windowed_mask=False):
        if (torch.compiler.is_compiling() and not return_lse and q_lengths is None and kv_lengths is None
                and (attn_mask is None or type(attn_mask) is torch.Tensor) and backend in backends
                and precision in precisions and (scale is None or isinstance(scale, (int, float)))):
            rest = (float(dropout_p), bool(is_causal), -1.0 if scale is None else float(scale), bool(enable_gqa),
                    backends.index(backend), precisions.index(precision), bool(windowed_mask))
            if attn_mask is None:
                return plain(q, k, v, *rest)
            return masked(q, k, v, attn_mask, *rest)
        return orig(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, backend=backend,
                    precision=precision, return_lse=return_lse, q_lengths=q_lengths, kv_lengths=kv_lengths,
                    windowed_mask=windowed_mask)

    api.attention = elsa_surgery.attention = attention
    import elsa_surgery.adapters as adapters_pkg

    for path in pathlib.Path(adapters_pkg.__file__).parent.glob("*.py"):  # adapters that imported the name
        mod = importlib.import_module(f"elsa_surgery.adapters.{path.stem}")
        if getattr(mod, "attention", None) is orig:
            mod.attention = attention
    return seen


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--side", choices=("native", "converted", "boundary"), required=True)
    ap.add_argument("--workload", default="swin_t")
    ap.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    ap.add_argument("--batch", type=int, default=8)
    a = ap.parse_args()
    import elsa_surgery

    bm = _bench_models()
    dtype = dict(fp32=torch.float32, bf16=torch.bfloat16)[a.dtype]
    model, call = bm.ab_build(a.workload, dtype, a.batch, "cuda")
    if a.side != "native":
        elsa_surgery.convert(model, verify=False)
    seen = install_boundary() if a.side == "boundary" else {}
    with torch.inference_mode():
        ref = call(model)
        torch.cuda.synchronize()
        bm.warm_up_compiler(argparse.Namespace(compile_backend="inductor", cpu_smoke=False), "cuda")
        compiled = torch.compile(model)
        t0 = time.perf_counter()
        out = call(compiled)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
    diff = float((out.float() - ref.float()).abs().max())
    print(json.dumps({"side": a.side, "workload": a.workload, "dtype": a.dtype, "compile_s": seconds,
                      "max_abs_diff_vs_eager": diff, **seen,
                      "is_compiling_src": " ".join(inspect.getsource(torch.compiler.is_compiling).split()[-6:])}),
          flush=True)


if __name__ == "__main__":
    main()
