"""The reference backend under torch.compile: the API calls the ``elsa_surgery::reference_attention*`` custom
ops while dynamo traces, so one graph (two: dynamo makes sizes dynamic on the first recompile) serves every
sequence length with ``fullgraph=True``, the results equal the eager reference, and training through the ops
(dropout included: the backward redraws the forward's keep-masks from the op's seed) gives the eager
reference's gradients. Eager calls are covered by tests/test_reference.py."""

import pytest
import torch
import torch._dynamo.testing as dynamo_testing

import elsa_surgery
from elsa_surgery import reference, reference_ops
from elsa_surgery.semantics import build_problem

LENGTHS = list(range(8, 8 + 7 * 12, 7))  # 12 sequence lengths
OPS = ("reference_attention", "reference_attention_state", "reference_attention_varlen")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _ops_in(graphs):
    return {op for gm in graphs for node in gm.graph.nodes for op in OPS if f"elsa_surgery.{op}." in str(node.target)}


def _dense_case(case, n, gen):
    """``(tensors, options)`` of one ``elsa_surgery.attention`` call of sequence length ``n``: the tensors are
    ``q, k, v, attn_mask, q_lengths, kv_lengths``, the options the same for every length."""
    B, H, D = (4, 2, 8) if case == "windowed" else (2, 2, 8)
    dtype = torch.float64 if case == "additive" else torch.float32
    hkv = 1 if case == "gqa" else H
    nq = n // 2 + 1 if case == "causal" else n  # bottom-right causal with Nq < Nk
    q = torch.randn(B, H, nq, D, generator=gen, dtype=dtype)
    k = torch.randn(B, hkv, n, D, generator=gen, dtype=dtype)
    v = torch.randn(B, hkv, n, D + 3, generator=gen, dtype=dtype)
    options = dict(backend="reference")
    mask = q_lengths = kv_lengths = None
    if case == "bool":
        mask = torch.rand(B, 1, nq, n, generator=gen) < 0.7
        mask[:, :, 1] = False  # a row with no key
    elif case == "additive":
        mask = torch.randn(1, H, nq, n, generator=gen, dtype=dtype).masked_fill(
            torch.rand(1, H, nq, n, generator=gen) < 0.2, float("-inf"))
        options["return_lse"] = True
    elif case == "windowed":
        mask = torch.randn(2, 1, nq, n, generator=gen)  # nW = 2 windows, batch row b reads b % 2
        options["windowed_mask"] = True
    elif case == "lengths":
        q_lengths, kv_lengths = torch.tensor([nq, nq - 3]), torch.tensor([n - 5, n])
        options["is_causal"] = True
    elif case == "causal":
        options["is_causal"] = True
    elif case == "gqa":
        options["enable_gqa"] = True
    elif case == "dropout":
        options.update(backend="auto", dropout_p=0.25)  # auto sends dropout to the reference backend
    return (q, k, v, mask, q_lengths, kv_lengths), options


@pytest.mark.parametrize("case", ["plain", "causal", "bool", "additive", "windowed", "lengths", "gqa", "dropout"])
def test_one_graph_for_every_length(case):
    recorder = dynamo_testing.EagerAndRecordGraphs()
    options = _dense_case(case, 8, torch.Generator())[1]

    def call(q, k, v, mask, q_lengths, kv_lengths):
        return elsa_surgery.attention(q, k, v, mask, q_lengths=q_lengths, kv_lengths=kv_lengths, **options)

    compiled = torch.compile(call, backend=recorder, fullgraph=True)
    gen = torch.Generator().manual_seed(0)
    for n in LENGTHS:
        tensors = _dense_case(case, n, gen)[0]
        torch.manual_seed(n)
        got = compiled(*tensors)
        if case == "dropout":  # the eager reference with the keep-masks of the seed the compiled call drew
            torch.manual_seed(n)
            seed = int(reference_ops.dropout_seed())
            want, _ = reference.run(build_problem(*tensors[:4], dropout_p=0.25), seed=seed)
            assert not torch.equal(got, elsa_surgery.attention(*tensors[:3]))  # something was dropped
        else:
            want = call(*tensors)
        if options.get("return_lse"):
            (got, lse), (want, want_lse) = got, want
            assert lse.dtype == want_lse.dtype == torch.float64 and torch.equal(lse, want_lse)
        assert got.dtype == want.dtype and torch.equal(got, want), (case, n)
    assert len(recorder.graphs) <= 2
    assert _ops_in(recorder.graphs) == {"reference_attention"}


