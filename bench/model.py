"""Whole-model and host-time benchmarks: ``python -m bench.model [model|host] [options]``.

``model``: one training step (forward + backward of a scalar loss) of a stack of attention
blocks under ``torch.compile(fullgraph=True)``: hidden 2048, H16, Hkv4, D128, bf16, pre-norm
and a residual per block, median ms per step. Variants differ only in the attention:

* ``sdpa``: ``scaled_dot_product_attention(is_causal=True, enable_gqa=True)``;
* ``ours-dense``: ``dmattn_ops.attention`` without mask or bias, causal (on CUDA in bf16 it
  runs PyTorch's flash kernels inside our op, dmattn_ops/executors/sdpa.py);
* ``ours-dense-triton``: the same with DMATTN_DENSE_SDPA=0, our Triton dense kernels;
* ``dma-w4`` / ``dma-w8``: ``DynamicMaskAttention`` with window L/4 or L/8 (bias per key and
  KV head, top-window mask), causal, Triton;
* ``dma-flex``: the same layer with ``backend="flex"``, window L/4;
* ``sdpa-plain`` / ``dma-w4-plain``: a stack of the bare attention layers, without norm and
  residual, whose later DMA layers select mostly early keys (more causal work than L/4 keeps
  in the pre-norm stack); their ratio is taken against ``sdpa-plain``.

Each DMA row also reports its selection's causal work: the scores the top-k mask leaves to a
causal call over all of a causal call's scores, per layer in the log and their mean in the
table (``selection_work``, from one eager forward of the same weights and input).

Compiled graphs launch our kernels themselves (dmattn_ops/registration/inductor.py); a
``+ops`` suffix
(``dma-w4+ops``) runs a variant with DMATTN_INDUCTOR_KERNELS=0 instead: the ops stay whole in
the graph and run our Python launchers. A ``+pt`` suffix (``dma-w4+pt``) runs it with
DMATTN_DT_BIAS=0: the layer's bias in PyTorch, not through the op dmattn::dt_bias
(dmattn_ops/dt_bias.py). A ``+split1`` suffix runs it inside ``dmattn_ops.kernel_options(
dkdv_split=1)``: the dK/dV kernel unsplit, without the reduce kernel a split launches
(``+split2``: split in two);
``+triton`` and ``+hopper`` with kernel option hopper False (no Gluon kernel) and True (the
Gluon forward, dQ and dK/dV kernels wherever they apply) instead of its default; ``+dense``,
``+tables`` and ``+lists`` force that Triton route; ``+dyn`` compiles the step with symbolic
sizes (``dynamic=True``, as PyTorch's automatic dynamic shapes do once a second sequence length
is seen; such graphs launch our kernels too, and ``+dyn+ops`` keeps the ops whole in them).
Suffixes combine (``dma-w4+dense+split1``).

``lengths``: one compiled training step per variant, run at each of ``--lengths`` in turn
(PyTorch's default dynamic shapes: static at the first length, symbolic from the second), as
a model trained on varied sequence lengths runs: per length the first call's seconds, the
graphs Dynamo has made so far, and the step's ms (``+ops``: our ops whole in those graphs);
``--static`` also compiles each length on its own (``dynamic=False``) and times that step.

``profile``: cProfile of those calls (forward+backward), the functions by own time.

``trace``: torch.profiler over five compiled model steps of each variant: GPU time per step
by kernel, the attention kernels' time and TFLOP/s on the scores they compute (the causal work
above times a causal call's), and the step's wall time against the sum of its kernels (the gap
is host time the GPU waited for).

``host``: the host time to issue one call (20 calls without synchronising, queued behind a
sleep kernel so that the GPU never waits on them: wall time / 20; the min and the median of 9
such rounds, as one round varies up to 2x on a shared host, the rounds of all kinds
alternating so that their ratios hold as the host drifts) beside its GPU time, for
PyTorch's SDPA and for our op with dense, bias-only, mask-only and DMA operands, forward and
forward+backward; and ``decode``, one decode step over a KV cache (B8, 4096 keys, seqused_k,
a per-key bias) eager, compiled, and compiled with the op kept whole (`decode_calls`). When
host time exceeds GPU time the GPU idles, and a compiled model in the default mode (no CUDA
graphs) pays it on every call.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time

import torch
import torch.nn.functional as F

import dmattn_ops
from bench.tables import markdown
from bench.timeline import idle_gaps
from dmattn_ops.masks import topk_mask
from dmattn_ops.nn import DynamicMaskAttention

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 2048, 16, 4, 128, 4
SHAPES = {"B4-L2048": (4, 2048), "B16-L512": (16, 512), "B1-L8192": (1, 8192),
          "B1-L16384": (1, 16384),
          "B1-L32768": (1, 32768)}  # fmt: skip
VARIANTS = ("sdpa", "ours-dense", "ours-dense-triton", "dma-w4", "dma-w8", "dma-flex",
            "sdpa-plain", "dma-w4-plain")  # fmt: skip
DENSE = ("sdpa", "ours-dense", "ours-dense-triton", "sdpa-plain")


class Block(torch.nn.Module):
    """x + attention(norm(x)); the attention is DynamicMaskAttention's projections with the
    variant's attention call in the middle."""

    def __init__(self, variant: str, length: int):
        super().__init__()
        window = length // (8 if variant == "dma-w8" else 4)
        backend = "flex" if variant == "dma-flex" else "triton"
        self.variant = variant
        # "-plain": attention alone, without norm and residual (the stack of issue 51, whose
        # later layers select mostly early keys)
        self.plain = variant.endswith("-plain")
        self.norm = torch.nn.RMSNorm(HIDDEN)
        self.attn = DynamicMaskAttention(
            HIDDEN, HEADS, KV_HEADS, window=window, backend=backend, is_causal=True
        )

    def dense(self, x):
        a = self.attn
        b, n, _ = x.shape
        q = a.q_proj(x).view(b, n, HEADS, HEAD_DIM)
        k = a.k_proj(x).view(b, n, KV_HEADS, HEAD_DIM)
        v = a.v_proj(x).view(b, n, KV_HEADS, HEAD_DIM)
        if self.variant.startswith("sdpa"):
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                enable_gqa=True,
            ).transpose(1, 2)  # fmt: skip
        else:
            out = dmattn_ops.attention(q, k, v, is_causal=True, backend="triton")
        return a.o_proj(out.flatten(2))

    def forward(self, x):
        if self.plain:
            return self.dense(x) if self.variant in DENSE else self.attn(x)
        h = self.norm(x)
        return x + (self.dense(h) if self.variant in DENSE else self.attn(h))


