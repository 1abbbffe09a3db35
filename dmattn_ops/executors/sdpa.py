"""Dense calls through PyTorch's fused attention kernels (cuDNN or FlashAttention-2).

A call with no mask, bias, softcap or seqused_k is plain softmax attention; on CUDA in
float16/bfloat16 PyTorch ships fused forward and backward kernels for it that are faster than our
dense Triton kernels on Hopper. The forward op then runs the kernel that
`scaled_dot_product_attention` itself would pick for these tensors (`torch._fused_sdp_choice`):
`aten._scaled_dot_product_cudnn_attention` where PyTorch picks cuDNN (on the H100, D128 GQA
causal: 0.72 ms forward+backward against flash's 1.23 ms), else
`aten._scaled_dot_product_flash_attention`. Both return the natural-log logsumexp the contract
needs, so either backward can follow either forward. Both sit below the ops' autograd, vmap and
autocast kernels, so every transform keeps its behaviour; only the kernel differs.

The backward falls back to our kernels when it must: a gradient of lse (the fused backwards
cannot take one), or deterministic=True (they accumulate dq with atomics).

Sinks (a logit per head in each row's denominator) are joined to the fused forward's (out, lse)
by launch.py (one pass: out rescaled by exp(lse - lse'), lse' = logaddexp(lse, sink)). Given
that out and lse, a fused backward computes P = exp(s - lse') and delta = rowsum(dO * O'), the
sinks' softmax, so its dq, dk, dv are exact; dsinks comes from the row statistics (one pass
over out and dO).

Kernel option ``fused_sdpa=False`` (or DMATTN_DENSE_SDPA=0 in the environment, read per call)
keeps dense calls on our Triton kernels; the test suite sets it, so the Triton dense kernels stay
tested, and tests/test_sdpa.py covers this path.
PyTorch's own switches apply: `torch.backends.cuda.enable_cudnn_sdp(False)` /
`enable_flash_sdp(False)` or an `sdpa_kernel` context rule the kernel out, and GPUs before sm_80
(no flash kernels) never take this path.

Sliding windows. A causal window in self-attention runs as one graph of cuDNN's own
(cudnn_graphs.py) where the optional cuDNN frontend is installed and takes it. Otherwise, a
causal window of C = left + 1 keys over L = n * C positions is two batched causal calls of the
same kernels (`window_chunk` says when): the n chunks of C rows against themselves, and each
chunk's queries against the previous chunk's keys, which a query at row a of its chunk sees
from row a + 1 on: reversed, the rows 0..C-2 of the queries and 1..C-1 of the keys are causal
again (the call is padded to C rows, the fused backward's faster length).
(The rows after the last whole chunk of a longer sequence run on our kernels: launch.py.) The
two parts are merged through their logsumexps (kernels/window_chunks.py, which also reverses
the rows); the backward runs both kernels' backwards with the merged out and lse, which gives
each part its exact share of the gradients (the probabilities exp(s - lse) and delta =
rowsum(dO * O) are those of the whole row), and adds the reversed part back. The work is the
window's own, at the fused kernels' speed; narrow windows stay on our
kernels, where the chunks would be too short.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from dmattn_ops.core._compat import fused_sdp_choice, is_fake, sdp_priority_order
from dmattn_ops.core.band import UNBOUNDED, Band
from dmattn_ops.core.device import cdiv, next_power_of_2
from dmattn_ops.core.options import WINDOW_MIN_KEYS
from dmattn_ops.core.problem import Options, Problem
from dmattn_ops.executors import cudnn_graphs
from dmattn_ops.executors._alloc import empty
from dmattn_ops.executors._triton import LazyKernel, interpreter_on


def _kernels() -> tuple:
    """The chunked window's kernels' module, imported (with Triton) at the first launch."""
    from dmattn_ops.kernels import window_chunks

    return (window_chunks,)


reverse_rows_kernel = LazyKernel(_kernels, "reverse_rows_kernel")
window_merge_kernel = LazyKernel(_kernels, "window_merge_kernel")

DTYPES = (torch.float16, torch.bfloat16)
FLASH, CUDNN = "flash", "cudnn"
GRAPHS = "cudnn-graphs"  # a window on cuDNN's own graphs (cudnn_graphs.py), chosen by `route`
# torch.nn.attention.SDPBackend's FLASH_ATTENTION and CUDNN_ATTENTION, as _fused_sdp_choice
# returns them
_FLASH_CHOICE, _CUDNN_CHOICE = 1, 3
_CUDNN_MAX_HEAD_DIM = 128  # cuDNN's backward on Hopper; larger head dims go to flash


@functools.cache
def _flash_capable(index: int) -> bool:
    """PyTorch's flash kernels need sm_80 or newer."""
    return torch.cuda.get_device_capability(index) >= (8, 0)


