"""Packed keys: the listed rows of K, V and a per-key bias, copied in list order."""

import triton
import triton.language as tl


@triton.jit
def _copy_rows(src, stride_n, stride_d, dst, dst_stride_r, o_n, o_r, m_r, D, BLOCK_D: tl.constexpr):
    """Rows o_n of src (strided) to rows o_r of dst (contiguous along D), where m_r."""
    i_d = tl.arange(0, BLOCK_D)
    m = m_r[:, None] & (i_d[None, :] < D)
    rows = tl.load(src + o_n[:, None] * stride_n + i_d[None, :] * stride_d, mask=m)
    tl.store(dst + o_r[:, None] * dst_stride_r + i_d[None, :], rows, mask=m)


@triton.jit
def pack_keys_kernel(
    K,
    V,
    BIAS,
    KEYS,
    COUNT,
    K_OUT,
    V_OUT,
    BIAS_OUT,
    stride_kb,
    stride_kn,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vn,
    stride_vh,
    stride_vd,
    stride_bb,
    stride_bh,
    stride_bn,
    keys_stride_b,
    keys_stride_h,
    count_stride_b,
    Hkv,
    G,
    Lk,
    D,
    Dv,
    mask_hdiv,
    bias_hdiv,
    BIAS_HEADS,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    """One program: BLOCK_R list positions of one (batch, KV head). Position r < COUNT of the
    group's key list (keys in ascending order, tiles.KeyLists) gets row keys[r] of K and V
    (K_OUT, V_OUT: contiguous (B, Lk, Hkv, D|Dv)) and of the per-key bias of each head the
    group's bias rows serve (BIAS_OUT: contiguous (B, BIAS_HEADS * Hkv, Lk), BIAS_HEADS = G for a
    bias per query head, else 1). Positions at or past COUNT are not written: the attention
    kernels never read them."""
    i_rb = tl.program_id(0)
    i_bg = tl.program_id(1)
    i_b = (i_bg // Hkv).to(tl.int64)
    i_g = (i_bg % Hkv).to(tl.int64)
    i_hm = (i_g * G) // mask_hdiv
    count = tl.load(COUNT + i_b * count_stride_b + i_hm)
    i_r = i_rb * BLOCK_R + tl.arange(0, BLOCK_R)
    m_r = i_r < count
    keys = tl.load(KEYS + i_b * keys_stride_b + i_hm * keys_stride_h + i_r, mask=m_r, other=0)
    o_n = keys.to(tl.int64)
    o_r = i_r.to(tl.int64)
    # K_OUT / V_OUT rows: (b, position, g) of contiguous (B, Lk, Hkv, D|Dv).
    _copy_rows(
        K + i_b * stride_kb + i_g * stride_kh, stride_kn, stride_kd,
        K_OUT + (i_b * Lk * Hkv + i_g) * D, Hkv * D, o_n, o_r, m_r, D, BLOCK_D,
    )  # fmt: skip
    _copy_rows(
        V + i_b * stride_vb + i_g * stride_vh, stride_vn, stride_vd,
        V_OUT + (i_b * Lk * Hkv + i_g) * Dv, Hkv * Dv, o_n, o_r, m_r, Dv, BLOCK_DV,
    )  # fmt: skip
    if HAS_BIAS:
        for j in range(0, BIAS_HEADS):
            i_h = i_g * G + j  # a query head the bias row serves (the group's first if shared)
            b_bias = tl.load(
                BIAS + i_b * stride_bb + (i_h // bias_hdiv) * stride_bh + o_n * stride_bn,
                mask=m_r,
            )
            o_out = ((i_b * Hkv + i_g) * BIAS_HEADS + j) * Lk + o_r
            tl.store(BIAS_OUT + o_out, b_bias, mask=m_r)
