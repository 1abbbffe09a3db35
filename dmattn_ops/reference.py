"""Plain PyTorch oracle for Dynamic Mask Attention.

It materialises the full (B, H, Lq, Lk) score matrix and computes every line of SPEC.md
"The function" in the dtype of its inputs, so `attention(*(t.double() for t in inputs))` is the
float64 oracle of the tests, and the same call on half-precision inputs measures PyTorch's own
error in that precision. Autograd differentiates it; it shares no code with the kernels.
"""

from __future__ import annotations

import torch

from dmattn_ops.validate import check_inputs, check_seqused_k_values


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
):
    r"""Dynamic Mask Attention, computed naively (the test oracle).

    Shapes: query (B, Lq, H, D), key (B, Lk, Hkv, D), value (B, Lk, Hkv, Dv); mask (bool) and
    bias each (B|1, H|Hkv|1, Lq|1, Lk); seqused_k int32 (B,). Returns out (B, Lq, H, Dv) in
    query's dtype, and with ``return_lse`` also lse float32 (B, H, Lq).

    For batch b, head h (KV head h // (H / Hkv)), query i and key j, with n = seqused_k[b] or Lk::

        allowed(i, j) = j < n and mask[b, h, i, j] and (not is_causal or j <= i + n - Lq)
        s(i, j) = cap(scale * q_i . k_j) + bias[b, h, i, j] if allowed else -inf
        cap(x)  = softcap * tanh(x / softcap) if softcap > 0 else x
        out_i   = sum_j softmax_j(s(i, .)) v_j      (0 when no key is allowed)
        lse_i   = log sum_j exp(s(i, j))            (-inf when no key is allowed)

    Keys at or beyond n are zeroed before use, so NaN in an unused KV-cache slot never reaches
    the result. ``deterministic`` and ``backend`` are accepted for signature parity and ignored.
    """
    check_inputs(query, key, value, mask, bias, seqused_k, scale, softcap, fn="reference.attention")
    if not torch.compiler.is_compiling():
        check_seqused_k_values(seqused_k, key.shape[1], "reference.attention")
    b, lq, h, d = query.shape
    lk, hkv = key.shape[1], key.shape[2]
    group = h // hkv
    scale = d**-0.5 if scale is None else scale
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
    k = torch.where(key_ok[:, None, :, None], k, 0)
    v = torch.where(key_ok[:, None, :, None], v, 0)

    allowed = key_ok[:, None, None, :]  # [B, 1, 1, Lk]
    if mask is not None:
        allowed = allowed & _per_query_head(mask, h, hkv)
    if is_causal:
        diag = i[None, :, None] + (n - lq)[:, None, None]  # [B, Lq, 1]
        allowed = allowed & (j[None, None, :] <= diag)[:, None]
    allowed = allowed.expand(b, h, lq, lk)

    x = scale * (q @ k.transpose(-1, -2))  # [B, H, Lq, Lk]
    if softcap > 0:
        x = softcap * torch.tanh(x / softcap)
    if bias is not None:
        x = x + _per_query_head(bias, h, hkv).to(x.dtype)
    s = torch.where(allowed, x, float("-inf"))

    m = s.amax(dim=-1, keepdim=True).detach() if lk > 0 else s.new_zeros(b, h, lq, 1)
    m = torch.where(m == float("-inf"), 0, m)
    p = torch.exp(s - m)
    denom = p.sum(dim=-1, keepdim=True)
    nonempty = denom > 0
    out = (p @ v) / torch.where(nonempty, denom, 1)
    lse = torch.where(
        nonempty, torch.log(torch.where(nonempty, denom, 1)) + m, float("-inf")
    ).squeeze(-1)

    out = out.transpose(1, 2).to(query.dtype)
    if return_lse:
        return out, lse.float()
    return out
