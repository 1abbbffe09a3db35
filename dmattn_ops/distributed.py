"""Context parallelism: Dynamic Mask Attention over a sequence sharded across ranks.

Each of R ranks holds L/R rows of the sequence (queries, keys, values, and the per-key mask and
bias columns of its keys). `ring_attention` computes exactly `dmattn_ops.attention` over the
whole sequence, returning this rank's output rows: K, V and their mask/bias columns travel around
the ring of ranks with torch.distributed point-to-point ops (the next block's transfer overlaps
the current block's compute), each step calls the forward op on each (query chunk, key chunk)
pair that sees anything, or once on both of a zigzag rank's chunks where the band allows it
(`_zigzag_block`), and the partial outputs merge by their log-sum-exp. The backward runs the
ring again with the global output and lse: dQ stays local, dK/dV/dbias accumulate while
travelling with their K/V and reach their owner after the last hop. No rank ever holds a
full-sequence tensor.

Layouts: "zigzag" cuts the sequence into 2R chunks and gives rank r chunks r and 2R-1-r, which
balances causal work (every rank has an early and a late chunk); "contiguous" gives rank r chunk
r. `shard` and `unshard` convert between whole tensors and this rank's part. The ring runs only
as many steps as some rank's queries need (`_Ring.last_step`: a narrow window or short packed
documents on the contiguous layout stop it after one).

Packed documents (`cu_seqlens` over the global sequence) cut no chunk differently: between two
chunks at most one document crosses, so each off-diagonal block is one dense call and each
chunk's own block one varlen call (`_doc_block`).

Backends: NCCL on GPUs, gloo on CPU (any torch.distributed backend with point-to-point ops).

Under torch.compile, the ring and the global top-k are ops (`dmattn::ring_attention_forward`
and `_backward`, `dmattn::cp_topk_select`) that take the process group by name, as PyTorch's
functional collectives do: a graph holds each as one node with a fake kernel for its shapes,
and runs its point-to-point ring or all-gathers eagerly inside it, so a model of
DynamicMaskAttention layers in context-parallel mode compiles with `fullgraph=True`. (Traced
by Dynamo instead, the ring broke a layer's graph 15 times: data-dependent `.tolist()`, ints
from torch.distributed.) The checks that need every rank's shapes run inside the forward op,
after one small all-gather, so a call one rank refuses raises on all of them.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dmattn_ops.core.band import UNBOUNDED, Band
from dmattn_ops.core.problem import Problem
from dmattn_ops.core.validate import (
    NO_WINDOW,
    check_flags,
    check_inputs,
    check_sinks,
    check_window,
)
from dmattn_ops.executors.chunked import join_sinks, lse_split, row_delta, sinks_grad
from dmattn_ops.masks import _allowed, rank_key
from dmattn_ops.registration import inductor
from dmattn_ops.registration.calls import default_scale

LAYOUTS = ("zigzag", "contiguous")

# The ring's backward calls size their dk/dv split within twice their query bytes of float32
# scratch, not the library's four: a rank already holds float32 dQ, dK and dV accumulators and
# the arriving dK/dV, and the split's scratch was the largest thing alive at its peak (2 x H200,
# DMA L65536, per (query chunk, key chunk) call: 26.78 ms and 0.553x of one GPU's peak with
# four, 26.76 ms and 0.501x with two; with one, 0.449x but 28.50 ms: the key-list dK/dV kernel
# needs the split's programs, since only the listed quarter of its key tiles has work).
RING_BACKWARD_OPTIONS = "dkdv_scratch=2"


def _world(group) -> tuple[int, int]:
    return dist.get_world_size(group), dist.get_rank(group)


def _group_name(group) -> str:
    """The name torch.distributed knows a group by: a name as it is, the default group's for
    None. The ops take groups by name, as PyTorch's functional collectives do."""
    if isinstance(group, str):
        return group
    return (dist.group.WORLD if group is None else group).group_name


def _group(name: str):
    return dist.distributed_c10d._resolve_process_group(name)


def _chunk_ids(layout: str, rank: int, world: int) -> tuple[int, ...]:
    """Global chunk indices held by a rank, in the order they sit in its local rows."""
    if layout not in LAYOUTS:
        raise ValueError(f"dmattn.distributed: layout must be one of {LAYOUTS}; got {layout!r}")
    return (rank, 2 * world - 1 - rank) if layout == "zigzag" else (rank,)


def shard(x: torch.Tensor, dim: int, group=None, *, layout: str = "zigzag") -> torch.Tensor:
    """This rank's part of x along dim (a copy); x.shape[dim] must divide into 2R chunks
    ("zigzag") or R chunks ("contiguous")."""
    world, rank = _world(group)
    ids = _chunk_ids(layout, rank, world)
    n_chunks = 2 * world if layout == "zigzag" else world
    if x.shape[dim] % n_chunks:
        raise ValueError(
            f"dmattn.distributed.shard: the sharded dim has {x.shape[dim]} entries, which do not "
            f"divide into {n_chunks} chunks ({layout} layout over {world} ranks)"
        )
    chunks = x.chunk(n_chunks, dim=dim)
    return torch.cat([chunks[i] for i in ids], dim=dim)


def unshard(x_local: torch.Tensor, dim: int, group=None, *, layout: str = "zigzag"):
    """The whole tensor from every rank's part (all-gather), on every rank; the inverse of
    `shard`. Not differentiable."""
    world, _ = _world(group)
    parts = [torch.empty_like(x_local) for _ in range(world)]
    dist.all_gather(parts, x_local.contiguous(), group=group)
    n_chunks = 2 * world if layout == "zigzag" else world
    chunks = [None] * n_chunks
    for rank, part in enumerate(parts):
        ids = _chunk_ids(layout, rank, world)
        for cid, piece in zip(ids, part.chunk(len(ids), dim=dim)):
            chunks[cid] = piece
    return torch.cat(chunks, dim=dim)


