"""dmattn_ops.dt_bias: the DMA layer's learned bias as one op (kernels/dt_bias.py), against
the float64 oracle (reference.dt_bias) within PyTorch's own error in each precision."""

import os
import subprocess
import sys

import pytest
import torch
from helpers import DEVICE, TRITON, assert_close, low_precision_bound, max_err

from dmattn_ops import reference
from dmattn_ops.dt_bias import Tiles, _backward, _forward, dt_bias, dt_bias_values, split_params

pytestmark = pytest.mark.skipif(not TRITON, reason="the kernels need Triton (GPU or interpreter)")


def _inputs(b, length, ch, h, dtype, logit_scale=1.0):
    x = torch.randn(b, length, ch, device=DEVICE).to(dtype)
    weight = torch.randn(h, ch, device=DEVICE) * logit_scale / ch**0.5
    bias = torch.randn(h, device=DEVICE) * logit_scale
    a = torch.rand(h, device=DEVICE) + 0.5
    return x, weight, bias, a


def _run(fn, inputs, grad):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    out.backward(grad.to(out.dtype))
    return [out.detach()] + [t.grad for t in leaves]


def _check(inputs, grad, dtype):
    """Ours against the float64 oracle, within twice the error of the oracle's own formula
    run in `dtype` (with float32 parameters, as the layer holds them)."""
    got = _run(dt_bias, inputs, grad)
    want = _run(reference.dt_bias, [t.double() for t in inputs], grad.double())
    lowp = _run(reference.dt_bias, inputs, grad)
    for name, g, w, e in zip(("out", "dx", "dweight", "dbias", "dA"), got, want, lowp):
        assert g.dtype == e.dtype and g.shape == w.shape, name
        assert_close(g.double(), w, low_precision_bound(w, e.double(), dtype), name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "b,length,ch,h",
    [(2, 40, 32, 2), (1, 70, 130, 4), (3, 5, 8, 1), (2, 129, 64, 3), (1, 300, 96, 16)],
)
def test_matches_the_float64_oracle(b, length, ch, h, dtype):
    inputs = _inputs(b, length, ch, h, dtype)
    grad = torch.randn(b, h, 1, length, device=DEVICE)
    _check(inputs, grad, dtype)


@pytest.mark.parametrize(
    "param_dtypes", [(torch.bfloat16,) * 3, (torch.bfloat16, torch.float32, torch.float32)]
)
def test_parameters_in_their_own_dtypes(param_dtypes):
    """Parameters in bf16 (a model cast whole, as bench.model's) or mixed (weight bf16, A
    float32): the kernels read them as they are, the parameter gradients come back in each
    one's dtype (summed in float32 and rounded once, in the parameters' dtype where weight
    and A share it), within bf16's own error against the float64 oracle."""
    x, *params = _inputs(2, 37, 48, 4, torch.bfloat16)
    params = [p.to(d) for p, d in zip(params, param_dtypes)]
    grad = torch.randn(2, 4, 1, 37, device=DEVICE).to(torch.bfloat16)
    inputs = (x, *params)
    got = _run(dt_bias, inputs, grad)
    want = _run(reference.dt_bias, [t.double() for t in inputs], grad.double())
    lowp = _run(reference.dt_bias, inputs, grad)
    for name, g, w, e, t in zip(("out", "dx", "dweight", "dbias", "dA"), got, want, lowp,
                                (x, x, *params)):  # fmt: skip
        assert g.dtype == t.dtype, name
        assert_close(g.double(), w, low_precision_bound(w, e.double(), torch.bfloat16), name)


@pytest.mark.parametrize(
    "tiles", [Tiles(8, 16), Tiles(64, 256, 8, 1), Tiles(16, 512, 4, 3), Tiles(32, 32, 2, 200)]
)
def test_any_tiles_give_the_same_function(tiles):
    """The tiles bench.glue sweeps (tokens and channels per step, warps, dW parts) change how
    the sums are split, never what they compute: each set against the float64 oracle."""
    x, weight, bias, a = _inputs(2, 45, 40, 3, torch.bfloat16)
    grad = torch.randn(2, 3, 1, 45, device=DEVICE).to(torch.bfloat16)
    out, logits = _forward(x, weight, bias, a, tiles)
    dx, dparams = _backward(grad, x, weight, a, logits, tiles=tiles)
    got = (out, dx, *split_params(dparams, 3, 40))
    want = _run(reference.dt_bias, [t.double() for t in (x, weight, bias, a)], grad.double())
    lowp = _run(reference.dt_bias, (x, weight, bias, a), grad)
    for name, g, w, e in zip(("out", "dx", "dweight", "dbias", "dA"), got, want, lowp):
        assert_close(g.double(), w, low_precision_bound(w, e.double(), torch.bfloat16), name)