def kernel(problem: Problem, opts: Options, enabled=True) -> str | None:
    """The PyTorch kernel ("cudnn" or "flash") that computes this call exactly as our contract
    says, or None when the call stays on ours (`choose` says why)."""
    return choose(problem, opts, enabled)[0]


def choose(problem: Problem, opts: Options, enabled=True) -> tuple[str | None, list[str]]:
    """(kernel, []) or (None, the reasons) for a dense-layout problem (its sinks are joined
    after the fused kernels, launch.py). It must be dense attention: no mask, bias, softcap or
    seqused_k; causal only with Lq == Lk (where the fused kernels' top-left alignment is our
    bottom-right one); CUDA fp16/bf16 on sm_80+ with one head dim, a multiple of 8 up to 256,
    unit stride along it; `enabled` (kernel option fused_sdpa, DMATTN_DENSE_SDPA). cuDNN where
    SDPA would pick it (head dims up to 128), else flash where PyTorch's flash backend is
    enabled."""
    query, key, value, is_causal = problem.query, problem.key, problem.value, opts.is_causal
    reasons = [
        f"{name}: the fused kernels compute plain softmax attention"
        for name, present in (
            ("a mask", problem.mask is not None), ("a bias", problem.bias is not None),
            ("seqused_k", problem.seqused_k is not None), ("softcap", opts.softcap > 0),
        )
        if present
    ]  # fmt: skip
    if not (query.is_cuda and query.dtype in DTYPES):
        reasons.append(f"{query.device.type} {query.dtype}: the fused kernels take CUDA fp16/bf16")
    if not enabled:
        reasons.append("switched off (kernel option fused_sdpa, DMATTN_DENSE_SDPA=0)")
    if reasons:
        return None, reasons
    index = query.device.index
    if not _flash_capable(torch.cuda.current_device() if index is None else index):
        return None, ["a GPU before sm_80"]
    d = query.shape[-1]
    if value.shape[-1] != d or d % 8 or d > 256:
        reasons.append(f"D {d}, Dv {value.shape[-1]}: needs D == Dv, a multiple of 8, <= 256")
    if is_causal and query.shape[1] != key.shape[1]:
        reasons.append("causal with Lq != Lk: the fused kernels align causality top-left")
    if not all(t.stride(-1) == 1 for t in (query, key, value)):
        reasons.append("a head dim whose stride is not 1")
    if reasons:
        return None, reasons
    if (
        d <= _CUDNN_MAX_HEAD_DIM
        and torch.backends.cuda.cudnn_sdp_enabled()
        and _sdpa_choice(query, key, value, bool(is_causal)) == _CUDNN_CHOICE
    ):
        return CUDNN, []
    if torch.backends.cuda.flash_sdp_enabled():
        return FLASH, []
    return None, ["PyTorch's cuDNN and flash SDPA backends are off (torch.backends / sdpa_kernel)"]


def _sdpa_choice(query, key, value, is_causal: bool) -> int:
    """`torch._fused_sdp_choice` for these (B, L, H, D) tensors: the kernel PyTorch's SDPA would
    run. On the fake tensors of a compiled graph's trace it would answer for meta tensors (the
    math kernel), so there it asks about real tensors of the same sizes, strides and dtype."""
    if not is_fake(query):
        return _choice_of(query, key, value, is_causal)
    metas = tuple((tuple(t.shape), tuple(t.stride())) for t in (query, key, value))
    if not all(isinstance(n, int) for shape, stride in metas for n in shape + stride):
        return -1  # symbolic sizes: no real tensors to ask about (the flash kernel then)
    flags = (
        torch.backends.cuda.flash_sdp_enabled(),
        torch.backends.cuda.mem_efficient_sdp_enabled(),
        torch.backends.cuda.math_sdp_enabled(),
        sdp_priority_order(),
    )
    return _traced_choice(metas, query.dtype, query.device, is_causal, flags)


def _choice_of(query, key, value, is_causal: bool) -> int:
    qt, kt, vt = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    return fused_sdp_choice(
        qt, kt, vt, None, 0.0, is_causal, enable_gqa=query.shape[2] != key.shape[2]
    )


