"""Measurement and output helpers shared by the benchmark recipes (``recipes/*.py``).

One timing method and one memory method for every recipe:

* **time**: ``warmup`` calls, then ``iters`` calls each timed on its own — CUDA events recorded around
  the call on a GPU, ``time.perf_counter`` on the CPU — and the **median** in milliseconds;
* **peak memory**: ``torch.cuda.max_memory_allocated`` over the measured block minus what was allocated
  when it started (after ``torch.cuda.reset_peak_memory_stats``), in MiB; ``None`` on the CPU. Also the
  same peak in *requested* bytes (the sizes the tensors asked for): the allocated figure counts whole
  allocator blocks, and a block may be up to 1 MiB larger than its tensor depending on which cached
  blocks happened to be free, so two runs holding the same tensors can differ by some KiB there; and the
  peak *reserved* from the GPU (the process's footprint: what has to fit), from an emptied cache.

:func:`measure_modes` measures one model native and then converted in each mode, a row each. Also: the
dispatch summary of a :func:`elsa_surgery.dispatch.record` log, the environment record, :func:`environ` (knobs
set inside a block), the native /
converted mode list, comma-list arguments, JSON output and the latency / memory plot.

Needs only torch (matplotlib is imported by :func:`plot_time_memory` when called); never imported by
``import elsa_surgery``.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import sys
import time
from collections import Counter
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from .dispatch import record
from .surgery import convert, revert

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# --------------------------------------------------------------------------------------------------
# timing and memory
# --------------------------------------------------------------------------------------------------

_REQUESTED = "requested_bytes.all"


class PeakMemory:
    """``with PeakMemory(device) as mem: ...`` then ``mem.mib``: the peak memory allocated inside the block
    beyond what was live when it started (MiB); ``mem.requested_mib``: the same in requested bytes
    (allocator block rounding excluded; ``None`` where the allocator does not count them);
    ``mem.reserved_mib``: the peak reserved from the GPU beyond what the emptied cache held at the start.
    All ``None`` on a non-CUDA device."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.mib: Optional[float] = None
        self.requested_mib: Optional[float] = None
        self.reserved_mib: Optional[float] = None
        self._base = self._reserved_base = 0
        self._requested_base: Optional[int] = None

    def __enter__(self) -> "PeakMemory":
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            self._base = torch.cuda.memory_allocated(self.device)
            self._requested_base = torch.cuda.memory_stats(self.device).get(_REQUESTED + ".current")
            self._reserved_base = torch.cuda.memory_reserved(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        return self

    def __exit__(self, *exc) -> bool:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.mib = (torch.cuda.max_memory_allocated(self.device) - self._base) / 2**20
            self.reserved_mib = (torch.cuda.max_memory_reserved(self.device) - self._reserved_base) / 2**20
            peak = torch.cuda.memory_stats(self.device).get(_REQUESTED + ".peak")
            if peak is not None and self._requested_base is not None:
                self.requested_mib = (peak - self._requested_base) / 2**20
        return False


def cuda_graph(fn: Callable[[], object], warmup: int = 1) -> Callable[[], object]:
    """``fn()`` captured in a CUDA graph: returns ``replay()``, which reruns the graph and returns the output
    tensors of the captured call.

    ``warmup`` calls run first on a side stream (kernel compilation, library workspaces), as capture
    requires. The returned callable holds ``fn`` and the graph, and with ``fn`` every tensor it reads: the
    memory a replay reads and writes stays allocated for as long as ``replay`` lives (a graph whose static
    input had been freed, then unmapped by ``empty_cache()``, read unmapped memory on the next replay).
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()

    def replay():
        graph.replay()
        return out

    replay.graph, replay.captured = graph, fn  # explicit keep-alive of the graph's inputs
    return replay


def measure(fn: Callable[[], object], device, warmup: int, iters: int, memory: Optional[PeakMemory] = None):
    """``(median ms, peak extra MiB or None, output of the last call)`` of ``fn()`` under ``torch.no_grad``.

    ``warmup`` untimed calls first (their outputs dropped at once); each timed call's output is released
    before the next call, so the peak holds one call's output and workspace, not two. ``memory``: the
    :class:`PeakMemory` to measure the timed calls with (the caller reads its other peaks afterwards).
    """
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    device = torch.device(device)
    cuda = device.type == "cuda"
    times: List[float] = []
    out = None
    with torch.no_grad():
        for _ in range(warmup):
            fn()
        mem = PeakMemory(device) if memory is None else memory
        with mem:
            for _ in range(iters):
                out = None
                if cuda:
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    out = fn()
                    end.record()
                    torch.cuda.synchronize(device)
                    times.append(start.elapsed_time(end))
                else:
                    t0 = time.perf_counter()
                    out = fn()
                    times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), mem.mib, out


@contextlib.contextmanager
def environ(variables: Dict[str, Optional[str]]):
    """``os.environ`` with ``variables`` set (a value of None unsets it) inside the block, and every one of them
    restored afterwards to what it was, set or not: the recipes' A/B switches of the kernels' knobs."""
    def put(values):
        for name, value in values.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value

    saved = {name: os.environ.get(name) for name in variables}
    try:
        put(variables)
        yield
    finally:
        put(saved)


def synchronize(device="cuda") -> None:
    """``torch.cuda.synchronize`` for a CUDA device; nothing for the CPU (whose calls return when done)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def per_call_ms(fn: Callable[[], object], n: int, *, host_only: bool = False, warmup: int = 5,
                device="cuda") -> float:
    """Mean ms per call of ``n`` back-to-back calls of ``fn`` on the GPU, after ``warmup`` calls: the clock
    stops after the device is synchronised (host and GPU time: the eager cost of a call), or before it with
    ``host_only`` (the host's launch and Python time alone). ``device="cpu"``: wall time, no synchronisation."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    t = time.perf_counter()
    for _ in range(n):
        fn()
    if not host_only:
        synchronize(device)
    ms = (time.perf_counter() - t) / n * 1e3
    synchronize(device)
    return ms


_SDPA_BACKENDS = {"efficient": "EFFICIENT_ATTENTION", "flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION",
                  "math": "MATH"}


def sdpa_backends(q, k, v, names: Sequence[str] = ("flash", "cudnn", "efficient"),
                  **kw) -> Tuple[Dict[str, Callable[[], object]], Dict[str, str]]:
    """PyTorch's SDPA on ``q, k, v`` (``kw``: its other arguments) pinned to each of the named backends:
    ``({name: call}, {name: why it cannot run the case})``; each call is made once here to find out."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    calls, errors = {}, {}
    for name in names:
        def run(backend=getattr(SDPBackend, _SDPA_BACKENDS[name])):
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, k, v, **kw)
        try:
            run()
            calls[name] = run
        except Exception as exc:  # a backend that cannot run this case
            errors[name] = str(exc).splitlines()[0][:120]
    return calls, errors


