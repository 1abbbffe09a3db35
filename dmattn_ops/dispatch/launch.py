"""Host side of the kernels: runs each call's plan (plan.py picks the path: PyTorch's chunked
code, SDPA, decode, key lists, tile tables, dense), allocates and launches; tiles.py builds the
tile tables and key lists.

No autograd here; ops.py calls these from the registered backend kernels.

Triton runs for CUDA tensors, and for CPU tensors when Triton's interpreter is on
(TRITON_INTERPRET=1). float64, and anything Triton cannot run, goes to the chunked PyTorch
implementation.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from dmattn_ops.core import configs, options
from dmattn_ops.core.band import UNBOUNDED, Band
from dmattn_ops.core.configs import Config
from dmattn_ops.core.device import cdiv, head_block, hint, next_power_of_2, sm_count, symbolic
from dmattn_ops.core.operands import (
    PER_ENTRY,
    batch_strides,
    compactable,
    head_div,
    is_limit,
    operand_kind,
    operand_strides,
)
from dmattn_ops.core.problem import Options, Problem, dense_rows
from dmattn_ops.core.problem import dense_index as _dense
from dmattn_ops.dispatch import plan
from dmattn_ops.dispatch.plan import (
    DECODE,
    EMPTY,
    KEY_LISTS,
    PYTORCH,
    SDPA,
    TILE_TABLES,
    BackwardConfigs,
)
from dmattn_ops.executors import chunked, hopper, sdpa
from dmattn_ops.executors._alloc import Carving, carve, contiguous_strides, empties, empty
from dmattn_ops.executors._triton import LazyKernel, Prepared, interpreter_on, prepared
from dmattn_ops.executors.chunked import stats_dtype
from dmattn_ops.executors.tiles import (
    KeyLists,
    PackFrom,
    _pool_queries,
    block_any,
    build_key_lists,
    build_tables,
    build_varlen_key_lists,
)


def _kernels() -> tuple:
    """The attention kernels' modules, imported (with Triton) at the first launch
    (_triton.LazyKernel)."""
    from dmattn_ops.kernels import (
        attention_bwd_dbias,
        attention_bwd_dkdv,
        attention_bwd_dq,
        attention_bwd_stats,
        attention_decode,
        attention_fwd,
    )

    return (attention_fwd, attention_bwd_stats, attention_bwd_dbias, attention_bwd_dkdv,
            attention_bwd_dq, attention_decode)  # fmt: skip


attention_fwd_kernel = LazyKernel(_kernels, "attention_fwd_kernel")
sinks_join_kernel = LazyKernel(_kernels, "sinks_join_kernel")
attention_row_stats_kernel = LazyKernel(_kernels, "attention_row_stats_kernel")
attention_bwd_dbias_kernel = LazyKernel(_kernels, "attention_bwd_dbias_kernel")
attention_bwd_sinks_kernel = LazyKernel(_kernels, "attention_bwd_sinks_kernel")
attention_bwd_dkdv_kernel = LazyKernel(_kernels, "attention_bwd_dkdv_kernel")
attention_bwd_dkdv_reduce_kernel = LazyKernel(_kernels, "attention_bwd_dkdv_reduce_kernel")
attention_bwd_dq_kernel = LazyKernel(_kernels, "attention_bwd_dq_kernel")
attention_decode_kernel = LazyKernel(_kernels, "attention_decode_kernel")
decode_combine_kernel = LazyKernel(_kernels, "decode_combine_kernel")


def _seen_buffer(mask, lk: int) -> torch.Tensor:
    """The zeroed int32 (Bm, Hm, Lk) in which tiles.block_any marks the keys some query sees."""
    return torch.zeros((*mask.shape[:2], lk), dtype=torch.int32, device=mask.device)


def _backward_tables(
    mask, seqused_k, b, lq, lk, band: Band, cfgs: BackwardConfigs, seen=None, launches=None
):
    """Tile tables of the dk/dv kernel and of the dq kernel, each on its own tile grid. When
    the grids share block_n and one block_m divides the other, the mask is read once and the
    coarser grid is pooled from the finer. The first pass over the mask fills `seen`."""
    kv, qc = cfgs.dkdv, cfgs.dq
    fine, coarse = sorted((kv.block_m, qc.block_m))
    if kv.block_n == qc.block_n and coarse % fine == 0:
        any_fine = block_any(mask, lq, lk, fine, kv.block_n, seen, launches)
        any_coarse = _pool_queries(any_fine, coarse // fine)
        any_kv, any_q = (any_fine, any_coarse) if kv.block_m == fine else (any_coarse, any_fine)
    else:
        any_kv = any_q = None
    args = (mask, seqused_k, b, lq, lk, band)
    tables = build_tables(
        *args, kv.block_m, kv.block_n, mask_any=any_kv, seen=seen, launches=launches
    )
    if qc == kv:
        return tables, tables
    return tables, build_tables(*args, qc.block_m, qc.block_n, mask_any=any_q, launches=launches)


def _head_blocks(d: int, dv: int) -> dict:
    """BLOCK_D and BLOCK_DV, both the larger of the two. Triton 3.6 on an H100 computes wrong
     outputs (errors ~1, fp16 and bf16) when a masked BLOCK_D exceeds BLOCK_DV with 64-key
     tiles, e.g. D=40 (BLOCK_D 64) with Dv=24 (BLOCK_DV 32); equal blocks are always right
    ."""
    block = head_block(max(d, dv))
    return dict(BLOCK_D=block, BLOCK_DV=block)


def _dot_precision(dtype: torch.dtype) -> str:
    if interpreter_on():
        return "interpret"  # see kernels/common.py dot() and score_dot()
    if dtype == torch.float32:
        return "ieee"
    return "tf32"  # ignored for 16-bit operands


def _empty_forward(query, value):
    b, lq, h, _ = query.shape
    stats = dict(dtype=stats_dtype(query.dtype), device=query.device)
    out = torch.zeros((b, lq, h, value.shape[-1]), dtype=query.dtype, device=query.device)
    lse = torch.full((b, h, lq), float("-inf"), **stats)
    lse_rem = torch.zeros((b, h, lq), **stats)
    return out, lse, lse_rem


class Saved(NamedTuple):
    """What the forward leaves for the backward besides the problem's tensors."""

    out: torch.Tensor
    lse: torch.Tensor
    lse_rem: torch.Tensor


