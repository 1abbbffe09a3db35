"""Dynamic Mask Attention as PyTorch custom ops (``torch.ops.dmattn``) backed by Triton kernels."""

from dmattn_ops import flex, inductor, masks, nn, ops, reference
from dmattn_ops.api import attention, attention_varlen, flash_attn_func, flash_attn_varlen_func

__all__ = [
    "attention",
    "attention_varlen",
    "flash_attn_func",
    "flash_attn_varlen_func",
    "flex",
    "masks",
    "nn",
    "ops",
    "reference",
]
__version__ = "0.1.0"

inductor.register()
