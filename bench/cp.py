"""Context-parallel benchmark: ``python -m bench.cp [--world 2] [--lengths 32768,65536,131072]``.

Spawns `--world` processes (NCCL on GPUs, one GPU each; gloo on CPU for a smoke run) and times
one forward+backward of `dmattn_ops.distributed.ring_attention` on B1 H16 Hkv4 D128 (bf16 on
GPUs), dense causal and DMA (a per-key bias and its top-L/4 mask), against
`dmattn_ops.attention` on the whole sequence in one process. Reports step ms, the ratio
(R GPUs over 1), and peak memory: the one process's, and the largest of the R ranks' (measured
with nothing of the one-process run alive); a length that does not fit is reported as OOM.

``--docs N``: packed documents of N tokens (causal within each): `attention_varlen` over the
whole sequence against the ring with `cu_seqlens` on the contiguous layout, whose ranks then
need one ring step (documents shorter than a rank's rows cross at most into the next rank).

``--overlap`` (GPUs): one more ring step per row under torch.profiler, rank 0's NCCL kernel
time and the share of it during which one of its compute kernels ran (`overlap`), and for
every rank where its step went (`rank_time`): the host's time to issue it, the GPU's compute
and NCCL time, and the time the GPU ran nothing; then rank 0's longest idle stretches, each
named by the kernels before and after it (`idle_gaps`).

``--model``: a whole training step instead of one call: bench.model's stack of four pre-norm
DMA blocks (hidden 2048, H16 Hkv4 D128, window L/4, B1), on one GPU against the same model with
`parallelize` on R (global top-k and the ring in every layer), compiled with fullgraph=True
(``--eager``: not compiled); step ms and peak memory as above.

``--census`` (GPUs): what is alive at each rank's peak in one ring step (and the one process's):
the step's allocations recorded (torch.cuda.memory._record_memory_history), replayed to their
highest point, the live blocks summed by the line of this repository that allocated them.

``--fit GIB`` (GPUs): the longest L whose forward+backward fits in GIB per GPU (the process's
memory capped with `torch.cuda.set_per_process_memory_fraction`), for one GPU and for the ring.
One GPU: a doubling search then bisection, OOM caught. The ring does not search upward blindly:
a rank that runs out of memory mid-ring leaves its peers' transfers unmatched. Its peak per rank
is measured at two lengths, the longest L under the cap is read off that line, and one step at
that L is run to show that it fits; where it does not (the peak is not quite linear in L),
bisection between 64k and that L. Each ring check runs in processes of its own, ended after
RING_CHECK_S seconds (a hang counts as running out), and every check prints its length and
answer as it ends.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.tables import markdown
from bench.timeline import idle_gaps

B, H, HKV, D = 1, 16, 4, 128


def _inputs(length: int, device, dtype, kind: str, on_device: bool = False):
    """(q, k, v, mask, bias), the same on every rank: drawn on the CPU, or with on_device from a
    seeded generator of the device, in dtype (faster at long L, no float32 copy of the whole
    sequence; equal across ranks of one GPU model)."""
    g = torch.Generator(device=device if on_device else "cpu").manual_seed(0)

    def draw(*shape):
        if on_device:
            return torch.randn(*shape, generator=g, device=device, dtype=dtype)
        return torch.randn(*shape, generator=g).to(device, dtype)

    q, k, v = draw(B, length, H, D), draw(B, length, HKV, D), draw(B, length, HKV, D)
    mask = bias = None
    if kind == "dma":
        from dmattn_ops.masks import topk_mask

        bias = draw(B, HKV, 1, length)
        mask = topk_mask(bias, length // 4)
    return q, k, v, mask, bias


def _time(fn, device) -> float:
    fn()  # compile / warm up
    if device.type == "cuda":
        torch.cuda.synchronize()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2] * 1e3


def _peak_gib(device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def _step(fn, tensors):
    leaves = [t.detach().requires_grad_() if t is not None and t.is_floating_point() else t
              for t in tensors]  # fmt: skip

    def run():
        for t in leaves:
            if t is not None and t.is_floating_point():
                t.grad = None
        fn(*leaves).sum().backward()

    return run


def _measure(row: dict, name: str, fn, tensors, device) -> None:
    """row[name + "_ms"] and row[name + "_gib"]: the median forward+backward step of fn over
    tensors, and the device's peak memory from an emptied cache on ("OOM" as the time where
    it does not fit). The step's leaves and their gradients are freed when it returns, before
    the next measurement empties the cache, so nothing of one counts in the next one's peak."""
    _measure_step(row, name, _step(fn, tensors), device)


