"""Output allocation for the library's kernels.

Under test (conftest sets POISON), freshly allocated floating outputs are filled with NaN, so an
element that a kernel forgets to write fails loudly instead of passing as zero.
"""

from __future__ import annotations

import torch

from dmattn_ops.core.switches import switch

POISON = switch("DMATTN_POISON_EMPTY", False)


def empty(shape, *, dtype: torch.dtype, device) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype, device=device)
    if POISON and t.is_floating_point():
        t.fill_(float("nan"))
    return t
