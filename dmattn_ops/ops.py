"""torch.library registrations of the dmattn ops: schemas, backend kernels, fake kernels,
autograd and vmap rules.

Three ops:

* ``dmattn::attention`` -- the public op (README "API" and "Semantics"), differentiable in
  query, key, value, bias.
* ``dmattn::attention_forward`` -> (out, lse, lse_rem) -- carries the forward kernel;
  differentiable in query, key, value and bias through out and lse (a gradient of lse folds into
  delta). lse and lse_rem are float32 (float64 for float64 inputs); lse_rem = (max_j s_ij +
  log sum_j exp(s_ij - max)) - lse is what rounding lse dropped, which backward needs to
  recompute P = exp((s - lse) - lse_rem) exactly when a row's max is huge (a finfo.min bias,
  logits of 1e6); it carries no gradient.
* ``dmattn::attention_backward`` -> (dq, dk, dv, dbias) -- carries the backward kernel. dbias has
  bias's shape and dtype when ``compute_dbias``, else it is an empty (0,) tensor.

Autograd: ``torch.library.register_autograd`` builds an autograd.Function without
``setup_context``, which torch.func refuses (pytorch#168393, #170834). So the Autograd kernels
here are written by hand and apply an autograd.Function that has ``setup_context``. Inside a
torch.func transform the Autograd kernel already runs at the transform's level, on its wrapped
tensors, like any built-in op's Autograd kernel; there the Function is applied as a
single-level function instead of being routed back through ``custom_function_call``.
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass

import torch
import torch.autograd.forward_ad as fwad

from dmattn_ops import chunked, launch
from dmattn_ops._compat import (
    AFTER_AUTOGRAD_KEYSET,
    SingleLevelFunction,
    below_autograd,
    enable_single_level_autograd_function,
    functorch,
    transforms_active,
    unwrap_dead_wrappers,
    without_autocast,
)
from dmattn_ops.chunked import stats_dtype
from dmattn_ops.validate import (
    NO_WINDOW,
    check_cu_seqlens_values,
    check_inputs,
    check_seqused_k_values,
    check_sinks,
    check_sinks_values,
    check_varlen_inputs,
    check_window,
)

ATTENTION_SCHEMA = (
    "attention(Tensor query, Tensor key, Tensor value, Tensor? mask=None, Tensor? bias=None, "
    "float? scale=None, bool is_causal=False, float softcap=0.0, Tensor? seqused_k=None, "
    "bool deterministic=False, int[2] window_size=[-1, -1], Tensor? sinks=None) -> Tensor"
)
FORWARD_SCHEMA = (
    "attention_forward(Tensor query, Tensor key, Tensor value, Tensor? mask, Tensor? bias, "
    "float scale, bool is_causal, float softcap, Tensor? seqused_k, bool deterministic=False"
    ", int[2] window_size=[-1, -1], Tensor? sinks=None) -> (Tensor out, Tensor lse, "
    "Tensor lse_rem)"
)
BACKWARD_SCHEMA = (
    "attention_backward(Tensor grad_out, Tensor? grad_lse, Tensor query, Tensor key, "
    "Tensor value, Tensor out, Tensor lse, Tensor lse_rem, Tensor? mask, Tensor? bias, "
    "float scale, "
    "bool is_causal, float softcap, Tensor? seqused_k, bool deterministic, bool compute_dbias"
    ", int[2] window_size=[-1, -1], Tensor? sinks=None) "
    "-> (Tensor grad_query, Tensor grad_key, Tensor grad_value, Tensor grad_bias, "
    "Tensor grad_sinks)"
)

_lib = torch.library.Library("dmattn", "DEF")
for _schema in (ATTENTION_SCHEMA, FORWARD_SCHEMA, BACKWARD_SCHEMA):
    _lib.define(_schema)


def default_scale(query: torch.Tensor) -> float:
    """1 / sqrt(D); with D = 0 every q . k is 0 and any scale gives the same result: 1."""
    d = query.shape[-1]
    return 1.0 / math.sqrt(d) if d > 0 else 1.0


_AUTOCAST_ELIGIBLE = (torch.float16, torch.bfloat16, torch.float32)


def autocast_inputs(query, key, value, bias):
    """Under torch.autocast for query's device: query, key and value in the autocast dtype,
    and bias too unless it is float32 (a float32 bias is accepted with any query dtype), as
    scaled_dot_product_attention's autocast rule casts its inputs. float64 is never cast.
    Outside autocast the tensors are returned as they are."""
    if not isinstance(query, torch.Tensor):
        return query, key, value, bias  # the validators name what is wrong
    device = query.device.type
    if not (device in ("cpu", "cuda") and torch.is_autocast_enabled(device)):
        return query, key, value, bias
    dtype = torch.get_autocast_dtype(device)

    def cast(t):
        if t is None or t.dtype not in _AUTOCAST_ELIGIBLE or t.device.type != device:
            return t
        return t.to(dtype)

    if bias is not None and bias.dtype != torch.float32:
        bias = cast(bias)
    return cast(query), cast(key), cast(value), bias


def autocast_off(query):
    """The ops' own arithmetic never runs under autocast: its inputs were cast once. Outside
    autocast, a no-op context."""
    if not isinstance(query, torch.Tensor) or query.device.type not in ("cpu", "cuda"):
        return contextlib.nullcontext()
    if not torch.is_autocast_enabled(query.device.type):
        return contextlib.nullcontext()
    return torch.autocast(query.device.type, enabled=False)


@dataclass(frozen=True)
class Options:
    """The non-tensor arguments that travel from forward to backward."""

    scale: float
    is_causal: bool
    softcap: float
    deterministic: bool
    window: tuple[int, int]


# Backend kernels.


def _forward_impl(
    query, key, value, mask, bias, scale, is_causal, softcap, seqused_k, deterministic=False,
    window_size=NO_WINDOW, sinks=None,
):  # fmt: skip
    fn = "dmattn::attention"
    check_inputs(query, key, value, mask, bias, seqused_k, scale, softcap, fn=fn)
    check_seqused_k_values(seqused_k, key.shape[1], fn)
    check_sinks(sinks, query, fn)
    check_sinks_values(sinks, fn)
    window = check_window(window_size, fn)
    return launch.attention_forward(
        query, key, value, mask, bias, scale, is_causal, softcap, seqused_k, window, sinks
    )


def _backward_impl(
    grad_out,
    grad_lse,
    query,
    key,
    value,
    out,
    lse,
    lse_rem,
    mask,
    bias,
    scale,
    is_causal,
    softcap,
    seqused_k,
    deterministic,
    compute_dbias,
    window_size=NO_WINDOW,
    sinks=None,
):
    return launch.attention_backward(
        grad_out,
        grad_lse,
        query,
        key,
        value,
        out,
        lse,
        lse_rem,
        mask,
        bias,
        scale,
        is_causal,
        softcap,
        seqused_k,
        deterministic,
        compute_dbias and bias is not None,
        tuple(window_size),
        sinks,
    )


for _key in ("CPU", "CUDA"):
    _lib.impl("attention_forward", _forward_impl, _key)
    _lib.impl("attention_backward", _backward_impl, _key)


def _attention_impl(
    query,
    key,
    value,
    mask=None,
    bias=None,
    scale=None,
    is_causal=False,
    softcap=0.0,
    seqused_k=None,
    deterministic=False,
    window_size=NO_WINDOW,
    sinks=None,
):
    scale = default_scale(query) if scale is None else scale
    out, _, _ = torch.ops.dmattn.attention_forward(
        query, key, value, mask, bias, scale, is_causal, softcap, seqused_k, deterministic,
        window_size, sinks,
    )  # fmt: skip
    return out


_lib.impl("attention", _attention_impl, "CompositeExplicitAutograd")


# Fake kernels: exactly the shapes, dtypes and (contiguous) strides the real kernels return.


@torch.library.register_fake("dmattn::attention_forward")
def _forward_fake(
    query, key, value, mask, bias, scale, is_causal, softcap, seqused_k, deterministic=False,
    window_size=NO_WINDOW, sinks=None,
):  # fmt: skip
    check_inputs(query, key, value, mask, bias, seqused_k, scale, softcap, fn="dmattn::attention")
    check_sinks(sinks, query, "dmattn::attention")
    check_window(window_size, "dmattn::attention")
    b, lq, h, _ = query.shape
    out = query.new_empty((b, lq, h, value.shape[-1]))
    lse = query.new_empty((b, h, lq), dtype=stats_dtype(query.dtype))
    lse_rem = query.new_empty((b, h, lq), dtype=stats_dtype(query.dtype))
    return out, lse, lse_rem


@torch.library.register_fake("dmattn::attention_backward")
def _backward_fake(
    grad_out,
    grad_lse,
    query,
    key,
    value,
    out,
    lse,
    lse_rem,
    mask,
    bias,
    scale,
    is_causal,
    softcap,
    seqused_k,
    deterministic,
    compute_dbias,
    window_size=NO_WINDOW,
    sinks=None,
):
    dq = query.new_empty(query.shape)
    dk = key.new_empty(key.shape)
    dv = value.new_empty(value.shape)
    if compute_dbias and bias is not None:
        dbias = bias.new_empty(bias.shape)
    else:
        dbias = query.new_empty((0,))
    dsinks = query.new_empty((0,)) if sinks is None else sinks.new_empty(sinks.shape)
    return dq, dk, dv, dbias, dsinks


# Autograd.


def _apply(function: type[torch.autograd.Function], *args):
    if transforms_active():
        # The Function records for this level only: its forward runs with grad and forward
        # grad off, which hides the call from an enclosing grad or jvp level that would
        # differentiate it once more (a silent zero there), so that is refused.
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if _outer_grad_levels(tensors) or (_has_tangent(tensors) and _base_requires_grad(tensors)):
            raise NotImplementedError(DOUBLE_BACKWARD_ERROR)
        with enable_single_level_autograd_function():
            return _single_level(function).apply(*args)
    # Function.apply would first bind every call's arguments to forward's signature
    # (inspect.signature, tens of microseconds of host time per call); ours are all positional
    # with no defaults, so the C++ apply takes them as they are.
    return super(torch.autograd.Function, function).apply(*unwrap_dead_wrappers(args))


@functools.cache
def _single_level(function: type[torch.autograd.Function]) -> type:
    """The Function as a single-level function (what functorch's own custom_function_call
    builds per transform): its apply records the Function at the current level only. Since
    torch 2.14 a torch.autograd.Function subclass applied under a transform always goes back
    through custom_function_call, which has no kernel for the Autograd key this runs at."""
    methods = ("forward", "setup_context", "backward", "jvp")
    return type(
        f"{function.__name__}SingleLevel",
        (SingleLevelFunction,),
        {name: staticmethod(getattr(function, name)) for name in methods},
    )


def _has_tangent(tensors) -> bool:
    """Whether forward-mode AD (torch.func.jvp, jacfwd, torch.autograd.forward_ad) carries a
    tangent on any of these tensors at the current level."""
    level = fwad._current_level
    if level < 0:
        return False
    return any(
        t is not None and fwad.unpack_dual(t, level=level).tangent is not None for t in tensors
    )


def _needs_grad(*tensors) -> bool:
    """Whether the Function must be applied: reverse mode records it, forward mode needs its
    jvp."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        return True
    return _has_tangent(tensors)


