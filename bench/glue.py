"""The DMA layer's bias glue: ``python -m bench.glue [--tokens 8192,32768]``.

``bias = A * softplus(x @ W^T + c)``, laid out (B, Hkv, 1, L), and its gradients, as
DynamicMaskAttention computes it (x: the value states, (B, L, Hkv * D) bf16; Hkv 4, D 128),
compiled fullgraph, forward+backward, with x's gradient also coming from another use (as v's
does from the attention). Forms: "pytorch" (the sum of products nn.py writes, fused by
Inductor), "linear" (F.linear, cuBLAS), "op" (dmattn::dt_bias, kernels/dt_bias.py). Prints
each form's kernels (profiler device time per step, largest first), their sum, and each
gradient's largest error against float64 relative to its largest value. ``--sweep``: the
op's forward and backward kernels alone, eagerly, for candidate tiles (dt_bias.Tiles), each
kernel's device time and its results' largest error against float64. ``--probe``: whether
this Triton sums a 3-D register tile over its middle axis of 4 (heads) right, the pattern of
the first dt_bias kernels, whose dx was wrong on an H200 under Triton 3.6 (`reduction_probe`).
CUDA only.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from bench.__main__ import header
from bench.tables import markdown
from bench.timeline import kernel_times

HKV, WIDTH = 4, 512


def _pytorch(x, w, c):
    return (x.float()[..., None, :] * w).sum(-1) + c


def _linear(x, w, c):
    return F.linear(x.float(), w, c)


def _layer(form: str):
    from dmattn_ops.dt_bias import dt_bias

    def layer(x, w, c, a):
        if form == "op":
            bias = dt_bias(x, w, c, a)
        else:
            logits = (_pytorch if form == "pytorch" else _linear)(x, w, c)
            bias = (a * F.softplus(logits)).transpose(1, 2).unsqueeze(2).to(x.dtype)
        return bias, x * 2  # x's other use, whose gradient adds to the glue's

    return layer


def run(form: str, tokens: int):
    """(kernel rows, relative errors of dx, dW, dc, dA) of one form at B1 L`tokens`."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1, tokens, WIDTH, device="cuda", generator=g).bfloat16().requires_grad_()
    w = (torch.randn(HKV, WIDTH, device="cuda", generator=g) / WIDTH**0.5).requires_grad_()
    c = torch.randn(HKV, device="cuda", generator=g).requires_grad_()
    a = (torch.rand(HKV, device="cuda", generator=g) + 0.5).requires_grad_()
    grads = (
        torch.randn(1, HKV, 1, tokens, device="cuda", generator=g).bfloat16(),
        torch.randn(x.shape, device="cuda", generator=g).bfloat16(),
    )
    torch._dynamo.reset()
    compiled = torch.compile(_layer(form), fullgraph=True)

    def step():
        for t in (x, w, c, a):
            t.grad = None
        torch.autograd.backward(compiled(x, w, c, a), grads)

    rows = kernel_times(step)
    leaves = [t.detach().double().requires_grad_() for t in (x, w, c, a)]
    logits = F.linear(leaves[0], leaves[1], leaves[2])
    want = (leaves[3] * F.softplus(logits)).transpose(1, 2).unsqueeze(2)
    torch.autograd.backward((want, leaves[0] * 2), tuple(t.double() for t in grads))
    step()
    errors = [
        ((t.grad.double() - r.grad).abs().max() / r.grad.abs().max()).item()
        for t, r in zip((x, w, c, a), leaves)
    ]
    return rows, errors


FORWARD_CANDIDATES = [(64, 64, 4), (32, 64, 4), (128, 64, 8), (64, 128, 8), (32, 256, 8)]
BACKWARD_CANDIDATES = [(32, 64, 4, 128), (16, 64, 4, 128), (32, 32, 4, 128), (32, 64, 4, 256),
                       (16, 128, 4, 128), (64, 64, 8, 128), (32, 128, 8, 64), (16, 64, 2, 256),
                       (32, 64, 4, 64)]  # fmt: skip


def sweep(tokens: int) -> list[list]:
    """Rows (tokens, kernel, tiles, us, largest relative error, why it failed) of the op's
    kernels for each candidate tile set."""
    import triton

    from dmattn_ops import dt_bias as op

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1, tokens, WIDTH, device="cuda", generator=g).bfloat16()
    w = torch.randn(HKV, WIDTH, device="cuda", generator=g) / WIDTH**0.5
    c = torch.randn(HKV, device="cuda", generator=g)
    a = torch.rand(HKV, device="cuda", generator=g) + 0.5
    grad = torch.randn(1, HKV, 1, tokens, device="cuda", generator=g).bfloat16()
    leaves = [t.double().requires_grad_() for t in (x, w, c, a)]
    want = (leaves[3] * F.softplus(F.linear(*leaves[:3]))).transpose(1, 2).unsqueeze(2)
    want.backward(grad.double())
    rows = []

    def error(got, ref):
        return ((got.double() - ref).abs().max() / ref.abs().max()).item()

    logits = op._forward(x, w, c, a)[1]
    for cand in FORWARD_CANDIDATES:
        tiles = op.Tiles(*cand)
        try:
            out = op._forward(x, w, c, a, tiles)[0]
        except triton.runtime.errors.OutOfResources as e:  # a tile set too large is a row
            rows.append([tokens, "forward", str(cand), None, None, str(e)[:40]])
            continue
        us = _kernel_us(lambda t=tiles: op._forward(x, w, c, a, t), "dt_bias_fwd_kernel")
        rows.append([tokens, "forward", str(cand), us, error(out, want.detach()), ""])
    for cand in BACKWARD_CANDIDATES:
        tiles = op.Tiles(*cand)
        try:
            dx, dparams = op._backward(grad, x, w, a, logits, tiles=tiles)
            dw, dc, da = op.split_params(dparams, HKV, WIDTH)
        except triton.runtime.errors.OutOfResources as e:
            rows.append([tokens, "backward", str(cand), None, None, str(e)[:40]])
            continue
        errors = [error(dx, leaves[0].grad), error(dw, leaves[1].grad),
                  error(dc, leaves[2].grad), error(da, leaves[3].grad)]  # fmt: skip
        us = _kernel_us(lambda t=tiles: op._backward(grad, x, w, a, logits, tiles=t),
                        "dt_bias_bwd_kernel")  # fmt: skip
        rows.append([tokens, "backward", str(cand), us, max(errors), ""])
    return rows


