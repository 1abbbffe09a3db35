"""Per-tile activity of a mask: one pass over the mask per call."""

import triton
import triton.language as tl

from dmattn_ops.kernels.common import (
    band_key_tiles,
    causal_key_end,
    interior_key_end,
    split_index,
)


@triton.jit
def mask_block_any_kernel(
    MASK,
    OUT,
    SEEN,
    stride_b,
    stride_h,
    stride_m,
    stride_n,
    Hm,
    Lqm,
    Lk,
    NQm,
    NK,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_SEEN: tl.constexpr,
):
    """OUT[b, h, qb, kb] = any(mask[b, h, qb*BM:(qb+1)*BM, kb*BN:(kb+1)*BN]), as int8. HAS_SEEN:
    also SEEN[b, h, j] = 1 (int32, zeroed by the caller) for every key j some query allows, in
    the same pass over the mask (chunked.zero_keys zeroes the others' K/V rows)."""
    i_qb = tl.program_id(0)
    i_kb = tl.program_id(1)
    i_bh = tl.program_id(2)
    i_b, i_h = split_index(i_bh, Hm)
    i_m = i_qb * BLOCK_M + tl.arange(0, BLOCK_M)
    i_n = i_kb * BLOCK_N + tl.arange(0, BLOCK_N)
    b_mask = tl.load(
        MASK
        + i_b * stride_b
        + i_h * stride_h
        + i_m.to(tl.int64)[:, None] * stride_m
        + i_n.to(tl.int64)[None, :] * stride_n,
        mask=(i_m[:, None] < Lqm) & (i_n[None, :] < Lk),
        other=0,
    )  # [BM, BN]
    b_cols = tl.max((b_mask != 0).to(tl.int32), 0)  # [BN]
    b_any = tl.max(b_cols, 0)
    if HAS_SEEN:
        # Every program that stores here stores 1: a plain store suffices (no atomics, which
        # contended at one address per key across the query tiles).
        tl.store(SEEN + i_bh.to(tl.int64) * Lk + i_n, b_cols, mask=b_cols > 0)
    tl.store(OUT + (i_bh.to(tl.int64) * NQm + i_qb) * NK + i_kb, b_any.to(tl.int8))


@triton.jit
def _tile_window(
    qb, kb, n, Lq, win_left, win_right, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
):  # fmt: skip
    """(inside, interior) of tile (qb, kb) for a batch with n keys: inside, the tile holds a key
    some row may see (causality or the window, n); interior, every row < Lq sees every key of
    it. The bounds the attention kernels loop to (common.causal_key_end, interior_key_end,
    band_key_tiles), per tile."""
    m_start = qb * BLOCK_M
    if HAS_WINDOW:
        kb_lo, ki_lo, ki_hi, kb_hi = band_key_tiles(
            m_start, n, Lq, win_left, win_right, BLOCK_M, BLOCK_N
        )
        inside = (kb >= kb_lo) & (kb < kb_hi)
        interior = (kb >= ki_lo) & (kb < ki_hi)
    else:
        m_end = tl.minimum(m_start + BLOCK_M, Lq)
        inside = kb * BLOCK_N < causal_key_end(m_end, n, Lq, IS_CAUSAL)
        interior = kb < interior_key_end(m_start, n, Lq, BLOCK_M, BLOCK_N, IS_CAUSAL)
    return inside, interior


@triton.jit
def tile_rows_kernel(
    ANY,
    SEQUSED,
    ACTIVE,
    KV_NUM,
    KV_IDX,
    KV_INT,
    any_stride_b,
    any_stride_h,
    any_stride_q,
    Hm,
    Lq,
    Lk,
    NQ,
    NK,
    win_left,
    win_right,
    HAS_SEQUSED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    """One program per (table batch, mask head, query tile): its active key tiles (the mask
    allows an entry and the tile is inside the window) in ascending order, how many, and how
    many of the leading ones are interior. Tables are (Bt, Hm, NQ[, NK]) contiguous."""
    qb = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = i_bh // Hm
    i_h = i_bh % Hm
    kb = tl.arange(0, BLOCK_K)
    m_k = kb < NK
    n = Lk
    if HAS_SEQUSED:
        n = tl.minimum(tl.maximum(tl.load(SEQUSED + i_b), 0), Lk)
    any_row = tl.load(
        ANY + i_b * any_stride_b + i_h * any_stride_h + qb * any_stride_q + kb, mask=m_k, other=0
    )
    inside, interior = _tile_window(
        qb, kb, n, Lq, win_left, win_right, BLOCK_M, BLOCK_N, IS_CAUSAL, HAS_WINDOW
    )
    if HAS_WINDOW:
        # The attention kernels take KV_INT interior tiles first; under a window the interior
        # ones sit between boundary tiles, so every tile is read as a boundary tile.
        interior = kb < 0
    active = m_k & (any_row != 0) & inside
    row = i_bh.to(tl.int64) * NQ + qb
    tl.store(ACTIVE + row * NK + kb, active.to(tl.int8), mask=m_k)
    pos = tl.cumsum(active.to(tl.int32), 0) - 1
    tl.store(KV_IDX + row * NK + pos, kb, mask=active)
    tl.store(KV_NUM + row, tl.sum(active.to(tl.int32), 0))
    tl.store(KV_INT + row, tl.sum((active & interior).to(tl.int32), 0))


@triton.jit
def tile_cols_kernel(
    ACTIVE,
    SEQUSED,
    Q_NUM,
    Q_IDX,
    Q_LO,
    Q_HI,
    Hm,
    Lq,
    Lk,
    NQ,
    NK,
    win_left,
    win_right,
    HAS_SEQUSED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    """One program per (table batch, mask head, key tile): its active query tiles in ascending
    order, how many, and the run [q_lo, q_hi) of them that is interior."""
    kb = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = i_bh // Hm
    qb = tl.arange(0, BLOCK_Q)
    m_q = qb < NQ
    n = Lk
    if HAS_SEQUSED:
        n = tl.minimum(tl.maximum(tl.load(SEQUSED + i_b), 0), Lk)
    base = i_bh.to(tl.int64) * NQ
    active = tl.load(ACTIVE + (base + qb) * NK + kb, mask=m_q, other=0) != 0
    _, interior = _tile_window(
        qb, kb, n, Lq, win_left, win_right, BLOCK_M, BLOCK_N, IS_CAUSAL, HAS_WINDOW
    )
    interior = interior & m_q
    first_int = tl.min(tl.where(interior, qb, NQ), 0)
    col = i_bh.to(tl.int64) * NK + kb
    pos = tl.cumsum(active.to(tl.int32), 0) - 1
    tl.store(Q_IDX + col * NQ + pos, qb, mask=active)
    tl.store(Q_NUM + col, tl.sum(active.to(tl.int32), 0))
    q_lo = tl.sum((active & (qb < first_int)).to(tl.int32), 0)
    tl.store(Q_LO + col, q_lo)
    tl.store(Q_HI + col, q_lo + tl.sum((active & interior).to(tl.int32), 0))