# Attention's own kernels in a step's trace: ours, Hopper's, and SDPA's (cuDNN, flash).
ATTENTION_KERNELS = ("attention_", "hopper_", "sdpa", "flash", "fmha", "compute_dot_do_o",
                     "convert_dq")  # fmt: skip


def is_attention_kernel(name: str) -> bool:
    """Whether a profiled kernel's name is one of ATTENTION_KERNELS' (top-k, key lists and the
    bias path are not: they count as the DMA layer's glue)."""
    return any(part in name for part in ATTENTION_KERNELS)


# Stages of a step's trace, first match wins (`stage_of`): a kernel name's parts.
STAGES = (
    ("attention forward", ("attention_fwd", "hopper_fwd", "fprop", "flash_fwd")),
    ("attention dQ", ("attention_bwd_dq", "hopper_dq", "convert_dq")),
    ("attention dK/dV", ("attention_bwd_dkdv", "hopper_dkdv", "fmha_reduce")),
    ("attention backward, fused (cuDNN, flash)", ("bprop", "flash_bwd")),
    ("attention, other", ATTENTION_KERNELS),
    ("top-k mask", ("topk_mask",)),
    ("key lists", ("key_lists", "block_any", "tile_rows", "tile_cols")),
    ("bias glue (dt_proj, softplus, A)", ("softplus", "dt_bias")),
    ("GEMMs (projections)", ("nvjet", "gemm", "xmma", "cutlass", "cublas", "splitKreduce")),
    ("norms", ("rms_norm", "layer_norm")),
)


def stage_of(name: str) -> str:
    """The stage of a step a profiled kernel belongs to (STAGES), or "other" (elementwise,
    copies, memsets, the loss)."""
    for stage, parts in STAGES:
        if any(part in name for part in parts):
            return stage
    return "other"


def _by_stage(values: dict) -> dict[str, float]:
    """{kernel name: value} summed by stage (stage_of)."""
    sums: dict[str, float] = {}
    for name, value in values.items():
        sums[stage_of(name)] = sums.get(stage_of(name), 0.0) + value
    return sums


def stage_table(total: dict, launches: dict | None = None) -> str:
    """ms per step of each stage of {kernel name: ms per step}, with its share of the kernels'
    time, in STAGES' order; with `launches` ({kernel name: launches per step}) each stage's
    launches per step too: in a compiled step each costs the host a launch, whatever the
    kernel's length."""
    by_stage = _by_stage(total)
    count = _by_stage({name: (launches or {}).get(name, 0.0) for name in total})
    kernels = sum(total.values()) or 1.0
    order = [stage for stage, _ in STAGES] + ["other"]
    rows = [[stage, by_stage[stage], by_stage[stage] / kernels] + ([count[stage]] if launches
            else []) for stage in order if stage in by_stage]  # fmt: skip
    headers = ["stage", "ms / step", "share"] + (["launches / step"] if launches else [])
    return markdown(headers, rows, ("", ".3f", ".2f", ".1f"))


# Products of 2 * D flops per computed score in each attention stage's kernels: the forward's
# S and PV; our dQ kernel recomputes S and dP beside dS K; our dK/dV kernel S, dP, P^T dO and
# dS^T Q; a fused backward (cuDNN, flash) five, each once.
STAGE_PRODUCTS = {"attention forward": 2, "attention dQ": 3, "attention dK/dV": 4,
                  "attention backward, fused (cuDNN, flash)": 5}  # fmt: skip


def tflops(ms: float, scores: float, products: int, head_dim: int) -> float:
    """TFLOP/s of `products` products of 2 * head_dim flops a score over `scores` in `ms`."""
    return products * 2 * head_dim * scores / ms / 1e9 if ms > 0 else 0.0


