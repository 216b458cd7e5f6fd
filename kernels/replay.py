"""Launch plans: the kernel launches of one call, recorded, then replayed for later calls of the same signature.

An eager call spends most of its host time before the GPU sees anything: planning it (dtype kind, tiles,
partitions, staging, which kernel; ``launch._run``) and Triton's launch path (binding and specialising some 60
arguments). On an H100 that was 150-220 µs per ``launch.attention`` call at N = 1K, against a 15-50 µs kernel
(docs/PERF.md, version 14). Both depend only on the call's signature: shapes, strides, dtypes, 16-byte
alignment of every pointer, scalars, flags, the environment knobs the planner reads, the current device and
whether the stream is capturing. ``launch`` builds that key; on the first call with a key the planner runs as
usual while this module records what it launches:

* every tensor a kernel receives must be one of the call's *slots* (q, k, v, mask, lengths, provided outputs,
  by identity, or a same-size dtype view of one, as the bool mask's ``uint8`` view) or a tensor the planner
  registered with :func:`allocated` (outputs and partition states it creates) or :func:`derived` (V staged
  transposed); host tensor descriptors (Gluon's TMA descriptors) over a slot are recorded as their fields;
* every environment variable the planner reads goes through :func:`env` and is recorded with its value.

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
import functools
import inspect
import os
import threading
from typing import Callable, Dict, Optional

import torch

ENV = "ELSA_LAUNCH_PLANS"
MAX_PLANS = 4096  # signatures kept (least recently recorded dropped first)

_local = threading.local()
_plans: Dict[tuple, "Plan"] = {}
STATS = {"recorded": 0, "replayed": 0, "not_replayable": 0}


# os.environ's own store (CPython: encoded names to encoded values, kept in step by os.environ's setters and
# deleters): a replay checks its recorded variables there, ~20x faster than os.environ.get (decoding)
_RAW = getattr(os.environ, "_data", None)
_ENCODE = getattr(os.environ, "encodekey", None)
if not (isinstance(_RAW, dict) and callable(_ENCODE)):  # pragma: no cover - other Pythons
    _RAW, _ENCODE = os.environ, lambda name: name
_ENV_KEY = _ENCODE(ENV)


def env(name: str) -> str:
    """``os.environ.get(name, "")``, recorded in the plan being recorded: a later call replays only while
    every variable its planning read still has the recorded value."""
    value = os.environ.get(name, "")
    rec = getattr(_local, "rec", None)
    if rec is not None and name not in rec.env:
        key = _ENCODE(name)
        rec.env[name] = (key, _RAW.get(key))
    reads = getattr(_local, "reads", None)
    if reads is not None and name not in reads:
        key = _ENCODE(name)
        reads[name] = (key, _RAW.get(key))
    return value


@contextlib.contextmanager
def reading_env():
    """``with reading_env() as read:`` collects ``{name: (key, raw value)}`` of every :func:`env` call inside the
    block (``launch.cached_plan`` keeps a plan while those values hold: :func:`env_unchanged`)."""
    prev = getattr(_local, "reads", None)
    _local.reads = reads = {}
    try:
        yield reads
    finally:
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


def wanted(t: torch.Tensor) -> bool:
    """Whether calls on ``t``'s device use plans (``ELSA_LAUNCH_PLANS``, see the module docstring)."""
    raw = _RAW.get(_ENV_KEY)
    if raw is None:
        return t.is_cuda
    value = os.environ.get(ENV, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"environment variable {ENV} must be 0 or 1 (or unset: on for CUDA tensors), got {value!r}")
    return value == "1" or (value == "" and t.is_cuda)


def encodes_descriptors(t: torch.Tensor) -> bool:
    """Whether replayed calls on ``t``'s device launch Gluon kernels with TMA maps encoded here (launch plans on,
    and the installed Triton's launcher as ``_DESC_SOURCE`` expects): their host cost is then the portable kernel's,
    and the Hopper kernels need no size threshold for eager calls (``kernels/hopper.py``)."""
    if not wanted(t):
        return False
    from triton.runtime import driver

    return _desc_module(driver.active.launcher_cls) is not None


CLEAR_HOOKS = []  # called by clear(): caches of what the planner decided (launch.clear_plans)


def clear() -> None:
    """Forget every plan (tests that patch the planner's module constants call this)."""
    _plans.clear()
    for hook in CLEAR_HOOKS:
        hook()


def allocated(name: str, t: Optional[torch.Tensor]) -> None:
    """Registers a tensor the planner allocated (output, lse, partition state) under ``name``: a replay
    allocates one of the same geometry."""
    rec = getattr(_local, "rec", None)
    if rec is not None and t is not None:
        rec.allocate(name, t)


