"""Dynamic masks from a learned bias: which keys each query (or each KV group) may see.

Both functions select keys from a detached copy of the bias, so the selection never carries a
gradient: the bias gets its gradient only through the attention it is added to.

Rules shared by both:

* ``mask`` (bool) restricts the choice: a key it disallows is never selected, whatever the bias
  holds there (large values, +-inf, finfo.min, NaN). It is 4-D (B|1, H|Hkv|1, Lq|1, Lk), like
  attention's mask, or a 2-D padding mask (B, Lk).
* The result has the broadcast shape of the bias and the mask: a (B, H, 1, Lk) bias gives a
  (B, H, 1, Lk) mask, and nothing of size Lq * Lk is allocated for it.
* NaN in the bias at an allowed key ranks below every number, -inf included (it is never
  preferred to a number).
* Where Triton runs (CUDA, or the interpreter), topk_mask uses a fused kernel
  (kernels/topk_mask.py) for rows of any length; ties at the k-th value then go to the lowest
  key indices. Elsewhere torch.topk selects, and picks among ties as it pleases.
* ``block_size`` smooths the selection to whole key blocks: a block of ``block_size``
  consecutive keys (the last one may be shorter) is kept whole when at least half of its
  allowed keys were selected and dropped otherwise; disallowed keys stay out either way.
"""

from __future__ import annotations

import torch

from dmattn_ops.core.device import hint, next_power_of_2, symbolic
from dmattn_ops.core.operands import operand_strides
from dmattn_ops.dispatch import plan
from dmattn_ops.executors import _triton
from dmattn_ops.executors._triton import LazyKernel
from dmattn_ops.registration import inductor


def _kernels() -> tuple:
    """The top-k selection kernel's module, imported (with Triton) at its first launch."""
    from dmattn_ops.kernels import topk_mask

    return (topk_mask,)


topk_mask_kernel = LazyKernel(_kernels, "topk_mask_kernel")


def _allowed(bias: torch.Tensor, mask: torch.Tensor | None, fn: str) -> torch.Tensor | None:
    if not isinstance(bias, torch.Tensor) or not bias.is_floating_point() or bias.dim() != 4:
        raise TypeError(
            f"dmattn.masks.{fn}: bias must be a 4-D floating tensor (B|1, H|Hkv|1, Lq|1, Lk); "
            f"got {type(bias).__name__ if not isinstance(bias, torch.Tensor) else bias.dtype} "
            f"of shape {tuple(getattr(bias, 'shape', ()))}"
        )
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        raise TypeError(f"dmattn.masks.{fn}: mask must be a bool tensor; got {mask!r:.60}")
    lk = bias.shape[-1]
    if mask.dim() == 2:
        if mask.shape[1] != lk:
            raise ValueError(
                f"dmattn.masks.{fn}: a 2-D padding mask must be (B, Lk) with Lk={lk}; "
                f"got {tuple(mask.shape)} for bias {tuple(bias.shape)}"
            )
        mask = mask[:, None, None, :]
    if mask.dim() != 4 or mask.shape[-1] != lk:
        raise ValueError(
            f"dmattn.masks.{fn}: mask must be (B, Lk) or 4-D with Lk={lk} last; "
            f"got {tuple(mask.shape)}"
        )
    try:
        torch.broadcast_shapes(mask.shape, bias.shape)
    except RuntimeError:
        raise ValueError(
            f"dmattn.masks.{fn}: mask {tuple(mask.shape)} does not broadcast with bias "
            f"{tuple(bias.shape)}"
        ) from None
    return mask


def _check_block_size(block_size) -> None:
    if block_size is None:
        return
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"dmattn.masks: block_size must be a positive int; got {block_size!r}")


