"""Sizes and device facts every launcher and the planner share: one home each."""

from __future__ import annotations

import torch


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


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
