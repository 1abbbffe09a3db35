"""A compiled training step's host time by phase, and what its graphs allocate.

``python -m bench.phases [--shapes B16-L512,B1-L8192] [--variants sdpa,dma-w4] [--rounds N]``:

bench.model's step (its model, variants and input), compiled, split in two phases: the forward
through the loss, and ``backward()``. For each phase:

* host ms: the phase issued while a sleep kernel keeps the GPU busy, so that nothing waits for
  the GPU and the wall time is the host's alone (min and median of the rounds);
* GPU ms: the same phase timed by CUDA events without the sleep. It includes any time the
  GPU waited for the host, so a phase whose GPU ms is about its host ms is host-bound;
* allocations: every buffer Inductor's code allocates (``empty_strided_cuda``), counted and
  timed on the host, the largest costs listed by shape and dtype;
* Triton launches: the kernels Inductor's code launches (its own and ours, through
  ``CachingAutotuner.run``; cuBLAS and cuDNN calls are not counted), and their host time.

A short step whose host exceeds its kernels' time runs at the host's pace in the default
compile mode (no CUDA graphs); this shows which phase does, and how much of it is allocation
(bench/NOTES.md 225).
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections import defaultdict

import torch

ROUNDS = 7
SLEEP_MS = 60.0  # longer than either phase of any shape here


class Allocations:
    """Inductor's `empty_strided_cuda` and its Triton launches, timed while `recording`. Its
    generated code binds the allocator when the code is loaded (after compiling), so `install`
    must come first."""

    def __init__(self):
        self.rows: dict[tuple, list[float]] = defaultdict(list)
        self.launches: list[float] = []
        self.on = False

    def install(self) -> None:
        import torch._C._dynamo.guards as guards
        from torch._inductor.runtime.triton_heuristics import CachingAutotuner

        real = guards._empty_strided_cuda

        def timed(size, stride, dtype):
            if not self.on:
                return real(size, stride, dtype)
            t0 = time.perf_counter()
            out = real(size, stride, dtype)
            self.rows[(tuple(size), tuple(stride), dtype)].append(time.perf_counter() - t0)
            return out

        guards._empty_strided_cuda = timed
        run = CachingAutotuner.run

        def timed_run(tuner, *args, **kwargs):
            if not self.on:
                return run(tuner, *args, **kwargs)
            t0 = time.perf_counter()
            out = run(tuner, *args, **kwargs)
            self.launches.append(time.perf_counter() - t0)
            return out

        CachingAutotuner.run = timed_run

    def clear(self) -> None:
        self.rows.clear()
        self.launches.clear()

    @contextlib.contextmanager
    def recording(self):
        self.on = True
        try:
            yield
        finally:
            self.on = False

    def summary(self, steps: int, top: int = 12) -> tuple[float, float, list[tuple], tuple]:
        """(allocations a step, their host us a step, [(us a step, count a step, best us,
        dtype, MiB, shape)] largest first, (Triton launches a step, their host us a step))
        since the last clear."""
        calls = sum(len(v) for v in self.rows.values()) / steps
        total = sum(sum(v) for v in self.rows.values()) / steps * 1e6
        launches = (len(self.launches) / steps, sum(self.launches) / steps * 1e6)
        largest = []
        for (size, stride, dtype), times in sorted(self.rows.items(), key=lambda kv: -sum(kv[1])):
            span = sum((s - 1) * st for s, st in zip(size, stride)) + 1 if all(size) else 0
            largest.append((sum(times) / steps * 1e6, len(times) / steps, min(times) * 1e6,
                            str(dtype).removeprefix("torch."), span * dtype.itemsize / 2**20,
                            size))  # fmt: skip
        return calls, total, largest[:top], launches


def measure(variant: str, shape: str, allocations: Allocations, rounds: int = ROUNDS) -> dict:
    """The phases of one variant's compiled step at one shape (module doc)."""
    from bench import model as bm

    torch._dynamo.reset()
    with bm._variant(variant) as base:
        step = bm._compiled_step(base, shape, "default")
        model, compiled, x = step.model, step.compiled, step.x

        def forward():
            return bm._train_loss(model, compiled, x)

        for _ in range(5):
            step()
        torch.cuda.synchronize()
        host = {"fwd": [], "bwd": []}
        gpu = {"fwd": [], "bwd": []}
        for _ in range(rounds):
            torch.cuda._sleep(bm._sleep_cycles(SLEEP_MS))
            t0 = time.perf_counter()
            loss = forward()
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            torch.cuda.synchronize()
            host["fwd"].append((t1 - t0) * 1e3)
            host["bwd"].append((t2 - t1) * 1e3)
            events = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            events[0].record()
            loss = forward()
            events[1].record()
            loss.backward()
            events[2].record()
            torch.cuda.synchronize()
            gpu["fwd"].append(events[0].elapsed_time(events[1]))
            gpu["bwd"].append(events[1].elapsed_time(events[2]))
        allocs = {}
        for phase in ("fwd", "bwd"):
            allocations.clear()
            for _ in range(rounds):
                torch.cuda._sleep(bm._sleep_cycles(SLEEP_MS))
                with allocations.recording() if phase == "fwd" else contextlib.nullcontext():
                    loss = forward()
                with allocations.recording() if phase == "bwd" else contextlib.nullcontext():
                    loss.backward()
                torch.cuda.synchronize()
            allocs[phase] = allocations.summary(rounds)
    return dict(variant=variant, shape=shape, host=host, gpu=gpu, allocs=allocs)


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def phase_table(rows: list[dict]) -> str:
    from bench.tables import markdown

    table = []
    for r in rows:
        for phase in ("fwd", "bwd"):
            calls, total, _, (launches, launch_us) = r["allocs"][phase]
            host, gpu = r["host"][phase], r["gpu"][phase]
            table.append([r["shape"], r["variant"], phase, min(host), _median(host),
                          _median(gpu), calls, total, launches, launch_us])  # fmt: skip
    headers = ["shape", "variant", "phase", "host ms (min)", "median", "GPU ms (events)",
               "allocations", "allocation host us", "Triton launches",
               "launch host us"]  # fmt: skip
    return markdown(headers, table, ("", "", "", ".3f", ".3f", ".3f", ".0f", ".0f", ".0f", ".0f"))


