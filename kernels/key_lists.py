"""Key lists of masks shared by all queries (the DMA pattern; executors/tiles.py KeyLists), and
the packed K, V and per-key bias rows the forward and dq kernels read through them."""

import triton
import triton.language as tl

from dmattn_ops.kernels.common import key_count, seq_extent, split_index


@triton.jit
def _copy_rows(src, stride_n, stride_d, dst, dst_stride_r, o_n, o_r, m_r, D, BLOCK_D: tl.constexpr):
    """Rows o_n of src (strided) to rows o_r of dst (contiguous along D), where m_r."""
    i_d = tl.arange(0, BLOCK_D)
    m = m_r[:, None] & (i_d[None, :] < D)
    rows = tl.load(src + o_n[:, None] * stride_n + i_d[None, :] * stride_d, mask=m)
    tl.store(dst + o_r[:, None] * dst_stride_r + i_d[None, :], rows, mask=m)


@triton.jit
def _zero_rows(dst, dst_stride_r, o_r, m_r, D, BLOCK_D: tl.constexpr):
    """Zeros at rows o_r of dst (contiguous along D), where m_r."""
    i_d = tl.arange(0, BLOCK_D)
    zeros = tl.zeros([o_r.shape[0], BLOCK_D], dtype=dst.dtype.element_ty)
    tl.store(dst + o_r[:, None] * dst_stride_r + i_d[None, :], zeros,
             mask=m_r[:, None] & (i_d[None, :] < D))  # fmt: skip


@triton.jit
def _table_end(t, n, lq, win_right, BLOCK_M: tl.constexpr, IS_CAUSAL: tl.constexpr,
               HAS_WINDOW: tl.constexpr):  # fmt: skip
    """One past the last key query tile t may see: n, cut by causality or the band's right
    side at the tile's last row; 0 for a tile past the queries (varlen)."""
    end = tl.zeros(t.shape, dtype=tl.int32) + n
    m_end = tl.minimum((t + 1) * BLOCK_M, lq)
    if IS_CAUSAL:
        end = tl.maximum(tl.minimum(end, m_end + n - lq), 0)
    if HAS_WINDOW:
        end = tl.maximum(tl.minimum(end, m_end + n - lq + win_right), 0)
    return tl.where(t * BLOCK_M < lq, end, 0)


@triton.jit
def _table_start(t, end, n, lq, win_left, BLOCK_M: tl.constexpr):
    """The first key of the band of query tile t's first row (at most end)."""
    return tl.minimum(tl.maximum(t * BLOCK_M + n - lq - win_left, 0), end)


