"""Warp-specialised Hopper (sm_90) kernels in Gluon for key-list calls with packed keys: the
forward, dQ (with the backward's row statistics) and dK/dV (dmattn_ops/executors/hopper.py says
which calls take them).

Triton's `tl.dot` kernels software-pipeline one warpgroup's loads and products; on the H100 they
stop at 60-80% of cuDNN's TFLOP/s. These kernels split each program
into FlashAttention-3's roles with `gl.warp_specialize`:

* a loader partition, one warp, issues every TMA load into shared-memory rings and signals
  their mbarriers;
* two consumer partitions, a warpgroup each, own half the program's rows and run the products
  as asynchronous wgmma, the softmax of one tile overlapping the products of the other
  consumer and their own previous product; registers move from the loader to them.

The kernels take the calls of tiles.KeyLists with packed rows (the DMA pattern: one sorted key
list per batch and KV group, causal by the keys' positions): K, V (B, Lk, Hkv, D) and the
per-key bias (B, Hkv * BIAS_HEADS, Lk) in list order, which key_lists_kernel packs (with
ZERO_TAIL, K's and V's rows past each list are zeros: a TMA tile reads them, and P V and dS K
must stay 0 there).
Numerics are the Triton kernels': scores in natural units, s = q.k * scale + bias, the max
subtracted before the scaling by log2(e), (lse, lse_rem) by TwoSum, and every disallowed
score replaced by a select, so NaN or Inf outside the lists never reaches a result.
"""

import triton.language.core as _language_core
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

# Gluon's aggregate (a struct of values a jit function takes and returns); Triton 3.6 has it
# only as the language's own, later versions as gluon.aggregate.
_aggregate = getattr(gluon, "aggregate", None) or _language_core._aggregate
# A TMA load (global to shared, signalling an mbarrier): tma.async_copy_global_to_shared in
# Triton 3.6; later versions name it async_load and make the old name raise.
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared

LOG2E = gl.constexpr(1.4426950408889634)


@gluon.jit
def _snake(k, n_items):
    """The work item a persistent program takes at its index k (program_id, then + num_programs
    each turn). Items come longest first; taking them round-robin, program 0 would get the
    longest of every round. Full rounds of num_programs items alternate direction instead, so
    each program's sum is about the same (the dK/dV kernel's SMs ran up to 13% apart without it:
    bench/NOTES.md 230); a last partial round goes forward, which keeps this a permutation of
    [0, n_items)."""
    p = gl.num_programs(0)
    r = k // p
    back = (r % 2 == 1) & ((r + 1) * p <= n_items)
    return gl.where(back, r * p + (p - 1) - (k - r * p), k)


@gluon.constexpr_function
def _mma_layout(n):
    """The register layout of a [64, n] wgmma accumulator of one warpgroup."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 16])


@gluon.constexpr_function
def _store_layout(n):
    """A register layout of a [64, n] tile (n a power of two, at least 32) for storing a wgmma
    accumulator's values: the accumulator's own has each thread hold column pairs 8 apart, so a
    warp's 4-byte store half-fills 32-byte sectors (32 such stores a thread for a [64, 128]
    tile); here lane bit 0 and the register bit of column 8 swap places, so a thread holds 4
    adjacent columns and a warp's 8-byte store fills whole sectors (16 a thread). Rows stay in
    their warps, so the conversion is one shuffle a register pair, not a trip through shared
    memory (which the forward has no room for; a second swap to 16-byte stores measured no
    better: bench/NOTES.md 240)."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [8, 0]] + [[0, 1 << e] for e in range(4, n.bit_length() - 1)],
        lane_bases=[[0, 8], [0, 4], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[64, n],
    )  # fmt: skip


@gluon.jit
def _store_tile(base, x, m0, Lq, stride_m, BLOCK_M: gl.constexpr, D: gl.constexpr):
    """Rows m0 .. m0 + BLOCK_M (those below Lq) of a (rows, D) tile at base (row stride
    stride_m, contiguous along D) from x, a wgmma accumulator-layout [BLOCK_M, D] tile of 16-bit
    values, through _store_layout (the forward's and dQ kernel's epilogues took ~4500
    cycles an item with the accumulator's 4-byte stores, ~2500 with these: NOTES 239-240)."""
    layout: gl.constexpr = _store_layout(D)
    x = gl.convert_layout(x, layout)
    rows = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
    ptr = base + rows.to(gl.int64)[:, None] * stride_m + cols[None, :]
    gl.store(ptr, x, mask=(rows < Lq)[:, None])


# Forward ---------------------------------------------------------------------------------------


@gluon.jit
def _fwd_item(t, n_bh, H, G, NQ, mask_hdiv, KEY_END, end_stride_b, BLOCK_N: gl.constexpr):
    """Work item t of the persistent forward: (b, h, KV group, mask head, query pair, key
    tiles), the query pairs longest first (under causality the last rows see the most keys)."""
    n_pairs = gl.cdiv(NQ, 2)
    pid_m = n_pairs - 1 - t // n_bh
    pid_bh = t % n_bh
    b = pid_bh // H
    h = pid_bh % H
    hk = h // G
    hm = (hk * G) // mask_hdiv
    last_tile = gl.minimum(2 * pid_m + 1, NQ - 1)
    n_tiles = gl.cdiv(gl.load(KEY_END + b * end_stride_b + hm * NQ + last_tile), BLOCK_N)
    return b, h, hk, hm, pid_m, n_tiles