def _whole(q, k, v, mask, bias):
    import dmattn_ops

    return dmattn_ops.attention(q, k, v, mask, bias, is_causal=True)


def _ring(q, k, v, mask, bias):
    from dmattn_ops import distributed as cp

    return cp.ring_attention(q, k, v, mask, bias, is_causal=True)


@dataclass(frozen=True)
class _Packed:
    """The calls of a packed-document row (--docs): attention_varlen over the whole sequence,
    and the ring with cu_seqlens on `layout`; per-key mask and bias as the varlen ops take
    them."""

    cu: torch.Tensor
    longest: int
    layout: str

    def whole(self, q, k, v, mask, bias):
        import dmattn_ops

        keys = (None if t is None else t[0, :, 0] for t in (mask, bias))
        return dmattn_ops.attention_varlen(
            q[0], k[0], v[0], self.cu, self.cu, self.longest, self.longest, *keys, is_causal=True
        )

    def ring(self, q, k, v, mask, bias):
        from dmattn_ops import distributed as cp

        return cp.ring_attention(
            q, k, v, mask, bias, is_causal=True, cu_seqlens=self.cu, layout=self.layout
        )


def _documents(length: int, doc: int, device) -> torch.Tensor:
    """cu_seqlens of documents of `doc` tokens packed into `length` (the last one shorter)."""
    return torch.tensor(sorted({*range(0, length, doc), length}), dtype=torch.int32, device=device)


def _union(intervals):
    """The disjoint union of (start, end) intervals, sorted."""
    merged = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return merged


def overlap(comm, compute) -> tuple[float, float]:
    """(time some transfer kernel ran, of it the time some compute kernel ran too) over
    (start, end) intervals on one GPU: how much of the ring's communication its compute hides."""
    comm, compute = _union(comm), _union(compute)
    busy = sum(b - a for a, b in comm)
    hidden, j = 0.0, 0
    for a, b in comm:
        while j < len(compute) and compute[j][1] <= a:
            j += 1
        k = j
        while k < len(compute) and compute[k][0] < b:
            hidden += min(b, compute[k][1]) - max(a, compute[k][0])
            k += 1
    return busy, hidden


def rank_time(wall: float, issue: float, comm, compute, lead: float = 0.0) -> dict:
    """Where one rank's profiled step went (ms; intervals in us on its GPU): `wall` the step
    with its synchronize, `issue` the host's time until the step returned (its last launch
    issued), `compute` the union of the
    compute kernels, `nccl` of the NCCL ones, `idle` the wall less the union of both (the GPU
    waiting for the host), `lead` (ms) the part of it before the step's first kernel. A step
    whose issue time is near its wall and whose idle time is large is host-bound; one whose
    NCCL time far exceeds its transfers' size waits for a peer."""
    busy = sum(b - a for a, b in _union([*comm, *compute]))
    return dict(wall=wall, issue=issue, compute=sum(b - a for a, b in _union(compute)) / 1e3,
                nccl=sum(b - a for a, b in _union(comm)) / 1e3,
                idle=max(0.0, wall - busy / 1e3), lead=lead)  # fmt: skip


KERNELS_SHOWN = 14  # --overlap: rank 0's GPU kernels by total time, the longest first
GAPS_SHOWN = 8  # --overlap: rank 0's longest idle stretches
CENSUS_SHOWN = 10  # --census: the sites holding the most at the peak


def _site(frames) -> str:
    """Where a block was allocated: the innermost frame in this repository's code
    (dmattn_ops/, bench/), as file:line:function, else the innermost frame's function."""
    for f in frames:
        if "dmattn_ops" in f["filename"] or "/bench/" in f["filename"]:
            return f"{os.path.basename(f['filename'])}:{f['line']}:{f['name']}"
    return f"({frames[0]['name']})" if frames else "(unknown)"


