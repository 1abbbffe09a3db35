"""torch.library registrations of the dmattn ops: schemas, backend kernels, fake kernels,
autograd and vmap rules.

Six ops, three for each sequence layout (dense / seqused_k, and packed sequences with
cu_seqlens, the ``_varlen`` ones):

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

The schemas are the one place the flat operand list is spelled: every kernel, rule and formula
below reads its call by name (calls.bind) as a Problem and Options, and the same code serves
both layouts. ``kernel_options`` (options.py) travels as one canonical string.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field

import torch
import torch.autograd.forward_ad as fwad

from dmattn_ops.core import options
from dmattn_ops.core._compat import (
    AFTER_AUTOGRAD_KEYSET,
    SingleLevelFunction,
    below_autograd,
    enable_single_level_autograd_function,
    functorch,
    plain_eager,
    saved_tensor_hooks_active,
    transforms_active,
    unwrap_dead_wrappers,
    without_autocast,
)
from dmattn_ops.core.problem import Options, Problem
from dmattn_ops.core.validate import check_problem, check_values, check_window
from dmattn_ops.dispatch import launch
from dmattn_ops.executors import chunked
from dmattn_ops.executors.chunked import stats_dtype
from dmattn_ops.registration.calls import bind, options_of, problem_of, unbind, values_of
from dmattn_ops.registration.static_launch import launch_statically

ATTENTION_SCHEMA = (
    "attention(Tensor query, Tensor key, Tensor value, Tensor? mask=None, Tensor? bias=None, "
    "float? scale=None, bool is_causal=False, float softcap=0.0, Tensor? seqused_k=None, "
    "bool deterministic=False, int[2] window_size=[-1, -1], Tensor? sinks=None) -> Tensor"
)
FORWARD_SCHEMA = (
    "attention_forward(Tensor query, Tensor key, Tensor value, Tensor? mask, Tensor? bias, "
    "float scale, bool is_causal, float softcap, Tensor? seqused_k, bool deterministic=False"
    ", int[2] window_size=[-1, -1], Tensor? sinks=None, str? kernel_options=None) -> "
    "(Tensor out, Tensor lse, Tensor lse_rem)"
)
BACKWARD_SCHEMA = (
    "attention_backward(Tensor grad_out, Tensor? grad_lse, Tensor query, Tensor key, "
    "Tensor value, Tensor out, Tensor lse, Tensor lse_rem, Tensor? mask, Tensor? bias, "
    "float scale, "
    "bool is_causal, float softcap, Tensor? seqused_k, bool deterministic, bool compute_dbias"
    ", int[2] window_size=[-1, -1], Tensor? sinks=None, str? kernel_options=None) "
    "-> (Tensor grad_query, Tensor grad_key, Tensor grad_value, Tensor grad_bias, "
    "Tensor grad_sinks)"
)
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
    "int[2] window_size=[-1, -1], str? kernel_options=None) -> (Tensor out, Tensor lse, "
    "Tensor lse_rem)"
)
VARLEN_BACKWARD_SCHEMA = (
    "attention_varlen_backward(Tensor grad_out, Tensor? grad_lse, Tensor query, Tensor key, "
    "Tensor value, Tensor out, Tensor lse, Tensor lse_rem, Tensor cu_seqlens_q, "
    "Tensor cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, Tensor? mask, "
    "Tensor? bias, float scale, bool is_causal, float softcap, bool deterministic, "
    "bool compute_dbias, int[2] window_size=[-1, -1], str? kernel_options=None) -> "
    "(Tensor grad_query, Tensor grad_key, Tensor grad_value, Tensor grad_bias)"
)

_lib = torch.library.Library("dmattn", "DEF")
for _schema in (
    ATTENTION_SCHEMA, FORWARD_SCHEMA, BACKWARD_SCHEMA,
    VARLEN_SCHEMA, VARLEN_FORWARD_SCHEMA, VARLEN_BACKWARD_SCHEMA,
):  # fmt: skip
    _lib.define(_schema)


@dataclass(frozen=True)
class Op:
    """The three ops of one layout: the public one, the forward and the backward."""

    public: torch._ops.OpOverload
    forward: torch._ops.OpOverload
    backward: torch._ops.OpOverload
    fn: str  # the name errors give

    @property
    def varlen(self) -> bool:
        return "varlen" in self.public.name()


DENSE_OPS = Op(
    torch.ops.dmattn.attention.default, torch.ops.dmattn.attention_forward.default,
    torch.ops.dmattn.attention_backward.default, "dmattn::attention",
)  # fmt: skip
VARLEN_OPS = Op(
    torch.ops.dmattn.attention_varlen.default, torch.ops.dmattn.attention_varlen_forward.default,
    torch.ops.dmattn.attention_varlen_backward.default, "dmattn::attention_varlen",
)  # fmt: skip


def check_call(call: dict, fn: str, values: bool = True) -> Problem:
    """Validates a bound call (validate.check_problem, and the kernel options; `values`: also
    the checks that read tensor data) and returns its problem."""
    problem = problem_of(call)
    window = call.get("window_size", (-1, -1))
    check_problem(problem, call.get("scale"), call.get("softcap"), window, fn, values)
    options.decode(call.get("kernel_options"), fn)
    return problem


# Backend kernels.


def forward_kernel(ops: Op):
    """The CPU/CUDA kernel of ops.forward: (out, lse, lse_rem). `kept` (launch.KeptLists):
    where its key lists are kept for the backward (a compiled graph's trace passes one)."""

    def kernel(*args, kept: launch.KeptLists | None = None, **kwargs):
        call = bind(ops.forward, args, kwargs)
        problem = check_call(call, ops.fn)
        return tuple(launch.forward(problem, options_of(call), kept))

    return kernel


def backward_kernel(ops: Op):
    """The CPU/CUDA kernel of ops.backward: the gradients (the varlen op has no sinks). `kept`:
    the forward's key lists (launch.KeptLists)."""

    def kernel(*args, kept: launch.KeptLists | None = None, **kwargs):
        call = bind(ops.backward, args, kwargs)
        saved = launch.Saved(call["out"], call["lse"], call["lse_rem"])
        grads = launch.backward(
            problem_of(call), options_of(call), saved, call["grad_out"], call["grad_lse"],
            call["compute_dbias"], kept,
        )  # fmt: skip
        return _backward_result(ops, grads)

    return kernel


def _backward_result(ops: Op, grads: launch.Gradients) -> tuple:
    """The backward op's outputs: the varlen op has no dsinks, the dense op an empty one
    without sinks (its schema returns a Tensor)."""
    if ops.varlen:
        return tuple(grads)[:4]
    dsinks = grads.dsinks if grads.dsinks is not None else grads.dq.new_empty((0,))
    return (*tuple(grads)[:4], dsinks)


def public_kernel(ops: Op, forward=None):
    """ops.public below autograd: the output of `forward` (ops.forward by default; a compiled
    graph's trace of a call that wants no gradient passes forward_kernel(ops), so that the
    kernels land in the graph as a training call's do: inductor.py)."""
    forward = ops.forward if forward is None else forward

    def kernel(*args, **kwargs):
        call = bind(ops.public, args, kwargs)
        call["scale"] = options_of(call).scale
        out, _, _ = forward(*unbind(ops.forward, call))
        return out

    return kernel


for _ops in (DENSE_OPS, VARLEN_OPS):
    for _key in ("CPU", "CUDA"):
        _lib.impl(_ops.forward.name().split("::")[1], forward_kernel(_ops), _key)
        _lib.impl(_ops.backward.name().split("::")[1], backward_kernel(_ops), _key)
    _lib.impl(_ops.public.name().split("::")[1], public_kernel(_ops), "CompositeExplicitAutograd")


# Fake kernels: exactly the shapes, dtypes and (contiguous) strides the real kernels return.


def _forward_fake(ops: Op):
    def fake(*args, **kwargs):
        problem = check_call(bind(ops.forward, args, kwargs), ops.fn, values=False)
        query = problem.query
        if query.is_cuda:  # a compiled graph's trace: its kernels launch statically
            launch_statically()
        out = query.new_empty((*query.shape[:-1], problem.value_dim))
        rows = (
            (problem.heads, problem.lq)
            if ops.varlen
            else (query.shape[0], problem.heads, problem.lq)
        )
        stats = stats_dtype(query.dtype)
        return out, query.new_empty(rows, dtype=stats), query.new_empty(rows, dtype=stats)

    return fake


def _backward_fake(ops: Op):
    def fake(*args, **kwargs):
        call = bind(ops.backward, args, kwargs)
        query, key, value, bias = call["query"], call["key"], call["value"], call["bias"]
        grads = (
            query.new_empty(query.shape),
            key.new_empty(key.shape),
            value.new_empty(value.shape),
        )
        if call["compute_dbias"] and bias is not None:
            dbias = bias.new_empty(bias.shape)
        else:
            dbias = query.new_empty((0,))
        if ops.varlen:
            return (*grads, dbias)
        sinks = call["sinks"]
        dsinks = query.new_empty((0,)) if sinks is None else sinks.new_empty(sinks.shape)
        return (*grads, dbias, dsinks)

    return fake


for _ops in (DENSE_OPS, VARLEN_OPS):
    torch.library.register_fake(_ops.forward.name(), _forward_fake(_ops), lib=_lib)
    torch.library.register_fake(_ops.backward.name(), _backward_fake(_ops), lib=_lib)


# Autograd.


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


# The differentiable inputs of AttentionFunction, in its apply order, then the call's Spec.
INPUTS = (
    "query", "key", "value", "mask", "bias", "sinks", "seqused_k", "cu_seqlens_q", "cu_seqlens_k",
)  # fmt: skip


@dataclass(frozen=True)
class Spec:
    """AttentionFunction's non-tensor argument: the options, the packed layout's longest
    sequences, and which ops run it. direct: a plain eager call (_differentiable_kernel), whose
    forward and backward run the kernels below the ops themselves, and `kept` then holds the
    forward's key lists for the backward (None where saved-tensor hooks, as activation
    checkpointing and offloading install, decide what the graph keeps)."""

    options: Options
    ops: Op
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    direct: bool = False
    kept: launch.KeptLists | None = field(default=None, compare=False)
    checked: bool = field(default=False, compare=False)  # validated by the caller (attend)

    def problem(self, tensors: dict) -> Problem:
        return Problem(*(tensors[name] for name in INPUTS), self.max_seqlen_q, self.max_seqlen_k)


class AttentionFunction(torch.autograd.Function):
    """(query, key, value, mask, bias, sinks, seqused_k, cu_seqlens_q, cu_seqlens_k, Spec) ->
    (out, lse, lse_rem), for either layout."""

    @staticmethod
    def forward(*args):
        *tensors, spec = args  # INPUTS, then the Spec
        problem = spec.problem(dict(zip(INPUTS, tensors)))
        if spec.direct:
            # What the forward op's CPU/CUDA kernel does (forward_kernel), without the
            # dispatcher's hops on the way there.
            if not spec.checked:
                check_call(values_of(problem, spec.options), spec.ops.fn)
            return tuple(launch.forward(problem, spec.options, spec.kept))
        op = spec.ops.forward
        return op(*unbind(op, values_of(problem, spec.options)))

    @staticmethod
    def setup_context(ctx, inputs, output):
        out, lse, lse_rem = output
        *tensors, spec = inputs
        saved = (*tensors, out, lse, lse_rem)
        ctx.save_for_backward(*saved)
        if fwad._current_level >= 0 or transforms_active():
            # jvp runs now or never (forward-mode AD is computed during the forward, inside a
            # dual level or a torch.func transform), so the forward's copy is kept only then.
            ctx.save_for_forward(*saved)
        ctx.mark_non_differentiable(lse_rem)
        ctx.spec = spec
        ctx.set_materialize_grads(False)

    @staticmethod
    def jvp(ctx, *tangents):
        *inputs, out, lse, lse_rem = ctx.saved_tensors
        spec, o = ctx.spec, ctx.spec.options
        problem = spec.problem(dict(zip(INPUTS, inputs)))
        t = dict(zip(INPUTS, tangents))
        dual = (t["query"], t["key"], t["value"], t["bias"])
        if problem.varlen:
            out_t, lse_t = chunked.varlen_jvp(problem, o, dual, lse, lse_rem)
            return out_t, lse_t, None
        out_t, lse_t = chunked.jvp(problem, o, dual, lse, lse_rem)
        if t["sinks"] is not None:
            # The sink's share w = exp(sinks[h] - lse) of each row: lse' gains w * sinks', and
            # out' loses w * sinks' * out (chunked.jvp's P already sums to 1 - w).
            w = chunked.sink_share(problem.sinks, lse, lse_rem) * t["sinks"].to(lse.dtype)[:, None]
            lse_t = lse_t + w.to(lse_t.dtype)
            out_t = out_t - (out.to(w.dtype) * w.transpose(1, 2)[..., None]).to(out_t.dtype)
        return out_t, lse_t, None

    @staticmethod
    def backward(ctx, grad_out, grad_lse, _grad_lse_rem):
        *inputs, out, lse, lse_rem = ctx.saved_tensors
        none = (None,) * (len(INPUTS) + 1)
        if grad_out is None and grad_lse is None:
            return none
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        spec = ctx.spec
        problem = spec.problem(dict(zip(INPUTS, inputs)))
        wanted = dict(zip(INPUTS, ctx.needs_input_grad))
        compute_dbias = problem.bias is not None and wanted["bias"]
        direct = spec.direct and not torch.is_grad_enabled()
        if direct and plain_eager((*inputs, grad_out, grad_lse)):
            # backward_kernel's work, reading the forward's key lists; with a graph to build
            # (create_graph) or under a mode, the backward op runs (and refuses a double
            # backward, or shows itself to the mode).
            saved = launch.Saved(out, lse, lse_rem)
            result = launch.backward(
                problem, spec.options, saved, grad_out, grad_lse, compute_dbias, spec.kept
            )
        else:
            op = spec.ops.backward
            call = values_of(problem, spec.options)
            call.update(
                grad_out=grad_out, grad_lse=grad_lse, out=out, lse=lse, lse_rem=lse_rem,
                compute_dbias=compute_dbias,
            )  # fmt: skip
            result = op(*unbind(op, call))
        grads = dict(zip(("query", "key", "value", "bias", "sinks"), result))
        if not compute_dbias:
            grads["bias"] = None
        if problem.sinks is None or not wanted["sinks"]:
            grads["sinks"] = None
        return (*(grads.get(name) for name in INPUTS), None)


DOUBLE_BACKWARD_ERROR = (
    "dmattn: a derivative of a derivative of attention (double backward: autograd.grad with "
    "create_graph, torch.func.grad of grad, hessian, jacfwd of jacrev, jacrev of jacfwd, jvp of "
    "jvp, jacfwd of jacfwd) is not supported; the first derivative is exact in either mode "
    "(grad, vjp, jacrev, jvp, jacfwd). Differentiate the attention output once, or use "
    "dmattn_ops.reference.attention, which autograd and torch.func differentiate to any order"
)


class _BackwardFunction(torch.autograd.Function):
    """A backward op's own autograd: usable once, refuses to be differentiated."""

    @staticmethod
    def forward(op, *args):
        return op(*args)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, *grads):
        raise NotImplementedError(DOUBLE_BACKWARD_ERROR)

    @staticmethod
    def jvp(ctx, *tangents):
        raise NotImplementedError(DOUBLE_BACKWARD_ERROR)


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


