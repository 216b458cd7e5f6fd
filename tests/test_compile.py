"""Converted models under ``torch.compile`` (issue 33): the converted-then-compiled model gives the converted eager
model's output, in one graph with no graph break, and does not recompile across calls of the same shape; the ELSA
custom op compiles with ``fullgraph=True`` and Inductor reads its output in the layout the kernels write (no clone
before the output projection where ``kernels.ops.STRIDED_OUTPUT`` holds).

CPU: the reference backend through Inductor's C++ code, the kernels in Triton's interpreter on tiny shapes; the
GPU variant runs ``backend="elsa"``. The model's first compiled call comes before any eager call of the converted
model, with the knobs' parse caches cleared, as in a fresh process (a cache write traced by dynamo once made the
second call recompile)."""

import os
import types

import pytest
import torch
import torch._dynamo.utils as dynamo_utils
import torch._inductor.metrics as inductor_metrics
from torch import nn
from torch._dynamo.backends.registry import lookup_backend
from torch._inductor.utils import run_and_get_code

import elsa_surgery
from elsa_surgery import dispatch
from elsa_surgery.kernels import knobs, ops

RTOL = 1e-6  # relative norm, fp32


@pytest.fixture(autouse=True)
def _fresh_compile():
    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    for knob in knobs.KNOBS.values():
        knob.cache.clear()
    yield
    torch._dynamo.reset()


def _timm_vit():
    timm = pytest.importorskip("timm")
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, embed_dim=32,
                              depth=1, num_heads=2, num_classes=0)
    return model, lambda: (torch.randn(2, 3, 32, 32),)


def _torch_mha():
    class Net(nn.Module):  # a bare MultiheadAttention (causal) and an encoder layer (padding mask)
        def __init__(self):
            super().__init__()
            self.mha = nn.MultiheadAttention(32, 4, batch_first=True)
            self.layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)

        def forward(self, x, pad):
            causal = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device), 1)
            y = self.mha(x, x, x, attn_mask=causal, need_weights=False)[0]
            return self.layer(y, src_key_padding_mask=pad)

    pad = torch.zeros(2, 10, dtype=torch.bool)
    pad[1, 7:] = True
    return Net(), lambda: (torch.randn(2, 10, 32), pad)


def _open_clip():
    open_clip = pytest.importorskip("open_clip")
    model = open_clip.create_model(
        "ViT-B-32", pretrained=None, embed_dim=16,
        vision_cfg=dict(image_size=32, layers=1, width=64, head_width=32, patch_size=8),
        text_cfg=dict(context_length=8, vocab_size=50, width=32, heads=2, layers=1))
    return model, lambda: (torch.rand(2, 3, 32, 32), torch.randint(1, 50, (2, 8)))


def _llama():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                   attn_implementation="sdpa")
    model = transformers.LlamaModel(cfg)
    return _Hidden(model, use_cache=False), lambda: (torch.randint(0, 97, (2, 12)),)


def _bert():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(vocab_size=97, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=48, max_position_embeddings=32, attn_implementation="sdpa")
    return _Hidden(transformers.BertModel(cfg)), lambda: (torch.randint(0, 97, (2, 12)),)


class _Hidden(nn.Module):
    """A transformers model returning its last hidden state (a tensor, not a ModelOutput)."""

    def __init__(self, model, **options):
        super().__init__()
        self.model, self.options = model, options

    def forward(self, ids):
        return self.model(input_ids=ids, **self.options).last_hidden_state


MODELS = {"timm_vit": _timm_vit, "torch_mha": _torch_mha, "open_clip": _open_clip, "llama": _llama, "bert": _bert}


def _rel(a, b):
    if isinstance(a, (tuple, list)):
        return max(_rel(x, y) for x, y in zip(a, b))
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _recording(compiler, graphs):
    """A torch.compile backend: ``compiler`` ("inductor", "aot_eager"), each graph it is given kept in ``graphs``."""
    def backend(gm, example_inputs):
        graphs.append(gm)
        return lookup_backend(compiler)(gm, example_inputs)
    return backend


def _compiled_matches_eager(name, backend, device, compiler="inductor"):
    """Convert, compile with ``fullgraph=True``, call three times on fresh inputs of one shape (before any eager call
    of the converted model), then compare with the converted eager model; returns the graph dynamo captured."""
    torch.manual_seed(0)
    model, make_inputs = MODELS[name]()
    model = model.eval().to(device)
    report = elsa_surgery.convert(model, backend=backend, verify=False)
    assert report.num_converted > 0, report
    graphs = []
    compiled = torch.compile(model, backend=_recording(compiler, graphs), fullgraph=True)
    inputs = [tuple(t.to(device) for t in make_inputs()) for _ in range(3)]
    with torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=True):
        got = [compiled(*x) for x in inputs]
    with torch.no_grad():
        want = [model(*x) for x in inputs]
    for i, (g, w) in enumerate(zip(got, want)):
        assert _rel(g, w) <= RTOL, (name, i, _rel(g, w))
    counters = dynamo_utils.counters
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert len(graphs) == 1  # the backend ran once: no recompilation (error_on_recompile would also have raised)
    return graphs[0]


def _targets(gm):
    return {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}


# Inductor's C++ compile takes 5-30 s a model on two cores: one model goes through Inductor, the others through
# AOTAutograd (fake implementations, decompositions, functionalization); all of them passed through Inductor when
# this file was written (85 s), and the GPU variant runs Inductor for every model.
CASES = [("timm_vit", "inductor"), ("torch_mha", "aot_eager"), ("open_clip", "aot_eager"), ("llama", "aot_eager"),
         ("bert", "aot_eager")]


@pytest.mark.parametrize("name,compiler", CASES)
def test_converted_then_compiled_equals_converted_eager(name, compiler):
    gm = _compiled_matches_eager(name, "reference", "cpu", compiler)
    ours = {t for t in _targets(gm) if t.startswith("elsa_surgery.")}
    assert ours and all(t.startswith("elsa_surgery.reference_attention") for t in ours), ours
    assert not any("scaled_dot_product" in t for t in _targets(gm))  # no attention escaped to native SDPA


INFERENCE_OPS = {"elsa_surgery.attention_inference.default", "elsa_surgery.attention_varlen_inference.default",
                 "elsa_surgery.attention_inline.default"}


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(MODELS))
def test_converted_then_compiled_equals_converted_eager_gpu(name):
    gm = _compiled_matches_eager(name, "elsa", "cuda")
    # inference: the ops without an autograd formula (dense, or packed varlen for padded BERT)
    ours = {t for t in _targets(gm) if t.startswith("elsa_surgery.")}
    assert ours and ours <= INFERENCE_OPS, ours


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["timm_vit", "bert"])
def test_auto_compiles_in_one_graph_gpu(name):
    """``auto`` under torch.compile: one graph, no graph break (session 31: reading the CUDA capture state while
    tracing broke the graph at every attention module), whichever backend its traced race takes."""
    gm = _compiled_matches_eager(name, "auto", "cuda")
    ours = {t for t in _targets(gm) if t.startswith("elsa_surgery.")}
    assert (ours and ours <= INFERENCE_OPS) or any("scaled_dot_product" in t for t in _targets(gm)), _targets(gm)


def _guard_tag_safety(model, inputs) -> dict:
    """``{guard source: tag safe}`` of the guard tree of ``model(*inputs)`` compiled with the recursive dict tags on
    (torch 2.11's default; 2.14 has them off): Dynamo skips a tag-safe module's subtree while its ``__dict__`` is
    unchanged, and a module holding anything else (a dataclass, the patch record) is checked in full every call."""
    torch._dynamo.reset()
    with torch._dynamo.config.patch(use_recursive_dict_tags_for_guards=True), torch.no_grad():
        torch.compile(model, backend="eager", fullgraph=True)(*inputs)
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    (entry,) = _debug_get_cache_entry_list(type(model).forward.__code__)
    out = {}

    def walk(mgr):
        if mgr is None:
            return
        out[mgr.get_source()] = mgr.is_tag_safe()
        if hasattr(mgr, "get_key_value_managers"):  # a DictGuardManager
            for key_mgr, val_mgr in mgr.get_key_value_managers().values():
                walk(key_mgr)
                walk(val_mgr)
        else:
            for child in mgr.get_child_managers():
                walk(child)

    walk(entry.guard_manager.root)
    return out


@pytest.mark.parametrize("name", list(MODELS))
def test_patched_modules_keep_dynamos_guard_fast_path(name):
    """Every guard node that is tag safe for the native model stays so converted: a patched forward reads its config
    as a plain attribute holding a tuple of strings, never through the patch record (session 49: the record made
    ViT-B/16's compiled guard check 27 µs against native's 6.4 on an H200, torch 2.11)."""
    torch.manual_seed(0)
    model, make_inputs = MODELS[name]()
    model = model.eval()
    inputs = make_inputs()
    if not hasattr(torch._dynamo.config, "use_recursive_dict_tags_for_guards"):
        pytest.skip("this torch has no recursive dict tags for guards")
    native = _guard_tag_safety(model, inputs)
    assert any(native.values()), "the native tree has no tag-safe node: nothing to compare"
    elsa_surgery.convert(model, backend="reference", verify=False)
    converted = _guard_tag_safety(model, inputs)
    lost = sorted(src for src, safe in native.items() if safe and converted.get(src) is False)
    assert not lost, lost[:5]
    assert any(patching_attr in src for src in converted for patching_attr in ("_elsa_config", "_elsa_passthrough"))


def test_auto_reads_no_capture_state_while_tracing(monkeypatch):
    """The race's eligibility on a CUDA call (a stand-in: only ``.device`` is read) does not ask whether the stream is
    capturing while torch.compile traces (a bool that breaks the graph), and does outside tracing."""
    from elsa_surgery import autoselect

    asked = []
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: asked.append(1) or False)
    cuda_call = types.SimpleNamespace(device=torch.device("cuda", 0))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert autoselect._eager_cuda(cuda_call) and not asked
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    assert autoselect._eager_cuda(cuda_call) and asked == [1]
    assert not autoselect._eager_cuda(types.SimpleNamespace(device=torch.device("cpu")))


