"""Launch plans (kernels/replay.py): a call's launches recorded once, replayed for later calls of its signature.

On the CPU the kernels run in the Triton interpreter with ``ELSA_LAUNCH_PLANS=1`` (plans are on by default for
CUDA tensors only); a replay there launches through ``kernel[grid]``. Every replay test first calls on *decoy*
tensors of the same geometry, then on the real ones, and checks the real call against the float64 oracle
through poisoned outputs: a replay that kept a tensor of the first call, dropped a launch or skipped an
allocation fails.
"""

import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import elsa_surgery
from elsa_surgery.kernels import launch, occupancy as occ, replay
from oracle import decoy
from oracle import rel_err as rel

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET", "") in ("", "0") and not torch.cuda.is_available(),
    reason="needs CUDA or TRITON_INTERPRET=1",
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 2e-6, torch.float16: 5e-3, torch.bfloat16: 2e-2}


@pytest.fixture(autouse=True)
def plans_on(monkeypatch):
    monkeypatch.setenv(replay.ENV, "1")
    replay.clear()
    for k in replay.STATS:
        monkeypatch.setitem(replay.STATS, k, 0)
    yield
    replay.clear()


def rand(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=torch.float64).to(dtype).to(DEV)


def poison(shape, dtype):
    return torch.full(shape, float("nan"), dtype=dtype, device=DEV)


def replayed(call):
    """Runs ``call(decoy=True)`` then ``call(decoy=False)``; returns the second result and the stats' change."""
    call(True)
    before = dict(replay.STATS)
    res = call(False)
    return res, {k: replay.STATS[k] - before[k] for k in before}


