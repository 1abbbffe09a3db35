"""The torch.func transform matrix (issue 18): every registered differentiable op under grad,
vjp, jvp, jacrev, jacfwd, vmap (each argument batched alone and all together),
compile(func.grad) and autocast, against the same transform of the float64 oracle, on the
chunked PyTorch path (float64) and the Triton kernels (float32; the interpreter on CPU).
Transforms that are refused (hessian, grad of grad, jvp of jvp, ...) must raise and name it.

README "torch.func transforms" lists the same matrix.
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from helpers import DEVICE, assert_close, low_precision_bound

from dmattn_ops import reference
from dmattn_ops.dispatch import launch

SOFTCAP = 4.0
PATHS = {
    "chunked": torch.float64,
    "triton": pytest.param(
        torch.float32,
        marks=pytest.mark.skipif(
            DEVICE == "cpu" and not launch.interpreter_on(), reason="needs CUDA or the interpreter"
        ),
    ),
}
REFUSED = "derivative of a derivative of attention"


class Problem:
    """One op's callable over its differentiable inputs (query, key, value, bias, and sinks for
    an op named "...+sinks"), the same function of the oracle, and the inputs; `extra` holds
    the other tensors (mask, seqused_k for the dense op) that vmap may batch."""

    def __init__(self, op: str, dtype: torch.dtype):
        g = torch.Generator().manual_seed(11)
        rand = functools.partial(torch.randn, generator=g, dtype=torch.float64)
        op, _, with_sinks = op.partition("+")
        self.op, self.dtype = op, dtype
        h, hkv, d = 2, 1, 4
        if op.startswith("attention_varlen"):
            # The last query row and key row lie outside every sequence.
            self.cu_q = torch.tensor([0, 2, 4], dtype=torch.int32)
            self.cu_k = torch.tensor([0, 4, 9], dtype=torch.int32)
            inputs = (rand(5, h, d), rand(10, hkv, d), rand(10, hkv, d), rand(h, 10))
            mask = torch.rand(hkv, 10, generator=g) < 0.6
            mask[:, [3, 4]] = True  # every row of both causal sequences keeps a key
            self.extra = (mask,)
        else:
            inputs = (rand(1, 3, h, d), rand(1, 6, hkv, d), rand(1, 6, hkv, d), rand(1, h, 3, 6))
            mask = torch.rand(1, hkv, 1, 6, generator=g) < 0.6
            mask[..., 0] = True
            self.extra = (mask, torch.tensor([5], dtype=torch.int32))
            if with_sinks:
                inputs = (*inputs, torch.tensor([0.3, -0.7], dtype=torch.float64))
        if op.startswith("attention_varlen"):
            self.cu_q, self.cu_k = self.cu_q.to(DEVICE), self.cu_k.to(DEVICE)
        self.extra = tuple(t.to(DEVICE) for t in self.extra)
        self.inputs64 = tuple(t.to(DEVICE) for t in inputs)
        self.inputs = tuple(t.to(dtype) for t in self.inputs64)

    def _split(self, args):
        """(q, k, v, bias), sinks or None, and the extra tensors (self.extra unless given)."""
        n = len(self.inputs)
        return args[:4], (args[4] if n == 5 else None), (args[n:] or self.extra)

    def ours(self, *args):
        (q, k, v, bias), sinks, extra = self._split(args)
        ops = torch.ops.dmattn
        if self.op == "attention":
            mask, seq = extra
            if sinks is None:
                return ops.attention(q, k, v, mask, bias, None, True, SOFTCAP, seq)
            return ops.attention(q, k, v, mask, bias, None, True, SOFTCAP, seq, False, [-1, -1],
                                 sinks)  # fmt: skip
        if self.op == "attention_forward":
            mask, seq = extra
            out, lse, _ = ops.attention_forward(
                q, k, v, mask, bias, q.shape[-1] ** -0.5, True, SOFTCAP, seq,
                *(() if sinks is None else (False, [-1, -1], sinks)),
            )  # fmt: skip
            return out, lse
        (mask,) = extra
        args = (q, k, v, self.cu_q, self.cu_k, 3, 6, mask, bias)
        if self.op == "attention_varlen":
            return ops.attention_varlen(*args, None, True, SOFTCAP)
        out, lse, _ = ops.attention_varlen_forward(*args, q.shape[-1] ** -0.5, True, SOFTCAP)
        return out, lse

    def oracle(self, *args):
        (q, k, v, bias), sinks, extra = self._split(args)
        fn = getattr(reference, self.op)
        kw = dict(is_causal=True, softcap=SOFTCAP)
        if sinks is not None:
            kw["sinks"] = sinks
        if self.op.startswith("attention_varlen"):
            (mask,) = extra
            return fn(q, k, v, self.cu_q, self.cu_k, 3, 6, mask, bias, **kw)
        mask, seq = extra
        return fn(q, k, v, mask, bias, seqused_k=seq, **kw)


OPS = (
    "attention", "attention_forward", "attention_varlen", "attention_varlen_forward",
    "attention+sinks", "attention_forward+sinks",
)  # fmt: skip


def _leaves(x):
    return [t for t in torch.utils._pytree.tree_leaves(x) if isinstance(t, torch.Tensor)]


def _compare(p: Problem, got, want64, want_lowp, cell: str) -> None:
    got, want64, want_lowp = _leaves(got), _leaves(want64), _leaves(want_lowp)
    assert len(got) == len(want64)
    for i, (a, w, wl) in enumerate(zip(got, want64, want_lowp)):
        if p.dtype == torch.float64:
            bound = 2.0**-50 * max(1.0, w.abs().max().item())
        else:
            bound = low_precision_bound(w, wl, p.dtype)
            bound = max(bound, 2.0**-20 * max(1.0, w.abs().max().item()))
        assert_close(a.double(), w.double(), bound, f"{cell}[{i}]")


def _run_cell(p: Problem, transform) -> None:
    got = transform(p.ours, p.inputs)
    want64 = transform(p.oracle, p.inputs64)
    want_lowp = want64 if p.dtype == torch.float64 else transform(p.oracle, p.inputs)
    _compare(p, got, want64, want_lowp, transform.__name__)


# The transforms, each (function, inputs) -> tensors.


def _weights(x):
    """Distinct weights, exact in every dtype (so bf16 and float64 losses weigh alike)."""
    return ((torch.arange(x.numel(), device=x.device) % 7 - 3) / 4).to(x.dtype).view(x.shape)


def _scalar(f):
    """A loss that depends on every output entry with distinct weights (a plain sum is
    invariant to some directions: the rows of P sum to one)."""

    def loss(*args):
        return sum((o * _weights(o)).sum() for o in _leaves(f(*args)))

    return loss


def grad(f, x):
    return torch.func.grad(_scalar(f), argnums=tuple(range(len(x))))(*x)


def vjp(f, x):
    out, fn = torch.func.vjp(f, *x)
    return fn(torch.utils._pytree.tree_map(_weights, out))


def jvp(f, x):
    tangents = tuple(torch.cos(torch.arange(t.numel()).to(t)).view(t.shape) for t in x)
    return torch.func.jvp(f, x, tangents)


def jacrev(f, x):
    return torch.func.jacrev(f, argnums=tuple(range(len(x))))(*x)


def jacfwd(f, x):
    return torch.func.jacfwd(f, argnums=tuple(range(len(x))))(*x)


def compile_grad(f, x):
    g = torch.func.grad(_scalar(f), argnums=(0, 3, *range(4, len(x))))
    if f.__name__ == "oracle":  # the varlen oracle reads cu_seqlens on the host
        return g(*x)
    torch._dynamo.reset()
    return torch.compile(g, fullgraph=True)(*x)


def vmap_of_grad(f, x):
    """Per-sample gradients: vmap over a stacked query of grad."""
    q = torch.stack([x[0], x[0].flip(-1)])
    g = torch.func.grad(_scalar(f), argnums=(0, 3, *range(4, len(x))))  # dsinks per sample
    return torch.vmap(g, in_dims=(0, *[None] * (len(x) - 1)))(q, *x[1:])


def jvp_under_vmap(f, x):
    """Several tangents at once (what jacfwd does), the tangent batched on dim 1."""
    tq = torch.stack([torch.cos(x[0]), torch.sin(x[0])], dim=1)
    return torch.vmap(lambda t: torch.func.jvp(f, x, (t, *map(torch.zeros_like, x[1:]))), 1)(tq)


TRANSFORMS = (grad, vjp, jvp, jacrev, jacfwd, compile_grad, vmap_of_grad, jvp_under_vmap)


@pytest.mark.parametrize("path", list(PATHS.values()), ids=list(PATHS))
@pytest.mark.parametrize("transform", TRANSFORMS, ids=[t.__name__ for t in TRANSFORMS])
@pytest.mark.parametrize("op", OPS)
def test_transform(op, transform, path):
    _run_cell(Problem(op, path), transform)


# vmap: each argument batched alone, then all together; the oracle runs per sample.


def _batched(t: torch.Tensor, n: int, seed: int) -> torch.Tensor:
    if t.dtype == torch.bool:
        out = torch.rand(n, *t.shape, generator=torch.Generator().manual_seed(seed)) < 0.6
        return out.to(t.device) | t  # keep the keys that keep every causal row non-empty
    if t.dtype == torch.int32:
        return torch.stack([t, t - 1 - seed % 2]).clamp(min=1)[:n]
    return torch.stack([t, torch.sin(t * (seed + 1))])[:n]


def _arg_names(op: str) -> tuple[str, ...]:
    extra = ("mask",) if "varlen" in op else ("mask", "seqused_k")
    sinks = ("sinks",) if op.endswith("+sinks") else ()
    return ("query", "key", "value", "bias", *sinks, *extra)


@pytest.mark.parametrize("path", list(PATHS.values()), ids=list(PATHS))
@pytest.mark.parametrize("batched", ["query", "key", "value", "bias", "mask", "seqused_k", "all"])
@pytest.mark.parametrize("op", OPS)
def test_vmap(op, batched, path):
    names = _arg_names(op)
    if batched not in names and batched != "all":
        pytest.skip(f"{op} has no {batched}")
    p = Problem(op, path)
    n = 2
    # Sinks are shared by the folded batch: batched alone they are refused (test below).
    pick = [batched == name or (batched == "all" and name != "sinks") for name in names]
    args = (*p.inputs, *p.extra)
    args64 = (*p.inputs64, *p.extra)
    b_args = [_batched(a, n, i) if on else a for i, (a, on) in enumerate(zip(args, pick))]
    b_args64 = [_batched(a, n, i) if on else a for i, (a, on) in enumerate(zip(args64, pick))]
    in_dims = tuple(0 if on else None for on in pick)
    torch._C._functorch._set_vmap_fallback_warning_enabled(True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a batching rule, not the per-sample fallback
            got = torch.vmap(p.ours, in_dims=in_dims)(*b_args)
    finally:
        torch._C._functorch._set_vmap_fallback_warning_enabled(False)

    def per_sample(fn, a):
        rows = [fn(*(t[i] if on else t for t, on in zip(a, pick))) for i in range(n)]
        return torch.utils._pytree.tree_map(lambda *r: torch.stack(r), *rows)

    want64 = per_sample(p.oracle, b_args64)
    want_lowp = want64 if path == torch.float64 else per_sample(p.oracle, b_args)
    _compare(p, got, want64, want_lowp, f"vmap[{batched}]")


@pytest.mark.parametrize("path", list(PATHS.values()), ids=list(PATHS))
def test_vmap_over_sinks_is_refused(path):
    p = Problem("attention+sinks", path)
    q, k, v, bias, sinks = p.inputs
    with pytest.raises(NotImplementedError, match="vmap over sinks"):
        torch.vmap(p.ours, in_dims=(None, None, None, None, 0))(
            q, k, v, bias, torch.stack([sinks, -sinks])
        )


# Refused: every derivative of a derivative, named in the error.


def _hessian(f, x):
    return torch.func.hessian(_scalar(lambda q: f(q, *x[1:])))(x[0])


def _grad_of_grad(f, x):
    inner = torch.func.grad(_scalar(lambda b: f(*x[:3], b)))
    return torch.func.grad(lambda b: (inner(b) * _weights(b)).sum())(x[3])


def _jvp_of_jvp(f, x):
    t = torch.ones_like(x[0])
    inner = lambda q: torch.func.jvp(lambda z: f(z, *x[1:]), (q,), (t,))[1]
    return torch.func.jvp(inner, (x[0],), (t,))


def _jacrev_of_jacfwd(f, x):
    return torch.func.jacrev(torch.func.jacfwd(_scalar(lambda q: f(q, *x[1:]))))(x[0])


def _autograd_of_jvp(f, x):
    q = x[0].clone().requires_grad_()
    _, t = torch.func.jvp(lambda z: f(z, *x[1:]), (q,), (torch.ones_like(q),))
    return torch.autograd.grad(_leaves(t)[0].sum(), q)


def _create_graph(f, x):
    q = x[0].clone().requires_grad_()
    (dq,) = torch.autograd.grad(_scalar(f)(q, *x[1:]), q, create_graph=True)
    return torch.autograd.grad(dq.sum(), q)


REFUSED_TRANSFORMS = (
    _hessian,
    _grad_of_grad,
    _jvp_of_jvp,
    _jacrev_of_jacfwd,
    _autograd_of_jvp,
    _create_graph,
)


@pytest.mark.parametrize("path", list(PATHS.values()), ids=list(PATHS))
@pytest.mark.parametrize("transform", REFUSED_TRANSFORMS, ids=lambda t: t.__name__[1:])
@pytest.mark.parametrize("op", ["attention", "attention_varlen"])
def test_second_order_is_refused(op, transform, path):
    p = Problem(op, path)
    with pytest.raises(NotImplementedError, match=REFUSED):
        transform(p.ours, p.inputs)
    transform(p.oracle, p.inputs64)  # the oracle differentiates to any order


# Autocast: inputs cast once to the autocast dtype, as scaled_dot_product_attention does.


@pytest.mark.parametrize("op", OPS)
def test_autocast(op):
    p = Problem(op, torch.float32)
    device_type = "cuda" if DEVICE == "cuda" else "cpu"
    inputs = list(p.inputs)
    with torch.autocast(device_type, torch.bfloat16):
        got = grad(p.ours, inputs), p.ours(*inputs)
    low = [t.to(torch.bfloat16) if i < 3 else t for i, t in enumerate(inputs)]
    want64 = grad(p.oracle, [t.double() for t in low]), p.oracle(*[t.double() for t in low])
    want_lowp = grad(p.oracle, low), p.oracle(*low)
    p.dtype = torch.bfloat16
    _compare(p, got, want64, want_lowp, "autocast")


@pytest.mark.parametrize("path", list(PATHS.values()), ids=list(PATHS))
def test_vmap_over_cu_seqlens(path):
    """Per-sample cu_seqlens (batched with the packed rows), with rows past each sample's last
    sequence: the folded batch must not let them see each other."""
    p = Problem("attention_varlen", path)
    cu_q = torch.tensor([[0, 2, 4], [0, 3, 3]], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([[0, 4, 9], [0, 6, 8]], dtype=torch.int32, device=DEVICE)
    q, k, v, bias = p.inputs
    qs, vs = torch.stack([q, q.flip(0)]), torch.stack([v, -v])
    mask = None  # only the fold's own masking keeps the samples' leftover rows apart

    def ours(q, v, cq, ck):
        return torch.ops.dmattn.attention_varlen(q, k, v, cq, ck, 3, 6, mask, bias, None, True)

    def grads(f, q, v, cq, ck):
        return torch.func.grad(lambda q, v: (f(q, v, cq, ck) * _weights(q)).sum(), (0, 1))(q, v)

    def oracle(q, v, cq, ck):
        kb = (k, bias) if q.dtype == k.dtype else (k.double(), bias.double())
        return reference.attention_varlen(q, kb[0], v, cq, ck, 3, 6, mask, kb[1], is_causal=True)

    torch._C._functorch._set_vmap_fallback_warning_enabled(True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            got = (
                torch.vmap(ours)(qs, vs, cu_q, cu_k),
                torch.vmap(functools.partial(grads, ours))(qs, vs, cu_q, cu_k),
            )
    finally:
        torch._C._functorch._set_vmap_fallback_warning_enabled(False)
    for i in range(2):
        args = (qs[i], vs[i], cu_q[i], cu_k[i])
        up = [a.double() if a.is_floating_point() else a for a in args]
        want64 = oracle(*up), grads(oracle, *up)
        want_lowp = oracle(*args), grads(oracle, *args)
        sample = (got[0][i], (got[1][0][i], got[1][1][i]))
        _compare(p, sample, want64, want_lowp, f"vmap cu_seqlens [{i}]")