def _differentiable_kernel(ops: Op, public: bool):
    """The Autograd kernel of ops.public (public) or ops.forward: AttentionFunction where a
    gradient is wanted, else the op below autograd. A plain eager call (plain_eager) runs the
    kernels itself, as the ops below would, without the dispatcher's hops to them."""
    op = ops.public if public else ops.forward

    def kernel(keyset, *args, **kwargs):
        call = bind(op, args, kwargs)
        tensors = [call.get(name) for name in INPUTS]
        direct = plain_eager(tensors)
        if direct:
            problem = check_call(call, ops.fn)
            return _run(ops, problem, options_of(call), public, True, checked=True)
        if _needs_grad(call["query"], call["key"], call["value"], call["bias"], call.get("sinks")):
            check_window(call["window_size"], ops.fn)
            return _run(ops, problem_of(call), options_of(call), public, False, checked=False)
        with below_autograd():
            return op.redispatch(keyset & AFTER_AUTOGRAD_KEYSET, *args, **kwargs)

    return kernel


def _run(ops: Op, problem: Problem, opts: Options, public: bool, direct: bool, checked: bool):
    """The Autograd kernels' work for a call that wants a gradient or is plain eager (direct):
    AttentionFunction where a gradient is wanted, else (direct calls only) the forward's
    kernels. checked: the call was validated by the caller, and AttentionFunction's forward
    validates it again where not (it runs the forward op, which validates, unless direct)."""
    tensors = (
        problem.query, problem.key, problem.value, problem.mask, problem.bias, problem.sinks,
        problem.seqused_k, problem.cu_seqlens_q, problem.cu_seqlens_k,
    )  # fmt: skip
    if _needs_grad(problem.query, problem.key, problem.value, problem.bias, problem.sinks):
        kept = launch.KeptLists() if direct and not saved_tensor_hooks_active() else None
        spec = Spec(opts, ops, problem.max_seqlen_q, problem.max_seqlen_k, direct, kept, checked)
        result = _apply(AttentionFunction, *tensors, spec)
        return result[0] if public else result
    saved = launch.forward(problem, opts)
    return saved.out if public else tuple(saved)


