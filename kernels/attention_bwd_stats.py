"""Backward kernels. P is recomputed as exp((s - lse) - lse_rem).

lse_rem = (max + log_sum) - lse is what rounding lse to float32 dropped (common.lse_split).
Carrying it keeps P exact when the row max is huge: with a bias of finfo(bf16).min on every
allowed key, lse = max + log(L) rounds to max in float32 and exp(s - lse) alone would be 1
instead of 1 / L; with logits of 1e6, lse's rounding alone would be a relative error of 3%.

No kernel here uses atomics: every output element is written by exactly one program, so
gradients are bitwise reproducible.
"""

import triton
import triton.language as tl

from dmattn_ops.kernels.common import (
    LOG2E,
    head_rows,
)


@triton.jit
def _row_stats(STATS, o_row, m_m, VECTOR: tl.constexpr):
    """Per query row: (lse, lse_rem, delta) for _probs, from the float32 rows [lse, lse_rem,
    delta, 0] the dq kernel writes (_dq_row_stats; lse already 0 where it was -inf: such a row
    has no allowed key, and every score of it is -inf).

    VECTOR: one 16-byte load per row, for the dk/dv kernel's transposed tiles, where the rows
    are columns and each thread holds many of them: three vector loads there made Triton 3.6
    copy every column a thread holds on its own, 48 four-byte copies per thread and query tile
    against 2. Kernels whose rows are tile rows (dq) keep three loads:
    the 16-byte one costs their packed-keys call 4% there."""
    if VECTOR:
        i_c = tl.arange(0, 4)
        st = tl.load(STATS + o_row[:, None] * 4 + i_c[None, :], mask=m_m[:, None], other=0.0)
        even, odd = tl.split(tl.reshape(st, [o_row.shape[0], 2, 2]))  # [lse, delta], [lse_rem, 0]
        lse, delta = tl.split(even)
        lse_rem, _ = tl.split(odd)
    else:
        o_st = o_row * 4
        lse = tl.load(STATS + o_st, mask=m_m, other=0.0)
        lse_rem = tl.load(STATS + o_st + 1, mask=m_m, other=0.0)
        delta = tl.load(STATS + o_st + 2, mask=m_m, other=0.0)
    return lse, lse_rem, delta


@triton.jit
def _dq_row_stats(
    STATS, LSE, LSE_REM, GRAD_LSE, b_o, b_do, o_row, o_grad, m_m, HAS_GRAD_LSE: tl.constexpr
):  # fmt: skip
    """The row statistics of BLOCK_M query rows, which the dq kernel computes first and the
    kernels launched after it read (_row_stats): delta = rowsum(dO * O) - grad_lse, lse (0
    where the forward stored -inf) and lse_rem from the forward's LSE and LSE_REM (contiguous,
    rows o_row), stored as float32 rows [lse, lse_rem, delta, 0] of STATS. Returns (lse,
    lse_rem, delta). Computed here instead of in a kernel of their own: the dq program already
    holds dO."""
    delta = tl.sum(b_o.to(tl.float32) * b_do.to(tl.float32), 1)
    if HAS_GRAD_LSE:
        delta -= tl.load(GRAD_LSE + o_grad, mask=m_m, other=0.0)
    lse = tl.load(LSE + o_row, mask=m_m, other=0.0)
    lse = tl.where(lse == float("-inf"), 0.0, lse)
    lse_rem = tl.load(LSE_REM + o_row, mask=m_m, other=0.0)
    o_st = o_row * 4
    tl.store(STATS + o_st, lse, mask=m_m)
    tl.store(STATS + o_st + 1, lse_rem, mask=m_m)
    tl.store(STATS + o_st + 2, delta, mask=m_m)
    tl.store(STATS + o_st + 3, tl.zeros_like(delta), mask=m_m)
    return lse, lse_rem, delta


@triton.jit
def _probs(s, lse, lse_rem):
    """P = exp((s - lse) - lse_rem) (broadcast by the caller to s's orientation). s - lse is
    exact near the row max, and lse_rem carries what lse's rounding dropped. The exponent is
    at most 0 in exact arithmetic (s <= max <= lse + lse_rem); clamping it there keeps P <= 1
    when a recomputed score differs from the forward's by a rounding at huge logits."""
    return tl.exp2(tl.minimum((s - lse) - lse_rem, 0.0) * LOG2E)


@triton.jit
def attention_bwd_sinks_kernel(
    SINKS,
    STATS,
    DSINKS,
    B,
    H,
    Lq,
    BLOCK: tl.constexpr,
):
    """dsinks[h] = -sum over (b, i) of exp(sinks[h] - lse) * delta, one program per head over
    the row statistics the dq kernel wrote (of the forward that joined the sinks), in
    a fixed order (deterministic), stored in sinks' dtype. A sink of -inf gets 0 (its share is
    0, also in rows with no key, whose lse is -inf too: 0 in STATS)."""
    i_h = tl.program_id(0).to(tl.int64)
    sink = tl.load(SINKS + i_h).to(tl.float32)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i_b in range(0, B):
        row0 = (i_b * H + i_h) * Lq
        for m0 in range(0, Lq, BLOCK):
            i_m = m0 + tl.arange(0, BLOCK)
            m_m = i_m < Lq
            lse, lse_rem, delta = _row_stats(STATS, row0 + i_m, m_m, False)
            # The sink's probability: it is a key whose score is the sink.
            acc += tl.where(m_m, _probs(sink, lse, lse_rem) * delta, 0.0)
    # A sink of -inf: its shares are exp(-inf) = 0 in every row.
    dsink = tl.where(sink > float("-inf"), -tl.sum(acc, 0), 0.0)
    tl.store(DSINKS + i_h, dsink.to(DSINKS.dtype.element_ty))


@triton.jit
def attention_row_stats_kernel(
    OUT,
    GRAD_OUT,
    LSE,
    LSE_REM,
    STATS,
    H,
    Lq,
    Dv,
    stride_ob,
    stride_om,
    stride_oh,
    stride_od,
    stride_gb,
    stride_gm,
    stride_gh,
    stride_gd,
    BLOCK_M: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """The backward's row statistics (_dq_row_stats, without a gradient of lse) on their own,
    for a backward that runs no dq kernel of ours (PyTorch's fused kernels, sdpa.py) and needs
    them for dsinks. OUT and GRAD_OUT (B, Lq, H, Dv); LSE, LSE_REM (B, H, Lq) contiguous; STATS
    (B, H, Lq, 4). Grid: (query row blocks, B * H)."""
    p_o, m, m_m, o_row = head_rows(
        OUT, H, Lq, Dv, stride_ob, stride_om, stride_oh, stride_od, BLOCK_M, BLOCK_DV
    )
    p_do, _, _, _ = head_rows(
        GRAD_OUT, H, Lq, Dv, stride_gb, stride_gm, stride_gh, stride_gd, BLOCK_M, BLOCK_DV
    )
    b_o = tl.load(p_o, mask=m, other=0.0)
    b_do = tl.load(p_do, mask=m, other=0.0)
    _dq_row_stats(STATS, LSE, LSE_REM, None, b_o, b_do, o_row, o_row, m_m, False)
