"""Hugging Face transformers: ELSA through the official ``AttentionInterface`` / ``AttentionMaskInterface``.

Two registrations (both in transformers' global interfaces, so they serve every model that dispatches
through ``ALL_ATTENTION_FUNCTIONS``):

``"elsa"``
    The attention function :func:`elsa_attention_forward` plus transformers' own SDPA mask builder (boolean,
    True = attend: ELSA's polarity). Without the mask registration transformers silently drops the padding
    mask (``_preprocess_mask_arguments`` returns None for unknown implementations).
``"elsa_varlen"``
    The same attention function plus :func:`elsa_varlen_mask`: for a *bidirectional* mask (encoders: BERT
    and friends) with right padding it hands the 2-D padding mask itself to the attention function, which
    runs ELSA's zero-copy padded-lengths path (``kv_lengths``): no ``[B, 1, L, L]`` mask is built and padding
    keys are never read. Left or interior padding, causal masks, sliding windows and caches go through the
    ``"elsa"`` mask builder unchanged, so the registration is correct for every model.

``convert(model)`` switches every (sub-)config with ``model.set_attn_implementation`` (the official API),
tags every attention module with the patch configuration (backend / precision) and reports it;
``revert`` restores the previous implementation of every config. The attention modules are found by
reading each module class's ``forward``: every class that dispatches through ``ALL_ATTENTION_FUNCTIONS``.
``include`` / ``exclude`` work although the switch is per config: modules left out run transformers'
own ``sdpa`` function (same masks) while the model is converted. A wrapper module holding
PreTrainedModels (e.g. a sentence-transformers pipeline) is converted through them.

Packed sequences with flash-attention kwargs (``cu_seq_lens_q`` / ``cu_seq_lens_k``, batch 1, as
``DataCollatorWithFlattening`` produces) run :func:`elsa_surgery.attention_varlen`.

Interface contract honoured by :func:`elsa_attention_forward`: ``query [B, Hq, L, D]``, ``key/value
[B, Hkv, S, D]``; output ``[B, L, Hq, Dv]`` (and ``None`` attention weights); ``scaling``; GQA with
``enable_gqa`` (no ``repeat_kv`` copies); causality from ``is_causal`` or ``module.is_causal`` with SDPA's
rule (no causal mask for a one-token decode step, and a mask when there is one). Soft-capping and
attention sinks are refused with a reason; sliding windows arrive in the boolean mask and are supported.

This module imports transformers only inside functions (``import elsa_surgery`` must work without it).
"""

from __future__ import annotations


import functools
import inspect
import logging
import sys
import threading
import weakref
from typing import Any, Dict, List, Optional

import torch
import torch.nn as nn

import elsa_surgery
from elsa_surgery import patching, semantics
from elsa_surgery.registry import Adapter, PatchConfig

logger = logging.getLogger("elsa_surgery")

IMPL = "elsa"
IMPL_VARLEN = "elsa_varlen"
IMPLEMENTATIONS = (IMPL, IMPL_VARLEN)
# Each attention module of a converted model carries a patch record of level "part" (its backend / precision, also
# in patching.CONFIG_ATTR; PASS_ATTR, set through the record, True on modules include/exclude left out: they run
# 'sdpa'); each PreTrainedModel switched carries one too (or the model-level record, when it is the converted model)
# holding the previous implementations (extras["hf_previous"]) and the per-module notes (extras["hf_modules"]).
# The attention function reads only the module's plain attributes (a config tuple, a bool), never the record: under
# torch.compile Dynamo's guard check then skips the module's subtree while its __dict__ is unchanged (patching).
PATCH_ATTR = patching.RECORD_ATTR
PASS_ATTR = "_elsa_passthrough"

_local = threading.local()


class UnsupportedAttention(NotImplementedError):
    """An attention feature ELSA does not implement (soft-capping, sinks, paged caches...)."""


# --------------------------------------------------------------------------------------------------
# the attention function
# --------------------------------------------------------------------------------------------------

def _note_call(module, how: str) -> None:
    log = getattr(_local, "calls", None)  # (None outside trace_calls: the common case, checked first)
    if log is not None and not torch.compiler.is_compiling():
        log.setdefault(id(module), {"module": module, "paths": set()})["paths"].add(how)