class AttentionFunction(torch.autograd.Function):
    """(query, key, value, mask, bias, seqused_k, sinks, Options) -> (out, lse, lse_rem)."""

    @staticmethod
    def forward(query, key, value, mask, bias, seqused_k, sinks, options: Options):
        return torch.ops.dmattn.attention_forward(
            query,
            key,
            value,
            mask,
            bias,
            options.scale,
            options.is_causal,
            options.softcap,
            seqused_k,
            options.deterministic,
            options.window,
            sinks,
        )

    @staticmethod
    def setup_context(ctx, inputs, output):
        query, key, value, mask, bias, seqused_k, sinks, options = inputs
        out, lse, lse_rem = output
        saved = (query, key, value, mask, bias, seqused_k, sinks, out, lse, lse_rem)
        ctx.save_for_backward(*saved)
        ctx.save_for_forward(*saved)
        ctx.mark_non_differentiable(lse_rem)
        ctx.options = options
        ctx.set_materialize_grads(False)

    @staticmethod
    def jvp(ctx, t_query, t_key, t_value, _t_mask, t_bias, _t_seqused_k, t_sinks, _t_options):
        query, key, value, mask, bias, seqused_k, sinks, out, lse, lse_rem = ctx.saved_tensors
        o = ctx.options
        out_t, lse_t = chunked.jvp(
            query, key, value, mask, bias, (t_query, t_key, t_value, t_bias), lse, lse_rem,
            o.scale, o.is_causal, o.softcap, seqused_k, window=o.window,
        )  # fmt: skip
        if t_sinks is not None:
            # The sink's share w = exp(sinks[h] - lse) of each row: lse' gains w * sinks', and
            # out' loses w * sinks' * out (chunked.jvp's P already sums to 1 - w).
            w = chunked.sink_share(sinks, lse, lse_rem) * t_sinks.to(lse.dtype)[:, None]
            lse_t = lse_t + w.to(lse_t.dtype)
            out_t = out_t - (out.to(w.dtype) * w.transpose(1, 2)[..., None]).to(out_t.dtype)
        return out_t, lse_t, None

    @staticmethod
    def backward(ctx, grad_out, grad_lse, _grad_lse_rem):
        query, key, value, mask, bias, seqused_k, sinks, out, lse, lse_rem = ctx.saved_tensors
        if grad_out is None and grad_lse is None:
            return (None,) * 8
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        o = ctx.options
        compute_dbias = bias is not None and ctx.needs_input_grad[4]
        dq, dk, dv, dbias, dsinks = torch.ops.dmattn.attention_backward(
            grad_out,
            grad_lse,
            query,
            key,
            value,
            out,
            lse,
            lse_rem,
            mask,
            bias,
            o.scale,
            o.is_causal,
            o.softcap,
            seqused_k,
            o.deterministic,
            compute_dbias,
            o.window,
            sinks,
        )
        dsinks = dsinks if sinks is not None and ctx.needs_input_grad[6] else None
        return dq, dk, dv, None, (dbias if compute_dbias else None), None, dsinks, None


