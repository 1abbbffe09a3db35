"""Which tiles and keys the kernels visit: tile tables for masks that vary per query, key lists
for masks shared by all queries (the DMA pattern). Built on the device by small Triton kernels
(kernels/block_mask.py, kernels/key_lists.py) and torch ops, without host synchronisation; the
launchers in launch.py hand them to the attention kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from dmattn_ops.core.band import Band
from dmattn_ops.core.device import cdiv, head_block, symbolic
from dmattn_ops.core.operands import batch_strides, head_div, operand_strides
from dmattn_ops.executors._alloc import Carving, carve, empties, empty
from dmattn_ops.executors._triton import LazyKernel, Prepared, interpreter_on, prepared


def _kernels() -> tuple:
    """The mask-structure kernels' modules, imported (with Triton) at the first launch."""
    from dmattn_ops.kernels import block_mask, key_lists

    return key_lists, block_mask


key_lists_kernel = LazyKernel(_kernels, "key_lists_kernel")
varlen_key_lists_kernel = LazyKernel(_kernels, "varlen_key_lists_kernel")
mask_block_any_kernel = LazyKernel(_kernels, "mask_block_any_kernel")
tile_cols_kernel = LazyKernel(_kernels, "tile_cols_kernel")
tile_rows_kernel = LazyKernel(_kernels, "tile_rows_kernel")


@dataclass
class Tables:
    """Which key tiles each query tile must visit (and the transpose), per table (batch, head).

    active (Bt, Ht, NQ, NK) int8; kv_num (Bt, Ht, NQ) and kv_idx (Bt, Ht, NQ, NK) list the active
    key tiles of each query tile in ascending order (entries past kv_num are never written nor
    read); q_num / q_idx the active query tiles of each key tile, likewise. Bt is B when
    seqused_k or the mask varies over the batch, else 1; Ht is the mask's head dim.

    Interior tiles (all rows < Lq, all keys < seqused_k, every key causally visible to every row)
    are read without predicates. They form a prefix of each query tile's key tiles and a run of
    each key tile's query tiles, so: kv_int (Bt, Ht, NQ), the first kv_int entries of kv_idx are
    interior; q_lo / q_hi (Bt, Ht, NK), entries [q_lo, q_hi) of q_idx are interior.
    """

    active: torch.Tensor
    kv_num: torch.Tensor
    kv_idx: torch.Tensor
    kv_int: torch.Tensor
    q_num: torch.Tensor
    q_idx: torch.Tensor
    q_lo: torch.Tensor
    q_hi: torch.Tensor
    stride_b: int
    stride_bt: int


def block_any(mask, lq, lk, block_m, block_n, seen=None, launches=None) -> torch.Tensor:
    """(Bm, Hm, NQ | 1, NK) int8: whether each (query tile, key tile) of the mask allows any
    entry. One pass over the mask; `seen`, a zeroed int32 (Bm, Hm, Lk) or None, gets 1 at the
    keys some query allows, in the same pass. launches: the plan's store of launch arguments
    (build_key_lists)."""
    bm, hm, lqm, _ = mask.shape
    nq, nk = cdiv(lq, block_m), cdiv(lk, block_n)
    nqm = nq if lqm > 1 else 1
    mask_any = torch.empty((bm, hm, nqm, nk), dtype=torch.int8, device=mask.device)
    args = prepared(
        launches, ("block_any", block_m, block_n, seen is None),
        lambda: Prepared(
            (nqm, nk, bm * hm), (*operand_strides(mask), hm, lqm, lk, nqm, nk),
            dict(BLOCK_M=block_m, BLOCK_N=block_n, HAS_SEEN=seen is not None),
        ),
    )  # fmt: skip
    mask_block_any_kernel.run(args, (mask, mask_any, seen))
    return mask_any


def _pool_queries(mask_any: torch.Tensor, ratio: int) -> torch.Tensor:
    """block_any for query tiles `ratio` times taller, from the finer one (no mask pass)."""
    if ratio == 1 or mask_any.shape[2] == 1:
        return mask_any
    pad = -mask_any.shape[2] % ratio
    fine = torch.nn.functional.pad(mask_any, (0, 0, 0, pad))
    return fine.unflatten(2, (-1, ratio)).amax(dim=3)