def elsa_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    is_causal: Optional[bool] = None,
    **kwargs,
):
    """transformers attention-interface function running :func:`elsa_surgery.attention`."""
    if getattr(module, PASS_ATTR, False):
        return _passthrough_sdpa(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)
    if kwargs.get("softcap") is not None:
        raise UnsupportedAttention(
            f"ELSA does not implement attention logit soft-capping (softcap={kwargs['softcap']}); "
            "keep this model on 'eager' or 'sdpa'")
    if kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None:
        raise UnsupportedAttention("ELSA does not implement attention sinks (s_aux); keep this model on 'eager'")
    if kwargs.get("position_bias") is not None:
        raise UnsupportedAttention("ELSA's transformers adapter does not take a position_bias; keep this model on 'sdpa'")
    if kwargs.get("cache") is not None:
        raise UnsupportedAttention("ELSA does not support transformers' paged (continuous-batching) cache")
    # transformers passes the module's attention_dropout / attention_probs_dropout_prob, 0 outside training
    dropout_p = float(dropout) if module.training else 0.0
    cfg = patching.config_of(module)
    q_len, kv_len = query.shape[2], key.shape[2]
    gqa = query.shape[1] != key.shape[1]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    kv_lengths = None
    mask = attention_mask

    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    packed = cu_q is not None and cu_k is not None and query.shape[0] == 1
    window = None
    if packed:
        # (looked up for packed calls only: a module without the attribute costs an AttributeError per call)
        window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
        max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
        max_q = int(max_q) if max_q is not None else int(cu_q.diff().max())
        max_k = int(max_k) if max_k is not None else int(cu_k.diff().max())
    if packed and window is not None and max_k > window:  # (query i sees key j when i - j < window)
        # the packed path has no window (issue 30: it was silently dropped): the mask transformers built from
        # the position_ids holds both the sequence boundaries and the window
        if mask is None or mask.dim() != 4:
            raise UnsupportedAttention(
                f"packed sequences (cu_seq_lens_q) with a sliding window ({window}) and no 4-D attention mask: "
                "ELSA's packed path has no window; pass the attention mask, or keep this model on 'sdpa'")
        packed = False
    if packed:
        # packed sequences (DataCollatorWithFlattening's flash-attention kwargs): the packed varlen path, as
        # transformers' flash-attention integration does (the cu_seqlens define the sequences, no mask)
        _note_call(module, "packed")
        out = elsa_surgery.attention_varlen(
            query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
            cu_q.to(torch.int32), cu_k.to(torch.int32), max_q, max_k,
            is_causal=bool(causal), scale=scaling, backend=cfg.backend, precision=cfg.precision, dropout_p=dropout_p)
        return out.unsqueeze(0).contiguous(), None

    if mask is not None and mask.dim() == 2:
        # "elsa_varlen": a right-padded 2-D padding mask [B, S] (True/1 = token) -> per-row key lengths
        kv_lengths = _lengths_of(mask)
        mask = None
        causal = False  # elsa_varlen_mask only hands over the 2-D mask for bidirectional masks
        _note_call(module, "varlen")
    else:
        # SDPA's rule: causal only without a mask and for more than one query (a decode step sees all keys)
        causal = bool(q_len > 1 and mask is None and causal)
        if causal and kv_len > q_len:
            # transformers builds no mask here only for a static-cache prefill whose trailing keys are
            # not filled yet (SDPA's top-left alignment); drop them, as its SDPA integration does
            key, value = key[:, :, :q_len], value[:, :, :q_len]
        if (mask is not None and mask.dim() == 4 and mask.dtype == torch.bool and q_len <= CACHE_TAIL_MAX_QUERIES
                and kv_len >= CACHE_TAIL_MIN_KEYS and not torch.compiler.is_compiling()):
            # a short-query step over a pre-allocated (static) cache: the mask hides the unfilled tail; the
            # kernels stop at each row's last visible key instead of reading the whole cache (exact: every key
            # past it is masked; no copy of the cache)
            kv_lengths = _visible_prefix(mask)
            if kv_lengths.shape[0] != query.shape[0]:
                kv_lengths = kv_lengths.expand(query.shape[0]).contiguous()
                semantics.trust_lengths(kv_lengths, mask.shape[-1])
        _note_call(module, "mask" if mask is not None else ("causal" if causal else "dense"))

    out = elsa_surgery.attention(
        query, key, value, attn_mask=mask, is_causal=causal, scale=scaling, enable_gqa=gqa,
        backend=cfg.backend, precision=cfg.precision, kv_lengths=kv_lengths, dropout_p=dropout_p,
    )
    return out.transpose(1, 2).contiguous(), None


