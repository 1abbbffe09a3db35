"""Dense calls through PyTorch's fused kernels, cuDNN or flash (dmattn_ops/executors/sdpa.py): when each
applies, that both match the float64 oracle, and that the calls they cannot serve stay on our
kernels.

The rest of the suite runs with DMATTN_DENSE_SDPA=0 (conftest.py) so that it tests our Triton
dense kernels; these tests turn the dispatch back on."""

import pytest
import torch
from helpers import Case, assert_close, low_precision_bound, param

import dmattn_ops
from dmattn_ops import reference
from dmattn_ops.core.band import Band
from dmattn_ops.core.problem import Options, Problem
from dmattn_ops.executors import chunked, cudnn_graphs, sdpa

gpu = pytest.mark.gpu


@pytest.fixture
def dispatch_on(monkeypatch):
    """DMATTN_DENSE_SDPA=1, and the fused forward and backward calls, each by the kernel it ran
    ("cudnn" or "flash", its last argument). Windows stay off cuDNN's graphs (their tests are
    below), so that these tests check the chunked calls wherever the frontend is installed."""
    monkeypatch.setenv("DMATTN_DENSE_SDPA", "1")
    monkeypatch.setenv("DMATTN_CUDNN_GRAPHS", "0")
    calls = {"forward": [], "backward": []}
    for name in calls:
        real = getattr(sdpa, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            calls[_name].append(args[-1])  # the kernel ("cudnn", "flash"); the chunk is a keyword
            return _real(*args, **kwargs)

        monkeypatch.setattr(sdpa, name, spy)
    return calls


def _operands(device="cpu", dtype=torch.bfloat16, lq=8, lk=8, d=16, dv=16, h=2, hkv=1):
    q = torch.zeros(1, lq, h, d, dtype=dtype, device=device)
    k = torch.zeros(1, lk, hkv, d, dtype=dtype, device=device)
    v = torch.zeros(1, lk, hkv, dv, dtype=dtype, device=device)
    return q, k, v


def _fused(q, k, v, mask=None, bias=None, *, is_causal=False, softcap=0.0, seqused_k=None,
           enabled=True):  # fmt: skip
    problem = Problem(q, k, v, mask, bias, seqused_k=seqused_k)
    return sdpa.kernel(problem, Options(0.25, is_causal, softcap), enabled)


def test_applies_only_to_plain_dense_cuda_calls(monkeypatch):
    monkeypatch.setenv("DMATTN_DENSE_SDPA", "1")
    q, k, v = _operands("meta")
    assert not _fused(q, k, v)  # not CUDA


@gpu
def test_applies_rules(monkeypatch):
    monkeypatch.setenv("DMATTN_DENSE_SDPA", "1")
    q, k, v = _operands("cuda")
    mask = torch.ones(1, 1, 1, 8, dtype=torch.bool, device="cuda")
    assert _fused(q, k, v, is_causal=True)
    assert not _fused(q, k, v, mask)
    assert not _fused(q, k, v, bias=mask.bfloat16())
    assert not _fused(q, k, v, softcap=5.0)
    seqused = torch.full((1,), 8, dtype=torch.int32, device="cuda")
    assert not _fused(q, k, v, seqused_k=seqused)
    assert not _fused(*_operands("cuda", torch.float32))
    assert not _fused(*_operands("cuda", lq=4), is_causal=True)  # Lq != Lk
    assert _fused(*_operands("cuda", lq=4))
    assert not _fused(*_operands("cuda", d=20, dv=20))
    assert not _fused(*_operands("cuda", dv=32))
    # Switched off (kernel option fused_sdpa, which DMATTN_DENSE_SDPA=0 sets: test_plan.py).
    assert _fused(q, k, v, is_causal=True, enabled=False) is None
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.MATH, SDPBackend.EFFICIENT_ATTENTION]):
        assert not _fused(q, k, v, is_causal=True)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        assert _fused(q, k, v, is_causal=True) == "flash"
    d256 = _operands("cuda", d=256, dv=256)
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):  # cuDNN only up to D128 here
        assert _fused(*d256, is_causal=True) is None


@gpu
def test_the_model_shape_takes_the_kernel_sdpa_picks(monkeypatch):
    """H16 Hkv4 D128 bf16 causal (bench.model's shape): our choice is SDPA's own."""
    from torch.nn.attention import SDPBackend

    monkeypatch.setenv("DMATTN_DENSE_SDPA", "1")
    q = torch.zeros(2, 256, 16, 128, dtype=torch.bfloat16, device="cuda")
    k = torch.zeros(2, 256, 4, 128, dtype=torch.bfloat16, device="cuda")
    picked = torch._fused_sdp_choice(
        q.transpose(1, 2), k.transpose(1, 2), k.transpose(1, 2), None, 0.0, True, enable_gqa=True
    )
    want = {int(SDPBackend.CUDNN_ATTENTION): "cudnn", int(SDPBackend.FLASH_ATTENTION): "flash"}
    assert _fused(q, k, k, is_causal=True) == want.get(picked, "flash")


