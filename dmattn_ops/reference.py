"""Plain PyTorch oracle for Dynamic Mask Attention.

It materialises the full (B, H, Lq, Lk) score matrix and computes every line of README "Semantics"
"The function" in the dtype of its inputs, so `attention(*(t.double() for t in inputs))` is the
float64 oracle of the tests, and the same call on half-precision inputs measures PyTorch's own
error in that precision. Autograd differentiates it; it shares no code with the kernels.
"""

from __future__ import annotations

import math

import torch

from dmattn_ops.core.problem import Problem
from dmattn_ops.core.validate import (
    check_backend,
    check_cu_seqlens_values,
    check_flags,
    check_inputs,
    check_seqused_k_values,
    check_varlen_inputs,
    check_window,
)


def _per_query_head(t: torch.Tensor, h: int, hkv: int) -> torch.Tensor:
    """(B|1, H|Hkv|1, Lq|1, Lk) -> (B|1, H|1, Lq|1, Lk): a KV-group head dim is repeated."""
    if t.shape[1] == hkv and hkv != h:
        return t.repeat_interleave(h // hkv, dim=1)
    return t


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
    sinks: torch.Tensor | None = None,
    window_size: tuple[int, int] = (-1, -1),
    kernel_options=None,
    _keep_lse_dtype: bool = False,
):
    r"""Dynamic Mask Attention, computed naively (the test oracle). `attention`'s signature;
    kernel_options choose among this library's kernels, so any raises here.

    Shapes: query (B, Lq, H, D), key (B, Lk, Hkv, D), value (B, Lk, Hkv, Dv); mask (bool, or an
    int32 row-limit mask (B|1, H|Hkv|1, 1, Lk): mask[b, h, i, j] reads i < mask[b, h, 0, j]) and
    bias each (B|1, H|Hkv|1, Lq|1, Lk); seqused_k int32 (B,). Returns out (B, Lq, H, Dv) in
    query's dtype, and with ``return_lse`` also lse float32 (B, H, Lq).

    For batch b, head h (KV head h // (H / Hkv)), query i and key j, with n = seqused_k[b] or Lk::

        p = i + n - Lq                                   (the query's aligned position)
        allowed(i, j) = j < n and mask[b, h, i, j] and (not is_causal or j <= p)
                        and (left < 0 or j >= p - left) and (right < 0 or j <= p + right)
        s(i, j) = cap(scale * q_i . k_j) + bias[b, h, i, j] if allowed else -inf
        cap(x)  = softcap * tanh(x / softcap) if softcap > 0 else x
        out_i   = sum_j softmax_j(s(i, .)) v_j      (0 when no key is allowed)
        lse_i   = log sum_j exp(s(i, j))            (-inf when no key is allowed)

    With ``sinks`` (H,), a learned logit per query head joins each row's softmax denominator
    only: lse_i = log(exp(sinks[h]) + sum_j exp(s(i, j))), out_i = sum_j exp(s(i, j) - lse_i) v_j
    (a row with no allowed key: out 0, lse sinks[h]).

    ``window_size`` = (left, right) bounds each query's keys to a band around its aligned
    position (-1: unbounded on that side), as flash-attn's window_size.

    Keys at or beyond n are zeroed before use, so NaN in an unused KV-cache slot never reaches
    the result. ``deterministic`` and ``backend`` keep the signature of `dmattn_ops.attention`
    (this function computes the same thing whatever their values; an unknown backend name
    raises as there).
    """
    fn = "reference.attention"
    check_backend(backend, fn)
    check_flags(fn, is_causal=is_causal, deterministic=deterministic, return_lse=return_lse)
    if kernel_options is not None:
        raise ValueError(
            f"{fn}: kernel_options choose among this library's kernels (backend 'auto' or "
            "'triton'); the reference runs none of them"
        )
    check_inputs(Problem(query, key, value, mask, bias, seqused_k=seqused_k), scale, softcap, fn)
    check_seqused_k_values(seqused_k, key.shape[1], "reference.attention")
    left, right = check_window(window_size, fn)
    b, lq, h, d = query.shape
    lk, hkv = key.shape[1], key.shape[2]
    group = h // hkv if hkv else 1
    scale = (d**-0.5 if d > 0 else 1.0) if scale is None else scale
    device = query.device

    n = (
        seqused_k.long()
        if seqused_k is not None
        else torch.full((b,), lk, dtype=torch.long, device=device)
    )
    i = torch.arange(lq, device=device)
    j = torch.arange(lk, device=device)
    key_ok = j[None, :] < n[:, None]  # [B, Lk]

    q = query.transpose(1, 2)  # [B, H, Lq, D]
    k = key.repeat_interleave(group, dim=2).transpose(1, 2)  # [B, H, Lk, D]
    v = value.repeat_interleave(group, dim=2).transpose(1, 2)  # [B, H, Lk, Dv]
    allowed = key_ok[:, None, None, :]  # [B, 1, 1, Lk]
    if mask is not None:
        if mask.dtype == torch.int32:  # a row-limit mask: key j is seen by rows i < mask[j]
            mask = i.view(lq, 1) < mask
        allowed = allowed & _per_query_head(mask, h, hkv)
    pos = i[None, :, None] + (n - lq)[:, None, None]  # [B, Lq, 1]: aligned query positions
    if is_causal:
        allowed = allowed & (j[None, None, :] <= pos)[:, None]
    if left >= 0:
        allowed = allowed & (j[None, None, :] >= pos - left)[:, None]
    if right >= 0:
        allowed = allowed & (j[None, None, :] <= pos + right)[:, None]
    allowed = allowed.expand(b, h, lq, lk)
    # A key no query of a head may see (past seqused_k, masked for every row) is not in any
    # sum: zeroed, whatever it holds (NaN in an unused cache slot) meets only zero weights.
    seen = allowed.any(dim=2)[..., None]  # [B, H, Lk, 1]
    k = torch.where(seen, k, 0)
    v = torch.where(seen, v, 0)

    x = scale * (q @ k.transpose(-1, -2))  # [B, H, Lq, Lk]
    if softcap > 0:
        x = softcap * torch.tanh(x / softcap)
    if bias is not None:
        x = x + _per_query_head(bias, h, hkv).to(x.dtype)
    s = torch.where(allowed, x, float("-inf"))

    m = s.amax(dim=-1, keepdim=True).detach() if lk > 0 else s.new_full((b, h, lq, 1), -math.inf)
    sink = None
    if sinks is not None:
        sink = sinks.to(x.dtype)[None, :, None, None]  # [1, H, 1, 1]
        m = torch.maximum(m, sink.detach())
    m = torch.where(m == float("-inf"), 0, m)
    p = torch.exp(s - m)
    denom = p.sum(dim=-1, keepdim=True)
    if sink is not None:
        denom = denom + torch.exp(sink - m)  # the sink joins the denominator only
    nonempty = denom > 0
    out = (p @ v) / torch.where(nonempty, denom, 1)
    lse = torch.where(
        nonempty, torch.log(torch.where(nonempty, denom, 1)) + m, float("-inf")
    ).squeeze(-1)

    out = out.transpose(1, 2).to(query.dtype)
    if return_lse:
        return out, lse if _keep_lse_dtype else lse.float()
    return out


