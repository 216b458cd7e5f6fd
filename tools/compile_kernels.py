"""Compile the portable Triton kernels for a GPU without one: Triton's own compiler, from the kernels' source to PTX
for sm_90 (no launch, no driver), for the variants the interpreter cannot vouch for (its semantics are Python's; the
compiler's type rules, loop-carried values and layouts are not checked there). Session 27: written to check the
backward's full-tile loops and the forward's ``BLOCKED_PV`` before any GPU saw them. Also strict's Gluon backward
(kernels/hopper_backward.py, :func:`gluon_variants`), whose code the interpreter cannot run at all.

Run with the interpreter off (``TRITON_INTERPRET`` unset): ``python tools/compile_kernels.py [--ptxas]``. Prints one
line per variant and exits 1 if any fails to compile. ``--ptxas``: also assemble each with Triton's bundled ptxas and
print its register count. Exit 3 when this Triton cannot compile for CUDA here (no NVIDIA backend, another
``ASTSource`` API): tests/test_kernels_compile.py then skips, naming why.

Against another Triton (the device machine's is 3.6, older than pip's here: session 59's kernel compiled here and
failed there): ``bash tools/compile_other_triton.sh 3.6.0``.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_PTR_DTYPES = {"LSE": "*fp32", "DELTA": "*fp32", "DQ": "*fp32", "DS": "*fp32", "RES": "*fp32", "PM": "*fp32",
               "PS": "*fp32", "PW": "*fp32", "KI": "*fp32", "VI": "*fp32", "QLEN": "*i32", "KVLEN": "*i32",
               "CUQ": "*i32", "CUK": "*i32", "SEED": "*i64", "RANGES": "*i32", "CLS": "*i8",
               "COUNT": "*i32"}
_DATA = ("Q", "K", "V", "MASK", "DO", "OUT", "DK", "DV", "KL", "VL")
_FLOATS = {"qk_scale", "scale", "p_drop", "keep_scale"}


def _signature(fn, data_dtype: str) -> dict:
    sig = {}
    for p in fn.params:
        if p.is_constexpr:
            sig[p.name] = "constexpr"
        elif p.name in _DATA:
            sig[p.name] = "*" + data_dtype
        elif p.name in _PTR_DTYPES:
            sig[p.name] = _PTR_DTYPES[p.name]
        elif p.name in _FLOATS:
            sig[p.name] = "fp32"
        else:
            sig[p.name] = "i32"
    return sig


def variants():
    """(name, kernel, data dtype, constexprs, num_warps or the launch's options)."""
    from elsa_surgery.kernels import backward, backward_launch, scan
    from elsa_surgery.kernels import occupancy as occ

    fwd = dict(D=64, DV=64, BLOCK_D=64, BLOCK_DV=64, BLOCK_M=128, BLOCK_N=64, MASK_KIND=0, HAS_QLEN=False,
               HAS_KVLEN=False, VARLEN=False, WRITE_LSE=True, CHUNKED=0, PACK=False, HAS_RANGES=False)
    for dot, blocked, state in itertools.product((0, 2), (False, True), (False, True)):
        dtype = "bf16" if dot == 0 else "fp32"
        yield (f"elsa_fwd dot={dot} blocked_pv={blocked} state={state}", scan.elsa_fwd, dtype,
               dict(fwd, IS_CAUSAL=True, DOT=dot, WRITE_STATE=state, BLOCKED_PV=blocked), 8)
    yield ("elsa_fwd dot=1 (strict) state=True", scan.elsa_fwd, "fp32",
           dict(fwd, IS_CAUSAL=True, DOT=1, WRITE_STATE=True, BLOCKED_PV=False), 8)
    # packed decode, phase 2 fused (FUSE_MERGE) and not
    for d, causal, qlen, fm in ((64, False, False, 8), (128, True, True, 8), (128, True, True, 0)):
        cfg = occ.decode_tile_config(d, d, 4)  # the packed kernel's tiles and options (4 rows a K/V head)
        yield (f"elsa_fwd pack fused merge={fm} D={d}", scan.elsa_fwd, "bf16",
               dict(fwd, D=d, DV=d, BLOCK_D=d, BLOCK_DV=d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                    IS_CAUSAL=causal, HAS_QLEN=qlen, HAS_KVLEN=qlen, DOT=0, WRITE_STATE=True, BLOCKED_PV=False,
                    PACK=True, FUSE_MERGE=fm, MERGE_M=4),
               dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
    for kind in (1, 2):  # the mask's tile ranges (scan.mask_tile_classes, mask_tile_ranges)
        yield (f"elsa_fwd mask={kind} ranges", scan.elsa_fwd, "bf16",
               dict(fwd, MASK_KIND=kind, IS_CAUSAL=True, DOT=0, WRITE_STATE=False, BLOCKED_PV=False,
                    HAS_RANGES=True), 8)
        yield (f"mask_tile_classes mask={kind}", scan.mask_tile_classes, "bf16" if kind == 2 else "u8",
               dict(BLOCK_M=128, BLOCK_N=64, MASK_KIND=kind), 4)
    yield ("mask_tile_ranges", scan.mask_tile_ranges, "bf16", dict(CHUNK=64), 4)
    bm, bn, warps, stages = backward_launch._blocks(64)  # the backward's tile at 2-byte D = 64
    bwd_options = dict(num_warps=warps, num_stages=stages)
    bwd = dict(D=64, DV_=64, BLOCK_D=64, BLOCK_DV=64, BLOCK_M=bm, BLOCK_N=bn, HAS_QLEN=False, HAS_KVLEN=False,
               VARLEN=False, DOT=0, HAS_RANGES=False)
    for keys_major, causal, mask in itertools.product((False, True), (False, True), (0, 2)):
        yield (f"bwd_kv keys_major={keys_major} causal={causal} mask={mask}", backward.bwd_kv, "bf16",
               dict(bwd, MASK_KIND=mask, IS_CAUSAL=causal, DROPOUT=mask == 2, ATOMIC_DQ=True, WRITE_DS=mask == 2,
                    KEYS_MAJOR=keys_major), bwd_options)
    for what, causal in itertools.product((0, 1), (False, True)):
        yield (f"row_pass what={what} causal={causal}", backward.row_pass, "bf16",
               dict(bwd, MASK_KIND=0, IS_CAUSAL=causal, DROPOUT=what == 1, WHAT=what), bwd_options)
    for keys_major in (False, True):
        yield (f"bwd_kv keys_major={keys_major} mask=1 ranges", backward.bwd_kv, "bf16",
               dict(bwd, MASK_KIND=1, IS_CAUSAL=True, DROPOUT=False, ATOMIC_DQ=False, WRITE_DS=False,
                    KEYS_MAJOR=keys_major, HAS_RANGES=True), bwd_options)
    yield ("row_pass what=0 mask=2 ranges", backward.row_pass, "bf16",
           dict(bwd, MASK_KIND=2, IS_CAUSAL=True, DROPOUT=False, WHAT=0, HAS_RANGES=True), bwd_options)


def gluon_variants():
    """(name, Gluon kernel, {descriptor argument: block rows, cols}, constexprs, num_warps): strict's backward on
    Hopper (kernels/hopper_backward.py), fp32, at its default tiles (the kv pass with atomic dQ where causal)."""
    from elsa_surgery.kernels import hopper_backward as hb

    if hb.gluon is None:
        return
    for d, dv, causal in ((64, 64, True), (128, 128, False), (16, 32, True)):
        (kn, km, ks, kw), (qm, qn, qs, qw) = hb.tiles(d, dv)
        yield (f"gluon strict_bwd_kv D={d} Dv={dv} causal={causal}", hb._strict_bwd_kv,
               dict(q_desc=(km, d), do_desc=(km, dv), k_desc=(kn, d), v_desc=(kn, dv)),
               dict(BLOCK_N=kn, BLOCK_M=km, HEAD_D=d, HEAD_DV=dv, STAGES=ks, IS_CAUSAL=causal, ATOMIC_DQ=causal),
               kw)
        yield (f"gluon strict_bwd_dq D={d} Dv={dv} causal={causal}", hb._strict_bwd_dq,
               dict(q_desc=(qm, d), do_desc=(qm, dv), k_desc=(qn, d), v_desc=(qn, dv)),
               dict(BLOCK_M=qm, BLOCK_N=qn, HEAD_D=d, HEAD_DV=dv, STAGES=qs, IS_CAUSAL=causal), qw)

    def lowp(bn, bm, st, d, causal, dq_tma):  # the fp16/bf16 kernels' descriptors and shared constexprs
        return (dict(q_desc=(bm, d, "bf16"), do_desc=(bm, d, "bf16"), k_desc=(bn, d, "bf16"),
                     v_desc=(bn, d, "bf16"), dq_desc=(bm, d)),
                dict(BLOCK_N=bn, BLOCK_M=bm, HEAD_D=d, HEAD_DV=d, STAGES=st, IS_CAUSAL=causal, DQ_TMA=dq_tma))

    bn, bm, st, w = hb.LOWP_TILES
    for d, causal, dq_tma, overlap in ((128, False, True, False), (128, True, False, False), (64, True, True, False),
                                       (64, False, False, True), (128, True, False, True)):
        if dq_tma and not hb.dq_tma_available():
            continue
        descs, const = lowp(bn, bm, st, d, causal, dq_tma)
        yield (f"gluon lowp_bwd D={d} causal={causal} dq_tma={dq_tma} overlap={overlap}", hb._lowp_bwd, descs,
               dict(const, OVERLAP=overlap), w)
    for d, causal in ((64, False), (128, True)):  # warp-specialised, at the tiles the launcher takes
        bn, bm, st, w = hb.lowp_tiles("ws", d, d)
        descs, const = lowp(bn, bm, st, d, causal, False)
        yield (f"gluon lowp_bwd_ws D={d} causal={causal} dq_tma=False tiles={bn}x{bm}/{w}", hb._lowp_bwd_ws, descs,
               dict(const, DQ_REGS=hb.WS_DQ_REGS, NC=1, COMPUTE_REGS=0), dict(num_warps=w, maxnreg=hb.ws_maxnreg(w)))
    for d, causal in ((64, False), (64, True), (32, False), (128, False), (128, True)):  # two compute partitions
        bn, bm, st, w = hb.lowp_tiles("ws2", d, d)
        descs, const = lowp(bn, bm, st, d, causal, False)
        yield (f"gluon lowp_bwd_ws2 D={d} causal={causal} dq_tma=False", hb._lowp_bwd_ws, descs,
               dict(const, NC=2, **dict(zip(("COMPUTE_REGS", "DQ_REGS"), hb.ws2_regs(d, d)))),
               dict(num_warps=4, maxnreg=hb.ws_maxnreg(8)))


def gluon_source(fn, descs: dict, const: dict, warps):
    """Gluon's ``GluonASTSource`` of ``fn``: TMA descriptors ``[1, 1, rows, cols]`` for ``descs`` (fp32, or the
    dtype named third: ``(rows, cols, "bf16")``), fp32 pointers for ``*_ptr``, fp32 ``qk_scale``/``scale``, int32 for
    the rest."""
    import torch
    import triton.runtime.jit as jit
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    sig = {}
    for p in fn.params:
        if p.is_constexpr:
            sig[p.name] = "constexpr"
        elif p.name in descs:
            rows, cols, *name = descs[p.name]
            block = [1, 1, rows, cols]
            tdt, gdt = {"fp32": (torch.float32, gl.float32), "bf16": (torch.bfloat16, gl.bfloat16)}[
                name[0] if name else "fp32"]
            t = torch.empty(block, dtype=tdt)
            layout = gl.NVMMASharedLayout.get_default_for(block, gdt)
            sig[p.name] = jit.mangle_type(TensorDescriptor(t, list(t.shape), list(t.stride()), block, layout))
        elif p.name.endswith("_ptr"):
            sig[p.name] = "*fp32"
        else:
            sig[p.name] = "fp32" if p.name in _FLOATS else "i32"
    const = dict(const, num_warps=warps["num_warps"] if isinstance(warps, dict) else warps)
    return GluonASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in const.items()})


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ptxas", action="store_true", help="assemble with Triton's ptxas and print registers")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "") not in ("", "0"):
        print("run with TRITON_INTERPRET unset: the interpreter replaces the compiler", file=sys.stderr)
        return 2
    if importlib.util.find_spec("elsa_surgery") is None:  # a checkout without an install or a mapped path
        sys.path.insert(0, str(ROOT))
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler import ASTSource  # noqa: F401
    except Exception as e:  # pragma: no cover - depends on the installed Triton
        print(f"skip: this Triton cannot compile for CUDA here ({type(e).__name__}: {e})")
        return 3
    failed = 0
    ptx = {}
    gluon = []
    try:
        gluon = list(gluon_variants())
    except ImportError as e:  # pragma: no cover - a Triton without Gluon's Hopper API
        print(f"no Gluon kernels compiled: {e}")
    for name, fn, dtype, const, warps in list(variants()) + gluon:
        try:
            src = gluon_source(fn, dtype, const, warps) if isinstance(dtype, dict) else source(fn, dtype, const)
        except TypeError as e:  # pragma: no cover - another Triton's ASTSource
            print(f"skip: this Triton's ASTSource takes other arguments ({e})")
            return 3
        try:
            ptx[name] = compile_source(src, warps)
        except Exception as e:
            failed += 1
            print(f"FAIL {name}: {type(e).__name__}: {str(e)[:2000]}", flush=True)
            continue
        extra = ""
        if args.ptxas:
            regs, spills, serial = assemble(ptx[name])
            extra = f"  ({regs} registers, {spills} bytes of spill stores{'; ptxas: ' + serial if serial else ''})"
        print(f"ok   {name}: {len(ptx[name])} bytes of PTX{extra}", flush=True)
    # BLOCKED_PV must survive Triton's combiner (which folds ``acc + tl.dot(a, b, 0)`` into ``tl.dot(a, b, acc)``):
    # its PTX has the blocks' fp32 adds that the tensor cores' chain has not
    for name in [n for n in ptx if "blocked_pv=True" in n]:
        extra = fp32_adds(ptx[name]) - fp32_adds(ptx[name.replace("blocked_pv=True", "blocked_pv=False")])
        if extra < 16:
            failed += 1
            print(f"FAIL {name}: {extra} more fp32 adds than without BLOCKED_PV (the compiler folded them away)")
    return 1 if failed else 0