def test_strided_inputs_and_gradient():
    """x as a view with its own strides (the layer passes v.flatten(2) of a projection's view)
    and a gradient that is not contiguous."""
    x, weight, bias, a = _inputs(2, 33, 24, 4, torch.float32)
    wide = torch.randn(2, 33, 2 * 24, device=DEVICE)
    x = wide[..., ::2]
    grad = torch.randn(2, 33, 4, device=DEVICE).transpose(1, 2).unsqueeze(2)
    assert not x.is_contiguous() and not grad.is_contiguous()
    _check((x, weight, bias, a), grad, torch.float32)


def test_extreme_logits_stay_exact_and_finite():
    """Logits far above softplus's threshold (20) and far below zero (softplus ~ exp(z), which
    log(1 + exp(z)) would round to 0 in float32): the bias and gradients match the oracle,
    with no NaN or Inf."""
    x, weight, bias, a = _inputs(1, 64, 16, 4, torch.float32)
    bias = torch.tensor([60.0, -40.0, 19.5, -90.0], device=DEVICE)
    grad = torch.randn(1, 4, 1, 64, device=DEVICE)
    _check((x, weight, bias, a), grad, torch.float32)
    out = dt_bias(x, weight, bias, a)
    assert torch.isfinite(out).all()
    assert (out[:, 1] > 0).all() and (out[:, 3] > 0).all()  # exp(-40) * A, exp(-90) * A


def test_no_token_and_no_channel():
    x, weight, bias, a = (t.requires_grad_() for t in _inputs(2, 0, 8, 3, torch.float32))
    out = dt_bias(x, weight, bias, a)
    assert out.shape == (2, 3, 1, 0)
    out.sum().backward()
    assert (weight.grad == 0).all() and (bias.grad == 0).all() and (a.grad == 0).all()
    inputs = _inputs(2, 7, 0, 3, torch.float32)
    _check(inputs, torch.randn(2, 3, 1, 7, device=DEVICE), torch.float32)


def test_bad_shapes_are_named():
    x, weight, bias, a = _inputs(1, 8, 16, 2, torch.float32)
    with pytest.raises(ValueError, match=r"weight \(Hkv, C\)"):
        dt_bias(x, weight[:, :8], bias, a)
    with pytest.raises(ValueError, match="bias and A must be"):
        dt_bias(x, weight, bias[:1], a)


def test_opcheck():
    x, weight, bias, a = _inputs(2, 20, 16, 2, torch.bfloat16)
    args = (x.requires_grad_(), weight.requires_grad_(), bias.requires_grad_(), a.requires_grad_())
    torch.library.opcheck(torch.ops.dmattn.dt_bias.default, args)
    out, logits = torch.ops.dmattn.dt_bias(*args)
    grad = torch.randn_like(out)
    torch.library.opcheck(
        torch.ops.dmattn.dt_bias_backward.default, (grad, x.detach(), weight.detach(),
                                                    a.detach(), logits)
    )  # fmt: skip


def test_values_hand_x_on_and_sum_its_gradients_in_the_kernel():
    """dt_bias_values: values equal x bit for bit, and x's gradient, from the bias and from a
    second consumer of values (as the layer's attention), is the sum the backward kernel
    forms: against the float64 oracle of the same function with x used twice, within twice
    the error of the oracle's formula run in the dtype (whose sum autograd rounds twice)."""
    for dtype in (torch.float32, torch.bfloat16):
        inputs = _inputs(2, 70, 48, 4, dtype)
        grad = torch.randn(2, 4, 1, 70, device=DEVICE)
        grad_values = torch.randn(2, 70, 48, device=DEVICE)

        def oracle(x, weight, bias, a):
            return reference.dt_bias(x, weight, bias, a), x

        results = []
        for fn, cast in ((dt_bias_values, None), (oracle, torch.float64), (oracle, None)):
            leaves = [t.detach().clone().to(cast or t.dtype).requires_grad_() for t in inputs]
            out, values = fn(*leaves)
            assert values.shape == leaves[0].shape and values.dtype == leaves[0].dtype
            assert torch.equal(values, leaves[0].detach())
            torch.autograd.backward(
                (out, values), (grad.to(out.dtype), grad_values.to(values.dtype))
            )  # fmt: skip
            results.append([out.detach()] + [t.grad for t in leaves])
        got, want, lowp = results
        for name, g, w, e in zip(("out", "dx", "dweight", "dbias", "dA"), got, want, lowp):
            assert g.dtype == e.dtype and g.shape == w.shape, name
            assert_close(g.double(), w, low_precision_bound(w, e.double(), dtype), name)