# the custom op ------------------------------------------------------------------------------------------------------


def _op_inputs(device, B=2, H=2, N=16, D=16, Dv=16):
    gen = torch.Generator(device=device).manual_seed(0)
    q, k = (torch.randn(B, H, N, D, device=device, generator=gen) for _ in range(2))
    v = torch.randn(B, H, N, Dv, device=device, generator=gen)
    w = torch.randn(H * Dv, 24, device=device, generator=gen)
    return q, k, v, w


def _projected(q, k, v, w):
    """The op, then what every attention module does next: heads back to channels, the output projection."""
    out, lse = torch.ops.elsa_surgery.attention(q, k, v, None, None, None, q.shape[-1] ** -0.5, False, "")
    B, H, N, Dv = out.shape
    return out.transpose(1, 2).reshape(B, N, H * Dv) @ w, lse


def _op_layout(device, strided, monkeypatch):
    """``(compiled == eager, Inductor kernels generated, generated code)`` of :func:`_projected` with the op's output
    layout ``strided`` ([B, N, H, Dv] in memory) or contiguous; Inductor's caches off (the FX graph cache keys on
    the graph, not on the op's fake, so a cached graph of the other layout would be replayed)."""
    monkeypatch.setattr(ops, "STRIDED_OUTPUT", strided)
    q, k, v, w = _op_inputs(device)
    want = _projected(q, k, v, w)
    inductor_metrics.reset()
    with torch._inductor.config.patch(force_disable_caches=True):
        got, code = run_and_get_code(torch.compile(_projected, fullgraph=True), q, k, v, w)
    kernels = inductor_metrics.generated_kernel_count
    assert dynamo_utils.counters["stats"]["unique_graphs"] == 1 and not dynamo_utils.counters["graph_break"]
    same = all(torch.allclose(a, b, rtol=1e-6, atol=1e-6) for a, b in zip(got, want))
    return same, kernels, "\n".join(code)


CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="the kernels on CPU tensors run in Triton's "
                              "interpreter, set up on machines without a GPU; the _gpu variants run them on CUDA")


@CPU_ONLY
@pytest.mark.parametrize("strided", [True, False])
def test_op_output_layout_under_inductor(strided, monkeypatch):
    """The op under ``torch.compile(fullgraph=True)`` equals the eager op, in both layouts; with the strided one
    Inductor generates no kernel at all (the matmul reads the op's buffer as ``[B·N, H·Dv]``), with the contiguous
    one it adds a copy (``clone``) before the matmul."""
    if strided and not ops.STRIDED_OUTPUT:
        pytest.skip(f"torch {torch.__version__}: the op keeps the contiguous layout (kernels/ops.py)")
    same, kernels, code = _op_layout("cpu", strided, monkeypatch)
    assert same
    B, H, N, Dv = 2, 2, 16, 16
    stride = (N * H * Dv, Dv, H * Dv, 1) if strided else (H * N * Dv, N * Dv, Dv, 1)
    assert f"({B}, {H}, {N}, {Dv}), {stride}" in code.replace("\n", " ")  # Inductor asserts the fake's strides
    if strided:
        assert kernels == 0 and "clone" not in code, code
    else:
        assert kernels == 1 and "clone" in code, code


@CPU_ONLY
def test_op_compiled_equals_eager_through_the_api(monkeypatch):
    """``elsa_surgery.attention(backend="elsa")`` under compile goes through the custom op (mask, causal, GQA) and
    equals its eager call (the launchers), also when the compiled call is the first of the process (the kernels'
    interface not yet bound: its binding cannot be traced)."""
    monkeypatch.setattr(dispatch, "_KERNELS", None)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, 12, 16, generator=gen)
    k, v = (torch.randn(1, 2, 20, 16, generator=gen) for _ in range(2))
    mask = torch.rand(1, 1, 12, 20, generator=gen) < 0.8

    def call(q, k, v, mask):
        return elsa_surgery.attention(q, k, v, mask, enable_gqa=True, backend="elsa"), \
            elsa_surgery.attention(q, k, v, is_causal=True, enable_gqa=True, backend="elsa")

    graphs = []
    compiled = torch.compile(call, backend=_recording("inductor", graphs), fullgraph=True)
    for a, b in zip(compiled(q, k, v, mask), call(q, k, v, mask)):
        assert _rel(a, b) <= RTOL
    # no gradient wanted: the op without an autograd formula (kernels/ops.py)
    assert {t for t in _targets(graphs[0]) if t.startswith("elsa_surgery.")} == \
        {"elsa_surgery.attention_inference.default"}


@CPU_ONLY
@pytest.mark.parametrize("varlen", [False, True])
def test_compiled_call_takes_the_op_its_gradient_needs(varlen):
    """A traced call that wants a gradient holds the op with the autograd formula and trains (gradients equal the
    eager call's); one that wants none holds the op without a formula, whose dispatch has no Python autograd kernel
    to run (the formula's kernel runs on every call under ``no_grad``: host time in host-bound compiled models)."""
    dispatch.kernels_module()
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    name = "elsa_surgery::attention_varlen" if varlen else "elsa_surgery::attention"
    assert has(name, "Autograd") and not has(name + "_inference", "Autograd")
    gen = torch.Generator().manual_seed(2)
    if varlen:
        cu = torch.tensor([0, 5, 12], dtype=torch.int32)
        q, k, v = (torch.randn(12, 2, 16, generator=gen) for _ in range(3))

        def call(q, k, v):
            return elsa_surgery.attention_varlen(q, k, v, cu, cu, 7, 7, backend="elsa")
    else:
        q, k, v = (torch.randn(1, 2, 12, 16, generator=gen) for _ in range(3))

        def call(q, k, v):
            return elsa_surgery.attention(q, k, v, is_causal=True, backend="elsa")

    for grad in (False, True):
        torch._dynamo.reset()
        graphs = []
        compiled = torch.compile(call, backend=_recording("aot_eager", graphs), fullgraph=True)
        qs = [t.clone().requires_grad_(grad) for t in (q, k, v)]
        out = compiled(*qs)
        ops = {t for t in _targets(graphs[0]) if t.startswith("elsa_surgery.")}
        assert ops == {name.replace("::", ".") + ("" if grad else "_inference") + ".default"}, ops
        ref_in = [t.clone().requires_grad_(grad) for t in (q, k, v)]
        ref = call(*ref_in)
        assert _rel(out, ref) <= RTOL
        if grad:
            out.square().sum().backward()
            ref.square().sum().backward()
            for a, b in zip(qs, ref_in):
                assert _rel(a.grad, b.grad) <= RTOL
    torch._dynamo.reset()


