"""Triton helpers shared by the forward and backward kernels."""

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)

# What the kernels' HAS_MASK / HAS_BIAS constexprs hold (0, absent, is falsy): PER_KEY operands
# have one entry per key, broadcast over the queries (query stride 0), and are loaded once per
# tile column instead of once per score; PER_ENTRY operands have their own query rows.
# Masks arrive as the caller's bool tensors (Triton reads a bool pointer as bytes); every kernel
# tests the loaded entries with != 0. LIMIT: a row-limit mask (int32, one entry per key, loaded
# as PER_KEY ones are): key j is allowed to the query rows i < mask[j]; the key lists hold its
# keys of limit > 0, and the kernels test the limit in every score tile of them.
PER_KEY = tl.constexpr(1)
PER_ENTRY = tl.constexpr(2)
LIMIT = tl.constexpr(3)

# What the forward and dq kernels' COMPACT constexpr holds for a mask shared by all queries
# (0, dense or tile tables, is falsy). LISTED: K, V and a per-key bias are read at the keys a
# sorted list of allowed keys names (a gather in every step). PACKED: the launch that built the
# lists copied the listed rows of K, V and the per-key bias into buffers in list order
# (kernels/key_lists.py), so a step reads contiguous rows; the list itself is read only where
# causality, the window or the list's end cut a tile.
LISTED = tl.constexpr(1)
PACKED = tl.constexpr(2)


@triton.jit
def as_fp32(x):
    """A float argument in float32. Triton's own launcher passes Python floats as fp32, but a
    compiled graph's launcher (Inductor, registration/inductor.py) types them fp64, which would
    make the scores, the softmax statistics and the accumulators float64."""
    return tl.cast(x, tl.float32)


@triton.jit
def grid_tile(TILE_MAJOR: tl.constexpr, LAST_FIRST: tl.constexpr):
    """(tile, row) of this program in a grid of (tiles, rows): query or key tiles times
    (batch, head) rows. Programs start in launch order, axis 0 fastest. TILE_MAJOR: one tile
    over every row, then the next, so tiles of equal work start together and, where a causal
    mask makes the work grow or shrink with the tile (LAST_FIRST where it grows), the longest
    programs start first and the short ones fill the tail of the grid. Otherwise a row's tiles
    run side by side, sharing its K and V in L2 (the better order for windows and varlen,
    whose tiles carry alike or uneven work)."""
    tiles = tl.num_programs(0)
    if TILE_MAJOR:
        i_lin = tl.program_id(1) * tiles + tl.program_id(0)
        tile = i_lin // tl.num_programs(1)
        row = i_lin % tl.num_programs(1)
    else:
        tile = tl.program_id(0)
        row = tl.program_id(1)
    if LAST_FIRST:
        tile = tiles - 1 - tile
    return tile, row