@dataclass(frozen=True)
class _Ring:
    group: object
    world: int
    rank: int
    layout: str
    scale: float
    is_causal: bool
    softcap: float
    deterministic: bool
    window: tuple[int, int] = NO_WINDOW

    def ids(self, rank: int) -> tuple[int, ...]:
        return _chunk_ids(self.layout, rank, self.world)

    def pairs(
        self,
        src: int,
        rows: int,
        docs: Sequence[int] | None = None,
        rank: int | None = None,
        *,
        whole: bool = True,
    ):
        """The op call (a _Block) for each (local query chunk of `rank`, this rank by default;
        key chunk of rank src) pair in which some query sees some key; chunks have
        rows // len(ids) rows. Pairs no query of which sees a key are skipped. docs: the global
        cu_seqlens of packed documents. With `whole`, zigzag steps whose band is the whole past
        or everything (no window, no documents) are one call instead (_zigzag_block)."""
        rank = self.rank if rank is None else rank
        q_ids, k_ids = self.ids(rank), self.ids(src)
        n, band = rows // len(q_ids), self.band()
        whole_band = band[0] == -math.inf and band[1] in (0, math.inf)
        if whole and docs is None and len(q_ids) == 2 and whole_band:
            yield _zigzag_block(rank, src, n, causal=band[1] == 0)
            return
        for qi, a in enumerate(q_ids):
            for ki, c in enumerate(k_ids):
                if docs is not None:
                    block = _doc_block(docs, a * n, c * n, n, self)
                    if block is not None:
                        yield block.moved(qi * n, ki * n)
                    continue
                call = _pair_call(band, (c - a) * n, n)
                if call is not None:
                    (q0, q1), (k0, k1), causal, window = call
                    yield _Block(qi * n + q0, qi * n + q1, ki * n + k0, ki * n + k1, causal,
                                 window)  # fmt: skip

    def band(self) -> tuple[float, float]:
        """The keys a query sees, as (lo, hi) on (key position - query position), global: the
        kernels' Band (causality folded into the window's right side), unbounded sides as
        infinities."""
        band = Band.of(self.is_causal, self.window)
        if not band.has_window:
            return -math.inf, 0 if band.is_causal else math.inf
        lo = -math.inf if band.left == UNBOUNDED else -band.left
        return lo, math.inf if band.right == UNBOUNDED else band.right

    def last_step(self, rows: int, docs: Sequence[int] | None = None) -> int:
        """The last ring step with work on any rank: at step s rank r computes with the keys of
        rank r - s, and every rank forwards what it holds, so all run the same steps; steps
        after the last that some rank's queries need are neither computed nor sent. A window
        narrower than a rank's rows on the contiguous layout, or short packed documents there,
        stop the ring after a step or two; zigzag, whose ranks hold an early and a late chunk,
        and unbounded or non-causal bands need every step. Cached: the search visits up to R^2
        rank pairs (about 10 ms of host at R = 64 with a narrow window)."""
        docs = None if docs is None else tuple(docs)
        return _last_step(self.layout, self.world, self.is_causal, self.window, rows, docs)

    def visits(self, key, value, mask, bias, last: int, ready=None):
        """(src, k, v, m, b) for each ring step up to `last` (last_step): the key-side blocks
        of rank src (this rank's first), the next block's transfer started before the caller
        computes on this one and finished after. ready: called once the caller has issued
        its own block, before any transfer starts (the ranks' agreement, _agreement): the
        first transfer then starts after that block, which the GPU runs meanwhile."""
        travelling = [key, value, mask, bias]
        for step in range(last + 1):
            early = step < last and (ready is None or step > 0)
            finish = self.exchange(travelling) if early else None
            yield (self.rank - step) % self.world, *travelling
            if step == 0 and ready is not None:
                ready()
                finish = self.exchange(travelling) if step < last else None
            if finish is not None:
                travelling = finish()

    def exchange(self, tensors, to: int = 1):
        """Send these tensors to rank + to (the next rank) and receive those of rank - to (same
        shapes; a None stays None, nothing sent): started now, finished by calling the returned
        function, which gives the incoming tensors in the same places."""
        peers = ((self.rank + to) % self.world, (self.rank - to) % self.world)
        ops, incoming = [], []
        for t in tensors:
            if t is None:
                incoming.append(None)
                continue
            # Bool masks travel as bytes (not every backend sends bool).
            out = t.contiguous()
            out = out.view(torch.uint8) if t.dtype == torch.bool else out
            buf = torch.empty_like(out)
            ops.append(dist.P2POp(dist.isend, out, self._global(peers[0]), self.group))
            ops.append(dist.P2POp(dist.irecv, buf, self._global(peers[1]), self.group))
            incoming.append(buf.view(torch.bool) if t.dtype == torch.bool else buf)
        requests = dist.batch_isend_irecv(ops) if ops else []

        def finish():
            for request in requests:
                request.wait()
            return incoming

        return finish

    def _global(self, rank: int) -> int:
        return dist.get_global_rank(self.group, rank) if self.group is not None else rank


