"""What the GPU ran, from the profiler: each kernel's device time per call (kernel_times: bench,
bench.profile, bench.tune, bench.glue, bench.window), and the stretches where it ran nothing in a
timeline of (start, end, name) spans (idle_gaps: bench.model's trace, bench.cp's --overlap)."""

from __future__ import annotations

from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

REPEAT = 10


def kernel_times(fn) -> list[tuple[str, float, int]]:
    """(kernel name, device ms per call, launches per call), largest first."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(REPEAT):
            fn()
        torch.cuda.synchronize()
    total: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            total[event.name] += event.device_time
            count[event.name] += 1
    rows = [(name, us / 1000 / REPEAT, count[name] // REPEAT) for name, us in total.items()]
    return sorted(rows, key=lambda r: -r[1])


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
