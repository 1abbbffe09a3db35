"""Hugging Face transformers integration: ``attn_implementation="dmattn"``.

    import dmattn_ops.hf
    dmattn_ops.hf.register()
    model = AutoModelForCausalLM.from_config(config, attn_implementation="dmattn")
    out = model(input_ids, dma_mask=mask, dma_bias=bias)

`register()` adds "dmattn" to transformers' AttentionInterface (the attention function below)
and AttentionMaskInterface (transformers' own SDPA mask builder, which yields a boolean
(B, 1, Lq, Lk) mask, or None when the pattern is plain causal). Every attention layer of the model
then runs `torch.ops.dmattn.attention`. Dynamic masks and learned biases travel as keyword
arguments of the model's forward, which transformers hands to every attention call:

* ``dma_mask``: bool, (B|1, H|Hkv|1, Lq|1, Lk), combined (and) with the model's own mask;
* ``dma_bias``: float, same broadcast shapes, added to the logits and differentiated.

They are the same for every layer; a model with per-layer dynamic masks computes them inside its
attention module instead (see `dmattn_ops.nn.DynamicMaskAttention`). Attention dropout is not
supported (DMA has none): a model in training mode with attention_dropout > 0 raises.

Keyword arguments transformers hands to the attention function are either used, ignored as
bookkeeping, or refused; nothing that changes the attention's math is dropped silently:

* used: ``dma_mask``, ``dma_bias``, ``softcap`` (Gemma 2 logit soft-capping), ``sliding_window``
  (transformers' mask builder has already applied the window to ``attention_mask``), ``s_aux``
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
    ((B, Lq, H, Dv), None), as the SDPA one returns."""
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
        sinks=sinks,
    )
    return out, None


def register() -> None:
    """Make ``attn_implementation="dmattn"`` available to every transformers model."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError as e:
        raise ImportError('dmattn_ops.hf needs transformers: pip install "dmattn-ops[hf]"') from e
    AttentionInterface.register(NAME, dmattn_attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)
