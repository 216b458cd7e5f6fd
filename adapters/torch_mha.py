"""PyTorch's own attention modules: ``nn.MultiheadAttention`` and the layers that bypass it.

Two adapters, matched by exact class (subclasses are not matched):

``torch.mha`` — ``nn.MultiheadAttention``
    ``forward`` is rebound (``bind_forward``); the module keeps its own parameters (``in_proj_weight`` or
    ``q/k/v_proj_weight``, ``in_proj_bias``, ``bias_k``/``bias_v``, ``out_proj``), so the state dict is
    unchanged. Supported: ``batch_first`` True and False, unbatched 2-D inputs, packed and separate
    q/k/v projections (``kdim``/``vdim``), self- and cross-attention, ``key_padding_mask`` and
    ``attn_mask`` (2-D ``[L, S]`` or 3-D ``[N*H, L, S]``) in PyTorch's polarity — bool **True = masked**,
    float masks additive — converted at the boundary to the API's polarity (True = attend),
    ``is_causal`` (PyTorch's hint that ``attn_mask`` is causal), ``add_bias_kv`` and ``add_zero_attn``.

    Calls the adapter does not run, and sends to the original implementation instead (counted per
    module in ``module.elsa_native_calls`` — ``{reason: count}`` —, logged once per reason and
    recorded as a ``Decision(backend="native", fallback=True)`` in :func:`elsa_surgery.dispatch.record`):

    * ``need_weights=True`` (PyTorch's default!): the caller wants the attention matrix, which an exact
      O(n)-memory kernel never forms. Pass ``need_weights=False`` to use ELSA — or, for models that
      discard the weights (``out, _ = attn(x, x, x)``), convert with the opt-in adapter instance
      ``TorchMultiheadAttention(weights_unused=True)``, which runs ELSA and returns ``(out, None)``.
    * nested-tensor inputs (only PyTorch's own fast path accepts them);

    Two differences from PyTorch, both on inputs PyTorch leaves undefined: a query row whose keys are
    all masked returns zeros (PyTorch: NaN); with ``is_causal=True`` and ``L != S`` the given
    ``attn_mask`` is used as is (PyTorch drops it for a top-left causal mask).

``torch.transformer_encoder_layer`` — ``nn.TransformerEncoderLayer``
    In eval mode under ``torch.no_grad()`` the layer's forward calls the fused
    ``torch._transformer_encoder_layer_fwd``, which never calls ``self_attn.forward``: a converted
    ``self_attn`` would be silently bypassed. The adapter rebinds the layer's ``forward`` to PyTorch's
    own composite path (norms, ``self_attn(..., need_weights=False)``, feed-forward), written with the
    layer's public submodules, and converts the layer's ``self_attn`` with the ``torch.mha`` logic (the
    framework does not visit a converted module's children; the report lists the layer). Nested-tensor
    inputs (``nn.TransformerEncoder``'s padding fast path, eval mode with ``src_key_padding_mask``) are
    padded, run with the padding masked and unpadded again, so outputs match PyTorch's (zeros at padding).

    Guard: every converted ``nn.MultiheadAttention`` also carries a no-op forward pre-hook. PyTorch skips
    the fused layer path when any module of the layer has hooks, so even with ``adapters=["torch.mha"]``
    alone an enclosing ``TransformerEncoderLayer`` calls the converted ``self_attn``.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from elsa_surgery.patching import patch_module, record_of, unpatch_module
from elsa_surgery.registry import PatchConfig

from ._base import ForwardAdapter, attention, bind_forward, original_forward, record_native_call

# --------------------------------------------------------------------------------------------------
# nn.MultiheadAttention
# --------------------------------------------------------------------------------------------------

def _float_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """PyTorch polarity (bool True = masked, float additive) -> additive float in ``dtype``."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask, float("-inf"))
    return mask.to(dtype)


