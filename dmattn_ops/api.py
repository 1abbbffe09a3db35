"""Public functions: validate inputs, pick a backend, call the op."""

from __future__ import annotations

import torch

from dmattn_ops import flex, reference
from dmattn_ops.core import options
from dmattn_ops.core._compat import plain_eager
from dmattn_ops.core.options import KernelOptions
from dmattn_ops.core.problem import Options, Problem
from dmattn_ops.core.validate import (
    check_backend,
    check_flags,
    check_inputs,
    check_sinks,
    check_sinks_values,
    check_varlen_inputs,
    check_window,
    has_window,
)
from dmattn_ops.dispatch import plan
from dmattn_ops.executors import sdpa
from dmattn_ops.executors.chunked import add_sinks
from dmattn_ops.registration import ops
from dmattn_ops.registration.calls import default_scale

_TRACING = torch.compiler.is_dynamo_compiling  # False eagerly; Dynamo folds it to True


def _encoded(kernel_options, backend: str, fn: str) -> str | None:
    """The kernel options as the lower ops carry them (options.encode), or None.

    While Dynamo traces, the active `kernel_options` blocks are folded into them, and the
    switches the kernels depend on (options.GRAPH_SWITCHES) are read: the plan and Inductor's
    lowering read both below the op, which Dynamo neither sees nor guards, so a graph compiled
    inside a block (or under one switch value) ran its options outside it, and one compiled
    outside ran inside a block without them. Read here, both are guarded (a graph is compiled
    again when they change) and the graph's op carries the blocks."""
    if backend in ("reference", "flex"):
        if kernel_options is not None:
            raise ValueError(
                f"{fn}: kernel_options choose among this library's kernels (backend 'auto' or "
                f"'triton'); backend={backend!r} runs none of them"
            )
        return None
    if _TRACING():
        options.read_graph_switches()
        if options.blocks_active():
            return options.encode(options.with_active(kernel_options), fn)
    if kernel_options is None:
        return None
    return options.encode(kernel_options, fn)


def _check_triton_can_run(query: torch.Tensor, fn: str = "dmattn.attention") -> None:
    if query.dtype not in plan.TRITON_DTYPES:
        raise TypeError(
            f"{fn}: backend='triton' supports float16, bfloat16 and float32; "
            f"got {query.dtype} (backend='auto' runs float64 in PyTorch)"
        )
    if not plan.available():
        raise ModuleNotFoundError(
            f"{fn}: backend='triton' needs the triton package, which is not installed here "
            "(it installs on Linux); backend='auto' runs the PyTorch implementation",
            name="triton",
        )
    if not plan.triton_runs_on(query):
        raise ValueError(
            f"{fn}: backend='triton' needs CUDA tensors, or TRITON_INTERPRET=1 "
            f"(Triton's interpreter) for CPU tensors; got tensors on {query.device}"
        )


