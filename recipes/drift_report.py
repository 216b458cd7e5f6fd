"""Drift of one backend against the float64 oracle, on the ELSA supplementary's scenarios.

    python recipes/drift_report.py --backend reference
    python recipes/drift_report.py --backend elsa --precision precise --device cuda
    python recipes/drift_report.py --backend elsa --dtype bf16 --device cuda --rows 1024 --json drift.json

Prints, for each scenario (regular n=1024, long n=8192, stress n=4096 with adversarial logits; long16k and long64k
on request: ``--scenarios regular,long,long16k,long64k``), the six
metrics' median / p95 / p99 / max over sampled query rows (argmax: the disagreement rate).
"""

import argparse
import json
import sys
import time

import torch

from elsa_surgery import parity
from elsa_surgery.table import format_table

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="auto", choices=["auto", "elsa", "reference", "sdpa"])
    ap.add_argument("--precision", default=None, choices=["strict", "precise", "turbo"])
    ap.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--scenarios", default="regular,long,stress")
    ap.add_argument("--rows", type=int, default=256, help="query rows sampled per scenario (all keys are kept)")
    ap.add_argument("--heads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the numbers to this file")
    a = ap.parse_args(argv)

    names = [s.strip() for s in a.scenarios.split(",") if s.strip()]
    unknown = [n for n in names if n not in parity.SCENARIOS]
    if unknown:
        ap.error(f"--scenarios: unknown {unknown}; choose from {sorted(parity.SCENARIOS)}")
    results, rows = {}, []
    for name in names:
        t0 = time.perf_counter()
        res = parity.scenario_drift(name, backend=a.backend, precision=a.precision, dtype=DTYPES[a.dtype],
                                    device=a.device, rows=a.rows, heads=a.heads, seed=a.seed)
        results[name] = res
        for metric in parity.METRICS:
            r = res[metric]
            if metric == "argmax":
                rows.append([name, "argmax disagreement", "", "", "", r["rate"]])
            else:
                rows.append([name, metric, r["median"], r["p95"], r["p99"], r["max"]])
        print(f"# {name}: {parity.SCENARIOS[name].description} ({time.perf_counter() - t0:.1f} s)", file=sys.stderr)
    print(f"backend={a.backend} precision={a.precision} dtype={a.dtype} device={a.device} rows={a.rows} heads={a.heads}")
    print(format_table(["scenario", "metric", "median", "p95", "p99", "max / rate"], rows))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