def derived(name: str, t: torch.Tensor, make: Callable) -> None:
    """Registers a tensor the planner derived from the call's tensors (V staged transposed): a replay derives it
    again with ``make(slots)`` (``make`` must not hold tensors: plans outlive calls)."""
    rec = getattr(_local, "rec", None)
    if rec is not None:
        rec.derive(name, t, make)


def launch(fn, grid, *args, **kwargs):
    """``fn[grid](*args, **kwargs)``, recorded when a plan is being recorded."""
    kernel = fn[grid](*args, **kwargs)
    rec = getattr(_local, "rec", None)
    if rec is not None:
        rec.add(fn, kernel, grid, args, kwargs)
    return kernel


def run(key: tuple, slots: Dict[str, Optional[torch.Tensor]], plan_and_run: Callable, aliases=()):
    """The call ``plan_and_run()`` (returning ``(out, lse, state)``) through the plan of ``key``: replayed when
    one is recorded for the current environment, else run and recorded. ``slots``: the call's tensors by name;
    ``aliases``: pairs of slot names whose identity (``a is b``) the key holds (a recording where any other two
    slots are one tensor is not replayable). A replay adds the tensors it allocates to ``slots``."""
    plan = _plans.get(key)
    if plan is not None and plan.env_unchanged():
        if plan.launches is None:
            return plan_and_run()
        STATS["replayed"] += 1
        return plan.replay(slots)
    rec = _Recorder(slots, aliases)
    _local.rec = rec
    try:
        result = plan_and_run()
    finally:
        _local.rec = None
    plan = rec.finish(result)
    STATS["recorded" if plan.launches is not None else "not_replayable"] += 1
    if len(_plans) >= MAX_PLANS and key not in _plans:
        del _plans[next(iter(_plans))]
    _plans[key] = plan
    return result


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


# The launch statements of Triton's JITFunction.run (Triton 3.4 to 3.9 at least) that a direct replay repeats
_RUN_SOURCE = ("launch_metadata = kernel.launch_metadata(grid, stream, *bound_args.values())",
               "kernel.run(grid_0, grid_1, grid_2, stream, kernel.function, kernel.packed_metadata, launch_metadata,",
               "knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, *bound_args.values())")


@functools.lru_cache(maxsize=None)
def _launches_as_recorded(cls: type) -> bool:
    """Whether ``cls.run`` (a Triton JIT function class) launches with the statements a direct replay repeats."""
    try:
        src = " ".join(inspect.getsource(cls.run).split())
    except (AttributeError, OSError, TypeError):
        return False
    return all(s in src for s in _RUN_SOURCE)


@functools.lru_cache(maxsize=None)
def _metadata_needs_hook(cls: type) -> bool:
    """Whether ``cls.launch_metadata`` (Triton's CompiledKernel) returns None when no launch-enter hook is set, as
    Triton 3.4 to 3.9 do: a launch with no hook to call (None, or Triton 3.6's empty hook chains, see
    :func:`_idle`) then replays with None for the metadata and both hooks, the combination Triton itself passes
    when no enter hook is set, and skips building the metadata (a dict over ~70 arguments) and calling the chains."""
    try:
        src = " ".join(inspect.getsource(cls.launch_metadata).split())
    except (AttributeError, OSError, TypeError):
        return False
    return "if knobs.runtime.launch_enter_hook is None: return None" in src


# Gluon kernels take host TMA descriptors. Triton 3.6's launcher turns each into a CUtensorMap through Python on every
# launch: TensorDescriptor's checks, wrap_handle_tensordesc's loop over every argument, make_tensordesc_arg. A
# replay's key fixes each descriptor's shape, strides, block, dtype and 16-byte alignment, so a replay encodes the
# maps itself (the same fill_tma_descriptor call) and calls the compiled C launcher with the arguments expanded as
# make_tensordesc_arg expands them: the statements below, checked against the installed Triton's source once. Where
# they differ (Triton 3.8 reorganised this code), a replay builds the descriptors and calls the kernel's launcher.
_DESC_SOURCE = {
    "make_tensordesc_arg": (
        "cu_tensor_map=triton.runtime.driver.active.utils.fill_tma_descriptor(arg.base.data_ptr(),swizzle,elem_size,"
        "TMA_DTYPE_DEVICE_TO_HOST[elem_type],block_size,shape,strides,padding,)",
        "return[cu_tensor_map,*shape,*strides]", "padding=1ifarg.padding==\"nan\"else0"),
    "wrap_handle_tensordesc": (
        "final_args=list(args[:_BASE_ARGS_FORMAT_LEN])",
        "final_args.extend(make_tensordesc_arg(arg,tensordesc_meta[tensordesc_idx]))",
        "final_args.append(arg)", "returnlauncher(*final_args)"),
    "CudaLauncher.__call__": (
        "self.launch(gridX,gridY,gridZ,stream,function,self.launch_cooperative_grid,self.launch_pdl,global_scratch,"
        "profile_scratch,*args)",),
}
_DESC_UNEXPECTED = ("round_f32_to_tf32", "im2col")  # descriptor features the statements above do not reproduce
_BASE_ARGS = 13  # gridX ... profile_scratch, packed metadata, launch metadata, both hooks


