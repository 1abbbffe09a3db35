"""attention_varlen: packed variable-length batches against the per-sequence float64 oracle.

Every packed buffer carries NaN rows past cu_seqlens[-1] (an unused tail of a preallocated
buffer); they must never reach an output or a gradient.
"""

from __future__ import annotations

import expecttest
import pytest
import torch
from helpers import (
    DEVICE,
    DTYPES,
    assert_close,
    float64_grad_bound,
    low_precision_bound,
)

import dmattn_ops
from dmattn_ops import reference
from dmattn_ops.dispatch import launch

TRITON_OK = DEVICE == "cuda" or launch.interpreter_on()
needs_triton = pytest.mark.skipif(not TRITON_OK, reason="needs CUDA or TRITON_INTERPRET=1")

OPS = {
    "attention_varlen": torch.ops.dmattn.attention_varlen.default,
    "attention_varlen_forward": torch.ops.dmattn.attention_varlen_forward.default,
    "attention_varlen_backward": torch.ops.dmattn.attention_varlen_backward.default,
}

# (query lengths, key lengths): zero-length and one-token sequences, sequences shorter and
# longer than a tile (16 under the interpreter, 64-128 on a GPU), queries without keys.
MIXES = {
    "mixed": ([5, 0, 1, 40, 17], [7, 3, 1, 33, 20]),
    "decode-like": ([1, 3, 1], [37, 70, 1]),
    "no-keys": ([4, 6], [0, 9]),
    "one": ([29], [29]),
    "all-empty": ([0, 0], [0, 0]),
}


def cu(lengths) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


class Packed:
    """Packed inputs with `tail` NaN rows past the last sequence in every buffer."""

    def __init__(
        self, lens_q, lens_k, h=4, hkv=2, d=16, dv=16, dtype=torch.float32, tail=3, device=DEVICE
    ):
        self.device = device
        self.cu_q, self.cu_k = cu(lens_q).to(device), cu(lens_k).to(device)
        self.max_q, self.max_k = max(lens_q), max(lens_k)
        tq, tk = sum(lens_q) + tail, sum(lens_k) + tail
        self.h, self.hkv, self.tk = h, hkv, tk
        self.q = torch.randn(tq, h, d, dtype=dtype, device=device)
        self.k = torch.randn(tk, hkv, d, dtype=dtype, device=device)
        self.v = torch.randn(tk, hkv, dv, dtype=dtype, device=device)
        self.grad_out = torch.randn(tq, h, dv, dtype=dtype, device=device)
        for t in (self.q, self.k, self.v, self.grad_out):
            t[t.shape[0] - tail :] = float("nan")

    def heads(self, kind: str) -> int:
        return {"H": self.h, "G": self.hkv, "h": 1}[kind]

    def operand(self, kind: str | None, dtype=None):
        if kind is None:
            return None
        shape = (self.heads(kind), self.tk)
        if dtype is None:
            return torch.rand(shape, device=self.device) < 0.6
        t = torch.randn(shape, dtype=dtype, device=self.device)
        t[:, self.tk - 3 :] = float("nan")  # bias past the last sequence: never read
        return t

    def args(self):
        return self.cu_q, self.cu_k, self.max_q, self.max_k


def run(fn, p: Packed, tensors, mask, cast, grads=True, **kwargs):
    """out, lse and the gradients of <out, grad_out>, with every tensor cast by `cast`."""
    leaves = [None if t is None else t.detach().to(cast(t)).requires_grad_() for t in tensors]
    q, k, v, bias = leaves
    out, lse = fn(q, k, v, *p.args(), mask, bias, return_lse=True, **kwargs)
    if not grads:
        return out, lse, []
    wrt = [t for t in leaves if t is not None]
    # grad_out keeps its NaN tail: rows outside every sequence must not pass it on.
    return out, lse, torch.autograd.grad(out, wrt, grad_outputs=p.grad_out.to(out.dtype))