def peak_census(trace) -> tuple[int, dict[str, int]]:
    """(bytes, {site: bytes}): the highest point of one device's recorded allocations (the
    events of torch.cuda.memory._snapshot()["device_traces"][i], in order) above what was
    allocated before the recording began, and what was alive there by allocating site."""
    live, total, peak, at = {}, 0, 0, -1
    for i, e in enumerate(trace):
        if e["action"] == "alloc":
            live[e["addr"]] = e["size"]
            total += e["size"]
        elif e["action"] == "free_completed":
            total -= live.pop(e["addr"], 0)
        if total > peak:
            peak, at = total, i
    held, sizes = {}, {}
    for e in trace[: at + 1]:
        if e["action"] == "alloc":
            held[e["addr"]] = _site(e.get("frames", []))
            sizes[e["addr"]] = e["size"]
        elif e["action"] == "free_completed":
            held.pop(e["addr"], None)
    census: dict[str, int] = {}
    for addr, site in held.items():
        census[site] = census.get(site, 0) + sizes[addr]
    return peak, census


def _census(row: dict, name: str, step, device) -> None:
    """row[name + "_census"]: (GiB allocated before, GiB at the peak, [(site, MiB)]) of one
    step after a warm one."""
    step()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated(device)
    torch.cuda.memory._record_memory_history(max_entries=200_000, stacks="python")
    try:
        step()
        torch.cuda.synchronize(device)
        trace = torch.cuda.memory._snapshot()["device_traces"][device.index]
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    peak, census = peak_census(trace)
    top = sorted(census.items(), key=lambda kv: -kv[1])[:CENSUS_SHOWN]
    row[name + "_census"] = (before / 2**30, (before + peak) / 2**30,
                             [(site, size / 2**20) for site, size in top])  # fmt: skip


def _profile_overlap(row: dict, step, device) -> None:
    """row["nccl_ms"], row["hidden"]: one profiled ring step's NCCL kernel time on this rank's
    GPU and the share of it during which a compute kernel ran (issue 52: each hop's transfer
    should overlap the previous block's compute)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    step()  # warm
    marker = torch.zeros(1, device=device)
    dist.barrier()  # the ranks start the profiled step together
    torch.cuda.synchronize(device)
    # CUDA activity alone: recording every host op too would slow the host and so lengthen
    # the GPU's idle stretches that this profile measures.
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        marker.zero_()  # a kernel where the step starts: its distance to the next is the lead
        t0 = time.perf_counter()
        step()
        issue = time.perf_counter() - t0
        torch.cuda.synchronize(device)
        wall = time.perf_counter() - t0
    comm, compute, by_name, named = [], [], {}, []
    events = sorted(
        (e.time_range.start, e.time_range.end, e.name)
        for e in prof.events()
        if e.device_type == DeviceType.CUDA and "memcpy" not in e.name.lower()
    )
    start = events[0][0] if events else 0.0  # the marker's
    for lo, hi, name in events[1:]:
        (comm if "nccl" in name.lower() else compute).append((lo, hi))
        named.append((lo, hi, name))
        calls, total = by_name.get(name, (0, 0.0))
        by_name[name] = (calls + 1, total + hi - lo)
    lead = (named[0][0] - start) / 1e3 if named else 0.0
    named.insert(0, (start, start, "(the step's start)"))
    busy, hidden = overlap(comm, compute)
    row["nccl_ms"] = busy / 1e3
    row["hidden"] = hidden / busy if busy else None
    row["kernels"] = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:KERNELS_SHOWN]
    row["gaps"] = idle_gaps(named, GAPS_SHOWN)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, rank_time(wall * 1e3, issue * 1e3, comm, compute, lead))
    row["ranks"] = every


def _join(rank: int, world: int, rendezvous: str) -> tuple[torch.device, torch.dtype]:
    """Join the group (NCCL, one GPU per rank, bf16; gloo and float32 on CPU): this rank's
    device and the benchmark's dtype."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{rendezvous}",
                            rank=rank, world_size=world)  # fmt: skip
    return device, torch.bfloat16 if cuda else torch.float32


def _largest_peak(row: dict, device) -> None:
    """row["ring_gib"] as the largest of every rank's peak (GPUs; the table shows it)."""
    if device.type == "cuda":
        peak = torch.tensor([row.get("ring_gib") or 0.0], device=device)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        row["ring_gib"] = peak.item()