@dataclass(frozen=True)
class Operands:
    """What one launch of the attention kernels reads. query, key, value: (B, L, H, D), or for
    packed sequences their (1, total, H, D) views with cu_q and cu_k; mask and bias as 4-D
    broadcast operands (packed: (1, H|Hkv|1, 1, total_k)); seqused_k; sinks (forward only).
    b, lq, lk: the batch and the rows and keys a batch holds (packed: the totals); span_q and
    span_k: the rows and keys a program grid covers (dense: lq and lk; packed: the longest
    sequences); lse_strides: the (batch, head) strides of lse, lse_rem and the row statistics,
    whose rows are unit-strided."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    mask: torch.Tensor | None
    bias: torch.Tensor | None
    seqused_k: torch.Tensor | None
    cu_q: torch.Tensor | None
    cu_k: torch.Tensor | None
    sinks: torch.Tensor | None
    b: int
    lq: int
    lk: int
    span_q: int
    span_k: int
    lse_strides: tuple[int, int]

    @classmethod
    def dense(cls, problem: Problem, key=None, value=None) -> Operands:
        """A (collapsed) dense or seqused_k problem's operands; key and value in place of the
        problem's (the tile-table routes zero the keys no query sees)."""
        query = problem.query
        b, lq, h, _ = query.shape
        lk = problem.key.shape[1]
        return cls(
            query, problem.key if key is None else key, problem.value if value is None else value,
            problem.mask, problem.bias, problem.seqused_k, None, None, problem.sinks,
            b, lq, lk, lq, lk, (h * lq, lq),
        )  # fmt: skip

    @classmethod
    def packed(cls, problem: Problem) -> Operands:
        """A packed (cu_seqlens) problem's operands: (1, total, H, D) views, the per-key-token
        mask and bias as 4-D operands, grids over the longest sequences (sym_min: an expression,
        not a guard, where the sizes are symbolic)."""
        total_q, total_k = problem.query.shape[0], problem.key.shape[0]
        span_q = torch.sym_min(problem.max_seqlen_q, total_q)
        span_k = torch.sym_min(problem.max_seqlen_k, total_k)
        return cls(
            problem.query[None], problem.key[None], problem.value[None],
            _varlen_operand(problem.mask), _varlen_operand(problem.bias), None,
            problem.cu_seqlens_q, problem.cu_seqlens_k, None, problem.batch, total_q, total_k,
            span_q, span_k, (0, total_q),
        )  # fmt: skip

    @property
    def varlen(self) -> bool:
        return self.cu_q is not None

    def strides(self, key=None, value=None, bias=None, grad_out=None) -> tuple[int, ...]:
        """The kernels' operand strides in their order: query, key, value, (grad_out,) mask,
        bias; key, value and bias may be replaced (packed rows)."""
        key = self.key if key is None else key
        value = self.value if value is None else value
        bias = self.bias if bias is None else bias
        grad = () if grad_out is None else batch_strides(grad_out)
        return (
            *batch_strides(self.query), *batch_strides(key), *batch_strides(value), *grad,
            *operand_strides(self.mask), *operand_strides(bias),
        )  # fmt: skip


class KeptLists:
    """Key lists a forward built, kept for the backward of the same call, which then builds
    none of its own (one key_lists launch and seven allocations fewer per call). Whoever makes
    one decides how long the lists live: the eager AttentionFunction keeps one per call in its
    autograd context (ops.py), released with the graph; a compiled graph's trace keeps one
    per trace (inductor.py), where AOTAutograd saves the list buffers between its forward and
    backward graphs. Packed lists hold a copy of the listed K, V and bias rows: as much memory
    as K and V while kept.

    Lists are found by the identity of the call's tensors as the op received them (the
    autograd context and the trace hand the backward the forward's objects), its band, and
    what shapes the lists: the query rows per tile and, for packed ones, the bias rows'
    layout and whether the rows past each list are zeros. A backward that finds none builds its
    own."""

    def __init__(self):
        self._kept: dict = {}

    @staticmethod
    def _key(problem: Problem, band: Band, block_m: int, pack: PackFrom | None):
        tensors = (
            problem.query, problem.key, problem.value, problem.mask, problem.bias,
            problem.seqused_k,
        )  # fmt: skip
        # The packed bias rows' layout follows the bias's heads (build_key_lists); rows past the
        # lists unwritten cannot serve a pass that reads them as zeros (the Hopper kernels).
        # The head count as text: a symbolic one (a graph with dynamic shapes) does not hash.
        layout = None if pack is None else (
            "0" if pack.bias is None else str(pack.bias.shape[1]), pack.zero_tail)  # fmt: skip
        return (*map(id, tensors), band, block_m, layout), tensors

    def put(self, problem: Problem, band: Band, block_m: int, pack, lists: KeyLists) -> None:
        key, tensors = self._key(problem, band, block_m, pack)
        self._kept[key] = (tensors, lists)  # the tensors keep their ids from being reused

    def take(self, problem: Problem, band: Band, block_m: int, pack) -> KeyLists | None:
        found = self._kept.pop(self._key(problem, band, block_m, pack)[0], None)
        return None if found is None else found[1]


def _key_lists(kept, inputs: Problem, problem: Problem, p: plan.Plan, block_m, pack, keep=False):
    """build_key_lists of the (collapsed) problem under plan p, or the forward's lists of this
    call (whose tensors as received are `inputs`) from `kept` (KeptLists); with `keep`, the
    lists built are kept there for the backward."""
    band = p.band
    lists = kept.take(inputs, band, block_m, pack) if kept is not None and not keep else None
    if lists is None:
        b, lq, lk = problem.batch, problem.lq, problem.lk
        lists = build_key_lists(
            problem.mask, problem.seqused_k, b, lq, lk, band, block_m, pack, p.launches
        )
        if keep and kept is not None:
            kept.put(inputs, band, block_m, pack, lists)
    return lists


class Gradients(NamedTuple):
    """dq, dk, dv in their inputs' layouts and dtypes; dbias in bias's shape and dtype (an empty
    (0,) tensor when not computed); dsinks in sinks' (None without sinks: the backward ops
    return an empty tensor there, ops._backward_result)."""

    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    dbias: torch.Tensor
    dsinks: torch.Tensor | None


def forward(problem: Problem, opts: Options, kept: KeptLists | None = None) -> Saved:
    """out (B, Lq, H, Dv), lse and lse_rem float32 (B, H, Lq) of a validated call (varlen:
    (total_q, H, Dv) and (H, total_q); rows outside every sequence are 0 and -inf), by its
    plan. sinks: the forward kernel starts each row's softmax from its head's sink and the
    decode merge takes it as one more part; PyTorch's fused kernels (SDPA) get it joined in one
    pass (_join_sinks), the other paths (PyTorch, an empty call) through chunked.join_sinks.
    kept: where the key lists this builds are kept for the backward (KeptLists)."""
    inputs, problem = problem, problem.collapsed()
    p = plan.plan(problem, opts)
    if problem.varlen:
        return Saved(*_varlen_forward(problem, opts, p))
    query, key, value = problem.query, problem.key, problem.value
    mask, bias, seqused_k, sinks = problem.mask, problem.bias, problem.seqused_k, problem.sinks
    scale, band = opts.scale, p.band
    if p.route == EMPTY:
        return Saved(*chunked.join_sinks(*_empty_forward(query, value), sinks))
    if p.route == PYTORCH:
        # It multiplies whole tiles of keys (as the tile tables do, below).
        key, value = chunked.zero_unseen_keys(key, value, mask)
        result = chunked.forward(replace(problem, key=key, value=value), opts)
        return Saved(*chunked.join_sinks(*result, sinks))
    if p.route == SDPA:
        if p.tail:
            result = _window_tail_forward(problem, opts, p)
        else:
            result = sdpa.forward(query, key, value, scale, band, p.fused, chunk=p.chunk)
        return Saved(*_join_sinks(*result, sinks))
    if p.route == DECODE:
        return Saved(*decode_forward(problem, opts, p))
    b, lq, h, _ = query.shape
    lk, dv, cfg = key.shape[1], value.shape[3], p.config
    tables = lists = None
    if p.route == KEY_LISTS:
        lists = _key_lists(
            kept, inputs, problem, p, hopper.BLOCK_M if p.hopper else p.list_rows,
            PackFrom(key, value, bias, h, zero_tail=p.hopper) if p.pack else None, keep=True,
        )  # fmt: skip
    elif p.route == TILE_TABLES:
        seen = _seen_buffer(mask, lk)
        tables = build_tables(
            mask, seqused_k, b, lq, lk, band, cfg.block_m, cfg.block_n, seen=seen,
            launches=p.launches,
        )  # fmt: skip
        key, value = chunked.zero_keys(key, value, seen)
    saved = Saved(
        empty((b, lq, h, dv), dtype=query.dtype, device=query.device),
        empty((b, h, lq), dtype=torch.float32, device=query.device),
        empty((b, h, lq), dtype=torch.float32, device=query.device),
    )
    if p.hopper:
        mask_div = head_div(mask, h, key.shape[2])
        hopper.forward(query, lists, *saved, scale, band.is_causal, mask_div)
        return saved
    _launch_forward(Operands.dense(problem, key, value), saved, tables, lists, p, opts)
    return saved