def main(argv=None) -> int:
    from bench.__main__ import header
    from bench.model import SHAPES, VARIANTS

    p = argparse.ArgumentParser(prog="python -m bench.phases", description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="B16-L512,B1-L8192")
    p.add_argument("--variants", default="sdpa,dma-w4")
    p.add_argument("--rounds", type=int, default=ROUNDS)
    args = p.parse_args(argv)
    for name, known in (("shape", SHAPES), ("variant", VARIANTS)):
        for value in getattr(args, f"{name}s").split(","):
            if value.split("+")[0] not in known:
                p.error(f"unknown {name} {value!r}; known: {', '.join(known)}")
    if not torch.cuda.is_available():
        print("bench.phases needs a CUDA GPU")
        return 0
    allocations = Allocations()
    allocations.install()
    # AOTAutograd's cache keys on the Dynamo graph, which does not see the variants' switches.
    torch._functorch.config.enable_autograd_cache = False
    print(header(), flush=True)
    rows = []
    for shape in args.shapes.split(","):
        for variant in args.variants.split(","):
            r = measure(variant, shape, allocations, args.rounds)
            rows.append(r)
            for phase in ("fwd", "bwd"):
                calls, total, largest, (launches, launch_us) = r["allocs"][phase]
                print(f"== {shape} {variant} {phase}: {launches:.0f} Triton launches a step "
                      f"({launch_us:.0f} us of host), {calls:.0f} allocations ({total:.0f} us); "
                      "the allocations' largest costs:", flush=True)  # fmt: skip
                for us, count, best, dtype, mib, size in largest:
                    print(f"  {us:7.1f} us x{count:<4.1f} best {best:5.1f} us  {dtype:9s} "
                          f"{mib:9.3f} MiB {size}")  # fmt: skip
    print()
    print(header())
    print(phase_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
