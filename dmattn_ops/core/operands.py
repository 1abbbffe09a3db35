"""How the kernels read a mask or bias operand: its broadcast strides, which head it serves, and
whether it varies per query (PER_ENTRY) or only per key (PER_KEY); K/V strides with a batch of 1
broadcast."""

from __future__ import annotations

import torch


def operand_strides(t: torch.Tensor | None) -> tuple[int, int, int, int]:
    """Strides of a (B|1, H|Hkv|1, Lq|1, Lk) operand with 0 on its broadcast dims."""
    if t is None:
        return (0, 0, 0, 0)
    return tuple(0 if size == 1 else stride for size, stride in zip(t.shape, t.stride()))


def head_div(t: torch.Tensor | None, h: int, hkv: int) -> int:
    """Query head h reads head h // div of the operand."""
    if t is None or t.shape[1] == h:
        return 1
    return h // hkv if t.shape[1] == hkv else h


# HAS_MASK / HAS_BIAS of a launch (kernels/common.py PER_KEY, PER_ENTRY, LIMIT): 0 without the
# operand, LIMIT for a row-limit mask, PER_KEY when its query stride is 0 (the launchers pass 0
# on broadcast dims), else PER_ENTRY.
PER_KEY, PER_ENTRY, LIMIT = 1, 2, 3


def operand_kind(t: torch.Tensor | None) -> int:
    """The HAS_MASK / HAS_BIAS value of a launch with operand t (see above)."""
    if t is None:
        return 0
    if is_limit(t):
        return LIMIT
    return PER_ENTRY if operand_strides(t)[2] != 0 else PER_KEY


def is_limit(mask: torch.Tensor | None) -> bool:
    """Whether `mask` is a row-limit mask: int32, (B|1, H|Hkv|1, 1, Lk), key j visible to the
    query rows i < mask[..., j] (README "Row-limit masks")."""
    return mask is not None and mask.dtype == torch.int32


def mask_rows(mask: torch.Tensor, q0: int, q1: int) -> torch.Tensor:
    """Rows q0:q1 of a mask as booleans: a bool mask's own rows (all of them where its query
    dim is 1: they broadcast), or a row-limit mask's test `row < limit` for those rows."""
    if is_limit(mask):
        rows = torch.arange(q0, q1, device=mask.device, dtype=torch.int32)
        return rows.view(*(1,) * (mask.dim() - 2), -1, 1) < mask
    return mask if mask.shape[-2] == 1 else mask[..., q0:q1, :]


def keys_seen(mask: torch.Tensor) -> torch.Tensor:
    """A mask with a query dim of 1 as (B|1, Hm, Lk) booleans: the keys some row may see (a
    row-limit mask's keys of limit > 0; causality or seqused_k may hide some of them still)."""
    return mask[:, :, 0] > 0 if is_limit(mask) else mask[:, :, 0]


def compactable(mask: torch.Tensor | None, h: int, hkv: int) -> bool:
    """Masks that allow the same keys for every query, with one key list per KV group."""
    return mask is not None and mask.shape[2] == 1 and (mask.shape[1] != h or h == hkv)


def batch_strides(t: torch.Tensor) -> tuple[int, ...]:
    """t's strides with 0 for a batch dim of 1 (varlen passes its packed tensors as (1, ...))."""
    return (0 if t.shape[0] == 1 else t.stride(0), *t.stride()[1:])
