"""Dense calls through PyTorch's fused attention kernels (cuDNN or FlashAttention-2).

A call with no mask, bias, softcap or seqused_k is plain softmax attention; on CUDA in
float16/bfloat16 PyTorch ships fused forward and backward kernels for it that are faster than our
dense Triton kernels on Hopper (bench/NOTES.md 22, 26). The forward op then runs the kernel that
`scaled_dot_product_attention` itself would pick for these tensors (`torch._fused_sdp_choice`):
`aten._scaled_dot_product_cudnn_attention` where PyTorch picks cuDNN (on the H100, D128 GQA
causal: 0.72 ms forward+backward against flash's 1.23 ms), else
`aten._scaled_dot_product_flash_attention`. Both return the natural-log logsumexp the contract
needs, so either backward can follow either forward. Both sit below the ops' autograd, vmap and
autocast kernels, so every transform keeps its behaviour; only the kernel differs.

The backward falls back to our kernels when it must: a gradient of lse (the fused backwards
cannot take one), or deterministic=True (they accumulate dq with atomics).

DMATTN_DENSE_SDPA=0 in the environment (read per call) forces our Triton kernels; the test
suite sets it, so the Triton dense kernels stay tested, and tests/test_sdpa.py covers this path.
PyTorch's own switches apply: `torch.backends.cuda.enable_cudnn_sdp(False)` /
`enable_flash_sdp(False)` or an `sdpa_kernel` context rule the kernel out, and GPUs before sm_80
(no flash kernels) never take this path.
"""

from __future__ import annotations

import functools
import os

import torch

DTYPES = (torch.float16, torch.bfloat16)
FLASH, CUDNN = "flash", "cudnn"
_CUDNN_CHOICE = 3  # torch.nn.attention.SDPBackend.CUDNN_ATTENTION, as _fused_sdp_choice returns it
_CUDNN_MAX_HEAD_DIM = 128  # cuDNN's backward on Hopper; larger head dims go to flash


@functools.cache
def _flash_capable(index: int) -> bool:
    """PyTorch's flash kernels need sm_80 or newer."""
    return torch.cuda.get_device_capability(index) >= (8, 0)


def kernel(query, key, value, mask, bias, is_causal, softcap, seqused_k) -> str | None:
    """The PyTorch kernel ("cudnn" or "flash") that computes this call exactly as our contract
    says, or None when the call stays on ours. It must be dense attention: no mask, bias,
    softcap or seqused_k; causal only with Lq == Lk (where the fused kernels' top-left alignment
    is our bottom-right one); CUDA fp16/bf16 on sm_80+ with one head dim, a multiple of 8 up to
    256, unit stride along it; DMATTN_DENSE_SDPA not "0". cuDNN where SDPA would pick it (head
    dims up to 128), else flash where PyTorch's flash backend is enabled."""
    if mask is not None or bias is not None or seqused_k is not None or softcap > 0:
        return None
    if not (query.is_cuda and query.dtype in DTYPES):
        return None
    if os.environ.get("DMATTN_DENSE_SDPA", "1") == "0":
        return None
    index = query.device.index
    if not _flash_capable(torch.cuda.current_device() if index is None else index):
        return None
    d = query.shape[-1]
    if value.shape[-1] != d or d % 8 or d > 256:
        return None
    if is_causal and query.shape[1] != key.shape[1]:
        return None
    if not all(t.stride(-1) == 1 for t in (query, key, value)):
        return None
    if d <= _CUDNN_MAX_HEAD_DIM and torch.backends.cuda.cudnn_sdp_enabled():
        choice = torch._fused_sdp_choice(
            query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), None, 0.0,
            bool(is_causal), enable_gqa=query.shape[2] != key.shape[2],
        )  # fmt: skip
        if choice == _CUDNN_CHOICE:
            return CUDNN
    return FLASH if torch.backends.cuda.flash_sdp_enabled() else None


def forward(query, key, value, scale, is_causal, which):
    """(out (B, Lq, H, D), lse (B, H, Lq) float32, lse_rem zeros) of a dense call through the
    kernel `which` ("cudnn" or "flash")."""
    qt, kt, vt = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    if which == CUDNN:
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
            qt, kt, vt, None, True, 0.0, bool(is_causal), False, scale=float(scale)
        )[:2]
        lse = lse.squeeze(-1)  # cuDNN's statistics are (B, H, Lq, 1)
    else:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
            qt, kt, vt, 0.0, bool(is_causal), False, scale=float(scale)
        )[:2]
    # Contiguous like the Triton path's outputs and the fake kernels (a no-op here: both write
    # (B, Lq, H, D) rows and return them transposed, and (B, H, Lq) statistics).
    lse = lse.contiguous()
    return out.transpose(1, 2).contiguous(), lse, torch.zeros_like(lse)


def backward(grad_out, query, key, value, out, lse, scale, is_causal, which):
    """dq, dk, dv of a dense call (no lse gradient), contiguous, in the inputs' dtypes, through
    the kernel `which`."""
    lq, lk = query.shape[1], key.shape[1]
    # Both kernels want the rows of grad_out and out as the forward wrote them.
    grad_out, out, lse = grad_out.contiguous(), out.contiguous(), lse.contiguous()
    qt, kt, vt = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    unused = torch.empty((), dtype=torch.long, device=query.device)  # dropout's RNG state
    if which == CUDNN:
        grads = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            grad_out.transpose(1, 2), qt, kt, vt, out.transpose(1, 2), lse.unsqueeze(-1),
            unused, unused, None, None, None, lq, lk, 0.0, bool(is_causal), scale=float(scale),
        )  # fmt: skip
    else:
        grads = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            grad_out.transpose(1, 2), qt, kt, vt, out.transpose(1, 2), lse, None, None, lq, lk,
            0.0, bool(is_causal), unused, unused, scale=float(scale),
        )  # fmt: skip
    # The gradients take the layout of the (transposed) inputs; the fake kernels promise
    # contiguous ones, as the Triton path returns.
    return tuple(g.transpose(1, 2).contiguous() for g in grads)
