"""Dynamic Mask Attention as PyTorch custom ops (``torch.ops.dmattn``) backed by Triton kernels."""

from dmattn_ops import flex, masks, nn, reference
from dmattn_ops.api import attention, attention_varlen, explain
from dmattn_ops.core.options import KernelOptions, kernel_options
from dmattn_ops.flash import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)
from dmattn_ops.registration import inductor, ops

__all__ = [
    "KernelOptions",
    "attention",
    "attention_varlen",
    "explain",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
    "flex",
    "kernel_options",
    "masks",
    "nn",
    "ops",
    "reference",
]
__version__ = "0.1.0"

inductor.register()
