"""Every use of a private Triton or CPython internal, in one place, behind a version gate.

Two fast paths rest on code that neither project promises to keep:

* **CPython's ``os.environ._data``** (its encoded store, kept in step by ``os.environ``'s setters and deleters, and
  ``os.environ.encodekey``): the knob registry (``knobs.py``), the per-call signature of ``elsa_surgery/callcache.py``
  and the launch plans' environment check (``replay.py``) read it, ~20x faster than ``os.environ.get`` (decoding).
  Public route: ``os.environ`` itself (string keys and values).
* **Triton's launcher internals** (``replay.py``'s direct replay): a compiled kernel's ``run``, ``function``,
  ``packed_metadata`` and ``launch_metadata``, the hook chains of ``triton.knobs.runtime``, the driver's
  ``fill_tma_descriptor``, the closure of the CUDA launcher that expands host TMA descriptors, and its C launcher's
  reading of an int pointer argument as the address (:func:`launcher_takes_ints`). Within a checked
  version ``replay.py`` still compares the installed Triton's source with the statements it repeats before it takes
  them. Public route: a replayed launch goes through ``kernel[grid](...)`` (Triton's own binding; the planning is
  still skipped), and the Hopper kernels keep their size threshold for eager calls.

On a Python or Triton version outside ``CHECKED_PYTHON`` / ``CHECKED_TRITON`` the public route runs and one log line
says so, once per process. Checked against: Triton 3.6.0 with torch 2.11 on Python 3.12 (the H100 machine: the GPU
test suite, docs/perf/history.md), Python 3.11 with Triton 3.8.0 and torch 2.14 (CPU; under ``TRITON_INTERPRET=1``
plans always launch through ``kernel[grid]``). On Triton 3.8 the direct launch statements still match the source
check but the descriptor expansion does not (Triton reorganised it), and the version was never run on a GPU: it is
not in ``CHECKED_TRITON``.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import sys
from typing import Optional

logger = logging.getLogger("elsa_surgery")

CHECKED_PYTHON = ((3, 11), (3, 12))
CHECKED_TRITON = ((3, 6),)

_logged: set = set()


def _log_once(what: str, version: str, checked) -> None:
    if what not in _logged:
        _logged.add(what)
        listed = ", ".join(".".join(map(str, v)) for v in checked)
        logger.info("elsa_surgery: %s %s was not checked against the private fast path (checked: %s); using the "
                    "public path", what, version, listed)


def python_version() -> tuple:
    return tuple(sys.version_info[:2])


def triton_version() -> Optional[tuple]:
    """``(major, minor)`` of the installed Triton, or None when it is not importable."""
    try:
        import triton
    except ImportError:
        return None
    try:
        return tuple(int(p) for p in triton.__version__.split(".")[:2])
    except (AttributeError, ValueError):
        return None


def python_private_ok(version: Optional[tuple] = None) -> bool:
    """Whether this Python's ``os.environ`` internals were checked (``version``: a stand-in, for tests)."""
    version = python_version() if version is None else tuple(version)
    if version in CHECKED_PYTHON:
        return True
    _log_once("Python", ".".join(map(str, version)), CHECKED_PYTHON)
    return False


_TRITON_OK: list = []  # the installed Triton's verdict, computed once


def triton_private_ok(version: Optional[tuple] = None) -> bool:
    """Whether the installed Triton's (or the stand-in ``version``'s) launcher internals were checked."""
    if version is None:
        if _TRITON_OK:
            return _TRITON_OK[0]
        found = triton_version()
        ok = found is not None and triton_private_ok(found)
        _TRITON_OK.append(ok)
        return ok
    version = tuple(version)[:2]
    if version in CHECKED_TRITON:
        return True
    _log_once("Triton", ".".join(map(str, version)), CHECKED_TRITON)
    return False


# --------------------------------------------------------------------------------------------------
# CPython: os.environ's encoded store
# --------------------------------------------------------------------------------------------------

