"""Triton, imported on first use.

`import dmattn_ops` does not import Triton: where it does not install (macOS, Windows) the
PyTorch paths (the chunked implementation, "flex", "reference") work without it. The kernels
of dmattn_ops.kernels are reached through LazyKernel, which imports them (and Triton) at their
first launch.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os


@functools.cache
def available() -> bool:
    """Whether Triton can be imported here."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreter_on() -> bool:
    """Whether Triton's interpreter runs the kernels (TRITON_INTERPRET=1): CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def torch_wrap_triton(fn):
    """torch.library.wrap_triton(fn), imported when first needed."""
    from torch.library import wrap_triton

    return wrap_triton(fn)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


_TRACING = 0  # > 0 while dmattn_ops/inductor.py traces a launcher for a compiled graph


@contextlib.contextmanager
def tracing():
    """Launches inside go through torch.library.wrap_triton: under make_fx they are recorded
    into the graph (Inductor then compiles and launches the kernels) instead of run."""
    global _TRACING
    _TRACING += 1
    try:
        yield
    finally:
        _TRACING -= 1


def tracing_on() -> bool:
    """Whether launches are being traced into a compiled graph (inside `tracing()`)."""
    return _TRACING > 0


class LazyKernel:
    """A kernel of dmattn_ops.kernels, imported at its first use: `kernel[grid](...)` and
    attribute access behave as on the @triton.jit function itself (inside `tracing()`, as on
    its torch.library.wrap_triton wrapper)."""

    def __init__(self, module: str, name: str):
        self._module, self._name = module, name

    @functools.cached_property
    def fn(self):
        module = importlib.import_module(f"dmattn_ops.kernels.{self._module}")
        try:
            return getattr(module, self._name)
        except AttributeError:
            # Not an AttributeError: from a property, Python would retry through __getattr__,
            # which asks for fn again (a RecursionError instead of this message).
            raise LookupError(f"{module.__file__} defines no kernel {self._name!r}") from None

    def __getitem__(self, grid):
        if tracing_on():
            return torch_wrap_triton(self.fn)[grid]
        return self.fn[grid]

    def __getattr__(self, attr):
        if attr.startswith("_") or attr == "fn":
            raise AttributeError(attr)
        return getattr(self.fn, attr)

    def __repr__(self) -> str:
        return f"LazyKernel(dmattn_ops.kernels.{self._module}.{self._name})"
