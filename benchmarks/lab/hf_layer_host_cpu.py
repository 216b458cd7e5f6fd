"""The host cost of one converted transformers attention call against the native SDPA integration's, on the CPU:
a tiny BERT with a right-padded batch (the adapter's key-lengths route, ``backend="sdpa"``), each side's attention
function captured with the arguments transformers passes it, then timed alone with SDPA itself stubbed out (both
sides), so that only the Python around it is measured. Interleaved rounds, medians, in µs per call.

    python benchmarks/lab/hf_layer_host_cpu.py [--rounds 21] [--calls 5000]

Session 38: issue 24's BERT-base bf16 batch 8 cell, where ``auto`` takes SDPA in every layer, lost ~50 µs of host
time a layer to native on an H200; this isolates that layer on any machine.
"""

import argparse
import copy
import statistics
import time

import torch
import torch.nn.functional as F
from transformers import BertConfig, BertModel
from transformers.integrations import sdpa_attention as tsa
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import elsa_surgery
from elsa_surgery.adapters import transformers_attention as ta


def capture(model, ids, am, names):
    """The arguments of the last call of the attention functions ``names`` during one forward of ``model``."""
    got, saved = {}, {n: ALL_ATTENTION_FUNCTIONS[n] for n in names}

    def spy(real):
        def fn(module, q, k, v, mask, *a, **kw):
            got["args"] = (module, q, k, v, mask, a, kw)
            return real(module, q, k, v, mask, *a, **kw)
        return fn

    for n in names:
        ALL_ATTENTION_FUNCTIONS[n] = spy(saved[n])
    try:
        with torch.no_grad():
            model(input_ids=ids, attention_mask=am)
    finally:
        for n in names:
            ALL_ATTENTION_FUNCTIONS[n] = saved[n]
    return got["args"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--calls", type=int, default=5000)
    a = ap.parse_args()
    torch.set_num_threads(1)
    cfg = BertConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, vocab_size=100)
    cfg._attn_implementation = "sdpa"
    native = BertModel(cfg).eval()
    converted = copy.deepcopy(native)
    elsa_surgery.convert(converted, backend="sdpa", verify=False)
    ids = torch.randint(0, 100, (8, 16))
    am = torch.ones(8, 16, dtype=torch.long)
    am[1, 10:] = 0
    am[5, 5:] = 0
    with torch.no_grad():
        converted(input_ids=ids, attention_mask=am)  # the route is learnt on the first call
    sides = {"converted": (ta.elsa_attention_forward,
                           capture(converted, ids, am, [n for n in ALL_ATTENTION_FUNCTIONS.keys() if "elsa" in n])),
             "native": (tsa.sdpa_attention_forward, capture(native, ids, am, ["sdpa"]))}
    stub = lambda q, k, v, *args, **kw: q  # noqa: E731  (SDPA out of the measurement, on both sides)
    real = F.scaled_dot_product_attention
    times = {s: [] for s in sides}
    F.scaled_dot_product_attention = stub  # (the one attribute every caller reads: torch.nn.functional's)
    try:
        with torch.no_grad():
            for _ in range(a.rounds):
                for s, (fn, (m, q, k, v, mask, args, kw)) in sides.items():
                    t0 = time.perf_counter()
                    for _ in range(a.calls):
                        fn(m, q, k, v, mask, *args, **kw)
                    times[s].append((time.perf_counter() - t0) / a.calls * 1e6)
    finally:
        F.scaled_dot_product_attention = real
    med = {s: statistics.median(t) for s, t in times.items()}
    print(f"host µs per attention call (SDPA stubbed): converted {med['converted']:.2f}, native {med['native']:.2f}, "
          f"extra {med['converted'] - med['native']:.2f}, ratio {med['converted'] / med['native']:.2f}")


if __name__ == "__main__":
    main()