def _zigzag_block(rank: int, src: int, n: int, causal: bool) -> _Block:
    """A zigzag step's one call where the band is the whole past (causal) or everything: the
    rank's chunks (rank, 2R-1-rank), n rows each, against the chunks (src, 2R-1-src) of src's
    keys. Causal, on its own keys the local rows and keys are in global order with a gap
    (chunk rank's rows see their own chunk causally and not the later one; chunk 2R-1-rank's
    see chunk rank whole and their own causally), so the call is causal over both chunks; an
    earlier rank's first chunk is seen whole by both row chunks and its second by neither; a
    later rank's chunks are both seen whole by the second row chunk only. As ring-flash-attention
    runs zigzag: one call a step where a pair of chunks a call would take two to four."""
    if not causal:
        return _Block(0, 2 * n, 0, 2 * n, False)
    if src == rank:
        return _Block(0, 2 * n, 0, 2 * n, True)
    if src < rank:
        return _Block(0, 2 * n, 0, n, False)
    return _Block(n, 2 * n, 0, 2 * n, False)


@functools.lru_cache(maxsize=64)
def _last_step(layout, world, is_causal, window, rows, docs) -> int:
    """_Ring.last_step for a ring of this shape (its rank, scale and group do not matter)."""
    ring = _Ring(None, world, 0, layout, 1.0, is_causal, 0.0, False, window)
    for step in range(world - 1, 0, -1):
        for rank in range(world):
            src = (rank - step) % world
            if next(ring.pairs(src, rows, docs, rank), None) is not None:
                return step
    return 0


@dataclass(frozen=True)
class _Block:
    """One op call of the ring: local query rows [q0, q1) against the visiting keys [k0, k1),
    with the op's causality and window over those slices; with cu (packed documents), a varlen
    call over the slices whose sequences start at cu (local, from 0: the diagonal block of a
    chunk, its documents cut at the chunk's ends)."""

    q0: int
    q1: int
    k0: int
    k1: int
    is_causal: bool
    window: tuple[int, int] = NO_WINDOW
    cu: tuple[int, ...] | None = None

    @property
    def qs(self) -> slice:
        return slice(self.q0, self.q1)

    @property
    def ks(self) -> slice:
        return slice(self.k0, self.k1)

    def moved(self, dq: int, dk: int) -> _Block:
        return _Block(self.q0 + dq, self.q1 + dq, self.k0 + dk, self.k1 + dk, self.is_causal,
                      self.window, self.cu)  # fmt: skip

    def forward(self, query, k, v, m, b, ring):
        """(out, lse, lse_rem) of the block's rows, as the dense forward op shapes them."""
        qs, ks = self.qs, self.ks
        if self.cu is None:
            return torch.ops.dmattn.attention_forward(
                query[:, qs], k[:, ks], v[:, ks], _cols(m, ks), _cols(b, ks), ring.scale,
                self.is_causal, ring.softcap, None, ring.deterministic, self.window,
            )  # fmt: skip
        cu, longest = self._cu(query.device)
        o, lse, rem = torch.ops.dmattn.attention_varlen_forward(
            query[0, qs], k[0, ks], v[0, ks], cu, cu, longest, longest, _keys(m, ks),
            _keys(b, ks), ring.scale, self.is_causal, ring.softcap, ring.deterministic,
            self.window,
        )  # fmt: skip
        return o[None], lse[None], rem[None]

    def backward(self, grad_out, query, k, v, m, b, out, lse, lse_rem, ring, need_dbias):
        """(dq, dk, dv, dbias) of the block, in the dense backward op's shapes."""
        qs, ks = self.qs, self.ks
        if self.cu is None:
            return torch.ops.dmattn.attention_backward(
                grad_out[:, qs], None, query[:, qs], k[:, ks], v[:, ks], out[:, qs],
                lse[:, :, qs], lse_rem[:, :, qs], _cols(m, ks), _cols(b, ks), ring.scale,
                self.is_causal, ring.softcap, None, ring.deterministic, need_dbias, self.window,
                kernel_options=RING_BACKWARD_OPTIONS,
            )  # fmt: skip
        cu, longest = self._cu(query.device)
        dq, dk, dv, db = torch.ops.dmattn.attention_varlen_backward(
            grad_out[0, qs], None, query[0, qs], k[0, ks], v[0, ks], out[0, qs], lse[0][:, qs],
            lse_rem[0][:, qs], cu, cu, longest, longest, _keys(m, ks), _keys(b, ks), ring.scale,
            self.is_causal, ring.softcap, ring.deterministic, need_dbias, self.window,
            RING_BACKWARD_OPTIONS,
        )  # fmt: skip
        return dq[None], dk[None], dv[None], db[None, :, None] if need_dbias else db

    def _cu(self, device) -> tuple[torch.Tensor, int]:
        longest = max(b - a for a, b in itertools.pairwise(self.cu))
        return torch.tensor(self.cu, dtype=torch.int32, device=device), longest


def _doc_block(docs: Sequence[int], qa: int, ka: int, n: int, ring: _Ring) -> _Block | None:
    """The block of packed documents (global cu_seqlens `docs`) between the query chunk at
    global rows [qa, qa + n) and the key chunk at [ka, ka + n), in chunk-local indices; None
    when no query of it sees a key. Documents are contiguous runs of the packed sequence, so
    off the diagonal at most one document (the one holding the later chunk's first position)
    reaches into both chunks, and that block is one dense call: its keys lie all before its
    queries or all after them, and the ring's band (causality, window: on positions within the
    document, the same as on global positions) over their global positions says which rows
    and keys of it take part (_pair_call). On the diagonal it is a varlen call over the
    chunk's documents, cut at the chunk's ends, with the ring's causality and window. Rows past
    the last document see nothing."""
    end = docs[-1]
    if qa == ka:
        last = min(end, qa + n)
        if last <= qa:
            return None
        cuts = sorted({x - qa for x in docs if qa < x < last})
        return _Block(0, last - qa, 0, last - qa, ring.is_causal, ring.window,
                      (0, *cuts, last - qa))  # fmt: skip
    later, earlier = max(qa, ka), min(qa, ka)
    if later >= end:
        return None
    i = bisect.bisect_right(docs, later) - 1
    start, stop = docs[i], docs[i + 1]
    if start >= earlier + n:  # the document begins after the earlier chunk ends
        return None
    # The earlier chunk's rows from the document's start, the later chunk's up to its end.
    e0, l1 = max(start, earlier) - earlier, min(stop, later + n) - later
    (q0, q1), (k0, k1) = ((0, l1), (e0, n)) if ka < qa else ((e0, n), (0, l1))
    call = _pair_call(ring.band(), (ka + k0) - (qa + q0), q1 - q0, k1 - k0)
    if call is None:
        return None
    (r0, r1), (c0, c1), causal, window = call
    return _Block(q0 + r0, q0 + r1, k0 + c0, k0 + c1, causal, window)