# The unit strides of a launch's contiguous operands (the head dim of q, k, v, out and their gradients; the last dim of
# lse, the mask and dS), which Triton specialises into the constant 1, and the other strides of the operands whose
# rows are whole heads (a multiple of 16 for the head dims the variants take)
_UNIT_STRIDES = re.compile(r"stride_(q|k|v|o|dq|dk|dv|do|r)d|stride_(l|m|s)n")
_ALIGNED_STRIDES = re.compile(r"stride_(q|k|v|o|dq|dk|dv|do|ki|vi)[bhn]")


def _launch_like(fn, sig: dict, const: dict):
    """``(signature, constexprs, attrs)`` of ``fn`` specialised as a launch on contiguous, 16-byte-aligned tensors
    would be (Triton's launch-time specialisation): every pointer and the operands' other strides divisible by 16
    (``tt.divisibility``; ``_ALIGNED_STRIDES``), the unit strides constant 1. Without it the compiler cannot
    vectorise a load, and the register counts ``--ptxas`` printed were those of scalar loads (session 66: the packed
    decode kernel at D = 128, 255 registers and 468 bytes of spills unspecialised, 128 and none as launched).
    Arguments the kernel marks ``do_not_specialize`` stay plain i32."""
    sig, const, attrs = dict(sig), dict(const), {}
    plain = {p.name for p in fn.params if getattr(p, "do_not_specialize", False)}
    for i, name in enumerate(fn.arg_names):
        kind = sig.get(name)
        if name in const or name in plain or kind == "constexpr":
            continue
        if _UNIT_STRIDES.fullmatch(name):
            sig[name], const[name] = "constexpr", 1
        elif kind.startswith("*") or (kind == "i32" and _ALIGNED_STRIDES.fullmatch(name)):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, const, attrs


