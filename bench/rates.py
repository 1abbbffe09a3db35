"""Key-list calls against dense attention, kernel by kernel, in TFLOP/s on computed scores.

``python -m bench.rates [--cases M-L8192,M-L32768] [--rounds 2] [--hopper]``

Issue 51 asks the key-list calls' forward and backward for at least 75% of the dense path's
TFLOP/s on the scores each computes, at 8192 and 32768 keys. For each of bench.tune's cases
(the model's DMA call at one length: B1 H16 Hkv4 D128, a per-key top-L/4 mask and bias,
causal), this times our call and SDPA's dense causal call at the same shape, the forward and
the backward apart (the backward replayed on one retained graph), each kernel's device time
from the profiler (bench.timeline.kernel_times). The attention kernels' time (bench.model
is_attention_kernel) is rated on the scores each call computes (bench.__main__.allowed_entries:
ours the listed keys at or before each query, SDPA every causal one): the forward counts 2
products of 2 D flops a score, the backward 5, a fused backward's, whatever it ran (ours runs
7: its dQ kernel recomputes S and dP), so both sides' backward rates count the same work. The
key-list call's other kernels (its key lists) are listed beside, not rated. Rounds alternate
the calls; each figure is the median over rounds. ``--hopper`` adds a third call, the key-list
call with kernel option hopper=True: both passes on the Gluon kernels whatever the length (by
default the forward takes them from FORWARD_MIN_LK keys, the backward from BACKWARD_MIN_LK).
"""

from __future__ import annotations

import argparse
import contextlib
import functools

import torch

FORWARD_PRODUCTS, BACKWARD_PRODUCTS = 2, 5
ROUNDS = 2


def pass_times(f, q, k, v, bias, g) -> tuple[dict, dict]:
    """{kernel name: device ms per call} of the forward, then of the backward (replayed on one
    retained graph; the gradients' accumulation between replays is not an attention kernel)."""
    from bench.timeline import kernel_times

    forward = {name: ms for name, ms, _ in kernel_times(lambda: f(q, k, v, bias))}
    out = f(q, k, v, bias)
    backward = {
        name: ms
        for name, ms, _ in kernel_times(lambda: out.backward(g, retain_graph=True))
    }  # fmt: skip
    return forward, backward


def split_attention(times: dict) -> tuple[float, float, list[str]]:
    """(attention kernels' ms, the others' ms, the others' names) of {kernel name: ms}."""
    from bench.model import is_attention_kernel

    attention = sum(ms for name, ms in times.items() if is_attention_kernel(name))
    others = {name: ms for name, ms in times.items() if not is_attention_kernel(name)}
    return attention, sum(others.values()), sorted(others, key=lambda n: -others[n])


def row(case: str, call: str, forward: dict, backward: dict, scores: float, head_dim: int):
    """One table row of a call's pass times (pass_times, medians over rounds)."""
    from bench.model import tflops

    fwd, fwd_other, fwd_names = split_attention(forward)
    bwd, bwd_other, _ = split_attention(backward)
    return {
        "case": case, "call": call, "scores": scores, "fwd ms": fwd, "bwd ms": bwd,
        "fwd TFLOP/s": tflops(fwd, scores, FORWARD_PRODUCTS, head_dim),
        "bwd TFLOP/s": tflops(bwd, scores, BACKWARD_PRODUCTS, head_dim),
        "other ms": fwd_other + bwd_other,
        "other kernels": ", ".join(n[:28] for n in fwd_names[:3]),
    }  # fmt: skip


def table(rows: list[dict]) -> str:
    """The rows (row) with each key-list call's rates over the dense call's of its case."""
    from bench.tables import markdown

    dense = {r["case"]: r for r in rows if r["call"] == "dense"}
    out = []
    for r in rows:
        d = dense.get(r["case"])
        ratio = [r[k] / d[k] if d and d[k] else 0.0 for k in ("fwd TFLOP/s", "bwd TFLOP/s")]
        out.append([r["case"], r["call"], r["scores"] / 1e9, r["fwd ms"], r["bwd ms"],
                    r["fwd TFLOP/s"], r["bwd TFLOP/s"], *ratio, r["other ms"],
                    r["other kernels"]])  # fmt: skip
    headers = ["case", "call", "G scores", "fwd ms", "bwd ms", "fwd TFLOP/s", "bwd TFLOP/s",
               "fwd x dense", "bwd x dense", "other ms", "other kernels (forward)"]  # fmt: skip
    return markdown(headers, out, ("", "", ".3f", ".3f", ".3f", ".0f", ".0f", ".2f", ".2f",
                                   ".3f", ""))  # fmt: skip


def _median_times(samples: list[dict]) -> dict:
    """{kernel name: the median over samples of its ms} (0 in a sample without it)."""
    from bench.model import _median

    names = {name for s in samples for name in s}
    return {n: _median([s.get(n, 0.0) for s in samples]) for n in names}


def measure(case_name: str, rounds: int, hopper: bool = False) -> list[dict]:
    """The key-list call's row and the dense call's of one bench.tune case (with `hopper`, the
    key-list call on the Gluon kernels too, a row between them)."""
    import dmattn_ops
    from bench.__main__ import Inputs, allowed_entries, build, impl_ours, impl_sdpa
    from bench.tune import TUNE_CASES

    x = build(TUNE_CASES[case_name], "cuda", torch.bfloat16)
    dense_x = Inputs(x.q, x.k, x.v, None, None, x.is_causal, None)
    calls = {"key lists": (impl_ours(x), x, contextlib.nullcontext)}
    if hopper:
        gluon = functools.partial(dmattn_ops.kernel_options, hopper=True)
        calls["key lists, hopper"] = (impl_ours(x), x, gluon)
    calls["dense"] = (impl_sdpa(dense_x), dense_x, contextlib.nullcontext)
    samples: dict[str, list] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, (f, inputs, options) in calls.items():
            q, k, v = (t.detach().requires_grad_() for t in (inputs.q, inputs.k, inputs.v))
            bias = inputs.bias.detach().requires_grad_() if inputs.bias is not None else None
            with options():
                samples[name].append(pass_times(f, q, k, v, bias, torch.randn_like(q)))
            torch.cuda.synchronize()
    rows = []
    for name, (_, inputs, _) in calls.items():
        forward = _median_times([s[0] for s in samples[name]])
        backward = _median_times([s[1] for s in samples[name]])
        rows.append(row(case_name, name, forward, backward, allowed_entries(inputs),
                        inputs.q.shape[-1]))  # fmt: skip
    return rows


def main(argv=None) -> int:
    from bench.__main__ import header
    from bench.tune import TUNE_CASES

    p = argparse.ArgumentParser(prog="python -m bench.rates", description=__doc__.splitlines()[0])
    p.add_argument("--cases", default="M-L8192,M-L32768")
    p.add_argument("--rounds", type=int, default=ROUNDS)
    p.add_argument("--hopper", action="store_true",
                   help="add the key-list call with kernel option hopper=True")  # fmt: skip
    args = p.parse_args(argv)
    for name in args.cases.split(","):
        if name not in TUNE_CASES:
            p.error(f"unknown case {name!r}; the cases are {', '.join(TUNE_CASES)}")
    if not torch.cuda.is_available():
        print("bench.rates needs a CUDA GPU")
        return 0
    print(header(), flush=True)
    rows = []
    for name in args.cases.split(","):
        case_rows = measure(name, args.rounds, args.hopper)
        rows += case_rows
        print(table(case_rows), flush=True)  # the case's calls, as they come
    print(f"\n{header()}\n{table(rows)}")  # every case, last
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
