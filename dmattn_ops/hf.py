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

import types

import torch

NAME = "dmattn"
NATIVE = "_dmattn_doge_native"  # config flag set by enable(): dmattn_mask returns key states
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
        # seqused_k is None or Lq < Lk: in range, no host read checks it.
        _seqused_k_in_range=True,
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

    config = kwargs.get("config")
    if getattr(config, NATIVE, False):
        if mask_function not in (None, causal_mask_function):
            raise ValueError(
                "dmattn_ops.hf.enable: a natively run Doge model takes causal masks with "
                "padding only (no packed sequences or custom mask functions)"
            )
        return _key_states(
            batch_size, q_length, kv_length, q_offset, kv_offset, attention_mask,
            kwargs.get("device", "cpu"),
        )  # fmt: skip
    mask_function = causal_mask_function if mask_function is None else mask_function
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


# What a natively run Doge layer (`enable`) gets from `dmattn_mask` instead of a (B, 1, Lq, Lk)
# mask: an int32 (B, 1, 1, Lk) per-key state, a 4-D tensor so that transformers passes it on
# as a prepared mask (generate builds it once for a static cache): 1 for a key that exists and
# is not padding, 0 for padding, -1 for a cache slot past the last query (not in use yet).
KEY_VALID, KEY_PADDING, KEY_UNUSED = 1, 0, -1


def _key_states(batch_size, q_length, kv_length, q_offset, kv_offset, attention_mask, device):
    """The per-key states of a causal call (above), or None when nothing but causality masks
    (no padding, and the queries end at the last key)."""
    plain = isinstance(q_offset, int) and q_offset + q_length == kv_offset + kv_length
    if plain and _no_padding(attention_mask):
        return None
    j = torch.arange(kv_length, device=device) + kv_offset
    end = torch.as_tensor(q_offset + q_length, device=device).reshape(-1, 1)  # per batch or one
    states = torch.where(j < end, KEY_VALID, KEY_UNUSED).to(torch.int32)
    states = states.expand(batch_size, kv_length)
    if attention_mask is not None:
        pad = attention_mask.to(device=device, dtype=torch.bool)
        pad = pad[:, kv_offset : kv_offset + kv_length]
        if pad.shape[1] < kv_length:  # slots past the padding mask are not in use yet
            pad = torch.nn.functional.pad(pad, (0, kv_length - pad.shape[1]), value=True)
        states = torch.where(pad | (states == KEY_UNUSED), states, KEY_PADDING)
    return states[:, None, None, :].contiguous()


def _read_key_states(states: torch.Tensor):
    """(valid keys (B, 1, 1, Lk) bool, seqused_k int32 (B,)) of _key_states' tensor."""
    valid = states == KEY_VALID
    seqused = (states != KEY_UNUSED).sum(dim=-1, dtype=torch.int32).reshape(-1)
    return valid, seqused


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


def enable(model: torch.nn.Module) -> torch.nn.Module:
    """Run every Doge attention layer of `model` (transformers' ``DogeForCausalLM`` and
    ``DogeModel``) natively: the per-key bias ``dt_states`` (B, Hkv, 1, Lk) and each query's
    top-``keep_window_size`` keys as a row-limit mask (`masks.causal_topk_mask`), causality and
    padding through ``is_causal`` / ``seqused_k`` / a per-key mask, never Doge's (B, H, Lq, Lk)
    tensor (``prepare_dynamic_mask`` is not called). Registers "dmattn" (`register`) and sets
    the model's attention implementation to it. Returns the model.

    The result is Doge's own: logits, gradients (``A`` and ``dt_proj`` included) and generation
    with dynamic and static caches and left padding, except where ``torch.topk`` (which Doge
    calls) breaks ties at a row's keep_window_size-th ``dt_states`` value its own way: ours
    keep the lowest key indices (at initialisation, ``A = 0`` makes every ``dt_states`` 1.0,
    all tied). Not native (ValueError): a config with ``sliding_window``, attention dropout in
    training (dmattn has none)."""
    register()
    try:
        from transformers.models.doge.modeling_doge import DogeAttention
    except ImportError as e:  # pragma: no cover - transformers without Doge
        raise ImportError("dmattn_ops.hf.enable needs a transformers with Doge models") from e
    layers = [m for m in model.modules() if isinstance(m, DogeAttention)]
    if not layers:
        raise ValueError("dmattn_ops.hf.enable: the model has no DogeAttention layer")
    config = model.config
    if getattr(config, "sliding_window", None) is not None:
        raise ValueError(
            "dmattn_ops.hf.enable: Doge with sliding_window selects within the window, which the "
            "native path does not compute; use attn_implementation='dmattn' without enable()"
        )
    model.set_attn_implementation(NAME)
    for m in (model, *model.modules()):
        c = getattr(m, "config", None)
        if c is not None:
            setattr(c, NATIVE, True)
    for layer in layers:
        layer.forward = types.MethodType(_doge_forward, layer)
    return model


def _doge_forward(self, hidden_states, position_embeddings, attention_mask=None, cache=None,
                  **kwargs):  # fmt: skip
    """DogeAttention.forward computed natively (enable): the same projections, norms, rotary
    embedding, cache update and dt_states, then one attention call with the per-key bias and the
    row-limit mask of each query's top keep_window_size keys."""
    from transformers.models.doge.modeling_doge import apply_rotary_pos_emb

    from dmattn_ops import attention
    from dmattn_ops.masks import causal_topk_mask

    cache = kwargs.pop("past_key_values", cache)
    if self.training and self.attention_dropout > 0:
        raise ValueError(
            "dmattn: attention dropout is not supported; set the config's attention_dropout to 0"
        )
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    query = self.q_norm(self.q_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
    key = self.k_norm(self.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
    value = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    cos, sin = position_embeddings
    query, key = apply_rotary_pos_emb(query, key, cos, sin)
    if cache is not None:
        key, value = cache.update(key, value, self.layer_idx, kwargs=kwargs)
    b, _, lk, _ = value.shape
    # (B, Hkv, Lk), made contiguous before the elementwise ops: with a transposed input their
    # backward kernels lay out gradients differently in eager and in the fake kernels a
    # compiled graph traces with (a `view` of softplus_backward's output then fails at run
    # time under torch.compile).
    dt = self.dt_proj(value.transpose(1, 2).reshape(b, lk, -1)).transpose(-1, -2).contiguous()
    dt = torch.exp(self.A[:, None] * torch.nn.functional.softplus(dt))
    bias = dt[:, :, None, :].to(query.dtype)
    valid = seqused_k = None
    if attention_mask is not None:
        if attention_mask.dtype != torch.int32 or attention_mask.shape[2] != 1:
            raise ValueError(
                "dmattn_ops.hf.enable: a natively run Doge layer takes the per-key states "
                f"dmattn_mask builds; got a {attention_mask.dtype} mask of shape "
                f"{tuple(attention_mask.shape)}"
            )
        valid, seqused_k = _read_key_states(attention_mask)
    lq = query.shape[2]
    limits = causal_topk_mask(
        bias, self.keep_window_size, valid, num_queries=lq, seqused_k=seqused_k
    )
    # seqused_k counts the cache's used slots: in [0, Lk], so no host read checks it.
    out = attention(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), limits, bias,
        scale=self.scaling, is_causal=True, seqused_k=seqused_k, _seqused_k_in_range=True,
    )  # fmt: skip
    out = self.o_proj(out.reshape(*input_shape, -1).contiguous())
    return out, None
