"""Dynamic Mask Attention as PyTorch custom ops (``torch.ops.dmattn``) backed by Triton kernels."""

from dmattn_ops import flex, ops, reference
from dmattn_ops.api import attention

__all__ = ["attention", "flex", "ops", "reference"]
__version__ = "0.1.0"