@triton.jit
def split_index(i, n):
    """(i // n, i % n) as int64: a grid index over (outer, inner) pairs, such as (batch, head),
    split back into its two parts (int64: they scale strides)."""
    return (i // n).to(tl.int64), (i % n).to(tl.int64)


@triton.jit
def tile_batch(i_bh, H, PACK_G: tl.constexpr):
    """The batch of grid row i_bh of the forward and dq kernels, as query_rows computes it (there
    in its own form: the hottest kernels' PTX stays as it was), for the kernels' own loads
    before query_tile (seq_extent says why)."""
    return (i_bh // (H // PACK_G) if PACK_G > 1 else i_bh // H).to(tl.int64)


@triton.jit
def query_rows(i_mb, i_bh, H, G, BLOCK_M: tl.constexpr, PACK_G: tl.constexpr):
    """(i_b, i_g, i_h, i_hr, i_hc, i_m) of query tile i_mb of grid row i_bh in the forward and dq
    kernels: the batch, the KV head, the query head whose mask, bias and key list the tile
    reads, each row's head (i_hr, and i_hc as a column of a [BM, D] tile) and each row's query
    position (i_m, [BM]). One head per program (PACK_G == 1): grid rows are (batch, head) and
    i_hr = i_hc = i_h. PACK_G = G: grid rows are (batch, KV head) and the tile holds the G heads
    of the group at BLOCK_M // G positions, row r being position r // G of head r % G; i_h is
    the group's first head, whose mask, bias and key list all its heads share."""
    if PACK_G > 1:
        i_b = (i_bh // (H // PACK_G)).to(tl.int64)
        i_g = (i_bh % (H // PACK_G)).to(tl.int64)
        i_h = i_g * PACK_G
        i_hr = i_h + tl.arange(0, BLOCK_M) % PACK_G
        i_hc = i_hr[:, None]
        i_m = i_mb * (BLOCK_M // PACK_G) + tl.arange(0, BLOCK_M) // PACK_G
    else:
        i_b = (i_bh // H).to(tl.int64)
        i_h = (i_bh % H).to(tl.int64)
        i_g = i_h // G
        i_hr = i_h
        i_hc = i_h
        i_m = i_mb * BLOCK_M + tl.arange(0, BLOCK_M)
    return i_b, i_g, i_h, i_hr, i_hc, i_m


@triton.jit
def dot(a, b, DOT_PRECISION: tl.constexpr):
    """tl.dot with fp32 accumulation. DOT_PRECISION "interpret" (the launcher selects it under
    the Triton interpreter only) multiplies the (already rounded) operands in fp32: Triton 3.9's
    interpreter computes bfloat16 tl.dot wrongly (error ~3e10 on a 16x16 product of unit
    normals)."""
    if DOT_PRECISION == "interpret":
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=DOT_PRECISION)


@triton.jit
def score_dot(a, b, DOT_PRECISION: tl.constexpr):
    """a @ b for the scores, which every kernel must reproduce bitwise: backward recomputes
    P = exp(s - lse) from the forward's lse, and at logits of 1e6 one ulp of s moves P by 6%.
    On the GPU an fp32 (ieee) dot or an MMA sums over k in one fixed order, whatever the tile's
    shape or orientation (Q K^T in the forward and dq kernels, K Q^T in the dk/dv kernel). The
    interpreter's tl.dot is numpy's matmul, whose BLAS rounds differently by shape and
    orientation; under it ("interpret") the products are summed elementwise in k order, the
    same for every tile."""
    if DOT_PRECISION == "interpret":
        return tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
    return dot(a, b, DOT_PRECISION)


@triton.jit
def dot_acc(a, b, acc, DOT_PRECISION: tl.constexpr):
    """acc + a @ b with the product accumulated inside the MMA (no separate add, no second
    accumulator live in registers)."""
    if DOT_PRECISION == "interpret":
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=DOT_PRECISION)


@triton.jit
def lse_split(m, log_sum, nonempty):
    """(lse, lse_rem) of rows with max m and log_sum = log(sum exp(s - m)): lse = m + log_sum
    rounded to float32 and lse_rem = (m + log_sum) - lse exactly (Knuth's TwoSum), so that
    backward recomputes P = exp((s - lse) - lse_rem) to float32 accuracy however large |m| is
    (s - lse is exact near the max). Empty rows: (-inf, 0)."""
    lse = m + log_sum
    b_virtual = lse - m
    a_virtual = lse - b_virtual
    lse_rem = (m - a_virtual) + (log_sum - b_virtual)
    return tl.where(nonempty, lse, float("-inf")), tl.where(nonempty, lse_rem, 0.0)


@triton.jit
def tanh(x):
    # exp2 form: saturates to +-1 for large |x| instead of producing inf / inf.
    e = tl.exp2(x * (2.0 * LOG2E))
    return 1.0 - 2.0 / (e + 1.0)


@triton.jit
def score_tile(
    a,
    b,
    r_m,
    r_n,
    c_n,
    n_keys,
    Lq,
    scale,
    softcap,
    p_mask,
    stride_mask_m,
    stride_mask_n,
    p_bias,
    stride_bias_m,
    stride_bias_n,
    win_left,
    win_right,
    IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BOUNDARY: tl.constexpr,
):
    """Scores of one tile, s = a @ b * scale (+ bias, softcap): (s, allowed, tanh term).

    r_m and r_n are the query and key indices as broadcastable 2-D tensors: ([BM, 1], [1, BN])
    for a [BM, BN] tile (a = Q, b = K^T), or ([1, BM], [BN, 1]) for the transposed tile the
    dk/dv kernel computes (a = K, b = Q^T). c_n, shaped as r_n, is the column the mask and bias
    are read at: r_n itself, or the list positions of packed keys (PACKED).

    s is exactly -inf where the key is not allowed. The mask and the bias are read only inside
    the tensors' bounds; a disallowed score is then replaced by -inf with a select, so NaN/Inf
    stored at disallowed positions never reaches a result. (Loading the bias under the mask's
    own predicate would make its loads scalar: the predicate is data, not a range.)

    BOUNDARY=False is the interior stage: the caller guarantees every row < Lq, every key
    < n_keys and (causal, window) every key visible to every row, so no bounds or band
    arithmetic is done; `allowed` is then only defined when HAS_MASK. HAS_WINDOW: key j is
    allowed to row i only if p - win_left <= j <= p + win_right, p = i + n_keys - Lq (the
    launcher folds causality into win_right and passes IS_CAUSAL False).

    HAS_MASK / HAS_BIAS are 0 (absent), PER_KEY or PER_ENTRY (see above); HAS_MASK may also be
    LIMIT (a row-limit mask, tested as r_m < limit). A PER_KEY operand is
    loaded with the shape of r_n and broadcast: a per-entry pointer tensor would issue BLOCK_M
    loads of every element (its query stride of 0 is a runtime value).
    """
    x = score_dot(a, b, DOT_PRECISION) * scale
    t = x
    if HAS_SOFTCAP:
        t = tanh(x / softcap)
        x = softcap * t
    o_m = r_m.to(tl.int64)
    o_n = c_n.to(tl.int64)
    m_allowed = 0
    m_in = 0
    if BOUNDARY:
        m_in = (r_m < Lq) & (r_n < n_keys)
    if HAS_MASK:
        b_mask = load_operand(
            p_mask, o_m, o_n, stride_mask_m, stride_mask_n, r_n < n_keys, m_in, 0, HAS_MASK,
            BOUNDARY,
        )  # fmt: skip
        if HAS_MASK == LIMIT:  # noqa: SIM108 (Triton: a constexpr branch)
            m_allowed = r_m < b_mask
        else:
            m_allowed = b_mask != 0
    if BOUNDARY:
        m_allowed = m_allowed & m_in if HAS_MASK else m_in
        if IS_CAUSAL:
            m_allowed = m_allowed & (r_n <= r_m + (n_keys - Lq))
        if HAS_WINDOW:
            pos = r_m + (n_keys - Lq)
            m_allowed = m_allowed & (r_n >= pos - win_left) & (r_n <= pos + win_right)
    if HAS_BIAS:
        b_bias = load_operand(
            p_bias, o_m, o_n, stride_bias_m, stride_bias_n, r_n < n_keys, m_in, 0.0, HAS_BIAS,
            BOUNDARY,
        )  # fmt: skip
        x = x + b_bias.to(tl.float32)
    s = x
    if BOUNDARY or HAS_MASK:
        s = tl.where(m_allowed, x, float("-inf"))
    return s, m_allowed, t


@triton.jit
def load_operand(
    p, o_m, o_n, stride_m, stride_n, m_n, m_in, other, KIND: tl.constexpr, BOUNDARY: tl.constexpr
):
    """Mask or bias entries of a score tile: with the shape of o_n when KIND is PER_KEY, else
    of the whole tile. BOUNDARY loads are predicated on the bounds (m_n: key < n_keys, for a
    PER_KEY operand; m_in: row and key in bounds, for a PER_ENTRY one)."""
    if KIND == PER_KEY or KIND == LIMIT:  # noqa: SIM109 (Triton compares constexprs)
        ptr = p + o_n * stride_n
        inside = m_n
    else:
        ptr = p + o_m * stride_m + o_n * stride_n
        inside = m_in
    if BOUNDARY:
        return tl.load(ptr, mask=inside, other=other)
    return tl.load(ptr)


@triton.jit
def load_rows(ptr, m_rows, m_cols, BOUNDARY: tl.constexpr, FULL: tl.constexpr):
    """A K, V, Q or dO tile of the kernels' inner loops. Predicated on its rows (m_rows: keys
    below n, or query rows below Lq) and its head-dim columns (m_cols), zeros outside (other=0
    keeps 0 * NaN out of the products), except in an interior tile whose head dims fill their
    blocks (FULL): every row and column of it exists, so its loads are unpredicated."""
    if BOUNDARY or not FULL:
        return tl.load(ptr, mask=m_rows & m_cols, other=0.0)
    return tl.load(ptr)


@triton.jit
def listed_keys(
    kb, pos0, n_pos, n_keys, p_keys, BLOCK_N: tl.constexpr, BOUNDARY: tl.constexpr,
    COMPACT: tl.constexpr,
):  # fmt: skip
    """(i_n, i_r) of key tile kb: the key indices (for causality, the window and the bounds)
    and the rows K, V and a per-key bias are read at. Without COMPACT both are the keys
    kb * BLOCK_N onwards. With COMPACT the tile holds list positions pos0 + kb * BLOCK_N
    onwards: i_n = the listed keys (n_keys past position n_pos), i_r = i_n (LISTED) or the
    positions themselves (PACKED). A PACKED interior tile reads no list entry (i_n is then the
    positions: interior tiles test no key index)."""
    i_p = pos0 + kb * BLOCK_N + tl.arange(0, BLOCK_N)
    i_n = i_p
    if COMPACT:
        if BOUNDARY:
            i_n = tl.load(p_keys + i_p, mask=i_p < n_pos, other=n_keys)
        elif COMPACT == LISTED:
            i_n = tl.load(p_keys + i_p)
    i_r = i_n
    if COMPACT == PACKED:
        i_r = i_p
    return i_n, i_r


@triton.jit
def listed_interior_count(
    p_end, i_mb, first, n_pos, Lq, BLOCK_M: tl.constexpr, IS_CAUSAL: tl.constexpr
):  # fmt: skip
    """How many leading entries of a sorted allowed-key list are interior for query tile i_mb
    (its rows all exist and all see them). p_end[i] is how many entries list tile i may see
    (n_pos for this tile's last); `first` is this tile's first list tile. Under causality that
    is p_end[first - 1]: the keys the previous row sees, one fewer than this tile's first row
    sees."""
    n_int = n_pos
    if IS_CAUSAL:
        n_int = tl.load(p_end + first - 1, mask=first > 0, other=0)
    return tl.where((i_mb + 1) * BLOCK_M <= Lq, n_int, 0)


@triton.jit
def interior_key_end(
    m_start, n_keys, Lq, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr
):
    """Number of leading key tiles that are interior for the query tile starting at m_start:
    the tile's rows all exist and its first row sees every key of them."""
    end = causal_key_end(m_start + 1, n_keys, Lq, IS_CAUSAL) // BLOCK_N
    return tl.where(m_start + BLOCK_M <= Lq, end, 0)


@triton.jit
def key_count(SEQUSED, i_b, Lk, HAS_SEQUSED: tl.constexpr):
    """n = seqused_k[b] clamped to [0, Lk] (used_keys), or Lk. For kernels whose stores'
    addresses do not depend on n (seq_extent says why that matters)."""
    return used_keys(tl.load(SEQUSED + i_b), Lk) if HAS_SEQUSED else Lk


@triton.jit
def used_keys(used, Lk):
    """A seqused_k value as a key count: clamped to [0, Lk]."""
    return tl.minimum(tl.maximum(used.to(tl.int32), 0), Lk)


@triton.jit
def seq_extent(cu_q, cu_k, used, i_b, Lq, Lk, HAS_SEQUSED: tl.constexpr, VARLEN: tl.constexpr):
    """Where batch b lives: (q_start, Lq, k_start, n_keys, Lk), from what the kernel read of
    it: cu_q = cu_seqlens_q[b], cu_seqlens_q[b + 1] and cu_k likewise (VARLEN), used =
    seqused_k[b] (HAS_SEQUSED).

    q_start / k_start index rows of the contiguous (B * Lq | total_q) and (B * Lk | total_k)
    flattenings that outputs and gradients use. Batched: b * Lq, b * Lk, n_keys from seqused_k
    clamped to [0, Lk]. Varlen (Lq, Lk are then total_q, total_k): from cu_seqlens, clamped
    into the packed buffers so that no cu_seqlens value, however wrong, reads or writes outside
    them.

    The kernels load cu_seqlens and seqused_k in their own bodies, not in a helper: Inductor's
    analysis of a user kernel (torch/_higher_order_ops/triton_kernel_wrap.py,
    identify_accessed_tensors) follows each store's address back through the ops that made it
    and stops at a load, but counts a helper's result as made from all of the helper's
    arguments; a pointer passed to a helper whose result addresses a store is then "written",
    and cu_seqlens or seqused_k became graph inputs that a compiled call mutates (copied back
    after each call, and an AOTAutograd partition of the varlen graph failed on it).
    tests/test_inductor.py holds every kernel to writing its outputs alone.
    """
    if VARLEN:
        q_end = tl.minimum(tl.maximum(cu_q[1], 0), Lq)
        q_start = tl.minimum(tl.maximum(cu_q[0], 0), q_end)
        k_end = tl.minimum(tl.maximum(cu_k[1], 0), Lk)
        k_start = tl.minimum(tl.maximum(cu_k[0], 0), k_end)
        lq = q_end - q_start
        lk = k_end - k_start
        n_keys = lk
        q_start = q_start.to(tl.int64)
        k_start = k_start.to(tl.int64)
    else:
        q_start = i_b * Lq
        k_start = i_b * Lk
        lq = Lq
        lk = Lk
        n_keys = Lk
        if HAS_SEQUSED:
            n_keys = used_keys(used, Lk)
    return q_start, lq, k_start, n_keys, lk


@triton.jit
def causal_key_end(m_end, n_keys, Lq, IS_CAUSAL: tl.constexpr):
    """One past the last key any query row below m_end may see."""
    end = n_keys
    if IS_CAUSAL:
        end = tl.minimum(end, m_end + n_keys - Lq)
    return tl.maximum(end, 0)


@triton.jit
def band_key_tiles(m_start, n_keys, Lq, win_left, win_right, BLOCK_M, BLOCK_N: tl.constexpr):
    """Key tiles of the query tile starting at m_start under a window (rows p - win_left to
    p + win_right, p = i + n_keys - Lq): (kb_lo, ki_lo, ki_hi, kb_hi). Tiles [kb_lo, kb_hi)
    hold a key some row sees; [ki_lo, ki_hi) within them are interior (every row exists and
    sees every key of the tile, all below n_keys); the rest are boundary tiles. Tiles outside
    [kb_lo, kb_hi) are never visited."""
    off = n_keys - Lq
    m_end = tl.minimum(m_start + BLOCK_M, Lq)
    lo = tl.maximum(m_start + off - win_left, 0)
    hi = tl.maximum(tl.minimum(m_end + off + win_right, n_keys), 0)
    kb_lo = lo // BLOCK_N
    kb_hi = tl.where(m_start < Lq, tl.maximum(tl.cdiv(hi, BLOCK_N), kb_lo), kb_lo)
    # Keys every row sees: from the last row's lower bound to the first row's upper bound.
    ki_lo = tl.cdiv(tl.maximum(m_start + BLOCK_M - 1 + off - win_left, 0), BLOCK_N)
    ki_hi = tl.minimum(m_start + off + win_right + 1, n_keys) // BLOCK_N
    ki_lo = tl.minimum(tl.maximum(ki_lo, kb_lo), kb_hi)
    ki_hi = tl.minimum(tl.maximum(ki_hi, ki_lo), kb_hi)
    ki_hi = tl.where(m_start + BLOCK_M <= Lq, ki_hi, ki_lo)
    return kb_lo, ki_lo, ki_hi, kb_hi


@triton.jit
def dense_key_tiles(
    m_start,
    n_keys,
    Lq,
    win_left,
    win_right,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    """(kb_lo, ki_lo, ki_hi, kb_hi) of the query tile starting at m_start over all keys (no
    mask): boundary tiles [kb_lo, ki_lo), interior ones [ki_lo, ki_hi), boundary ones
    [ki_hi, kb_hi). Under a window as band_key_tiles; otherwise kb_lo = ki_lo = 0 and the end
    comes from causality (0 for a tile past a varlen sequence's queries)."""
    if HAS_WINDOW:
        kb_lo, ki_lo, ki_hi, kb_hi = band_key_tiles(
            m_start, n_keys, Lq, win_left, win_right, BLOCK_M, BLOCK_N
        )
    else:
        m_end = tl.minimum(m_start + BLOCK_M, Lq)
        kb_hi = tl.cdiv(causal_key_end(m_end, n_keys, Lq, IS_CAUSAL), BLOCK_N)
        kb_hi = tl.where(m_start < Lq, kb_hi, 0)
        ki_hi = tl.minimum(
            interior_key_end(m_start, n_keys, Lq, BLOCK_M, BLOCK_N, IS_CAUSAL), kb_hi
        )
        kb_lo = 0
        ki_lo = 0
    return kb_lo, ki_lo, ki_hi, kb_hi


@triton.jit
def run_end(a_end, b_start, b_end):
    """Where a run of iterations over the tiles [a_start, a_end) and then [b_start, b_end)
    ends; it starts at a_start (run_tile maps an iteration to its tile).

    Every kernel walks the tiles a program sees in two runs, and so calls its tile function
    twice: the interior run (whole tiles every row or column sees: no bounds, causal or window
    arithmetic) and the boundary run, which holds the tiles on both sides of the interior ones:
    [lo, int_lo) and [int_hi, hi) of tiles [lo, hi) with interior tiles [int_lo, int_hi)."""
    return a_end + (b_end - b_start)


@triton.jit
def key_run(RUN: tl.constexpr, ki_lo, ki_hi, kb_lo, kb_hi):
    """The iterations [lo, hi) of a query tile's key-tile run RUN (the forward and dq kernels):
    0, the interior tiles [ki_lo, ki_hi); 1, the boundary tiles after them and (WRAP) before
    them, [ki_hi, kb_hi) then [kb_lo, ki_lo) (run_end, run_tile)."""
    lo, hi = ki_lo, ki_hi
    if RUN == 1:
        lo, hi = ki_hi, run_end(kb_hi, kb_lo, ki_lo)
    return lo, hi


@triton.jit
def run_tile(it, a_end, b_start, p_idx, WRAP: tl.constexpr, TABLE: tl.constexpr):
    """The tile of iteration `it` of a run (run_end): `it` itself, or with WRAP, where the run
    has a second range, b_start + (it - a_end) from iteration a_end on. TABLE: the tiles are
    entries of a list at p_idx (tile tables), which `it` then indexes."""
    idx = it
    if WRAP:
        idx = tl.where(it < a_end, it, it - a_end + b_start)
    if TABLE:
        idx = tl.load(p_idx + idx)
    return idx


@triton.jit
def query_tile(
    i_mb, i_bh, cu_q, cu_k, used, Lq, Lk, H, G, BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, PACK_G: tl.constexpr,
    HAS_SEQUSED: tl.constexpr, VARLEN: tl.constexpr,
):  # fmt: skip
    """Query tile i_mb of (batch, head) column i_bh for the forward and dq kernels:
    (i_b, i_g, i_h, i_hr, i_hc, i_m) as query_rows, (q_start, Lq, n_keys, Lk) as seq_extent
    (cu_q, cu_k, used: what the kernel read of the tile's batch, tile_batch),
    k_row0 (the sequence's first key row in the packed operands: k_start with VARLEN, else 0),
    the column indices i_d and i_dv (BLOCK_D, BLOCK_DV), m_m (rows below Lq) and o_m (the
    rows in the packed operands, int64)."""
    i_b, i_g, i_h, i_hr, i_hc, i_m = query_rows(i_mb, i_bh, H, G, BLOCK_M, PACK_G)
    q_start, Lq, k_start, n_keys, Lk = seq_extent(
        cu_q, cu_k, used, i_b, Lq, Lk, HAS_SEQUSED, VARLEN
    )
    if VARLEN:
        q_row0 = q_start
        k_row0 = k_start
    else:
        q_row0 = 0
        k_row0 = 0
    i_d = tl.arange(0, BLOCK_D)
    i_dv = tl.arange(0, BLOCK_DV)
    m_m = i_m < Lq
    o_m = q_row0 + i_m.to(tl.int64)
    return i_b, i_g, i_h, i_hr, i_hc, i_m, q_start, Lq, n_keys, Lk, k_row0, i_d, i_dv, m_m, o_m


@triton.jit
def row_tile(X, i_b, i_hc, o_m, m_m, i_c, stride_b, stride_h, stride_m, stride_d, n_cols):
    """The [BLOCK_M, columns i_c] tile of X (B, L, H, n_cols) at rows o_m of head i_hc, zeros
    past Lq (m_m) and n_cols."""
    return tl.load(
        X + i_b * stride_b + i_hc * stride_h + o_m[:, None] * stride_m + i_c[None, :] * stride_d,
        mask=m_m[:, None] & (i_c[None, :] < n_cols),
        other=0.0,
    )


@triton.jit
def key_tile_bounds(
    KEY_START, KEY_END, KV_INT, KV_NUM, row, i_b, i_hm, i_mb, n_keys, Lq, table_stride_b,
    table_stride_h, win_left, win_right, BLOCK_M: tl.constexpr, POS_M: tl.constexpr,
    BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_MASK: tl.constexpr, COMPACT: tl.constexpr, LIST_R: tl.constexpr = 1,
):  # fmt: skip
    """(pos0, n_pos, kb_lo, ki_lo, ki_hi, kb_hi): the key tiles of query tile i_mb (POS_M
    positions) for the forward and dq kernels, interior tiles [ki_lo, ki_hi) of [kb_lo, kb_hi)
    (run_end), mask head i_hm.

    COMPACT: tiles of the sorted allowed-key list from list position pos0 (KEY_START under a
    window, else 0) up to n_pos, the entries this tile may see (KEY_END, from causality,
    seqused_k and the window); the interior ones are those every row sees in full (none under a
    window). LIST_R: the lists hold their ends and starts per tile of POS_M // LIST_R
    positions (lists built once for the forward and the dQ pass, whose tiles differ: at the
    finer of the two); this tile's are those of its last and first list tiles. HAS_MASK (tile
    tables): positions in the table row `row`, the KV_INT interior tiles first, KV_NUM in all;
    tiles outside it are never loaded. Otherwise the tiles come from causality, the window and
    seqused_k (dense_key_tiles)."""
    pos0 = 0
    n_pos = 0
    if COMPACT:
        p_end = KEY_END + i_b * table_stride_b + i_hm * table_stride_h
        first = i_mb
        last = i_mb
        if LIST_R > 1:
            first = i_mb * LIST_R
            last = tl.minimum(first + LIST_R, tl.cdiv(Lq, POS_M // LIST_R)) - 1
        n_pos = tl.load(p_end + last)
        kb_int = 0
        if HAS_WINDOW:
            pos0 = tl.load(KEY_START + i_b * table_stride_b + i_hm * table_stride_h + first)
        else:
            kb_int = (
                listed_interior_count(p_end, i_mb, first, n_pos, Lq, POS_M, IS_CAUSAL) // BLOCK_N
            )
        kb_lo, ki_lo, ki_hi, kb_hi = 0, 0, kb_int, tl.cdiv(n_pos - pos0, BLOCK_N)
    elif HAS_MASK:
        kb_lo, ki_lo, ki_hi, kb_hi = 0, 0, tl.load(KV_INT + row), tl.load(KV_NUM + row)
    else:
        kb_lo, ki_lo, ki_hi, kb_hi = dense_key_tiles(
            i_mb * BLOCK_M, n_keys, Lq, win_left, win_right, BLOCK_M, BLOCK_N, IS_CAUSAL,
            HAS_WINDOW,
        )  # fmt: skip
    return pos0, n_pos, kb_lo, ki_lo, ki_hi, kb_hi


@triton.jit
def band_query_tiles(
    k_lo, k_hi, k_full, NQ, n_keys, Lq, win_left, win_right, BLOCK_M: tl.constexpr
):
    """Query tiles that see keys k_lo..k_hi (inclusive; a key tile or a tile of listed keys)
    under a window: (qb_lo, qi_lo, qi_hi, qb_hi) as band_key_tiles, transposed. Row i sees key
    j iff j - win_right <= i + off <= j + win_left. k_full: the key tile is whole (no unused
    positions, all keys below n_keys), a condition of an interior run."""
    off = n_keys - Lq
    qb_lo = tl.maximum(k_lo - win_right - off, 0) // BLOCK_M
    qb_hi = tl.minimum(tl.cdiv(tl.maximum(k_hi + win_left - off + 1, 0), BLOCK_M), NQ)
    qb_hi = tl.maximum(qb_hi, qb_lo)
    qi_lo = tl.cdiv(tl.maximum(k_hi - win_right - off, 0), BLOCK_M)
    qi_hi = tl.minimum(tl.maximum(k_lo + win_left - off + 1, 0), Lq) // BLOCK_M
    qi_hi = tl.where(k_full, qi_hi, 0)
    qi_lo = tl.minimum(tl.maximum(qi_lo, qb_lo), qb_hi)
    qi_hi = tl.minimum(tl.maximum(qi_hi, qi_lo), qb_hi)
    return qb_lo, qi_lo, qi_hi, qb_hi


@triton.jit
def head_rows(X, H, Lq, Dv, stride_b, stride_m, stride_h, stride_d, BLOCK_M, BLOCK_DV):
    """The tile of a one-pass row kernel (grid: query row blocks, B * H): pointers to BLOCK_M
    rows of one (batch, head) of X (B, Lq, H, Dv) and their bounds mask, the rows' bounds, and
    their offsets in a contiguous (B, H, Lq) statistics tensor."""
    i_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    i_bh = tl.program_id(1)
    i_d = tl.arange(0, BLOCK_DV)
    m_m = i_m < Lq
    p_x = (
        X
        + (i_bh // H).to(tl.int64) * stride_b
        + i_m.to(tl.int64)[:, None] * stride_m
        + (i_bh % H).to(tl.int64) * stride_h
        + i_d[None, :] * stride_d
    )
    return p_x, m_m[:, None] & (i_d[None, :] < Dv), m_m, i_bh.to(tl.int64) * Lq + i_m