@functools.lru_cache(maxsize=None)
def _desc_module(cls: type):
    """The driver module of ``cls`` (a compiled kernel's launcher class) when it expands host descriptors with the
    statements of ``_DESC_SOURCE``, else None."""
    module = inspect.getmodule(cls)
    try:
        parts = {"make_tensordesc_arg": module.make_tensordesc_arg, "wrap_handle_tensordesc":
                 module.wrap_handle_tensordesc, "CudaLauncher.__call__": cls.__call__}
        src = {name: "".join(inspect.getsource(f).split()) for name, f in parts.items()}
        table, base = module.TMA_DTYPE_DEVICE_TO_HOST, module._BASE_ARGS_FORMAT_LEN
    except (AttributeError, OSError, TypeError):
        return None
    if base != _BASE_ARGS or not isinstance(table, dict):
        return None
    if any(bad in src["make_tensordesc_arg"] for bad in _DESC_UNEXPECTED):
        return None
    return module if all(s in src[name] for name, stmts in _DESC_SOURCE.items() for s in stmts) else None


def _closure(fn) -> dict:
    cells = getattr(fn, "__closure__", None) or ()
    return dict(zip(getattr(getattr(fn, "__code__", None), "co_freevars", ()), (c.cell_contents for c in cells)))


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

    def derive(self, name: str, t: torch.Tensor, make: Callable):
        if self._new_slot(name, t):
            self.prep.append((name, make))

    def _slot(self, t: torch.Tensor):
        """``(slot name, view dtype or None)`` of a tensor argument, or None."""
        name = self.ids.get(id(t))
        if name is not None:
            return name, None
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
        direct = kernel is not None and _direct_ok(fn, kernel)
        self.launches.append(_Launch(fn, kernel if direct else None, tuple(grid), vals, subs, descs, options))

    def _name(self, t):
        if t is None:
            return None
        name = self.ids.get(id(t))
        if name is None:
            self.fail("a returned tensor is not a tensor of the call")
        return name

    def finish(self, result) -> "Plan":
        out, lse, state = result
        names = (self._name(out), self._name(lse), None if state is None else tuple(self._name(t) for t in state))
        return Plan(tuple(self.env.values()), None if self.why else tuple(self.prep),
                    None if self.why else tuple(self.launches), names, self.why)


_TRITON = []  # (get_current_device, get_current_stream, knobs.runtime) of the installed Triton, fetched once


def _triton():
    if not _TRITON:
        from triton import knobs
        from triton.runtime import driver

        _TRITON.append((driver.active.get_current_device, driver.active.get_current_stream, knobs.runtime))
    return _TRITON[0]


def _fill_tma():
    """Triton's ``fill_tma_descriptor`` (the CUtensorMap encoder its launcher calls for host descriptors)."""
    from triton.runtime import driver

    return driver.active.utils.fill_tma_descriptor


STATS_DESC = {"encoded": 0, "through_triton": 0}  # replayed launches with host descriptors, by route
MAPS_PER_DESCRIPTOR = 8  # CUtensorMaps kept per descriptor argument of a launch, by base address


