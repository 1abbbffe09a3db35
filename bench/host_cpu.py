"""The Python host time of one eager call with every kernel launch stubbed, on any machine:
``python -m bench.host_cpu [dma|dense|decode] [--launch-cache] [--profile tottime|cumtime]
[--rounds N]``.

What our own Python costs per call (validation, planning, allocation, launch arguments, the
autograd Function), without the GPU or Triton's launchers: the kernels run in Triton's
interpreter mode with each launch replaced by a no-op, so nothing is computed. B4 L2048 H16/4
D128 bf16, causal; "dma" adds a per-key bias (B, Hkv, 1, L) and its top-512 mask; "decode" is
one query row a sequence against that cache, mask and bias (a forward without gradients, as a
serving loop's step). Prints the min and median over rounds of 50 calls, and with --profile
the functions by own or cumulative time. --launch-cache: launches through LaunchCache and the
kernels kept per plan, as on a GPU. A GPU's host runs this Python about 4x slower than a
laptop core (bench/NOTES.md 134), and a Python op's floor there (a trivial
autograd.Function) is about 0.2 ms (NOTES 103): compare A/B on one machine, alternating, not
across machines.
"""

from __future__ import annotations

import argparse
import cProfile
import inspect
import os
import pstats
import time

B, L, H, HKV, D = 4, 2048, 16, 4, 128
CALLS = 50


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.host_cpu", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("kind", nargs="?", default="dma", choices=("dma", "dense", "decode"))
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--profile", choices=("tottime", "cumtime"), default=None)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument(
        "--launch-cache", action="store_true",
        help="launch through LaunchCache and Prepared's kept kernels as on a GPU",
    )  # fmt: skip
    args = parser.parse_args(argv)
    # Before the package imports Triton: the interpreter's launch path, then stubbed.
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ.setdefault("DMATTN_DENSE_SDPA", "0")
    import torch

    import dmattn_ops
    from dmattn_ops.executors import _triton
    from dmattn_ops.masks import topk_mask

    _stub_kernels(_triton, args.launch_cache)
    dt = torch.bfloat16
    q = torch.randn(B, L, H, D, dtype=dt, requires_grad=True)
    k = torch.randn(B, L, HKV, D, dtype=dt, requires_grad=True)
    v = torch.randn(B, L, HKV, D, dtype=dt, requires_grad=True)
    bias = torch.randn(B, HKV, 1, L, dtype=dt, requires_grad=True)
    mask = topk_mask(bias.detach(), 512)
    grad = torch.randn(B, L, H, D, dtype=dt)

    step_q = q.detach()[:, -1:]

    def step():
        if args.kind == "decode":
            with torch.no_grad():
                dmattn_ops.attention(step_q, k, v, mask, bias)
            return
        for t in (q, k, v, bias):
            t.grad = None
        if args.kind == "dma":
            out = dmattn_ops.attention(q, k, v, mask, bias, is_causal=True)
        else:
            out = dmattn_ops.attention(q, k, v, is_causal=True)
        out.backward(grad)

    for _ in range(5):
        step()
    per_call = []
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        for _ in range(CALLS):
            step()
        per_call.append((time.perf_counter() - t0) / CALLS * 1e3)
    per_call.sort()
    what = "one decode step" if args.kind == "decode" else "forward+backward"
    print(
        f"{args.kind} {what}, launches stubbed: host {per_call[0]:.4f} ms min, "
        f"{per_call[len(per_call) // 2]:.4f} median ({args.rounds} rounds of {CALLS} calls)"
    )
    if args.profile:
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(CALLS):
            step()
        profile.disable()
        pstats.Stats(profile).sort_stats(args.profile).print_stats(args.top)
    return 0


class _Compiled:
    """A compiled kernel's stand-in: LaunchCache keeps it (one source signature entry per
    parameter, a `run`), and its launches do nothing."""

    def __init__(self, n_params: int):
        self.src = type("Src", (), {"signature": dict.fromkeys(range(n_params))})()

    def run(self, *args):
        pass

    def __getitem__(self, grid):
        return self.run


class _Jit:
    """A @triton.jit function's stand-in with the real kernel's signature: `fn[grid](...)`
    returns a _Compiled and computes nothing."""

    def __init__(self, real):
        self.signature = inspect.signature(real.fn)
        self.pre_run_hooks = []
        self.compiled = _Compiled(len(self.signature.parameters))

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.compiled


def _stub_kernels(_triton, launch_cache: bool) -> None:
    """Every kernel a stand-in whose launches do nothing, whichever launch path reaches it;
    with `launch_cache`, eager launches go through LaunchCache and Prepared's kept kernels as
    they do on a GPU (the compiled kernels' own C launchers are what is then left out)."""
    load = _triton.LazyKernel.fn.func  # the cached_property's loader
    stubs: dict = {}

    def fn(self):
        if self._name not in stubs:
            stubs[self._name] = _Jit(load(self))
        return stubs[self._name]

    _triton.LazyKernel.fn = property(fn)
    if launch_cache:
        import torch

        _triton.launch_cache_on = lambda: True
        torch.cuda.current_device = lambda: 0


if __name__ == "__main__":
    raise SystemExit(main())
