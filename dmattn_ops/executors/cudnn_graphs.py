"""Causal sliding windows through cuDNN's own attention graphs (the cuDNN frontend's Python API).

PyTorch's cuDNN attention op takes causality but no window. cuDNN's SDPA graph takes a
diagonal band: with causality and a left bound of C = left + 1 (the keys a query sees,
itself included), its forward and backward kernels skip the tiles outside the band, at the
same rate as a causal call. So where the optional `nvidia-cudnn-frontend` package is installed
(`pip install "dmattn-ops[cudnn]"`), a causal window call that SDPA would run on cuDNN is one
forward and one backward graph: no chunks, copies or merge (sdpa.py's chunked calls), for any
length and windows of at least the kernel option graph_window_min_keys keys (512 by default:
core/options.py GRAPH_WINDOW_MIN_KEYS). H100, B1 H32/8 D128 bf16, fwd+bwd ms, graphs
against chunked calls: L32768 window 4096 14.21 against 16.39 (0.262x of
the full causal call against 0.302x), L16384 window 2048 4.01 against 5.24.

Without the package, or where cuDNN declines a graph (its support check, remembered per shape),
windows take the routes they took before: chunked calls or our kernels. DMATTN_CUDNN_GRAPHS=0 in
the environment (read per call) keeps windows off this path, as DMATTN_DENSE_SDPA=0 keeps dense
calls off PyTorch's kernels.

Graphs are built once per shape, dtype, window and scale, per thread (a cuDNN handle and the
plans built on it belong to one thread), and run on the caller's current stream with a
workspace from PyTorch's allocator, so they follow streams and CUDA graph capture as PyTorch's
own cuDNN calls do.
"""

from __future__ import annotations

import functools
import threading

import torch

from dmattn_ops.core.band import UNBOUNDED, Band
from dmattn_ops.core.device import symbolic
from dmattn_ops.core.options import GRAPH_WINDOW_MIN_KEYS
from dmattn_ops.core.switches import switch
from dmattn_ops.executors._library import define_launch

# A cuDNN 9 backend; whether it takes a window's graph is asked per shape (`supports`), so an
# older 9.x that lacks one falls back. Measured on 9.19 (PyTorch 2.11's CUDA 13 wheels).
MIN_BACKEND = 90000

_DTYPES = (torch.float16, torch.bfloat16)
_local = threading.local()


@functools.cache
def _module():
    """The cudnn module, or None where it is missing or its backend is older than MIN_BACKEND."""
    try:
        import cudnn
    except Exception:  # ImportError, or a frontend that cannot load its backend library
        return None
    try:
        return cudnn if cudnn.backend_version() >= MIN_BACKEND else None
    except Exception:
        return None


def version() -> str | None:
    """The frontend's and cuDNN's versions ("1.16.0/91900"), None without a usable frontend."""
    cudnn = _module()
    return None if cudnn is None else f"{cudnn.__version__}/{cudnn.backend_version()}"


def enabled() -> bool:
    """The frontend is importable and DMATTN_CUDNN_GRAPHS is not "0"."""
    return switch("DMATTN_CUDNN_GRAPHS", True) and _module() is not None


def window_of(query, key, band: Band, min_keys: int = GRAPH_WINDOW_MIN_KEYS) -> int | None:
    """cuDNN's left bound (C = left + 1 keys) for a causal window these graphs could take: a band
    with a bounded left side and causality as its right (right = 0), Lq == Lk (the alignment of
    both corners), a window of min_keys keys or more (the kernel option graph_window_min_keys)
    and shorter than the sequence (longer ones are plain causal calls, sdpa.py); None
    otherwise. Whether cuDNN takes it is `supports`."""
    if not band.has_window or band.right != 0 or band.left == UNBOUNDED:
        return None
    length = query.shape[1]
    c = band.left + 1
    if key.shape[1] != length or c >= length or c < min_keys:
        return None
    return c


