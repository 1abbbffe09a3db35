"""Gluon launches with TMA descriptors at little host cost (executors/hopper.py's kernels).

A TMA descriptor is made and checked by Triton once per shape, strides, dtype, box and base
alignment (`tma`, `kept`) and copied with each later tensor of that key; and a launch whose
arguments (grid, scalars, constexprs, descriptors) follow from its operands' layout is kept per
layout (`launched`), so a repeated launch puts the call's tensors in place and calls the
compiled kernel's runner. Both caches hold no tensor.
"""

from __future__ import annotations

import copy
import functools

import torch

from dmattn_ops.core.switches import switch
from dmattn_ops.executors._triton import LaunchCache, _grid3, _is_descriptor, launch_cache_on

_LAYOUTS: dict = {}  # (dtype, box) -> the shared-memory layout of a TMA box


def shared_layout(dtype: torch.dtype, block: tuple):
    """Gluon's default shared-memory layout of a box of this dtype, made once per box (its
    get_default_for takes ~10 us a call)."""
    layout = _LAYOUTS.get((dtype, block))
    if layout is None:
        from triton.experimental.gluon import language as gl

        gdt = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32,
               torch.int32: gl.int32}[dtype]  # fmt: skip
        layout = _LAYOUTS[(dtype, block)] = gl.NVMMASharedLayout.get_default_for(list(block), gdt)
    return layout


_DESCRIPTORS: dict = {}  # (shape, strides, dtype, box, 16-byte aligned) -> a baseless descriptor


def kept(t: torch.Tensor, block: tuple):
    """A descriptor of t with `block` boxes made from the one kept for its shape, strides, dtype,
    box and base alignment (tma), or None.

    Triton's TensorDescriptor checks its fields when made (~8 us a descriptor on the CI's host,
    and a forward launch takes five); what it checks of the base is its dtype and 16-byte
    alignment, so a descriptor made and checked once serves every later tensor of that key,
    copied with its base. Only TMA-ready tensors are kept (the Hopper launchers make the others
    contiguous first), and the key decides readiness: the strides are in it and the storage
    offset's alignment is the base's (allocations start 16-byte aligned)."""
    found = _DESCRIPTORS.get(_descriptor_key(t, block))
    return None if found is None else _rebased(found, t)


def _descriptor_key(t: torch.Tensor, block: tuple) -> tuple:
    """_DESCRIPTORS' key of t with `block` boxes (kept)."""
    return t.shape, t.stride(), t.dtype, block, t.data_ptr() % 16 == 0


def _rebased(desc, base):
    """A copy of descriptor `desc` on `base`, its fields otherwise as they are (not checked
    again): through its __dict__ (0.5 us; copy.copy takes 2.4) where it has one, and set past a
    frozen dataclass's guard."""
    if hasattr(desc, "__dict__"):
        new = object.__new__(type(desc))
        new.__dict__.update(desc.__dict__)
    else:
        new = copy.copy(desc)
    object.__setattr__(new, "base", base)
    return new


def tma(t: torch.Tensor, block: tuple):
    """Gluon's TMA descriptor of t (its own shape and strides) with `block` boxes; made and
    checked once per key (kept), the cache holding no tensor."""
    desc = kept(t, block)
    return _made(t, block) if desc is None else desc