def _pair_call(band, offset: int, nq: int, nk: int | None = None):
    """How the op computes one block: nq queries at global positions p + i against nk (nq by
    default) keys at p + offset + j, the keys visible where key - query lies in band = (lo,
    hi). Returns the rows (q0, q1) and keys (k0, k1) that see anything, and the op's
    (is_causal, window_size) over those slices; None when nothing is visible.

    In local indices the band is j - i in [lo - offset, hi - offset]. The op aligns the slices'
    ends (bottom-right: j - i - (Lk - Lq) in [-left, right]), so cutting rows or keys off the
    end shifts its band: the slices end where the first invisible row and key begin, so the
    last row's last key lies in the band, and the window is what is left of the band around
    that shift (one side is then 0, or both are unbounded)."""
    nk = nq if nk is None else nk
    lo, hi = band[0] - offset, band[1] - offset
    if lo > nk - 1 or hi < -(nq - 1) or lo > hi:
        return None
    # j - i lies in [-(nq - 1), nk - 1]: a side beyond that bounds nothing.
    lo = -math.inf if lo <= -(nq - 1) else lo
    hi = math.inf if hi >= nk - 1 else hi
    q0, q1 = int(max(0, -hi)), int(min(nq, nk - lo))
    k0, k1 = int(max(0, lo)), int(min(nk, nq + hi))
    shift = k1 - q1  # the op's band is [shift - left, shift + right]
    left = -1 if lo == -math.inf else int(shift - lo)
    right = -1 if hi == math.inf else int(hi - shift)
    if (left, right) == (-1, 0) and q1 - q0 == k1 - k0:
        return (q0, q1), (k0, k1), True, NO_WINDOW  # a causal block, as the op knows it
    return (q0, q1), (k0, k1), False, (left, right)


def _cols(t, s: slice):
    return None if t is None else t[..., s]


def _keys(t, s: slice):
    """A per-key (1, H|Hkv|1, 1, n) mask or bias's columns s as the varlen ops take them."""
    return None if t is None else t[0, :, 0, s]


def _merge(out, m, lg, o, lse_o, rem_o) -> None:
    """Merge a partial (o, lse_o + rem_o) into the running (out, m + lg), all fp32 (float64 for
    float64), in place: out, m and lg are views of the rows' accumulators, and the update makes
    no copy of out's size (the ring's forward holds one (B, rows, H, Dv) accumulator, nothing
    more). The running lse is kept as two numbers: m, the largest block lse seen, and lg, the
    log of the sum relative to it. One rounded number would lose the log-sum next to a huge m:
    a row whose every key has a bias of finfo.min has lse = -3.4e38 + log n, which rounds to
    -3.4e38 in every block, and merging equal blocks must still halve each one's weight.
    Rows that have seen no key stay (0, -inf, 0)."""
    m_new = torch.maximum(m, lse_o)
    seen = m_new > float("-inf")
    m_safe = torch.where(seen, m_new, 0.0)
    # Both differences are exact where they matter (Sterbenz: operands within a factor 2).
    a = torch.where(seen, (m - m_safe) + lg, float("-inf"))
    b = torch.where(seen, (lse_o - m_safe) + rem_o, float("-inf"))
    lg_new = torch.logaddexp(a, b)
    w_old = torch.where(seen, torch.exp(a - lg_new), 0.0).transpose(1, 2)[..., None]
    w_new = torch.where(seen, torch.exp(b - lg_new), 0.0).transpose(1, 2)[..., None]
    out.mul_(w_old).addcmul_(o, w_new)
    m.copy_(m_new)
    lg.copy_(torch.where(seen, lg_new, 0.0))


def _ring_spec(
    group, layout: str, scale: float, is_causal: bool, softcap: float, deterministic: bool, window
) -> str:
    """The ring's options as the ops take them: one string (a compiled graph holds it as a
    constant), the group's name last since a name may hold any character. Floats as repr
    (exact round trip)."""
    return (f"{layout}|{float(scale)!r}|{int(is_causal)}|{float(softcap)!r}|"
            f"{int(deterministic)}|{window[0]}|{window[1]}|{_group_name(group)}")  # fmt: skip


def _ring_of(spec: str) -> _Ring:
    layout, scale, causal, softcap, deterministic, left, right, name = spec.split("|", 7)
    group = _group(name)
    world, rank = _world(group)
    return _Ring(group, world, rank, layout, float(scale), causal == "1", float(softcap),
                 deterministic == "1", (int(left), int(right)))  # fmt: skip


def _stats_dtype(query: torch.Tensor) -> torch.dtype:
    return torch.float64 if query.dtype == torch.float64 else torch.float32