def environ_store(version: Optional[tuple] = None):
    """``(store, encode)``: a mapping from encoded names to encoded values, or None when unset, and the function
    encoding a name for it. CPython's ``os.environ._data`` where checked, else ``os.environ`` itself."""
    raw, encode = getattr(os.environ, "_data", None), getattr(os.environ, "encodekey", None)
    if python_private_ok(version) and isinstance(raw, dict) and callable(encode):
        return raw, encode
    return os.environ, str


ENVIRON, ENCODE = environ_store()


# --------------------------------------------------------------------------------------------------
# Triton: the launcher internals a direct replay uses
# --------------------------------------------------------------------------------------------------

_RUNTIME = []  # (get_current_device, get_current_stream, knobs.runtime) of the installed Triton, fetched once


def runtime():
    """``(get_current_device, get_current_stream, knobs.runtime)`` of the installed Triton's active driver."""
    if not _RUNTIME:
        from triton import knobs
        from triton.runtime import driver

        _RUNTIME.append((driver.active.get_current_device, driver.active.get_current_stream, knobs.runtime))
    return _RUNTIME[0]


def fill_tma():
    """Triton's ``fill_tma_descriptor`` (the CUtensorMap encoder its launcher calls for host descriptors)."""
    from triton.runtime import driver

    return driver.active.utils.fill_tma_descriptor


def launcher_cls():
    """The active driver's launcher class (the compiled kernels' ``run``)."""
    from triton.runtime import driver

    return driver.active.launcher_cls


def closure(fn) -> dict:
    """The free variables of a Python closure by name (Triton's descriptor-wrapping launcher keeps its C launcher
    and descriptor metadata there)."""
    cells = getattr(fn, "__closure__", None) or ()
    return dict(zip(getattr(getattr(fn, "__code__", None), "co_freevars", ()), (c.cell_contents for c in cells)))


def idle(hook) -> bool:
    """Whether a launch hook calls nothing: None, or an empty HookChain (Triton 3.6's default)."""
    return hook is None or (type(hook).__name__ == "HookChain" and type(getattr(hook, "calls", None)) is list
                            and not hook.calls)


# The launch statements a direct replay repeats, each compared once with the installed Triton's source (within a
# checked version too: a patch release may change them)

# The launch statements of Triton's JITFunction.run (Triton 3.4 to 3.9 at least) that a direct replay repeats
RUN_SOURCE = ("launch_metadata = kernel.launch_metadata(grid, stream, *bound_args.values())",
               "kernel.run(grid_0, grid_1, grid_2, stream, kernel.function, kernel.packed_metadata, launch_metadata,",
               "knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, *bound_args.values())")


@functools.lru_cache(maxsize=None)
def launches_as_recorded(cls: type) -> bool:
    """Whether ``cls.run`` (a Triton JIT function class) launches with the statements a direct replay repeats."""
    try:
        src = " ".join(inspect.getsource(cls.run).split())
    except (AttributeError, OSError, TypeError):
        return False
    return all(s in src for s in RUN_SOURCE)


