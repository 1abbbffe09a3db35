"""Backward, dK and dV (and the per-key column sums of dS that give dbias): one program per key
tile, over the query tiles that see it; the split form and its reduction (attention_bwd_stats
says how P is recomputed)."""

import triton
import triton.language as tl

from dmattn_ops.kernels.attention_bwd_stats import _probs, _row_stats
from dmattn_ops.kernels.common import (
    as_fp32,
    band_query_tiles,
    dot,
    dot_acc,
    grid_tile,
    load_rows,
    run_end,
    run_tile,
    score_tile,
    seq_extent,
    split_index,
)


@triton.jit
def _dkdv_tile(
    dk,
    dv,
    dbias_col,
    b_k,
    b_v,
    i_n,
    qb,
    n_keys,
    Lq,
    D,
    Dv,
    scale,
    softcap,
    p_q,
    stride_qm,
    stride_qd,
    p_do,
    stride_dom,
    stride_dod,
    STATS,
    row_base,
    p_mask,
    stride_mm,
    stride_mn,
    p_bias,
    stride_bm,
    stride_bn,
    win_left,
    win_right,
    IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    DBIAS_COLS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BOUNDARY: tl.constexpr,
    FULL: tl.constexpr,
):
    """One query tile against this program's key tile, in transposed form: S^T = K Q^T is
    [BN, BM], so P^T and dS^T are the left operands of the dV and dK products as they stand
    (no transpose of a register tile through shared memory)."""
    i_r = tl.arange(0, BLOCK_M)
    i_m = qb * BLOCK_M + i_r
    i_d = tl.arange(0, BLOCK_D)
    i_dv = tl.arange(0, BLOCK_DV)
    m_m = i_m < Lq
    o_m = i_m.to(tl.int64)
    if BLOCK_M <= 32:
        # A 64-bit tile base and 32-bit offsets within the tile: the offsets are loop-invariant
        # and stay in registers across the loop, where 64-bit ones took twice as many (the
        # kernel spilled 644 bytes per thread at the model's call, 388 with these; dk/dv -9% at
        # B4 L2048). 64-query tiles ran 5% slower with them.
        o_q0 = tl.cast(qb * BLOCK_M, tl.int64)
        p_qt = p_q + o_q0 * stride_qm + (i_r[None, :] * stride_qm + i_d[:, None] * stride_qd)
        p_dot = p_do + o_q0 * stride_dom + (i_r[:, None] * stride_dom + i_dv[None, :] * stride_dod)
    else:
        p_qt = p_q + o_m[None, :] * stride_qm + i_d[:, None] * stride_qd
        p_dot = p_do + o_m[:, None] * stride_dom + i_dv[None, :] * stride_dod
    b_qt = load_rows(p_qt, m_m[None, :], i_d[:, None] < D, BOUNDARY, FULL)  # [BD, BM]
    b_do = load_rows(p_dot, m_m[:, None], i_dv[None, :] < Dv, BOUNDARY, FULL)  # [BM, BDV]
    lse_row, lse_rem, delta = _row_stats(STATS, row_base + o_m, m_m, True)
    s, m_allowed, t = score_tile(
        b_k, b_qt, i_m[None, :], i_n[:, None], i_n[:, None], n_keys, Lq, scale, softcap,
        p_mask, stride_mm, stride_mn, p_bias, stride_bm, stride_bn, win_left, win_right,
        IS_CAUSAL, HAS_WINDOW, HAS_MASK, HAS_BIAS, HAS_SOFTCAP, DOT_PRECISION, BOUNDARY,
    )  # fmt: skip
    p = _probs(s, lse_row[None, :], lse_rem[None, :])  # [BN, BM]
    dv = dot_acc(p.to(b_do.dtype), b_do, dv, DOT_PRECISION)
    dp = dot(b_v, tl.trans(b_do), DOT_PRECISION)  # [BN, BM]
    ds = p * (dp - delta[None, :])
    if BOUNDARY or HAS_MASK:
        ds = tl.where(m_allowed, ds, 0.0)
    if DBIAS_COLS:
        dbias_col += tl.sum(ds, 1)
    if HAS_SOFTCAP:
        ds = ds * (1.0 - t * t)
    dk = dot_acc(ds.to(b_qt.dtype), tl.trans(b_qt), dk, DOT_PRECISION)
    return dk, dv, dbias_col


