"""The benchmark runner's CPU smoke version: every case builds, and every implementation that
runs on CPU passes its correctness check."""

import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.sweep
def test_bench_smoke(tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # the smoke version is the CPU one
    res = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--check-only", "--out", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    rows = [line for line in res.stdout.splitlines() if line.startswith("| ")]
    status = [line.strip().strip("|").split("|")[-1].strip() for line in rows[1:]]
    assert len(rows) > 10 and set(status) == {"ok"}, res.stdout
    assert (tmp_path / "results.csv").exists()
    assert (tmp_path / "results.json").exists()


@pytest.mark.sweep
def test_cpu_timings_and_help_without_a_gpu(tmp_path):
    """On CPU the bench times the PyTorch paths (torch.utils.benchmark), and every entry's
    --help answers before any device check."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    res = subprocess.run(
        [sys.executable, "-m", "bench", "--cases", "A", "--impls", "sdpa", "--out", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    lines = res.stdout.splitlines()
    header = next(line for line in lines if line.startswith("| case"))
    row = next(line for line in lines if line.startswith("| A"))
    cells = dict(zip(*([c.strip() for c in r.strip("|").split("|")] for r in (header, row))))
    for timing in ("fwd ms", "fwd+bwd ms"):
        assert float(cells[timing]) > 0, row
    assert float(cells["work"]) == 1.0  # case A is dense: its work is the causal call's
    entries = ("bench", "bench.model", "bench.masks", "bench.window", "bench.tune", "bench.cp",
               "bench.profile", "bench.glue", "bench.phases", "bench.rates")  # fmt: skip
    for entry in entries:
        res = subprocess.run([sys.executable, "-m", entry, "--help"], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=120)  # fmt: skip
        assert res.returncode == 0 and "usage:" in res.stdout, (entry, res.stdout, res.stderr)
    res = subprocess.run([sys.executable, "-m", "bench", "--help"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert "M-dense" in res.stdout  # the cases are listed


def test_argument_errors_are_clear(capsys, monkeypatch):
    """A wrong case, implementation or kernel kind ends in argparse's usage error (exit 2), the
    known ones named. In-process (each subprocess cost CI ~6 s); test_cpu_timings_and_help_
    without_a_gpu runs every entry as `python -m`."""
    import bench.__main__
    from bench import rates, tune

    # `python -m bench` sets DMATTN_DENSE_SDPA=0 for its run; monkeypatch restores it.
    monkeypatch.setenv("DMATTN_DENSE_SDPA", "1")
    for main, args, wanted in (
        (bench.__main__.main, ["--cases", "Z"], "unknown case 'Z'"),
        (bench.__main__.main, ["--impls", "cudnn"], "unknown implementation 'cudnn'"),
        (tune.parse, ["Z"], "unknown case 'Z'"),
        (tune.parse, ["A", "fwdd"], "unknown kernel kind 'fwdd'"),
        (rates.main, ["--cases", "Z"], "unknown case 'Z'"),
    ):
        with pytest.raises(SystemExit) as exit_:
            main(args)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and wanted in err, (args, err[-2000:])


def test_tune_parses_its_own_cases():
    from bench import tune

    assert tune.parse(["M-L32768,M", "dkdv"]) == (["M-L32768", "M"], ["dkdv"])
    case = tune.TUNE_CASES["M-L32768"]
    assert (case.b, case.h, case.hkv, case.lq, case.keep) == (1, 16, 4, 32768, 8192)
    assert "M-L32768" not in tune.CASES  # not one of `python -m bench`'s cases


@pytest.mark.sweep
def test_context_parallel_bench_smoke():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    res = subprocess.run([sys.executable, "-m", "bench.cp", "--world", "2", "--lengths", "128"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    rows = [line for line in res.stdout.splitlines() if line.startswith("| dense")]
    assert len(rows) == 1 and "OOM" not in rows[0], res.stdout


def test_context_parallel_bench_with_packed_documents():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    cmd = [sys.executable, "-m", "bench.cp", "--world", "2", "--lengths", "128", "--docs", "24",
           "--kinds", "dma"]  # fmt: skip
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    rows = [line for line in res.stdout.splitlines() if line.startswith("| dma")]
    assert len(rows) == 1 and "OOM" not in rows[0], res.stdout
    assert "packed documents of 24 tokens" in res.stdout


def test_context_parallel_bench_of_a_whole_model():
    """bench.cp --model: bench.model's DMA stack on one process and parallelized on two
    (gloo, eager, the PyTorch path), one table row."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    cmd = [sys.executable, "-m", "bench.cp", "--world", "2", "--lengths", "64", "--model",
           "--eager"]  # fmt: skip
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    rows = [line for line in res.stdout.splitlines() if line.startswith("| model dma-w4")]
    assert len(rows) == 1 and "OOM" not in rows[0], res.stdout


