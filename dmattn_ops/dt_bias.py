"""The DMA layer's learned bias as one op: ``bias = A * softplus(x @ W^T + c)``, per token and
KV head, laid out (B, Hkv, 1, L) for the attention it feeds (nn.DynamicMaskAttention).

Written in PyTorch, this is a product with Hkv (4) columns, a softplus, a scale, a transpose
and a cast: under torch.compile Inductor fuses them into reductions that ran 5-10x below the
memory bandwidth on an H200 (61 us forward+backward per layer at 8192 tokens, about 3% of the
model benchmark's B16 L512 step), and as cuBLAS calls no less (67 us). Here a forward kernel
reads x once and writes the bias and the float32 logits the backward needs; a backward kernel
reads x once more, writes dx and per-program parts of dW, dc and dA into one buffer, which one
sum finishes in the parameters' dtype (kernels/dt_bias.py). Both read the parameters in their
own dtype: no cast is launched for them.

``dmattn::dt_bias`` and ``dmattn::dt_bias_backward`` are custom ops with fake kernels and an
autograd formula; compiled graphs trace their launches (registration/inductor.py).
``dmattn::dt_bias_values`` (what the layer calls) also returns the values, a copy of x the
forward kernel writes as it reads x; the layer's attention takes it in x's place, and its
backward passes the attention's dV to dt_bias_backward, whose kernel adds it to dx. Autograd
would otherwise sum x's two gradients in a kernel of its own: in bench.model's compiled B16
L512 step (H200) that was one of the 10 launches a DMA layer issued beyond SDPA's, in a step
bound by its host's launches (~12-23 us of host each); the backward graph's launches went
from 32 to 28, the copy costs the forward a store of x and no launch. Where
Triton does not run (CPU without the interpreter, float64, inside torch.func transforms),
`dt_bias` computes the same function in PyTorch.

DynamicMaskAttention takes it unless ``DMATTN_DT_BIAS=0`` or its backend is flex: in a
compiled graph whose FlexAttention score_mod captured the op's output, Inductor read the traced
buffer as unwritten (NaN), the topk_select case of inductor.py's docstring. On an H200 (Triton
3.6, x (8192, 512) bf16, Hkv 4, `python -m bench.glue`) forward and backward take 36 us of
kernels against 61 for Inductor's kernels of the PyTorch form (119 against 194 at 32768
tokens). The first kernels (e0fe785) were right in Triton's interpreter and wrong on the H200:
dx, a sum over a 3-D tile's heads' axis of 4 elements, which Triton 3.6 sums wrong
(`bench.glue --probe`); these sum over no such axis.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from dmattn_ops.core.device import cdiv, next_power_of_2, symbolic
from dmattn_ops.dispatch import plan
from dmattn_ops.executors._alloc import empty
from dmattn_ops.executors._triton import LazyKernel
from dmattn_ops.registration import inductor


def _kernels() -> tuple:
    from dmattn_ops.kernels import dt_bias

    return (dt_bias,)


dt_bias_fwd_kernel = LazyKernel(_kernels, "dt_bias_fwd_kernel")
dt_bias_bwd_kernel = LazyKernel(_kernels, "dt_bias_bwd_kernel")


class Tiles(NamedTuple):
    """A kernel's tiles: the tokens and channels of one step's x tile, its warps, and (the
    backward) the most programs along the tokens, whose float32 dW parts (groups x Hkv x C)
    the caller sums. `python -m bench.glue --sweep` times candidates."""

    block_t: int
    block_c: int
    num_warps: int = 4
    groups: int = 64


# bench.glue --sweep on an H200 (Triton 3.6; forward of f1d799b, x (32768, 512) bf16, Hkv 4):
# 64 x 64 at 4 warps 13 us, the best of nine; 32 x 64 (the first guess) 17 us.
FORWARD_TILES = Tiles(64, 64, 4)
BACKWARD_TILES = Tiles(32, 64, 4, 128)


def dt_bias(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, A: torch.Tensor,
    *, kernel: bool = True,
) -> torch.Tensor:  # fmt: skip
    """``(A * softplus(x @ weight.T + bias)).transpose(1, 2).unsqueeze(2)`` in x's dtype,
    computed in float32 (x's dtype where wider) and rounded once.

    Args:
        x: (B, L, C) floating, the tokens' features (the layer's value states).
        weight: (Hkv, C), bias: (Hkv,), A: (Hkv,): the layer's dt_proj and A parameters.
        kernel: through the op dmattn::dt_bias where Triton runs (module docstring); False:
            the PyTorch form (`pytorch_form`) everywhere.

    Returns:
        (B, Hkv, 1, L) in x's dtype. Differentiable in all four inputs.
    """
    if _takes_op(x, kernel):
        return torch.ops.dmattn.dt_bias(x, weight, bias, A)[0]  # the op checks the shapes
    _check(x, weight, bias, A)
    return pytorch_form(x, weight, bias, A)


def dt_bias_values(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, A: torch.Tensor,
    *, kernel: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(dt_bias(x, ...), values): values equal x, for the layer to hand on to its attention in
    x's place. Through the op dmattn::dt_bias_values, values is a copy the forward kernel
    writes as it reads x, and x's gradient (the attention's dV through values, plus the
    bias's part) is summed in the backward kernel, one launch fewer per layer in a compiled
    step than autograd's separate sum of the two. Without the op (`dt_bias`'s conditions),
    values is x itself.

    Args and shapes as `dt_bias`; values (B, L, C) contiguous in x's dtype."""
    if _takes_op(x, kernel):
        out, _, values = torch.ops.dmattn.dt_bias_values(x, weight, bias, A)
        return out, values
    _check(x, weight, bias, A)
    return pytorch_form(x, weight, bias, A), x


