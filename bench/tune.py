"""Tile-config sweep: ``python -m bench.tune [A,B,...] [fwd,dkdv,dq,split]``.

For each case and kernel kind, every candidate (block_m, block_n, num_warps, num_stages) is
forced through the kernel options (dmattn_ops.kernel_options) and the kernel's own device time
is read from the profiler (bench.profile), so the dk/dv and dq kernels are tuned separately
(each reads tile tables on its own grid). The dkdv sweep also reports the dq kernel's time,
which a shared mask pass affects.
The split sweep forces how many programs share a KV group's query heads in the dk/dv kernel
(kernel option dkdv_split; 0 leaves it to configs.dkdv_split), with the dk/dv tile config given,
and reports the dk/dv kernel plus the reduce kernel that sums its parts. Besides bench's own
cases it takes M-L32768 and M-L512 (the model's DMA call at B1 L32768 and B16 L512; the
first is too long for `python -m bench`),
and the sliding windows W128 (GPT-OSS's layer) and W4096 (bench.window's).
"""

from __future__ import annotations

import argparse
import sys

import torch

import dmattn_ops
from bench.__main__ import CASES, Case, build, impl_ours
from bench.timeline import kernel_times

# Cases only the sweep takes (too long for `python -m bench`, whose other impls would
# materialise their masks): the model's DMA call at its longest shape.
TUNE_CASES = {
    **CASES,
    "M-L32768": Case("M-L32768", "the model's DMA call at B1 L32768: H16 Hkv4, bias (B,Hkv,1,L), "
                     "top-8192 per key", 1, 16, 4, 32768, 32768, 128, "gqa", keep=8192),
    "M-L16384": Case("M-L16384", "the model's DMA call at B1 L16384: H16 Hkv4, bias (B,Hkv,1,L), "
                     "top-4096 per key", 1, 16, 4, 16384, 16384, 128, "gqa", keep=4096),
    "M-L8192": Case("M-L8192", "the model's DMA call at B1 L8192: H16 Hkv4, bias (B,Hkv,1,L), "
                    "top-2048 per key", 1, 16, 4, 8192, 8192, 128, "gqa", keep=2048),
    "M-L512": Case("M-L512", "the model's DMA call at B16 L512: H16 Hkv4, bias (B,Hkv,1,L), "
                   "top-128 per key", 16, 16, 4, 512, 512, 128, "gqa", keep=128),
    "W128": Case("W128", "GPT-OSS's sliding layer: B1 H64 Hkv8 L8192 D64, causal window 128",
                 1, 64, 8, 8192, 8192, 64, "dense", window=128),
    "W4096": Case("W4096", "bench.window's case: B1 H32 Hkv8 L16384 D128, causal window 4096",
                  1, 32, 8, 16384, 16384, 128, "dense", window=4096),
}  # fmt: skip

CANDIDATES = {
    "fwd": [(128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 2), (128, 128, 8, 3),
            (128, 64, 4, 3), (64, 64, 4, 3), (128, 32, 4, 3), (64, 64, 4, 4), (64, 64, 4, 2),
            (128, 64, 4, 2), (64, 32, 4, 3)],
    "dkdv": [(64, 64, 4, 2), (64, 64, 4, 3), (32, 128, 4, 3), (32, 128, 4, 5), (64, 128, 8, 2),
             (64, 128, 8, 3), (32, 64, 4, 3), (16, 128, 4, 4), (32, 128, 8, 3), (64, 64, 4, 4),
             (64, 32, 4, 3), (32, 32, 4, 3), (128, 32, 8, 3), (32, 64, 8, 3), (32, 64, 8, 2),
             (64, 64, 8, 2), (64, 64, 8, 3), (16, 64, 4, 3)],
    "dq": [(64, 64, 4, 2), (64, 64, 4, 3), (128, 32, 4, 3), (128, 32, 4, 5), (128, 64, 8, 2),
           (128, 64, 8, 3), (64, 32, 4, 3), (128, 32, 8, 3), (64, 64, 4, 4)],
    # (split, dk/dv config); split 0 is configs.dkdv_split's own choice.
    "split": [(0, (32, 64, 4, 3)), (1, (32, 64, 4, 3)), (2, (32, 64, 4, 3)), (4, (32, 64, 4, 3)),
              (4, (64, 64, 4, 2)), (4, (64, 64, 4, 3)), (4, (32, 128, 4, 3)),
              (4, (64, 128, 8, 2)), (2, (64, 64, 4, 3))],
}  # fmt: skip
KERNELS = {
    "fwd": ("attention_fwd_kernel",),
    "dkdv": ("attention_bwd_dkdv_kernel", "attention_bwd_dq_kernel"),
    "dq": ("attention_bwd_dq_kernel",),
    "split": ("attention_bwd_dkdv_kernel", "attention_bwd_dkdv_reduce_kernel"),
}


def _sweep(name: str, kind: str) -> None:
    x = build(TUNE_CASES[name], "cuda", torch.bfloat16)
    q, k, v = (t.detach().clone().requires_grad_() for t in (x.q, x.k, x.v))
    bias = x.bias.detach().clone().requires_grad_() if x.bias is not None else None
    grad = torch.randn_like(x.q)
    inputs = [q, k, v, *([bias] if bias is not None else [])]

    f = impl_ours(x)

    def step():
        out = f(q, k, v, bias)
        if kind != "fwd":
            torch.autograd.grad(out, inputs, grad)

    results = []
    for cfg in CANDIDATES[kind]:
        if kind == "split":
            forced = {"dkdv_config": tuple(cfg[1])}
            if cfg[0]:
                forced["dkdv_split"] = cfg[0]
        else:
            forced = {f"{kind}_config": tuple(cfg)}
        try:
            with dmattn_ops.kernel_options(**forced):
                times = {kernel: ms for kernel, ms, _ in kernel_times(step)}
            parts = [times.get(kernel, 0.0) for kernel in KERNELS[kind]]
            shown = " + ".join(f"{ms:.3f}" for ms in parts)
            results.append((sum(parts), cfg))
            print(f"{name} {kind} {cfg} {sum(parts):.3f} ms ({shown})", flush=True)
        except Exception as e:  # out of shared memory, say: a result, not a crash
            print(f"{name} {kind} {cfg} FAILED {type(e).__name__}: {str(e)[:100]}", flush=True)
    if results:
        best = min(results)
        print(f"BEST {name} {kind}: {best[1]} {best[0]:.3f} ms", flush=True)


def main(cases: list[str], kinds: list[str]) -> int:
    for name in cases:
        for kind in kinds:
            _sweep(name, kind)
    return 0


def parse(argv=None) -> tuple[list[str], list[str]]:
    p = argparse.ArgumentParser(prog="python -m bench.tune", description=__doc__.splitlines()[0])
    p.add_argument(
        "cases", nargs="?", default="A,B", help=f"comma-separated, of {list(TUNE_CASES)}"
    )
    p.add_argument("kinds", nargs="?", default="fwd,dkdv,dq", help="of fwd, dkdv, dq, split")
    args = p.parse_args(argv)
    cases, kinds = args.cases.split(","), args.kinds.split(",")
    for c in cases:
        if c not in TUNE_CASES:
            p.error(f"unknown case {c!r}; the cases are {', '.join(TUNE_CASES)}")
    for k in kinds:
        if k not in CANDIDATES:
            p.error(f"unknown kernel kind {k!r}; the kinds are {', '.join(CANDIDATES)}")
    return cases, kinds


if __name__ == "__main__":
    if not torch.cuda.is_available():
        parse()
        sys.exit("bench.tune needs a CUDA GPU")
    sys.exit(main(*parse()))
