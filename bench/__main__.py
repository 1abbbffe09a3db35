"""Benchmark runner: ``python -m bench [--cases A,B1,...] [--quick] [--out DIR]``.

Every implementation runs in this one process on the same inputs: ours (our Triton kernels, with
DMATTN_DENSE_SDPA=0 so that dense cases do not run PyTorch's flash kernels), PyTorch SDPA
(flash backend without mask/bias, a float mask built from mask + bias + bottom-right causal
otherwise) and FlexAttention (compiled; BlockMask from the mask, bias through score_mod). Each
case checks every implementation's output against float32 math on sampled rows before timing it
and reports a failure instead of a time. Times are medians of triton.testing.do_bench; TFLOP/s
count only the allowed (query, key) entries (forward 4*D flops per entry, backward 2.5x that);
"kernels ms" is the GPU's kernel time per call from the profiler, which do_bench's ms exceeds
where a call is host-bound (eager short cases on a slow host);
"work" is a case's allowed entries over those of the same call without its mask (causal,
seqused_k and sequences kept): the share of the scores its selection leaves to compute.
On CPU it runs a tiny smoke version of each case with the reference-checked implementations.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace

import torch

import dmattn_ops
from bench.tables import markdown
from bench.timeline import kernel_times
from dmattn_ops import reference


@dataclass
class Inputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask: torch.Tensor | None
    bias: torch.Tensor | None
    is_causal: bool
    seqused_k: torch.Tensor | None = None
    # Varlen: q (total_q, H, D), k/v (total_k, Hkv, D), mask/bias per key token (H, total_k).
    cu_seqlens: torch.Tensor | None = None
    max_seqlen: int = 0
    window: int = 0  # Case.window


@dataclass
class Case:
    name: str
    title: str
    b: int
    h: int
    hkv: int
    lq: int
    lk: int
    d: int
    kind: str  # dense | topk4d | keys | blocks | gqa | decode | varlen
    keep: int = 0
    is_causal: bool = True
    tags: list = field(default_factory=list)
    window: int = 0  # a causal sliding window of this many keys (ours only; bench.tune's)

    def shrink(self) -> Case:
        """The CPU smoke version: same structure, tiny sizes."""
        lq = 1 if self.lq == 1 else 64
        return Case(self.name, self.title, 3 if self.kind == "varlen" else 1, 2,
                    2 if self.hkv == self.h else 1, lq, 128 if self.kind != "varlen" else 64,
                    32, self.kind, keep=min(self.keep, 32) if self.keep else 0,
                    is_causal=self.is_causal)  # fmt: skip


def _cases() -> list[Case]:
    cases = [
        Case("A", "dense B2 H16 L4096", 2, 16, 16, 4096, 4096, 128, "dense"),
        Case("B", "4-D bias + top-1024 per query, B1 H16 L4096", 1, 16, 16, 4096, 4096, 128,
             "topk4d", keep=1024),
        Case("C", "bias+top-2048 per key (random), B1 H16 L16384", 1, 16, 16, 16384, 16384,
             128, "keys", keep=2048),
        Case("C-blocks", "bias+top-2048 per key (blocks of 64), B1 H16 L16384", 1, 16, 16,
             16384, 16384, 128, "blocks", keep=2048),
        Case("D", "GQA B2 H32 Hkv8 L8192, bias (B,Hkv,1,L), mask per key", 2, 32, 8, 8192, 8192,
             128, "gqa", keep=2048),
        Case("M", "the model's DMA call: B4 H16 Hkv4 L2048, bias (B,Hkv,1,L), top-512 per key",
             4, 16, 4, 2048, 2048, 128, "gqa", keep=512),
        Case("M-dense", "the model's dense call: B4 H16 Hkv4 L2048", 4, 16, 4, 2048, 2048, 128,
             "dense"),
        Case("E", "decode B8 H32 Hkv8 Lq1 Lk32768, seqused_k, bias (B,Hkv,1,Lk)", 8, 32, 8, 1,
             32768, 128, "decode", is_causal=True),
        Case("V", "varlen training: 8 sequences of 256..4096 tokens, H16, bias+mask per key "
             "token", 8, 16, 16, 4096, 4096, 128, "varlen"),
        Case("F64-A", "dense D64 B2 H16 L4096", 2, 16, 16, 4096, 4096, 64, "dense"),
        Case("F64-B", "4-D bias + top-1024, D64 B1 H16 L4096", 1, 16, 16, 4096, 4096, 64,
             "topk4d", keep=1024),
        Case("F64-M", "the model's DMA call at D64: B4 H16 Hkv4 L2048, bias (B,Hkv,1,L), "
             "top-512 per key", 4, 16, 4, 2048, 2048, 64, "gqa", keep=512),
        Case("F256-A", "dense D256 B2 H16 L4096", 2, 16, 16, 4096, 4096, 256, "dense"),
        Case("F256-B", "4-D bias + top-1024, D256 B1 H16 L4096", 1, 16, 16, 4096, 4096, 256,
             "topk4d", keep=1024),
    ]  # fmt: skip
    for length in (1024, 2048, 4096, 8192, 16384):
        cases.append(
            Case(
                f"sweep-{length}",
                f"dense sweep B1 H16 L{length}",
                1,
                16,
                16,
                length,
                length,
                128,
                "dense",
                tags=["sweep"],
            )
        )
    return cases


CASES = {c.name: c for c in _cases()}


def build(c: Case, device: str, dtype: torch.dtype) -> Inputs:
    g = torch.Generator(device=device).manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, device=device, dtype=dtype, generator=g)

    if c.kind == "varlen":
        # Lengths from 1/16 of the longest up to it; DMA's relu mask (keys with a positive bias).
        lengths = torch.randint(
            max(1, c.lq // 16), c.lq + 1, (c.b,), generator=torch.Generator().manual_seed(0)
        )
        cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32).to(device)
        total = int(lengths.sum())
        q, k, v = randn(total, c.h, c.d), randn(total, c.hkv, c.d), randn(total, c.hkv, c.d)
        bias = randn(c.h, total)
        return Inputs(q, k, v, bias > 0, bias, c.is_causal, None, cu, int(lengths.max()))
    q, k, v = randn(c.b, c.lq, c.h, c.d), randn(c.b, c.lk, c.hkv, c.d), randn(c.b, c.lk, c.hkv, c.d)
    mask = bias = seqused = None
    if c.kind == "topk4d":
        bias = randn(c.b, c.h, c.lq, c.lk)
        top = bias.topk(c.keep, dim=-1).indices
        mask = torch.zeros_like(bias, dtype=torch.bool).scatter_(-1, top, True)
    elif c.kind in ("keys", "gqa"):
        heads = c.hkv if c.kind == "gqa" else c.h
        bias = randn(c.b, heads, 1, c.lk)
        top = bias.topk(c.keep, dim=-1).indices
        mask = torch.zeros_like(bias, dtype=torch.bool).scatter_(-1, top, True)
    elif c.kind == "blocks":
        bias = randn(c.b, c.h, 1, c.lk)
        nblk = c.lk // 64
        score = torch.rand(c.b, c.h, 1, nblk, device=device, generator=g)
        top = score.topk(c.keep // 64, dim=-1).indices
        blocks = torch.zeros_like(score, dtype=torch.bool).scatter_(-1, top, True)
        mask = blocks.repeat_interleave(64, dim=-1)
    elif c.kind == "decode":
        bias = randn(c.b, c.hkv, 1, c.lk)
        seqused = torch.randint(c.lk // 4, c.lk + 1, (c.b,), device=device, generator=g)
        seqused = seqused.to(torch.int32)
    return Inputs(q, k, v, mask, bias, c.is_causal, seqused, window=c.window)


def allowed_entries(x: Inputs) -> int:
    """Number of allowed (b, h, i, j), counted in query chunks."""
    if x.cu_seqlens is not None:
        # Per key j of a sequence of length L: L - j queries see it (causal), or L.
        cu = x.cu_seqlens.tolist()
        total = 0
        for s in range(len(cu) - 1):
            n = cu[s + 1] - cu[s]
            j = torch.arange(n, device=x.q.device)
            seen = (n - j) if x.is_causal else torch.full_like(j, n)
            total += int((x.mask[:, cu[s] : cu[s + 1]] * seen).sum())
        return total
    b, lq, h, _ = x.q.shape
    lk = x.k.shape[1]
    n = x.seqused_k.long() if x.seqused_k is not None else torch.full((b,), lk, device=x.q.device)
    total = 0
    j = torch.arange(lk, device=x.q.device)
    for i0 in range(0, lq, 1024):
        i = torch.arange(i0, min(i0 + 1024, lq), device=x.q.device)
        ok = (j[None, None, :] < n[:, None, None]).unsqueeze(1)  # [B, 1, 1, Lk]
        if x.is_causal:
            ok = ok & (j[None, None, :] <= i[None, :, None] + (n - lq)[:, None, None]).unsqueeze(1)
        if x.mask is not None:
            rows = x.mask if x.mask.shape[2] == 1 else x.mask[:, :, i0 : i0 + len(i)]
            m = (
                rows.repeat_interleave(h // rows.shape[1], 1)
                if rows.shape[1] not in (1, h)
                else rows
            )
            ok = ok & m
        total += int(ok.expand(b, h, len(i), lk).sum())
    return total


def float_mask(x: Inputs) -> torch.Tensor | None:
    """SDPA's additive mask: bias where allowed, -inf elsewhere, (B, H, Lq, Lk) broadcastable."""
    b, lq, h, _ = x.q.shape
    lk = x.k.shape[1]
    if x.mask is None and x.bias is None and x.seqused_k is None and (not x.is_causal or lq == lk):
        return None
    dev = x.q.device
    n = x.seqused_k.long() if x.seqused_k is not None else torch.full((b,), lk, device=dev)
    j = torch.arange(lk, device=dev)
    i = torch.arange(lq, device=dev)
    ok = (j[None, :] < n[:, None])[:, None, None, :]
    if x.is_causal:
        ok = ok & (j[None, None, :] <= i[None, :, None] + (n - lq)[:, None, None])[:, None]
    if x.mask is not None:
        ok = ok & _per_query_head(x.mask, h)
    zero = torch.zeros((), dtype=x.q.dtype, device=dev)
    add = _per_query_head(x.bias, h).to(x.q.dtype) if x.bias is not None else zero
    return torch.where(ok, add, torch.tensor(float("-inf"), dtype=x.q.dtype, device=dev))