def test_causal_work_counts_the_scores_a_key_mask_leaves():
    """bench.model's work fraction against a count of every (query, key) pair."""
    from bench.model import causal_work

    g = torch.Generator().manual_seed(0)
    mask = torch.rand(2, 3, 1, 37, generator=g) < 0.3
    n = mask.shape[-1]
    causal = torch.ones(n, n, dtype=torch.bool).tril()  # query i sees keys j <= i
    pairs = int((mask & causal).sum()) / (mask.shape[0] * mask.shape[1] * int(causal.sum()))
    assert causal_work(mask) == pytest.approx(pairs, rel=1e-12)
    assert causal_work(torch.ones(1, 1, 1, n, dtype=torch.bool)) == pytest.approx(1.0)
    early = torch.zeros(1, 1, 1, n, dtype=torch.bool)
    early[..., : n // 4] = True
    late = early.flip(-1)
    assert causal_work(early) > 0.4 > 0.1 > causal_work(late)  # where the kept keys fall


def test_selection_work_reads_each_dma_layer():
    """One value per DMA layer of the stack, from the layer's own mask (a top-L/4 selection
    leaves between 1/16 and 7/16 of the causal scores)."""
    from bench.model import HIDDEN, LAYERS, make_model, selection_work

    torch.manual_seed(0)
    n = 32
    x = torch.randn(1, n, HIDDEN)
    model = make_model("dma-w4-plain", n, "cpu", torch.float32)
    for block in model:
        block.attn.backend = "reference"
    works = selection_work(model, x)
    assert len(works) == LAYERS
    assert all(1 / 16 - 1e-9 <= w <= 7 / 16 + 1e-9 for w in works), works
    assert selection_work(make_model("sdpa-plain", n, "cpu", torch.float32), x) == []


def test_rank_time_splits_a_step_into_compute_nccl_and_idle():
    """bench.cp's rank_time: compute and NCCL time as the unions of their kernels' intervals
    (us in, ms out), idle as the wall less the union of both."""
    from bench.cp import rank_time

    # Compute [0, 4000) and [3000, 5000) us: 5 ms; NCCL [4500, 7000): 2.5 ms; both: 7 ms.
    got = rank_time(10.0, 9.5, [(4500, 7000)], [(3000, 5000), (0, 4000)])
    assert got == dict(wall=10.0, issue=9.5, compute=5.0, nccl=2.5, idle=3.0, lead=0.0)
    assert rank_time(10.0, 9.5, [], [(0, 4000)], lead=1.5)["lead"] == 1.5
    assert rank_time(1.0, 0.2, [], [])["idle"] == 1.0


def test_overlap_counts_transfer_time_under_compute():
    """bench.cp's overlap: the time some transfer ran (its intervals' union) and the part of it
    during which some compute kernel ran, whatever the intervals' order and overlaps."""
    from bench.cp import overlap

    assert overlap([], [(0, 5)]) == (0, 0)
    assert overlap([(0, 10)], []) == (10, 0)
    # Transfers [0, 4) and [6, 10) (one given twice, overlapping); compute [2, 7) and [3, 5).
    assert overlap([(6, 10), (0, 4), (7, 9)], [(3, 5), (2, 7)]) == (8, 3)
    # Compute covering everything, and compute between the transfers only.
    assert overlap([(1, 2), (3, 4)], [(0, 10)]) == (2, 2)
    assert overlap([(0, 1), (5, 6)], [(1, 5)]) == (2, 0)


def test_decode_host_kind_compiles_both_ways_to_the_eager_result():
    """bench.model host's decode kind: the eager step, the compiled one and the one compiled
    with the op whole (traced under DMATTN_INDUCTOR_KERNELS=0) give the same output, and the
    switch is restored after."""
    from bench import model

    torch._dynamo.reset()
    before = os.environ.get("DMATTN_INDUCTOR_KERNELS")
    calls = model.decode_calls(device="cpu", dtype=torch.float32, b=2, n=40)
    assert [name for name, _ in calls] == ["eager", "compiled", "compiled, op whole"]
    assert os.environ.get("DMATTN_INDUCTOR_KERNELS") == before
    outs = [fn() for _, fn in calls]
    assert outs[0].shape == (2, 1, model.HEADS, model.HEAD_DIM)
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0])


