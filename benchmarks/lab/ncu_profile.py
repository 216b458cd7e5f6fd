"""Lab: Where does the time of the cells that miss their target go (pipes, issue slots, warp stalls), against SDPA on the same call?
Answered in docs/perf/history.md, section "Version 17". A one-off investigation, not a recipe.

Nsight Compute counters of ELSA's kernel against SDPA's on the same call: where the time of the cells that miss
their target goes (pipe utilisation, issue slots, warp stall reasons, occupancy).

    python benchmarks/lab/ncu_profile.py                         # bf16 / fp16 32x128 1K and 4K vs cuDNN, strict 1K vs ME
    python benchmarks/lab/ncu_profile.py --cells bf16:1x32x4096x128:0 --csv rows.csv

Each cell (``dtype:BxHxNxD:causal``) runs ``elsa_surgery.attention(..., backend="elsa")`` and the SDPA backend it
is compared with (cuDNN for fp16/bf16, memory-efficient for fp32), warmed up, then once each inside a profiler
range, each call after a marker kernel (``torch.cuda._sleep``) that tells whose kernels follow. The script runs
itself under ``ncu --clock-control none --profile-from-start off`` (the clocks are left alone, as the device
notes ask), with the metrics below that this ncu knows, and prints one row per kernel: duration, tensor / FMA /
ALU / MUFU (xu) pipe utilisation, issue slots busy, warps per scheduler, registers, shared memory, grid, and the
warp stall reasons (cycles per issued instruction, the largest first). Needs ncu on PATH and an NVIDIA GPU.
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import shutil
import subprocess
import sys

from elsa_surgery.kernels import knobs

CHILD = knobs.NCU_CHILD
CELLS = ("bf16:1x32x1024x128:0", "fp16:1x32x1024x128:0", "bf16:1x32x4096x128:0", "fp16:1x32x4096x128:0",
         "fp32-strict:1x32x1024x128:0")
DTYPES = {"bf16": ("bfloat16", None), "fp16": ("float16", None), "fp32-strict": ("float32", "strict"),
          "fp32-precise": ("float32", "precise"), "fp32-turbo": ("float32", "turbo")}
# (column, metric): ratios of two metrics are computed below, so that a pct_of_peak this ncu cannot give for a
# pipe (v8: n/a for gmma) does not leave the column empty
METRICS = {
    "us": "gpu__time_duration.sum",
    "cycles": "sm__cycles_elapsed.avg",
    "tensor_pct": "sm__pipe_tensor_cycles_active_realtime.avg.pct_of_peak_sustained_elapsed",
    "tensor_inst": "sm__inst_executed_pipe_tensor.sum",  # HMMA (ME-SDPA's sm80 kernels) and HGMMA
    "inst": "smsp__inst_executed.sum",
    "fma_pct": "sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active",
    "alu_pct": "sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active",
    "xu_pct": "sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active",
    "issue_pct": "smsp__issue_active.avg.pct_of_peak_sustained_active",
    "warps_per_sched": "smsp__warps_active.avg.per_cycle_active",
    # shared-memory data-stage wavefronts (one 128-byte access a cycle per SM): all, and those of wgmma operands
    "smem_wf": "l1tex__data_pipe_lsu_wavefronts_mem_shared.sum",
    "gmma_wf": "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_gmma.sum",
    "gmma_conflicts": "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_gmma.sum",
    "local_ld": "smsp__sass_inst_executed_op_local_ld.sum",
    "local_st": "smsp__sass_inst_executed_op_local_st.sum",
    "regs": "launch__registers_per_thread",
    "smem_kb": "launch__shared_mem_per_block",
    "grid": "launch__grid_size",
    "block": "launch__block_size",
}
STALLS = r"regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio"


def parse_cell(text):
    try:
        dname, shape, causal = text.split(":")
        b, h, n, d = (int(x) for x in shape.split("x"))
        if dname not in DTYPES or causal not in ("0", "1"):
            raise ValueError
    except ValueError:
        raise SystemExit(f"--cells: {text!r} is not dtype:BxHxNxD:causal with dtype in {sorted(DTYPES)} and "
                         "causal 0 or 1") from None
    return dname, (b, h, n, d), causal == "1"


def child(cells, ws=False):
    """Warm every call, then run each once after a marker kernel inside one profiler range. ``ws``: fp16/bf16
    cells also run the warp-specialised kernel of ``benchmarks/lab/gluon_ws_ceiling.py`` (plain, 128-key tiles)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import elsa_surgery

    calls = []
    for text in cells:
        dname, (B, H, N, D), causal = parse_cell(text)
        tname, prec = DTYPES[dname]
        dtype = getattr(torch, tname)
        q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=dtype) for _ in range(3))
        be = SDPBackend.EFFICIENT_ATTENTION if dtype == torch.float32 else SDPBackend.CUDNN_ATTENTION

        def elsa(q=q, k=k, v=v, causal=causal, prec=prec):
            return elsa_surgery.attention(q, k, v, is_causal=causal, backend="elsa", precision=prec)

        def sdpa(q=q, k=k, v=v, causal=causal, be=be):
            with sdpa_kernel([be]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

        calls += [(f"{text} elsa", elsa), (f"{text} sdpa-{be.name.split('_')[0].lower()}", sdpa)]
        if ws and prec is None:
            sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
            import gluon_ws_ceiling

            calls.append((f"{text} ws-plain", lambda q=q, k=k, v=v, causal=causal: gluon_ws_ceiling.ws_forward(
                q, k, v, scale=q.shape[-1] ** -0.5, is_causal=causal)))
    for _, fn in calls:
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for label, fn in calls:
        torch.cuda._sleep(1000)
        fn()
        print("CALL", label, flush=True)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def known_metrics(ncu):
    out = subprocess.run([ncu, "--query-metrics"], capture_output=True, text=True).stdout
    # names may carry a group prefix ("TPC.TriageCompute.sm__...")
    return {line.split()[0].split(".")[-1] for line in out.splitlines()
            if line and not line.startswith(("-", " ", "Device"))}


def number(text):
    try:
        return float(text.replace(",", ""))
    except (AttributeError, ValueError):
        return None


def report(rows, labels, sms):
    """One line per profiled kernel, grouped under the call that launched it (the marker kernels split them).
    ``sms``: the GPU's multiprocessors, for the shared-memory share (wavefronts over SM cycles)."""
    groups, current = [], None
    for row in rows:
        if "spin" in row["Kernel Name"].lower():
            current = []
            groups.append(current)
        elif current is not None:
            current.append(row)
    if len(groups) != len(labels):
        print(f"warning: {len(groups)} marker kernels for {len(labels)} calls; kernels listed without labels")
        labels = [f"call {i}" for i in range(len(groups))]
    out = []
    for label, kernels in zip(labels, groups):
        for row in kernels:
            m = {col: number(row.get(metric)) for col, metric in METRICS.items()}
            busy = m["cycles"] and sms * m["cycles"]  # SM cycles of the kernel, all SMs
            line = {"call": label, "kernel": row["Kernel Name"][:60], "us": m["us"] and m["us"] / 1e3,
                    "tensor_%": m["tensor_pct"], "tensor_inst": m["tensor_inst"], "inst": m["inst"],
                    "fma_%": m["fma_pct"], "alu_%": m["alu_pct"], "xu_%": m["xu_pct"],
                    "issue_%": m["issue_pct"], "warps/sched": m["warps_per_sched"],
                    "smem_%": m["smem_wf"] and busy and 100 * m["smem_wf"] / busy,
                    "gmma_smem_%": m["gmma_wf"] and busy and 100 * m["gmma_wf"] / busy,
                    "gmma_conflicts": m["gmma_conflicts"], "local_ld": m["local_ld"], "local_st": m["local_st"],
                    "regs": m["regs"], "smem_kb": m["smem_kb"] and m["smem_kb"] / 1024, "grid": m["grid"],
                    "block": m["block"]}
            stalls = {k.split("stalled_")[1].split("_per_issue")[0]: number(v) for k, v in row.items()
                      if "issue_stalled_" in k and number(v)}
            line["stalls"] = dict(sorted(stalls.items(), key=lambda kv: -kv[1])[:6])
            out.append(line)
            print(f"{label:34s} {line['kernel']:60s}", flush=True)
            print("    " + "  ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}"
                                     for k, v in line.items() if k not in ("call", "kernel", "stalls")))
            print("    stalls (warp cycles per issued instruction): "
                  + ", ".join(f"{k} {v:.2f}" for k, v in line["stalls"].items()))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cells", default=",".join(CELLS), help="comma list of dtype:BxHxNxD:causal")
    ap.add_argument("--csv", help="also write ncu's raw CSV here")
    ap.add_argument("--ncu", default=shutil.which("ncu") or "ncu")
    ap.add_argument("--ws", action="store_true", help="also profile benchmarks/lab/gluon_ws_ceiling.py's plain kernel")
    args = ap.parse_args(argv)
    cells = [c for c in args.cells.split(",") if c]
    for c in cells:
        parse_cell(c)
    if knobs.get(CHILD):
        return child(cells, ws=args.ws)
    if not shutil.which(args.ncu):
        raise SystemExit(f"--ncu: {args.ncu!r} not found (Nsight Compute's command line is needed)")
    known = known_metrics(args.ncu)
    wanted = [m for m in METRICS.values() if m.startswith("launch__") or m.split(".")[0] in known]
    missing = sorted(set(METRICS.values()) - set(wanted))
    if missing:
        print("this ncu lacks:", ", ".join(missing))
    cmd = [args.ncu, "--clock-control", "none", "--profile-from-start", "off", "--csv", "--page", "raw",
           "--print-units", "base",
           "--metrics", ",".join(wanted + [STALLS]), sys.executable, os.path.abspath(__file__), "--cells",
           ",".join(cells)] + (["--ws"] if args.ws else [])
    proc = subprocess.run(cmd, env={**os.environ, CHILD: "1"}, capture_output=True, text=True)
    labels = [line[5:] for line in proc.stdout.splitlines() if line.startswith("CALL ")]
    text = "\n".join(line for line in proc.stdout.splitlines() if line.startswith('"'))
    if proc.returncode or not text:
        print(proc.stdout[-4000:], proc.stderr[-4000:], sep="\n")
        raise SystemExit(f"ncu exited {proc.returncode}")
    if args.csv:
        with open(args.csv, "w") as f:
            f.write(text + "\n")
    table = list(csv.DictReader(io.StringIO(text)))
    import torch

    return report(table[1:], labels, torch.cuda.get_device_properties(0).multi_processor_count)


if __name__ == "__main__":
    main()
