"""Mask construction against attention time: ``python -m bench.masks``.

The shape flash-dmattn users measured (B2 H8 Hkv4 D64 L4096, fp16; 3.6-6.9 ms of mask creation
against 0.7-1.0 ms of attention): a learned bias per (KV head, key), (B, Hkv, 1, Lk), as in the
DMA layer, and a bias per (KV head, query, key), (B, Hkv, Lq, Lk), the 4-D case; top-k windows
of 512 and 2048 keys, with and without block smoothing, then attention with that mask and bias
(causal, forward and forward+backward). Medians of triton.testing.do_bench.
"""

from __future__ import annotations

import argparse
import sys

import torch

import dmattn_ops
from dmattn_ops import masks


def main(argv=None) -> int:
    argparse.ArgumentParser(
        prog="python -m bench.masks", description=__doc__.splitlines()[0]
    ).parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.masks needs a CUDA device")
        return 0
    import triton

    b, h, hkv, d, length = 2, 8, 4, 64, 4096
    dev, dtype = "cuda", torch.float16
    q = torch.randn(b, length, h, d, device=dev, dtype=dtype)
    k = torch.randn(b, length, hkv, d, device=dev, dtype=dtype)
    v = torch.randn(b, length, hkv, d, device=dev, dtype=dtype)
    grad = torch.randn_like(q)

    def ms(fn):
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")

    print(f"device {torch.cuda.get_device_name()} | torch {torch.__version__} | "
          f"triton {triton.__version__} | B{b} H{h} Hkv{hkv} D{d} L{length} fp16 "
          "causal")  # fmt: skip
    print("| bias | window | block | mask ms | attn fwd ms | attn fwd+bwd ms | mask / fwd+bwd |")
    print("|---|---|---|---|---|---|---|")
    for rows in (1, length):
        bias = torch.randn(b, hkv, rows, length, device=dev, dtype=dtype)
        for window in (512, 2048):
            for block in (None, 64):
                t_mask = ms(lambda b=bias, w=window, s=block: masks.topk_mask(b, w, block_size=s))
                mask = masks.topk_mask(bias, window, block_size=block)
                leaves = [t.detach().requires_grad_() for t in (q, k, v, bias)]

                def fwd(mask=mask, bias=bias):
                    with torch.no_grad():
                        dmattn_ops.attention(q, k, v, mask, bias, is_causal=True)

                def fwdbwd(mask=mask, leaves=leaves):
                    out = dmattn_ops.attention(*leaves[:3], mask, leaves[3], is_causal=True)
                    out.backward(grad)

                t_fwd, t_all = ms(fwd), ms(fwdbwd)
                shape = "(B,Hkv,1,L)" if rows == 1 else "(B,Hkv,L,L)"
                print(f"| {shape} | {window} | {block or '-'} | {t_mask:.3f} | {t_fwd:.3f} | "
                      f"{t_all:.3f} | {t_mask / t_all:.2f} |", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