def build_tables(
    mask, seqused_k, b, lq, lk, band: Band, block_m, block_n, mask_any=None, seen=None,
    launches=None,
) -> Tables:  # fmt: skip
    """Activity of every (query tile, key tile): the mask has an allowed entry there (mask_any,
    from block_any unless given, which then fills `seen` too) and the tile lies inside the
    causal / window / seqused_k bounds. Two kernel launches (rows, then columns) whatever the
    shapes: the host cost stays flat. The tables are views of one int32 allocation (they live
    and die together); launches: the plan's store of launch arguments (build_key_lists)."""
    if mask_any is None:
        mask_any = block_any(mask, lq, lk, block_m, block_n, seen, launches)
    layout = prepared(
        launches, ("tables", block_m, block_n, seqused_k is None),
        lambda: _tables_layout(mask_any, seqused_k, b, lq, lk, band, block_m, block_n),
    )  # fmt: skip
    device = mask.device
    active = empty(layout.active, dtype=torch.int8, device=device)
    kv_num, kv_int, kv_idx, q_num, q_lo, q_hi, q_idx = empties(layout.buffers, device=device)
    tile_rows_kernel.run(layout.rows, (mask_any, seqused_k, active, kv_num, kv_idx, kv_int))
    tile_cols_kernel.run(layout.cols, (active, seqused_k, q_num, q_idx, q_lo, q_hi))
    return Tables(
        active, kv_num, kv_idx, kv_int, q_num, q_idx, q_lo, q_hi,
        stride_b=layout.strides[0], stride_bt=layout.strides[1],
    )  # fmt: skip


class _TablesLayout(NamedTuple):
    """What build_tables makes once per plan: `active`'s shape, the int32 tables' Carving
    (kv_num, kv_int, kv_idx, q_num, q_lo, q_hi, q_idx), the two launches and the tables'
    (stride_b, stride_bt)."""

    active: tuple
    buffers: Carving
    rows: Prepared
    cols: Prepared
    strides: tuple[int, int]


def _tables_layout(mask_any, seqused_k, b, lq, lk, band, block_m, block_n) -> _TablesLayout:
    bm, hm, _, nk = mask_any.shape
    nq = cdiv(lq, block_m)
    bt = b if seqused_k is not None else bm
    i32 = torch.int32
    shape = (bt, hm, nq)
    buffers = carve([
        (shape, i32), (shape, i32), ((*shape, nk), i32), ((bt, hm, nk), i32), ((bt, hm, nk), i32),
        ((bt, hm, nk), i32), ((bt, hm, nk, nq), i32),
    ])  # fmt: skip
    sb, sh, sq, _ = operand_strides(mask_any)
    common = dict(
        BLOCK_M=block_m, BLOCK_N=block_n, **band.flags(), num_warps=1 if interpreter_on() else 4,
        HAS_SEQUSED=seqused_k is not None,
    )  # fmt: skip
    rows = Prepared(
        (nq, bt * hm), (sb, sh, sq, hm, lq, lk, nq, nk, *band.args()),
        dict(BLOCK_K=head_block(nk), **common),
    )  # fmt: skip
    cols = Prepared(
        (nk, bt * hm), (hm, lq, lk, nq, nk, *band.args()), dict(BLOCK_Q=head_block(nq), **common)
    )
    strides = (hm * nq if bt > 1 else 0, hm * nk if bt > 1 else 0)
    return _TablesLayout((*shape, nk), buffers, rows, cols, strides)


@dataclass(frozen=True)
class Packed:
    """K, V and the per-key bias rows of a key-list call in list order (build_key_lists with
    `pack`): what the forward and dq kernels read in place of key, value and bias (their
    COMPACT=PACKED). Rows past each list's count are unwritten and never read by the Triton
    kernels (K's and V's are zeros where PackFrom.zero_tail asked for them)."""

    key: torch.Tensor  # (B, Lk, Hkv, D), contiguous
    value: torch.Tensor  # (B, Lk, Hkv, Dv), contiguous
    bias: torch.Tensor | None  # (B, Hkv | H, 1, Lk): read through head_div like any bias


class PackFrom(NamedTuple):
    """What build_key_lists packs: key and value (B, Lk, Hkv, D|Dv), the per-key bias (or None)
    and the query heads H; zero_tail: the packed K and V rows past each list are zeros (the
    Hopper kernels read whole tiles of them)."""

    key: torch.Tensor
    value: torch.Tensor
    bias: torch.Tensor | None
    heads: int
    zero_tail: bool = False