def test_fit_bisection_finds_the_last_length_that_fits():
    """bench.cp --fit's bisection between a length known to fit and one known not to: the
    longest multiple of GRAIN below the limit, asking only inside the interval."""
    from bench.cp import GRAIN, bisect

    for limit in (65536, 65536 + GRAIN, 300000, 548864 - 1):
        asked = []

        def fits(length, limit=limit, asked=asked):
            asked.append(length)
            return length <= limit

        assert bisect(65536, 548864, fits) == limit // GRAIN * GRAIN
        assert all(65536 < n < 548864 and n % GRAIN == 0 for n in asked)
        assert len(asked) <= 6  # log2 of the interval's 59 grains


def test_fit_reads_the_line_then_bisects_down_where_it_ran_out(monkeypatch):
    """bench.cp.fit's orchestration with its processes stood in for: the one-GPU length as its
    worker found it, the ring's peaks at 32k and 64k, the line's length checked, and below it,
    where that ran out (a hung check gives no row: ran out too), the last length that runs."""
    import bench.cp as cp

    limit, asked = 483328, []

    def spawn(worker, world, *args, timeout=None):
        if worker is cp._one_fit_worker:
            return [dict(one=409600)]
        kind, length, cap = args
        asked.append(length)
        if length > limit:  # near the limit one rank ran out and its peer hung
            return [] if length <= limit + 4 * cp.GRAIN else [dict(peak=None)]
        return [dict(peak=0.12 + length * 0.0000145)]  # a line that promises too much

    monkeypatch.setattr(cp, "_spawn", spawn)
    (row,) = cp.fit(2, ["dense"], 8.0)
    assert row["one"] == 409600 and row["ring_ok"]
    assert row["line"] > limit and asked[:3] == [32768, 65536, row["line"]]
    assert limit - cp.GRAIN < row["ring"] <= limit and row["ring"] % cp.GRAIN == 0
    assert [p for p, _ in row["points"]] == [32768, 65536]


def _answering_worker(rank, world, rendezvous, hang, results):
    """bench.cp._spawn's worker for the test below: rank 0 answers; with `hang`, rank 1 sleeps
    far past the test's timeout first and rank 0 waits for it (a peer stuck in a transfer)."""
    import time

    if hang:
        time.sleep(600 if rank == 1 else 0)
        while rank == 0:
            time.sleep(1)
    if rank == 0:
        results.put(dict(rank=rank, world=world))


def test_spawn_ends_processes_that_outlive_its_timeout():
    """bench.cp --fit checks each ring length in processes of their own (a rank that ran out
    of memory left the next collective hung): _spawn with a timeout ends them and returns what
    rank 0 had put by then, nothing here; without a hang it returns rank 0's rows."""
    import time

    from bench.cp import _spawn

    assert _spawn(_answering_worker, 2, False, timeout=60) == [dict(rank=0, world=2)]
    start = time.monotonic()
    assert _spawn(_answering_worker, 2, True, timeout=3) == []
    assert time.monotonic() - start < 30