@CPU_ONLY
@pytest.mark.parametrize("varlen", [False, True])
def test_compiled_inference_call_returns_lse_only_when_asked(varlen):
    """The inference op writes lse only when the call asks for it (an empty tensor otherwise, the kernel variant
    eager calls compile); asked for, it equals the eager call's."""
    gen = torch.Generator().manual_seed(3)
    if varlen:
        cu = torch.tensor([0, 5, 12], dtype=torch.int32)
        q, k, v = (torch.randn(12, 2, 16, generator=gen) for _ in range(3))

        def call(q, k, v, lse):
            return elsa_surgery.attention_varlen(q, k, v, cu, cu, 7, 7, backend="elsa", return_lse=lse)
    else:
        q, k, v = (torch.randn(1, 2, 12, 16, generator=gen) for _ in range(3))

        def call(q, k, v, lse):
            return elsa_surgery.attention(q, k, v, is_causal=True, backend="elsa", return_lse=lse)

    torch._dynamo.reset()
    compiled = torch.compile(call, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        out, lse = compiled(q, k, v, True)
        ref_out, ref_lse = call(q, k, v, True)
        assert _rel(out, ref_out) <= RTOL and _rel(lse, ref_lse) <= RTOL
        plain = compiled(q, k, v, False)
        assert isinstance(plain, torch.Tensor) and _rel(plain, ref_out) <= RTOL
    torch._dynamo.reset()


@pytest.mark.parametrize("backend", ["reference", "auto"])
def test_autocast_region_compiles_fullgraph(backend):
    """Inside ``torch.autocast`` (fp32 q/k beside a bf16 v, as a LayerNorm under autocast gives), ``attention``
    casts and runs the call with autocast off; that traces with ``fullgraph=True`` and equals the eager call."""
    gen = torch.Generator().manual_seed(3)
    q, k = torch.randn(1, 2, 12, 16, generator=gen), torch.randn(1, 2, 12, 16, generator=gen)
    v = torch.randn(1, 2, 12, 16, generator=gen).bfloat16()

    def call(q, k, v):
        with torch.autocast("cpu", torch.bfloat16):
            return elsa_surgery.attention(q, k, v, is_causal=True, backend=backend)

    got, want = torch.compile(call, fullgraph=True)(q, k, v), call(q, k, v)
    assert got.dtype == want.dtype == torch.bfloat16
    assert (got.float() - want.float()).abs().max() <= 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("strided", [True, False])
def test_op_output_layout_under_inductor_gpu(strided, monkeypatch):
    same, kernels, code = _op_layout("cuda", strided, monkeypatch)
    assert same
    if strided:
        assert "clone" not in code and kernels == 0, code
    else:
        assert kernels >= 1, code



# Traced in a process of its own without TRITON_INTERPRET (the interpreter's kernels are not traceable: the inline op
# is not taken under it): the inline op on CPU fake tensors through AOTAutograd (whose graph is what Inductor lowers),
# printing per call the graph's ELSA kernels, whether the opaque op is in it and whether any as_strided view is.
_TRACE_INLINE = r"""
import json, os, sys, torch
from torch._dynamo.backends.common import aot_autograd
from elsa_surgery import dispatch
from elsa_surgery.kernels import knobs
ops = dispatch.kernels_module().ops
g = torch.Generator().manual_seed(0)
def r(*shape):
    return torch.randn(*shape, generator=g)
def traced(fn, *args, dynamic=False, count=False):
    graphs = []
    def capture(gm, example):
        graphs.append(gm)
        return lambda *a: None
    torch._dynamo.reset()
    try:
        torch.compile(fn, backend=aot_autograd(fw_compiler=capture), fullgraph=True, dynamic=dynamic)(*args)
    except Exception:  # the captured graph returns nothing (never run)
        pass
    nodes = [n for n in graphs[0].graph.nodes if n.op == "call_function"]
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
    launches = [n for n in nodes if "triton_kernel_wrapper" in str(n.target)]
    kernels = sorted({kernel_side_table.get_kernel(n.kwargs["kernel_idx"]).fn.__name__ for n in launches})
    # parameters a launch leaves to their defaults (Inductor's launcher takes every constexpr positionally); a
    # launch with num_warps is traced as an Autotuner of one config, whose kwargs would count as given
    omitted = set()
    for n in launches:
        k = kernel_side_table.get_kernel(n.kwargs["kernel_idx"])
        jit, configs = (k.fn, k.configs) if hasattr(k, "configs") else (k, [])
        given = {**n.kwargs["kwargs"], **kernel_side_table.get_constant_args(n.kwargs["constant_args_idx"])}
        given.update({name: None for c in configs for name in c.kwargs})
        omitted.update(f"{jit.fn.__name__}.{p.name}" for p in jit.params if p.name not in given)
    omitted = sorted(omitted)
    got = dict(kernels=kernels, opaque=any("attention_inference" in str(n.target) for n in nodes),
               as_strided=any("as_strided" in str(n.target) for n in nodes), omitted=omitted)
    if count:  # (the launches, and the kernel side table's entries they name)
        got.update(launches=len(launches), entries=len({n.kwargs["kernel_idx"] for n in launches}))
    return got
def call(precision, mask=True, n=300, d=16):
    q, k, v = r(1, 4, n, d), r(1, 2, n, d), r(1, 2, n, d)
    m = (torch.arange(n)[:, None] >= torch.arange(n)[None])[None, None] if mask else None
    return (lambda q, k, v, m: ops.attention_inline_op(q, k, v, m, None, None, d ** -0.5, not mask, precision,
                                                        False)), (q, k, v, m)
out = {}
split = {knobs.PRECISE_SPLIT: "f16"}  # K and V split into fp16 pieces by the launcher
# (the heads case has the precise case's signature: a plan made while tracing must not be cached, as the knob reads
# that would invalidate it are not observed then)
for name, kw, env, dynamic in (("masked", {}, {}, False), ("precise", dict(mask=False, n=2048, d=64), split, False),
                               ("heads", dict(mask=False, n=2048, d=64), {**split, knobs.STAGE_PLAN: "heads:1"}, False),
                               ("dynamic", {}, {}, True),
                               # ELSA_COMPILE_OP=auto: a long call (8.6e9 multiply-adds) opaque, a shorter one inline
                               ("long_auto", dict(mask=False, n=4096, d=64), {**split, knobs.COMPILE_OP: "auto"},
                                False),
                               ("short_auto", dict(mask=False, n=2048, d=64), {**split, knobs.COMPILE_OP: "auto"},
                                False),
                               ("long_inline", dict(mask=False, n=4096, d=64), {**split, knobs.COMPILE_OP: "inline"},
                                False)):
    os.environ.update(env)
    fn, args = call("strict" if name in ("masked", "dynamic") else "precise", **kw)
    out[name] = traced(fn, *args, dynamic=dynamic)
    for key in env:
        os.environ.pop(key)
os.environ.update(split)
fn, args = call("precise", mask=False, n=2048, d=64)


def chain(q, k, v, m):  # three identical calls: their launches name one side-table entry a kernel
    for _ in range(3):
        q = fn(q, k, v, m)[0] + 0
    return q


out["chain"] = traced(chain, *args, count=True)
print(json.dumps(out))
"""


def _traced_in_a_process(script: str) -> dict:
    """The JSON a trace script prints last, run in a process of its own with Triton's compiler (not its
    interpreter); skipped where this torch has no inline op."""
    import json
    import subprocess
    import sys

    if ops.attention_inline_op is None:
        pytest.skip(ops.INLINE_UNAVAILABLE)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(p.stdout.strip().splitlines()[-1])

def test_inline_op_traces_to_kernel_launches_without_a_gpu():
    """The inline op's body traced as Inductor traces it (AOTAutograd, fake CPU tensors, Triton's compiled kernels
    without a GPU): a masked call becomes launches of ``mask_tile_classes``, ``mask_tile_ranges`` and ``elsa_fwd``
    with no opaque op; an fp32 ``precise`` call whose K/V are split into fp16 pieces adds ``split_f16`` and writes no
    ``as_strided`` view (functionalization refuses such writes: the traced pieces are tensors of their own); every
    launch passes every kernel parameter (one left to its default broke Inductor's launcher, ``replay.with_defaults``,
    and made Dynamo assume every input written); the same
    call with K/V staged a head at a time, and a call traced with dynamic shapes (the planner needs sizes), keep the
    opaque op."""
    got = _traced_in_a_process(_TRACE_INLINE)
    assert got["masked"] == dict(kernels=["elsa_fwd", "mask_tile_classes", "mask_tile_ranges"], opaque=False,
                                 as_strided=False, omitted=[]), got
    assert got["precise"] == dict(kernels=["elsa_fwd", "split_f16"], opaque=False, as_strided=False,
                                  omitted=[]), got
    for name in ("heads", "dynamic", "long_auto"):
        assert got[name]["opaque"] and not got[name]["kernels"], got
    for name in ("short_auto", "long_inline"):  # (auto's short call and inline's long one: the inline op)
        assert got[name] == got["precise"], got
    # each launch's options (num_warps, num_stages) as one autotuner a kernel (replay._one_config), not a new one a
    # launch: torch's kernel side table holds each kernel once (a CLIP-L/14-336: 2 entries, not 146)
    assert got["chain"] == dict(got["precise"], launches=6, entries=2), got["chain"]


def test_auto_compile_op_sends_long_calls_to_the_opaque_op(monkeypatch):
    """``ELSA_COMPILE_OP=auto``'s rule (``launch.long_call``): a call of at least ``launch.OPAQUE_MACS`` multiply-adds
    for its dtype (B * Hq * Nq * Nk * (D + Dv), halved when causal) is named, with its count; a shorter one, and every
    call under ``inline`` or ``opaque``, is not."""
    from elsa_surgery.kernels import launch

    def call(n, dtype=torch.float32, heads=4, d=64, causal=False):
        q = torch.empty(1, heads, n, d, dtype=dtype, device="meta")
        k = torch.empty(1, heads, n, d, dtype=dtype, device="meta")
        return launch.long_call(q, k, k, causal)

    monkeypatch.setenv("ELSA_COMPILE_OP", "auto")
    assert launch.OPAQUE_MACS[torch.float32] < launch.OPAQUE_MACS[torch.bfloat16] == launch.OPAQUE_MACS[torch.float16]
    assert call(2048) is None  # 2.1e9 < 3e9
    said = call(4096)
    assert said is not None and "8.59e+09 multiply-adds >= 3e+09" in said and "ELSA_COMPILE_OP=auto" in said, said
    assert call(4096, causal=True) is not None and call(3072, causal=True) is None  # (4.8e9 and 2.4e9: halved)
    assert call(4096, dtype=torch.bfloat16) is None and call(8192, dtype=torch.bfloat16) is not None
    for other in ("inline", "opaque"):
        monkeypatch.setenv("ELSA_COMPILE_OP", other)
        assert call(8192) is None


_TTIR_MEMO = r"""
import json, os, sys, torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime import driver


class Sm90:  # torch's analysis compiles to TTIR for the current target: an sm_90 one without a GPU
    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def is_active(self):
        return True


driver.set_active(Sm90())
from torch._dynamo.backends.common import aot_autograd
from torch._higher_order_ops import triton_kernel_wrap as tkw
from elsa_surgery import dispatch
from elsa_surgery.kernels import replay
ops = dispatch.kernels_module().ops
compiled = []
real_ttir = tkw.generate_ttir


def counted(kernel, *a, **kw):  # (in front of torch's: the memo, installed later, wraps this)
    compiled.append(getattr(getattr(kernel, "fn", kernel), "__name__", "?"))
    return real_ttir(kernel, *a, **kw)


tkw.generate_ttir = counted
walked, real_walk = [], tkw.ttir_to_functions


def walk(module, *a, **kw):  # (the functions read out of a module: memoised with it)
    walked.append(1)
    return real_walk(module, *a, **kw)


tkw.ttir_to_functions = walk
name = "identify_mutated_tensors" if hasattr(tkw, "identify_mutated_tensors") else "identify_accessed_tensors"
real_analysis, answers = getattr(tkw, name), []


def analysis(kernel, *a, **kw):
    got = real_analysis(kernel, *a, **kw)
    rw = getattr(got, "read_writes", None)
    answers.append([getattr(getattr(kernel, "fn", kernel), "__name__", "?"),
                    sorted(got) if rw is None else [sorted(d.name for d in rw.reads), sorted(d.name for d in rw.writes)]])
    return got


setattr(tkw, name, analysis)
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(2, 4, 2048, 64, generator=g) for _ in range(3))
from elsa_surgery.kernels import knobs
os.environ[knobs.PRECISE_SPLIT] = "f16"  # (K and V split into fp16 pieces)
os.environ[knobs.COMPILE_OP] = "inline"  # (4.3e9 multiply-adds: auto, the default, would trace them to the opaque op)


def chain(q, k, v):
    for _ in range(3):
        q = ops.attention_inline_op(q, k, v, None, None, None, 0.125, False, "precise", False)[0] + 0
    return q


out = {}
for memo in (True, False):
    compiled.clear(), answers.clear(), walked.clear()
    if not memo:
        tkw.generate_ttir = counted
    torch._dynamo.reset()
    try:
        torch.compile(chain, backend=aot_autograd(fw_compiler=lambda gm, ex: lambda *a: None), fullgraph=True)(q, k, v)
    except Exception:  # the captured graph returns nothing (never run)
        pass
    out["memo" if memo else "plain"] = dict(compiled=list(compiled), answers=[list(a) for a in answers],
                                            walked=len(walked))
out["stats"] = dict(replay.TTIR_MEMO)
print(json.dumps(out))
"""


def test_torchs_kernel_analysis_compiles_each_elsa_kernel_once_per_specialisation():
    """torch's analysis of what a user Triton kernel reads and writes compiles it to TTIR for every launch it
    traces, twice a launch once Inductor lowers it, with no cache (a CLIP-L/14-336's 24 calls: 96 compiles while
    tracing, 4.4 s of 6.9 s on a CPU). ``replay`` memoises that TTIR for ELSA's kernels, and the functions torch
    reads out of it: three identical fp32 ``precise`` split calls (``split_f16`` and ``elsa_fwd`` each) compile and
    walk each kernel once per specialisation, and every analysis answers as it does without the memo. Run on an sm_90 target without a GPU, in a process of its
    own (the memo stays installed)."""
    got = _traced_in_a_process(_TTIR_MEMO)
    memo, plain = got["memo"], got["plain"]
    assert got["stats"]["installed"] == "yes" and got["stats"]["hits"] > 0, got["stats"]
    assert got["stats"]["misses"] > 0 and got["stats"]["miss_s"] > 0, got["stats"]  # (the misses' seconds counted)
    assert sorted(set(plain["compiled"])) == ["elsa_fwd", "split_f16"], plain["compiled"]
    assert len(plain["compiled"]) >= 6 and len(plain["compiled"]) == len(plain["answers"]), plain
    assert len(memo["compiled"]) <= 4 and len(memo["compiled"]) < len(plain["compiled"]), memo["compiled"]
    assert memo["walked"] == len(memo["compiled"]) and plain["walked"] == len(plain["compiled"]), (memo, plain)
    assert memo["answers"] == plain["answers"], (memo["answers"], plain["answers"])
    assert any(a[1] for a in plain["answers"]), plain["answers"]  # (the analysis ran: it found what is written)

_TTIR_LOWERED = _TTIR_MEMO[:_TTIR_MEMO.index("out = {}")] + r"""  # (its inputs and chain of calls)
import torch._inductor.graph as G


class Lowered(Exception):  # raised once Inductor has lowered the graph (its code is not generated: no GPU here)
    pass


def stop(self, *a, **kw):
    raise Lowered()


G.GraphLowering.compile_to_module = stop
out = {}
for memo in (True, False):
    compiled.clear(), answers.clear()
    if not memo:
        tkw.generate_ttir = counted
    torch._dynamo.reset()
    lowered = False
    try:
        torch.compile(chain, fullgraph=True)(q, k, v)
    except Exception as e:  # (dynamo wraps it)
        lowered = "Lowered" in repr(e) or "Lowered" in repr(e.__cause__)
    out["memo" if memo else "plain"] = dict(compiled=list(compiled), analyses=len(answers), lowered=lowered)
out["stats"] = dict(replay.TTIR_MEMO)
print(json.dumps(out))
"""


def test_ttir_memo_serves_inductors_lowering():
    """Inductor's lowering of each launch (``ir.UserDefinedTritonKernel``) runs torch's analysis again, handing the
    kernel itself with its config's arguments in kwargs, where tracing hands an autotuner around it: the memo serves
    both (session 53: it took the kernel's Python function for the kernel there, and every lowered launch compiled its
    TTIR: 2.0 of the 2.6 s of lowering 24 CLIP-L/14-336-shaped calls on a CPU; on an H200 that model's lowering took
    7.0 s against the native model's 2.0 s). Three fp32 ``precise`` split calls compiled by Inductor up to the end
    of its lowering (sm_90 target without a GPU, in a process of its own): each kernel compiled once per
    specialisation, nothing passed on, against one compile an analysis without it."""
    got = _traced_in_a_process(_TTIR_LOWERED)
    memo, plain = got["memo"], got["plain"]
    assert memo["lowered"] and plain["lowered"], got
    assert sorted(set(plain["compiled"])) == ["elsa_fwd", "split_f16"], plain
    assert len(plain["compiled"]) == plain["analyses"] >= 12, plain  # (6 launches: traced twice, lowered)
    assert memo["analyses"] == plain["analyses"] and len(memo["compiled"]) <= 4, memo
    assert got["stats"]["others"] == 0 and got["stats"]["hits"] >= memo["analyses"] - 4, got["stats"]


def test_ttir_memo_keys_arguments_as_torch_compiles_them():
    """The memo's key of an argument is what ``generate_ttir`` compiles it as: a fake tensor as its dtype alone (a
    2-element tensor of it), a real tensor with its address's 16-byte alignment (Triton specialises on it), a symbolic
    size as one key (it substitutes 2), anything else by value; an unhashable one has no key (torch's function runs)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from elsa_surgery.kernels import replay

    with FakeTensorMode():
        f32, f16 = torch.empty(3, 5), torch.empty(7, dtype=torch.float16)
    assert replay._arg_spec(f32) == ("tensor", torch.float32) and replay._arg_spec(f16) == ("tensor", torch.float16)
    real = torch.zeros(8)
    assert replay._arg_spec(real) == ("real tensor", torch.float32, True)
    assert replay._arg_spec(real[1:]) == ("real tensor", torch.float32, False)
    sym = ShapeEnv().create_unbacked_symint()
    assert replay._arg_spec(sym) == ("symbolic",)
    assert replay._arg_spec(64) == ("value", int, 64) != replay._arg_spec(True)
    with pytest.raises(TypeError):
        replay._arg_spec([1, 2])

def test_compiled_calls_take_the_inline_op_unless_told_or_unable(monkeypatch, caplog):
    """Which op a compiled inference call traces to (``interface.inference_op``): the inline one by default (``auto``,
    whose long calls the inline op's body sends on, ``launch.long_call``) and with ``inline``; the opaque one with
    ``ELSA_COMPILE_OP=opaque``, under the interpreter (whose kernels ``wrap_triton`` cannot trace), and where this
    torch has no ``triton_op``, said once in the log; the inline op on real tensors (called outside Inductor) is the
    opaque op's kernel, the eager launcher."""
    from elsa_surgery.kernels import interface, occupancy

    k = dispatch.kernels_module()
    monkeypatch.setattr(occupancy, "interpreting", lambda: False)
    monkeypatch.setattr(interface, "_inline_ptxas", lambda: True)  # (this process's ptxas left alone)
    monkeypatch.delenv("ELSA_COMPILE_OP", raising=False)
    assert knobs.get(knobs.COMPILE_OP) == "auto"
    if ops.attention_inline_op is not None:
        assert interface.inference_op() is ops.attention_inline_op
        monkeypatch.setenv("ELSA_COMPILE_OP", "inline")
        assert interface.inference_op() is ops.attention_inline_op
    monkeypatch.setenv("ELSA_COMPILE_OP", "opaque")
    assert interface.inference_op() is ops.attention_inference_op
    monkeypatch.setenv("ELSA_COMPILE_OP", "sometimes")
    with pytest.raises(ValueError, match="ELSA_COMPILE_OP"):
        interface.inference_op()
    monkeypatch.delenv("ELSA_COMPILE_OP")
    monkeypatch.setattr(ops, "attention_inline_op", None)
    monkeypatch.setattr(ops, "INLINE_UNAVAILABLE", "torch 2.5 has no torch.library.triton_op (torch >= 2.6)")
    monkeypatch.setattr(interface, "_INLINE_LOGGED", [])
    with caplog.at_level("WARNING", logger="elsa_surgery.kernels"):
        assert interface.inference_op() is ops.attention_inference_op
        assert interface.inference_op() is ops.attention_inference_op
    said = [r.getMessage() for r in caplog.records if "opaque ELSA op" in r.getMessage()]
    assert said == ["elsa_surgery: compiled calls use the opaque ELSA op: torch 2.5 has no torch.library.triton_op "
                    "(torch >= 2.6)"], said
    monkeypatch.undo()
    assert k is dispatch.kernels_module() and occupancy.interpreting()
    assert interface.inference_op() is ops.attention_inference_op  # CI runs the interpreter
    gen = torch.Generator().manual_seed(4)
    q, kk, v = (torch.randn(1, 2, 12, 16, generator=gen) for _ in range(3))
    if ops.attention_inline_op is not None:
        a = ops.attention_inline_op(q, kk, v, None, None, None, 0.25, True, "strict", False)
        b = ops.attention_inference_op(q, kk, v, None, None, None, 0.25, True, "strict", False)
        assert torch.equal(a[0], b[0])


def test_a_call_traced_to_the_inline_op_matches_the_ptxas_before_inductor_compiles(monkeypatch):
    """A call traced to the inline op matches Triton's ptxas to Inductor's (``internals.match_inductor_ptxas``) when the
    op is chosen (``interface.inference_op``), as plain Python while dynamo traces (no graph break): a warm start
    (AOTAutograd's cache hit) traces no launch of the op's body, and Inductor compiles the graph's ELSA kernels again
    in this process, which with Triton's own ptxas missed the cold start's cache entries (session 54, H200: the
    warm-start GPU test found a new ``elsa_fwd`` entry). The traced route's plans choose the op the same way
    (``callcache._make_traced_plan``); a call on the opaque op leaves the match to that op's first launch."""
    from elsa_surgery.kernels import interface, internals, occupancy

    if ops.attention_inline_op is None:
        pytest.skip(ops.INLINE_UNAVAILABLE)
    calls = []
    monkeypatch.setattr(internals, "match_inductor_ptxas", lambda: calls.append(1))
    monkeypatch.setattr(occupancy, "interpreting", lambda: False)

    def f(x):
        return x + (1 if interface.inference_op() is ops.attention_inline_op else 2)

    torch._dynamo.reset()
    assert torch.equal(torch.compile(f, backend="eager", fullgraph=True)(torch.zeros(2)), torch.ones(2))
    assert calls == [1], calls
    monkeypatch.setenv("ELSA_COMPILE_OP", "opaque")
    assert interface.inference_op() is ops.attention_inference_op and calls == [1]
    torch._dynamo.reset()


_SM90_COMPILER = r"""
import contextlib, json, os, sys, tempfile, torch
os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp()  # (every kernel compiled here, not read from a cache)
from triton.backends.compiler import GPUTarget
from triton.runtime import driver


class Sm90:  # Triton's compiler for an sm_90 target without a GPU (ptxas included)
    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def is_active(self):
        return True


driver.set_active(Sm90())
from torch._subclasses.fake_tensor import FakeTensorMode
from triton.runtime.jit import JITFunction
compiles = []  # the name of every kernel Triton compiles
real_compile = JITFunction._do_compile


def counted(self, *a, **kw):
    compiles.append(self.fn.__name__)
    return real_compile(self, *a, **kw)


JITFunction._do_compile = counted
"""


_PRECOMPILE = _SM90_COMPILER + r"""
from elsa_surgery.kernels import knobs, launch, replay
os.environ[knobs.COMPILE_OP] = "opaque"
os.environ[knobs.PRECISE_SPLIT] = "f16"
launch._triton_device = lambda t: True
calls = [("masked", (1, 4, 300, 16), (1, 2, 300, 16), True, "strict"),
         ("precise", (1, 4, 2048, 64), (1, 4, 2048, 64), False, "precise")]
out = {}
with FakeTensorMode():
    fakes = {}
    for name, qs, ks, masked, prec in calls:
        q, k, v = torch.empty(qs), torch.empty(ks), torch.empty(ks)
        n = qs[2]
        m = torch.empty(1, 1, n, n, dtype=torch.bool) if masked else None
        fakes[name] = (q, k, v, m, prec)
        out[name] = launch.precompile(q, k, v, scale=0.125, mask=m, precision=prec)
    out["again"] = launch.precompile(*fakes["masked"][:3], scale=0.125, mask=fakes["masked"][3],
                                     precision="strict")
launch._POOL[0].shutdown(wait=True)
out["background"] = sorted(compiles)
out["stats"] = {k: v for k, v in launch.PRECOMPILE.items() if k != "not"}
# the launches a real first run makes, on real tensors of the same sizes, strides and alignment: all found compiled
# (made as the eager launcher makes them, outside wrapped_launches: replay.launch itself intercepted; session 55's
# GPU run found a bool mask collected as *u1 where the run reads a *u8 view, its kernels compiled twice)
compiles.clear()
relaunched = []


def first_run(fn, grid, *args, **kwargs):
    fn.run(*args, grid=grid, warmup=True, **kwargs)  # (warmup: compiled or found, not launched: no GPU here)
    relaunched.append(fn.fn.__name__)


replay.launch = first_run
for name, (q, k, v, m, prec) in fakes.items():
    q2, k2, v2 = (torch.empty(t.shape) for t in (q, k, v))
    m2 = None if m is None else torch.empty(m.shape, dtype=torch.bool)
    launch.attention(q2, k2, v2, scale=0.125, mask=m2, precision=prec, return_lse=False)
out["relaunched"] = sorted(relaunched)
out["compiled_again"] = compiles
print(json.dumps(out))
"""


def test_precompile_compiles_what_the_first_run_launches():
    """``launch.precompile`` (calls traced to the opaque op: a long one under ``auto``, every one under ``opaque``)
    records a call's launches on fake tensors and compiles their kernels in a background thread with Triton's
    ``warmup``, for an sm_90 target without a GPU (ptxas included): a masked GQA ``strict`` call (the mask-tile
    kernels and ``elsa_fwd``) and a ``precise`` call over the fp16 split (``split_f16`` and ``elsa_fwd``), each
    kernel once; the same signature is not submitted again; and the launches of the calls' first run, on real tensors
    of the same sizes, strides and alignment, find every kernel compiled (Triton compiles nothing again: the warmup's
    specialisation is the launch's). Triton 3.6 and 3.8 alike."""
    got = _traced_in_a_process(_PRECOMPILE)
    assert got["masked"] is None and got["precise"] is None and got["again"] == "submitted before", got
    want = ["elsa_fwd", "elsa_fwd", "mask_tile_classes", "mask_tile_ranges", "split_f16"]
    assert got["background"] == want and got["relaunched"] == want, got
    assert got["stats"]["kernels"] == 5 and got["stats"]["errors"] == 0 and got["stats"]["calls"] == 2, got
    assert got["compiled_again"] == [], got


_PRECOMPILE_HOPPER = _SM90_COMPILER + r"""
from elsa_surgery.kernels import hopper, knobs, launch, occupancy, replay
if hopper.gluon is None:
    print(json.dumps({"skip": "no Gluon in this Triton"}))
    raise SystemExit
os.environ[knobs.COMPILE_OP] = "auto"
# a CUDA device of compute capability 9.0 with 132 SMs, as the planner and hopper.eligible ask for one
occupancy._capability = lambda index: (9, 0)
occupancy.sm_count = lambda index: 132
occupancy._l2_bytes = lambda index: 50 << 20
torch.cuda.current_device = lambda: 0
torch.cuda.device = lambda index: contextlib.nullcontext()
torch.cuda.is_current_stream_capturing = lambda: False
# bf16 (the wgmma kernel), fp32 strict (the FMA kernel), fp32 turbo (TF32 wgmma), each long enough for the Hopper
# kernel in an eager call without encoded TMA maps (hopper.MIN_WORK*); causal for one
calls = [("bf16", torch.bfloat16, (8, 8, 2048, 64), False, None),
         ("strict", torch.float32, (2, 8, 1024, 64), True, "strict"),
         ("turbo", torch.float32, (2, 8, 1024, 128), False, "turbo")]
out = {}
import warnings
from torch._subclasses.fake_tensor import FakeTensor


def no_pointer(self):  # torch 2.11's answer (2.14: 0 with a deprecation warning); session 57's GPU run met it
    raise RuntimeError("Cannot access data pointer of Tensor (e.g. FakeTensor, FunctionalTensor)")


with warnings.catch_warnings(record=True) as caught, FakeTensorMode():
    warnings.simplefilter("always")
    FakeTensor.data_ptr = no_pointer
    try:
        for name, dt, shape, causal, prec in calls:
            q = torch.empty(shape, dtype=dt, device="cuda")
            out[name] = launch.precompile(q, q, q, scale=0.125, is_causal=causal, precision=prec)
    finally:
        del FakeTensor.data_ptr
out["warnings"] = [str(w.message)[:100] for w in caught if "FakeTensor" in str(w.message)]
launch._POOL[0].shutdown(wait=True)
out["background"] = sorted(compiles)
out["stats"] = {k: v for k, v in launch.PRECOMPILE.items() if k not in ("not", "compiled_s")}
# the first run's launches, made as the eager launcher makes them (outside wrapped_launches: replay.launch itself
# intercepted, launch plans off), on fake CUDA tensors of the same sizes and strides: all found compiled
os.environ[knobs.LAUNCH_PLANS] = "0"
compiles.clear()
relaunched = []
current = [None]


def first_run(fn, grid, *args, **kwargs):
    fn.run(*args, grid=grid, warmup=True, **kwargs)  # (warmup: compiled or found, not launched: no GPU here)
    relaunched.append((current[0], fn.fn.__name__))


replay.launch = first_run
with FakeTensorMode():
    for name, dt, shape, causal, prec in calls:
        q = torch.empty(shape, dtype=dt, device="cuda")
        current[0] = name
        launch.attention(q, q, q, scale=0.125, is_causal=causal, precision=prec, return_lse=False)
out["relaunched"] = sorted(relaunched)
out["compiled_again"] = compiles
print(json.dumps(out))
"""


def test_precompile_compiles_the_hopper_kernels_for_their_first_run():
    """Calls the Hopper kernels take run on the opaque op whatever ``ELSA_COMPILE_OP`` says, and ``launch.precompile``
    compiles their Gluon kernels in the background too (before session 56 they compiled at the compiled call's first
    run, in the main thread, unless an eager call had compiled them): on fake CUDA tensors of an sm_90 device without
    a GPU (Triton's compiler for that target, the device's properties stubbed), a bf16 call (the wgmma kernel), a
    causal ``strict`` call (the FMA kernel) and a ``turbo`` call (TF32 wgmma) are each submitted and compiled there
    without an error, and the launches of their first run, made as the eager launcher makes them, find every kernel
    compiled: Triton compiles nothing again (a TMA descriptor made on a fake tensor specialises as the run's). The
    fake tensors refuse ``data_ptr()`` while the calls are submitted, as torch 2.11's do (session 57: the GPU run's
    failure, which torch 2.14's warning hid here)."""
    got = _traced_in_a_process(_PRECOMPILE_HOPPER)
    if "skip" in got:
        pytest.skip(got["skip"])
    assert got["bf16"] is None and got["strict"] is None and got["turbo"] is None, got
    assert got["relaunched"] == [["bf16", "_elsa_fwd_sm90"], ["strict", "_elsa_fwd_sm90_fma"],
                                 ["turbo", "_elsa_fwd_sm90"]], got
    assert got["background"] == ["_elsa_fwd_sm90", "_elsa_fwd_sm90", "_elsa_fwd_sm90_fma"], got
    assert got["stats"]["calls"] == 3 and got["stats"]["kernels"] == 3 and got["stats"]["errors"] == 0, got
    assert got["compiled_again"] == [], got
    assert got["warnings"] == [], got  # (no data_ptr read of a fake base: hopper._desc)


def test_traced_calls_ask_for_their_kernels_precompiled(monkeypatch):
    """A call that torch.compile traces through the traced route asks ``launch.precompile`` for its kernels, with the
    plan's fake tensors (canonical ``[B, H, N, D]`` views, the mask, causal flag, scale and precision), while dynamo
    traces (plain Python: no graph break); whatever it answers, the call is traced as before."""
    from torch._subclasses.fake_tensor import FakeTensor

    from elsa_surgery.kernels import launch

    seen = []

    def record(q, k, v, *, scale, mask=None, is_causal=False, precision=None):
        seen.append((type(q) is FakeTensor, tuple(q.shape), tuple(k.shape), None if mask is None else mask.dtype,
                     is_causal, scale, precision))
        return "recorded"

    monkeypatch.setattr(launch, "precompile", record)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, h, 40, 16, generator=gen) for h in (4, 2, 2))
    mask = torch.rand(40, 40, generator=gen) > 0.3

    def f(q, k, v, mask):
        return elsa_surgery.attention(q, k, v, mask, backend="elsa", precision="strict", enable_gqa=True)

    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(f, backend="eager", fullgraph=True)(q, k, v, mask)
        want = f(q, k, v, mask)
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-7)
    assert seen == [(True, (1, 4, 40, 16), (1, 2, 40, 16), torch.bool, False, 0.25, "strict")], seen
    torch._dynamo.reset()