def _smooth(selected: torch.Tensor, allowed: torch.Tensor | None, block_size: int | None):
    _check_block_size(block_size)
    if block_size is None:
        return selected
    lk = selected.shape[-1]
    pad = (-lk) % block_size
    ok = allowed.expand_as(selected) if allowed is not None else torch.ones_like(selected)
    sel = torch.nn.functional.pad(selected, (0, pad)).unflatten(-1, (-1, block_size))
    okb = torch.nn.functional.pad(ok, (0, pad)).unflatten(-1, (-1, block_size))
    votes = sel.sum(dim=-1, keepdim=True)  # [..., nblk, 1]
    eligible = okb.sum(dim=-1, keepdim=True)
    keep = (2 * votes >= eligible) & (votes > 0)
    return (keep & okb).flatten(-2)[..., :lk]


def topk_mask(
    bias: torch.Tensor,
    window: int,
    mask: torch.Tensor | None = None,
    *,
    block_size: int | None = None,
) -> torch.Tensor:
    """The ``window`` keys with the largest bias, per row of ``bias`` (the DMA top-k mask).

    Args:
        bias: (B|1, H|Hkv|1, Lq|1, Lk) float; not differentiated through.
        window: how many keys to keep per row; when fewer keys are allowed, all allowed keys.
        mask: optional bool (B, Lk) padding mask or (B|1, H|Hkv|1, Lq|1, Lk) mask.
        block_size: optional smoothing to whole key blocks (module docstring).

    Returns:
        bool mask of the broadcast shape of bias and mask.
    """
    return select_topk(bias, window, mask, block_size=block_size)


def select_topk(
    bias: torch.Tensor,
    window: int,
    mask: torch.Tensor | None = None,
    *,
    block_size: int | None = None,
    direct: bool = False,
) -> torch.Tensor:
    """topk_mask, and with ``direct`` the form of a mask that only this library's attention
    ops read: in a compiled graph it is the selection kernel's own buffer, one launch fewer
    than the mask a FlexAttention mask_mod may capture (topk_select says why)."""
    allowed = _allowed(bias, mask, "topk_mask")
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ValueError(f"dmattn.masks.topk_mask: window must be an int >= 0; got {window!r}")
    score = bias.detach()
    shape = torch.broadcast_shapes(score.shape, allowed.shape) if allowed is not None else None
    if shape is not None:
        score = score.expand(shape)
    # Allowed numbers rank by value, allowed NaN below them, disallowed keys below everything
    # (rank_key): when fewer than `window` keys are allowed all of them are picked, and the
    # final & drops the rest.
    lk = score.shape[-1]
    _check_block_size(block_size)
    # Compiled (the length may be symbolic: Dynamo does not tell), the kernel takes k = window
    # whatever Lk, selecting every allowed key where window >= Lk as the unfused path does;
    # comparing the window with a symbolic Lk would compile the graph again at that length.
    any_length = torch.compiler.is_compiling() and _fused_dtype(score)
    k = window if any_length else min(window, lk)
    if k > 0 and (any_length or _fused_applies(score, k)):
        fuse_smooth = block_size is not None and block_size & (block_size - 1) == 0
        smooth = block_size if fuse_smooth else 0
        selected = torch.ops.dmattn.topk_select(bias.detach(), allowed, k, smooth, direct)
        return selected if fuse_smooth else _smooth(selected, allowed, block_size)
    return _smooth(_torch_topk(score, allowed, k), allowed, block_size)


_INT_OF = {2: torch.int16, 4: torch.int32, 8: torch.int64}
# -inf's bits as a signed integer of the float's width.
_NEG_INF_BITS = {
    torch.float16: 0xFC00 - (1 << 16),
    torch.bfloat16: 0xFF80 - (1 << 16),
    torch.float32: 0xFF800000 - (1 << 32),
    torch.float64: 0xFFF0000000000000 - (1 << 64),
}