def mha_mask(attn_mask: Optional[torch.Tensor], key_padding_mask: Optional[torch.Tensor], *, batch: int,
             heads: int, n_q: int, n_k: int, extra: int, dtype: torch.dtype) -> Optional[torch.Tensor]:
    """Merge nn.MultiheadAttention's masks into one mask in the API's polarity.

    ``attn_mask`` ``[L, S]`` or ``[N*H, L, S]`` and ``key_padding_mask`` ``[N, S]`` (bool True = masked,
    or additive float) become a bool (True = attend) or additive float mask broadcastable to
    ``[N, H, L, S + extra]``; the ``extra`` key columns (``bias_k``, ``add_zero_attn``) are visible.
    Masks of mismatched kinds are merged as floats, as PyTorch does.
    """
    am = kpm = None
    if attn_mask is not None:
        if attn_mask.dim() == 2:
            if tuple(attn_mask.shape) != (n_q, n_k):
                raise ValueError(f"attn_mask: a 2-D mask must have shape (L, S) = ({n_q}, {n_k}), "
                                 f"got {tuple(attn_mask.shape)}")
            am = attn_mask.view(1, 1, n_q, n_k)
        elif attn_mask.dim() == 3:
            if tuple(attn_mask.shape) != (batch * heads, n_q, n_k):
                raise ValueError(f"attn_mask: a 3-D mask must have shape (N*num_heads, L, S) = "
                                 f"({batch * heads}, {n_q}, {n_k}), got {tuple(attn_mask.shape)}")
            am = attn_mask.view(batch, heads, n_q, n_k)
        else:
            raise ValueError(f"attn_mask must be 2-D (L, S) or 3-D (N*num_heads, L, S), got {attn_mask.dim()}-D")
        if not (am.dtype == torch.bool or am.is_floating_point()):
            raise TypeError(f"attn_mask must be bool or floating, got {am.dtype}")
    if key_padding_mask is not None:
        if tuple(key_padding_mask.shape) != (batch, n_k):
            raise ValueError(f"key_padding_mask must have shape (N, S) = ({batch}, {n_k}), "
                             f"got {tuple(key_padding_mask.shape)}")
        if not (key_padding_mask.dtype == torch.bool or key_padding_mask.is_floating_point()):
            raise TypeError(f"key_padding_mask must be bool or floating, got {key_padding_mask.dtype}")
        kpm = key_padding_mask.view(batch, 1, 1, n_k)
    if am is None and kpm is None:
        return None
    parts = [m for m in (am, kpm) if m is not None]
    if all(m.dtype == torch.bool for m in parts):
        masked = parts[0] if len(parts) == 1 else parts[0] | parts[1]
        mask = ~masked
        if extra:
            mask = F.pad(mask, (0, extra), value=True)
        return mask
    merged = _float_mask(parts[0], dtype)
    if len(parts) == 2:
        merged = merged + _float_mask(parts[1], dtype)
    if extra:
        merged = F.pad(merged, (0, extra), value=0.0)
    return merged


def _mha_native_reason(self: nn.MultiheadAttention, query, key, value, need_weights) -> Optional[str]:
    if need_weights and not record_of(self).extras.get("weights_unused", False):
        return "need_weights=True: the attention weights are requested"
    if query.is_nested or key.is_nested or value.is_nested:
        return "nested-tensor inputs"
    return None


def _mha_project(self: nn.MultiheadAttention, query, key, value):
    """The input projections, exactly as ``F.multi_head_attention_forward`` splits the weights."""
    E = self.embed_dim
    b = self.in_proj_bias
    if self._qkv_same_embed_dim:
        w = self.in_proj_weight
        if query is key and key is value:
            return F.linear(query, w, b).chunk(3, dim=-1)
        if key is value:
            w_q, w_kv = w.split([E, 2 * E])
            b_q, b_kv = (None, None) if b is None else b.split([E, 2 * E])
            k, v = F.linear(key, w_kv, b_kv).chunk(2, dim=-1)
            return F.linear(query, w_q, b_q), k, v
        w_q, w_k, w_v = w.chunk(3)
    else:
        w_q, w_k, w_v = self.q_proj_weight, self.k_proj_weight, self.v_proj_weight
    b_q, b_k, b_v = (None, None, None) if b is None else b.chunk(3)
    return F.linear(query, w_q, b_q), F.linear(key, w_k, b_k), F.linear(value, w_v, b_v)