def test_traced_long_calls_go_to_the_opaque_op_itself(monkeypatch):
    """Under ``ELSA_COMPILE_OP=auto`` (the default) a long call's traced plan names the opaque op itself
    (``launch.long_call``), so the graph dynamo hands on holds ``attention_inference``, not the inline op whose body
    would send it there while AOTAutograd traces; a short call's plan names the inline op (here in a process the
    inline op serves, as a GPU's: the interpreter's takes the opaque op for every call)."""
    from elsa_surgery import callcache
    from elsa_surgery.kernels import interface, launch

    if ops.attention_inline_op is None:
        pytest.skip(ops.INLINE_UNAVAILABLE)
    monkeypatch.setattr(interface, "inference_op", lambda: ops.attention_inline_op)
    monkeypatch.setattr(launch, "precompile", lambda *a, **k: "not here")
    sig = ((1, 2, 32, 16), torch.float32, torch.device("cpu"), False) * 3 + (None, 0.0, False, None, False, "elsa",
                                                                             "strict", False, False, False)
    for long, kind in ((None, callcache._INLINE), ("a long call", callcache._OPAQUE)):
        monkeypatch.setattr(launch, "long_call", lambda q, k, v, causal, long=long: long)
        plan = callcache._traced_plan(sig)
        assert plan is not None and plan[6] == kind, (long, plan)
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 32, 16, generator=gen) for _ in range(3))

    def f(q, k, v):
        return elsa_surgery.attention(q, k, v, backend="elsa", precision="strict")

    ops_in_graph = []

    def capture(gm, example):
        ops_in_graph.extend(str(n.target) for n in gm.graph.nodes if "elsa_surgery" in str(n.target))
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(f, backend=capture, fullgraph=True)(q, k, v)
        assert torch.allclose(got, f(q, k, v), rtol=1e-6, atol=1e-7)
    assert ops_in_graph == ["elsa_surgery.attention_inference.default"], ops_in_graph
    torch._dynamo.reset()


