"""The version gate of kernels/internals.py (every private Triton / CPython internal the project uses), on the CPU
with stand-in versions: a checked version takes the private fast path, any other the public one, with one log line
per process."""

import logging
import os

import pytest
import torch

from elsa_surgery.kernels import internals, replay


@pytest.fixture
def fresh_gate(monkeypatch):
    monkeypatch.setattr(internals, "_logged", set())
    monkeypatch.setattr(internals, "_TRITON_OK", [])


def test_python_gate_picks_the_private_store_only_where_checked(fresh_gate, caplog):
    checked = internals.CHECKED_PYTHON[0]
    store, encode = internals.environ_store(checked)
    if isinstance(getattr(os.environ, "_data", None), dict):
        assert store is os.environ._data and encode("ELSA_HOPPER") == os.environ.encodekey("ELSA_HOPPER")
    with caplog.at_level(logging.INFO, logger="elsa_surgery"):
        store, encode = internals.environ_store((3, 99))
        assert store is os.environ and encode("ELSA_HOPPER") == "ELSA_HOPPER"
        internals.environ_store((3, 99))
        internals.python_private_ok((3, 98))
    lines = [r.getMessage() for r in caplog.records if "not checked" in r.getMessage()]
    assert len(lines) == 1 and "Python 3.99" in lines[0] and "public path" in lines[0]


def test_public_store_reads_like_the_private_one(monkeypatch):
    """The knob registry and the call memo read raw values from either store; both agree on what is set."""
    monkeypatch.setenv("ELSA_HOPPER", "force")
    private, enc = internals.environ_store(internals.CHECKED_PYTHON[0])
    public, penc = internals.environ_store((2, 7))
    raw = private.get(enc("ELSA_HOPPER"))
    assert (raw.decode() if isinstance(raw, bytes) else raw) == public.get(penc("ELSA_HOPPER")) == "force"


def test_triton_gate_with_stand_in_versions(fresh_gate, caplog):
    with caplog.at_level(logging.INFO, logger="elsa_surgery"):
        assert internals.triton_private_ok(internals.CHECKED_TRITON[0])
        assert internals.triton_private_ok((3, 6, 0))  # patch releases of a checked minor version
        assert not internals.triton_private_ok((3, 99))
        assert not internals.triton_private_ok((3, 99))
    lines = [r.getMessage() for r in caplog.records if "not checked" in r.getMessage()]
    assert len(lines) == 1 and "Triton 3.99" in lines[0]


def test_installed_triton_is_judged_once(fresh_gate, monkeypatch):
    calls = []
    monkeypatch.setattr(internals, "triton_version", lambda: calls.append(1) or (3, 99))
    assert not internals.triton_private_ok() and not internals.triton_private_ok()
    assert calls == [1]


def _recorded_launch(monkeypatch, gate_open: bool):
    """A launch recorded with a stand-in compiled kernel that passes the source checks: the gate decides whether the
    plan keeps it (direct replay through Triton's launcher) or launches through ``kernel[grid]``."""
    monkeypatch.setattr(internals, "_TRITON_OK", [gate_open])
    monkeypatch.setattr(replay, "_direct_ok", lambda fn, kernel: True)

    class Fn:  # a JIT function's Python signature
        fn = staticmethod(lambda x, n: None)

    rec = replay._Recorder({"x": torch.zeros(4)})
    rec.add(Fn(), object(), (1,), (rec.slots["x"], 4), {})
    (one,) = rec.launches
    return one


def test_unchecked_triton_replays_through_the_public_launch(monkeypatch):
    assert _recorded_launch(monkeypatch, True).kernel is not None
    assert _recorded_launch(monkeypatch, False).kernel is None


