"""Registers and spills of the backward kernels for each tile configuration, without a GPU: Triton's compiler to PTX
for sm_90 and Triton's bundled ptxas (``tools/compile_kernels.py``), bf16, causal, no mask, atomic dQ. Session 27's
output: docs/perf/raw/bwd_ptxas_spills_sm90_s27.jsonl (the default D = 64 tile, 64 x 64 with 4 warps, spilled in
bwd_kv; at D = 128 every tile of the backward sweep's former space did). Run with TRITON_INTERPRET unset:
``python benchmarks/lab/bwd_spills.py [--dims 64,128] > spills.jsonl`` (~10 min on 2 cores)."""

import argparse
import itertools
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "tools"), str(ROOT)]

import compile_kernels as ck  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dims", default="64,128")
    args = p.parse_args(argv)
    from elsa_surgery.kernels import backward as bw

    for d in (int(x) for x in args.dims.split(",")):
        for bm, bn, w in itertools.product((16, 32, 64, 128), (32, 64, 128), (4, 8)):
            base = dict(D=d, DV_=d, BLOCK_D=d, BLOCK_DV=d, BLOCK_M=bm, BLOCK_N=bn, HAS_QLEN=False, HAS_KVLEN=False,
                        VARLEN=False, DOT=0, MASK_KIND=0, IS_CAUSAL=True, DROPOUT=False)
            runs = [("bwd_kv", bw.bwd_kv, dict(base, ATOMIC_DQ=True, WRITE_DS=False, KEYS_MAJOR=km), km)
                    for km in (False, True)] + [("row_pass", bw.row_pass, dict(base, WHAT=0), None)]
            for name, fn, const, km in runs:
                try:
                    regs, spills = ck.assemble(ck.compile_ptx(fn, "bf16", const, w))
                    row = dict(registers=regs, spill_store_bytes=spills)
                except Exception as e:  # a configuration the compiler refuses
                    row = dict(error=f"{type(e).__name__}: {str(e)[:120]}")
                print(json.dumps(dict(kernel=name, D=d, bm=bm, bn=bn, w=w, keys_major=km, **row)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
