"""Hugging Face transformers integration: ``attn_implementation="dmattn"``.

    import dmattn_ops.hf
    dmattn_ops.hf.register()
    model = AutoModelForCausalLM.from_config(config, attn_implementation="dmattn")
    out = model(input_ids, dma_mask=mask, dma_bias=bias)

`register()` adds "dmattn" to transformers' AttentionInterface (the attention function below)
and AttentionMaskInterface (`dmattn_mask`: transformers' own SDPA mask builder, which yields a
boolean (B, 1, Lq, Lk) mask, or None when the pattern is plain causal; and None as well for a
sliding-window causal layer without padding, whose window then reaches the kernels as
``window_size``, so no O(L^2) mask is built for Mistral, Qwen2/3, Gemma 2/3 or GPT-OSS).
Every attention layer of the model then runs `torch.ops.dmattn.attention`. Dynamic masks and
learned biases travel as keyword arguments of the model's forward, which transformers hands to
every attention call:

* ``dma_mask``: bool, (B|1, H|Hkv|1, Lq|1, Lk), combined (and) with the model's own mask;
* ``dma_bias``: float, same broadcast shapes, added to the logits and differentiated.

They are the same for every layer; a model with per-layer dynamic masks computes them inside its
attention module instead (see `dmattn_ops.nn.DynamicMaskAttention`). Attention dropout is not
supported (DMA has none): a model in training mode with attention_dropout > 0 raises.

Keyword arguments transformers hands to the attention function are either used, ignored as
bookkeeping, or refused; nothing that changes the attention's math is dropped silently:

* used: ``dma_mask``, ``dma_bias``, ``softcap`` (Gemma 2 logit soft-capping), ``sliding_window``
  (a key is visible when q - k < sliding_window: ``window_size=(sliding_window - 1, 0)`` when
  the layer's mask was left to the kernels; else the mask builder has applied it), ``s_aux``
  (GPT-OSS attention sinks, passed as ``sinks``);
* ignored (bookkeeping): ``IGNORED`` below (positions, cache and output flags);
* refused with a ValueError naming it: packed-sequence arguments (``cu_seq_lens_q`` and
  friends: use ``dmattn_ops.attention_varlen``), ``head_mask``,
  and any other keyword whose value is not None.

Generation: ``model.generate`` does not forward unknown model kwargs such as ``dma_mask`` to the
model (transformers rejects them). Generate with a model whose attention computes its own dynamic
mask (as `dmattn_ops.nn.DynamicMaskAttention` does, from its keys), or call the model's forward
step by step with ``dma_mask``/``dma_bias`` sized for the cache.

Needs the optional extra: ``pip install "dmattn-ops[hf]"``.
"""

from __future__ import annotations

import torch

NAME = "dmattn"
USED = frozenset({"dma_mask", "dma_bias", "softcap", "sliding_window", "s_aux"})
IGNORED = frozenset({
    "position_ids", "use_cache", "cache_position", "past_key_value", "past_key_values",
    "output_attentions", "output_hidden_states", "return_dict", "position_embeddings",
    "token_type_ids", "labels", "logits_to_keep", "num_items_in_batch", "layer_idx",
    "output_router_logits",
})  # fmt: skip
REFUSED = {
    "cu_seq_lens_q": "packed sequences: call dmattn_ops.attention_varlen",
    "cu_seq_lens_k": "packed sequences: call dmattn_ops.attention_varlen",
    "max_length_q": "packed sequences: call dmattn_ops.attention_varlen",
    "max_length_k": "packed sequences: call dmattn_ops.attention_varlen",
    "head_mask": "head masks are not supported",
}


def _check_kwargs(kwargs: dict) -> None:
    for name, value in kwargs.items():
        if name in USED or name in IGNORED or value is None:
            continue
        reason = REFUSED.get(name, "an argument this integration does not handle")
        raise ValueError(
            f"dmattn (transformers integration): keyword argument {name!r} would change the "
            f"attention's result and is not applied ({reason}); it is refused rather than "
            "silently dropped"
        )