def rank_key(score: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    """An integer image of the scores in the order topk_mask ranks them: numbers by value
    (-inf lowest among them), then NaN, then disallowed keys; int64, or int32 for 16-bit
    scores. The float's bits with the magnitude bits of negative values flipped are monotone
    in its value; NaN and disallowed keys take the two images just below -inf's."""
    bits = score.view(_INT_OF[score.element_size()])
    wide = torch.int32 if score.element_size() == 2 else torch.int64
    bits = bits.to(wide)
    width = 8 * score.element_size() - 1
    key = bits ^ ((bits >> width) & ((1 << width) - 1))
    neg_inf = _NEG_INF_BITS[score.dtype] ^ ((1 << width) - 1)
    key = torch.where(torch.isnan(score), neg_inf - 1, key)
    if allowed is not None:
        key = torch.where(allowed, key, neg_inf - 2)
    return key


def _torch_topk(score, allowed, k):
    selected = torch.zeros(score.shape, dtype=torch.bool, device=score.device)
    if k > 0:
        key = rank_key(score, allowed)
        selected.scatter_(-1, key.topk(k, dim=-1).indices, True)
    if allowed is not None:
        selected &= allowed
    return selected


# Rows of at most this many keys live in registers (one block, loaded once); longer ones are
# read ROW_CHUNK keys at a time on each of the kernel's counting passes. The widest chunk is
# fastest (H200, B1 Hkv4 top L/4, the call under a CUDA graph, int32 ranks: L32768 0.104 /
# 0.079 / 0.067 / 0.062 ms at chunks of 2048 / 4096 / 8192 / 16384 keys, L65536 0.203 / 0.153
# / 0.129 / 0.117): fewer, longer passes over the row.
FUSED_MAX_KEYS = 16384
ROW_CHUNK = 16384


def _fused_dtype(score: torch.Tensor) -> bool:
    """Where Triton runs, on a dtype it takes."""
    return plan.triton_runs_on(score) and score.dtype in plan.TRITON_DTYPES


def _fused_applies(score: torch.Tensor, k: int) -> bool:
    """The fused kernel (kernels/topk_mask.py) runs where Triton runs, for a selection that is
    not the whole row."""
    return _fused_dtype(score) and k < score.shape[-1]


def topk_select(
    bias: torch.Tensor,
    allowed: torch.Tensor | None,
    k: int,
    smooth: int,
    direct: bool = False,
) -> torch.Tensor:
    """The k largest of every row of bias among the allowed keys (4-D, broadcast together), as
    a bool mask of their broadcast shape, block-smoothed when smooth > 0 (a power of two).
    Registered as the op dmattn::topk_select (below); compiled graphs trace its kernel launch
    (inductor.py). Where Triton cannot run, torch.topk.

    direct: traced into a compiled graph, return the kernel's bool buffer itself instead of
    `bytes != 0`, one launch fewer per call. Only for a mask that no FlexAttention mask_mod
    captures (the comment below says why); DynamicMaskAttention passes it when its mask goes
    to this library's ops alone."""
    if not plan.triton_runs_on(bias) or bias.dtype not in plan.TRITON_DTYPES:
        shape = _broadcast(bias, allowed)
        score = bias.expand(shape)
        selected = _torch_topk(score, allowed.expand(shape) if allowed is not None else None, k)
        return _smooth(selected, allowed, smooth).contiguous() if smooth else selected
    shape = _broadcast(bias, allowed)
    b, h, lq, lk = shape
    # Traced into a compiled graph (inductor.py), the kernel writes bytes and the mask is
    # `bytes != 0`: Inductor would read a bool buffer that comes from torch.empty and is
    # written only by a user kernel as its fill value (all False) where FlexAttention's
    # mask_mod captures it.
    traced = _triton.tracing_on() and not direct
    out = torch.empty(shape, dtype=torch.uint8 if traced else torch.bool, device=bias.device)
    if out.numel() > 0:
        bias_e = bias.expand(shape)
        mask_e = allowed.expand(shape) if allowed is not None else None
        # A symbolic Lk (a graph with dynamic shapes) reads its row in chunks, sized for the
        # example's length: one kernel for every length, no guard on it.
        chunked = symbolic(lk) or lk > FUSED_MAX_KEYS
        block = min(ROW_CHUNK, next_power_of_2(hint(lk))) if chunked else next_power_of_2(lk)
        block = max(block, smooth)
        warps = 1 if _triton.interpreter_on() else min(16, max(4, block // 512))
        topk_mask_kernel[(b * h * lq,)](
            bias_e, mask_e, out, *operand_strides(bias_e),
            *operand_strides(mask_e), h, lq, lk, k,
            BLOCK=block, SMOOTH=smooth, HAS_MASK=mask_e is not None, CHUNKED=chunked,
            num_warps=warps,
        )  # fmt: skip
    return out != 0 if traced else out


_fused_topk = torch.library.custom_op("dmattn::topk_select", topk_select, mutates_args=())
inductor.trace_into_graphs(torch.ops.dmattn.topk_select.default, topk_select)


@_fused_topk.register_fake
def _(bias, allowed, k, smooth, direct=False):
    return bias.new_empty(_broadcast(bias, allowed), dtype=torch.bool)


def _broadcast(bias: torch.Tensor, allowed: torch.Tensor | None) -> tuple[int, ...]:
    return tuple(
        torch.broadcast_shapes(bias.shape, allowed.shape) if allowed is not None else bias.shape
    )


def relu_mask(
    bias: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    block_size: int | None = None,
) -> torch.Tensor:
    """Keys whose bias is positive (NaN is not), restricted to ``mask``; shapes as topk_mask."""
    allowed = _allowed(bias, mask, "relu_mask")
    selected = bias.detach() > 0
    if allowed is not None:
        selected = selected & allowed
    return _smooth(selected, allowed, block_size)


def causal_topk_mask(
    bias: torch.Tensor,
    window: int,
    mask: torch.Tensor | None = None,
    *,
    num_queries: int | None = None,
    seqused_k: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each query's ``window`` keys of largest bias among the keys it sees under causality, as
    a row-limit mask (README "Row-limit masks"): Doge's selection (transformers'
    ``DogeAttention.prepare_dynamic_mask``) in O(Lk log Lk) per row, without its (Lq, Lk)
    tensor.

    The query at position p sees the keys j <= p that ``mask`` allows and keeps the ``window``
    of them whose bias is largest (all of them when fewer). A key leaves a query's selection
    only when ``window`` better keys precede that query, and then never returns to a later
    one, so key j is kept by the positions j <= p < limit_j: one int32 per key.

    Args:
        bias: (B|1, H|Hkv|1, 1, Lk) float, a score per key; not differentiated through.
        window: how many keys each query keeps (>= 0).
        mask: optional bool (B, Lk) padding mask or (B|1, H|Hkv|1, 1, Lk) per-key mask.
        num_queries: the queries are the last ``num_queries`` positions (Lq of the attention
            call, aligned bottom-right as ``is_causal`` aligns them); default Lk.
        seqused_k: optional int32 (B,): only the first seqused_k[b] keys exist (a static
            cache); the queries are then the last ``num_queries`` of those.

    Returns:
        int32 (B|1, H|Hkv|1, 1, Lk) row-limit mask for ``attention(..., mask=it,
        is_causal=True, seqused_k=seqused_k)``: query row i sees key j when j is at or before
        its position and i < mask[..., j]; keys no query keeps hold 0.

    Ties: among keys of equal bias the lower index ranks higher (torch.topk, which Doge
    calls, picks among ties as it pleases, so the two agree exactly only without ties at a
    row's window-th value). NaN ranks below every number, as in topk_mask.
    """
    allowed = _allowed(bias, mask, "causal_topk_mask")
    if bias.shape[2] != 1 or (allowed is not None and allowed.shape[2] != 1):
        raise ValueError(
            "dmattn.masks.causal_topk_mask: bias and mask hold one value per key, (B|1, H|Hkv|1, "
            f"1, Lk); got bias {tuple(bias.shape)}"
        )
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ValueError(
            f"dmattn.masks.causal_topk_mask: window must be an int >= 0; got {window!r}"
        )
    score = bias.detach()
    lk = score.shape[-1]
    lq = lk if num_queries is None else num_queries
    device = score.device
    j = torch.arange(lk, device=device)
    if seqused_k is not None:
        n = seqused_k.to(torch.int64).clamp(0, lk)
        inside = (j < n[:, None])[:, None, None, :]
        allowed = inside if allowed is None else allowed & inside
        offset = (n - lq).view(-1, 1, 1, 1)  # position of query row 0, per batch
    else:
        offset = lk - lq
    shape = _broadcast(score, allowed)
    key = rank_key(score.expand(shape), None if allowed is None else allowed.expand(shape))
    rows = key.reshape(-1, lk)
    # rank[j]: j's place in the order (bias descending, ties to the lower index).
    order = torch.sort(rows, dim=-1, descending=True, stable=True).indices
    if window == 0:
        limit = torch.zeros_like(order)
    elif lq == 1:
        # One query (decoding), at the last key position: its window best keys (row 0 sees
        # them, limit 1), straight from the order.
        limit = torch.zeros_like(order).scatter_(-1, order[:, :window], 1)
        limit = limit.view(shape)
        return (limit if allowed is None else torch.where(allowed, limit, 0)).to(torch.int32)
    else:
        rank = torch.empty_like(order).scatter_(-1, order, j.expand_as(order))
        # tau[p]: the window-th best rank among keys 0..p (Lk while fewer keys); non-increasing,
        # so key j is among the window best of 0..p exactly while p < #{p: tau[p] >= rank[j]}.
        tau = _prefix_kth_smallest(rank, window)
        limit = torch.searchsorted(-tau, (-rank).contiguous(), right=True)
        limit = torch.where(limit > j, limit, 0)  # 0: no query keeps it
    limit = limit.view(shape)
    if allowed is not None:
        limit = torch.where(allowed, limit, 0)
    # Positions to the attention call's query rows.
    limit = torch.where(limit > 0, (limit - offset).clamp(min=0), 0)
    return limit.to(torch.int32)


def _prefix_kth_smallest(values: torch.Tensor, k: int) -> torch.Tensor:
    """out[:, p] = the k-th smallest (k >= 1) of values[:, :p + 1], or L where p + 1 < k, for
    rows of a permutation of 0..L-1 (N, L), int64: all prefixes at once through a wavelet
    matrix (one stable partition of the values per bit, from the top; a prefix's k-th smallest
    then descends one level per bit through the zeros counted before its end), O(L log L)
    work in 2 log2(L) vectorised steps."""
    n, length = values.shape
    device = values.device
    bits = max(1, (length - 1).bit_length())
    s = torch.arange(length, device=device).expand(n, length)
    zero = torch.zeros((n, 1), dtype=torch.int64, device=device)
    levels = []
    a = values
    for level in range(bits):
        bit = (a >> (bits - 1 - level)) & 1
        zeros = torch.cat([zero, torch.cumsum(1 - bit, dim=-1)], dim=-1)  # zeros before each
        nz = zeros[:, -1:]
        before = zeros[:, :-1]
        place = torch.where(bit == 0, before, nz + s - before)
        levels.append((zeros, nz))
        a = torch.empty_like(a).scatter_(-1, place, a)
    lo = torch.zeros((n, length), dtype=torch.int64, device=device)
    hi = s + 1
    rest = torch.full((n, length), k - 1, dtype=torch.int64, device=device)
    out = torch.zeros((n, length), dtype=torch.int64, device=device)
    for zeros, nz in levels:
        zlo, zhi = zeros.gather(-1, lo), zeros.gather(-1, hi)
        count = zhi - zlo
        left = rest < count
        out = out * 2 + (~left).to(torch.int64)
        rest = torch.where(left, rest, rest - count)
        lo = torch.where(left, zlo, nz + lo - zlo)
        hi = torch.where(left, zhi, nz + hi - zhi)
    return torch.where(s + 1 >= k, out, length)