def check_against_oracle(p: Packed, mask, bias, dtype, backend="triton", **kwargs):
    tensors = [p.q.to(dtype), p.k.to(dtype), p.v.to(dtype), bias]

    def ours(*a, **kw):
        return dmattn_ops.attention_varlen(*a, backend=backend, **kw)

    out, lse, grads = run(ours, p, tensors, mask, lambda t: t.dtype, **kwargs)
    ref64 = run(reference.attention_varlen, p, tensors, mask, lambda t: torch.float64, **kwargs)
    ref_lp = run(reference.attention_varlen, p, tensors, mask, lambda t: t.dtype, **kwargs)
    assert out.dtype == dtype and lse.dtype == torch.float32 and lse.shape == (p.h, p.q.shape[0])
    assert_close(out, ref64[0], low_precision_bound(ref64[0], ref_lp[0], dtype), "out")
    finite = ref64[1].isfinite()
    lse_bound = 2 * (ref_lp[1] - ref64[1])[finite].abs().max().item() + 1e-5 if finite.any() else 0
    assert_close(lse, ref64[1], lse_bound, "lse")
    for name, g, r, rl in zip(("dq", "dk", "dv", "dbias"), grads, ref64[2], ref_lp[2]):
        assert g.shape == r.shape and g.dtype == rl.dtype, name
        assert_close(g, r, low_precision_bound(r, rl, g.dtype), name)
    # Rows past the last sequence: out 0, lse -inf, zero gradients.
    tail_q = slice(int(p.cu_q[-1]), None)
    assert (out[tail_q] == 0).all() and (lse[:, tail_q] == float("-inf")).all()
    assert (grads[0][tail_q] == 0).all()
    assert (grads[1][int(p.cu_k[-1]) :] == 0).all() and (grads[2][int(p.cu_k[-1]) :] == 0).all()
    return out, lse, grads


@needs_triton
@pytest.mark.parametrize("mix", MIXES, ids=list(MIXES))
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_length_mixes(mix, is_causal):
    p = Packed(*MIXES[mix])
    check_against_oracle(
        p, p.operand("G"), p.operand("h", torch.float32), torch.float32, is_causal=is_causal
    )


@needs_triton
@pytest.mark.parametrize(
    ("mask_kind", "bias_kind"),
    [(None, None), ("h", None), ("H", "H"), ("G", "h"), ("H", "G"), (None, "H")],
)
def test_mask_and_bias_heads(mask_kind, bias_kind):
    # A mask per query head under GQA takes the dk/dv path without key lists.
    p = Packed([9, 1, 35], [20, 4, 35], h=4, hkv=2)
    check_against_oracle(
        p, p.operand(mask_kind), p.operand(bias_kind, torch.float32), torch.float32,
        is_causal=True,
    )  # fmt: skip


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dtypes_softcap_gqa(dtype):
    p = Packed([12, 33, 2], [30, 33, 19], h=6, hkv=2, d=40, dv=24)
    check_against_oracle(
        p, p.operand("G"), p.operand("G", dtype), dtype, is_causal=True, softcap=5.0
    )


@pytest.mark.parametrize("mix", ["mixed", "no-keys"])
def test_cpu_pytorch_path(kernel_options, mix):
    """The chunked PyTorch kernels (the CPU path without the interpreter), float64."""
    kernel_options(route="pytorch")
    p = Packed(*MIXES[mix], dtype=torch.float64, device="cpu")
    mask, bias = p.operand("H"), p.operand("G", torch.float64)
    check_against_oracle(p, mask, bias, torch.float64, backend="auto", is_causal=True)


@needs_triton
def test_equal_lengths_match_the_batched_op():
    b, lq, lk, h, hkv, d = 3, 21, 37, 4, 2, 16
    q = torch.randn(b, lq, h, d, device=DEVICE)
    k = torch.randn(b, lk, hkv, d, device=DEVICE)
    v = torch.randn(b, lk, hkv, d, device=DEVICE)
    mask = torch.rand(b, hkv, lk, device=DEVICE) < 0.5
    bias = torch.randn(b, hkv, lk, device=DEVICE)
    batched = dmattn_ops.attention(
        q, k, v, mask[:, :, None], bias[:, :, None], is_causal=True, backend="triton"
    )
    # Per key token: (Hkv, total_k) with sequence b's keys at columns b * lk ... (b + 1) * lk.
    out = dmattn_ops.attention_varlen(
        q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu([lq] * b).to(DEVICE),
        cu([lk] * b).to(DEVICE), lq, lk, mask.transpose(0, 1).flatten(1),
        bias.transpose(0, 1).flatten(1), is_causal=True, backend="triton",
    )  # fmt: skip
    torch.testing.assert_close(out.view(b, lq, h, d), batched, rtol=0, atol=2e-6)


