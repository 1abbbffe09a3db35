"""Where the time goes: ``python -m bench.profile [A,B,...]``.

Runs ours forward and forward+backward on each case under torch.profiler and prints the device
time of every kernel (and PyTorch op kernel) per call, largest first. CUDA only.
"""

from __future__ import annotations

import argparse
import sys

import torch

from bench.__main__ import CASES, build, impl_ours
from bench.timeline import kernel_times


def main(names: list[str]) -> int:
    if not torch.cuda.is_available():
        print("bench.profile needs a CUDA device")
        return 1
    for name in names:
        x = build(CASES[name], "cuda", torch.bfloat16)
        q, k, v = (t.detach().clone().requires_grad_() for t in (x.q, x.k, x.v))
        bias = x.bias.detach().clone().requires_grad_() if x.bias is not None else None
        grad = torch.randn_like(x.q)

        f = impl_ours(x)  # the bench's own call, varlen included

        def call(f=f, q=q, k=k, v=v, bias=bias):
            return f(q, k, v, bias)

        def forward(call=call):
            with torch.no_grad():
                call()

        def train(call=call, grad=grad):
            call().backward(grad)

        for label, fn in (("forward", forward), ("forward+backward", train)):
            rows = kernel_times(fn)
            print(f"\n{name} {label}: {sum(r[1] for r in rows):.3f} ms of kernels per call")
            for kernel, ms, n in rows[:12]:
                print(f"  {ms:8.3f} ms  x{n:<3d} {kernel[:100]}")
    return 0


def cli(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.profile", description=__doc__.splitlines()[0])
    p.add_argument(
        "cases", nargs="?", default="A,B", help=f"comma-separated, of {', '.join(CASES)}"
    )
    names = p.parse_args(argv).cases.split(",")
    for name in names:
        if name not in CASES:
            p.error(f"unknown case {name!r}; the cases are {', '.join(CASES)}")
    return main(names)


if __name__ == "__main__":
    sys.exit(cli())
