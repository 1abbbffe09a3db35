"""Backward, dQ (and dbias written per entry): one program per query tile, over the key tiles it
sees (attention_bwd_stats says how P is recomputed)."""

import triton
import triton.language as tl

from dmattn_ops.kernels.attention_bwd_stats import _dq_row_stats, _probs
from dmattn_ops.kernels.common import (
    as_fp32,
    dot,
    dot_acc,
    grid_tile,
    key_run,
    key_tile_bounds,
    listed_keys,
    load_rows,
    query_tile,
    row_tile,
    run_tile,
    score_tile,
    tile_batch,
)


@triton.jit
def _dq_tile(
    dq,
    b_q,
    b_do,
    lse_row,
    lse_rem,
    delta,
    i_m,
    kb,
    n_keys,
    Lq,
    Lk,
    D,
    Dv,
    scale,
    softcap,
    p_k,
    stride_kn,
    stride_kd,
    p_v,
    stride_vn,
    stride_vd,
    p_mask,
    stride_mm,
    stride_mn,
    p_bias,
    stride_bm,
    stride_bn,
    p_dbias,
    win_left,
    win_right,
    IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    DBIAS_DIRECT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BOUNDARY: tl.constexpr,
    p_keys,
    pos0,
    n_pos,
    COMPACT: tl.constexpr,
    FULL: tl.constexpr,
):
    i_n, i_r = listed_keys(kb, pos0, n_pos, n_keys, p_keys, BLOCK_N, BOUNDARY, COMPACT)
    i_d = tl.arange(0, BLOCK_D)
    i_dv = tl.arange(0, BLOCK_DV)
    m_n = i_n < n_keys
    o_n = i_r.to(tl.int64)
    b_kt = load_rows(  # [BD, BN]
        p_k + o_n[None, :] * stride_kn + i_d[:, None] * stride_kd, m_n[None, :],
        i_d[:, None] < D, BOUNDARY, FULL,
    )  # fmt: skip
    b_vt = load_rows(  # [BDV, BN]
        p_v + o_n[None, :] * stride_vn + i_dv[:, None] * stride_vd, m_n[None, :],
        i_dv[:, None] < Dv, BOUNDARY, FULL,
    )  # fmt: skip
    s, m_allowed, t = score_tile(
        b_q, b_kt, i_m[:, None], i_n[None, :], i_r[None, :], n_keys, Lq, scale, softcap,
        p_mask, stride_mm, stride_mn, p_bias, stride_bm, stride_bn, win_left, win_right,
        IS_CAUSAL, HAS_WINDOW, HAS_MASK, HAS_BIAS, HAS_SOFTCAP, DOT_PRECISION, BOUNDARY,
    )  # fmt: skip
    p = _probs(s, lse_row[:, None], lse_rem[:, None])
    dp = dot(b_do, b_vt, DOT_PRECISION)  # [BM, BN]
    ds = p * (dp - delta[:, None])
    if BOUNDARY or HAS_MASK:
        ds = tl.where(m_allowed, ds, 0.0)
    if DBIAS_DIRECT:
        o_db = i_m.to(tl.int64)[:, None] * Lk + o_n[None, :]
        tl.store(
            p_dbias + o_db,
            ds.to(p_dbias.dtype.element_ty),
            mask=(i_m[:, None] < Lq) & (i_n[None, :] < Lk),
        )
    if HAS_SOFTCAP:
        ds = ds * (1.0 - t * t)
    return dot_acc(ds.to(b_kt.dtype), tl.trans(b_kt), dq, DOT_PRECISION)