@needs_triton
def test_deterministic_is_bitwise():
    p = Packed([30, 7], [41, 12])
    bias = p.operand("h", torch.float32)
    results = []
    for _ in range(2):
        leaves = [t.detach().clone().requires_grad_() for t in (p.q, p.k, p.v, bias)]
        torch.manual_seed(1)
        mask = p.operand("G")
        out = dmattn_ops.attention_varlen(
            leaves[0], leaves[1], leaves[2], *p.args(), mask, leaves[3], deterministic=True
        )
        grads = torch.autograd.grad(out, leaves, grad_outputs=p.grad_out)
        results.append([out, *grads])
    for a, b in zip(*results):
        assert torch.equal(a, b)


@needs_triton
def test_nan_everywhere_outside_the_sequences():
    """K/V/bias rows outside every sequence and a mask that allows them: nothing leaks."""
    p = Packed([8, 3], [10, 5], tail=20)
    mask = torch.ones(1, p.tk, dtype=torch.bool, device=DEVICE)
    bias = torch.full((1, p.tk), float("nan"), device=DEVICE)
    bias[:, :15] = torch.randn(1, 15, device=DEVICE)
    check_against_oracle(p, mask, bias, torch.float32)


def test_empty_batch():
    q = torch.randn(0, 2, 8)
    k = torch.randn(0, 1, 8)
    empty_cu = torch.zeros(1, dtype=torch.int32)
    out, lse = dmattn_ops.attention_varlen(q, k, k, empty_cu, empty_cu, 0, 0, return_lse=True)
    assert out.shape == (0, 2, 8) and lse.shape == (2, 0)


# Registered ops.


def varlen_sample(dtype=torch.float64, requires_grad=True):
    p = Packed([5, 0, 9], [7, 2, 9], h=4, hkv=2, d=8, dv=8, dtype=dtype, tail=0, device="cpu")
    q, k, v = (t.requires_grad_(requires_grad) for t in (p.q, p.k, p.v))
    mask = p.operand("G")
    bias = torch.randn(p.hkv, p.tk, dtype=dtype).requires_grad_(requires_grad)
    return (q, k, v, p.cu_q.cpu(), p.cu_k.cpu(), p.max_q, p.max_k, mask, bias)


class TestVarlenSchemas(expecttest.TestCase):
    def test_schemas(self):
        self.assertExpectedInline(
            "\n".join(str(op._schema) for op in OPS.values()),
            """\
dmattn::attention_varlen(Tensor query, Tensor key, Tensor value, Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, Tensor? mask=None, Tensor? bias=None, float? scale=None, bool is_causal=False, float softcap=0., bool deterministic=False, int[2] window_size=-1) -> Tensor
dmattn::attention_varlen_forward(Tensor query, Tensor key, Tensor value, Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, Tensor? mask, Tensor? bias, float scale, bool is_causal, float softcap, bool deterministic=False, int[2] window_size=-1, str? kernel_options=None) -> (Tensor out, Tensor lse, Tensor lse_rem)
dmattn::attention_varlen_backward(Tensor grad_out, Tensor? grad_lse, Tensor query, Tensor key, Tensor value, Tensor out, Tensor lse, Tensor lse_rem, Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, Tensor? mask, Tensor? bias, float scale, bool is_causal, float softcap, bool deterministic, bool compute_dbias, int[2] window_size=-1, str? kernel_options=None) -> (Tensor grad_query, Tensor grad_key, Tensor grad_value, Tensor grad_bias)""",
        )


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_opcheck_varlen(is_causal):
    args = varlen_sample()
    torch.library.opcheck(OPS["attention_varlen"], (*args, None, is_causal), test_utils="ALL")
    torch.library.opcheck(
        OPS["attention_varlen_forward"], (*args, 0.3, is_causal, 0.0), test_utils="ALL"
    )