def dmattn_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: query (B, H, Lq, D), key/value (B, Hkv, Lk, D) ->
    ((B, Lq, H, Dv), None), as the SDPA one returns.

    Each call keeps transformers' meaning: a boolean or additive ``attention_mask`` is the
    whole pattern (causality included); no mask with Lq > 1 means SDPA's top-left
    ``is_causal`` (query i sees keys j <= i; Lq < Lk is the prefill of a static cache), and
    with Lq == 1 every key."""
    _check_kwargs(kwargs)
    if dropout > 0:
        raise ValueError(
            "dmattn: attention dropout is not supported; set the config's attention_dropout "
            f"to 0 (got dropout={dropout})"
        )
    mask = kwargs.get("dma_mask")
    bias = kwargs.get("dma_bias")
    if attention_mask is not None:
        if attention_mask.dtype != torch.bool:
            # An additive float mask: its lowest value means "masked", the rest is a bias.
            allowed = attention_mask > torch.finfo(attention_mask.dtype).min
            extra = torch.where(allowed, attention_mask, 0).to(query.dtype)
            bias = extra if bias is None else bias + extra
            attention_mask = allowed
        mask = attention_mask if mask is None else mask & attention_mask
        # transformers' mask already encodes causality (aligned with the cache position).
        causal = False
    else:
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        causal = bool(causal) and query.shape[2] > 1
    seqused_k = None
    lq, lk = query.shape[2], key.shape[2]
    if attention_mask is None and causal and lq != lk:
        # transformers left the mask out because SDPA's is_causal (top-left: query i sees keys
        # j <= i) is right here, e.g. the prefill of an empty static cache whose later slots
        # are unused. Top-left is bottom-right over the first Lq keys.
        if lq < lk:
            seqused_k = torch.full((query.shape[0],), lq, dtype=torch.int32, device=query.device)
        else:
            top_left = torch.ones(lq, lk, dtype=torch.bool, device=query.device).tril()
            mask = top_left[None, None] if mask is None else mask & top_left
            causal = False
    window = (-1, -1)
    sliding = kwargs.get("sliding_window")
    if attention_mask is None and sliding is not None and sliding > 0:
        # dmattn_mask left this sliding layer's mask to us: causal, bottom-right aligned.
        window = (int(sliding) - 1, 0)
    softcap = kwargs.get("softcap") or 0.0
    sinks = kwargs.get("s_aux")
    if sinks is not None:
        sinks = sinks.to(torch.float32 if sinks.dtype != query.dtype else sinks.dtype)
    from dmattn_ops import attention

    out = attention(
        query.transpose(1, 2),
        key.transpose(1, 2),
        value.transpose(1, 2),
        mask,
        bias,
        scale=scaling,
        is_causal=causal,
        softcap=float(softcap),
        seqused_k=seqused_k,
        sinks=sinks,
        window_size=window,
    )
    return out, None


def dmattn_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function=None,
    attention_mask: torch.Tensor | None = None,
    local_size: int | None = None,
    allow_is_causal_skip: bool = True,
    **kwargs,
):
    """transformers mask builder for "dmattn": its SDPA builder's result, except for a sliding
    window causal layer with no padding whose queries end at the last key with Lq == Lk or
    Lq == 1 (no static cache slack): None, and the attention function passes the window to the
    kernels (window_size), so the band is never materialised. Anything else (padding, packed
    sequences, chunked attention or prefill, a static cache) gets the SDPA builder's result."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    mask_function = causal_mask_function if mask_function is None else mask_function
    config = kwargs.get("config")
    sliding = local_size is not None and getattr(config, "sliding_window", None) == local_size
    # Only where bottom-right and top-left agree (Lq == Lk, or one query at the last key): the
    # attention function reads a missing mask with Lq != Lk as SDPA's top-left is_causal.
    aligned = q_offset + q_length == kv_offset + kv_length and q_length in (1, kv_length)
    if sliding and allow_is_causal_skip and aligned and _no_padding(attention_mask):
        return None
    return sdpa_mask(
        batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
        kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
        local_size=local_size, allow_is_causal_skip=allow_is_causal_skip, **kwargs,
    )  # fmt: skip


def _no_padding(attention_mask: torch.Tensor | None) -> bool:
    """No padding mask, or (outside a trace, where it can be read) one that is all ones."""
    if attention_mask is None:
        return True
    if torch.compiler.is_compiling():
        return False
    return bool(attention_mask.all())


def register() -> None:
    """Make ``attn_implementation="dmattn"`` available to every transformers model."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as e:
        raise ImportError('dmattn_ops.hf needs transformers: pip install "dmattn-ops[hf]"') from e
    AttentionInterface.register(NAME, dmattn_attention_forward)
    AttentionMaskInterface.register(NAME, dmattn_mask)