# The forward and dq kernels' COMPACT values (kernels/common.py).
LISTED, PACKED = 1, 2


def scored_mask(mask, lists):
    """The mask the kernels test per score: none where key lists hold it whole (a bool mask
    shared by all queries), a row-limit mask's limits where they list its keys (the rows of
    each key differ), the mask itself without lists."""
    return mask if lists is None or is_limit(mask) else None


def _key_operands(key, value, bias, lists):
    """(key, value, bias, COMPACT) the forward and dq kernels read: the packed rows, or the
    caller's tensors (through the key lists, if any)."""
    if lists is not None and lists.packed is not None:
        return lists.packed.key, lists.packed.value, lists.packed.bias, PACKED
    return key, value, bias, 0 if lists is None else LISTED


def _launch_forward(ops: Operands, saved: Saved, tables, lists, p: plan.Plan, opts: Options):
    """attention_fwd_kernel over `ops` into saved's (out, lse, lse_rem), out (B, Lq, H, Dv)
    (packed: its (1, total, H, Dv) view), by the plan's config, band and heads per program,
    reading the tile tables or the key lists if any. Key lists with packed rows: the kernel
    reads those instead of K, V and bias (PACKED). The arguments besides the tensors are made
    once per plan (_forward_args)."""
    key, value, bias, compact = _key_operands(ops.key, ops.value, ops.bias, lists)
    scored = scored_mask(ops.mask, lists)
    tensors = (
        ops.query, key, value, scored, bias, ops.seqused_k, ops.cu_q, ops.cu_k,
        *_table_rows(tables), *_list_rows(lists), *saved, ops.sinks,
    )  # fmt: skip
    site = ("fwd", compact, tables is None, lists is None)
    args = prepared(
        p.launches, site,
        lambda: _forward_args(ops, saved, key, value, bias, scored, tables, lists, compact, p,
                              opts),
    )  # fmt: skip
    attention_fwd_kernel.run(args, tensors)


def _query_tile_args(ops: Operands, tables, lists, bias, nq, key_tiles, p, opts) -> tuple:
    """The scalar arguments the forward and dq kernels (one program per query tile) share after
    their strides: the tables' or lists' batch strides, the grid's query tiles, lse's strides,
    the sizes, the head divisors, scale, softcap and the band."""
    h, d = ops.query.shape[2], ops.query.shape[3]
    hkv, dv = ops.key.shape[2], ops.value.shape[3]
    return (
        tables.stride_b if tables else (lists.end_stride_b if lists else 0),
        lists.end_stride_h if lists else nq,
        lists.keys_stride_b if lists else 0, lists.keys_stride_h if lists else 0,
        *ops.lse_strides, h, h // hkv, ops.lq, ops.lk, d, dv, key_tiles,
        head_div(ops.mask, h, hkv), head_div(bias, h, hkv), float(opts.scale),
        float(opts.softcap), *p.band.args(),
    )  # fmt: skip


def _table_rows(tables) -> tuple:
    """The forward and dq kernels' tile-table operands (kv_num, kv_idx, kv_int), or Nones."""
    return (None, None, None) if tables is None else (tables.kv_num, tables.kv_idx, tables.kv_int)


def _list_rows(lists) -> tuple:
    """The forward and dq kernels' key-list operands (keys, key_start, key_end), or Nones."""
    return (None, None, None) if lists is None else (lists.keys, lists.key_start, lists.key_end)