def _per_query_head(t: torch.Tensor, h: int) -> torch.Tensor:
    return t if t.shape[1] in (1, h) else t.repeat_interleave(h // t.shape[1], dim=1)


# Implementations: each returns a callable out = f(q, k, v, bias) on (B, L, H, D) tensors.


def _varlen(fn, x: Inputs, **kw):
    def f(q, k, v, bias):
        cu, n = x.cu_seqlens, x.max_seqlen
        return fn(q, k, v, cu, cu, n, n, x.mask, bias, is_causal=x.is_causal, **kw)

    return f


def impl_ours(x: Inputs):
    if x.cu_seqlens is not None:
        return _varlen(dmattn_ops.attention_varlen, x, backend="triton")

    window = (x.window - 1, 0) if x.window else (-1, -1)

    def f(q, k, v, bias):
        return dmattn_ops.attention(
            q,
            k,
            v,
            x.mask,
            bias,
            is_causal=x.is_causal,
            seqused_k=x.seqused_k,
            backend="triton",
            window_size=window,
        )

    return f  # fmt: skip


def impl_sdpa(x: Inputs):
    import torch.nn.functional as F

    if x.cu_seqlens is not None:
        return None  # SDPA has no variable-length batches
    dense = x.mask is None and x.bias is None and x.seqused_k is None
    h, hkv = x.q.shape[2], x.k.shape[2]
    if dense and (x.q.shape[1] == x.k.shape[1] or not x.is_causal):

        def f(q, k, v, bias):
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2),
                k.transpose(1, 2),
                v.transpose(1, 2),
                is_causal=x.is_causal,
                enable_gqa=h != hkv,
            )
            return out.transpose(1, 2)

        return f  # fmt: skip

    def f(q, k, v, bias):
        xm = Inputs(q, k, v, x.mask, bias, x.is_causal, x.seqused_k)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=float_mask(xm),
            enable_gqa=h != hkv,
        )
        return out.transpose(1, 2)

    return f  # fmt: skip