def _fused_eager(query, key, value, scale, is_causal: bool, deterministic: bool):
    """out of a plain eager dense call (no mask, bias, seqused_k, sinks, softcap, window or
    returned lse: the caller checks) whose plan puts every pass it will run on PyTorch's
    fused kernels, computed by the aten op under PyTorch's autograd (sdpa.attention); None
    for any other call, which then goes through the ops. The same plan decides, so the same
    kernels run either way; transforms, modes, tensor subclasses and traces always take the
    ops, whose graphs and rules they need."""
    if not query.is_cuda or torch.compiler.is_compiling() or not plain_eager((query, key, value)):
        return None
    problem = Problem(query, key, value)
    opts = Options(scale, is_causal, deterministic=deterministic)
    grads = query.requires_grad or key.requires_grad or value.requires_grad
    fused, native = plan.fused_kernel(problem, opts, both=grads and torch.is_grad_enabled())
    if fused is None:
        return None
    return sdpa.attention(query, key, value, scale, is_causal, fused, native)


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    softcap: float = 0.0,
    seqused_k: torch.Tensor | None = None,
    deterministic: bool = False,
    return_lse: bool = False,
    backend: str = "auto",
    sinks: torch.Tensor | None = None,
    window_size: tuple[int, int] = (-1, -1),
    kernel_options: KernelOptions | None = None,
    _internal_lse: bool = False,
    _seqused_k_in_range: bool = False,
):
    r"""Dynamic Mask Attention.

    Args:
        query: (B, Lq, H, D).
        key: (B, Lk, Hkv, D), with H % Hkv == 0 (GQA / MQA).
        value: (B, Lk, Hkv, Dv). D and Dv are at most 256, of any size.
        mask: bool, (B|1, H|Hkv|1, Lq|1, Lk): which keys each query may see. A head dim of Hkv
            is shared by the query heads of that KV group. Broadcast dims are read through
            strides, never materialised. No gradient.
        bias: float (query's dtype or float32), same broadcast shapes as mask, added to the
            logits; its gradient has exactly its shape and dtype.
        scale: multiplies q . k; defaults to 1 / sqrt(D).
        is_causal: bottom-right aligned causal masking (the last query sees the last key).
        softcap: if > 0, logits become softcap * tanh(logit / softcap) before the bias.
        seqused_k: int32 (B,): keys j >= seqused_k[b] do not exist for batch b.
        deterministic: bitwise reproducible backward.
        return_lse: also return lse, float32 (B, H, Lq), natural log.
        backend: "auto", "triton", "flex" or "reference".
        sinks: float (H,) (query's dtype or float32), or None: a learned logit per query head
            that joins each row's softmax denominator only (attention sinks, as GPT-OSS);
            differentiable. A row with no allowed key then has out 0 and lse sinks[h].
        window_size: (left, right), flash-attn's sliding window: query i sees keys j with
            p - left <= j <= p + right, p = i + n - Lq its aligned position; -1 leaves a side
            unbounded. Combines (and) with is_causal, mask and seqused_k; key tiles outside
            the band are never read.
        kernel_options: a `KernelOptions` dict (dmattn_ops.core.options): force a route, override
            tile configs or splits; they change speed, never the result. Backends "auto" and
            "triton" only. `dmattn_ops.explain` shows the route each pass takes and why.

    Returns:
        out (B, Lq, H, Dv) in query's dtype, or (out, lse) when ``return_lse``.

    With n = seqused_k[b] (or Lk), p = i + n - Lq, for batch b, head h, query i and key j::

        allowed(i, j) = j < n and mask[b, h, i, j] and (not is_causal or j <= p)
                        and (left < 0 or j >= p - left) and (right < 0 or j <= p + right)
        s(i, j) = cap(scale * q_i . k_j) + bias[b, h, i, j] if allowed else -inf
        out_i   = sum_j softmax_j(s(i, .)) v_j      (0 when no key is allowed)
        lse_i   = log sum_j exp(s(i, j))            (-inf when no key is allowed)

    Rows with no allowed key give zero output and zero gradients. NaN or Inf in bias at
    positions that are not allowed, in K/V at or beyond seqused_k, and in K/V at keys that no
    query may see (the mask is False for every query of the key's KV group, as for unused
    cache slots) never reach the result, on every backend.

    Under torch.autocast, query, key and value (and a bias that is not float32) are cast to
    the autocast dtype, as for scaled_dot_product_attention; the result has that dtype.
    """
    check_backend(backend)
    check_flags(
        "dmattn.attention", is_causal=is_causal, deterministic=deterministic,
        return_lse=return_lse,
    )  # fmt: skip
    window = check_window(window_size, "dmattn.attention")
    tuned = _encoded(kernel_options, backend, "dmattn.attention")
    query, key, value, bias = ops.autocast_inputs(query, key, value, bias)
    if sinks is not None and backend in ("reference", "flex"):
        # The registered ops take sinks themselves (their forward kernel starts each row's
        # softmax from its sink); Flex has none, so it gets them joined to its (out, lse).
        if isinstance(query, torch.Tensor) and query.dim() == 4:
            check_sinks(sinks, query, "dmattn.attention")
            check_sinks_values(sinks, "dmattn.attention")
        with ops.autocast_off(query):
            if backend == "reference":
                return reference.attention(
                    query, key, value, mask, bias, scale=scale, is_causal=is_causal,
                    softcap=softcap, seqused_k=seqused_k, return_lse=return_lse, sinks=sinks,
                    window_size=window,
                )  # fmt: skip
            out, lse = attention(
                query, key, value, mask, bias, scale=scale, is_causal=is_causal,
                softcap=softcap, seqused_k=seqused_k, deterministic=deterministic,
                backend=backend, return_lse=True, window_size=window, _internal_lse=True,
            )  # fmt: skip
            out, lse = add_sinks(out, lse, sinks)
        return (out, lse.float()) if return_lse else out
    with ops.autocast_off(query):
        if backend in ("reference", "flex"):
            fn = reference.attention if backend == "reference" else flex.attention
            return fn(
                query, key, value, mask, bias, scale=scale, is_causal=is_causal,
                softcap=softcap, seqused_k=seqused_k, deterministic=deterministic,
                return_lse=return_lse, window_size=window,
            )  # fmt: skip
        # The value checks (seqused_k's range) run inside the op, below any torch.func
        # transform, so that direct calls of torch.ops.dmattn.* keep the same contract.
        problem = Problem(query, key, value, mask, bias, sinks, seqused_k)
        check_inputs(problem, scale, softcap)
        if backend == "triton":
            _check_triton_can_run(query)
        # Only a window that bounds something is passed: graphs of windowless calls stay as
        # they were.
        extra = (window,) if has_window(window) else ()
        if sinks is not None:
            check_sinks(sinks, query, "dmattn.attention")
            extra = (window, sinks)
        if tuned is not None:
            extra = (window, sinks, tuned)  # only the lower op carries kernel options
        resolved = default_scale(query) if scale is None else scale
        dense = mask is None and bias is None and seqused_k is None and not softcap
        if dense and not (extra or return_lse):
            out = _fused_eager(query, key, value, resolved, is_causal, deterministic)
            if out is not None:
                return out
        lower = return_lse or tuned is not None  # only the lower op returns lse
        if not torch.compiler.is_compiling() and plain_eager(
            (query, key, value, mask, bias, seqused_k, sinks)
        ):
            # Validated above: the op's Autograd kernel's work, without a second validation.
            cap = 0.0 if softcap is None else softcap
            opts = Options(resolved, bool(is_causal), cap, bool(deterministic), window, tuned)
            # The library's own callers whose seqused_k lies in [0, Lk] by construction (a
            # count of a cache's used slots), or was checked before (flash_attn_with_kvcache),
            # skip its range check: one host sync a call, which in an eager decode loop stalls
            # the host on every layer.
            result = ops.attend(problem, opts, not lower, _seqused_k_in_range)
        elif lower:
            result = torch.ops.dmattn.attention_forward(
                query, key, value, mask, bias, resolved, is_causal, softcap, seqused_k,
                deterministic, *extra,
            )  # fmt: skip
        else:
            result = torch.ops.dmattn.attention(
                query, key, value, mask, bias, scale, is_causal, softcap, seqused_k,
                deterministic, *extra,
            )  # fmt: skip
        if not lower:
            return result
        out, lse, _ = result
        if not return_lse:
            return out
        # float64 inputs keep a float64 lse inside the ops
        return out, (lse if _internal_lse else lse.float())


