"""Dynamic Mask Attention as PyTorch custom ops (``torch.ops.dmattn``) backed by Triton kernels."""

from dmattn_ops import flex, masks, nn, reference
from dmattn_ops.api import (
    attention,
    attention_varlen,
    explain,
    flash_attn_func,
    flash_attn_varlen_func,
)
from dmattn_ops.core.options import KernelOptions, kernel_options
from dmattn_ops.registration import inductor, ops

__all__ = [
    "KernelOptions",
    "attention",
    "attention_varlen",
    "explain",
    "flash_attn_func",
    "flash_attn_varlen_func",
    "flex",
    "kernel_options",
    "masks",
    "nn",
    "ops",
    "reference",
]
__version__ = "0.1.0"

inductor.register()