@triton.jit
def attention_bwd_dkdv_kernel(
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
    Q_NUM,
    Q_IDX,
    Q_LO,
    Q_HI,
    KEYS,
    KEY_COUNT,
    DK,
    DV,
    DBIAS_COL,
    PART_DK,
    PART_DV,
    PART_DB,
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
    keys_stride_b,
    keys_stride_h,
    count_stride_b,
    lse_stride_b,
    lse_stride_h,
    col_stride_b,
    col_stride_h,
    H,
    Hkv,
    G,
    Lq,
    Lk,
    D: tl.constexpr,
    Dv: tl.constexpr,
    NQ,
    mask_hdiv,
    bias_hdiv,
    scale,
    softcap,
    SPLIT,
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
    DBIAS_COLS: tl.constexpr,
    GROUP_COLS: tl.constexpr,
    COMPACT: tl.constexpr,
    ZERO_UNLISTED: tl.constexpr,
    VARLEN: tl.constexpr,
    PARTIAL: tl.constexpr,
):
    """One program: BLOCK_N keys of one (batch, KV head) and G / SPLIT query heads of its group;
    sums dk/dv over those heads. With a bias broadcast over queries it also writes the column
    sums of dS: per query head into DBIAS_COL (B, H, Lk) float32 (varlen: (H, total_k)), or,
    GROUP_COLS (a bias per KV head), summed over the group into DBIAS_COL (B, Hkv, Lk) in the
    bias's dtype: the bias gradient itself.

    SPLIT == 1 (PARTIAL False) stores dk, dv into DK, DV. Otherwise the SPLIT programs of a key
    tile each store their float32 sums into PART_DK / PART_DV (SPLIT, B * Hkv, Lk, D|Dv) and,
    GROUP_COLS, PART_DB (SPLIT, B * Hkv, Lk) at the tile's rows (list positions with COMPACT),
    and attention_bwd_dkdv_reduce_kernel adds them in split order: more programs for small
    grids, no atomics, bitwise reproducible.

    ZERO_UNLISTED (COMPACT, batched): the key list is a permutation of the keys, the listed
    ones first (key_lists.py key_lists_kernel); rows at list positions past KEY_COUNT are keys
    no query sees, and get zeros here (dk, dv and the column sums), so the launcher allocates
    nothing with a fill.

    VARLEN as in the forward kernel. A mask that is not compacted is then read per tile (it is
    per key token, so there are no tile tables)."""
    scale, softcap = as_fp32(scale), as_fp32(softcap)
    # Under causality the first key tiles see the most query tiles: each key tile over every
    # (batch, KV head, part) before the next, longest first (grid_tile).
    i_nb, i_row = grid_tile(IS_CAUSAL and not HAS_WINDOW and not VARLEN, False)
    i_bg = i_row // SPLIT
    i_split = i_row % SPLIT
    G_PART = G // SPLIT
    i_b, i_g = split_index(i_bg, Hkv)
    # cu_seqlens and seqused_k are loaded here, not in a helper (common.seq_extent says why).
    cu_q = (tl.load(CU_Q + i_b), tl.load(CU_Q + i_b + 1)) if VARLEN else (0, 0)
    cu_k = (tl.load(CU_K + i_b), tl.load(CU_K + i_b + 1)) if VARLEN else (0, 0)
    used = tl.load(SEQUSED + i_b) if HAS_SEQUSED else Lk
    q_start, Lq, k_start, n_keys, Lk = seq_extent(
        cu_q, cu_k, used, i_b, Lq, Lk, HAS_SEQUSED, VARLEN
    )
    if VARLEN:
        q_row0 = q_start
        k_row0 = k_start
        NQ = tl.cdiv(Lq, BLOCK_M)
    else:
        q_row0 = 0
        k_row0 = 0

    i_n = i_nb * BLOCK_N + tl.arange(0, BLOCK_N)
    n_pos = 0
    j_first = 0
    p_keys = KEYS
    if COMPACT:
        # BLOCK_N consecutive entries of the sorted allowed-key list of this KV group (the
        # launcher compacts only masks whose head dim is 1 or Hkv). Unlisted keys keep the
        # zeros the launcher put in dk/dv.
        i_hm = (i_g * G) // mask_hdiv
        p_keys = KEYS + i_b * keys_stride_b + i_hm * keys_stride_h + k_row0
        n_pos = tl.load(KEY_COUNT + i_b * count_stride_b + i_hm)
        m_pos = i_n < n_pos
        j_first = tl.load(p_keys + i_nb * BLOCK_N, mask=i_nb * BLOCK_N < n_pos, other=0)
        i_n = tl.load(p_keys + i_n, mask=m_pos, other=Lk)
    i_d = tl.arange(0, BLOCK_D)
    i_dv = tl.arange(0, BLOCK_DV)
    m_n = i_n < n_keys
    o_n = i_n.to(tl.int64)
    p_k = K + i_b * stride_kb + k_row0 * stride_kn + i_g * stride_kh
    b_k = tl.load(
        p_k + o_n[:, None] * stride_kn + i_d[None, :] * stride_kd,
        mask=m_n[:, None] & (i_d[None, :] < D),
        other=0.0,
    )  # [BN, BD]
    b_v = tl.load(
        V
        + i_b * stride_vb
        + i_g * stride_vh
        + (k_row0 + o_n[:, None]) * stride_vn
        + i_dv[None, :] * stride_vd,
        mask=m_n[:, None] & (i_dv[None, :] < Dv),
        other=0.0,
    )  # [BN, BDV]
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    dbias_group = tl.zeros([BLOCK_N], dtype=tl.float32)
    # Where each row is stored: its key, or with ZERO_UNLISTED, for list positions past the
    # count, the unlisted key the permutation holds there (its rows stay 0).
    i_out = i_n
    if ZERO_UNLISTED:
        i_pos = i_nb * BLOCK_N + tl.arange(0, BLOCK_N)
        i_out = tl.load(p_keys + i_pos, mask=i_pos < Lk, other=Lk)

    FULL: tl.constexpr = D == BLOCK_D and Dv == BLOCK_DV  # load_rows
    for hh in range(i_split * G_PART, (i_split + 1) * G_PART):
        i_h = i_g * G + hh
        p_q = Q + i_b * stride_qb + q_row0 * stride_qm + i_h * stride_qh
        p_do = DO + i_b * stride_dob + q_row0 * stride_dom + i_h * stride_doh
        p_mask = MASK
        if HAS_MASK:
            p_mask = MASK + i_b * stride_mb + (i_h // mask_hdiv) * stride_mh + k_row0 * stride_mn
        p_bias = BIAS
        if HAS_BIAS:
            p_bias = BIAS + i_b * stride_bb + (i_h // bias_hdiv) * stride_bh + k_row0 * stride_bn
        row_base = i_b * lse_stride_b + i_h * lse_stride_h + q_row0
        dbias_col = tl.zeros([BLOCK_N], dtype=tl.float32)
        # The query tiles in two runs (common.run_end).
        p_idx = Q_IDX
        TABLE: tl.constexpr = HAS_MASK and not VARLEN and not COMPACT
        if TABLE:
            # The tile table lists the query tiles that see any key of this tile; [Q_LO, Q_HI)
            # of the list are interior (unpredicated mask and bias loads).
            col = i_b * table_stride_b + (i_h // mask_hdiv) * table_stride_h + i_nb
            p_idx = Q_IDX + col * NQ
            qb_lo, qi_lo = 0, tl.load(Q_LO + col)
            qi_hi, qb_hi = tl.load(Q_HI + col), tl.load(Q_NUM + col)
        else:
            # Boundary tiles before the first one whose rows all see the whole key tile, the
            # interior tiles, boundary tiles after the last full one; nothing past seqused_k.
            # A tile of listed keys (COMPACT) spans its first and last key; one with unused
            # list entries has no interior run.
            if COMPACT:
                k_lo = j_first
                k_hi = tl.max(i_n, 0)
                k_any = i_nb * BLOCK_N < n_pos
                k_full = (i_nb + 1) * BLOCK_N <= n_pos
            else:
                k_lo = i_nb * BLOCK_N
                k_hi = k_lo + BLOCK_N - 1
                k_any = k_lo < n_keys
                k_full = k_lo + BLOCK_N <= n_keys
            if HAS_WINDOW:
                qb_lo, qi_lo, qi_hi, qb_hi = band_query_tiles(
                    k_lo, k_hi, k_full, NQ, n_keys, Lq, win_left, win_right, BLOCK_M
                )
                qb_hi = tl.where(k_any, qb_hi, qb_lo)
                qi_lo = tl.minimum(qi_lo, qb_hi)
                qi_hi = tl.minimum(qi_hi, qb_hi)
            else:
                qb_lo = 0
                qi_lo = 0
                if IS_CAUSAL:
                    qb_lo = tl.maximum(k_lo - n_keys + Lq, 0) // BLOCK_M
                    qi_lo = tl.cdiv(tl.maximum(k_hi - n_keys + Lq, 0), BLOCK_M)
                qb_hi = tl.where(k_any, NQ, 0)
                qi_hi = tl.where(k_full, Lq // BLOCK_M, 0)
                qi_lo = tl.minimum(tl.maximum(qi_lo, qb_lo), qb_hi)
                qi_hi = tl.minimum(tl.maximum(qi_hi, qi_lo), qb_hi)
        # The boundary run first: the tiles before the interior ones (the diagonal, under
        # causality), then those after them; the interior run last.
        for run in tl.static_range(2):  # unrolled: run 0's tiles are boundary tiles
            it_lo, it_hi = qi_lo, qi_hi
            if run == 0:
                it_lo, it_hi = qb_lo, run_end(qi_lo, qi_hi, qb_hi)
            for it in range(it_lo, it_hi):
                qb = run_tile(it, qi_lo, qi_hi, p_idx, run == 0, TABLE)
                dk, dv, dbias_col = _dkdv_tile(
                    dk, dv, dbias_col, b_k, b_v, i_n, qb, n_keys, Lq, D, Dv, scale, softcap,
                    p_q, stride_qm, stride_qd, p_do, stride_dom, stride_dod, STATS, row_base,
                    p_mask, stride_mm, stride_mn, p_bias, stride_bm, stride_bn, win_left,
                    win_right, IS_CAUSAL, HAS_WINDOW, HAS_MASK, HAS_BIAS, HAS_SOFTCAP,
                    DBIAS_COLS, BLOCK_M, BLOCK_D, BLOCK_DV, DOT_PRECISION, run == 0, FULL,
                )  # fmt: skip
        if GROUP_COLS:
            dbias_group += dbias_col
        elif DBIAS_COLS:
            if ZERO_UNLISTED:
                dbias_col = tl.where(i_nb * BLOCK_N + tl.arange(0, BLOCK_N) < n_pos, dbias_col, 0.0)
            o_col = i_b * col_stride_b + i_h * col_stride_h + k_row0 + i_out.to(tl.int64)
            tl.store(DBIAS_COL + o_col, dbias_col, mask=i_out < Lk)

    if PARTIAL:
        i_r = i_nb * BLOCK_N + tl.arange(0, BLOCK_N)
        m_r = i_r < (n_pos if COMPACT else Lk)
        n_bg = tl.num_programs(1) // SPLIT
        o_p = (i_split * n_bg + i_bg).to(tl.int64) * Lk + i_r
        o_r = o_p[:, None]
        tl.store(
            PART_DK + o_r * D + i_d[None, :], dk * scale, mask=m_r[:, None] & (i_d[None, :] < D)
        )
        tl.store(PART_DV + o_r * Dv + i_dv[None, :], dv, mask=m_r[:, None] & (i_dv[None, :] < Dv))
        if GROUP_COLS:
            tl.store(PART_DB + o_p, dbias_group, mask=m_r)
    else:
        m_store = i_out < Lk
        o_out = i_out.to(tl.int64)
        if ZERO_UNLISTED:
            # Past the count the accumulators hold exact zeros (no score was allowed there);
            # cleared anyway, so that no product of a skipped key can reach a stored row.
            m_pos = (i_nb * BLOCK_N + tl.arange(0, BLOCK_N)) < n_pos
            dk = tl.where(m_pos[:, None], dk, 0.0)
            dv = tl.where(m_pos[:, None], dv, 0.0)
            dbias_group = tl.where(m_pos, dbias_group, 0.0)
        if GROUP_COLS:
            o_col = i_b * col_stride_b + i_g * col_stride_h + k_row0 + o_out
            tl.store(DBIAS_COL + o_col, dbias_group.to(DBIAS_COL.dtype.element_ty), mask=m_store)
        # dk, dv are (B, Lk, Hkv, D|Dv) contiguous.
        o_kv = (k_start + o_out[:, None]) * Hkv + i_g
        o_dk = o_kv * D + i_d[None, :]
        tl.store(
            DK + o_dk,
            (dk * scale).to(DK.dtype.element_ty),
            mask=m_store[:, None] & (i_d[None, :] < D),
        )
        o_dv = o_kv * Dv + i_dv[None, :]
        tl.store(
            DV + o_dv, dv.to(DV.dtype.element_ty), mask=m_store[:, None] & (i_dv[None, :] < Dv)
        )


@triton.jit
def attention_bwd_dkdv_reduce_kernel(
    PART_DK,
    PART_DV,
    PART_DB,
    KEYS,
    KEY_COUNT,
    DK,
    DV,
    DBIAS,
    keys_stride_b,
    keys_stride_h,
    count_stride_b,
    dbias_stride_b,
    dbias_stride_h,
    Hkv,
    G,
    Lk,
    D,
    Dv,
    mask_hdiv,
    SPLIT: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    COMPACT: tl.constexpr,
    GROUP_COLS: tl.constexpr,
):
    """dk, dv (and, GROUP_COLS, the bias gradient (B, Hkv, Lk) in DBIAS's dtype) = the sums of
    attention_bwd_dkdv_kernel's SPLIT float32 parts, in split order, for BLOCK_R rows of one
    (batch, KV head), cast and stored at their keys. With COMPACT the rows are list positions
    of a key permutation (the dkdv kernel's ZERO_UNLISTED): those past the count are keys no
    query sees, stored as zeros."""
    i_rb = tl.program_id(0)
    i_bg = tl.program_id(1)
    n_bg = tl.num_programs(1)
    i_b, i_g = split_index(i_bg, Hkv)
    i_r = i_rb * BLOCK_R + tl.arange(0, BLOCK_R)
    i_d = tl.arange(0, BLOCK_D)
    i_dv = tl.arange(0, BLOCK_DV)
    m_r = i_r < Lk
    m_sum = m_r
    i_n = i_r
    if COMPACT:
        i_hm = (i_g * G) // mask_hdiv
        m_sum = i_r < tl.load(KEY_COUNT + i_b * count_stride_b + i_hm)
        i_n = tl.load(KEYS + i_b * keys_stride_b + i_hm * keys_stride_h + i_r, mask=m_r, other=0)
    dk = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_R, BLOCK_DV], dtype=tl.float32)
    db = tl.zeros([BLOCK_R], dtype=tl.float32)
    # Unrolled (SPLIT is a constexpr): every part's loads are issued before the first add, not
    # one round trip per part.
    for i_split in tl.static_range(SPLIT):
        o_p = (i_split * n_bg + i_bg).to(tl.int64) * Lk + i_r
        o_r = o_p[:, None]
        dk += tl.load(
            PART_DK + o_r * D + i_d[None, :], mask=m_sum[:, None] & (i_d[None, :] < D), other=0.0
        )
        dv += tl.load(
            PART_DV + o_r * Dv + i_dv[None, :],
            mask=m_sum[:, None] & (i_dv[None, :] < Dv),
            other=0.0,
        )
        if GROUP_COLS:
            db += tl.load(PART_DB + o_p, mask=m_sum, other=0.0)
    o_n = i_n.to(tl.int64)
    o_kv = ((i_b * Lk + o_n) * Hkv + i_g)[:, None]
    tl.store(
        DK + o_kv * D + i_d[None, :],
        dk.to(DK.dtype.element_ty),
        mask=m_r[:, None] & (i_d[None, :] < D),
    )
    tl.store(
        DV + o_kv * Dv + i_dv[None, :],
        dv.to(DV.dtype.element_ty),
        mask=m_r[:, None] & (i_dv[None, :] < Dv),
    )
    if GROUP_COLS:
        o_db = i_b * dbias_stride_b + i_g * dbias_stride_h + o_n
        tl.store(DBIAS + o_db, db.to(DBIAS.dtype.element_ty), mask=m_r)