def attention_varlen(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    mask: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    softcap: float = 0.0,
    deterministic: bool = False,
    return_lse: bool = False,
    backend: str = "auto",
    sinks: torch.Tensor | None = None,
    window_size: tuple[int, int] = (-1, -1),
    kernel_options: KernelOptions | None = None,
    _internal_lse: bool = False,
):
    r"""Dynamic Mask Attention over a packed batch of variable-length sequences.

    Args:
        query: (total_q, H, D), the sequences' queries one after another.
        key: (total_k, Hkv, D); value: (total_k, Hkv, Dv).
        cu_seqlens_q, cu_seqlens_k: int32 (B + 1,), starting at 0 and non-decreasing: sequence
            b is query rows cu_seqlens_q[b]:cu_seqlens_q[b + 1] and the matching key rows.
            Rows past cu_seqlens[-1] may hold anything (NaN included); they are never read.
        max_seqlen_q, max_seqlen_k: upper bounds of the sequence lengths (size the launch
            grid; an int, or a SymInt under torch.compile).
        mask: bool (H|Hkv|1, total_k), per key token, broadcast over the queries of the
            key's sequence. No gradient.
        bias: float (H|Hkv|1, total_k), per key token like mask; its gradient has its shape.
        scale, is_causal, softcap, deterministic, backend, window_size, kernel_options: as in
            `attention`; causal and the window are bottom-right aligned within each sequence.
        return_lse: also return lse, float32 (H, total_q).
        sinks: float (H,) or None: attention sinks, as in `attention`; rows outside every
            sequence keep out 0 and lse -inf.

    Returns:
        out (total_q, H, Dv), or (out, lse). Rows outside every sequence get out 0, lse -inf
        and zero gradients. Sequence b computes exactly `attention` on its own rows with
        mask/bias[:, k0:k1] as (1, H|Hkv|1, 1, n).

    Under torch.compile(dynamic=True), new cu_seqlens values and new totals do not recompile.
    The cu_seqlens checks (start, monotone, totals, max_seqlen) read the tensors and are skipped
    while tracing and during CUDA graph capture.
    """
    fn = "dmattn.attention_varlen"
    check_backend(backend, fn)
    check_flags(fn, is_causal=is_causal, deterministic=deterministic, return_lse=return_lse)
    window = check_window(window_size, fn)
    tuned = _encoded(kernel_options, backend, fn)
    query, key, value, bias = ops.autocast_inputs(query, key, value, bias)
    args = (query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, mask, bias)
    common = dict(
        scale=scale, is_causal=is_causal, softcap=softcap, deterministic=deterministic,
        window_size=window,
    )  # fmt: skip
    if sinks is not None:
        if isinstance(query, torch.Tensor) and query.dim() == 3:
            check_sinks(sinks, query[None], fn)
            check_sinks_values(sinks, fn)
        with ops.autocast_off(query):
            if backend == "reference":
                return reference.attention_varlen(*args, **common, return_lse=return_lse,
                                                  sinks=sinks)  # fmt: skip
            out, lse = attention_varlen(*args, **common, backend=backend, return_lse=True,
                                        kernel_options=kernel_options,
                                        _internal_lse=True)  # fmt: skip
            # (total, H, Dv) and (H, total) as one batch of (1, total, H, Dv), (1, H, total).
            out_s, lse_s = add_sinks(out[None], lse[None], sinks)
            inside = torch.arange(lse.shape[1], device=lse.device) < cu_seqlens_q[-1]
            out, lse = out_s[0], torch.where(inside, lse_s[0], lse)
        return (out, lse.float()) if return_lse else out
    with ops.autocast_off(query):
        if backend in ("reference", "flex"):
            fn_backend = (
                reference.attention_varlen if backend == "reference" else flex.attention_varlen
            )
            return fn_backend(*args, **common, return_lse=return_lse)
        # The cu_seqlens value checks run inside the op (see attention).
        packed = Problem(
            query, key, value, mask, bias, None, None, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
            max_seqlen_k,
        )  # fmt: skip
        check_varlen_inputs(packed, scale, softcap, fn)
        if backend == "triton":
            _check_triton_can_run(query, fn)
        extra = (window,) if has_window(window) else ()
        if tuned is not None:
            extra = (window, tuned)
        if return_lse or tuned is not None:
            scale = default_scale(query) if scale is None else scale
            out, lse, _ = torch.ops.dmattn.attention_varlen_forward(
                *args, scale, is_causal, softcap, deterministic, *extra
            )
            if not return_lse:
                return out
            return out, (lse if _internal_lse else lse.float())
        return torch.ops.dmattn.attention_varlen(
            *args, scale, is_causal, softcap, deterministic, *extra
        )


