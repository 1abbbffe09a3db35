"""Every route, forced through the kernel options, on every feature it can take: the same
function as the float64 oracle (forward, lse and every gradient), or a ValueError that names
the reasons `dmattn_ops.explain` gives. Routes that cannot run here (PyTorch's fused kernels
without CUDA) are checked for refusing with their reasons.
"""

from __future__ import annotations

import pytest
import torch
from helpers import DEVICE, assert_close, low_precision_bound, max_err

import dmattn_ops
from dmattn_ops import reference
from dmattn_ops.dispatch import plan

needs_triton = pytest.mark.skipif(
    not plan.triton_runs_on(torch.empty(0, device=DEVICE)), reason="needs CUDA or the interpreter"
)
B, LK, H, D = 2, 40, 4, 16

# feature id -> (Lq, Hkv, mask shape or None, bias shape or None, keywords)
FEATURES = {
    "plain": (24, 2, None, None, {}),
    "causal-mqa": (24, 1, None, None, {"is_causal": True}),
    "key-mask-bias": (24, 2, (B, 2, 1, LK), (B, 2, 1, LK), {"is_causal": True}),
    "entry-mask-bias": (24, 2, (B, H, 24, LK), (B, H, 24, LK), {}),
    "window": (24, 2, (1, 1, 1, LK), None, {"is_causal": True, "window_size": (9, 0)}),
    "sinks": (24, 2, (B, 2, 1, LK), (1, H, 1, LK), {"sinks": "sinks"}),
    "seqused_k": (24, 2, (B, 2, 1, LK), None, {"seqused_k": "seqused_k", "is_causal": True}),
    "softcap": (24, 2, None, (B, H, 24, LK), {"softcap": 5.0}),
    "decode-gqa": (3, 1, (B, 1, 1, LK), (B, 1, 1, LK), {}),
}


def _inputs(feature: str, dtype=torch.float32):
    lq, hkv, mask_shape, bias_shape, kw = FEATURES[feature]
    g = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(DEVICE)

    q, k, v = randn(B, lq, H, D), randn(B, LK, hkv, D), randn(B, LK, hkv, D)
    mask = None
    if mask_shape is not None:
        mask = (torch.rand(*mask_shape, generator=g) < 0.6).to(DEVICE)
    bias = randn(*bias_shape) if bias_shape is not None else None
    kw = dict(kw)
    if kw.get("sinks") == "sinks":
        kw["sinks"] = randn(H)
    if kw.get("seqused_k") == "seqused_k":
        kw["seqused_k"] = torch.tensor([LK - 7, 29], dtype=torch.int32, device=DEVICE)
    return (q, k, v, mask, bias), kw


def _grads(fn, inputs, kw, grad_out):
    q, k, v, mask, bias = (t.detach().requires_grad_() if t is not None and t.is_floating_point()
                           else t for t in inputs)  # fmt: skip
    sinks = kw.get("sinks")
    if sinks is not None:
        kw = dict(kw, sinks=sinks.detach().requires_grad_())
    out, lse = fn(q, k, v, mask, bias, return_lse=True, **kw)
    wrt = [t for t in (q, k, v, bias, kw.get("sinks")) if t is not None]
    grads = torch.autograd.grad((out * grad_out).sum() + lse.sum(), wrt)
    return out, lse, grads


@needs_triton
@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("route", plan.ROUTES)
def test_forced_routes_compute_the_function_or_say_why_not(route, feature):
    inputs, kw = _inputs(feature)
    low = [t.float() if t is not None and t.is_floating_point() else t for t in inputs]
    low_kw = {name: (t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t)
              for name, t in kw.items()}  # fmt: skip
    options = {"route": route}
    told = dmattn_ops.explain(*low, **low_kw, return_lse=True, kernel_options=options)
    why = told.forward.reasons[route]
    if why:
        with pytest.raises(ValueError, match=f"route={route!r} cannot compute") as raised:
            dmattn_ops.attention(*low, **low_kw, kernel_options=options)
        assert why[0] in str(raised.value)
        return
    assert told.forward.route == route
    grad_out = torch.randn(*inputs[0].shape, dtype=torch.float64, device=DEVICE)

    def ours(*args, **kwargs):
        return dmattn_ops.attention(*args, **kwargs, kernel_options=options)

    out, lse, grads = _grads(ours, low, low_kw, grad_out.float())
    want_out, want_lse, want_grads = _grads(reference.attention, inputs, kw, grad_out)
    lp_out, lp_lse, lp_grads = _grads(reference.attention, low, low_kw, grad_out.float())
    assert_close(out, want_out, low_precision_bound(want_out, lp_out, torch.float32), "out")
    assert_close(lse, want_lse, low_precision_bound(want_lse, lp_lse, torch.float32), "lse")
    names = ["dq", "dk", "dv"]
    names += ["dbias"] if inputs[4] is not None else []
    names += ["dsinks"] if kw.get("sinks") is not None else []
    assert len(grads) == len(names)
    for name, g, w, wl in zip(names, grads, want_grads, lp_grads):
        assert_close(g, w, low_precision_bound(w, wl, torch.float32), name)


