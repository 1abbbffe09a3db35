"""Tile-config sweep: ``python -m bench.tune``. Times forward and backward separately for a few
cases under each candidate (block_m, block_n, num_warps, num_stages) and prints the best."""

from __future__ import annotations

import sys

import torch
import triton

import dmattn_ops
from bench.__main__ import CASES, build
from dmattn_ops import launch

FWD = [
    (128, 64, 8, 2),
    (128, 64, 4, 3),
    (128, 128, 8, 2),
    (128, 64, 8, 3),
    (64, 64, 4, 3),
    (128, 32, 4, 3),
    (128, 128, 8, 3),
]
BWD = [(64, 64, 8, 2), (64, 64, 4, 2), (64, 64, 4, 3), (32, 64, 4, 3), (64, 128, 8, 2),
       (128, 64, 8, 2), (32, 32, 4, 4), (64, 32, 4, 3)]  # fmt: skip


def main(cases=("A", "B")) -> int:
    orig = launch._base_config
    for name in cases:
        x = build(CASES[name], "cuda", torch.bfloat16)
        leaves = [t.detach().clone().requires_grad_() for t in (x.q, x.k, x.v)]
        bias = x.bias.detach().clone().requires_grad_() if x.bias is not None else None
        grad = torch.randn_like(x.q)
        for which, configs in (("fwd", FWD), ("bwd", BWD)):
            results = []
            for cfg in configs:

                def pick(d, dv, backward, masked=False, cfg=cfg, which=which):
                    if backward == (which == "bwd"):
                        return launch.Config(*cfg)
                    return orig(d, dv, backward, masked)

                launch._base_config = pick
                try:
                    out = dmattn_ops.attention(
                        *leaves,
                        x.mask,
                        bias,
                        is_causal=x.is_causal,
                        seqused_k=x.seqused_k,
                        backend="triton",
                    )
                    if which == "fwd":

                        def fn():
                            with torch.no_grad():
                                dmattn_ops.attention(
                                    x.q,
                                    x.k,
                                    x.v,
                                    x.mask,
                                    x.bias,
                                    is_causal=x.is_causal,
                                    seqused_k=x.seqused_k,
                                    backend="triton",
                                )
                    else:

                        def fn(out=out):
                            torch.autograd.grad(
                                out,
                                [*leaves, *([bias] if bias is not None else [])],
                                grad,
                                retain_graph=True,
                            )

                    ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
                    results.append((ms, cfg))
                    print(f"{name} {which} {cfg} {ms:.3f} ms", flush=True)
                except Exception as e:
                    print(
                        f"{name} {which} {cfg} FAILED {type(e).__name__}: "
                        f"{str(e).splitlines()[0][:100]}",
                        flush=True,
                    )
                finally:
                    launch._base_config = orig
            if results:
                best = min(results)
                print(f"BEST {name} {which}: {best[1]} {best[0]:.3f} ms", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1].split(",") if len(sys.argv) > 1 else ("A", "B")))