def test_values_op_passes_opcheck():
    x, weight, bias, a = _inputs(2, 20, 16, 2, torch.bfloat16)
    args = (x.requires_grad_(), weight.requires_grad_(), bias.requires_grad_(), a.requires_grad_())
    torch.library.opcheck(torch.ops.dmattn.dt_bias_values.default, args)
    out, logits, values = torch.ops.dmattn.dt_bias_values(*args)
    grad, gv = torch.randn_like(out), torch.randn_like(values).transpose(0, 1).contiguous()
    torch.library.opcheck(
        torch.ops.dmattn.dt_bias_backward.default,
        (grad, x.detach(), weight.detach(), a.detach(), logits, gv.transpose(0, 1)),
    )  # fmt: skip
    with pytest.raises(ValueError, match="grad_values must have x's shape"):
        torch.ops.dmattn.dt_bias_backward(grad, x.detach(), weight.detach(), a.detach(), logits,
                                          gv)  # fmt: skip


def test_torch_func_takes_the_pytorch_form_with_the_same_gradients():
    """Inside torch.func transforms dt_bias computes in PyTorch (the op has no vmap or
    functorch rule); its gradients equal the op's."""
    inputs = _inputs(2, 24, 32, 4, torch.float32)
    grad = torch.randn(2, 4, 1, 24, device=DEVICE)

    def loss(*inputs):
        return (dt_bias(*inputs) * grad).sum()

    via_func = torch.func.grad(loss, argnums=(0, 1, 2, 3))(*inputs)
    with torch.profiler.profile() as prof:
        via_op = _run(dt_bias, inputs, grad)[1:]
    assert any(e.name == "dmattn::dt_bias" for e in prof.events())
    for name, g, w in zip(("dx", "dweight", "dbias", "dA"), via_op, via_func):
        # Two float32 computations of one function (summation orders differ).
        assert_close(g.double(), w.double(), 1e-5 * max(1.0, w.abs().max().item()), name)


