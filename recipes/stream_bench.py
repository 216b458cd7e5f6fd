"""Stream-CQSA on ELSA states (``elsa_surgery.stream``): long causal attention with Q/K/V/O in host memory or on disk.

Modes (each prints one JSON line per measurement; docs/stream.md explains the method):

* ``target``: N tokens (default 8M) causal, B=1, H=8, D=64, bf16, Q/K/V/O host-resident (pinned), GPU capped at
  ``--budget`` (default 8 GiB; ``torch.cuda.set_per_process_memory_fraction`` makes the cap real, so an excess is an
  OOM that the guardrails handle). Reports the stream's TFLOP/s against the in-core ELSA kernel's on one task-sized
  tile on the device, and spot rows against float64.
* ``compare``: ``cqs`` vs ``blocks`` (and what ``auto`` predicts/picks) at the same budget.
* ``memory``: the planner's predicted peak vs the measured peak for several budgets; a PNG plot with ``--plot``
  (needs the ``plot`` extra: matplotlib; without it the points are saved and ``--plot-from`` draws them elsewhere).
* ``scaling``: the ``target`` run in this process (one GPU, with its in-core and float64 checks after the timed
  run), then the same run under ``torchrun --nproc-per-node
  --ranks`` (one GPU each, every GPU capped at ``--budget``); the ranks' output is compared with the one-GPU output
  bit for bit, and the aggregate throughputs give the scaling ratio; comm_share is the merge's time (collectives
  and copies) as a share of the run, wait_share the time a rank waited for the slower ones.
* ``drill``: a rank killed mid-run (``os._exit`` from the fault hook, checkpointing on): how long until the job
  fails and with what error, then the rerun resuming every rank's finished tasks, compared with one GPU's output.
* ``incore``: the in-core figure of ``target`` alone: the ELSA kernel on one ``--tile`` × ``--tile`` tile resident
  on the device (to set beside a ``scaling`` run's one-GPU stream TFLOP/s measured without it).
* ``slices``: a memory-mapped run (default 32M tokens, H=1) in resumable slices: each invocation runs at most
  ``--slice-seconds`` (or ``--max-tasks``) and checkpoints into ``--data-dir``; rerun the same command until it
  prints ``"finished": true`` with the spot-row check.

Under ``torchrun --nproc-per-node R ... --ranks R`` tasks are sharded over the ranks (NCCL on GPUs, gloo on CPU).

Examples::

    python recipes/stream_bench.py --mode target                       # 8M tokens, 8 GiB budget (H100: < 9 min)
    python recipes/stream_bench.py --mode memory --n 1M --budgets 1GiB,2GiB,4GiB --plot stream_memory.png
    python recipes/stream_bench.py --mode compare --n 1M --budget 2GiB
    python recipes/stream_bench.py --mode slices --n 32M --heads 1 --slice-seconds 480 --data-dir /tmp/s32m
    python recipes/stream_bench.py --device cpu --n 4096 --heads 2 --budget 8MiB --mode compare   # CPU smoke test
    python recipes/stream_bench.py --mode scaling --ranks 2                # 8M on 1 GPU, then on 2 (torchrun)
    python recipes/stream_bench.py --mode drill --ranks 2 --n 1M --budget 1GiB
    python recipes/stream_bench.py --device cpu --mode scaling --ranks 2 --n 4096 --heads 2 --budget 8MiB  # gloo
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch

from elsa_surgery import monoid, stream
from elsa_surgery.stream import faults

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
UNITS = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}


def size(text: str) -> int:
    """``8M`` -> 8 * 2**20, ``8GiB`` -> 8 * 2**30, ``4096`` -> 4096."""
    t = text.strip().lower()
    for unit in sorted(UNITS, key=len, reverse=True):
        if t.endswith(unit):
            return int(float(t[: -len(unit)]) * UNITS[unit])
    return int(t)


def emit(row: dict) -> None:
    """One JSON line in one write (ranks share torchrun's stdout: print's separate newline write interleaved
    them)."""
    sys.stdout.write(json.dumps(row) + "\n")
    sys.stdout.flush()


def host_inputs(args, device):
    """Pinned host Q/K/V, drawn on the device in chunks when it is a GPU (fast), else on the CPU."""
    shape = (1, args.heads, args.n, args.dim)
    out = []
    g = torch.Generator(device=device).manual_seed(0)
    for _ in range(3):
        t = torch.empty(shape, dtype=DTYPES[args.dtype], pin_memory=device.type == "cuda")
        fill_random(t, args, g, device)
        out.append(t)
    return out


def fill_random(t, args, g, device) -> None:
    """``t [1, H, N, D]`` (host or memory-mapped) filled with N(0, 1) draws made on ``device`` in chunks of
    :func:`scratch_bytes` fp32."""
    step = max(1, scratch_bytes(args) // (4 * args.heads * args.dim))
    for a in range(0, args.n, step):
        b = min(args.n, a + step)
        t[:, :, a:b].copy_(torch.randn((1, args.heads, b - a, args.dim), generator=g, device=device))


def scratch_bytes(args) -> int:
    """The bench's own device chunks (input draws, the spot rows' float64 keys and values): 64 MiB, or a sixteenth of
    the budget under a smaller cap (the allocator is capped at the budget; a 96 MiB budget ran out with 64 MiB chunks:
    the spot rows hold a key and a value chunk at once)."""
    return max(1 << 20, min(64 << 20, int(args.budget) // 16))


def spot_rows(q, k, v, out, rows, scale=None, device="cpu", chunk_bytes=64 << 20):
    """Max relative error of output rows (causal) against float64, keys in chunks folded with the public monoid."""
    worst = 0.0
    B, H, _, D = q.shape
    scale = D ** -0.5 if scale is None else scale
    step = max(1, chunk_bytes // (8 * H * D))  # keys a chunk: chunk_bytes of float64 K
    for r in rows:
        qr = q[:, :, r:r + 1].to(device, torch.float64)  # [B, H, 1, D]
        st = monoid.identity((B, H, 1), v.shape[-1], dtype=torch.float64, device=device)
        for a in range(0, r + 1, step):
            b = min(r + 1, a + step)
            s = qr @ k[:, :, a:b].to(device, torch.float64).transpose(-1, -2) * scale
            st = monoid.fold_scores(st, s, v[:, :, a:b].to(device, torch.float64))
        ref = monoid.finalize(st)[0][:, :, 0]
        got = out[:, :, r].to(device, torch.float64)
        worst = max(worst, float((got - ref).norm() / ref.norm()))
    return worst


def in_core_tflops(args, device, tile: int) -> float:
    """The ELSA kernel on one task-sized tile (tile x tile keys, non-causal) resident on the device."""
    from elsa_surgery import attention_state

    q, k, v = (torch.randn(1, args.heads, tile, args.dim, device=device, dtype=DTYPES[args.dtype]) for _ in range(3))
    attention_state(q, k, v)  # compile / warm up
    if device.type == "cuda":  # a task-sized call takes seconds: two timed calls, CUDA events
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(2):
            attention_state(q, k, v)
        end.record()
        end.synchronize()
        ms = start.elapsed_time(end) / 2
    else:
        t = time.perf_counter()
        attention_state(q, k, v)
        ms = (time.perf_counter() - t) * 1e3
    return 4.0 * args.heads * tile * tile * args.dim / (ms * 1e-3) / 1e12


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def run(args, q, k, v, schedule, budget, **kw):
    kill = args.exit_after is not None and _rank() == args.exit_rank
    if args.checkpoint_dir and "checkpoint_dir" not in kw:
        kw.update(checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        # the ranks start the timed call together: each rank's input draw and start-up end at different times (measured:
        # 2.4 s apart at 8M tokens), which is not the attention's time. NCCL creates its communicator at the first
        # collective: one all_reduce here, so that the job's one-time set-up is not counted in the call (as the
        # process's start is not)
        torch.distributed.barrier(group=stream.distributed.control())
        if torch.distributed.get_backend() == "nccl":
            torch.distributed.all_reduce(torch.zeros(1, device=args.device))
            torch.cuda.synchronize()
    t = time.perf_counter()
    with faults.inject(exit_after=args.exit_after) if kill else contextlib.nullcontext():
        out = stream.attention(q, k, v, is_causal=True, schedule=schedule, memory_budget=budget,
                               progress=args.progress, device=args.device, **kw)
    secs = time.perf_counter() - t
    rep = stream.last_report()
    row = {"schedule": rep.schedule, "settings": rep.settings, "n_cap": rep.n_cap, "budget": budget,
           "predicted_peak": rep.predicted_peak, "measured_peak": rep.measured_peak, "calibrated": rep.calibrated,
           "seconds": round(secs, 2), "stream_tflops": rep.tflops,
           # every rank's FLOPs over this rank's wall time: the job's throughput (the same as stream_tflops alone)
           "throughput_tflops": rep.plan_flops / secs / 1e12, "comm": rep.comm,
           # the merge's collectives and copies, and the wait for the slower ranks, as shares of this rank's run
           "comm_share": rep.comm.get("seconds", 0.0) / secs, "wait_share": rep.comm.get("wait_seconds", 0.0) / secs,
           "resumed": rep.resumed, "tasks_run": rep.tasks_run,
           "events": rep.events, "auto": rep.auto, "finished": rep.finished, "rank": rep.rank, "world": rep.world}
    return out, row


def compare(out, path) -> dict:
    """``out`` against the output saved at ``path`` (the one-GPU run): bit for bit, else how far (1M tokens at a
    time: fp32 copies of a whole 8M-token output would take ~17 GiB each)."""
    ref = torch.load(path, mmap=True)
    worst, differ = 0.0, 0
    for a in range(0, out.shape[2], 1 << 20):
        o, r = out[:, :, a:a + (1 << 20)], ref[:, :, a:a + (1 << 20)]
        worst = max(worst, (o.float() - r.float()).abs().max().item())
        differ += int((o != r).sum())
    return {"identical_to": str(path), "bit_identical": differ == 0 and not torch.isnan(out).any().item(),
            "max_abs_diff": worst, "differing_elements": differ}


def mode_target(args, device, budget):
    t = time.perf_counter()
    q, k, v = host_inputs(args, device)
    draw = time.perf_counter() - t
    out, row = run(args, q, k, v, args.schedule, budget)
    row["draw_seconds"] = round(draw, 1)  # the bench's own phases, outside the timed call
    lead = _rank() == 0  # the checks and files of rank 0 only
    if lead and args.in_core:
        tile = stream.last_report().task_tokens  # the in-core kernel on one task's size (a tile x tile call)
        row["in_core_tile"] = tile
        row["in_core_tflops"] = in_core_tflops(args, device, tile)
        row["ratio_vs_in_core"] = row["stream_tflops"] / row["in_core_tflops"]
    if lead and args.spot:
        rows = sorted({0, 1, args.n // 3, args.n // 2, args.n - 1})
        row["spot_rows"] = rows
        row["spot_max_rel_err_vs_fp64"] = spot_rows(q, k, v, out, rows, device=device,
                                                    chunk_bytes=scratch_bytes(args))
    if lead and args.save_out:
        t = time.perf_counter()
        torch.save(out, args.save_out)
        row["save_seconds"] = round(time.perf_counter() - t, 1)
    if lead and args.compare_to:
        t = time.perf_counter()
        row.update(compare(out, args.compare_to))
        row["compare_seconds"] = round(time.perf_counter() - t, 1)
    emit({"mode": "target", "n": args.n, "heads": args.heads, "dim": args.dim, "dtype": args.dtype, **row})
    return row


def _torchrun(args, extra, timeout=None):
    """This script under ``torchrun --standalone --nproc-per-node args.ranks`` (target mode, the same shape);
    returns (exit code, seconds, rank rows, stderr tail). ``--tokens``, not ``--n``: torchrun's parser rejects
    ``--n`` anywhere on its command line as an ambiguous prefix of its own options."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.ranks}",
           os.path.abspath(__file__), "--mode", "target", "--ranks", str(args.ranks), "--tokens", str(args.n),
           "--heads", str(args.heads), "--dim", str(args.dim), "--dtype", args.dtype, "--budget", str(args.budget),
           "--schedule", args.schedule, "--device", torch.device(args.device).type, "--timeout", str(args.timeout),
           "--no-progress", "--no-in-core", "--no-spot", *extra] + (["--no-enforce"] if args.no_enforce else [])
    # torchrun sets OMP_NUM_THREADS=1 unless it is set: the ranks' host-side gathers and finalize would then run on
    # one core each (measured: 2 ranks slower than 1 process on an H200 pair); give each rank its share of the cores
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS",
                                                           str(max(1, (os.cpu_count() or 1) // args.ranks)))}
    t = time.perf_counter()
    # its own session: on a timeout the whole group goes (torchrun starts its workers in new sessions of their own,
    # so they are named by the agent's children; killing the group takes the agent, which then stops them)
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         start_new_session=True)
    try:
        stdout, stderr = p.communicate(timeout=timeout)
        rc = p.returncode
    except subprocess.TimeoutExpired:
        import signal

        for sig in (signal.SIGTERM, signal.SIGKILL):
            _kill_tree(p.pid, sig)
            time.sleep(2)
        stdout, stderr = p.communicate()
        rc = f"timed out after {timeout} s (process tree killed)"
    secs = time.perf_counter() - t
    rows = [json.loads(x) for x in stdout.splitlines() if x.startswith("{")]
    tail = [x for x in stderr.splitlines() if x.strip()][-12:]
    return rc, secs, sorted(rows, key=lambda r: r.get("rank", 0)), tail


def _kill_tree(pid: int, sig) -> None:
    """``sig`` to ``pid`` and every descendant (torchrun's workers run in sessions of their own)."""
    try:
        import psutil

        procs = psutil.Process(pid).children(recursive=True) + [psutil.Process(pid)]
    except Exception:  # psutil missing or the process gone: the agent's group at least
        procs = []
    for proc in procs:
        try:
            proc.send_signal(sig)
        except Exception:
            pass
    try:
        os.killpg(pid, sig)
    except Exception:
        pass


def _one_gpu_reference(args, device, budget, path):
    """The target mode's run in this process, its output saved at ``path`` for the ranks to compare with."""
    args.save_out = str(path)
    row = mode_target(args, device, budget)
    args.save_out = None
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def _reference_path(args, d: Path, name: str) -> Path:
    """Where the one-GPU output is saved for the ranks: RAM (/dev/shm) when it has twice the output's size free (the
    8M output is 8 GiB: written to and read back from a disk it cost more than the attention's merge), else
    ``d``."""
    import shutil

    nbytes = args.n * args.heads * args.dim * DTYPES[args.dtype].itemsize
    try:
        if shutil.disk_usage("/dev/shm").free > 2 * nbytes:
            return Path("/dev/shm") / f"stream_bench_{os.getpid()}_{name}"
    except OSError:
        pass
    return d / name


def mode_scaling(args, device, budget):
    d = Path(args.data_dir)
    d.mkdir(parents=True, exist_ok=True)
    ref = _reference_path(args, d, "one_gpu_out.pt")
    try:
        _scaling(args, device, budget, ref)
    finally:
        if str(ref).startswith("/dev/shm/"):
            ref.unlink(missing_ok=True)


def _scaling(args, device, budget, ref):
    one = _one_gpu_reference(args, device, budget, ref)  # timed alone; then its in-core and spot-row checks
    rc, secs, rows, tail = _torchrun(args, ["--compare-to", str(ref)])
    for r in rows:
        emit({**r, "mode": "scaling", "ranks": args.ranks})  # (the rank rows are target rows)
    if rc != 0 or not rows:
        emit({"mode": "scaling", "error": f"torchrun exited {rc}", "stderr_tail": tail})
        sys.exit(1)
    r0 = rows[0]
    emit({"mode": "scaling", "summary": True, "ranks": args.ranks, "n": args.n,
          "one_gpu_seconds": one["seconds"], "ranks_seconds": max(r["seconds"] for r in rows),
          "scaling": one["seconds"] / max(r["seconds"] for r in rows),
          "throughput_tflops": {"1": one["throughput_tflops"],
                                str(args.ranks): min(r["throughput_tflops"] for r in rows)},
          "comm_share": max(r["comm_share"] for r in rows), "wait_share": max(r["wait_share"] for r in rows),
          "merge": r0["comm"].get("merge"), "merge_bytes_per_rank": r0["comm"].get("bytes"),
          "bit_identical": r0.get("bit_identical"), "max_abs_diff": r0.get("max_abs_diff"),
          "torchrun_seconds": round(secs, 1), "reference_at": str(ref),
          "bench_phases": {"one_gpu": {x: one.get(x) for x in ("draw_seconds", "save_seconds")},
                           "rank0": {x: r0.get(x) for x in ("draw_seconds", "compare_seconds")}}})


def mode_drill(args, device, budget):
    d = Path(args.data_dir)
    d.mkdir(parents=True, exist_ok=True)
    ref, ck = d / "drill_ref.pt", d / "drill_ckpt"
    if ck.exists():
        import shutil

        shutil.rmtree(ck)
    args.spot = args.in_core = False
    one = _one_gpu_reference(args, device, budget, ref)
    kill_after = max(1, one["tasks_run"] // (2 * args.ranks))  # half of a rank's share
    common = ["--checkpoint-dir", str(ck), "--checkpoint-every", str(args.checkpoint_every)]
    rc, secs, rows, tail = _torchrun(args, common + ["--exit-rank", str(args.ranks - 1),
                                                     "--exit-after", str(kill_after)], timeout=args.timeout + 300)
    killed = {"mode": "drill", "phase": "killed", "exit_code": rc, "seconds_to_failure": round(secs, 1),
              "timeout_s": args.timeout, "killed_rank": args.ranks - 1, "after_tasks": kill_after,
              "stderr_tail": tail, "rows": rows}
    emit(killed)
    rc2, secs2, rows2, tail2 = _torchrun(args, common + ["--compare-to", str(ref)])
    emit({"mode": "drill", "phase": "rerun", "exit_code": rc2, "seconds": round(secs2, 1),
          "resumed": [r.get("resumed") for r in rows2], "tasks_run": [r.get("tasks_run") for r in rows2],
          "bit_identical": rows2[0].get("bit_identical") if rows2 else None, "stderr_tail": tail2 if rc2 else []})
    if rc == 0 or rc2 != 0 or not rows2 or not rows2[0].get("bit_identical") or not any(
            r.get("resumed") for r in rows2):
        sys.exit("drill: expected the killed run to fail and the rerun to resume finished tasks and match one GPU "
                 "bit for bit")


def mode_compare(args, device, budget):
    q, k, v = host_inputs(args, device)
    outs = {}
    for schedule in ("cqs", "blocks", "auto"):
        outs[schedule], row = run(args, q, k, v, schedule, budget)
        emit({"mode": "compare", "n": args.n, **row})
    diff = (outs["cqs"].float() - outs["blocks"].float()).abs().max().item()
    emit({"mode": "compare", "max_abs_diff_cqs_vs_blocks": diff})


def mode_memory(args, device, budgets):
    q, k, v = host_inputs(args, device)
    points = []
    for budget in budgets:
        _, row = run(args, q, k, v, args.schedule, budget)
        row["error_vs_measured"] = (None if not row["measured_peak"] else
                                    (row["predicted_peak"] - row["measured_peak"]) / row["measured_peak"])
        emit({"mode": "memory", "n": args.n, **row})
        points.append((budget, row["predicted_peak"], row["measured_peak"]))
    if args.plot:
        plot_memory(points, args.plot, f"stream.attention N={args.n} H={args.heads} D={args.dim} {args.dtype}")


def plot_memory(points, path, title) -> None:
    """``points``: (budget, predicted, measured) bytes. Without matplotlib (the ``plot`` extra; GPU machines may lack
    it) the points go to ``<path>.jsonl`` and ``--plot-from`` draws them later on a machine that has it."""
    try:
        import matplotlib  # the ``plot`` extra, imported only here
    except ImportError:
        rows = Path(str(path) + ".jsonl")
        rows.write_text("".join(json.dumps({"mode": "memory", "budget": b, "predicted_peak": p, "measured_peak": m,
                                            "title": title}) + "\n" for b, p, m in points))
        emit({"mode": "memory", "plot": None, "why": "matplotlib is not installed (pip install 'elsa-surgery[plot]')",
              "points": str(rows), "then": f"python recipes/stream_bench.py --plot-from {rows} --plot {path}"})
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gib = 1 << 30
    fig, ax = plt.subplots(figsize=(5, 4))
    xs = [b / gib for b, _, _ in points]
    ax.plot(xs, [p / gib for _, p, _ in points], "o-", label="predicted peak")
    measured = [(b / gib, m / gib) for b, _, m in points if m is not None]  # None: no device (CPU)
    if measured:
        ax.plot(*zip(*measured), "s--", label="measured peak")
    ax.plot(xs, xs, ":", color="gray", label="budget")
    ax.set_xlabel("memory_budget (GiB)")
    ax.set_ylabel("peak GPU memory (GiB)")
    import textwrap

    ax.set_title(textwrap.fill(title, 60), fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    emit({"mode": "memory", "plot": str(path)})


def mode_slices(args, device, budget):
    """Q/K/V and O as files mapped with torch.from_file (bf16 on disk); progress in <data-dir>/ckpt."""
    d = Path(args.data_dir)
    d.mkdir(parents=True, exist_ok=True)
    shape = (1, args.heads, args.n, args.dim)
    numel = math.prod(shape)
    dtype = DTYPES[args.dtype]
    maps = {}
    for name in ("q", "k", "v", "o"):
        path = d / f"{name}.bin"
        fresh = not path.exists()
        if fresh:
            with open(path, "wb") as f:
                f.truncate(numel * dtype.itemsize)
        maps[name] = torch.from_file(str(path), shared=True, size=numel, dtype=dtype).view(shape)
        if fresh and name != "o":
            fill_random(maps[name], args, torch.Generator(device=device).manual_seed(ord(name)), device)
    out, row = run(args, maps["q"], maps["k"], maps["v"], args.schedule, budget, out=maps["o"],
                   checkpoint_dir=str(d / "ckpt"), max_tasks=args.max_tasks, max_seconds=args.slice_seconds,
                   checkpoint_every=args.checkpoint_every)
    rep = stream.last_report()
    row.update({"tasks_done_total": rep.resumed + rep.tasks_run, "tasks_total": rep.tasks_total})
    if out is not None:
        rows = sorted({0, args.n // 2, args.n - 1})
        row["spot_rows"] = rows
        row["spot_max_rel_err_vs_fp64"] = spot_rows(maps["q"], maps["k"], maps["v"], out, rows, device=device,
                                                    chunk_bytes=scratch_bytes(args))
    emit({"mode": "slices", "n": args.n, **row})


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("target", "compare", "memory", "slices", "scaling", "drill", "incore"),
                   default="target")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--n", "--tokens", dest="n", type=size, default=None,
                   help="tokens (8M; 32M in slices mode); suffixes k/M")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    p.add_argument("--budget", type=size, default=8 << 30, help="memory_budget in bytes (suffixes MiB/GiB)")
    p.add_argument("--budgets", default="1GiB,2GiB,4GiB", help="memory mode: comma-separated budgets")
    p.add_argument("--schedule", choices=("cqs", "blocks", "auto"), default="auto")
    p.add_argument("--plot", default=None, help="memory mode: write the predicted-vs-measured PNG here")
    p.add_argument("--data-dir", default="/tmp/elsa_stream_slices", help="slices mode: files and checkpoint")
    p.add_argument("--slice-seconds", type=float, default=None, help="slices mode: stop after this long")
    p.add_argument("--max-tasks", type=int, default=None, help="slices mode: stop after this many tasks")
    p.add_argument("--checkpoint-every", type=float, default=None,
                   help="seconds between checkpoint saves (default 300; drill: 0, every flushed query row); each "
                   "writes the fp32 accumulators: 8 GiB at 32M, H=1")
    p.add_argument("--no-enforce", action="store_true", help="do not cap the allocator at the budget")
    p.add_argument("--ranks", type=int, default=1, help="target: run under torchrun with this many ranks; "
                   "scaling / drill: launch torchrun with this many")
    p.add_argument("--timeout", type=float, default=1800.0, help="the process group's timeout (s)")
    p.add_argument("--checkpoint-dir", default=None, help="target mode: a resumable run")
    p.add_argument("--save-out", default=None, help="target mode: torch.save the output here (rank 0)")
    p.add_argument("--compare-to", default=None, help="target mode: compare the output with one saved earlier")
    p.add_argument("--no-in-core", dest="in_core", action="store_false", help="target: skip the in-core timing")
    p.add_argument("--no-spot", dest="spot", action="store_false", help="target: skip the float64 spot rows")
    p.add_argument("--exit-rank", type=int, default=0, help="drills: the rank that --exit-after kills")
    p.add_argument("--exit-after", type=int, default=None,
                   help="drills: os._exit(17) on --exit-rank when it starts its (n+1)-th task")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    p.add_argument("--tile", type=size, default=1 << 20, help="incore mode: the tile's tokens (a task's size)")
    p.add_argument("--plot-from", default=None, help="draw --plot from memory-mode JSON lines saved earlier")
    args = p.parse_args(argv)
    if args.plot_from:
        rows = [json.loads(line) for line in Path(args.plot_from).read_text().splitlines() if line.startswith("{")]
        rows = [r for r in rows if r.get("mode") == "memory" and r.get("predicted_peak") is not None]
        plot_memory([(r["budget"], r["predicted_peak"], r["measured_peak"]) for r in rows], args.plot or "memory.png",
                    rows[0].get("title", "stream.attention memory model") if rows else "")
        return
    if args.n is None:
        args.n = (32 << 20) if args.mode == "slices" else (8 << 20)
    if args.checkpoint_every is None:  # the drill saves at every flushed query row: a kill must find saves
        args.checkpoint_every = 0.0 if args.mode == "drill" else 300.0
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:  # set_per_process_memory_fraction needs an index (2.11)
        device = torch.device("cuda", torch.cuda.current_device())
    if args.ranks > 1 and args.mode not in ("scaling", "drill"):
        import torch.distributed as dist

        if int(os.environ.get("WORLD_SIZE", "1")) != args.ranks:
            sys.exit(f"--ranks {args.ranks}: run under torchrun --nproc-per-node {args.ranks}")
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(device)
            args.device = str(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(seconds=args.timeout))
    if device.type == "cuda" and not args.no_enforce:
        total = torch.cuda.get_device_properties(device).total_memory
        cap = max(args.budget, *(size(b) for b in args.budgets.split(","))) if args.mode == "memory" else args.budget
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), device)
    if args.mode == "target":
        mode_target(args, device, args.budget)
    elif args.mode == "compare":
        mode_compare(args, device, args.budget)
    elif args.mode == "memory":
        mode_memory(args, device, [size(b) for b in args.budgets.split(",")])
    elif args.mode == "scaling":
        mode_scaling(args, device, args.budget)
    elif args.mode == "drill":
        mode_drill(args, device, args.budget)
    elif args.mode == "incore":  # the target mode's in-core figure alone (a task-sized tile resident on the GPU)
        emit({"mode": "incore", "tile": args.tile, "heads": args.heads, "dim": args.dim, "dtype": args.dtype,
              "in_core_tflops": in_core_tflops(args, device, args.tile)})
    else:
        mode_slices(args, device, args.budget)


if __name__ == "__main__":
    main()
