"""Fused top-k mask: one program selects the `k` largest scores of one row of the bias.

torch.topk on a (B, Hkv, L, L) bias sorts (or radix-selects) every row and then needs a
scatter into a fresh mask: about 3-4 ms at B2 Hkv4 L4096 on an H100, as long as the attention
it feeds. Here the k-th largest value is found by bisection on an order-preserving integer image
of the scores (16 counting passes for 16-bit biases, 32 for float32; int32 images, whose
range holds every float32 image and the sentinels below -inf's), and the mask row is written
directly. Ties at the threshold go to the lowest key indices, so exactly k keys are
selected, deterministically.

A row of at most BLOCK keys is loaded once and held in registers. A longer row (CHUNKED; the
model's long contexts: 32768 keys per KV head) is read in chunks of BLOCK keys on every pass,
from L2 after the first: no length is too long, and torch.topk's ~48 launches per call (radix
passes, sort, scatter) become one. A graph with symbolic sizes launches the chunked kernel at
every length (masks.topk_select); a row that fits one block is still held in registers there
(a branch on Lk at run time).
"""

import triton
import triton.language as tl


@triton.jit
def _rank_keys(
    p_bias, p_mask, stride_bn, stride_mn, j0, Lk, HAS_MASK: tl.constexpr, BLOCK: tl.constexpr
):
    """(key, valid, allowed) of keys j0 .. j0 + BLOCK - 1 of a row: masks.rank_key's ranking.
    Numbers rank by value through an order-preserving int image (the magnitude bits of negative
    floats flipped), then NaN, then disallowed keys, on the two images just below -inf's.
    `valid`: the key exists (j < Lk)."""
    j = j0 + tl.arange(0, BLOCK)
    valid = j < Lk
    o_j = j.to(tl.int64)
    x = tl.load(p_bias + o_j * stride_bn, mask=valid, other=0.0)
    allowed = valid
    if HAS_MASK:
        m = tl.load(p_mask + o_j * stride_mn, mask=valid, other=0)
        allowed = valid & (m != 0)
    if p_bias.dtype.element_ty.primitive_bitwidth == 16:
        # Through float32 and back: Triton's interpreter bitcasts bfloat16 wrongly otherwise.
        x16 = x.to(tl.float32).to(p_bias.dtype.element_ty)
        bits = x16.to(tl.int16, bitcast=True).to(tl.int32)
        key = bits ^ ((bits >> 15) & 0x7FFF)
        neg_inf = tl.full([], float("-inf"), tl.float32).to(p_bias.dtype.element_ty)
        inf_key = neg_inf.to(tl.int16, bitcast=True).to(tl.int32) ^ 0x7FFF
    else:
        bits = x.to(tl.float32).to(tl.int32, bitcast=True)
        key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
        inf_key = tl.full([], -2139095041, tl.int32)  # -inf: 0xFF800000 ^ 0x7FFFFFFF
    x32 = x.to(tl.float32)
    key = tl.where(x32 != x32, inf_key - 1, key)
    key = tl.where(allowed, key, inf_key - 2)
    return key, valid, allowed


