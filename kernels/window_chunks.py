"""Copies and merges for a sliding window computed as chunked causal attention (sdpa.py).

A causal window of C = left + 1 keys over L = n * C positions splits into chunks of C rows: each
chunk's queries see their own chunk causally, and the previous chunk's keys above the diagonal,
which in reversed row order is causal again. These kernels reverse the rows of chunks (and add
them back), and merge the two partial results through their logsumexps.
"""

import triton
import triton.language as tl

from dmattn_ops.kernels.common import split_index


@triton.jit
def reverse_rows_kernel(
    SRC,
    DST,
    chunks,
    n_src,
    c_src,
    src_chunk0,
    src_row0,
    n_dst,
    c_dst,
    dst_chunk0,
    dst_row0,
    rows,
    keep,
    width,
    ACCUMULATE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    """For each batch b and chunk t < chunks: DST row dst_row0 + i of chunk dst_chunk0 + t gets
    SRC row src_row0 + rows - 1 - i of chunk src_chunk0 + t, for i < keep, and zeros for keep <= i
    < rows (ACCUMULATE: added to it, in float32). SRC and DST are row-major (B, n * c, width) with
    n_src / n_dst chunks of c_src / c_dst rows; src_row0 may be -1 (the previous chunk's last
    row) for a chunk t past the first. Grid: (row blocks, B * chunks, width blocks)."""
    i_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    i_b = tl.program_id(1) // chunks
    i_t = tl.program_id(1) % chunks
    i_w = tl.program_id(2) * BLOCK_W + tl.arange(0, BLOCK_W)
    m_r = i_r < rows
    src_row = (i_b * n_src + src_chunk0 + i_t).to(tl.int64) * c_src + src_row0 + (rows - 1 - i_r)
    dst_row = (i_b * n_dst + dst_chunk0 + i_t).to(tl.int64) * c_dst + dst_row0 + i_r
    m = m_r[:, None] & (i_w[None, :] < width)
    x = tl.load(
        SRC + src_row[:, None] * width + i_w[None, :], mask=m & (i_r < keep)[:, None], other=0.0
    )
    p_dst = DST + dst_row[:, None] * width + i_w[None, :]
    if ACCUMULATE:
        x = x.to(tl.float32) + tl.load(p_dst, mask=m, other=0.0).to(tl.float32)
    tl.store(p_dst, x.to(DST.dtype.element_ty), mask=m)


@triton.jit
def window_merge_kernel(
    OUT,
    LSE_DIAG,
    OUT_PREV,
    LSE_PREV,
    LSE,
    H,
    L,
    n,
    C,
    D,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Merges the two parts of a chunked window, for BLOCK_R positions of one (batch, head).

    OUT (B, L, H, D) holds the own-chunk part (causal within each chunk of C rows), whose
    logsumexps LSE_DIAG are (B * n, H, C); OUT_PREV (B * (n - 1), C, H, D) and LSE_PREV
    (B * (n - 1), H, C) the previous-chunk part of chunks 1.. in reversed row order: row
    C - 2 - a holds chunk row a, for a < C - 1 (a chunk's last row sees no key of the previous
    chunk; the part's last row is padding). OUT gets the merged rows in place, LSE (B, H, L)
    every row's logsumexp."""
    i_l = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    i_bh = tl.program_id(1)
    i_b, i_h = split_index(i_bh, H)
    i_d = tl.arange(0, BLOCK_D)
    m_l = i_l < L
    t = i_l // C
    a = i_l % C
    lse_d = tl.load(LSE_DIAG + ((i_b * n + t) * H + i_h) * C + a, mask=m_l, other=0.0)
    m_prev = m_l & (t >= 1) & (a < C - 1)
    prev = (i_b * (n - 1) + t - 1) * C + (C - 2 - a)  # its row in OUT_PREV
    lse_p = tl.load(
        LSE_PREV + ((i_b * (n - 1) + t - 1) * H + i_h) * C + (C - 2 - a),
        mask=m_prev,
        other=float("-inf"),
    )
    top = tl.maximum(lse_d, lse_p)
    top = tl.where(top == float("-inf"), 0.0, top)
    w_d = tl.exp(lse_d - top)
    w_p = tl.exp(lse_p - top)
    total = w_d + w_p
    lse = tl.where(total > 0.0, top + tl.log(total), float("-inf"))
    tl.store(LSE + (i_b * H + i_h) * L + i_l, lse, mask=m_l)
    m_tile = m_prev[:, None] & (i_d[None, :] < D)
    p_out = OUT + ((i_b * L + i_l) * H + i_h)[:, None] * D + i_d[None, :]
    o_d = tl.load(p_out, mask=m_tile, other=0.0).to(tl.float32)
    o_p = tl.load(
        OUT_PREV + (prev * H + i_h)[:, None] * D + i_d[None, :], mask=m_tile, other=0.0
    ).to(tl.float32)
    inv = 1.0 / tl.where(total > 0.0, total, 1.0)
    merged = (o_d * (w_d * inv)[:, None]) + (o_p * (w_p * inv)[:, None])
    tl.store(p_out, merged.to(OUT.dtype.element_ty), mask=m_tile)
