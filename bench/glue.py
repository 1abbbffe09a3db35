"""The DMA layer's bias glue: ``python -m bench.glue [--tokens 8192,32768]``.

``bias = A * softplus(x @ W^T + c)``, laid out (B, Hkv, 1, L), and its gradients, as
DynamicMaskAttention computes it (x: the value states, (B, L, Hkv * D) bf16; Hkv 4, D 128),
compiled fullgraph, forward+backward, with x's gradient also coming from another use (as v's
does from the attention). Forms: "pytorch" (the sum of products nn.py writes, fused by
Inductor), "linear" (F.linear, cuBLAS), "op" (dmattn::dt_bias, kernels/dt_bias.py). Prints
each form's kernels (profiler device time per step, largest first), their sum, and each
gradient's largest error against float64 relative to its largest value. CUDA only.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from bench.__main__ import header
from bench.profile import kernel_times
from bench.tables import markdown

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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.glue", description=__doc__)
    parser.add_argument("--tokens", default="8192,32768")
    parser.add_argument("--forms", default="pytorch,linear,op")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.glue needs a CUDA device")
        return 1
    print(header())
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