@triton.jit
def attention_bwd_dq_kernel(
    Q,
    K,
    V,
    DO,
    MASK,
    BIAS,
    SEQUSED,
    CU_Q,
    CU_K,
    STATS,
    OUT,
    GRAD_LSE,
    LSE,
    LSE_REM,
    KV_NUM,
    KV_IDX,
    KV_INT,
    KEYS,
    KEY_START,
    KEY_END,
    DQ,
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
    stride_ob,
    stride_om,
    stride_oh,
    stride_od,
    stride_gb,
    stride_gh,
    stride_gm,
    table_stride_b,
    table_stride_h,
    keys_stride_b,
    keys_stride_h,
    lse_stride_b,
    lse_stride_h,
    H,
    G,
    Lq,
    Lk,
    D: tl.constexpr,
    Dv: tl.constexpr,
    NK,
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
    HAS_BIAS: tl.constexpr,
    HAS_SEQUSED: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    DBIAS_DIRECT: tl.constexpr,
    COMPACT: tl.constexpr,
    VARLEN: tl.constexpr,
    HAS_GRAD_LSE: tl.constexpr,
    PACK_G: tl.constexpr = 1,
    LIST_R: tl.constexpr = 1,
):
    """One program: dq for BLOCK_M queries of one (batch, head). When the bias has its own
    (batch, head, query) entries, dS is also stored straight into DBIAS (B, H, Lq, Lk).
    PACK_G = G > 1 (key lists only): the G query heads of a KV group at BLOCK_M // G positions,
    as in the forward kernel.

    LIST_R (key lists only): as in the forward kernel.

    It runs first in the backward: it also writes its rows' statistics into STATS (B, H, Lq, 4)
    (_dq_row_stats), from OUT, dO, GRAD_LSE (strides stride_g*, as dO's rows) and the forward's
    LSE and LSE_REM, for the dk/dv, dbias and sinks kernels launched after it."""
    scale, softcap = as_fp32(scale), as_fp32(softcap)
    # A causal call's last query tiles see the most keys: each tile over every (batch, head),
    # last first (grid_tile); not with key lists, whose consecutive query tiles of one head
    # share the packed rows in L2.
    tile_major = IS_CAUSAL and not HAS_WINDOW and not VARLEN and not COMPACT
    i_mb, i_bh = grid_tile(tile_major, tile_major)
    POS_M: tl.constexpr = BLOCK_M // PACK_G  # positions per tile
    # cu_seqlens and seqused_k are loaded here, not in a helper (common.seq_extent says why).
    i_b = tile_batch(i_bh, H, PACK_G)
    cu_q = (tl.load(CU_Q + i_b), tl.load(CU_Q + i_b + 1)) if VARLEN else (0, 0)
    cu_k = (tl.load(CU_K + i_b), tl.load(CU_K + i_b + 1)) if VARLEN else (0, 0)
    used = tl.load(SEQUSED + i_b) if HAS_SEQUSED else Lk
    i_b, i_g, i_h, i_hr, i_hc, i_m, q_start, Lq, n_keys, Lk, k_row0, i_d, i_dv, m_m, o_m = (
        query_tile(
            i_mb, i_bh, cu_q, cu_k, used, Lq, Lk, H, G, BLOCK_M, BLOCK_D, BLOCK_DV, PACK_G,
            HAS_SEQUSED, VARLEN,
        )
    )  # fmt: skip
    b_q = row_tile(Q, i_b, i_hc, o_m, m_m, i_d, stride_qb, stride_qh, stride_qm, stride_qd, D)
    b_do = row_tile(
        DO, i_b, i_hc, o_m, m_m, i_dv, stride_dob, stride_doh, stride_dom, stride_dod, Dv
    )
    b_o = row_tile(OUT, i_b, i_hc, o_m, m_m, i_dv, stride_ob, stride_oh, stride_om, stride_od, Dv)
    o_row = i_b * lse_stride_b + i_hr * lse_stride_h + o_m
    lse_row, lse_rem, delta = _dq_row_stats(
        STATS, LSE, LSE_REM, GRAD_LSE, b_o, b_do, o_row,
        i_b * stride_gb + i_hr * stride_gh + o_m * stride_gm, m_m, HAS_GRAD_LSE,
    )  # fmt: skip
    p_k = K + i_b * stride_kb + k_row0 * stride_kn + i_g * stride_kh
    p_v = V + i_b * stride_vb + k_row0 * stride_vn + i_g * stride_vh
    p_mask = MASK
    if HAS_MASK:
        p_mask = MASK + i_b * stride_mb + (i_h // mask_hdiv) * stride_mh + k_row0 * stride_mn
    p_bias = BIAS
    if HAS_BIAS:
        p_bias = BIAS + i_b * stride_bb + (i_h // bias_hdiv) * stride_bh + k_row0 * stride_bn
    p_dbias = DBIAS
    if DBIAS_DIRECT:
        p_dbias = DBIAS + i_bh.to(tl.int64) * Lq * Lk

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # The key tiles in two runs, as in the forward kernel.
    TABLE: tl.constexpr = HAS_MASK and not COMPACT
    i_hm = i_h // mask_hdiv
    p_keys = KEYS
    if COMPACT:
        p_keys = KEYS + i_b * keys_stride_b + i_hm * keys_stride_h + k_row0
    row = i_b * table_stride_b + i_hm * table_stride_h + i_mb  # in the tile tables
    p_idx = KV_IDX
    if TABLE:
        p_idx = KV_IDX + row * NK
    pos0, n_pos, kb_lo, ki_lo, ki_hi, kb_hi = key_tile_bounds(
        KEY_START, KEY_END, KV_INT, KV_NUM, row, i_b, i_hm, i_mb, n_keys, Lq, table_stride_b,
        table_stride_h, win_left, win_right, BLOCK_M, POS_M, BLOCK_N, IS_CAUSAL, HAS_WINDOW,
        HAS_MASK, COMPACT, LIST_R,
    )  # fmt: skip
    WRAP: tl.constexpr = HAS_WINDOW and not HAS_MASK and not COMPACT
    FULL: tl.constexpr = D == BLOCK_D and Dv == BLOCK_DV
    for run in tl.static_range(2):  # unrolled: run 1's tiles are boundary tiles (constexpr)
        it_lo, it_hi = key_run(run, ki_lo, ki_hi, kb_lo, kb_hi)
        for it in range(it_lo, it_hi):
            kb = run_tile(it, kb_hi, kb_lo, p_idx, WRAP and run == 1, TABLE)
            dq = _dq_tile(
                dq, b_q, b_do, lse_row, lse_rem, delta, i_m, kb, n_keys, Lq, Lk, D, Dv,
                scale, softcap, p_k, stride_kn, stride_kd, p_v, stride_vn, stride_vd,
                p_mask, stride_mm, stride_mn, p_bias, stride_bm, stride_bn, p_dbias,
                win_left, win_right, IS_CAUSAL, HAS_WINDOW, HAS_MASK, HAS_BIAS, HAS_SOFTCAP,
                DBIAS_DIRECT, BLOCK_N, BLOCK_D, BLOCK_DV, DOT_PRECISION, run == 1, p_keys,
                pos0, n_pos, COMPACT, FULL,
            )  # fmt: skip
    # dq is (B, Lq, H, D) or (total_q, H, D), contiguous.
    o_dq = ((q_start + i_m.to(tl.int64)[:, None]) * H + i_hc) * D + i_d[None, :]
    tl.store(
        DQ + o_dq, (dq * scale).to(DQ.dtype.element_ty), mask=m_m[:, None] & (i_d[None, :] < D)
    )