def _forward_args(ops: Operands, saved, key, value, bias, scored, tables, lists, compact, p, opts):
    """attention_fwd_kernel's grid and arguments after its tensors (Prepared)."""
    query = ops.query
    h, d, dv = query.shape[2], query.shape[3], ops.value.shape[3]
    cfg, band, pack_heads = p.config, p.band, p.heads
    nq = cdiv(ops.span_q, cfg.block_m // pack_heads)
    scalars = (
        *ops.strides(key, value, bias), *batch_strides(saved.out),
        *_query_tile_args(ops, tables, lists, bias, nq, cdiv(ops.lk, cfg.block_n), p, opts),
    )  # fmt: skip
    meta = dict(
        **band.flags(), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        **_head_blocks(d, dv), DOT_PRECISION=_dot_precision(query.dtype),
        HAS_MASK=operand_kind(scored), HAS_BIAS=operand_kind(bias),
        HAS_SEQUSED=ops.seqused_k is not None, HAS_SOFTCAP=opts.softcap > 0, COMPACT=compact,
        VARLEN=ops.varlen, HAS_SINKS=ops.sinks is not None, PACK_G=pack_heads,
        LIST_R=_list_ratio(lists, cfg.block_m // pack_heads, p), num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )  # fmt: skip
    return Prepared((nq, ops.b * h // pack_heads), scalars, meta)


def _list_ratio(lists, positions: int, p: plan.Plan) -> int:
    """LIST_R of a forward or dq launch: how many list tiles (plan.Plan.list_rows positions
    each) one of its query tiles (`positions`) spans; 1 without batched key lists."""
    return positions // p.list_rows if lists is not None and p.list_rows else 1


def _sum_to_bias(cols: torch.Tensor, bias: torch.Tensor, hkv: int) -> torch.Tensor:
    """(B, H, Lk) float32 column sums of dS -> bias's (B|1, H|Hkv|1, 1, Lk) shape and dtype."""
    b, h, lk = cols.shape
    bb, hb = bias.shape[0], bias.shape[1]
    if hb != h:
        cols = cols.view(b, hkv, h // hkv, lk).sum(dim=2) if hb == hkv else cols.sum(1, True)
    if bb != b:
        cols = cols.sum(dim=0, keepdim=True)
    return cols.view(bb, hb, 1, lk).to(bias.dtype)


def backward(
    problem: Problem,
    opts: Options,
    saved: Saved,
    grad_out,
    grad_lse,
    compute_dbias: bool,
    kept: KeptLists | None = None,
) -> Gradients:
    """The gradients of a validated call (Gradients). Sinks change nothing else: with lse and
    out of the forward that joined them, P = exp(s - lse) and delta = rowsum(dO * O) - grad_lse
    are the sinks' softmax already, and dsinks[h] = -sum exp(sinks[h] - lse) * delta
    (chunked.sinks_grad). Our kernels use no atomics, so every route but PyTorch's fused
    backwards (dense calls, sdpa.py) is deterministic; deterministic=True keeps dense calls on
    our kernels. kept: the forward's key lists of this call (KeptLists), read instead of building
    them again where they fit."""
    compute_dbias = compute_dbias and problem.bias is not None
    inputs, problem = problem, problem.collapsed(grad_bias=compute_dbias)
    saved = Saved(saved.out, _dense(saved.lse), _dense(saved.lse_rem))
    grad_out = dense_rows(grad_out)
    p = plan.plan(
        problem, opts, plan.BACKWARD, grad_lse=grad_lse is not None, compute_dbias=compute_dbias
    )
    if problem.varlen:
        return _varlen_backward(problem, opts, p, saved, grad_out, grad_lse, compute_dbias)
    query, key, value = problem.query, problem.key, problem.value
    mask, bias, seqused_k, sinks = problem.mask, problem.bias, problem.seqused_k, problem.sinks
    out, lse, lse_rem = saved
    scale = opts.scale
    b, lq, h, _ = query.shape
    lk, hkv = key.shape[1], key.shape[2]
    device = query.device
    no_sinks = None  # Gradients.dsinks without sinks
    if p.route == EMPTY:
        dbias = (
            torch.zeros(bias.shape, dtype=bias.dtype, device=device)
            if compute_dbias
            else torch.empty((0,), dtype=query.dtype, device=device)
        )
        # No key to compute with, but a row's lse is still its sink's (lse = sinks[h] when
        # Lk = 0): dsinks is the sum of those rows' lse gradients.
        dsinks = no_sinks
        if sinks is not None:
            delta = chunked.row_delta(out, grad_out, grad_lse)
            dsinks = chunked.sinks_grad(sinks, lse, lse_rem, delta)
        return Gradients(
            torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(value), dbias, dsinks
        )  # fmt: skip
    if p.route == PYTORCH:
        key, value = chunked.zero_unseen_keys(key, value, mask)
        grads = chunked.backward(
            replace(problem, key=key, value=value), opts, saved, grad_out, grad_lse,
            compute_dbias,
        )  # fmt: skip
        if sinks is None:
            return Gradients(*grads, no_sinks)
        delta = chunked.row_delta(out, grad_out, grad_lse)
        return Gradients(*grads, chunked.sinks_grad(sinks, lse, lse_rem, delta))
    if p.route == SDPA:
        # With sinks, out and lse are the forward's joined ones: the fused backwards then take
        # P = exp(s - lse) and delta = rowsum(dO * O) of the sinks' softmax, as ours do.
        if p.tail:
            dq, dk, dvv = _window_tail_backward(problem, opts, p, saved, grad_out)
        else:
            dq, dk, dvv = sdpa.backward(
                grad_out, query, key, value, out, lse, scale, p.band, p.fused, chunk=p.chunk
            )
        dsinks = (
            no_sinks
            if sinks is None
            else _sinks_grad(sinks, _row_stats(out, grad_out, lse, lse_rem))
        )
        return Gradients(dq, dk, dvv, torch.empty((0,), dtype=query.dtype, device=device), dsinks)
    band, dbias_mode, cfgs = p.band, p.dbias, p.configs
    tables = dq_tables = lists = None
    if p.route == KEY_LISTS:
        # hopper_dq_kernel reads lists made as the forward's (those kept, where it made them).
        lists = _key_lists(
            kept, inputs, problem, p, hopper.BLOCK_M if p.hopper else p.list_rows,
            PackFrom(key, value, bias, h, zero_tail=p.hopper) if p.pack else None,
        )  # fmt: skip
    elif p.route == TILE_TABLES:
        seen = _seen_buffer(mask, lk)
        tables, dq_tables = _backward_tables(
            mask, seqused_k, b, lq, lk, band, cfgs, seen, p.launches
        )
        key, value = chunked.zero_keys(key, value, seen)
    stats = empty((b, h, lq, 4), dtype=torch.float32, device=device)

    # Every row of dk, dv and the column sums is written by the dk/dv kernels, keys outside
    # the key lists included (their rows are zeros): no fills.
    dq = empty(query.shape, dtype=query.dtype, device=device)
    dk = empty(key.shape, dtype=key.dtype, device=device)
    dvv = empty(value.shape, dtype=value.dtype, device=device)
    dbias_cols = dbias_direct = dbias_bcast = None
    if dbias_mode == "group":
        dbias_cols = empty((b, hkv, 1, lk), dtype=bias.dtype, device=device)
    elif dbias_mode == "cols":
        dbias_cols = empty((b, h, lk), dtype=torch.float32, device=device)
    elif dbias_mode == "direct":
        dbias_direct = torch.zeros((b, h, lq, lk), dtype=bias.dtype, device=device)
    elif dbias_mode == "bcast":
        dbias_bcast = empty(bias.shape, dtype=bias.dtype, device=device)

    ops = Operands.dense(problem, key, value)
    rows = RowStats(stats, out, grad_lse, lse, lse_rem)
    _launch_backward(
        ops, grad_out, rows, Grads(dq, dk, dvv, dbias_cols, dbias_direct), tables, dq_tables,
        lists, lists, p, opts,
    )  # fmt: skip
    if dbias_bcast is not None:
        _launch_dbias_bcast(ops, grad_out, stats, tables, dbias_bcast, p, opts)

    if not compute_dbias:
        dbias = torch.empty((0,), dtype=query.dtype, device=device)
    elif dbias_mode == "group":
        dbias = dbias_cols
    elif dbias_cols is not None:
        dbias = _sum_to_bias(dbias_cols, bias, hkv)
    elif dbias_direct is not None:
        dbias = dbias_direct.view(bias.shape)
    else:
        dbias = dbias_bcast
    dsinks = no_sinks if sinks is None else _sinks_grad(sinks, stats)
    return Gradients(dq, dk, dvv, dbias, dsinks)


def _launch_dbias_bcast(ops: Operands, grad_out, stats, tables, dbias, p: plan.Plan, opts):
    """dbias of a bias with query rows shared over batch and/or heads (plan "bcast"): one
    program per query tile of each bias (batch, head) sums dS over the query heads and batches
    that share it, reading the dk/dv kernel's tile tables (the plan keeps such calls off key
    lists) and the row statistics the dq kernel wrote."""
    query, key, value, mask, bias = ops.query, ops.key, ops.value, ops.mask, ops.bias
    cfg, band, scale, softcap = p.configs.dkdv, p.band, opts.scale, opts.softcap
    b, lq, h, d = query.shape
    lk, hkv, dv = key.shape[1], key.shape[2], value.shape[3]
    g = h // hkv
    nq, nk = cdiv(lq, cfg.block_m), cdiv(lk, cfg.block_n)
    strides = (
        *query.stride(), *key.stride(), *value.stride(), *grad_out.stride(),
        *operand_strides(mask), *operand_strides(bias),
    )  # fmt: skip
    bb, hb = bias.shape[0], bias.shape[1]
    n_batch, batch_mul = (1, 1) if bb == b else (b, 0)
    if hb == h:
        n_head, head_mul = 1, 1
    elif hb == hkv:
        n_head, head_mul = g, g
    else:
        n_head, head_mul = h, 0
    attention_bwd_dbias_kernel[(nq, bb * hb)](
        query, key, value, grad_out, mask, bias, ops.seqused_k, stats,
        tables.active if tables else None, dbias, *strides,
        tables.stride_b if tables else 0, nq,
        h, g, hb, lq, lk, d, dv, nq, nk, n_batch, batch_mul, n_head, head_mul,
        head_div(mask, h, hkv), head_div(bias, h, hkv), float(scale), float(softcap),
        *band.args(), HAS_MASK=operand_kind(mask), HAS_SEQUSED=ops.seqused_k is not None,
        HAS_SOFTCAP=softcap > 0, **_meta(cfg, d, dv, band, query.dtype),
    )  # fmt: skip


def _row_block(dv: int) -> dict:
    """Tiles of the one-pass row kernels (sinks_join_kernel, attention_row_stats_kernel)."""
    return dict(
        BLOCK_M=16 if interpreter_on() else 64, BLOCK_DV=head_block(dv), num_warps=4,
    )  # fmt: skip


def _join_sinks(out, lse, lse_rem, sinks):
    """chunked.join_sinks in one launch, in place, for the fresh (out, lse, lse_rem) of
    PyTorch's fused kernels (lse and lse_rem contiguous)."""
    if sinks is None:
        return out, lse, lse_rem
    b, lq, h, dv = out.shape
    meta = _row_block(dv)
    sinks_join_kernel[(cdiv(lq, meta["BLOCK_M"]), b * h)](
        out, lse, lse_rem, sinks, h, lq, dv, *out.stride(), **meta
    )  # fmt: skip
    return out, lse, lse_rem


def _row_stats(out, grad_out, lse, lse_rem) -> torch.Tensor:
    """The backward's row statistics (RowStats.stats) of a call whose backward runs no dq
    kernel of ours: one launch over out and grad_out (B, Lq, H, Dv)."""
    b, lq, h, dv = out.shape
    stats = empty((b, h, lq, 4), dtype=torch.float32, device=out.device)
    meta = _row_block(dv)
    attention_row_stats_kernel[(cdiv(lq, meta["BLOCK_M"]), b * h)](
        out, grad_out, lse, lse_rem, stats, h, lq, dv, *out.stride(), *grad_out.stride(), **meta
    )  # fmt: skip
    return stats


def _sinks_grad(sinks, stats) -> torch.Tensor:
    """chunked.sinks_grad in one launch (a dozen small PyTorch ops eagerly): one program per
    head over the (B, H, Lq) row statistics, deterministic."""
    b, h, lq, _ = stats.shape
    dsinks = empty((h,), dtype=sinks.dtype, device=sinks.device)
    attention_bwd_sinks_kernel[(h,)](
        _dense(sinks), stats, dsinks, b, h, lq,
        BLOCK=64 if interpreter_on() else 1024, num_warps=1 if interpreter_on() else 4,
    )  # fmt: skip
    return dsinks


@dataclass(frozen=True)
class RowStats:
    """The backward's row statistics: `stats` (B, H, Lq, 4) float32 rows [lse, lse_rem, delta,
     0] (varlen: (H, total_q, 4)) with delta = rowsum(dO * O) - grad_lse and lse 0 where it is
     -inf, which the dq kernel computes from the rest (out (B, Lq, H, Dv) of any strides, the
     optional grad_lse, the forward's contiguous lse and lse_rem) and writes for the kernels
     launched after it. The dk/dv kernel reads a row's three values in one 16-byte load
    ."""

    stats: torch.Tensor
    out: torch.Tensor
    grad_lse: torch.Tensor | None
    lse: torch.Tensor
    lse_rem: torch.Tensor


def _meta(cfg: Config, d: int, dv: int, band: Band, dtype: torch.dtype) -> dict:
    return dict(
        **band.flags(), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        **_head_blocks(d, dv), DOT_PRECISION=_dot_precision(dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip


class Grads(NamedTuple):
    """The buffers the backward kernels write: dq, dk, dv in their inputs' layouts, and the
    bias gradient as column sums (dbias_cols: float32 (B, H, Lk), or the gradient (B, Hkv, 1,
    Lk) itself with the plan's "group" mode; packed: (H, total_k)) or per entry
    (dbias_direct), or neither."""

    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    dbias_cols: torch.Tensor | None = None
    dbias_direct: torch.Tensor | None = None

    def col_strides(self, varlen: bool) -> tuple[int, int]:
        """dbias_cols' (batch, head) strides; its keys are unit-strided."""
        cols = self.dbias_cols
        if cols is None:
            return (0, 0)
        return (0, cols.stride(0)) if varlen else (cols.stride(0), cols.stride(1))


def _launch_backward(
    ops: Operands, grad_out, rows: RowStats, grads: Grads, tables, dq_tables, lists,
    dkdv_lists, p: plan.Plan, opts: Options,
):  # fmt: skip
    """The dq kernel, which also writes rows.stats, then the dk/dv kernels that read them, over
    `ops` as in _launch_forward, with the plan's backward configs (p.configs: BackwardConfigs).
    dkdv_lists is lists, or None where the mask is per query head under GQA (one key list per
    KV group is needed). The plan's "group" dbias mode: grads.dbias_cols is the bias gradient
    (B, Hkv, 1, Lk) itself, summed over each KV group's heads by the kernels. Key lists with
    packed rows (no DBIAS_DIRECT): the dq kernel reads those (PACKED); the dk/dv kernels read
    key, value and bias through the lists; or (p.hopper) hopper.py's dQ and dK/dV kernels read
    the packed rows. The arguments besides the tensors are made once per plan and layout of the
    tensors the plan does not fix (grad_out, grad_lse, out): _dq_args, _dkdv_args."""
    dq, dk, dv, dbias_cols, dbias_direct = grads
    # What the plan does not fix: the caller's gradient and output tensors' layouts, and which
    # of the optional buffers this call has.
    layout = (
        grad_out.stride(), None if rows.grad_lse is None else rows.grad_lse.stride(),
        rows.out.stride(), dbias_cols is None, dbias_direct is None, tables is None,
        lists is None, dkdv_lists is None,
    )  # fmt: skip
    launches = p.launches
    mask_div = head_div(ops.mask, ops.query.shape[2], ops.key.shape[2]) if p.hopper else 1
    if p.hopper:
        hopper.dq(ops.query, grad_out, rows, lists, dq, opts.scale, p.band.is_causal, mask_div)
    else:
        dq_key, dq_value, dq_bias, compact = _key_operands(ops.key, ops.value, ops.bias, lists)
        scored = scored_mask(ops.mask, lists)
        args = prepared(
            launches, ("dq", *layout),
            lambda: _dq_args(
                ops, grad_out, rows, grads, dq_tables, lists, dq_bias, compact, p, opts
            ),
        )  # fmt: skip
        attention_bwd_dq_kernel.run(args, (
            ops.query, dq_key, dq_value, grad_out, scored, dq_bias, ops.seqused_k, ops.cu_q,
            ops.cu_k, rows.stats, rows.out, rows.grad_lse, rows.lse, rows.lse_rem,
            *_table_rows(dq_tables), *_list_rows(lists), dq, dbias_direct,
        ))  # fmt: skip

    split, parts = prepared(launches, ("split", *layout), lambda: _dkdv_split(ops, p, dkdv_lists))
    part_dk = part_dv = part_db = None
    if split > 1:
        part_dk, part_dv, part_db = empties(parts, device=ops.query.device)
    listed = (None, None) if dkdv_lists is None else (dkdv_lists.keys, dkdv_lists.key_count)
    if p.hopper:
        hopper.dkdv(
            ops.query, grad_out, rows.stats, dkdv_lists, dk, dv,
            None if split > 1 else dbias_cols, (part_dk, part_dv, part_db), opts.scale,
            p.band.is_causal, mask_div, split,
        )  # fmt: skip
    else:
        dkdv_scored = scored_mask(ops.mask, dkdv_lists)
        args = prepared(
            launches, ("dkdv", *layout),
            lambda: _dkdv_args(ops, grad_out, grads, tables, dkdv_lists, dkdv_scored, split, p,
                               opts),
        )  # fmt: skip
        q_tiles = (None,) * 4 if tables is None else (
            tables.q_num, tables.q_idx, tables.q_lo, tables.q_hi)  # fmt: skip
        attention_bwd_dkdv_kernel.run(args, (
            ops.query, ops.key, ops.value, grad_out, dkdv_scored, ops.bias, ops.seqused_k,
            ops.cu_q, ops.cu_k, rows.stats, *q_tiles, *listed, dk, dv, dbias_cols, part_dk,
            part_dv, part_db,
        ))  # fmt: skip
    if split > 1:
        args = prepared(
            launches, ("reduce", *layout), lambda: _reduce_args(ops, grads, dkdv_lists, split, p)
        )
        attention_bwd_dkdv_reduce_kernel.run(args, (
            part_dk, part_dv, part_db, *listed, dk, dv,
            dbias_cols if p.dbias == "group" else None,
        ))  # fmt: skip


def _dq_args(ops: Operands, grad_out, rows: RowStats, grads: Grads, dq_tables, lists, dq_bias,
             compact, p: plan.Plan, opts: Options) -> Prepared:  # fmt: skip
    """attention_bwd_dq_kernel's grid and arguments after its tensors (Prepared)."""
    query = ops.query
    h, d, d_v = query.shape[2], query.shape[3], ops.value.shape[3]
    qc, band, pack_heads = p.configs.dq, p.band, p.heads
    dq_key, dq_value = _key_operands(ops.key, ops.value, ops.bias, lists)[:2]
    nq = cdiv(ops.span_q, qc.block_m // pack_heads)
    key_tiles = cdiv(ops.span_k, qc.block_n)
    scalars = (
        *ops.strides(dq_key, dq_value, dq_bias, grad_out), *batch_strides(rows.out),
        *(operand_strides(rows.grad_lse)[:3] if rows.grad_lse is not None else (0, 0, 0)),
        *_query_tile_args(ops, dq_tables, lists, dq_bias, nq, key_tiles, p, opts),
    )  # fmt: skip
    meta = dict(
        HAS_MASK=operand_kind(scored_mask(ops.mask, lists)),
        DBIAS_DIRECT=grads.dbias_direct is not None, COMPACT=compact,
        HAS_GRAD_LSE=rows.grad_lse is not None, PACK_G=pack_heads,
        LIST_R=_list_ratio(lists, qc.block_m // pack_heads, p), **_backward_flags(ops, opts),
        **_meta(qc, d, d_v, band, query.dtype),
    )  # fmt: skip
    return Prepared((nq, ops.b * h // pack_heads), scalars, meta)


def _backward_flags(ops: Operands, opts: Options) -> dict:
    """The constexpr flags the dq and dk/dv kernels share."""
    return dict(
        HAS_BIAS=operand_kind(ops.bias), HAS_SEQUSED=ops.seqused_k is not None,
        HAS_SOFTCAP=opts.softcap > 0, VARLEN=ops.varlen,
    )  # fmt: skip


def _dkdv_split(ops: Operands, p: plan.Plan, dkdv_lists) -> tuple[int, Carving | None]:
    """(split, parts): how many programs share each key tile's query heads in the dk/dv pass,
    and with split > 1 the Carving of their float32 dK, dV (and "group" dbias) parts, which
    attention_bwd_dkdv_reduce_kernel then sums."""
    split = _split(ops, p, dkdv_lists)
    if split == 1:
        return 1, None
    f32, rows = torch.float32, ops.b * ops.key.shape[2]
    return split, carve([
        ((split, rows, ops.lk, ops.query.shape[3]), f32),
        ((split, rows, ops.lk, ops.value.shape[3]), f32),
        ((split, rows, ops.lk), f32) if p.dbias == "group" else None,
    ])  # fmt: skip


def _split(ops: Operands, p: plan.Plan, dkdv_lists) -> int:
    """The dk/dv pass's split: the kernel option's, or configs.dkdv_split's; 1 for packed
    sequences."""
    query = ops.query
    h, hkv = query.shape[2], ops.key.shape[2]
    g = h // hkv
    if ops.cu_q is not None:
        return 1  # packed sequences: one program per key tile and KV head
    if p.split is not None:
        if g % p.split:
            raise ValueError(f"dmattn: kernel option dkdv_split={p.split} must divide G={g}")
        return p.split
    nk = _dkdv_tiles(ops, p)
    return configs.dkdv_split(
        g, nk * ops.b * hkv, sm_count(query.device),
        ops.b * hkv * ops.lk * (query.shape[3] + ops.value.shape[3]) * 4,
        query.numel() * query.element_size(), listed=dkdv_lists is not None,
        query_tiles=cdiv(ops.span_q, hopper.DKDV_BLOCK_M if p.hopper else p.configs.dkdv.block_m),
        scratch_ratio=p.tuning.dkdv_scratch,
    )  # fmt: skip


def _dkdv_tiles(ops: Operands, p: plan.Plan) -> int:
    """Key tiles of the dk/dv grid per (batch, KV head)."""
    return hopper.dkdv_programs(ops.lk) if p.hopper else cdiv(ops.span_k, p.configs.dkdv.block_n)


def _dkdv_args(ops: Operands, grad_out, grads: Grads, tables, dkdv_lists, scored, split,
               p: plan.Plan, opts: Options) -> Prepared:  # fmt: skip
    """attention_bwd_dkdv_kernel's grid and arguments after its tensors (Prepared)."""
    query = ops.query
    h, d = query.shape[2], query.shape[3]
    hkv, d_v = ops.key.shape[2], ops.value.shape[3]
    kv, band = p.configs.dkdv, p.band
    nk = _dkdv_tiles(ops, p)
    group_cols = p.dbias == "group"
    scalars = (
        *ops.strides(grad_out=grad_out), tables.stride_bt if tables else 0, nk,
        dkdv_lists.keys_stride_b if dkdv_lists else 0,
        dkdv_lists.keys_stride_h if dkdv_lists else 0,
        dkdv_lists.count_stride_b if dkdv_lists else 0, *ops.lse_strides,
        *grads.col_strides(ops.varlen), h, hkv, h // hkv, ops.lq, ops.lk, d, d_v,
        cdiv(ops.span_q, kv.block_m), head_div(ops.mask, h, hkv), head_div(ops.bias, h, hkv),
        float(opts.scale), float(opts.softcap), split, *band.args(),
    )  # fmt: skip
    meta = dict(
        HAS_MASK=operand_kind(scored), DBIAS_COLS=grads.dbias_cols is not None,
        GROUP_COLS=group_cols, COMPACT=dkdv_lists is not None,
        # Batched key lists are permutations of the keys (tiles.KeyLists): the dk/dv kernels
        # write zeros at the keys no list holds.
        ZERO_UNLISTED=dkdv_lists is not None and ops.cu_q is None, PARTIAL=split > 1,
        **_backward_flags(ops, opts), **_meta(kv, d, d_v, band, query.dtype),
    )  # fmt: skip
    return Prepared((nk, ops.b * hkv * split), scalars, meta)


def _reduce_args(ops: Operands, grads: Grads, dkdv_lists, split, p: plan.Plan) -> Prepared:
    """attention_bwd_dkdv_reduce_kernel's grid and arguments after its tensors (Prepared)."""
    h, hkv = ops.query.shape[2], ops.key.shape[2]
    d, d_v = ops.query.shape[3], ops.value.shape[3]
    block_r = 16 if interpreter_on() else 64
    scalars = (
        dkdv_lists.keys_stride_b if dkdv_lists else 0,
        dkdv_lists.keys_stride_h if dkdv_lists else 0,
        dkdv_lists.count_stride_b if dkdv_lists else 0, *grads.col_strides(ops.varlen),
        hkv, h // hkv, ops.lk, d, d_v, head_div(ops.mask, h, hkv), split,
    )  # fmt: skip
    meta = dict(
        BLOCK_R=block_r, **_head_blocks(d, d_v), COMPACT=dkdv_lists is not None,
        GROUP_COLS=p.dbias == "group", num_warps=1 if interpreter_on() else 4,
    )  # fmt: skip
    return Prepared((cdiv(ops.lk, block_r), ops.b * hkv), scalars, meta)


# A chunked window call (sdpa.py) whose length is not a multiple of its chunk: the whole chunks
# through PyTorch's kernels, the rows after them through ours (against every key: a dense call
# with Lq < Lk, which the band bounds to the window).


def _tail_options(opts: Options) -> Options:
    """The tail rows' call: our kernels, whatever route the options force on the whole."""
    return replace(
        opts, softcap=0.0, deterministic=False, kernel=options.without_route(opts.kernel)
    )


def _window_tail_forward(problem: Problem, opts: Options, p: plan.Plan):
    query, key, value = problem.query, problem.key, problem.value
    head = query.shape[1] - p.tail
    out, lse, lse_rem = sdpa.forward(
        query[:, :head], key[:, :head], value[:, :head], opts.scale, p.band, p.fused, chunk=p.chunk
    )
    tail = Problem(query[:, head:], key, value)
    out_t, lse_t, rem_t = forward(tail, _tail_options(opts))
    return torch.cat((out, out_t), 1), torch.cat((lse, lse_t), 2), torch.cat((lse_rem, rem_t), 2)


def _window_tail_backward(problem: Problem, opts: Options, p: plan.Plan, saved: Saved, grad_out):
    query, key, value = problem.query, problem.key, problem.value
    out, lse, lse_rem = saved
    head = query.shape[1] - p.tail
    dq, dk, dv = sdpa.backward(
        grad_out[:, :head], query[:, :head], key[:, :head], value[:, :head], out[:, :head],
        lse[:, :, :head], opts.scale, p.band, p.fused, chunk=p.chunk,
    )  # fmt: skip
    tail = Problem(query[:, head:], key, value)
    tail_saved = Saved(out[:, head:], lse[:, :, head:], lse_rem[:, :, head:])
    dq_t, dk_t, dv_t, _, _ = backward(
        tail, _tail_options(opts), tail_saved, grad_out[:, head:],
        None, False,
    )  # fmt: skip
    dk_t[:, :head] += dk
    dv_t[:, :head] += dv
    return torch.cat((dq, dq_t), 1), dk_t, dv_t


# Variable-length batches: packed (total, H, D) tensors and cu_seqlens.


def _varlen_operand(t: torch.Tensor | None) -> torch.Tensor | None:
    """A per-key-token mask/bias (H|Hkv|1, total_k) as the 4-D operand (1, H|Hkv|1, 1, total_k)."""
    return None if t is None else t[None, :, None, :]


def _varlen_empty(total_q, h, dv, query):
    out = torch.zeros((total_q, h, dv), dtype=query.dtype, device=query.device)
    lse = torch.full((h, total_q), float("-inf"), dtype=torch.float32, device=query.device)
    lse_rem = torch.zeros((h, total_q), dtype=torch.float32, device=query.device)
    return out, lse, lse_rem


def _varlen_forward(problem: Problem, opts: Options, p: plan.Plan):
    """out (total_q, H, Dv), lse and lse_rem float32 (H, total_q) of packed sequences. Rows of
    out and lse outside every sequence are 0 and -inf."""
    query, value = problem.query, problem.value
    mask, cu_q, cu_k = problem.mask, problem.cu_seqlens_q, problem.cu_seqlens_k
    if p.route == PYTORCH:
        return chunked.varlen_forward(problem, opts)
    total_q, h, _ = query.shape
    dv = value.shape[2]
    # Written in full: rows outside every sequence are never visited by a kernel.
    out, lse, lse_rem = _varlen_empty(total_q, h, dv, query)
    if p.route == EMPTY:
        return out, lse, lse_rem
    ops = Operands.packed(problem)
    lists = None
    if mask is not None:
        nq = cdiv(ops.span_q, p.config.block_m)
        lists = build_varlen_key_lists(
            mask, cu_q, cu_k, total_q, nq, p.band, p.config.block_m, ops.span_k, p.launches
        )
    _launch_forward(ops, Saved(out[None], lse, lse_rem), None, lists, p, opts)
    return out, lse, lse_rem


def _varlen_sum_to_bias(cols: torch.Tensor, bias: torch.Tensor, hkv: int) -> torch.Tensor:
    """(H, total_k) float32 column sums of dS -> bias's (H|Hkv|1, total_k) shape and dtype."""
    h, total_k = cols.shape
    hb = bias.shape[0]
    if hb != h:
        cols = cols.view(hkv, h // hkv, total_k).sum(dim=1) if hb == hkv else cols.sum(0, True)
    return cols.to(bias.dtype)


def _varlen_backward(
    problem: Problem, opts: Options, p: plan.Plan, saved: Saved, grad_out, grad_lse,
    compute_dbias: bool,
) -> Gradients:  # fmt: skip
    """Gradients of packed sequences: 0 on rows outside every sequence, dbias in bias's
    (H|Hkv|1, total_k) shape and dtype. No atomics: always deterministic."""
    query, key, value = problem.query, problem.key, problem.value
    mask, bias, cu_q, cu_k = problem.mask, problem.bias, problem.cu_seqlens_q, problem.cu_seqlens_k
    out, lse, lse_rem = saved
    no_sinks = None  # Gradients.dsinks without sinks
    if p.route == PYTORCH:
        grads = chunked.varlen_backward(problem, opts, saved, grad_out, grad_lse, compute_dbias)
        return Gradients(*grads, no_sinks)
    total_q, h, _ = query.shape
    total_k, hkv = key.shape[0], key.shape[1]
    device = query.device
    dq, dk, dvv = torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(value)
    dbias_cols = None
    if compute_dbias:
        dbias_cols = torch.zeros((h, total_k), dtype=torch.float32, device=device)
    if p.route != EMPTY:
        ops = Operands.packed(problem)
        lists = None
        if mask is not None:
            block_m = p.configs.dq.block_m
            nq = cdiv(ops.span_q, block_m)
            lists = build_varlen_key_lists(
                mask, cu_q, cu_k, total_q, nq, p.band, block_m, ops.span_k, p.launches
            )
        dkdv_lists = lists if compactable(ops.mask, h, hkv) else None
        # Rows outside every sequence are never written nor read.
        stats = empty((h, total_q, 4), dtype=torch.float32, device=device)
        rows = RowStats(
            stats, out[None], None if grad_lse is None else grad_lse[None], lse, lse_rem
        )
        _launch_backward(
            ops, grad_out[None], rows, Grads(dq, dk, dvv, dbias_cols), None, None, lists,
            dkdv_lists, p, opts,
        )  # fmt: skip
    if not compute_dbias:
        return Gradients(dq, dk, dvv, torch.empty((0,), dtype=query.dtype, device=device), no_sinks)
    return Gradients(dq, dk, dvv, _varlen_sum_to_bias(dbias_cols, bias, hkv), no_sinks)


# Decoding: split-K forward for a few queries against a long cache.

DECODE_WAVES = 8  # programs per SM to aim for (measured fastest on an H100)


def decode_forward(problem: Problem, opts: Options, p: plan.Plan):
    """out, lse, lse_rem as `forward`, through attention_decode_kernel and its merge, which
    joins the sinks (H,) if any. Under a window the splits cover the band (at most left + Lq +
    right keys, from the first query's lower bound), not the cache. The launches' arguments
    and the buffers' shapes are made once per plan (_decode_layout): a decode step's host time
    is most of its time."""
    query, key, value = problem.query, problem.key, problem.value
    mask, bias, seqused_k, sinks = problem.mask, problem.bias, problem.seqused_k, problem.sinks
    b, lq, lk, band = query.shape[0], query.shape[1], key.shape[1], p.band
    device = query.device
    lists = None
    if mask is not None:
        lists = build_key_lists(mask, seqused_k, b, lq, lk, band, lq, launches=p.launches)
    layout = prepared(
        p.launches, ("decode", lists is None), lambda: _decode_layout(problem, opts, p, lists)
    )
    acc, m, l_part = empties(layout.parts, device=device)  # the splits' scratch: one allocation
    attention_decode_kernel.run(layout.decode, (
        query, key, value, bias, seqused_k, *_list_rows(lists), acc, m, l_part,
    ))  # fmt: skip
    out = empty(layout.out, dtype=query.dtype, device=device)
    lse = empty(layout.lse, dtype=torch.float32, device=device)
    lse_rem = empty(layout.lse, dtype=torch.float32, device=device)
    decode_combine_kernel.run(layout.combine, (acc, m, l_part, out, lse, lse_rem, sinks))
    return out, lse, lse_rem


class _DecodeLayout(NamedTuple):
    """What decode_forward makes once per plan: the split parts' Carving (acc, m, l, float32),
    out's and lse's shapes, and the two launches (Prepared)."""

    parts: Carving
    out: tuple
    lse: tuple
    decode: Prepared
    combine: Prepared


def _decode_layout(problem: Problem, opts: Options, p: plan.Plan, lists) -> _DecodeLayout:
    query, key, value = problem.query, problem.key, problem.value
    mask, bias, seqused_k = problem.mask, problem.bias, problem.seqused_k
    scale, softcap, band = opts.scale, opts.softcap, p.band
    b, lq, h, d = query.shape
    lk, hkv, dv = key.shape[1], key.shape[2], value.shape[3]
    g = h // hkv
    cfg = p.config
    block_n = cfg.block_n
    block_m = max(16, next_power_of_2(g * lq))
    span = lk
    if band.has_window and band.left < UNBOUNDED and band.right < UNBOUNDED:
        span = torch.sym_min(lk, band.left + lq + band.right + block_n)  # + a tile of alignment
    tiles = cdiv(span, block_n)
    most = cdiv(DECODE_WAVES * sm_count(query.device), hint(b) * hkv)
    splits = max(1, min(hint(tiles), most))
    tiles_per_split = cdiv(tiles, splits)
    if not symbolic(tiles):
        splits = cdiv(tiles, tiles_per_split)  # no split without a tile
    # A symbolic cache length (a compiled generate loop, registration/inductor.py) keeps the
    # example's split count whatever the length: a split past the last tile writes an empty
    # part, which the combine weighs 0, so the split count and the combine's block guard
    # nothing.
    rows = b * h * lq
    decode = Prepared(
        (splits, b * hkv),
        (
            *query.stride(), *key.stride(), *value.stride(), *operand_strides(bias),
            lists.keys_stride_b if lists else 0, lists.keys_stride_h if lists else 0,
            lists.end_stride_b if lists else 0, 1,
            h, g, lq, lk, d, dv, rows, tiles_per_split * block_n,
            head_div(mask, h, hkv), head_div(bias, h, hkv), float(scale), float(softcap),
            *band.args(),
        ),
        dict(
            **band.flags(), BLOCK_M=block_m, BLOCK_N=block_n, **_head_blocks(d, dv),
            DOT_PRECISION=_dot_precision(query.dtype),
            # Per-row bias pointers (the rows span the G heads of a group): PER_ENTRY loads.
            HAS_BIAS=PER_ENTRY if bias is not None else 0,
            HAS_SEQUSED=seqused_k is not None, HAS_SOFTCAP=softcap > 0,
            COMPACT=LISTED if lists else 0, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        ),
    )  # fmt: skip
    out = (b, lq, h, dv)
    out_strides = contiguous_strides(out)  # `empty`'s
    combine = Prepared(
        (rows,),
        (rows, splits, h, lq, dv, *out_strides),
        dict(
            BLOCK_S=max(2, next_power_of_2(splits)), BLOCK_DV=head_block(dv),
            HAS_SINKS=problem.sinks is not None, num_warps=1 if interpreter_on() else 4,
        ),
    )  # fmt: skip
    f32 = torch.float32
    parts = carve([((splits, rows, dv), f32), ((splits, rows), f32), ((splits, rows), f32)])
    return _DecodeLayout(parts, out, (b, h, lq), decode, combine)