CASES = {
    "fp32": dict(shape=(2, 2, 70, 32), dtype=torch.float32),
    "fp16 causal Nq<Nk": dict(shape=(1, 2, 40, 16), nk=90, dtype=torch.float16, is_causal=True),
    "bf16 gqa": dict(shape=(2, 4, 33, 24), hkv=1, dtype=torch.bfloat16),
    "bool mask": dict(shape=(2, 2, 50, 16), mask="bool"),
    "windowed additive mask": dict(shape=(4, 2, 49, 16), mask="window"),
    "lengths": dict(shape=(3, 2, 60, 16), lengths=True),
    "partitions": dict(shape=(1, 2, 8, 32), nk=600, parts=3),
    "no lse, dv != d": dict(shape=(1, 2, 45, 16), dv=40, want_lse=False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_replay_matches_the_oracle(case):
    c = CASES[case]
    B, H, N, D = c["shape"]
    dtype = c.get("dtype", torch.float32)
    nk, hkv, dv = c.get("nk", N), c.get("hkv", H), c.get("dv", D)
    q, k, v = rand(B, H, N, D, dtype=dtype), rand(B, hkv, nk, D, dtype=dtype), rand(B, hkv, nk, dv, dtype=dtype)
    mask = None
    if c.get("mask") == "bool":
        mask = torch.rand(B, 1, N, nk, device=DEV) > 0.3
    elif c.get("mask") == "window":
        mask = torch.randn(2, H, N, nk, device=DEV).to(dtype)
        mask[1, :, :, ::3] = float("-inf")
    ql = kl = None
    if c.get("lengths"):
        ql = torch.tensor([60, 17, 0], device=DEV, dtype=torch.int32)  # canonical lengths (semantics.py)
        kl = torch.tensor([5, 60, 30], device=DEV, dtype=torch.int32)
    want_lse = c.get("want_lse", True)

    def call(use_decoy):
        t = decoy if use_decoy else (lambda x: x)
        out = poison((B, H, N, dv), dtype)
        lse = poison((B, H, N), torch.float32) if want_lse else None
        launch.attention(t(q), t(k), t(v), scale=0.3, mask=t(mask), is_causal=c.get("is_causal", False),
                         q_lengths=ql, kv_lengths=kl, precision="strict" if dtype == torch.float32 else None,
                         return_lse=want_lse, out=out, lse=lse, num_partitions=c.get("parts"))
        return out, lse

    (out, lse), stats = replayed(call)
    assert stats == {"recorded": 0, "replayed": 1, "not_replayable": 0}, stats
    ref_mask = None if mask is None else (mask if mask.dtype == torch.bool else mask.double())
    if c.get("mask") == "window":
        ref_mask = ref_mask.repeat(B // 2, 1, 1, 1)
    ref, ref_lse = elsa_surgery.attention(q.double(), k.double(), v.double(), ref_mask, scale=0.3,
                                          is_causal=c.get("is_causal", False), enable_gqa=True, return_lse=True,
                                          q_lengths=ql, kv_lengths=kl, backend="reference")
    assert not out.isnan().any()
    assert rel(out, ref) <= TOL[dtype], rel(out, ref)
    if want_lse:
        fin = torch.isfinite(ref_lse)
        assert torch.equal(torch.isfinite(lse), fin) and rel(lse[fin], ref_lse[fin]) <= 1e-5


@pytest.mark.parametrize("merge", ["kernel", "fused"])
def test_replay_allocates_outputs_and_partition_states(merge, monkeypatch):
    """Outputs the planner allocated (out, lse, the partition states of a split call) come new from each replay; the
    three partition states are pieces of one allocation, each at a 16-byte boundary. A packed call (8 query rows a K/V
    head) whose merge is fused into its one launch carves them from its stream's scratch, beside its ticket counters
    (``merge_count``): each replay looks both up (``launch.merge_scratch``) instead of allocating."""
    monkeypatch.setenv("ELSA_DECODE_MERGE", merge)
    replay.clear()
    q, k, v = rand(1, 2, 8, 32), rand(1, 2, 600, 32), rand(1, 2, 600, 32)
    first, _ = launch.attention(decoy(q), decoy(k), decoy(v), scale=0.2, precision="strict", num_partitions=3)
    before = replay.STATS["replayed"]
    out, lse = launch.attention(q, k, v, scale=0.2, precision="strict", num_partitions=3)
    assert replay.STATS["replayed"] == before + 1
    assert out.data_ptr() != first.data_ptr() and out.stride() == first.stride()
    ref, ref_lse = elsa_surgery.attention(q.double(), k.double(), v.double(), scale=0.2, return_lse=True,
                                          backend="reference")
    assert rel(out, ref) <= 2e-6 and rel(lse, ref_lse) <= 1e-6
    (plan,) = replay._plans.values()
    fused = merge == "fused"
    prep = dict(plan.prep)
    assert set(prep) == {"out", "lse", "part"} | ({"merge_count"} if fused else set())
    assert callable(prep["part"]) == fused and all(callable(prep[n]) for n in prep if n == "merge_count")
    assert len(plan.launches) == (1 if fused else 2)  # phase 1 and the merge
    pieces = {view for one in plan.launches for _, name, view in one.subs if name == "part"}
    n = 3 * 2 * 8  # partitions x batch·heads x rows
    assert sorted((v[0], v[2]) for v in pieces) == [((3, 2, 8), 0), ((3, 2, 8), 48), ((3, 2, 8, 32), 96)]
    assert all(v[3] % 16 == 0 and v[3] == 4 * v[2] for v in pieces) and n == 48


def test_inference_op_replays_the_eager_calls_plan():
    """The inference op hands the launcher no output where the launcher's own has the op's layout: an eager call
    and the op (what a compiled no-grad graph calls) share one launch plan, and the op's output has the layout its
    fake declares."""
    from elsa_surgery.kernels import ops

    q, k, v = rand(2, 2, 24, 16), rand(2, 2, 24, 16), rand(2, 2, 24, 16)
    eager, _ = launch.attention(decoy(q), decoy(k), decoy(v), scale=0.25, precision="strict", is_causal=True,
                                return_lse=False)
    before = dict(replay.STATS)
    out, lse = ops.attention_inference_op(q, k, v, None, None, None, 0.25, True, "strict", False)
    assert replay.STATS["replayed"] == before["replayed"] + 1 and replay.STATS["recorded"] == before["recorded"]
    assert out.stride() == ops.dense_out(q, v).stride() == eager.stride() and lse.numel() == 0
    ref = elsa_surgery.attention(q.double(), k.double(), v.double(), scale=0.25, is_causal=True, backend="reference")
    assert rel(out, ref) <= 2e-6


def test_state_and_varlen_calls_replay():
    q, k, v = rand(2, 2, 30, 16), rand(2, 2, 50, 16), rand(2, 2, 50, 16)
    launch.attention_state(decoy(q), decoy(k), decoy(v), scale=0.25)
    before = replay.STATS["replayed"]
    m, S, W = launch.attention_state(q, k, v, scale=0.25)
    out, _ = elsa_surgery.monoid.finalize(elsa_surgery.monoid.State(m, S, W))
    ref = elsa_surgery.attention(q.double(), k.double(), v.double(), scale=0.25, backend="reference")
    assert replay.STATS["replayed"] == before + 1 and rel(out, ref) <= 2e-6

    lens = [17, 40, 3]
    cu = torch.tensor([0, 17, 57, 60], device=DEV, dtype=torch.int32)
    qp, kp, vp = rand(60, 2, 16), rand(60, 2, 16), rand(60, 2, 16)
    launch.attention_varlen(decoy(qp), decoy(kp), decoy(vp), cu, cu, 40, 40, scale=0.25, is_causal=True)
    before = replay.STATS["replayed"]
    out, lse = launch.attention_varlen(qp, kp, vp, cu, cu, 40, 40, scale=0.25, is_causal=True)
    assert replay.STATS["replayed"] == before + 1
    s = 0
    for n in lens:
        sl = slice(s, s + n)
        ref = elsa_surgery.attention(*(t[sl].transpose(0, 1).double() for t in (qp, kp, vp)), scale=0.25,
                                     is_causal=True, backend="reference")
        assert rel(out[sl].transpose(0, 1), ref) <= 2e-6
        s += n


def test_new_plan_for_other_alignment_environment_or_scale():
    """Whatever the planner or Triton's specialisation reads is in the key or checked: a pointer off the 16-byte
    grid, an environment knob the planner read, another scale: planned again, and right."""
    q, k, v = rand(1, 2, 40, 16, dtype=torch.float16), rand(1, 2, 40, 16, dtype=torch.float16), \
        rand(1, 2, 40, 16, dtype=torch.float16)
    ref = elsa_surgery.attention(q.double(), k.double(), v.double(), scale=0.25, backend="reference")
    launch.attention(q, k, v, scale=0.25)
    buf = torch.empty(q.numel() + 1, dtype=q.dtype, device=DEV)
    q_off = buf[1:].view(q.shape).copy_(q)  # 2 bytes off the 16-byte grid
    assert q_off.data_ptr() % 16 != q.data_ptr() % 16
    before = dict(replay.STATS)
    out, _ = launch.attention(q_off, k, v, scale=0.25)
    assert replay.STATS["recorded"] == before["recorded"] + 1 and rel(out, ref) <= 5e-3
    out, _ = launch.attention(q, k, v, scale=0.5)
    assert replay.STATS["recorded"] == before["recorded"] + 2
    os.environ[occ.ENV_PARTITIONS] = "2"
    try:
        out, _ = launch.attention(q, k, v, scale=0.25)
    finally:
        del os.environ[occ.ENV_PARTITIONS]
    assert replay.STATS["recorded"] == before["recorded"] + 3 and rel(out, ref) <= 5e-3
    assert replay.STATS["replayed"] == before["replayed"]
    for _ in range(2):  # the environment as before: planned again (a key keeps one plan), then replayed
        out, _ = launch.attention(q, k, v, scale=0.25)
        assert rel(out, ref) <= 5e-3
    assert replay.STATS["recorded"] == before["recorded"] + 4
    assert replay.STATS["replayed"] == before["replayed"] + 1


def test_aliased_inputs_and_staged_calls(monkeypatch):
    """One tensor as q, k and v replays (whether they are one tensor is in the key: the same geometry with three
    tensors is another plan); V staged transposed replays; K/V staged in chunks never do (the reason is kept);
    all right."""
    x = rand(1, 2, 50, 16)
    ref = elsa_surgery.attention(x.double(), x.double(), x.double(), scale=0.25, backend="reference")
    out, _ = launch.attention(decoy(x), decoy(x), decoy(x), scale=0.25, precision="strict")  # three tensors
    for _ in range(2):
        y = decoy(x).copy_(x)
        out, _ = launch.attention(y, y, y, scale=0.25, precision="strict")
        assert rel(out, ref) <= 2e-6
    assert replay.STATS == {"recorded": 2, "replayed": 1, "not_replayable": 0}, replay.STATS
    three = [decoy(x) for _ in range(3)]
    out, _ = launch.attention(*three, scale=0.25, precision="strict")
    ref3 = elsa_surgery.attention(*(t.double() for t in three), scale=0.25, backend="reference")
    assert replay.STATS["replayed"] == 2 and rel(out, ref3) <= 2e-6

    # V staged transposed (the TF32 modes of the portable kernel; on an H100 the Gluon kernel would take the call):
    # the staged copy is derived again from each replay's V
    monkeypatch.setenv("ELSA_HOPPER", "0")
    monkeypatch.setattr(occ, "MIN_ROWS_PER_KV_HEAD_TO_STAGE", 1)
    q, k, v = rand(1, 2, 50, 16), rand(1, 2, 50, 16), rand(1, 2, 50, 16)
    ref = elsa_surgery.attention(q.double(), k.double(), v.double(), scale=0.25, backend="reference")
    replay.clear()
    launch.attention(decoy(q), decoy(k), decoy(v), scale=0.25, precision="turbo")
    out, _ = launch.attention(q, k, v, scale=0.25, precision="turbo")
    (plan,) = replay._plans.values()
    assert [name for name, _ in plan.prep] == ["out", "lse", "v_staged"] and rel(out, ref) <= 2e-3
    # staged in key chunks (slices of K/V, pieces carved from a buffer): never replayed, the reason kept
    monkeypatch.setenv(occ.ENV_STAGE_PLAN, "keys:16")
    replay.clear()
    for _ in range(2):
        out, _ = launch.attention(q, k, v, scale=0.25, precision="turbo")
        assert rel(out, ref) <= 2e-3
    (key,) = replay._plans
    assert "staged or sliced" in replay.why_not_replayable(key)


@pytest.mark.parametrize("kind", ["f16", "f16k"])
def test_precise_split_calls_replay(monkeypatch, kind):
    """``precise``'s fp16 split (K and V split by the launcher into fp16 pieces, or K alone with ``f16k``) replays:
    the pieces are allocated again and split from the replay's K and V (a replay that kept the first call's pieces,
    or its K/V, fails the oracle). Before session 43 the split was not replayable, and its eager calls paid the
    planner's host time (0.2-0.45 ms a call on an H200)."""
    monkeypatch.setenv("ELSA_HOPPER", "0")
    monkeypatch.setenv(occ.ENV_PRECISE_SPLIT, kind)
    q, k, v = rand(2, 2, 40, 16), rand(2, 2, 40, 16), rand(2, 2, 40, 16)
    ref = elsa_surgery.attention(q.double(), k.double(), v.double(), scale=0.25, backend="reference")
    sig = launch.call_signature(q, k, v, None, precision="precise")
    assert launch.plan_launch(sig).dot == (occ.DOT_F16X3 if kind == "f16" else occ.DOT_F16X3V)

    def call(first):
        args = (decoy(q), decoy(k), decoy(v)) if first else (q, k, v)
        return launch.attention(*args, scale=0.25, precision="precise")[0]

    out, stats = replayed(call)
    assert stats == {"recorded": 0, "replayed": 1, "not_replayable": 0}, stats
    (plan,) = replay._plans.values()
    pieces = 6 if kind == "f16" else 3
    assert [name for name, _ in plan.prep] == ["out", "lse"] + [f"stage_{i}" for i in range(pieces)]
    assert rel(out, ref) <= 2e-6


def test_bad_switch_names_the_variable(monkeypatch):
    monkeypatch.setenv(replay.ENV, "yes")
    q = rand(1, 1, 8, 8)
    with pytest.raises(ValueError, match=replay.ENV):
        launch.attention(q, q.clone(), q.clone(), scale=1.0)


def test_recorder_rebuilds_descriptors_and_options():
    """Host tensor descriptors (Gluon's TMA descriptors) are rebuilt around the new tensor with their fields;
    launch options and constexprs given by keyword reach the replayed launch."""

    @dataclasses.dataclass
    class Desc:
        base: torch.Tensor
        block_shape: list
        layout: str = "swizzled"

    calls = []

    class Kernel:  # a JIT function's surface: .fn (its Python signature) and [grid]
        @staticmethod
        def fn(desc, x_ptr, n, BLOCK=16):
            pass

        def __getitem__(self, grid):
            return lambda *a, **kw: calls.append((grid, a, kw))

    fn = Kernel()
    q, x = torch.zeros(4, 8), torch.ones(3)
    rec = replay._Recorder({"q": q, "x": x})
    replay._local.rec = rec
    try:
        replay.launch(fn, (5,), Desc(q, [2, 8]), x, 7, BLOCK=32, num_warps=8)
    finally:
        replay._local.rec = None
    plan = rec.finish((q, None, None))
    assert plan.why is None
    q2, x2 = torch.zeros(4, 8), torch.ones(3)
    calls.clear()
    out, lse, state = plan.replay({"q": q2, "x": x2})
    assert out is q2 and lse is None and state is None
    (grid, args, kw), = calls
    assert grid == (5,) and kw == {"num_warps": 8}
    assert args[0] == Desc(q2, [2, 8]) and args[0].base is q2 and args[1] is x2 and args[2:] == (7, 32)


def test_direct_launch_matches_the_installed_triton():
    """The direct replay repeats the launch statement of Triton's JITFunction.run: the check accepts the
    installed Triton (else plans would launch through kernel[grid], still correct, slower)."""
    from triton.runtime.jit import JITFunction

    class Compiled:
        run = function = packed_metadata = launch_metadata = None

    class Jit(JITFunction):
        pass

    assert replay._launches_as_recorded(Jit)
    assert replay._direct_ok(Jit.__new__(Jit), Compiled())
    assert not replay._direct_ok(Jit.__new__(Jit), object())  # not a compiled kernel


def test_idle_hooks_are_none_or_empty_chains():
    """A replay passes no hooks only when Triton would call nothing: None, or an empty HookChain (Triton 3.6 keeps
    those instead of None); a chain with a hook, or any other callable, is live."""
    knobs = pytest.importorskip("triton.knobs")
    assert replay._idle(None)
    chain = knobs.HookChain()
    assert replay._idle(chain)
    chain.add(print)
    assert not replay._idle(chain)
    assert not replay._idle(print)


@pytest.mark.parametrize("ints", [False, True])
def test_encoded_descriptor_launch_expands_arguments_as_triton_does(monkeypatch, ints):
    """The encoded route hands Triton's compiled launcher what Triton 3.6's own path hands it: the base launch
    arguments, then every kernel argument in order with each host descriptor expanded to (CUtensorMap, shape...,
    strides...); maps are encoded once per base address and at most MAPS_PER_DESCRIPTOR are kept. Where the
    launcher takes addresses (``ints``: internals.launcher_takes_ints), a tensor argument goes as its address. With a
    hook set, the launch goes through the kernel's launcher with Triton's metadata instead."""
    knobs = pytest.importorskip("triton.knobs")
    monkeypatch.setattr(replay, "_launcher_takes_ints", lambda cls: ints)

    @dataclasses.dataclass
    class Desc:  # the fields of Gluon's host TensorDescriptor
        base: torch.Tensor
        shape: list
        strides: list
        block_shape: list
        layout: str = "nvmma"
        padding: str = "zero"

    raw_calls, fills, via_triton = [], [], []
    meta = {"swizzle": 3, "elem_size": 2, "elem_type": 10, "block_size": [1, 64, 64], "fp4_padded": False}

    def make_inner(launcher, tensordesc_meta):
        def inner(*args):  # Triton's wrap_handle_tensordesc closure: the names the route reads
            return launcher(*args), tensordesc_meta
        return inner

    class Launcher:
        global_scratch_size = profile_scratch_size = 0
        launch_cooperative_grid, launch_pdl = False, True
        launch = make_inner(lambda *a: raw_calls.append(a), [meta])

        def __call__(self, *args):
            via_triton.append(args)

    class Compiled:
        run, function, packed_metadata = Launcher(), "cu-function", "packed"

        def launch_metadata(self, grid, stream, *args):
            if knobs.runtime.launch_enter_hook is None:
                return None
            return "metadata"

    def fill(ptr, *static):
        fills.append(ptr)
        return ("map", ptr)

    monkeypatch.setattr(replay, "_desc_module", lambda cls: type("Driver", (), {"TMA_DTYPE_DEVICE_TO_HOST": {10: 9}}))
    monkeypatch.setattr(replay, "_fill_tma", lambda: fill)
    enter, leave = knobs.HookChain(), knobs.HookChain(reversed=True)
    runtime = type("Runtime", (), {"launch_enter_hook": enter, "launch_exit_hook": leave})
    monkeypatch.setattr(replay, "_TRITON", [(lambda: 0, lambda device: "stream", runtime)])
    fields = dict(shape=[2, 128, 64], strides=[8192, 64, 1], block_shape=[1, 64, 64])
    one = replay._Launch(None, Compiled(), (4, 2), [None, None, 128, 0.5, 64], [(1, "lse", None)],
                         [(0, "q", Desc, fields)], {})
    q, lse = torch.zeros(2, 128, 64, dtype=torch.float16), torch.zeros(2, 128)
    one({"q": q, "lse": lse})
    one({"q": q, "lse": lse})
    (first, second) = raw_calls
    assert first == second and fills == [q.data_ptr()]  # one map for one address
    base = (4, 2, 1, "stream", "cu-function", False, True, None, None, "packed", None, None, None)
    assert first[:13] == base
    assert first[13:] == (("map", q.data_ptr()), 2, 128, 64, 8192, 64, 1, lse.data_ptr() if ints else lse, 128, 0.5,
                          64)
    for _ in range(replay.MAPS_PER_DESCRIPTOR + 1):
        one({"q": torch.zeros(2, 128, 64, dtype=torch.float16), "lse": lse})
    assert len(one.expanded[-1][0][-1]) <= replay.MAPS_PER_DESCRIPTOR
    hook = lambda metadata: None
    enter.add(hook)
    one({"q": q, "lse": lse})  # a hook set: Triton's launcher, its descriptor objects and metadata
    (args,) = via_triton
    assert args[5:9] == ("packed", "metadata", enter, leave) and args[9] == Desc(q, **fields) and args[10] is lse


BWD_CASES = {
    "fp32 causal": dict(shape=(2, 2, 70, 32), is_causal=True),
    "bf16 gqa": dict(shape=(2, 4, 33, 24), hkv=2, dtype=torch.bfloat16),
    "additive mask with its gradient": dict(shape=(2, 2, 40, 16), mask="grad"),
    "atomic dq": dict(shape=(1, 2, 45, 16), atomic=True),
    "precise's fp16 split": dict(shape=(2, 4, 70, 24), hkv=2, split=True, is_causal=True),
}


@pytest.mark.parametrize("case", list(BWD_CASES))
def test_backward_replays_match_the_oracle(monkeypatch, case):
    """The backward's launches (delta, bwd_kv, the row pass) go through a launch plan too (session 31: Triton's
    generic launch path was most of a training call's host time on an H100): recorded on decoys, replayed on the
    real tensors, gradients against the float64 oracle (a replay that kept a buffer of the first call, skipped a
    launch or an allocation's zero fill fails)."""
    c = BWD_CASES[case]
    if c.get("atomic"):
        monkeypatch.setenv("ELSA_BWD_DQ", "atomic")
    precision = None
    if c.get("split"):  # q/dO and K/V split into the plan's registered buffers (backward_launch._split_buffers)
        monkeypatch.setenv("ELSA_BWD_SPLIT", "f16")
        precision = "precise"
    B, H, N, D = c["shape"]
    dtype = c.get("dtype", torch.float32)
    nk, hkv = c.get("nk", N), c.get("hkv", H)
    q, k, v = rand(B, H, N, D, dtype=dtype), rand(B, hkv, nk, D, dtype=dtype), rand(B, hkv, nk, D, dtype=dtype)
    mask = rand(B, 1, N, nk) if c.get("mask") else None
    go = rand(B, H, N, D, dtype=dtype)

    def call(use_decoy):
        t = decoy if use_decoy else (lambda x: x)
        leaves = [t(x).detach().requires_grad_() for x in (q, k, v)]
        m = None if mask is None else t(mask).detach().requires_grad_()
        out = elsa_surgery.attention(*leaves, m, scale=0.3, is_causal=c.get("is_causal", False), enable_gqa=True,
                                     backend="elsa", precision=precision)
        out.backward(t(go))
        return [x.grad for x in leaves] + ([m.grad] if m is not None else [])

    grads, stats = replayed(call)
    assert stats == {"recorded": 0, "replayed": 2, "not_replayable": 0}, stats  # the forward's plan and the backward's
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    m = None if mask is None else mask.double().requires_grad_()
    ref = elsa_surgery.attention(*leaves, m, scale=0.3, is_causal=c.get("is_causal", False), enable_gqa=True,
                                 backend="reference")
    ref.backward(go.double())
    tol = {torch.float32: 1e-5, torch.bfloat16: 3e-2}[dtype]
    for g, r in zip(grads, [x.grad for x in leaves] + ([m.grad] if m is not None else [])):
        assert g is not None and not g.isnan().any()
        assert rel(g, r) <= tol, (case, rel(g, r))


def test_eager_training_calls_skip_the_custom_ops(monkeypatch):
    """An eager call that wants a gradient runs the ops' autograd formula without their dispatch
    (training.EagerAttention): neither the forward op nor the backward op is called, and a second-order backward
    (create_graph=True) still goes through the backward op, which refuses it (tests/test_backward.py)."""
    from elsa_surgery.kernels import ops, training

    called = []
    for name in ("attention_op", "attention_varlen_op"):
        real = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *a, _real=real, _n=name, **kw: (called.append(_n), _real(*a, **kw))[1])
    real_bwd = training.bl.attention_backward
    direct = []
    monkeypatch.setattr(training.bl, "attention_backward",
                        lambda *a, **kw: (direct.append(torch.is_grad_enabled()), real_bwd(*a, **kw))[1])
    q, k, v = (rand(1, 2, 20, 16).requires_grad_() for _ in range(3))
    elsa_surgery.attention(q, k, v, backend="elsa").sum().backward()
    cu = torch.tensor([0, 7, 20], dtype=torch.int32, device=DEV)
    qp, kp, vp = (rand(20, 2, 16).requires_grad_() for _ in range(3))
    elsa_surgery.attention_varlen(qp, kp, vp, cu, cu, 13, 13, backend="elsa").sum().backward()
    assert called == [] and direct == [False, False]
    assert all(t.grad is not None for t in (q, k, v, qp, kp, vp))