@functools.lru_cache(maxsize=64)
def _traced_choice(metas, dtype, device, is_causal, flags) -> int:
    """The choice for real tensors with these (shape, stride) pairs, allocated outside the
    trace's modes, once per compiled call site and freed at once."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        try:
            real = [torch.empty_strided(s, st, dtype=dtype, device=device) for s, st in metas]
        except torch.OutOfMemoryError:
            return -1
        return _choice_of(*real, is_causal)


def window_chunk(query, key, band: Band, min_keys: int = WINDOW_MIN_KEYS) -> int | None:
    """C, the chunk of a windowed call that runs as chunked causal calls (module docstring): a
    band of left + 1 keys ending at the query (causal, or right = 0), Lq == Lk, at least
    min_keys keys; a window as long as the sequence is one chunk, plain causal attention.
    None for any other band. Rows past the last whole chunk (the plan's tail) are not this
    module's: launch.py runs them on our kernels."""
    if not band.has_window or band.right != 0 or band.left == UNBOUNDED:
        return None
    length = query.shape[1]
    c = band.left + 1
    if key.shape[1] != length or c < min_keys:
        return None
    return min(c, length)


def window_route(
    query, key, value, band: Band, min_keys: int, graphs: bool, graph_min_keys: int
) -> tuple[bool, int | None, list[str]]:
    """How a windowed dense call could run here, by its shape alone: (on cuDNN's graphs
    possible, chunk C or None, reasons if neither). graphs, min_keys, graph_min_keys: the
    kernel options cudnn_graphs, window_min_keys and graph_window_min_keys."""
    if not band.has_window:
        return False, None, []
    on_graphs = graphs and cudnn_graphs.window_of(query, key, band, graph_min_keys) is not None
    chunk = window_chunk(query, key, band, min_keys)
    if on_graphs or chunk is not None:
        return on_graphs, chunk, []
    return (
        False,
        None,
        [
            f"window {band.left, band.right} over Lq {query.shape[1]}, Lk {key.shape[1]}: the "
            f"fused kernels take causal windows of Lq == Lk with at least {min_keys} keys (or "
            f"{graph_min_keys} on cuDNN's graphs)"
        ],
    )


def graphs_take(query, key, value, band: Band, which, backward: bool, min_keys: int) -> bool:
    """Whether this pass of a windowed call on `which` runs on cuDNN's own graphs
    (cudnn_graphs.supports, asked per pass; min_keys: the kernel option
    graph_window_min_keys)."""
    return which == CUDNN and cudnn_graphs.supports(query, key, value, band, backward, min_keys)


def forward(query, key, value, scale, band: Band, which, chunk=None):
    """(out (B, Lq, H, D), lse (B, H, Lq) float32, lse_rem zeros) of a dense call through the
    kernel `which` ("cudnn" or "flash"); a windowed one through cuDNN's graphs (which ==
    GRAPHS), else in whole chunks of `chunk` rows (the plan's)."""
    if which == GRAPHS:
        out, lse = cudnn_graphs.forward(query, key, value, scale, band)
    elif chunk is not None:
        out, lse = _window_forward(query, key, value, scale, _whole(query, chunk), which)
    else:
        out, lse = _forward(query, key, value, scale, band.is_causal, which)
    return out, lse, torch.zeros_like(lse)


def backward(grad_out, query, key, value, out, lse, scale, band: Band, which, chunk=None):
    """dq, dk, dv of a dense call (no lse gradient), contiguous, in the inputs' dtypes, through
    the kernel `which`; a windowed one as `forward` runs it (either way is exact from the
    forward's out and lse)."""
    if which == GRAPHS:
        return cudnn_graphs.backward(grad_out, query, key, value, out, lse, scale, band)
    if chunk is None:
        return _backward(grad_out, query, key, value, out, lse, scale, band.is_causal, which)
    c = _whole(query, chunk)
    return _window_backward(grad_out, query, key, value, out, lse, scale, c, which)


def _whole(query, c: int) -> int:
    if query.shape[1] % c:
        raise ValueError(
            f"a chunked window call takes whole chunks of {c} rows, not {query.shape[1]}: the "
            "rows past the last one run on our kernels (launch.py)"
        )
    return c


def _forward(query, key, value, scale, is_causal, which):
    """(out (B, Lq, H, D) contiguous, lse (B, H, Lq) float32) through the kernel `which`."""
    out, lse = _fused(query, key, value, scale, is_causal, which)
    # Contiguous like the Triton path's outputs and the fake kernels (a no-op here: both write
    # (B, Lq, H, D) rows and return them transposed, and (B, H, Lq) statistics).
    return out.contiguous(), lse.contiguous()


def _fused(query, key, value, scale, is_causal, which):
    """(out (B, Lq, H, D), lse (B, H, Lq)) of the aten op of the kernel `which`, as that op
    returns them (out a transposed view of its (B, Lq, H, D) rows)."""
    qt, kt, vt = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    if which == CUDNN:
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
            qt, kt, vt, None, True, 0.0, bool(is_causal), False, scale=float(scale)
        )[:2]
        lse = lse.squeeze(-1)  # cuDNN's statistics are (B, H, Lq, 1)
    else:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
            qt, kt, vt, 0.0, bool(is_causal), False, scale=float(scale)
        )[:2]
    return out.transpose(1, 2), lse