CACHE_TAIL_MAX_QUERIES = 64  # decode, speculative and chunked steps (the kernels' short-query path)
CACHE_TAIL_MIN_KEYS = 1024  # below this, reading the masked tail costs less than finding it

_LAST_LENGTHS: list = [None, -1, None]  # (weakref to the 2-D padding mask, its _version, its per-row lengths)
_LAST_PREFIX: list = [None, -1, None]  # the same for a 4-D mask's visible prefix


def _per_mask(memo: list, mask: torch.Tensor, compute):
    """``compute(mask)``, kept while ``mask`` is the same unmodified tensor: every layer of a forward pass gets the
    same result. The result lies in ``[0, mask.shape[-1]]`` by construction, so it is recorded as checked
    (``semantics.trust_lengths``): its calls skip the value check, a host sync. An inference tensor (made under
    ``torch.inference_mode``) has no version counter, so an in-place change could not be seen: its result is
    computed again for each layer (one small reduction, no sync)."""
    ref, version, value = memo
    compiling = torch.compiler.is_compiling()
    inference = mask.is_inference()
    if not compiling and not inference and ref is not None and ref() is mask and version == mask._version:
        return value
    value = compute(mask)
    if not compiling:
        semantics.trust_lengths(value, mask.shape[-1])
        if not inference:
            memo[:] = [weakref.ref(mask), mask._version, value]
    return value


def _lengths_of(mask2d: torch.Tensor) -> torch.Tensor:
    """Per-row key lengths of a right-padded 2-D padding mask: those that :func:`elsa_varlen_mask` computed for the
    mask object it made for this forward pass, else once per mask (:func:`_per_mask`)."""
    lengths = getattr(mask2d, _LENGTHS_ATTR, None)
    if lengths is not None and not torch.compiler.is_compiling():
        return lengths
    return _per_mask(_LAST_LENGTHS, mask2d, lambda m: m.sum(dim=-1, dtype=torch.int32))


_LENGTHS_ATTR = "_elsa_kv_lengths"  # the per-row lengths that elsa_varlen_mask attaches to the mask object it returns


def _last_visible(mask4d: torch.Tensor) -> torch.Tensor:
    """One past the last key that any query row of any head sees, per batch row (int32 ``[B|1]``, 0 when none). A
    decode step's mask (at most :data:`FUSED_PREFIX_MAX` elements) takes two launches, the positions of its visible
    keys and their maximum; a longer one is reduced over its heads and rows first (no mask-sized int32 copy)."""
    s = mask4d.shape[-1]
    key = (s, mask4d.device)
    position = _POSITIONS.get(key)  # 1..S, made once per length and device (decode steps share it)
    if position is None:
        if len(_POSITIONS) >= 16:
            _POSITIONS.clear()
        position = _POSITIONS[key] = torch.arange(1, s + 1, device=mask4d.device, dtype=torch.int32)
    if mask4d.numel() <= FUSED_PREFIX_MAX:
        return torch.where(mask4d, position, 0).flatten(1).amax(dim=-1)
    seen = mask4d.any(dim=2).any(dim=1)  # [B|1, S]: keys some query row of some head sees
    return torch.where(seen, position, 0).amax(dim=-1)


FUSED_PREFIX_MAX = 1 << 22  # mask elements up to which _last_visible takes its two-launch form (16 MiB of int32)
_POSITIONS: dict = {}  # (keys, device) -> int32 positions 1..keys


def _visible_prefix(mask4d: torch.Tensor) -> torch.Tensor:
    """Per batch row of a 4-D bool mask, one past the last key any query row sees (0 when none), once per mask."""
    return _per_mask(_LAST_PREFIX, mask4d, _last_visible)


