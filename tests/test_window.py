"""Sliding windows (issue 16): window_size=(left, right) bounds the keys of query i to
[p - left, p + right], p = i + n - Lq, in every backend, against the float64 oracle."""

import math

import pytest
import torch
from helpers import (
    DEVICE,
    F64,
    TRITON,
    assert_close,
    assert_grads_close,
    float64_grad_bound,
    low_precision_bound,
)

import dmattn_ops
from dmattn_ops import flex, reference

# left only, right only, both, wider than the sequence, zero (the diagonal only), one-sided zero.
WINDOWS = [(5, 0), (-1, 3), (4, 2), (500, 500), (0, 0), (0, -1), (7, -1)]


def _band(b, lq, lk, window, seqused_k=None, is_causal=False):
    """The window as an explicit (B, 1, Lq, Lk) mask, written independently of the oracle."""
    n = seqused_k.long() if seqused_k is not None else torch.full((b,), lk)
    allowed = torch.zeros(b, 1, lq, lk, dtype=torch.bool)
    left, right = window
    for bi in range(b):
        for i in range(lq):
            p = i + int(n[bi]) - lq
            lo = 0 if left < 0 else p - left
            hi = lk - 1 if right < 0 else p + right
            if is_causal:
                hi = min(hi, p)
            for j in range(max(lo, 0), min(hi, lk - 1) + 1):
                allowed[bi, 0, i, j] = True
    return allowed


def _inputs(dtype, b=2, lq=9, lk=13, h=4, hkv=2, d=16, seed=0, bias_rows=1):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, lq, h, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, lk, hkv, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, lk, hkv, d, generator=g, dtype=torch.float64)
    bias = torch.randn(b, h, bias_rows, lk, generator=g, dtype=torch.float64)
    return [t.to(DEVICE, dtype) for t in (q, k, v, bias)]


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("is_causal", [False, True])
def test_oracle_window_is_the_band_as_a_mask(window, is_causal):
    q, k, v, bias = _inputs(torch.float64)
    seq = torch.tensor([13, 6], dtype=torch.int32)
    got = reference.attention(q.cpu(), k.cpu(), v.cpu(), None, bias.cpu(), window_size=window,
                              is_causal=is_causal, seqused_k=seq)  # fmt: skip
    band = _band(2, 9, 13, window, seq, is_causal)
    want = reference.attention(q.cpu(), k.cpu(), v.cpu(), band, bias.cpu(), seqused_k=seq)
    assert torch.equal(got, want)


def _grads(fn, tensors, mask, **kw):
    q, k, v, bias = tensors
    out, lse = fn(q, k, v, mask, bias, return_lse=True, **kw)
    loss = (out.double() * torch.cos(out.double())).sum() + (
        lse.double().where(lse.isfinite(), 0) * 0.3
    ).sum()
    return out, lse, torch.autograd.grad(loss, tensors)


def _check(dtype, inputs, mask, backend="auto", **kw):
    """Forward, lse and every gradient of dmattn_ops.attention against the float64 oracle,
    with bounds from PyTorch's own error in dtype (float64: a few ulps)."""
    leaves = [t.clone().requires_grad_() for t in inputs]
    out, lse, grads = _grads(dmattn_ops.attention, leaves, mask, backend=backend, **kw)
    up = [t.detach().double().requires_grad_() for t in inputs]
    ref, ref_lse, ref_grads = _grads(reference.attention, up, mask, **kw)
    low = [t.detach().clone().requires_grad_() for t in inputs]
    ref_lp, _, ref_lp_grads = _grads(reference.attention, low, mask, **kw)
    assert not out.isnan().any() and not lse.isnan().any()
    names = ("dq", "dk", "dv", "dbias")
    if dtype == torch.float64:
        assert_close(out, ref, F64 * max(1.0, ref.abs().max().item()), "out")
    else:
        assert_close(out, ref, low_precision_bound(ref, ref_lp, dtype), "out")
    assert_grads_close(names, grads, ref_grads, ref_lp_grads, ref_lse, dtype)
    fin = ref_lse.isfinite()
    assert torch.equal(lse.isfinite(), fin)
    assert_close(lse[fin], ref_lse[fin].float(), 1e-5 * max(1.0, ref_lse[fin].abs().max().item()),
                 "lse")  # fmt: skip


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("is_causal", [False, True])
def test_chunked_path_float64(window, is_causal):
    q, k, v, bias = _inputs(torch.float64)
    seq = torch.tensor([13, 6], dtype=torch.int32, device=DEVICE)
    _check(torch.float64, [q, k, v, bias], None, window_size=window, is_causal=is_causal,
           seqused_k=seq)  # fmt: skip


