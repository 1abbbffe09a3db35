"""Mask construction against attention time: ``python -m bench.masks``.

The shape flash-dmattn users measured (B2 H8 Hkv4 D64 L4096, fp16; 3.6-6.9 ms of mask creation
against 0.7-1.0 ms of attention): a learned bias per (KV head, key), (B, Hkv, 1, Lk), as in the
DMA layer, and a bias per (KV head, query, key), (B, Hkv, Lq, Lk), the 4-D case; top-k windows
of 512 and 2048 keys, with and without block smoothing, then attention with that mask and bias
(causal, forward and forward+backward). Medians of triton.testing.do_bench.

Then the long rows of bench.model's L/4 DMA layers (B1 Hkv4, a bias per key, top L/4): the
fused kernel (chunked past masks.FUSED_MAX_KEYS keys) against torch.topk, the path those
rows took before (`--long-only` runs just that table).
"""

from __future__ import annotations

import argparse
import sys

import torch

import dmattn_ops
from dmattn_ops import masks


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.masks", description=__doc__)
    parser.add_argument("--long-only", action="store_true", help="only the long rows' table")
    args = parser.parse_args(argv)
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
    if not args.long_only:
        short_table(q, k, v, grad, ms)
    long_table(ms)
    return 0


def long_table(ms) -> None:
    print("| B1 Hkv4 bias (1, 4, 1, L), bf16, top L/4 | fused ms | torch.topk ms |")
    print("|---|---|---|")
    for length in (16384, 32768, 65536):
        bias = torch.randn(1, 4, 1, length, device="cuda", dtype=torch.bfloat16)
        fused = ms(lambda b=bias: masks.topk_mask(b, b.shape[-1] // 4))
        applies = masks._fused_applies
        masks._fused_applies = lambda score, k: False
        try:
            plain = ms(lambda b=bias: masks.topk_mask(b, b.shape[-1] // 4))
        finally:
            masks._fused_applies = applies
        print(f"| L{length} | {fused:.3f} | {plain:.3f} |", flush=True)


def short_table(q, k, v, grad, ms) -> None:
    b, length, hkv = q.shape[0], q.shape[1], k.shape[2]
    dev, dtype = q.device, q.dtype
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


if __name__ == "__main__":
    sys.exit(main())