def stage_rates(total: dict, scores: float, head_dim: int) -> dict[str, float]:
    """TFLOP/s on the computed scores of each attention stage of {kernel name: ms per step}
    (issue 51: forward, dQ and dK/dV apart), counting the products its kernels run
    (STAGE_PRODUCTS); `scores`: the computed scores per step, every layer and head. Where a
    fused backward ran, the dQ and dK/dV stages hold its pre- and post-processing kernels and
    get no rate."""
    by_stage = _by_stage(total)
    skip = ("attention dQ", "attention dK/dV") if "attention backward, fused (cuDNN, flash)" in (
        by_stage) else ()  # fmt: skip
    return {
        stage: tflops(by_stage[stage], scores, products, head_dim)
        for stage, products in STAGE_PRODUCTS.items()
        if by_stage.get(stage, 0.0) > 0 and stage not in skip
    }


def causal_work(mask: torch.Tensor) -> float:
    """The share of a causal call's scores that a key mask (B, Hkv, 1, L) leaves to compute:
    key j is seen by the L - j queries at or after it."""
    n = mask.shape[-1]
    seen = torch.arange(n, 0, -1, device=mask.device, dtype=torch.float64)
    return float((mask.to(torch.float64) * seen).sum() / (mask[..., 0].numel() * n * (n + 1) / 2))


@torch.no_grad()
def selection_work(model: torch.nn.Module, x: torch.Tensor) -> list[float]:
    """causal_work of each DMA layer's mask on input x (one eager forward without gradients)."""
    works = []

    def record(attn, args):
        (h,) = args
        b, n, _ = h.shape
        v = attn.v_proj(h).view(b, n, attn.num_kv_heads, attn.head_dim)
        works.append(causal_work(attn.dynamic_mask(v)[0]))

    hooks = [
        block.attn.register_forward_pre_hook(record)
        for block in model
        if block.variant not in DENSE
    ]
    try:
        model(x)
    finally:
        for hook in hooks:
            hook.remove()
    return works


def make_model(variant: str, length: int, device, dtype) -> torch.nn.Module:
    blocks = [Block(variant, length) for _ in range(LAYERS)]
    return torch.nn.Sequential(*blocks).to(device=device, dtype=dtype)


def bench_ms(fn, warmup=5, reps=20) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


MODEL_ROUNDS = 7  # rounds of every variant's steps, alternating: their median per variant


def _prepare(variant: str, shape: str, mode: str):
    """(compiled step, seconds of its first, compiling, step, the causal work of each DMA
    layer's selection: selection_work; None for dense variants). The variant's switches and
    kernel options hold while it compiles; Dynamo guards on the environment variables a trace
    reads and on the kernel_options blocks (dmattn_ops.api._encoded), so each variant's graphs
    stay in the cache beside the others' and the variant's setting at call time picks them
    (run_model)."""
    with _variant(variant) as base:
        step = _compiled_step(base, shape, mode, dynamic=_dynamic(variant))
        t0 = time.time()
        step()
        torch.cuda.synchronize()
        compile_s = time.time() - t0
        work = None if base in DENSE else selection_work(step.model, step.x)
    return step, compile_s, work


def _compiled_step(variant: str, shape: str, mode: str, dynamic: bool = False):
    """A compiled training step of this variant (switches set by the caller); dynamic: compiled
    with symbolic sizes (``torch.compile(dynamic=True)``), as a graph becomes once a second
    sequence length has been seen."""
    b, n = SHAPES[shape]
    torch.manual_seed(0)
    model = make_model(variant, n, "cuda", torch.bfloat16)
    compiled = torch.compile(
        model, fullgraph=True, mode=None if mode == "default" else mode, dynamic=dynamic or None
    )
    x = torch.randn(b, n, HIDDEN, device="cuda", dtype=torch.bfloat16)

    def step():
        _train_step(model, compiled, x, graphs=mode == "reduce-overhead")

    step.model, step.compiled, step.x = model, compiled, x  # selection_work, bench.phases
    return step


def _train_loss(model, compiled, x, graphs: bool = False) -> torch.Tensor:
    """A training step's forward: fresh gradients (as after an optimizer step), then the loss.
    graphs: under CUDA graphs (reduce-overhead), each step reuses the graph's outputs."""
    model.zero_grad(set_to_none=True)
    if graphs:
        torch.compiler.cudagraph_mark_step_begin()
    return compiled(x).float().square().mean()


def _train_step(model, compiled, x, graphs: bool = False) -> None:
    """One training step: _train_loss, then backward."""
    _train_loss(model, compiled, x, graphs).backward()


# A variant's suffixes: kernel options its calls take (dmattn_ops.kernel_options blocks, which
# compiled graphs carry and Dynamo guards on). "split1": the dK/dV kernel unsplit, one
# launch fewer a layer where the split's reduce kernel would run; "split2": split in two (half
# the float32 parts the library's split of 4 writes at long calls, NOTES 266).
# "triton": every kernel on Triton (kernel option hopper=False: long calls' forwards leave the
# Gluon kernels); "hopper": both passes of every key-list call on Gluon (sm_90).
# "dense" / "tables": every call on that Triton route (the mask read in the kernels, or through
# tile tables) instead of the plan's; "lists": on key lists.
SUFFIX_OPTIONS = {
    "split1": {"dkdv_split": 1},
    "split2": {"dkdv_split": 2},
    "triton": {"hopper": False},
    "hopper": {"hopper": True},
    "dense": {"route": "dense"},
    "tables": {"route": "tile_tables"},
    "lists": {"route": "key_lists"},
}
SUFFIX_SWITCHES = ("ops", "pt", "dyn")


