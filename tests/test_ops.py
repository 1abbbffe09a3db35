"""The registered ops: schemas, opcheck, torch.compile, torch.func, torch.export."""

import warnings

import expecttest
import pytest
import torch
from helpers import Case, assert_close, float64_grad_bound, make_bias, make_mask, make_qkv

import dmattn_ops

OPS = {
    "attention": torch.ops.dmattn.attention.default,
    "attention_forward": torch.ops.dmattn.attention_forward.default,
    "attention_backward": torch.ops.dmattn.attention_backward.default,
}


class TestSchemas(expecttest.TestCase):
    def test_attention_schema(self):
        self.assertExpectedInline(
            str(OPS["attention"]._schema),
            """dmattn::attention(Tensor query, Tensor key, Tensor value, Tensor? mask=None, Tensor? bias=None, float? scale=None, bool is_causal=False, float softcap=0., Tensor? seqused_k=None, bool deterministic=False, int[2] window_size=-1, Tensor? sinks=None) -> Tensor""",
        )

    def test_forward_schema(self):
        self.assertExpectedInline(
            str(OPS["attention_forward"]._schema),
            """dmattn::attention_forward(Tensor query, Tensor key, Tensor value, Tensor? mask, Tensor? bias, float scale, bool is_causal, float softcap, Tensor? seqused_k, bool deterministic=False, int[2] window_size=-1, Tensor? sinks=None, str? kernel_options=None) -> (Tensor out, Tensor lse, Tensor lse_rem)""",
        )

    def test_backward_schema(self):
        self.assertExpectedInline(
            str(OPS["attention_backward"]._schema),
            """dmattn::attention_backward(Tensor grad_out, Tensor? grad_lse, Tensor query, Tensor key, Tensor value, Tensor out, Tensor lse, Tensor lse_rem, Tensor? mask, Tensor? bias, float scale, bool is_causal, float softcap, Tensor? seqused_k, bool deterministic, bool compute_dbias, int[2] window_size=-1, Tensor? sinks=None, str? kernel_options=None) -> (Tensor grad_query, Tensor grad_key, Tensor grad_value, Tensor grad_bias, Tensor grad_sinks)""",
        )