def _worker(rank, world, rendezvous, lengths, kinds, profile_overlap, doc, census, results):
    device, dtype = _join(rank, world, rendezvous)
    cuda = device.type == "cuda"
    from dmattn_ops import distributed as cp

    try:
        for kind in kinds:
            for length in lengths:
                row = dict(kind=kind, length=length)
                q, k, v, mask, bias = _inputs(length, device, dtype, kind)
                whole, ring, layout = _whole, _ring, "zigzag"
                if doc is not None:
                    layout = "contiguous"  # short documents: each rank's work is local
                    packed = _Packed(_documents(length, doc, device), doc, layout)
                    whole, ring = packed.whole, packed.ring
                if rank == 0:  # one process, the whole sequence
                    _measure(row, "one", whole, (q, k, v, mask, bias), device)
                    if cuda and census and row["one_ms"] != "OOM":
                        _census(row, "one", _step(whole, (q, k, v, mask, bias)), device)
                dist.barrier()
                part = [cp.shard(t, 1, layout=layout) for t in (q, k, v)]
                m_part = cp.shard(mask, 3, layout=layout) if mask is not None else None
                b_part = cp.shard(bias, 3, layout=layout) if bias is not None else None
                del q, k, v, mask, bias
                _measure(row, "ring", ring, (*part, m_part, b_part), device)
                if cuda and profile_overlap and row["ring_ms"] != "OOM":
                    _profile_overlap(row, _step(ring, (*part, m_part, b_part)), device)
                if cuda and census and row["ring_ms"] != "OOM":
                    _census(row, "ring", _step(ring, (*part, m_part, b_part)), device)
                    every = [None] * world
                    dist.all_gather_object(every, row.pop("ring_census"))
                    row["ring_census"] = every
                _largest_peak(row, device)
                if rank == 0:
                    results.put(row)
                del part, m_part, b_part
                if cuda:
                    torch.cuda.empty_cache()
    finally:
        dist.destroy_process_group()


def _model_step(model, x, compiled: bool):
    """One training step of model on x (leaf gradients freed first): the loss is the output's
    mean square."""
    fn = torch.compile(model, fullgraph=True) if compiled else model

    def run():
        model.zero_grad(set_to_none=True)
        fn(x).float().square().mean().backward()

    return run


def _model_worker(rank, world, rendezvous, lengths, compiled, results):
    """--model: bench.model's DMA stack on one process (rank 0), then parallelized on all."""
    from bench.model import HIDDEN, make_model
    from dmattn_ops import distributed as cp
    from dmattn_ops.nn import DynamicMaskAttention

    device, dtype = _join(rank, world, rendezvous)
    cuda = device.type == "cuda"
    try:
        for length in lengths:
            row = dict(kind="model dma-w4", length=length)
            torch.manual_seed(0)  # the same weights on every rank
            model = make_model("dma-w4", length, device, dtype)
            if not cuda:  # a smoke run: the PyTorch path, not Triton's interpreter
                for layer in model.modules():
                    if isinstance(layer, DynamicMaskAttention):
                        layer.backend = "auto"
            x = torch.randn(1, length, HIDDEN, generator=torch.Generator().manual_seed(1))
            x = x.to(device, dtype)
            if rank == 0:
                _measure_step(row, "one", _model_step(model, x, compiled), device)
            dist.barrier()
            cp.parallelize(model)
            local = cp.shard(x, 1)
            del x
            _measure_step(row, "ring", _model_step(model, local, compiled), device)
            _largest_peak(row, device)
            if rank == 0:
                results.put(row)
            del model, local
            if cuda:
                torch.cuda.empty_cache()
    finally:
        dist.destroy_process_group()


def _measure_step(row: dict, name: str, step, device) -> None:
    """_measure for a prepared step (a model's: its parameters stay, its gradients are freed
    at each step's start)."""
    cuda = device.type == "cuda"
    try:
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        row[name + "_ms"] = _time(step, device)
        row[name + "_gib"] = _peak_gib(device)
    except torch.OutOfMemoryError:
        row[name + "_ms"] = "OOM"
    finally:
        if cuda:
            torch.cuda.empty_cache()


GRAIN = 8192  # the fit's L resolution (a multiple of every ring's 2 R chunks)