def source(fn, dtype: str, const: dict):
    """Triton's ``ASTSource`` of ``fn`` with data pointers of ``dtype`` and the constexprs ``const``, specialised as a
    launch on contiguous aligned tensors (:func:`_launch_like`)."""
    from triton.compiler import ASTSource

    sig, const, attrs = _launch_like(fn, _signature(fn, dtype), const)
    return ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in const.items()},
                     attrs=attrs)


def compile_source(src, warps) -> str:
    """``src`` compiled to PTX for sm_90 (Triton's compiler, no GPU needed); ``warps``: the warps, or the compile
    options (a dict with ``num_warps``)."""
    import triton
    from triton.backends.compiler import GPUTarget

    options = warps if isinstance(warps, dict) else {"num_warps": warps}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]


def compile_ptx(fn, dtype: str, const: dict, warps: int) -> str:
    """``fn`` compiled to PTX for sm_90."""
    return compile_source(source(fn, dtype, const), warps)


def assemble(ptx: str):
    """(registers, bytes of spill stores, ptxas's warning that it serialised wgmma instructions or '') of ``ptx``
    assembled for sm_90a by Triton's bundled ptxas."""
    import re

    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(90)
    ptxas = getattr(ptxas, "path", ptxas)
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "k.ptx"
        src.write_text(ptx)
        r = subprocess.run([ptxas, "-arch=sm_90a", "-v", str(src), "-o", str(Path(d) / "k.cubin")],
                           capture_output=True, text=True)
    regs = re.findall(r"Used (\d+) registers", r.stderr)
    spills = re.findall(r"(\d+) bytes spill stores", r.stderr)
    if not regs:
        raise RuntimeError(f"ptxas: {r.stderr[-500:]}")
    serial = next((ln.split("ptxas", 1)[-1].strip(" :") for ln in r.stderr.splitlines() if "serialized" in ln), "")
    return int(regs[-1]), int(spills[-1]) if spills else 0, serial


def fp32_adds(ptx: str) -> int:
    """fp32 add and fma instructions in ``ptx`` (predicated ones too)."""
    n = 0
    for line in ptx.splitlines():
        words = line.split()
        op = words[1] if words and words[0].startswith("@") and len(words) > 1 else (words[0] if words else "")
        n += op in ("add.f32", "add.rn.f32", "fma.rn.f32")
    return n


if __name__ == "__main__":
    sys.exit(main())