def impl_flex(x: Inputs):
    """FlexAttention through dmattn_ops.flex: compiled flex_attention, a BlockMask built (and
    cached) from the mask, the bias through score_mod, kernel options that fit an H100."""
    from dmattn_ops import flex

    if x.cu_seqlens is not None:
        return _varlen(flex.attention_varlen, x)

    def f(q, k, v, bias):
        return flex.attention(q, k, v, x.mask, bias, is_causal=x.is_causal, seqused_k=x.seqused_k)

    return f  # fmt: skip


def impl_ours_cpu(x: Inputs):
    """Ours on CPU without the interpreter: the chunked PyTorch implementation."""
    if x.cu_seqlens is not None:
        return _varlen(dmattn_ops.attention_varlen, x)

    def f(q, k, v, bias):
        return dmattn_ops.attention(
            q, k, v, x.mask, bias, is_causal=x.is_causal, seqused_k=x.seqused_k
        )

    return f  # fmt: skip


IMPLS = {"ours": impl_ours, "ours-cpu": impl_ours_cpu, "sdpa": impl_sdpa, "flex": impl_flex}


def check(f, x: Inputs, rows: torch.Tensor) -> float:
    """Max error of f on sampled rows against float32 math (the reference in fp32)."""
    with torch.no_grad():
        out = f(x.q, x.k, x.v, x.bias)
    if x.cu_seqlens is not None:
        ref = _varlen(reference.attention_varlen, x)(x.q.float(), x.k.float(), x.v.float(),
                                                     x.bias.float())  # fmt: skip
        return (out.float() - ref).abs().max().item() if out.isfinite().all() else float("nan")
    lq = x.q.shape[1]
    sub_mask = None
    if x.mask is not None or x.is_causal:
        j = torch.arange(x.k.shape[1], device=x.q.device)
        b = x.q.shape[0]
        n = (
            x.seqused_k.long()
            if x.seqused_k is not None
            else torch.full((b,), x.k.shape[1], device=x.q.device)
        )
        ok = torch.ones(b, 1, len(rows), len(j), dtype=torch.bool, device=x.q.device)
        if x.is_causal:
            ok = ok & (j[None, None, :] <= rows[None, :, None] + (n - lq)[:, None, None])[:, None]
        if x.mask is not None:
            m = x.mask if x.mask.shape[2] == 1 else x.mask[:, :, rows]
            ok = ok & m
        sub_mask = ok
    bias = None
    if x.bias is not None:
        bias = (x.bias if x.bias.shape[2] == 1 else x.bias[:, :, rows]).float()
    ref = reference.attention(
        x.q[:, rows].float(), x.k.float(), x.v.float(), sub_mask, bias, seqused_k=x.seqused_k
    )
    got = out[:, rows].float()
    if not torch.isfinite(got).all():
        return float("nan")
    return (got - ref).abs().max().item()