# Kernel paths: no mask (the band bounds the loops), a mask shared by all queries (key lists,
# the band as list positions), a mask per query (tile tables), a bias per query row with its
# dbias summed over the batch (the dbias kernel), and decoding (Lq <= 16, split-K).
KERNEL_CASES = [
    # (b, lq, lk, h, hkv, mask, bias rows, bias batch)
    (2, 40, 70, 4, 2, None, 1, 2),
    (2, 40, 70, 4, 2, "keys", 1, 2),
    (1, 70, 40, 2, 1, "entries", 70, 1),
    (2, 33, 50, 4, 2, None, 33, 1),
    (2, 5, 90, 4, 2, None, 1, 2),
    (2, 5, 90, 4, 2, "keys", 1, 2),
]


@pytest.mark.skipif(not TRITON, reason="needs CUDA or the interpreter")
@pytest.mark.parametrize("case", KERNEL_CASES, ids=lambda c: f"{c[1]}x{c[2]}-{c[5]}-{c[6]}")
@pytest.mark.parametrize("window, is_causal", [((9, 0), False), ((20, 5), True), ((-1, 6), False),
                                                ((11, -1), True), ((0, 0), False)])  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels(case, window, is_causal, dtype):
    b, lq, lk, h, hkv, mask_kind, bias_rows, bias_b = case
    if dtype == torch.bfloat16 and window != (20, 5):
        pytest.skip("bf16: one window per case keeps the interpreter's time down")
    q, k, v, bias = _inputs(dtype, b, lq, lk, h, hkv, seed=lq + lk, bias_rows=bias_rows)
    bias = bias[:bias_b].contiguous()
    g = torch.Generator().manual_seed(1)
    mask = None
    if mask_kind == "keys":
        mask = (torch.rand(b, hkv, 1, lk, generator=g) < 0.7).to(DEVICE)
    elif mask_kind == "entries":
        mask = (torch.rand(b, h, lq, lk, generator=g) < 0.7).to(DEVICE)
    seq = torch.tensor([lk] + [lk - 9] * (b - 1), dtype=torch.int32, device=DEVICE)
    kw = dict(backend="triton", seqused_k=seq)
    if dtype == torch.float32:
        _check(dtype, [q, k, v, bias], mask, window_size=window, is_causal=is_causal, **kw)
        return
    # bf16: the window against the same kernels given the band as a mask, whose bf16 accuracy
    # the mask tests hold (their dV error is up to ~3x PyTorch's own here, with or without a
    # window). The two runs differ at most in fp32 summation order, so in
    # their final bf16 rounding.
    band = _band(b, lq, lk, window, seq.cpu(), is_causal).to(DEVICE)
    both = band if mask is None else band & mask
    win = _grads(dmattn_ops.attention, [t.clone().requires_grad_() for t in (q, k, v, bias)],
                 mask, window_size=window, is_causal=is_causal, **kw)  # fmt: skip
    masked = _grads(dmattn_ops.attention, [t.clone().requires_grad_() for t in (q, k, v, bias)],
                    both, **kw)  # fmt: skip
    for name, got, want in zip(
        ("out", "lse", "dq", "dk", "dv", "dbias"),
        (win[0], win[1], *win[2]),
        (masked[0], masked[1], *masked[2]),
    ):
        fin = want[want.isfinite()]
        ulp = torch.finfo(got.dtype).eps * (fin.abs().max().item() if fin.numel() else 0.0)
        assert_close(got, want, 2 * ulp, name)


