"""Per-tile activity of a mask: one pass over the mask per call."""

import triton
import triton.language as tl


@triton.jit
def mask_block_any_kernel(
    MASK,
    OUT,
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
):
    """OUT[b, h, qb, kb] = any(mask[b, h, qb*BM:(qb+1)*BM, kb*BN:(kb+1)*BN]), as int8."""
    i_qb = tl.program_id(0)
    i_kb = tl.program_id(1)
    i_bh = tl.program_id(2)
    i_b = (i_bh // Hm).to(tl.int64)
    i_h = (i_bh % Hm).to(tl.int64)
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
    )  # [BM, BN]  fmt: skip
    b_any = tl.max(tl.max((b_mask != 0).to(tl.int32), 1), 0)
    tl.store(OUT + (i_bh.to(tl.int64) * NQm + i_qb) * NK + i_kb, b_any.to(tl.int8))