DOUBLE_BACKWARD_ERROR = (
    "dmattn: a derivative of a derivative of attention (double backward: autograd.grad with "
    "create_graph, torch.func.grad of grad, hessian, jacfwd of jacrev, jacrev of jacfwd, jvp of "
    "jvp, jacfwd of jacfwd) is not supported; the first derivative is exact in either mode "
    "(grad, vjp, jacrev, jvp, jacfwd). Differentiate the attention output once, or use "
    "dmattn_ops.reference.attention, which autograd and torch.func differentiate to any order"
)


class _BackwardFunction(torch.autograd.Function):
    """attention_backward's own autograd: usable once, refuses to be differentiated."""

    @staticmethod
    def forward(*args):
        return torch.ops.dmattn.attention_backward(*args)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, *grads):
        raise NotImplementedError(DOUBLE_BACKWARD_ERROR)

    @staticmethod
    def jvp(ctx, *tangents):
        raise NotImplementedError(DOUBLE_BACKWARD_ERROR)


def _attention_autograd(
    keyset,
    query,
    key,
    value,
    mask=None,
    bias=None,
    scale=None,
    is_causal=False,
    softcap=0.0,
    seqused_k=None,
    deterministic=False,
    window_size=NO_WINDOW,
    sinks=None,
):
    if _needs_grad(query, key, value, bias, sinks):
        scale = default_scale(query) if scale is None else scale
        window = check_window(window_size, "dmattn::attention")
        options = Options(scale, is_causal, softcap, deterministic, window)
        out, _, _ = _apply(
            AttentionFunction, query, key, value, mask, bias, seqused_k, sinks, options
        )
        return out
    with below_autograd():
        return torch.ops.dmattn.attention.default.redispatch(
            keyset & AFTER_AUTOGRAD_KEYSET,
            query,
            key,
            value,
            mask,
            bias,
            scale,
            is_causal,
            softcap,
            seqused_k,
            deterministic,
            window_size,
            sinks,
        )


