"""Which keys a query may see by position: causality and the sliding window as one Band."""

from __future__ import annotations

from typing import NamedTuple

# A window side left unbounded (-1) reaches the kernels as this many keys: past any length
# they take (int32 positions), and small enough that position +- it stays inside int32.
UNBOUNDED = 1 << 29


def fold_causal(is_causal: bool, window: tuple[int, int]) -> tuple[int, int]:
    """(left, right) of a window (-1: unbounded) with causality folded into its right side: a
    causal query sees no key after it, so right is at most 0."""
    left, right = window
    if is_causal:
        right = 0 if right < 0 else min(right, 0)
    return left, right


class Band(NamedTuple):
    """How a launch restricts keys by position: (IS_CAUSAL, HAS_WINDOW, win_left, win_right).
    A window (kernels/common.py score_tile) takes causality into its right side, so at most
    one of the two flags is set, and calls without a window launch exactly as before."""

    is_causal: bool
    has_window: bool
    left: int
    right: int

    @staticmethod
    def of(is_causal: bool, window: tuple[int, int]) -> Band:
        left, right = window
        if left < 0 and (right < 0 or is_causal):
            # No lower bound, and no upper bound beyond causality's: the plain launch (dense
            # causal calls keep PyTorch's fused kernels, sdpa.py).
            return Band(bool(is_causal), False, 0, 0)
        left, right = fold_causal(is_causal, window)
        return Band(False, True, UNBOUNDED if left < 0 else left, UNBOUNDED if right < 0 else right)

    def args(self) -> tuple[int, int]:
        """win_left, win_right."""
        return self.left, self.right

    def flags(self) -> dict:
        return dict(IS_CAUSAL=self.is_causal, HAS_WINDOW=self.has_window)

    def width(self) -> int | None:
        """Keys a query may see at most (left + right + 1) when both sides are bounded."""
        if not self.has_window or UNBOUNDED in (self.left, self.right):
            return None
        return self.left + self.right + 1