def test_precompile_says_why_not(monkeypatch):
    """What ``launch.precompile`` leaves to the first run, and why: ``ELSA_PRECOMPILE=0``, the interpreter or a
    device Triton does not compile for, and a call the inline op takes (Inductor compiles its kernels:
    a short call under ``auto``); ``callcache._precompile`` counts the reasons and never raises."""
    from types import SimpleNamespace

    from torch._subclasses.fake_tensor import FakeTensorMode

    from elsa_surgery import callcache
    from elsa_surgery.kernels import interface, launch, occupancy

    with FakeTensorMode():
        q = torch.empty(1, 2, 64, 16)
    assert launch.precompile(q, q, q, scale=0.25) == "not a CUDA call compiled by Triton"  # (CI: the interpreter)
    monkeypatch.setattr(occupancy, "interpreting", lambda: False)
    assert launch.precompile(q, q, q, scale=0.25) == "not a CUDA call compiled by Triton"  # (a CPU tensor)
    monkeypatch.setattr(launch, "_triton_device", lambda t: True)
    monkeypatch.setenv("ELSA_PRECOMPILE", "0")
    assert launch.precompile(q, q, q, scale=0.25) == "ELSA_PRECOMPILE=0"
    monkeypatch.setenv("ELSA_PRECOMPILE", "1")
    if ops.attention_inline_op is not None:
        monkeypatch.setattr(interface, "_inline_ptxas", lambda: True)
        assert launch.precompile(q, q, q, scale=0.25) == "the inline op: Inductor compiles its kernels"
    monkeypatch.setitem(launch.PRECOMPILE, "not", {})

    def boom(*a, **k):
        raise RuntimeError("no plan")

    monkeypatch.setattr(launch, "precompile", boom)
    p = SimpleNamespace(q=q, k=q, v=q, scale=0.25, mask=None, is_causal=False)
    callcache._precompile(p, SimpleNamespace(precision=None))
    assert launch.PRECOMPILE["not"] == {"failed: RuntimeError: no plan": 1}