def reduction_probe() -> list[list]:
    """Rows (pattern, heads, largest error against float64) of a kernel computing, for a
    (T, H) tile a, an (H, C) tile w and a (T, C) tile x, both sums the first dt_bias backward
    took: over the heads' axis, sum(a[:, :, None] * w[None, :, :], axis=1), and over the
    tokens', sum(a[:, :, None] * x[:, None, :], axis=0); and the one a forward accumulating
    a 3-D tile would take, over the channels' (last) axis, sum(x[:, None, :] * w[None, :, :],
    axis=2)."""
    import triton
    import triton.language as tl

    @triton.jit
    def probe(A, W, X, OUT_HEADS, OUT_TOKENS, OUT_CHANNELS, T: tl.constexpr, H: tl.constexpr,
              C: tl.constexpr):  # fmt: skip
        t, h, c = tl.arange(0, T), tl.arange(0, H), tl.arange(0, C)
        a = tl.load(A + t[:, None] * H + h[None, :])
        w = tl.load(W + h[:, None] * C + c[None, :])
        x = tl.load(X + t[:, None] * C + c[None, :])
        tl.store(OUT_HEADS + t[:, None] * C + c[None, :], tl.sum(a[:, :, None] * w[None, :, :], 1))
        tl.store(OUT_TOKENS + h[:, None] * C + c[None, :], tl.sum(a[:, :, None] * x[:, None, :], 0))
        tl.store(OUT_CHANNELS + t[:, None] * H + h[None, :],
                 tl.sum(x[:, None, :] * w[None, :, :], 2))  # fmt: skip

    rows = []
    for heads in (1, 2, 4, 8):
        t_, c_ = 32, 64
        a, w, x = (torch.randn(*shape, device="cuda") for shape in
                   ((t_, heads), (heads, c_), (t_, c_)))  # fmt: skip
        out_heads = torch.empty(t_, c_, device="cuda")
        out_tokens = torch.empty(heads, c_, device="cuda")
        out_channels = torch.empty(t_, heads, device="cuda")
        probe[(1,)](a, w, x, out_heads, out_tokens, out_channels, T=t_, H=heads, C=c_)
        for name, got, want in (("sum over heads (axis 1)", out_heads, a.double() @ w.double()),
                                ("sum over tokens (axis 0)", out_tokens,
                                 a.double().T @ x.double()),
                                ("sum over channels (axis 2)", out_channels,
                                 x.double() @ w.double().T)):  # fmt: skip
            rows.append([name, heads, (got.double() - want).abs().max().item()])
    return rows


def _kernel_us(fn, name: str) -> float:
    return sum(ms for kernel, ms, _ in kernel_times(fn) if kernel == name) * 1e3


def main(argv=None) -> int:
    """The command line (module docstring): the forms' table, or --sweep's, or --probe's."""
    parser = argparse.ArgumentParser(prog="python -m bench.glue", description=__doc__)
    parser.add_argument("--tokens", default="8192,32768")
    parser.add_argument("--forms", default="pytorch,linear,op")
    parser.add_argument("--sweep", action="store_true", help="the op's kernels per tile set")
    parser.add_argument("--probe", action="store_true", help="Triton's sums over a small axis")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.glue needs a CUDA device")
        return 1
    print(header())
    if args.probe:
        headers = ["pattern", "heads", "largest error"]
        print(markdown(headers, reduction_probe(), ("", "", ".1e")))
        return 0
    if args.sweep:
        rows = [row for tokens in map(int, args.tokens.split(",")) for row in sweep(tokens)]
        headers = ["tokens", "kernel", "tiles", "us", "largest rel. error", "failed"]
        print(markdown(headers, rows, ("", "", "", ".1f", ".1e", "")))
        return 0
    table = []
    for tokens in map(int, args.tokens.split(",")):
        for form in args.forms.split(","):
            rows, errors = run(form, tokens)
            total = sum(ms for _, ms, _ in rows) * 1e3
            launches = sum(n for _, _, n in rows)
            print(f"== {form}, {tokens} tokens: {total:.1f} us of kernels, {launches} launches")
            for name, ms, n in rows[:8]:
                print(f"    {ms * 1e3:7.1f} us x{n} {name[:90]}")
            table.append([tokens, form, total, launches, *errors])
    print()
    headers = ["tokens", "form", "kernel us", "launches", "dx err", "dW err", "dc err", "dA err"]
    print(markdown(headers, table, ("", "", ".1f", "", ".1e", ".1e", ".1e", ".1e")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