def attend(problem: Problem, opts: Options, public: bool, seqused_k_in_range: bool = False):
    """A plain eager (plain_eager) dense or seqused_k call that api.attention has validated
    (shapes, window, sinks' shape, kernel options) as dmattn::attention (public) or
    dmattn::attention_forward would run it: their Autograd kernel's work without the
    dispatcher's hop to it and without validating the call again; the checks that read values
    run here (check_values; `seqused_k_in_range` as there). Under torch.profiler the call is
    recorded under the op's name."""
    check_values(problem, DENSE_OPS.fn, seqused_k_in_range)
    if not torch.autograd._profiler_enabled():
        return _run(DENSE_OPS, problem, opts, public, True, checked=True)
    name = DENSE_OPS.public.name() if public else DENSE_OPS.forward.name()
    with torch.profiler.record_function(name):
        return _run(DENSE_OPS, problem, opts, public, True, checked=True)


def _backward_autograd(ops: Op):
    op = ops.backward

    def kernel(keyset, *args, **kwargs):
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        if _outer_grad_levels(tensors):
            raise NotImplementedError(DOUBLE_BACKWARD_ERROR)
        if _needs_grad(*tensors):
            return _apply(_BackwardFunction, op, *unbind(op, bind(op, args, kwargs)))
        with below_autograd():
            return op.redispatch(keyset & AFTER_AUTOGRAD_KEYSET, *args, **kwargs)

    return kernel