@pytest.mark.skipif(not TRITON, reason="needs CUDA or the interpreter")
@pytest.mark.parametrize("lq", [1, 32])
def test_key_tiles_outside_the_band_are_never_read(lq):
    """NaN in every key and value far below the band (whole tiles of any size up to 64)
    reaches no output and no gradient: those tiles are never loaded. The poisoned keys get
    zero gradients."""
    lk, window = 200, (8, 0)
    q, k, v, bias = _inputs(torch.float32, b=1, lq=lq, lk=lk, seed=5)
    clean = [t.clone() for t in (k, v)]
    k[:, :128] = float("nan")
    v[:, :128] = float("nan")
    leaves = [t.clone().requires_grad_() for t in (q, k, v, bias)]
    out = dmattn_ops.attention(*leaves[:3], None, leaves[3], is_causal=True, window_size=window,
                               backend="triton")  # fmt: skip
    want = reference.attention(q.double(), clean[0].double(), clean[1].double(), None,
                               bias.double(), is_causal=True, window_size=window)  # fmt: skip
    assert_close(out, want, 1e-5, "out")
    out.square().sum().backward()
    for t in leaves:
        assert not t.grad.isnan().any()
    assert (leaves[1].grad[:, :128] == 0).all() and (leaves[2].grad[:, :128] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("window, is_causal", [((3, 0), True), ((2, 4), False)])
def test_varlen_against_the_oracle(dtype, window, is_causal):
    if dtype != torch.float64 and not TRITON:
        pytest.skip("needs CUDA or the interpreter")
    g = torch.Generator().manual_seed(4)
    h, hkv, d = 4, 2, 16
    cu_q = torch.tensor([0, 9, 10, 25], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 14, 20, 40], dtype=torch.int32, device=DEVICE)
    q = torch.randn(27, h, d, generator=g, dtype=torch.float64).to(DEVICE)
    k, v = (torch.randn(42, hkv, d, generator=g, dtype=torch.float64).to(DEVICE) for _ in "kv")
    bias = torch.randn(h, 42, generator=g, dtype=torch.float64).to(DEVICE)
    mask = (torch.rand(hkv, 42, generator=g) < 0.7).to(DEVICE)
    args = (cu_q, cu_k, 15, 20, mask)
    kw = dict(window_size=window, is_causal=is_causal, return_lse=True)

    def run(fn, tensors):
        leaves = [t.clone().requires_grad_() for t in tensors]
        out, lse = fn(*leaves[:3], *args, leaves[3], **kw)
        out.square().sum().backward()
        return out, lse, [t.grad for t in leaves]

    out, lse, grads = run(dmattn_ops.attention_varlen, [t.to(dtype) for t in (q, k, v, bias)])
    ref, ref_lse, ref_grads = run(reference.attention_varlen, [q, k, v, bias])
    _, _, lp_grads = run(reference.attention_varlen, [t.to(dtype) for t in (q, k, v, bias)])
    ref_lp = run(reference.attention_varlen, [t.to(dtype) for t in (q, k, v, bias)])[0]
    if dtype == torch.float64:
        assert_close(out, ref, F64 * ref.abs().max().item(), "out")
    else:
        assert_close(out, ref, low_precision_bound(ref, ref_lp, dtype), "out")
    assert torch.equal(lse.isfinite(), ref_lse.isfinite())
    for name, a, w, wl in zip(("dq", "dk", "dv", "dbias"), grads, ref_grads, lp_grads):
        bound = (float64_grad_bound(w, ref_lse) if dtype == torch.float64
                 else low_precision_bound(w, wl, dtype))  # fmt: skip
        assert_close(a, w, bound, name)


