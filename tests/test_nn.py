"""dmattn_ops.nn.DynamicMaskAttention."""

import re
import warnings

import pytest
import torch
from helpers import assert_close, low_precision_bound

from dmattn_ops.api import attention
from dmattn_ops.nn import DynamicMaskAttention


def make(backend="auto", **kw):
    torch.manual_seed(0)
    return DynamicMaskAttention(32, 4, 2, window=12, backend=backend, **kw)


def test_shapes_repr_and_matches_the_reference_backend():
    layer = make()
    oracle = make(backend="reference").double()
    oracle.load_state_dict(layer.state_dict())
    x = torch.randn(2, 40, 32)
    out = layer(x)
    assert out.shape == x.shape
    assert "num_kv_heads=2" in repr(layer) and "window=12" in repr(layer)
    ref = oracle(x.double())
    assert (out.double() - ref).abs().max() < 1e-5
    out.square().mean().backward()
    ref.square().mean().backward()
    for (name, p), (_, r) in zip(layer.named_parameters(), oracle.named_parameters()):
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert (p.grad.double() - r.grad).abs().max() < 1e-5, name
    assert layer.A.grad.abs().sum() > 0 and layer.dt_proj.weight.grad.abs().sum() > 0


def test_trains_under_compile_fullgraph():
    torch._dynamo.reset()
    layer = make(softcap=5.0)
    compiled = torch.compile(layer, fullgraph=True)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    x = torch.randn(2, 24, 32)
    target = torch.randn(2, 24, 32)
    losses = []
    for _ in range(3):
        opt.zero_grad()
        loss = (compiled(x) - target).square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def _output_and_grads(layer, x):
    layer.zero_grad()
    out = layer(x)
    (out * torch.cos(out)).sum().backward()
    return [out.detach()] + [p.grad.clone() for p in layer.parameters()]


def test_compiled_layer_matches_the_oracle_as_eager_fp32_does():
    """Compiled, the bias goes through dmattn::dt_bias where Triton runs (the interpreter on
    CPU) and is written as a sum of products elsewhere (dt_bias.pytorch_form); the layer's
    output and every parameter gradient stay within fp32's own error against the float64
    oracle (the bound: the oracle layer run in fp32)."""
    torch._dynamo.reset()
    layer = make()
    oracle = make(backend="reference").double()
    oracle.load_state_dict(layer.state_dict())
    fp32 = make(backend="reference")
    fp32.load_state_dict(layer.state_dict())
    x = torch.randn(2, 40, 32)
    got = _output_and_grads(torch.compile(layer, fullgraph=True), x)
    want = _output_and_grads(oracle, x.double())
    lowp = _output_and_grads(fp32, x)
    names = ["out"] + [name for name, _ in layer.named_parameters()]
    assert "dt_proj.weight" in names and "A" in names
    for name, g, w, e in zip(names, got, want, lowp):
        assert_close(g.double(), w, low_precision_bound(w, e, torch.float32), name)


def _matmul_calls(step) -> list[int]:
    """Matmuls (cuBLAS calls on CUDA) in each graph Inductor generates while step runs."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    _, codes = run_and_get_code(step)
    return [len(re.findall(r"extern_kernels\.(?:mm|addmm|bmm|baddbmm)\(", c)) for c in codes]


def test_compiled_bias_path_adds_no_matmul_calls():
    """Compiled, the layer issues the matmuls of its q/k/v/o projections and no more: dt_proj
    (Hkv output columns) is fused into Inductor's reductions, because a cuBLAS call per layer
    and pass cost a compiled step more host time than its GPU time."""
    layer = make()
    x = torch.randn(2, 24, 32)

    def dense(x):
        b, n, _ = x.shape
        q = layer.q_proj(x).view(b, n, 4, 8)
        k = layer.k_proj(x).view(b, n, 2, 8)
        v = layer.v_proj(x).view(b, n, 2, 8)
        return layer.o_proj(attention(q, k, v, is_causal=True).flatten(2))

    dense_step = torch.compile(dense, fullgraph=True)
    layer_step = torch.compile(layer, fullgraph=True)
    want = _matmul_calls(lambda: dense_step(x).square().mean().backward())
    got = _matmul_calls(lambda: layer_step(x).square().mean().backward())
    assert len(got) == 2 and sum(want) >= 8, (got, want)  # forward and backward graphs
    assert got == want


def test_bad_head_counts():
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        DynamicMaskAttention(32, 4, 3)


@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_tracing_the_layer_and_the_api_warns_nothing(backend):
    """torch.compile traces our public functions; Dynamo warns about what it cannot trace
    faithfully (a functools.cache wrapper, say), once per call site and in the user's log."""
    device = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the interpreter (conftest)
    torch._dynamo.reset()
    layer = torch.compile(make(backend=backend).to(device), fullgraph=True, backend="eager")
    call = torch.compile(
        lambda q, k, v: attention(q, k, v, is_causal=True, backend=backend),
        fullgraph=True, backend="eager",
    )  # fmt: skip
    q, k, v = (torch.randn(1, 8, 2, 16, device=device) for _ in range(3))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        layer(torch.randn(2, 24, 32, device=device)).square().mean().backward()
        call(q, k, v)
    assert [str(w.message) for w in caught if "Dynamo" in str(w.message)] == []