def _dynamic(variant: str) -> bool:
    """Whether the variant compiles with symbolic sizes (suffix "+dyn")."""
    return "dyn" in variant.split("+")[1:]


def _switches(variant: str):
    """(base variant, environment switches, kernel options) of a variant name such as
    ``dma-w4+ops`` or ``dma-w4+dense+split1`` (suffixes combine)."""
    base, *flags = variant.split("+")
    if base not in VARIANTS or any(f not in (*SUFFIX_SWITCHES, *SUFFIX_OPTIONS) for f in flags):
        raise ValueError(f"unknown variant {variant}")
    env = {
        "DMATTN_DENSE_SDPA": "0" if base == "ours-dense-triton" else "1",
        "DMATTN_INDUCTOR_KERNELS": "0" if "ops" in flags else "1",
        "DMATTN_DT_BIAS": "0" if "pt" in flags else "1",
    }
    options = {}
    for flag in flags:
        options.update(SUFFIX_OPTIONS.get(flag, {}))
    return base, env, options


@contextlib.contextmanager
def _variant(variant: str):
    """The variant's switches and kernel options, for a with-block; yields its base."""
    base, env, options = _switches(variant)
    block = dmattn_ops.kernel_options(**options) if options else contextlib.nullcontext()
    with _environ(env), block:
        yield base


class _environ:
    """Sets environment variables for a with-block and restores them after."""

    def __init__(self, values):
        self.values = values

    def __enter__(self):
        self.saved = {name: os.environ.get(name) for name in self.values}
        os.environ.update(self.values)

    def __exit__(self, *exc):
        for name, value in self.saved.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value


def trace_step(variant: str, shape: str, mode: str, log, steps: int = 5, top: int = 14) -> None:
    """torch.profiler over `steps` compiled steps: kernel ms per step, largest first, and by
    stage (stage_table); the step's wall time against the sum of its kernels; the largest
    idle gaps of the GPU, each named by the kernel that ended it (the launch the host was late
    with); and cProfile of the host work of the same steps, by own time."""

    from torch.profiler import ProfilerActivity, profile

    # AOTAutograd's cache keys on the Dynamo graph, which does not see the switches.
    torch._functorch.config.enable_autograd_cache = False
    torch._dynamo.reset()
    with _variant(variant) as base:
        step = _compiled_step(base, shape, mode, dynamic=_dynamic(variant))
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            for _ in range(steps):
                step()
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) * 1e3 / steps
        host_text = _cprofile(step, steps, top)
    total: dict[str, float] = {}
    count: dict[str, int] = {}
    spans = []
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            total[event.name] = total.get(event.name, 0.0) + event.device_time / 1e3 / steps
            count[event.name] = count.get(event.name, 0) + 1
            spans.append((event.time_range.start, event.time_range.end, event.name))
    kernels = sum(total.values())
    log(f"== trace {shape} {mode} {variant}: {wall:.2f} ms per step (profiled), "
        f"{kernels:.2f} ms of kernels, {sum(count.values()) // steps} launches")  # fmt: skip
    for name, ms in sorted(total.items(), key=lambda kv: -kv[1])[:top]:
        log(f"  {ms:7.3f} ms x{count[name] / steps:<4.1f} {name[:90]}")
    log(stage_table(total, {name: c / steps for name, c in count.items()}))
    attention_ms = sum(ms for name, ms in total.items() if is_attention_kernel(name))
    works = [1.0] * LAYERS if base in DENSE else selection_work(step.model, step.x)
    b, n = SHAPES[shape]
    # Forward 4 * D flops per computed score, forward + backward 3.5x that (bench/__main__.py).
    scores = sum(works) * HEADS * b * n * (n + 1) / 2
    flops = 3.5 * 4 * HEAD_DIM * scores
    log(f"  attention kernels {attention_ms:.3f} ms per step (causal work "
        f"{sum(works) / len(works):.3f}): {flops / attention_ms / 1e9:.0f} TFLOP/s on the "
        "computed scores")  # fmt: skip
    log("  TFLOP/s on the computed scores by stage (the products its kernels run): " + ", ".join(
        f"{stage} {rate:.0f} ({STAGE_PRODUCTS[stage]})"
        for stage, rate in stage_rates(total, scores, HEAD_DIM).items()
    ))  # fmt: skip
    gaps: dict[str, list[float]] = {}  # ms of each gap, by the kernel that ended it
    for gap, _, _, ended_by in idle_gaps(spans):
        gaps.setdefault(ended_by, []).append(gap / 1e3)
    idle = sum(sum(v) for v in gaps.values()) / steps
    log(f"  GPU idle between kernels: {idle:.2f} ms per step; by the kernel that ended the gap:")
    for name, v in sorted(gaps.items(), key=lambda kv: -sum(kv[1]))[:top]:
        log(f"  {sum(v) / steps:7.3f} ms x{len(v) / steps:<4.1f} {name[:90]}")
    idle_by_stage: dict[str, float] = {}
    for name, v in gaps.items():
        idle_by_stage[stage_of(name)] = idle_by_stage.get(stage_of(name), 0.0) + sum(v) / steps
    log("  GPU idle by the stage of the kernel that ended the gap (ms per step): " + ", ".join(
        f"{stage} {ms:.3f}" for stage, ms in sorted(idle_by_stage.items(), key=lambda kv: -kv[1])
    ))  # fmt: skip
    log(f"== host of {steps} steps, by own time")
    log(host_text[:5000])