@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_sinks_with_a_window_and_empty_rows(backend):
    """A window of (0, 0) with the diagonal key masked out leaves rows with no key: out 0, lse
    the sink, every gradient finite and equal to the oracle's."""
    if backend == "triton" and not TRITON:
        pytest.skip("needs CUDA or the interpreter")
    dtype = torch.float32 if backend == "triton" else torch.float64
    q, k, v, bias = _inputs(dtype, lq=13, lk=13)
    bias[0, :, :, 3] = torch.finfo(dtype).min
    mask = torch.ones(2, 2, 1, 13, dtype=torch.bool, device=DEVICE)
    mask[:, :, :, 5] = False
    sinks = torch.tensor([0.5, -1.0, float("-inf"), 3.0], dtype=torch.float64).to(DEVICE)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, bias, sinks.to(dtype))]
    out, lse = dmattn_ops.attention(*leaves[:3], mask, leaves[3], sinks=leaves[4],
                                    window_size=(0, 0), return_lse=True, backend=backend)  # fmt: skip
    out.square().sum().backward()
    up = [t.detach().double().requires_grad_() for t in leaves]
    ref, ref_lse = reference.attention(*up[:3], mask, up[3], sinks=up[4], window_size=(0, 0),
                                       return_lse=True)  # fmt: skip
    ref.square().sum().backward()
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    assert (out[:, 5] == 0).all()
    assert_close(lse[:, :, 5], sinks.float()[None].expand(2, 4), 0.0, "lse = sink")
    assert_close(out, ref, tol, "out")
    for name, a, w in zip(("dq", "dk", "dv", "dbias", "dsinks"), leaves, up):
        assert not a.grad.isnan().any(), name
        assert_close(a.grad, w.grad, tol * max(1.0, w.grad.abs().max().item()), name)