def explain(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    softcap: float = 0.0,
    seqused_k: torch.Tensor | None = None,
    deterministic: bool = False,
    return_lse: bool = False,
    backend: str = "auto",
    sinks: torch.Tensor | None = None,
    window_size: tuple[int, int] = (-1, -1),
    kernel_options: KernelOptions | None = None,
) -> plan.Explanation:
    """The route each pass of ``attention(query, key, value, mask, bias, **same keywords)``
    would take, and for every other route the reasons it was not taken; nothing is computed.

    The backward is explained as `attention`'s autograd would call it: with a gradient of
    lse when ``return_lse`` and dbias when ``bias`` requires grad. ``print(explain(...))``
    gives one line per route; the returned `plan.Explanation` holds the plans themselves.
    """
    fn = "dmattn.explain"
    check_backend(backend, fn)
    window = check_window(window_size, fn)
    tuned = _encoded(kernel_options, backend, fn)
    query, key, value, bias = ops.autocast_inputs(query, key, value, bias)
    if backend in ("reference", "flex"):
        return plan.Explanation(backend, None, None)
    problem = Problem(query, key, value, mask, bias, sinks, seqused_k)
    check_inputs(problem, scale, softcap, fn)
    check_sinks(sinks, query, fn)
    opts = Options(
        default_scale(query) if scale is None else scale, is_causal, softcap, deterministic,
        window, tuned,
    )  # fmt: skip
    dbias = bias is not None and bias.requires_grad
    return plan.explanation(problem, opts, backend, grad_lse=return_lse, compute_dbias=dbias)


# flash-attn-style entry points, for code written against flash_attn.flash_attn_func.