def _passthrough_sdpa(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs):
    """A module that include/exclude did not select: transformers' own SDPA function, unchanged semantics."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    _note_call(module, "passthrough-sdpa")
    if attention_mask is not None and attention_mask.dim() == 2:  # elsa_varlen's padding mask -> SDPA's [B,1,1,S]
        attention_mask = attention_mask[:, None, None, :].to(torch.bool)
    for k in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"):
        kwargs.pop(k, None)
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kwargs)


# --------------------------------------------------------------------------------------------------
# mask functions
# --------------------------------------------------------------------------------------------------

_MASKING_UTILS: List[Any] = []


def _masking_utils():
    """``transformers.masking_utils``, imported once, when the mask builders are registered (eagerly): torch 2.11's
    dynamo cannot trace an import through transformers' lazy module ("Bad import result"), and the builders run
    inside compiled models."""
    if not _MASKING_UTILS:
        import transformers.masking_utils as mu

        _MASKING_UTILS.append(mu)
    return _MASKING_UTILS[0]


def _sdpa_mask():
    return _masking_utils().sdpa_mask


def elsa_mask(*args, **kwargs):
    """Boolean masks (True = attend), None where SDPA's ``is_causal`` rule applies: transformers' SDPA builder, and
    its causal skip also while torch.compile traces, where it needs no tensor value (:func:`_traced_causal_skip`)."""
    if not args and _traced_causal_skip(kwargs):
        return None
    return _sdpa_mask()(*args, **kwargs)


def _traced_causal_skip(kw) -> bool:
    """Whether a mask builder call that torch.compile traces is transformers' plain causal mask with no padding, where
    SDPA's ``is_causal`` rule holds (one query, or as many queries as keys), decided from static values only.

    transformers makes this skip outside tracing; while tracing it skips only in recent releases on torch >= 2.14
    (5.17 never does: its ``is_tracing`` check comes first), so a compiled model with a cache materialised a
    ``[B, 1, N, N]`` mask at every prefill step and ran the masked kernel: on an H100 (session 32, torch 2.11,
    LLaMA-13B-shaped, 4K tokens, bf16) that kernel took 2.5 ms per layer where the causal one takes 0.35 ms (native
    SDPA's cuDNN: 1.0 ms with the mask, 0.33 without). That measurement was a call without a cache, whose mask
    transformers builds from the position ids (packed sequences): a mask function this skip does not cover, as it
    would read tensor values. Only Python ints count (no ``SymInt``, no tensor offset: a dynamic-shape or exported
    graph keeps the mask), with no 2-D padding mask, no local window reaching the keys and the plain causal mask
    function; our adapter then runs causal attention (bottom-right, equal to top-left here) without a mask."""
    if not torch.compiler.is_compiling() or not kw.get("allow_is_causal_skip", True):
        return False
    mu = _masking_utils()
    q_len, kv_len = kw.get("q_length"), kw.get("kv_length")
    cache_position = kw.get("cache_position")
    if q_len is None and isinstance(cache_position, torch.Tensor):  # transformers releases that pass cache_position
        q_len = cache_position.shape[0]
    local = kw.get("local_size")
    return (kw.get("attention_mask") is None and kw.get("mask_function", mu.causal_mask_function)
            is mu.causal_mask_function and not kw.get("use_vmap", False)
            and type(q_len) is int and type(kv_len) is int and (q_len == 1 or q_len == kv_len)
            and type(kw.get("q_offset", 0)) is int and type(kw.get("kv_offset", 0)) is int
            and (local is None or (type(local) is int and kv_len < local)))


def elsa_varlen_mask(*args, **kwargs):
    """Mask builder of ``"elsa_varlen"``: the 2-D padding mask itself for right-padded bidirectional masks.

    Everything else (causal masks, left / interior padding, key offsets from a cache, local windows,
    custom mask functions, positional calls) is handed unchanged to :func:`elsa_mask`, so the result is
    always correct. Reads only keyword arguments, which transformers uses in every 5.x release (whether it
    passes ``q_length`` / ``q_offset`` or the older ``cache_position``: a bidirectional mask does not depend
    on the query positions).
    """
    mu = _masking_utils()
    attention_mask = kwargs.get("attention_mask")
    mask_function = kwargs.get("mask_function")
    kv_offset = kwargs.get("kv_offset", 0)
    kv_length = kwargs.get("kv_length")
    batch_size = kwargs.get("batch_size")
    bidirectional = getattr(mu, "bidirectional_mask_function", None)
    if (args or attention_mask is None or not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2
            or bidirectional is None or mask_function is not bidirectional
            or kwargs.get("local_size") is not None or kwargs.get("use_vmap", False)
            or not isinstance(kv_offset, int) or kv_offset != 0
            or attention_mask.shape[-1] != kv_length or attention_mask.shape[0] != batch_size):
        return elsa_mask(*args, **kwargs)
    if torch.compiler.is_compiling():  # keep the graph free of data-dependent branches
        return elsa_mask(*args, **kwargs)
    mask2d = attention_mask.to(torch.bool)
    n = mask2d.shape[-1]
    lengths = mask2d.sum(dim=-1, dtype=torch.int32)
    right = mask2d == (torch.arange(n, device=mask2d.device) < lengths[:, None])
    # one host sync for the three facts
    full, right_padded, empty = torch.stack([(lengths == n).all(), right.all(), (lengths == 0).any()]).tolist()
    if full:
        return None  # no padding: dense bidirectional attention
    if not right_padded:
        _log_once("elsa_varlen: the padding mask is not right-aligned (left or interior padding); "
                  "using the boolean-mask path for such calls")
        return elsa_mask(*args, **kwargs)
    # Every layer of this forward pass gets the object returned here: it carries the lengths, computed once (also
    # under torch.inference_mode, whose tensors have no version counter for _per_mask). A view when the caller's
    # mask was bool already: an object of our own, which no other forward pass receives, so its lengths stay its own.
    if mask2d is attention_mask:
        mask2d = mask2d.view(mask2d.shape)
    semantics.trust_lengths(lengths, n, positive=not empty)
    setattr(mask2d, _LENGTHS_ATTR, lengths)
    return mask2d


_logged = set()


def _log_once(msg: str) -> None:
    if msg not in _logged:
        _logged.add(msg)
        logger.info("elsa_surgery: %s", msg)


# --------------------------------------------------------------------------------------------------
# registration with transformers
# --------------------------------------------------------------------------------------------------

def register_attention_functions() -> None:
    from transformers.modeling_utils import AttentionInterface

    for name in IMPLEMENTATIONS:
        AttentionInterface.register(name, elsa_attention_forward)


def register_mask_functions() -> None:
    AttentionMaskInterface = _masking_utils().AttentionMaskInterface
    AttentionMaskInterface.register(IMPL, elsa_mask)
    AttentionMaskInterface.register(IMPL_VARLEN, elsa_varlen_mask)


def ensure_registered() -> None:
    register_attention_functions()
    register_mask_functions()


def is_registered() -> bool:
    mu = sys.modules.get("transformers.masking_utils")
    md = sys.modules.get("transformers.modeling_utils")
    if mu is None or md is None:
        return False
    return all(n in md.AttentionInterface._global_mapping and n in mu.AttentionMaskInterface._global_mapping
               for n in IMPLEMENTATIONS)


# --------------------------------------------------------------------------------------------------
# finding the attention modules and what ELSA cannot do for a model
# --------------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _class_uses_interface(cls) -> bool:
    """True when ``cls.forward`` dispatches through ``ALL_ATTENTION_FUNCTIONS`` (read from its source)."""
    try:
        src = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False
    return "ALL_ATTENTION_FUNCTIONS" in src


def attention_modules(model: nn.Module) -> List[tuple]:
    """``(name, module)`` of every module whose forward goes through ``ALL_ATTENTION_FUNCTIONS``."""
    return [(n, m) for n, m in model.named_modules() if _class_uses_interface(type(m))]


def _all_configs(model) -> List[Any]:
    """Every config object of the model: the top one, nested sub-configs, and those of sub-models."""
    from transformers import PreTrainedModel

    seen, out, todo = set(), [], [model.config]
    todo += [m.config for m in model.modules() if isinstance(m, PreTrainedModel)]
    while todo:
        c = todo.pop(0)
        if c is None or id(c) in seen:
            continue
        seen.add(id(c))
        out.append(c)
        for key in getattr(c, "sub_configs", {}) or {}:
            todo.append(getattr(c, key, None))
    return out


def refusal_reason(model) -> Optional[str]:
    """Why ELSA cannot run this model's attention exactly, or None."""
    for c in _all_configs(model):
        for attr in ("attn_logit_softcapping", "attention_logit_softcapping"):
            if getattr(c, attr, None) not in (None, 0, 0.0):
                return (f"{type(c).__name__}.{attr}={getattr(c, attr)}: attention logit soft-capping is not "
                        f"implemented by ELSA (exact softmax attention only)")
    for name, m in attention_modules(model):
        if isinstance(getattr(m, "sinks", None), torch.Tensor) or isinstance(getattr(m, "s_aux", None), torch.Tensor):
            return f"{name} ({type(m).__name__}) uses attention sinks, which ELSA does not implement"
    return None


def module_notes(model, module) -> str:
    notes = []
    groups = getattr(module, "num_key_value_groups", 1) or 1
    if groups > 1:
        notes.append(f"GQA x{groups} (enable_gqa, no repeat_kv)")
    sw = getattr(module, "sliding_window", None)
    if sw:
        notes.append(f"sliding window {sw} (boolean mask)")
    if getattr(module, "is_causal", False):
        notes.append("causal")
    return ", ".join(notes)


def choose_implementation(model) -> str:
    """``elsa_varlen`` for text encoders (padding-free varlen), ``elsa`` for everything else.

    Both are correct for any model (``elsa_varlen`` only changes bidirectional right-padded masks).
    """
    config = model.config
    if getattr(model, "main_input_name", None) != "input_ids":
        return IMPL
    if getattr(config, "is_decoder", False) or getattr(config, "is_encoder_decoder", False):
        return IMPL
    try:
        if model.can_generate():
            return IMPL
    except Exception:
        pass
    mods = attention_modules(model)
    if any(getattr(m, "is_causal", False) for _, m in mods):
        return IMPL
    return IMPL_VARLEN


def _current_impl(config) -> Optional[str]:
    return getattr(config, "_attn_implementation", None)


def _set_impl(model, impl) -> None:
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(impl)
    else:  # transformers without the official switch
        model.config._attn_implementation = impl


# --------------------------------------------------------------------------------------------------
# example inputs for the parity check
# --------------------------------------------------------------------------------------------------

def _text_inputs(config, batch: int, seq_len: int, device, padding: str = "right") -> Dict[str, torch.Tensor]:
    vocab = int(getattr(config, "vocab_size", 1000) or 1000)
    max_pos = getattr(config, "max_position_embeddings", None)
    if max_pos:
        seq_len = min(seq_len, int(max_pos))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(low=min(5, vocab - 1), high=vocab, size=(batch, seq_len), generator=g)
    mask = torch.ones(batch, seq_len, dtype=torch.long)
    if batch > 1 and seq_len > 2:  # pad the other rows by different amounts
        for b in range(1, batch):
            n = max(1, seq_len - (b * seq_len) // (batch + 1))
            if padding == "right":
                mask[b, n:] = 0
            else:
                mask[b, : seq_len - n] = 0
    pad = getattr(config, "pad_token_id", None)
    if pad is not None and 0 <= int(pad) < vocab:
        ids = ids.masked_fill(mask == 0, int(pad))
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device)}