@pytest.mark.parametrize("bias_rows", [1, 6])
@pytest.mark.parametrize("window", [(2, 1), (-1, 2), (3, -1), (0, 0)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_flex_row_shift_is_the_band_max(bias_rows, window, is_causal):
    """Flex's lse shift for rows near finfo.min is the largest bias each row's band holds."""
    g = torch.Generator().manual_seed(2)
    b, h, hkv, lq, lk = 2, 4, 2, 6, 11
    bias = torch.randn(b, hkv, bias_rows, lk, generator=g) * 1e37 - 3e37
    mask = torch.rand(b, 1, 1, lk, generator=g) < 0.8
    seq = torch.tensor([11, 7], dtype=torch.int32)
    got = flex.row_shift(mask, bias, seq, is_causal, b, h, hkv, lq, lk, window)
    used = (torch.arange(lk)[None, :] < seq[:, None].long())[:, None, None, :]
    allowed = _band(b, lq, lk, window, seq, is_causal) & mask & used
    x = torch.where(allowed, bias.repeat_interleave(2, dim=1), -math.inf)
    best = x.amax(dim=-1)
    want = torch.where((best < -1e37) & best.isfinite(), best, 0.0)
    assert torch.equal(got, want)


def test_flex_backend_forward():
    q, k, v, bias = (t.float() for t in _inputs(torch.float64, lq=20, lk=20, seed=7))
    mask = (torch.rand(2, 2, 1, 20, generator=torch.Generator().manual_seed(0)) < 0.8).to(DEVICE)
    for window, causal in (((4, 0), True), ((2, 3), False)):
        with torch.no_grad():
            out, lse = dmattn_ops.attention(q, k, v, mask, bias, window_size=window,
                                            is_causal=causal, backend="flex", return_lse=True)  # fmt: skip
        ref, ref_lse = reference.attention(q.double(), k.double(), v.double(), mask,
                                           bias.double(), window_size=window, is_causal=causal,
                                           return_lse=True)  # fmt: skip
        assert_close(out, ref, 1e-5, "flex out")
        assert_close(lse, ref_lse, 1e-5, "flex lse")


def test_func_transforms_and_opcheck():
    q, k, v, bias = _inputs(torch.float64, lq=7, lk=9)
    kw = dict(window_size=(3, 1), is_causal=False)

    def f(q, bias):
        return dmattn_ops.attention(q, k, v, None, bias, **kw).square().sum()

    def f_ref(q, bias):
        return reference.attention(q, k, v, None, bias, **kw).square().sum()

    for got, want in zip(torch.func.grad(f, (0, 1))(q, bias),
                         torch.func.grad(f_ref, (0, 1))(q, bias)):  # fmt: skip
        assert_close(got, want, 1e-12 * max(1.0, want.abs().max().item()), "grad")
    tq = torch.randn_like(q)
    _, jvp = torch.func.jvp(lambda q: dmattn_ops.attention(q, k, v, None, bias, **kw), (q,), (tq,))
    _, jvp_ref = torch.func.jvp(lambda q: reference.attention(q, k, v, None, bias, **kw), (q,),
                                (tq,))  # fmt: skip
    assert_close(jvp, jvp_ref, 1e-12, "jvp")
    batched = torch.func.vmap(lambda q: dmattn_ops.attention(q, k, v, None, bias, **kw))(
        torch.stack([q, 2 * q])
    )
    assert_close(batched[1], reference.attention(2 * q, k, v, None, bias, **kw), 1e-12, "vmap")
    args = (q.requires_grad_(), k, v, None, bias.requires_grad_(), None, False, 0.0, None, False,
            [3, 1])  # fmt: skip
    torch.library.opcheck(torch.ops.dmattn.attention.default, args)
    scale = 16**-0.5
    torch.library.opcheck(torch.ops.dmattn.attention_forward.default,
                          (q, k, v, None, bias, scale, True, 0.0, None, False, [2, -1]))  # fmt: skip


def test_compiles_fullgraph():
    q, k, v, bias = _inputs(torch.float32, lq=16, lk=16)

    @torch.compile(fullgraph=True, backend="aot_eager")
    def f(q, k, v, bias):
        return dmattn_ops.attention(q, k, v, None, bias, is_causal=True, window_size=(4, 0))

    want = reference.attention(q.double(), k.double(), v.double(), None, bias.double(),
                               is_causal=True, window_size=(4, 0))  # fmt: skip
    assert_close(f(q, k, v, bias), want, 1e-5, "compiled")


@pytest.mark.parametrize(
    "window, error, match",
    [
        ((-2, 0), ValueError, "left must be >= 0, or -1"),
        ((1, -5), ValueError, "right must be >= 0, or -1"),
        ((1,), ValueError, "pair"),
        ((1.5, 0), TypeError, "must be an int"),
        (3, TypeError, "pair"),
        ((True, 0), TypeError, "must be an int"),
    ],
)
def test_invalid_windows_raise(window, error, match):
    q, k, v, _ = _inputs(torch.float32)
    with pytest.raises(error, match=match):
        dmattn_ops.attention(q, k, v, window_size=window)
    with pytest.raises(error, match=match):
        dmattn_ops.attention_varlen(q[0], k[0], v[0], torch.tensor([0, 9], dtype=torch.int32,
                                    device=DEVICE), torch.tensor([0, 13], dtype=torch.int32,
                                    device=DEVICE), 9, 13, window_size=window)  # fmt: skip


def test_a_window_unbounded_below_under_causality_is_plain_causal():
    from dmattn_ops.core.band import Band

    assert Band.of(True, (-1, 3)) == Band.of(True, (-1, 0)) == Band.of(True, (-1, -1))
    assert Band.of(True, (-1, -1)) == (True, False, 0, 0)
    assert Band.of(False, (-1, 3)).has_window and Band.of(True, (5, -1)).has_window