def supports(
    query, key, value, band: Band, backward: bool = False, min_keys: int = GRAPH_WINDOW_MIN_KEYS
) -> bool:
    """Whether this pass of the call (the forward, or with `backward` the backward) runs here:
    window_of, CUDA fp16/bf16, a usable frontend (the plan asks the kernel option cudnn_graphs,
    DMATTN_CUDNN_GRAPHS, first), and cuDNN builds the pass's graph for these shapes
    (checked once per shape and pass, so inference builds no backward graph; the check's
    graph, built at the default scale, stays cached for calls that use it). Each pass decides
    alone: either backward is exact from the forward's out and lse."""
    c = window_of(query, key, band, min_keys)
    if c is None or not _usable(query) or _module() is None:
        return False
    b, length, h, d = query.shape
    hkv, dv = key.shape[2], value.shape[3]
    if any(symbolic(n) for n in (b, length, h, hkv, d, dv, c)):
        return False  # a graph with symbolic sizes: cuDNN builds its graphs for fixed ones
    kind = "bwd" if backward else "fwd"
    return _builds(kind, query.device.index or 0, query.dtype, b, length, h, hkv, d, dv, c)


def _usable(query) -> bool:
    return query.is_cuda and query.dtype in _DTYPES


def forward(query, key, value, scale: float, band: Band):
    """(out (B, L, H, Dv) contiguous, lse (B, H, L) float32) of a causal window call that
    `supports` took."""
    q, k, v = query.contiguous(), key.contiguous(), value.contiguous()
    b, length, h, _ = q.shape
    out = torch.empty((b, length, h, v.shape[3]), dtype=q.dtype, device=q.device)
    lse = torch.empty((b, h, length), dtype=torch.float32, device=q.device)
    torch.ops.dmattn._cudnn_window_forward(q, k, v, out, lse, float(scale), band.left + 1)
    return out, lse


def backward(grad_out, query, key, value, out, lse, scale: float, band: Band):
    """dq, dk, dv (contiguous, in the inputs' dtypes) of `forward`'s call from its out and lse."""
    q, k, v = query.contiguous(), key.contiguous(), value.contiguous()
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    torch.ops.dmattn._cudnn_window_backward(
        grad_out.contiguous(), q, k, v, out.contiguous(), lse.contiguous(), dq, dk, dv,
        float(scale), band.left + 1,
    )  # fmt: skip
    return dq, dk, dv


def _forward_graph(query, key, value, out, lse, scale: float, c: int) -> None:
    graph, tensors = _graph("fwd", query, key, value, scale, c)
    buffers = (_bhsd(query), _bhsd(key), _bhsd(value), _bhsd(out), lse.unsqueeze(-1))
    _execute(graph, tensors, buffers, query.device)


def _backward_graph(grad_out, query, key, value, out, lse, dq, dk, dv, scale, c) -> None:
    graph, tensors = _graph("bwd", query, key, value, scale, c)
    buffers = (
        _bhsd(query), _bhsd(key), _bhsd(value), _bhsd(out), _bhsd(grad_out), lse.unsqueeze(-1),
        _bhsd(dq), _bhsd(dk), _bhsd(dv),
    )  # fmt: skip
    _execute(graph, tensors, buffers, query.device)


# Each graph run is an op of its own (executors/_library.py).
define_launch(
    "_cudnn_window_forward(Tensor query, Tensor key, Tensor value, Tensor(a!) out, "
    "Tensor(b!) lse, float scale, int window) -> ()",
    _forward_graph,
)
define_launch(
    "_cudnn_window_backward(Tensor grad_out, Tensor query, Tensor key, Tensor value, "
    "Tensor out, Tensor lse, Tensor(a!) dq, Tensor(b!) dk, Tensor(c!) dv, float scale, "
    "int window) -> ()",
    _backward_graph,
)


def _bhsd(t):
    """(B, L, H, D) as the (B, H, L, D) view cuDNN's graphs describe."""
    return t.transpose(1, 2)


def _handle(device: torch.device):
    handles = getattr(_local, "handles", None)
    if handles is None:
        handles = _local.handles = {}
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in handles:
        with torch.cuda.device(index):
            handles[index] = _module().create_handle()
    return handles[index]