def samples(dtype=torch.float64, requires_grad=True):
    """(id, args of attention_forward minus scale-resolved options) for opcheck."""
    c = Case(2, 11, 19, 4, 2, 16, 8)
    out = []
    for name, with_operands, causal, softcap, seq in [
        ("plain", False, False, 0.0, None),
        ("mask-bias-causal", True, True, 0.0, None),
        ("softcap-seqused", True, False, 2.0, torch.tensor([19, 7], dtype=torch.int32)),
        ("row-limits-causal", "limits", True, 0.0, None),
        ("transposed-layouts", "transposed", True, 0.0, None),
    ]:
        q, k, v = make_qkv(c, dtype=dtype, requires_grad=requires_grad)
        mask = make_mask((c.b, c.hkv, 1, c.lk)) if with_operands else None
        if with_operands == "limits":  # a row-limit mask (README "Row-limit masks")
            mask = torch.randint(0, c.lq + 2, (c.b, c.hkv, 1, c.lk), dtype=torch.int32)
        bias = (
            make_bias((1, c.h, c.lq, c.lk), dtype=dtype, requires_grad=requires_grad)
            if with_operands
            else None
        )
        if with_operands == "transposed":
            # Views as models make them: q/k/v (B, L, H, D) of (B, H, L, D) tensors (HF's
            # layout), a per-key bias and mask (B, Hkv, 1, L) of (B, L, Hkv) ones (the DMA
            # layer's). Outputs must have the strides the fake kernels say (Inductor asserts
            # them at run time).
            q, k, v = (t.detach().transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
            q, k, v = (t.requires_grad_(requires_grad) for t in (q, k, v))
            bias = torch.randn(c.b, c.lk, c.hkv, dtype=dtype).transpose(1, 2).unsqueeze(2)
            bias.requires_grad_(requires_grad)
            mask = (torch.rand(c.b, c.lk, c.hkv) < 0.6).transpose(1, 2).unsqueeze(2)
        out.append(
            (name, (q, k, v, mask, bias), dict(is_causal=causal, softcap=softcap, seqused_k=seq))
        )
    return out


SAMPLES = samples()


@pytest.mark.parametrize("sample", SAMPLES, ids=[s[0] for s in SAMPLES])
def test_opcheck_attention(sample):
    _, (q, k, v, mask, bias), kw = sample
    args = (q, k, v, mask, bias, None, kw["is_causal"], kw["softcap"], kw["seqused_k"], False)
    torch.library.opcheck(OPS["attention"], args, test_utils="ALL")


@pytest.mark.parametrize("sample", SAMPLES, ids=[s[0] for s in SAMPLES])
def test_opcheck_attention_forward(sample):
    _, (q, k, v, mask, bias), kw = sample
    args = (q, k, v, mask, bias, 0.3, kw["is_causal"], kw["softcap"], kw["seqused_k"], True)
    torch.library.opcheck(OPS["attention_forward"], args, test_utils="ALL")


@pytest.mark.parametrize("sample", SAMPLES, ids=[s[0] for s in SAMPLES])
@pytest.mark.parametrize("with_grad_lse", [False, True], ids=["no-dlse", "dlse"])
def test_opcheck_attention_backward(sample, with_grad_lse):
    # attention_backward refuses to be differentiated (no double backward), so its inputs do not
    # require grad here; every other opcheck utility applies.
    _, (q, k, v, mask, bias), kw = sample
    q, k, v = (t.detach() for t in (q, k, v))
    bias = bias.detach() if bias is not None else None
    out, lse, lse_rem = OPS["attention_forward"](
        q, k, v, mask, bias, 0.3, kw["is_causal"], kw["softcap"], kw["seqused_k"], False
    )
    grad_out = torch.randn_like(out)
    grad_lse = torch.randn_like(lse) if with_grad_lse else None
    args = (
        grad_out,
        grad_lse,
        q,
        k,
        v,
        out,
        lse,
        lse_rem,
        mask,
        bias,
        0.3,
        kw["is_causal"],
        kw["softcap"],
        kw["seqused_k"],
        False,
        bias is not None,
    )
    torch.library.opcheck(OPS["attention_backward"], args, test_utils="ALL")


def test_fake_matches_real():
    from torch._subclasses.fake_tensor import FakeTensorMode

    _, (q, k, v, mask, bias), kw = SAMPLES[2]
    real = OPS["attention_forward"](q, k, v, mask, bias, 0.3, True, 0.0, None, False)
    with FakeTensorMode() as mode:
        fake_in = [mode.from_tensor(t) if t is not None else None for t in (q, k, v, mask, bias)]
        fake = OPS["attention_forward"](*fake_in, 0.3, True, 0.0, None, False)
    for r, f in zip(real, fake):
        assert (r.shape, r.dtype, r.stride()) == (f.shape, f.dtype, f.stride())


def test_double_backward_raises_clearly():
    c = Case(1, 4, 5, 2, 2, 8, 8)
    q, k, v = make_qkv(c, requires_grad=True)
    out = dmattn_ops.attention(q, k, v)
    (dq,) = torch.autograd.grad(out.sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        dq.sum().backward()


def test_dispatch_modes_see_the_forward_and_backward_ops():
    # A plain eager call runs its kernels straight from the autograd Function (ops.py: no
    # dispatcher hops below it); under a dispatch mode (a profiler's, FlopCounterMode, a
    # trace) the forward and backward ops run, so the mode sees them, with the same results.
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    _, (q, k, v, mask, bias), kw = SAMPLES[2]
    leaves = [t.detach().requires_grad_() for t in (q, k, v, bias)]

    def run():
        out = dmattn_ops.attention(*leaves[:3], mask, leaves[3], **kw)
        return out, torch.autograd.grad((out * out).sum(), leaves)

    plain = run()
    with Seen() as seen:
        moded = run()
    assert "dmattn.attention_forward" in seen.ops and "dmattn.attention_backward" in seen.ops
    for a, b in zip((plain[0], *plain[1]), (moded[0], *moded[1])):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    with torch.no_grad():  # no gradient: the mode sees the public op below autograd
        out = dmattn_ops.attention(q, k, v, mask, bias, **kw)
        with Seen() as seen:
            moded = dmattn_ops.attention(q, k, v, mask, bias, **kw)
    assert seen.ops == ["dmattn.attention"]
    torch.testing.assert_close(out, moded, rtol=0, atol=0)
    torch.testing.assert_close(out, plain[0].detach(), rtol=0, atol=0)


def test_the_profiler_sees_the_op_of_a_plain_eager_call():
    """A plain eager dmattn_ops.attention call runs the op's work without the dispatcher's hop
    (ops.attend); torch.profiler still records it under the op's name, with and without a
    gradient, and the lower op's where lse is returned."""
    _, (q, k, v, mask, bias), kw = SAMPLES[2]
    leaves = [t.detach().requires_grad_() for t in (q, k, v, bias)]
    calls = {
        "dmattn::attention": lambda: dmattn_ops.attention(*leaves[:3], mask, leaves[3], **kw),
        "dmattn::attention_forward": lambda: dmattn_ops.attention(
            q, k, v, mask, bias, return_lse=True, **kw
        ),
    }
    for name, call in calls.items():
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            call()
        assert name in {e.name for e in prof.events()}, name


# torch.compile


def compiled_matches_eager(fn, *args):
    eager = fn(*args)
    compiled = torch.compile(fn, fullgraph=True)(*args)
    return eager, compiled


@pytest.mark.parametrize("entry", ["op", "api"])
def test_compile_fullgraph_forward_backward(entry):
    torch._dynamo.reset()
    c = Case(2, 33, 47, 4, 2, 16, 16)
    q, k, v = make_qkv(c, dtype=torch.float32)
    bias = make_bias((c.b, c.hkv, 1, c.lk), dtype=torch.float32)
    mask = make_mask((c.b, 1, c.lq, c.lk))

    if entry == "op":

        def f(q, k, v, bias):
            return torch.ops.dmattn.attention(q, k, v, mask, bias, None, True, 0.0, None, False)
    else:

        def f(q, k, v, bias):
            return dmattn_ops.attention(q, k, v, mask, bias, is_causal=True)

    def step(fn):
        inputs = [t.clone().requires_grad_() for t in (q, k, v, bias)]
        out = fn(*inputs)
        out.square().sum().backward()
        return out, [t.grad for t in inputs]

    out_e, grads_e = step(f)
    out_c, grads_c = step(torch.compile(f, fullgraph=True))
    torch.testing.assert_close(out_c, out_e, rtol=0, atol=1e-6)
    for a, b in zip(grads_c, grads_e):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_compile_dynamic_does_not_recompile():
    torch._dynamo.reset()

    def f(q, k, v, bias, mask):
        return dmattn_ops.attention(q, k, v, mask, bias, is_causal=True)

    cf = torch.compile(f, fullgraph=True, dynamic=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for lq, lk in [(17, 29), (33, 41), (9, 64)]:
            c = Case(1, lq, lk, 2, 1, 16, 16)
            q, k, v = make_qkv(c, dtype=torch.float32, requires_grad=True)
            bias = make_bias((1, 1, 1, lk), dtype=torch.float32, requires_grad=True)
            mask = make_mask((1, 1, lq, lk))
            out = cf(q, k, v, bias, mask)
            out.sum().backward()
            ref = dmattn_ops.reference.attention(q, k, v, mask, bias, is_causal=True)
            torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
            assert q.grad.shape == q.shape and bias.grad.shape == bias.shape


# torch.func


def func_case():
    c = Case(2, 7, 9, 4, 2, 8, 6)
    q, k, v = make_qkv(c)
    bias = make_bias((c.b, c.hkv, 1, c.lk))
    mask = make_mask((1, 1, c.lq, c.lk), density=0.7)
    return c, q, k, v, bias, mask


ENTRIES = {
    "op": lambda q, k, v, m, b: torch.ops.dmattn.attention(q, k, v, m, b, None, True),
    "api": lambda q, k, v, m, b: dmattn_ops.attention(q, k, v, m, b, is_causal=True),
}
REF = lambda q, k, v, m, b: dmattn_ops.reference.attention(q, k, v, m, b, is_causal=True)


@pytest.mark.parametrize("entry", list(ENTRIES))
def test_func_grad_and_vjp(entry):
    fn = ENTRIES[entry]
    c, q, k, v, bias, mask = func_case()
    w = torch.randn(c.b, c.lq, c.h, c.dv, dtype=torch.float64)
    loss = lambda f: lambda q, k, v, b: (f(q, k, v, mask, b) * w).sum()
    got = torch.func.grad(loss(fn), argnums=(0, 1, 2, 3))(q, k, v, bias)
    want = torch.func.grad(loss(REF), argnums=(0, 1, 2, 3))(q, k, v, bias)
    _, lse = dmattn_ops.reference.attention(q, k, v, mask, bias, is_causal=True, return_lse=True)
    for a, b in zip(got, want):
        assert_close(a, b, float64_grad_bound(b, lse), "grad")
    out, vjp_fn = torch.func.vjp(lambda q, b: fn(q, k, v, mask, b), q, bias)
    dq, db = vjp_fn(w)
    assert_close(dq, want[0], float64_grad_bound(want[0], lse), "vjp dq")
    assert_close(db, want[3], float64_grad_bound(want[3], lse), "vjp dbias")


@pytest.mark.parametrize("entry", list(ENTRIES))
def test_func_jacrev(entry):
    fn = ENTRIES[entry]
    c = Case(1, 3, 5, 2, 1, 4, 2)
    q, k, v = make_qkv(c)
    bias = make_bias((1, 1, 1, c.lk))
    got = torch.func.jacrev(lambda b: fn(q, k, v, None, b), argnums=0)(bias)
    want = torch.func.jacrev(lambda b: REF(q, k, v, None, b), argnums=0)(bias)
    assert got.shape == want.shape
    assert_close(got, want, 1e-5, "jacobian")


@pytest.mark.parametrize("entry", list(ENTRIES))
def test_vmap_has_a_real_batching_rule(entry):
    fn = ENTRIES[entry]
    c, q, k, v, bias, mask = func_case()
    n = 3
    qs = torch.randn(n, *q.shape, dtype=torch.float64)
    biases = torch.randn(n, *bias.shape, dtype=torch.float64)
    torch._C._functorch._set_vmap_fallback_warning_enabled(True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            got = torch.vmap(lambda q, b: fn(q, k, v, mask, b))(qs, biases)
            got_t = torch.vmap(lambda q, b: fn(q, k, v, mask, b), in_dims=(2, None))(
                qs.movedim(0, 2), bias
            )
    finally:
        torch._C._functorch._set_vmap_fallback_warning_enabled(False)
    want = torch.stack([REF(qs[i], k, v, mask, biases[i]) for i in range(n)])
    want_t = torch.stack([REF(qs[i], k, v, mask, bias) for i in range(n)])
    assert_close(got, want, 1e-12, "vmap")
    assert_close(got_t, want_t, 1e-12, "vmap in_dims=2")


@pytest.mark.parametrize("entry", list(ENTRIES))
def test_per_sample_gradients_vmap_of_grad(entry):
    fn = ENTRIES[entry]
    c, q, k, v, bias, mask = func_case()
    shared_bias = make_bias((1, 1, 1, c.lk))
    n = 3
    qs = torch.randn(n, *q.shape, dtype=torch.float64)

    def loss(f):
        return lambda q, b: f(q, k, v, mask, b).square().sum()

    got = torch.vmap(torch.func.grad(loss(fn), argnums=(0, 1)), in_dims=(0, None))(qs, shared_bias)
    for i in range(n):
        want = torch.func.grad(loss(REF), argnums=(0, 1))(qs[i], shared_bias)
        assert_close(got[0][i], want[0], 1e-5, "per-sample dq")
        assert_close(got[1][i], want[1], 1e-5, "per-sample dbias")


# torch.export


class TinyAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.bias = torch.nn.Parameter(torch.zeros(1, 2, 1, 12))

    def forward(self, q, k, v, mask):
        return torch.ops.dmattn.attention(q, k, v, mask, self.bias, None, True, 0.0, None, False)


def test_export():
    c = Case(1, 10, 12, 2, 1, 8, 8)
    q, k, v = make_qkv(c, dtype=torch.float32)
    mask = make_mask((1, 1, c.lq, c.lk))
    model = TinyAttention()
    ep = torch.export.export(model, (q, k, v, mask))
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert "dmattn.attention.default" in targets
    torch.testing.assert_close(ep.module()(q, k, v, mask), model(q, k, v, mask), rtol=0, atol=0)