def attention_forward(query, key, value, mask=None, bias=None, **kwargs):
    """(out, lse) as `attention` with return_lse, lse kept in the dtype it was computed in
    (float64 for float64 inputs), as the op dmattn::attention_forward returns it: the oracle
    of that op and of its derivatives."""
    return attention(query, key, value, mask, bias, return_lse=True, _keep_lse_dtype=True, **kwargs)


def attention_varlen(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    mask: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    softcap: float = 0.0,
    deterministic: bool = False,
    return_lse: bool = False,
    backend: str = "auto",
    sinks: torch.Tensor | None = None,
    window_size: tuple[int, int] = (-1, -1),
    _keep_lse_dtype: bool = False,
):
    r"""Varlen oracle: `attention` on each sequence of the packed batch on its own.

    query (total_q, H, D), key/value (total_k, Hkv, D|Dv), cu_seqlens_* int32 (B + 1,); mask and
    bias per key token, (H|Hkv|1, total_k). Sequence b is query rows cu_seqlens_q[b]:[b + 1] and
    key rows cu_seqlens_k[b]:[b + 1], its mask/bias the same key columns broadcast over its
    queries. Rows outside every sequence get out 0 and lse -inf (sinks or not).
    Differentiable by autograd.
    """
    fn = "reference.attention_varlen"
    check_backend(backend, fn)
    check_flags(fn, is_causal=is_causal, deterministic=deterministic, return_lse=return_lse)
    problem = Problem(
        query, key, value, mask, bias, None, None, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
        max_seqlen_k,
    )  # fmt: skip
    check_varlen_inputs(problem, scale, softcap, fn)
    total_q, h, d = query.shape
    total_k = key.shape[0]
    check_cu_seqlens_values(
        cu_seqlens_q, cu_seqlens_k, total_q, total_k, max_seqlen_q, max_seqlen_k, fn
    )
    scale = (d**-0.5 if d > 0 else 1.0) if scale is None else scale
    out = query.new_zeros((total_q, h, value.shape[2]))
    lse_dtype = torch.float64 if _keep_lse_dtype and query.dtype == torch.float64 else torch.float32
    lse = query.new_full((h, total_q), float("-inf"), dtype=lse_dtype)
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(cu_q) - 1):
        q0, q1, k0, k1 = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        o, s_lse = attention(
            query[None, q0:q1], key[None, k0:k1], value[None, k0:k1],
            None if mask is None else mask[None, :, None, k0:k1],
            None if bias is None else bias[None, :, None, k0:k1],
            scale=scale, is_causal=is_causal, softcap=softcap, return_lse=True, sinks=sinks,
            window_size=window_size, _keep_lse_dtype=_keep_lse_dtype,
        )  # fmt: skip
        out[q0:q1] = o[0]
        lse[:, q0:q1] = s_lse[0]
    return (out, lse) if return_lse else out


def attention_varlen_forward(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                             max_seqlen_k, mask=None, bias=None, **kwargs):  # fmt: skip
    """(out, lse) of `attention_varlen`, lse in float64 for float64 inputs: the oracle of the
    op dmattn::attention_varlen_forward."""
    return attention_varlen(
        query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, mask, bias,
        return_lse=True, _keep_lse_dtype=True, **kwargs,
    )  # fmt: skip


def dt_bias(x, weight, bias, A):
    """The DMA layer's learned bias (dmattn_ops.dt_bias): ``A * softplus(x @ weight.T + bias)``
    laid out (B, Hkv, 1, L), computed in the wider of x's and weight's dtypes and returned in
    x's."""
    dtype_x, dtype = x.dtype, torch.promote_types(x.dtype, weight.dtype)
    x, weight, bias, A = (t.to(dtype) for t in (x, weight, bias, A))
    logits = torch.nn.functional.linear(x, weight, bias)
    out = A * torch.nn.functional.softplus(logits)
    return out.transpose(1, 2).unsqueeze(2).to(dtype_x)
