"""Compiled graphs launch our kernels themselves.

Eagerly, each dmattn op runs its Python launcher (launch.py) on every call: allocations, tile
tables or key lists, and Triton launches through ``JITFunction.run``, which binds and
specialises some 60 arguments per launch. In a model compiled in the default mode (no CUDA
graphs) that host time is paid on every call and leaves the GPU idle.

Under torch.compile, AOTAutograd traces the graph under ``FunctionalTensorMode``. For CUDA
tensors the rules below replace the kernel-carrying ops (``attention_forward``,
``attention_backward``, their varlen pair, ``topk_select``, and the public ``attention`` and
``attention_varlen`` where a call wants no gradient: inference and decode steps) by their own
CUDA kernels (ops.py: validation, then the launcher; masks.topk_select), traced: the
allocations become graph buffers and every Triton launch goes through
``torch.library.wrap_triton`` (_triton.tracing), so Inductor compiles the kernels into the graph
and launches them from its generated code, with the grids and arguments computed there.
This is how ``torch.library.triton_op`` works (torch/_library/triton.py); it is applied here
below the ops' hand-written autograd and vmap kernels (ops.py says why those cannot come from
register_autograd), so eager calls, torch.func, opcheck and the fake kernels are unchanged.

Inductor launches them through its static launcher where it can (static_launch.py).

Graphs with symbolic sizes (``torch.compile(dynamic=True)``, or PyTorch's automatic dynamic
shapes once a second sequence length was seen) are traced too. The launchers then compute grids
and scalars as expressions of the sizes, and make the choices that only change speed (tile
configurations, the dK/dV split, head packing, the decode split) from the example sizes the
graph is traced with, without guarding on them (core/device.hint). Paths that would guard on a
size, or were never traced with symbolic ones, are left out: the decode kernel for a symbolic Lq
(it takes a fixed Lq <= 16), the Gluon kernels (traced and tested with fixed sizes only), the
tile tables (their kernels are sized by the length: masks with query rows are read in the dense
kernels), a window on PyTorch's fused kernels (whole chunks of L and a tail: our kernels take
it); the top-k kernel reads a symbolic row in chunks, so that one kernel serves every length
(a row within its block is still held in registers: kernels/topk_mask.py)
(tests/test_inductor.py checks every guard the traced launchers leave holds from 2 tokens to
40000). So such a graph is not compiled again for new lengths, and runs each of them with the
example's configurations. bench.model's DMA step compiled with dynamic=True on an H200: B4 L2048
6.88 ms traced, 11.92 ms with the ops whole (static: 6.64).
DMATTN_SYMBOLIC_KERNELS=0 keeps the ops whole in such graphs (symbolic_enabled()). The varlen
ops are traced there too, with one buffer shaped for it: functionalization clones the buffers a
kernel writes and checks their layout, and the key lists' ends, (B, H, query tiles), guarded on
a dim of 1 (a graph first compiled with every sequence within one 16-row query tile compiled
again for longer ones on an H200, where the contract (SPEC) says no recompiles for new
cu_seqlens). Under symbolic sizes that buffer is one flat row (tiles._per_query_tile);
tests/test_varlen.py's dynamic test checks it.

The ops stay whole (one node each) for torch.export, which keeps them serialisable as
triton_op does; for CPU tensors (Triton's interpreter cannot run on fake tensors, and the
chunked PyTorch path gains nothing); and where DMATTN_INDUCTOR_KERNELS=0 (see enabled()).

``dmattn::topk_select`` is traced the same way. Its kernel writes bytes and the traced body
returns ``bytes != 0``, not the bool buffer itself: Inductor inlines a buffer allocated by
torch.empty and written only by a user-defined kernel as its constant fill value (False) when
FlexAttention's mask_mod captures it, because the mask_mod's subgraph lowering keeps its own
empty set of mutated buffers (torch 2.11, torch/_inductor/ir.py ComputedBuffer.make_loader);
a compiled ``DynamicMaskAttention(backend="flex")`` then attended to nothing
(tests/test_flex.py holds it). ``!= 0`` is an ordinary kernel that reads the buffer.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import pathlib
import weakref

import torch
from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode

from dmattn_ops.core import options
from dmattn_ops.core.device import symbolic
from dmattn_ops.core.switches import switch
from dmattn_ops.dispatch import launch, plan
from dmattn_ops.executors import _triton, cudnn_graphs
from dmattn_ops.registration import ops
from dmattn_ops.registration.calls import bind
from dmattn_ops.registration.static_launch import launch_statically

log = logging.getLogger(__name__)


def enabled() -> bool:
    """On unless DMATTN_INDUCTOR_KERNELS=0 (read per trace): then compiled graphs keep the ops
    whole and run the eager launchers."""
    return switch("DMATTN_INDUCTOR_KERNELS", True)


def symbolic_enabled() -> bool:
    """On unless DMATTN_SYMBOLIC_KERNELS=0 (read per trace): graphs with symbolic sizes trace
    the kernels too (module docstring); off, such graphs keep the ops whole."""
    return switch("DMATTN_SYMBOLIC_KERNELS", True)


def _export_keeps_ops() -> bool:
    try:
        from torch.export._trace import custom_triton_ops_decomposition_disabled
    except ImportError:  # older torch: export traces with the ops whole anyway
        return False
    return custom_triton_ops_decomposition_disabled()


def _traced() -> bool:
    """Whether this is a trace on fake tensors (a compiled graph), not an eager
    functionalisation of real tensors."""
    return torch._guards.detect_fake_mode() is not None


def applies(first: torch.Tensor) -> bool:
    """Whether an op call whose first tensor is `first` is traced into the graph: CUDA in a dtype
    our kernels take (float64 runs the chunked PyTorch path, whose varlen form reads
    cu_seqlens and cannot be traced on fake tensors), the path switched on, a compiled graph's
    trace, not torch.export."""
    return (
        first.is_cuda
        and first.dtype in plan.TRITON_DTYPES
        and enabled()
        and _traced()
        and not _export_keeps_ops()
    )


def _sizes(args) -> str | None:
    """None where every tensor argument's sizes are fixed; "symbolic" where one is symbolic
    (torch.compile(dynamic=True), or a size that changed since the first compile);
    "unbacked" where one has no example value (a data-dependent size: the launchers' speed
    choices read the example's, core/device.hint, so such a call keeps the op whole)."""
    found = None
    for t in args:
        if not isinstance(t, torch.Tensor):
            continue
        for s in t.shape:
            if symbolic(s):
                if s.node.hint is None:
                    return "unbacked"
                found = "symbolic"
    return found


# One trace's key lists (launch.KeptLists), by the trace's mode: the backward of a training
# graph, traced in the same pass as its forward, reads the forward's lists (AOTAutograd then
# saves their buffers for the backward graph) instead of launching a key_lists kernel again.
_KEPT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _kept(mode) -> launch.KeptLists:
    found = _KEPT.get(mode)
    if found is None:
        found = _KEPT[mode] = launch.KeptLists()
    return found


def _rule(body, op, keeps_lists: bool):
    """The FunctionalTensorMode rule of one op: its CUDA kernel's body, traced, where it applies
    (with symbolic sizes too where symbolic_enabled()); the op as one node otherwise.
    keeps_lists: the body takes the trace's KeptLists."""

    def rule(mode, op_, types, args, kwargs):
        known = (torch.Tensor, FunctionalTensor, torch._subclasses.FakeTensor)
        if any(not issubclass(t, known) for t in types):
            return NotImplemented
        call = bind(op, args, kwargs)
        first = next(v for v in call.values() if isinstance(v, torch.Tensor))
        if not applies(first):
            return mode.__torch_dispatch__(op_, types, args, kwargs)
        sizes = _sizes(args)
        if sizes == "unbacked" or (sizes and not symbolic_enabled()):
            return mode.__torch_dispatch__(op_, types, args, kwargs)
        launch_statically()
        if keeps_lists:
            kwargs = {**kwargs, "kept": _kept(mode)}
        with mode, _triton.tracing():
            return body(*args, **kwargs)

    return rule


# What a traced launcher's choices depend on, for Inductor's caches. AOTAutograd's cache keys a
# compiled graph on the Dynamo graph, where each of our ops is one node, so the route the rules
# above traced (sdpa.py, cudnn_graphs.py, the Hopper kernels, our Triton kernels and their
# configs) would be reused from the cache after an upgrade of this package or a change of a
# DMATTN_* switch, and the traced kernels' sources with it (a cached graph
# called an op that the code it ran with no longer defined). That key includes the sources of
# the Triton kernels torch.library.triton_op records per op
# (torch/_functorch/_aot_autograd/autograd_cache.py, _iter_triton_kernels_from_node); each of
# our ops records one stand-in there whose source is this fingerprint, read when a key is made.


@functools.cache
def _source_digest() -> str:
    """sha256 of this package's Python sources, the kernels' included (found without importing
    them, which would import Triton)."""
    kernels = importlib.util.find_spec("dmattn_ops.kernels").submodule_search_locations
    digest = hashlib.sha256()
    package = pathlib.Path(ops.__file__).parent.parent
    for folder in (package, *map(pathlib.Path, kernels)):
        for path in sorted(folder.rglob("*.py")):
            digest.update(str(path.relative_to(folder)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def fingerprint() -> str:
    """The state a traced launcher's choices depend on beyond the graph: the package's sources,
    the DMATTN_* switches, the active kernel_options blocks, PyTorch's fused-attention switches
    and the cuDNN frontend."""
    switches = sorted((k, v) for k, v in os.environ.items() if k.startswith("DMATTN_"))
    switches.append(("kernel_options", options.active()))
    backends = torch.backends.cuda
    fused = (
        backends.flash_sdp_enabled(), backends.cudnn_sdp_enabled(),
        backends.mem_efficient_sdp_enabled(), backends.math_sdp_enabled(),
    )  # fmt: skip
    frontend = cudnn_graphs.version()
    return f"# dmattn_ops {_source_digest()} {switches} {fused} {frontend}\n"


class _Fingerprint:
    """Stands in for a Triton kernel in torch.library's record of an op's kernels: the cache key
    reads its `src` (and walks `fn`, which references nothing)."""

    __name__ = "dmattn_ops_fingerprint"

    @property
    def src(self) -> str:
        return fingerprint()

    @staticmethod
    def fn() -> None:
        return None


def key_compiled_graphs_on_fingerprint() -> None:
    """Record the fingerprint for every dmattn op registered so far that lacks it (at `import
    dmattn_ops`, and again where a module registers more ops: dmattn_ops.distributed). A
    compiled graph holding an op keeps its fake kernel's output strides in Inductor's asserts,
    so a cached graph must also miss when the package's code changes."""
    kernels = getattr(torch._library.triton, "triton_ops_to_kernels", None)
    if not isinstance(kernels, dict):  # another PyTorch: its caches key as they do
        return
    names = [n for n in torch._C._dispatch_get_all_op_names() if n.startswith("dmattn::")]
    for name in names:
        recorded = kernels.setdefault(name, [])
        if not any(isinstance(k, _Fingerprint) for k in recorded):
            recorded.append(_Fingerprint())


def register() -> None:
    """Install the rules and record the fingerprint for Inductor's caches (once, at
    `import dmattn_ops`: neither changes a setting of PyTorch's)."""
    key_compiled_graphs_on_fingerprint()
    for layout in (ops.DENSE_OPS, ops.VARLEN_OPS):
        forward = ops.forward_kernel(layout)
        trace_into_graphs(layout.public, ops.public_kernel(layout, forward))
        trace_into_graphs(layout.forward, forward, keeps_lists=True)
        trace_into_graphs(layout.backward, ops.backward_kernel(layout), keeps_lists=True)


def trace_into_graphs(op, body, keeps_lists: bool = False) -> None:
    """Compiled graphs trace `body`, the op's CUDA kernel, in place of `op` (module docstring;
    masks.py installs dmattn::topk_select's). keeps_lists: `body` takes `kept`, the trace's
    launch.KeptLists."""
    rule = _rule(body, op, keeps_lists)
    torch.library.register_torch_dispatch(op.name(), FunctionalTensorMode, rule)