def host_and_eager_us(fn: Callable[[], object], calls: int, rounds: int = 5,
                      device="cuda") -> Tuple[float, float]:
    """``(host µs, eager µs)`` per call of ``calls`` back-to-back calls of ``fn``, medians of ``rounds`` rounds, both
    read from the same calls: the host clock stops when the last call returns (the GPU queue absorbs the kernels),
    the eager one after the device is synchronised."""
    host, eager = [], []
    for _ in range(rounds):
        synchronize(device)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        synchronize(device)
        t2 = time.perf_counter()
        host.append((t1 - t0) / calls * 1e6)
        eager.append((t2 - t0) / calls * 1e6)
    return statistics.median(host), statistics.median(eager)


def print_host_profile(fn: Callable[[], object], calls: int, orders: Sequence[Tuple[str, int]] = (("tottime", 25),),
                       device="cuda") -> None:
    """cProfile of ``calls`` calls of ``fn`` (the device synchronised after the profile stops: its wait is not host
    work), printed once per ``(sort order, rows)`` of ``orders``."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    synchronize(device)
    for order, top in orders:
        pstats.Stats(prof).sort_stats(order).print_stats(top)


def kernel_ms(fn: Callable[[], object], calls: int = 10) -> float:
    """GPU time of ``fn``'s kernels per call, in ms: the profiler's device times summed over ``calls`` calls (each
    kernel's own time; host stalls between launches do not count, so a neighbour's compile load on the CPU does not
    move it: session 29's sweeps read one configuration 0.674 and 0.981 ms by wall clock, with other work on the
    host). One warm call first."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages()) / calls / 1e3