def _execute(graph, tensors, buffers, device) -> None:
    cudnn = _module()
    handle = _handle(device)
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream(device).cuda_stream)
    workspace = torch.empty(graph.get_workspace_size(), dtype=torch.uint8, device=device)
    graph.execute(dict(zip(tensors, buffers)), workspace, handle=handle)


def _graph(kind: str, q, k, v, scale: float, c: int):
    b, length, h, d = q.shape
    index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    return _built(kind, index, q.dtype, b, length, h, k.shape[2], d, v.shape[3], c, float(scale))


@functools.lru_cache(maxsize=256)
def _builds(kind, index, dtype, b, length, h, hkv, d, dv, c) -> bool:
    try:
        _built(kind, index, dtype, b, length, h, hkv, d, dv, c, d**-0.5)
    except Exception:  # cudnnGraphNotSupportedError, or any failure to build: not this path
        return False
    return True


def _built(kind, index, dtype, b, length, h, hkv, d, dv, c, scale):
    """A built graph and its tensors in the order forward/backward pass buffers, from the
    calling thread's cache."""
    cache = getattr(_local, "graphs", None)
    if cache is None:
        cache = _local.graphs = {}
    key = (kind, index, dtype, b, length, h, hkv, d, dv, c, scale)
    if key not in cache:
        if len(cache) >= 64:
            cache.pop(next(iter(cache)))
        cache[key] = _build(kind, index, dtype, b, length, h, hkv, d, dv, c, scale)
    return cache[key]


def _build(kind, index, dtype, b, length, h, hkv, d, dv, c, scale):
    with torch.cuda.device(index):
        return _build_on_device(kind, index, dtype, b, length, h, hkv, d, dv, c, scale)


def _build_on_device(kind, index, dtype, b, length, h, hkv, d, dv, c, scale):
    cudnn = _module()
    io = cudnn.data_type.HALF if dtype == torch.float16 else cudnn.data_type.BFLOAT16
    f32 = cudnn.data_type.FLOAT
    graph = cudnn.pygraph(
        io_data_type=io, intermediate_data_type=f32, compute_data_type=f32,
        handle=_handle(torch.device("cuda", index)),
    )  # fmt: skip

    def rows(heads, width, virtual=None):
        # (B, L, heads, width) contiguous, described as (B, heads, L, width)
        dims = [b, heads, length, width]
        strides = [length * heads * width, width, heads * width, 1]
        if virtual is not None:
            return virtual.set_output(True).set_dim(dims).set_stride(strides).set_data_type(io)
        return graph.tensor(dim=dims, stride=strides, data_type=io)

    def stats(t=None):
        dims, strides = [b, h, length, 1], [h * length, length, 1, 1]
        if t is not None:
            return t.set_output(True).set_dim(dims).set_stride(strides).set_data_type(f32)
        return graph.tensor(dim=dims, stride=strides, data_type=f32)

    q, k, v = rows(h, d), rows(hkv, d), rows(hkv, dv)
    band = dict(attn_scale=scale, use_causal_mask=True, diagonal_band_left_bound=c)
    if kind == "fwd":
        try:
            out, lse = graph.sdpa(name="window", q=q, k=k, v=v, generate_stats=True, **band)
        except TypeError:  # frontends before 1.13 name it is_inference
            out, lse = graph.sdpa(name="window", q=q, k=k, v=v, is_inference=False, **band)
        tensors = (q, k, v, rows(h, dv, out), stats(lse))
    else:
        o, d_o, lse = rows(h, dv), rows(h, dv), stats()
        dq, dk, dv_ = graph.sdpa_backward(
            name="window_backward", q=q, k=k, v=v, o=o, dO=d_o, stats=lse, **band
        )
        tensors = (q, k, v, o, d_o, lse, rows(h, d, dq), rows(hkv, d, dk), rows(hkv, dv, dv_))
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans()
    return graph, tensors
