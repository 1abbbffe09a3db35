"""Forward kernel: FlashAttention-2 style online softmax over the key tiles a query tile may see."""

import triton
import triton.language as tl

from dmattn_ops.kernels.common import (
    LOG2E,
    as_fp32,
    dot_acc,
    grid_tile,
    head_rows,
    key_run,
    key_tile_bounds,
    listed_keys,
    load_rows,
    lse_split,
    query_tile,
    row_tile,
    run_tile,
    score_tile,
    tile_batch,
)


@triton.jit
def _fwd_tile(
    acc,
    l_i,
    m_i,
    b_q,
    i_m,
    kb,
    n_keys,
    Lq,
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
    win_left,
    win_right,
    IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
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
    """One key tile of the online softmax, in natural units (so that backward recomputes the
    very scores whose max the forward stored). COMPACT: list positions pos0 + kb * BLOCK_N
    onwards, those below n_pos. FULL: the head dims fill their blocks (load_rows)."""
    i_n, i_r = listed_keys(kb, pos0, n_pos, n_keys, p_keys, BLOCK_N, BOUNDARY, COMPACT)
    i_d = tl.arange(0, BLOCK_D)
    i_dv = tl.arange(0, BLOCK_DV)
    m_n = i_n < n_keys
    o_n = i_r.to(tl.int64)
    # Keys at or beyond n are never loaded (load_rows).
    b_kt = load_rows(  # [BD, BN]
        p_k + o_n[None, :] * stride_kn + i_d[:, None] * stride_kd, m_n[None, :],
        i_d[:, None] < D, BOUNDARY, FULL,
    )  # fmt: skip
    s, _, _ = score_tile(
        b_q, b_kt, i_m[:, None], i_n[None, :], i_r[None, :], n_keys, Lq, scale, softcap,
        p_mask, stride_mm, stride_mn, p_bias, stride_bm, stride_bn, win_left, win_right,
        IS_CAUSAL, HAS_WINDOW, HAS_MASK, HAS_BIAS, HAS_SOFTCAP, DOT_PRECISION, BOUNDARY,
    )  # fmt: skip
    m_new = tl.maximum(m_i, tl.max(s, 1))  # [BM]
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    # Subtract first, then scale by log2(e): (s - m) * log2e cannot overflow for finite s, m
    # (s * log2e can: a bias of finfo.min times log2(e) is past the float32 range).
    alpha = tl.exp2((m_i - m_safe) * LOG2E)  # [BM]
    p = tl.exp2((s - m_safe[:, None]) * LOG2E)  # [BM, BN]
    l_i = l_i * alpha + tl.sum(p, 1)
    b_v = load_rows(  # [BN, BDV]
        p_v + o_n[:, None] * stride_vn + i_dv[None, :] * stride_vd, m_n[:, None],
        i_dv[None, :] < Dv, BOUNDARY, FULL,
    )  # fmt: skip
    acc = dot_acc(p.to(b_v.dtype), b_v, acc * alpha[:, None], DOT_PRECISION)
    return acc, l_i, m_new


@triton.jit
def attention_fwd_kernel(
    Q,
    K,
    V,
    MASK,
    BIAS,
    SEQUSED,
    CU_Q,
    CU_K,
    KV_NUM,
    KV_IDX,
    KV_INT,
    KEYS,
    KEY_START,
    KEY_END,
    OUT,
    LSE,
    LSE_REM,
    SINKS,
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
    COMPACT: tl.constexpr,
    VARLEN: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    PACK_G: tl.constexpr = 1,
    LIST_R: tl.constexpr = 1,
):
    """One program: BLOCK_M queries of one (batch, head). Writes out, lse and lse_rem.

    PACK_G = G > 1 (key lists only): one program takes the G query heads of a KV group at
    BLOCK_M // G positions, row r being position r // G of head r % G: the heads share every K,
    V and bias tile it loads, and a tile spans G times fewer positions. Grid (position tiles,
    B * Hkv); the key lists were built for tiles of BLOCK_M // G positions.

    LIST_R > 1 (key lists only): the lists' ends and starts are per tile of POS_M // LIST_R
    positions (built once for this pass and the dQ pass, at the finer of their tilings); this
    tile reads those of its first and last list tiles (common.key_tile_bounds).

    HAS_SINKS: SINKS (H,) holds a logit per query head that joins every row's denominator as
    a key whose value is 0: the online softmax starts from it (max = sink, sum = 1) instead of
    from nothing, and a sink of -inf starts it from nothing, exactly as without one.

    With a mask, KV_NUM / KV_IDX list the key tiles of this query tile that hold any allowed key
    (KV_INT of them, first in the list, interior)
    (built once per call); tiles outside the list are never loaded. Without one, the loop bound
    comes from causality and seqused_k.

    VARLEN: Q/K/V/OUT are packed (batch strides 0), Lq and Lk arrive as the packed totals, and
    batch b's rows start at cu_seqlens[b]; mask and bias are per key token.

    Query tiles launch last first: under causality the last tiles have the most keys, and
    launching them first leaves the short ones for the tail of the grid; for a causal call
    without window or varlen, each tile over every (batch, head) before the next (grid_tile).
    """
    scale, softcap = as_fp32(scale), as_fp32(softcap)
    i_mb, i_bh = grid_tile(IS_CAUSAL and not HAS_WINDOW and not VARLEN, True)
    POS_M: tl.constexpr = BLOCK_M // PACK_G  # positions per tile
    # cu_seqlens and seqused_k are loaded here, not in a helper (common.seq_extent says why).
    i_b = tile_batch(i_bh, H, PACK_G)
    cu_q = (tl.load(CU_Q + i_b), tl.load(CU_Q + i_b + 1)) if VARLEN else (0, 0)
    cu_k = (tl.load(CU_K + i_b), tl.load(CU_K + i_b + 1)) if VARLEN else (0, 0)
    used = tl.load(SEQUSED + i_b) if HAS_SEQUSED else Lk
    i_b, i_g, i_h, i_hr, i_hc, i_m, _, Lq, n_keys, Lk, k_row0, i_d, i_dv, m_m, o_m = query_tile(
        i_mb, i_bh, cu_q, cu_k, used, Lq, Lk, H, G, BLOCK_M, BLOCK_D, BLOCK_DV, PACK_G,
        HAS_SEQUSED, VARLEN,
    )  # fmt: skip
    b_q = row_tile(Q, i_b, i_hc, o_m, m_m, i_d, stride_qb, stride_qh, stride_qm, stride_qd, D)
    p_k = K + i_b * stride_kb + k_row0 * stride_kn + i_g * stride_kh
    p_v = V + i_b * stride_vb + k_row0 * stride_vn + i_g * stride_vh
    p_mask = MASK
    if HAS_MASK:
        p_mask = MASK + i_b * stride_mb + (i_h // mask_hdiv) * stride_mh + k_row0 * stride_mn
    p_bias = BIAS
    if HAS_BIAS:
        p_bias = BIAS + i_b * stride_bb + (i_h // bias_hdiv) * stride_bh + k_row0 * stride_bn

    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    if HAS_SINKS:
        sink = tl.load(SINKS + i_hr).to(tl.float32)
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + sink
        l_i = tl.where(m_i > float("-inf"), 1.0, 0.0)
    # The key tiles in two runs (common.run_end): the interior ones, then the boundary ones
    # after them and (under a window) before them.
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
            acc, l_i, m_i = _fwd_tile(
                acc, l_i, m_i, b_q, i_m, kb, n_keys, Lq, D, Dv, scale, softcap,
                p_k, stride_kn, stride_kd, p_v, stride_vn, stride_vd,
                p_mask, stride_mm, stride_mn, p_bias, stride_bm, stride_bn, win_left,
                win_right, IS_CAUSAL, HAS_WINDOW, HAS_MASK, HAS_BIAS, HAS_SOFTCAP,
                BLOCK_N, BLOCK_D, BLOCK_DV, DOT_PRECISION, run == 1, p_keys, pos0, n_pos,
                COMPACT, FULL,
            )  # fmt: skip

    nonempty = l_i > 0.0
    l_safe = tl.where(nonempty, l_i, 1.0)
    b_out = acc / l_safe[:, None]
    lse, lse_rem = lse_split(tl.where(nonempty, m_i, 0.0), tl.log(l_safe), nonempty)
    tl.store(
        OUT + i_b * stride_ob + i_hc * stride_oh + o_m[:, None] * stride_om
        + i_dv[None, :] * stride_od,
        b_out.to(OUT.dtype.element_ty),
        mask=m_m[:, None] & (i_dv[None, :] < Dv),
    )  # fmt: skip
    o_row = i_b * lse_stride_b + i_hr * lse_stride_h + o_m
    tl.store(LSE + o_row, lse, mask=m_m)
    tl.store(LSE_REM + o_row, lse_rem, mask=m_m)


@triton.jit
def sinks_join_kernel(
    OUT,
    LSE,
    LSE_REM,
    SINKS,
    H,
    Lq,
    Dv,
    stride_ob,
    stride_om,
    stride_oh,
    stride_od,
    BLOCK_M: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """Joins sinks to a result computed without them, in place (chunked.join_sinks in one
    pass; for PyTorch's fused kernels, sdpa.py): lse' = log(exp(lse + lse_rem) + exp(sinks[h]))
    split as lse_split does, and each row of OUT scaled by exp(lse - lse'). A sink of -inf
    changes nothing. OUT (B, Lq, H, Dv); LSE, LSE_REM (B, H, Lq) contiguous. Grid: (query row
    blocks, B * H)."""
    p_out, m, m_m, o_row = head_rows(
        OUT, H, Lq, Dv, stride_ob, stride_om, stride_oh, stride_od, BLOCK_M, BLOCK_DV
    )
    lse = tl.load(LSE + o_row, mask=m_m, other=float("-inf"))
    lse_rem = tl.load(LSE_REM + o_row, mask=m_m, other=0.0)
    sink = tl.load(SINKS + tl.program_id(1) % H).to(tl.float32)
    has_sink = sink > float("-inf")
    # Without a sink the row is kept as it is (below); its placeholders keep the arithmetic
    # finite: a sink of 0 and no mass in the row.
    sink_s = tl.where(has_sink, sink, 0.0)
    lse_s = tl.where(has_sink, lse, float("-inf"))
    top = tl.maximum(lse_s, sink_s)  # finite; the sum of the exponentials below is >= 1
    log_sum = tl.log(tl.exp((lse_s - top) + lse_rem) + tl.exp(sink_s - top))
    new_lse, new_rem = lse_split(top, log_sum, True)
    # exp(-inf) = 0 for a row with no key; the exponent is <= 0 in exact arithmetic.
    weight = tl.exp(tl.minimum((lse - new_lse) + (lse_rem - new_rem), 0.0))
    weight = tl.where(has_sink, weight, 1.0)
    tl.store(LSE + o_row, tl.where(has_sink, new_lse, lse), mask=m_m)
    tl.store(LSE_REM + o_row, tl.where(has_sink, new_rem, lse_rem), mask=m_m)
    b_o = tl.load(p_out, mask=m, other=0.0).to(tl.float32)
    tl.store(p_out, (b_o * weight[:, None]).to(OUT.dtype.element_ty), mask=m)
