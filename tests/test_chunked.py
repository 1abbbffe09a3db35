"""The PyTorch implementation (the ops' CPU kernel) against the float64 oracle."""

import math

import pytest
import torch
from helpers import (
    DTYPES,
    PATTERNS,
    Case,
    assert_close,
    float64_grad_bound,
    low_precision_bound,
    make_bias,
    make_mask,
    make_qkv,
    operand_shape,
    param,
    reference_grads,
)

import dmattn_ops
from dmattn_ops.core.problem import Options, Problem
from dmattn_ops.executors import chunked


@pytest.fixture(autouse=True)
def chunked_only(kernel_options):
    """This file tests the PyTorch implementation: every call planned in it takes that route."""
    kernel_options(route="pytorch")


SHAPES = [
    param(Case(1, 1, 1, 1, 1, 16, 16)),
    param(Case(2, 17, 63, 4, 2, 40, 40)),
    param(Case(1, 113, 203, 4, 1, 80, 64)),
    param(Case(1, 128, 128, 2, 2, 96, 96)),
    param(Case(2, 63, 17, 6, 3, 64, 72)),
    param(Case(1, 1023, 33, 2, 1, 16, 16)),
    param(Case(1, 33, 1023, 2, 2, 128, 128)),
    param(Case(1, 19, 41, 2, 1, 256, 256)),
]


def run_direct(c, q, k, v, mask, bias, grad_out, kwargs, block_q, block_k):
    scale = kwargs.get("scale") or c.d**-0.5
    problem = Problem(q, k, v, mask, bias, seqused_k=kwargs["seqused_k"])
    opts = Options(scale, kwargs["is_causal"], kwargs["softcap"])
    blocks = dict(block_q=block_q, block_k=block_k)
    saved = chunked.forward(problem, opts, **blocks)
    grads = chunked.backward(problem, opts, saved, grad_out, None, bias is not None, **blocks)
    return saved[0], saved[1], grads