def run_model(shapes, variants, modes, log, rounds: int = MODEL_ROUNDS) -> list[dict]:
    """Per shape and mode: every variant compiled, then `rounds` rounds that time each variant
    in turn (bench_ms: the median of 20 steps) under its own switches; a variant's ms is the
    median of its rounds. One variant timed after another took whatever the shared host did
    meanwhile (B16 L512 SDPA 5.36 and 5.88 ms on two runs of one commit); alternating rounds
    give every variant the same drift, so their ratios hold. A variant that recompiled while
    timed (Dynamo's graph count moved) is marked, and one whose compile made no graph of its own
    (it would run another's) fails."""
    rows = []
    # AOTAutograd's cache keys on the Dynamo graph, which does not see the switches: a
    # variant could load another's compiled graph.
    torch._functorch.config.enable_autograd_cache = False
    graphs = torch._dynamo.utils.counters["stats"]
    for shape in shapes:
        for mode in modes:
            torch._dynamo.reset()
            ready, timed = [], []
            for variant in variants:
                row = dict(shape=shape, mode=mode, variant=variant, ms=None, work=None,
                           status="ok", rounds=[])  # fmt: skip
                timed.append(row)
                try:
                    before = graphs["unique_graphs"]
                    step, row["compile_s"], row["work"] = _prepare(variant, shape, mode)
                    if graphs["unique_graphs"] == before:  # the guards took another's graph
                        raise RuntimeError("compiled no graph of its own")
                    ready.append((row, step))
                except Exception as e:  # a variant failing is a result
                    row["status"] = f"FAILED: {type(e).__name__}: {str(e).splitlines()[0][:80]}"
            compiled = graphs["unique_graphs"]
            for _ in range(rounds):
                for row, step in ready:
                    if row["status"] != "ok":
                        continue
                    with _variant(row["variant"]):
                        try:
                            row["rounds"].append(bench_ms(step))
                        except Exception as e:
                            row["status"] = f"FAILED: {type(e).__name__}: {str(e)[:80]}"
            if graphs["unique_graphs"] != compiled:
                for row, _ in ready:
                    row["status"] = "recompiled while timed"
            for row in timed:
                times = sorted(row["rounds"])
                row["ms"] = times[len(times) // 2] if times else None
                spread = f" (rounds {times[0]:.2f}-{times[-1]:.2f})" if times else ""
                works = (
                    ""
                    if row["work"] is None
                    else " causal work per layer " + ", ".join(f"{w:.3f}" for w in row["work"])
                )
                log(f"  model {shape} {mode} {row['variant']}: {row['ms']} ms{spread} "
                    f"{row['status']}{works}")  # fmt: skip
            rows += timed
            del ready
            torch.cuda.empty_cache()
    return rows


LENGTHS = (512, 640, 1024, 1500, 2048, 3000, 4096, 700, 8192, 300)


def run_lengths(
    variants, lengths, batch: int, log, static: bool = False, rounds: int = MODEL_ROUNDS
) -> list[dict]:
    """A training step compiled once per variant in the default mode and PyTorch's default
    dynamic shapes (static at the first length, symbolic from the second), run at each length
    in turn, as a model trained on varied sequence lengths runs: per length the first call's
    seconds (a compile where it made a graph) and the graphs Dynamo made so far. DMA variants
    keep the top first-length / 4 keys at every length (the layer's window is fixed when it is
    built). static: each length also compiled on its own with dynamic=False: what the first
    length's speed choices and the symbolic sizes cost the others. Then `rounds` rounds time
    every length's step (and its static one), alternating as run_model's do: ms and static_ms
    are the medians of the rounds, their per-round ratio in "rounds"/"static_rounds"
    (one step timed once right after its compile varied 20-40% between runs; NOTES 207)."""
    rows = []
    torch._functorch.config.enable_autograd_cache = False
    limit = torch._dynamo.config.recompile_limit
    # Every static compile adds an entry to the model code's cache beside the dynamic ones.
    torch._dynamo.config.recompile_limit = max(limit, 6 * len(lengths))
    try:
        for variant in variants:
            if _dynamic(variant):
                raise ValueError(f"{variant}: `lengths` takes PyTorch's default dynamic shapes")
            torch._dynamo.reset()
            with _variant(variant) as base:
                found, steps = _lengths_of(variant, base, lengths, batch, log)
                fixed = [_static_step(base, lengths[0], n, batch) if static else None
                         for n in lengths]  # fmt: skip
                for row in found:
                    row["rounds"], row["static_rounds"] = [], []
                for _ in range(rounds):
                    for row, step, alone in zip(found, steps, fixed):
                        row["rounds"].append(bench_ms(step))
                        if alone is not None:
                            row["static_rounds"].append(bench_ms(alone))
                for row in found:
                    row["ms"] = _median(row["rounds"])
                    row["static_ms"] = _median(row["static_rounds"])
                    log(f"  lengths {variant} L{row['length']}: {row['ms']:.2f} ms"
                        + (f", static {row['static_ms']:.2f}" if static else ""))  # fmt: skip
                del steps, fixed
            rows += found
            torch.cuda.empty_cache()
    finally:
        torch._dynamo.config.recompile_limit = limit
    return rows


def _median(values):
    return sorted(values)[len(values) // 2] if values else None


def _lengths_of(variant: str, base: str, lengths, batch: int, log) -> tuple[list[dict], list]:
    """The variant's model compiled once and called at each length in turn: its rows (length,
    first call's seconds, graphs made so far) and each length's step."""
    graphs = torch._dynamo.utils.counters["stats"]
    start = graphs["unique_graphs"]
    torch.manual_seed(0)
    model = make_model(base, lengths[0], "cuda", torch.bfloat16)
    compiled = torch.compile(model, fullgraph=True)
    rows, steps = [], []
    for n in lengths:
        x = torch.randn(batch, n, HIDDEN, device="cuda", dtype=torch.bfloat16)
        t0 = time.perf_counter()
        _train_step(model, compiled, x)
        torch.cuda.synchronize()
        first = time.perf_counter() - t0
        made = graphs["unique_graphs"] - start
        log(f"  lengths {variant} L{n}: first call {first:.1f} s, {made} graphs")
        rows.append(dict(variant=variant, length=n, first_s=first, graphs=made))
        steps.append(lambda x=x: _train_step(model, compiled, x))
    return rows, steps


def _static_step(base: str, built: int, n: int, batch: int):
    """A step of the variant's model compiled for length n alone (dynamic=False), built as
    _lengths_of's (at length `built`: the same weights and as many keys kept), compiled."""
    torch.manual_seed(0)
    model = make_model(base, built, "cuda", torch.bfloat16)
    compiled = torch.compile(model, fullgraph=True, dynamic=False)
    x = torch.randn(batch, n, HIDDEN, device="cuda", dtype=torch.bfloat16)
    _train_step(model, compiled, x)
    return lambda: _train_step(model, compiled, x)


def lengths_table(rows, limit: int) -> str:
    """run_lengths' rows as a table: per variant and length the first call's seconds, the
    graphs so far (marked past Dynamo's recompile_limit `limit`), ms a step, and with
    --static the step compiled for that length alone and the median of the rounds' ratios
    (traced over static)."""
    table = []
    for r in rows:
        ratio, spread = None, ""
        if r.get("static_rounds"):
            ratio, spread = paired_ratio(r, dict(rounds=r["static_rounds"], ms=r["static_ms"]))
        table.append((r["variant"], r["length"], r["first_s"], r["graphs"], r["ms"],
                      r.get("static_ms"), ratio, spread,
                      "past recompile_limit" if r["graphs"] > limit else ""))  # fmt: skip
    headers = ["variant", "L", "first call s", "graphs so far", "ms / step", "static ms",
               "x static", "range", ""]  # fmt: skip
    return markdown(headers, table, ("", "", ".1f", "", ".2f", ".2f", ".2f", "", ""))


def model_table(rows) -> str:
    """ms per step against the dense SDPA stack of the same shape, mode and kind (the
    pre-norm stack, or "-plain"), with the DMA layers' mean causal work (selection_work).

    The ratio is the median over rounds of each round's ms over the reference's ms in the same
    round (run_model alternates the variants round by round), where both have every round;
    the host drifts between rounds (B16 L512 SDPA 5.3 to 6.7 ms a step in one run), and a
    round's pair shares its drift. "range": the rounds' lowest and highest ratio. Without
    paired rounds, the ratio of the medians."""

    def family(variant):
        return variant.split("+")[0].endswith("-plain")

    ref = {
        (r["shape"], r["mode"], family(r["variant"])): r
        for r in rows
        if r["variant"] in ("sdpa", "sdpa-plain")
    }
    table = []
    for r in rows:
        base = ref.get((r["shape"], r["mode"], family(r["variant"])))
        ratio, spread = paired_ratio(r, base) if base is not None else (None, "")
        work = sum(r["work"]) / len(r["work"]) if r.get("work") else None
        table.append([r["shape"], r["mode"], r["variant"], r["ms"] or None, ratio, spread, work,
                      r["status"]])  # fmt: skip
    headers = ["shape", "mode", "variant", "ms / step", "x SDPA dense", "range", "causal work",
               "status"]  # fmt: skip
    return markdown(headers, table, ("", "", "", ".2f", ".2f", "", ".3f", ""))


def paired_ratio(row: dict, base: dict) -> tuple[float | None, str]:
    """(ratio of row to base, "lo-hi" of the per-round ratios or ""): model_table's rule."""
    mine, theirs = row.get("rounds") or [], base.get("rounds") or []
    if mine and len(mine) == len(theirs) and all(theirs):
        ratios = sorted(a / b for a, b in zip(mine, theirs))
        return ratios[len(ratios) // 2], f"{ratios[0]:.2f}-{ratios[-1]:.2f}"
    if row["ms"] and base["ms"]:
        return row["ms"] / base["ms"], ""
    return None, ""


# Host time of one call.

HOST_KINDS = ("sdpa", "dense", "bias", "mask", "dma", "decode")
DECODE_BATCH, DECODE_KEYS = 8, 4096  # the decode kind: one query per sequence over a KV cache


def host_inputs(kind: str, b=4, n=2048, device="cuda", dtype=torch.bfloat16):
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(b, n, HEADS, HEAD_DIM, device=device, dtype=dtype, generator=g)
    k = torch.randn(b, n, KV_HEADS, HEAD_DIM, device=device, dtype=dtype, generator=g)
    v = torch.randn(b, n, KV_HEADS, HEAD_DIM, device=device, dtype=dtype, generator=g)
    bias = torch.randn(b, KV_HEADS, 1, n, device=device, dtype=dtype, generator=g)
    mask = topk_mask(bias, n // 4)
    return (
        q,
        k,
        v,
        (mask if kind in ("mask", "dma") else None),
        (bias if kind in ("bias", "dma") else None),
    )


def decode_calls(device="cuda", dtype=torch.bfloat16, b=DECODE_BATCH, n=DECODE_KEYS):
    """[(name, callable)] of one decode step over a KV cache (b sequences, one query each, n
    cached keys of which seqused_k uses 7 fewer per sequence, a per-key bias):
    eager; compiled, the graph launching our kernels itself; and compiled with the op whole
    (DMATTN_INDUCTOR_KERNELS=0 at its trace), as every compiled call that wanted no gradient ran
    before 2026-11-30 (NOTES 215). Each compiled one is traced at its first call here. The eager
    step waits for the GPU: the range check of a caller's seqused_k reads it (one host sync a
    call, NOTES 219), which compiled calls skip."""
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(b, 1, HEADS, HEAD_DIM, device=device, dtype=dtype, generator=g)
    k, v = (torch.randn(b, n, KV_HEADS, HEAD_DIM, device=device, dtype=dtype, generator=g)
            for _ in range(2))  # fmt: skip
    bias = torch.randn(b, KV_HEADS, 1, n, device=device, dtype=dtype, generator=g)
    used = torch.arange(n, n - 7 * b, -7, device=device, dtype=torch.int32)

    def step(q, used):
        return dmattn_ops.attention(q, k, v, None, bias, seqused_k=used)

    def traced(q, used):  # its own code object: its own compiled entry
        return step(q, used)

    def whole(q, used):
        return step(q, used)

    traced, whole = (torch.compile(f, fullgraph=True) for f in (traced, whole))
    traced(q, used)
    with _environ({"DMATTN_INDUCTOR_KERNELS": "0"}):
        whole(q, used)
    return [("eager", lambda: step(q, used)), ("compiled", lambda: traced(q, used)),
            ("compiled, op whole", lambda: whole(q, used))]  # fmt: skip


def host_calls(kind: str):
    """[(pass, callable)]: the forward and forward+backward of one attention call with these
    operands; for "decode", decode_calls."""
    if kind == "decode":
        return decode_calls()
    q, k, v, mask, bias = host_inputs(kind)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    lb = bias.detach().requires_grad_() if bias is not None else None
    grad = torch.randn_like(q)

    def call(q, k, v, bias):
        if kind == "sdpa":  # PyTorch's own host time, for comparison
            return F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                enable_gqa=True,
            ).transpose(1, 2)  # fmt: skip
        return dmattn_ops.attention(q, k, v, mask, bias, is_causal=True, backend="triton")

    def fwd():
        with torch.no_grad():
            call(q, k, v, bias)

    def fwdbwd():
        call(*leaves, lb).backward(grad)

    return [("fwd", fwd), ("fwd+bwd", fwdbwd)]


SLEEP_MS = 200.0  # the GPU is kept busy this long while one round of calls is issued
ROUNDS = 9  # host time varies 2x between rounds on a shared host: min and median of rounds


def _sleep_cycles(ms: float) -> int:
    """Cycles of torch.cuda._sleep that keep the GPU busy for about `ms` milliseconds."""
    clock_khz = torch.cuda.get_device_properties(0).clock_rate
    return int(ms * clock_khz)


def _host_round(fn, calls: int) -> tuple[float, bool]:
    """(host ms per call, waited) of one round of `calls` calls of fn queued behind a sleep
    kernel: the calls' wall time is then host time alone, and a call that waited for the GPU
    (a hidden synchronisation) would take the sleep's length."""
    torch.cuda._sleep(_sleep_cycles(SLEEP_MS))
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    wall_ms = (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    return wall_ms / calls, wall_ms > SLEEP_MS / 2


def host_ms(fns, calls=20, rounds=ROUNDS) -> list[tuple[float, float, bool]]:
    """(min, median, waited) of the host ms per call of each of `fns` over `rounds` rounds of
    `calls` calls (_host_round). The rounds of the callables alternate (round r of every fn,
    then round r + 1), so a host that slows down or speeds up during the run moves them all
    alike: ratios between them hold better than between separate runs (NOTES 142)."""
    for fn in fns:
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    per_call = [[] for _ in fns]
    waited = [False] * len(fns)
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            ms, late = _host_round(fn, calls)
            per_call[i].append(ms)
            waited[i] = waited[i] or late
    found = []
    for times, late in zip(per_call, waited):
        times.sort()
        found.append((times[0], times[len(times) // 2], late))
    return found


def run_host(kinds, log, calls=20) -> list[dict]:
    """Host ms per call (min and median of ROUNDS rounds, every kind's rounds alternating:
    host_ms) beside the GPU ms."""
    named = [(kind, name, fn) for kind in kinds for name, fn in host_calls(kind)]
    rows = []
    for (kind, name, fn), (best, median, waited) in zip(
        named, host_ms([fn for _, _, fn in named], calls)
    ):
        gpu_ms = bench_ms(fn)
        rows.append(dict(kind=kind, pass_=name, host_ms=best, host_median=median,
                         gpu_ms=gpu_ms, waited=waited))  # fmt: skip
        log(f"  host {kind} {name}: host {best:.3f} ms (median {median:.3f}), "
            f"gpu {gpu_ms:.3f} ms" + (" (WAITED for the GPU)" if waited else ""))  # fmt: skip
    return rows


def _cprofile(fn, calls: int, top: int, orders=("tottime",)) -> str:
    """cProfile of `calls` calls of fn, queued behind a sleep kernel so that no call waits for
    the GPU (then a synchronize): the `top` functions in each of `orders` (pstats' sort keys:
    "tottime" own time, "cumulative" with callees)."""
    import cProfile
    import io
    import pstats

    profile = cProfile.Profile()
    torch.cuda._sleep(_sleep_cycles(SLEEP_MS))
    profile.enable()
    for _ in range(calls):
        fn()
    profile.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    for order in orders:
        text.write(f"-- by {order}\n")
        pstats.Stats(profile, stream=text).sort_stats(order).print_stats(top)
    return "\n".join(line for line in text.getvalue().splitlines() if line.strip())


def host_profile(kinds, log, calls=20, top=30) -> None:
    """cProfile of `calls` forward+backward calls per kind, the `top` functions by own time and
    by cumulative time: where the host time of a call goes (the autograd engine, Triton's
    launch path, the launchers). The profiler inflates each Python call several times: read
    shares, and host_ms for the time."""

    for kind in kinds:
        if kind == "decode":  # no backward to profile
            continue
        fwdbwd = dict(host_calls(kind))["fwd+bwd"]
        for _ in range(3):
            fwdbwd()
        torch.cuda.synchronize()
        text = _cprofile(fwdbwd, calls, top, ("tottime", "cumulative"))
        log(f"== {kind} fwd+bwd, {calls} calls")
        log(text[:12000])


def host_table(rows) -> str:
    table = [
        [r["kind"], r["pass_"], f"{r['host_ms']:.3f}" + (" (waited for the GPU)" if r.get("waited")
         else ""), r["host_median"], r["gpu_ms"]]
        for r in rows
    ]  # fmt: skip
    headers = ["operands", "pass", "host ms / call (min)", "median", "GPU ms / call"]
    return markdown(headers, table, ("", "", "", ".3f", ".3f"))


def main(argv=None) -> int:
    from bench.__main__ import header

    p = argparse.ArgumentParser(prog="python -m bench.model", description=__doc__.splitlines()[0])
    p.add_argument(
        "what", nargs="?", default="model,host",
        help="model, host, profile (cProfile of host calls), trace (kernels per step), "
        "lengths (one compiled step run at many sequence lengths)",
    )  # fmt: skip
    p.add_argument("--shapes", default="B4-L2048,B16-L512,B1-L8192,B1-L32768")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--modes", default="default,reduce-overhead")
    p.add_argument("--kinds", default=",".join(HOST_KINDS))
    p.add_argument("--lengths", default=",".join(map(str, LENGTHS)), help="for lengths")
    p.add_argument("--batch", type=int, default=2, help="for lengths")
    p.add_argument(
        "--static", action="store_true",
        help="for lengths: also compile each length on its own (dynamic=False) and time it",
    )  # fmt: skip
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.model needs a CUDA GPU")
        return 0

    def log(s):
        print(s, flush=True)

    print(header(), flush=True)
    tables = []
    if "profile" in args.what:
        host_profile(args.kinds.split(","), log)
    if "host" in args.what:
        tables.append(host_table(run_host(args.kinds.split(","), log)))
    if "trace" in args.what:
        for shape in args.shapes.split(","):
            for variant in args.variants.split(","):
                trace_step(variant, shape, args.modes.split(",")[0], log)
    if "lengths" in args.what:
        lengths = [int(n) for n in args.lengths.split(",")]
        rows = run_lengths(args.variants.split(","), lengths, args.batch, log, args.static)
        tables.append(lengths_table(rows, torch._dynamo.config.recompile_limit))
    if "model" in args.what:
        rows = run_model(
            args.shapes.split(","), args.variants.split(","), args.modes.split(","), log
        )
        tables.append(model_table(rows))
    print()
    print(header())
    for t in tables:
        print(t)
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
