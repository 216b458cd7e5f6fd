"""Where the time of one converted attention call goes at small N: kernel vs host (launch, dispatch).

    python recipes/profile_host_cost.py            # timm ViT-B/16, bf16, batch 8 (N = 197, H = 12, D = 64)

Prints native vs converted eager model time (and the model replayed from a CUDA graph: its GPU time alone), the
profiler's top CUDA kernels, and per-call host times of the public call, the bare launcher and PyTorch SDPA on
the model's own q/k/v views, and of one attention module native and converted: eager (host and GPU: the clock stops
after a sync) and host alone (the clock stops when the last call returns; the GPU queue absorbs the kernels). Each
converted figure is the median of three rounds (settings interleaved), taken with the host-cost layers on (the
defaults) and off: direct routes (``callcache.direct``: a call seen before runs its launch plan at once; "direct off"
takes the memo), the memo of validation and dispatch (``elsa_surgery/callcache.py``; "memo off" runs them in full on
every call) and launch plans (``kernels/replay.py``; ``ELSA_LAUNCH_PLANS=0``: every call planned and launched through
Triton's ``kernel[grid]``). The last line compares the public call's host time with SDPA's (issue 24's target: no
higher). Runs on older checkouts of the package too (settings they lack are skipped). Needs a CUDA GPU.
"""

import argparse
import contextlib
import copy
import statistics

import torch

import elsa_surgery
from elsa_surgery import benchmark, callcache
from elsa_surgery.kernels import launch, replay


HAS_DIRECT = hasattr(callcache, "direct")  # checkouts before direct routes lack it


@contextlib.contextmanager
def layers(direct: bool, memo: bool, plans: bool):
    """Direct routes, the memo (callcache) and launch plans (replay) on or off inside the block."""
    saved_key, saved_direct = callcache._key, getattr(callcache, "direct", None)
    if not memo:
        callcache._key = lambda *args: None  # every call validated and dispatched in full
    if not direct and HAS_DIRECT:
        # the memo's full path (a Miss without a route key: checkouts since session 30; None before)
        callcache.direct = (lambda *args: callcache.Miss(None)) if hasattr(callcache, "Miss") else (lambda *args: None)
    try:
        with benchmark.environ({replay.ENV: "1" if plans else "0"}):
            yield
    finally:
        callcache._key = saved_key
        if HAS_DIRECT:
            callcache.direct = saved_direct


# (direct, memo, plans): today's defaults, then each layer off
SETTINGS = ((True, True, True), (False, True, True), (False, False, True), (False, False, False))
if not HAS_DIRECT:
    SETTINGS = SETTINGS[1:]
ROUNDS = 3


def _name(direct, memo, plans):
    on = lambda flag: "on" if flag else "off"  # noqa: E731
    return (f"direct {on(direct)}, " if HAS_DIRECT else "") + f"memo {on(memo)}, plans {on(plans)}"


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
        for setting in SETTINGS:  # warm each setting (plans recorded, memo filled) before timing
            with layers(*setting):
                benchmark.per_call_ms(lambda: m(x), 10)
        model = {s: [] for s in SETTINGS}
        native_ms = []
        for _ in range(ROUNDS):  # settings interleaved, the median of the rounds reported: host load drifts
            native_ms.append(benchmark.per_call_ms(lambda: native(x), 30))
            for setting in SETTINGS:
                with layers(*setting):
                    model[setting].append(benchmark.per_call_ms(lambda: m(x), 30))
        print(f"native model ms {statistics.median(native_ms):.3f} (rounds: {', '.join(f'{t:.3f}' for t in native_ms)})")
        for setting, times in model.items():
            print(f"converted model ms ({_name(*setting)}) {statistics.median(times):.3f} "
                  f"(rounds: {', '.join(f'{t:.3f}' for t in times)})")
        blk = m.blocks[0].attn
        q, k, v = blk.qkv(xa).reshape(a.batch, n_tok, 3, blk.num_heads, blk.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v)  # noqa: E731
        public = lambda: elsa_surgery.attention(q, k, v, scale=blk.scale)  # noqa: E731
        launcher = lambda: launch.attention(q, k, v, scale=blk.scale, precision=None, return_lse=False)  # noqa: E731
        entries = [("SDPA call", None, sdpa), ("native attention module", None, lambda: native_attn(xa))]
        for setting in SETTINGS:
            entries += [(f"{what} ({_name(*setting)})", setting, fn) for what, fn in
                        (("public call", public), ("launcher only", launcher), ("converted module", lambda: blk(xa)))]
        host = race(entries, host_only=True)
        eager = race(entries, host_only=False)
        print(f"per call, us: median (min) of {CALL_ROUNDS} interleaved rounds of {CALLS} calls")
        for name, _, _ in entries:
            print(f"  {name:<58} host {_fmt(host[name])}   eager {_fmt(eager[name])}")
        ours, theirs = host[f"public call ({_name(*SETTINGS[0])})"], host["SDPA call"]
        print(f"host time of the public call / SDPA's (defaults, medians): {statistics.median(ours):.1f} / "
              f"{statistics.median(theirs):.1f} us = {statistics.median(ours) / statistics.median(theirs):.2f}; "
              f"minima {min(ours) / min(theirs):.2f} (target: <= 1)")

        # last: the profiler's hooks can outlive its block and slow every later eager call
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                m(x)
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=8))


CALL_ROUNDS, CALLS = 15, 200


def race(entries, host_only: bool) -> dict:
    """µs a call of each ``(name, setting, fn)``, one sample a round, the entries interleaved in every round (the
    device's host is shared: its speed drifts, so each side must see the same drift)."""
    times = {name: [] for name, _, _ in entries}
    for _ in range(CALL_ROUNDS):
        for name, setting, fn in entries:
            with (layers(*setting) if setting else contextlib.nullcontext()):
                times[name].append(benchmark.per_call_ms(fn, CALLS, host_only=host_only, warmup=2) * 1e3)
    return times


def _fmt(samples) -> str:
    return f"{statistics.median(samples):7.1f} ({min(samples):6.1f})"


if __name__ == "__main__":
    main()
