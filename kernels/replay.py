"""Launch plans: the kernel launches of one call, recorded, then replayed for later calls of the same signature.

An eager call spends most of its host time before the GPU sees anything: planning it (dtype kind, tiles,
partitions, staging, which kernel; ``launch._run``) and Triton's launch path (binding and specialising some 60
arguments). On an H100 that was 150-220 µs per ``launch.attention`` call at N = 1K, against a 15-50 µs kernel
(docs/perf/history.md, version 14). Both depend only on the call's signature: shapes, strides, dtypes, 16-byte
alignment of every pointer, scalars, flags, the environment knobs the planner reads, the current device and
whether the stream is capturing. ``launch`` builds that key; on the first call with a key the planner runs as
usual while this module records what it launches:

* every tensor a kernel receives must be one of the call's *slots* (q, k, v, mask, lengths, provided outputs,
  by identity, or a same-size dtype view of one, as the bool mask's ``uint8`` view) or a tensor the planner
  registered with :func:`allocated` (outputs and the partition states' allocation it creates), :func:`carved` (the
  partition states, pieces of that allocation) or :func:`derived` (V staged transposed); host tensor descriptors
  (Gluon's TMA descriptors) over a slot are recorded as their fields;
* every environment variable the planner reads is recorded with its value: the ``ELSA_*`` knobs as ``knobs.get``
  reads them (the registry reports each read while a plan records), other variables through :func:`env`.

A call that launches anything else (K/V pieces staged into carved buffers, head or key slices: the big staged
fp32 calls, whose host cost is small beside their kernels) is marked not replayable and keeps the planner. Later calls with the
key and the same environment values replay: the registered tensors are allocated with the recorded
geometry, and each launch goes straight to the kernel Triton compiled for the first call, with the
arguments rebuilt around the new tensors, exactly as Triton's own ``JITFunction.run`` calls it (checked
against the installed Triton's source once; where it differs, the replay launches through ``kernel[grid]``,
which still skips the planning). Sizes, strides and alignment are in the key, so the kernel Triton
specialised for the first call is the one it would pick again.

``ELSA_LAUNCH_PLANS``: unset = on for CUDA tensors, ``0`` = off, ``1`` = on everywhere (also under
``TRITON_INTERPRET=1``, where the replay launches through ``kernel[grid]``: this is how CI tests it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import os
import threading
import time
from typing import Callable, Dict, Optional

import torch

from . import internals, knobs

ENV = knobs.LAUNCH_PLANS
MAX_PLANS = 4096  # signatures kept (least recently recorded dropped first)

_local = threading.local()
_plans: Dict[tuple, "Plan"] = {}
GENERATION = [0]  # bumped by clear(): a plan held outside this module (a direct route) is valid while it holds
STATS = {"recorded": 0, "replayed": 0, "not_replayable": 0}
STATS_POINTERS = {"addresses": 0}  # direct launches that handed the launcher the tensors' addresses


# os.environ's own store (CPython's, where checked: kernels/internals.py): a replay checks its recorded variables
# there, ~20x faster than os.environ.get (decoding)
_RAW, _ENCODE = internals.ENVIRON, internals.ENCODE


def _observe_read(name: str, key, raw) -> None:
    rec = getattr(_local, "rec", None)
    if rec is not None and name not in rec.env:
        rec.env[name] = (key, raw)
    reads = getattr(_local, "reads", None)
    if reads is not None and name not in reads:
        reads[name] = (key, raw)


_recording = [0]  # plans being recorded or planned (reading_env), every thread: knob reads are observed only then
_recording_lock = threading.Lock()


def _observe(delta: int) -> None:
    with _recording_lock:
        _recording[0] += delta
        knobs.set_observer(_observe_read if _recording[0] else None)


def env(name: str) -> str:
    """A variable that is not an ``ELSA_*`` knob (``TRITON_INTERPRET``), as a string ("" when unset), recorded in
    the plan being recorded: a later call replays only while every variable its planning read (knobs included,
    through ``knobs.get``) still has the recorded value."""
    key = _ENCODE(name)
    raw = _RAW.get(key)
    if not knobs.tracing():  # nothing is recorded while torch.compile traces (thread-local state would be a guard)
        _observe_read(name, key, raw)
    return "" if raw is None else knobs.decode(raw)


@contextlib.contextmanager
def reading_env():
    """``with reading_env() as read:`` collects ``{name: (key, raw value)}`` of every variable read inside the block
    (:func:`env` and ``knobs.get``; ``launch.cached_plan`` keeps a plan while those values hold: :func:`env_unchanged`)."""
    prev = getattr(_local, "reads", None)
    _local.reads = reads = {}
    _observe(1)
    try:
        yield reads
    finally:
        _observe(-1)
        _local.reads = prev
        if prev is not None:
            for name, entry in reads.items():
                prev.setdefault(name, entry)


def env_unchanged(entries) -> bool:
    """Whether every ``(key, raw value)`` of ``entries`` (from :func:`reading_env`) still holds."""
    return all(_RAW.get(key) == raw for key, raw in entries)


def reread_env(names) -> None:
    """:func:`env` on ``names`` while a plan is being recorded, so that it depends on them as if it had read them
    (a cached launch plan stands for the planner's reads)."""
    if getattr(_local, "rec", None) is not None or getattr(_local, "reads", None) is not None:
        for name in names:
            env(name)


@contextlib.contextmanager
def wrapped_launches(into: Optional[list] = None):
    """Inside the block, :func:`launch` hands every kernel to ``torch.library.wrap_triton`` (the body of a
    ``triton_op`` traced by torch.compile on fake tensors: ``kernels/ops.py``'s inline op) and nothing is recorded
    or replayed (:func:`wanted` is False): Inductor's generated code launches the kernels itself. Given ``into``,
    :func:`launch` appends every launch to it as ``(fn, grid, args, kwargs)`` instead and runs nothing: what
    ``launch.precompile`` compiles ahead of a call's first run."""
    prev = getattr(_local, "wrap", False), getattr(_local, "collect", None)
    _local.wrap, _local.collect = True, into
    try:
        yield
    finally:
        _local.wrap, _local.collect = prev


def wrapping() -> bool:
    """Whether launches go to ``wrap_triton`` (inside :func:`wrapped_launches` without a list). Launches collected
    into a list are made as a real run makes them (``launch.precompile`` compiles them for that run: session 55 found
    a bool mask collected as ``*u1``, where the run reads it as a ``*u8`` view, and its kernels compiled twice)."""
    return getattr(_local, "wrap", False) and getattr(_local, "collect", None) is None


def aligned16(t: torch.Tensor) -> bool:
    """Whether ``t``'s data starts on a 16-byte boundary. While launches are wrapped the tensors are fake (no
    address): their storage offset decides, as Inductor allocates (and assumes) 16-byte aligned storages."""
    if getattr(_local, "wrap", False):
        return (t.storage_offset() * t.element_size()) % 16 == 0
    return t.data_ptr() % 16 == 0


def wanted(t: torch.Tensor) -> bool:
    """Whether calls on ``t``'s device use plans (``ELSA_LAUNCH_PLANS``, see the module docstring)."""
    if getattr(_local, "wrap", False):
        return False
    value = knobs.get(ENV)
    return value == "1" or (value is None and t.is_cuda)


def encodes_descriptors(t: torch.Tensor) -> bool:
    """Whether replayed calls on ``t``'s device launch Gluon kernels with TMA maps encoded here (launch plans on,
    and the installed Triton's launcher as ``_DESC_SOURCE`` expects): their host cost is then the portable kernel's,
    and the Hopper kernels need no size threshold for eager calls (``kernels/hopper.py``)."""
    if not wanted(t) or not internals.triton_private_ok():
        return False
    return _desc_module(internals.launcher_cls()) is not None


CLEAR_HOOKS = []  # called by clear(): caches of what the planner decided (launch.clear_plans)


def clear() -> None:
    """Forget every plan (tests that patch the planner's module constants call this)."""
    _plans.clear()
    GENERATION[0] += 1
    for hook in CLEAR_HOOKS:
        hook()


def allocated(name: str, t: Optional[torch.Tensor]) -> None:
    """Registers a tensor the planner allocated (output, lse, partition state) under ``name``: a replay
    allocates one of the same geometry."""
    rec = getattr(_local, "rec", None)
    if rec is not None and t is not None:
        rec.allocate(name, t)


def carved(name: str, t: torch.Tensor, base: str) -> None:
    """Registers ``t``, a piece of the tensor registered as ``base`` (:func:`allocated`; the same dtype), under
    ``name``: a replay hands the kernels the same piece of its ``base`` (its address plus the offset, or the view),
    so that one allocation serves several buffers (the partition states)."""
    rec = getattr(_local, "rec", None)
    if rec is not None:
        rec.carve(name, t, base)


def derived(name: str, t: torch.Tensor, make: Callable) -> None:
    """Registers a tensor the planner derived from the call's tensors (V staged transposed): a replay derives it
    again with ``make(slots)`` (``make`` must not hold tensors: plans outlive calls)."""
    rec = getattr(_local, "rec", None)
    if rec is not None:
        rec.derive(name, t, make)


def note(name: str, value) -> None:
    """Keeps ``value`` with the plan being recorded, as ``plan.notes[name]``: what the planner knew that a later user
    of the plan needs (``launch.KeysFamily``: the partition rule of a packed short-query call; ``value`` must not hold
    tensors)."""
    rec = getattr(_local, "rec", None)
    if rec is not None:
        rec.notes[name] = value


def collecting() -> bool:
    """Whether launches are collected into a list, not run (``launch.precompile``: :func:`wrapped_launches`)."""
    return getattr(_local, "wrap", False) and getattr(_local, "collect", None) is not None


def launch(fn, grid, *args, **kwargs):
    """``fn[grid](*args, **kwargs)``, recorded when a plan is being recorded; through ``wrap_triton`` inside
    :func:`wrapped_launches` (returns None there)."""
    if not internals._ptxas_matched and os.environ.get("TRITON_INTERPRET", "") in ("", "0"):  # (once a process)
        internals.match_inductor_ptxas()
    if getattr(_local, "wrap", False):
        into = getattr(_local, "collect", None)
        if into is not None:
            into.append((fn, grid, args, kwargs))
            return None
        from torch.library import wrap_triton

        _memo_ttir(fn)
        kernel, kwargs = _one_config(fn, kwargs)
        wrap_triton(kernel)[grid](*args, **with_defaults(fn, args, kwargs))
        return None
    kernel = fn[grid](*args, **kwargs)
    rec = getattr(_local, "rec", None)
    if rec is not None:
        rec.add(fn, kernel, grid, args, kwargs)
    return kernel


# torch's analysis of which tensors a user Triton kernel reads and writes (``torch._higher_order_ops.
# triton_kernel_wrap``: ``identify_mutated_tensors`` in torch 2.11, ``identify_accessed_tensors`` in 2.14) compiles the
# kernel to TTIR (``generate_ttir``) for every launch it traces, with no cache: once when the launch is functionalized
# and once when Inductor lowers it. A CLIP-L/14-336 (24 calls of ``elsa_fwd`` and ``split_f16``) compiled them 96 times
# while tracing alone, 4.4 of its 6.9 s on a CPU (session 51; memoised: 3 times, 1.5 s). For ELSA's kernels the TTIR is
# memoised here by all that ``generate_ttir`` compiles from: the kernel and its arguments (with an autotuner's first
# config's, which it compiles with), each tensor argument's dtype (it compiles a 2-element tensor of it), each symbolic
# size as the 2 it substitutes, every other argument's value; and the functions torch reads out of a memoised module
# (``ttir_to_functions``, a walk of it: another 13 ms a launch). The analyses only read both. Other kernels and modules
# go to torch's functions as they are.
_OURS: Dict[int, object] = {}  # id -> ELSA's kernel (held here: an id is never reused for another kernel)
_TTIR: Dict[tuple, tuple] = {}
_FUNCTIONS: Dict[int, list] = {}  # id(a memoised module) -> [module, its functions or None]
MAX_TTIR = 64
# (miss_s: seconds in torch's compiles; others: calls the memo passed on, for other kernels or unkeyable arguments)
TTIR_MEMO = {"installed": None, "hits": 0, "misses": 0, "miss_s": 0.0, "others": 0}


def _arg_spec(a):
    """What ``generate_ttir`` compiles an argument as, hashable (or a TypeError): a fake tensor or an Inductor
    ``TensorBox`` as a 2-element tensor of its dtype, a real tensor as itself (its address's alignment counts), a
    symbolic size as 2, anything else as its value."""
    from torch._subclasses.fake_tensor import FakeTensor

    if isinstance(a, FakeTensor):
        return ("tensor", a.dtype)
    if isinstance(a, torch.Tensor):
        return ("real tensor", a.dtype, a.data_ptr() % 16 == 0)
    if type(a).__name__ == "TensorBox" and type(a).__module__ == "torch._inductor.ir":
        return ("tensor", a.dtype)
    if isinstance(a, (torch.SymInt, torch.SymFloat, torch.SymBool)) or type(a).__module__.startswith("sympy"):
        return ("symbolic",)
    hash(a)
    return ("value", type(a), a)


def _memo_ttir(fn) -> None:
    """Registers ``fn`` as ELSA's and, once a process, puts the memo (above) in front of torch's ``generate_ttir``."""
    _OURS.setdefault(id(fn), fn)
    if TTIR_MEMO["installed"] is not None:
        return
    try:
        from torch._higher_order_ops import triton_kernel_wrap as tkw

        real = tkw.generate_ttir
    except (ImportError, AttributeError) as e:  # (a torch without the analysis: nothing to memoise)
        TTIR_MEMO["installed"] = f"no: {e}"
        return

    def generate_ttir(kernel, kwargs, tma_descriptor_metadata, *rest, **kw):
        # an autotuner torch made around ELSA's kernel (a traced launch) compiles its kernel with its first config's
        # arguments; Inductor's lowering hands the kernel itself, those arguments already in kwargs (session 53: the
        # memo took the JITFunction's Python function for the kernel there and missed every lowered launch)
        configs = getattr(kernel, "configs", None)
        base = getattr(kernel, "fn", kernel) if configs is not None else kernel
        if rest or kw or tma_descriptor_metadata or _OURS.get(id(base)) is not base:
            TTIR_MEMO["others"] += 1
            return real(kernel, kwargs, tma_descriptor_metadata, *rest, **kw)
        merged = {**kwargs, **configs[0].kwargs} if configs else kwargs
        try:
            key = (id(base), tuple(sorted((name, _arg_spec(a)) for name, a in merged.items())))
            hash(key)
        except TypeError:
            TTIR_MEMO["others"] += 1
            return real(kernel, kwargs, tma_descriptor_metadata)
        got = _TTIR.get(key)
        if got is None:
            TTIR_MEMO["misses"] += 1
            t0 = time.perf_counter()
            module, names = real(kernel, kwargs, tma_descriptor_metadata)
            TTIR_MEMO["miss_s"] += time.perf_counter() - t0
            if len(_TTIR) >= MAX_TTIR:
                _FUNCTIONS.pop(id(_TTIR.pop(next(iter(_TTIR)))[0]), None)
            got = _TTIR[key] = (module, tuple(names))
            _FUNCTIONS[id(module)] = [module, None]
        else:
            TTIR_MEMO["hits"] += 1
        return got[0], list(got[1])

    real_functions = getattr(tkw, "ttir_to_functions", None)

    def ttir_to_functions(module, *rest, **kw):
        held = _FUNCTIONS.get(id(module))
        if held is None or held[0] is not module or rest or kw:
            return real_functions(module, *rest, **kw)
        if held[1] is None:
            held[1] = real_functions(module)
        return held[1]

    generate_ttir.__wrapped__ = real
    tkw.generate_ttir = generate_ttir
    if real_functions is not None:
        ttir_to_functions.__wrapped__ = real_functions
        tkw.ttir_to_functions = ttir_to_functions
    TTIR_MEMO["installed"] = "yes"


_LAUNCH_CONFIG = ("num_warps", "num_stages")  # (the launch options ELSA's launches pass)
_ONE_CONFIG: Dict[tuple, object] = {}


def _one_config(fn, kwargs: dict):
    """``(kernel, kwargs)`` for a traced launch: ``fn`` with the launch options of ``kwargs`` (num_warps, num_stages)
    as an autotuner of that one config, made once per kernel and options, and the other kwargs. torch wraps a
    launch that passes them in a new autotuner of one config each time it traces it, a new entry of its kernel side
    table each (a CLIP-L/14-336's 48 launches: 146 entries over its traces), and the repro string Inductor writes
    for every compile (``save_graph_repro``) walks every entry's source; a kernel torch has seen is not added again."""
    options = {name: kwargs[name] for name in _LAUNCH_CONFIG if name in kwargs}
    if not options:
        return fn, kwargs
    key = (id(fn), tuple(sorted(options.items())))  # (the autotuner holds fn: its id is not reused while kept)
    kernel = _ONE_CONFIG.get(key)
    if kernel is None:
        import triton

        kernel = _ONE_CONFIG[key] = triton.autotune(configs=[triton.Config({}, **options)], key=[])(fn)
    return kernel, {name: value for name, value in kwargs.items() if name not in options}


def with_defaults(fn, args: tuple, kwargs: dict) -> dict:
    """``kwargs`` plus the defaults of ``fn``'s parameters that the call leaves out. A launch traced through
    ``wrap_triton`` passes every parameter: Inductor's launcher for a user kernel (torch 2.11, Triton 3.6) takes each
    constexpr of the signature as a positional argument but its call site passes only those given, so a constexpr
    left to its default shifted the grid's arguments (``launcher() missing ... '_grid_1' and '_grid_2'``), and
    Dynamo's mutation analysis, which compiles the kernel with the arguments given, assumed every input written."""
    try:
        params = _params(fn)
    except (AttributeError, TypeError, ValueError):  # (no Python signature: the call as it is)
        return kwargs
    missing = {name: default for name, default in params[len(args):]
               if name not in kwargs and default is not inspect.Parameter.empty}
    return {**kwargs, **missing} if missing else kwargs


def run(key: tuple, slots: Dict[str, Optional[torch.Tensor]], plan_and_run: Callable, aliases=()):
    """The call ``plan_and_run()`` (returning ``(out, lse, state)``) through the plan of ``key``: replayed when
    one is recorded for the current environment, else run and recorded. ``slots``: the call's tensors by name;
    ``aliases``: pairs of slot names whose identity (``a is b``) the key holds (a recording where any other two
    slots are one tensor is not replayable). A replay adds the tensors it allocates to ``slots``."""
    plan = _plans.get(key)
    if plan is not None and plan.env_unchanged():
        if plan.launches is None:
            return plan_and_run()
        return plan.replay(slots)
    rec = _Recorder(slots, aliases)
    _local.rec = rec
    _observe(1)
    try:
        result = plan_and_run()
    finally:
        _local.rec = None
        _observe(-1)
    plan = rec.finish(result)
    STATS["recorded" if plan.launches is not None else "not_replayable"] += 1
    if len(_plans) >= MAX_PLANS and key not in _plans:
        del _plans[next(iter(_plans))]
    _plans[key] = plan
    return result


def replayable(key: tuple) -> Optional["Plan"]:
    """The recorded plan of ``key`` when it replays in the current environment, else None."""
    plan = _plans.get(key)
    return plan if plan is not None and plan.launches is not None and plan.env_unchanged() else None


def why_not_replayable(key: tuple) -> Optional[str]:
    """The reason the plan of ``key`` is not replayed (None: replayable or not recorded)."""
    plan = _plans.get(key)
    return None if plan is None else plan.why


_PARAMS: Dict[int, tuple] = {}


def _params(fn):
    """``((name, default), ...)`` of a Triton kernel's parameters in order (cached per kernel)."""
    got = _PARAMS.get(id(fn))
    if got is None or got[0] is not fn:
        sig = inspect.signature(fn.fn)
        got = (fn, tuple((p.name, p.default) for p in sig.parameters.values()))
        _PARAMS[id(fn)] = got
    return got[1]


# Triton's private launch path (kernels/internals.py, behind its version gate); the names tests and recipes patch
_launches_as_recorded = internals.launches_as_recorded
_launcher_takes_ints = internals.launcher_takes_ints
_tensor_arg = internals.tensor_arg
_metadata_needs_hook = internals.metadata_needs_hook
_desc_module = internals.desc_module
_idle = internals.idle


def _direct_ok(fn, kernel) -> bool:
    """Whether a launch of ``fn`` that returned ``kernel`` can be replayed by calling ``kernel`` directly."""
    return _launches_as_recorded(type(fn)) and all(
        hasattr(kernel, a) for a in ("run", "function", "packed_metadata", "launch_metadata"))


class _Recorder:
    def __init__(self, slots, aliases=()):
        self.slots = {n: t for n, t in slots.items() if t is not None}
        self.ids: Dict[int, str] = {}
        self.why: Optional[str] = None
        allowed = {frozenset(pair) for pair in aliases}
        for name, t in self.slots.items():
            first = self.ids.setdefault(id(t), name)  # an aliased tensor is replayed from its first slot
            if first != name and frozenset((first, name)) not in allowed:
                self.fail(f"{name} and {first} are the same tensor")
        self.prep = []  # (name, geometry to allocate, or a function of the slots deriving it), in call order
        self.launches = []
        self.env: Dict[str, tuple] = {}  # name -> (encoded name, encoded value or None) as read
        self.notes: dict = {}  # (note)
        self.carved: Dict[str, tuple] = {}  # name -> (base slot, internals.Carved) (carved)

    def fail(self, why: str):
        if self.why is None:
            self.why = why

    def _new_slot(self, name: str, t: torch.Tensor) -> bool:
        if name in self.slots:
            self.fail(f"slot {name} registered twice")
            return False
        self.slots[name] = t
        self.ids.setdefault(id(t), name)
        return True

    def allocate(self, name: str, t: torch.Tensor):
        if self._new_slot(name, t):
            self.prep.append((name, (tuple(t.shape), t.stride(), t.dtype, t.device)))

    def carve(self, name: str, t: torch.Tensor, base: str):
        b = self.slots.get(base)
        if b is None or b.dtype != t.dtype or b.device != t.device:
            self.fail(f"{name} is not a piece of a registered {base}")
            return
        offset = (t.data_ptr() - b.data_ptr()) // t.element_size()
        if self._new_slot(name, t):
            self.carved[name] = (base, internals.Carved((tuple(t.shape), t.stride(), offset,
                                                          offset * t.element_size())))

    def derive(self, name: str, t: torch.Tensor, make: Callable):
        if self._new_slot(name, t):
            self.prep.append((name, make))

    def _slot(self, t: torch.Tensor):
        """``(slot name, view dtype or None)`` of a tensor argument, or None."""
        name = self.ids.get(id(t))
        if name is not None:
            return self.carved.get(name) or (name, None)
        for name, s in self.slots.items():  # a dtype view of a slot (the bool mask as uint8)
            if (s.dtype != t.dtype and s.dtype.itemsize == t.dtype.itemsize and s.data_ptr() == t.data_ptr()
                    and s.shape == t.shape and s.stride() == t.stride() and s.device == t.device):
                return name, t.dtype
        return None

    def add(self, fn, kernel, grid, args, kwargs):
        if self.why is not None:
            return
        try:
            params = _params(fn)
        except (AttributeError, TypeError, ValueError):
            self.fail(f"kernel {fn!r}: no Python signature")
            return
        names = {n for n, _ in params}
        vals, subs, descs = [], [], []
        for i, (name, default) in enumerate(params):
            val = args[i] if i < len(args) else kwargs.get(name, default)
            if val is inspect.Parameter.empty:
                self.fail(f"argument {name} of {fn!r} not given")
                return
            if isinstance(val, torch.Tensor):
                slot = self._slot(val)
                if slot is None:
                    self.fail(f"argument {name} of {getattr(fn, '__name__', fn)} is not a tensor of the call "
                              "(staged or sliced operands)")
                    return
                subs.append((i, *slot))
                val = None
            elif dataclasses.is_dataclass(val) and isinstance(getattr(val, "base", None), torch.Tensor):
                slot = self._slot(val.base)
                if slot is None or slot[1] is not None:
                    self.fail(f"descriptor {name} is not over a tensor of the call")
                    return
                fields = {f.name: getattr(val, f.name) for f in dataclasses.fields(val) if f.init and f.name != "base"}
                descs.append((i, slot[0], type(val), fields))
                val = None
            vals.append(val)
        options = {n: v for n, v in kwargs.items() if n not in names}
        direct = kernel is not None and _direct_ok(fn, kernel) and internals.triton_private_ok()
        self.launches.append(_Launch(fn, kernel if direct else None, tuple(grid), vals, subs, descs, options))

    def _name(self, t):
        if t is None:
            return None
        name = self.ids.get(id(t))
        if name is None or name in self.carved:
            self.fail("a returned tensor is not a tensor of the call")
        return name

    def finish(self, result) -> "Plan":
        out, lse, state = result
        names = (self._name(out), self._name(lse), None if state is None else tuple(self._name(t) for t in state))
        return Plan(tuple(self.env.values()), None if self.why else tuple(self.prep),
                    None if self.why else tuple(self.launches), names, self.why, self.notes)


_TRITON = []  # (get_current_device, get_current_stream, knobs.runtime) of the installed Triton, fetched once


def _triton():
    if not _TRITON:
        _TRITON.append(internals.runtime())
    return _TRITON[0]


_fill_tma = internals.fill_tma


STATS_DESC = {"encoded": 0, "through_triton": 0}  # replayed launches with host descriptors, by route
MAPS_PER_DESCRIPTOR = 8  # CUtensorMaps kept per descriptor argument of a launch, by base address


_STREAM = "\0stream"  # a replay's slots: (the current stream, Triton's runtime hooks), once read (not a tensor name)


class _Launch:
    __slots__ = ("fn", "kernel", "grid", "grid3", "vals", "subs", "descs", "options", "expanded", "ints")

    def __init__(self, fn, kernel, grid, vals, subs, descs, options):
        self.fn, self.kernel, self.grid, self.vals = fn, kernel, grid, vals
        self.grid3 = tuple(grid) + (1,) * (3 - len(grid))
        self.subs, self.descs, self.options = tuple(subs), tuple(descs), options
        self.expanded = None if descs and kernel is not None else False  # None: not tried yet
        self.ints = None  # launcher_takes_ints: the pointer plan, or False; None: not asked

    def _expand(self):
        """How this launch's host descriptors are expanded for Triton's compiled launcher, or False (see
        ``internals.expand_descriptors``)."""
        return internals.expand_descriptors(self.kernel, self.vals, self.subs, self.descs, _desc_module, _fill_tma)

    def __call__(self, slots):
        kernel = self.kernel
        if kernel is None:
            vals = self._vals(slots)
            self.fn[self.grid](*vals, **self.options)
            return
        got = slots.get(_STREAM)  # the launches of one replay share the current device's stream (read once)
        if got is None:
            device, stream, hooks = _triton()
            got = slots[_STREAM] = (stream(device()), hooks)
        stream, hooks = got
        enter, leave = hooks.launch_enter_hook, hooks.launch_exit_hook
        quiet = internals.quiet(kernel, enter, leave)
        ints = self.ints  # the launch's internals.pointer_plan where the launcher takes addresses, else False
        if ints is None:
            ints = self.ints = _launcher_takes_ints(type(kernel.run)) and internals.pointer_plan(self.subs)
        if quiet and self.expanded is not False:
            if self.expanded is None:
                self.expanded = self._expand()
            if self.expanded:
                STATS_DESC["encoded"] += 1
                return internals.launch_expanded(self.expanded, kernel, self.grid3, stream, slots,
                                                 MAPS_PER_DESCRIPTOR, bool(ints))
        if quiet and ints is not False and not self.descs:  # (no hook reads the arguments: addresses will do)
            STATS_POINTERS["addresses"] += 1
            return internals.launch_compiled(kernel, self.grid, self.grid3, stream, None,
                                             internals.pointer_args(self.vals, ints, slots))
        vals = self._vals(slots)
        if self.descs:
            STATS_DESC["through_triton"] += 1
        internals.launch_compiled(kernel, self.grid, self.grid3, stream, None if quiet else (enter, leave), vals)

    def with_args(self, changes) -> "_Launch":
        """This launch with the non-tensor arguments ``changes`` (``{parameter index: value}``) set: the same compiled
        kernel and grid, which the caller has checked hold for them (``launch.KeysFamily``)."""
        vals = self.vals.copy()
        for i, val in changes.items():
            vals[i] = val
        return _Launch(self.fn, self.kernel, self.grid, vals, self.subs, self.descs, self.options)

    def _vals(self, slots):
        vals = self.vals.copy()
        for i, name, view in self.subs:
            vals[i] = _tensor_arg(slots, name, view)
        for i, name, cls, fields in self.descs:
            vals[i] = cls(slots[name], **fields)
        return vals


class Plan:
    __slots__ = ("env", "env_keys", "env_values", "prep", "launches", "result", "why", "notes")

    def __init__(self, env, prep, launches, result, why, notes=None):
        self.env, self.prep, self.launches, self.result, self.why = env, prep, launches, result, why
        self.env_keys, self.env_values = tuple(e[0] for e in env), tuple(e[1] for e in env)
        self.notes = notes or {}

    def with_launches(self, launches) -> "Plan":
        """This plan (environment, allocations, result) running ``launches`` instead (``_Launch.with_args``)."""
        plan = Plan.__new__(Plan)
        plan.env, plan.env_keys, plan.env_values, plan.prep, plan.result, plan.why, plan.notes = (
            self.env, self.env_keys, self.env_values, self.prep, self.result, self.why, self.notes)
        plan.launches = tuple(launches)
        return plan

    def env_unchanged(self) -> bool:
        return tuple(map(_RAW.get, self.env_keys)) == self.env_values

    def replay(self, slots):
        """Runs the plan on the call's ``slots`` (a dict this adds the allocated and derived tensors to); counted in
        ``STATS["replayed"]`` whoever replays it (:func:`run`, or ``elsa_surgery.callcache``'s direct routes)."""
        STATS["replayed"] += 1
        for name, how in self.prep:
            if callable(how):
                slots[name] = how(slots)
            else:
                shape, stride, dtype, device = how
                slots[name] = torch.empty_strided(shape, stride, dtype=dtype, device=device)
        for one in self.launches:
            one(slots)
        out, lse, state = self.result
        return (slots[out] if out else None, slots[lse] if lse else None,
                None if state is None else tuple(slots[n] for n in state))