@dataclass
class KeyLists:
    """For a mask broadcast over queries, (B|1, H|Hkv|1, 1, Lk): the allowed keys of each
    (batch, mask head) in ascending order, then the others (keys, (Bm, Hm, Lk) int32, a
    permutation of the keys; varlen: padded with total_k instead); how many
    of them each query tile may see under causality and seqused_k (key_end, (Bt, Hm, NQ)); and
    how many lie below seqused_k (key_count, (Bt, Hm)). Under a window, key_start (Bt, Hm, NQ):
    how many lie below the band of each query tile's first row (else None); the tile's keys
    are then the list positions [key_start, key_end). packed: the listed rows of K, V and the
    bias when the lists were built with them (batched calls only)."""

    keys: torch.Tensor
    key_end: torch.Tensor
    key_count: torch.Tensor
    keys_stride_b: int
    keys_stride_h: int
    end_stride_b: int
    count_stride_b: int
    end_stride_h: int  # NQ, the list tiles per row of key_end and key_start
    key_start: torch.Tensor | None = None
    packed: Packed | None = None


def build_key_lists(
    mask, seqused_k, b, lq, lk, band: Band, block_m, pack: PackFrom | None = None, launches=None
) -> KeyLists:
    """KeyLists of a compactable mask and, with `pack`, its packed K, V and per-key bias rows
    (KeyLists.packed): one launch of kernels/key_lists.py key_lists_kernel, whose programs each
    take a chunk of keys, no host sync. launches: the plan's store of launch arguments (plan.Plan
    .launches), where the buffers' shapes and the launch's arguments are made once."""
    site = ("key_lists", block_m, pack is None, pack is not None and pack.zero_tail)
    layout = prepared(
        launches, site,
        lambda: _key_lists_layout(mask, seqused_k, b, lq, lk, band, block_m, pack),
    )  # fmt: skip
    # The lists, their ends and counts and the packed rows live as long as each other (the
    # backward keeps them); the prefix sums are the kernel's scratch, small beside the lists:
    # one allocation a dtype.
    keys, key_end, key_start, key_count, prefix, *packs = empties(
        layout.buffers, device=mask.device
    )
    packed = None if pack is None else Packed(*packs)
    key, value, bias = (None,) * 3 if pack is None else pack[:3]
    key_lists_kernel.run(layout.launch, (
        mask, seqused_k, prefix, keys, key_start, key_end, key_count, key, value, bias, *packs,
    ))  # fmt: skip
    keys_stride_b, end_stride_b, count_stride_b, nq = layout.strides
    return KeyLists(
        keys=keys, key_end=key_end, key_count=key_count, keys_stride_b=keys_stride_b,
        keys_stride_h=lk, end_stride_b=end_stride_b, count_stride_b=count_stride_b,
        end_stride_h=nq, key_start=key_start, packed=packed,
    )  # fmt: skip


class _ListsLayout(NamedTuple):
    """What build_key_lists makes once per plan: its buffers (_alloc.Carving), the launch of
    key_lists_kernel (Prepared) and the lists' (keys batch, end batch, count batch, end head)
    strides."""

    buffers: Carving
    launch: Prepared
    strides: tuple[int, int, int, int]


def _per_query_tile(bt, hm, nq) -> tuple:
    """The shape of key_end and key_start, (Bt, Hm, NQ). With a symbolic NQ (a compiled graph
    with dynamic shapes) one flat row with a spare element instead: functionalizing a traced
    launch clones the buffers it writes, and the clone's layout check guards a dim that may be
    1 (a graph first traced with one query tile compiled again for more). The kernels read
    them through explicit strides either way."""
    return (bt * hm * nq + 1,) if symbolic(nq) else (bt, hm, nq)


