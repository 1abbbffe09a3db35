"""Inputs an adversarial probe found silently wrong (issue 19), each against the float64 oracle.

The Triton cases run compiled on a GPU and in Triton's interpreter on CPU; the CPU cases run the
chunked PyTorch path.
"""

import math

import pytest
import torch
from helpers import COMPUTE_ULPS, DEVICE, assert_close, float64_grad_bound, low_precision_bound

import dmattn_ops
from dmattn_ops import masks, reference
from dmattn_ops.dispatch import launch, plan

needs_triton = pytest.mark.skipif(
    DEVICE == "cpu" and not launch.interpreter_on(), reason="needs CUDA or TRITON_INTERPRET=1"
)


def _randn(*shape, dtype=torch.float32, device=DEVICE):
    return torch.randn(*shape, dtype=dtype, device=device)


def _grads(fn, tensors, grad_out=None):
    """fn(*tensors) and the gradients of <fn(...), grad_out> w.r.t. the tensors."""
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    out = fn(*leaves)
    grad_out = torch.ones_like(out) if grad_out is None else grad_out.to(out.dtype)
    return out, torch.autograd.grad((out * grad_out).sum(), leaves)


@needs_triton
def test_non_contiguous_seqused_k():
    q, k, v = _randn(2, 9, 2, 16), _randn(2, 9, 2, 16), _randn(2, 9, 2, 16)
    seqused = torch.tensor([5, 9, 3, 1], dtype=torch.int32, device=DEVICE)[::2]  # [5, 3]
    assert not seqused.is_contiguous()
    go = _randn(2, 9, 2, 16)
    fn = lambda q, k, v: dmattn_ops.attention(q, k, v, seqused_k=seqused, backend="triton")
    out, grads = _grads(fn, (q, k, v), go)
    ref = lambda q, k, v: reference.attention(q, k, v, seqused_k=seqused.contiguous())
    ref_out, ref_grads = _grads(ref, [t.double() for t in (q, k, v)], go.double())
    low_out, low_grads = _grads(ref, (q, k, v), go)
    assert_close(out, ref_out, low_precision_bound(ref_out, low_out, q.dtype), "out")
    for name, g, r, lo in zip(("dq", "dk", "dv"), grads, ref_grads, low_grads):
        assert_close(g, r, low_precision_bound(r, lo, q.dtype), name)


@needs_triton
def test_non_contiguous_cu_seqlens():
    cu = torch.tensor([0, 99, 5, 99, 12, 99], dtype=torch.int32, device=DEVICE)[::2]  # [0, 5, 12]
    assert not cu.is_contiguous()
    q, k, v = _randn(12, 2, 16), _randn(12, 2, 16), _randn(12, 2, 16)
    out = dmattn_ops.attention_varlen(q, k, v, cu, cu, 7, 7, is_causal=True, backend="triton")
    want = reference.attention_varlen(
        *(t.double() for t in (q, k, v)), cu.contiguous(), cu.contiguous(), 7, 7, is_causal=True
    )
    low = reference.attention_varlen(
        q, k, v, cu.contiguous(), cu.contiguous(), 7, 7, is_causal=True
    )
    assert_close(out, want, low_precision_bound(want, low, q.dtype), "out")


@needs_triton
def test_vmap_folds_stride_zero_operands():
    """vmap over query with B = 1 and an unbatched seqused_k folds them into batch-stride-0
    views; the kernels must not read past their storage (forward, and vmap(vjp) = jacrev)."""
    q = _randn(3, 1, 9, 2, 16)
    k, v = _randn(1, 9, 2, 16), _randn(1, 9, 2, 16)
    seqused = torch.tensor([6], dtype=torch.int32, device=DEVICE)
    fn = lambda x: dmattn_ops.attention(x, k, v, seqused_k=seqused, backend="triton")
    batched = torch.func.vmap(fn)(q)
    one_by_one = torch.stack([fn(x) for x in q])
    assert_close(batched, one_by_one, 0.0, "vmap out")

    bias = _randn(1, 2, 5, 9)
    q1 = _randn(1, 5, 2, 16)
    rows = lambda f: lambda b: f(b).sum(dim=(0, 1, 3))  # (H,) per bias: a 2-row Jacobian
    jac = torch.func.jacrev(
        rows(lambda b: dmattn_ops.attention(q1, k, v, None, b, backend="triton"))
    )(bias)
    up = [t.double() for t in (q1, k, v)]
    jac64 = torch.func.jacrev(rows(lambda b: reference.attention(*up, None, b)))(bias.double())
    jac_low = torch.func.jacrev(rows(lambda b: reference.attention(q1, k, v, None, b)))(bias)
    assert_close(jac, jac64, low_precision_bound(jac64, jac_low, torch.float32), "jacrev dbias")