def test_attention_state_and_varlen_one_graph():
    recorder = dynamo_testing.EagerAndRecordGraphs()
    state = torch.compile(lambda q, k, v: elsa_surgery.attention_state(q, k, v, is_causal=True, backend="reference"),
                          backend=recorder, fullgraph=True)
    varlen = torch.compile(lambda q, k, v, cq, ck: elsa_surgery.attention_varlen(
        q, k, v, cq, ck, 64, 64, is_causal=True, backend="reference", return_lse=True), backend=recorder, fullgraph=True)
    for n in LENGTHS:
        q, k, v = (torch.randn(1, 4, n, 8) for _ in range(3))
        for a, b in zip(state(q, k, v), elsa_surgery.attention_state(q, k, v, is_causal=True, backend="reference")):
            assert torch.equal(a, b)
        cq = torch.tensor([0, n // 3, n], dtype=torch.int32)
        ck = torch.tensor([0, n // 2, n], dtype=torch.int32)
        qp, kp, vp = (t[0].transpose(0, 1) for t in (q, k, v))  # packed [total, H, D]
        want = elsa_surgery.attention_varlen(qp, kp, vp, cq, ck, 64, 64, is_causal=True, backend="reference",
                                             return_lse=True)
        for a, b in zip(varlen(qp, kp, vp, cq, ck), want):
            assert torch.equal(a, b)
    assert len(recorder.graphs) <= 4  # two functions, at most two graphs each
    assert _ops_in(recorder.graphs) == {"reference_attention_state", "reference_attention_varlen"}


def _training_inputs(n, gen):
    """float64 (auto runs the reference): GQA, bottom-right causal, kv_lengths, a learned additive bias."""
    q = torch.randn(2, 4, n - 2, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 2, n, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 2, n, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(1, 4, n - 2, n, generator=gen, dtype=torch.float64, requires_grad=True)
    return q, k, v, bias


@pytest.mark.parametrize("dropout_p", [0.0, 0.3, 1.0])
def test_compiled_training_step_matches_eager(dropout_p):
    """Forward and backward through the op under AOTAutograd (fullgraph, lengths changing): the output and the
    gradients of q, k, v and the additive bias equal the eager reference's (autograd through the chunk loops)
    computed with the keep-masks of the same seed."""
    counter = dynamo_testing.CompileCounterWithBackend("aot_eager")
    gen = torch.Generator().manual_seed(1)

    def step(q, k, v, bias, kv_lengths, weight):
        out = elsa_surgery.attention(q, k, v, bias * 2.0, dropout_p=dropout_p, is_causal=True, enable_gqa=True,
                                     kv_lengths=kv_lengths)
        return (out * weight).sum()

    compiled = torch.compile(step, backend=counter, fullgraph=True)
    for n in LENGTHS[::3]:
        inputs = _training_inputs(n, gen)
        kv_lengths = torch.tensor([n, n - 3])
        weight = torch.randn(2, 4, n - 2, 6, generator=gen, dtype=torch.float64)
        torch.manual_seed(n)
        compiled(*inputs, kv_lengths, weight).backward()
        got = [t.grad for t in inputs]

        twins = [t.detach().clone().requires_grad_() for t in inputs]
        q, k, v, bias = twins
        p = build_problem(q, k, v, bias * 2.0, dropout_p, True, None, True, kv_lengths=kv_lengths)
        torch.manual_seed(n)
        seed = int(reference_ops.dropout_seed()) if dropout_p > 0 else None
        out, _ = reference.run(p, seed=seed)
        (out * weight).sum().backward()
        for a, t in zip(got, twins):
            assert torch.allclose(a, t.grad, rtol=1e-9, atol=1e-11), (dropout_p, n, (a - t.grad).abs().max())
        if dropout_p == 1.0:
            assert all(bool((a == 0).all()) for a in got)
        if dropout_p == 0.0:  # the eager API itself (no seed involved)
            for t in twins:
                t.grad = None
            (elsa_surgery.attention(q, k, v, bias * 2.0, is_causal=True, enable_gqa=True, kv_lengths=kv_lengths)
             * weight).sum().backward()
            for a, t in zip(got, twins):
                assert torch.allclose(a, t.grad, rtol=1e-9, atol=1e-11)
    assert counter.frame_count <= 2


def test_compiled_state_and_varlen_gradients_match_eager():
    counter = dynamo_testing.CompileCounterWithBackend("aot_eager")

    def state_loss(q, k, v, mask, w):
        m, S, W = elsa_surgery.attention_state(q, k, v, mask, backend="reference", windowed_mask=True)
        return m.sum() + (S * w[..., 0]).sum() + (W * w).sum()  # every row sees a key: all finite

    def varlen_loss(q, k, v, cq, ck, w):
        out, lse = elsa_surgery.attention_varlen(q, k, v, cq, ck, 64, 64, is_causal=True, backend="reference",
                                                 return_lse=True)
        return (out * w).sum() + lse.sum()

    compiled_state = torch.compile(state_loss, backend=counter, fullgraph=True)
    compiled_varlen = torch.compile(varlen_loss, backend=counter, fullgraph=True)
    for n in LENGTHS[::4]:
        q, k, v = (torch.randn(4, 2, n, 8, dtype=torch.float64) for _ in range(3))
        mask = torch.randn(2, 2, n, n, dtype=torch.float64)
        w = torch.randn(4, 2, n, 8, dtype=torch.float64)
        cq = torch.tensor([0, n // 3, n], dtype=torch.int32)
        ck = torch.tensor([0, n // 2, n + 4], dtype=torch.int32)
        packed = (q[0].transpose(0, 1), torch.randn(n + 4, 1, 8, dtype=torch.float64),
                  torch.randn(n + 4, 1, 8, dtype=torch.float64))
        for fn, compiled, args, n_grad in ((state_loss, compiled_state, (q, k, v, mask, w), 4),
                                           (varlen_loss, compiled_varlen, (*packed, cq, ck, w[0].transpose(0, 1)), 3)):
            grads = []
            for f in (compiled, fn):
                leaves = [t.clone().requires_grad_() for t in args[:n_grad]]
                grads.append(torch.autograd.grad(f(*leaves, *args[n_grad:]), leaves))
            for a, b in zip(*grads):
                assert torch.allclose(a, b, rtol=1e-9, atol=1e-11), (fn.__name__, n, (a - b).abs().max())
    assert counter.frame_count <= 4


def test_ops_registration_and_gradcheck():
    """The ops' schemas, fake implementations and autograd registrations (``torch.library.opcheck``), and a
    float64 gradcheck of their backward scan: additive mask, causal, GQA, lengths, dropout from a fixed seed (packed
    varlen too)."""
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(2, 4, 5, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 2, 7, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 2, 7, 2, generator=gen, dtype=torch.float64, requires_grad=True)
    mask = torch.randn(2, 1, 5, 7, generator=gen, dtype=torch.float64)
    mask[0, 0, 1] = float("-inf")  # a row with no key
    mask.requires_grad_()
    lengths = torch.tensor([7, 5], dtype=torch.int32)
    seed = torch.tensor(11)
    dense = (reference_ops.reference_attention_op, reference_ops.reference_attention_state_op)
    for op in dense:
        for args in ((q, k, v, mask, None, lengths, 0.5, True, 0.3, seed),
                     (q, k, v, mask > 0, lengths, None, 0.5, False, 0.0, None)):
            torch.library.opcheck(op, args)
    cu = torch.tensor([0, 2, 2, 5], dtype=torch.int32), torch.tensor([0, 3, 4, 7], dtype=torch.int32)
    varlen_args = (q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), *cu, 0.5, True, 0.3, seed)
    torch.library.opcheck(reference_ops.reference_attention_varlen_op, varlen_args)
    torch.library.opcheck(reference_ops.reference_attention_varlen_op, varlen_args[:-2] + (0.0, None))

    def finite(outputs):  # the lse / m of the keyless row is -inf
        return tuple(t.masked_fill(t.isinf(), 0.0) for t in outputs)

    for op in dense:
        f = lambda q, k, v, mask: finite(op(q, k, v, mask, None, lengths, 0.5, True, 0.3, seed))
        assert torch.autograd.gradcheck(f, (q, k, v, mask))
    assert torch.autograd.gradcheck(
        lambda q, k, v: reference_ops.reference_attention_varlen_op(q, k, v, *varlen_args[3:]), varlen_args[:3])
