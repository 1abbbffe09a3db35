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


def symbolic(n) -> bool:
    """Whether n is a symbolic size (a SymInt with no fixed value: a graph traced with dynamic
    shapes)."""
    return isinstance(n, torch.SymInt) and n.node.maybe_as_int() is None


def hint(n) -> int:
    """n, or for a symbolic size the value it has in the example the graph is traced with,
    read without guarding on it: for choices that only change speed (tile configurations,
    splits, packing), made once for the example and valid at every size, so that a graph
    with symbolic sizes is not compiled again when a size crosses one of their thresholds.
    Choices a result depends on compare n itself (and guard)."""
    if not isinstance(n, torch.SymInt):
        return n
    fixed = n.node.maybe_as_int()
    if fixed is not None:
        return fixed
    found = n.node.hint
    if found is None:  # an unbacked size (data-dependent): no example value to read
        raise ValueError(f"no example value for the symbolic size {n}")
    return int(found)


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
