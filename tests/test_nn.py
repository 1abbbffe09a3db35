"""dmattn_ops.nn.DynamicMaskAttention."""

import pytest
import torch

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


def test_bad_head_counts():
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        DynamicMaskAttention(32, 4, 3)