def interleaved_ms(fns: Dict[str, Callable[[], object]], rounds: int = 3, calls: int = 10,
                   warmup: int = 3, device="cuda") -> Dict[str, float]:
    """Median eager ms per call of each of ``fns``, timed in interleaved rounds (A/B/A/B...: clock and thermal drift
    hit every side alike): each round runs every function ``calls`` times back to back (:func:`per_call_ms`,
    host and GPU time), and the median over the rounds is reported."""
    times: Dict[str, List[float]] = {name: [] for name in fns}
    for fn in fns.values():
        per_call_ms(fn, 1, warmup=warmup, device=device)
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(per_call_ms(fn, calls, warmup=0, device=device))
    return {name: statistics.median(t) for name, t in times.items()}


# ratio field -> the peak it compares (allocated, requested, reserved: see PeakMemory)
_PEAK_RATIOS = {"memory_vs_native": "peak_mib", "requested_memory_vs_native": "peak_requested_mib",
                "reserved_memory_vs_native": "peak_reserved_mib"}


def versus_native(row: dict, native: Optional[dict]) -> dict:
    """``speedup_vs_native`` (None without a native time) and, for each peak of :data:`_PEAK_RATIOS`, its
    ratio to native's (None unless both peaks are known and the native one is positive)."""
    native = native or {}
    res = {"speedup_vs_native": native["ms"] / row["ms"] if native.get("ms") else None}
    for key, peak in _PEAK_RATIOS.items():
        mine, theirs = row.get(peak), native.get(peak)
        res[key] = mine / theirs if (mine is not None and theirs) else None
    return res


def output_diff(y: torch.Tensor, ref: Optional[torch.Tensor]) -> dict:
    """``max_abs_diff`` = max |y - ref| and ``rel_diff`` = that / max |ref| (the converted output against the
    native one)."""
    if ref is None:
        raise RuntimeError("no native output to compare with (the native run failed)")
    d = (y - ref).abs().max().item()
    return {"max_abs_diff": d, "rel_diff": d / max(ref.abs().max().item(), 1e-30)}


def measure_modes(model: torch.nn.Module, fn: Callable[[], object], modes: Sequence[Tuple[str, Optional[str]]],
                  device, warmup: int, iters: int, base_row: dict, *, backend: str = "auto", adapters=None,
                  on_output: Optional[Callable[[dict, object], None]] = None,
                  show: Optional[Callable[[dict], None]] = None) -> List[dict]:
    """Time ``fn()`` (which runs ``model``) for each ``(label, precision)`` of ``modes`` (see :func:`modes_for`):
    ``native`` as the model is, the others after ``convert(model, backend=..., precision=..., adapters=...)``.

    One row per mode: ``base_row``, ``mode``, ``ms``, ``peak_mib``, ``peak_requested_mib``, ``peak_reserved_mib``;
    converted rows also ``converted_modules``, ``backends`` / ``fallbacks`` (:func:`dispatch_summary`),
    and :func:`versus_native` (speed and the three memory ratios). ``on_output(row, out)``
    adds the recipe's own fields (output parity, throughput); whatever raises (out of memory...) leaves
    ``row["error"]`` and the sweep goes on. The model is reverted after every mode; ``show(row)`` after each.
    """
    device = torch.device(device)
    rows: List[dict] = []
    native: Optional[dict] = None
    for label, precision in modes:
        row = dict(base_row, mode=label)
        out = None
        try:
            if label != "native":
                rep = convert(model, backend=backend, precision=precision, verify=False, adapters=adapters)
                row["converted_modules"] = rep.num_converted
            mem = PeakMemory(device)
            with record() as log:
                ms, peak, out = measure(fn, device, warmup, iters, memory=mem)
            row.update(ms=ms, peak_mib=peak, peak_requested_mib=mem.requested_mib, peak_reserved_mib=mem.reserved_mib)
            if label == "native":
                native = row
            else:
                row.update(dispatch_summary(log))
                row.update(versus_native(row, native))
            if on_output is not None:
                on_output(row, out)
        except Exception as exc:  # e.g. out of memory: record it and go on
            row["error"] = error_text(exc)
        finally:
            del out
            revert(model)
            if device.type == "cuda":
                torch.cuda.empty_cache()
        rows.append(row)
        if show is not None:
            show(row)
    return rows


