"""Dense calls through PyTorch's fused FlashAttention-2 kernels.

A call with no mask, bias, softcap or seqused_k is plain softmax attention; on CUDA in
float16/bfloat16 PyTorch ships a FlashAttention-2 forward and backward for it that are faster
than our dense Triton kernels on Hopper (bench/NOTES.md). The forward op then runs
`aten._scaled_dot_product_flash_attention`, which returns the same natural-log lse the contract
needs, and the backward op `aten._scaled_dot_product_flash_attention_backward`. Both sit below
the ops' autograd, vmap and autocast kernels, so every transform keeps its behaviour; only the
kernel differs.

The backward falls back to our kernels when it must: a gradient of lse (flash's backward
cannot take one), or deterministic=True (flash accumulates dq with atomics).

DMATTN_DENSE_SDPA=0 in the environment (read per call) forces our Triton kernels; the test
suite sets it, so the Triton dense kernels stay tested, and tests/test_sdpa.py covers this path.
`torch.backends.cuda.enable_flash_sdp(False)` turns it off too, and GPUs before sm_80 (no
flash kernels) never take it.
"""

from __future__ import annotations

import functools
import os

import torch

DTYPES = (torch.float16, torch.bfloat16)


def enabled() -> bool:
    """DMATTN_DENSE_SDPA is not "0", and PyTorch's flash backend is on
    (torch.backends.cuda.enable_flash_sdp)."""
    switch = os.environ.get("DMATTN_DENSE_SDPA", "1") != "0"
    return switch and torch.backends.cuda.flash_sdp_enabled()


@functools.cache
def _flash_capable(index: int) -> bool:
    """PyTorch's flash kernels need sm_80 or newer."""
    return torch.cuda.get_device_capability(index) >= (8, 0)


def applies(query, key, value, mask, bias, is_causal, softcap, seqused_k) -> bool:
    """Whether this call is dense attention that PyTorch's flash kernels compute exactly as our
    contract says: no mask, bias, softcap or seqused_k; causal only with Lq == Lk (where flash's
    top-left alignment is our bottom-right one); CUDA fp16/bf16 with one head dim, a multiple of
    8 up to 256, unit stride along it."""
    if mask is not None or bias is not None or seqused_k is not None or softcap > 0:
        return False
    if not (query.is_cuda and query.dtype in DTYPES and enabled()):
        return False
    index = query.device.index
    if not _flash_capable(torch.cuda.current_device() if index is None else index):
        return False
    d = query.shape[-1]
    if value.shape[-1] != d or d % 8 or d > 256:
        return False
    if is_causal and query.shape[1] != key.shape[1]:
        return False
    return all(t.stride(-1) == 1 for t in (query, key, value))


def forward(query, key, value, scale, is_causal):
    """(out (B, Lq, H, D), lse (B, H, Lq) float32, lse_rem zeros) of a dense call."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
        0.0, bool(is_causal), False, scale=float(scale),
    )[:2]  # fmt: skip
    # Contiguous like the Triton path's outputs and the fake kernels (a no-op here: flash
    # writes (B, Lq, H, D) rows and returns them transposed).
    return out.transpose(1, 2).contiguous(), lse, torch.zeros_like(lse)


def backward(grad_out, query, key, value, out, lse, scale, is_causal):
    """dq, dk, dv of a dense call (no lse gradient), contiguous, in the inputs' dtypes."""
    lq, lk = query.shape[1], key.shape[1]
    if grad_out.stride(-1) != 1:
        grad_out = grad_out.contiguous()
    if out.stride(-1) != 1:
        out = out.contiguous()
    unused = torch.empty((), dtype=torch.long, device=query.device)  # dropout's RNG state
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        grad_out.transpose(1, 2), query.transpose(1, 2), key.transpose(1, 2),
        value.transpose(1, 2), out.transpose(1, 2), lse, None, None, lq, lk, 0.0,
        bool(is_causal), unused, unused, scale=float(scale),
    )  # fmt: skip
    # Flash's gradients take the layout of its (transposed) inputs; the fake kernels promise
    # contiguous ones, as the Triton path returns.
    return tuple(g.transpose(1, 2).contiguous() for g in (dq, dk, dv))