@torch.library.custom_op("dmattn::ring_attention_forward", mutates_args=())
def _ring_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    bias: torch.Tensor | None,
    sinks: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    ring: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ring's forward on this rank: (out, lse, lse_rem) of its rows, after the checks every
    rank agrees on (module docstring: a graph runs this op whole, the ring inside it). ring:
    _ring_spec's string; cu_seqlens: packed documents over the global sequence, or None."""
    fn = "dmattn.distributed.ring_attention"
    ring = _ring_of(ring)
    docs = None
    try:
        _check_local(Problem(query, key, value, mask, bias), ring, fn)
        check_sinks(sinks, query, fn)
        docs = _check_docs(cu_seqlens, query, ring, fn)
        error = None
    except (TypeError, ValueError) as e:
        error = e
    agreed = _agreement(query, key, value, error, ring.group, fn, docs)
    if error is not None:
        agreed()  # raises, once every rank has heard of it
    rows = query.shape[1]
    stats = _stats_dtype(query)
    b, _, h, _ = query.shape
    out = torch.zeros((*query.shape[:3], value.shape[-1]), dtype=stats, device=query.device)
    top = torch.full((b, h, rows), float("-inf"), dtype=stats, device=query.device)
    log_sum = torch.zeros_like(top)
    last = ring.last_step(rows, docs)
    merged = []  # the row ranges some block has written
    for src, k, v, m, bb in ring.visits(key, value, mask, bias, last, ready=agreed):
        for block in ring.pairs(src, rows, docs):
            o, l_o, rem_o = block.forward(query, k, v, m, bb, ring)
            qs = block.qs
            if any(a < block.q1 and block.q0 < b for a, b in merged):
                _merge(out[:, qs], top[:, :, qs], log_sum[:, :, qs], o, l_o, rem_o.to(stats))
            else:  # the rows' first block: the merge into (0, -inf, 0) is the block itself
                out[:, qs] = o
                top[:, :, qs] = l_o
                log_sum[:, :, qs] = rem_o
            merged.append((block.q0, block.q1))
            del o  # the next block's call may reuse its memory
    # (lse, lse_rem) as the forward op hands them to the backward op; the sinks join once,
    # after every block (each row's softmax has one sink, not one per block).
    lse, lse_rem = lse_split(top, log_sum, top > float("-inf"))
    out, lse, lse_rem = join_sinks(out, lse, lse_rem, sinks)
    return out.to(query.dtype), lse, lse_rem


@_ring_forward.register_fake
def _(query, key, value, mask, bias, sinks, cu_seqlens, ring):
    b, rows, h, _ = query.shape
    stats = query.new_empty((b, h, rows), dtype=_stats_dtype(query))
    return query.new_empty((b, rows, h, value.shape[-1])), stats, torch.empty_like(stats)