def _forward_autograd(
    keyset, query, key, value, mask, bias, scale, is_causal, softcap, seqused_k,
    deterministic=False, window_size=NO_WINDOW, sinks=None,
):  # fmt: skip
    if _needs_grad(query, key, value, bias, sinks):
        window = check_window(window_size, "dmattn::attention")
        options = Options(scale, is_causal, softcap, deterministic, window)
        return _apply(AttentionFunction, query, key, value, mask, bias, seqused_k, sinks, options)
    with below_autograd():
        return torch.ops.dmattn.attention_forward.default.redispatch(
            keyset & AFTER_AUTOGRAD_KEYSET,
            query,
            key,
            value,
            mask,
            bias,
            scale,
            is_causal,
            softcap,
            seqused_k,
            deterministic,
            window_size,
            sinks,
        )


def _outer_grad_levels(tensors) -> bool:
    """Whether a torch.func transform outside the current one tracks any of these tensors.

    Called from the backward ops' Autograd kernels: each tensor is unwrapped from the current
    level inwards; a grad or jvp wrapper (functorch's TensorWrapper) found below the current
    level means an enclosing grad/jvp/jacfwd/hessian would differentiate this gradient. The
    single-level Function applied here cannot record for that level (it runs its forward with
    grad mode off, which hides the call from the enclosing level), so the result would be a
    silent zero; the caller raises instead.
    """
    if not transforms_active():
        return False
    F = functorch
    current = F.peek_interpreter_stack().level()
    for t in tensors:
        while F.is_functorch_wrapped_tensor(t) or F.is_batchedtensor(t):
            if F.is_gradtrackingtensor(t) and F.maybe_get_level(t) < current:
                return True
            t = F.get_unwrapped(t)
    return False


