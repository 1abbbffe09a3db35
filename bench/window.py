"""Sliding-window benchmark (issue 16): ``python -m bench.window [--quick]``.

Causal sliding windows of 4096 keys at L16384 and L32768 (B1 H32 Hkv8 D128, bf16), forward +
backward: ours with window_size, ours on full causal attention (the window's time should fall
with the window), PyTorch SDPA with the window materialised as a boolean mask, and
FlexAttention (compiled) with a window mask_mod. Then a GPT-OSS-shaped layer (B1 L8192 H64 Hkv8
D64, window 128, sinks): ours, eager and compiled, against Flex (compiled) with the same window
(Flex has no sinks: it computes less); and GPT-OSS's full-attention layer (causal, sinks) on the
fused kernels' path against our own kernels. Every implementation is checked against ours on the
output before it is timed. Times are medians of triton.testing.do_bench (ms), each the median
of three rounds in which the implementations of a shape are timed in turn. ``--profile``:
then the device time of every kernel of ours and of Flex per forward+backward
(bench/profile.py), to see which kernel is behind.
"""

from __future__ import annotations

import argparse
import functools

import torch

import dmattn_ops


def _inputs(b, lq, h, hkv, d, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, lq, h, d, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(b, lq, hkv, d, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(b, lq, hkv, d, device="cuda", dtype=dtype, generator=g)
    return [t.requires_grad_() for t in (q, k, v)]


def _fwd_bwd(fn, tensors):
    grad = None

    def step():
        nonlocal grad
        out = fn(*tensors)
        if grad is None:
            grad = torch.randn_like(out)
        torch.autograd.grad(out, tensors, grad)

    return step


@functools.cache
def _flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def _flex_window(q, k, v, left, block_mask, sinks=None):
    out = _flex()(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=block_mask,
                  enable_gqa=q.shape[2] != k.shape[2])  # fmt: skip
    return out.transpose(1, 2)


def _window_block_mask(lq, left):
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b, h, qi, kj):
        return (kj <= qi) & (kj >= qi - left)

    return create_block_mask(mask_mod, 1, 1, lq, lq, device="cuda")


def _sdpa_masked(q, k, v, band):
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=band,
        enable_gqa=q.shape[2] != k.shape[2],
    )  # fmt: skip
    return out.transpose(1, 2)


def _time(step) -> float:
    from triton.testing import do_bench

    return do_bench(step, warmup=5, rep=40)