def test_descriptor_encoding_needs_a_checked_triton(monkeypatch):
    """Hopper's size threshold for eager calls is lifted only where replays encode TMA maps: never on an unchecked
    Triton (``encodes_descriptors``), whatever the source checks say."""
    monkeypatch.setattr(internals, "_TRITON_OK", [False])
    monkeypatch.setattr(replay, "wanted", lambda t: True)
    monkeypatch.setattr(replay, "_desc_module", lambda cls: object())
    assert not replay.encodes_descriptors(torch.zeros(1))


class _Cache:
    """Stands in for ``get_ptxas_version``'s lru_cache: ``currsize`` entries."""

    def __init__(self, currsize):
        self.currsize = currsize

    def cache_info(self):
        return self


@pytest.fixture
def fresh_ptxas(monkeypatch, tmp_path):
    """No match made yet, TRITON_PTXAS_PATH unset, and an executable stand-in for torch's ptxas."""
    from triton.backends.nvidia import compiler

    monkeypatch.setattr(internals, "_ptxas_matched", [])
    monkeypatch.delenv(internals.PTXAS_ENV, raising=False)
    ptxas = tmp_path / "ptxas"
    ptxas.write_text("#!/bin/sh\n")
    ptxas.chmod(0o755)
    monkeypatch.setattr(internals, "torch_ptxas", lambda: str(ptxas))
    monkeypatch.setattr(compiler, "get_ptxas_version", _Cache(0), raising=False)
    return ptxas


def test_torch_ptxas_follows_inductors_rule():
    """The path is the one Inductor's workers set (torch/bin/ptxas), found without importing Inductor."""
    compile_tasks = pytest.importorskip("torch._inductor.runtime.compile_tasks")
    want = os.path.join(os.path.dirname(os.path.abspath(compile_tasks.__file__)), "..", "..", "bin", "ptxas")
    got = internals.torch_ptxas()
    if os.path.isfile(want) and os.access(want, os.X_OK):
        assert got == os.path.abspath(want)
    else:
        assert got is None  # (CPU and ROCm wheels)


def test_ptxas_matched_before_triton_compiles(fresh_ptxas, monkeypatch, caplog):
    with caplog.at_level(logging.INFO, logger="elsa_surgery"):
        reason = internals.match_inductor_ptxas()
    assert os.environ[internals.PTXAS_ENV] == str(fresh_ptxas)
    assert "Inductor's compile workers" in reason and reason in caplog.text
    monkeypatch.delenv(internals.PTXAS_ENV)
    assert internals.match_inductor_ptxas() == reason  # once a process: not set again
    assert internals.PTXAS_ENV not in os.environ


@pytest.mark.parametrize("case", ["user set it", "triton compiled first", "no ptxas in torch"])
def test_ptxas_left_alone(fresh_ptxas, monkeypatch, case):
    from triton.backends.nvidia import compiler

    if case == "user set it":
        monkeypatch.setenv(internals.PTXAS_ENV, "/opt/my/ptxas")
    elif case == "triton compiled first":  # its cache key already holds its own ptxas's version
        monkeypatch.setattr(compiler, "get_ptxas_version", _Cache(1), raising=False)
    else:
        monkeypatch.setattr(internals, "torch_ptxas", lambda: None)
    reason = internals.match_inductor_ptxas()
    assert os.environ.get(internals.PTXAS_ENV) == ("/opt/my/ptxas" if case == "user set it" else None)
    assert {"user set it": "already set", "triton compiled first": "left unset",
            "no ptxas in torch": "ships no ptxas"}[case] in reason


def test_first_launch_matches_ptxas_unless_interpreting(fresh_ptxas, monkeypatch):
    """kernels/replay.launch makes the match before the first compiled launch; under TRITON_INTERPRET it does not."""
    calls = []
    monkeypatch.setattr(internals, "match_inductor_ptxas", lambda: calls.append(1))

    class _Fn:
        def __getitem__(self, grid):
            return lambda *a, **k: None

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    replay.launch(_Fn(), (1,))
    assert calls == []
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    replay.launch(_Fn(), (1,))
    assert calls == [1]