@pytest.mark.parametrize("backend", ["auto", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_double_backward_through_torch_func_raises(backend, varlen):
    dtype = torch.float64 if backend == "auto" else torch.float32
    q, k, v = (_randn(1, 5, 1, 4, dtype=dtype) for _ in range(3))
    bias = _randn(1, 1, 5, 5, dtype=dtype)
    w = torch.linspace(-1, 2, 5, dtype=dtype, device=DEVICE)
    if varlen:
        cu = torch.tensor([0, 5], dtype=torch.int32, device=DEVICE)
        bias = bias[0, :, 0]  # (1, total_k): per key token
        attn = lambda b: dmattn_ops.attention_varlen(
            q[0], k[0], v[0], cu, cu, 5, 5, None, b, backend=backend
        )
    else:
        attn = lambda b: dmattn_ops.attention(q, k, v, None, b, backend=backend)
    inner = torch.func.grad(lambda b: attn(b).square().sum())
    with pytest.raises(RuntimeError, match="double backward"):
        torch.func.grad(lambda b: (inner(b) * w).sum())(bias)
    # One level of grad still works, and equals the oracle's.
    assert torch.isfinite(inner(bias)).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("path", ["fused", "torch"])
def test_topk_mask_ranks_nan_below_every_number(dtype, path):
    if path == "fused" and (dtype == torch.float64 or not plan.triton_runs_on(_randn(1))):
        pytest.skip("the fused kernel runs for 16/32-bit biases where Triton runs")
    nan, lowest = math.nan, torch.finfo(dtype).min
    for other in (lowest, -math.inf, 0.0, -1.0):
        row = torch.tensor([nan, other], dtype=dtype, device=DEVICE).view(1, 1, 1, 2)
        got = masks.topk_mask(row, 1) if path == "fused" else masks._torch_topk(row, None, 1)
        assert got.flatten().tolist() == [False, True], (other, got)
    # Numbers by value, -inf the lowest of them, then NaN, and a disallowed key never.
    row = torch.tensor([nan, -math.inf, lowest, 9.0, 3.0], dtype=dtype, device=DEVICE)
    allowed = torch.tensor([True, True, True, False, True], device=DEVICE).view(1, 1, 1, 5)
    want = {1: [0, 0, 0, 0, 1], 2: [0, 0, 1, 0, 1], 3: [0, 1, 1, 0, 1], 4: [1, 1, 1, 0, 1]}
    for k, expected in want.items():
        if path == "fused":
            got = masks.topk_mask(row.view(1, 1, 1, 5), k, allowed)
        else:
            got = masks._torch_topk(row.view(1, 1, 1, 5), allowed, k)
        assert got.flatten().int().tolist() == expected, (k, got)


def test_float64_row_of_lowest_biases_keeps_its_gradients():
    """A float64 row whose every bias is finfo(float64).min: lse ~ -1.8e308 is outside float32;
    the ops keep lse in float64 internally, so backward does not mistake the row for empty."""
    q, k, v = (_randn(1, n, 1, 4, dtype=torch.float64, device="cpu") for n in (3, 5, 5))
    bias = _randn(1, 1, 3, 5, dtype=torch.float64, device="cpu")
    bias[:, :, 1, :] = torch.finfo(torch.float64).min
    go = _randn(1, 3, 1, 4, dtype=torch.float64, device="cpu")
    out, grads = _grads(lambda *t: dmattn_ops.attention(*t[:3], None, t[3]), (q, k, v, bias), go)
    ref_out, ref_grads = _grads(
        lambda *t: reference.attention(*t[:3], None, t[3]), (q, k, v, bias), go
    )
    _, ref_lse = reference.attention(q, k, v, None, bias, return_lse=True)
    assert_close(out, ref_out, 1e-12, "out")
    for name, g, r in zip(("dq", "dk", "dv", "dbias"), grads, ref_grads):
        assert_close(g, r, float64_grad_bound(r, ref_lse.double()), name)
    assert ref_grads[0][:, 1].abs().max() > 0.01  # the row's gradients are not trivially 0


@pytest.mark.parametrize(
    "backend,dtype",
    [
        ("auto", torch.float64),
        ("auto", torch.float32),
        pytest.param("triton", torch.float32, marks=needs_triton),
    ],
)
@pytest.mark.parametrize("scale", [1e3, 1e6, 1e10, 1e12])
def test_large_logits(backend, dtype, scale):
    """Logits of scale * q.k: backward recomputes P from (lse, lse_rem) exactly, so it stays
    finite, and within the error PyTorch itself makes in that precision."""
    dev = "cpu" if backend == "auto" else DEVICE
    q, k, v = (_randn(1, 8, 2, 8, dtype=dtype, device=dev) for _ in range(3))
    go = _randn(1, 8, 2, 8, dtype=dtype, device=dev)
    fn = lambda q, k, v: dmattn_ops.attention(q, k, v, scale=scale, backend=backend)
    ref = lambda q, k, v: reference.attention(q, k, v, scale=scale)
    out, grads = _grads(fn, (q, k, v), go)
    ref_out, ref_grads = _grads(ref, [t.double() for t in (q, k, v)], go.double())
    low_out, low_grads = _grads(ref, (q, k, v), go)
    for name, g in zip(("dq", "dk", "dv"), grads):
        assert torch.isfinite(g).all(), name
    if dtype == torch.float64:
        _, lse = reference.attention(q, k, v, scale=scale, return_lse=True)
        for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
            assert_close(g, r, float64_grad_bound(r, lse.double()), name)
        return
    assert_close(out, ref_out, low_precision_bound(ref_out, low_out, dtype), "out")
    for name, g, r, lo in zip(("dq", "dk", "dv"), grads, ref_grads, low_grads):
        assert_close(g, r, low_precision_bound(r, lo, dtype), name)


@needs_triton
@pytest.mark.parametrize("scale", [1e4, 1e6, 1e8, 1e30])
@pytest.mark.parametrize("operands", [False, True], ids=["plain", "mask-bias"])
def test_large_logits_on_tiles_of_every_shape(scale, operands):
    """The forward, dq and dk/dv kernels compute the scores on tiles of different shapes and
    orientations (K Q^T in dk/dv), and backward's P = exp(s - lse) needs the forward's s to the
    bit: under the interpreter, numpy's matmul rounded them differently (issue 48: dv off by
    0.75 of 4.8 at scale 1e6 with B1 L16 D4)."""
    q_shape, kv_shape = ((2, 24, 4), (2, 24, 2)) if operands else ((1, 16, 1), (1, 16, 1))
    d = 16 if operands else 4
    torch.manual_seed(0)
    q, k, v = _randn(*q_shape, d), _randn(*kv_shape, d), _randn(*kv_shape, d)
    mask = bias = None
    if operands:
        mask = torch.rand(2, 2, 24, 24, device=DEVICE) < 0.7
        bias = _randn(2, 4, 1, 24)
    go = _randn(*q.shape)
    kw = dict(scale=scale, is_causal=operands)
    fn = lambda *t: dmattn_ops.attention(*t[:3], mask, *t[3:], backend="triton", **kw)
    ref = lambda *t: reference.attention(*t[:3], mask, *t[3:], **kw)
    tensors = (q, k, v) + ((bias,) if operands else ())
    out, grads = _grads(fn, tensors, go)
    ref_out, ref_grads = _grads(ref, [t.double() for t in tensors], go.double())
    low_out, low_grads = _grads(ref, tensors, go)
    assert_close(out, ref_out, low_precision_bound(ref_out, low_out, torch.float32), "out")
    for name, g, r, lo in zip(("dq", "dk", "dv", "dbias"), grads, ref_grads, low_grads):
        bound = low_precision_bound(r, lo, torch.float32)
        if name in ("dq", "dk"):
            # dS = P * (dP - delta), delta = rowsum(dO * O): where P is one-hot, dP and delta
            # are the same number summed in two orders and dq, dk are scale times their
            # rounding difference (PyTorch's softmax backward makes the same kind of error,
            # about half as large here, so the 2x term alone sits at the edge). The rounding of
            # the formulation: a few fp32 ulps of scale * |dO| |V| |K or Q|.
            other = q if name == "dk" else k
            terms = (go.abs() * out.abs()).sum(-1).max() * other.abs().max()
            bound += COMPUTE_ULPS * torch.finfo(torch.float32).eps * scale * terms.item()
        assert_close(g, r, bound, name)


@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_autocast_casts_inputs_like_sdpa(backend):
    """Under CPU autocast (bf16): q from a bf16 matmul with fp32 k/v is accepted, every input
    is cast once, the result is bf16 and carries bf16 input rounding only."""
    q, k, v = (_randn(1, 16, 2, 16, device="cpu") for _ in range(3))
    w = torch.eye(16)
    bias = _randn(1, 2, 1, 16, device="cpu")  # float32 bias: kept as it is
    with torch.autocast("cpu", torch.bfloat16):
        qb = q @ w  # bfloat16 under autocast
        assert qb.dtype == torch.bfloat16
        out = dmattn_ops.attention(qb, k, v, None, bias, backend=backend)
        out_op = torch.ops.dmattn.attention(q, k, v, None, bias)
    assert out.dtype == out_op.dtype == torch.bfloat16
    up = [t.bfloat16().double() for t in (q, k, v)]
    want = reference.attention(*up, None, bias.double())
    low = reference.attention(*(t.bfloat16() for t in (q, k, v)), None, bias)
    assert_close(out_op, want, low_precision_bound(want, low, torch.bfloat16), "op")
    assert_close(out, want, low_precision_bound(want, low, torch.bfloat16), "out")


@pytest.mark.parametrize("backend", ["auto", "reference", "flex"])
def test_degenerate_shapes_and_flags(backend):
    k, v = _randn(1, 4, 1, 0, device="cpu"), _randn(1, 4, 1, 3, device="cpu")
    # D = 0: every q . k is 0, a uniform average of V (the default scale cannot be 1/sqrt(0)).
    out = dmattn_ops.attention(_randn(1, 4, 2, 0, device="cpu"), k, v, backend=backend)
    assert_close(out, v.mean(dim=1, keepdim=True).expand(1, 4, 2, 3), 1e-6, "D=0")
    # H = Hkv = 0: an empty result.
    q0, k0 = _randn(1, 4, 0, 8, device="cpu"), _randn(1, 4, 0, 8, device="cpu")
    assert dmattn_ops.attention(q0, k0, k0, backend=backend).shape == (1, 4, 0, 8)
    q, k = _randn(1, 4, 2, 8, device="cpu"), _randn(1, 4, 1, 8, device="cpu")
    for flag in ("is_causal", "deterministic", "return_lse"):
        with pytest.raises(TypeError, match=f"{flag} must be a bool"):
            dmattn_ops.attention(q, k, k, backend=backend, **{flag: "yes"})


def test_op_checks_seqused_k_values_like_the_api():
    q, k = _randn(1, 4, 2, 8, device="cpu"), _randn(1, 4, 1, 8, device="cpu")
    for bad in (-5, 99):
        seqused = torch.tensor([bad], dtype=torch.int32)
        with pytest.raises(ValueError, match="seqused_k values must lie in"):
            torch.ops.dmattn.attention(q, k, k, seqused_k=seqused)


@pytest.mark.parametrize(
    "backend", ["auto", "reference", pytest.param("triton", marks=needs_triton)]
)
def test_vmap_over_seqused_k_alone(backend):
    dev = "cpu" if backend != "triton" else DEVICE
    q, k, v = (
        _randn(1, 6, 2, 8, device=dev),
        _randn(1, 6, 1, 8, device=dev),
        _randn(1, 6, 1, 8, device=dev),
    )
    seqused = torch.tensor([[2], [4], [6]], dtype=torch.int32, device=dev)
    fn = lambda s: dmattn_ops.attention(q, k, v, seqused_k=s, is_causal=True, backend=backend)
    assert_close(torch.func.vmap(fn)(seqused), torch.stack([fn(s) for s in seqused]), 0.0, "vmap")


def test_the_environment_reads_as_os_environ_does(monkeypatch):
    """switches.getenv reads os.environ's own dict: every write through os.environ (set,
    change, delete), non-ASCII values, and a replaced os.environ read as os.environ.get does."""
    import os

    from dmattn_ops.core.switches import getenv

    name = "DMATTN_TEST_GETENV"
    monkeypatch.delenv(name, raising=False)
    assert getenv(name) is None
    for value in ("1", "", " off ", "vä lue"):
        monkeypatch.setenv(name, value)
        assert getenv(name) == os.environ.get(name) == value
    monkeypatch.delenv(name)
    assert getenv(name) is None
    monkeypatch.setattr(os, "environ", {name: "replaced"})
    assert getenv(name) == "replaced"


def test_a_compiled_switch_recompiles_only_when_its_value_changes(monkeypatch):
    """A graph that read a switch is guarded on that variable's value alone: reading other
    variables eagerly (the tables behind getenv grow) or setting them leaves it compiled;
    changing the switch's value compiles a second graph that follows it, and the first still
    serves the old value; a switch unset when traced and set later is guarded too."""
    from dmattn_ops.core.switches import getenv, switch

    name = "DMATTN_TEST_COMPILED_SWITCH"
    monkeypatch.delenv(name, raising=False)
    torch._dynamo.reset()
    unset = torch.compile(lambda x: x * 2 if switch(name, False) else x + 1, fullgraph=True,
                          backend="eager")  # fmt: skip
    assert (unset(torch.ones(3)) == 2).all()
    monkeypatch.setenv(name, "1")
    assert (unset(torch.ones(3) * 3) == 6).all()
    monkeypatch.setenv(name, "0")

    def f(x):
        return x * 2 if switch(name, False) else x + 1

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="eager")
    x = torch.ones(3)
    graphs = torch._dynamo.utils.counters["stats"]
    assert (compiled(x) == 2).all()
    before = graphs["unique_graphs"]
    for i in range(3):
        monkeypatch.setenv(f"DMATTN_TEST_OTHER_{i}", f"value {i}")
        assert getenv(f"DMATTN_TEST_OTHER_{i}") == f"value {i}"
        assert (compiled(x) == 2).all()
    assert graphs["unique_graphs"] == before
    monkeypatch.setenv(name, "1")
    assert (compiled(x) == 2 * x).all()
    monkeypatch.setenv(name, "0")
    assert (compiled(x) == 2).all()
    assert graphs["unique_graphs"] == before + 1


def test_unclear_inputs_of_issue_48_get_clear_answers(monkeypatch):
    from dmattn_ops.core.switches import switch

    q = torch.randn(1, 8, 2, 16)
    causal = dmattn_ops.attention(q, q, q, is_causal=True)
    for backend in ("auto", "reference", "flex"):
        # A window wider than any sequence bounds nothing (it was a schema or Overflow error).
        out = dmattn_ops.attention(q, q, q, window_size=(2**64, 0), backend=backend)
        torch.testing.assert_close(out, causal, rtol=0, atol=1e-6)
    # flash-attn code passes window_size=None for "no window".
    full = dmattn_ops.attention(q, q, q)
    torch.testing.assert_close(dmattn_ops.flash_attn_func(q, q, q, window_size=None), full)
    with pytest.raises(TypeError, match="window_size must be a pair"):
        dmattn_ops.flash_attn_func(q, q, q, window_size=5)
    # Switches: every spelling of off is off; a typo raises instead of leaving a path on.
    for off in ("0", "false", "OFF", " no "):
        monkeypatch.setenv("DMATTN_TEST_SWITCH", off)
        assert switch("DMATTN_TEST_SWITCH", True) is False
    for on in ("1", "True", "on", "yes"):
        monkeypatch.setenv("DMATTN_TEST_SWITCH", on)
        assert switch("DMATTN_TEST_SWITCH", False) is True
    monkeypatch.setenv("DMATTN_TEST_SWITCH", "")
    assert switch("DMATTN_TEST_SWITCH", True) is True
    monkeypatch.setenv("DMATTN_TEST_SWITCH", "of")
    with pytest.raises(ValueError, match="DMATTN_TEST_SWITCH='of'"):
        switch("DMATTN_TEST_SWITCH", True)
    from dmattn_ops.registration import inductor

    monkeypatch.setenv("DMATTN_INDUCTOR_KERNELS", "false")
    assert not inductor.enabled()


UNSEEN_BACKENDS = ["auto", "reference", "flex"] + (
    ["triton"] if DEVICE == "cuda" or launch.interpreter_on() else []
)


@pytest.mark.parametrize("backend", UNSEEN_BACKENDS)
@pytest.mark.parametrize(
    "mask_shape,lq", [((2, 4, 40, 40), 40), ((2, 2, 1, 40), 40), ((1, 1, 40, 40), 40),
                      ((2, 2, 1, 40), 1), ((2, 4, 1, 40), 3)],
    ids=["BHQ", "BGq", "bhQ", "decode", "Lq3"],
)  # fmt: skip
def test_nan_at_keys_no_query_may_see_never_reaches_a_result(backend, mask_shape, lq):
    """Unused cache slots marked by the mask, holding NaN/Inf: every backend exact (issue 48:
    the default path, flex, reference and Triton with a 4-D mask returned NaN)."""
    torch.manual_seed(0)
    q, k, v = _randn(2, lq, 4, 16), _randn(2, 40, 2, 16), _randn(2, 40, 2, 16)
    mask = torch.rand(mask_shape, device=DEVICE) < 0.7
    mask[..., 0] = True
    mask[..., [5, 17, 33]] = False
    clean_k, clean_v = k.clone(), v.clone()
    k[:, 5], v[:, 17], k[:, 33], v[:, 33] = float("nan"), float("nan"), float("inf"), -float("inf")
    clean_k[:, [5, 33]], clean_v[:, [17, 33]] = 0.0, 0.0
    kw = dict(is_causal=lq > 1)
    train = backend != "flex" or DEVICE == "cuda"
    tensors = [t.clone().requires_grad_(train) for t in (q, k, v)]
    out = dmattn_ops.attention(*tensors, mask, backend=backend, **kw)
    ref = reference.attention(q.double(), clean_k.double(), clean_v.double(), mask, **kw)
    low = reference.attention(q, clean_k, clean_v, mask, **kw)
    assert_close(out, ref, low_precision_bound(ref, low, torch.float32), "out")
    if train:
        grads = torch.autograd.grad(out.sum(), tensors)
        for name, g in zip(("dq", "dk", "dv"), grads):
            assert torch.isfinite(g).all(), name
            if name != "dq":
                assert (g[:, [5, 17, 33]] == 0).all(), name


@pytest.mark.parametrize("backend", UNSEEN_BACKENDS)
def test_varlen_nan_at_keys_no_query_may_see(backend):
    torch.manual_seed(0)
    cu = torch.tensor([0, 17, 40], dtype=torch.int32, device=DEVICE)
    q, k, v = _randn(40, 4, 16), _randn(40, 2, 16), _randn(40, 2, 16)
    mask = torch.rand(2, 40, device=DEVICE) < 0.7
    mask[:, [0, 17]] = True
    mask[:, [5, 30]] = False
    clean_k, clean_v = k.clone(), v.clone()
    k[5], v[30] = float("nan"), float("nan")
    clean_k[5], clean_v[30] = 0.0, 0.0
    out = dmattn_ops.attention_varlen(q, k, v, cu, cu, 23, 23, mask, is_causal=True,
                                      backend=backend)  # fmt: skip
    ref = dmattn_ops.attention_varlen(q.double(), clean_k.double(), clean_v.double(), cu, cu, 23,
                                      23, mask, is_causal=True, backend="reference")  # fmt: skip
    assert_close(out, ref, 1e-5, "varlen out")