@functools.lru_cache(maxsize=None)
def metadata_needs_hook(cls: type) -> bool:
    """Whether ``cls.launch_metadata`` (Triton's CompiledKernel) returns None when no launch-enter hook is set, as
    Triton 3.4 to 3.9 do: a launch with no hook to call (None, or Triton 3.6's empty hook chains, see
    :func:`idle`) then replays with None for the metadata and both hooks, the combination Triton itself passes
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
DESC_SOURCE = {
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
DESC_UNEXPECTED = ("round_f32_to_tf32", "im2col")  # descriptor features the statements above do not reproduce
BASE_ARGS = 13  # gridX ... profile_scratch, packed metadata, launch metadata, both hooks


@functools.lru_cache(maxsize=None)
def desc_module(cls: type):
    """The driver module of ``cls`` (a compiled kernel's launcher class) when it expands host descriptors with the
    statements of ``DESC_SOURCE``, else None."""
    module = inspect.getmodule(cls)
    try:
        parts = {"make_tensordesc_arg": module.make_tensordesc_arg, "wrap_handle_tensordesc":
                 module.wrap_handle_tensordesc, "CudaLauncher.__call__": cls.__call__}
        src = {name: "".join(inspect.getsource(f).split()) for name, f in parts.items()}
        table, base = module.TMA_DTYPE_DEVICE_TO_HOST, module._BASE_ARGS_FORMAT_LEN
    except (AttributeError, OSError, TypeError):
        return None
    if base != BASE_ARGS or not isinstance(table, dict):
        return None
    if any(bad in src["make_tensordesc_arg"] for bad in DESC_UNEXPECTED):
        return None
    return module if all(s in src[name] for name, stmts in DESC_SOURCE.items() for s in stmts) else None


def expand_descriptors(kernel, vals, subs, descs, desc_module_of=desc_module, fill=fill_tma):
    """``(C launcher, map encoder, cooperative, pdl, template, tensor positions, their pointer_plan, descriptor
    positions)``: a compiled kernel's arguments expanded as Triton's launcher expands them, around placeholders for
    the call's tensors and maps (each descriptor position with its encoder arguments and its maps by base address);
    False when this Triton or kernel does not allow it (see ``DESC_SOURCE``). ``vals``: the recorded arguments, ``subs``
    ``(position, slot, view dtype)`` of the tensors, ``descs`` ``(position, slot, class, fields)`` of the host
    descriptors; ``desc_module_of`` and ``fill``: :func:`desc_module` and :func:`fill_tma` (tests stand in)."""
    launcher = kernel.run
    module = desc_module_of(type(launcher))
    scratch = getattr(launcher, "global_scratch_size", 1) or getattr(launcher, "profile_scratch_size", 1)
    if module is None or scratch:
        return False
    inner = launcher.launch
    free = closure(inner)
    raw, metas = free.get("launcher"), free.get("tensordesc_meta")
    if getattr(inner, "__name__", "") != "inner" or not callable(raw) or not metas or len(metas) != len(descs):
        return False
    descs = {i: (name, fields) for i, name, _, fields in descs}
    subs = {i: (name, view) for i, name, view in subs}
    template, at_tensor, at_desc, metas = [], [], [], iter(metas)
    for i, val in enumerate(vals):
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
    return (raw, fill(), launcher.launch_cooperative_grid, launcher.launch_pdl, template, tuple(at_tensor),
            pointer_plan(at_tensor), tuple(at_desc))


def launch_expanded(how, kernel, grid3, stream, slots, maps_per_descriptor: int, ints: bool = False) -> None:
    """Launches ``kernel`` through the C launcher of ``how`` (:func:`expand_descriptors`) on the call's ``slots``,
    encoding a descriptor's map once per base address (at most ``maps_per_descriptor`` kept); ``ints``: tensors handed
    over as their addresses (:func:`launcher_takes_ints`)."""
    raw, fill, coop, pdl, template, at_tensor, plan, at_desc = how
    if ints:
        args = pointer_args(template, plan, slots)
    else:
        args = template.copy()
        for pos, name, view in at_tensor:
            args[pos] = tensor_arg(slots, name, view)
    for pos, name, static, maps in at_desc:
        ptr = slots[name].data_ptr()
        m = maps.get(ptr)
        if m is None:  # a map depends only on the base address and the (keyed) geometry
            if len(maps) >= maps_per_descriptor:
                maps.clear()
            m = maps[ptr] = fill(ptr, *static)
        args[pos] = m
    g0, g1, g2 = grid3
    raw(g0, g1, g2, stream, kernel.function, coop, pdl, None, None, kernel.packed_metadata, None, None, None, *args)


# How the driver's C launcher reads a pointer argument (Triton 3.6's getPointer template in driver.py, 3.8's
# extractPointer in driver.c): a Python int is taken as the address itself; anything else has its data_ptr() called and
# the address checked by the driver (cuPointerGetAttribute), per argument and launch. A replay's key fixes each tensor's
# device, so a replay may hand over the addresses (one data_ptr() per tensor, not per argument: the scan kernel
# receives q in place of every pointer it does not read).
POINTER_FUNCTIONS = ("getPointer(PyObject*obj", "extractPointer(void*ptr,PyObject*obj)")
POINTER_INT_TEST = "if(PyLong_Check(obj))"


@functools.lru_cache(maxsize=None)
def launcher_takes_ints(cls: type) -> bool:
    """Whether the C launcher of ``cls`` (a compiled kernel's launcher class) takes a Python int for a pointer argument
    as the address, before any data_ptr() call (``POINTER_FUNCTIONS``, read in its driver's source: the module and a
    ``driver.c`` beside it)."""
    try:
        path = inspect.getsourcefile(inspect.getmodule(cls))
        texts = [open(path).read()]
        c_path = os.path.join(os.path.dirname(path), "driver.c")
        if os.path.exists(c_path):
            texts.append(open(c_path).read())
    except (OSError, TypeError):
        return False
    for text in texts:
        flat = "".join(text.split())
        for fn in POINTER_FUNCTIONS:
            at = flat.find(fn)
            if at < 0:
                continue
            body = flat[at:flat.find("data_ptr", at)]
            return POINTER_INT_TEST in body
    return False


class Carved(tuple):
    """A launch argument that is a piece of a slot: ``(shape, strides, offset, byte offset)`` of the view
    ``slot.as_strided(shape, strides, offset)`` (partition states carved from one allocation: ``replay.carved``)."""

    __slots__ = ()


def tensor_arg(slots, name, view):
    """The tensor a launch receives for slot ``name``: the slot, its dtype view (``view`` a dtype) or a piece of it
    (``view`` a :class:`Carved`)."""
    t = slots[name]
    if view is None:
        return t
    if type(view) is Carved:
        return t.as_strided(view[0], view[1], view[2])
    return t.view(view)


def pointer_plan(subs) -> tuple:
    """``subs`` ``(position, slot, view)`` grouped for :func:`pointer_args`: ``((slot, ((position, byte offset), ...)),
    ...)`` (a dtype view shares its base's address, a carved piece adds its byte offset)."""
    at: dict = {}
    for i, name, view in subs:
        at.setdefault(name, []).append((i, view[3] if type(view) is Carved else 0))
    return tuple((name, tuple(pos)) for name, pos in at.items())


def pointer_args(vals, plan, slots) -> list:
    """``vals`` with the call's tensors placed as their addresses (:func:`launcher_takes_ints`), one data_ptr() per
    slot; ``plan``: :func:`pointer_plan` of the launch's tensor arguments."""
    vals = vals.copy()
    for name, at in plan:
        p = slots[name].data_ptr()
        for i, off in at:
            vals[i] = p + off
    return vals


def quiet(kernel, enter, leave) -> bool:
    """No hook to call: the launch takes None for the hooks and their metadata, as Triton's own launch does when
    no enter hook is set (checked by :func:`metadata_needs_hook`); Triton 3.6 keeps empty hook chains instead of
    None."""
    return idle(enter) and idle(leave) and metadata_needs_hook(type(kernel))


def launch_compiled(kernel, grid, grid3, stream, hooks, vals) -> None:
    """``kernel.run(...)`` as Triton's ``JITFunction.run`` calls it (``RUN_SOURCE``); ``hooks``: ``(enter, exit)``,
    or None when :func:`quiet` (no metadata built)."""
    if hooks is None:
        meta = enter = leave = None
    else:
        enter, leave = hooks
        meta = kernel.launch_metadata(grid, stream, *vals)
    g0, g1, g2 = grid3
    kernel.run(g0, g1, g2, stream, kernel.function, kernel.packed_metadata, meta, enter, leave, *vals)


PTXAS_ENV = "TRITON_PTXAS_PATH"
_ptxas_matched: list = []  # [reason]: match_inductor_ptxas ran (once a process)


def torch_ptxas():
    """The ptxas that Inductor's compile workers give Triton (``TRITON_PTXAS_PATH``): ``torch/bin/ptxas``, the rule of
    ``torch._inductor.runtime.compile_tasks._set_triton_ptxas_path`` (torch 2.11-2.14; importing it here would
    import Inductor, ~2 s). None where torch ships none (CPU and ROCm wheels) or it is not executable."""
    import torch

    path = os.path.join(os.path.dirname(os.path.abspath(torch.__file__)), "bin", "ptxas")
    return path if os.path.isfile(path) and os.access(path, os.X_OK) else None


def triton_compiled_yet() -> Optional[bool]:
    """Whether Triton has already found the version of its ptxas in this process (its compile cache key holds that
    version, read once: ``triton.backends.nvidia.compiler.get_ptxas_version``'s cache, a private detail); None where
    that cannot be told (another Triton)."""
    try:
        from triton.backends.nvidia import compiler
    except ImportError:
        return None
    info = getattr(compiler.get_ptxas_version, "cache_info", None)
    return None if info is None else info().currsize > 0


def match_inductor_ptxas() -> str:
    """Points Triton at the ptxas that Inductor's compile workers use, once a process, before the first ELSA kernel
    compiles (``kernels/replay.launch``): sets ``TRITON_PTXAS_PATH`` to torch's ptxas where torch ships one, the
    variable is unset and Triton has compiled nothing yet. Returns what was done (logged at INFO).

    Why (session 42, H100, torch 2.11): a cold ``torch.compile`` of a converted model compiles the ELSA kernels in
    Inductor's workers, which set the variable to torch's ptxas (CUDA 13.0 there); a warm start serves the graph
    from Inductor's cache but compiles user-defined Triton kernels again in this process (Inductor bundles only
    its own), with Triton's ptxas (CUDA 12.8) when the variable is unset. The ptxas version is part of Triton's
    cache key, so the first warm process compiled every ELSA kernel from scratch: Swin-T fp32 6.3 s against 3.5 s
    for the next. Eager kernels then compile with torch's ptxas as well, the one Inductor's kernels use. A set
    variable is left alone (a user's choice, or ``TRITON_PTXAS_PATH`` pointing at Triton's own to opt out)."""
    if _ptxas_matched:
        return _ptxas_matched[0]
    if os.environ.get(PTXAS_ENV) is not None:
        reason = f"{PTXAS_ENV} already set: left alone"
    else:
        path = torch_ptxas()
        compiled = triton_compiled_yet()
        if path is None:
            reason = "torch ships no ptxas: Triton's own is used"
        elif compiled is None or compiled:
            reason = ("Triton compiled a kernel before the first ELSA kernel (or its ptxas version cache is not the "
                      f"one known): {PTXAS_ENV} left unset, so a warm torch.compile start may compile the ELSA "
                      "kernels again")
        else:
            os.environ[PTXAS_ENV] = path
            reason = f"{PTXAS_ENV}={path} (the ptxas Inductor's compile workers use)"
    _ptxas_matched.append(reason)
    logger.info("elsa_surgery: %s", reason)
    return reason


def settle_cache_keys(namespace: dict) -> int:
    """Computes the cache key of every Triton function defined in ``namespace`` (a kernel module's globals) callees
    first, so that it does not depend on which one a process happened to compute first; returns how many passes it
    took. Triton 3.6 (``DependenciesFinder._update_hash``; 3.8 computes the callee's key first) merges a called
    function's global constexprs into its caller's key only when the callee's key was computed before the caller's:
    session 55 found ``elsa_fwd``'s key different in a cold ``torch.compile`` process (torch's analysis computed its
    helpers' keys first) and in a warm one (``elsa_fwd``'s own first), and the warm start compiled it again. Passes
    from scratch until no key changes: each pass completes one more level of calls. Never raises (a Triton whose keys
    cannot be computed so: logged, -1; the keys are then computed as Triton computes them)."""
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:
        return 0
    fns = [f for f in namespace.values() if isinstance(f, JITFunction) and f.__module__ == namespace.get("__name__")]
    before, passes = None, 0
    try:
        while passes < 16:
            for f in fns:
                f.hash = None
            keys = [f.cache_key for f in fns]
            passes += 1
            if keys == before:
                break
            before = keys
    except Exception as e:  # noqa: BLE001 - the keys' stability across processes, not the kernels' use
        for f in fns:
            f.hash = None
        logger.info("elsa_surgery: the Triton cache keys of %s were not settled (%s: %s); a warm torch.compile start "
                    "may compile its kernels again", namespace.get("__name__"), type(e).__name__, e)
        return -1
    return passes