def test_opcheck_varlen_backward():
    q, k, v, cu_q, cu_k, max_q, max_k, mask, bias = varlen_sample(requires_grad=False)
    out, lse, lse_rem = OPS["attention_varlen_forward"](
        q, k, v, cu_q, cu_k, max_q, max_k, mask, bias, 0.3, True, 0.0
    )
    args = (
        torch.randn_like(out), torch.randn_like(lse), q, k, v, out, lse, lse_rem, cu_q, cu_k,
        max_q, max_k, mask, bias, 0.3, True, 0.0, False, True,
    )  # fmt: skip
    torch.library.opcheck(OPS["attention_varlen_backward"], args, test_utils="ALL")


def test_gradcheck_float64():
    q, k, v, cu_q, cu_k, max_q, max_k, mask, bias = varlen_sample()

    def f(q, k, v, bias):
        return dmattn_ops.attention_varlen(
            q, k, v, cu_q, cu_k, max_q, max_k, mask, bias, is_causal=True
        )

    torch.autograd.gradcheck(f, (q, k, v, bias))


def test_compile_dynamic_does_not_recompile(monkeypatch):
    """New cu_seqlens, totals and longest sequences run in the graph compiled for the first,
    the longest query sequence growing past one 16-row tile included (on a GPU, a graph first
    traced within one query tile recompiled there: registration/inductor.py). On a GPU the
    graph launches our kernels itself: no launcher runs at a call (the op is not left whole)."""
    torch._dynamo.reset()
    calls = []

    def counted(run):
        def launcher(problem, *args, **kwargs):
            if torch._guards.detect_fake_mode() is None:  # a call, not the graph's trace
                calls.append(run.__name__)
            return run(problem, *args, **kwargs)

        return launcher

    monkeypatch.setattr(launch, "forward", counted(launch.forward))
    monkeypatch.setattr(launch, "backward", counted(launch.backward))

    def f(q, k, v, cu_q, cu_k, max_q, max_k, mask, bias):
        return dmattn_ops.attention_varlen(
            q, k, v, cu_q, cu_k, max_q, max_k, mask, bias, is_causal=True
        )

    cf = torch.compile(f, fullgraph=True, dynamic=True)
    lengths = [([5, 9], [6, 12]), ([3, 11, 2], [3, 20, 7]), ([17, 4], [30, 4])]
    if DEVICE == "cuda":  # past one tile of the GPU's configs too
        lengths.append(([130, 1, 300], [200, 1, 300]))
    with torch._dynamo.config.patch(error_on_recompile=True):
        for lens_q, lens_k in lengths:
            p = Packed(lens_q, lens_k, tail=0)
            leaves = [t.detach().requires_grad_() for t in (p.q, p.k, p.v)]
            bias = torch.randn(p.hkv, p.tk, device=DEVICE, requires_grad=True)
            mask = p.operand("G")
            out = cf(*leaves, *p.args(), mask, bias)
            out.sum().backward()
            ref = reference.attention_varlen(*leaves, *p.args(), mask, bias, is_causal=True)
            torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
            assert bias.grad.shape == bias.shape
    if DEVICE == "cuda":
        assert calls == []
    else:  # CPU graphs keep the op whole: its launchers run at each call
        assert calls.count("forward") == len(lengths)


def test_torch_func_grad():
    q, k, v, cu_q, cu_k, max_q, max_k, mask, bias = varlen_sample(requires_grad=False)

    def loss(q, bias):
        out = dmattn_ops.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, mask, bias)
        return out.square().sum()

    def loss_ref(q, bias):
        out = reference.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, mask, bias)
        return out.square().sum()

    got = torch.func.grad(loss, argnums=(0, 1))(q, bias)
    want = torch.func.grad(loss_ref, argnums=(0, 1))(q, bias)
    _, lse = reference.attention_varlen(
        q, k, v, cu_q, cu_k, max_q, max_k, mask, bias, return_lse=True
    )
    for name, a, b in zip(("dq", "dbias"), got, want):
        assert_close(a, b, float64_grad_bound(b, lse), name)


# Flex.