def _time_in_turn(steps: dict, rounds: int = 3) -> dict:
    """The median of `rounds` _time figures per step, the steps timed in turn (A B C A B C
    ...): the GPU's speed drifts by 2-3% within one process (bench/NOTES.md 61), which figures
    taken one implementation after another would read as a difference between them."""
    runs: dict = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            runs[name].append(_time(step))
    return {name: sorted(v)[len(v) // 2] for name, v in runs.items()}


def _check(name, got, want):
    err = (got.float() - want.float()).abs().max().item()
    assert err < 3e-2 and got.isfinite().all(), f"{name}: max error {err:.3e} against ours"


PROFILES: list = []  # (label, step), filled when --profile asks for kernel breakdowns


def window_case(lq: int, window: int, rows: list) -> None:
    b, h, hkv, d = 1, 32, 8, 128
    left = window - 1  # window keys including the query's own
    q, k, v = _inputs(b, lq, h, hkv, d)
    ours = functools.partial(dmattn_ops.attention, is_causal=True, window_size=(left, 0))
    full = functools.partial(dmattn_ops.attention, is_causal=True)
    with torch.no_grad():
        ref = ours(q, k, v)
    block_mask = _window_block_mask(lq, left)
    flex = functools.partial(_flex_window, left=left, block_mask=block_mask)
    with torch.no_grad():
        _check("flex", flex(q, k, v), ref)
    times = _time_in_turn({
        "ours window": _fwd_bwd(ours, (q, k, v)),
        "ours causal": _fwd_bwd(full, (q, k, v)),
        "flex window": _fwd_bwd(flex, (q, k, v)),
    })  # fmt: skip
    PROFILES.append((f"L{lq} window {window}: ours", _fwd_bwd(ours, (q, k, v))))
    PROFILES.append((f"L{lq} window {window}: flex", _fwd_bwd(flex, (q, k, v))))
    i = torch.arange(lq, device="cuda")
    band = (i[None, :] <= i[:, None]) & (i[None, :] >= i[:, None] - left)
    sdpa = functools.partial(_sdpa_masked, band=band)
    try:
        with torch.no_grad():
            _check("sdpa", sdpa(q, k, v), ref)
        times["sdpa masked"] = _time(_fwd_bwd(sdpa, (q, k, v)))
    except torch.OutOfMemoryError:
        times["sdpa masked"] = float("nan")
    del band
    shape = f"B{b} L{lq} H{h}/{hkv} D{d} causal window {window}"
    for name, t in times.items():
        rows.append((shape, name, t, t / times["ours window"]))
    rows.append((shape, "window / causal (ours)", times["ours window"] / times["ours causal"], 0))


def gpt_oss_case(lq: int, rows: list) -> None:
    b, h, hkv, d, window = 1, 64, 8, 64, 128
    left = window - 1
    q, k, v = _inputs(b, lq, h, hkv, d, seed=1)
    sinks = torch.randn(h, device="cuda", dtype=torch.float32).requires_grad_()
    ours = functools.partial(dmattn_ops.attention, is_causal=True, window_size=(left, 0))
    ours_sinks = functools.partial(ours, sinks=sinks)
    block_mask = _window_block_mask(lq, left)
    flex = functools.partial(_flex_window, left=left, block_mask=block_mask)
    with torch.no_grad():
        _check("flex", flex(q, k, v), ours(q, k, v))
    # Compiled like Flex (fullgraph): Inductor then launches our kernels itself, without the
    # eager launcher's host time, which this short call is bound by.
    compiled_sinks = torch.compile(lambda q, k, v: ours_sinks(q, k, v), fullgraph=True)
    compiled = torch.compile(lambda q, k, v: ours(q, k, v), fullgraph=True)
    with torch.no_grad():
        _check("ours compiled", compiled(q, k, v), ours(q, k, v))
        _check("ours + sinks compiled", compiled_sinks(q, k, v), ours_sinks(q, k, v))
    times = _time_in_turn({
        "ours window + sinks": _fwd_bwd(ours_sinks, (q, k, v)),
        "ours window": _fwd_bwd(ours, (q, k, v)),
        "ours + sinks, compiled": _fwd_bwd(compiled_sinks, (q, k, v)),
        "ours, compiled": _fwd_bwd(compiled, (q, k, v)),
        "flex window (no sinks)": _fwd_bwd(flex, (q, k, v)),
    })  # fmt: skip
    PROFILES.append(("GPT-OSS: ours + sinks", _fwd_bwd(ours_sinks, (q, k, v))))
    PROFILES.append(("GPT-OSS: flex", _fwd_bwd(flex, (q, k, v))))
    shape = f"GPT-OSS layer B{b} L{lq} H{h}/{hkv} D{d} window {window}"
    for name, t in times.items():
        rows.append((shape, name, t, t / times["ours window + sinks"]))


def gpt_oss_full_case(lq: int, rows: list) -> None:
    """GPT-OSS's full-attention layers: causal, no window, a sink per head. The fused kernels'
    path joins the sinks to their result (sdpa.py); against our own kernels (PyTorch's fused
    backends switched off for the call) and the same call without sinks."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    b, h, hkv, d = 1, 64, 8, 64
    q, k, v = _inputs(b, lq, h, hkv, d, seed=2)
    sinks = torch.randn(h, device="cuda", dtype=torch.float32).requires_grad_()
    full = functools.partial(dmattn_ops.attention, is_causal=True)
    full_sinks = functools.partial(full, sinks=sinks)

    def on_ours(step):
        def run():
            with sdpa_kernel([SDPBackend.MATH]):  # keeps the call off the fused kernels
                step()

        return run

    with torch.no_grad():
        with sdpa_kernel([SDPBackend.MATH]):
            ours_kernels = full_sinks(q, k, v)
        _check("fused + sinks", full_sinks(q, k, v), ours_kernels)
    times = _time_in_turn({
        "full + sinks": _fwd_bwd(full_sinks, (q, k, v)),
        "full + sinks, our kernels": on_ours(_fwd_bwd(full_sinks, (q, k, v))),
        "full, no sinks": _fwd_bwd(full, (q, k, v)),
    })  # fmt: skip
    shape = f"GPT-OSS full layer B{b} L{lq} H{h}/{hkv} D{d}"
    for name, t in times.items():
        rows.append((shape, name, t, t / times["full + sinks"]))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.window", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="L16384 only")
    parser.add_argument("--profile", action="store_true", help="kernel times of ours and Flex")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    rows: list = []
    for lq in (16384,) if args.quick else (16384, 32768):
        window_case(lq, 4096, rows)
    gpt_oss_case(8192, rows)
    gpt_oss_full_case(8192, rows)
    print(f"{'shape':<42} {'implementation':<24} {'fwd+bwd ms':>10} {'x ours':>7}")
    for shape, name, t, ratio in rows:
        print(f"{shape:<42} {name:<24} {t:>10.3f} {ratio:>7.2f}")
    if args.profile:
        from bench.timeline import kernel_times

        for label, step in PROFILES:
            kernels = kernel_times(step)
            print(f"\n{label}: {sum(r[1] for r in kernels):.3f} ms of kernels per call")
            for kernel, ms, n in kernels[:10]:
                print(f"  {ms:8.3f} ms  x{n:<3d} {kernel[:90]}")


if __name__ == "__main__":
    main()