def _made(t: torch.Tensor, block: tuple):
    """A TMA descriptor of t made (and checked) by Triton, and kept for its key (kept)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    desc = TensorDescriptor(
        t, list(t.shape), list(t.stride()), list(block), shared_layout(t.dtype, block)
    )
    if len(_DESCRIPTORS) >= 256:  # shapes seen: a bound, not a working set
        _DESCRIPTORS.clear()
    _DESCRIPTORS[_descriptor_key(t, block)] = _rebased(desc, None)
    return desc


# Launches made ready once per operand layout (launched): _Ready entries by launch key, or
# _UNKEPT where a launch cannot be kept (an operand copied to make it TMA-ready, aliased
# operands, a kernel LaunchCache does not keep). A bound, not a working set: a model's calls
# take a handful of layouts.
_READY: dict = {}
_READY_SIZE = 64
_UNKEPT = object()


def launched(build):
    """The launcher of a Gluon kernel whose arguments `build(*operands)` makes, returning
    (kernel, grid, args, meta): every scalar and constexpr follows from the operands' shapes,
    strides, dtypes and 16-byte alignment, the current device and the scalar operands, so the
    first launch of each such layout keeps them (_Ready), and later ones only put the call's
    tensors in place and call the compiled kernel's runner: ~45 us of host time a launch
    against ~90 (descriptors, Triton's LaunchCache key and binder; H200, Triton 3.6, NOTES
    263), which a compiled step pays for each of its Gluon extern calls. What `build` reads
    besides its operands (the launcher module's tile constants) is taken as fixed: set it
    before the first launch. With DMATTN_CHECK_PREPARED=1 (the tests) every kept launch is
    made again and compared (_Ready.check), which catches a build that reads anything else.
    DMATTN_LAUNCH_CACHE=0 keeps nothing."""

    @functools.wraps(build)
    def launch(*operands) -> None:
        key = _launch_key(build, operands) if launch_cache_on() else None
        ready = None if key is None else _READY.get(key)
        if ready is not None and ready is not _UNKEPT:
            if switch("DMATTN_CHECK_PREPARED", False):
                ready.check(operands, *build(*operands))
            ready(operands)
            return
        kernel, grid, args, meta = build(*operands)
        compiled = kernel[grid](*args, **meta)
        if key is not None and ready is None:
            if len(_READY) >= _READY_SIZE:
                _READY.clear()
            _READY[key] = _Ready.made(compiled, kernel.fn, grid, operands, args, meta)

    return launch


def _launch_key(build, operands: tuple) -> tuple | None:
    """What a Gluon launch's arguments follow from (launched): the launcher, the current
    device, each tensor operand's shape, strides, dtype and 16-byte alignment, and the other
    operands (None, scale, flags, sizes) by value; None (nothing kept) off CUDA."""
    device = _cuda_device(operands[0])
    if device is None:
        return None
    return (
        build,
        device,
        *[
            (o.shape, o.stride(), o.dtype, o.data_ptr() & 15 == 0)
            if isinstance(o, torch.Tensor) else o
            for o in operands
        ],
    )  # fmt: skip


def _cuda_device(t: torch.Tensor) -> int | None:
    """The current CUDA device, where the launch of CUDA tensor t runs and its compiled kernel
    is loaded; None for a tensor elsewhere (tests/test_hopper_compile.py compiles the launches
    from CPU tensors)."""
    return torch.cuda.current_device() if t.is_cuda else None


class _Ready:
    """A Gluon launch fixed but for its tensors (launched): the compiled kernel's runner for
    the grid, the positional arguments with every scalar in place, which operand each tensor
    argument is and which each TMA descriptor reads (kept baseless, rebased per call:
    _rebased), and the values of the constexpr parameters (LaunchCache._tail). It holds no
    tensor."""

    __slots__ = ("args", "descriptors", "grid", "meta", "runner", "tail", "tensors")

    def __call__(self, operands: tuple) -> None:
        self.runner(*self.arguments(operands), *self.tail)

    def arguments(self, operands: tuple) -> list:
        """The launch's positional arguments with this call's operands."""
        args = list(self.args)
        for slot, i in self.tensors:
            args[slot] = operands[i]
        for slot, i, desc in self.descriptors:
            args[slot] = _rebased(desc, operands[i])
        return args

    @classmethod
    def made(cls, compiled, fn, grid, operands: tuple, args: tuple, meta: dict):
        """The _Ready of a launch just made, or _UNKEPT where an argument is no operand (a
        copy) or more than one (aliased operands), or LaunchCache would not keep the kernel."""
        tail = LaunchCache._tail(fn, compiled, args, meta)
        if tail is None:
            return _UNKEPT
        tensors, descriptors, fixed = [], [], list(args)
        for slot, arg in enumerate(args):
            descriptor = _is_descriptor(type(arg))
            if not (descriptor or isinstance(arg, torch.Tensor)):
                continue
            found = [i for i, o in enumerate(operands)
                     if (_reads(arg.base, o) if descriptor else o is arg)]  # fmt: skip
            if len(found) != 1:
                return _UNKEPT
            if descriptor:
                descriptors.append((slot, found[0], _rebased(arg, None)))
            else:
                tensors.append((slot, found[0]))
            fixed[slot] = None
        ready = cls()
        ready.runner, ready.grid, ready.args = compiled[_grid3(grid)], _grid3(grid), tuple(fixed)
        ready.tensors, ready.descriptors = tuple(tensors), tuple(descriptors)
        ready.tail, ready.meta = tail, dict(meta)
        return ready

    def check(self, operands: tuple, kernel, grid, args: tuple, meta: dict) -> None:
        """Raises where the arguments made afresh (`build`'s) differ from the kept ones with
        these operands: the launch key then left out something the arguments follow from."""
        kept = self.arguments(operands)
        same = (
            _grid3(grid) == self.grid and meta == self.meta and len(kept) == len(args)
            and all(_same_argument(a, b) for a, b in zip(kept, args))
        )  # fmt: skip
        if not same:
            raise AssertionError(f"{kernel}: kept launch arguments {kept} {self.meta} differ "
                                 f"from those made now: {list(args)} {meta}")  # fmt: skip


def _reads(base: torch.Tensor, operand) -> bool:
    """Whether a descriptor's base is (a view of the whole of) this operand: its memory, dtype
    and size."""
    return (
        isinstance(operand, torch.Tensor) and operand.data_ptr() == base.data_ptr()
        and operand.dtype == base.dtype and operand.numel() == base.numel()
    )  # fmt: skip


def _fields(desc) -> dict:
    """A TMA descriptor's fields but its base."""
    return {name: value for name, value in vars(desc).items() if name != "base"}


def _same_argument(a, b) -> bool:
    """Whether two launch arguments are the same: a tensor by identity, a TMA descriptor by
    its base's memory and dtype and its other fields, a scalar by type and value."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    if _is_descriptor(type(a)) and type(a) is type(b):
        return _reads(a.base, b.base) and _fields(a) == _fields(b)
    return type(a) is type(b) and a == b