def _key_lists_layout(mask, seqused_k, b, lq, lk, band: Band, block_m, pack) -> _ListsLayout:
    bm, hm = mask.shape[0], mask.shape[1]
    bt = b if seqused_k is not None else bm
    nq = cdiv(lq, block_m)
    i32 = torch.int32
    if pack is None:
        # One program row per (table batch, mask head): K, V and the bias are not read.
        rows, groups, g, mask_div, bias_div, bias_heads = bt, hm, 1, 1, 1, 0
        bias = None
        key_strides = value_strides = (0, 0, 0, 0)
        d = dv = 16
        packs = [None] * 3
    else:
        key, value, bias, h, _ = pack
        rows, groups, d, dv = b, key.shape[2], key.shape[3], value.shape[3]
        g = h // groups
        mask_div, bias_div = head_div(mask, h, groups), head_div(bias, h, groups)
        bias_heads = g if bias is not None and bias.shape[1] == h else 1
        key_strides, value_strides = batch_strides(key), batch_strides(value)
        packs = [
            ((b, lk, groups, d), key.dtype), ((b, lk, groups, dv), value.dtype),
            None if bias is None else ((b, groups * bias_heads, 1, lk), bias.dtype),
        ]  # fmt: skip
    ends = _per_query_tile(bt, hm, nq)
    buffers = [
        ((bm, hm, lk), i32), (ends, i32), (ends, i32) if band.has_window else None,
        ((bt, hm), i32), ((rows * groups, lk), i32), *packs,
    ]  # fmt: skip
    keys_stride_b = hm * lk if bm > 1 else 0
    end_stride_b, count_stride_b = (hm * nq, hm) if bt > 1 else (0, 0)
    block_d = head_block(max(d, dv))
    sb, sh, _, sn = operand_strides(bias)
    mb, mh, _, mn = operand_strides(mask)
    interpreted = interpreter_on()
    # Short chunks: a program's work is one dependent chain of loads (its chunk, the rows it
    # packs), so more programs, not longer ones, hide the latency.
    chunk = 64
    scalars = (
        mb, mh, mn, *key_strides, *value_strides, sb, sh, sn, keys_stride_b, lk, end_stride_b,
        count_stride_b, groups, g, lq, lk, nq, d, dv, mask_div, bias_div, bias_heads,
        *band.args(),
    )  # fmt: skip
    meta = dict(
        HAS_SEQUSED=seqused_k is not None, **band.flags(), PACK=pack is not None,
        ZERO_TAIL=pack is not None and pack.zero_tail, HAS_BIAS=bias is not None,
        BLOCK_M=block_m, CHUNK=chunk,
        SCAN=256 if interpreted else 4096, BLOCK_T=64 if interpreted else 512,
        BLOCK_D=block_d, BLOCK_DV=block_d, num_warps=1 if interpreted else 4,
    )  # fmt: skip
    launch = Prepared((cdiv(lk, chunk), rows * groups), scalars, meta)
    strides = (keys_stride_b, end_stride_b, count_stride_b, nq)
    return _ListsLayout(carve(buffers), launch, strides)


def build_varlen_key_lists(
    mask, cu_q, cu_k, total_q, nq, band: Band, block_m, max_k, launches=None
) -> KeyLists:
    """Key lists of a varlen mask (Hm, total_k): per (mask head, sequence) the sequence's allowed
    keys in ascending order, as indices local to the sequence, stored where the sequence's keys
    are (keys (Hm, total_k), total_k elsewhere); key_end (B, Hm, NQ) and key_count (B, Hm) as in
    build_key_lists (kernels/key_lists.py varlen_key_lists_kernel). One kernel launch, no host
    synchronisation; nothing is packed. launches: the plan's store of launch arguments, as
    build_key_lists'."""
    hm, total_k = mask.shape
    b = cu_q.shape[0] - 1
    i32 = torch.int32
    # One allocation, as build_key_lists' (the prefix sums are the kernel's scratch); keys
    # holds total_k where no sequence's list reaches.
    ends = _per_query_tile(b, hm, nq)
    keys, key_end, key_start, key_count, prefix = empties([
        ((hm, total_k), i32), (ends, i32), (ends, i32) if band.has_window else None,
        ((b, hm), i32), ((b * hm, max(max_k, 1)), i32),
    ], device=mask.device)  # fmt: skip
    keys.fill_(total_k)
    if b > 0:
        args = prepared(
            launches, ("varlen_key_lists", block_m),
            lambda: Prepared(
                (b * hm,),
                (mask.stride(0), mask.stride(1), total_k, hm * nq, hm, hm, total_q, total_k, nq,
                 max(max_k, 1), *band.args()),
                dict(**band.flags(), BLOCK_M=block_m, CHUNK=1024,
                     num_warps=1 if interpreter_on() else 4),
            ),
        )  # fmt: skip
        varlen_key_lists_kernel.run(
            args, (mask, cu_q, cu_k, prefix, keys, key_start, key_end, key_count)
        )
    return KeyLists(
        keys=keys, key_end=key_end, key_count=key_count, keys_stride_b=0,
        keys_stride_h=total_k, end_stride_b=hm * nq, count_stride_b=hm, end_stride_h=nq,
        key_start=key_start,
    )  # fmt: skip
