"""Attention sinks (issue 16, the sinks half): a learned logit per query head in each row's
softmax denominator, against the float64 oracle and an independent formulation."""

import pytest
import torch
from helpers import (
    DEVICE,
    F64,
    TRITON,
    assert_close,
    assert_grads_close,
    low_precision_bound,
)

import dmattn_ops
from dmattn_ops import reference
from dmattn_ops.dispatch import launch


def _inputs(dtype, b=2, lq=7, lk=9, h=4, hkv=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, lq, h, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, lk, hkv, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, lk, hkv, d, generator=g, dtype=torch.float64)
    bias = torch.randn(b, hkv, 1, lk, generator=g, dtype=torch.float64)
    mask = torch.rand(b, hkv, 1, lk, generator=g) < 0.5
    mask[0, 0] = False  # the query heads of this KV group see no key at all
    sinks = torch.tensor([0.5, -1.0, float("-inf"), 3.0], dtype=torch.float64)
    sinks = sinks.to(DEVICE, torch.float64 if dtype == torch.float64 else torch.float32)
    return [t.to(DEVICE, dtype) for t in (q, k, v, bias)] + [mask.to(DEVICE), sinks]


def test_oracle_equals_a_sink_key_with_zero_value():
    """The sink as one more key, first in line, whose logit is sinks[h] and whose value is 0."""
    q, k, v, bias, mask, sinks = _inputs(torch.float64)
    sinks = sinks.clone()
    sinks[2] = -2.0  # a plain key cannot carry -inf and stay visible
    b, lq, h, _ = q.shape
    lk = k.shape[1]
    hkv = k.shape[2]
    k1 = torch.cat([torch.zeros_like(k[:, :1]), k], dim=1)
    v1 = torch.cat([torch.zeros_like(v[:, :1]), v], dim=1)
    bias_h = bias.repeat_interleave(h // hkv, dim=1).expand(b, h, lq, lk)
    bias1 = torch.cat([sinks[None, :, None, None].expand(b, h, lq, 1), bias_h], dim=-1)
    mask_h = mask.repeat_interleave(h // hkv, dim=1).expand(b, h, lq, lk)
    mask1 = torch.cat([torch.ones(b, h, lq, 1, dtype=torch.bool, device=DEVICE), mask_h], dim=-1)
    want, want_lse = reference.attention(q, k1, v1, mask1, bias1, is_causal=True, return_lse=True)
    got, lse = reference.attention(q, k, v, mask, bias, is_causal=True, sinks=sinks,
                                   return_lse=True)  # fmt: skip
    assert_close(got, want, F64 * want.abs().max().item(), "out")
    assert_close(lse, want_lse, 1e-6, "lse")  # the public lse is float32


@pytest.mark.parametrize("backend", ["auto", "triton"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_forward_and_gradients_against_the_oracle(backend, dtype):
    if backend == "triton" and (dtype == torch.float64 or not TRITON):
        pytest.skip("the Triton kernels take fp16/bf16/fp32, on CUDA or the interpreter")
    inputs = _inputs(dtype)
    mask = inputs[4]
    leaves = [t.clone().requires_grad_() for i, t in enumerate(inputs) if i != 4]

    def run(fn, tensors, **kw):
        q, k, v, bias, sinks = tensors
        out, lse = fn(q, k, v, mask, bias, is_causal=True, softcap=4.0, sinks=sinks,
                      return_lse=True, **kw)  # fmt: skip
        loss = (out.double() * torch.cos(out.double())).sum() + (
            lse.double().where(lse.isfinite(), 0) * 0.3
        ).sum()
        grads = torch.autograd.grad(loss, tensors)
        return out, lse, grads

    out, lse, grads = run(dmattn_ops.attention, leaves, backend=backend)
    up = [t.detach().double().requires_grad_() for t in leaves]
    ref, ref_lse, ref_grads = run(reference.attention, up)
    low = [t.detach().clone().requires_grad_() for t in leaves]
    ref_lp, _, ref_lp_grads = run(reference.attention, low)
    assert torch.isfinite(out).all() and not torch.isnan(lse).any()
    names = ("dq", "dk", "dv", "dbias", "dsinks")
    if dtype == torch.float64:
        assert_close(out, ref, F64 * ref.abs().max().item(), "out")
    else:
        assert_close(out, ref, low_precision_bound(ref, ref_lp, dtype), "out")
    assert_grads_close(names, grads, ref_grads, ref_lp_grads, ref_lse, dtype)
    assert_close(lse, ref_lse, 1e-5 * max(1.0, ref_lse[ref_lse.isfinite()].abs().max().item()),
                 "lse")  # fmt: skip
    # Rows of the KV group that sees no key: out 0, lse = sinks[h] (-inf for a -inf sink).
    assert (out[0, :, :2] == 0).all()
    sinks = inputs[5]
    assert_close(lse[0, :2], sinks[:2, None].float().expand(2, lse.shape[2]), 0.0, "lse = sink")


def test_sinks_of_finfo_min_and_minus_inf_are_no_sink():
    q, k, v, bias, mask, _ = _inputs(torch.float32)
    plain = dmattn_ops.attention(q, k, v, mask, bias, is_causal=True)
    for value in (torch.finfo(torch.float32).min, float("-inf")):
        sinks = torch.full((4,), value, device=DEVICE)
        out = dmattn_ops.attention(q, k, v, mask, bias, is_causal=True, sinks=sinks)
        assert torch.equal(out, plain)


def test_invalid_sinks_raise():
    q, k, v, bias, mask, _ = _inputs(torch.float32)
    with pytest.raises(ValueError, match="sinks must have shape"):
        dmattn_ops.attention(q, k, v, sinks=torch.zeros(3, device=DEVICE))
    with pytest.raises(TypeError, match="sinks dtype"):
        dmattn_ops.attention(q, k, v, sinks=torch.zeros(4, dtype=torch.float16, device=DEVICE))


BACKENDS = ["auto", "reference", "flex"] + (["triton"] if TRITON else [])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_nan_and_inf_sinks_raise_on_every_backend(backend, bad):
    q, k, v, _, _, sinks = _inputs(torch.float32)
    sinks = sinks.clone()
    sinks[1] = bad
    with pytest.raises(ValueError, match=r"sinks must be finite or -inf .* head\(s\) \[1\]"):
        dmattn_ops.attention(q, k, v, sinks=sinks, backend=backend)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="sinks must be finite or -inf"):
        dmattn_ops.attention_varlen(q[0], k[0, :7], v[0, :7], cu, cu, 4, 4, sinks=sinks,
                                    backend=backend)  # fmt: skip
    if backend == "auto":
        with pytest.raises(ValueError, match="sinks must be finite or -inf"):
            torch.ops.dmattn.attention(q, k, v, sinks=sinks)


def test_the_same_sinks_are_read_once_until_written(monkeypatch):
    """A model passes the same sinks parameter every call: after one check, a call reads no
    value of it on the host (each read was a sync a layer a token) until an in-place write
    moves its version counter; a NaN written then still raises. Sinks made under
    inference_mode keep no version counter and are checked every call."""
    q, k, v = _qkv64()
    sinks = torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))
    dmattn_ops.attention(q, k, v, sinks=sinks)
    reads = []
    for name in ("tolist", "item", "__bool__"):
        original = getattr(torch.Tensor, name)

        def read(self, *args, original=original):
            reads.append(self)
            return original(self, *args)

        monkeypatch.setattr(torch.Tensor, name, read)
    dmattn_ops.attention(q, k, v, sinks=sinks)
    assert reads == []
    with torch.no_grad():
        sinks[2] = float("nan")
    with pytest.raises(ValueError, match=r"sinks must be finite or -inf .* head\(s\) \[2\]"):
        dmattn_ops.attention(q, k, v, sinks=sinks)
    monkeypatch.undo()
    with torch.inference_mode():
        frozen = torch.zeros(4, dtype=torch.float64)
        dmattn_ops.attention(q, k, v, sinks=frozen)
        frozen[1] = float("inf")
        with pytest.raises(ValueError, match="sinks must be finite or -inf"):
            dmattn_ops.attention(q, k, v, sinks=frozen)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dsinks_without_keys(backend):
    """Lk = 0: every row's lse is its sink, so the gradient of sum(lse) in sinks[h] is the
    number of rows of head h (issue 48: it was 0 on the default path and the kernels)."""
    q, k, v, _, _, sinks = _inputs(torch.float32, lk=0)
    sinks = sinks.clone().requires_grad_()
    out, lse = dmattn_ops.attention(q, k, v, sinks=sinks, return_lse=True, backend=backend)
    assert (out == 0).all()
    (lse[lse.isfinite()].sum() + out.sum()).backward()
    rows = q.shape[0] * q.shape[1]
    want = torch.where(sinks.isfinite(), float(rows), 0.0).detach()
    assert_close(sinks.grad, want, 0.0, "dsinks")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_varlen_sinks_against_the_oracle(dtype):
    if dtype != torch.float64 and not TRITON:
        pytest.skip("needs CUDA or the interpreter")
    g = torch.Generator().manual_seed(3)
    total, h, hkv, d = 13, 4, 2, 16
    q, k, v = (torch.randn(total, x, d, generator=g, dtype=torch.float64) for x in (h, hkv, hkv))
    bias = torch.randn(hkv, total, generator=g, dtype=torch.float64)
    mask = torch.rand(hkv, total, generator=g) < 0.6
    mask[:, 5:9] = False  # the second sequence (rows 5..8) sees no key
    cu = torch.tensor([0, 5, 9, 12], dtype=torch.int32)  # row 12 is outside every sequence
    sinks = torch.tensor([0.5, -1.0, float("-inf"), 3.0], dtype=torch.float64)
    up = [t.to(DEVICE) for t in (q, k, v, bias)]
    low = [t.to(dtype) for t in up]
    args = (cu.to(DEVICE), cu.to(DEVICE), 5, 5, mask.to(DEVICE))
    s = sinks.to(DEVICE, torch.float64 if dtype == torch.float64 else torch.float32)
    leaves = [t.clone().requires_grad_() for t in (*low, s)]
    q_, k_, v_, b_, s_ = leaves
    out, lse = dmattn_ops.attention_varlen(q_, k_, v_, *args[:4], args[4], b_, is_causal=True,
                                           sinks=s_, return_lse=True)  # fmt: skip
    out.square().sum().backward()

    def oracle(tensors):
        leaves = [t.clone().requires_grad_() for t in tensors]
        qq, kk, vv, bb, ss = leaves
        o, l_ = reference.attention_varlen(qq, kk, vv, *args[:4], args[4], bb, is_causal=True,
                                           sinks=ss, return_lse=True)  # fmt: skip
        o.square().sum().backward()
        return o, l_, [t.grad for t in leaves]

    ref, ref_lse, ref_grads = oracle((*up, sinks.to(DEVICE)))
    ref_lp, _, ref_lp_grads = oracle((*low, s))

    def bound(w, wl):
        return (
            F64 * max(1.0, w.abs().max().item())
            if dtype == torch.float64
            else (low_precision_bound(w, wl, dtype))
        )

    assert_close(out, ref, bound(ref, ref_lp), "out")
    assert_close(lse, ref_lse, 1e-5, "lse")  # the public lse is float32
    assert lse[:, 12].isinf().all() and (out[12] == 0).all()  # outside every sequence
    assert_close(lse[:, 5:9], s[:, None].float().expand(4, 4), 0.0, "empty sequence: lse = sink")
    names = ("dq", "dk", "dv", "dbias", "dsinks")
    for name, a, w, wl in zip(names, leaves, ref_grads, ref_lp_grads):
        assert_close(a.grad, w, bound(w, wl), name)


@pytest.mark.parametrize(
    "lq, lk", [(1, 70), (2, 70), (5, 0)], ids=["decode", "decode-2", "no-keys"]
)
def test_decode_and_empty_calls_with_sinks(lq, lk, monkeypatch):
    """The paths that do not start each row's softmax from its sink: split-key decode, whose
    merge takes the sink as one more part (a KV group that sees no key: out 0, lse = sinks),
    and a call with no keys (chunked.join_sinks; out 0, lse = sinks)."""
    if not TRITON:
        pytest.skip("needs CUDA or the interpreter")
    q, k, v, bias, _, sinks = _inputs(torch.float32, b=2, lq=lq, lk=lk)
    mask = torch.rand(2, 2, 1, lk, generator=torch.Generator().manual_seed(5)) < 0.7
    mask[1, 0] = False  # the query heads of this KV group see no key
    mask = mask.to(DEVICE)
    if lk:
        # The cache past seqused_k holds NaN, as an uninitialised KV cache would.
        k[:, 60:], v[:, 60:] = float("nan"), float("nan")
    seq = torch.tensor([60, 33], dtype=torch.int32, device=DEVICE) if lk else None
    calls = []
    if lk:
        decode = launch.decode_forward
        monkeypatch.setattr(launch, "decode_forward", lambda *a: calls.append(1) or decode(*a))
    leaves = [t.clone().requires_grad_() for t in (q, k, v, bias, sinks)]
    out, lse = dmattn_ops.attention(*leaves[:3], mask, leaves[3], sinks=leaves[4],
                                    seqused_k=seq, return_lse=True, backend="triton")  # fmt: skip
    assert calls == ([1] if lk else [])
    up = [t.detach().double().requires_grad_() for t in leaves]
    low = [t.detach().clone().requires_grad_() for t in leaves]
    ref, ref_lse = reference.attention(*up[:3], mask, up[3], sinks=up[4], seqused_k=seq,
                                       return_lse=True)  # fmt: skip
    ref_lp = reference.attention(*low[:3], mask, low[3], sinks=low[4], seqused_k=seq)
    assert_close(out, ref, low_precision_bound(ref, ref_lp, torch.float32), "out")
    assert_close(lse, ref_lse, 1e-5 * max(1.0, ref_lse.abs().max().item()), "lse")
    weights = torch.cos(torch.arange(out.numel(), device=DEVICE)).view(out.shape)
    (out * weights).sum().backward()
    (ref * weights.double()).sum().backward()
    (ref_lp * weights).sum().backward()
    for name, a, w, wl in zip(("dq", "dk", "dv", "dbias", "dsinks"), leaves, up, low):
        assert torch.isfinite(a.grad).all(), name
        assert_close(a.grad, w.grad, low_precision_bound(w.grad, wl.grad, torch.float32), name)
    empty = slice(None) if not lk else slice(1, 2)  # every row, or batch 1's KV group 0
    assert (out[empty, :, :2] == 0).all() if lk else (out == 0).all()
    want = sinks.float()[None, :, None].expand_as(lse)[empty]
    assert_close(lse[empty][:, :2] if lk else lse, want[:, :2] if lk else want, 0.0, "lse = sink")


def test_the_registered_ops_take_the_sinks(monkeypatch):
    """backend auto/triton passes sinks to dmattn::attention (the forward kernel starts from
    them); only Flex joins them to its result in PyTorch (api.add_sinks)."""
    from dmattn_ops import api

    q, k, v, bias, mask, sinks = _inputs(torch.float32)
    monkeypatch.setattr(api, "add_sinks", None)  # a call would raise TypeError
    seen = []

    class Spy(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.dmattn.attention.default:
                seen.append(args[11] if len(args) > 11 else None)
            return func(*args, **(kwargs or {}))

    with Spy():
        dmattn_ops.attention(q, k, v, mask, bias, is_causal=True, sinks=sinks)
    assert len(seen) == 1 and seen[0] is not None and torch.equal(seen[0], sinks)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_join_kernel_joins_as_join_sinks_does(dtype):
    """launch._join_sinks (one kernel, in place; the fused kernels' path) against
    chunked.join_sinks: rows with no key (lse -inf), a sink of -inf, a huge sink, a lse_rem
    that is not 0, strided rows."""
    if not TRITON:
        pytest.skip("needs CUDA or the interpreter")
    from dmattn_ops.executors import chunked

    g = torch.Generator().manual_seed(5)
    b, lq, h, dv = 2, 37, 4, 24
    out = torch.randn(b, lq, h, 2 * dv, generator=g)[..., ::2].to(DEVICE, dtype)  # strided
    lse = (5 * torch.randn(b, h, lq, generator=g)).to(DEVICE)
    lse[0, 1, :3] = float("-inf")
    lse_rem = (1e-7 * torch.randn(b, h, lq, generator=g)).to(DEVICE)
    lse_rem[0, 1, :3] = 0.0
    sinks = torch.tensor([0.5, 3.0, float("-inf"), 1e4], device=DEVICE)
    want = chunked.join_sinks(out.clone(), lse.clone(), lse_rem.clone(), sinks)
    got = launch._join_sinks(out.clone(), lse.clone(), lse_rem.clone(), sinks)
    # (lse, lse_rem) is one value split in two (lse_split): compared as their sum.
    pairs = [got[0], got[1].double() + got[2].double()], [want[0], want[1].double() + want[2]]
    for name, x, w in zip(("out", "lse + lse_rem"), *pairs):
        assert x.isfinite().eq(w.isfinite()).all(), name
        finite = w.isfinite()
        eps = torch.finfo(dtype if name == "out" else torch.float32).eps
        bound = 4 * eps * w[finite].abs().max().item()
        assert_close(x[finite].double(), w[finite].double(), bound, name)
    assert got[0].dtype == dtype and got[1].dtype == got[2].dtype == torch.float32
    assert (got[1][0, 1, :3] == 3.0).all() and (got[0][0, :3, 1] == 0).all()  # the sink's rows
    assert torch.equal(got[0][:, :, 2], out[:, :, 2])  # -inf: no sink


def test_flex_and_the_oracle_take_attention_s_keywords():
    """`flex.attention` and `reference.attention` have `attention`'s signature: sinks join
    Flex's result exactly as the oracle's; kernel_options, which choose among this library's
    kernels, raise on both."""
    import inspect

    public = inspect.signature(dmattn_ops.attention).parameters
    names = {name for name in public if not name.startswith("_")}  # the library's own keywords
    for fn in (dmattn_ops.flex.attention, dmattn_ops.reference.attention):
        assert names <= set(inspect.signature(fn).parameters), fn
        with pytest.raises(ValueError, match="kernel_options"):
            fn(*_qkv64(), kernel_options={"route": "pytorch"})
    q, k, v = _qkv64()
    sinks = torch.randn(q.shape[2], dtype=torch.float64)
    want, want_lse = reference.attention(q, k, v, is_causal=True, sinks=sinks, return_lse=True)
    got, lse = dmattn_ops.flex.attention(q, k, v, is_causal=True, sinks=sinks, return_lse=True)
    # Flex returns a float32 lse (the contract's), through which the sink's share is weighed:
    # a few float32 roundings of lse, relative to out.
    bound = 8 * 2.0**-24 * max(1.0, want_lse.abs().max().item()) * want.abs().max().item()
    assert (got - want).abs().max() <= bound
    assert (lse - want_lse).abs().max() <= 8 * 2.0**-24 * max(1.0, want_lse.abs().max().item())


def _qkv64():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 9, 4, 8, generator=g, dtype=torch.float64)
    k = torch.randn(1, 11, 2, 8, generator=g, dtype=torch.float64)
    return q, k, torch.randn(1, 11, 2, 8, generator=g, dtype=torch.float64)