for _ops in (DENSE_OPS, VARLEN_OPS):
    for _op, _kernel in (
        (_ops.public, _differentiable_kernel(_ops, public=True)),
        (_ops.forward, _differentiable_kernel(_ops, public=False)),
        (_ops.backward, _backward_autograd(_ops)),
    ):
        _lib.impl(_op.name().split("::")[1], _kernel, "Autograd", with_keyset=True)


# Autocast: the differentiable ops cast their floating inputs once (autocast_inputs) and run
# below autocast, as scaled_dot_product_attention does. The backward ops see tensors that are
# already in one dtype and only leave autocast, so that the CPU path's matmuls keep float32.


def _autocast_kernel(op, cast: bool):
    def kernel(keyset, *args, **kwargs):
        call = bind(op, args, kwargs)
        if cast:
            cast_to = autocast_inputs(call["query"], call["key"], call["value"], call["bias"])
            call.update(zip(("query", "key", "value", "bias"), cast_to))
        with without_autocast(call["query"].device.type):
            return op(*unbind(op, call))

    return kernel


for _ops in (DENSE_OPS, VARLEN_OPS):
    for _op, _cast in ((_ops.public, True), (_ops.forward, True), (_ops.backward, False)):
        for _key in ("AutocastCPU", "AutocastCUDA"):
            _lib.impl(
                _op.name().split("::")[1], _autocast_kernel(_op, _cast), _key, with_keyset=True
            )


# The vmap rules (batching.py) register on import, once the ops above exist.
from dmattn_ops.registration import batching  # noqa: E402, F401