def _fits(fn, length: int, kind: str, device, world: int = 1) -> float | None:
    """The peak GiB of one forward+backward of fn at `length`, None when it runs out of memory.
    The ring (world > 1) gets its rank's rows drawn as they are (never the whole sequence, which
    alone would not fit under the cap at the lengths R GPUs reach), its DMA mask the top quarter
    of its own keys: the same shapes and density as a shard, which is all memory depends on."""
    step = None
    try:
        torch.cuda.empty_cache()
        q, k, v, mask, bias = _inputs(length // world, device, torch.bfloat16, kind, True)
        step = _step(fn, (q, k, v, mask, bias))
        del q, k, v, mask, bias
        # From here: the step's inputs (this rank's shard) and all it allocates.
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        return _peak_gib(device)
    except torch.OutOfMemoryError:
        return None
    finally:
        step = None
        torch.cuda.empty_cache()


def bisect(lo: int, hi: int, fits) -> int:
    """The longest L, a multiple of GRAIN in [lo, hi), for which fits(L) holds, given that it
    holds at lo and fails at hi (fits is monotone: what fits in less memory fits at less L)."""
    while hi - lo > GRAIN:
        mid = (lo + hi) // 2 // GRAIN * GRAIN
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def _logged(fits, what: str):
    """fits, printing each length it checks, its answer and its seconds as it ends (stderr,
    flushed): a search that a time limit cuts still shows how far it got."""

    def checked(length: int) -> bool:
        start = time.perf_counter()
        ok = fits(length)
        print(f"  fit {what} L={length}: {'fits' if ok else 'ran out'} "
              f"({time.perf_counter() - start:.1f} s)", file=sys.stderr, flush=True)  # fmt: skip
        return ok

    return checked


def _search_one(kind: str, device, start: int = 65536) -> int:
    """The longest L (a multiple of GRAIN) whose whole-sequence step fits: doubling, then
    bisection between the last length that fit and the first that did not."""

    @functools.partial(_logged, what=f"{kind}, 1 GPU")
    def fits(length: int) -> bool:
        return _fits(_whole, length, kind, device) is not None

    lo, hi = 0, start
    while fits(hi):
        lo, hi = hi, 2 * hi
    return bisect(lo, hi, fits)


def _capped(rank: int, cap_gib: float):
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    total = torch.cuda.get_device_properties(device).total_memory / 2**30
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap_gib / total), device)
    return device


def _one_fit_worker(rank, world, rendezvous, kind, cap_gib, results):
    """The longest whole-sequence L under the cap on one GPU (one process, no group)."""
    results.put(dict(one=_search_one(kind, _capped(rank, cap_gib))))


def _ring_fit_worker(rank, world, rendezvous, kind, length, cap_gib, results):
    """The ring's peak GiB per rank at `length` (the largest over ranks), or None where a rank
    ran out of memory under the cap."""
    device = _capped(rank, cap_gib)
    dist.init_process_group("nccl", init_method=f"file://{rendezvous}", rank=rank,
                            world_size=world)  # fmt: skip
    try:
        peak = _fits(_ring, length, kind, device, world)
        found = torch.tensor([math.inf if peak is None else peak], device=device)
        dist.all_reduce(found, op=dist.ReduceOp.MAX)
        if rank == 0:
            results.put(dict(peak=None if math.isinf(found.item()) else found.item()))
    finally:
        dist.destroy_process_group()


RING_CHECK_S = 90  # a ring check still running after this is taken as run out (a hang)


def fit(world: int, kinds, cap_gib: float) -> list[dict]:
    """Per kind: the longest L on one GPU and on the ring of `world` GPUs under `cap_gib` per
    GPU. The ring's longest comes from the line through its peaks at 32k and 64k (2% under it:
    the allocator's rounding must not make the check run out), checked there, and where it ran
    out (2 x H200, dense on our kernels: the line's 548864) bisected down to the last length
    measured. Each of these checks runs in processes of its own: a rank that runs out of
    memory inside the ring leaves its peer's transfers unmatched, and the next collective of
    the same processes hung (session 59, after 516096 ran out), so a check that outlives
    RING_CHECK_S is ended and counts as run out."""
    # What a long-context user sets: segments that grow, so that fragmentation does not decide
    # where a capped process runs out (the spawned workers inherit it).
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    rows = []
    for kind in kinds:
        (row,) = _spawn(_one_fit_worker, 1, kind, cap_gib)

        def ring_peak(length: int, kind=kind) -> float | None:
            found = _spawn(_ring_fit_worker, world, kind, length, cap_gib, timeout=RING_CHECK_S)
            return found[0]["peak"] if found else None

        points = [(length, ring_peak(length) or -1.0) for length in (32768, 65536)]
        (l0, p0), (l1, p1) = points
        slope = (p1 - p0) / (l1 - l0)
        guess = int(0.98 * ((cap_gib - p0) / slope + l0)) // GRAIN * GRAIN if slope > 0 else 0

        @functools.partial(_logged, what=f"{kind}, {world} GPUs")
        def fits(length: int, ring_peak=ring_peak) -> bool:
            return ring_peak(length) is not None

        ok = guess > l1 and fits(guess)
        longest = guess if ok else bisect(l1, guess, fits) if guess > l1 else 0
        row.update(kind=kind, cap=cap_gib, points=points, ring=longest, ring_ok=longest > 0,
                   line=guess)  # fmt: skip
        rows.append(row)
    return rows


