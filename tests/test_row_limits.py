"""Row-limit masks (README "Row-limit masks"): an int32 mask (B|1, H|Hkv|1, 1, Lk) under which
key j is seen by the query rows i < mask[..., j], on every route against the float64 oracle, and
`masks.causal_topk_mask`, the per-query top-k selection Doge makes, against a brute force.

On CPU the Triton kernels run in the interpreter (conftest); routes are forced through the
kernel options, and every route's result is compared with the oracle, which reads the mask as
its definition says (reference.attention)."""

from __future__ import annotations

import itertools

import pytest
import torch
from helpers import (
    DEVICE,
    DTYPES,
    Case,
    assert_close,
    assert_grads_close,
    low_precision_bound,
    make_bias,
    reference_grads,
)

import dmattn_ops
from dmattn_ops import masks, reference


def _limits(shape, lq: int, generator=None) -> torch.Tensor:
    """Limits from 0 (a key no row sees) to past the last row (every row), with negatives."""
    return torch.randint(-2, lq + 3, shape, dtype=torch.int32, generator=generator).to(DEVICE)


def _inputs(c: Case, dtype, head: int):
    q = torch.randn(c.b, c.lq, c.h, c.d, dtype=dtype, device=DEVICE, requires_grad=True)
    k = torch.randn(c.b, c.lk, c.hkv, c.d, dtype=dtype, device=DEVICE, requires_grad=True)
    v = torch.randn(c.b, c.lk, c.hkv, c.dv, dtype=dtype, device=DEVICE, requires_grad=True)
    bias = make_bias((c.b, head, 1, c.lk), dtype=dtype, device=DEVICE, requires_grad=True)
    return q, k, v, bias


def _check(c: Case, dtype, limits, call_kwargs, ref_kwargs):
    q, k, v, bias = _inputs(c, dtype, limits.shape[1])
    out = dmattn_ops.attention(q, k, v, limits, bias, **call_kwargs)
    grad = torch.randn_like(out)
    grads = torch.autograd.grad((out * grad).sum(), (q, k, v, bias))
    leaves64 = [t.detach().double().requires_grad_() for t in (q, k, v, bias)]
    ref, lse, ref_grads = reference_grads(leaves64, ref_kwargs, grad.double(), limits)
    leaves_lp = [t.detach().requires_grad_() for t in (q, k, v, bias)]
    ref_lp, _, ref_lp_grads = reference_grads(leaves_lp, ref_kwargs, grad, limits)
    if dtype == torch.float64:
        assert_close(out, ref, 1e-12, "out")
    else:
        assert_close(out, ref, low_precision_bound(ref, ref_lp, dtype), "out")
    assert_grads_close(("dq", "dk", "dv", "dbias"), grads, ref_grads, ref_lp_grads, lse, dtype)


CASES = [Case(2, 37, 37, 4, 2, 16, 16), Case(1, 20, 45, 4, 4, 16, 8), Case(2, 50, 50, 6, 2, 32, 32)]
ROUTES = ["key_lists", "pytorch", None]  # None: the automatic choice