def _mha_forward(self: nn.MultiheadAttention, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 key_padding_mask: Optional[torch.Tensor] = None, need_weights: bool = True,
                 attn_mask: Optional[torch.Tensor] = None, average_attn_weights: bool = True,
                 is_causal: bool = False, *, config: PatchConfig) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    reason = _mha_native_reason(self, query, key, value, need_weights)
    if reason is not None:
        record_native_call(self, reason)
        return original_forward(self)(query, key, value, key_padding_mask=key_padding_mask,
                                      need_weights=need_weights, attn_mask=attn_mask,
                                      average_attn_weights=average_attn_weights, is_causal=is_causal)
    if is_causal and attn_mask is None:
        raise RuntimeError("Need attn_mask if specifying the is_causal hint (nn.MultiheadAttention's contract); "
                           "nn.Transformer.generate_square_subsequent_mask builds one")
    batched = query.dim() == 3
    if query.dim() not in (2, 3):
        raise ValueError(f"query must be 2-D (L, E) or 3-D, got shape {tuple(query.shape)}")
    if not batched and key_padding_mask is not None:
        key_padding_mask = key_padding_mask.unsqueeze(0)
    H, hd, E = self.num_heads, self.head_dim, self.embed_dim

    q, k, v = _mha_project(self, query, key, value)
    # to batch-first views [N, L, E]
    if not batched:
        q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
    elif not self.batch_first:
        q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    N, L, S = q.shape[0], q.shape[1], k.shape[1]

    extra = 0
    if self.bias_k is not None and self.bias_v is not None:
        k = torch.cat([k, self.bias_k.reshape(1, 1, E).expand(N, 1, E)], dim=1)
        v = torch.cat([v, self.bias_v.reshape(1, 1, E).expand(N, 1, E)], dim=1)
        extra += 1
    q = q.unflatten(-1, (H, hd)).transpose(1, 2)  # [N, H, L, hd]
    k = k.unflatten(-1, (H, hd)).transpose(1, 2)
    v = v.unflatten(-1, (H, hd)).transpose(1, 2)
    if self.add_zero_attn:
        k = torch.cat([k, k.new_zeros(N, H, 1, hd)], dim=2)
        v = torch.cat([v, v.new_zeros(N, H, 1, hd)], dim=2)
        extra += 1

    causal = bool(is_causal) and key_padding_mask is None and extra == 0 and L == S
    mask = None if causal else mha_mask(attn_mask, key_padding_mask, batch=N, heads=H, n_q=L, n_k=S,
                                        extra=extra, dtype=q.dtype)
    out = attention(config, q, k, v, attn_mask=mask, is_causal=causal,
                    dropout_p=self.dropout if self.training else 0.0)  # [N, H, L, hd]
    if not batched:
        out = out.transpose(1, 2).reshape(L, E)
    elif self.batch_first:
        out = out.transpose(1, 2).reshape(N, L, E)
    else:
        out = out.permute(2, 0, 1, 3).reshape(L, N, E)
    return F.linear(out, self.out_proj.weight, self.out_proj.bias), None


def _fast_path_guard(module, args, kwargs):
    """A no-op forward pre-hook. Its presence makes an enclosing ``nn.TransformerEncoderLayer`` skip its fused
    ``torch._transformer_encoder_layer_fwd`` (PyTorch checks for hooks on the layer's modules), so the
    converted ``self_attn`` is called even when the layer itself is not converted."""
    return None


def patch_mha(module: nn.MultiheadAttention, config: PatchConfig, weights_unused: bool = False) -> None:
    rec = bind_forward(module, _mha_forward, config)
    if weights_unused:
        rec.extras["weights_unused"] = True
    if "guard" not in rec.extras:
        rec.extras["guard"] = module.register_forward_pre_hook(_fast_path_guard, with_kwargs=True)


def unpatch_mha(module: nn.MultiheadAttention) -> None:
    """Remove the fast-path guard hook (the record restores the rest)."""
    handle = record_of(module).extras.pop("guard", None)
    if handle is not None:
        handle.remove()


class TorchMultiheadAttention(ForwardAdapter):
    """``weights_unused=True`` (opt-in, for models that call ``mha(x, x, x)`` with PyTorch's default
    ``need_weights=True`` and throw the weights away, e.g. ``out, _ = self.attn(x, x, x)``): such calls run
    ELSA too and return ``(out, None)``. Use it as ``convert(model, adapters=[TorchMultiheadAttention(
    weights_unused=True), ...])`` or register it with ``register_adapter(..., override=True)``."""

    name = "torch.mha"
    library = None
    description = ("torch.nn.MultiheadAttention (exact class): forward rebound; "
                   "need_weights=True and nested inputs run the original and are counted")

    def __init__(self, weights_unused: bool = False):
        self.weights_unused = bool(weights_unused)

    def matches(self, module: nn.Module) -> bool:
        return type(module) is nn.MultiheadAttention

    def skip_reason(self, module: nn.Module, config: PatchConfig) -> Optional[str]:
        if (module.bias_k is None) != (module.bias_v is None):
            return "only one of bias_k / bias_v is set (PyTorch itself rejects this module)"
        return None

    def patch(self, module: nn.Module, config: PatchConfig) -> None:
        patch_mha(module, config, self.weights_unused)

    def unpatch(self, module: nn.Module) -> None:
        unpatch_mha(module)

    def example_inputs(self, model: nn.Module):
        # (open_clip's towers are built of nn.MHA: the open_clip adapter builds their inputs, through the registry)
        if type(model) is not nn.MultiheadAttention:
            return None
        p = next(model.parameters())
        n, l, s = 2, 7, 9
        q = torch.randn((n, l, model.embed_dim) if model.batch_first else (l, n, model.embed_dim),
                        dtype=p.dtype, device=p.device)
        shape_k = (n, s) if model.batch_first else (s, n)
        k = torch.randn(*shape_k, model.kdim, dtype=p.dtype, device=p.device)
        v = torch.randn(*shape_k, model.vdim, dtype=p.dtype, device=p.device)
        return {"query": q, "key": k, "value": v, "need_weights": False}


