"""The ops an executor registers for its launches (executors/hopper.py's Gluon kernels,
executors/cudnn_graphs.py's cuDNN graphs).

Each is an op of its own so that a compiled graph (registration/inductor.py traces the
launchers) keeps the launch as a node, as it keeps PyTorch's cuDNN attention ops. They are
defined through a torch.library.Library fragment rather than torch.library.custom_op, whose
Python wrappers around mutated arguments cost ~60 us a call, paid again at each launch that a
compiled graph makes.
"""

from __future__ import annotations

import torch

_lib = torch.library.Library("dmattn", "FRAGMENT")


def define_launch(schema: str, impl) -> None:
    """Op dmattn::<name> of `schema` (name(args) -> (), every output a mutated argument),
    implemented by `impl` for CUDA; its fake kernel does nothing (it returns nothing and its
    outputs already have their shapes)."""
    name = schema.split("(", 1)[0]
    _lib.define(schema)
    _lib.impl(name, impl, "CUDA")
    torch.library.register_fake(f"dmattn::{name}", _writes_only, lib=_lib)


def _writes_only(*args) -> None:
    return None
