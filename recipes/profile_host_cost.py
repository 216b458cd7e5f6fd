"""Where the time of one converted attention call goes at small N: kernel vs host (launch, dispatch).

    python recipes/profile_host_cost.py            # timm ViT-B/16, bf16, batch 8 (N = 197, H = 12, D = 64)

Prints native vs converted eager model time (and the model replayed from a CUDA graph: its GPU time alone), the
profiler's top CUDA kernels, and per-call host times of the public call, the bare launcher and PyTorch SDPA on
the model's own q/k/v views, and of one attention module native and converted. Each converted figure is the median of three
rounds (settings interleaved), taken with the host-cost layers on (the defaults) and off: the memo of validation and dispatch
(``elsa_surgery/callcache.py``; "memo off" runs them in full on every call) and launch plans
(``kernels/replay.py``; ``ELSA_LAUNCH_PLANS=0``: every call planned and launched through Triton's
``kernel[grid]``). Needs a CUDA GPU.
"""

import argparse
import contextlib
import copy
import statistics

import torch

import elsa_surgery
from elsa_surgery import benchmark, callcache
from elsa_surgery.kernels import launch, replay


@contextlib.contextmanager
def layers(memo: bool, plans: bool):
    """The memo (callcache) and launch plans (replay) on or off inside the block."""
    saved = callcache._key
    if not memo:
        callcache._key = lambda *args: None  # every call validated and dispatched in full
    try:
        with benchmark.environ({replay.ENV: "1" if plans else "0"}):
            yield
    finally:
        callcache._key = saved


SETTINGS = ((True, True), (False, True), (False, False))  # (memo, plans): today's defaults, then each layer off
ROUNDS = 3


def _name(memo, plans):
    return f"memo {'on' if memo else 'off'}, plans {'on' if plans else 'off'}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="vit_base_patch16_224")
    ap.add_argument("--batch", type=int, default=8)
    a = ap.parse_args(argv)
    import timm
    from torch.profiler import ProfilerActivity, profile

    dev, dt = "cuda", torch.bfloat16
    m = timm.create_model(a.model, pretrained=False).to(dev, dt).eval()
    x = torch.randn(a.batch, 3, 224, 224, device=dev, dtype=dt)
    n_tok = m.patch_embed.num_patches + m.num_prefix_tokens
    xa = torch.randn(a.batch, n_tok, m.embed_dim, device=dev, dtype=dt)
    with torch.inference_mode():
        native = copy.deepcopy(m)
        native_attn = native.blocks[0].attn
        graphed = benchmark.cuda_graph(lambda: native(x))
        print(f"native model, CUDA graph ms {benchmark.per_call_ms(graphed, 30):.3f}")
        del graphed
        elsa_surgery.convert(m, verify=False)
        graphed = benchmark.cuda_graph(lambda: m(x))
        print(f"converted model, CUDA graph ms {benchmark.per_call_ms(graphed, 30):.3f}")
        del graphed
        for memo, plans in SETTINGS:  # warm each setting (plans recorded, memo filled) before timing
            with layers(memo, plans):
                benchmark.per_call_ms(lambda: m(x), 10)
        model = {s: [] for s in SETTINGS}
        native_ms = []
        for _ in range(ROUNDS):  # settings interleaved, the median of the rounds reported: host load drifts
            native_ms.append(benchmark.per_call_ms(lambda: native(x), 30))
            for memo, plans in SETTINGS:
                with layers(memo, plans):
                    model[memo, plans].append(benchmark.per_call_ms(lambda: m(x), 30))
        print(f"native model ms {statistics.median(native_ms):.3f} (rounds: {', '.join(f'{t:.3f}' for t in native_ms)})")
        for (memo, plans), times in model.items():
            print(f"converted model ms ({_name(memo, plans)}) {statistics.median(times):.3f} "
                  f"(rounds: {', '.join(f'{t:.3f}' for t in times)})")
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                m(x)
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=8))
        blk = m.blocks[0].attn
        q, k, v = blk.qkv(xa).reshape(a.batch, n_tok, 3, blk.num_heads, blk.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        def us(fn):  # median of ROUNDS rounds of 300 calls, µs a call
            return statistics.median(benchmark.per_call_ms(fn, 300) * 1e3 for _ in range(ROUNDS))

        print(f"native attention module us {us(lambda: native_attn(xa)):.1f}, "
              f"SDPA call us {us(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v)):.1f}")
        for memo, plans in SETTINGS:
            with layers(memo, plans):
                public = us(lambda: elsa_surgery.attention(q, k, v, scale=blk.scale))
                launcher = us(lambda: launch.attention(q, k, v, scale=blk.scale, precision=None, return_lse=False))
                module = us(lambda: blk(xa))
            print(f"{_name(memo, plans)}: public call us {public:.1f}, launcher only us {launcher:.1f}, "
                  f"converted module us {module:.1f}")


if __name__ == "__main__":
    main()
