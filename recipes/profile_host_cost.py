"""Where the time of one converted attention call goes at small N: kernel vs host (launch, dispatch).

    python recipes/profile_host_cost.py            # timm ViT-B/16, bf16, batch 8 (N = 197, H = 12, D = 64)

Prints native vs converted eager model time, the profiler's top CUDA kernels, and per-call times of the
public call, the bare launcher and PyTorch SDPA on the same q/k/v, each with launch plans on (the default:
kernels/replay.py) and off (``ELSA_LAUNCH_PLANS=0``: every call planned and launched through Triton's
``kernel[grid]``). Needs a CUDA GPU.
"""

import argparse
import os

import torch

import elsa_surgery
from elsa_surgery import benchmark
from elsa_surgery.kernels import launch, replay


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
    with torch.inference_mode():
        print(f"native model ms {benchmark.per_call_ms(lambda: m(x), 30):.3f}")
        elsa_surgery.convert(m, verify=False)
        for plans in ("1", "0"):
            os.environ[replay.ENV] = plans
            print(f"converted model ms (launch plans {plans}) {benchmark.per_call_ms(lambda: m(x), 30):.3f}")
        os.environ.pop(replay.ENV)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                m(x)
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=8))
        blk = m.blocks[0].attn
        n_tok = m.patch_embed.num_patches + m.num_prefix_tokens
        q, k, v = (torch.randn(a.batch, blk.num_heads, n_tok, blk.head_dim, device=dev, dtype=dt) for _ in range(3))
        for plans in ("1", "0"):
            os.environ[replay.ENV] = plans
            public = benchmark.per_call_ms(lambda: elsa_surgery.attention(q, k, v, backend='elsa'), 200)
            launcher = benchmark.per_call_ms(lambda: launch.attention(
                q, k, v, scale=blk.head_dim ** -0.5, precision=None, return_lse=False), 200)
            print(f"launch plans {plans}: public call us {public * 1e3:.1f}, launcher only us {launcher * 1e3:.1f}")
        os.environ.pop(replay.ENV)
        print(f"SDPA call us {benchmark.per_call_ms(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v), 200) * 1e3:.1f}")


if __name__ == "__main__":
    main()