def _inline_calls(dtype, precision):
    """``(call, inputs)``: four ELSA calls as converted models make them (a bool window mask and GQA, causal GQA,
    a causal-shaped bool mask over 1,100 keys whose tiles are classified first, and an unmasked call over 2,048 keys
    that ``precise`` runs on K/V split into fp16 pieces), on fresh inputs."""
    gen = torch.Generator(device="cuda").manual_seed(5)

    def r(*shape):
        return torch.randn(*shape, device="cuda", generator=gen).to(dtype)

    pos = torch.arange(300, device="cuda")
    window = ((pos[:, None] - pos[None]).abs() < 40)[None, None]
    long_pos = torch.arange(1100, device="cuda")
    causal = (long_pos[:, None] >= long_pos[None])[None, None]
    inputs = (r(2, 4, 300, 64), r(2, 2, 300, 64), r(2, 2, 300, 64), window, r(1, 2, 1100, 64), r(1, 2, 1100, 64),
              r(1, 2, 1100, 64), causal, r(1, 4, 2048, 64), r(1, 4, 2048, 64), r(1, 4, 2048, 64))

    def call(q, k, v, window, lq, lk, lv, causal, sq, sk, sv):
        kw = dict(backend="elsa", precision=precision)
        return (elsa_surgery.attention(q, k, v, window, enable_gqa=True, **kw),
                elsa_surgery.attention(q, k, v, is_causal=True, enable_gqa=True, **kw),
                elsa_surgery.attention(lq, lk, lv, causal, **kw),
                elsa_surgery.attention(sq, sk, sv, **kw))

    return call, inputs


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,precision", [(torch.float32, "precise"), (torch.float32, "strict"),
                                             (torch.float32, "turbo"), (torch.bfloat16, None)])
def test_inline_op_launches_its_kernels_from_inductors_code_gpu(dtype, precision, monkeypatch):
    """The inline op (``ELSA_COMPILE_OP=auto``, the default, for these short calls): Inductor's generated code launches
    the ELSA kernels itself (no call of the op in it, ``elsa_fwd`` and the mask-tile kernels defined in it), torch's
    analysis of what each kernel writes succeeded (where it fails it assumes every argument written and copies the
    inputs), and the compiled calls equal the eager ones: fp32 within 1e-6 relative. Calls the Hopper kernel takes
    (unmasked bf16/fp16, fp32 strict and turbo) stay on the opaque op. ``precise``'s split call launches
    ``split_f16`` from Inductor's code too (its constexprs left to their defaults once broke Inductor's launcher:
    ``replay.with_defaults``)."""
    from elsa_surgery.kernels import hopper

    from torch._higher_order_ops import triton_kernel_wrap

    monkeypatch.delenv("ELSA_COMPILE_OP", raising=False)
    analysed, failed, real = [], [], triton_kernel_wrap.generate_ttir

    def generate_ttir(kernel, *args, **kwargs):  # what torch's write analysis compiles (a failure is swallowed)
        try:
            analysed.append(getattr(getattr(kernel, "fn", kernel), "__name__", repr(kernel)))
            return real(kernel, *args, **kwargs)
        except Exception as e:
            failed.append(repr(e)[:500])
            raise

    monkeypatch.setattr(triton_kernel_wrap, "generate_ttir", generate_ttir)
    call, inputs = _inline_calls(dtype, precision)
    torch._dynamo.reset()
    with torch.no_grad(), torch._inductor.config.patch(force_disable_caches=True):
        got, code = run_and_get_code(torch.compile(call, fullgraph=True), *inputs)
        want = call(*inputs)
    assert "elsa_fwd" in analysed and not failed, (analysed, failed)
    code = "\n".join(code)
    for g, w in zip(got, want):
        if dtype == torch.float32:
            assert _rel(g, w) <= RTOL
        else:
            assert (g.float() - w.float()).abs().max() <= 2e-2
    assert "ops.elsa_surgery.attention_inline" not in code, code
    assert "def elsa_fwd" in code and "def mask_tile_ranges" in code, code
    assert ("def split_f16" in code) == (precision == "precise"), code  # (launched with every parameter)
    hopper_ok = any(hopper.eligible(q, k, v, q, mask=None, q_lengths=None, kv_lengths=None, varlen=False,
                                    state=None, scale=0.125, precision=precision, how="force") is None
                    for q, k, v in (inputs[0:3], inputs[8:11]))  # (the unmasked calls)
    assert ("ops.elsa_surgery.attention_inference" in code) == hopper_ok, code



@pytest.mark.gpu
def test_auto_compile_op_traces_long_calls_to_the_opaque_op_gpu(monkeypatch):
    """``ELSA_COMPILE_OP=auto`` on the GPU: in one compiled function, a short fp32 ``precise`` call's kernels are
    launched from Inductor's code and a long causal one's (8.6e9 multiply-adds) through the opaque op; both equal their
    eager calls within 1e-6 relative."""
    monkeypatch.setenv("ELSA_COMPILE_OP", "auto")
    gen = torch.Generator(device="cuda").manual_seed(7)
    short = [torch.randn(1, 4, 300, 64, device="cuda", generator=gen) for _ in range(3)]
    long = [torch.randn(1, 8, 4096, 64, device="cuda", generator=gen) for _ in range(3)]

    def call(q, k, v, lq, lk, lv):
        kw = dict(backend="elsa", precision="precise")
        return elsa_surgery.attention(q, k, v, **kw), elsa_surgery.attention(lq, lk, lv, is_causal=True, **kw)

    torch._dynamo.reset()
    with torch.no_grad(), torch._inductor.config.patch(force_disable_caches=True):
        got, code = run_and_get_code(torch.compile(call, fullgraph=True), *short, *long)
        want = call(*short, *long)
    code = "\n".join(code)
    assert "def elsa_fwd" in code and "ops.elsa_surgery.attention_inference" in code, code
    for g, w in zip(got, want):
        assert _rel(g, w) <= RTOL


