"""Sizes and device facts every launcher and the planner share: one home each."""

from __future__ import annotations

import torch


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The least power of two >= n (1 for n <= 1). A symbolic size (a SymInt while a graph is
    traced with dynamic shapes) is compared with powers of two instead, so that the trace
    guards on the bucket (256 < n <= 512) rather than on n's value, which would compile the
    graph again for every length."""
    if isinstance(n, int):
        return 1 if n <= 1 else 1 << (n - 1).bit_length()
    p = 1
    while n > p:
        p *= 2
    return p


def head_block(dim: int) -> int:
    """Block of a head dim (or of any dim a kernel holds whole): the next power of two, at
    least 16 (tl.dot's smallest)."""
    return max(16, next_power_of_2(dim))


_SMS: dict[int, int] = {}


def sm_count(device: torch.device) -> int:
    """Multiprocessors of a CUDA device (read once per device); 4 elsewhere (the interpreter's
    grids are sized as for a small GPU)."""
    if device.type != "cuda":
        return 4
    index = device.index if device.index is not None else torch.cuda.current_device()
    found = _SMS.get(index)
    if found is None:
        found = _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return found
