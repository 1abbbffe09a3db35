"""GPU kernel timelines of a profiled step, as (start, end, name) spans (us): where the GPU ran
nothing. Shared by bench.model's trace and bench.cp's --overlap."""

from __future__ import annotations


def idle_gaps(spans, top: int | None = None) -> list[tuple[float, float, str, str]]:
    """The stretches in which the GPU ran nothing, over (start, end, name) kernel spans (us;
    overlapping, in any order): (gap, its start after the first kernel began, the kernel
    before it, the kernel that ended it), the longest first, the `top` longest where given.
    Named so, a gap says which launch the host was late with (after a synchronisation, or a
    slow stretch of Python)."""
    gaps, end, last, first = [], None, None, None
    for start, stop, name in sorted(spans):
        first = start if first is None else first
        if end is not None and start > end:
            gaps.append((start - end, end - first, last, name))
        if end is None or stop >= end:
            end, last = stop, name
    gaps.sort(key=lambda g: -g[0])
    return gaps if top is None else gaps[:top]
