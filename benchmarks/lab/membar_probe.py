"""Lab: What do the CTA barriers Triton 3.6 puts around the Hopper kernel's mbarrier and TMA operations cost?
Answered in docs/perf/history.md, section "Version 17". A one-off investigation, not a recipe.

What do the CTA barriers that Triton 3.6 puts around the mbarrier and TMA operations of the Hopper kernel's key
loop cost? A measurement, not a fix.

    python benchmarks/lab/membar_probe.py                          # bf16 1x32xNx128, N = 1K/4K/16K, against cuDNN

Triton 3.6's shared-memory barrier analysis treats mbarrier waits, ``expect`` and TMA copies as ordinary reads and
writes of shared memory, so the fp16/bf16 kernel's loop (``kernels/hopper._elsa_fwd_sm90``) holds four
``bar.sync`` a key tile: before the wait on the tile's mbarrier ("top"), before the refill's ``expect`` (the one
the schedule needs: both warpgroups must be done reading the stage before TMA overwrites it), and before each of the
two TMA copies ("tma"). The hardware orders mbarrier operations itself, so "top" and "tma" are not needed.

The recipe compiles the kernel once with Triton's IR dump on, removes the "top" and "tma" barriers from the loop's
PTX, and times ``recipes/bench_attention.py`` with the original kernel and with the edited one
(``TRITON_KERNEL_OVERRIDE``), each in a fresh process with its own kernel cache; the bench checks the output against
float64 too. fp16 cells are not edited: they are the run-to-run control. Needs an sm_90 GPU and Triton 3.6 (the
dump and override knobs). Measured (docs/perf/history.md, v17): no change.
"""

from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
KERNEL = "_elsa_fwd_sm90"


def classify(lines, start, end):
    """``{line index: kind}`` of the ``bar.sync`` lines of the loop body ``lines[start:end]``."""
    kinds = {}
    for i in range(start, end):
        if lines[i].strip() != "bar.sync \t0;":
            continue
        ahead = "\n".join(lines[i + 1:i + 9])
        if "mbarrier.try_wait" in ahead:
            kinds[i] = "top"
        elif "mbarrier.arrive.expect_tx" in "\n".join(lines[i + 1:i + 4]):
            kinds[i] = "needed"
        elif "cp.async.bulk.tensor" in ahead:
            kinds[i] = "tma"
        else:
            kinds[i] = "other"
    return kinds


def edit(dump, override):
    """Copies the dumped PTX of the kernel into ``override`` without the loop's "top" and "tma" barriers."""
    paths = glob.glob(os.path.join(dump, "*", f"{KERNEL}.ptx"))
    if not paths:
        raise SystemExit(f"no {KERNEL}.ptx under {dump}: did the call take the Hopper kernel?")
    for path in paths:
        lines = open(path).read().split("\n")
        start = next(i for i, line in enumerate(lines) if "Inner Loop Header" in line)
        end = next(i for i in range(start, len(lines)) if "%._crit_edge" in lines[i])
        kinds = classify(lines, start, end)
        drop = {i for i, kind in kinds.items() if kind in ("top", "tma")}
        print(f"{os.path.basename(os.path.dirname(path))}: loop barriers {sorted(kinds.values())}, removed {len(drop)}")
        out_dir = os.path.join(override, os.path.basename(os.path.dirname(path)))
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, f"{KERNEL}.ptx"), "w") as f:
            f.write("\n".join("\t// bar.sync removed" if i in drop else line for i, line in enumerate(lines)))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", default="1024,4096,16384")
    a = ap.parse_args(argv)
    tmp = tempfile.mkdtemp(prefix="membar_probe_")
    dump, override = os.path.join(tmp, "dump"), os.path.join(tmp, "override")
    env = {**os.environ, "TRITON_CACHE_DIR": os.path.join(tmp, "cache0"), "TRITON_KERNEL_DUMP": "1",
           "TRITON_DUMP_DIR": dump}
    call = ("import torch, elsa_surgery\n"
            "q, k, v = (torch.randn(1, 32, 1024, 128, device='cuda', dtype=torch.bfloat16) for _ in range(3))\n"
            "elsa_surgery.attention(q, k, v, backend='elsa'); torch.cuda.synchronize()\n")
    subprocess.run([sys.executable, "-c", call], env=env, check=True, cwd=tmp)  # not the checkout's package dir
    edit(dump, override)
    bench = [sys.executable, os.path.join(HERE, "bench_attention.py"), "--no-varlen", "--dtypes", "bf16,fp16",
             "--n", a.n, "--shapes", "32x128", "--causal", "0", "--baselines", "cudnn", "--graph"]
    for name, extra in (("original", {}), ("top and tma barriers removed (bf16 only)",
                                          {"TRITON_KERNEL_OVERRIDE": "1", "TRITON_OVERRIDE_DIR": override})):
        print(f"== {name}", flush=True)
        env = {**os.environ, "TRITON_CACHE_DIR": os.path.join(tmp, f"cache_{len(extra)}"), **extra}
        out = subprocess.run(bench, env=env, capture_output=True, text=True)
        lines = (out.stdout + out.stderr).splitlines()
        print("\n".join(line for line in lines if "N=" in line or "Overriding" in line))
        if out.returncode:
            print(out.stderr[-2000:])


if __name__ == "__main__":
    main()