@triton.jit
def _select_store(
    p_out, j0, key, valid, allowed, threshold, need, seen, BLOCK: tl.constexpr, SMOOTH: tl.constexpr
):
    """Writes the selection of keys j0 .. j0 + BLOCK - 1: every key above the threshold, and
    the first `need` of the row's keys at it, `seen` of which came before j0. SMOOTH > 0
    applies masks.py's block smoothing with blocks of SMOOTH keys (a power of two dividing
    BLOCK). Returns the ties in this chunk."""
    ties = valid & (key == threshold)
    rank = tl.cumsum(ties.to(tl.int32), 0) + seen
    selected = ((valid & (key > threshold)) | (ties & (rank <= need))) & allowed
    if SMOOTH > 0:
        # Keep a block whole when at least half of its allowed keys were selected.
        votes = tl.sum(tl.reshape(selected.to(tl.int32), (BLOCK // SMOOTH, SMOOTH)), 1)
        eligible = tl.sum(tl.reshape(allowed.to(tl.int32), (BLOCK // SMOOTH, SMOOTH)), 1)
        keep = (2 * votes >= eligible) & (votes > 0)
        keep_row = tl.reshape(tl.broadcast_to(keep[:, None], (BLOCK // SMOOTH, SMOOTH)), (BLOCK,))
        selected = keep_row & allowed
    j = j0 + tl.arange(0, BLOCK)
    tl.store(p_out + j.to(tl.int64), selected.to(tl.int8), mask=valid)
    return tl.sum(ties.to(tl.int32), 0)


@triton.jit
def _bisect_start(p_bias):
    """(lo, hi) of the bisection over the integer images of p_bias's dtype, in int64 (their
    sum overflows int32)."""
    if p_bias.dtype.element_ty.primitive_bitwidth == 16:
        lo = tl.full([], -32768, tl.int64)
        hi = tl.full([], 32767, tl.int64)
    else:
        lo = tl.full([], -2147483648, tl.int64)
        hi = tl.full([], 2147483647, tl.int64)
    return lo, hi


@triton.jit
def _bisect_step(lo, hi, above, count, k):
    """One bisection step, given count = #{key >= mid} at mid = (lo + hi + 1) // 2: keep the
    upper half where it still holds k keys. `above` = #{key > hi}: the count at the last
    midpoint rejected (hi = mid - 1 then), 0 while hi is the range's top."""
    mid = (lo + hi + 1) // 2
    take = count >= k
    return tl.where(take, mid, lo), tl.where(take, hi, mid - 1), tl.where(take, above, count)


@triton.jit
def _select_whole(
    p_bias, p_mask, p_out, stride_bn, stride_mn, Lk, k,
    HAS_MASK: tl.constexpr, BLOCK: tl.constexpr, SMOOTH: tl.constexpr,
):  # fmt: skip
    """A row of at most BLOCK keys: loaded once, held in registers through the bisection."""
    steps: tl.constexpr = 16 if p_bias.dtype.element_ty.primitive_bitwidth == 16 else 32
    lo, hi = _bisect_start(p_bias)
    key, valid, allowed = _rank_keys(p_bias, p_mask, stride_bn, stride_mn, 0, Lk, HAS_MASK, BLOCK)
    # The largest t with #{key >= t} >= k, by bisection over the integer range (_bisect_step).
    # The keys compare in int32 with mid, which lies in [lo + 1, hi], inside int32's range.
    above = tl.full([], 0, tl.int32)
    for _ in range(steps):
        mid = (lo + hi + 1) // 2
        count = tl.sum(tl.where(valid & (key >= mid.to(tl.int32)), 1, 0), 0)
        lo, hi, above = _bisect_step(lo, hi, above, count, k)
    # lo == hi now: every key above lo is selected (`above` of them), and of those at lo the
    # first k - above in key order.
    _select_store(p_out, 0, key, valid, allowed, lo.to(tl.int32), k - above, 0, BLOCK, SMOOTH)


@triton.jit
def _select_chunked(
    p_bias, p_mask, p_out, stride_bn, stride_mn, Lk, k,
    HAS_MASK: tl.constexpr, BLOCK: tl.constexpr, SMOOTH: tl.constexpr,
):  # fmt: skip
    """_select_whole's selection for a row of any length, read BLOCK keys at a time on every
    pass (from L2 after the first)."""
    steps: tl.constexpr = 16 if p_bias.dtype.element_ty.primitive_bitwidth == 16 else 32
    lo, hi = _bisect_start(p_bias)
    above = tl.full([], 0, tl.int32)
    for _ in range(steps):
        mid = (lo + hi + 1) // 2
        count = tl.full([], 0, tl.int32)
        for j0 in range(0, Lk, BLOCK):
            key, valid, allowed = _rank_keys(
                p_bias, p_mask, stride_bn, stride_mn, j0, Lk, HAS_MASK, BLOCK
            )
            count += tl.sum(tl.where(valid & (key >= mid.to(tl.int32)), 1, 0), 0)
        lo, hi, above = _bisect_step(lo, hi, above, count, k)
    seen = tl.full([], 0, tl.int32)
    for j0 in range(0, Lk, BLOCK):
        key, valid, allowed = _rank_keys(
            p_bias, p_mask, stride_bn, stride_mn, j0, Lk, HAS_MASK, BLOCK
        )
        seen += _select_store(
            p_out, j0, key, valid, allowed, lo.to(tl.int32), k - above, seen, BLOCK, SMOOTH
        )


@triton.jit
def topk_mask_kernel(
    BIAS,
    MASK,
    OUT,
    stride_bb,
    stride_bh,
    stride_bm,
    stride_bn,
    stride_mb,
    stride_mh,
    stride_mm,
    stride_mn,
    H,
    Lq,
    Lk,
    k,
    HAS_MASK: tl.constexpr,
    BLOCK: tl.constexpr,
    SMOOTH: tl.constexpr,
    CHUNKED: tl.constexpr = False,
):
    """Row program_id(0) = (b * H + h) * Lq + q of the (B, H, Lq, Lk) output; bias and mask
    are read through their (broadcast, stride-0) strides. Without CHUNKED the row fits in one
    block of BLOCK keys; with it, a row of any length: one that fits a block (checked at run
    time: a graph with symbolic sizes launches this one kernel at every length) is still held
    in registers, a longer one read BLOCK keys at a time. SMOOTH > 0 applies masks.py's block
    smoothing with blocks of SMOOTH keys (a power of two <= BLOCK)."""
    row = tl.program_id(0).to(tl.int64)
    i_b = row // (H * Lq)
    i_h = (row // Lq) % H
    i_q = row % Lq
    p_bias = BIAS + i_b * stride_bb + i_h * stride_bh + i_q * stride_bm
    p_mask = MASK
    if HAS_MASK:
        p_mask = MASK + i_b * stride_mb + i_h * stride_mh + i_q * stride_mm
    p_out = OUT + row * Lk
    if CHUNKED:
        if Lk <= BLOCK:
            _select_whole(
                p_bias, p_mask, p_out, stride_bn, stride_mn, Lk, k, HAS_MASK, BLOCK, SMOOTH
            )
        else:
            _select_chunked(
                p_bias, p_mask, p_out, stride_bn, stride_mn, Lk, k, HAS_MASK, BLOCK, SMOOTH
            )
    else:
        _select_whole(p_bias, p_mask, p_out, stride_bn, stride_mn, Lk, k, HAS_MASK, BLOCK, SMOOTH)