VARLEN_FEATURES = {
    "plain": (None, None, {}),
    "key-mask-bias-causal": ((2, 40), (2, 40), {"is_causal": True}),
    "window-softcap": ((1, 40), None, {"is_causal": True, "window_size": (5, 0), "softcap": 4.0}),
}


@needs_triton
@pytest.mark.parametrize("feature", list(VARLEN_FEATURES))
@pytest.mark.parametrize("route", ["varlen", "pytorch", "dense", "key_lists"])
def test_forced_routes_on_packed_sequences(route, feature):
    mask_shape, bias_shape, kw = VARLEN_FEATURES[feature]
    g = torch.Generator().manual_seed(1)
    cu_q = torch.tensor([0, 11, 30], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 17, 40], dtype=torch.int32, device=DEVICE)
    q = torch.randn(30, H, D, generator=g).to(DEVICE)
    k, v = (torch.randn(40, 2, D, generator=g).to(DEVICE) for _ in range(2))
    mask = (torch.rand(*mask_shape, generator=g) < 0.6).to(DEVICE) if mask_shape else None
    bias = torch.randn(*bias_shape, generator=g).to(DEVICE) if bias_shape else None
    args = (q, k, v, cu_q, cu_k, 19, 23, mask, bias)
    options = {"route": route}
    if route not in ("varlen", "pytorch"):
        with pytest.raises(ValueError, match="packed sequences"):
            dmattn_ops.attention_varlen(*args, **kw, kernel_options=options)
        return
    out = dmattn_ops.attention_varlen(*args, **kw, kernel_options=options)
    args64 = (q.double(), k.double(), v.double(), cu_q, cu_k, 19, 23, mask,
              None if bias is None else bias.double())  # fmt: skip
    want = reference.attention_varlen(*args64, **kw)
    low = reference.attention_varlen(*args, **kw)
    assert_close(out, want, low_precision_bound(want, low, torch.float32), "out")


@needs_triton
def test_kernel_options_change_no_result():
    """Configs, packing, head packing and the dk/dv split forced: the same values."""
    inputs, kw = _inputs("key-mask-bias")
    low = [t.float() if t is not None and t.is_floating_point() else t for t in inputs]
    grad_out = torch.randn(*inputs[0].shape, device=DEVICE)
    base_out, base_lse, base_grads = _grads(dmattn_ops.attention, low, kw, grad_out)
    for options in (
        {"pack_keys": False},
        {"pack_heads": True, "dkdv_split": 2},
        {"route": "tile_tables", "fwd_config": (32, 16, 4, 1), "dq_config": (16, 32, 4, 1)},
    ):
        with dmattn_ops.kernel_options(**options):
            out, lse, grads = _grads(dmattn_ops.attention, low, kw, grad_out)
        assert max_err(out, base_out) < 1e-5 and max_err(lse, base_lse) < 1e-5, options
        for g, w in zip(grads, base_grads):
            assert max_err(g, w) < 1e-4, options


def test_compiled_graphs_follow_the_kernel_options_blocks():
    """A graph compiled inside a kernel_options block carries the block's options in its op
    call, and Dynamo guards on the blocks: entering one compiles again, leaving it takes the
    first graph back (the blocks were module state the plan read below the op, unguarded)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append([a for node in gm.graph.nodes if "dmattn" in str(node.target)
                       for a in (*node.args, *node.kwargs.values()) if isinstance(a, str)])  # fmt: skip
        return gm.forward

    torch._dynamo.reset()
    fn = torch.compile(lambda q: dmattn_ops.attention(q, q, q, is_causal=True), backend=backend,
                       fullgraph=True)  # fmt: skip
    q = torch.randn(1, 8, 2, 16, device=DEVICE)
    want = fn(q)
    with dmattn_ops.kernel_options(dkdv_split=1, fwd_config=(32, 16, 4, 1)):
        got = fn(q)
    assert_close(fn(q), want, 0.0, "outside the block again")
    assert_close(got, want, 1e-6, "inside the block")
    assert len(graphs) == 2, graphs
    assert graphs[0] == [] and graphs[1] == ["dkdv_split=1,fwd_config=32x16x4x1"], graphs


def test_compiled_graphs_follow_the_switches_below_the_op(monkeypatch):
    """The switches the launchers and Inductor's lowering read below the op (DMATTN_DENSE_SDPA,
    DMATTN_CUDNN_GRAPHS, DMATTN_HOPPER, DMATTN_INDUCTOR_KERNELS) are guarded like the
    environment reads Dynamo traces: changing one compiles again, restoring it takes the first
    graph back."""
    from dmattn_ops.core.options import GRAPH_SWITCHES

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    fn = torch.compile(lambda q: dmattn_ops.attention(q, q, q, is_causal=True), backend=backend,
                       fullgraph=True)  # fmt: skip
    q = torch.randn(1, 8, 2, 16, device=DEVICE)
    for name in GRAPH_SWITCHES:
        monkeypatch.delenv(name, raising=False)
    fn(q)
    for i, name in enumerate(GRAPH_SWITCHES):
        monkeypatch.setenv(name, "0")
        fn(q)
        assert len(graphs) == i + 2, name
        monkeypatch.delenv(name)
    fn(q)
    assert len(graphs) == len(GRAPH_SWITCHES) + 1
