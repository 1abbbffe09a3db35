"""One attention call as two values: the `Problem` (its tensors and their sequence layout) and
its `Options` (everything else that decides the result or the path).

The op schemas (ops.py) stay flat, as torch.library needs; right under them each call becomes
these two values once, and the planner (plan.py) and the launchers read them. Dense, `seqused_k`
and packed (`cu_seqlens`) sequences are layouts of one problem, as FlashAttention's
``SeqlenInfo`` folds them into one object.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dmattn_ops.core.band import Band
from dmattn_ops.core.device import symbolic
from dmattn_ops.core.operands import is_limit

DENSE, SEQUSED, VARLEN = "dense", "seqused_k", "cu_seqlens"


def dense_index(t: torch.Tensor | None) -> torch.Tensor | None:
    """A small index or statistics tensor the kernels read as dense rows (seqused_k + b,
    cu_seqlens + b, lse + row): any other layout, a vmap-folded one with batch stride 0
    included, is copied first."""
    return None if t is None else t.contiguous()


def dense_rows(t: torch.Tensor) -> torch.Tensor:
    """An upstream gradient (B, Lq, H, Dv) as the kernels read it at full speed: unit stride on
    the last dim and no expanded dim, else copied once. `out.sum().backward()` hands the backward
    a gradient with every stride 0; Triton then cannot vectorise its loads, and a DMA
    forward+backward at B1 H16 L65536 (top L/4, H200) took 62.9 ms against 43.7 with the same
    values contiguous (PyTorch's fused backwards copy such a gradient too)."""
    if t.stride(-1) == 1 and all(s > 0 or n == 1 for s, n in zip(t.stride(), t.shape)):
        return t
    return t.contiguous()


def collapse_broadcast(t: torch.Tensor | None) -> torch.Tensor | None:
    """A (B, H, Lq, Lk) operand whose batch, head or query dim is an expanded view (stride 0,
    as `mask.expand(B, H, Lq, Lk)` gives) as the same view with that dim of size 1: the data
    is the same, and a mask shared by all queries then takes the key-list path instead of tile
    tables. Only for operands that get no gradient (a gradient must keep the caller's shape)."""
    if t is None or all(t.stride(i) != 0 or t.shape[i] == 1 for i in range(3)):
        return t
    index = tuple(slice(0, 1) if t.stride(i) == 0 else slice(None) for i in range(3))
    return t[index]


@dataclass(frozen=True, eq=False)
class Problem:
    """The tensors of one call.

    Dense and seqused_k layouts: query (B, Lq, H, D), key (B, Lk, Hkv, D), value (B, Lk, Hkv,
    Dv); mask and bias (B|1, H|Hkv|1, Lq|1, Lk); seqused_k int32 (B,) or None.
    cu_seqlens layout: query (total_q, H, D), key/value (total_k, Hkv, D|Dv), cu_seqlens_q/_k
    int32 (B + 1,), max_seqlen_q/_k the longest sequences; mask and bias per key token
    (H|Hkv|1, total_k). sinks (H,) or None in either layout.
    """

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    mask: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    sinks: torch.Tensor | None = None
    seqused_k: torch.Tensor | None = None
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0

    @property
    def layout(self) -> str:
        if self.cu_seqlens_q is not None:
            return VARLEN
        return DENSE if self.seqused_k is None else SEQUSED

    @property
    def varlen(self) -> bool:
        return self.cu_seqlens_q is not None

    @property
    def batch(self) -> int:
        return self.cu_seqlens_q.shape[0] - 1 if self.varlen else self.query.shape[0]

    @property
    def lq(self) -> int:
        """Query rows per sequence (varlen: the total)."""
        return self.query.shape[-3]

    @property
    def lk(self) -> int:
        return self.key.shape[-3]

    @property
    def symbolic(self) -> bool:
        """Whether Lq or Lk is symbolic (a compiled graph with dynamic shapes): the planner then
        leaves out the paths that would guard on them (registration/inductor.py)."""
        return symbolic(self.lq) or symbolic(self.lk)

    @property
    def heads(self) -> int:
        return self.query.shape[-2]

    @property
    def kv_heads(self) -> int:
        return self.key.shape[-2]

    @property
    def groups(self) -> int:
        return self.heads // self.kv_heads

    @property
    def head_dim(self) -> int:
        return self.query.shape[-1]

    @property
    def value_dim(self) -> int:
        return self.value.shape[-1]

    @property
    def empty(self) -> bool:
        """No query row or no key: the results are zeros (lse -inf, or the sinks)."""
        if self.varlen:
            return (
                self.batch <= 0 or self.lq * self.heads == 0 or self.lk == 0
                or self.max_seqlen_q <= 0 or self.max_seqlen_k <= 0
            )  # fmt: skip
        return self.query.shape[0] * self.lq * self.heads == 0 or self.lk == 0

    def collapsed(self, grad_bias: bool = False) -> Problem:
        """The problem as the kernels take it: broadcast dims of mask (and of bias, unless its
        gradient keeps the caller's shape) collapsed, a row-limit mask of one query row as
        the bool mask it is, index tensors dense. The problem itself
        where nothing changes (the common case: no expanded views)."""
        varlen = self.varlen
        mask = self.mask if varlen else collapse_broadcast(self.mask)
        if is_limit(mask) and self.lq == 1:
            mask = mask > 0  # one query row: the keys of limit > 0 (decode takes a bool mask)
        bias = self.bias if grad_bias or varlen else collapse_broadcast(self.bias)
        seqused_k, sinks = dense_index(self.seqused_k), dense_index(self.sinks)
        cu_q, cu_k = dense_index(self.cu_seqlens_q), dense_index(self.cu_seqlens_k)
        if (
            mask is self.mask and bias is self.bias and seqused_k is self.seqused_k
            and sinks is self.sinks and cu_q is self.cu_seqlens_q and cu_k is self.cu_seqlens_k
        ):  # fmt: skip
            return self
        return Problem(
            self.query, self.key, self.value, mask, bias, sinks, seqused_k, cu_q, cu_k,
            self.max_seqlen_q, self.max_seqlen_k,
        )  # fmt: skip

    def signature(self) -> tuple | None:
        """What the planner may read of the tensors (sizes, strides, storage offsets, dtypes,
        devices), as a hashable key; None when a size is symbolic (torch.SymInt does not hash:
        such calls are planned each time)."""
        key = tuple(
            None if t is None else (t.shape, t.stride(), t.storage_offset(), t.dtype, t.device)
            for t in (
                self.query, self.key, self.value, self.mask, self.bias, self.sinks,
                self.seqused_k, self.cu_seqlens_q,
            )
        ) + (self.max_seqlen_q, self.max_seqlen_k)  # fmt: skip
        try:
            hash(key)
        except TypeError:
            return None
        return key


@dataclass(frozen=True)
class Options:
    """The non-tensor arguments of a call: the scale, causality and window (as `band`), the
    softcap, determinism, and the encoded kernel options (options.py)."""

    scale: float
    is_causal: bool = False
    softcap: float = 0.0
    deterministic: bool = False
    window: tuple[int, int] = (-1, -1)
    kernel: str | None = None

    @property
    def band(self) -> Band:
        return Band.of(self.is_causal, self.window)
