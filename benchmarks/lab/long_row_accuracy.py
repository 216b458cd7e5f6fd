"""How the error of one attention call grows with the keys a row sees (session 27: the 32M stream's spot rows were
1.05e-2 from float64, against 2.4-2.6e-3 at 2M-8M tokens, where each task's call sees 8M keys instead of 1M).

For Nk in the list: q [1, 1, Nq, 64] (Nq rows: enough programs that the kernel does not split the keys, so each
program accumulates over every key, as a stream task's call does), k and v [1, 1, Nk, 64], N(0, 1), bf16,
non-causal. Printed per Nk, as row-relative errors against float64 (max over ``--rows`` rows spread over Nq):

* ``elsa``: the kernels' forward (one partition; on an H100 the Gluon kernel, which accumulates in the tensor
  cores); ``elsa_state_chain`` / ``elsa_state_blocked``: ``attention_state`` over every key, finalized (a stream
  task's call, the portable kernel) with P·V accumulated in the tensor cores across key blocks, or added block by
  block with round-to-nearest adds (``ELSA_BLOCKED_PV_KEYS`` = 2^62 or 0);
* ``elsa_chunks``: the same keys in calls of ``--chunk`` keys, their (m, S, W) states merged with the monoid in fp32
  (what a cap on the keys of one call would give);
* ``flash``, ``cudnn``, ``efficient``: SDPA's kernels on the same call (their accumulators are tensor-core ones too);
* ``bf16_out``: the float64 answer rounded to bf16 (the floor no kernel goes under).

A growth shared by SDPA's kernels, and gone in ``elsa_state_blocked``, is the tensor cores' accumulation; one of
``elsa`` alone is ours.
Usage: python benchmarks/lab/long_row_accuracy.py [--nk 1M,2M,4M,8M,16M] [--nq 65536] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch


def size(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20}.get(s[-1:], 1)
    return int(float(s[:-1] if s[-1:] in "KM" else s) * mult)


def reference(q, k, v, rows, scale, chunk=1 << 20):
    """float64 output of the chosen query rows, keys in chunks folded with the public monoid."""
    from elsa_surgery import monoid

    qr = q[0, 0, rows].double()
    st = monoid.identity((qr.shape[0],), v.shape[-1], dtype=torch.float64, device=q.device)
    for a in range(0, k.shape[2], chunk):
        s = (qr @ k[0, 0, a:a + chunk].double().T) * scale
        st = monoid.fold_scores(st, s, v[0, 0, a:a + chunk].double())
    return monoid.finalize(st)[0]


def rel(got_rows, ref):
    return float(((got_rows.double() - ref).norm(dim=-1) / ref.norm(dim=-1)).max())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nk", default="1M,2M,4M,8M,16M")
    p.add_argument("--nq", type=size, default=65536)
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--chunk", type=size, default=1 << 20)
    p.add_argument("--json", default=None)
    p.add_argument("--device", default="cuda", help="cpu: a smoke run of the script (TRITON_INTERPRET=1, small sizes)")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("needs a CUDA GPU (or --device cpu with TRITON_INTERPRET=1 for a smoke run)", file=sys.stderr)
        return 2
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from elsa_surgery import attention_state, monoid
    from elsa_surgery.kernels import knobs, launch

    dev, D = torch.device(args.device), 64
    scale = D ** -0.5
    g = torch.Generator(device=dev).manual_seed(27)
    q = torch.randn(1, 1, args.nq, D, device=dev, generator=g).bfloat16()
    rows = torch.linspace(0, args.nq - 1, args.rows, device=dev).long()
    out_rows = []
    for nk in (size(x) for x in args.nk.split(",")):
        k = torch.randn(1, 1, nk, D, device=dev, generator=g).bfloat16()
        v = torch.randn(1, 1, nk, D, device=dev, generator=g).bfloat16()
        ref = reference(q, k, v, rows, scale)
        row = {"nk": nk, "nq": args.nq, "bf16_out": rel(ref.bfloat16(), ref)}
        o, _ = launch.attention(q, k, v, scale=scale, num_partitions=1, return_lse=False)
        row["elsa"] = rel(o[0, 0, rows], ref)
        del o
        for name, keys in (("elsa_state_chain", str(1 << 62)), ("elsa_state_blocked", "0")):
            os.environ[knobs.BLOCKED_PV_KEYS] = keys
            o, _ = monoid.finalize(attention_state(q, k, v, scale=scale, backend="elsa"))
            row[name] = rel(o[0, 0, rows].bfloat16(), ref)
        os.environ.pop(knobs.BLOCKED_PV_KEYS)
        states = [attention_state(q, k[:, :, a:a + args.chunk], v[:, :, a:a + args.chunk], scale=scale,
                                  backend="elsa") for a in range(0, nk, args.chunk)]
        o, _ = monoid.finalize(monoid.merge_all(states))
        row["elsa_chunks"] = rel(o[0, 0, rows].bfloat16(), ref)
        del states, o
        for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                         ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
            try:
                with sdpa_kernel([be]):
                    o = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale)
                row[name] = rel(o[0, 0, rows], ref)
            except RuntimeError as e:  # a backend that refuses the call (length limits; the CPU)
                row[name] = f"refused: {str(e)[:80]}"
        out_rows.append(row)
        print(json.dumps(row), flush=True)
        del k, v
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out_rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
