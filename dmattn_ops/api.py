"""Public functions: validate inputs, pick a backend, call the op."""

from __future__ import annotations

import torch

from dmattn_ops import flex, launch, ops, reference
from dmattn_ops.validate import check_backend, check_inputs, check_seqused_k_values


def _tracing() -> bool:
    if torch.compiler.is_compiling():
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _check_triton_can_run(query: torch.Tensor) -> None:
    if query.dtype not in launch.TRITON_DTYPES:
        raise TypeError(
            "dmattn.attention: backend='triton' supports float16, bfloat16 and float32; "
            f"got {query.dtype} (backend='auto' runs float64 in PyTorch)"
        )
    if not launch.triton_runs_on(query):
        raise ValueError(
            "dmattn.attention: backend='triton' needs CUDA tensors, or TRITON_INTERPRET=1 "
            f"(Triton's interpreter) for CPU tensors; got tensors on {query.device}"
        )


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    softcap: float = 0.0,
    seqused_k: torch.Tensor | None = None,
    deterministic: bool = False,
    return_lse: bool = False,
    backend: str = "auto",
):
    r"""Dynamic Mask Attention.

    Args:
        query: (B, Lq, H, D).
        key: (B, Lk, Hkv, D), with H % Hkv == 0 (GQA / MQA).
        value: (B, Lk, Hkv, Dv). D and Dv are at most 256, of any size.
        mask: bool, (B|1, H|Hkv|1, Lq|1, Lk): which keys each query may see. A head dim of Hkv
            is shared by the query heads of that KV group. Broadcast dims are read through
            strides, never materialised. No gradient.
        bias: float (query's dtype or float32), same broadcast shapes as mask, added to the
            logits; its gradient has exactly its shape and dtype.
        scale: multiplies q . k; defaults to 1 / sqrt(D).
        is_causal: bottom-right aligned causal masking (the last query sees the last key).
        softcap: if > 0, logits become softcap * tanh(logit / softcap) before the bias.
        seqused_k: int32 (B,): keys j >= seqused_k[b] do not exist for batch b.
        deterministic: bitwise reproducible backward.
        return_lse: also return lse, float32 (B, H, Lq), natural log.
        backend: "auto", "triton", "flex" or "reference".

    Returns:
        out (B, Lq, H, Dv) in query's dtype, or (out, lse) when ``return_lse``.

    With n = seqused_k[b] (or Lk), for batch b, head h, query i and key j::

        allowed(i, j) = j < n and mask[b, h, i, j] and (not is_causal or j <= i + n - Lq)
        s(i, j) = cap(scale * q_i . k_j) + bias[b, h, i, j] if allowed else -inf
        out_i   = sum_j softmax_j(s(i, .)) v_j      (0 when no key is allowed)
        lse_i   = log sum_j exp(s(i, j))            (-inf when no key is allowed)

    Rows with no allowed key give zero output and zero gradients; NaN or Inf in bias or K/V at
    positions that are not allowed never reach the result.
    """
    check_backend(backend)
    if backend in ("reference", "flex"):
        # Both validate their own inputs; checking here too would double the seqused_k sync.
        fn = reference.attention if backend == "reference" else flex.attention
        return fn(
            query, key, value, mask, bias, scale=scale, is_causal=is_causal, softcap=softcap,
            seqused_k=seqused_k, deterministic=deterministic, return_lse=return_lse,
        )  # fmt: skip
    check_inputs(query, key, value, mask, bias, seqused_k, scale, softcap)
    if not _tracing():
        check_seqused_k_values(seqused_k, key.shape[1], "dmattn.attention")
    if backend == "triton":
        _check_triton_can_run(query)
    if return_lse:
        scale = ops.default_scale(query) if scale is None else scale
        out, lse, _ = torch.ops.dmattn.attention_forward(
            query, key, value, mask, bias, scale, is_causal, softcap, seqused_k, deterministic
        )
        return out, lse
    return torch.ops.dmattn.attention(
        query, key, value, mask, bias, scale, is_causal, softcap, seqused_k, deterministic
    )