def bench_ms(fn, device: str = "cuda") -> float:
    """Median ms of fn: triton.testing.do_bench on CUDA; torch.utils.benchmark elsewhere (where
    Triton may be absent, and its bench would time nothing a CPU runs)."""
    if device != "cuda":
        from torch.utils import benchmark

        timer = benchmark.Timer(stmt="fn()", globals={"fn": fn})
        return timer.blocked_autorange(min_run_time=0.5).median * 1e3
    import triton

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def kernel_ms(fn) -> float:
    """The GPU's kernel ms per call of fn (the profiler's CUDA time, bench.profile): beside
    do_bench's ms, which times the host where a call's launches take longer to issue than its
    kernels take to run (the short cases eagerly on a slow host: bench/NOTES.md 219)."""
    return sum(ms for _, ms, _ in kernel_times(fn))


def run_case(c: Case, impls, device, dtype, log, timed: bool = True) -> list[dict]:
    x = build(c, device, dtype)
    entries = allowed_entries(x)
    flops_fwd = 4 * entries * c.d
    # The selection's work: its entries over those of the same call with nothing masked
    # (causal, seqused_k and sequences as the case has them).
    unmasked = (
        entries if x.mask is None else allowed_entries(replace(x, mask=torch.ones_like(x.mask)))
    )
    work = entries / max(unmasked, 1)
    rows = torch.tensor([0, 1, c.lq // 3, c.lq // 2, c.lq - 1], device=device)
    rows = torch.unique(rows.clamp(max=c.lq - 1))
    results = []
    for name in impls:
        row = dict(case=c.name, impl=name, work=work, fwd_ms=None, fwdbwd_ms=None,
                   fwd_kernel_ms=None, fwdbwd_kernel_ms=None, peak_gib=None, fwd_tflops=None,
                   fwdbwd_tflops=None, max_err=None, status="ok")  # fmt: skip
        try:
            f = IMPLS[name](x)
            if f is None:
                log(f"  {c.name:<10} {name:<8} not supported")
                continue
            err = check(f, x, rows)
            row["max_err"] = err
            tol = 0.05 if dtype != torch.float32 else 1e-3
            if not err <= tol:
                row["status"] = f"WRONG (max err {err:.3g})"
                results.append(row)
                continue
            if not timed:
                results.append(row)
                continue
            leaves = [t.detach().clone().requires_grad_() for t in (x.q, x.k, x.v)]
            bias = x.bias.detach().clone().requires_grad_() if x.bias is not None else None
            grad = torch.randn_like(x.q[..., : x.v.shape[-1]])

            def fwd(f=f):
                with torch.no_grad():
                    f(x.q, x.k, x.v, x.bias)

            def fwdbwd(f=f, leaves=leaves, bias=bias, grad=grad):
                out = f(*leaves, bias)
                out.backward(grad)

            if device == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                fwdbwd()
                torch.cuda.synchronize()
                row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
            row["fwd_ms"] = bench_ms(fwd, device)
            row["fwdbwd_ms"] = bench_ms(fwdbwd, device)
            row["fwd_tflops"] = flops_fwd / row["fwd_ms"] / 1e9
            row["fwdbwd_tflops"] = 3.5 * flops_fwd / row["fwdbwd_ms"] / 1e9
            if device == "cuda":
                row["fwd_kernel_ms"], row["fwdbwd_kernel_ms"] = kernel_ms(fwd), kernel_ms(fwdbwd)
        except Exception as e:  # a peer failing to compile or run is a result, not a crash
            row["status"] = f"FAILED: {type(e).__name__}: {str(e).splitlines()[0][:80]}"
        results.append(row)
        fwd = row["fwd_ms"]
        msg = (
            row["status"]
            if row["status"] != "ok"
            else (
                f"checked (max err {row['max_err']:.2e})"
                if fwd is None
                else f"fwd {fwd:.3f} ms, fwd+bwd {row['fwdbwd_ms']:.3f} ms"
            )
        )
        log(f"  {c.name:<10} {name:<8} {msg}")
        if device == "cuda":
            torch.cuda.empty_cache()
    return results


def header() -> str:
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=os.path.dirname(__file__),
        ).stdout.strip()
    except OSError:
        commit = ""
    # A copy of the tree (a GPU run) may carry stale git metadata: DMATTN_COMMIT wins.
    commit = os.environ.get("DMATTN_COMMIT", "") or commit
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "absent"
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return (
        f"date {time.strftime('%Y-%m-%d')} | device {dev} | torch {torch.__version__} | "
        f"triton {triton_version} | python {platform.python_version()} | "
        f"commit {commit or 'unknown'}"
    )


def table(results: list[dict]) -> str:
    by_case: dict[str, dict[str, dict]] = {}
    for r in results:
        by_case.setdefault(r["case"], {})[r["impl"]] = r
    headers = ["case", "impl", "work", "fwd ms", "fwd+bwd ms", "kernels ms, fwd / fwd+bwd",
               "fwd TFLOP/s", "fwd+bwd TFLOP/s", "peak GiB", "fwd x ours", "fwd+bwd x ours",
               "max err", "status"]  # fmt: skip
    rows = []
    for case, impls in by_case.items():
        ours = impls.get("ours", {})
        for name, r in impls.items():
            ratio_f = ratio_b = None
            if ours.get("fwd_ms") and r.get("fwd_ms"):
                ratio_f = r["fwd_ms"] / ours["fwd_ms"]
            if ours.get("fwdbwd_ms") and r.get("fwdbwd_ms"):
                ratio_b = r["fwdbwd_ms"] / ours["fwdbwd_ms"]
            kernels = None
            if r.get("fwdbwd_kernel_ms") is not None:
                kernels = f"{r['fwd_kernel_ms']:.3f} / {r['fwdbwd_kernel_ms']:.3f}"
            rows.append([
                case, name, r.get("work"), r["fwd_ms"], r["fwdbwd_ms"], kernels,
                r["fwd_tflops"], r["fwdbwd_tflops"], r["peak_gib"], ratio_f, ratio_b,
                r["max_err"], r["status"],
            ])  # fmt: skip
    formats = ("", "", ".3f", ".3f", ".3f", "", ".0f", ".0f", ".2f", ".2f", ".2f", ".1e", "")
    return markdown(headers, rows, formats)


def plot(results: list[dict], path: str) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot skipped: matplotlib is not installed"
    sweep = [r for r in results if r["case"].startswith("sweep-") and r["fwdbwd_tflops"]]
    if not sweep:
        return "plot skipped: no sweep results"
    fig, ax = plt.subplots(figsize=(6, 4))
    for impl in sorted({r["impl"] for r in sweep}):
        pts = sorted(
            (int(r["case"].split("-")[1]), r["fwdbwd_tflops"]) for r in sweep if r["impl"] == impl
        )
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=impl)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length")
    ax.set_ylabel("fwd+bwd TFLOP/s (allowed entries)")
    ax.set_title("dense causal, B1 H16 D128, bf16")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return f"plot written to {path}"


