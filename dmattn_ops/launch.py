"""Host side of the kernels: picks the implementation for a device and launches it.

No autograd here; ops.py calls these from the registered backend kernels.
"""

from __future__ import annotations

import torch

from dmattn_ops import chunked


def attention_forward(query, key, value, mask, bias, scale, is_causal, softcap, seqused_k):
    return chunked.forward(query, key, value, mask, bias, scale, is_causal, softcap, seqused_k)


def attention_backward(
    grad_out,
    grad_lse,
    query,
    key,
    value,
    out,
    lse,
    mask,
    bias,
    scale,
    is_causal,
    softcap,
    seqused_k,
    deterministic,
    compute_dbias,
):
    # The chunked implementation has no atomics: it is deterministic whatever the flag says.
    del deterministic
    return chunked.backward(
        grad_out,
        grad_lse,
        query,
        key,
        value,
        out,
        lse,
        mask,
        bias,
        scale,
        is_causal,
        softcap,
        seqused_k,
        compute_dbias,
    )


def empty_backward_bias(query: torch.Tensor) -> torch.Tensor:
    return torch.empty((0,), dtype=query.dtype, device=query.device)