@pytest.mark.parametrize("case", SHAPES)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("blocks", [(16, 32), (64, 16)], ids=["bq16-bk32", "bq64-bk16"])
def test_float64_shapes(case, is_causal, blocks):
    c = case
    q, k, v = make_qkv(c, requires_grad=True)
    mask = make_mask((c.b, c.h, c.lq, c.lk), density=0.7)
    bias = make_bias((c.b, c.h, c.lq, c.lk), requires_grad=True)
    seqused = torch.randint(c.lk // 2, c.lk + 1, (c.b,), dtype=torch.int32)
    kwargs = dict(is_causal=is_causal, softcap=0.0, seqused_k=seqused)
    grad_out = torch.randn(c.b, c.lq, c.h, c.dv, dtype=torch.float64)
    ref_out, ref_lse, ref_grads = reference_grads((q, k, v, bias), kwargs, grad_out, mask)
    out, lse, grads = run_direct(
        c, q.detach(), k.detach(), v.detach(), mask, bias.detach(), grad_out, kwargs, *blocks
    )
    assert_close(out, ref_out, 1e-12, "out")
    assert lse.dtype == torch.float64  # internally; the public lse is float32, as the oracle's
    assert_close(lse.float(), ref_lse, 0.0, "lse")
    for name, g, r in zip(("dq", "dk", "dv", "dbias"), grads, ref_grads):
        assert_close(g, r, float64_grad_bound(r, ref_lse), name)


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_every_broadcast_pattern_through_the_op(pattern, is_causal):
    c = Case(2, 23, 37, 4, 2, 32, 24)
    q, k, v = make_qkv(c, requires_grad=True)
    mask = make_mask(operand_shape(pattern, c), density=0.6)
    bias = make_bias(operand_shape(pattern, c), requires_grad=True)
    kwargs = dict(is_causal=is_causal, softcap=0.0, seqused_k=None)
    grad_out = torch.randn(c.b, c.lq, c.h, c.dv, dtype=torch.float64)
    ref_out, ref_lse, ref_grads = reference_grads((q, k, v, bias), kwargs, grad_out, mask)
    out, lse = dmattn_ops.attention(q, k, v, mask, bias, return_lse=True, **kwargs)
    grads = torch.autograd.grad((out * grad_out).sum(), (q, k, v, bias))
    assert_close(out, ref_out, 1e-12, "out")
    assert_close(lse, ref_lse, 0.0, "lse")
    assert grads[3].shape == bias.shape and grads[3].dtype == bias.dtype
    for name, g, r in zip(("dq", "dk", "dv", "dbias"), grads, ref_grads):
        assert_close(g, r, float64_grad_bound(r, ref_lse), name)


@pytest.mark.parametrize(
    "mask_pattern,bias_pattern", [("bhq", "BHQ"), ("BGQ", "bhq"), ("bHq", "BGq"), ("Bhq", "bGQ")]
)
def test_mixed_mask_and_bias_patterns(mask_pattern, bias_pattern):
    c = Case(2, 19, 29, 6, 2, 16, 16)
    q, k, v = make_qkv(c, requires_grad=True)
    mask = make_mask(operand_shape(mask_pattern, c))
    bias = make_bias(operand_shape(bias_pattern, c), requires_grad=True)
    kwargs = dict(is_causal=True, softcap=3.0, seqused_k=None)
    grad_out = torch.randn(c.b, c.lq, c.h, c.dv, dtype=torch.float64)
    ref_out, ref_lse, ref_grads = reference_grads((q, k, v, bias), kwargs, grad_out, mask)
    out = dmattn_ops.attention(q, k, v, mask, bias, **kwargs)
    grads = torch.autograd.grad((out * grad_out).sum(), (q, k, v, bias))
    assert_close(out, ref_out, 1e-12, "out")
    for name, g, r in zip(("dq", "dk", "dv", "dbias"), grads, ref_grads):
        assert_close(g, r, float64_grad_bound(r, ref_lse), name)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bias_fp32", [False, True], ids=["bias-same", "bias-fp32"])
def test_low_precision_against_oracle(dtype, bias_fp32):
    c = Case(2, 65, 97, 4, 2, 64, 64)
    q, k, v = make_qkv(c, dtype=dtype, requires_grad=True)
    bias = make_bias(
        (c.b, c.hkv, 1, c.lk), dtype=torch.float32 if bias_fp32 else dtype, requires_grad=True
    )
    mask = make_mask((c.b, 1, c.lq, c.lk), density=0.5)
    kwargs = dict(is_causal=True, softcap=0.0, seqused_k=None)
    grad_out = torch.randn(c.b, c.lq, c.h, c.dv, dtype=dtype)
    up = [t.detach().double().requires_grad_() for t in (q, k, v, bias)]
    ref64 = reference_grads(up, kwargs, grad_out.double(), mask)
    low = [t.detach().clone().requires_grad_() for t in (q, k, v, bias)]
    ref_lp = reference_grads(low, kwargs, grad_out, mask)
    out = dmattn_ops.attention(q, k, v, mask, bias, **kwargs)
    grads = torch.autograd.grad((out * grad_out).sum(), (q, k, v, bias))
    assert out.dtype == dtype and grads[3].dtype == bias.dtype
    assert_close(out, ref64[0], low_precision_bound(ref64[0], ref_lp[0], dtype), "out")
    for name, g, r, rl in zip(("dq", "dk", "dv", "dbias"), grads, ref64[2], ref_lp[2]):
        assert_close(g, r, low_precision_bound(r, rl, g.dtype), name)


def test_gradcheck_float64():
    c = Case(1, 5, 7, 2, 1, 4, 3)
    q, k, v = make_qkv(c, requires_grad=True)
    bias = make_bias((1, c.h, 1, c.lk), requires_grad=True)
    mask = make_mask((1, 1, c.lq, c.lk), density=0.7)
    seqused = torch.tensor([6], dtype=torch.int32)

    def f(q, k, v, bias):
        return dmattn_ops.attention(
            q, k, v, mask, bias, is_causal=True, softcap=2.0, seqused_k=seqused
        )

    assert torch.autograd.gradcheck(f, (q, k, v, bias), atol=1e-5, rtol=1e-3)


def test_lse_gradient():
    c = Case(1, 9, 13, 2, 2, 8, 8)
    q, k, v = make_qkv(c, requires_grad=True)
    bias = make_bias((1, 1, c.lq, c.lk), requires_grad=True)
    out, lse = dmattn_ops.attention(q, k, v, None, bias, return_lse=True)
    g = torch.autograd.grad(lse.sum() + out.sum(), (q, k, bias))
    ro, rl = dmattn_ops.reference.attention(q, k, v, None, bias, return_lse=True)
    r = torch.autograd.grad(rl.sum() + ro.sum(), (q, k, bias))
    for name, a, b in zip(("dq", "dk", "dbias"), g, r):
        assert_close(a, b, float64_grad_bound(b, rl), name)


# Edge cases: empty inputs, fully masked rows/heads/batches, -inf bias, poisoned caches.


@pytest.mark.parametrize(
    "case",
    [
        param(Case(0, 5, 7, 2, 1, 8, 8)),
        param(Case(2, 0, 7, 2, 1, 8, 8)),
        param(Case(2, 5, 0, 2, 1, 8, 8)),
    ],
)
def test_empty_inputs(case):
    c = case
    q, k, v = make_qkv(c, requires_grad=True)
    bias = make_bias((c.b, 1, 1, c.lk), requires_grad=True)
    mask = make_mask((1, c.h, c.lq, c.lk))
    out, lse = dmattn_ops.attention(q, k, v, mask, bias, return_lse=True, is_causal=True)
    assert out.shape == (c.b, c.lq, c.h, c.dv) and lse.shape == (c.b, c.h, c.lq)
    assert (out == 0).all() and torch.isneginf(lse).all()
    out.sum().backward()
    for t in (q, k, v, bias):
        assert t.grad.shape == t.shape and (t.grad == 0).all()


def test_fully_masked_rows_heads_batches():
    c = Case(3, 21, 34, 4, 2, 16, 16)
    q, k, v = make_qkv(c, requires_grad=True)
    bias = make_bias((c.b, c.h, c.lq, c.lk), requires_grad=True)
    mask = make_mask((c.b, c.h, c.lq, c.lk), density=0.8)
    mask[0] = False  # a whole batch
    mask[1, 2] = False  # a whole head
    mask[2, :, 5] = False  # whole rows
    mask[2, :, :, 16:32] = False  # whole tiles of keys
    kwargs = dict(is_causal=False, softcap=0.0, seqused_k=None)
    grad_out = torch.randn(c.b, c.lq, c.h, c.dv, dtype=torch.float64)
    ref_out, ref_lse, ref_grads = reference_grads((q, k, v, bias), kwargs, grad_out, mask)
    out, lse = dmattn_ops.attention(q, k, v, mask, bias, return_lse=True)
    grads = torch.autograd.grad((out * grad_out).sum(), (q, k, v, bias))
    assert (out[0] == 0).all() and (out[1, :, 2] == 0).all() and (out[2, 5] == 0).all()
    assert torch.isneginf(lse[0]).all() and torch.isneginf(lse[2, :, 5]).all()
    assert (grads[0][0] == 0).all() and (grads[3][0] == 0).all()
    assert_close(out, ref_out, 1e-12, "out")
    for name, g, r in zip(("dq", "dk", "dv", "dbias"), grads, ref_grads):
        assert_close(g, r, float64_grad_bound(r, ref_lse), name)


@pytest.mark.parametrize("dtype", (*DTYPES, torch.float64), ids=str)
def test_neg_inf_and_finfo_min_bias(dtype):
    c = Case(1, 6, 40, 2, 1, 16, 16)
    q, k, v = make_qkv(c, dtype=dtype, requires_grad=True)
    bias = make_bias((1, c.h, c.lq, c.lk), dtype=dtype)
    bias[:, :, 0] = -math.inf  # a row that is -inf everywhere: empty
    bias[:, :, 1, ::2] = -math.inf
    bias[:, :, 2] = torch.finfo(dtype).min  # finfo.min everywhere: a uniform average
    bias[:, :, 3, :7] = torch.finfo(dtype).min
    bias.requires_grad_()
    out, lse = dmattn_ops.attention(q, k, v, None, bias, return_lse=True)
    grads = torch.autograd.grad(out.float().sum(), (q, k, v, bias))
    assert (out[:, 0] == 0).all() and torch.isneginf(lse[..., 0]).all()
    for g in grads:
        assert torch.isfinite(g).all()
    up = [t.detach().double() for t in (q, k, v, bias)]
    ref = dmattn_ops.reference.attention(*up[:3], None, up[3])
    ref_lp = dmattn_ops.reference.attention(*(t.detach() for t in (q, k, v)), None, bias.detach())
    bound = low_precision_bound(ref, ref_lp, dtype) if dtype != torch.float64 else 1e-12
    assert_close(out.double(), ref, bound, "out")
    if dtype != torch.float16:
        # finfo.min swamps every logit (|x| < ulp(min) / 2), so the exact row is uniform. In
        # float16 finfo.min is only -65504 and the row is softmax(x) instead.
        uniform = up[2].mean(dim=1).expand(1, c.h, c.dv)  # [B, H, Dv]
        assert_close(out[:, 2].double(), uniform, bound, "uniform row")


def test_nonfinite_bias_where_not_allowed_is_never_used():
    c = Case(2, 17, 30, 2, 2, 16, 16)
    q, k, v = make_qkv(c, requires_grad=True)
    mask = make_mask((c.b, 1, c.lq, c.lk), density=0.5)
    seqused = torch.tensor([25, 30], dtype=torch.int32)
    clean = make_bias((c.b, c.h, c.lq, c.lk))
    poisoned = clean.clone()
    j = torch.arange(c.lk)
    junk = torch.tensor([math.nan, math.inf, -math.inf]).repeat(c.lk)[: c.lk].double()
    causal_out = torch.ones(c.lq, c.lk, dtype=torch.bool).triu(c.lk - c.lq + 1)
    outside = ((~mask) | (j >= seqused[:, None, None, None]) | causal_out).expand(
        c.b, c.h, c.lq, c.lk
    )
    poisoned = torch.where(outside, junk.expand_as(poisoned), poisoned).requires_grad_()
    clean.requires_grad_()
    kwargs = dict(is_causal=True, seqused_k=seqused)
    out_p = dmattn_ops.attention(q, k, v, mask, poisoned, **kwargs)
    g_p = torch.autograd.grad(out_p.sum(), (q, k, v, poisoned))
    out_c = dmattn_ops.attention(q, k, v, mask, clean, **kwargs)
    g_c = torch.autograd.grad(out_c.sum(), (q, k, v, clean))
    assert torch.equal(out_p, out_c)
    for a in g_p:
        assert torch.isfinite(a).all()
    for a, b in zip(g_p[:3], g_c[:3]):
        assert torch.equal(a, b)
    assert torch.equal(g_p[3][~outside], g_c[3][~outside]) and (g_p[3][outside] == 0).all()


@pytest.mark.parametrize("dtype", (*DTYPES, torch.float64), ids=str)
def test_nan_in_kv_beyond_seqused_k_and_lk(dtype):
    c = Case(2, 9, 40, 2, 1, 16, 16)
    # A KV cache of 64 slots, filled with NaN/Inf, of which the first 40 are the view and the
    # first seqused_k[b] are written.
    cache_k = torch.full((c.b, 64, c.hkv, c.d), math.nan, dtype=dtype)
    cache_v = torch.full((c.b, 64, c.hkv, c.dv), math.inf, dtype=dtype)
    seqused = torch.tensor([23, 40], dtype=torch.int32)
    for b, n in enumerate(seqused.tolist()):
        cache_k[b, :n] = torch.randn(n, c.hkv, c.d, dtype=dtype)
        cache_v[b, :n] = torch.randn(n, c.hkv, c.dv, dtype=dtype)
    k = cache_k[:, : c.lk].requires_grad_()
    v = cache_v[:, : c.lk].requires_grad_()
    q = torch.randn(c.b, c.lq, c.h, c.d, dtype=dtype, requires_grad=True)
    bias = make_bias((c.b, c.hkv, 1, c.lk), dtype=dtype, requires_grad=True)
    out = dmattn_ops.attention(q, k, v, None, bias, seqused_k=seqused, is_causal=True)
    grads = torch.autograd.grad(out.float().sum(), (q, k, v, bias))
    assert torch.isfinite(out).all()
    for g in grads:
        assert torch.isfinite(g).all()
    assert (grads[1][0, 23:] == 0).all() and (grads[3][0, ..., 23:] == 0).all()
    # The poisoned cache goes to the oracle as it is: it must ignore keys past seqused_k too.
    clean = [t.detach().double() for t in (k, v)]
    ref = dmattn_ops.reference.attention(
        q.detach().double(), *clean, None, bias.detach().double(), seqused_k=seqused, is_causal=True
    )
    ref_lp = dmattn_ops.reference.attention(
        q.detach(),
        *(t.detach() for t in (k, v)),
        None,
        bias.detach(),
        seqused_k=seqused,
        is_causal=True,
    )
    bound = low_precision_bound(ref, ref_lp, dtype) if dtype != torch.float64 else 1e-12
    assert_close(out.double(), ref, bound, "out")


def test_causal_with_more_queries_than_keys_gives_zero_rows():
    c = Case(2, 20, 8, 2, 2, 8, 8)
    q, k, v = make_qkv(c, requires_grad=True)
    seqused = torch.tensor([8, 5], dtype=torch.int32)
    out, lse = dmattn_ops.attention(q, k, v, is_causal=True, seqused_k=seqused, return_lse=True)
    assert (out[0, :12] == 0).all() and (out[1, :15] == 0).all()
    assert torch.isfinite(out).all() and torch.isfinite(lse[0, :, 12:]).all()
    ref = dmattn_ops.reference.attention(q, k, v, is_causal=True, seqused_k=seqused)
    assert_close(out, ref, 1e-12, "out")
