"""Self-check and demo: ``python -m dmattn_ops``.

Builds a tiny dynamic-mask attention layer (``dmattn_ops.nn.DynamicMaskAttention``: a learned
per-key bias, a top-k mask from it, causal attention through the dmattn ops), runs a compiled
(fullgraph) training step and a ``torch.func.grad`` call, checks both against the float64
oracle, and prints a table. Seconds on CPU; uses CUDA when present. Exits non-zero if any check
fails.
"""

from __future__ import annotations

import platform
import sys
import time

import torch

import dmattn_ops
from dmattn_ops.nn import DynamicMaskAttention


def _max_rel_err(got, want) -> float:
    got, want = got.double(), want.double()
    if not torch.isfinite(got).all():
        return float("inf")
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def main() -> int:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    name = torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu"
    print(
        f"dmattn-ops {dmattn_ops.__version__} | torch {torch.__version__} | triton "
        f"{triton_version} | python {platform.python_version()} | device {device} ({name})"
    )

    torch.manual_seed(0)

    def build(backend):
        torch.manual_seed(0)
        layer = DynamicMaskAttention(64, 4, 2, head_dim=16, window=24, backend=backend)
        return layer.to(device)

    model = build("auto")
    oracle = build("reference").double()
    oracle.load_state_dict(model.state_dict())
    x = torch.randn(2, 96, 64, device=device)
    params = dict(model.named_parameters())

    def loss_fn(m, p, inp):
        return torch.func.functional_call(m, p, (inp,)).square().mean()

    rows = []
    want = torch.autograd.grad(
        loss_fn(oracle, dict(oracle.named_parameters()), x.double()),
        list(dict(oracle.named_parameters()).values()),
    )

    compiled = torch.compile(model, fullgraph=True)

    def train_step():
        model.zero_grad()
        compiled(x).square().mean().backward()
        if device == "cuda":
            torch.cuda.synchronize()

    print("compiling a DMA layer with torch.compile(fullgraph=True): the first step compiles "
          "(tens of seconds on a cold cache)...", flush=True)  # fmt: skip
    first = _seconds(train_step)
    later = _seconds(train_step)
    err = max(_max_rel_err(p.grad, w) for p, w in zip(params.values(), want))
    rows.append(("compiled train step (fullgraph)", first, later, err))

    print("torch.func.grad of the same loss...", flush=True)
    grad_fn = torch.func.grad(lambda p: loss_fn(model, p, x))
    first = _seconds(lambda: grad_fn(params))
    grads = grad_fn(params)
    later = _seconds(lambda: grad_fn(params))
    err = max(_max_rel_err(grads[k], w) for k, w in zip(params, want))
    rows.append(("torch.func.grad", first, later, err))

    # float32 activations against the float64 oracle: a few float32 roundings per element.
    bound = 1e-4
    print(f"\n{'check':<34}{'first call s':>13}{'next call ms':>13}{'max rel err vs fp64':>21}"
          "  result")  # fmt: skip
    ok = True
    for label, first, later, e in rows:
        passed = e <= bound
        ok &= passed
        print(f"{label:<34}{first:>13.2f}{later * 1e3:>13.2f}{e:>21.2e}  "
              f"{'ok' if passed else 'FAIL'}")  # fmt: skip
    print("(the first call includes compiling; these tiny shapes time the host, not the kernels)")
    print(f"\nbound {bound:.0e}; {'all checks passed' if ok else 'SOME CHECKS FAILED'}")
    if device == "cuda" and ok and triton_version != "not installed":
        _speed_line()
    return 0 if ok else 1


def _seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _speed_line() -> None:
    """One DMA shape on this GPU: forward + backward, ours (top-1024 of a per-key bias, causal)
    against SDPA's dense causal attention on the same tensors."""
    import torch.nn.functional as F

    b, n, h, hkv, d = 2, 4096, 16, 4, 128
    kw = dict(device="cuda", dtype=torch.bfloat16, requires_grad=True)
    q, k, v = (torch.randn(b, n, x, d, **kw) for x in (h, hkv, hkv))
    bias = torch.randn(b, hkv, 1, n, **kw)
    mask = dmattn_ops.masks.topk_mask(bias.detach(), 1024)

    def ours():
        dmattn_ops.attention(q, k, v, mask, bias, is_causal=True).sum().backward()

    def sdpa():
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
            enable_gqa=True,
        )  # fmt: skip
        out.sum().backward()

    def median_ms(fn) -> float:
        from triton.testing import do_bench

        return do_bench(fn, warmup=25, rep=100, return_mode="median")

    t_ours, t_sdpa = median_ms(ours), median_ms(sdpa)
    print(f"speed, B{b} L{n} H{h} Hkv{hkv} D{d} bf16 causal, forward+backward: DMA top-1024 "
          f"{t_ours:.2f} ms, SDPA dense {t_sdpa:.2f} ms ({t_sdpa / t_ours:.2f}x); "
          "python -m bench has the full tables")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