@gluon.jit
def _fwd_loader(q_desc, do_desc, o_desc, k_desc, v_desc, keys_desc, bias_desc, rings, KEY_END,
                end_stride_b, keys_rows_b, bias_heads, bias_head_mul, n_items, n_bh, H,
                G, NQ, mask_hdiv, Lk, WITH_DO: gl.constexpr, HAS_BIAS: gl.constexpr,
                BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):  # fmt: skip
    """The loader of the forward and dQ kernels. For each work item of this program: both
    consumers' Q tiles (with WITH_DO, the dQ kernel's, their dO and O tiles on the same
    barrier; once each consumer released its previous ones), then for list positions
    [0, n_tiles * BLOCK_N) the K tile with its list columns (the keys' positions and biases,
    flat 1-D boxes: a box running past its row reads the next row's, which only masked columns
    hold) and the V tile, into a STAGES-deep ring shared across items; a slot is reused once
    both consumers released it. So the next item's loads run under the current item's last
    products and epilogue, and the consumers read the columns from shared memory instead of
    carrying them in registers."""
    k_bytes: gl.constexpr = (
        k_desc.block_type.nbytes + keys_desc.block_type.nbytes
        + (bias_desc.block_type.nbytes if HAS_BIAS else 0)
    )  # fmt: skip
    q_bytes: gl.constexpr = q_desc.block_type.nbytes * (3 if WITH_DO else 1)
    it = 0
    i = 0
    for k in range(gl.program_id(0), n_items, gl.num_programs(0)):
        t = _snake(k, n_items)
        b, h, hk, hm, pid_m, n_tiles = _fwd_item(
            t, n_bh, H, G, NQ, mask_hdiv, KEY_END, end_stride_b, BLOCK_N
        )
        m0 = pid_m * (2 * BLOCK_M)
        for c in gl.static_range(2):
            mbarrier.wait(rings.q_empty.index(c), (i & 1) ^ 1)
            mbarrier.expect(rings.q_bars.index(c), q_bytes)
            _tma_load(
                q_desc, [b, m0 + c * BLOCK_M, h, 0], rings.q_bars.index(c), rings.q_smem.index(c)
            )
            if WITH_DO:
                _tma_load(
                    do_desc,
                    [b, m0 + c * BLOCK_M, h, 0],
                    rings.q_bars.index(c),
                    rings.do_smem.index(c),
                )
                _tma_load(
                    o_desc,
                    [b, m0 + c * BLOCK_M, h, 0],
                    rings.q_bars.index(c),
                    rings.o_smem.index(c),
                )
        keys0 = (b * keys_rows_b + hm) * Lk
        bias0 = ((b * (H // G) + hk) * bias_heads + (h % G) * bias_head_mul) * Lk
        for j in range(n_tiles):
            slot = it % STAGES
            mbarrier.wait(rings.kv_empty.index(slot), ((it // STAGES) & 1) ^ 1)
            mbarrier.expect(rings.k_ready.index(slot), k_bytes)
            _tma_load(
                k_desc, [b, j * BLOCK_N, hk, 0], rings.k_ready.index(slot), rings.k_smem.index(slot)
            )
            _tma_load(
                keys_desc,
                [keys0 + j * BLOCK_N],
                rings.k_ready.index(slot),
                rings.kcol_smem.index(slot),
            )
            if HAS_BIAS:
                _tma_load(
                    bias_desc,
                    [bias0 + j * BLOCK_N],
                    rings.k_ready.index(slot),
                    rings.bcol_smem.index(slot),
                )
            mbarrier.expect(rings.v_ready.index(slot), v_desc.block_type.nbytes)
            _tma_load(
                v_desc, [b, j * BLOCK_N, hk, 0], rings.v_ready.index(slot), rings.v_smem.index(slot)
            )
            it += 1
        i += 1  # noqa: SIM113 (Gluon loops take no enumerate)


@gluon.jit
def _fwd_logits(s, slot, j, kcol_smem, bcol_smem, count, rows, off, scale,
                MASKED: gl.constexpr, IS_CAUSAL: gl.constexpr, HAS_BIAS: gl.constexpr,
                BLOCK_N: gl.constexpr):  # fmt: skip
    """The natural-unit scores of list tile j (ring slot `slot`): s * scale plus the keys'
    biases; MASKED: -inf where the key is past the list or (causal) after the row's position
    (a tile every row sees whole needs neither test)."""
    col_layout: gl.constexpr = gl.SliceLayout(0, s.type.layout)
    x = s * scale
    if HAS_BIAS:
        x = x + bcol_smem.index(slot).load(col_layout).to(gl.float32)[None, :]
    if MASKED:
        ok = _fwd_allowed(slot, j, kcol_smem, count, rows, off, IS_CAUSAL, BLOCK_N)
        x = gl.where(ok, x, float("-inf"))
    return x


@gluon.jit
def _fwd_allowed(slot, j, kcol_smem, count, rows, off, IS_CAUSAL: gl.constexpr,
                 BLOCK_N: gl.constexpr):  # fmt: skip
    """[rows, keys of list tile j]: the key is listed and (causal) not after the row (rows: a
    slice of the scores' layout)."""
    col_layout: gl.constexpr = gl.SliceLayout(0, rows.type.layout.parent)
    cols = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=col_layout)
    ok = (cols < count)[None, :]
    if IS_CAUSAL:
        pos = kcol_smem.index(slot).load(col_layout)
        ok = ok & (pos[None, :] <= rows[:, None] + off)
    return ok


@gluon.jit
def _product_t(a2, ring_smem, slot, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
               D: gl.constexpr):  # fmt: skip
    """A B^T into a fresh float32 accumulator, issued asynchronously: a2 (BLOCK_M, D) and the
    ring slot's tile B (BLOCK_N, D) in shared memory (S = Q K^T, dP = dO V^T)."""
    return warpgroup_mma(
        a2, ring_smem.index(slot).reshape([BLOCK_N, D]).permute((1, 0)),
        gl.zeros([BLOCK_M, BLOCK_N], gl.float32, _mma_layout(BLOCK_N)), use_acc=False,
        is_async=True,
    )  # fmt: skip


@gluon.jit
def _item_rows(KEY_END, KEY_COUNT, b, hm, pid_m, n_tiles, end_stride_b, count_stride_b, NQ,
               row_l: gl.constexpr, C: gl.constexpr, IS_CAUSAL: gl.constexpr,
               BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):  # fmt: skip
    """Consumer C's share of a forward or dQ work item: (count, n_whole, first row, rows in
    layout row_l): the list's count and how many of the item's key tiles every row of the
    consumer sees whole (their keys all precede its first row: the previous query tile's
    key_end; without causality the whole list)."""
    count = gl.load(KEY_COUNT + b * count_stride_b + hm)
    qt = pid_m * 2 + C  # this consumer's query tile
    if IS_CAUSAL:
        seen = gl.load(KEY_END + b * end_stride_b + hm * NQ + gl.maximum(qt - 1, 0))
        seen = gl.where(qt > 0, seen, 0)
    else:
        seen = count
    mr = qt * BLOCK_M
    return count, gl.minimum(seen // BLOCK_N, n_tiles), mr, mr + gl.arange(0, BLOCK_M, layout=row_l)


# The ping-pong's named barriers (bar.sync / bar.arrive ids; Triton's warp specialisation takes
# the low ones for its own partition barriers): consumer C waits on PP_BARRIER + C.
PP_BARRIER = gl.constexpr(8)


@gluon.constexpr_function
def _bar_asm(op, bar_id):
    """PTX of named barrier op ("sync" or "arrive") on bar_id for both consumers' 256 threads,
    then a move that gives the inline assembly its one output."""
    return f"bar.{op} {bar_id}, 256;\n\tmov.b32 $0, $1;"


@gluon.jit
def _named_barrier(op: gl.constexpr, bar_id: gl.constexpr):
    """Named barrier `op` on bar_id, executed once by each thread of the calling 4-warp
    consumer (one element a thread). Every thread takes part, so no warpgroup barrier is
    needed first, as it is before an mbarrier arrive, which one thread makes for all."""
    one_each: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    gl.inline_asm_elementwise(_bar_asm(op, bar_id), "=r,r",
                              [gl.arange(0, 128, layout=one_each)], gl.int32, False, 1)  # fmt: skip


@gluon.jit
def _fwd_turn(C: gl.constexpr, PINGPONG: gl.constexpr):
    """Ping-pong: before consumer C issues its products it waits for the other consumer's
    issue of its own previous ones (consumer 0 goes first: _pp_start), so the tensor cores
    alternate. Named barrier PP_BARRIER + C: C's 128 threads wait, the other's 128 arrive."""
    if PINGPONG:
        _named_barrier("sync", PP_BARRIER + C)


@gluon.jit
def _fwd_pass(C: gl.constexpr, PINGPONG: gl.constexpr):
    """Ping-pong: consumer C has issued; the other's turn."""
    if PINGPONG:
        _named_barrier("arrive", PP_BARRIER + 1 - C)


@gluon.jit
def _pp_start(C: gl.constexpr, PINGPONG: gl.constexpr):
    """Ping-pong: consumer 1 passes once before its first issue, so that consumer 0 goes
    first."""
    if PINGPONG:  # noqa: SIM102 (two constexpr tests)
        if C == 1:
            _named_barrier("arrive", PP_BARRIER)


@gluon.jit
def _pp_end(C: gl.constexpr, PINGPONG: gl.constexpr):
    """Ping-pong: consumer 0 takes the pass consumer 1 made after its last issue, so that both
    named barriers end with no arrival pending (as many issues in both consumers)."""
    if PINGPONG:  # noqa: SIM102 (two constexpr tests)
        if C == 0:
            _named_barrier("sync", PP_BARRIER)


@gluon.jit
def _fwd_step(j, it, q2, rings, state, count, rows, off, scale, C: gl.constexpr,
              MASKED: gl.constexpr, IS_CAUSAL: gl.constexpr, HAS_BIAS: gl.constexpr,
              PINGPONG: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              D: gl.constexpr, STAGES: gl.constexpr):  # fmt: skip
    """Key tile j >= 1 of an item: S_j = Q K_j^T and O += P_{j-1} V_{j-1} issued back to back,
    the softmax of S_j while the second product runs, then slot j - 1 released. rings: the
    shared buffers and barriers (_Rings); state: (o, p, m_i, l_i), returned updated: p, the
    previous tile's probabilities, crosses the loop in float32 and is converted here, next to
    the product that reads it (a 16-bit P carried through the loop comes back as halves that
    ptxas repacks, one PRMT a register pair)."""
    o, p, m_i, l_i = state
    o_layout: gl.constexpr = _mma_layout(D)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    slot = (it + j) % STAGES
    prev = (it + j - 1) % STAGES
    mbarrier.wait(rings.k_ready.index(slot), ((it + j) // STAGES) & 1)
    mbarrier.wait(rings.v_ready.index(prev), ((it + j - 1) // STAGES) & 1)
    p16 = gl.convert_layout(p.to(q2.dtype), p_layout)
    _fwd_turn(C, PINGPONG)
    s = _product_t(q2, rings.k_smem, slot, BLOCK_M, BLOCK_N, D)
    o = warpgroup_mma(p16, rings.v_smem.index(prev).reshape([BLOCK_N, D]), o, is_async=True)
    _fwd_pass(C, PINGPONG)
    s = warpgroup_mma_wait(1, deps=[s])  # S_j done; P_{j-1} V_{j-1} may still run
    x = _fwd_logits(s, slot, j, rings.kcol_smem, rings.bcol_smem, count, rows, off, scale, MASKED,
                    IS_CAUSAL, HAS_BIAS, BLOCK_N)  # fmt: skip
    m_new = gl.maximum(m_i, gl.max(x, axis=1))
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    # Subtract first, then scale by log2(e): (x - m) * log2e cannot overflow for finite x and
    # m, where x * log2e can (a bias of finfo.min).
    alpha = gl.exp2((m_i - m_safe) * LOG2E)
    p = gl.exp2((x - m_safe[:, None]) * LOG2E)
    l_i = l_i * alpha + gl.sum(p, axis=1)
    o, p16 = warpgroup_mma_wait(0, deps=[o, p16])
    mbarrier.arrive(rings.kv_empty.index(prev), count=1)
    o = o * gl.convert_layout(alpha, row_o)[:, None]
    return o, p, m_new, l_i


@gluon.jit
def _fwd_consumer(OUT, LSE, LSE_REM, KEY_END, KEY_COUNT, rings, n_items, n_bh, H,
                  G, NQ, mask_hdiv, Lq, Lk, scale, stride_ob, stride_om, stride_oh,
                  end_stride_b, count_stride_b, C: gl.constexpr, IS_CAUSAL: gl.constexpr,
                  HAS_BIAS: gl.constexpr, PINGPONG: gl.constexpr, BLOCK_M: gl.constexpr,
                  BLOCK_N: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr):  # fmt: skip
    """Rows C * BLOCK_M onwards of each work item's query pair, key tile by key tile
    (_fwd_step): first the tiles every row of this consumer sees whole (their keys all precede
    its first row: the previous query tile's key_end; without causality the whole list) with
    no mask, then the rest masked. Q's slot is released once the item's last S is done, before
    its epilogue."""
    s_layout: gl.constexpr = _mma_layout(BLOCK_N)
    o_layout: gl.constexpr = _mma_layout(D)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    dtype: gl.constexpr = rings.q_smem.dtype

    off = Lk - Lq
    q2 = rings.q_smem.index(C).reshape([BLOCK_M, D])
    it = 0
    i = 0
    _pp_start(C, PINGPONG)
    for k in range(gl.program_id(0), n_items, gl.num_programs(0)):
        t = _snake(k, n_items)
        b, h, _, hm, pid_m, n_tiles = _fwd_item(
            t, n_bh, H, G, NQ, mask_hdiv, KEY_END, end_stride_b, BLOCK_N
        )
        count, n_whole, mr, rows = _item_rows(
            KEY_END, KEY_COUNT, b, hm, pid_m, n_tiles, end_stride_b, count_stride_b, NQ, row_s,
            C, IS_CAUSAL, BLOCK_M, BLOCK_N,
        )  # fmt: skip
        m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, row_s)
        l_i = gl.zeros([BLOCK_M], gl.float32, row_s)
        o = gl.zeros([BLOCK_M, D], gl.float32, o_layout)
        mbarrier.wait(rings.q_bars.index(C), i & 1)
        if n_tiles > 0:
            slot = it % STAGES
            mbarrier.wait(rings.k_ready.index(slot), (it // STAGES) & 1)
            _fwd_turn(C, PINGPONG)
            s = _product_t(q2, rings.k_smem, slot, BLOCK_M, BLOCK_N, D)
            _fwd_pass(C, PINGPONG)
            s = warpgroup_mma_wait(0, deps=[s])
            x = _fwd_logits(s, slot, 0, rings.kcol_smem, rings.bcol_smem, count, rows, off, scale,
                            True, IS_CAUSAL, HAS_BIAS, BLOCK_N)  # fmt: skip
            m_i = gl.max(x, axis=1)
            m_safe = gl.where(m_i == float("-inf"), 0.0, m_i)
            p = gl.exp2((x - m_safe[:, None]) * LOG2E)
            l_i = gl.sum(p, axis=1)
            for j in range(1, n_whole):
                o, p, m_i, l_i = _fwd_step(
                    j, it, q2, rings, (o, p, m_i, l_i), count, rows, off, scale, C, False,
                    IS_CAUSAL, HAS_BIAS, PINGPONG, BLOCK_M, BLOCK_N, D, STAGES,
                )  # fmt: skip
            for j in range(gl.maximum(n_whole, 1), n_tiles):
                o, p, m_i, l_i = _fwd_step(
                    j, it, q2, rings, (o, p, m_i, l_i), count, rows, off, scale, C, True,
                    IS_CAUSAL, HAS_BIAS, PINGPONG, BLOCK_M, BLOCK_N, D, STAGES,
                )  # fmt: skip
            mbarrier.arrive(rings.q_empty.index(C), count=1)  # the item's last S is done
            last = (it + n_tiles - 1) % STAGES
            mbarrier.wait(rings.v_ready.index(last), ((it + n_tiles - 1) // STAGES) & 1)
            p16 = gl.convert_layout(p.to(dtype), p_layout)
            _fwd_turn(C, PINGPONG)
            o = warpgroup_mma(p16, rings.v_smem.index(last).reshape([BLOCK_N, D]), o, is_async=True)
            _fwd_pass(C, PINGPONG)
            o, p16 = warpgroup_mma_wait(0, deps=[o, p16])
            mbarrier.arrive(rings.kv_empty.index(last), count=1)
        else:
            mbarrier.arrive(rings.q_empty.index(C), count=1)
        it += n_tiles
        i += 1  # noqa: SIM113 (Gluon loops take no enumerate)

        nonempty = l_i > 0.0
        l_safe = gl.where(nonempty, l_i, 1.0)
        o = o / gl.convert_layout(l_safe, row_o)[:, None]
        # (lse, lse_rem) = m + log(l) split by TwoSum, as kernels/common.py lse_split.
        m_r = gl.where(nonempty, m_i, 0.0)
        log_sum = gl.log(l_safe)
        lse = m_r + log_sum
        b_virtual = lse - m_r
        a_virtual = lse - b_virtual
        lse_rem = (m_r - a_virtual) + (log_sum - b_virtual)
        lse = gl.where(nonempty, lse, float("-inf"))
        lse_rem = gl.where(nonempty, lse_rem, 0.0)
        p_out = OUT + b.to(gl.int64) * stride_ob + h * stride_oh
        _store_tile(p_out, o.to(dtype), mr, Lq, stride_om, BLOCK_M, D)
        o_row = (b * H + h).to(gl.int64) * Lq + rows
        gl.store(LSE + o_row, lse, mask=rows < Lq)
        gl.store(LSE_REM + o_row, lse_rem, mask=rows < Lq)
    _pp_end(C, PINGPONG)


@_aggregate
class _Rings:
    """The forward's and dQ kernel's shared memory and mbarriers (_rings): both consumers' Q
    tiles (q_smem) and, in the dQ kernel, their dO tiles (do_smem; else Q's buffer again),
    with q_bars (Q and dO land on one barrier) and q_empty per consumer; the ring's K, V and
    list columns (keys' positions, biases) with k_ready, v_ready and kv_empty (both consumers
    release a slot) per slot. (The ping-pong takes named barriers: _fwd_turn.)"""

    q_smem: gl.shared_memory_descriptor
    do_smem: gl.shared_memory_descriptor
    o_smem: gl.shared_memory_descriptor
    k_smem: gl.shared_memory_descriptor
    v_smem: gl.shared_memory_descriptor
    kcol_smem: gl.shared_memory_descriptor
    bcol_smem: gl.shared_memory_descriptor
    q_bars: gl.shared_memory_descriptor
    q_empty: gl.shared_memory_descriptor
    k_ready: gl.shared_memory_descriptor
    v_ready: gl.shared_memory_descriptor
    kv_empty: gl.shared_memory_descriptor

    @gluon.constexpr_function
    def __init__(self, q_smem, do_smem, o_smem, k_smem, v_smem, kcol_smem, bcol_smem, q_bars,
                 q_empty, k_ready, v_ready, kv_empty):  # fmt: skip
        self.q_smem, self.do_smem, self.o_smem = q_smem, do_smem, o_smem
        self.k_smem, self.v_smem = k_smem, v_smem
        self.kcol_smem, self.bcol_smem = kcol_smem, bcol_smem
        self.q_bars, self.q_empty = q_bars, q_empty
        self.k_ready, self.v_ready, self.kv_empty = k_ready, v_ready, kv_empty


@gluon.jit
def _rings(q_desc, do_desc, o_desc, k_desc, v_desc, keys_desc, bias_desc, WITH_DO: gl.constexpr,
           HAS_BIAS: gl.constexpr, STAGES: gl.constexpr):  # fmt: skip
    """The forward's and dQ kernel's _Rings, allocated, the barriers initialised."""
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [2] + q_desc.block_type.shape, q_desc.layout)
    do_smem = q_smem
    o_smem = q_smem
    if WITH_DO:
        do_smem = gl.allocate_shared_memory(dtype, [2] + do_desc.block_type.shape, do_desc.layout)
        o_smem = gl.allocate_shared_memory(dtype, [2] + o_desc.block_type.shape, o_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    kcol_smem = gl.allocate_shared_memory(
        keys_desc.dtype, [STAGES] + keys_desc.block_type.shape, keys_desc.layout
    )
    bcol_smem = gl.allocate_shared_memory(
        bias_desc.dtype, [STAGES if HAS_BIAS else 1] + bias_desc.block_type.shape,
        bias_desc.layout,
    )  # fmt: skip
    q_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(q_bars.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=2)
    return _Rings(q_smem, do_smem, o_smem, k_smem, v_smem, kcol_smem, bcol_smem, q_bars, q_empty,
                  k_ready, v_ready, kv_empty)  # fmt: skip


@gluon.jit
def _rows_shape(q_desc, k_desc, bias_heads, BLOCK_M: gl.constexpr, D: gl.constexpr):
    """What the forward and dQ kernels read from their descriptors' shapes instead of taking
    them as arguments: (H, G, Lq, Lk, NQ query tiles, n_items, bias_head_mul, and the strides
    (batch, row, head) of their contiguous (B, Lq, H, D) outputs and O)."""
    Lq = q_desc.shape[1]
    H = q_desc.shape[2]
    NQ = gl.cdiv(Lq, BLOCK_M)
    stride_m = H * D
    bias_head_mul = 1 - 1 // bias_heads  # 0 where one row serves the group; a constexpr at 1
    n_items = gl.cdiv(NQ, 2) * q_desc.shape[0] * H
    return (H, H // k_desc.shape[2], Lq, k_desc.shape[1], NQ, n_items, bias_head_mul,
            Lq.to(gl.int64) * stride_m, stride_m, D)  # fmt: skip


@gluon.jit
def hopper_fwd_kernel(q_desc, k_desc, v_desc, keys_desc, bias_desc, OUT, LSE, LSE_REM, KEY_END,
                      KEY_COUNT, keys_rows_b, end_stride_b, count_stride_b, bias_heads, mask_hdiv,
                      scale, IS_CAUSAL: gl.constexpr, HAS_BIAS: gl.constexpr,
                      PINGPONG: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                      D: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr):  # fmt: skip
    """A persistent program: work items (2 * BLOCK_M queries of one (batch, head) against its KV
    group's key list, KEY_END counted per BLOCK_M-row tile) t = program_id, + num_programs, ...
    of n_items = cdiv(NQ, 2) * B * H (_rows_shape). keys_desc, bias_desc: flat 1-D views of the
    lists (Bm * Hm * Lk) and of the packed bias (rows of Lk; without a bias, keys_desc again,
    unread). Writes out (B, Lq, H, D) contiguous, lse and lse_rem."""
    gl.static_assert(num_warps == 4)
    H, G, Lq, Lk, NQ, n_items, bias_head_mul, stride_ob, stride_om, stride_oh = _rows_shape(
        q_desc, k_desc, bias_heads, BLOCK_M, D
    )
    n_bh = n_items // gl.cdiv(NQ, 2)

    rings = _rings(
        q_desc, q_desc, q_desc, k_desc, v_desc, keys_desc, bias_desc, False, HAS_BIAS, STAGES
    )
    # the two consumers: the default partition (C = 0) and a worker (C = 1)
    gl.warp_specialize([
        (_fwd_consumer, (OUT, LSE, LSE_REM, KEY_END, KEY_COUNT, rings, n_items, n_bh, H, G, NQ,
                         mask_hdiv, Lq, Lk, scale, stride_ob, stride_om, stride_oh, end_stride_b,
                         count_stride_b, 0, IS_CAUSAL, HAS_BIAS, PINGPONG, BLOCK_M, BLOCK_N, D,
                         STAGES)),
        (_fwd_consumer, (OUT, LSE, LSE_REM, KEY_END, KEY_COUNT, rings, n_items, n_bh, H, G, NQ,
                         mask_hdiv, Lq, Lk, scale, stride_ob, stride_om, stride_oh, end_stride_b,
                         count_stride_b, 1, IS_CAUSAL, HAS_BIAS, PINGPONG, BLOCK_M, BLOCK_N, D,
                         STAGES)),
        (_fwd_loader, (q_desc, q_desc, q_desc, k_desc, v_desc, keys_desc, bias_desc, rings,
                       KEY_END, end_stride_b, keys_rows_b, bias_heads, bias_head_mul, n_items,
                       n_bh, H, G, NQ, mask_hdiv, Lk, False, HAS_BIAS, BLOCK_M, BLOCK_N,
                       STAGES)),
    ], [4, 1], [240, 24])  # fmt: skip


# dQ --------------------------------------------------------------------------------------------


@gluon.jit
def _dq_stats(STATS, o2, LSE, LSE_REM, do2, b, h, mr, H, Lq, row_l: gl.constexpr,
              BLOCK_M: gl.constexpr, D: gl.constexpr):  # fmt: skip
    """The backward's row statistics of query rows mr... of head h (launch.RowStats): delta =
    rowsum(dO * O) from dO and O in shared memory (the loader brings both with Q; rows past Lq
    are zeros there), lse (0 where the forward stored -inf) and lse_rem; stored as float32 rows
    [lse, lse_rem, delta, 0] of STATS for the dK/dV kernel launched after this one, and
    returned in layout row_l. The tiles load in a [BLOCK_M, D] wgmma accumulator's layout,
    whose rows are row_l's (a [BLOCK_M, BLOCK_N] accumulator's: the rows of a warpgroup's
    wgmma do not depend on N), so no row vector goes through shared memory."""
    acc_l: gl.constexpr = _mma_layout(D)
    delta = gl.sum(o2.load(acc_l).to(gl.float32) * do2.load(acc_l).to(gl.float32), axis=1)
    delta = gl.convert_layout(delta, row_l)  # no data moves
    rows = mr + gl.arange(0, BLOCK_M, layout=row_l)
    in_q = rows < Lq
    o_row = (b * H + h).to(gl.int64) * Lq + rows
    lse = gl.load(LSE + o_row, mask=in_q, other=0.0)
    lse = gl.where(lse == float("-inf"), 0.0, lse)
    lse_rem = gl.load(LSE_REM + o_row, mask=in_q, other=0.0)
    gl.store(STATS + o_row * 4, lse, mask=in_q)
    gl.store(STATS + o_row * 4 + 1, lse_rem, mask=in_q)
    gl.store(STATS + o_row * 4 + 2, delta, mask=in_q)
    gl.store(STATS + o_row * 4 + 3, gl.zeros_like(delta), mask=in_q)
    return lse, lse_rem, delta


@gluon.jit
def _dq_probs(s, slot, j, kcol_smem, bcol_smem, stats, count, rows, off, scale,
              IS_CAUSAL: gl.constexpr, HAS_BIAS: gl.constexpr, BLOCK_N: gl.constexpr):  # fmt: skip
    """P of key tile j from S: exp((s - lse) - lse_rem), the exponent clamped at 0 (as
    kernels/attention_bwd_stats.py _probs); unmasked (_dq_scores selects dS)."""
    lse, lse_rem, _ = stats
    x = _fwd_logits(s, slot, j, kcol_smem, bcol_smem, count, rows, off, scale, False,
                    IS_CAUSAL, HAS_BIAS, BLOCK_N)  # fmt: skip
    return gl.exp2(gl.minimum((x - lse[:, None]) - lse_rem[:, None], 0.0) * LOG2E)


@gluon.jit
def _dq_scores(p, dp, slot, j, kcol_smem, stats, count, rows, off, MASKED: gl.constexpr,
               IS_CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr):  # fmt: skip
    """dS of key tile j from P (_dq_probs) and dP: P (dP - delta); MASKED: 0 where the key is
    past the list or (causal) after the row (a select: P there may be anything, dP NaN)."""
    delta = stats[2]
    ds = p * (dp - delta[:, None])
    if MASKED:
        ok = _fwd_allowed(slot, j, kcol_smem, count, rows, off, IS_CAUSAL, BLOCK_N)
        ds = gl.where(ok, ds, 0.0)
    return ds


@gluon.jit
def _dq_step(j, it, q2, do2, rings, dq, ds, stats, count, rows, off, scale,
             C: gl.constexpr, MASKED: gl.constexpr, IS_CAUSAL: gl.constexpr,
             HAS_BIAS: gl.constexpr, PINGPONG: gl.constexpr, BLOCK_M: gl.constexpr,
             BLOCK_N: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr):  # fmt: skip
    """Key tile j >= 1 of an item: S_j = Q K_j^T, dP_j = dO V_j^T and dQ += dS_{j-1} K_{j-1}
    issued back to back, dS_j computed while the last two run, then slot j - 1 released. dS
    crosses the loop in float32, as the forward's P (_fwd_step)."""
    ds_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=_mma_layout(D),
                                                  k_width=2)  # fmt: skip
    slot = (it + j) % STAGES
    prev = (it + j - 1) % STAGES
    phase = ((it + j) // STAGES) & 1
    mbarrier.wait(rings.k_ready.index(slot), phase)
    mbarrier.wait(rings.v_ready.index(slot), phase)
    ds16 = gl.convert_layout(ds.to(q2.dtype), ds_layout)
    _fwd_turn(C, PINGPONG)
    s = _product_t(q2, rings.k_smem, slot, BLOCK_M, BLOCK_N, D)
    dp = _product_t(do2, rings.v_smem, slot, BLOCK_M, BLOCK_N, D)
    dq = warpgroup_mma(ds16, rings.k_smem.index(prev).reshape([BLOCK_N, D]), dq, is_async=True)
    _fwd_pass(C, PINGPONG)
    s = warpgroup_mma_wait(2, deps=[s])
    p = _dq_probs(s, slot, j, rings.kcol_smem, rings.bcol_smem, stats, count, rows, off, scale,
                  IS_CAUSAL, HAS_BIAS, BLOCK_N)  # fmt: skip
    dp = warpgroup_mma_wait(1, deps=[dp])  # P's exponentials ran under dP
    ds = _dq_scores(p, dp, slot, j, rings.kcol_smem, stats, count, rows, off, MASKED, IS_CAUSAL,
                    BLOCK_N)  # fmt: skip
    dq, ds16 = warpgroup_mma_wait(0, deps=[dq, ds16])
    mbarrier.arrive(rings.kv_empty.index(prev), count=1)
    return dq, ds


@gluon.jit
def _dq_consumer(DQ, STATS, LSE, LSE_REM, KEY_END, KEY_COUNT, rings, n_items, n_bh, H, G,
                 NQ, mask_hdiv, Lq, Lk, scale, stride_b, stride_m, stride_h, end_stride_b,
                 count_stride_b, C: gl.constexpr, IS_CAUSAL: gl.constexpr,
                 HAS_BIAS: gl.constexpr, PINGPONG: gl.constexpr, BLOCK_M: gl.constexpr,
                 BLOCK_N: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr):  # fmt: skip
    """Rows C * BLOCK_M onwards of each work item's query pair: their row statistics
    (_dq_stats), then key tile by key tile (_dq_step; the tiles every row sees whole first,
    unmasked, as in the forward) dQ = scale * sum dS K, stored in DQ's dtype. Q's and dO's
    slot (and O's, which the statistics read) is released once the item's last products that
    read them are done. DQ is (B, Lq, H, D) contiguous."""
    s_layout: gl.constexpr = _mma_layout(BLOCK_N)
    acc_layout: gl.constexpr = _mma_layout(D)
    ds_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    dtype: gl.constexpr = rings.q_smem.dtype

    off = Lk - Lq
    q2 = rings.q_smem.index(C).reshape([BLOCK_M, D])
    do2 = rings.do_smem.index(C).reshape([BLOCK_M, D])
    o2 = rings.o_smem.index(C).reshape([BLOCK_M, D])
    it = 0
    i = 0
    _pp_start(C, PINGPONG)
    for k in range(gl.program_id(0), n_items, gl.num_programs(0)):
        t = _snake(k, n_items)
        b, h, _, hm, pid_m, n_tiles = _fwd_item(
            t, n_bh, H, G, NQ, mask_hdiv, KEY_END, end_stride_b, BLOCK_N
        )
        count, n_whole, mr, rows = _item_rows(
            KEY_END, KEY_COUNT, b, hm, pid_m, n_tiles, end_stride_b, count_stride_b, NQ, row_s,
            C, IS_CAUSAL, BLOCK_M, BLOCK_N,
        )  # fmt: skip
        dq = gl.zeros([BLOCK_M, D], gl.float32, acc_layout)
        mbarrier.wait(rings.q_bars.index(C), i & 1)
        stats = _dq_stats(STATS, o2, LSE, LSE_REM, do2, b, h, mr, H, Lq, row_s, BLOCK_M, D)
        if n_tiles > 0:
            slot = it % STAGES
            mbarrier.wait(rings.k_ready.index(slot), (it // STAGES) & 1)
            mbarrier.wait(rings.v_ready.index(slot), (it // STAGES) & 1)
            _fwd_turn(C, PINGPONG)
            s = _product_t(q2, rings.k_smem, slot, BLOCK_M, BLOCK_N, D)
            dp = _product_t(do2, rings.v_smem, slot, BLOCK_M, BLOCK_N, D)
            _fwd_pass(C, PINGPONG)
            s = warpgroup_mma_wait(1, deps=[s])
            p = _dq_probs(s, slot, 0, rings.kcol_smem, rings.bcol_smem, stats, count, rows, off,
                          scale, IS_CAUSAL, HAS_BIAS, BLOCK_N)  # fmt: skip
            dp = warpgroup_mma_wait(0, deps=[dp])
            ds = _dq_scores(p, dp, slot, 0, rings.kcol_smem, stats, count, rows, off, True,
                            IS_CAUSAL, BLOCK_N)  # fmt: skip
            for j in range(1, n_whole):
                dq, ds = _dq_step(
                    j, it, q2, do2, rings, dq, ds, stats, count, rows, off, scale, C,
                    False, IS_CAUSAL, HAS_BIAS, PINGPONG, BLOCK_M, BLOCK_N, D, STAGES,
                )  # fmt: skip
            for j in range(gl.maximum(n_whole, 1), n_tiles):
                dq, ds = _dq_step(
                    j, it, q2, do2, rings, dq, ds, stats, count, rows, off, scale, C,
                    True, IS_CAUSAL, HAS_BIAS, PINGPONG, BLOCK_M, BLOCK_N, D, STAGES,
                )  # fmt: skip
            mbarrier.arrive(rings.q_empty.index(C), count=1)  # the item's last S and dP are done
            last = (it + n_tiles - 1) % STAGES
            ds16 = gl.convert_layout(ds.to(dtype), ds_layout)
            _fwd_turn(C, PINGPONG)
            dq = warpgroup_mma(
                ds16, rings.k_smem.index(last).reshape([BLOCK_N, D]), dq, is_async=True
            )
            _fwd_pass(C, PINGPONG)
            dq, ds16 = warpgroup_mma_wait(0, deps=[dq, ds16])
            mbarrier.arrive(rings.kv_empty.index(last), count=1)
        else:
            mbarrier.arrive(rings.q_empty.index(C), count=1)
        it += n_tiles
        i += 1  # noqa: SIM113 (Gluon loops take no enumerate)

        p_dq = DQ + b.to(gl.int64) * stride_b + h * stride_h
        _store_tile(p_dq, (dq * scale).to(dtype), mr, Lq, stride_m, BLOCK_M, D)
    _pp_end(C, PINGPONG)


@gluon.jit
def hopper_dq_kernel(q_desc, do_desc, o_desc, k_desc, v_desc, keys_desc, bias_desc, DQ, STATS, LSE,
                     LSE_REM, KEY_END, KEY_COUNT, keys_rows_b, end_stride_b, count_stride_b,
                     bias_heads, mask_hdiv, scale, IS_CAUSAL: gl.constexpr,
                     HAS_BIAS: gl.constexpr, PINGPONG: gl.constexpr, BLOCK_M: gl.constexpr,
                     BLOCK_N: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr,
                     num_warps: gl.constexpr):  # fmt: skip
    """The forward's persistent programs and work items (hopper_fwd_kernel), each computing
    dQ of its two query tiles and their row statistics: K and V (packed, both zero past each
    list: dS = 0 there meets K) through the forward's loader, dO and O with Q. Writes DQ (B, Lq,
    H, D) contiguous and STATS."""
    gl.static_assert(num_warps == 4)
    H, G, Lq, Lk, NQ, n_items, bias_head_mul, stride_b, stride_m, stride_h = _rows_shape(
        q_desc, k_desc, bias_heads, BLOCK_M, D
    )
    n_bh = n_items // gl.cdiv(NQ, 2)

    rings = _rings(
        q_desc, do_desc, o_desc, k_desc, v_desc, keys_desc, bias_desc, True, HAS_BIAS, STAGES
    )
    # the two consumers, as in the forward
    gl.warp_specialize([
        (_dq_consumer, (DQ, STATS, LSE, LSE_REM, KEY_END, KEY_COUNT, rings, n_items, n_bh, H,
                        G, NQ, mask_hdiv, Lq, Lk, scale, stride_b, stride_m, stride_h,
                        end_stride_b, count_stride_b, 0, IS_CAUSAL, HAS_BIAS, PINGPONG, BLOCK_M,
                        BLOCK_N, D, STAGES)),
        (_dq_consumer, (DQ, STATS, LSE, LSE_REM, KEY_END, KEY_COUNT, rings, n_items, n_bh, H,
                        G, NQ, mask_hdiv, Lq, Lk, scale, stride_b, stride_m, stride_h,
                        end_stride_b, count_stride_b, 1, IS_CAUSAL, HAS_BIAS, PINGPONG, BLOCK_M,
                        BLOCK_N, D, STAGES)),
        (_fwd_loader, (q_desc, do_desc, o_desc, k_desc, v_desc, keys_desc, bias_desc, rings,
                       KEY_END, end_stride_b, keys_rows_b, bias_heads, bias_head_mul, n_items,
                       n_bh, H, G, NQ, mask_hdiv, Lk, True, HAS_BIAS, BLOCK_M, BLOCK_N,
                       STAGES)),
    ], [4, 1], [240, 24])  # fmt: skip


# dK / dV ---------------------------------------------------------------------------------------


@gluon.jit
def _dkdv_item(t, n_parts, n_bg, hkv, G, SPLIT, Lq, Lk, KEYS, KEY_COUNT, keys_stride_b,
               keys_stride_h, count_stride_b, mask_hdiv, BLOCK_M: gl.constexpr,
               BLOCK_N: gl.constexpr, IS_CAUSAL: gl.constexpr):  # fmt: skip
    """Work item t of the persistent dK/dV pass: list positions [n0, n0 + 2 * BLOCK_N) of one
    (batch, KV group) and G / SPLIT of its query heads (part `part`), over the query tiles
    [t_lo, n_q) that see the first of its keys. Items go by key tile first: under causality
    the first listed keys are seen by the most queries, so the longest items come first."""
    n0 = (t // n_parts) * (2 * BLOCK_N)
    part = t % n_parts
    i_bg = part % n_bg
    b = i_bg // hkv
    hk = i_bg % hkv
    n_heads = G // SPLIT
    g0 = (part // n_bg) * n_heads
    hm = (hk * G) // mask_hdiv
    count = gl.load(KEY_COUNT + b * count_stride_b + hm)
    keys = KEYS + b * keys_stride_b + hm * keys_stride_h
    n_q = gl.cdiv(Lq, BLOCK_M)
    t_lo = 0
    if IS_CAUSAL:
        # The first query that sees the first listed key of the item (positions ascend).
        first = gl.load(keys + n0, mask=n0 < count, other=0)
        t_lo = gl.maximum(first - (Lk - Lq), 0) // BLOCK_M
    t_lo = gl.where(n0 < count, gl.minimum(t_lo, n_q), n_q)
    return b, hk, g0, n0, part, n_heads, count, keys, t_lo, n_q


@gluon.jit
def _dkdv_step(i, hk, G, g0, t_lo, steps, BLOCK_M: gl.constexpr):
    """(query head, first row) of an item's step i: its heads in turn, each over the query
    tiles [t_lo, t_lo + steps)."""
    return hk * G + g0 + i // steps, (t_lo + i % steps) * BLOCK_M


@gluon.jit
def _dkdv_stats(stats_smem, slot, first: gl.constexpr, query_l: gl.constexpr,
                BLOCK_M: gl.constexpr):  # fmt: skip
    """Two of the row statistics of the query tile in ring slot `slot`, columns first and
    first + 1 of the dq kernel's (B, H, Lq, 4) rows [lse, lse_rem, delta, 0]
    (launch.RowStats), brought by the loader with Q: (lse, lse_rem) or (delta, 0), one value
    per row in the step's query layout. Rows past Lq hold another head's or zeros, and are
    masked by the caller. Each thread loads the rows of the query columns it holds in a [keys,
    queries] wgmma accumulator (2 * (lane % 4) + {0, 1} + 8 j, alike in every warp and for
    every lane / 4), so the split columns are already in that layout: a row-per-thread load
    converts each column through shared memory, two warpgroup barriers apiece, six a step
    (bench/NOTES.md 231). The pairs load apart, where each is used: all three columns live
    together cost the consumer more spills."""
    acc_cols: gl.constexpr = gl.BlockedLayout([2, 2], [4, 8], [1, 4], [0, 1])
    pair = stats_smem.index(slot).slice(first, 2, dim=1).load(acc_cols)  # [BLOCK_M, 2]
    a, b = gl.split(pair)
    return gl.convert_layout(a, query_l), gl.convert_layout(b, query_l)  # no data moves


@gluon.jit
def _dkdv_ok(in_list, m0, Lq, pos, off, query_l: gl.constexpr, IS_CAUSAL: gl.constexpr,
             BLOCK_M: gl.constexpr):  # fmt: skip
    """[keys, queries m0...]: the key is listed, the row below Lq and (causal) not before the
    key (made where a step needs it: its row vectors would otherwise stay live)."""
    rows = m0 + gl.arange(0, BLOCK_M, layout=query_l)
    ok = in_list[:, None] & (rows < Lq)[None, :]
    if IS_CAUSAL:
        ok = ok & (pos[:, None] <= rows[None, :] + off)
    return ok


@gluon.jit
def _dkdv_tile(i, it, item, rings, state, scale, FIRST: gl.constexpr, IS_CAUSAL: gl.constexpr,
               HAS_BIAS: gl.constexpr, DBIAS_COLS: gl.constexpr, BLOCK_M: gl.constexpr,
               BLOCK_N: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr):  # fmt: skip
    """Step i of a dK/dV work item (its query head and tile: _dkdv_step), ring slot it + i:
    S^T = K Q^T and dP^T = V dO^T issued; then (past the FIRST step) the wait for S^T that also
    completes dK += dS^T Q of step i - 1, whose slot is then released; P^T, dV += P^T dO,
    dS^T, and dK += dS^T Q left running under the next step's products. item: the work item's
    values; rings: the shared buffers and barriers (_DkdvRings); state (dK, dV, dS^T of the step
    in flight, the dbias column sums, the keys' biases), returned updated."""
    (
        hk,
        G,
        g0,
        t_lo,
        steps,
        Lq,
        off,
        r,
        keys_whole,
        last_pos,
        in_list,
        pos,
        bias_base,
        bias_head_mul,
        kc,
        vc,
    ) = item
    dk, dv, ds16, db, b_row = state
    st_layout: gl.constexpr = _mma_layout(BLOCK_M)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=_mma_layout(D),
                                                 k_width=2)  # fmt: skip
    query_l: gl.constexpr = gl.SliceLayout(0, st_layout)
    dtype: gl.constexpr = rings.q_smem.dtype
    h, m0 = _dkdv_step(i, hk, G, g0, t_lo, steps, BLOCK_M)
    slot = (it + i) % STAGES
    phase = ((it + i) // STAGES) & 1
    q2 = rings.q_smem.index(slot).reshape([BLOCK_M, D])
    do2 = rings.do_smem.index(slot).reshape([BLOCK_M, D])
    whole = keys_whole & (m0 + BLOCK_M <= Lq)
    if IS_CAUSAL:
        whole = whole & (last_pos <= m0 + off)
    if HAS_BIAS:  # noqa: SIM102 (a constexpr test, then a runtime one)
        if bias_head_mul != 0:
            p_bias = bias_base + (h % G).to(gl.int64) * (Lq + off)  # rows of Lk biases
            b_row = gl.load(p_bias + r, mask=in_list, other=0.0).to(gl.float32)
    mbarrier.wait(rings.q_ready.index(slot), phase)
    st = warpgroup_mma(kc, q2.permute((1, 0)), gl.zeros([BLOCK_N, BLOCK_M], gl.float32, st_layout),
                       use_acc=False, is_async=True)  # fmt: skip
    mbarrier.wait(rings.do_ready.index(slot), phase)
    dpt = warpgroup_mma(vc, do2.permute((1, 0)),
                        gl.zeros([BLOCK_N, BLOCK_M], gl.float32, st_layout), use_acc=False,
                        is_async=True)  # fmt: skip
    if FIRST:
        st = warpgroup_mma_wait(1, deps=[st])
    else:
        st, dk, ds16 = warpgroup_mma_wait(1, deps=[st, dk, ds16])  # dK of step i - 1 as well
        mbarrier.arrive(rings.qdo_empty.index((it + i - 1) % STAGES), count=1)
    x = st * scale
    if HAS_BIAS:
        x = x + b_row[:, None]
    lse, lse_rem = _dkdv_stats(rings.stats_smem, slot, 0, query_l, BLOCK_M)
    pt = gl.exp2(((x - lse[None, :]) - lse_rem[None, :]) * LOG2E)
    if not whole:
        pt = gl.where(_dkdv_ok(in_list, m0, Lq, pos, off, query_l, IS_CAUSAL, BLOCK_M), pt, 0.0)
    pt16 = gl.convert_layout(pt.to(dtype), a_layout)
    dv = warpgroup_mma(pt16, do2, dv, is_async=True)
    dpt = warpgroup_mma_wait(1, deps=[dpt])
    # dS^T keeps its own select: 0 * (dP^T - delta) is 0 only where both are finite.
    delta, _ = _dkdv_stats(rings.stats_smem, slot, 2, query_l, BLOCK_M)
    dst = pt * (dpt - delta[None, :])
    if not whole:
        dst = gl.where(_dkdv_ok(in_list, m0, Lq, pos, off, query_l, IS_CAUSAL, BLOCK_M), dst, 0.0)
    if DBIAS_COLS:
        db += gl.sum(dst, axis=1)
    ds16 = gl.convert_layout(dst.to(dtype), a_layout)
    dk = warpgroup_mma(ds16, q2, dk, is_async=True)
    dv, pt16 = warpgroup_mma_wait(1, deps=[dv, pt16])
    return dk, dv, ds16, db, b_row


@gluon.jit
def _dkdv_loader(q_desc, k_desc, v_desc, do_desc, stats_desc, rings, KEYS, KEY_COUNT,
                 keys_stride_b, keys_stride_h, count_stride_b, mask_hdiv, n_items, n_parts,
                 n_bg, hkv, H, G, SPLIT, Lq, Lk, IS_CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr,
                 BLOCK_N: gl.constexpr, STAGES: gl.constexpr):  # fmt: skip
    """For each work item with query tiles to visit: both consumers' packed K and V rows (once
    both released the previous item's), then the Q tiles with their row statistics and the dO
    tiles of its heads and query tiles into a STAGES-deep ring shared across items. Items with
    nothing to visit load nothing."""
    q_bytes: gl.constexpr = q_desc.block_type.nbytes + stats_desc.block_type.nbytes
    it = 0
    n_kv = 0
    for k in range(gl.program_id(0), n_items, gl.num_programs(0)):
        t = _snake(k, n_items)
        b, hk, g0, n0, _, n_heads, _, _, t_lo, n_q = _dkdv_item(
            t, n_parts, n_bg, hkv, G, SPLIT, Lq, Lk, KEYS, KEY_COUNT, keys_stride_b,
            keys_stride_h, count_stride_b, mask_hdiv, BLOCK_M, BLOCK_N, IS_CAUSAL,
        )  # fmt: skip
        steps = n_q - t_lo
        if steps > 0:
            mbarrier.wait(rings.kv_empty, (n_kv & 1) ^ 1)
            mbarrier.expect(
                rings.kv_bar, 2 * k_desc.block_type.nbytes + 2 * v_desc.block_type.nbytes
            )
            for c in gl.static_range(2):
                _tma_load(k_desc, [b, n0 + c * BLOCK_N, hk, 0], rings.kv_bar, rings.k_smem.index(c))
                _tma_load(v_desc, [b, n0 + c * BLOCK_N, hk, 0], rings.kv_bar, rings.v_smem.index(c))
            n_kv += 1
            for i in range(n_heads * steps):
                h, m0 = _dkdv_step(i, hk, G, g0, t_lo, steps, BLOCK_M)
                slot = it % STAGES
                mbarrier.wait(rings.qdo_empty.index(slot), ((it // STAGES) & 1) ^ 1)
                mbarrier.expect(rings.q_ready.index(slot), q_bytes)
                _tma_load(
                    q_desc, [b, m0, h, 0], rings.q_ready.index(slot), rings.q_smem.index(slot)
                )
                _tma_load(
                    stats_desc, [(b * H + h) * Lq + m0, 0], rings.q_ready.index(slot),
                    rings.stats_smem.index(slot),
                )  # fmt: skip
                mbarrier.expect(rings.do_ready.index(slot), do_desc.block_type.nbytes)
                _tma_load(
                    do_desc, [b, m0, h, 0], rings.do_ready.index(slot), rings.do_smem.index(slot)
                )
                it += 1


@gluon.jit
def _dkdv_consumer(DK, DV, DBIAS, PART_DK, PART_DV, PART_DB, BIAS, KEYS, KEY_COUNT, rings,
                   keys_stride_b, keys_stride_h, count_stride_b, mask_hdiv, n_items, n_parts,
                   n_bg, hkv, H, G, SPLIT, Lq, Lk, scale, bias_heads, bias_head_mul,
                   dbias_stride_b, dbias_stride_h, C: gl.constexpr, IS_CAUSAL: gl.constexpr,
                   HAS_BIAS: gl.constexpr, DBIAS_COLS: gl.constexpr, PARTIAL: gl.constexpr,
                   BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr,
                   STAGES: gl.constexpr):  # fmt: skip
    """List positions n0 + C * BLOCK_N onwards of each work item: S^T = K Q^T and
    dP^T = V dO^T per query tile, P^T = exp(S^T - lse), dV += P^T dO,
    dS^T = P^T (dP^T - delta), dK += dS^T Q, with dK, dV (and the dbias column sums) in
    registers; stored at the keys' positions (zeros for the list positions past the count), or
    as float32 parts at list positions (PARTIAL). A step whose rows all see all its keys (all
    listed, rows below Lq, the last key's position at or before the first row's) skips the
    masks. K and V are released before the epilogue, so the next item's loads run under it."""
    st_layout: gl.constexpr = _mma_layout(BLOCK_M)
    acc_layout: gl.constexpr = _mma_layout(D)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    key_l: gl.constexpr = gl.SliceLayout(1, st_layout)
    acc_rows: gl.constexpr = gl.SliceLayout(1, acc_layout)
    dtype: gl.constexpr = rings.q_smem.dtype

    off = Lk - Lq
    kc = rings.k_smem.index(C).reshape([BLOCK_N, D])
    vc = rings.v_smem.index(C).reshape([BLOCK_N, D])
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, acc_layout))
    it = 0
    n_kv = 0
    for k in range(gl.program_id(0), n_items, gl.num_programs(0)):
        t = _snake(k, n_items)
        b, hk, g0, n0, part, n_heads, count, keys, t_lo, n_q = _dkdv_item(
            t, n_parts, n_bg, hkv, G, SPLIT, Lq, Lk, KEYS, KEY_COUNT, keys_stride_b,
            keys_stride_h, count_stride_b, mask_hdiv, BLOCK_M, BLOCK_N, IS_CAUSAL,
        )  # fmt: skip
        steps = n_q - t_lo
        r = n0 + C * BLOCK_N + gl.arange(0, BLOCK_N, layout=key_l)
        in_list = r < count
        pos = gl.load(keys + r, mask=r < Lk, other=0)
        n_end = n0 + C * BLOCK_N + BLOCK_N  # this consumer's keys are list positions < n_end
        last_pos = gl.load(keys + gl.minimum(n_end, Lk) - 1)
        keys_whole = n_end <= count
        bias_base = BIAS
        b_row = gl.zeros([BLOCK_N], gl.float32, key_l)
        if HAS_BIAS:
            bias_base = BIAS + ((b * hkv + hk) * bias_heads).to(gl.int64) * Lk
            b_row = gl.load(bias_base + r, mask=in_list, other=0.0).to(gl.float32)
        dk = gl.zeros([BLOCK_N, D], gl.float32, acc_layout)
        dv = gl.zeros([BLOCK_N, D], gl.float32, acc_layout)
        db = gl.zeros([BLOCK_N], gl.float32, key_l)
        if steps > 0:
            mbarrier.wait(rings.kv_bar, n_kv & 1)
            item = (hk, G, g0, t_lo, steps, Lq, off, r, keys_whole, last_pos, in_list, pos,
                    bias_base, bias_head_mul, kc, vc)  # fmt: skip
            state = (dk, dv, gl.zeros([BLOCK_N, BLOCK_M], dtype, a_layout), db, b_row)
            state = _dkdv_tile(0, it, item, rings, state, scale, True, IS_CAUSAL, HAS_BIAS,
                               DBIAS_COLS, BLOCK_M, BLOCK_N, D, STAGES)  # fmt: skip
            for i in range(1, n_heads * steps):
                state = _dkdv_tile(i, it, item, rings, state, scale, False, IS_CAUSAL, HAS_BIAS,
                                   DBIAS_COLS, BLOCK_M, BLOCK_N, D, STAGES)  # fmt: skip
            dk, dv, ds16, db, b_row = state
            dk, ds16 = warpgroup_mma_wait(0, deps=[dk, ds16])
            it += n_heads * steps
            mbarrier.arrive(rings.qdo_empty.index((it - 1) % STAGES), count=1)
            mbarrier.arrive(rings.kv_empty, count=1)
            n_kv += 1

        r_a = gl.convert_layout(r, acc_rows)
        dk = dk * scale
        if PARTIAL:
            # Float32 parts at list positions: attention_bwd_dkdv_reduce_kernel sums them in
            # split order and stores them at the keys; it reads positions below the count only
            # (the keys past it get zeros there), so the parts past it are not written: at the
            # model's B1 L32768 call (split 4, a quarter of the keys listed) they were 400 MB a
            # call (bench/NOTES.md 232).
            listed = r_a < count
            o_p = (part * Lk + r_a).to(gl.int64)[:, None] * D + cols[None, :]
            gl.store(PART_DK + o_p, dk, mask=listed[:, None])
            gl.store(PART_DV + o_p, dv, mask=listed[:, None])
            if DBIAS_COLS:
                gl.store(PART_DB + part * Lk + r, db, mask=in_list)
        else:
            in_k = (r_a < Lk)[:, None]
            pos_a = gl.convert_layout(pos, acc_rows).to(gl.int64)[:, None]
            # DK, DV (B, Lk, Hkv, D) contiguous: row (b, key, hk) starts at ((b * Lk + key) *
            # Hkv + hk) * D.
            o_kv = ((b.to(gl.int64) * Lk + pos_a) * hkv + hk) * D
            p_dk = DK + o_kv
            gl.store(p_dk + cols[None, :], dk.to(dtype), mask=in_k)
            p_dv = DV + o_kv
            gl.store(p_dv + cols[None, :], dv.to(dtype), mask=in_k)
            if DBIAS_COLS:
                p_db = DBIAS + b.to(gl.int64) * dbias_stride_b + hk * dbias_stride_h + pos
                gl.store(p_db, db.to(DBIAS.dtype.element_ty), mask=r < Lk)


@_aggregate
class _DkdvRings:
    """The dK/dV kernel's shared memory and mbarriers (_dkdv_rings): both consumers' K and V
    tiles with kv_bar (all four land on one barrier) and kv_empty (both consumers release
    them); the STAGES-deep ring of Q tiles with their row statistics (q_ready) and of dO tiles
    (do_ready), with qdo_empty per slot (both consumers release a slot)."""

    k_smem: gl.shared_memory_descriptor
    v_smem: gl.shared_memory_descriptor
    q_smem: gl.shared_memory_descriptor
    do_smem: gl.shared_memory_descriptor
    stats_smem: gl.shared_memory_descriptor
    kv_bar: gl.shared_memory_descriptor
    kv_empty: gl.shared_memory_descriptor
    q_ready: gl.shared_memory_descriptor
    do_ready: gl.shared_memory_descriptor
    qdo_empty: gl.shared_memory_descriptor

    @gluon.constexpr_function
    def __init__(self, k_smem, v_smem, q_smem, do_smem, stats_smem, kv_bar, kv_empty, q_ready,
                 do_ready, qdo_empty):  # fmt: skip
        self.k_smem, self.v_smem, self.q_smem, self.do_smem = k_smem, v_smem, q_smem, do_smem
        self.stats_smem, self.kv_bar, self.kv_empty = stats_smem, kv_bar, kv_empty
        self.q_ready, self.do_ready, self.qdo_empty = q_ready, do_ready, qdo_empty


@gluon.jit
def _dkdv_rings(q_desc, k_desc, v_desc, do_desc, stats_desc, STAGES: gl.constexpr):
    """The dK/dV kernel's _DkdvRings, allocated, the barriers initialised."""
    dtype: gl.constexpr = q_desc.dtype
    k_smem = gl.allocate_shared_memory(dtype, [2] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [2] + v_desc.block_type.shape, v_desc.layout)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES] + do_desc.block_type.shape, do_desc.layout)
    stats_smem = gl.allocate_shared_memory(
        gl.float32, [STAGES] + stats_desc.block_type.shape, stats_desc.layout
    )
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    qdo_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    mbarrier.init(kv_empty, count=2)
    for i in gl.static_range(STAGES):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(do_ready.index(i), count=1)
        mbarrier.init(qdo_empty.index(i), count=2)
    return _DkdvRings(k_smem, v_smem, q_smem, do_smem, stats_smem, kv_bar, kv_empty, q_ready,
                      do_ready, qdo_empty)  # fmt: skip


@gluon.jit
def hopper_dkdv_kernel(q_desc, k_desc, v_desc, do_desc, stats_desc, BIAS, KEYS, KEY_COUNT, DK, DV,
                       DBIAS, PART_DK, PART_DV, PART_DB, keys_stride_b, count_stride_b,
                       bias_heads, bias_head_mul, mask_hdiv, scale, SPLIT, IS_CAUSAL: gl.constexpr,
                       HAS_BIAS: gl.constexpr, DBIAS_COLS: gl.constexpr, PARTIAL: gl.constexpr,
                       BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr,
                       STAGES: gl.constexpr, num_warps: gl.constexpr):  # fmt: skip
    """A persistent program: work items (_dkdv_item) t = program_id, + num_programs, ... of
    n_items = (list tiles of 2 * BLOCK_N) * n_parts, n_parts = B * Hkv * SPLIT. Every list
    position below Lk is written: keys past the count get zeros. Shapes come from the
    descriptors; DK and DV (B, Lk, Hkv, D) and DBIAS (B, Hkv, 1, Lk) are contiguous, the key
    lists' rows Lk apart. bias_head_mul (0 or 1, bias_heads > 1) comes from the host, unlike
    the forward's: a constant 0 here, which folds the consumers' per-head bias branch away, makes
    Triton 3.6's ConvertTritonGPUToLLVM fail an assertion (an LLVM SmallVector index)."""
    gl.static_assert(num_warps == 4)
    Lq = q_desc.shape[1]
    H = q_desc.shape[2]
    Lk = k_desc.shape[1]
    hkv = k_desc.shape[2]
    G = H // hkv
    n_bg = q_desc.shape[0] * hkv
    n_parts = n_bg * SPLIT
    n_items = gl.cdiv(Lk, 2 * BLOCK_N) * n_parts
    keys_stride_h = Lk
    dbias_stride_h = Lk
    dbias_stride_b = hkv * Lk

    rings = _dkdv_rings(q_desc, k_desc, v_desc, do_desc, stats_desc, STAGES)

    gl.warp_specialize([
        (_dkdv_consumer, (DK, DV, DBIAS, PART_DK, PART_DV, PART_DB, BIAS, KEYS, KEY_COUNT, rings,
                          keys_stride_b, keys_stride_h, count_stride_b, mask_hdiv, n_items,
                          n_parts, n_bg, hkv, H, G, SPLIT, Lq, Lk, scale, bias_heads,
                          bias_head_mul, dbias_stride_b, dbias_stride_h, 0, IS_CAUSAL, HAS_BIAS,
                          DBIAS_COLS, PARTIAL, BLOCK_M, BLOCK_N, D, STAGES)),
        (_dkdv_consumer, (DK, DV, DBIAS, PART_DK, PART_DV, PART_DB, BIAS, KEYS, KEY_COUNT, rings,
                          keys_stride_b, keys_stride_h, count_stride_b, mask_hdiv, n_items,
                          n_parts, n_bg, hkv, H, G, SPLIT, Lq, Lk, scale, bias_heads,
                          bias_head_mul, dbias_stride_b, dbias_stride_h, 1, IS_CAUSAL, HAS_BIAS,
                          DBIAS_COLS, PARTIAL, BLOCK_M, BLOCK_N, D, STAGES)),
        (_dkdv_loader, (q_desc, k_desc, v_desc, do_desc, stats_desc, rings, KEYS, KEY_COUNT,
                        keys_stride_b, keys_stride_h, count_stride_b, mask_hdiv, n_items, n_parts,
                        n_bg, hkv, H, G, SPLIT, Lq, Lk, IS_CAUSAL, BLOCK_M, BLOCK_N, STAGES)),
    ], [4, 1], [240, 24])  # fmt: skip