def fit_table(rows, world: int) -> str:
    headers = ["kind", "cap GiB per GPU", "longest L, 1 GPU", f"longest L, {world} GPUs",
               "ratio", f"{world}-GPU peak GiB at 32k / 64k"]  # fmt: skip
    table = []
    for r in rows:
        ring = r["ring"] if r["ring_ok"] else "none"
        if r["ring"] != r.get("line", r["ring"]):
            ring = f"{ring} (line: {r['line']})"
        ratio = r["ring"] / r["one"] if r["ring_ok"] and r["one"] else None
        points = " / ".join(f"{p:.2f}" for _, p in r["points"])
        table.append([r["kind"], r["cap"], r["one"], ring, ratio, points])
    return markdown(headers, table, ("", ".1f", "", "", ".2f", ""))


def _spawn(worker, world: int, *args, timeout: float | None = None) -> list[dict]:
    """worker(rank, world, rendezvous, *args, results) on `world` spawned processes; the rows
    rank 0 put in results. With `timeout` (seconds), processes still running then are ended
    and the rows are those put so far (none, where rank 0 had not finished)."""
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        context = mp.start_processes(
            worker, args=(world, os.path.join(tmp, "rdv"), *args, results), nprocs=world,
            join=False, start_method="spawn",
        )  # fmt: skip
        deadline = None if timeout is None else time.monotonic() + timeout
        while not context.join(timeout=5):
            if deadline is not None and time.monotonic() > deadline:
                for process in context.processes:
                    if process.is_alive():
                        process.kill()
                for process in context.processes:
                    process.join()
                break
    rows = []
    while not results.empty():
        rows.append(results.get())
    return rows


def run(world: int, lengths, kinds, profile_overlap: bool = False, doc=None,
        census: bool = False) -> list[dict]:  # fmt: skip
    return _spawn(_worker, world, lengths, kinds, profile_overlap, doc, census)


def census_lines(title: str, census) -> list[str]:
    """--census's lines for one process: its GiB before the step and at its peak, then the
    sites holding the most there."""
    before, peak, sites = census
    lines = [f"{title}: {before:.3f} GiB allocated before the step, {peak:.3f} at its peak"]
    lines += [f"    {mib:9.1f} MiB  {site}" for site, mib in sites]
    return lines


def table(rows, world: int) -> str:
    headers = ["kind", "L", "1 process ms", f"{world} processes ms", "ratio", "peak GiB 1",
               f"peak GiB, largest rank ({world})", "memory ratio"]  # fmt: skip
    overlaps = any("nccl_ms" in r for r in rows)
    if overlaps:
        headers += ["NCCL kernels ms (rank 0)", "of it under compute"]
    table = []
    for r in rows:
        one, ring = r.get("one_ms"), r.get("ring_ms")
        ratio = ring / one if isinstance(one, float) and isinstance(ring, float) else None
        gib = (r.get("one_gib"), r.get("ring_gib"))
        memory = gib[1] / gib[0] if None not in gib and gib[0] else None
        # A time is "OOM" where that run ran out of memory: the column is then text.
        times = [f"{t:.2f}" if isinstance(t, float) else t for t in (one, ring)]
        cells = [r["kind"], r["length"], *times, ratio, *gib, memory]
        if overlaps:
            hidden = r.get("hidden")
            cells += [r.get("nccl_ms"), None if hidden is None else f"{100 * hidden:.0f}%"]
        table.append(cells)
    return markdown(headers, table, ("", "", ".2f", ".2f", ".2f", ".2f", ".2f", ".2f", ".2f", ""))


