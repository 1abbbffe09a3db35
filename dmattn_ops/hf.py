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

Needs the optional extra: ``pip install "dmattn-ops[hf]"``.
"""

from __future__ import annotations

import torch

NAME = "dmattn"


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