# --------------------------------------------------------------------------------------------------
# nn.TransformerEncoderLayer: its fused fast path bypasses self_attn.forward
# --------------------------------------------------------------------------------------------------

def _composite_layer(self: nn.TransformerEncoderLayer, src, src_mask, src_key_padding_mask, is_causal):
    """PyTorch's composite (non-fused) encoder-layer path, written with the layer's public submodules."""

    def sa_block(x):
        y = self.self_attn(x, x, x, attn_mask=src_mask, key_padding_mask=src_key_padding_mask,
                           need_weights=False, is_causal=is_causal)[0]
        return self.dropout1(y)

    def ff_block(x):
        return self.dropout2(self.linear2(self.dropout(self.activation(self.linear1(x)))))

    x = src
    if self.norm_first:
        x = x + sa_block(self.norm1(x))
        x = x + ff_block(self.norm2(x))
    else:
        x = self.norm1(x + sa_block(x))
        x = self.norm2(x + ff_block(x))
    return x


def _encoder_layer_forward(self: nn.TransformerEncoderLayer, src: torch.Tensor,
                           src_mask: Optional[torch.Tensor] = None,
                           src_key_padding_mask: Optional[torch.Tensor] = None,
                           is_causal: bool = False, *, config: PatchConfig) -> torch.Tensor:
    if not src.is_nested:
        return _composite_layer(self, src, src_mask, src_key_padding_mask, is_causal)
    # Nested input (nn.TransformerEncoder's padding fast path): pad, mask the padding, run, unpad.
    if src_mask is not None or src_key_padding_mask is not None or not self.self_attn.batch_first:
        record_native_call(self, "nested-tensor input with masks or batch_first=False")
        return original_forward(self)(src, src_mask=src_mask, src_key_padding_mask=src_key_padding_mask,
                                      is_causal=is_causal)
    lengths = [int(t.shape[0]) for t in src.unbind()]
    padded = src.to_padded_tensor(0.0)
    lens = torch.tensor(lengths, device=padded.device)
    pad = torch.arange(padded.shape[1], device=padded.device)[None, :] >= lens[:, None]  # True = padding
    out = _composite_layer(self, padded, None, pad, False)
    return torch.nested.nested_tensor([out[i, :n] for i, n in enumerate(lengths)])


class TorchTransformerEncoderLayer(ForwardAdapter):
    name = "torch.transformer_encoder_layer"
    library = None
    description = ("torch.nn.TransformerEncoderLayer (exact class): forward rebound to the composite path so the "
                   "fused torch._transformer_encoder_layer_fwd cannot bypass self_attn, which it converts too")

    def matches(self, module: nn.Module) -> bool:
        return type(module) is nn.TransformerEncoderLayer

    def skip_reason(self, module: nn.Module, config: PatchConfig) -> Optional[str]:
        sa = getattr(module, "self_attn", None)
        if type(sa) is not nn.MultiheadAttention:
            return f"its self_attn is a {type(sa).__name__}, not an nn.MultiheadAttention"
        return TorchMultiheadAttention().skip_reason(sa, config)

    forward_fn = _encoder_layer_forward

    def patch(self, module: nn.Module, config: PatchConfig) -> None:
        sa = module.self_attn
        # The framework does not visit a converted module's children: the layer converts its self_attn (a record
        # of its own, undone with the layer's), unless that module was converted on its own before (left as is).
        rec = bind_forward(module, _encoder_layer_forward, config)
        if record_of(sa) is None:
            patch_module(sa, _MHA, config)
            rec.extras["patched_self_attn"] = True

    def unpatch(self, module: nn.Module) -> None:
        if record_of(module).extras.pop("patched_self_attn", False) and record_of(module.self_attn) is not None:
            unpatch_module(module.self_attn)


_MHA = TorchMultiheadAttention()
ADAPTERS = [_MHA, TorchTransformerEncoderLayer()]
