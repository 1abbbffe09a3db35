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
from torch._subclasses.fake_tensor import is_fake

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
    if (
        d <= _CUDNN_MAX_HEAD_DIM
        and torch.backends.cuda.cudnn_sdp_enabled()
        and _sdpa_choice(query, key, value, bool(is_causal)) == _CUDNN_CHOICE
    ):
        return CUDNN
    return FLASH if torch.backends.cuda.flash_sdp_enabled() else None


def _sdpa_choice(query, key, value, is_causal: bool) -> int:
    """`torch._fused_sdp_choice` for these (B, L, H, D) tensors: the kernel PyTorch's SDPA would
    run. On the fake tensors of a compiled graph's trace it would answer for meta tensors (the
    math kernel), so there it asks about real tensors of the same sizes, strides and dtype."""
    if not is_fake(query):
        return _choice_of(query, key, value, is_causal)
    metas = tuple((tuple(t.shape), tuple(t.stride())) for t in (query, key, value))
    if not all(isinstance(n, int) for shape, stride in metas for n in shape + stride):
        return -1  # symbolic sizes: no real tensors to ask about (the flash kernel then)
    flags = (
        torch.backends.cuda.flash_sdp_enabled(),
        torch.backends.cuda.mem_efficient_sdp_enabled(),
        torch.backends.cuda.math_sdp_enabled(),
    )
    return _traced_choice(metas, query.dtype, query.device, is_causal, flags)


def _choice_of(query, key, value, is_causal: bool) -> int:
    qt, kt, vt = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    return torch._fused_sdp_choice(
        qt, kt, vt, None, 0.0, is_causal, enable_gqa=query.shape[2] != key.shape[2]
    )


@functools.lru_cache(maxsize=64)
def _traced_choice(metas, dtype, device, is_causal, flags) -> int:
    """The choice for real tensors with these (shape, stride) pairs, allocated outside the
    trace's modes, once per compiled call site and freed at once."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        try:
            real = [torch.empty_strided(s, st, dtype=dtype, device=device) for s, st in metas]
        except torch.OutOfMemoryError:
            return -1
        return _choice_of(*real, is_causal)


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