def attention(query, key, value, scale, is_causal, which, native=False):
    """out (B, Lq, H, D) of a dense call through the kernel `which`, as a differentiable call of
    the aten op: PyTorch's own autograd formula (a C++ node) runs its backward kernel, the one
    `backward` calls. The eager fast path (api.py) takes this where the plan puts both passes
    of a plain eager call here, for the same kernels without the ops' Python autograd node: on
    two H200 hosts our dense forward+backward's host time went from 2.7x SDPA's to 1.2-1.5x.
    native: `which` is the kernel scaled_dot_product_attention itself picks for these tensors
    (picks), whose one C++ call then reaches that aten op with less host time than a Python
    call of the op does."""
    if native:
        out = F.scaled_dot_product_attention(
            query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
            is_causal=bool(is_causal), scale=float(scale),
            enable_gqa=query.shape[2] != key.shape[2],
        ).transpose(1, 2)  # fmt: skip
    else:
        out = _fused(query, key, value, scale, is_causal, which)[0]
    # Both kernels write (B, Lq, H, D) rows: the transposed view is contiguous, as the ops'
    # outputs are (contiguous() adds no copy and no autograd node then).
    return out.contiguous()


def picks(query, key, value, is_causal: bool, which: str) -> bool:
    """Whether scaled_dot_product_attention itself runs the kernel `which` for these (B, L, H, D)
    tensors, asked as the plan asks (_sdpa_choice); the plan may pick flash where SDPA would
    pick cuDNN (head dims above 128)."""
    choice = _sdpa_choice(query, key, value, bool(is_causal))
    return choice == (_CUDNN_CHOICE if which == CUDNN else _FLASH_CHOICE)


def _backward(grad_out, query, key, value, out, lse, scale, is_causal, which):
    lq, lk = query.shape[1], key.shape[1]
    # Both kernels want the rows of grad_out and out as the forward wrote them.
    grad_out, out, lse = grad_out.contiguous(), out.contiguous(), lse.contiguous()
    qt, kt, vt = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    unused = torch.empty((), dtype=torch.long, device=query.device)  # dropout's RNG state
    if which == CUDNN:
        grads = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            grad_out.transpose(1, 2), qt, kt, vt, out.transpose(1, 2), lse.unsqueeze(-1),
            unused, unused, None, None, None, lq, lk, 0.0, bool(is_causal), scale=float(scale),
        )  # fmt: skip
    else:
        grads = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            grad_out.transpose(1, 2), qt, kt, vt, out.transpose(1, 2), lse, None, None, lq, lk,
            0.0, bool(is_causal), unused, unused, scale=float(scale),
        )  # fmt: skip
    # The gradients take the layout of the (transposed) inputs; the fake kernels promise
    # contiguous ones, as the Triton path returns.
    return tuple(g.transpose(1, 2).contiguous() for g in grads)


def _chunks(t, c):
    """(B, n * c, heads, D) contiguous as (B * n, c, heads, D): a view."""
    return t.view(-1, c, *t.shape[2:])


def _reversed(src, c, chunk0, row0, rows, chunks, keep=None):
    """(B * chunks, rows, heads, D): rows row0.. row0 + rows - 1 of chunks chunk0.. of src (B,
    n * c, heads, D), contiguous, in reversed order within each chunk; row0 = -1 starts at the
    previous chunk's last row. The last rows - keep rows are zeros instead (keep: all)."""
    b, length = src.shape[:2]
    dst = empty((b * chunks, rows, *src.shape[2:]), dtype=src.dtype, device=src.device)
    _launch_reverse(
        src, dst, b, chunks, length // c, c, chunk0, row0, chunks, rows, 0, 0, rows,
        rows if keep is None else keep,
    )  # fmt: skip
    return dst


def _add_reversed(dst, c, chunk0, row0, src, rows, chunks):
    """dst (B, n * c, heads, D) rows row0.. row0 + rows - 1 of chunks chunk0.. += the first rows
    rows of each chunk of src (B * chunks, c, heads, D) in reversed order: _reversed's inverse,
    added."""
    b, length = dst.shape[:2]
    _launch_reverse(
        src, dst, b, chunks, chunks, c, 0, 0, length // c, c, chunk0, row0, rows, rows,
        accumulate=True,
    )  # fmt: skip


