"""Fused top-k mask: one program selects the `k` largest scores of one row of the bias.

torch.topk on a (B, Hkv, L, L) bias sorts (or radix-selects) every row and then needs a
scatter into a fresh mask: about 3-4 ms at B2 Hkv4 L4096 on an H100, as long as the attention
it feeds. Here a row is loaded once and held in registers; the k-th largest value is found by
bisection on an order-preserving integer image of the scores (32 counting passes over
registers), and the mask row is written directly. Ties at the threshold go to the lowest key
indices, so exactly k keys are selected, deterministically.
"""

import triton
import triton.language as tl


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
):
    """Row program_id(0) = (b * H + h) * Lq + q of the (B, H, Lq, Lk) output; bias and mask
    are read through their (broadcast, stride-0) strides. SMOOTH > 0 applies masks.py's block
    smoothing with blocks of SMOOTH keys (a power of two) before the row is stored."""
    row = tl.program_id(0).to(tl.int64)
    i_b = row // (H * Lq)
    i_h = (row // Lq) % H
    i_q = row % Lq
    j = tl.arange(0, BLOCK)
    valid = j < Lk
    o_j = j.to(tl.int64)
    x = tl.load(
        BIAS + i_b * stride_bb + i_h * stride_bh + i_q * stride_bm + o_j * stride_bn,
        mask=valid,
        other=0.0,
    )
    allowed = valid
    if HAS_MASK:
        m = tl.load(
            MASK + i_b * stride_mb + i_h * stride_mh + i_q * stride_mm + o_j * stride_mn,
            mask=valid,
            other=0,
        )
        allowed = valid & (m != 0)
    # The ranking of masks.rank_key: numbers by value through an order-preserving int image
    # (the magnitude bits of negative floats flipped), then NaN, then disallowed keys, on the
    # two images just below -inf's. 16-bit biases need 16 bisection steps, not 32.
    if BIAS.dtype.element_ty.primitive_bitwidth == 16:
        # Through float32 and back: Triton's interpreter bitcasts bfloat16 wrongly otherwise.
        x16 = x.to(tl.float32).to(BIAS.dtype.element_ty)
        bits = x16.to(tl.int16, bitcast=True).to(tl.int32)
        key = (bits ^ ((bits >> 15) & 0x7FFF)).to(tl.int64)
        neg_inf = tl.full([], float("-inf"), tl.float32).to(BIAS.dtype.element_ty)
        inf_bits = neg_inf.to(tl.int16, bitcast=True).to(tl.int32)
        lo = tl.full([], -32768, tl.int64)
        hi = tl.full([], 32767, tl.int64)
        steps: tl.constexpr = 16
        inf_key = (inf_bits ^ 0x7FFF).to(tl.int64)
    else:
        bits = x.to(tl.float32).to(tl.int32, bitcast=True)
        key = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64)
        lo = tl.full([], -2147483648, tl.int64)
        hi = tl.full([], 2147483647, tl.int64)
        steps: tl.constexpr = 32
        inf_key = tl.full([], -2139095041, tl.int64)  # -inf: 0xFF800000 ^ 0x7FFFFFFF
    x32 = x.to(tl.float32)
    key = tl.where(x32 != x32, inf_key - 1, key)
    key = tl.where(allowed, key, inf_key - 2)
    # Largest t with #{key >= t} >= k, by bisection over the integer range.
    for _ in range(steps):
        mid = (lo + hi + 1) // 2
        count = tl.sum(tl.where(valid & (key >= mid), 1, 0), 0)
        take = count >= k
        lo = tl.where(take, mid, lo)
        hi = tl.where(take, hi, mid - 1)
    greater = valid & (key > lo)
    ties = valid & (key == lo)
    need = k - tl.sum(greater.to(tl.int32), 0)
    rank = tl.cumsum(ties.to(tl.int32), 0)
    selected = (greater | (ties & (rank <= need))) & allowed
    if SMOOTH > 0:
        # Keep a block whole when at least half of its allowed keys were selected.
        votes = tl.sum(tl.reshape(selected.to(tl.int32), (BLOCK // SMOOTH, SMOOTH)), 1)
        eligible = tl.sum(tl.reshape(allowed.to(tl.int32), (BLOCK // SMOOTH, SMOOTH)), 1)
        keep = (2 * votes >= eligible) & (votes > 0)
        keep_row = tl.reshape(tl.broadcast_to(keep[:, None], (BLOCK // SMOOTH, SMOOTH)), (BLOCK,))
        selected = keep_row & allowed
    tl.store(OUT + row * Lk + o_j, selected.to(tl.int8), mask=valid)