def main(argv=None) -> int:
    # "ours" times our Triton kernels: dense calls would otherwise run PyTorch's flash kernels
    # inside our op (dmattn_ops/executors/sdpa.py), which the sdpa column already times.
    os.environ["DMATTN_DENSE_SDPA"] = "0"
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cases", default=None,
        help=f"comma-separated case names (default all): {', '.join(CASES)}",
    )  # fmt: skip
    parser.add_argument(
        "--impls", default="ours,sdpa,flex", help=f"comma-separated, of {', '.join(IMPLS)}"
    )
    parser.add_argument("--quick", action="store_true", help="skip the length sweep")
    parser.add_argument(
        "--check-only", action="store_true",
        help="check every implementation against the oracle, time nothing (the CI smoke run)",
    )  # fmt: skip
    parser.add_argument(
        "--out", default="dmattn-bench",
        help="folder for results.csv, results.json and the plot (default ./dmattn-bench)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    names = args.cases.split(",") if args.cases else list(CASES)
    for name in names:
        if name not in CASES:
            parser.error(f"unknown case {name!r}; the cases are {', '.join(CASES)}")
    for name in args.impls.split(","):
        if name not in IMPLS:
            parser.error(f"unknown implementation {name!r}; they are {', '.join(IMPLS)}")
    if args.quick:
        names = [n for n in names if "sweep" not in CASES[n].tags]
    impls = args.impls.split(",")
    if device == "cpu":
        impls = [i for i in impls if i in ("ours", "sdpa", "flex")]
        if os.environ.get("TRITON_INTERPRET") != "1":
            impls = [i for i in impls if i != "ours"] + ["ours-cpu"]
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    os.makedirs(args.out, exist_ok=True)
    print(header(), flush=True)
    results = []
    start = time.time()
    for idx, name in enumerate(names):
        c = CASES[name] if device == "cuda" else CASES[name].shrink()
        title = (
            c.title
            if device == "cuda"
            else (f"CPU smoke of '{c.title}' at B{c.b} H{c.h} Hkv{c.hkv} Lq{c.lq} Lk{c.lk} D{c.d}")
        )
        print(f"[{idx + 1}/{len(names)}] {name}: {title} ({time.time() - start:.0f}s)", flush=True)
        results += run_case(
            c, impls, device, dtype, lambda s: print(s, flush=True), not args.check_only
        )
    with open(os.path.join(args.out, "results.csv"), "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(results[0]))
        writer.writeheader()
        writer.writerows(results)
    with open(os.path.join(args.out, "results.json"), "w") as fh:
        json.dump({"header": header(), "command": " ".join(sys.argv), "results": results}, fh,
                  indent=1)  # fmt: skip
    print(plot(results, os.path.join(args.out, "tflops_vs_length.png")))
    print()
    print(header())
    print(table(results))
    bad = [r for r in results if r["impl"] == "ours" and r["status"] != "ok"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
