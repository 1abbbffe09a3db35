"""Output allocation for the library's kernels.

Under test (conftest sets POISON), freshly allocated floating outputs are filled with NaN, so an
element that a kernel forgets to write fails loudly instead of passing as zero.

`empties` carves several buffers of one dtype out of one allocation: each `torch.empty` on
CUDA costs host time (the caching allocator's lookup and a tensor's construction, about 5 us
of a call's host time on an H200's host), and a key-list call made 18 of them a
forward+backward.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from dmattn_ops.core.switches import switch
from dmattn_ops.executors._triton import tracing_on

POISON = switch("DMATTN_POISON_EMPTY", False)

# Each buffer `empties` carves starts at a multiple of this many bytes, as a buffer of its own
# would (the caching allocator's blocks are 512-byte aligned; Triton specialises pointers on
# 16-byte alignment, and vector loads want more).
ALIGN_BYTES = 128


def empty(shape, dtype: torch.dtype, *, device) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype, device=device)
    if POISON and t.is_floating_point():
        t.fill_(float("nan"))
    return t


class Carving(NamedTuple):
    """How `empties` carves its buffers, made once per list of specs (`carve`): per dtype, the
    one allocation's length and each buffer's (index, shape, strides, offset) in it."""

    specs: tuple
    pools: tuple  # ((dtype, total, ((index, shape, strides, offset), ...)), ...)


def carve(specs) -> Carving:
    """The Carving of these (shape, dtype) pairs (None for None): the buffers of one dtype
    contiguous in one allocation, each starting ALIGN_BYTES-aligned."""
    specs = tuple(specs)
    pools = []
    for dtype in dict.fromkeys(spec[1] for spec in specs if spec is not None):
        step = max(1, ALIGN_BYTES // dtype.itemsize)
        total, views = 0, []
        for i, spec in enumerate(specs):
            if spec is None or spec[1] != dtype:
                continue
            shape = tuple(spec[0])
            views.append((i, shape, contiguous_strides(shape), total))
            total += -(-math.prod(shape) // step) * step
        pools.append((dtype, max(total, 1), tuple(views)))
    return Carving(specs, tuple(pools))


def contiguous_strides(shape: tuple) -> tuple:
    """The strides torch.empty(shape) has (a size-0 dim counts as 1)."""
    strides, n = [], 1
    for size in reversed(shape):
        strides.append(n)
        n *= max(size, 1)
    return tuple(reversed(strides))


def empties(specs, *, device) -> list[torch.Tensor | None]:
    """Contiguous buffers for these (shape, dtype) pairs (None for None), or for a Carving of
    them (`carve`, made once where the specs repeat), the buffers of one dtype views of one
    allocation, each starting ALIGN_BYTES-aligned. Buffers of one storage are for scratch and
    for buffers that live and die together, never for an op's separate outputs (which must
    not alias)."""
    carving = specs if isinstance(specs, Carving) else carve(specs)
    if tracing_on():
        # Traced into a compiled graph, Inductor allocates the buffers (no host cost to save),
        # and views of one base, mutated by user kernels, are functionalized as one tensor:
        # a Hopper key-list call compiled that way read out of bounds on the H200.
        return [None if spec is None else empty(*spec, device=device) for spec in carving.specs]
    out: list[torch.Tensor | None] = [None] * len(carving.specs)
    for dtype, total, views in carving.pools:
        flat = empty((total,), dtype=dtype, device=device)
        for i, shape, strides, offset in views:
            out[i] = flat.as_strided(shape, strides, offset)
    return out