def _sinks(h: int, device="cuda") -> torch.Tensor:
    """float32 sinks (H,) of every kind: ordinary, large (a row's mass mostly in its sink), none
    (-inf), negative."""
    kinds = torch.tensor([0.5, 6.0, float("-inf"), -2.0])
    return kinds.repeat(h // 4 + 1)[:h].to(device)


def _check(
    c: Case, dtype, is_causal, *, lse_grad=False, deterministic=False, fn=None, lse=True,
    window=None, sinks=False,
):  # fmt: skip
    """Runs fn (dmattn_ops.attention, backend auto) and the oracle; checks out, lse, grads.
    window: window_size for both; sinks: both take _sinks(H), and dsinks is checked too."""
    q = torch.randn(c.b, c.lq, c.h, c.d, dtype=dtype, device="cuda")
    k = torch.randn(c.b, c.lk, c.hkv, c.d, dtype=dtype, device="cuda")
    v = torch.randn(c.b, c.lk, c.hkv, c.dv, dtype=dtype, device="cuda")
    g_out = torch.randn(c.b, c.lq, c.h, c.dv, dtype=dtype, device="cuda")
    g_lse = torch.randn(c.b, c.h, c.lq, device="cuda")
    s = _sinks(c.h) if sinks else None

    def run(fn, cast, **kw):
        leaves = [t.detach().to(cast).requires_grad_() for t in (q, k, v)]
        if sinks:
            leaves.append(s.to(torch.float64 if cast == torch.float64 else torch.float32))
            kw["sinks"] = leaves[-1].requires_grad_()
        if window is not None:
            kw["window_size"] = window
        out, lse = fn(*leaves[:3], is_causal=is_causal, return_lse=True, **kw)
        loss = (out * g_out.to(out.dtype)).sum()
        if lse_grad:
            loss = loss + (lse * g_lse.to(lse.dtype)).sum()
        return out, lse, torch.autograd.grad(loss, leaves)

    got = run(fn or dmattn_ops.attention, dtype, deterministic=deterministic)
    ref64 = run(reference.attention, torch.float64)
    ref_lp = run(reference.attention, dtype)
    assert_close(got[0], ref64[0], low_precision_bound(ref64[0], ref_lp[0], dtype), "out")
    if lse:
        finite = ref64[1].isfinite()
        lse_bound = 2 * (ref_lp[1] - ref64[1])[finite].abs().max().item() + 1e-5
        assert_close(got[1], ref64[1], lse_bound, "lse")
    for name, g, r, rl in zip(("dq", "dk", "dv", "dsinks"), got[2], ref64[2], ref_lp[2]):
        assert g.dtype == (torch.float32 if name == "dsinks" else dtype) and g.shape == r.shape
        assert_close(g, r, low_precision_bound(r, rl, dtype), name)


CASES = [
    param(Case(2, 256, 256, 8, 8, 64, 64)),
    param(Case(2, 300, 300, 16, 4, 128, 128)),  # GQA, a partial tile
    param(Case(1, 128, 512, 4, 1, 96, 96)),  # MQA, Lq != Lk (non-causal only)
    param(Case(1, 64, 64, 2, 2, 256, 256)),
]


@gpu
@pytest.mark.parametrize("which", ["cudnn", "flash"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("c", CASES)
def test_dense_calls_run_fused_kernels_and_match_the_oracle(
    dispatch_on, c, dtype, is_causal, which
):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if is_causal and c.lq != c.lk:
        pytest.skip("bottom-right causal with Lq != Lk stays on our kernels")
    only = SDPBackend.CUDNN_ATTENTION if which == "cudnn" else SDPBackend.FLASH_ATTENTION
    with sdpa_kernel([only]):
        operands = _operands("cuda", dtype, c.lq, c.lk, c.d, c.dv, c.h, c.hkv)
        if _fused(*operands, is_causal=is_causal) is None:
            pytest.skip(f"PyTorch's {which} kernel does not take this call here")
        _check(c, dtype, is_causal)
    assert dispatch_on == {"forward": [which], "backward": [which]}


@gpu
@pytest.mark.parametrize("which", ["cudnn", "flash"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("c", [CASES[0], CASES[1]])
def test_dense_calls_with_sinks_run_fused_kernels(dispatch_on, c, is_causal, which):
    """Sinks joined to the fused forward's (out, lse); the fused backward from those gives the
    sinks' softmax gradients, and dsinks comes from the row statistics: the oracle's values."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    only = SDPBackend.CUDNN_ATTENTION if which == "cudnn" else SDPBackend.FLASH_ATTENTION
    with sdpa_kernel([only]):
        operands = _operands("cuda", torch.bfloat16, c.lq, c.lk, c.d, c.dv, c.h, c.hkv)
        if _fused(*operands, is_causal=is_causal) is None:
            pytest.skip(f"PyTorch's {which} kernel does not take this call here")
        _check(c, torch.bfloat16, is_causal, sinks=True)
    assert dispatch_on == {"forward": [which], "backward": [which]}


@gpu
@pytest.mark.parametrize("sinks", [False, True], ids=["plain", "sinks"])
def test_lse_gradient_and_deterministic_take_our_backward(dispatch_on, sinks):
    """Our backward after the fused forward, from its (joined, with sinks) out, lse and
    lse_rem."""
    c = Case(2, 200, 200, 8, 2, 64, 64)
    _check(c, torch.bfloat16, True, lse_grad=True, sinks=sinks)
    assert len(dispatch_on["forward"]) == 1 and dispatch_on["backward"] == []
    _check(c, torch.bfloat16, True, deterministic=True, sinks=sinks)
    assert len(dispatch_on["forward"]) == 2 and dispatch_on["backward"] == []


@pytest.fixture
def eager_calls(monkeypatch):
    """The kernels the eager fast path (api._fused_eager) ran, one entry per call: "cudnn" or
    "flash" where it went through scaled_dot_product_attention itself (the kernel SDPA picks),
    "cudnn (aten)" or "flash (aten)" where it called the aten op."""
    calls = []
    real = sdpa.attention

    def spy(query, key, value, scale, is_causal, which, native):
        calls.append(which if native else f"{which} (aten)")
        return real(query, key, value, scale, is_causal, which, native)

    monkeypatch.setattr(sdpa, "attention", spy)
    return calls


def _eager(*args, return_lse, **kwargs):
    """dmattn_ops.attention without lse (the fast path's calls), in _check's (out, lse) form."""
    return dmattn_ops.attention(*args, **kwargs), None


@gpu
@pytest.mark.parametrize("which", ["cudnn", "flash"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("c", [CASES[0], CASES[1], CASES[2]])
def test_plain_eager_dense_calls_run_the_aten_op_under_pytorchs_autograd(
    dispatch_on, eager_calls, c, is_causal, which
):
    """Where the plan puts both passes on a fused kernel, a plain eager call runs that aten op
    under PyTorch's own autograd (no ops, no Python autograd node): the oracle's values. With
    SDPA held to that kernel (sdpa_kernel), SDPA's own call reaches it."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if is_causal and c.lq != c.lk:
        pytest.skip("bottom-right causal with Lq != Lk stays on our kernels")
    only = SDPBackend.CUDNN_ATTENTION if which == "cudnn" else SDPBackend.FLASH_ATTENTION
    with sdpa_kernel([only]):
        q, k, v = _operands("cuda", torch.bfloat16, c.lq, c.lk, c.d, c.dv, c.h, c.hkv)
        if _fused(q, k, v, is_causal=is_causal) is None:
            pytest.skip(f"PyTorch's {which} kernel does not take this call here")
        _check(c, torch.bfloat16, is_causal, fn=_eager, lse=False)
        assert eager_calls == [which] and dispatch_on == {"forward": [], "backward": []}
        q.requires_grad_()
        out = dmattn_ops.attention(q, k, v, is_causal=is_causal)
        names = {type(out.grad_fn).__name__}
        names |= {type(f).__name__ for f, _ in out.grad_fn.next_functions if f is not None}
        assert not any("AttentionFunction" in n for n in names), names
        with torch.no_grad():  # inference: the forward's plan alone
            dmattn_ops.attention(q, k, v, is_causal=is_causal)
    assert eager_calls == [which] * 3


@gpu
def test_calls_the_fast_path_cannot_serve_take_the_ops(dispatch_on, eager_calls):
    """deterministic (our backward), a returned lse and a torch.func transform go through the
    ops, with the oracle's values."""
    c = Case(2, 256, 256, 8, 2, 64, 64)
    _check(c, torch.bfloat16, True, fn=_eager, lse=False, deterministic=True)
    assert len(dispatch_on["forward"]) == 1 and dispatch_on["backward"] == []
    _check(c, torch.bfloat16, True)
    assert len(dispatch_on["forward"]) == 2 and len(dispatch_on["backward"]) == 1
    q, k, v = (t.normal_() for t in _operands("cuda", torch.bfloat16, 64, 64, 64, 64, 4, 2))
    g = torch.randn_like(q)

    def loss(fn, q, k, v):
        return (fn(q, k, v, is_causal=True) * g.to(q.dtype)).sum()

    got = torch.func.grad(lambda q: loss(dmattn_ops.attention, q, k, v))(q)
    assert len(dispatch_on["forward"]) == 3 and len(dispatch_on["backward"]) == 2
    ref64, ref_lp = (
        torch.func.grad(loss, argnums=1)(reference.attention, q.to(t), k.to(t), v.to(t))
        for t in (torch.float64, torch.bfloat16)
    )
    assert_close(got, ref64, low_precision_bound(ref64, ref_lp, torch.bfloat16), "dq (func.grad)")
    assert eager_calls == []


@gpu
def test_causal_with_more_queries_than_keys_stays_bottom_right(dispatch_on):
    # Flash aligns causality top-left; the contract's bottom-right alignment must hold.
    c = Case(1, 96, 64, 4, 4, 64, 64)
    _check(c, torch.bfloat16, True)
    assert dispatch_on["forward"] == []


@gpu
def test_switch_forces_our_kernels(dispatch_on, monkeypatch):
    monkeypatch.setenv("DMATTN_DENSE_SDPA", "0")
    _check(Case(1, 128, 128, 4, 4, 64, 64), torch.bfloat16, True)
    assert dispatch_on == {"forward": [], "backward": []}


@gpu
@pytest.mark.parametrize("sinks", [False, True], ids=["plain", "sinks"])
def test_compiled_dense_call(dispatch_on, sinks):
    """Traced into a compiled graph; with sinks, the join and row-statistics kernels too."""
    torch._dynamo.reset()

    def attention(*args, **kwargs):
        out = dmattn_ops.attention(*args, **kwargs)
        return out, torch.zeros(())  # no lse: a returned lse would get a gradient slot

    compiled = torch.compile(attention, fullgraph=True)
    c = Case(2, 256, 256, 8, 2, 64, 64)
    # Inductor's caches would load the graph of an earlier run on this machine without tracing.
    with torch._inductor.config.patch(force_disable_caches=True):
        _check(
            c, torch.bfloat16, True, fn=lambda *a, return_lse, **kw: compiled(*a, **kw),
            lse=False, sinks=sinks,
        )  # fmt: skip
    # Traced once (the graph then launches the kernels itself), forward and backward.
    assert dispatch_on["forward"] and dispatch_on["backward"]


@gpu
def test_outputs_are_contiguous_as_the_fake_kernels_say(dispatch_on):
    """Transposed (B, H, L, D) storage seen as (B, L, H, D): the real outputs must have the
    fake kernels' (contiguous) strides, or compiled graphs misread them."""
    q, k, v = (
        torch.randn(2, h, 128, 64, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        for h in (8, 2, 2)
    )
    args = (q, k, v, None, None, 0.125, True, 0.0, None, False)
    out, lse, lse_rem = torch.ops.dmattn.attention_forward(*args)
    g = torch.randn_like(out)
    dq, dk, dv, _, _ = torch.ops.dmattn.attention_backward(
        g, None, q, k, v, out, lse, lse_rem, None, None, 0.125, True, 0.0, None, False, False
    )
    for t in (out, dq, dk, dv):
        assert t.is_contiguous()
    assert len(dispatch_on["forward"]) == 1 and len(dispatch_on["backward"]) == 1
    torch.library.opcheck(torch.ops.dmattn.attention_forward.default, args,
                          test_utils=("test_schema", "test_faketensor"))  # fmt: skip


@gpu
def test_traces_take_the_kernel_eager_calls_take(monkeypatch):
    """On a compiled graph's fake tensors `torch._fused_sdp_choice` answers for meta tensors;
    the choice must still be the eager one (cuDNN for the model's shape on an H100)."""
    from torch._subclasses import FakeTensorMode

    monkeypatch.setenv("DMATTN_DENSE_SDPA", "1")
    q = torch.zeros(2, 256, 16, 128, dtype=torch.bfloat16, device="cuda")
    k = torch.zeros(2, 256, 4, 128, dtype=torch.bfloat16, device="cuda")
    eager = _fused(q, k, k, is_causal=True)
    with FakeTensorMode() as mode:
        fq, fk = mode.from_tensor(q), mode.from_tensor(k)
        assert _fused(fq, fk, fk, is_causal=True) == eager


# Sliding windows as chunked causal calls (sdpa.window_chunk).


def _fused_stand_ins(monkeypatch) -> list:
    """sdpa's two calls of PyTorch's fused kernels replaced by float64 stand-ins, so that the
    chunking, the row reversals and the merge run on the CPU (through the interpreter) and are
    checked without the fused kernels' rounding: the oracle's forward, and the chunked PyTorch
    backward, which like the fused backwards works from the out and lse it is given. Returns
    the list of (batch, query rows, key rows) of the forward calls."""
    shapes = []

    def forward(q, k, v, scale, is_causal, which):
        shapes.append((q.shape[0], q.shape[1], k.shape[1]))
        out, lse = reference.attention_forward(q, k, v, scale=scale, is_causal=is_causal)
        return out.contiguous(), lse.contiguous()

    def backward(grad_out, q, k, v, out, lse, scale, is_causal, which):
        saved = (out, lse, torch.zeros_like(lse))
        grads = chunked.backward(
            Problem(q, k, v), Options(scale, is_causal), saved, grad_out, None, False
        )
        return grads[:3]

    monkeypatch.setattr(sdpa, "_forward", forward)
    monkeypatch.setattr(sdpa, "_backward", backward)
    return shapes


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's CPU run of the glue")
@pytest.mark.parametrize(
    "b,n,c,h,hkv,d",
    [(1, 1, 8, 2, 2, 16), (2, 3, 8, 4, 2, 16), (1, 4, 5, 2, 1, 24)],
    ids=["one-chunk", "gqa", "odd-chunk"],
)
def test_window_chunks_compute_the_window(monkeypatch, b, n, c, h, hkv, d):
    """Chunks of c = left + 1 rows against themselves and (reversed) against the previous
    chunk, merged: exactly the causal window of c keys, forward and backward. Both fused calls
    take whole chunks of c rows (the reversed one padded: the fused backward is slower at c - 1
    rows), and the padding row adds nothing to any gradient."""
    shapes = _fused_stand_ins(monkeypatch)
    length, scale = n * c, d**-0.5
    q = torch.randn(b, length, h, d, dtype=torch.float64)
    k = torch.randn(b, length, hkv, d, dtype=torch.float64)
    v = torch.randn(b, length, hkv, d, dtype=torch.float64)
    g = torch.randn(b, length, h, d, dtype=torch.float64)
    out, lse = sdpa._window_forward(q, k, v, scale, c, "cudnn")
    grads = sdpa._window_backward(g, q, k, v, out, lse, scale, c, "cudnn")
    assert shapes == [(b * n, c, c)] + ([(b * (n - 1), c, c)] if n > 1 else [])

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want, want_lse = reference.attention_forward(
        *leaves, scale=scale, is_causal=True, window_size=(c - 1, 0)
    )
    want_grads = torch.autograd.grad(want, leaves, g)
    # The merge, its lse and the added reversed rows are computed in float32 (the fused kernels
    # give bf16/fp16 parts): a few float32 roundings of each value. A wrong row or weight
    # errs by the values themselves.
    for name, got, w in zip(
        ("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), (want, want_lse, *want_grads)
    ):
        bound = 8 * torch.finfo(torch.float32).eps * max(1.0, w.abs().max().item())
        assert_close(got.double(), w, bound, name)


def _on_stand_in_fused_path(monkeypatch, kernel_options) -> list:
    """The stand-in fused kernels (_fused_stand_ins) for dense calls and causal windows of 4
    keys or more; returns the list of the query lengths sdpa.forward is called with."""
    _fused_stand_ins(monkeypatch)
    kernel_options(window_min_keys=4)
    monkeypatch.setattr(sdpa, "choose", lambda *args: ("cudnn", []))
    calls = []
    real = sdpa.forward
    monkeypatch.setattr(
        sdpa, "forward", lambda *a, **k: calls.append(a[0].shape[1]) or real(*a, **k)
    )
    return calls


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's CPU run of the glue")
@pytest.mark.parametrize("length,c", [(30, 8), (68, 24)], ids=["decode-tail", "dense-tail"])
def test_window_tails_run_on_our_kernels(monkeypatch, kernel_options, length, c):
    """A length that is no multiple of the chunk: the whole chunks through the (stand-in) fused
    kernels, the rows after them through ours (decode or dense), joined in the op's forward and
    backward: the causal window of c keys, against the oracle."""
    calls = _on_stand_in_fused_path(monkeypatch, kernel_options)
    q = torch.randn(1, length, 4, 16)
    k, v = torch.randn(1, length, 2, 16), torch.randn(1, length, 2, 16)
    g = torch.randn(1, length, 4, 16)
    kw = dict(is_causal=True, window_size=(c - 1, 0), return_lse=True)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = dmattn_ops.attention(*leaves, **kw)
    grads = torch.autograd.grad(out, leaves, g)
    assert calls == [length - length % c]  # the whole chunks went to the fused kernels

    ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    want, want_lse = reference.attention(*ref_leaves, **kw)
    want_grads = torch.autograd.grad(want, ref_leaves, g.double())
    for name, got, w in zip(
        ("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), (want, want_lse, *want_grads)
    ):
        # float32 kernels and stand-ins: a wrong row or part errs by the values themselves.
        assert_close(got.double(), w.double(), 1e-4 * max(1.0, w.abs().max().item()), name)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's CPU run of the glue")
@pytest.mark.parametrize(
    "length,window", [(24, None), (24, (7, 0)), (30, (7, 0))],
    ids=["dense", "window-chunks", "window-tail"],
)  # fmt: skip
def test_sinks_on_the_fused_path(monkeypatch, kernel_options, length, window):
    """Sinks on the (stand-in) fused kernels' path: joined to the forward's result, and the
    backward from the joined out and lse with dsinks from the row statistics, against the
    oracle; a dense causal call, whole window chunks, and chunks with a tail on our kernels."""
    calls = _on_stand_in_fused_path(monkeypatch, kernel_options)
    q = torch.randn(2, length, 4, 16)
    k, v = torch.randn(2, length, 2, 16), torch.randn(2, length, 2, 16)
    g = torch.randn(2, length, 4, 16)
    sinks = _sinks(4, "cpu")
    kw = dict(is_causal=True, return_lse=True)
    if window is not None:
        kw["window_size"] = window
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    out, lse = dmattn_ops.attention(*leaves[:3], sinks=leaves[3], **kw)
    grads = torch.autograd.grad(out, leaves, g)
    assert calls == [length - length % 8 if window else length]

    ref_leaves = [t.double().requires_grad_() for t in (q, k, v, sinks)]
    want, want_lse = reference.attention(*ref_leaves[:3], sinks=ref_leaves[3], **kw)
    want_grads = torch.autograd.grad(want, ref_leaves, g.double())
    names = ("out", "lse", "dq", "dk", "dv", "dsinks")
    for name, got, w in zip(names, (out, lse, *grads), (want, want_lse, *want_grads)):
        assert got.isfinite().all(), name
        # float32 kernels and stand-ins: a wrong row or weight errs by the values themselves.
        assert_close(got.double(), w.double(), 1e-4 * max(1.0, w.abs().max().item()), name)


def test_window_chunk_rules(monkeypatch, kernel_options):
    q, k, _ = _operands("meta", lq=32, lk=32)
    assert sdpa.window_chunk(q, k, Band.of(True, (7, 0)), 4) == 8
    assert sdpa.window_chunk(q, k, Band.of(True, (7, -1)), 4) == 8  # causal caps the right side
    assert sdpa.window_chunk(q, k, Band.of(False, (7, 0)), 4) == 8
    assert sdpa.window_chunk(q, k, Band.of(True, (40, 0)), 4) == 32  # the whole sequence: causal
    assert sdpa.window_chunk(q, k, Band.of(False, (7, 2)), 4) is None  # keys right of the query
    assert sdpa.window_chunk(q, k, Band.of(True, (-1, 0)), 4) is None  # no window at all
    assert sdpa.window_chunk(q, k, Band.of(True, (2, 0)), 4) is None  # under min_keys
    q16, _, _ = _operands("meta", lq=16, lk=32)
    assert sdpa.window_chunk(q16, k, Band.of(True, (7, 0)), 4) is None  # Lq != Lk
    # The plan of such a call on the (stand-in) fused kernels: whole chunks, and the rows
    # after the last one (its tail) on our kernels.
    from dmattn_ops.core.problem import Options, Problem
    from dmattn_ops.dispatch import plan

    monkeypatch.setattr(sdpa, "choose", lambda *args: ("cudnn", []))
    kernel_options(window_min_keys=4)
    for left, chunk, tail in ((6, 7, 4), (7, 8, 0)):
        p = plan.plan(Problem(q, k, k), Options(0.25, True, window=(left, 0)))
        assert (p.route, p.fused, p.chunk, p.tail) == (plan.SDPA, "cudnn", chunk, tail)


@gpu
@pytest.mark.parametrize("which", ["cudnn", "flash"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    "c,n", [(64, 1), (64, 2), (128, 4)], ids=["one-chunk", "two-chunks", "four-chunks"]
)
def test_windowed_calls_run_fused_kernels_in_chunks(
    dispatch_on, monkeypatch, kernel_options, c, n, dtype, which
):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kernel_options(window_min_keys=64)
    case = Case(2, n * c, n * c, 8, 2, 128, 128)
    only = SDPBackend.CUDNN_ATTENTION if which == "cudnn" else SDPBackend.FLASH_ATTENTION
    with sdpa_kernel([only]):
        operands = _operands("cuda", dtype, case.lq, case.lk, case.d, case.dv, case.h, case.hkv)
        if _fused(*operands, is_causal=True) is None:
            pytest.skip(f"PyTorch's {which} kernel does not take this call here")
        _check(case, dtype, True, window=(c - 1, 0))
    assert dispatch_on == {"forward": [which], "backward": [which]}


@gpu
@pytest.mark.parametrize("tail", [8, 40], ids=["decode-tail", "dense-tail"])
def test_windowed_calls_with_a_partial_chunk(dispatch_on, monkeypatch, kernel_options, tail):
    """The rows after the last whole chunk run on our kernels (decode or dense)."""
    kernel_options(window_min_keys=64)
    _check(Case(2, 128 + tail, 128 + tail, 8, 2, 128, 128), torch.bfloat16, True, window=(63, 0))
    assert len(dispatch_on["forward"]) == 1 and len(dispatch_on["backward"]) == 1


@gpu
@pytest.mark.parametrize("tail", [0, 40], ids=["whole-chunks", "dense-tail"])
def test_windowed_calls_with_sinks(dispatch_on, monkeypatch, kernel_options, tail):
    """GPT-OSS's pattern (a causal window and a sink per head) on the chunked fused path."""
    kernel_options(window_min_keys=64)
    c = Case(2, 128 + tail, 128 + tail, 8, 2, 64, 64)
    _check(c, torch.bfloat16, True, window=(63, 0), sinks=True)
    assert len(dispatch_on["forward"]) == 1 and len(dispatch_on["backward"]) == 1


@gpu
def test_windows_the_chunks_cannot_serve_stay_on_our_kernels(
    dispatch_on, monkeypatch, kernel_options
):
    kernel_options(window_min_keys=64)
    _check(Case(1, 256, 256, 4, 2, 64, 64), torch.bfloat16, False, window=(63, 5))
    kernel_options(window_min_keys=128)
    _check(Case(1, 256, 256, 4, 2, 64, 64), torch.bfloat16, True, window=(63, 0))
    assert dispatch_on == {"forward": [], "backward": []}


@gpu
def test_compiled_windowed_call_with_a_partial_chunk(dispatch_on, monkeypatch, kernel_options):
    """Traced into a compiled graph: the chunks' copies and merge, both fused calls and the
    tail on our kernels, forward and backward, against the oracle."""
    torch._dynamo.reset()
    kernel_options(window_min_keys=64)

    def attention(*args, **kwargs):
        return dmattn_ops.attention(*args, **kwargs), torch.zeros(())

    compiled = torch.compile(attention, fullgraph=True)
    with torch._inductor.config.patch(force_disable_caches=True):
        _check(
            Case(2, 128 + 40, 128 + 40, 8, 2, 64, 64), torch.bfloat16, True,
            fn=lambda *a, return_lse, **kw: compiled(*a, **kw), lse=False, window=(63, 0),
        )  # fmt: skip
    assert dispatch_on["forward"] and dispatch_on["backward"]


# Causal windows through cuDNN's own graphs (cudnn_graphs.py, with the optional frontend).


def test_graph_window_rules():
    """Which bands the graphs could take (window_of: shapes only; `supports` then asks cuDNN):
    a causal window shorter than the sequence and not under min_keys (the kernel option
    graph_window_min_keys, 512 by default), with Lq == Lk; C = left + 1 keys."""
    q, k, _ = _operands("meta", lq=32, lk=32)

    def window_of(query, band, min_keys=1):
        return cudnn_graphs.window_of(query, k, band, min_keys)

    assert cudnn_graphs.window_of(q, k, Band.of(True, (7, 0))) is None  # under the default
    assert window_of(q, Band.of(True, (7, 0)), min_keys=9) is None  # under min_keys
    assert window_of(q, Band.of(True, (7, 0)), min_keys=8) == 8
    assert window_of(q, Band.of(True, (7, -1))) == 8  # causal caps the right
    assert window_of(q, Band.of(False, (7, 0))) == 8
    assert window_of(q, Band.of(True, (0, 0))) == 1  # only the query's own key
    assert window_of(q, Band.of(True, (31, 0))) is None  # the whole sequence
    assert window_of(q, Band.of(False, (7, 2))) is None  # keys right of it
    assert window_of(q, Band.of(True, (-1, 0))) is None  # no window
    assert window_of(q, Band.of(False, (-1, 0))) is None  # no lower bound
    q16, _, _ = _operands("meta", lq=16, lk=32)
    assert window_of(q16, Band.of(True, (7, 0))) is None  # Lq != Lk
    assert not cudnn_graphs.supports(q, k, k, Band.of(True, (7, 0)), min_keys=1)  # not CUDA


def test_graph_windows_can_be_switched_off(monkeypatch):
    monkeypatch.setenv("DMATTN_CUDNN_GRAPHS", "0")
    assert not cudnn_graphs.enabled()


def test_graph_support_is_checked_per_pass(monkeypatch):
    """`supports` builds only the graph of the pass it is asked about, once per shape: an
    inference call builds no backward graph. (cuDNN faked: the device test is below.)"""
    built = []
    monkeypatch.setattr(cudnn_graphs, "_module", lambda: object())
    monkeypatch.setattr(cudnn_graphs, "_usable", lambda query: True)
    monkeypatch.setattr(cudnn_graphs, "_build", lambda kind, *args: built.append(kind) or kind)
    monkeypatch.setattr(cudnn_graphs._local, "graphs", {}, raising=False)
    cudnn_graphs._builds.cache_clear()
    q, k, _ = _operands("meta", lq=32, lk=32)
    band = Band.of(True, (7, 0))
    assert cudnn_graphs.supports(q, k, k, band, min_keys=1) and built == ["fwd"]
    assert cudnn_graphs.supports(q, k, k, band, min_keys=1) and built == ["fwd"]
    assert cudnn_graphs.supports(q, k, k, band, True, 1) and built == ["fwd", "bwd"]
    cudnn_graphs._builds.cache_clear()


def test_graph_window_min_keys_decides_which_windows_take_the_graphs(monkeypatch, kernel_options):
    """The kernel option graph_window_min_keys (default 512) is the shortest window the plan
    puts on cuDNN's graphs, for both passes; shorter ones take the other routes. (cuDNN
    faked: every graph builds.)"""
    from dmattn_ops.core.problem import Options, Problem
    from dmattn_ops.dispatch import plan

    monkeypatch.setattr(cudnn_graphs, "_module", lambda: object())
    monkeypatch.setattr(cudnn_graphs, "_usable", lambda query: True)
    monkeypatch.setattr(cudnn_graphs, "_build", lambda kind, *args: kind)
    monkeypatch.setattr(cudnn_graphs._local, "graphs", {}, raising=False)
    monkeypatch.setattr(sdpa, "choose", lambda *args: ("cudnn", []))
    cudnn_graphs._builds.cache_clear()
    q, k, _ = _operands("meta", lq=32, lk=32)
    opts = Options(0.25, True, window=(7, 0))
    assert plan.plan(Problem(q, k, k), opts).fused != sdpa.GRAPHS  # 8 keys < 512
    kernel_options(graph_window_min_keys=9)
    assert plan.plan(Problem(q, k, k), opts).fused != sdpa.GRAPHS
    kernel_options(graph_window_min_keys=8)
    for direction in (plan.FORWARD, plan.BACKWARD):
        p = plan.plan(Problem(q, k, k), opts, direction)
        assert (p.route, p.fused) == (plan.SDPA, sdpa.GRAPHS), direction
    with pytest.raises(ValueError, match="graph_window_min_keys"):
        dmattn_ops.kernel_options(graph_window_min_keys=0).__enter__()
    cudnn_graphs._builds.cache_clear()


def test_a_graph_cudnn_declines_leaves_the_window_to_the_other_routes(monkeypatch, kernel_options):
    """A graph whose build fails (cuDNN's support check) is remembered as declined, once per
    shape and pass, and the call's plan takes the chunked calls or our kernels instead."""
    from dmattn_ops.core.problem import Options, Problem
    from dmattn_ops.dispatch import plan

    tries = []

    def declined(kind, *args):
        tries.append(kind)
        raise RuntimeError("cudnnGraphNotSupportedError stand-in")

    monkeypatch.setattr(cudnn_graphs, "_module", lambda: object())
    monkeypatch.setattr(cudnn_graphs, "_usable", lambda query: True)
    monkeypatch.setattr(cudnn_graphs, "_build", declined)
    monkeypatch.setattr(cudnn_graphs._local, "graphs", {}, raising=False)
    monkeypatch.setattr(sdpa, "choose", lambda *args: ("cudnn", []))
    cudnn_graphs._builds.cache_clear()
    kernel_options(graph_window_min_keys=1)
    q, k, _ = _operands("meta", lq=32, lk=32)
    band = Band.of(True, (7, 0))
    assert not cudnn_graphs.supports(q, k, k, band, min_keys=1)
    assert not cudnn_graphs.supports(q, k, k, band, min_keys=1)
    assert tries == ["fwd"]
    opts = Options(0.25, True, window=(7, 0))
    p = plan.plan(Problem(q, k, k), opts)
    assert p.route != plan.SDPA  # a window of 8 keys: under window_min_keys, so our kernels
    kernel_options(window_min_keys=4)
    p = plan.plan(Problem(q, k, k), opts)
    assert (p.route, p.fused, p.chunk, p.tail) == (plan.SDPA, sdpa.CUDNN, 8, 0)  # chunks
    cudnn_graphs._builds.cache_clear()


needs_graphs = pytest.mark.skipif(
    not cudnn_graphs.enabled(),
    reason="needs the cuDNN frontend (pip install nvidia-cudnn-frontend)",
)


@pytest.fixture
def graphs_on(monkeypatch, kernel_options):
    """DMATTN_DENSE_SDPA=1 and DMATTN_CUDNN_GRAPHS=1, windows of any width on the graphs
    (kernel option graph_window_min_keys=1); returns the calls of cudnn_graphs' forward and
    backward (the window's C each) and of sdpa's chunked calls."""
    monkeypatch.setenv("DMATTN_DENSE_SDPA", "1")
    monkeypatch.setenv("DMATTN_CUDNN_GRAPHS", "1")
    kernel_options(graph_window_min_keys=1)
    calls = {"forward": [], "backward": [], "chunks": []}
    for name in ("forward", "backward"):
        real = getattr(cudnn_graphs, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            calls[_name].append(args[-1].left + 1)
            return _real(*args, **kwargs)

        monkeypatch.setattr(cudnn_graphs, name, spy)
    real_chunks = sdpa._window_forward
    monkeypatch.setattr(
        sdpa, "_window_forward", lambda *a: calls["chunks"].append(a[4]) or real_chunks(*a)
    )
    return calls


@gpu
@needs_graphs
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    "case,left",
    [
        (Case(2, 256, 256, 8, 2, 128, 128), 63),  # GQA, whole tiles
        (Case(1, 300, 300, 4, 4, 64, 64), 99),  # a partial tile, a window across tiles
        (Case(1, 200, 200, 8, 1, 128, 128), 0),  # MQA, each query sees only itself
        (Case(2, 384, 384, 4, 2, 64, 64), 250),  # a window no multiple of anything
    ],
    ids=["gqa", "partial-tile", "self-only", "odd-window"],
)
def test_graph_windows_compute_the_window(graphs_on, case, left, dtype):
    """One forward and one backward graph compute the causal window of left + 1 keys: out, lse,
    dq, dk and dv against the float64 oracle, within PyTorch's own error in the dtype."""
    _check(case, dtype, True, window=(left, 0))
    assert graphs_on == {"forward": [left + 1], "backward": [left + 1], "chunks": []}


@gpu
@needs_graphs
def test_graph_windows_with_sinks(graphs_on):
    """GPT-OSS's pattern (a narrow causal window and a sink per head): the sinks joined to the
    graph's out and lse, dsinks from the row statistics."""
    _check(Case(2, 256, 256, 8, 2, 64, 64), torch.bfloat16, True, window=(127, 0), sinks=True)
    assert graphs_on["forward"] == [128] and graphs_on["backward"] == [128]


@gpu
@needs_graphs
def test_graph_windows_leave_other_calls(graphs_on):
    """Calls the graphs do not take: an lse gradient or deterministic=True (the backward on our
    kernels, from the graph's forward), a window with keys right of the query, Lq != Lk."""
    _check(Case(1, 256, 256, 4, 2, 64, 64), torch.bfloat16, True, window=(63, 0), lse_grad=True)
    _check(
        Case(1, 256, 256, 4, 2, 64, 64), torch.bfloat16, True, window=(63, 0), deterministic=True
    )
    assert graphs_on == {"forward": [64, 64], "backward": [], "chunks": []}
    _check(Case(1, 256, 256, 4, 2, 64, 64), torch.bfloat16, False, window=(63, 5))
    _check(Case(1, 128, 256, 4, 2, 64, 64), torch.bfloat16, True, window=(63, 0))
    assert graphs_on == {"forward": [64, 64], "backward": [], "chunks": []}


@gpu
@needs_graphs
def test_graph_inference_builds_no_backward_graph(graphs_on):
    q, k, v = (torch.randn(1, 320, h, 64, device="cuda", dtype=torch.bfloat16) for h in (4, 2, 2))
    with torch.no_grad():
        out = dmattn_ops.attention(q, k, v, is_causal=True, window_size=(70, 0))
    assert out.isfinite().all() and graphs_on["forward"] == [71]
    # the thread's graphs: (kind, device, dtype, B, L, H, Hkv, D, Dv, C, scale)
    kinds = {key[0] for key in cudnn_graphs._local.graphs if key[4] == 320 and key[9] == 71}
    assert kinds == {"fwd"}


@gpu
@needs_graphs
def test_graph_windows_compiled_and_in_cuda_graphs(graphs_on):
    """Inside torch.compile(fullgraph=True), and captured in a CUDA graph and replayed: the
    eager call's results (up to the order of cuDNN's dq atomics: a rounding of the dtype)."""
    torch._dynamo.reset()
    q, k, v = (torch.randn(1, 512, h, 64, device="cuda", dtype=torch.bfloat16) for h in (8, 2, 2))
    g = torch.randn_like(q)

    def step(fn):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves, is_causal=True, window_size=(99, 0))
        return (out, *torch.autograd.grad(out, leaves, g))

    want = step(dmattn_ops.attention)
    got = step(torch.compile(dmattn_ops.attention, fullgraph=True))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step(dmattn_ops.attention)  # warm-up off the capture, as CUDA graphs want
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step(dmattn_ops.attention)
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(captured, want):
        assert a.isfinite().all()
        torch.testing.assert_close(a, b)
    # The eager, warm-up and captured calls at least (the compiled graph's runs bypass the spy:
    # they run the graph op its trace recorded).
    assert graphs_on["chunks"] == []
    for name in ("forward", "backward"):
        assert len(graphs_on[name]) >= 3 and set(graphs_on[name]) == {100}, name
