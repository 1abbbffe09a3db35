"""Backward, dbias of a bias with its own query rows shared over batch and/or heads: one program
per block of bias rows, summing dS over the (batch, head) pairs that read them
(attention_bwd_stats says how P is recomputed)."""

import triton
import triton.language as tl

from dmattn_ops.kernels.attention_bwd_stats import _probs, _row_stats
from dmattn_ops.kernels.common import (
    PER_ENTRY,
    as_fp32,
    band_key_tiles,
    causal_key_end,
    dot,
    key_count,
    row_tile,
    score_tile,
)


@triton.jit
def attention_bwd_dbias_kernel(
    Q,
    K,
    V,
    DO,
    MASK,
    BIAS,
    SEQUSED,
    STATS,
    ACTIVE,
    DBIAS,
    stride_qb,
    stride_qm,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_kn,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vn,
    stride_vh,
    stride_vd,
    stride_dob,
    stride_dom,
    stride_doh,
    stride_dod,
    stride_mb,
    stride_mh,
    stride_mm,
    stride_mn,
    stride_bb,
    stride_bh,
    stride_bm,
    stride_bn,
    table_stride_b,
    table_stride_h,
    H,
    G,
    Hb,
    Lq,
    Lk,
    D,
    Dv,
    NQ,
    NK,
    n_batch,
    batch_mul,
    n_head,
    head_mul,
    mask_hdiv,
    bias_hdiv,
    scale,
    softcap,
    win_left,
    win_right,
    IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_SEQUSED: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
):
    """dbias for a bias with its own query rows but shared over batch and/or heads, without
    O(Lq * Lk) scratch per head: one program owns BLOCK_M rows of one bias (batch, head) and sums
    dS over the (batch, head) pairs that read them, tile by tile, in registers."""
    scale, softcap = as_fp32(scale), as_fp32(softcap)
    i_mb = tl.program_id(0)
    i_bbh = tl.program_id(1)
    i_bb = (i_bbh // Hb).to(tl.int64)
    i_hb = (i_bbh % Hb).to(tl.int64)
    i_m = i_mb * BLOCK_M + tl.arange(0, BLOCK_M)
    i_d = tl.arange(0, BLOCK_D)
    i_dv = tl.arange(0, BLOCK_DV)
    m_m = i_m < Lq
    o_m = i_m.to(tl.int64)
    for kb in range(0, NK):
        i_n = kb * BLOCK_N + tl.arange(0, BLOCK_N)
        o_n = i_n.to(tl.int64)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for ib in range(0, n_batch):
            i_b = i_bb * batch_mul + ib
            n_keys = key_count(SEQUSED, i_b, Lk, HAS_SEQUSED)
            for ih in range(0, n_head):
                i_h = i_hb * head_mul + ih
                if HAS_MASK:
                    o_act = i_b * table_stride_b + (i_h // mask_hdiv) * table_stride_h + i_mb
                    active = tl.load(ACTIVE + o_act * NK + kb) != 0
                elif HAS_WINDOW:
                    kb_lo, _kb_int_lo, _kb_int_hi, kb_hi = band_key_tiles(
                        i_mb * BLOCK_M, n_keys, Lq, win_left, win_right, BLOCK_M, BLOCK_N
                    )
                    active = (kb >= kb_lo) & (kb < kb_hi)
                else:
                    m_end = tl.minimum((i_mb + 1) * BLOCK_M, Lq)
                    active = kb * BLOCK_N < causal_key_end(m_end, n_keys, Lq, IS_CAUSAL)
                if active:
                    i_g = i_h // G
                    m_n = i_n < n_keys
                    b_q = row_tile(
                        Q, i_b, i_h, o_m, m_m, i_d, stride_qb, stride_qh, stride_qm, stride_qd, D
                    )  # [BM, BD]
                    b_do = row_tile(  # [BM, BDV]
                        DO, i_b, i_h, o_m, m_m, i_dv, stride_dob, stride_doh, stride_dom,
                        stride_dod, Dv,
                    )  # fmt: skip
                    p_k = K + i_b * stride_kb + i_g * stride_kh
                    p_v = V + i_b * stride_vb + i_g * stride_vh
                    b_kt = tl.load(p_k + o_n[None, :] * stride_kn + i_d[:, None] * stride_kd,
                                   mask=m_n[None, :] & (i_d[:, None] < D), other=0.0)  # fmt: skip
                    b_vt = tl.load(p_v + o_n[None, :] * stride_vn + i_dv[:, None] * stride_vd,
                                   mask=m_n[None, :] & (i_dv[:, None] < Dv), other=0.0)  # fmt: skip
                    p_mask = MASK
                    if HAS_MASK:
                        p_mask = MASK + i_b * stride_mb + (i_h // mask_hdiv) * stride_mh
                    p_bias = BIAS + i_b * stride_bb + (i_h // bias_hdiv) * stride_bh
                    lse_row, lse_rem, delta = _row_stats(
                        STATS, (i_b * H + i_h) * Lq + o_m, m_m, False
                    )
                    s, m_allowed, _ = score_tile(
                        b_q, b_kt, i_m[:, None], i_n[None, :], i_n[None, :], n_keys, Lq, scale,
                        softcap, p_mask, stride_mm, stride_mn, p_bias, stride_bm, stride_bn,
                        win_left, win_right, IS_CAUSAL, HAS_WINDOW, HAS_MASK, PER_ENTRY,
                        HAS_SOFTCAP, DOT_PRECISION, True,
                    )  # fmt: skip
                    p = _probs(s, lse_row[:, None], lse_rem[:, None])
                    dp = dot(b_do, b_vt, DOT_PRECISION)
                    acc += tl.where(m_allowed, p * (dp - delta[:, None]), 0.0)
        o_db = (i_bbh.to(tl.int64) * Lq + o_m[:, None]) * Lk + o_n[None, :]
        tl.store(
            DBIAS + o_db, acc.to(DBIAS.dtype.element_ty), mask=m_m[:, None] & (i_n[None, :] < Lk)
        )