@pytest.mark.parametrize("c", CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("route", ROUTES, ids=lambda r: r or "auto")
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("head", ["hkv", "one"])
def test_row_limits_match_the_oracle(c, route, causal, head, kernel_options):
    if route:
        kernel_options(route=route)
    torch.manual_seed(0)
    heads = c.hkv if head == "hkv" else 1
    limits = _limits((c.b, heads, 1, c.lk), c.lq)
    kw = dict(is_causal=causal)
    _check(c, torch.float32, limits, kw, kw)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_row_limits_in_every_dtype(dtype):
    torch.manual_seed(1)
    c = Case(2, 40, 40, 4, 2, 32, 32)
    _check(
        c, dtype, _limits((c.b, c.hkv, 1, c.lk), c.lq), dict(is_causal=True), dict(is_causal=True)
    )


@pytest.mark.parametrize(
    "extra",
    [dict(window_size=(7, 0)), dict(window_size=(5, 3)), dict(softcap=3.0), "seqused"],
    ids=["window-causal", "window", "softcap", "seqused"],
)
def test_row_limits_with_windows_softcap_and_seqused(extra):
    torch.manual_seed(2)
    c = Case(2, 30, 41, 4, 2, 16, 16)
    if extra == "seqused":
        extra = dict(seqused_k=torch.tensor([41, 33], dtype=torch.int32, device=DEVICE))
    kw = dict(is_causal="window_size" not in extra or extra["window_size"][1] == 0, **extra)
    if "window_size" in extra:
        kw["is_causal"] = False
    _check(c, torch.float32, _limits((c.b, c.hkv, 1, c.lk), c.lq), kw, kw)


def test_row_limits_match_the_bool_mask_they_stand_for():
    """Every route's result with the limits equals its result with the (B, H, Lq, Lk) bool mask
    they stand for: the limits are a compact form of that mask, nothing else."""
    torch.manual_seed(3)
    c = Case(2, 33, 33, 4, 2, 16, 16)
    limits = _limits((c.b, c.hkv, 1, c.lk), c.lq)
    full = torch.arange(c.lq, device=DEVICE).view(c.lq, 1) < limits
    q, k, v, bias = (t.detach() for t in _inputs(c, torch.float64, c.hkv))
    a = reference.attention(q, k, v, limits, bias, is_causal=True)
    b = reference.attention(q, k, v, full, bias, is_causal=True)
    assert torch.equal(a, b)
    out = dmattn_ops.attention(
        q.float(), k.float(), v.float(), limits, bias.float(), is_causal=True
    )
    assert_close(out, a, 1e-5, "out")


def test_one_query_row_reads_the_limits_as_a_bool_mask():
    """Decode (Lq = 1): the keys of limit > 0; the decode route takes it as a bool mask."""
    torch.manual_seed(4)
    c = Case(3, 1, 300, 8, 2, 32, 32)
    limits = torch.randint(0, 2, (c.b, c.hkv, 1, c.lk), dtype=torch.int32, device=DEVICE)
    q, k, v, bias = (t.detach() for t in _inputs(c, torch.float32, c.hkv))
    k[:, 5] = float("nan")  # a key no row sees is never read
    limits[:, :, :, 5] = 0
    out = dmattn_ops.attention(q, k, v, limits, bias)
    ref = reference.attention(q.double(), k.double(), v.double(), limits, bias.double())
    assert_close(out, ref, 1e-5, "out")


def test_keys_of_limit_zero_are_never_read():
    """NaN in a key (and its value) of limit <= 0 reaches no result, forward or backward."""
    torch.manual_seed(5)
    c = Case(2, 24, 24, 4, 2, 16, 16)
    limits = _limits((c.b, c.hkv, 1, c.lk), c.lq).clamp(min=1)
    limits[:, :, :, 3] = 0
    limits[:, :, :, 10] = -4
    q, k, v, bias = _inputs(c, torch.float32, c.hkv)
    with torch.no_grad():
        k[:, 3] = float("nan")
        v[:, 10] = float("inf")
    out = dmattn_ops.attention(q, k, v, limits, bias, is_causal=True)
    out.sum().backward()
    for name, t in (("out", out), ("dq", q.grad), ("dbias", bias.grad)):
        assert not torch.isnan(t).any(), name


def test_row_limit_masks_are_refused_where_they_do_not_apply():
    c = Case(2, 8, 8, 2, 2, 16, 16)
    q, k, v, _ = (t.detach() for t in _inputs(c, torch.float32, 1))
    with pytest.raises(ValueError, match="one limit per key"):
        dmattn_ops.attention(q, k, v, torch.zeros(2, 2, 8, 8, dtype=torch.int32, device=DEVICE))
    with pytest.raises(TypeError, match="int32 row-limit"):
        dmattn_ops.attention(q, k, v, torch.zeros(2, 2, 1, 8, dtype=torch.int64, device=DEVICE))


@pytest.mark.parametrize(
    "causal, window, lq, seqused",
    [(True, (-1, -1), 37, False), (False, (-1, -1), 37, False), (True, (5, -1), 20, True),
     (False, (6, 2), 37, True), (False, (-1, 3), 9, False), (True, (0, 0), 1, True)],
)  # fmt: skip
def test_flex_row_shift_takes_row_limits_as_intervals(causal, window, lq, seqused):
    """flex's lse shift (the largest bias a row sees) under a row-limit mask and a per-key bias
    comes from one interval of rows per key (flex._limit_max), never an Lq x Lk tensor; it
    equals the brute force over the rows' visible keys, NaN kept where a row sees one."""
    from dmattn_ops import flex

    g = torch.Generator().manual_seed(lq)
    b, h, hkv, lk = 3, 4, 2, 37
    limit = _limits((b, hkv, 1, lk), lq, g)
    x = torch.randn(1, h, 1, lk, generator=g).to(DEVICE)
    x[0, 1, 0, 4] = float("nan")
    x[0, 2, 0, 7] = float("-inf")
    n = torch.randint(lk // 2, lk + 1, (b,), generator=g).to(DEVICE) if seqused else None
    ns = n if seqused else torch.full((1,), lk, device=DEVICE)
    got = flex._limit_max(x, flex._per_head(limit, h, hkv), ns, lq, causal, window)

    i = torch.arange(lq, device=DEVICE).view(1, 1, -1, 1)
    j = torch.arange(lk, device=DEVICE)
    p = i + (ns - lq).view(-1, 1, 1, 1)
    seen = (i < flex._per_head(limit, h, hkv)) & (j < ns.view(-1, 1, 1, 1))
    left, right = window
    if causal:
        seen &= j <= p
    if left >= 0:
        seen &= j >= p - left
    if right >= 0:
        seen &= j <= p + right
    want = torch.where(seen, x, float("-inf")).amax(-1)
    assert got.shape == want.shape == (b, h, lq)
    torch.testing.assert_close(got, want, equal_nan=True, rtol=0, atol=0)


def test_compiled_fullgraph_with_row_limits():
    torch.manual_seed(6)
    c = Case(2, 32, 32, 4, 2, 16, 16)
    limits = _limits((c.b, c.hkv, 1, c.lk), c.lq)
    q, k, v, bias = _inputs(c, torch.float32, c.hkv)

    def f(q, k, v, bias):
        return dmattn_ops.attention(q, k, v, limits, bias, is_causal=True)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    out = compiled(q, k, v, bias)
    out.sum().backward()
    ref = reference.attention(
        *(t.detach().double() for t in (q, k, v)), limits, bias.detach().double(), is_causal=True
    )
    assert_close(out, ref, 1e-5, "out")
    assert bias.grad is not None and torch.isfinite(bias.grad).all()


# masks.causal_topk_mask


def _brute_causal_topk(bias, window, allowed, lq, n):
    """Per query position p: the window keys j <= p, j < n[b], allowed, of largest bias, ties to
    the lower index, as a (B, H, Lq, Lk) bool mask."""
    b_, h_, _, lk = bias.shape
    out = torch.zeros(b_, h_, lq, lk, dtype=torch.bool)
    for b, h in itertools.product(range(b_), range(h_)):
        for i in range(lq):
            p = i + n[b] - lq
            keys = [
                j for j in range(lk) if j <= p and j < n[b] and (allowed is None or allowed[b, j])
            ]
            keys.sort(key=lambda j: (-bias[b, h, 0, j].item(), j))
            out[b, h, i, keys[:window]] = True
    return out


def _seen(limits, lq, n):
    lk = limits.shape[-1]
    i = torch.arange(lq).view(lq, 1)
    j = torch.arange(lk)
    n = torch.tensor(n).view(-1, 1, 1, 1)
    return (i < limits) & (j <= i + n - lq) & (j < n)


@pytest.mark.parametrize("trial", range(24))
def test_causal_topk_mask_is_each_querys_top_window(trial):
    g = torch.Generator().manual_seed(trial)
    lk = int(torch.randint(1, 48, (), generator=g))
    window = int(torch.randint(0, lk + 3, (), generator=g))
    lq = int(torch.randint(1, lk + 1, (), generator=g))
    shape = (2, 3, 1, lk)
    # Odd trials draw from four values: ties everywhere.
    if trial % 2:
        bias = torch.randint(0, 4, shape, generator=g).double()
    else:
        bias = torch.randn(shape, generator=g, dtype=torch.float64)
    pad = torch.rand(2, lk, generator=g) > 0.2 if trial % 3 == 0 else None
    used = None
    n = [lk, lk]
    if trial % 4 == 1:
        used = torch.randint(lq, lk + 1, (2,), generator=g, dtype=torch.int32)
        n = used.tolist()
    limits = masks.causal_topk_mask(bias, window, pad, num_queries=lq, seqused_k=used)
    assert limits.dtype == torch.int32 and limits.shape == shape
    assert torch.equal(_seen(limits, lq, n), _brute_causal_topk(bias, window, pad, lq, n))


def test_causal_topk_mask_ranks_nan_last_and_ignores_masked_keys():
    bias = torch.tensor([[[[1.0, float("nan"), 3.0, float("inf"), -float("inf"), 2.0]]]])
    allowed = torch.tensor([[True, True, True, False, True, True]])
    limits = masks.causal_topk_mask(bias, 2, allowed)
    seen = _seen(limits, 6, [6])[0, 0]
    expected = torch.tensor([
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],  # NaN is kept while fewer than 2 keys are better
        [1, 0, 1, 0, 0, 0],
        [1, 0, 1, 0, 0, 0],  # the masked +inf is never chosen
        [1, 0, 1, 0, 0, 0],  # -inf ranks below 1.0
        [0, 0, 1, 0, 0, 1],
    ], dtype=torch.bool)  # fmt: skip
    assert torch.equal(seen, expected)


def test_causal_topk_mask_refuses_query_rows():
    with pytest.raises(ValueError, match="one value per key"):
        masks.causal_topk_mask(torch.randn(1, 1, 4, 4), 2)
    with pytest.raises(ValueError, match="window"):
        masks.causal_topk_mask(torch.randn(1, 1, 1, 4), -1)


def test_causal_topk_mask_with_the_attention_equals_the_materialised_selection():
    """The row-limit mask in attention = Doge's way: the (B, H, Lq, Lk) selection as a mask."""
    torch.manual_seed(7)
    c = Case(2, 64, 64, 4, 2, 16, 16)
    bias = torch.randn(c.b, c.hkv, 1, c.lk, dtype=torch.float64, device=DEVICE)
    limits = masks.causal_topk_mask(bias, 9)
    selected = _brute_causal_topk(bias.cpu(), 9, None, c.lq, [c.lk] * c.b).to(DEVICE)
    q, k, v, _ = (t.detach() for t in _inputs(c, torch.float32, 1))
    out = dmattn_ops.attention(q, k, v, limits, bias.float(), is_causal=True)
    ref = reference.attention(q.double(), k.double(), v.double(), selected, bias, is_causal=True)
    assert_close(out, ref, 1e-5, "out")
