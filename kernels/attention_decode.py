"""Split-K forward for decoding: a few queries against a long KV cache.

With Lq <= 16, one program per (batch, head) leaves most of an H100 idle when B * H is small,
and each query head reads the whole cache of its KV group again. Here one program owns the
G * Lq query rows of one KV group (K and V are read once for all of them) and one slice of
the keys; partial (acc, max, sum) triples are merged afterwards by `decode_combine_kernel`
with their log-sum-exp weights.
"""

import triton
import triton.language as tl

from dmattn_ops.kernels.attention_fwd import _fwd_tile
from dmattn_ops.kernels.common import (
    LOG2E,
    as_fp32,
    band_key_tiles,
    causal_key_end,
    key_count,
    lse_split,
    split_index,
)


@triton.jit
def attention_decode_kernel(
    Q,
    K,
    V,
    BIAS,
    SEQUSED,
    KEYS,
    KEY_START,
    KEY_END,
    ACC,
    M,
    L,
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
    stride_bb,
    stride_bh,
    stride_bm,
    stride_bn,
    keys_stride_b,
    keys_stride_h,
    end_stride_b,
    end_stride_h,
    H,
    G,
    Lq,
    Lk,
    D,
    Dv,
    n_rows,
    keys_per_split,
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
    HAS_BIAS: tl.constexpr,
    HAS_SEQUSED: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    COMPACT: tl.constexpr,
):
    """One program: the G * Lq rows (head-major) of one (batch, KV group), keys_per_split keys
    (or allowed-key-list positions, COMPACT) of split program_id(0). Writes ACC (S, rows, Dv),
    M and L (S, rows) float32, rows indexed (b * H + h) * Lq + q; splits with no keys write
    (0, -inf, 0)."""
    scale, softcap = as_fp32(scale), as_fp32(softcap)
    i_s = tl.program_id(0)
    i_bg = tl.program_id(1)
    Hkv = H // G
    i_b, i_g = split_index(i_bg, Hkv)
    n_keys = key_count(SEQUSED, i_b, Lk, HAS_SEQUSED)

    r = tl.arange(0, BLOCK_M)
    valid = r < G * Lq
    i_h = i_g * G + (r // Lq).to(tl.int64)  # [BM]
    i_q = tl.where(valid, r % Lq, Lq)  # padding rows sit past the last query: never allowed
    i_d = tl.arange(0, BLOCK_D)
    i_dv = tl.arange(0, BLOCK_DV)
    b_q = tl.load(
        Q
        + i_b * stride_qb
        + i_h[:, None] * stride_qh
        + i_q.to(tl.int64)[:, None] * stride_qm
        + i_d[None, :] * stride_qd,
        mask=valid[:, None] & (i_d[None, :] < D),
        other=0.0,
    )  # [BM, BD]
    p_k = K + i_b * stride_kb + i_g * stride_kh
    p_v = V + i_b * stride_vb + i_g * stride_vh
    p_bias = BIAS
    if HAS_BIAS:
        # One base pointer per row: the rows span the G heads of the group.
        p_bias = (BIAS + i_b * stride_bb + (i_h // bias_hdiv) * stride_bh)[:, None]

    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    # The splits cover keys (list positions, COMPACT) from `base` on; under a window, base is
    # where the band of the first query starts (rounded down to a tile), so that splits are
    # sized by the band, not by the cache.
    base = 0
    p_keys = KEYS
    if COMPACT:
        i_hm = (i_g * G) // mask_hdiv
        p_keys = KEYS + i_b * keys_stride_b + i_hm * keys_stride_h
        end = tl.load(KEY_END + i_b * end_stride_b + i_hm * end_stride_h)
        if HAS_WINDOW:
            base = tl.load(KEY_START + i_b * end_stride_b + i_hm * end_stride_h)
    elif HAS_WINDOW:
        kb_lo, _kb_int_lo, _kb_int_hi, kb_hi = band_key_tiles(
            0, n_keys, Lq, win_left, win_right, Lq, BLOCK_N
        )
        base = kb_lo * BLOCK_N
        end = kb_hi * BLOCK_N
    else:
        end = causal_key_end(Lq, n_keys, Lq, IS_CAUSAL)
    # keys_per_split is a multiple of BLOCK_N: the splits' tiles never overlap.
    start = base + i_s * keys_per_split
    end = tl.minimum(end, start + keys_per_split)
    for kb in range((start - base) // BLOCK_N, tl.cdiv(end - base, BLOCK_N)):
        acc, l_i, m_i = _fwd_tile(
            acc, l_i, m_i, b_q, i_q, kb, n_keys, Lq, D, Dv,
            scale, softcap, p_k, stride_kn, stride_kd, p_v, stride_vn, stride_vd,
            BIAS, 0, 0, p_bias, stride_bm, stride_bn, win_left, win_right,
            IS_CAUSAL, HAS_WINDOW, False, HAS_BIAS, HAS_SOFTCAP,
            BLOCK_N, BLOCK_D, BLOCK_DV, DOT_PRECISION, True, p_keys, base, end, COMPACT, False,
        )  # fmt: skip
    row = (i_b * H + i_h) * Lq + i_q
    o_split = i_s.to(tl.int64) * n_rows
    tl.store(
        ACC + (o_split + row)[:, None] * Dv + i_dv[None, :],
        acc,
        mask=valid[:, None] & (i_dv[None, :] < Dv),
    )
    tl.store(M + o_split + row, m_i, mask=valid)
    tl.store(L + o_split + row, l_i, mask=valid)


@triton.jit
def decode_combine_kernel(
    ACC,
    M,
    L,
    OUT,
    LSE,
    LSE_REM,
    SINKS,
    n_rows,
    S,
    H,
    Lq,
    Dv,
    stride_ob,
    stride_om,
    stride_oh,
    stride_od,
    BLOCK_S: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    """One program per row (b * H + h) * Lq + q: merges the S partial results of the row.
    HAS_SINKS: SINKS (H,) joins as one more part with max sinks[h], sum 1 and no value (a row
    with no key then has out 0 and lse sinks[h]; a sink of -inf is no part)."""
    row = tl.program_id(0).to(tl.int64)
    i_b = row // (H * Lq)
    i_h = (row // Lq) % H
    i_q = row % Lq
    s = tl.arange(0, BLOCK_S)
    m_s = s < S
    o = s.to(tl.int64) * n_rows + row
    m = tl.load(M + o, mask=m_s, other=float("-inf"))
    l_part = tl.load(L + o, mask=m_s, other=0.0)
    m_max = tl.max(m, 0)
    if HAS_SINKS:
        sink = tl.load(SINKS + i_h).to(tl.float32)
        m_max = tl.maximum(m_max, sink)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2((m - m_safe) * LOG2E)  # 0 for splits without keys
    l_sum = tl.sum(w * l_part, 0)
    if HAS_SINKS:
        l_sum += tl.exp2((sink - m_safe) * LOG2E)  # 0 for a sink of -inf
    i_dv = tl.arange(0, BLOCK_DV)
    acc = tl.load(
        ACC + o[:, None] * Dv + i_dv[None, :], mask=m_s[:, None] & (i_dv[None, :] < Dv), other=0.0
    )
    nonempty = l_sum > 0.0
    l_safe = tl.where(nonempty, l_sum, 1.0)
    out = tl.sum(acc * w[:, None], 0) / l_safe
    tl.store(
        OUT + i_b * stride_ob + i_h * stride_oh + i_q * stride_om + i_dv * stride_od,
        out.to(OUT.dtype.element_ty),
        mask=i_dv < Dv,
    )
    lse, lse_rem = lse_split(m_safe, tl.log(l_safe), nonempty)
    tl.store(LSE + row, lse)
    tl.store(LSE_REM + row, lse_rem)