def _image_inputs(config, batch: int, device, image_size: Optional[int] = None) -> Dict[str, torch.Tensor]:
    size = image_size or getattr(config, "image_size", None) or 224
    if isinstance(size, (list, tuple)):
        size = size[0]
    ch = int(getattr(config, "num_channels", 3) or 3)
    g = torch.Generator().manual_seed(0)
    return {"pixel_values": torch.randn(batch, ch, int(size), int(size), generator=g).to(device)}


def make_example_inputs(model, *, batch: int = 2, seq_len: int = 16, image_size: Optional[int] = None,
                        padding: str = "right") -> Optional[Dict[str, torch.Tensor]]:
    """Inputs for ``model(**inputs)``: token ids with padding, images, or both (CLIP-like)."""
    try:
        device = next(p.device for p in model.parameters() if p.device.type != "meta")
    except StopIteration:
        device = torch.device("cpu")
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        params = {}
    config = model.config
    inputs: Dict[str, torch.Tensor] = {}
    if "input_ids" in params:
        text_cfg = getattr(config, "text_config", None) or config
        inputs.update(_text_inputs(text_cfg, batch, seq_len, device, padding))
        if "attention_mask" not in params:
            inputs.pop("attention_mask")
    if "pixel_values" in params:
        vis_cfg = getattr(config, "vision_config", None) or getattr(config, "backbone_config", None) or config
        if getattr(vis_cfg, "image_size", None) is None and getattr(config, "image_size", None) is not None:
            vis_cfg = config
        px = _image_inputs(vis_cfg, batch, device, image_size)
        dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
        inputs["pixel_values"] = px["pixel_values"].to(dtype)
    if not inputs:
        return None
    if "use_cache" in params:
        inputs["use_cache"] = False  # a parity run must not grow a KV cache (modules are re-run one by one)
    if "input_ids" in inputs and "pixel_values" not in inputs and getattr(model, "main_input_name", "input_ids") == "pixel_values":
        return None
    return inputs