def test_idle_gaps_names_the_kernels_around_each_stretch_the_gpu_ran_nothing():
    """bench.timeline's idle_gaps (bench.cp --overlap, bench.model trace): stretches outside
    every span (overlapping spans, given in any order, close none), the longest first, each
    with its start after the first kernel began and the kernels before and after it (the one
    that ran last, not the one that began last); all of them without `top`."""
    from bench.timeline import idle_gaps

    spans = [(30, 35, "c"), (0, 10, "a"), (2, 4, "a2"), (14, 20, "b"), (15, 16, "b2")]
    assert idle_gaps(spans, 5) == [(10, 20, "b", "c"), (4, 10, "a", "b")]
    assert idle_gaps(spans, 1) == [(10, 20, "b", "c")]
    assert idle_gaps(spans) == idle_gaps(spans, 5)
    assert idle_gaps([(0, 5, "x"), (5, 6, "y")], 3) == []  # touching spans leave no gap
    assert idle_gaps([], 3) == []


def test_phases_sums_allocations_per_step_and_orders_them_by_cost():
    """bench.phases' allocation census: calls and host time a step over the steps recorded,
    each (shape, stride, dtype) row's cost a step, count a step and best call, the bytes its
    strides span (a broadcast stride of 0 spans one row; an empty buffer none), most costly
    first."""
    from bench.phases import Allocations

    allocs = Allocations()
    allocs.rows[((4, 8), (8, 1), torch.bfloat16)] = [3e-6, 5e-6, 4e-6, 4e-6]
    allocs.rows[((2, 3), (0, 1), torch.float32)] = [30e-6, 10e-6]
    allocs.rows[((0, 5), (5, 1), torch.int32)] = [1e-6, 1e-6]
    allocs.launches += [20e-6, 10e-6, 30e-6]
    calls, total, rows, launches = allocs.summary(steps=2)
    assert calls == 4 and total == pytest.approx(29.0)
    assert launches == (1.5, pytest.approx(30.0))
    assert [r[3] for r in rows] == ["float32", "bfloat16", "int32"]
    us, count, best, _, mib, size = rows[0]
    assert (us, count, best, size) == (pytest.approx(20.0), 1.0, pytest.approx(10.0), (2, 3))
    assert mib * 2**20 == 3 * 4  # one row of 3 float32: the batch dim's stride is 0
    assert rows[1][4] * 2**20 == 4 * 8 * 2 and rows[1][1] == 2.0
    assert rows[2][4] == 0
    assert len(allocs.summary(steps=1, top=1)[2]) == 1
    allocs.clear()
    assert allocs.summary(steps=1) == (0, 0, [], (0, 0))


def test_peak_census_replays_allocations_to_their_highest_point():
    """bench.cp's peak_census: the recorded events replayed in order, the highest total above
    the start and the blocks alive there summed by the repository line that allocated them
    (a frame outside this repository's code names its function); blocks freed before the
    peak, or allocated after it, do not count, nor do frees of blocks from before the
    recording."""
    from bench.cp import census_lines, peak_census

    def frame(path, line, name):
        return {"filename": path, "line": line, "name": name}

    ring = [frame("/x/dmattn_ops/distributed.py", 10, "_ring_backward")]
    kernel = [frame("/t/torch/functional.py", 3, "empty"), frame("/x/bench/cp.py", 7, "run")]
    other = [frame("/t/torch/autograd.py", 1, "backward")]

    def alloc(addr, size, frames):
        return {"action": "alloc", "addr": addr, "size": size, "frames": frames}

    def free(addr):
        return {"action": "free_completed", "addr": addr, "size": 0}

    events = [
        free(99),  # a block from before the recording
        alloc(1, 100, ring), alloc(2, 50, kernel), free(2), alloc(3, 70, ring),
        alloc(4, 30, other),  # the peak: 100 + 70 + 30
        free(1), alloc(5, 60, kernel),  # after it: 160
    ]  # fmt: skip
    peak, census = peak_census(events)
    assert peak == 200
    assert census == {"distributed.py:10:_ring_backward": 170, "(backward)": 30}
    assert peak_census([]) == (0, {})
    lines = census_lines("rank 0", (0.5, 0.75, [("distributed.py:10:_ring_backward", 1.5)]))
    assert lines[0] == "rank 0: 0.500 GiB allocated before the step, 0.750 at its peak"
    assert lines[1].split() == ["1.5", "MiB", "distributed.py:10:_ring_backward"]