def _takes_op(x: torch.Tensor, kernel: bool) -> bool:
    """Whether dt_bias / dt_bias_values run through their op: asked for, where Triton runs,
    and outside torch.func transforms (the op has no functorch rule)."""
    return kernel and plan.use_triton(x) and not torch._C._are_functorch_transforms_active()


def pytorch_form(x, weight, bias, A) -> torch.Tensor:
    """dt_bias in PyTorch. Under torch.compile the product with weight is written as a sum of
    products, which Inductor fuses with the softplus into one reduction kernel (and the
    gradients into reductions it fuses with their neighbours), instead of a cuBLAS call with Hkv
    (4) columns: in a compiled training step those calls (one forward, two backward per layer)
    cost the host more than the GPU time they save. Eagerly the sum of products would
    materialise (B, L, Hkv, C), so eager calls keep F.linear (a compile backend that does not
    fuse, such as "aot_eager", materialises it too)."""
    dtype = torch.promote_types(x.dtype, torch.float32)
    w, c, a = (t.to(dtype) for t in (weight, bias, A))
    xf = x.to(dtype)
    if torch.compiler.is_compiling():
        logits = (xf[..., None, :] * w).sum(-1) + c
    else:
        logits = F.linear(xf, w, c)
    return (a * F.softplus(logits)).transpose(1, 2).unsqueeze(2).to(x.dtype)


