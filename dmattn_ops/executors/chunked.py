"""Memory-efficient PyTorch implementation of the forward and backward passes.

Queries and keys are processed in tiles with an online softmax, FlashAttention-2 style, so the
largest temporary is (B, H, block_q, block_k) and B*H*Lq*Lk is never allocated. It is the CPU
kernel of the registered ops and the fallback wherever Triton cannot run.

Heads are laid out as (Hkv, G) with G = H // Hkv, so a mask or bias whose head dim is H, Hkv or 1
is a plain broadcasting view of shape (B|1, Hkv|1, G|1, Lq|1, Lk) and GQA needs no copies of K/V.
Arithmetic is float32 (float64 for float64 inputs).
"""

from __future__ import annotations

import torch

from dmattn_ops.core.operands import keys_seen, mask_rows
from dmattn_ops.core.problem import Options, Problem
from dmattn_ops.executors._alloc import empty

_MAX_TILE_ELEMENTS = 1 << 22


def heads_5d(t: torch.Tensor | None, h: int, hkv: int) -> torch.Tensor | None:
    """(B|1, H|Hkv|1, Lq|1, Lk) -> (B|1, Hkv|1, G|1, Lq|1, Lk), a view."""
    if t is None:
        return None
    bt, ht, lqt, lk = t.shape
    if ht == h:
        return t.unflatten(1, (hkv, h // hkv))
    if ht == hkv:
        return t.unsqueeze(2)
    return t.view(bt, 1, 1, lqt, lk)


def zero_unseen_keys(key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None):
    """key and value (B, Lk, Hkv, D|Dv) with the rows of keys that no query may see (the mask
    is False for every query of every head of the key's KV group) set to 0.

    Such a key's probability is 0 in every row, but a computation that still multiplies it (a
    whole tile, P @ V, dS @ K) turns NaN or Inf stored there (unused KV-cache slots marked by
    the mask) into NaN: 0 * NaN is NaN. Zeroed, they contribute exactly nothing, as the math
    says. Paths that never load such keys (key lists) need not call this. A copy of K and V,
    so only the paths that would multiply them pay it."""
    if mask is None:
        return key, value
    seen = mask.any(dim=2) if mask.shape[2] > 1 else keys_seen(mask)  # [B|1, Hm, Lk]
    return zero_keys(key, value, seen)


def zero_keys(key: torch.Tensor, value: torch.Tensor, seen: torch.Tensor):
    """key and value with the rows of keys that `seen` (B|1, Hm, Lk, nonzero where some query
    of that head may see the key; Hm = H, Hkv or 1) marks unseen for every head of their KV
    group set to 0 (zero_unseen_keys; the Triton tile tables fill `seen` while they read the
    mask, tiles.block_any)."""
    lk, hkv = key.shape[1], key.shape[2]
    seen = seen != 0
    hm = seen.shape[1]
    if hm not in (1, hkv):  # a head dim of H: a key is seen if any head of its group sees it
        seen = seen.view(seen.shape[0], hkv, hm // hkv, lk).any(dim=2)
    seen = seen.transpose(1, 2)[..., None]  # [B|1, Lk, Hkv|1, 1]
    zero = torch.zeros((), dtype=key.dtype, device=key.device)
    return torch.where(seen, key, zero), torch.where(seen, value, zero)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def stats_dtype(dtype: torch.dtype) -> torch.dtype:
    """dtype of lse and lse_rem: float32, float64 for float64 inputs (a float64 row max such
    as a bias of finfo(float64).min is outside float32's range)."""
    return compute_dtype(dtype)


def lse_split(m: torch.Tensor, log_l: torch.Tensor, nonempty: torch.Tensor):
    """(lse, lse_rem) as kernels/common.py lse_split: lse = m + log_l rounded, lse_rem what the
    rounding dropped (TwoSum), so (s - lse) - lse_rem recovers s - m - log_l exactly."""
    lse = m + log_l
    b_virtual = lse - m
    lse_rem = (m - (lse - b_virtual)) + (log_l - b_virtual)
    return torch.where(nonempty, lse, float("-inf")), torch.where(nonempty, lse_rem, 0)


def _blocks(b: int, h: int, lq: int, lk: int, block_q, block_k) -> tuple[int, int]:
    block_k = block_k or max(16, min(256, lk))
    block_q = block_q or max(16, min(256, lq))
    while block_q > 16 and b * h * block_q * block_k > _MAX_TILE_ELEMENTS:
        block_q //= 2
    return block_q, block_k


class _Tiles:
    """Everything a tile of a dense (or seqused_k) problem needs, fixed once per call. The
    problem's sinks are not read: the callers join them (join_sinks, sinks_grad)."""

    def __init__(self, problem: Problem, opts: Options):
        query, key, value = problem.query, problem.key, problem.value
        mask, bias, seqused_k = problem.mask, problem.bias, problem.seqused_k
        self.b, self.lq, self.h, self.d = query.shape
        self.lk, self.hkv, self.dv = key.shape[1], key.shape[2], value.shape[3]
        self.g = self.h // self.hkv
        self.ct = compute_dtype(query.dtype)
        self.scale, self.is_causal, self.softcap = opts.scale, opts.is_causal, opts.softcap
        self.left, self.right = opts.window
        device = query.device
        # [B, Hkv, G, Lq, D] and [B, Hkv, 1, Lk, D]: views, no copies.
        self.q = query.permute(0, 2, 1, 3).unflatten(1, (self.hkv, self.g))
        self.k = key.permute(0, 2, 1, 3).unsqueeze(2)
        self.v = value.permute(0, 2, 1, 3).unsqueeze(2)
        self.mask = heads_5d(mask, self.h, self.hkv)
        self.bias = heads_5d(bias, self.h, self.hkv)
        self.n = (
            seqused_k.to(torch.long).clamp(0, self.lk)
            if seqused_k is not None
            else torch.full((self.b,), self.lk, dtype=torch.long, device=device)
        )
        self.device = device

    def tile(self, q0: int, q1: int, k0: int, k1: int):
        """Scores of one tile: (s, allowed, tanh term, q, k, v), all [B, Hkv, G, bq, bk]-shaped.

        K/V rows at or beyond seqused_k are zeroed before any product, so NaN in an unused
        KV-cache slot cannot leak through 0 * NaN; disallowed scores are exactly -inf.
        """
        ct = self.ct
        i = torch.arange(q0, q1, device=self.device)
        j = torch.arange(k0, k1, device=self.device)
        key_ok = j[None, :] < self.n[:, None]  # [B, bk]
        key_ok5 = key_ok[:, None, None, :, None]
        q = self.q[:, :, :, q0:q1].to(ct)  # [B, Hkv, G, bq, D]
        k = torch.where(key_ok5, self.k[:, :, :, k0:k1], 0).to(ct)  # [B, Hkv, 1, bk, D]
        v = torch.where(key_ok5, self.v[:, :, :, k0:k1], 0).to(ct)  # [B, Hkv, 1, bk, Dv]
        x = self.scale * (q @ k.transpose(-1, -2))  # [B, Hkv, G, bq, bk]
        t = None
        if self.softcap > 0:
            t = torch.tanh(x / self.softcap)
            x = self.softcap * t
        allowed = key_ok[:, None, None, None, :]  # [B, 1, 1, 1, bk]
        if self.mask is not None:
            allowed = allowed & mask_rows(self.mask[..., k0:k1], q0, q1)
        pos = i[None, :, None] + (self.n - self.lq)[:, None, None]  # [B, bq, 1]
        jj = j[None, None, :]
        if self.is_causal:
            allowed = allowed & (jj <= pos)[:, None, None]
        if self.left >= 0:
            allowed = allowed & (jj >= pos - self.left)[:, None, None]
        if self.right >= 0:
            allowed = allowed & (jj <= pos + self.right)[:, None, None]
        if self.bias is not None:
            x = x + _rows(self.bias, q0, q1)[..., k0:k1].to(ct)
        s = torch.where(allowed, x, float("-inf"))
        return s, allowed, t, q, k, v


def _rows(t: torch.Tensor, q0: int, q1: int) -> torch.Tensor:
    return t if t.shape[3] == 1 else t[:, :, :, q0:q1]


def forward(problem: Problem, opts: Options, *, block_q=None, block_k=None):
    """Returns out (B, Lq, H, Dv) in query's dtype, and lse and lse_rem (B, H, Lq), float32
    (float64 for float64 inputs), of a dense or seqused_k problem (its sinks not joined).

    lse_rem = (max + log_sum) - lse, what rounding lse dropped (0 for empty rows); backward
    recomputes P as exp((s - lse) - lse_rem), exact however large the row max is.
    """
    pb = _Tiles(problem, opts)
    query = problem.query
    b, lq, h, lk, hkv, g, dv, ct = pb.b, pb.lq, pb.h, pb.lk, pb.hkv, pb.g, pb.dv, pb.ct
    out = empty((b, lq, h, dv), dtype=query.dtype, device=query.device)
    lse = empty((b, h, lq), dtype=stats_dtype(query.dtype), device=query.device)
    lse_rem = empty((b, h, lq), dtype=stats_dtype(query.dtype), device=query.device)
    out5 = out.permute(0, 2, 1, 3).unflatten(1, (hkv, g))  # [B, Hkv, G, Lq, Dv] view
    lse5 = lse.unflatten(1, (hkv, g))  # [B, Hkv, G, Lq] view
    lse_rem5 = lse_rem.unflatten(1, (hkv, g))
    block_q, block_k = _blocks(b, h, lq, lk, block_q, block_k)
    neg_inf = float("-inf")
    for q0 in range(0, lq, block_q):
        q1 = min(q0 + block_q, lq)
        shape = (b, hkv, g, q1 - q0)
        m = torch.full(shape, neg_inf, dtype=ct, device=query.device)
        denom = torch.zeros(shape, dtype=ct, device=query.device)
        acc = torch.zeros((*shape, dv), dtype=ct, device=query.device)
        for k0 in range(0, lk, block_k):
            s, _, _, _, _, v = pb.tile(q0, q1, k0, min(k0 + block_k, lk))
            m_new = torch.maximum(m, s.amax(dim=-1))
            m_safe = torch.where(m_new == neg_inf, 0, m_new)
            alpha = torch.exp(m - m_safe)
            p = torch.exp(s - m_safe[..., None])
            denom = denom * alpha + p.sum(dim=-1)
            acc = acc * alpha[..., None] + p @ v
            m = m_new
        nonempty = denom > 0
        out5[:, :, :, q0:q1] = (acc / torch.where(nonempty, denom, 1)[..., None]).to(out.dtype)
        log_l = torch.log(torch.where(nonempty, denom, 1))
        m_safe = torch.where(nonempty, m, 0)
        lse5[:, :, :, q0:q1], lse_rem5[:, :, :, q0:q1] = lse_split(m_safe, log_l, nonempty)
    return out, lse, lse_rem


def row_delta(out, grad_out, grad_lse) -> torch.Tensor:
    """rowsum(dO * O) - grad_lse, (..., H, Lq) from (..., Lq, H, Dv) tensors, in the compute
    dtype of out's (float32, float64 for float64)."""
    ct = compute_dtype(out.dtype)
    d = (grad_out.to(ct) * out.to(ct)).sum(dim=-1).transpose(-1, -2)
    return d if grad_lse is None else d - grad_lse.to(ct)


def join_sinks(out, lse, lse_rem, sinks):
    """(out, lse, lse_rem) of attention without sinks -> with sinks (H,) in each row's
    denominator: lse' = log(exp(lse + lse_rem) + exp(sinks[h])) split as lse_split does, and
    out' = out * exp(lse - lse'). No autograd (the ops' impls call it: CPU, decode and empty
    calls; the forward kernel starts from the sink instead). A sink of -inf is no sink."""
    if sinks is None:
        return out, lse, lse_rem
    s = sinks.to(lse.dtype)[:, None]  # [H, 1] against (..., H, Lq)
    m = torch.maximum(lse, s)
    log_l = torch.log(torch.exp((lse - m) + lse_rem) + torch.exp(s - m))
    new_lse, new_rem = lse_split(m, log_l, torch.ones_like(lse, dtype=torch.bool))
    # exp(-inf) = 0 for a row with no key; the exponent is <= 0 in exact arithmetic.
    weight = torch.exp(((lse - new_lse) + (lse_rem - new_rem)).clamp(max=0))
    none = s == float("-inf")
    weight = torch.where(none, 1.0, weight)
    out = (out.to(weight.dtype) * weight.transpose(-1, -2)[..., None]).to(out.dtype)
    return out, torch.where(none, lse, new_lse), torch.where(none, lse_rem, new_rem)


def sink_share(sinks, lse, lse_rem) -> torch.Tensor:
    """exp(sinks[h] - lse) (..., H, Lq): the share of each row's softmax its sink takes, from
    the lse that includes the sinks; 0 for a sink of -inf."""
    s = sinks.to(lse.dtype)[:, None]
    share = torch.exp(((s - lse) - lse_rem).clamp(max=0))
    return torch.where(s == float("-inf"), 0.0, share)


def sinks_grad(sinks, lse, lse_rem, delta) -> torch.Tensor:
    """dsinks[h] = -sum over rows of exp(sinks[h] - lse) * delta, in sinks' dtype, from
    (..., B, H, Lq) statistics (a vmapped call's leading sample dim is kept)."""
    share = sink_share(sinks, lse, lse_rem)
    return -(share * delta.to(lse.dtype)).sum(-1).sum(-2).to(sinks.dtype)


def _sum_to(x: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    dims = tuple(d for d, (a, b) in enumerate(zip(x.shape, shape)) if b == 1 and a != 1)
    return x.sum(dim=dims, keepdim=True) if dims else x


def backward(
    problem: Problem, opts: Options, saved, grad_out, grad_lse, compute_dbias: bool, *,
    block_q=None, block_k=None,
):  # fmt: skip
    """Returns dq, dk, dv in their inputs' shapes and dtypes, and dbias in bias's shape and dtype
    (an empty tensor when compute_dbias is False), of a dense or seqused_k problem whose
    forward left `saved` = (out, lse, lse_rem). P is recomputed as exp(min((s - lse) -
    lse_rem, 0)): the exponent is at most 0 in exact arithmetic."""
    out, lse, lse_rem = saved
    query, key, value, bias = problem.query, problem.key, problem.value, problem.bias
    pb = _Tiles(problem, opts)
    scale = opts.scale
    b, lq, h, lk, hkv, g, d, dv, ct = pb.b, pb.lq, pb.h, pb.lk, pb.hkv, pb.g, pb.d, pb.dv, pb.ct
    dev = query.device
    do = grad_out.permute(0, 2, 1, 3).unflatten(1, (hkv, g))  # [B, Hkv, G, Lq, Dv]
    delta = row_delta(out, grad_out, grad_lse).unflatten(1, (hkv, g))  # [B, Hkv, G, Lq]
    lse5 = lse.unflatten(1, (hkv, g)).to(ct)
    lse_rem5 = lse_rem.unflatten(1, (hkv, g)).to(ct)
    lse5 = torch.where(lse5 == float("-inf"), 0, lse5)

    dq = torch.zeros((b, hkv, g, lq, d), dtype=ct, device=dev)
    dk = torch.zeros((b, hkv, 1, lk, d), dtype=ct, device=dev)
    dvv = torch.zeros((b, hkv, 1, lk, dv), dtype=ct, device=dev)
    dbias = None
    if compute_dbias:
        dbias = torch.zeros(pb.bias.shape, dtype=ct, device=dev)
    block_q, block_k = _blocks(b, h, lq, lk, block_q, block_k)
    for q0 in range(0, lq, block_q):
        q1 = min(q0 + block_q, lq)
        doc = do[:, :, :, q0:q1].to(ct)  # [B, Hkv, G, bq, Dv]
        for k0 in range(0, lk, block_k):
            k1 = min(k0 + block_k, lk)
            s, allowed, t, q, k, v = pb.tile(q0, q1, k0, k1)
            rows = slice(q0, q1)
            x = (s - lse5[:, :, :, rows, None]) - lse_rem5[:, :, :, rows, None]
            p = torch.exp(x.clamp(max=0))
            dp = doc @ v.transpose(-1, -2)
            ds = torch.where(allowed, p * (dp - delta[:, :, :, q0:q1, None]), 0)
            if dbias is not None:
                target = dbias[..., k0:k1] if dbias.shape[3] == 1 else dbias[:, :, :, q0:q1, k0:k1]
                target += _sum_to(ds, target.shape)
            dvv[:, :, :, k0:k1] += (p.transpose(-1, -2) @ doc).sum(dim=2, keepdim=True)
            if t is not None:
                ds = ds * (1 - t * t)
            dq[:, :, :, q0:q1] += scale * (ds @ k)
            dk[:, :, :, k0:k1] += scale * (ds.transpose(-1, -2) @ q).sum(dim=2, keepdim=True)
    grad_query = dq.flatten(1, 2).transpose(1, 2).to(query.dtype).contiguous()
    grad_key = dk.squeeze(2).transpose(1, 2).to(key.dtype).contiguous()
    grad_value = dvv.squeeze(2).transpose(1, 2).to(value.dtype).contiguous()
    if dbias is None:
        grad_bias = torch.empty((0,), dtype=query.dtype, device=dev)
    else:
        grad_bias = dbias.reshape(bias.shape).to(bias.dtype).contiguous()
    return grad_query, grad_key, grad_value, grad_bias


# Variable-length batches: one sequence at a time (this is the CPU path, where the host loop
# costs nothing next to the arithmetic).


def varlen_bounds(cu: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(start, end) int64 (B,) of each sequence, clamped into [0, total] exactly as the kernels
    clamp them (kernels/common.py seq_extent)."""
    cu = cu.to(torch.int64)
    end = cu[1:].clamp(0, total)
    start = torch.minimum(cu[:-1].clamp(min=0), end)
    return start, end


def varlen_spans(cu_q, cu_k, total_q, total_k) -> list[tuple[int, int, int, int]]:
    """(q_start, q_end, k_start, k_end) of every sequence, clamped as the kernels clamp them."""
    bounds = (*varlen_bounds(cu_q, total_q), *varlen_bounds(cu_k, total_k))
    return list(zip(*torch.stack(bounds).tolist()))


def _seq_operand(t, k0, k1):
    """Sequence slice of a per-key-token (H|Hkv|1, total_k) operand, as (1, H|Hkv|1, 1, n)."""
    return None if t is None else t[None, :, None, k0:k1]


def _spans(problem: Problem):
    """(q0, q1, k0, k1, the sequence as a dense problem of batch 1) of each sequence of a packed
    problem."""
    query, key, value = problem.query, problem.key, problem.value
    spans = varlen_spans(problem.cu_seqlens_q, problem.cu_seqlens_k, query.shape[0], key.shape[0])
    for q0, q1, k0, k1 in spans:
        sequence = Problem(
            query[None, q0:q1], key[None, k0:k1], value[None, k0:k1],
            _seq_operand(problem.mask, k0, k1), _seq_operand(problem.bias, k0, k1),
        )  # fmt: skip
        yield q0, q1, k0, k1, sequence


def varlen_forward(problem: Problem, opts: Options):
    """A packed problem's (total, H, D) inputs -> out (total_q, H, Dv), lse and lse_rem (H,
    total_q); rows outside every sequence are 0, -inf and 0."""
    query, value = problem.query, problem.value
    total_q, h, _ = query.shape
    out = torch.zeros((total_q, h, value.shape[-1]), dtype=query.dtype, device=query.device)
    stats = dict(dtype=stats_dtype(query.dtype), device=query.device)
    lse = torch.full((h, total_q), float("-inf"), **stats)
    lse_rem = torch.zeros((h, total_q), **stats)
    for q0, q1, _, _, sequence in _spans(problem):
        if q1 == q0:
            continue
        o, s_lse, s_lse_rem = forward(sequence, opts)
        out[q0:q1] = o[0]
        lse[:, q0:q1] = s_lse[0]
        lse_rem[:, q0:q1] = s_lse_rem[0]
    return out, lse, lse_rem


def varlen_backward(
    problem: Problem, opts: Options, saved, grad_out, grad_lse, compute_dbias: bool
):
    """dq, dk, dv (0 outside every sequence) and dbias in bias's (H|Hkv|1, total_k) shape of a
    packed problem whose forward left `saved` = (out, lse, lse_rem)."""
    query, key, value, bias = problem.query, problem.key, problem.value, problem.bias
    out, lse, lse_rem = saved
    dq, dk, dv = torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(value)
    dbias = torch.zeros_like(bias) if compute_dbias else None
    for q0, q1, k0, k1, sequence in _spans(problem):
        if q1 == q0 or k1 == k0:
            continue
        rows = (out[None, q0:q1], lse[None, :, q0:q1], lse_rem[None, :, q0:q1])
        grads = backward(
            sequence, opts, rows, grad_out[None, q0:q1],
            None if grad_lse is None else grad_lse[None, :, q0:q1], compute_dbias,
        )  # fmt: skip
        dq[q0:q1], dk[k0:k1], dv[k0:k1] = grads[0][0], grads[1][0], grads[2][0]
        if dbias is not None:
            dbias[:, k0:k1] = grads[3][0, :, 0]
    if dbias is None:
        dbias = torch.empty((0,), dtype=query.dtype, device=query.device)
    return dq, dk, dv, dbias


# Forward-mode derivative (jvp). Written without in-place writes, so that vmap (jacfwd) and an
# enclosing grad or jvp transform (reverse-over-forward, forward-over-forward) see plain torch
# ops they differentiate and batch themselves.


def jvp(problem: Problem, opts: Options, tangents, lse, lse_rem, *, block_q=None, block_k=None):
    """Tangents (out', lse') of (out, lse) of a dense or seqused_k problem for tangents (q', k',
    v', bias') of its inputs, any of which may be None. With P the attention weights and S' =
    d(scores), in exact arithmetic

        lse' = rowsum(P * S'),  out' = P V' + (P * S') V - lse' * out,

    S' = scale * (q' k^T + q k'^T) [* (1 - tanh^2) under softcap] + bias', only at allowed
    entries. P is recomputed from lse and lse_rem as in backward; out from the same P. Tiles of
    (B, H, block_q, block_k) as in forward; K/V tangents past seqused_k are never read."""
    tq, tk, tv, tbias = tangents
    query, scale = problem.query, opts.scale
    pb = _Tiles(problem, opts)
    b, lq, h, lk, hkv, g, ct = pb.b, pb.lq, pb.h, pb.lk, pb.hkv, pb.g, pb.ct
    tq5 = None if tq is None else tq.permute(0, 2, 1, 3).unflatten(1, (hkv, g))
    tk5 = None if tk is None else tk.permute(0, 2, 1, 3).unsqueeze(2)
    tv5 = None if tv is None else tv.permute(0, 2, 1, 3).unsqueeze(2)
    tbias5 = heads_5d(tbias, h, hkv)
    lse5 = lse.unflatten(1, (hkv, g)).to(ct)
    lse5 = torch.where(lse5 == float("-inf"), 0, lse5)
    lse_rem5 = lse_rem.unflatten(1, (hkv, g)).to(ct)
    block_q, block_k = _blocks(b, h, lq, lk, block_q, block_k)
    out_t, lse_t = [], []
    for q0 in range(0, lq, block_q):
        q1 = min(q0 + block_q, lq)
        o = ot = r = 0
        for k0 in range(0, lk, block_k):
            k1 = min(k0 + block_k, lk)
            s, allowed, t, q, k, v = pb.tile(q0, q1, k0, k1)
            key_ok = (torch.arange(k0, k1, device=pb.device)[None, :] < pb.n[:, None])[
                :, None, None, :, None
            ]
            x = (s - lse5[:, :, :, q0:q1, None]) - lse_rem5[:, :, :, q0:q1, None]
            p = torch.exp(x.clamp(max=0))
            ds = torch.zeros_like(s)
            if tq5 is not None:
                ds = ds + tq5[:, :, :, q0:q1].to(ct) @ k.transpose(-1, -2)
            if tk5 is not None:
                tk_tile = torch.where(key_ok, tk5[:, :, :, k0:k1], 0).to(ct)
                ds = ds + q @ tk_tile.transpose(-1, -2)
            ds = scale * ds
            if t is not None:
                ds = ds * (1 - t * t)
            if tbias5 is not None:
                ds = ds + _rows(tbias5, q0, q1)[..., k0:k1].to(ct)
            pds = torch.where(allowed, p * ds, 0)
            r = r + pds.sum(dim=-1)
            o = o + p @ v
            ot = ot + pds @ v
            if tv5 is not None:
                ot = ot + p @ torch.where(key_ok, tv5[:, :, :, k0:k1], 0).to(ct)
        out_t.append(ot - r[..., None] * o)
        lse_t.append(r)
    out_t = torch.cat(out_t, dim=3).flatten(1, 2).transpose(1, 2).to(query.dtype)
    lse_t = torch.cat(lse_t, dim=3).flatten(1, 2).to(lse.dtype)
    return out_t, lse_t


def varlen_jvp(problem: Problem, opts: Options, tangents, lse, lse_rem):
    """attention_varlen's (out', lse') of a packed problem, one sequence at a time; 0 on rows
    outside every sequence."""
    tq, tk, tv, tbias = tangents
    query, value = problem.query, problem.value
    total_q, h, _ = query.shape
    out_t = query.new_zeros((total_q, h, value.shape[-1]))
    lse_t = lse.new_zeros(lse.shape)
    parts_o, parts_l, covered = [], [], 0
    for q0, q1, k0, k1, sequence in _spans(problem):
        if q1 == q0:
            continue
        o, ls = jvp(
            sequence, opts,
            tuple(None if t is None else t[None, lo:hi] for t, lo, hi in (
                (tq, q0, q1), (tk, k0, k1), (tv, k0, k1))) + (_seq_operand(tbias, k0, k1),),
            lse[None, :, q0:q1], lse_rem[None, :, q0:q1],
        )  # fmt: skip
        parts_o += [out_t[covered:q0], o[0]]
        parts_l += [lse_t[:, covered:q0], ls[0]]
        covered = q1
    parts_o.append(out_t[covered:])
    parts_l.append(lse_t[:, covered:])
    return torch.cat(parts_o, dim=0), torch.cat(parts_l, dim=1)


def add_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor):
    """(out, lse) of attention without sinks -> with them: lse' = logaddexp(lse, sinks[h]),
    out' = out * exp(lse - lse'), exactly the softmax with the sink in its denominator.
    Differentiable in out, lse (so in every input) and sinks; finite everywhere: a sink of -inf
    is no sink, and a row with no key and a sink of -inf keeps lse -inf."""
    s = sinks.to(lse.dtype)[None, :, None]  # [1, H, 1]
    s_finite = s.clamp(min=torch.finfo(lse.dtype).min)
    with_sink = torch.logaddexp(lse, s_finite)
    weight = torch.exp(lse - with_sink)  # in [0, 1]; 0 for a row with no key
    # A sink of -inf is no sink, exactly: clamped to finfo.min it would still take half of a
    # row whose lse lies near finfo.min (a bias of finfo.min on every allowed key).
    none = s == float("-inf")
    lse_new = torch.where(none, lse, with_sink)
    weight = torch.where(none, 1.0, weight)
    out_new = (out.to(weight.dtype) * weight.transpose(1, 2)[..., None]).to(out.dtype)
    return out_new, lse_new