def test_host_cpu_times_the_python_of_an_eager_call():
    """bench.host_cpu (our Python's host time with the launches stubbed) runs anywhere and
    prints its line, through Triton's launch path and through the kept kernels'."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    for kind, flags, line in [
        ("dma", [], "dma forward+backward"), ("decode", ["--launch-cache"], "decode one decode step"),
    ]:  # fmt: skip
        cmd = [sys.executable, "-m", "bench.host_cpu", kind, "--rounds", "1", *flags]
        res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stdout + res.stderr
        assert f"{line}, launches stubbed: host" in res.stdout, res.stdout


def test_trace_stages_name_each_kernel_of_a_step():
    """bench.model trace's stage table: each kernel of a DMA or an SDPA step lands in its
    stage (names as the H200's profiler reported them), and the shares add up to the whole."""
    from bench.model import stage_of, stage_table

    expected = {
        "attention_fwd_kernel": "attention forward",
        "attention_bwd_dq_kernel": "attention dQ",
        "attention_bwd_dkdv_reduce_kernel": "attention dK/dV",
        "hopper_fwd_kernel": "attention forward",
        "hopper_dq_kernel": "attention dQ",
        "hopper_dkdv_kernel": "attention dK/dV",
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16": "attention forward",
        "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16": (
            "attention backward, fused (cuDNN, flash)"
        ),
        "void cudnn::fusion::compute_dot_do_o_specialized<true, 128>": "attention, other",
        "topk_mask_kernel": "top-k mask",
        "key_lists_kernel": "key lists",
        "triton_red_fused__to_copy_expand_mul_softplus_backward_squeeze_sum": (
            "bias glue (dt_proj, softplus, A)"
        ),
        "dt_bias_bwd_kernel": "bias glue (dt_proj, softplus, A)",
        "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT": "GEMMs (projections)",
        "triton_per_fused__fused_rms_norm__fused_rms_norm_backward_add_view_0": "norms",
        "Memset (Device)": "other",
    }
    for name, stage in expected.items():
        assert stage_of(name) == stage, name
    table = stage_table(dict.fromkeys(expected, 0.5))
    ms = [float(line.split("|")[2]) for line in table.splitlines()[2:]]
    # Printed to 3 decimals: each row within half a unit of its own.
    assert abs(sum(ms) - 0.5 * len(expected)) <= 0.0005 * len(ms)
    assert len(ms) == len(set(expected.values()))
    launches = stage_table(dict.fromkeys(expected, 0.5), dict.fromkeys(expected, 2.0))
    rows = {line.split("|")[1].strip(): float(line.split("|")[4]) for line in
            launches.splitlines()[2:]}  # fmt: skip
    assert rows["bias glue (dt_proj, softplus, A)"] == 4.0 and rows["top-k mask"] == 2.0


def test_stage_rates_count_each_kernels_products():
    """bench.model's per-stage TFLOP/s (issue 51): products * 2 * D flops per computed score over
    the stage's ms; with a fused backward the dQ and dK/dV stages (its pre- and post-processing)
    get no rate."""
    from bench.model import stage_rates

    scores, d = 1e9, 128  # 2 * D * 1e9 flops per product: 0.256 TFLOP per product
    ours = {"attention_fwd_kernel": 1.0, "attention_bwd_dq_kernel": 2.0,
            "attention_bwd_dkdv_kernel": 1.5, "attention_bwd_dkdv_reduce_kernel": 0.5}  # fmt: skip
    rates = stage_rates(ours, scores, d)
    assert rates == pytest.approx(
        {"attention forward": 512.0, "attention dQ": 384.0, "attention dK/dV": 512.0}
    )
    fused = {"cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16": 2.0,
             "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16": 5.0,
             "convert_dq": 0.1, "fmha_reduce": 0.1}  # fmt: skip
    assert stage_rates(fused, scores, d) == pytest.approx(
        {"attention forward": 256.0, "attention backward, fused (cuDNN, flash)": 256.0}
    )


def test_rates_rate_each_calls_attention_kernels_on_its_own_scores():
    """bench.rates (issue 51's 75% of dense): the forward at 2 products of 2 * D flops a computed
    score, the backward at 5 whatever it ran (our dQ and dK/dV kernels, or a fused one, and
    their small kernels), each call on its own scores; the key-list call's key lists and the
    gradients' accumulation are listed apart, not rated; x dense is the rate over the dense
    call's of the same case."""
    from bench.rates import row, table

    d = 128  # 2 * D * 1e9 flops per product of 1e9 scores: 0.256 TFLOP
    ours = row("M", "key lists", {"hopper_fwd_kernel": 1.0, "key_lists_kernel": 0.25},
               {"hopper_dq_kernel": 2.0, "hopper_dkdv_kernel": 2.5,
                "attention_bwd_dkdv_reduce_kernel": 0.5, "vectorized_elementwise_add": 0.5},
               1e9, d)  # fmt: skip
    assert ours["fwd ms"] == 1.0 and ours["bwd ms"] == 5.0 and ours["other ms"] == 0.75
    assert ours["fwd TFLOP/s"] == pytest.approx(512.0)
    assert ours["bwd TFLOP/s"] == pytest.approx(256.0)
    assert ours["other kernels"] == "key_lists_kernel"
    dense = row("M", "dense",
                {"cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16": 2.0},
                {"cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16": 3.9,
                 "convert_dq": 0.1}, 4e9, d)  # fmt: skip
    assert dense["fwd TFLOP/s"] == pytest.approx(1024.0)
    assert dense["bwd TFLOP/s"] == pytest.approx(1280.0)
    lines = table([ours, dense]).splitlines()
    cells = [c.strip() for c in lines[2].strip("|").split("|")]
    assert cells[:2] == ["M", "key lists"]
    assert cells[7:9] == ["0.50", "0.20"]  # 512 / 1024, 256 / 1280


def test_rates_hopper_adds_the_gluon_call_under_its_option(monkeypatch):
    """bench.rates --hopper: a third call, the key-list call timed inside kernel_options(
    hopper=True) (its forward and its backward), rounds alternating the three calls, each rated
    on the key-list call's scores against the dense call of its case; without --hopper, two."""
    import bench.__main__ as bmain
    from bench import rates
    from dmattn_ops.core import options

    seen = []
    x = bmain.Inputs(*(torch.zeros(1, 4, 2, 8) for _ in range(3)), torch.zeros(1, 1, 1, 4),
                     None, True, None)  # fmt: skip

    def pass_times(f, q, k, v, bias, g):
        seen.append((f, options.with_active(None).get("hopper")))
        if f == "sdpa":
            return (
                {"cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16": 1.0},
                {"cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16": 2.0},
            )
        return {"hopper_fwd_kernel": 1.0}, {"hopper_dq_kernel": 2.0}

    monkeypatch.setattr(bmain, "build", lambda case, device, dtype: x)
    monkeypatch.setattr(bmain, "impl_ours", lambda inputs: "ours")
    monkeypatch.setattr(bmain, "impl_sdpa", lambda inputs: "sdpa")
    monkeypatch.setattr(bmain, "allowed_entries", lambda inputs: 1e9 if inputs is x else 4e9)
    monkeypatch.setattr(rates, "pass_times", pass_times)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    rows = rates.measure("M", 2, hopper=True)
    assert seen == [("ours", None), ("ours", True), ("sdpa", None)] * 2
    assert [r["call"] for r in rows] == ["key lists", "key lists, hopper", "dense"]
    assert [r["scores"] for r in rows] == [1e9, 1e9, 4e9]
    cells = [line.strip("|").split("|") for line in rates.table(rows).splitlines()[2:]]
    assert [c[7].strip() for c in cells] == ["0.25", "0.25", "1.00"]  # the same ms, 1/4 scores
    seen.clear()
    assert [r["call"] for r in rates.measure("M", 1)] == ["key lists", "dense"]
    assert seen == [("ours", None), ("sdpa", None)]


def test_model_rounds_alternate_and_take_each_variants_median(monkeypatch):
    """bench.model's run_model on a stub of the GPU: every variant is prepared before any is
    timed, rounds alternate the variants under each one's own setting (switches and kernel
    options), a variant's ms is the median of its rounds, a variant whose compile made no
    graph of its own fails without stopping the others, and a graph compiled while timed
    marks every variant of the shape."""
    from bench import model

    events, stats = [], {"unique_graphs": 0}
    times = {"sdpa": iter([5.0, 7.0, 6.0]), "dma-w4+split1": iter([4.0, 9.0, 5.0])}

    def prepare(variant, shape, mode):
        events.append(("prepare", variant))
        if variant != "dma-w4":  # dma-w4 compiles nothing of its own here
            stats["unique_graphs"] += 1
        return variant, 1.0, None

    def bench_ms(step):
        import dmattn_ops.core.options as options

        events.append(("time", step, os.environ["DMATTN_DT_BIAS"], options.active()))
        return next(times[step])

    monkeypatch.setattr(model, "_prepare", prepare)
    monkeypatch.setattr(model, "bench_ms", bench_ms)
    monkeypatch.setattr(torch._dynamo.utils, "counters", {"stats": stats})
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    # run_model turns AOTAutograd's cache off; torch's own patch restores it after (pytest 9.2's
    # monkeypatch would delete the attribute of torch's config module, which then hides it:
    # every later compile in the process fails reading it).
    config = torch._functorch.config
    with config.patch(enable_autograd_cache=config.enable_autograd_cache):
        rows = model.run_model(["B16-L512"], ["sdpa", "dma-w4", "dma-w4+split1"], ["default"],
                               lambda line: None, rounds=3)  # fmt: skip
    assert [e[1] for e in events[:3]] == ["sdpa", "dma-w4", "dma-w4+split1"]
    timed = [e[1] for e in events[3:]]
    assert timed == ["sdpa", "dma-w4+split1"] * 3
    assert events[4][2:] == ("1", "[{'dkdv_split': 1}]") and events[3][3] == "[]"
    by = {r["variant"]: r for r in rows}
    assert by["sdpa"]["ms"] == 6.0 and by["dma-w4+split1"]["ms"] == 5.0
    assert by["dma-w4"]["ms"] is None and by["dma-w4"]["status"].startswith("FAILED")
    assert "compiled no graph of its own" in by["dma-w4"]["status"]

    def recompiling(step):
        stats["unique_graphs"] += 1
        return 1.0

    monkeypatch.setattr(model, "bench_ms", recompiling)
    rows = model.run_model(["B16-L512"], ["sdpa"], ["default"], lambda line: None, rounds=2)
    assert rows[0]["status"] == "recompiled while timed" and rows[0]["ms"] == 1.0


def test_model_variant_suffixes_combine():
    """bench.model's variant names: suffixes set switches, kernel options (merged, in order)
    and the symbolic-size compile; an unknown suffix or base is named."""
    from bench import model

    base, env, options = model._switches("dma-w4+dense+split1+pt")
    assert base == "dma-w4" and options == {"route": "dense", "dkdv_split": 1}
    assert env["DMATTN_DT_BIAS"] == "0" and env["DMATTN_INDUCTOR_KERNELS"] == "1"
    assert model._switches("sdpa") == ("sdpa", {**env, "DMATTN_DT_BIAS": "1"}, {})
    assert model._dynamic("dma-w4+dyn") and not model._dynamic("dma-w4+ops")
    for bad in ("dma-w4+fast", "dma-w5", "dma-w4+"):
        with pytest.raises(ValueError, match="unknown variant"):
            model._switches(bad)


def test_model_ratio_pairs_each_round_with_the_references():
    """The model table's ratio is the median of per-round ratios (each round's drift shared by
    the pair), with their range; rows without paired rounds fall back to the medians' ratio."""
    from bench import model

    sdpa = dict(shape="S", mode="default", variant="sdpa", ms=6.0, work=None, status="ok",
                rounds=[5.0, 6.0, 7.0])  # fmt: skip
    dma = dict(sdpa, variant="dma-w4", ms=6.3, work=[0.25], rounds=[5.5, 6.3, 6.3])
    assert model.paired_ratio(dma, sdpa) == (pytest.approx(1.05), "0.90-1.10")
    unpaired = dict(dma, rounds=[6.3])
    assert model.paired_ratio(unpaired, sdpa) == (pytest.approx(1.05), "")
    failed = dict(dma, ms=None, rounds=[])
    assert model.paired_ratio(failed, sdpa) == (None, "")
    table = model.model_table([sdpa, dma])
    assert " 1.05 |" in table and "0.90-1.10" in table and "0.250" in table


def test_model_lengths_runs_each_variant_under_its_switches_and_marks_the_limit(monkeypatch):
    """bench.model's `lengths` on a stub of the GPU: each variant runs under its own switches
    with Dynamo's recompile_limit raised to count every graph (and restored after), a `+dyn`
    variant is refused (the run takes PyTorch's default dynamic shapes), and the table marks
    lengths whose graphs went past the default limit; with `static`, each length is also
    compiled on its own, its model built as the first length's, and the rounds alternate the
    traced and static steps of every length (their medians and per-round ratio reported)."""
    from bench import model

    seen, timed = [], []

    def lengths_of(variant, base, lengths, batch, log):
        seen.append((variant, base, os.environ["DMATTN_INDUCTOR_KERNELS"],
                     torch._dynamo.config.recompile_limit))  # fmt: skip
        rows = [dict(variant=variant, length=n, first_s=1.0, graphs=i + 8)
                for i, n in enumerate(lengths)]  # fmt: skip
        return rows, [("traced", variant, n) for n in lengths]

    # Round r times a step at 2 + r ms traced, 1 + r static: per-round ratios 2, 1.5, 1.33.
    def bench_ms(step):
        timed.append(step)
        r = sum(1 for t in timed if t == step) - 1
        return (2.0 if step[0] == "traced" else 1.0) + r

    monkeypatch.setattr(model, "_lengths_of", lengths_of)
    monkeypatch.setattr(model, "bench_ms", bench_ms)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    limit = torch._dynamo.config.recompile_limit
    config = torch._functorch.config
    with config.patch(enable_autograd_cache=config.enable_autograd_cache):
        rows = model.run_lengths(["sdpa", "dma-w4+ops"], [512, 1024], 2, lambda line: None)
        with pytest.raises(ValueError, match="default dynamic shapes"):
            model.run_lengths(["dma-w4+dyn"], [512], 2, lambda line: None)
    assert torch._dynamo.config.recompile_limit == limit
    assert [s[:3] for s in seen] == [("sdpa", "sdpa", "1"), ("dma-w4+ops", "dma-w4", "0")]
    assert all(s[3] >= 8 for s in seen)
    assert [r["ms"] for r in rows] == [5.0] * 4  # the median of 2..8 over 7 rounds
    table = model.lengths_table(rows, 8)
    assert table.count("past recompile_limit") == 2  # the second length of each variant

    # --static: each length compiled on its own, its model built as the first length's.
    built = []

    def static_step(base, first, n, batch):
        built.append((base, first, n, os.environ["DMATTN_INDUCTOR_KERNELS"]))
        return ("static", n)

    monkeypatch.setattr(model, "_static_step", static_step)
    monkeypatch.setattr(torch._dynamo, "reset", lambda: None)
    timed.clear()
    with config.patch(enable_autograd_cache=config.enable_autograd_cache):
        rows = model.run_lengths(
            ["dma-w4+ops"], [512, 1024], 2, lambda line: None, static=True, rounds=3
        )
    assert built == [("dma-w4", 512, 512, "0"), ("dma-w4", 512, 1024, "0")]
    # Alternating: each round times every length's traced step, then its static one.
    assert timed[:4] == [("traced", "dma-w4+ops", 512), ("static", 512),
                         ("traced", "dma-w4+ops", 1024), ("static", 1024)]  # fmt: skip
    assert [r["static_ms"] for r in rows] == [2.0, 2.0] and [r["ms"] for r in rows] == [3.0, 3.0]
    table = model.lengths_table(rows, 8)
    assert " 1.50 " in table  # the median of the rounds' ratios
    assert "1.33-2.00" in table