def _base_requires_grad(tensors) -> bool:
    """Whether plain autograd, outside every torch.func transform, records any of these
    tensors: a jvp transform inside it computes tangents it would differentiate wrongly."""
    if not torch.is_grad_enabled():
        return False
    F = functorch
    for t in tensors:
        while F.is_functorch_wrapped_tensor(t) or F.is_batchedtensor(t):
            t = F.get_unwrapped(t)
        if t.requires_grad:
            return True
    return False


def _backward_autograd(keyset, *args):
    if _outer_grad_levels(a for a in args if isinstance(a, torch.Tensor)):
        raise NotImplementedError(DOUBLE_BACKWARD_ERROR)
    if _needs_grad(*(a for a in args if isinstance(a, torch.Tensor))):
        return _apply(_BackwardFunction, *args)
    with below_autograd():
        return torch.ops.dmattn.attention_backward.default.redispatch(
            keyset & AFTER_AUTOGRAD_KEYSET, *args
        )


_lib.impl("attention", _attention_autograd, "Autograd", with_keyset=True)
_lib.impl("attention_forward", _forward_autograd, "Autograd", with_keyset=True)
_lib.impl("attention_backward", _backward_autograd, "Autograd", with_keyset=True)


# Variable-length batches.

VARLEN_SCHEMA = (
    "attention_varlen(Tensor query, Tensor key, Tensor value, Tensor cu_seqlens_q, "
    "Tensor cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, Tensor? mask=None, "
    "Tensor? bias=None, float? scale=None, bool is_causal=False, float softcap=0.0, "
    "bool deterministic=False, int[2] window_size=[-1, -1]) -> Tensor"
)
VARLEN_FORWARD_SCHEMA = (
    "attention_varlen_forward(Tensor query, Tensor key, Tensor value, Tensor cu_seqlens_q, "
    "Tensor cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, Tensor? mask, Tensor? bias, "
    "float scale, bool is_causal, float softcap, bool deterministic=False, "
    "int[2] window_size=[-1, -1]) -> (Tensor out, Tensor lse, Tensor lse_rem)"
)
VARLEN_BACKWARD_SCHEMA = (
    "attention_varlen_backward(Tensor grad_out, Tensor? grad_lse, Tensor query, Tensor key, "
    "Tensor value, Tensor out, Tensor lse, Tensor lse_rem, Tensor cu_seqlens_q, "
    "Tensor cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, Tensor? mask, "
    "Tensor? bias, float scale, bool is_causal, float softcap, bool deterministic, "
    "bool compute_dbias, int[2] window_size=[-1, -1]) -> (Tensor grad_query, Tensor grad_key, "
    "Tensor grad_value, Tensor grad_bias)"
)
for _schema in (VARLEN_SCHEMA, VARLEN_FORWARD_SCHEMA, VARLEN_BACKWARD_SCHEMA):
    _lib.define(_schema)