_PRECOMPILE_GPU = r"""
import json, os, sys, tempfile, threading, torch
os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp()  # (nothing compiled before)
import elsa_surgery
from triton.runtime.jit import JITFunction
from elsa_surgery.kernels import launch
compiled = {"main": [], "background": [], "eager": []}
phase = ["main"]
real = JITFunction._do_compile


def counted(self, *a, **kw):
    side = phase[0] if threading.current_thread() is threading.main_thread() else "background"
    compiled[side].append(self.fn.__name__)
    return real(self, *a, **kw)


JITFunction._do_compile = counted
loaded = {"main": [], "background": [], "eager": []}
try:
    from triton.compiler.compiler import CompiledKernel
    real_init = CompiledKernel._init_handles


    def counted_init(self):
        if getattr(self, "module", None) is None:
            side = phase[0] if threading.current_thread() is threading.main_thread() else "background"
            loaded[side].append(self.name)
        return real_init(self)


    CompiledKernel._init_handles = counted_init
except (ImportError, AttributeError):
    loaded = None
gen = torch.Generator(device="cuda").manual_seed(8)
hopper_call = len(sys.argv) > 1 and sys.argv[1] == "hopper"
dtype = torch.bfloat16 if hopper_call else torch.float32
q, k, v = (torch.randn(1, 16 if hopper_call else 8, 4096, 64, device="cuda", generator=gen, dtype=dtype)
           for _ in range(3))
pos = torch.arange(4096, device="cuda")
mask = None if hopper_call else (pos[:, None] >= pos[None])[None, None]


def f(q, k, v, mask):
    return elsa_surgery.attention(q, k, v, mask, backend="elsa", precision=None if hopper_call else "precise")


with torch.no_grad():
    got = torch.compile(f, fullgraph=True)(q, k, v, mask)
    if launch._POOL:
        launch._POOL[0].shutdown(wait=True)
    phase[0] = "eager"
    want = f(q, k, v, mask)
print(json.dumps(dict(stats={n: x for n, x in launch.PRECOMPILE.items() if n != "compiled_s"}, compiled=compiled,
                      loaded=loaded, rel=float((got.float() - want.float()).norm() / want.float().norm()))))
"""


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["masked", "hopper"])
def test_precompile_compiles_a_long_masked_calls_kernels_while_traced_gpu(case):
    """A long masked fp32 call (8.6e9 multiply-adds: the opaque op under ``auto``, the default) has its kernels
    compiled in the background while torch.compile traces it (``launch.precompile``), in a process of its own on an
    empty Triton cache: one call submitted, the mask-tile kernels and ``elsa_fwd`` compiled there without an error,
    the compiled call's first run compiles nothing in the main thread (session 55: it compiled the bool mask's kernels
    again, as ``*u8``) and loads nothing there (session 56: the kernels' launchers were built by its first launch), and
    the compiled call equals the eager one (fp32 within 1e-6 relative). ``hopper``: a long bf16 call without a mask,
    which the Hopper kernel takes (session 56: its Gluon kernel precompiled too), equal to eager within 1e-2."""
    import json
    import subprocess
    import sys

    if case == "hopper" and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Hopper kernels need a compute capability 9.x GPU")
    env = {n: x for n, x in os.environ.items() if n not in ("TRITON_INTERPRET", "ELSA_COMPILE_OP", "ELSA_PRECOMPILE")}
    p = subprocess.run([sys.executable, "-c", _PRECOMPILE_GPU, case], capture_output=True, text=True, env=env,
                       timeout=500)
    assert p.returncode == 0, p.stderr[-4000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    print(got)
    assert got["stats"]["calls"] == 1 and got["stats"]["errors"] == 0, got
    want = {"_elsa_fwd_sm90"} if case == "hopper" else {"elsa_fwd", "mask_tile_classes", "mask_tile_ranges"}
    assert want <= set(got["compiled"]["background"]), got
    assert got["compiled"]["main"] == [], got
    if got["loaded"] is not None:  # (a Triton with CompiledKernel._init_handles: loaded and launchers built there too)
        assert got["stats"]["loaded"] == got["stats"]["kernels"], got
        assert got["loaded"]["main"] == [], got
    assert got["rel"] <= (1e-2 if case == "hopper" else RTOL), got


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,precision", [(torch.float32, "precise"), (torch.bfloat16, None)])
def test_compiled_calls_under_cuda_graphs_gpu(dtype, precision, monkeypatch):
    """``max-autotune`` and ``reduce-overhead`` run the compiled graph as CUDA graphs (cudagraph trees): the ELSA
    launches of the inline and the opaque op are captured once and replayed on the graph's static buffers. Each call,
    on inputs of new values, equals the eager one (fp32 within 1e-6 relative), the outputs copied at once (the next
    replay may reuse their memory). Session 51: the compiled-cell benchmark read a max-autotune LLaMA 4K fp32 output
    that a later call had overwritten."""
    monkeypatch.delenv("ELSA_COMPILE_OP", raising=False)
    call, inputs = _inline_calls(dtype, precision)
    torch._dynamo.reset()
    compiled = torch.compile(call, mode="reduce-overhead", fullgraph=True)
    gen = torch.Generator(device="cuda").manual_seed(6)
    with torch.no_grad():
        for step in range(4):  # warm-up, capture, then replays
            if step:
                inputs = tuple(x if x.dtype == torch.bool else torch.randn(x.shape, device="cuda", generator=gen)
                               .to(dtype) for x in inputs)
            got = [g.clone() for g in compiled(*inputs)]
            want = call(*inputs)
            for g, w in zip(got, want):
                if dtype == torch.float32:
                    assert _rel(g, w) <= RTOL, (step, _rel(g, w))
                else:
                    assert (g.float() - w.float()).abs().max() <= 2e-2, step
    torch._dynamo.reset()

_WARM_START = r"""
import json, os, torch, elsa_surgery
gen = torch.Generator(device="cuda").manual_seed(0)
q, k, v = (torch.randn(2, 4, 300, 64, device="cuda", generator=gen) for _ in range(3))
mask = (torch.arange(300, device="cuda")[:, None] >= torch.arange(300, device="cuda")[None])[None, None]

def call(q, k, v, mask):
    return elsa_surgery.attention(q, k, v, mask, backend="elsa", precision="strict")

with torch.no_grad():
    got = torch.compile(call, fullgraph=True)(q, k, v, mask)
    want = call(q, k, v, mask)
print(json.dumps(dict(ptxas=os.environ.get("TRITON_PTXAS_PATH"),
                      rel=float((got - want).norm() / want.norm()))))
"""


@pytest.mark.gpu
def test_warm_compile_start_finds_the_kernels_in_tritons_cache_gpu(tmp_path):
    """A compiled masked call (the inline op: Inductor's code launches ``elsa_fwd`` and the mask-tile kernels),
    compiled cold in one process, then warm in another on the same caches: the warm process compiles no ELSA kernel
    again (no new Triton cache entry of theirs). Session 42 (torch 2.11): the warm start compiled them in the main
    process with Triton's ptxas, the cold one in Inductor's workers with torch's; the ptxas version is in Triton's
    cache key (``kernels/internals.match_inductor_ptxas``)."""
    import json
    import subprocess
    import sys

    from elsa_surgery.kernels import internals

    if ops.attention_inline_op is None:
        pytest.skip(ops.INLINE_UNAVAILABLE)
    drop = ("TRITON_PTXAS_PATH", "TRITON_INTERPRET", "ELSA_COMPILE_OP", "TORCHINDUCTOR_FORCE_DISABLE_CACHES")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"), TRITON_CACHE_DIR=str(tmp_path / "triton"))

    def run():
        p = subprocess.run([sys.executable, "-c", _WARM_START], capture_output=True, text=True, env=env, timeout=500)
        assert p.returncode == 0, p.stderr[-4000:]
        got = json.loads(p.stdout.strip().splitlines()[-1])
        assert got["rel"] <= RTOL, got
        return got

    def elsa_entries():
        return {d.name for d in (tmp_path / "triton").iterdir() if d.is_dir()
                and any(f.suffix == ".json" and f.name.startswith(("elsa_fwd", "mask_tile")) for f in d.iterdir())}

    cold = run()
    compiled = elsa_entries()
    assert compiled, "no ELSA kernel in Triton's cache after the cold start"
    warm = run()
    assert elsa_entries() == compiled, "the warm start compiled ELSA kernels again"
    assert cold["ptxas"] == warm["ptxas"] == internals.torch_ptxas()


def _block(x, w_qkv, w_out, heads):
    """An attention block as the adapters run it: one qkv projection viewed as ``[B, H, N, D]`` q, k, v (strided
    views of the projection's output, no copy), the op, heads back to channels, the output projection."""
    B, N, C = x.shape
    q, k, v = (x @ w_qkv).view(B, N, 3, heads, C // heads).permute(2, 0, 3, 1, 4).unbind(0)
    out, _ = torch.ops.elsa_surgery.attention(q, k, v, None, None, None, (C // heads) ** -0.5, False, "")
    return out.transpose(1, 2).reshape(B, N, C) @ w_out


def _block_code(device):
    gen = torch.Generator(device=device).manual_seed(2)
    x = torch.randn(2, 16, 32, device=device, generator=gen)
    w_qkv, w_out = torch.randn(32, 96, device=device, generator=gen), torch.randn(32, 32, device=device, generator=gen)
    want = _block(x, w_qkv, w_out, 2)
    inductor_metrics.reset()
    with torch._inductor.config.patch(force_disable_caches=True):
        got, code = run_and_get_code(torch.compile(_block, fullgraph=True), x, w_qkv, w_out, 2)
    assert _rel(got, want) <= RTOL
    return inductor_metrics.generated_kernel_count, "\n".join(code)


@CPU_ONLY
def test_op_reads_the_adapters_strided_views_without_a_copy():
    """The q, k, v views the adapters hand over (``[B, N, 3, H, D]`` memory seen as ``[B, H, N, D]``) reach the op as
    they are: with the strided output layout, Inductor generates no kernel at all around it (no clone of q, k or v
    before it, none of the output after it): the two matmuls are library calls."""
    if not ops.STRIDED_OUTPUT:
        pytest.skip(f"torch {torch.__version__}: the op keeps the contiguous layout (kernels/ops.py)")
    kernels, code = _block_code("cpu")
    assert kernels == 0 and "clone" not in code, code


@pytest.mark.gpu
def test_op_reads_the_adapters_strided_views_without_a_copy_gpu():
    if not ops.STRIDED_OUTPUT:
        pytest.skip(f"torch {torch.__version__}: the op keeps the contiguous layout (kernels/ops.py)")
    kernels, code = _block_code("cuda")
    assert kernels == 0 and "clone" not in code, code


def test_mask_builder_takes_the_causal_skip_while_tracing(monkeypatch):
    """Under torch.compile the adapter's mask builder returns no mask (SDPA's ``is_causal`` rule: our causal kernel
    skips the masked blocks) where transformers would skip outside tracing and the decision reads no tensor: plain
    causal, no padding mask, int lengths with one query or as many queries as keys, no local window reaching the
    keys. Everything else goes to transformers' builder; outside tracing, transformers decides."""
    pytest.importorskip("transformers")
    from elsa_surgery.adapters import transformers_attention as ta

    mu = ta._masking_utils()
    built = []
    monkeypatch.setattr(ta, "_sdpa_mask", lambda: (lambda *a, **kw: built.append(kw) or "mask"))
    causal = dict(batch_size=2, mask_function=mu.causal_mask_function)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    assert ta.elsa_mask(q_length=8, kv_length=8, **causal) == "mask"  # eager: transformers' own rule
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    for q_len, kv_len in ((8, 8), (1, 8)):
        assert ta.elsa_mask(q_length=q_len, kv_length=kv_len, **causal) is None
    assert ta.elsa_mask(cache_position=torch.arange(6), kv_length=6, **causal) is None  # older transformers' kwargs
    assert ta.elsa_mask(q_length=8, kv_length=8, local_size=16, **causal) is None
    built.clear()
    kept = [dict(q_length=4, kv_length=8), dict(q_length=8, kv_length=8, attention_mask=torch.ones(2, 8)),
            dict(q_length=8, kv_length=8, local_size=8), dict(q_length=8, kv_length=8, q_offset=torch.tensor(0)),
            dict(q_length=8, kv_length=8, use_vmap=True), dict(q_length=8, kv_length=8, allow_is_causal_skip=False),
            dict(q_length=8, kv_length=8, mask_function=mu.bidirectional_mask_function, batch_size=2)]
    for kw in kept:
        assert ta.elsa_mask(**{**causal, **kw}) == "mask", kw
    assert len(built) == len(kept)


def _traced_cases(dev):
    """``name -> (call, tensors)``: calls whose canonical problem differs from their arguments in every way the traced
    route replays (3-D inputs, broadcast batch and heads, GQA, masks of fewer dims, windowed masks, lse)."""
    gen = torch.Generator().manual_seed(7)
    r = lambda *s: torch.randn(*s, generator=gen).to(dev)  # noqa: E731
    e = dict(backend="elsa")
    return {
        "3d": (lambda q, k, v: elsa_surgery.attention(q, k, v, **e), (r(2, 12, 16), r(2, 20, 16), r(2, 20, 16))),
        "broadcast": (lambda q, k, v: elsa_surgery.attention(q, k, v, scale=1.0, **e),
                      (r(2, 4, 12, 16), r(1, 1, 20, 16), r(1, 1, 20, 24))),
        "gqa_causal": (lambda q, k, v: elsa_surgery.attention(q, k, v, is_causal=True, enable_gqa=True, **e),
                       (r(2, 4, 12, 16), r(2, 2, 20, 16), r(2, 2, 20, 16))),
        "mask_2d_bool": (lambda q, k, v, m: elsa_surgery.attention(q, k, v, m, **e),
                         (r(2, 4, 12, 16), r(2, 4, 20, 16), r(2, 4, 20, 16),
                          (torch.rand(12, 20, generator=gen) < 0.7).to(dev))),
        "mask_additive_lse": (lambda q, k, v, m: elsa_surgery.attention(q, k, v, m, return_lse=True, **e),
                              (r(2, 4, 12, 16), r(2, 4, 20, 16), r(2, 4, 20, 16), r(1, 4, 1, 20))),
        "windowed": (lambda q, k, v, m: elsa_surgery.attention(q, k, v, m, windowed_mask=True, **e),
                     (r(4, 2, 12, 16), r(4, 2, 12, 16), r(4, 2, 12, 16), r(2, 1, 12, 12))),
    }


def _check_traced_route(dev):
    from elsa_surgery import callcache

    for name, (call, tensors) in _traced_cases(dev).items():
        torch._dynamo.reset()
        dynamo_utils.counters.clear()
        graphs = []
        before = dict(callcache.TRACED)
        compiled = torch.compile(call, backend=_recording("aot_eager", graphs), fullgraph=True)
        got = compiled(*tensors)
        assert callcache.TRACED["plans"] == before["plans"] + 1 and callcache.TRACED["full"] == before["full"], name
        assert _rel(got, call(*tensors)) <= RTOL, name
        again = compiled(*[t.clone() for t in tensors])  # the same shapes: no recompilation
        assert _rel(again, got) == 0 and len(graphs) == 1, name
        # the full path traced (the route off) holds the same op, and gives the same answer
        torch._dynamo.reset()
        full_graphs = []
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(callcache, "traced", lambda *a: None)
            full = torch.compile(call, backend=_recording("aot_eager", full_graphs), fullgraph=True)(*tensors)
        assert _rel(full, got) <= RTOL, name
        ours = {t for t in _targets(graphs[0]) if t.startswith("elsa_surgery.")}
        assert ours == {t for t in _targets(full_graphs[0]) if t.startswith("elsa_surgery.")} and ours, name


@CPU_ONLY
def test_traced_route_equals_the_full_path():
    """A call that torch.compile traces is validated and decided outside dynamo's tracing (``callcache.traced``, issue
    33's compile time): each case gets a plan, compiles in one graph with the op the full path traces, gives the eager
    call's answer and does not recompile for new tensors of its shapes."""
    _check_traced_route("cpu")


@pytest.mark.gpu
def test_traced_route_equals_the_full_path_gpu():
    _check_traced_route("cuda")


@CPU_ONLY
def test_traced_route_leaves_to_the_full_path_what_it_cannot_plan():
    """Calls the route has no plan for take the full path, which raises their errors (as eager calls do) or runs them:
    bad shapes, the reference backend, lengths, and every call of a graph with symbolic sizes (dynamic shapes)."""
    from elsa_surgery import callcache

    q, k, v = (torch.randn(1, 2, 12, 16) for _ in range(3))
    before = dict(callcache.TRACED)
    bad = torch.compile(lambda q, k: elsa_surgery.attention(q, k, k, backend="elsa"), backend="aot_eager",
                        fullgraph=True)
    with pytest.raises(Exception, match="same head dim D"):
        bad(q, torch.randn(1, 2, 12, 8))
    assert callcache.TRACED["full"] == before["full"] + 1 and callcache.TRACED["plans"] == before["plans"]
    torch._dynamo.reset()
    ref = torch.compile(lambda q, k, v: elsa_surgery.attention(q, k, v, backend="reference"), backend="aot_eager",
                        fullgraph=True)
    assert _rel(ref(q, k, v), elsa_surgery.attention(q, k, v, backend="reference")) <= RTOL
    assert callcache.TRACED["full"] == before["full"] + 2
    torch._dynamo.reset()
    lengths = torch.tensor([9])
    padded = torch.compile(lambda q, k, v: elsa_surgery.attention(q, k, v, kv_lengths=lengths, backend="elsa"),
                           backend="aot_eager", fullgraph=True)
    assert _rel(padded(q, k, v), elsa_surgery.attention(q, k, v, kv_lengths=lengths, backend="elsa")) <= RTOL
    assert callcache.TRACED["full"] == before["full"] + 2  # (lengths never reach the route)
    torch._dynamo.reset()
    dynamic = torch.compile(lambda q, k, v: elsa_surgery.attention(q, k, v, backend="elsa"), backend="aot_eager",
                            fullgraph=True, dynamic=True)
    for n in (12, 17):
        q, k, v = (torch.randn(1, 2, n, 16) for _ in range(3))
        assert _rel(dynamic(q, k, v), elsa_surgery.attention(q, k, v, backend="elsa")) <= RTOL
    assert callcache.TRACED == {"plans": before["plans"], "full": before["full"] + 2}


def test_the_opaque_op_waits_for_kernels_still_compiling_in_the_background(monkeypatch):
    """The opaque op's kernel (``ops.dense_forward``) waits for every kernel ``launch.precompile`` submitted before it
    launches: session 55's GPU test traced a short function, its first run came before the background finished
    ``elsa_fwd`` and compiled it again in the main thread, beside it."""
    import threading
    import time
    from concurrent.futures import Future

    from elsa_surgery.kernels import launch

    order = []
    fut: Future = Future()

    def finish():
        time.sleep(0.2)
        order.append("compiled")
        fut.set_result(None)

    monkeypatch.setattr(launch, "PENDING", [fut])
    monkeypatch.setattr(launch, "attention", lambda *a, **kw: order.append("launched") or (None, None))
    threading.Thread(target=finish).start()
    q = torch.zeros(1, 1, 4, 8)
    ops.dense_forward(q, q, q, None, None, None, 1.0, False, "precise", False)
    assert order == ["compiled", "launched"] and launch.PENDING == []