# --------------------------------------------------------------------------------------------------
# the adapter
# --------------------------------------------------------------------------------------------------

class _CallTrace:
    """``with trace_calls() as calls:`` collects ``{id(module): {"module", "paths"}}`` of ELSA calls."""

    def __enter__(self):
        self.prev = getattr(_local, "calls", None)
        _local.calls = {}
        return _local.calls

    def __exit__(self, *exc):
        _local.calls = self.prev
        return False


def trace_calls() -> _CallTrace:
    return _CallTrace()


def _already_reason(impl: str) -> str:
    return (f"already runs ELSA: attn_implementation={impl!r} was set outside elsa_surgery.convert (e.g. "
            f"from_pretrained(..., attn_implementation={impl!r})), so there is no original to verify against; "
            f"load it with 'sdpa' and convert() to get a parity check")


def pretrained_roots(model: nn.Module) -> List[tuple]:
    """``(name, PreTrainedModel)`` for the model itself or, in a wrapper, its outermost PreTrainedModels."""
    from transformers import PreTrainedModel

    if isinstance(model, PreTrainedModel):
        return [("", model)]
    roots: List[tuple] = []
    for name, m in model.named_modules():
        if isinstance(m, PreTrainedModel) and not any(name.startswith(r + ".") for r, _ in roots):
            roots.append((name, m))
    return roots