def _meta(h: int, ch: int, tiles: Tiles, backward: bool = False) -> dict:
    """The kernels' constexprs and warps: the heads (unrolled) and their power-of-two block,
    and the x tile (its channels no wider than C's power of two). The backward's dW tile holds
    block_t x heads x block_c float32 products in registers (kernels/dt_bias.py), so its
    tokens shrink as the heads' block grows past 4."""
    block_h = next_power_of_2(h)
    block_c = min(tiles.block_c, max(16, next_power_of_2(ch)))
    block_t = tiles.block_t
    if backward:
        block_t = max(1, min(block_t, 4 * block_t // block_h))
    return dict(H=h, BLOCK_H=block_h, BLOCK_T=block_t, BLOCK_C=block_c,
                num_warps=tiles.num_warps)  # fmt: skip


def _params_dtype(weight: torch.Tensor, A: torch.Tensor) -> torch.dtype:
    """The dtype of the backward's summed parameter gradients: the parameters' own where
    weight and A share it (each cast in the autograd formula is then no kernel; the bias
    almost always shares it too), float32 where they differ."""
    return weight.dtype if A.dtype == weight.dtype else torch.float32


def split_params(dparams: torch.Tensor, h: int, ch: int) -> tuple:
    """(dweight (Hkv, C), dbias (Hkv,), dA (Hkv,)): views of the backward's flat dparams."""
    return dparams[: h * ch].view(h, ch), dparams[h * ch : h * ch + h], dparams[h * ch + h :]


def _forward(x, weight, bias, A, tiles: Tiles = FORWARD_TILES, values: bool = False):
    """dmattn::dt_bias's CUDA (and interpreter) kernel: (bias (B, Hkv, 1, L), logits (B, L,
    Hkv) float32), and with `values` (dmattn::dt_bias_values) the copy of x the kernel
    writes as it reads it. Compiled graphs trace it (registration/inductor.py)."""
    b, length, ch = x.shape
    h = weight.shape[0]
    out = empty((b, h, 1, length), x.dtype, device=x.device)
    logits = empty((b, length, h), torch.float32, device=x.device)
    copy = empty(x.shape, x.dtype, device=x.device) if values else None
    n = b * length
    if n > 0:
        w, c, a = (t.contiguous() for t in (weight, bias, A))
        dt_bias_fwd_kernel[(cdiv(n, tiles.block_t),)](
            x, w, c, a, out, logits, copy, *x.stride(), length, n, ch,
            **_meta(h, ch, tiles), COPY=values,
        )  # fmt: skip
    return (out, logits) if copy is None else (out, logits, copy)


def _forward_values(x, weight, bias, A):
    return _forward(x, weight, bias, A, values=True)


def _backward(grad, x, weight, A, logits, grad_values=None, tiles: Tiles = BACKWARD_TILES):
    """dmattn::dt_bias_backward's kernel: (dx in x's dtype, dparams (Hkv * C + 2 * Hkv,): dW,
    dc and dA summed in float32 and rounded once to _params_dtype; split_params takes them
    apart). The kernel writes float32 parts of all three into one buffer, so one reduction
    (with its cast, which Inductor fuses into it) finishes them. grad_values (B, L, C), the
    gradient of dt_bias_values' values, joins dx in the kernel. Compiled graphs trace it."""
    b, length, ch = x.shape
    h = weight.shape[0]
    n = b * length
    dtype = _params_dtype(weight, A)
    dx = empty(x.shape, x.dtype, device=x.device)
    if n == 0 or ch == 0:  # (and then grad_values, if any, holds no element either)
        dca = torch.zeros((2, h), dtype=torch.float32, device=x.device)
        if n > 0:  # no channel: every logit is its head's c; dc and dA still sum the tokens
            g = grad.to(torch.float32).squeeze(2)  # (B, H, L)
            z = logits.transpose(1, 2)
            dz = g * A.detach().float()[:, None] * torch.sigmoid(z)
            dca = torch.stack((dz.sum((0, 2)), (g * F.softplus(z)).sum((0, 2))))
        dw = torch.zeros(h * ch, dtype=torch.float32, device=x.device)
        return dx, torch.cat((dw, dca.flatten())).to(dtype)
    meta = _meta(h, ch, tiles, backward=True)
    tokens = meta["BLOCK_T"] * cdiv(n, meta["BLOCK_T"] * tiles.groups)
    # With a symbolic token count (a compiled graph with dynamic shapes) every group runs,
    # those past the last token writing zero parts: a count that may be 1 would be guarded on
    # (tiles.py _per_query_tile says why).
    groups = tiles.groups if symbolic(n) else cdiv(n, tokens)
    parts = empty((groups, h * ch + 2 * h), torch.float32, device=x.device)
    w, a = weight.contiguous(), A.contiguous()
    gv = grad_values
    dt_bias_bwd_kernel[(groups, cdiv(ch, meta["BLOCK_C"]))](
        grad, x, w, a, logits, dx, parts, gv, *grad.stride()[:2], grad.stride(3),
        *x.stride(), *(gv.stride() if gv is not None else (0, 0, 0)), length, n, ch, tokens,
        **meta, HAS_GRAD_V=gv is not None,
    )  # fmt: skip
    return dx, parts.sum(0).to(dtype)


def _check(x, weight, bias, A):
    if x.dim() != 3 or weight.dim() != 2 or weight.shape[1] != x.shape[2]:
        raise ValueError(
            f"dmattn.dt_bias: x must be (B, L, C) and weight (Hkv, C); got {tuple(x.shape)} "
            f"and {tuple(weight.shape)}"
        )
    h = weight.shape[0]
    if bias.shape != (h,) or A.shape != (h,):
        raise ValueError(
            f"dmattn.dt_bias: bias and A must be ({h},); got {tuple(bias.shape)} and "
            f"{tuple(A.shape)}"
        )


@torch.library.custom_op("dmattn::dt_bias", mutates_args=())
def _dt_bias_op(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, A: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(bias (B, Hkv, 1, L) in x's dtype, logits (B, L, Hkv) float32, kept for the backward)."""
    _check(x, weight, bias, A)
    return _forward(x, weight, bias, A)


def _fake(x, weight, bias, A, values: bool = False) -> tuple:
    """The forward ops' outputs on fake tensors: (bias, logits), and values with `values`."""
    _check(x, weight, bias, A)
    b, length, _ = x.shape
    h = weight.shape[0]
    out = (x.new_empty((b, h, 1, length)), x.new_empty((b, length, h), dtype=torch.float32))
    return (*out, torch.empty_like(x, memory_format=torch.contiguous_format)) if values else out


@_dt_bias_op.register_fake
def _(x, weight, bias, A):
    return _fake(x, weight, bias, A)


@torch.library.custom_op("dmattn::dt_bias_values", mutates_args=())
def _dt_bias_values_op(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, A: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dmattn::dt_bias's (bias, logits) and values, x's copy (B, L, C) contiguous, which
    dt_bias_values hands on in x's place."""
    _check(x, weight, bias, A)
    return _forward_values(x, weight, bias, A)


@_dt_bias_values_op.register_fake
def _(x, weight, bias, A):
    return _fake(x, weight, bias, A, values=True)


@torch.library.custom_op("dmattn::dt_bias_backward", mutates_args=())
def _dt_bias_backward_op(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, A: torch.Tensor,
    logits: torch.Tensor, grad_values: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(dx in x's dtype, with grad_values (B, L, C), if given, added; dparams (Hkv * C + 2 *
    Hkv,): dweight, dbias and dA, flat (split_params), in weight's dtype where A shares it,
    else float32)."""
    if grad_values is not None and grad_values.shape != x.shape:
        raise ValueError(
            f"dmattn.dt_bias: grad_values must have x's shape {tuple(x.shape)}; got "
            f"{tuple(grad_values.shape)}"
        )
    return _backward(grad, x, weight, A, logits, grad_values)


@_dt_bias_backward_op.register_fake
def _(grad, x, weight, A, logits, grad_values=None):
    h, ch = weight.shape
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)
    return dx, x.new_empty((h * ch + 2 * h,), dtype=_params_dtype(weight, A))


def _setup(ctx, inputs, output):
    x, weight, _, A = inputs
    # dt_bias_values' values equal x: the backward reads them, and x itself need not be kept.
    ctx.save_for_backward(output[2] if len(output) == 3 else x, weight, A, output[1])
    ctx.dtypes = tuple(t.dtype for t in inputs)
    ctx.mark_non_differentiable(output[1])


def _grads(ctx, grad, _grad_logits, grad_values=None):
    x, weight, A, logits = ctx.saved_tensors
    dx, dparams = torch.ops.dmattn.dt_bias_backward(grad, x, weight, A, logits, grad_values)
    grads = (dx, *split_params(dparams, *weight.shape))
    return tuple(g.to(dtype) for g, dtype in zip(grads, ctx.dtypes))


_dt_bias_op.register_autograd(_grads, setup_context=_setup)
_dt_bias_values_op.register_autograd(_grads, setup_context=_setup)
inductor.trace_into_graphs(torch.ops.dmattn.dt_bias.default, _forward)
inductor.trace_into_graphs(torch.ops.dmattn.dt_bias_values.default, _forward_values)
inductor.trace_into_graphs(torch.ops.dmattn.dt_bias_backward.default, _backward)
inductor.key_compiled_graphs_on_fingerprint()