@triton.jit
def key_lists_kernel(
    MASK,
    SEQUSED,
    PREFIX,
    KEYS,
    KEY_START,
    KEY_END,
    KEY_COUNT,
    K,
    V,
    BIAS,
    K_OUT,
    V_OUT,
    BIAS_OUT,
    stride_mb,
    stride_mh,
    stride_mn,
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
    end_stride_b,
    count_stride_b,
    Hkv,
    G,
    Lq,
    Lk,
    NQ,
    D,
    Dv,
    mask_hdiv,
    bias_hdiv,
    BIAS_HEADS,
    win_left,
    win_right,
    HAS_SEQUSED: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    PACK: tl.constexpr,
    ZERO_TAIL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,
    SCAN: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """Batched key lists, and with PACK the packed rows, in one launch. The allowed keys are
    those whose mask entry is > 0: True in a bool mask, a limit above 0 in a row-limit mask
    (whose limits the attention kernels then test per score). One program per
    (CHUNK keys, batch b, KV group g); mask head (g * G) // mask_hdiv. A program counts the
    allowed keys before its chunk (one pass over them, SCAN at a time), so no program waits for
    another, and then for its own keys:

    KEYS[b, h, :]: the allowed keys in ascending order, followed by the others in descending
    order (a permutation of 0..Lk-1; the dk/dv kernels store zeros at those past the count);
    written by the first program of each mask row (b = 0 when the mask broadcasts over the
    batch, keys_stride_b = 0; the first KV group a mask head serves). KEY_COUNT[b, h]: how many
    lie below n (seqused_k[b] or Lk). KEY_END[b, h, t]: how many query tile t may see, those
    below min(n, end of the tile + n - Lq) under causality, else below n; HAS_WINDOW: below the
    band's end for the tile's last row, and KEY_START those below its start for the tile's
    first row (the tile's keys are list positions [KEY_START, KEY_END)). Each value is stored
    by the program whose chunk holds the last key it counts, from the running counts of its
    chunk in PREFIX (B * Hkv, Lk; stored by the programs that store counts), read back after a
    barrier.

    PACK: rows of K and V (B, Lk, Hkv, D|Dv) at the chunk's allowed keys below n go to their
    list positions of K_OUT / V_OUT (contiguous, the same shapes), and the per-key bias of each
    query head the group's bias rows serve to BIAS_OUT (contiguous (B, Hkv * BIAS_HEADS, Lk)).
    Positions at or past the count are not written: the Triton kernels never read them; with
    ZERO_TAIL, K_OUT's and V_OUT's rows there are zeros (kernels/hopper.py loads whole tiles by
    TMA, and its P = 0 and dS = 0 there must not meet NaN in a product: P V, dS K)."""
    i_c = tl.program_id(0)
    i_bg = tl.program_id(1)
    i_b, i_g = split_index(i_bg, Hkv)
    i_hm = (i_g * G) // mask_hdiv
    # Which programs store the lists and the counts: 0 or 1, applied to masks by products (the
    # interpreter of Triton 3.9 rejects a load mask that is a tensor & a scalar bool).
    head_first = (((i_g * G) % mask_hdiv) == 0).to(tl.int32)
    writes_keys = head_first * ((i_b == 0) | (i_b * keys_stride_b != 0)).to(tl.int32)
    writes_tables = head_first * ((i_b == 0) | (i_b * end_stride_b != 0)).to(tl.int32)
    n = key_count(SEQUSED, i_b, Lk, HAS_SEQUSED)
    row = MASK + i_b * stride_mb + i_hm * stride_mh
    c0 = i_c * CHUNK
    base = 0
    for s in range(0, c0, SCAN):
        j = s + tl.arange(0, SCAN)
        a = tl.load(row + j.to(tl.int64) * stride_mn, mask=j < c0, other=0).to(tl.int32) > 0
        base += tl.sum(a.to(tl.int32), 0)
    j = c0 + tl.arange(0, CHUNK)
    in_k = j < Lk
    a = tl.load(row + j.to(tl.int64) * stride_mn, mask=in_k, other=0).to(tl.int32)
    a = (a > 0).to(tl.int32)
    inclusive = base + tl.cumsum(a, 0)
    keys = KEYS + i_b * keys_stride_b + i_hm * keys_stride_h
    tl.store(keys + inclusive - 1, j, mask=a * writes_keys != 0)
    tl.store(keys + Lk - (j + 1 - inclusive), j, mask=((1 - a) * writes_keys != 0) & in_k)
    if PACK:
        # K_OUT / V_OUT rows: (b, position, g) of contiguous (B, Lk, Hkv, D|Dv).
        m_r = (a != 0) & (j < n)
        o_n = j.to(tl.int64)
        o_r = (inclusive - 1).to(tl.int64)
        _copy_rows(
            K + i_b * stride_kb + i_g * stride_kh, stride_kn, stride_kd,
            K_OUT + (i_b * Lk * Hkv + i_g) * D, Hkv * D, o_n, o_r, m_r, D, BLOCK_D,
        )  # fmt: skip
        _copy_rows(
            V + i_b * stride_vb + i_g * stride_vh, stride_vn, stride_vd,
            V_OUT + (i_b * Lk * Hkv + i_g) * Dv, Hkv * Dv, o_n, o_r, m_r, Dv, BLOCK_DV,
        )  # fmt: skip
        if HAS_BIAS:
            for jh in range(0, BIAS_HEADS):
                i_h = i_g * G + jh  # a query head the bias row serves (the group's first if shared)
                b_bias = tl.load(
                    BIAS + i_b * stride_bb + (i_h // bias_hdiv) * stride_bh + o_n * stride_bn,
                    mask=m_r,
                )
                o_out = ((i_b * Hkv + i_g) * BIAS_HEADS + jh) * Lk + o_r
                tl.store(BIAS_OUT + o_out, b_bias, mask=m_r)
        if ZERO_TAIL:
            # Every position at or past the count holds one key of some chunk: an unlisted key
            # (placed from the end) or a listed one at or past n.
            m_z = in_k & ((a == 0) | (j >= n))
            o_z = tl.where(a != 0, inclusive - 1, Lk - (j + 1 - inclusive)).to(tl.int64)
            _zero_rows(K_OUT + (i_b * Lk * Hkv + i_g) * D, Hkv * D, o_z, m_z, D, BLOCK_D)
            _zero_rows(V_OUT + (i_b * Lk * Hkv + i_g) * Dv, Hkv * Dv, o_z, m_z, Dv, BLOCK_DV)

    i_t = i_b * end_stride_b + i_hm * NQ
    last = tl.where(n > 0, (n - 1) // CHUNK, 0)
    below_n = base + tl.sum(tl.where(j < n, a, 0), 0)
    owns_count = writes_tables * (last == i_c).to(tl.int32) != 0
    tl.store(KEY_COUNT + i_b * count_stride_b + i_hm, below_n, mask=owns_count)
    prefix = PREFIX + i_bg * Lk
    tl.store(prefix + j, inclusive, mask=(in_k.to(tl.int32) * writes_tables) != 0)
    tl.debug_barrier()  # the PREFIX stores above are read back by other threads of the program
    for t0 in range(0, NQ, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        m_t = ((t < NQ).to(tl.int32) * writes_tables) != 0
        end = _table_end(t, n, Lq, win_right, BLOCK_M, IS_CAUSAL, HAS_WINDOW)
        # The program whose chunk holds key end - 1 stores the count (the first one: 0).
        mine = tl.where(end > 0, (end - 1) // CHUNK, 0) == i_c
        seen = tl.load(prefix + end - 1, mask=m_t & mine & (end > 0), other=0)
        tl.store(KEY_END + i_t + t, seen, mask=m_t & mine)
        if HAS_WINDOW:
            first = _table_start(t, end, n, Lq, win_left, BLOCK_M)
            mine = tl.where(first > 0, (first - 1) // CHUNK, 0) == i_c
            below = tl.load(prefix + first - 1, mask=m_t & mine & (first > 0), other=0)
            tl.store(KEY_START + i_t + t, below, mask=m_t & mine)


@triton.jit
def varlen_key_lists_kernel(
    MASK,
    CU_Q,
    CU_K,
    PREFIX,
    KEYS,
    KEY_START,
    KEY_END,
    KEY_COUNT,
    stride_mh,
    stride_mn,
    stride_kh,
    stride_eb,
    stride_cb,
    Hm,
    Lq,
    Lk,
    NQ,
    prefix_len,
    win_left,
    win_right,
    IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """Key lists of a varlen mask (Hm, total_k), one program per (sequence b, mask head h), in
    one pass over the sequence's keys: KEYS[h, :] at the sequence's own positions holds its
    allowed keys in ascending order, as indices local to the sequence (the launcher fills KEYS
    with Lk = total_k, which pads the rest);
    KEY_COUNT[b, h], KEY_END[b, h, t] and KEY_START as in key_lists_kernel (a tile past the
    sequence's queries sees none). PREFIX (B * Hm, prefix_len) is scratch for the running
    counts, read back by the same program after a barrier."""
    pid = tl.program_id(0)
    i_bt = pid // Hm
    i_h = pid % Hm
    # cu_seqlens are loaded here, not in a helper (common.seq_extent says why).
    cu_q = (tl.load(CU_Q + i_bt), tl.load(CU_Q + i_bt + 1))
    cu_k = (tl.load(CU_K + i_bt), tl.load(CU_K + i_bt + 1))
    _, lq, k_start, n, lk = seq_extent(cu_q, cu_k, Lk, i_bt, Lq, Lk, False, True)
    # A sequence longer than max_seqlen_k breaks the contract (checked outside compiled code);
    # the scratch row holds prefix_len = max_seqlen_k entries, so never scan more.
    lk = tl.minimum(lk, prefix_len)
    n = lk
    row = MASK + i_h.to(tl.int64) * stride_mh + k_start * stride_mn
    keys = KEYS + i_h.to(tl.int64) * stride_kh + k_start
    prefix = PREFIX + pid.to(tl.int64) * prefix_len
    total = 0
    for start in range(0, lk, CHUNK):
        j = start + tl.arange(0, CHUNK)
        a = (tl.load(row + j.to(tl.int64) * stride_mn, mask=j < lk, other=0) != 0).to(tl.int32)
        inclusive = total + tl.cumsum(a, 0)
        tl.store(prefix + j, inclusive, mask=j < lk)
        tl.store(keys + inclusive - 1, j, mask=a != 0)
        total += tl.sum(a, 0)
    tl.store(KEY_COUNT + i_bt * stride_cb + i_h, total)
    tl.debug_barrier()  # the PREFIX stores above are read back by other threads of the program
    for t0 in range(0, NQ, CHUNK):
        t = t0 + tl.arange(0, CHUNK)
        end = _table_end(t, n, lq, win_right, BLOCK_M, IS_CAUSAL, HAS_WINDOW)
        seen = tl.load(prefix + end - 1, mask=(t < NQ) & (end > 0), other=0)
        tl.store(KEY_END + i_bt * stride_eb + i_h * NQ + t, seen, mask=t < NQ)
        if HAS_WINDOW:
            first = _table_start(t, end, n, lq, win_left, BLOCK_M)
            below = tl.load(prefix + first - 1, mask=(t < NQ) & (first > 0), other=0)
            tl.store(KEY_START + i_bt * stride_eb + i_h * NQ + t, below, mask=t < NQ)
