"""Triton kernels of dmattn_ops, installed as ``dmattn_ops.kernels``.

Only @triton.jit code lives here: no torch.library, no autograd.
"""