def rank_table(ranks) -> str:
    """rank_time's figures of every rank, one row each."""
    rows = [[r, t["wall"], t["issue"], t["compute"], t["nccl"], t["idle"], t["lead"]]
            for r, t in enumerate(ranks)]  # fmt: skip
    headers = ["rank", "step ms (profiled)", "host issue ms", "compute ms", "NCCL ms",
               "GPU idle ms", "of it before the first kernel"]  # fmt: skip
    return markdown(headers, rows, ("", ".2f", ".2f", ".2f", ".2f", ".2f", ".2f"))


def gap_table(gaps) -> str:
    """idle_gaps' rows as a table (ms)."""
    rows = [[gap / 1e3, at / 1e3, before[:48], after[:48]] for gap, at, before, after in gaps]
    headers = ["idle ms", "at ms", "after kernel", "ended by kernel"]
    return markdown(headers, rows, (".3f", ".2f", "", ""))


def kernel_table(kernels) -> str:
    """(name, (calls, total us)) rows as a table: the profiled step's kernels by GPU time."""
    rows = [[name[:70], calls, total / 1e3] for name, (calls, total) in kernels]
    return markdown(["kernel", "calls", "ms"], rows, ("", "", ".2f"))


FLAGS = (  # main's switches: (flag, help)
    ("--overlap", "profile one ring step per row: NCCL kernel time and the share of it that "
     "compute kernels overlap (GPUs)"),
    ("--census", "what is alive at each process's memory peak in one step, by allocating line "
     "(GPUs)"),
    ("--model", "a whole training step of bench.model's DMA stack instead of one call"),
    ("--eager", "--model without torch.compile"),
)  # fmt: skip


def main(argv=None) -> int:
    from bench.__main__ import header

    p = argparse.ArgumentParser(prog="python -m bench.cp", description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2, help="processes (GPUs) in the ring")
    p.add_argument("--lengths", default="32768,65536,131072", help="comma-separated")
    p.add_argument("--kinds", default="dense,dma", help="dense, dma")
    p.add_argument(
        "--docs",
        type=int,
        default=None,
        metavar="N",
        help="packed documents of N tokens: attention_varlen on one GPU against the ring with "
        "cu_seqlens on the contiguous layout",
    )
    for flag, text in FLAGS:
        p.add_argument(flag, action="store_true", help=text)
    p.add_argument(
        "--fit",
        type=float,
        default=None,
        metavar="GIB",
        help="longest L that fits in GIB per GPU, 1 GPU and the ring (GPUs only)",
    )
    args = p.parse_args(argv)
    if args.fit is not None:
        if not torch.cuda.is_available() or torch.cuda.device_count() < args.world:
            p.error(f"--fit needs {args.world} CUDA GPUs")
        print(header(), flush=True)
        print(fit_table(fit(args.world, args.kinds.split(","), args.fit), args.world))
        return 0
    lengths = [int(x) for x in args.lengths.split(",")]
    for length in lengths:
        if length % (2 * args.world):
            p.error(f"length {length} does not divide into {2 * args.world} zigzag chunks")
    if torch.cuda.is_available() and torch.cuda.device_count() < args.world:
        p.error(f"--world {args.world} needs as many GPUs; {torch.cuda.device_count()} visible")
    print(header(), flush=True)
    if args.model:
        print("bench.model's DMA stack, " + ("eager" if args.eager else "compiled, fullgraph"))
        print(table(_spawn(_model_worker, args.world, lengths, not args.eager), args.world))
        return 0
    if args.docs is not None:
        print(f"packed documents of {args.docs} tokens; the ring on the contiguous layout")
    rows = run(args.world, lengths, args.kinds.split(","), args.overlap, args.docs, args.census)
    print(table(rows, args.world))
    for r in rows:
        if r.get("ring_census"):
            print(f"\n{r['kind']} L{r['length']}: what is alive at the peak of one step")
            if r.get("one_census"):
                print("\n".join(census_lines("one process", r["one_census"])))
            for rank, census in enumerate(r["ring_census"]):
                print("\n".join(census_lines(f"rank {rank}", census)))
    for r in rows:
        if r.get("kernels"):
            print(f"\n{r['kind']} L{r['length']}: rank 0's kernels in one ring step")
            print(kernel_table(r["kernels"]))
            print(f"\n{r['kind']} L{r['length']}: where each rank's profiled step went")
            print(rank_table(r["ranks"]))
            print(f"\n{r['kind']} L{r['length']}: rank 0's longest GPU idle stretches "
                  "(at: ms after the step's start)")  # fmt: skip
            print(gap_table(r["gaps"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