_CACHE_KEY_ORDER = r"""
import json
from triton.runtime import jit
from elsa_surgery.kernels import backward, hopper, hopper_backward, internals, scan
unsettled = [f"{m.__name__}.{n}" for m in (scan, backward, hopper, hopper_backward) for n, f in vars(m).items()
             if isinstance(f, jit.JITFunction) and f.__module__ == m.__name__ and f.hash is None]
ours = [f for f in vars(scan).values() if isinstance(f, jit.JITFunction) and f.__module__ == scan.__name__]
settled = {f.__name__: f.cache_key for f in ours}  # (at import: 3.8's finder)


def triton36_update_hash(self, func):  # (3.6's order: the callee's globals read before its key is computed)
    self.used_global_vals.update(func.used_global_vals)
    self.hasher.update((func.cache_key + str(getattr(func, "noinline", False))).encode("utf-8"))


def fresh():
    for f in ours:
        f.hash, f.used_global_vals = None, {}


real = jit.DependenciesFinder._update_hash
jit.DependenciesFinder._update_hash = triton36_update_hash
fresh()
kernel_first = scan.elsa_fwd.cache_key
fresh()
for f in ours:
    if f is not scan.elsa_fwd:
        f.cache_key  # (helpers first, as torch's analysis of a traced launch computes them)
helpers_first = scan.elsa_fwd.cache_key
fresh()
scan.elsa_fwd.cache_key  # (the order that gave the other key)
passes = internals.settle_cache_keys(vars(scan))
settled36 = scan.elsa_fwd.cache_key
jit.DependenciesFinder._update_hash = real
print(json.dumps(dict(unsettled=unsettled, kernel_first=kernel_first, helpers_first=helpers_first,
                      settled36=settled36, passes=passes, settled=settled["elsa_fwd"])))
"""


def test_kernel_cache_keys_do_not_depend_on_the_order_they_were_computed_in():
    """``internals.settle_cache_keys`` (run at the import of each kernel module) gives every ELSA kernel the
    Triton cache key computed callees first. Triton 3.6's ``DependenciesFinder._update_hash`` merged a called
    function's global constexprs into the caller's key only when the callee's key was computed already (3.8 computes
    it first), emulated here in a process of its own (compiled Triton functions, not the interpreter's; no GPU
    needed): ``elsa_fwd``'s key computed before its helpers' differs from the one computed after them (session 55: a
    warm ``torch.compile`` start compiled it again, its key not the cold process's), and settling gives the latter
    whatever was computed before, the key settling at import gave under this Triton's own finder."""
    import json
    import subprocess
    import sys

    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, "-c", _CACHE_KEY_ORDER], capture_output=True, text=True, env=env,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["unsettled"] == [], got  # (every kernel module settles its keys at import)
    assert got["kernel_first"] != got["helpers_first"], got  # (the emulation shows the order dependence)
    assert got["settled36"] == got["helpers_first"] and got["passes"] >= 2, got
    assert got["settled"] == got["helpers_first"], got  # (what settling at import gave: the same key)


def test_cache_keys_not_settled_are_logged_not_raised(monkeypatch, caplog):
    """A Triton whose keys cannot be computed so (here: computing one raises) leaves the kernel module importable:
    ``settle_cache_keys`` logs why, returns -1 and leaves the keys to Triton."""
    pytest.importorskip("triton")
    from triton.runtime import jit

    def kernel(x):
        return x

    namespace = {"__name__": __name__, "kernel": jit.JITFunction(kernel)}

    def broken(self):
        raise RuntimeError("no key here")

    monkeypatch.setattr(jit.JITFunction, "cache_key", property(broken))
    with caplog.at_level(logging.INFO, logger="elsa_surgery"):
        assert internals.settle_cache_keys(namespace) == -1
    assert namespace["kernel"].hash is None
    assert any("were not settled" in r.getMessage() and "no key here" in r.getMessage() for r in caplog.records)


