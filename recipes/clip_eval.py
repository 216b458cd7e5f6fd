"""CLIP with ELSA attention: zero-shot agreement with the native model, and image-encoder latency / memory.

1. **Zero-shot agreement** at the model's own resolution: ``--zs-images`` images are classified among
   ``--zs-classes`` ImageNet class prompts ("a photo of a {name}.") by the native model and by the converted
   one; reports the fraction of identical top-1 predictions (target >= 99.9%) and the max |Δ logits|.
   Weights: ``--pretrained`` (an open_clip tag or a local checkpoint file) when present locally, otherwise
   random weights **with a warning** (nothing is downloaded: ``HF_HUB_OFFLINE=1`` is set). Images are random
   (no dataset is read), so the agreement measures numerical fidelity, not accuracy.
2. **Image-encoder latency and peak memory** at ``--sizes`` (224, 336, 448, 560 px), batch ``--batch``, for
   fp32 in every precision mode (``--modes strict,precise,turbo``) and bf16, native vs converted (one process,
   same inputs; CUDA events, median of ``--iters`` after ``--warmup``). Each size gets the image tower built at
   that resolution with random weights (latency does not depend on the weights).

Writes JSON (``--out``) and, when matplotlib is installed, a PNG plot (``--plot``).

Examples::

    python recipes/clip_eval.py --model ViT-L-14 --out clip.json --plot clip.png          # GPU, full
    python recipes/clip_eval.py --model ViT-L-14 --sizes 336 --dtypes fp32 --modes precise
    python recipes/clip_eval.py --hf /path/to/clip-vit-large-patch14                     # HF CLIP, local
    python recipes/clip_eval.py --smoke                                                   # CPU, seconds
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import sys
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

import elsa_surgery  # noqa: E402
from elsa_surgery import dispatch  # noqa: E402
from elsa_surgery.benchmark import (  # noqa: E402
    DTYPES, comma_list, dispatch_summary, env_info, error_text, measure_modes, modes_for, peak_text,
    plot_time_memory, write_json,
)


# --------------------------------------------------------------------------------------------------
# models
# --------------------------------------------------------------------------------------------------

def open_clip_model(args, image_size=None, layers=None):
    import open_clip

    cfg = copy.deepcopy(open_clip.get_model_config(args.model))
    if cfg is None:
        raise SystemExit(f"--model {args.model!r} is not an open_clip config ({', '.join(open_clip.list_models()[:8])}...)")
    vision, text = cfg["vision_cfg"], cfg["text_cfg"]
    if layers:
        vision["layers"], text["layers"] = layers, layers
    if image_size:
        vision["image_size"] = image_size
    kw = dict(vision_cfg=vision, text_cfg=text)
    pretrained, source = None, "random"
    if args.pretrained and image_size is None:
        tags = open_clip.list_pretrained_tags_by_model(args.model) if hasattr(open_clip, "list_pretrained_tags_by_model") else []
        if os.path.isfile(args.pretrained) or args.pretrained in tags:
            pretrained, source = args.pretrained, f"pretrained:{args.pretrained}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.getLogger().setLevel(logging.ERROR)
        try:
            model = open_clip.create_model(args.model, pretrained=pretrained, **({} if pretrained else kw))
        except Exception as exc:  # not cached locally (offline) or unreadable
            if pretrained is None:
                raise
            print(f"WARNING: could not load pretrained weights {pretrained!r} ({type(exc).__name__}: {exc}); "
                  f"using random weights", file=sys.stderr)
            model, source = open_clip.create_model(args.model, pretrained=None, **kw), "random"
    if source == "random" and image_size is None:
        print("WARNING: random weights (no local pretrained checkpoint): zero-shot agreement measures numerical "
              "fidelity only", file=sys.stderr)
    return model.eval(), source


def zero_shot_prompts(n_classes: int):
    try:
        from open_clip.zero_shot_metadata import IMAGENET_CLASSNAMES
        names = list(IMAGENET_CLASSNAMES)
    except ImportError:
        names = [f"object {i}" for i in range(1000)]
    return [f"a photo of a {c}." for c in names[:n_classes]]


class OpenClipTask:
    def __init__(self, args, device):
        import open_clip

        self.args, self.device = args, device
        self.model, self.source = open_clip_model(args, layers=args.layers)
        self.model.to(device)
        self.tokenizer = open_clip.get_tokenizer(args.model)
        size = self.model.visual.image_size
        self.image_size = size[0] if isinstance(size, (tuple, list)) else size

    def features(self, images, tokens):
        img = self.model.encode_image(images, normalize=True)
        txt = self.model.encode_text(tokens, normalize=True)
        return img, txt

    def tokens(self, prompts):
        return self.tokenizer(prompts).to(self.device)

    def image_tower(self, size, dtype):
        model, _ = open_clip_model(self.args, image_size=size, layers=self.args.layers)
        return model.visual.to(self.device, dtype).eval()


class HFClipTask:
    def __init__(self, args, device):
        from transformers import CLIPModel, CLIPTokenizer

        self.args, self.device = args, device
        try:
            self.model = CLIPModel.from_pretrained(args.hf, local_files_only=True)
            self.source = f"pretrained:{args.hf}"
            self.tokenizer = CLIPTokenizer.from_pretrained(args.hf, local_files_only=True)
        except Exception as exc:
            raise SystemExit(f"--hf {args.hf!r}: cannot load a local HF CLIP model ({exc})")
        self.model.eval().to(device)
        self.image_size = self.model.config.vision_config.image_size

    def features(self, images, tokens):
        img = self.model.get_image_features(pixel_values=images)
        txt = self.model.get_text_features(**tokens)
        img = getattr(img, "pooler_output", img)
        txt = getattr(txt, "pooler_output", txt)
        return torch.nn.functional.normalize(img, dim=-1), torch.nn.functional.normalize(txt, dim=-1)

    def tokens(self, prompts):
        return {k: v.to(self.device) for k, v in self.tokenizer(prompts, padding=True, return_tensors="pt").items()}

    def image_tower(self, size, dtype):
        vision = self.model.vision_model.to(dtype)

        class Tower(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.vision = vision

            def forward(self, x):
                return self.vision(pixel_values=x, interpolate_pos_encoding=True).pooler_output

        return Tower().eval()


# --------------------------------------------------------------------------------------------------
# the two measurements
# --------------------------------------------------------------------------------------------------

def zero_shot(task, args, device):
    gen = torch.Generator().manual_seed(0)
    images = torch.rand(args.zs_images, 3, task.image_size, task.image_size, generator=gen).to(device)
    mean = torch.tensor([0.48145466, 0.4578275, 0.40821073], device=device).view(1, 3, 1, 1)
    std = torch.tensor([0.26862954, 0.26130258, 0.27577711], device=device).view(1, 3, 1, 1)
    images = (images - mean) / std
    tokens = task.tokens(zero_shot_prompts(args.zs_classes))

    def logits():
        outs = []
        with torch.no_grad():
            for chunk in images.split(args.batch):
                img, txt = task.features(chunk, tokens)
                outs.append(100.0 * img.float() @ txt.float().T)
        return torch.cat(outs)

    native = logits()
    result = {"images": args.zs_images, "classes": args.zs_classes, "weights": task.source, "modes": {}}
    for label, precision in modes_for("fp32", args.modes):
        if precision is None:
            continue
        report = elsa_surgery.convert(task.model, backend=args.backend, precision=precision, verify=False)
        with dispatch.record() as log:
            conv = logits()
        elsa_surgery.revert(task.model)
        agree = (conv.argmax(-1) == native.argmax(-1)).float().mean().item()
        result["modes"][label] = {
            "top1_agreement": agree, "target_met": agree >= 0.999,
            "logits_max_abs_diff": (conv - native).abs().max().item(),
            "converted_modules": report.num_converted, **dispatch_summary(log),
        }
        print(f"zero-shot {label:13s} top-1 agreement {100 * agree:7.3f}%  max|Δlogits| "
              f"{result['modes'][label]['logits_max_abs_diff']:.3g}  ({report.num_converted} modules)")
    return result


def latency(task, args, device):
    rows = []
    for size in args.sizes:
        for dname in args.dtypes:
            dtype = DTYPES[dname]
            try:
                tower = task.image_tower(size, dtype)
            except Exception as exc:
                rows.append({"size": size, "dtype": dname, "error": error_text(exc)})
                print(f"{size}px {dname}: cannot build the image tower ({exc})")
                continue
            x = torch.randn(args.batch, 3, size, size, device=device, dtype=dtype)
            rows += measure_modes(tower, lambda: tower(x), modes_for(dname, args.modes), device, args.warmup,
                                  args.iters, {"size": size, "dtype": dname, "batch": args.batch},
                                  backend=args.backend, show=lambda row: print(fmt_row(row)))
            del tower
    return rows


def fmt_row(r):
    if "error" in r:
        return f"{r['size']:4d}px {r['dtype']:4s} {r.get('mode', '-'):13s} ERROR {r['error']}"
    peak = peak_text(r["peak_mib"])
    extra = f"  x{r['speedup_vs_native']:.3f} vs native" if r.get("speedup_vs_native") else ""
    return f"{r['size']:4d}px {r['dtype']:4s} {r['mode']:13s} {r['ms']:10.3f} ms  peak {peak}{extra}"


def plot(result, path):
    title = f"{result['model']} image encoder latency"
    plot_time_memory(result["latency"], path, "size",
                     dict(xlabel="image size (px)", ylabel="ms / batch", title=title),
                     dict(xlabel="image size (px)", ylabel="peak extra MiB", title="peak memory"))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="ViT-L-14", help="open_clip model config name")
    p.add_argument("--pretrained", default="openai", help="open_clip tag (if cached locally) or checkpoint path")
    p.add_argument("--hf", default=None, help="local path of a Hugging Face CLIP model (instead of open_clip)")
    p.add_argument("--layers", type=int, default=None, help="override the depth of both towers (random weights)")
    p.add_argument("--sizes", default="224,336,448,560")
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--modes", default="strict,precise,turbo", help="fp32 precision modes to convert with")
    p.add_argument("--backend", default="auto")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--zs-images", type=int, default=1000)
    p.add_argument("--zs-classes", type=int, default=100)
    p.add_argument("--skip-zero-shot", action="store_true")
    p.add_argument("--skip-latency", action="store_true")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=None, help="JSON output path")
    p.add_argument("--plot", default=None, help="PNG output path (needs matplotlib)")
    p.add_argument("--smoke", action="store_true", help="tiny CPU-friendly run: 2 layers, 224 px, few images")
    args = p.parse_args(argv)
    if args.smoke:
        args.layers = args.layers or 2
        args.sizes, args.dtypes = "224", "fp32" if args.device == "cpu" else args.dtypes
        args.modes = "strict" if args.device == "cpu" else args.modes
        args.batch, args.zs_images, args.zs_classes, args.warmup, args.iters = 2, 8, 10, 1, 2
        args.model = "ViT-B-32" if args.model == "ViT-L-14" else args.model
        args.pretrained = None
    args.sizes = comma_list(p, "--sizes", args.sizes, type=int)
    args.dtypes = comma_list(p, "--dtypes", args.dtypes, DTYPES, "dtype")
    args.modes = comma_list(p, "--modes", args.modes, elsa_surgery.PRECISIONS, "precision")
    return args


def main(argv=None):
    args = parse_args(argv)
    device = torch.device(args.device)
    task = HFClipTask(args, device) if args.hf else OpenClipTask(args, device)
    result = {"recipe": "clip_eval", "model": args.hf or args.model, "weights": task.source, "env": env_info(device),
              "args": {k: v for k, v in vars(args).items()}}
    if not args.skip_zero_shot:
        result["zero_shot"] = zero_shot(task, args, device)
    if not args.skip_latency:
        result["latency"] = latency(task, args, device)
    if args.out:
        write_json(args.out, result)
    if args.plot and result.get("latency"):
        plot(result, args.plot)
    return result


if __name__ == "__main__":
    main()
