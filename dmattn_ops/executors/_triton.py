"""Triton, imported on first use.

`import dmattn_ops` needs no Triton: where it does not install (macOS, Windows) the PyTorch
paths (the chunked implementation, "flex", "reference") work without it. The kernels of
dmattn_ops.kernels are reached through LazyKernel, whose loader (a function importing the
kernel's module by name in its body) runs at the first launch. (Where Triton is installed,
PyTorch's own compile stack, which the package imports, imports it.)

Eager launches skip most of Triton's launch path (LaunchCache): `JITFunction.run` binds and
specialises every argument on every launch (42-88 us for our 75-87-argument
kernels on the H100's hosts, 105-127 us inside an eager call, where its C launcher alone takes
9-14 us). The first launch with a given specialisation goes through it and keeps the compiled
kernel it returns; later launches with the same key call that kernel directly.

The attention launchers go further (Prepared): a plan (dispatch/plan.py) fixes every argument
of its kernels but the tensors, so those are made once per plan and launch site, and the
compiled kernel is kept beside them, found again by the tensors' alignment alone.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import operator
import threading
from collections.abc import Callable
from types import ModuleType

import torch

from dmattn_ops.core.switches import getenv, switch

# Found once, at import, without importing it. A module constant rather than a cached function:
# torch.compile traces the public functions that ask, and warns about every functools.cache
# wrapper it traces through.
_FOUND = importlib.util.find_spec("triton") is not None


def available() -> bool:
    """Whether Triton is installed here."""
    return _FOUND


def interpreter_on() -> bool:
    """Whether Triton's interpreter runs the kernels (TRITON_INTERPRET=1): CPU tensors."""
    return getenv("TRITON_INTERPRET") == "1"


def torch_wrap_triton(fn):
    """torch.library.wrap_triton(fn), imported when first needed."""
    from torch.library import wrap_triton

    return wrap_triton(fn)


def launch_cache_on() -> bool:
    """Whether eager launches reuse compiled kernels (LaunchCache): not under the interpreter, and
    not where DMATTN_LAUNCH_CACHE=0 (read per launch)."""
    return switch("DMATTN_LAUNCH_CACHE", True) and not interpreter_on()


class LaunchCache:
    """The compiled kernels of one @triton.jit function, by launch key, for eager launches.

    A key holds everything Triton specialises a compiled kernel on, or more: the current device,
    the keyword arguments (constexprs, num_warps, num_stages) by value, the type of every
    positional argument, each tensor's dtype and whether its address is 16-byte aligned, and
    every other argument (ints, floats, bools, None) by value, and a TMA descriptor's dtype,
    block shape and shared-memory layout (its shape and strides are runtime values), so a hit is
    a launch that Triton would compile to the same kernel. Ints by exact value (Triton keys them
    only on == 1, divisibility by 16 and range) cost more entries for changing sizes, hence the
    bound of SIZE entries, the oldest evicted. The key is built in few Python steps, as the
    launches it saves are short: the types, taken in one pass, name the tensor and scalar
    positions once per layout, and those are then picked out by itemgetters.

    A hit launches the CompiledKernel through its own `kernel[grid](*args)`, which takes every
    parameter, constexprs included, in signature order (Triton 3.3 onwards: the kernel's source
    signature lists them all; older launchers take only the others, and then nothing is kept).
    Not kept: kernels with pre-run hooks (an autotuner's) or an asynchronous compile's future.
    """

    SIZE = 64

    def __init__(self):
        self._kernels: dict = {}
        self._lock = threading.Lock()
        self._layouts: dict = {}  # argument types -> (tensor picker, scalar picker)

    def key(self, args, kwargs, device: int) -> tuple:
        """The launch key of fn[grid](*args, **kwargs) on `device` (class doc)."""
        layout = tuple(map(type, args))
        pickers = self._layouts.get(layout)
        if pickers is None:
            pickers = self._layouts[layout] = _pickers(layout)
        tensors, scalars, descriptors = pickers
        return (
            device,
            layout,
            tuple(kwargs.items()),
            scalars(args),
            tuple([(t.dtype, t.data_ptr() & 15 == 0) for t in tensors(args)]),
            tuple([_descriptor_key(d) for d in descriptors(args)]),
        )

    def launch(self, fn, grid, args, kwargs, device: int):
        """fn[grid](*args, **kwargs) on the current device, `device`."""
        key = self.key(args, kwargs, device)
        entry = self._kernels.get(key)
        if entry is not None:
            compiled, tail = entry
            compiled[_grid3(grid)](*args, *tail)
            return compiled
        compiled = fn[grid](*args, **kwargs)
        tail = self._tail(fn, compiled, args, kwargs)
        if tail is not None:
            with self._lock:  # misses only: hits read the dict, which the GIL keeps whole
                while len(self._kernels) >= self.SIZE:
                    del self._kernels[next(iter(self._kernels))]
                self._kernels[key] = (compiled, tail)
        return compiled

    @staticmethod
    def _tail(fn, compiled, args, kwargs):
        """The values of the parameters after the positional ones, in signature order, for
        `compiled[grid](*args, *tail)`; None where the kernel is not to be kept (class doc)."""
        params = list(fn.signature.parameters.values())
        src = getattr(compiled, "src", None)
        if (
            getattr(fn, "pre_run_hooks", None)
            or not hasattr(compiled, "run")
            or len(getattr(src, "signature", ())) != len(params)
        ):
            return None
        tail = []
        for p in params[len(args) :]:
            value = kwargs.get(p.name, p.default)
            if value is p.empty:
                return None
            tail.append(value)
        return tuple(tail)

    def __len__(self) -> int:
        return len(self._kernels)


