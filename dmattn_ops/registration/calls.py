"""Between the flat op schemas and the call's values: every kernel, rule and formula registered in
ops.py and batching.py reads its arguments by name through `bind`, turns them into a `Problem`
and `Options` (problem.py) with `problem_of` / `options_of`, and calls an op back with `unbind`.
The schemas in ops.py are the one place the flat operand list is spelled; nothing indexes an
argument tuple by position (the dispatcher also drops trailing arguments left at their
defaults, which `bind` restores).
"""

from __future__ import annotations

import math

import torch

from dmattn_ops.core.problem import Options, Problem

_SIGNATURES: dict = {}  # op -> (argument names, their defaults)


def _signature(op) -> tuple[tuple, tuple]:
    """(names, defaults) of op's arguments (an OpOverload, or an op's "ns::name")."""
    found = _SIGNATURES.get(op)
    if found is None:
        if isinstance(op, str):
            namespace, name = op.split("::")
            op = getattr(getattr(torch.ops, namespace), name).default
        arguments = op._schema.arguments
        defaults = tuple(
            tuple(a.default_value) if isinstance(a.default_value, list) else a.default_value
            for a in arguments
        )
        found = _SIGNATURES[op] = (tuple(a.name for a in arguments), defaults)
    return found


def bind(op, args: tuple, kwargs: dict | None = None) -> dict:
    """{argument name: value} of one call of op (an OpOverload), defaults filled in."""
    names, defaults = _signature(op)
    if len(args) == len(names) and not kwargs:
        return dict(zip(names, args))
    call = dict(zip(names, defaults))
    call.update(zip(names, args))
    if kwargs:
        call.update(kwargs)
    return call


def unbind(op, call: dict) -> tuple:
    """The positional arguments of op for the named values of `call` (absent names: defaults)."""
    names, defaults = _signature(op)
    get = call.get
    return tuple([get(name, default) for name, default in zip(names, defaults)])


def default_scale(query: torch.Tensor) -> float:
    """1 / sqrt(D); with D = 0 every q . k is 0 and any scale gives the same result: 1."""
    d = query.shape[-1]
    return 1.0 / math.sqrt(d) if d > 0 else 1.0


def problem_of(call: dict) -> Problem:
    """The tensors of a bound call, in the layout its op takes (dense / seqused_k, or packed
    sequences when it has cu_seqlens)."""
    return Problem(
        call["query"], call["key"], call["value"], call.get("mask"), call.get("bias"),
        call.get("sinks"), call.get("seqused_k"), call.get("cu_seqlens_q"),
        call.get("cu_seqlens_k"), call.get("max_seqlen_q", 0), call.get("max_seqlen_k", 0),
    )  # fmt: skip


def options_of(call: dict) -> Options:
    scale = call.get("scale")
    return Options(
        default_scale(call["query"]) if scale is None else scale,
        bool(call.get("is_causal", False)),
        0.0 if call.get("softcap") is None else call["softcap"],
        bool(call.get("deterministic", False)),
        tuple(call.get("window_size", (-1, -1))),
        call.get("kernel_options"),
    )


def values_of(problem: Problem, opts: Options) -> dict:
    """A call's named values from its problem and options (for `unbind`)."""
    values = dict(
        query=problem.query, key=problem.key, value=problem.value, mask=problem.mask,
        bias=problem.bias, sinks=problem.sinks, seqused_k=problem.seqused_k,
        scale=opts.scale, is_causal=opts.is_causal, softcap=opts.softcap,
        deterministic=opts.deterministic, window_size=opts.window,
        kernel_options=opts.kernel,
    )  # fmt: skip
    if problem.varlen:
        values.update(
            cu_seqlens_q=problem.cu_seqlens_q, cu_seqlens_k=problem.cu_seqlens_k,
            max_seqlen_q=problem.max_seqlen_q, max_seqlen_k=problem.max_seqlen_k,
        )  # fmt: skip
    return values
