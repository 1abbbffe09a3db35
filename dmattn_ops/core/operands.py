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


# HAS_MASK / HAS_BIAS of a launch (kernels/common.py PER_KEY, PER_ENTRY): 0 without the operand,
# PER_KEY when its query stride is 0 (the launchers pass 0 on broadcast dims), else PER_ENTRY.
PER_KEY, PER_ENTRY = 1, 2


def operand_kind(t: torch.Tensor | None) -> int:
    """The HAS_MASK / HAS_BIAS value of a launch with operand t (see above)."""
    if t is None:
        return 0
    return PER_ENTRY if operand_strides(t)[2] != 0 else PER_KEY


def compactable(mask: torch.Tensor | None, h: int, hkv: int) -> bool:
    """Masks that allow the same keys for every query, with one key list per KV group."""
    return mask is not None and mask.shape[2] == 1 and (mask.shape[1] != h or h == hkv)


def batch_strides(t: torch.Tensor) -> tuple[int, ...]:
    """t's strides with 0 for a batch dim of 1 (varlen passes its packed tensors as (1, ...))."""
    return (0 if t.shape[0] == 1 else t.stride(0), *t.stride()[1:])