def _varlen_forward_impl(
    query, key, value, cu_q, cu_k, max_q, max_k, mask, bias, scale, is_causal, softcap,
    deterministic=False, window_size=NO_WINDOW,
):  # fmt: skip
    fn = "dmattn::attention_varlen"
    window = check_window(window_size, fn)
    check_varlen_inputs(
        query, key, value, cu_q, cu_k, max_q, max_k, mask, bias, scale, softcap, fn=fn
    )
    check_cu_seqlens_values(cu_q, cu_k, query.shape[0], key.shape[0], max_q, max_k, fn)
    return launch.attention_varlen_forward(
        query, key, value, cu_q, cu_k, max_q, max_k, mask, bias, scale, is_causal, softcap, window
    )


def _varlen_backward_impl(
    grad_out, grad_lse, query, key, value, out, lse, lse_rem, cu_q, cu_k, max_q, max_k,
    mask, bias, scale, is_causal, softcap, deterministic, compute_dbias, window_size=NO_WINDOW,
):  # fmt: skip
    return launch.attention_varlen_backward(
        grad_out, grad_lse, query, key, value, out, lse, lse_rem, cu_q, cu_k, max_q, max_k,
        mask, bias, scale, is_causal, softcap, deterministic, compute_dbias and bias is not None,
        tuple(window_size),
    )  # fmt: skip


for _key in ("CPU", "CUDA"):
    _lib.impl("attention_varlen_forward", _varlen_forward_impl, _key)
    _lib.impl("attention_varlen_backward", _varlen_backward_impl, _key)


def _varlen_impl(
    query, key, value, cu_q, cu_k, max_q, max_k, mask=None, bias=None, scale=None,
    is_causal=False, softcap=0.0, deterministic=False, window_size=NO_WINDOW,
):  # fmt: skip
    scale = default_scale(query) if scale is None else scale
    out, _, _ = torch.ops.dmattn.attention_varlen_forward(
        query, key, value, cu_q, cu_k, max_q, max_k, mask, bias, scale, is_causal, softcap,
        deterministic, window_size,
    )  # fmt: skip
    return out


_lib.impl("attention_varlen", _varlen_impl, "CompositeExplicitAutograd")


@torch.library.register_fake("dmattn::attention_varlen_forward")
def _varlen_forward_fake(
    query, key, value, cu_q, cu_k, max_q, max_k, mask, bias, scale, is_causal, softcap,
    deterministic=False, window_size=NO_WINDOW,
):  # fmt: skip
    check_window(window_size, "dmattn::attention_varlen")
    check_varlen_inputs(
        query, key, value, cu_q, cu_k, max_q, max_k, mask, bias, scale, softcap,
        fn="dmattn::attention_varlen",
    )  # fmt: skip
    total_q, h, _ = query.shape
    out = query.new_empty((total_q, h, value.shape[-1]))
    lse = query.new_empty((h, total_q), dtype=stats_dtype(query.dtype))
    lse_rem = query.new_empty((h, total_q), dtype=stats_dtype(query.dtype))
    return out, lse, lse_rem