# --------------------------------------------------------------------------------------------------
# what ran, where
# --------------------------------------------------------------------------------------------------

def dispatch_summary(log) -> dict:
    """What the converted calls ran on: {"backend/precision": calls}, plus distinct fallback reasons."""
    used = Counter(d.backend + (f"/{d.precision}" if d.precision else "") for d in log)
    return {"backends": dict(used), "fallbacks": sorted({d.reason for d in log if d.fallback})}


def env_info(device) -> dict:
    """Versions, device, TF32 switches and the command line of this run."""
    from . import __version__

    device = torch.device(device)
    info = {"torch": torch.__version__, "python": platform.python_version(), "device": str(device),
            "elsa_surgery": __version__,
            "tf32_matmul": torch.backends.cuda.matmul.allow_tf32, "cudnn_tf32": torch.backends.cudnn.allow_tf32,
            "command": " ".join([sys.executable] + sys.argv)}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["capability"] = list(torch.cuda.get_device_capability(device))
    return info


def error_text(exc: BaseException) -> str:
    """``"Type: first line of the message"`` for a configuration that failed (out of memory...)."""
    lines = str(exc).splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


# --------------------------------------------------------------------------------------------------
# arguments and output
# --------------------------------------------------------------------------------------------------

def modes_for(dtype_name: str, modes: Iterable[str]) -> List[Tuple[str, Optional[str]]]:
    """``(label, precision)`` pairs to measure, native first: fp32 converts once per precision mode
    (``elsa-<mode>``); other dtypes once (``elsa``: their precision is fixed)."""
    out: List[Tuple[str, Optional[str]]] = [("native", None)]
    if dtype_name == "fp32":
        out += [(f"elsa-{m}", m) for m in modes]
    else:
        out += [("elsa", None)]
    return out


def comma_list(parser, flag: str, value, choices: Optional[Sequence] = None, what: str = "value",
               type: Callable = str) -> list:
    """``"a,b"`` -> ``[type(a), type(b)]``; an item not in ``choices`` is a usage error naming ``flag``."""
    items = [type(s) for s in str(value).split(",") if s]
    if choices is not None:
        for item in items:
            if item not in choices:
                parser.error(f"{flag}: unknown {what} {item!r} (choose from {', '.join(map(str, choices))})")
    return items


def write_json(path, obj, announce: bool = True) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
    if announce:
        print(f"json: {path}")


def peak_text(mib: Optional[float], width: int = 9) -> str:
    return "-" if mib is None else f"{mib:{width}.1f} MiB"


def plot_time_memory(rows, path, x_key: str, time_axes: dict, memory_axes: dict,
                     time_scale: float = 1.0, memory_scale: float = 1.0) -> None:
    """Two panels, one line per (dtype, mode): ``ms * time_scale`` and ``peak_mib * memory_scale`` against
    ``row[x_key]`` (rows without ``ms`` are left out; memory only where every point has one). ``*_axes``
    are ``Axes.set`` keywords (xlabel, ylabel, title). Needs matplotlib: without it, says so and returns."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    rows = [r for r in rows if "ms" in r]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for key in sorted({(r["dtype"], r["mode"]) for r in rows}):
        pts = sorted((r[x_key], r["ms"], r["peak_mib"]) for r in rows if (r["dtype"], r["mode"]) == key)
        axes[0].plot([p[0] for p in pts], [p[1] * time_scale for p in pts], marker="o", label=" ".join(key))
        if all(p[2] is not None for p in pts):
            axes[1].plot([p[0] for p in pts], [p[2] * memory_scale for p in pts], marker="o", label=" ".join(key))
    axes[0].set(**time_axes)
    axes[1].set(**memory_axes)
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")