def _hf_state(model: nn.Module, key: str):
    """What this adapter keeps for a switched PreTrainedModel, in its patch record (None when not switched)."""
    rec = patching.record_of(model)
    return None if rec is None else rec.extras.get(key)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else (prefix or name)


class TransformersAttentionAdapter(Adapter):
    """Every transformers ``PreTrainedModel`` whose attention dispatches through ``AttentionInterface``.

    Model level: ``claims_model`` accepts a ``PreTrainedModel`` (or a wrapper holding some, e.g. a
    sentence-transformers pipeline) that ELSA can run exactly; ``patch_model`` switches each one's
    configs with ``set_attn_implementation``. A model ELSA must refuse (soft-capping, sinks, no
    AttentionInterface) is not claimed: its attention modules are then matched one by one and reported as
    skipped with the reason (``skip_reason``).
    """

    name = "transformers"
    library = "transformers"
    description = "transformers AttentionInterface + AttentionMaskInterface ('elsa' / 'elsa_varlen')"
    # include/exclude: the config switch is per model, so modules left out run transformers' SDPA function
    supports_module_filter = True

    # -- per-module path: only to report refusals -------------------------------------------------
    def matches(self, module: nn.Module) -> bool:
        return self.library_loaded() and _class_uses_interface(type(module))

    def skip_reason(self, module: nn.Module, config: PatchConfig) -> Optional[str]:
        cfg = getattr(module, "config", None)
        for attr in ("attn_logit_softcapping", "attention_logit_softcapping"):
            v = getattr(module, attr, None) or getattr(cfg, attr, None)
            if v not in (None, 0, 0.0):
                return f"{attr}={v}: attention logit soft-capping is not implemented by ELSA (exact softmax only)"
        if isinstance(getattr(module, "sinks", None), torch.Tensor) or isinstance(getattr(module, "s_aux", None), torch.Tensor):
            return "attention sinks are not implemented by ELSA"
        if _current_impl(cfg) in IMPLEMENTATIONS:
            return _already_reason(_current_impl(cfg))
        return ("transformers attention is converted through its PreTrainedModel (set_attn_implementation), "
                "and this module's model could not be switched; convert the PreTrainedModel itself")

    def patch(self, module: nn.Module, config: PatchConfig) -> None:  # never reached: skip_reason always answers
        raise NotImplementedError("transformers attention modules are converted at model level")

    # -- model level ------------------------------------------------------------------------------
    def claims_model(self, model: nn.Module) -> bool:
        if not self.library_loaded():
            return False
        roots = pretrained_roots(model)
        return bool(roots) and all(self.model_skip_reason(m) is None for _, m in roots)

    def model_modules(self, model: nn.Module) -> List[tuple]:
        return [(_join(p, n), m) for p, root in pretrained_roots(model) for n, m in attention_modules(root)]

    def model_skip_reason(self, model: nn.Module) -> Optional[str]:
        if hasattr(model, "_can_set_attn_implementation") and not model._can_set_attn_implementation():
            return (f"{type(model).__name__} does not dispatch attention through transformers' AttentionInterface, "
                    f"so its implementation cannot be switched")
        if not attention_modules(model):
            return f"{type(model).__name__} has no module that dispatches through ALL_ATTENTION_FUNCTIONS"
        if _hf_state(model, "hf_previous") is None and _current_impl(model.config) in IMPLEMENTATIONS:
            return _already_reason(_current_impl(model.config))
        return refusal_reason(model)

    def patch_model(self, model: nn.Module, config: PatchConfig, implementation: Optional[str] = None) -> None:
        """Switch every config of every PreTrainedModel in ``model`` to ELSA (all or nothing).

        Raises :class:`UnsupportedAttention` (model untouched) when ELSA cannot run a model exactly.
        """
        roots = pretrained_roots(model)
        for _, root in roots:
            why = self.model_skip_reason(root)
            if why:
                raise UnsupportedAttention(why)
        ensure_registered()
        done = []
        try:
            for prefix, root in roots:
                names = [_join(prefix, n) for n, _ in attention_modules(root)]
                if config.modules is not None and not any(n in config.modules for n in names):
                    continue  # nothing selected in this sub-model: leave it alone
                self._patch_one(root, config, implementation, prefix)
                done.append(root)
        except Exception:
            for root in done:
                self._revert_one(root)
            raise

    def _patch_one(self, model, config: PatchConfig, implementation: Optional[str], prefix: str = "") -> None:
        impl = implementation or choose_implementation(model)
        if impl not in IMPLEMENTATIONS:
            raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {impl!r}")
        configs = _all_configs(model)
        rec = patching.record_of(model) or patching.attach(model, self, config, level="part")
        if "hf_previous" not in rec.extras:
            rec.extras["hf_previous"] = (_current_impl(model.config), [(c, _current_impl(c)) for c in configs])
        try:
            _set_impl(model, impl)
        except Exception:
            self._restore(model)
            raise
        entries = []
        for name, m in attention_modules(model):
            part = patching.attach(m, self, config, level="part")
            selected = config.modules is None or _join(prefix, name) in config.modules
            part.set(m, PASS_ATTR, not selected)
            if selected:
                entries.append({"name": name, "module_class": type(m).__name__, "implementation": impl,
                                "note": module_notes(model, m)})
        rec.extras["hf_modules"] = entries
        # honest report: say so when transformers kept another implementation for some config
        for c in configs:
            if _current_impl(c) not in IMPLEMENTATIONS:
                logger.warning("elsa_surgery: %s kept attn_implementation=%r (transformers refused the switch)",
                               type(c).__name__, _current_impl(c))

    def _restore(self, model) -> None:
        saved = _hf_state(model, "hf_previous")
        if saved is None:
            return
        prev_top, previous = saved
        try:
            _set_impl(model, prev_top)
        except Exception as exc:  # e.g. flash_attention_2 requested but the package is gone: restore by hand
            logger.warning("elsa_surgery: set_attn_implementation(%r) failed on revert (%s); restoring the configs directly",
                           prev_top, exc)
        for c, p in previous:
            if _current_impl(c) != p:
                if hasattr(c, "_attn_implementation_internal"):
                    c._attn_implementation_internal = p
                else:
                    c._attn_implementation = p
        rec = patching.record_of(model)
        for key in ("hf_previous", "hf_modules"):
            rec.extras.pop(key, None)
        if rec.level == "part":  # a model-level record is the framework's to remove
            patching.detach(model)

    def _revert_one(self, model) -> None:
        for _, m in model.named_modules():
            rec = patching.record_of(m)
            if m is not model and rec is not None and rec.level == "part" and rec.adapter_name == self.name:
                patching.detach(m)
        self._restore(model)

    def revert_model(self, model: nn.Module) -> None:
        for _, root in pretrained_roots(model):
            self._revert_one(root)

    def is_patched(self, model: nn.Module) -> bool:
        return any(_hf_state(r, "hf_previous") is not None for _, r in pretrained_roots(model))

    def notes(self, model: nn.Module) -> List[dict]:
        """Per attention module: implementation used and what it relies on (GQA, window, causal)."""
        out = []
        for p, root in pretrained_roots(model):
            for e in _hf_state(root, "hf_modules") or []:
                out.append(dict(e, name=_join(p, e["name"])))
        return out

    def example_inputs(self, model: nn.Module):
        return self.sized_example_inputs(model)

    def sized_example_inputs(self, model: nn.Module, *, batch=None, seq_len=None, image_size=None):
        roots = pretrained_roots(model) if self.library_loaded() else []
        if roots and roots[0][0] == "":
            return make_example_inputs(model, batch=batch or 2, seq_len=seq_len or 16, image_size=image_size)
        return None


ADAPTERS = [TransformersAttentionAdapter()]