class _Launch:
    __slots__ = ("fn", "kernel", "grid", "grid3", "vals", "subs", "descs", "options", "expanded")

    def __init__(self, fn, kernel, grid, vals, subs, descs, options):
        self.fn, self.kernel, self.grid, self.vals = fn, kernel, grid, vals
        self.grid3 = tuple(grid) + (1,) * (3 - len(grid))
        self.subs, self.descs, self.options = tuple(subs), tuple(descs), options
        self.expanded = None if descs and kernel is not None else False  # None: not tried yet

    def _expand(self):
        """``(C launcher, map encoder, cooperative, pdl, template, tensor positions, descriptor positions)``: the
        kernel's arguments expanded as Triton's launcher expands them, around placeholders for the call's tensors
        and maps (each descriptor position with its encoder arguments and its maps by base address); False when
        this Triton or kernel does not allow it (see ``_DESC_SOURCE``)."""
        launcher = self.kernel.run
        module = _desc_module(type(launcher))
        scratch = getattr(launcher, "global_scratch_size", 1) or getattr(launcher, "profile_scratch_size", 1)
        if module is None or scratch:
            return False
        inner = launcher.launch
        free = _closure(inner)
        raw, metas = free.get("launcher"), free.get("tensordesc_meta")
        if getattr(inner, "__name__", "") != "inner" or not callable(raw) or not metas or len(metas) != len(self.descs):
            return False
        descs = {i: (name, fields) for i, name, _, fields in self.descs}
        subs = {i: (name, view) for i, name, view in self.subs}
        template, at_tensor, at_desc, metas = [], [], [], iter(metas)
        for i, val in enumerate(self.vals):
            if i in descs:
                name, fields = descs[i]
                meta = next(metas)
                if (meta is None or meta.get("fp4_padded") or fields.get("padding", "zero") != "zero"
                        or meta.get("elem_type") not in module.TMA_DTYPE_DEVICE_TO_HOST):
                    return False
                shape, strides = list(fields["shape"]), list(fields["strides"])
                static = (meta["swizzle"], meta["elem_size"], module.TMA_DTYPE_DEVICE_TO_HOST[meta["elem_type"]],
                          meta["block_size"], shape, strides, 0)
                at_desc.append((len(template), name, static, {}))
                template += [None, *shape, *strides]
            elif i in subs:
                at_tensor.append((len(template), *subs[i]))
                template.append(None)
            else:
                template.append(val)
        return (raw, _fill_tma(), launcher.launch_cooperative_grid, launcher.launch_pdl, template, tuple(at_tensor),
                tuple(at_desc))

    def _run_expanded(self, slots, kernel, how, stream):
        raw, fill, coop, pdl, template, at_tensor, at_desc = how
        args = template.copy()
        for pos, name, view in at_tensor:
            args[pos] = slots[name] if view is None else slots[name].view(view)
        for pos, name, static, maps in at_desc:
            ptr = slots[name].data_ptr()
            m = maps.get(ptr)
            if m is None:  # a map depends only on the base address and the (keyed) geometry
                if len(maps) >= MAPS_PER_DESCRIPTOR:
                    maps.clear()
                m = maps[ptr] = fill(ptr, *static)
            args[pos] = m
        g0, g1, g2 = self.grid3
        raw(g0, g1, g2, stream, kernel.function, coop, pdl, None, None, kernel.packed_metadata, None, None, None,
            *args)

    def __call__(self, slots):
        kernel = self.kernel
        if kernel is None:
            vals = self._vals(slots)
            self.fn[self.grid](*vals, **self.options)
            return
        device, stream, hooks = _triton()
        stream = stream(device())
        enter, leave = hooks.launch_enter_hook, hooks.launch_exit_hook
        # no hook to call: the launch takes None for the hooks and their metadata, as Triton's own launch does when
        # no enter hook is set (checked by _metadata_needs_hook); Triton 3.6 keeps empty hook chains instead of None
        quiet = _idle(enter) and _idle(leave) and _metadata_needs_hook(type(kernel))
        if quiet and self.expanded is not False:
            if self.expanded is None:
                self.expanded = self._expand()
            if self.expanded:
                STATS_DESC["encoded"] += 1
                return self._run_expanded(slots, kernel, self.expanded, stream)
        vals = self._vals(slots)
        if self.descs:
            STATS_DESC["through_triton"] += 1
        if quiet:
            meta = enter = leave = None
        else:
            meta = kernel.launch_metadata(self.grid, stream, *vals)
        g0, g1, g2 = self.grid3
        kernel.run(g0, g1, g2, stream, kernel.function, kernel.packed_metadata, meta, enter, leave, *vals)

    def _vals(self, slots):
        vals = self.vals.copy()
        for i, name, view in self.subs:
            vals[i] = slots[name] if view is None else slots[name].view(view)
        for i, name, cls, fields in self.descs:
            vals[i] = cls(slots[name], **fields)
        return vals


def _idle(hook) -> bool:
    """Whether a launch hook calls nothing: None, or an empty HookChain (Triton 3.6's default)."""
    return hook is None or (type(hook).__name__ == "HookChain" and type(getattr(hook, "calls", None)) is list
                            and not hook.calls)


class Plan:
    __slots__ = ("env", "prep", "launches", "result", "why")

    def __init__(self, env, prep, launches, result, why):
        self.env, self.prep, self.launches, self.result, self.why = env, prep, launches, result, why

    def env_unchanged(self) -> bool:
        return all(_RAW.get(key) == value for key, value in self.env)

    def replay(self, slots):
        """Runs the plan on the call's ``slots`` (a dict this adds the allocated and derived tensors to)."""
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