def _pickers(layout: tuple):
    """(tensors, scalars, descriptors): functions returning the tensor, the TMA descriptor and
    the other arguments of an argument tuple whose types are `layout`, as tuples."""
    tensor = [i for i, t in enumerate(layout) if issubclass(t, torch.Tensor)]
    descriptor = [i for i, t in enumerate(layout) if _is_descriptor(t)]
    other = sorted(set(range(len(layout))) - set(tensor) - set(descriptor))
    return _picker(tensor), _picker(other), _picker(descriptor)


def _is_descriptor(t: type) -> bool:
    """Triton's (and Gluon's) host-side TMA descriptors, TensorDescriptor, without importing
    Triton."""
    return t.__name__ == "TensorDescriptor" and t.__module__.startswith("triton.")


def _descriptor_key(d) -> tuple:
    """What Triton specialises a kernel on for a descriptor argument (its type string: dtype,
    block shape, shared-memory layout), and the base's 16-byte alignment."""
    return (
        d.base.dtype,
        d.base.data_ptr() & 15 == 0,
        tuple(d.block_shape),
        getattr(d, "layout", None),
        getattr(d, "padding", None),
    )


def _picker(index: list):
    if len(index) > 1:
        return operator.itemgetter(*index)
    if index:
        return lambda args, i=index[0]: (args[i],)
    return lambda args: ()


def _grid3(grid) -> tuple:
    grid = tuple(grid)
    return grid + (1,) * (3 - len(grid))


class Prepared:
    """One launch site's arguments other than its tensors, made once per plan (`prepared`, from
    the launchers of dispatch/launch.py and executors/tiles.py): the grid, the scalar
    positional arguments that follow the tensors, and the keyword ones (constexprs, num_warps,
    num_stages). LazyKernel.run launches it with the call's
    tensors. Eager launches on the GPU keep here, by the tensors' dtypes and 16-byte alignment
    (all Triton specialises a tensor on; everything else is fixed), the compiled kernel and the
    values of its trailing parameters (LaunchCache._tail), so that a repeated launch builds no
    LaunchCache key and goes straight to the compiled kernel's launcher."""

    __slots__ = ("compiled", "grid", "meta", "scalars")

    def __init__(self, grid: tuple, scalars: tuple, meta: dict):
        self.grid, self.scalars, self.meta = grid, scalars, meta
        self.compiled: dict = {}

    def __eq__(self, other) -> bool:
        """The same grid and arguments, each scalar of the same type (Triton specialises an int
        and a float of one value differently): the check of DMATTN_CHECK_PREPARED."""
        if not isinstance(other, Prepared):
            return NotImplemented
        return (self.grid, self.scalars, self.meta) == (other.grid, other.scalars, other.meta) and [
            type(v) for v in self.scalars
        ] == [type(v) for v in other.scalars]

    __hash__ = None  # mutable (its compiled kernels)

    def __repr__(self) -> str:
        return f"Prepared(grid={self.grid}, scalars={self.scalars}, meta={self.meta})"