def _launch_reverse(
    src, dst, b, chunks, n_src, c_src, src_chunk0, src_row0, n_dst, c_dst, dst_chunk0, dst_row0,
    rows, keep, accumulate=False,
):  # fmt: skip
    width = src[0, 0].numel()
    block_r, block_w = (4, 64) if interpreter_on() else (8, 512)
    grid = (cdiv(rows, block_r), b * chunks, cdiv(width, block_w))
    reverse_rows_kernel[grid](
        src, dst, chunks, n_src, c_src, src_chunk0, src_row0, n_dst, c_dst, dst_chunk0,
        dst_row0, rows, keep, width, ACCUMULATE=accumulate, BLOCK_R=block_r, BLOCK_W=block_w,
        num_warps=4,
    )  # fmt: skip


def _window_forward(query, key, value, scale, c, which):
    """out, lse of a causal window of c keys (window_chunk) through the kernel `which`."""
    b, length, h, d = query.shape
    n = length // c
    q, k, v = query.contiguous(), key.contiguous(), value.contiguous()
    out, lse_diag = _forward(_chunks(q, c), _chunks(k, c), _chunks(v, c), scale, True, which)
    if n == 1:
        return out, lse_diag
    # Chunk t's queries 0..c-2 against chunk t-1's keys 1..c-1, reversed (a chunk's last query
    # sees no key of the previous chunk), padded to c rows (the fused
    # backward is 4% slower at c - 1 rows): the queries from the previous chunk's last row, the
    # keys from row 0. That padding query sees all of the previous chunk's keys (its own
    # window, which the diagonal part has), the padding key is seen by it alone, and the merge
    # ignores its row.
    q_prev = _reversed(q, c, 1, -1, c, n - 1)
    k_prev = _reversed(k, c, 0, 0, c, n - 1)
    v_prev = _reversed(v, c, 0, 0, c, n - 1)
    out_prev, lse_prev = _forward(q_prev, k_prev, v_prev, scale, True, which)
    out = out.view(b, length, h, d)
    lse = empty((b, h, length), dtype=torch.float32, device=query.device)
    block_r = 16 if interpreter_on() else 64
    window_merge_kernel[(cdiv(length, block_r), b * h)](
        out, lse_diag, out_prev, lse_prev, lse, h, length, n, c, d,
        BLOCK_R=block_r, BLOCK_D=next_power_of_2(d), num_warps=4,
    )  # fmt: skip
    return out, lse


def _window_backward(grad_out, query, key, value, out, lse, scale, c, which):
    """dq, dk, dv of _window_forward's call, from its merged out and lse."""
    b, length, h, d = query.shape
    hkv = key.shape[2]
    n = length // c
    q, k, v = query.contiguous(), key.contiguous(), value.contiguous()
    grad_out, out = grad_out.contiguous(), out.contiguous()
    by_chunk = lse.view(b, h, n, c)
    dq, dk, dv = _backward(
        _chunks(grad_out, c), _chunks(q, c), _chunks(k, c), _chunks(v, c), _chunks(out, c),
        by_chunk.transpose(1, 2).reshape(b * n, h, c), scale, True, which,
    )  # fmt: skip
    dq, dk, dv = dq.view(b, length, h, d), dk.view(b, length, hkv, d), dv.view(b, length, hkv, d)
    if n == 1:
        return dq, dk, dv
    # The forward's padded layout. The padding query (the previous chunk's last row) gets dO = 0,
    # so it adds nothing to dk, dv; its lse is its own row's (it saw that row's keys), so its
    # probabilities stay finite.
    shifted = lse.view(b, h, length)[:, :, c - 1 : length - 1].reshape(b, h, n - 1, c)
    lse_prev = shifted.flip(-1).transpose(1, 2).reshape(b * (n - 1), h, c)
    dq_prev, dk_prev, dv_prev = _backward(
        _reversed(grad_out, c, 1, -1, c, n - 1, keep=c - 1), _reversed(q, c, 1, -1, c, n - 1),
        _reversed(k, c, 0, 0, c, n - 1), _reversed(v, c, 0, 0, c, n - 1),
        _reversed(out, c, 1, -1, c, n - 1), lse_prev, scale, True, which,
    )  # fmt: skip
    # Back without the padding rows: prev row i is query row c - 2 - i and key row c - 1 - i.
    _add_reversed(dq, c, 1, 0, dq_prev, c - 1, n - 1)
    _add_reversed(dk, c, 0, 1, dk_prev, c - 1, n - 1)
    _add_reversed(dv, c, 0, 1, dv_prev, c - 1, n - 1)
    return dq, dk, dv