def test_launcher_takes_ints_reads_the_drivers_pointer_extraction(tmp_path, monkeypatch):
    """A replay hands Triton's C launcher the tensors' addresses only where the driver's source shows that the
    launcher takes an int as the address before it calls data_ptr() (Triton 3.6: the getPointer template in
    driver.py; 3.8: extractPointer in driver.c); a launcher that does not, or a source that cannot be read, gets the
    tensors."""
    import importlib.util
    import sys

    from triton.backends.nvidia import driver

    assert internals.launcher_takes_ints(driver.CudaLauncher)  # the installed Triton's
    for name, test, want in (("takes_ints", "if (PyLong_Check(obj)) {\n    return addr(obj);\n  }", True),
                             ("calls_data_ptr", "", False)):
        path = tmp_path / f"{name}.py"
        path.write_text('SRC = """\nstatic inline DevicePtrInfo getPointer(PyObject *obj, int idx) {\n  '
                        + test + '\n  PyObject *ptr = PyObject_GetAttrString(obj, "data_ptr");\n}\n"""\n\n\n'
                        'class Launcher:\n    pass\n')
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, name, module)
        spec.loader.exec_module(module)
        assert internals.launcher_takes_ints(module.Launcher) is want
    assert internals.launcher_takes_ints(int) is False  # (a built-in: no source)


class _Ptr:
    """A tensor stand-in that counts its data_ptr() calls."""

    def __init__(self, addr):
        self.addr, self.calls = addr, 0

    def data_ptr(self):
        self.calls += 1
        return self.addr


@pytest.mark.parametrize("ints", [True, False])
def test_direct_replay_hands_the_launcher_addresses_where_it_takes_them(monkeypatch, ints):
    """A direct replay with no launch hook gives the C launcher each tensor's address, read once per tensor however
    many arguments it fills (the scan kernel receives q for every pointer it does not read); where the launcher does
    not take ints, the tensors themselves."""
    import types

    got = []

    class Kernel:
        function, packed_metadata = "function", "metadata"

        @staticmethod
        def run(*args):
            got.append(args)

    monkeypatch.setattr(replay, "_triton", lambda: (lambda: 0, lambda device: 7, types.SimpleNamespace(
        launch_enter_hook=None, launch_exit_hook=None)))
    monkeypatch.setattr(internals, "quiet", lambda kernel, enter, leave: True)
    monkeypatch.setattr(replay, "_launcher_takes_ints", lambda cls: ints)
    slots = {"q": _Ptr(4096), "out": _Ptr(8192)}
    one = replay._Launch(None, Kernel(), (2, 3), [None, None, None, 5, "C"], [(0, "q", None), (1, "out", None),
                                                                           (2, "q", None)], (), {})
    before = replay.STATS_POINTERS["addresses"]
    one(slots)
    (args,) = got
    assert args[:9] == (2, 3, 1, 7, "function", "metadata", None, None, None)
    if ints:
        assert list(args[9:]) == [4096, 8192, 4096, 5, "C"] and slots["q"].calls == 1
        assert replay.STATS_POINTERS["addresses"] == before + 1
    else:
        assert list(args[9:]) == [slots["q"], slots["out"], slots["q"], 5, "C"] and slots["q"].calls == 0
    plan = internals.pointer_plan
    assert internals.pointer_args([None, 1], plan([(0, "q", torch.int32)]), slots) == [4096, 1]
    piece = internals.Carved(((2, 3), (3, 1), 5, 20))  # a piece of a slot: its address plus the byte offset
    assert internals.pointer_args([None, None], plan([(0, "q", piece), (1, "q", None)]), slots) == [4116, 4096]
    base = torch.arange(12.0)
    assert torch.equal(internals.tensor_arg({"b": base}, "b", piece), base[5:11].view(2, 3))