@torch.library.register_fake("dmattn::attention_varlen_backward")
def _varlen_backward_fake(
    grad_out, grad_lse, query, key, value, out, lse, lse_rem, cu_q, cu_k, max_q, max_k,
    mask, bias, scale, is_causal, softcap, deterministic, compute_dbias, window_size=NO_WINDOW,
):  # fmt: skip
    dbias = bias.new_empty(bias.shape) if compute_dbias and bias is not None else None
    if dbias is None:
        dbias = query.new_empty((0,))
    grads = (query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape))
    return (*grads, dbias)


@dataclass(frozen=True)
class VarlenOptions(Options):
    max_seqlen_q: int
    max_seqlen_k: int


class VarlenAttentionFunction(torch.autograd.Function):
    """(query, key, value, cu_q, cu_k, mask, bias, VarlenOptions) -> (out, lse, lse_rem)."""

    @staticmethod
    def forward(query, key, value, cu_q, cu_k, mask, bias, options: VarlenOptions):
        o = options
        return torch.ops.dmattn.attention_varlen_forward(
            query, key, value, cu_q, cu_k, o.max_seqlen_q, o.max_seqlen_k, mask, bias,
            o.scale, o.is_causal, o.softcap, o.deterministic, o.window,
        )  # fmt: skip

    @staticmethod
    def setup_context(ctx, inputs, output):
        query, key, value, cu_q, cu_k, mask, bias, options = inputs
        out, lse, lse_rem = output
        ctx.save_for_backward(query, key, value, cu_q, cu_k, mask, bias, out, lse, lse_rem)
        ctx.save_for_forward(query, key, value, cu_q, cu_k, mask, bias, out, lse, lse_rem)
        ctx.mark_non_differentiable(lse_rem)
        ctx.options = options
        ctx.set_materialize_grads(False)

    @staticmethod
    def jvp(ctx, t_query, t_key, t_value, _t_cu_q, _t_cu_k, _t_mask, t_bias, _t_options):
        query, key, value, cu_q, cu_k, mask, bias, _, lse, lse_rem = ctx.saved_tensors
        o = ctx.options
        out_t, lse_t = chunked.varlen_jvp(
            query, key, value, cu_q, cu_k, mask, bias, (t_query, t_key, t_value, t_bias), lse,
            lse_rem, o.scale, o.is_causal, o.softcap, o.window,
        )  # fmt: skip
        return out_t, lse_t, None

    @staticmethod
    def backward(ctx, grad_out, grad_lse, _grad_lse_rem):
        query, key, value, cu_q, cu_k, mask, bias, out, lse, lse_rem = ctx.saved_tensors
        if grad_out is None and grad_lse is None:
            return (None,) * 8
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        o = ctx.options
        compute_dbias = bias is not None and ctx.needs_input_grad[6]
        dq, dk, dv, dbias = torch.ops.dmattn.attention_varlen_backward(
            grad_out, grad_lse, query, key, value, out, lse, lse_rem, cu_q, cu_k,
            o.max_seqlen_q, o.max_seqlen_k, mask, bias, o.scale, o.is_causal, o.softcap,
            o.deterministic, compute_dbias, o.window,
        )  # fmt: skip
        return dq, dk, dv, None, None, None, (dbias if compute_dbias else None), None