def test_flex_forward_matches_the_oracle():
    p = Packed([6, 0, 19, 1], [9, 4, 19, 1], tail=2, device="cpu")
    mask = torch.rand(p.hkv, p.tk) < 0.7
    bias = torch.randn(1, p.tk)
    kwargs = dict(is_causal=True, softcap=4.0, return_lse=True)
    out, lse = dmattn_ops.attention_varlen(
        p.q, p.k, p.v, *p.args(), mask, bias, backend="flex", **kwargs
    )
    ref, ref_lse = reference.attention_varlen(
        *(t.double() for t in (p.q, p.k, p.v)), *p.args(), mask, bias.double(), **kwargs
    )
    assert_close(out, ref, 1e-5, "out")
    assert_close(lse, ref_lse, 1e-5, "lse")


# Validation.


def message(exc_type, *args, **kwargs) -> str:
    with pytest.raises(exc_type) as info:
        dmattn_ops.attention_varlen(*args, **kwargs)
    return str(info.value)


class TestVarlenErrors(expecttest.TestCase):
    def setUp(self):
        self.q, self.k = torch.randn(10, 4, 8), torch.randn(12, 2, 8)

    def check(self, exc_type, expected, *args, **kwargs):
        self.assertExpectedInline(
            message(exc_type, self.q, self.k, self.k, *args, **kwargs), expected, skip=1
        )

    def test_cu_seqlens_values(self):
        good = torch.tensor([0, 4, 10], dtype=torch.int32)
        good_k = torch.tensor([0, 5, 12], dtype=torch.int32)
        self.check(
            ValueError,
            """dmattn::attention_varlen: cu_seqlens_q must start at 0; got 1""",
            torch.tensor([1, 4, 10], dtype=torch.int32), good_k, 6, 7,
        )  # fmt: skip
        self.check(
            ValueError,
            """dmattn::attention_varlen: cu_seqlens_k must be monotone (non-decreasing); it falls by 2 from index 1 to 2""",
            good, torch.tensor([0, 7, 5], dtype=torch.int32), 6, 7,
        )  # fmt: skip
        self.check(
            ValueError,
            """dmattn::attention_varlen: cu_seqlens_q[-1] = 11 exceeds the packed query length 10""",
            torch.tensor([0, 4, 11], dtype=torch.int32), good_k, 7, 7,
        )  # fmt: skip
        self.check(
            ValueError,
            """dmattn::attention_varlen: a sequence in cu_seqlens_k has length 7, more than max_seqlen_k=6""",
            good, good_k, 6, 6,
        )  # fmt: skip

    def test_cu_seqlens_tensors(self):
        good = torch.tensor([0, 4, 10], dtype=torch.int32)
        self.check(
            TypeError,
            """dmattn.attention_varlen: cu_seqlens_q must be int32; got torch.int64""",
            good.long(), good, 6, 6,
        )  # fmt: skip
        self.check(
            ValueError,
            """dmattn.attention_varlen: cu_seqlens_q and cu_seqlens_k must both have B + 1 entries; got (3,) and (2,)""",
            good, good[:2], 6, 6,
        )  # fmt: skip
        self.check(
            TypeError,
            """dmattn.attention_varlen: max_seqlen_q must be an int; got float""",
            good, good, 6.0, 6,
        )  # fmt: skip

    def test_shapes(self):
        good = torch.tensor([0, 4, 10], dtype=torch.int32)
        self.assertExpectedInline(
            message(ValueError, self.q[None], self.k, self.k, good, good, 6, 6),
            """dmattn.attention_varlen: query must be 3-D (total_q, H, D); got shape (1, 10, 4, 8)""",
        )
        self.check(
            ValueError,
            """dmattn.attention_varlen: mask must be per key token, (H|Hkv|1, total_k) with H=4, Hkv=2, total_k=12; got shape (3, 12)""",
            good, good, 6, 6, torch.ones(3, 12, dtype=torch.bool),
        )  # fmt: skip
        self.check(
            TypeError,
            """dmattn.attention_varlen: bias dtype must be query's (torch.float32) or torch.float32; got torch.float16""",
            good, good, 6, 6, None, torch.zeros(1, 12, dtype=torch.float16),
        )  # fmt: skip