def prepared(store: dict | None, key: tuple, build: Callable[[], Prepared]) -> Prepared:
    """The Prepared arguments of launch site `key` in `store` (a plan's `launches`; None: a
    caller without a plan, made each time), made by `build()` the first time (or any other
    value a plan fixes, and tuples of them). With
    DMATTN_CHECK_PREPARED=1 (the tests set it) every later use makes them again and raises
    where they differ: a plan then did not fix what the site's key claimed it does. A key with
    a symbolic size (a trace with dynamic shapes) keeps nothing."""
    if store is None:
        return build()
    try:
        found = store.get(key)
    except TypeError:  # a symbolic size or stride (torch.SymInt does not hash): made each time
        return build()
    if found is None:
        found = store[key] = build()
    elif switch("DMATTN_CHECK_PREPARED", False):
        fresh = build()
        if fresh != found:
            raise AssertionError(f"launch arguments of {key} changed under one plan: kept "
                                 f"{found}, now {fresh}")  # fmt: skip
    return found


def _alignment(tensors: tuple) -> tuple:
    """What Triton specialises each tensor argument on (dtype, 16-byte alignment), None for
    None."""
    return tuple([None if t is None else (t.dtype, t.data_ptr() & 15 == 0) for t in tensors])


_TRACING = 0  # > 0 while dmattn_ops/registration/inductor.py traces a launcher for a compiled graph


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
    its torch.library.wrap_triton wrapper). Eager launches go through a LaunchCache.

    `load` is the launching module's function that imports the kernel modules it launches
    from (`from dmattn_ops.kernels import attention_fwd`) in its body and returns them: the
    imports, which import Triton, run at the first launch and not at `import dmattn_ops`,
    while the code still names the modules. The kernel is the one of those modules that
    defines `name`."""

    def __init__(self, load: Callable[[], tuple[ModuleType, ...]], name: str):
        self._load, self._name = load, name
        self.launches = LaunchCache()

    @functools.cached_property
    def fn(self):
        modules = self._load()
        for module in modules:
            if hasattr(module, self._name):
                return getattr(module, self._name)
        # Not an AttributeError: from a property, Python would retry through __getattr__,
        # which asks for fn again (a RecursionError instead of this message).
        names = ", ".join(m.__name__ for m in modules)
        raise LookupError(f"no kernel {self._name!r} in {names}")

    def __getitem__(self, grid):
        fn = self.fn  # imported here: a missing kernel is named at `kernel[grid]`
        if tracing_on():
            return torch_wrap_triton(fn)[grid]
        if callable(grid) or not launch_cache_on():
            return fn[grid]
        return functools.partial(self._launch, fn, grid)

    def run(self, prepared: Prepared, tensors: tuple):
        """The launch `kernel[prepared.grid](*tensors, *prepared.scalars, **prepared.meta)`;
        eagerly on the GPU, through the compiled kernel kept in `prepared` (Prepared)."""
        fn = self.fn
        args = (*tensors, *prepared.scalars)
        if tracing_on():
            return torch_wrap_triton(fn)[prepared.grid](*args, **prepared.meta)
        if not launch_cache_on():
            return fn[prepared.grid](*args, **prepared.meta)
        key = (torch.cuda.current_device(), _alignment(tensors))
        entry = prepared.compiled.get(key)
        if entry is not None:
            compiled, tail = entry
            compiled[_grid3(prepared.grid)](*args, *tail)
            return compiled
        compiled = self.launches.launch(fn, prepared.grid, args, prepared.meta, key[0])
        tail = LaunchCache._tail(fn, compiled, args, prepared.meta)
        if tail is not None:
            if len(prepared.compiled) >= 8:  # alignments seen: a handful at most
                prepared.compiled.clear()
            prepared.compiled[key] = (compiled, tail)
        return compiled

    def _launch(self, fn, grid, *args, **kwargs):
        return self.launches.launch(fn, grid, args, kwargs, torch.cuda.current_device())

    def __getattr__(self, attr):
        if attr.startswith("_") or attr == "fn":
            raise AttributeError(attr)
        return getattr(self.fn, attr)

    def __repr__(self) -> str:
        return f"LazyKernel({self._name}, from {self._load.__module__}.{self._load.__qualname__})"