@torch.library.custom_op("dmattn::ring_attention_backward", mutates_args=())
def _ring_backward(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    bias: torch.Tensor | None,
    sinks: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    out: torch.Tensor,
    lse: torch.Tensor,
    lse_rem: torch.Tensor,
    ring: str,
    need_dbias: bool,
    need_dsinks: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ring's backward on this rank: (dq, dk, dv, dbias, dsinks), the last two empty
    where not asked for. dK/dV/dbias travel with their keys and reach their owner after one
    more hop; dsinks is this rank's rows' share."""
    ring = _ring_of(ring)
    rows = query.shape[1]
    acc = _stats_dtype(query)
    dq = torch.zeros(query.shape, dtype=acc, device=query.device)
    dk = torch.zeros(key.shape, dtype=acc, device=key.device)
    dv = torch.zeros(value.shape, dtype=acc, device=value.device)
    db = torch.zeros(bias.shape, dtype=acc, device=bias.device) if need_dbias else None
    # Each block's call reads its rows of grad_out as they are. Where grad_out is expanded, the
    # op itself copies that call's slice (Problem's dense_rows rule); a copy of all the rows
    # made here would live through the whole ring.
    docs = None if cu_seqlens is None else cu_seqlens.tolist()
    last = ring.last_step(rows, docs)
    # The accumulators travel with the keys they belong to. The hop after step s is started
    # once the step's blocks are added and finished after the first block of step s + 1 has
    # computed (it overlaps that block's backward): its gradients are added then. After the
    # last step they sit `last` ranks after their owner (one before it when the ring went
    # round), and one more transfer brings them home.
    arriving = None
    for step, (src, k, v, m, bb) in enumerate(ring.visits(key, value, mask, bias, last)):
        # Per pair of chunks, not a zigzag step's one call: a backward call's transient memory
        # (its gradients and the dK/dV kernel's float32 scratch, tens of times a row's size)
        # grows with its rows, and the backward sets the ring's peak (measured: one call a
        # step took the largest rank's peak from 0.55x to 0.68x of one GPU's at L65536).
        for block in ring.pairs(src, rows, docs, whole=False):
            g = block.backward(grad_out, query, k, v, m, bb, out, lse, lse_rem, ring, need_dbias)
            qs, ks = block.qs, block.ks
            dq[:, qs] += g[0]
            if arriving is not None:
                dk, dv, db = arriving()
                arriving = None
            dk[:, ks] += g[1]
            dv[:, ks] += g[2]
            if need_dbias:
                db[..., ks] += g[3]
            del g  # freed before the next block's call: its memory is that call's to reuse
        if arriving is not None:  # no block of this rank at this step
            dk, dv, db = arriving()
        if last > 0:
            arriving = ring.exchange([dk, dv, db], 1 if step < last else -last)
    if arriving is not None:
        dk, dv, db = arriving()
    # With the joined out and lse, the blocks' backward is the sinks' softmax already.
    # Outputs may not alias each other: each absent gradient is its own empty tensor.
    dsinks = (
        sinks_grad(sinks, lse, lse_rem, row_delta(out, grad_out, None)).to(sinks.dtype)
        if need_dsinks
        else query.new_empty(0)
    )
    dbias = db.to(bias.dtype) if need_dbias else query.new_empty(0)
    return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype), dbias, dsinks


@_ring_backward.register_fake
def _(grad_out, query, key, value, mask, bias, sinks, cu_seqlens, out, lse, lse_rem, ring,
      need_dbias, need_dsinks):  # fmt: skip
    # Contiguous whatever the inputs' layouts, as the real kernel returns them (empty_like would
    # keep a transposed bias's strides, which Inductor then asserts against the real ones).
    return (
        query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape),
        bias.new_empty(bias.shape) if need_dbias else query.new_empty(0),
        sinks.new_empty(sinks.shape) if need_dsinks else query.new_empty(0),
    )  # fmt: skip


def _ring_setup(ctx, inputs, output):
    query, key, value, mask, bias, sinks, cu_seqlens, ctx.ring = inputs
    out, lse, lse_rem = output
    ctx.save_for_backward(query, key, value, mask, bias, sinks, cu_seqlens, out, lse, lse_rem)
    ctx.mark_non_differentiable(lse, lse_rem)


def _ring_grads(ctx, grad_out, _grad_lse, _grad_rem):
    query, key, value, mask, bias, sinks, cu_seqlens, out, lse, lse_rem = ctx.saved_tensors
    need_dbias = bias is not None and ctx.needs_input_grad[4]
    need_dsinks = sinks is not None and ctx.needs_input_grad[5]
    dq, dk, dv, dbias, dsinks = torch.ops.dmattn.ring_attention_backward(
        grad_out, query, key, value, mask, bias, sinks, cu_seqlens, out, lse, lse_rem,
        ctx.ring, need_dbias, need_dsinks,
    )  # fmt: skip
    return (dq, dk, dv, None, dbias if need_dbias else None, dsinks if need_dsinks else None,
            None, None)  # fmt: skip


_ring_forward.register_autograd(_ring_grads, setup_context=_ring_setup)


def _check_local(problem: Problem, ring: _Ring, fn: str) -> None:
    """This rank's shard of a ring call, checked as a call of its own, and what the ring needs
    besides: per-key masks and biases, as many query rows as key rows, whole layout chunks."""
    check_flags(fn, is_causal=ring.is_causal, deterministic=ring.deterministic)
    check_inputs(problem, ring.scale, ring.softcap, fn)
    query, key, layout = problem.query, problem.key, ring.layout
    for name, t in (("mask", problem.mask), ("bias", problem.bias)):
        if t is not None and t.shape[2] != 1:
            raise ValueError(
                f"{fn}: {name} must be per key, (B|1, H|Hkv|1, 1, L/R), shared by all queries "
                f"(the DMA pattern); got {tuple(t.shape)}: masks or biases that vary per query "
                "are not supported across ranks"
            )
    if query.shape[1] != key.shape[1]:
        raise ValueError(
            f"{fn}: each rank holds the same rows of queries and keys; got {query.shape[1]} "
            f"query rows and {key.shape[1]} key rows"
        )
    if query.shape[1] % len(_chunk_ids(layout, ring.rank, ring.world)):
        raise ValueError(f"{fn}: the {layout} layout needs an even number of rows per rank")


def _check_docs(cu_seqlens, query, ring, fn) -> list[int] | None:
    """cu_seqlens as a list, checked: packed documents of the global sequence, int32 or int64,
    (N+1,), from 0, non-decreasing, ending at or before the global length (rows past the last
    document attend to nothing), one batch row."""
    if cu_seqlens is None:
        return None
    if cu_seqlens.dim() != 1 or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"{fn}: cu_seqlens must be a 1-D int32 (or int64) tensor; got "
            f"{tuple(cu_seqlens.shape)} {cu_seqlens.dtype}"
        )
    if query.shape[0] != 1:
        raise ValueError(f"{fn}: with cu_seqlens the documents are packed in one batch row; got "
                         f"B = {query.shape[0]}")  # fmt: skip
    docs = cu_seqlens.tolist()
    length = query.shape[1] * ring.world
    if (
        not docs
        or docs[0] != 0
        or any(b < a for a, b in itertools.pairwise(docs))
        or docs[-1] > length
    ):
        raise ValueError(
            f"{fn}: cu_seqlens must start at 0, never decrease and end at most at the global "
            f"length {length}; got {docs}"
        )
    return docs


_HOST_GROUPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _host_group(group):
    """A group over the same ranks whose collectives run on the host (gloo), for the shape
    agreement: the group itself where its backend already takes CPU tensors, else a gloo group
    made at the first call (every member is in that call), None where gloo is not available.
    On NCCL the agreement's all-gather would otherwise be a device collective read back by the
    host: a synchronisation that drained the GPU's queue at every ring call, every layer's in a
    model, leaving the GPU idle while the host issued the layer's first blocks."""
    group = dist.group.WORLD if group is None else group
    if group not in _HOST_GROUPS:
        host = None
        if "gloo" in str(dist.get_backend(group)):
            host = group
        elif dist.is_gloo_available():
            ranks = dist.get_process_group_ranks(group)
            host = dist.new_group(ranks, backend="gloo", use_local_synchronization=True)
        _HOST_GROUPS[group] = host
    return _HOST_GROUPS[group]


def _agreement(query, key, value, error, group, fn, docs=None):
    """One small all-gather of every rank's shapes and verdict, so that a call some rank
    refuses (or whose ranks hold different lengths or documents) raises on every rank instead
    of leaving the others waiting in the ring's first exchange. Started here; the returned
    function waits for it and raises (this rank's `error` first). On a host group the gather
    runs while the caller issues its own block (Ring.visits' ready): its round trip, ~1 ms
    between two processes, is then no longer GPU idle time at the ring's start. docs: the
    cu_seqlens list, of which the ranks compare the length and two checksums."""
    docs = docs or []
    sums = [len(docs), sum(docs), sum(i * x for i, x in enumerate(docs))]
    mine = [int(error is not None), *query.shape, *key.shape, *value.shape[-1:], *sums]
    world, _ = _world(group)
    host = _host_group(group)
    device = query.device if host is None and query.device.type != "meta" else torch.device("cpu")
    local = torch.tensor(mine if len(mine) == 13 else [1] + [0] * 12, device=device)
    gathered = [torch.empty_like(local) for _ in range(world)]
    work = dist.all_gather(gathered, local, group=group if host is None else host, async_op=True)
    return functools.partial(_agreed, work, gathered, error, fn)


def _agreed(work, gathered, error, fn) -> None:
    """_agreement's wait and verdict."""
    work.wait()
    every = [t.tolist() for t in gathered]
    if error is not None:
        raise error
    refused = [r for r, t in enumerate(every) if t[0]]
    if refused:
        raise ValueError(f"{fn}: rank(s) {refused} refused their inputs (their error says why)")
    if any(t[10:] != every[0][10:] for t in every):
        raise ValueError(f"{fn}: every rank must pass the same cu_seqlens (the global documents)")
    if any(t != every[0] for t in every):
        shapes = "; ".join(
            f"rank {r}: query {tuple(t[1:5])}, key {tuple(t[5:9])}" for r, t in enumerate(every)
        )
        raise ValueError(
            f"{fn}: every rank must hold the same shapes (L/R rows each, as `shard` cuts them); "
            f"got {shapes}"
        )


def ring_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    *,
    group=None,
    scale: float | None = None,
    is_causal: bool = False,
    softcap: float = 0.0,
    deterministic: bool = False,
    layout: str = "zigzag",
    window_size: tuple[int, int] = (-1, -1),
    sinks: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """`dmattn_ops.attention` over a sequence sharded across the ranks of `group`; returns this
    rank's output rows (B, L/R, H, Dv).

    query (B, L/R, H, D), key/value (B, L/R, Hkv, D|Dv): this rank's rows (`shard` with the same
    layout), every rank the same length. mask and bias: per key, shared by all queries,
    (B|1, H|Hkv|1, 1, L/R), sharded along their last dim like the keys. Causal masking is on
    global positions (query and key sequences of the same length), and so is window_size
    (left, right), as attention's: a query at position i sees keys i - left .. i + right (-1:
    unbounded). A (query chunk, key chunk) block that no query of it sees is not computed, and
    of the others only the rows and keys that see something. sinks (H,), as attention's: one
    more logit per head in every row's softmax, joined once after the ring. Differentiable in
    query, key, value, bias and sinks; bias's gradient comes back for this rank's columns,
    sinks' as this rank's rows' share (sum it over the ranks, as for any parameter every rank
    holds).

    cu_seqlens: packed documents, int32 (N+1,) over the global sequence (the same on every
    rank, from 0, ending at most at L; documents may straddle ranks): the result is then
    `dmattn_ops.attention_varlen` over the whole packed sequence (each document its own
    sequence, causal within it with is_causal; rows past cu_seqlens[-1] get zeros). B must be
    1; query, key and value may also come packed as attention_varlen's, (L/R, H|Hkv, D) with
    mask and bias (H|Hkv|1, L/R), and the output is then (L/R, H, Dv). Off the diagonal a block
    holds at most one document and is one dense call; a chunk's own block is one varlen call.
    window_size and sinks apply within each document, as attention_varlen's.

    group: a process group, its name (``group.group_name``), or None for the default group.
    The ring runs inside one op (``dmattn::ring_attention_forward`` and its backward), so a
    compiled model keeps it as one node of a full graph; there, pass the group by name (as
    ``parallelize`` does): Dynamo does not read a process group's attributes.
    """
    fn = "dmattn.distributed.ring_attention"
    check_flags(fn, is_causal=is_causal, deterministic=deterministic)
    _chunk_ids(layout, 0, 1)  # checks the layout's name
    window = check_window(window_size, fn)
    scale = default_scale(query) if scale is None else scale
    ring = _ring_spec(group, layout, scale, is_causal, softcap, deterministic, window)
    packed = cu_seqlens is not None and query.dim() == 3
    if packed:  # attention_varlen's layout: one batch row, per-key operands (H|Hkv|1, L/R)
        query, key, value = query[None], key[None], value[None]
        mask, bias = (None if t is None else t[None, :, None] for t in (mask, bias))
    out, _, _ = torch.ops.dmattn.ring_attention_forward(
        query, key, value, mask, bias, sinks, cu_seqlens, ring
    )
    return out[0] if packed else out


def topk_mask(
    bias: torch.Tensor,
    window: int,
    mask: torch.Tensor | None = None,
    *,
    group=None,
    layout: str = "zigzag",
) -> torch.Tensor:
    """`dmattn_ops.masks.topk_mask` over the whole sequence, for this rank's key columns.

    bias (B|1, H|Hkv|1, 1, L/R) and the optional bool mask (the same, broadcastable, or a (B,
    L/R) padding mask) hold this rank's columns (`shard` along the last dim, as for
    `ring_attention`); returns this rank's columns of `topk_mask(unshard(bias), window,
    unshard(mask))`: the `window` largest biases of each (batch, head) row over all R * L/R
    keys. The ranking is topk_mask's (numbers by value, then NaN, disallowed keys never), and
    ties at the window-th value go to the lowest global key indices, as topk_mask's fused
    kernel breaks them (where torch.topk selects, on one rank, it breaks ties as it pleases).

    Two all-gathers, O(window) per row and rank: every rank's `window` best values (the
    global window-th value is among them), then per row the count above that value and the
    count equal to it in each of the rank's chunks (the ties to keep are the first ones in
    global key order). No rank holds a whole row. group: as ring_attention's (an op takes it
    by name, so compiled models keep this call in a full graph).
    """
    fn = "dmattn.distributed.topk_mask"
    allowed = _allowed(bias, mask, "topk_mask")
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ValueError(f"{fn}: window must be an int >= 0; got {window!r}")
    if bias.shape[2] != 1 or (allowed is not None and allowed.shape[2] != 1):
        raise ValueError(
            f"{fn}: bias and mask must be per key, (B|1, H|Hkv|1, 1, L/R); got bias "
            f"{tuple(bias.shape)}" + ("" if mask is None else f" and mask {tuple(mask.shape)}")
        )
    if bias.shape[-1] % len(_chunk_ids(layout, 0, 1)):
        raise ValueError(f"{fn}: the {layout} layout needs an even number of columns per rank")
    return torch.ops.dmattn.cp_topk_select(
        bias.detach(), allowed, window, _group_name(group), layout
    )


@torch.library.custom_op("dmattn::cp_topk_select", mutates_args=())
def _cp_topk_select(
    bias: torch.Tensor, allowed: torch.Tensor | None, window: int, group_name: str, layout: str
) -> torch.Tensor:
    """topk_mask's selection across the ranks of the group (two all-gathers), one op: a
    compiled model keeps it as one node of a full graph."""
    group = _group(group_name)
    world, rank = _world(group)
    ids = _chunk_ids(layout, rank, world)
    score = bias
    if allowed is not None:
        shape = torch.broadcast_shapes(score.shape, allowed.shape)
        score, allowed = score.expand(shape), allowed.expand(shape)
    n = score.shape[-1]
    k = min(window, n * world)
    if k == 0:
        return torch.zeros(score.shape, dtype=torch.bool, device=score.device)
    key = rank_key(score, allowed)  # [..., n]: larger is better
    # 1. The global k-th best value: the k best of the whole row are among the ranks' k best.
    floor = torch.iinfo(key.dtype).min
    best = key.topk(min(k, n), dim=-1).values
    best = torch.nn.functional.pad(best, (0, k - best.shape[-1]), value=floor)
    gathered = [torch.empty_like(best) for _ in range(world)]
    dist.all_gather(gathered, best.contiguous(), group=group)
    kth = torch.cat(gathered, dim=-1).topk(k, dim=-1).values[..., -1:]  # [..., 1]
    # 2. Counts above it, and ties per chunk of this rank, from every rank.
    above, tied = key > kth, key == kth
    chunk = n // len(ids)
    tied_chunks = tied.unflatten(-1, (len(ids), chunk))  # [..., chunks, chunk]
    counts = torch.cat([above.sum(-1, keepdim=True), tied_chunks.sum(-1)], dim=-1)
    gathered = [torch.empty_like(counts) for _ in range(world)]
    dist.all_gather(gathered, counts.contiguous(), group=group)
    above_all = sum(c[..., :1] for c in gathered)  # [..., 1]
    ties_by_chunk = [None] * (len(ids) * world)  # in global chunk order
    for r, c in enumerate(gathered):
        for slot, cid in enumerate(_chunk_ids(layout, r, world)):
            ties_by_chunk[cid] = c[..., 1 + slot]
    ties = torch.stack(ties_by_chunk, dim=-1)  # [..., chunks]
    before = ties.cumsum(-1) - ties  # ties in the chunks before each chunk
    # 3. A tie is kept when fewer than (k - above_all) ties precede it in global key order.
    order = torch.cumsum(tied_chunks.to(torch.int64), dim=-1) - 1
    order = order + before[..., list(ids)].unsqueeze(-1)
    keep_tie = tied_chunks & (order < (k - above_all).unsqueeze(-1))
    selected = above | keep_tie.flatten(-2)
    selected = selected & allowed if allowed is not None else selected
    # Contiguous, as the fake kernel says: the elementwise ops above follow the bias's layout
    # (a transposed one in the DMA layer), and Inductor asserts the fake's strides at run time.
    return selected.contiguous()


@_cp_topk_select.register_fake
def _(bias, allowed, window, group_name, layout):
    shape = bias.shape if allowed is None else torch.broadcast_shapes(bias.shape, allowed.shape)
    return bias.new_empty(shape, dtype=torch.bool)


@dataclass(frozen=True)
class ContextParallel:
    """How a DynamicMaskAttention layer shards its sequence (set by `parallelize`): the
    process group and the layout of its rows across the group's ranks."""

    group: object = None
    layout: str = "zigzag"
    # The group's name, what the layer passes to the ops (a compiled graph reads a string).
    group_name: str = ""


def parallelize(
    model: torch.nn.Module, group=None, *, layout: str | None = "zigzag"
) -> torch.nn.Module:
    """Puts every `dmattn_ops.nn.DynamicMaskAttention` of `model` (every module with a
    `context_parallel` attribute) in context-parallel mode and returns the model: each rank
    then feeds the model its rows of the sequence (`shard(x, 1, group, layout=layout)`), each
    layer selects its keys over the whole sequence (`topk_mask` above: the same keys as on one
    rank, ties aside) and attends through `ring_attention`. Layers that mix tokens otherwise
    (convolutions, position embeddings computed from local indices) are not adapted: the model
    must be token-wise outside its attention. `parallelize(model, layout=None)` undoes it."""
    if layout is not None:
        _chunk_ids(layout, 0, 1)  # checks the layout's name
    mode = None if layout is None else ContextParallel(group, layout, _group_name(group))
    for module in model.modules():
        if hasattr(module, "context_parallel"):
            module.context_parallel = mode
    return model


# A compiled graph holding these ops keeps their fake kernels' strides in Inductor's asserts:
# its cached form must miss when the package changes, as for the attention ops.
inductor.key_compiled_graphs_on_fingerprint()