@pytest.mark.gpu
def test_compiled_graph_launches_the_kernels():
    """In a compiled training step the op's kernels are traced into the graph (one launch
    each way), not run as an opaque op."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    inputs = [t.requires_grad_() for t in _inputs(2, 64, 32, 4, torch.bfloat16)]

    def step(*inputs):
        return dt_bias(*inputs).float().square().sum()

    compiled = torch.compile(step, fullgraph=True)
    _, codes = run_and_get_code(lambda: compiled(*inputs).backward())
    code = "\n".join(codes)
    assert "dt_bias_fwd_kernel" in code and "dt_bias_bwd_kernel" in code
    assert "torch.ops.dmattn.dt_bias" not in code
    grads = [t.grad.clone() for t in inputs]
    for t in inputs:
        t.grad = None
    step(*inputs).backward()
    for g, t in zip(grads, inputs):
        # The same kernels; only the parts' final float32 sums may add in another order.
        assert_close(g.double(), t.grad.double(), 1e-6 * t.grad.abs().max().item(), "grad")


def test_layer_takes_the_op_by_default(monkeypatch):
    """By default DynamicMaskAttention computes its bias through dmattn::dt_bias_values (not for
    dynamic_mask's public form, which a flex mask_mod may capture); output and every parameter
    gradient stay within fp32's own error against the float64 oracle layer, eager and
    compiled. fp32's own error is the larger of the PyTorch layer's (backend "reference") and
    the same layer's with the bias in PyTorch: the op is tested for what it adds. (On an H200
    the Triton attention's gradients, each within its own bound in the attention's tests, came
    a few ulps past twice the PyTorch layer's once the layer summed them over the tokens: A's
    gradient 4.2e-6 and 4.8e-6 against bounds of 3.7e-6 with this layer at seeds 1 and 2; the
    op's 3.0e-6 and 3.6e-6.)"""
    from dmattn_ops.nn import DynamicMaskAttention

    monkeypatch.delenv("DMATTN_DT_BIAS", raising=False)
    torch.manual_seed(0)
    layer = DynamicMaskAttention(32, 4, 2, window=12).to(DEVICE)
    oracle = DynamicMaskAttention(32, 4, 2, window=12, backend="reference").to(DEVICE)
    oracle.load_state_dict(layer.state_dict())
    fp32 = DynamicMaskAttention(32, 4, 2, window=12, backend="reference").to(DEVICE)
    fp32.load_state_dict(layer.state_dict())
    oracle.double()
    x = torch.randn(2, 40, 32, device=DEVICE)

    def run(module, x):
        for p in module.parameters():
            p.grad = None
        with torch.profiler.profile() as prof:
            out = module(x)
            (out * torch.cos(out)).sum().backward()
        # Eagerly the op's own event; compiled on CUDA, its kernels traced into the graph.
        used = any(
            e.name in ("dmattn::dt_bias_values", "dt_bias_fwd_kernel") for e in prof.events()
        )
        return [out.detach()] + [p.grad.clone() for p in module.parameters()], used

    want, _ = run(oracle, x.double())
    with monkeypatch.context() as m:
        m.setenv("DMATTN_DT_BIAS", "0")
        lowp, _ = run(fp32, x)
        plain, used = run(layer, x)
        assert not used
    names = ["out"] + [name for name, _ in layer.named_parameters()]
    torch._dynamo.reset()
    for module in (layer, torch.compile(layer, fullgraph=True)):
        got, used = run(module, x)
        assert used
        for name, g, w, e, p in zip(names, got, want, lowp, plain):
            base = max(e, p, key=lambda t: max_err(t, w))
            assert_close(g.double(), w, low_precision_bound(w, base.double(), torch.float32), name)
    v = layer.v_proj(x).view(2, 40, 2, 8)
    with torch.profiler.profile() as prof:
        layer.dynamic_mask(v)
    assert not any(e.name.startswith("dmattn::dt_bias") for e in prof.events())


COMPILE = """
import triton
from helpers import compile_for_gpu

from dmattn_ops.kernels.dt_bias import dt_bias_bwd_kernel, dt_bias_fwd_kernel

TYPES = dict(X="*bf16", W="*fp32", C="*fp32", A="*fp32", OUT="*bf16", LOGITS="*fp32",
             GRAD="*bf16", DX="*bf16", PARTS="*fp32", VALUES="*bf16", GRAD_V="*bf16", **{
                 f"stride_{o}{d}": "i64" for o in "gxv" for d in ("b", "h", "l", "c")})

for kernel, h, block_t, block_c, warps in (
    (dt_bias_fwd_kernel, 4, 64, 64, 4), (dt_bias_fwd_kernel, 3, 16, 512, 4),
    (dt_bias_bwd_kernel, 4, 32, 64, 4), (dt_bias_bwd_kernel, 1, 64, 256, 8),
    (dt_bias_bwd_kernel, 16, 8, 64, 4),
):
    values = dict(H=h, BLOCK_H=triton.next_power_of_2(h), BLOCK_T=block_t, BLOCK_C=block_c)
    for cc in (90, 80):
        # The values' copy and gradient (dt_bias_values) on both, without them on sm_90.
        for flag in (False, True) if cc == 90 else (True,):
            values.update(COPY=flag, HAS_GRAD_V=flag)
            compile_for_gpu(kernel, values, TYPES, cc, warps)
            params = dict(TYPES, W="*bf16", C="*bf16", A="*bf16")
            compile_for_gpu(kernel, values, params, cc, warps)
print("ok")
"""


@pytest.mark.sweep
def test_kernels_compile_for_sm90_and_sm80():
    """Both kernels compile for the GPUs the README names, without a GPU and without the
    interpreter (tiles bench.glue sweeps, Hkv 1, 3 and 4)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", COMPILE], capture_output=True, text=True,
                         env=env, cwd=os.path.dirname(__file__), timeout=600)  # fmt: skip
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-3000:]
