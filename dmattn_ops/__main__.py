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
    t0 = time.perf_counter()
    model.zero_grad()
    loss = compiled(x).square().mean()
    loss.backward()
    elapsed = time.perf_counter() - t0
    err = max(_max_rel_err(p.grad, w) for p, w in zip(params.values(), want))
    rows.append(("compiled train step (fullgraph)", elapsed, err))

    t0 = time.perf_counter()
    grads = torch.func.grad(lambda p: loss_fn(model, p, x))(params)
    elapsed = time.perf_counter() - t0
    err = max(_max_rel_err(grads[k], w) for k, w in zip(params, want))
    rows.append(("torch.func.grad", elapsed, err))

    # float32 activations against the float64 oracle: a few float32 roundings per element.
    bound = 1e-4
    print(f"\n{'check':<34}{'seconds':>9}{'max rel err vs fp64':>22}  result")
    ok = True
    for label, seconds, e in rows:
        passed = e <= bound
        ok &= passed
        print(f"{label:<34}{seconds:>9.3f}{e:>22.2e}  {'ok' if passed else 'FAIL'}")
    print(f"\nbound {bound:.0e}; {'all checks passed' if ok else 'SOME CHECKS FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