def _varlen_autograd(
    keyset, query, key, value, cu_q, cu_k, max_q, max_k, mask=None, bias=None, scale=None,
    is_causal=False, softcap=0.0, deterministic=False, window_size=NO_WINDOW,
):  # fmt: skip
    if _needs_grad(query, key, value, bias):
        scale = default_scale(query) if scale is None else scale
        window = check_window(window_size, "dmattn::attention_varlen")
        options = VarlenOptions(scale, is_causal, softcap, deterministic, window, max_q, max_k)
        args = (query, key, value, cu_q, cu_k, mask, bias, options)
        out, _, _ = _apply(VarlenAttentionFunction, *args)
        return out
    with below_autograd():
        return torch.ops.dmattn.attention_varlen.default.redispatch(
            keyset & AFTER_AUTOGRAD_KEYSET, query, key, value, cu_q, cu_k, max_q,
            max_k, mask, bias, scale, is_causal, softcap, deterministic, window_size,
        )  # fmt: skip


def _varlen_forward_autograd(
    keyset, query, key, value, cu_q, cu_k, max_q, max_k, mask, bias, scale, is_causal, softcap,
    deterministic=False, window_size=NO_WINDOW,
):  # fmt: skip
    if _needs_grad(query, key, value, bias):
        window = check_window(window_size, "dmattn::attention_varlen")
        options = VarlenOptions(scale, is_causal, softcap, deterministic, window, max_q, max_k)
        return _apply(VarlenAttentionFunction, query, key, value, cu_q, cu_k, mask, bias, options)
    with below_autograd():
        return torch.ops.dmattn.attention_varlen_forward.default.redispatch(
            keyset & AFTER_AUTOGRAD_KEYSET, query, key, value, cu_q, cu_k, max_q,
            max_k, mask, bias, scale, is_causal, softcap, deterministic, window_size,
        )  # fmt: skip


def _varlen_backward_autograd(keyset, *args):
    if _outer_grad_levels(a for a in args if isinstance(a, torch.Tensor)):
        raise NotImplementedError(DOUBLE_BACKWARD_ERROR)
    if _needs_grad(*(a for a in args if isinstance(a, torch.Tensor))):
        return _apply(_VarlenBackwardFunction, *args)
    with below_autograd():
        return torch.ops.dmattn.attention_varlen_backward.default.redispatch(
            keyset & AFTER_AUTOGRAD_KEYSET, *args
        )


class _VarlenBackwardFunction(_BackwardFunction):
    @staticmethod
    def forward(*args):
        return torch.ops.dmattn.attention_varlen_backward(*args)


_lib.impl("attention_varlen", _varlen_autograd, "Autograd", with_keyset=True)
_lib.impl("attention_varlen_forward", _varlen_forward_autograd, "Autograd", with_keyset=True)
_lib.impl("attention_varlen_backward", _varlen_backward_autograd, "Autograd", with_keyset=True)


# Autocast: the differentiable ops cast their floating inputs once (autocast_inputs) and run
# below autocast, as scaled_dot_product_attention does. The backward ops see tensors that are
# already in one dtype and only leave autocast, so that the CPU path's matmuls keep float32.


def _autocast_kernel(op, cast: bool):
    def kernel(keyset, *args):
        device = next(a for a in args if isinstance(a, torch.Tensor)).device.type
        if cast:
            # The dispatcher drops trailing arguments left at their defaults (bias among them).
            bias_at = 8 if "varlen" in op.name() else 4
            bias = args[bias_at] if len(args) > bias_at else None
            q, k, v, bias = autocast_inputs(*args[:3], bias)
            rest = (bias, *args[bias_at + 1 :]) if len(args) > bias_at else ()
            args = (q, k, v, *args[3:bias_at], *rest)
        with without_autocast(device):
            return op(*args)

    return kernel


for _name, _cast in (
    ("attention", True),
    ("attention_forward", True),
    ("attention_backward", False),
    ("attention_varlen", True),
    ("attention_varlen_forward", True),
    ("attention_varlen_backward", False),
):
    for _key in ("AutocastCPU", "AutocastCUDA"):
        _op = getattr(torch.ops.dmattn, _name).default
        _lib.impl(_name, _autocast_kernel(_op, _cast), _key, with_keyset=True)


# The vmap rules (batching.py) register on import, once the ops above exist.
from dmattn_ops import batching  # noqa: E402, F401
