"""The Triton kernels against the float64 oracle.

On CPU they run in Triton's interpreter (conftest sets TRITON_INTERPRET=1), with 16x16 tiles,
so small shapes still cross many tile boundaries; on a GPU the same tests run compiled, plus the
large-shape tests at the end.
"""

import math

import pytest
import torch
import triton
import triton.language as tl
from helpers import (
    DEVICE,
    DTYPES,
    PATTERNS,
    Case,
    assert_close,
    low_precision_bound,
    make_bias,
    make_mask,
    operand_shape,
    param,
)

import dmattn_ops
from dmattn_ops import reference
from dmattn_ops.core import configs
from dmattn_ops.core.band import Band
from dmattn_ops.core.problem import Problem
from dmattn_ops.dispatch import launch, plan
from dmattn_ops.executors.tiles import PackFrom
from dmattn_ops.kernels.common import grid_tile, run_end, run_tile

pytestmark = pytest.mark.skipif(
    DEVICE == "cpu" and not launch.interpreter_on(), reason="needs CUDA or TRITON_INTERPRET=1"
)


def run_case(
    c: Case,
    dtype,
    mask_shape=None,
    bias_shape=None,
    *,
    bias_dtype=None,
    is_causal=False,
    softcap=0.0,
    seqused=None,
    mask=None,
    bias=None,
    kv=None,
    check_grads=True,
):
    """Runs the Triton path and the oracle (float64 and in dtype) and checks out, lse, grads."""
    q = torch.randn(c.b, c.lq, c.h, c.d, dtype=dtype, device=DEVICE)
    k, v = (
        kv
        if kv is not None
        else (
            torch.randn(c.b, c.lk, c.hkv, c.d, dtype=dtype, device=DEVICE),
            torch.randn(c.b, c.lk, c.hkv, c.dv, dtype=dtype, device=DEVICE),
        )
    )
    if mask is None and mask_shape is not None:
        mask = make_mask(mask_shape, device=DEVICE)
    if bias is None and bias_shape is not None:
        bias = make_bias(bias_shape, dtype=bias_dtype or dtype, device=DEVICE)
    if seqused is not None:
        seqused = seqused.to(DEVICE)
    kwargs = dict(is_causal=is_causal, softcap=softcap, seqused_k=seqused)
    inputs = [q, k, v, bias]
    grad_out = torch.randn(c.b, c.lq, c.h, c.dv, dtype=dtype, device=DEVICE)

    def run(fn, tensors, cast):
        leaves = [
            t.detach().to(cast(t)).requires_grad_() if t is not None else None for t in tensors
        ]
        out, lse = fn(leaves[0], leaves[1], leaves[2], mask, leaves[3], return_lse=True, **kwargs)
        wrt = [t for t in leaves if t is not None]
        grads = (
            torch.autograd.grad((out * grad_out.to(out.dtype)).sum(), wrt) if check_grads else []
        )
        return out, lse, grads

    def triton_attention(*args, **kw):
        return dmattn_ops.attention(*args, backend="triton", **kw)

    out, lse, grads = run(triton_attention, inputs, lambda t: t.dtype)
    ref64 = run(reference.attention, inputs, lambda t: torch.float64)
    ref_lp = run(reference.attention, inputs, lambda t: t.dtype)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert_close(out, ref64[0], low_precision_bound(ref64[0], ref_lp[0], dtype), "out")
    lse_bound = (
        2 * (ref_lp[1] - ref64[1])[ref64[1].isfinite()].abs().max().item() + 1e-5
        if ref64[1].isfinite().any()
        else 0.0
    )
    assert_close(lse, ref64[1], lse_bound, "lse")
    names = ("dq", "dk", "dv", "dbias")
    for name, g, r, rl in zip(names, grads, ref64[2], ref_lp[2]):
        assert g.dtype == r.dtype or g.dtype in DTYPES
        assert_close(g, r, low_precision_bound(r, rl, g.dtype), name)
    return out, lse, grads


SHAPES = [
    param(Case(1, 1, 1, 1, 1, 16, 16)),
    param(Case(2, 17, 63, 4, 2, 40, 40)),
    param(Case(1, 63, 17, 2, 1, 80, 64)),
    param(Case(1, 113, 128, 2, 2, 96, 96)),
    param(Case(1, 128, 113, 4, 1, 64, 64)),
    param(Case(1, 33, 47, 2, 2, 128, 128)),
    param(Case(1, 17, 40, 2, 1, 256, 256)),
    param(Case(1, 21, 19, 3, 3, 24, 8)),
]


@pytest.mark.parametrize("case", SHAPES)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_shapes(case, is_causal):
    c = case
    run_case(c, torch.float32, (c.b, c.hkv, c.lq, c.lk), (1, c.h, c.lq, c.lk), is_causal=is_causal)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bias_fp32", [False, True], ids=["bias-same", "bias-fp32"])
def test_dtypes(dtype, bias_fp32):
    c = Case(2, 45, 70, 4, 2, 64, 64)
    run_case(
        c,
        dtype,
        (c.b, 1, 1, c.lk),
        (c.b, c.hkv, 1, c.lk),
        bias_dtype=torch.float32 if bias_fp32 else None,
        is_causal=True,
    )


@pytest.mark.parametrize("pattern", PATTERNS)
def test_every_broadcast_pattern(pattern):
    c = Case(2, 23, 37, 4, 2, 32, 24)
    causal = pattern in ("BHQ", "bGq", "Bhq")
    run_case(
        c, torch.float32, operand_shape(pattern, c), operand_shape(pattern, c), is_causal=causal
    )


def test_per_key_operands_given_as_expanded_views():
    """A mask and a bias with one row per key, passed as (B, H, Lq, Lk) views with query stride
    0, are loaded once per key (PER_KEY) on tile tables, through boundary and interior tiles;
    dbias comes back in the view's full shape."""
    c = Case(2, 37, 45, 4, 2, 32, 32)
    full = (c.b, c.h, c.lq, c.lk)
    mask = make_mask((c.b, c.h, 1, c.lk), density=0.8, device=DEVICE).expand(full)
    bias = make_bias((c.b, c.h, 1, c.lk), dtype=torch.float32, device=DEVICE).expand(full)
    assert mask.stride(2) == 0 and bias.stride(2) == 0
    assert not plan.compactable(mask, c.h, c.hkv)
    _, _, grads = run_case(c, torch.float32, mask=mask, bias=bias, is_causal=True)
    assert grads[3].shape == full


def test_mask_shared_by_all_queries_given_expanded_takes_the_key_lists(monkeypatch):
    """mask.expand(B, H, Lq, Lk) of a (B, 1, 1, Lk) mask, as model code often passes it, is a
    mask shared by all queries: it runs on key lists (no tile tables), with the same result."""
    c = Case(2, 37, 45, 4, 2, 32, 32)
    full = (c.b, c.h, c.lq, c.lk)
    mask = make_mask((c.b, 1, 1, c.lk), density=0.5, device=DEVICE).expand(full)
    bias = make_bias((c.b, c.hkv, 1, c.lk), dtype=torch.float32, device=DEVICE)

    def no_tables(*args, **kwargs):
        raise AssertionError("tile tables were built for a mask shared by all queries")

    monkeypatch.setattr(launch, "build_tables", no_tables)
    _, _, grads = run_case(c, torch.float32, mask=mask, bias=bias, is_causal=True)
    assert grads[3].shape == bias.shape


@pytest.mark.parametrize(
    "mask_pattern,bias_pattern",
    [("bhq", "BHQ"), ("BGQ", "bhq"), ("bHq", "BGq"), ("Bhq", "bGQ"), ("BHQ", "bhQ")],
)
def test_mixed_patterns_softcap(mask_pattern, bias_pattern):
    c = Case(2, 19, 29, 6, 2, 16, 16)
    run_case(
        c,
        torch.float32,
        operand_shape(mask_pattern, c),
        operand_shape(bias_pattern, c),
        is_causal=True,
        softcap=3.0,
    )


@pytest.mark.parametrize("lq,lk", [(9, 40), (40, 9), (33, 33)], ids=["Lq<Lk", "Lq>Lk", "Lq=Lk"])
@pytest.mark.parametrize("with_mask", [False, True], ids=["nomask", "mask"])
def test_causal_alignment_and_seqused(lq, lk, with_mask):
    c = Case(3, lq, lk, 2, 1, 16, 16)
    seqused = torch.tensor([lk, lk // 2, 0], dtype=torch.int32)
    mask_shape = (c.b, 1, c.lq, c.lk) if with_mask else None
    run_case(c, torch.float32, mask_shape, (1, 1, c.lq, c.lk), is_causal=True, seqused=seqused)


# NaN torture: one test per guarantee of README "Semantics".


def test_fully_masked_rows_tiles_heads_batches():
    c = Case(3, 40, 70, 4, 2, 16, 16)
    mask = make_mask((c.b, c.h, c.lq, c.lk), density=0.8, device=DEVICE)
    mask[0] = False  # a whole batch
    mask[1, 2] = False  # a whole head
    mask[2, :, 5] = False  # whole rows
    mask[2, :, 16:32] = False  # whole query tiles
    mask[1, :, :, 16:48] = False  # whole key tiles
    out, lse, grads = run_case(c, torch.float32, mask=mask, bias_shape=(c.b, c.h, c.lq, c.lk))
    assert (out[0] == 0).all() and (out[1, :, 2] == 0).all() and (out[2, 5] == 0).all()
    assert torch.isneginf(lse[0]).all() and torch.isneginf(lse[2, :, 5]).all()
    assert (grads[0][0] == 0).all() and (grads[3][0] == 0).all() and (grads[3][2, :, 5] == 0).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_finfo_min_and_neg_inf_bias(dtype):
    c = Case(1, 20, 40, 2, 1, 16, 16)
    bias = make_bias((1, c.h, c.lq, c.lk), dtype=dtype, device=DEVICE)
    bias[:, :, 0] = -math.inf  # every key -inf: an empty row
    bias[:, :, 1, ::2] = -math.inf
    bias[:, :, 2] = torch.finfo(dtype).min  # finfo.min everywhere: a uniform average
    bias[:, :, 3, :7] = torch.finfo(dtype).min
    bias[:, :, 17:, :20] = torch.finfo(dtype).min  # whole tiles of finfo.min
    out, lse, grads = run_case(c, dtype, bias=bias)
    assert (out[:, 0] == 0).all() and torch.isneginf(lse[..., 0]).all()
    assert (grads[0][:, 0] == 0).all() and (grads[3][:, :, 0] == 0).all()


def test_nonfinite_bias_where_not_allowed():
    c = Case(2, 33, 50, 2, 2, 16, 16)
    mask = make_mask((c.b, 1, c.lq, c.lk), density=0.5, device=DEVICE)
    seqused = torch.tensor([41, 50], dtype=torch.int32)
    bias = make_bias((c.b, c.h, c.lq, c.lk), device=DEVICE, dtype=torch.float32)
    j = torch.arange(c.lk, device=DEVICE)
    causal_out = torch.ones(c.lq, c.lk, dtype=torch.bool, device=DEVICE).triu(c.lk - c.lq + 1)
    outside = (~mask) | (j >= seqused.to(DEVICE)[:, None, None, None]) | causal_out
    junk = torch.tensor([math.nan, math.inf, -math.inf], device=DEVICE).repeat(c.lk)[: c.lk]
    poisoned = torch.where(outside, junk, bias)
    out_p, _, g_p = run_case(
        c, torch.float32, mask=mask, bias=poisoned, is_causal=True, seqused=seqused
    )
    assert (g_p[3][outside.expand_as(g_p[3])] == 0).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_poisoned_kv_cache_beyond_lk_and_seqused(dtype):
    c = Case(2, 9, 45, 4, 2, 16, 16)
    # A cache of 64 slots full of NaN/Inf; the view has Lk = 45 and seqused_k[b] rows written.
    cache_k = torch.full((c.b, 64, c.hkv, c.d), math.nan, dtype=dtype, device=DEVICE)
    cache_v = torch.full((c.b, 64, c.hkv, c.dv), math.inf, dtype=dtype, device=DEVICE)
    seqused = torch.tensor([23, 45], dtype=torch.int32)
    for b, n in enumerate(seqused.tolist()):
        cache_k[b, :n] = torch.randn(n, c.hkv, c.d, dtype=dtype, device=DEVICE)
        cache_v[b, :n] = torch.randn(n, c.hkv, c.dv, dtype=dtype, device=DEVICE)
    k, v = cache_k[:, : c.lk], cache_v[:, : c.lk]
    # The oracle zeroes keys past seqused_k; the kernels must never load them.
    out, lse, grads = run_case(
        c, dtype, None, (c.b, c.hkv, 1, c.lk), kv=(k, v), is_causal=True, seqused=seqused
    )
    assert torch.isfinite(out).all()
    assert (grads[1][0, 23:] == 0).all() and (grads[2][0, 23:] == 0).all()


def test_skipped_tiles_are_never_loaded():
    # V and K hold NaN in key tiles that the mask rules out entirely; loading any of them into
    # a product would give NaN (0 * NaN), so a finite, exact result shows they were skipped.
    # Whole key tiles of every kernel: block sizes are powers of two.
    q16 = torch.empty(1, 1, 1, 16, device=DEVICE)
    mask16 = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=DEVICE)
    tile = max(
        plan.config(k, Problem(q16, q16, q16, mask16)).block_n for k in ("fwd", "dkdv", "dq")
    )
    c = Case(1, 3 * tile, 6 * tile, 2, 1, 16, 16)
    mask = make_mask((1, 1, c.lq, c.lk), density=0.7, device=DEVICE)
    dead = slice(tile, 3 * tile)
    mask[..., dead] = False
    k = torch.randn(c.b, c.lk, c.hkv, c.d, device=DEVICE)
    v = torch.randn(c.b, c.lk, c.hkv, c.dv, device=DEVICE)
    k_poisoned, v_poisoned = k.clone(), v.clone()
    k_poisoned[:, dead], v_poisoned[:, dead] = math.nan, math.nan
    q = torch.randn(c.b, c.lq, c.h, c.d, device=DEVICE, requires_grad=True)
    bias = make_bias((1, c.h, 1, c.lk), device=DEVICE, dtype=torch.float32, requires_grad=True)
    out = dmattn_ops.attention(q, k_poisoned, v_poisoned, mask, bias, backend="triton")
    dq, dbias = torch.autograd.grad(out.sum(), (q, bias))
    ref = reference.attention(q, k, v, mask, bias)
    rdq, rdbias = torch.autograd.grad(ref.sum(), (q, bias))
    assert_close(out, ref, 1e-5, "out")
    assert_close(dq, rdq, 1e-4, "dq")
    assert_close(dbias, rdbias, 1e-4, "dbias")


def test_bf16_large_logits():
    c = Case(1, 40, 60, 2, 1, 64, 64)
    q = (torch.randn(c.b, c.lq, c.h, c.d, device=DEVICE) * 30).bfloat16()
    k = (torch.randn(c.b, c.lk, c.hkv, c.d, device=DEVICE) * 30).bfloat16()
    v = torch.randn(c.b, c.lk, c.hkv, c.dv, device=DEVICE).bfloat16()
    bias = (torch.randn(1, 1, c.lq, c.lk, device=DEVICE) * 1e4).bfloat16()
    run_case(c, torch.bfloat16, bias=bias, kv=(k, v), is_causal=True)
    del q


@pytest.mark.parametrize("dq_block_m", [16, 32], ids=["same-grid", "pooled-grid"])
def test_backward_kernels_on_their_own_tile_grids(kernel_options, dq_block_m):
    # The dq kernel's tile tables pooled from the dk/dv kernel's finer ones (one mask pass).
    kernel_options(dkdv_config=(16, 16, 1, 1), dq_config=(dq_block_m, 16, 1, 1))
    c = Case(2, 70, 75, 2, 1, 16, 16)
    seqused = torch.tensor([75, 50], dtype=torch.int32)
    mask = make_mask((c.b, c.h, c.lq, c.lk), density=0.3, device=DEVICE)
    mask[:, :, 32:64] = False  # whole pooled query tiles without an allowed key
    run_case(c, torch.float32, mask=mask, bias_shape=(c.b, c.h, c.lq, c.lk), is_causal=True,
             seqused=seqused)  # fmt: skip


def test_deterministic_backward_is_bitwise_reproducible():
    c = Case(2, 50, 70, 4, 2, 32, 32)
    q = torch.randn(c.b, c.lq, c.h, c.d, device=DEVICE, dtype=torch.bfloat16)
    k = torch.randn(c.b, c.lk, c.hkv, c.d, device=DEVICE, dtype=torch.bfloat16)
    v = torch.randn(c.b, c.lk, c.hkv, c.dv, device=DEVICE, dtype=torch.bfloat16)
    mask = make_mask((c.b, 1, c.lq, c.lk), device=DEVICE)
    biases = [
        make_bias(s, device=DEVICE, dtype=torch.bfloat16)
        for s in [(1, 1, c.lq, c.lk), (c.b, c.hkv, 1, c.lk)]
    ]

    def grads(bias):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, bias)]
        out = dmattn_ops.attention(
            *leaves[:3], mask, leaves[3], deterministic=True, is_causal=True, backend="triton"
        )
        return [out, *torch.autograd.grad(out.float().square().sum(), leaves)]

    for bias in biases:
        first, second = grads(bias), grads(bias)
        for a, b in zip(first, second):
            assert torch.equal(a, b)


@pytest.mark.parametrize("split", [1, 2, 4])
@pytest.mark.parametrize("mask_kind", ["key-lists", "tables", "none"])
def test_dkdv_split_across_query_heads(kernel_options, split, mask_kind):
    """The dk/dv kernel with a KV group's 4 query heads split over 1, 2 or 4 programs (float32
    parts summed by the reduce kernel): the oracle's gradients, with seqused_k, causal
    alignment, a per-key bias's dbias columns, and NaN in every K/V row no list holds."""
    kernel_options(dkdv_split=split)
    c = Case(2, 45, 70, 8, 2, 32, 24)
    seqused = torch.tensor([70, 52], dtype=torch.int32)
    mask = None
    if mask_kind == "key-lists":
        mask = make_mask((c.b, c.hkv, 1, c.lk), density=0.4, device=DEVICE)
        assert plan.compactable(mask, c.h, c.hkv)
    elif mask_kind == "tables":
        mask = make_mask((c.b, 1, c.lq, c.lk), density=0.4, device=DEVICE)
        assert not plan.compactable(mask, c.h, c.hkv)
    run_case(c, torch.float32, mask=mask, bias_shape=(c.b, c.hkv, 1, c.lk), is_causal=True,
             seqused=seqused)  # fmt: skip


def test_dkdv_scratch_option_bounds_the_split(kernel_options, monkeypatch):
    """Kernel option dkdv_scratch reaches the launcher's split choice: a key-list call of a
    KV group of 4 heads takes four parts with the default scratch (4 x its query's bytes) and
    two within 1 x, and both give the same gradients. (SPLIT_MIN_STEPS, which stops short
    calls' splits by the platform's tile rows, is out of the way.)"""
    monkeypatch.setattr(configs, "SPLIT_MIN_STEPS", 1)
    c = Case(1, 128, 128, 4, 1, 16, 16)
    mask = make_mask((c.b, 1, 1, c.lk), density=0.5, device=DEVICE)
    q = torch.randn(c.b, c.lq, c.h, c.d, device=DEVICE)
    k, v = (torch.randn(c.b, c.lk, 1, c.d, device=DEVICE) for _ in range(2))
    chosen = []
    split = launch._split
    monkeypatch.setattr(launch, "_split", lambda *a: chosen.append(split(*a)) or chosen[-1])

    def grads():
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = dmattn_ops.attention(*leaves, mask, backend="triton", deterministic=True)
        return torch.autograd.grad(out.square().sum(), leaves)

    default = grads()
    kernel_options(dkdv_scratch=1)
    bounded = grads()
    assert chosen == [4, 2], chosen
    for a, b in zip(default, bounded):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("split", [2, 4])
def test_dkdv_split_never_reads_unlisted_keys_and_is_reproducible(kernel_options, split):
    kernel_options(dkdv_split=split)
    c = Case(2, 40, 60, 4, 1, 16, 16)
    mask = make_mask((c.b, 1, 1, c.lk), density=0.3, device=DEVICE)
    q = torch.randn(c.b, c.lq, c.h, c.d, device=DEVICE, dtype=torch.bfloat16)
    k = torch.randn(c.b, c.lk, c.hkv, c.d, device=DEVICE, dtype=torch.bfloat16)
    v = torch.randn(c.b, c.lk, c.hkv, c.dv, device=DEVICE, dtype=torch.bfloat16)
    unlisted = (~mask[:, 0, 0, :])[:, :, None, None]  # [B, Lk, 1, 1]

    def grads(k, v):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = dmattn_ops.attention(*leaves, mask, is_causal=True, backend="triton")
        return [out, *torch.autograd.grad(out.float().square().sum(), leaves)]

    first, second = grads(k, v), grads(k, v)
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    out, dq, dk, dv = grads(torch.where(unlisted, math.nan, k), torch.where(unlisted, math.nan, v))
    assert torch.equal(out, first[0]) and torch.equal(dq, first[1])
    assert torch.equal(dk[~unlisted.expand_as(dk)], first[2][~unlisted.expand_as(dk)])
    assert (dk[unlisted.expand_as(dk)] == 0).all() and (dv[unlisted.expand_as(dv)] == 0).all()


def test_dkdv_split_choice():
    mib = 1 << 20
    # The DMA model's call (B4 Hkv4 L2048, 64-key tiles, 132 SMs): 512 programs, G = 4.
    assert configs.dkdv_split(4, 512, 132, 32 * mib, 32 * mib) == 2
    assert configs.dkdv_split(4, 100, 132, 30 * mib, 32 * mib) == 4
    assert configs.dkdv_split(4, 100, 132, 70 * mib, 32 * mib) == 1  # scratch over its cap
    assert configs.dkdv_split(4, 1024, 132, 1, 1) == 1  # enough programs
    assert configs.dkdv_split(1, 10, 132, 1, 1) == 1
    assert configs.dkdv_split(6, 100, 132, 1, 100) == 6
    assert configs.dkdv_split(6, 300, 132, 1, 100) == 2
    # Key lists split as far as the scratch allows, whatever the grid (its tiles may be unlisted).
    assert configs.dkdv_split(4, 2048, 132, 128 * mib, 128 * mib, listed=True) == 4
    assert configs.dkdv_split(4, 2048, 132, 200 * mib, 128 * mib, listed=True) == 2
    assert configs.dkdv_split(4, 2048, 132, 600 * mib, 128 * mib, listed=True) == 1
    assert configs.dkdv_split(6, 2048, 132, 1, 100, listed=True) == 6
    # A context-parallel ring's pair call (DMA L65536 on 2 ranks: 16384 rows, Hkv4, G 4):
    # four parts with the library's scratch, two within the ring's (dkdv_scratch=2).
    ring_call = (4, 512, 132, 64 * mib, 64 * mib)
    assert configs.dkdv_split(*ring_call, listed=True, query_tiles=256) == 4
    assert configs.dkdv_split(*ring_call, listed=True, query_tiles=256, scratch_ratio=2) == 2
    # ... and as long as each program keeps SPLIT_MIN_STEPS query tiles: the model's B16 L512
    # call (16 query tiles per head) splits its 4 heads in 2, its B4 L2048 call (64) in 4.
    assert configs.SPLIT_MIN_STEPS == 32
    assert configs.dkdv_split(4, 512, 132, 32 * mib, 32 * mib, listed=True, query_tiles=16) == 2
    assert configs.dkdv_split(4, 512, 132, 32 * mib, 32 * mib, listed=True, query_tiles=64) == 4
    assert configs.dkdv_split(4, 512, 132, 32 * mib, 32 * mib, listed=True, query_tiles=4) == 1
    # Where that is not the limit, the scratch still is.
    assert configs.dkdv_split(4, 512, 132, 40 * mib, 32 * mib, listed=True, query_tiles=64) == 2


# GPU only: sizes the interpreter cannot reach.

gpu = pytest.mark.gpu


@gpu
def test_bias_over_2_pow_31_elements():
    b, h, lq, lk, d = 1, 2, 40000, 28000, 64  # bias: 2.24e9 elements
    q = torch.randn(b, lq, h, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, lk, h, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, lk, h, d, device="cuda", dtype=torch.bfloat16)
    bias = torch.zeros(b, h, lq, lk, device="cuda", dtype=torch.bfloat16)
    assert bias.numel() > 2**31
    rows = torch.tensor([0, 1, 20000, lq - 1], device="cuda")
    bias[:, 1, rows] = torch.randn(len(rows), lk, device="cuda", dtype=torch.bfloat16)
    out, lse = dmattn_ops.attention(q, k, v, None, bias, return_lse=True, backend="triton")
    ref_out, ref_lse = reference.attention(
        q[:, rows].double(),
        k.double(),
        v.double(),
        None,
        bias[:, :, rows].double(),
        return_lse=True,
        is_causal=False,
    )
    ref_lp = reference.attention(q[:, rows], k, v, None, bias[:, :, rows])
    assert_close(
        out[:, rows], ref_out, low_precision_bound(ref_out, ref_lp, torch.bfloat16), "sampled rows"
    )
    assert torch.isfinite(lse).all()


@gpu
def test_long_sequence_broadcast_bias_and_mask():
    b, h, length, d = 1, 16, 16384, 128
    q = torch.randn(b, length, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(b, length, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(b, length, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    bias = torch.randn(b, h, 1, length, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    top = bias.detach().topk(2048, dim=-1).indices
    mask = torch.zeros_like(bias, dtype=torch.bool).scatter(-1, top, True)
    out = dmattn_ops.attention(q, k, v, mask, bias, is_causal=True, backend="triton")
    out.float().square().sum().backward()
    for t in (out, q.grad, k.grad, v.grad, bias.grad):
        assert torch.isfinite(t).all()
    rows = torch.tensor([0, 1, 777, 8191, length - 1], device="cuda")
    # Sampled rows against the oracle: causal rows i see keys j <= i.
    j = torch.arange(length, device="cuda")
    row_mask = mask.expand(b, h, len(rows), length) & (j[None, :] <= rows[:, None])
    ref = reference.attention(
        q[:, rows].detach().double(),
        k.detach().double(),
        v.detach().double(),
        row_mask,
        bias.detach().double(),
    )
    ref_lp = reference.attention(
        q[:, rows].detach(), k.detach(), v.detach(), row_mask, bias.detach()
    )
    assert_close(
        out[:, rows].detach(), ref, low_precision_bound(ref, ref_lp, torch.bfloat16), "sampled rows"
    )


@gpu
def test_cuda_graph_capture_forward_backward():
    c = Case(2, 256, 256, 4, 2, 64, 64)
    q = torch.randn(c.b, c.lq, c.h, c.d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(c.b, c.lk, c.hkv, c.d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(c.b, c.lk, c.hkv, c.dv, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    bias = torch.randn(c.b, c.hkv, 1, c.lk, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    mask = make_mask((c.b, 1, c.lq, c.lk), device="cuda")
    seqused = torch.tensor([200, 256], dtype=torch.int32, device="cuda")

    def step():
        for t in (q, k, v, bias):
            t.grad = None
        out = dmattn_ops.attention(q, k, v, mask, bias, is_causal=True, seqused_k=seqused)
        out.float().sum().backward()
        return out

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    graph.replay()
    torch.cuda.synchronize()
    eager = dmattn_ops.attention(
        q.detach(), k.detach(), v.detach(), mask, bias.detach(), is_causal=True, seqused_k=seqused
    )
    assert torch.equal(out, eager)
    assert torch.isfinite(bias.grad).all() and bias.grad.abs().sum() > 0


def spy_on(monkeypatch, name: str) -> list:
    """Wraps launch.<name>; returns the list of its calls' query shapes (its first argument
    is the call's Problem)."""
    calls = []
    real = getattr(launch, name)

    def spy(*args):
        calls.append(args[0].query.shape)
        return real(*args)

    monkeypatch.setattr(launch, name, spy)
    return calls


@pytest.fixture(params=[True, False], ids=["packed", "gathered"])
def pack_spy(request, monkeypatch, kernel_options):
    """Runs a test with the kernel option pack_keys on and off; records whether each key-list
    build packed K, V and the bias."""
    kernel_options(pack_keys=request.param)
    packed = []
    real = launch.build_key_lists

    def spy(*args):
        lists = real(*args)
        packed.append(lists.packed is not None)
        return lists

    monkeypatch.setattr(launch, "build_key_lists", spy)
    return request.param, packed


@pytest.mark.parametrize("bias_pattern", ["BGq", "BHq", "BHQ", "bhq"])
def test_key_lists_never_load_unlisted_keys(bias_pattern, pack_spy):
    # A mask broadcast over queries is run over the sorted list of its allowed keys. K/V hold
    # NaN at every key outside the list (and past seqused_k): any load of them into a product
    # would show up as NaN, so a finite result equal to the oracle's shows they never were.
    # Packed keys (a per-key bias, or none) leave NaN in the packed buffers past each list
    # (conftest poisons fresh allocations): they must not be read either.
    c = Case(2, 40, 90, 4, 2, 16, 16)
    assert plan.compactable(torch.ones(c.b, c.hkv, 1, c.lk, dtype=torch.bool), c.h, c.hkv)
    mask = make_mask((c.b, c.hkv, 1, c.lk), density=0.3, device=DEVICE)
    seqused = torch.tensor([90, 61], dtype=torch.int32, device=DEVICE)
    k = torch.randn(c.b, c.lk, c.hkv, c.d, device=DEVICE)
    v = torch.randn(c.b, c.lk, c.hkv, c.dv, device=DEVICE)
    unlisted = (~mask[:, :, 0, :]).transpose(1, 2)[..., None]  # [B, Lk, Hkv, 1]
    k_bad = torch.where(unlisted, math.nan, k)
    v_bad = torch.where(unlisted, math.nan, v)
    k_bad[1, 61:], v_bad[1, 61:] = math.nan, math.nan
    q = torch.randn(c.b, c.lq, c.h, c.d, device=DEVICE, requires_grad=True)
    bias = make_bias(
        operand_shape(bias_pattern, c), dtype=torch.float32, device=DEVICE, requires_grad=True
    )
    kw = dict(is_causal=True, seqused_k=seqused)
    out = dmattn_ops.attention(q, k_bad, v_bad, mask, bias, backend="triton", **kw)
    grads = torch.autograd.grad(out.square().sum(), (q, bias))
    ref = reference.attention(q, k, v, mask, bias, **kw)
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, bias))
    assert_close(out, ref, 1e-5, "out")
    for name, g, r in zip(("dq", "dbias"), grads, ref_grads):
        assert_close(g, r, 1e-4, name)
    # dk / dv with clean K/V: listed keys get their gradient, unlisted ones exactly zero.
    kk, vv = k.clone().requires_grad_(), v.clone().requires_grad_()
    out = dmattn_ops.attention(q, kk, vv, mask, bias, backend="triton", **kw)
    dk, dv = torch.autograd.grad(out.square().sum(), (kk, vv))
    kr, vr = k.clone().requires_grad_(), v.clone().requires_grad_()
    rdk, rdv = torch.autograd.grad(
        reference.attention(q, kr, vr, mask, bias, **kw).square().sum(), (kr, vr)
    )
    assert_close(dk, rdk, 1e-4, "dk")
    assert_close(dv, rdv, 1e-4, "dv")
    assert (dk[unlisted.expand_as(dk)] == 0).all()
    pack, packed = pack_spy
    # One build per call above: the backward reads the forward's lists (launch.KeptLists).
    # They pack unless the bias has query rows.
    assert len(packed) == 2 and sum(packed) == (2 if pack and bias_pattern != "BHQ" else 0)


def test_backward_reads_the_forward_key_lists(pack_spy):
    # An eager call builds its key lists once and its backward reads them (launch.KeptLists);
    # a second backward of a retained graph builds them again; under saved-tensor hooks
    # (activation checkpointing), which decide what the graph keeps, nothing is kept. Every
    # one of these matches the oracle.
    c = Case(2, 40, 72, 4, 2, 16, 16)
    mask = make_mask((c.b, c.hkv, 1, c.lk), density=0.4, device=DEVICE)
    q = torch.randn(c.b, c.lq, c.h, c.d, device=DEVICE, requires_grad=True)
    k = torch.randn(c.b, c.lk, c.hkv, c.d, device=DEVICE, requires_grad=True)
    v = torch.randn(c.b, c.lk, c.hkv, c.dv, device=DEVICE, requires_grad=True)
    bias = make_bias((c.b, c.hkv, 1, c.lk), dtype=torch.float32, device=DEVICE, requires_grad=True)
    leaves = (q, k, v, bias)
    ref = reference.attention(q, k, v, mask, bias, is_causal=True)
    expected = torch.autograd.grad(ref.square().sum(), leaves)
    _, builds = pack_spy

    def check(grads):
        for name, g, r in zip(("dq", "dk", "dv", "dbias"), grads, expected):
            assert_close(g, r, 1e-4, name)

    loss = dmattn_ops.attention(q, k, v, mask, bias, is_causal=True, backend="triton").square()
    check(torch.autograd.grad(loss.sum(), leaves, retain_graph=True))
    assert len(builds) == 1
    check(torch.autograd.grad(loss.sum(), leaves))
    assert len(builds) == 2

    def layer(*leaves):
        return dmattn_ops.attention(*leaves[:3], mask, leaves[3], is_causal=True, backend="triton")

    builds.clear()
    out = torch.utils.checkpoint.checkpoint(layer, *leaves, use_reentrant=False)
    check(torch.autograd.grad(out.square().sum(), leaves))
    assert len(builds) == 3  # the forward, its recomputation, the backward


@pytest.mark.parametrize("fwd_rows, dq_rows", [(32, 16), (16, 32)])
@pytest.mark.parametrize("window", [(-1, -1), (20, 0)], ids=["causal", "window"])
@pytest.mark.parametrize("pack_heads", [False, True], ids=["one-head", "group"])
def test_key_lists_serve_passes_of_different_tiles(
    kernel_options, pack_spy, fwd_rows, dq_rows, window, pack_heads
):
    """Forward and dQ tiles of different rows (as an H200's D64 and D256 configs take): the
    lists are built once, at the finer tiling (plan._list_rows), and the other pass reads
    LIST_R list tiles per query tile, clamped at the last (75 rows: 3 tiles of 32, 5 of 16);
    with and without a window (whose starts come from the first list tile), one head or a KV
    group per program. Outputs and every gradient match the float64 oracle; the backward
    builds no lists of its own."""
    kernel_options(
        fwd_config=(fwd_rows, 16, 1, 1), dq_config=(dq_rows, 16, 1, 1), pack_heads=pack_heads
    )
    c = Case(2, 75, 75, 4, 2, 16, 16)
    mask = make_mask((c.b, c.hkv, 1, c.lk), density=0.5, device=DEVICE)
    leaves = [
        torch.randn(c.b, c.lq, c.h, c.d, device=DEVICE, requires_grad=True),
        torch.randn(c.b, c.lk, c.hkv, c.d, device=DEVICE, requires_grad=True),
        torch.randn(c.b, c.lk, c.hkv, c.dv, device=DEVICE, requires_grad=True),
        make_bias((c.b, c.hkv, 1, c.lk), dtype=torch.float32, device=DEVICE, requires_grad=True),
    ]
    kw = dict(is_causal=True, window_size=window)
    out = dmattn_ops.attention(*leaves[:3], mask, leaves[3], backend="triton", **kw)
    grads = torch.autograd.grad(out.square().sum(), leaves)
    _, builds = pack_spy
    assert len(builds) == 1
    wide = [t.detach().double().requires_grad_() for t in leaves]
    ref = reference.attention(*wide[:3], mask, wide[3], **kw)
    ref_grads = torch.autograd.grad(ref.square().sum(), wide)
    assert_close(out.double(), ref, 1e-5, "out")
    for name, g, r in zip(("dq", "dk", "dv", "dbias"), grads, ref_grads):
        assert_close(g.double(), r, 1e-4, name)


@pytest.fixture
def heads_spy(monkeypatch, kernel_options):
    """Packs a KV group's query heads into one forward / dq program at every length (kernel
    option pack_heads; on the GPU only long calls do) and records the heads per program of
    every forward and backward plan."""
    kernel_options(pack_heads=True)
    heads = []
    real = plan.plan

    def spy(*args, **kwargs):
        p = real(*args, **kwargs)
        heads.append(p.heads)
        return p

    monkeypatch.setattr(plan, "plan", spy)
    return heads


@pytest.mark.parametrize(
    "case",
    [param(Case(2, 40, 40, 4, 2, 16, 16)), param(Case(1, 37, 70, 8, 2, 32, 24))],
)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shared", ["Hkv", "1"], ids=["per-group", "one-for-all"])
def test_packed_heads_match_the_oracle(case, is_causal, shared, heads_spy):
    """Key lists with the G query heads of a KV group in one forward / dq program (rows:
    position r // G of head r % G): every result against the float64 oracle, with seqused_k
    cutting one batch's list short, a mask and bias per KV group or one for all heads, and
    Lq != Lk (the causal diagonal then runs through the packed tiles' positions)."""
    c = case
    hm = c.hkv if shared == "Hkv" else 1
    mask = make_mask((c.b, hm, 1, c.lk), density=0.7, device=DEVICE)
    seqused = torch.tensor([c.lk, c.lk - 7][: c.b], dtype=torch.int32)
    run_case(
        c, torch.float32, bias_shape=(c.b, hm, 1, c.lk), mask=mask, is_causal=is_causal,
        seqused=seqused,
    )  # fmt: skip
    g = c.h // c.hkv
    assert heads_spy == [g, g], heads_spy


def test_packed_heads_with_sinks_window_and_poisoned_keys(heads_spy):
    """Packed heads with a sink per head (each row starts from its own head's), a window
    whose listed keys start mid-list, NaN in K and V at every unlisted key, and an empty
    row (a query whose window holds no listed key): finite, and equal to the oracle."""
    c = Case(2, 48, 48, 4, 1, 16, 16)
    mask = make_mask((c.b, c.hkv, 1, c.lk), density=0.5, device=DEVICE)
    mask[0, :, 0, 20:40] = False  # rows 27..39 of batch 0: no listed key in their window
    q = torch.randn(c.b, c.lq, c.h, c.d, device=DEVICE, requires_grad=True)
    k = torch.randn(c.b, c.lk, c.hkv, c.d, device=DEVICE)
    v = torch.randn(c.b, c.lk, c.hkv, c.dv, device=DEVICE)
    unlisted = (~mask[:, :, 0, :]).transpose(1, 2)[..., None]
    k_bad, v_bad = torch.where(unlisted, math.nan, k), torch.where(unlisted, math.nan, v)
    bias = make_bias((c.b, c.hkv, 1, c.lk), dtype=torch.float32, device=DEVICE).requires_grad_()
    sinks = torch.tensor([0.5, -1.0, float("-inf"), 2.0], device=DEVICE, requires_grad=True)
    kw = dict(is_causal=True, window_size=(7, 0))
    out = dmattn_ops.attention(q, k_bad, v_bad, mask, bias, sinks=sinks, backend="triton", **kw)
    grads = torch.autograd.grad(out.square().sum(), (q, bias, sinks))
    ref = reference.attention(q, k, v, mask, bias, sinks=sinks, **kw)
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, bias, sinks))
    assert out.isfinite().all() and all(g.isfinite().all() for g in grads)
    assert_close(out, ref, 1e-5, "out")
    for name, g, r in zip(("dq", "dbias", "dsinks"), grads, ref_grads):
        assert_close(g, r, 1e-4, name)
    assert heads_spy == [4, 4], heads_spy


# Split-K decoding (Lq <= 16 against a long cache).

DECODE = [
    param(Case(3, 1, 150, 8, 2, 32, 32)),
    param(Case(2, 3, 97, 4, 4, 16, 24)),
    param(Case(1, 16, 70, 2, 1, 64, 64)),
]


@pytest.mark.parametrize("lq,lk", [(96, 96), (70, 100)], ids=["Lq=Lk", "Lq<Lk"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_key_lists_interior_and_boundary_tiles(lq, lk, is_causal, pack_spy):
    """Per-key masks dense enough that the listed keys fill interior tiles (every row of the
    query tile sees them: no bounds or causal arithmetic) as well as boundary ones, with
    seqused_k cutting one batch's list short."""
    c = Case(2, lq, lk, 4, 2, 32, 32)
    mask = make_mask((c.b, c.hkv, 1, c.lk), density=0.9, device=DEVICE)
    assert plan.compactable(mask, c.h, c.hkv)
    run_case(
        c,
        torch.float32,
        bias_shape=(c.b, c.hkv, 1, c.lk),
        mask=mask,
        is_causal=is_causal,
        seqused=torch.tensor([lk, lk - 9], dtype=torch.int32),
    )
    pack, packed = pack_spy
    assert packed and all(p == pack for p in packed)


@pytest.fixture
def decode_spy(monkeypatch):
    """Counts calls of the split-K forward, to show the tests below run it."""
    return spy_on(monkeypatch, "decode_forward")


@pytest.mark.parametrize("case", DECODE)
@pytest.mark.parametrize(
    ("mask_pattern", "bias_pattern"), [(None, "BGq"), ("bGq", "bHQ"), ("Bhq", "BHq")]
)
def test_decode_split_k(decode_spy, case, mask_pattern, bias_pattern):
    c = case
    # seqused_k: an empty cache, a partly filled one, a full one; NaN in every unused slot.
    seqused = torch.tensor([0, 61, c.lk][: c.b], dtype=torch.int32)
    k = torch.full((c.b, c.lk, c.hkv, c.d), math.nan, device=DEVICE)
    v = torch.full((c.b, c.lk, c.hkv, c.dv), math.nan, device=DEVICE)
    for b, n in enumerate(seqused.tolist()):
        k[b, :n], v[b, :n] = torch.randn(n, c.hkv, c.d), torch.randn(n, c.hkv, c.dv)
    run_case(
        c, torch.float32,
        operand_shape(mask_pattern, c) if mask_pattern else None,
        operand_shape(bias_pattern, c), kv=(k, v), is_causal=True, softcap=3.0, seqused=seqused,
    )  # fmt: skip
    assert decode_spy, "the split-K decode path did not run"


def test_decode_splits_past_the_last_tile(decode_spy, monkeypatch):
    """With a symbolic cache length (a compiled graph with dynamic shapes) the split count is
    the example length's, so a shorter cache leaves splits without a key tile: each writes
    an empty part (m = -inf, l = 0) and the combine weighs it 0. Here 8 times the splits the
    cache has tiles for (the launcher told every size is symbolic, its example 8 times as
    long), against the float64 oracle."""
    from dmattn_ops.dispatch import launch

    monkeypatch.setattr(launch, "symbolic", lambda n: True)
    monkeypatch.setattr(launch, "hint", lambda n: 8 * n)
    monkeypatch.setattr(launch, "sm_count", lambda device: 10_000)
    c = Case(3, 1, 333, 6, 2, 24, 24)  # a shape of its own: no plan made before the patch
    seqused = torch.tensor([0, 77, c.lk], dtype=torch.int32)
    run_case(c, torch.float32, (c.b, c.hkv, 1, c.lk), (c.b, c.hkv, 1, c.lk), seqused=seqused)
    assert decode_spy, "the split-K decode path did not run"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_dtypes_without_seqused(decode_spy, dtype):
    c = Case(2, 2, 130, 8, 2, 40, 40)
    run_case(c, dtype, (1, 1, 1, c.lk), (c.b, c.hkv, 1, c.lk), is_causal=False)
    assert decode_spy


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("d", "dv"), [(40, 24), (48, 24), (40, 8), (24, 40)])
def test_unequal_head_dims_16_bit(dtype, d, dv):
    """Regression: with BLOCK_D > BLOCK_DV, Triton 3.6 on an H100 produced errors ~1 here."""
    c = Case(2, 45, 50, 6, 2, d, dv)
    run_case(c, dtype, (c.b, c.hkv, 1, c.lk), (c.b, c.hkv, 1, c.lk), is_causal=True, softcap=5.0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bias_kind", ["none", "key", "entry"])
@pytest.mark.parametrize("mask_kind", ["none", "key", "entry"])
@pytest.mark.parametrize("d", [8, 40, 64, 72, 96, 128, 160, 192, 256])
def test_head_dim_sweep_every_operand_kind(d, mask_kind, bias_kind, dtype):
    """Every head-dim bucket with every mask and bias kind (none, per key, per entry), forward
    and backward: the configs the launcher picks compile, fit and are exact (issue 13)."""
    c = Case(2, 80, 96, 4, 2, d, d)
    shapes = {"none": None, "key": (c.b, c.hkv, 1, c.lk), "entry": (c.b, c.h, c.lq, c.lk)}
    run_case(c, dtype, shapes[mask_kind], shapes[bias_kind], is_causal=True)


def _key_lists_by_counting(mask, seqused_k, b, lq, lk, is_causal, block_m):
    """KeyLists' contents written out directly: sorted allowed keys then the others in
    descending order (a permutation), and counts below each query tile's causal end and below
    seqused_k."""
    bm, hm = mask.shape[:2]
    bt = b if seqused_k is not None else bm
    nq = -(-lq // block_m)
    keys = torch.full((bm, hm, lk), lk, dtype=torch.int32)
    key_end = torch.zeros((bt, hm, nq), dtype=torch.int32)
    key_count = torch.zeros((bt, hm), dtype=torch.int32)
    for i in range(bt):
        n = lk if seqused_k is None else min(max(int(seqused_k[i]), 0), lk)
        for h in range(hm):
            allowed = torch.nonzero(mask[i if bm > 1 else 0, h, 0].cpu()).flatten()
            others = torch.nonzero(~mask[i if bm > 1 else 0, h, 0].cpu()).flatten().flip(0)
            keys[i if bm > 1 else 0, h] = torch.cat((allowed, others)).to(torch.int32)
            key_count[i, h] = int((allowed < n).sum())
            for t in range(nq):
                end = n
                if is_causal:
                    end = max(min(n, min((t + 1) * block_m, lq) + n - lq), 0)
                key_end[i, h, t] = int((allowed < end).sum())
    return keys, key_end, key_count


@pytest.mark.parametrize(
    "bm, seq, is_causal, lq, lk, block_m",
    [
        (1, None, True, 64, 64, 16),
        (3, None, False, 40, 1500, 16),  # many chunks of keys
        (1, [1500, 0, 700], True, 1100, 1500, 1),  # more query tiles than a chunk of keys
        (3, [5, 1499, 2000], True, 33, 1499, 32),  # seqused_k past Lk is clamped
    ],
)
def test_key_lists_kernel_matches_direct_counting(bm, seq, is_causal, lq, lk, block_m):
    if DEVICE == "cpu" and not launch.interpreter_on():
        pytest.skip("needs CUDA or the interpreter")
    b, hm = 3, 2
    g = torch.Generator().manual_seed(lk + lq)
    mask = torch.rand(bm, hm, 1, lk, generator=g) < 0.3
    mask[0, 0, 0] = False
    mask[-1, -1, 0] = True
    seqused_k = None if seq is None else torch.tensor(seq, dtype=torch.int32)
    want = _key_lists_by_counting(mask, seqused_k, b, lq, lk, is_causal, block_m)
    got = launch.build_key_lists(
        mask.to(DEVICE), None if seqused_k is None else seqused_k.to(DEVICE), b, lq, lk,
        Band.of(is_causal, (-1, -1)), block_m,
    )  # fmt: skip
    for name, g_, w in zip(("keys", "key_end", "key_count"), (got.keys, got.key_end,
                                                             got.key_count), want):  # fmt: skip
        assert torch.equal(g_.cpu().reshape(w.shape), w), name


@pytest.mark.parametrize("zero_tail", [False, True], ids=["tail-unwritten", "zero-tail"])
@pytest.mark.parametrize(
    "mask_heads, bias_heads", [(2, 2), (1, 6), (2, None)], ids=["group", "shared", "no-bias"]
)
def test_key_lists_pack_listed_rows(mask_heads, bias_heads, zero_tail):
    """Packed rows are K, V and the bias at the listed keys in list order, for every batch and
    KV group, up to the count below seqused_k: a mask per KV group, or one shared by all heads
    and broadcast over the batch; a bias per KV group, per query head, or none. With
    zero_tail (the Hopper kernels' packing), K's and V's rows past the count are zeros
    (conftest fills fresh buffers with NaN, so an unwritten row shows)."""
    if DEVICE == "cpu" and not launch.interpreter_on():
        pytest.skip("needs CUDA or the interpreter")
    b, h, hkv, lk, d, dv = 3, 6, 2, 300, 24, 40
    g = torch.Generator().manual_seed(5)
    mask = torch.rand(1 if mask_heads == 1 else b, mask_heads, 1, lk, generator=g) < 0.4
    k, v = torch.randn(b, lk, hkv, d, generator=g), torch.randn(b, lk, hkv, dv, generator=g)
    bias = None if bias_heads is None else torch.randn(b, bias_heads, 1, lk, generator=g)
    seqused = torch.tensor([lk, 170, 0], dtype=torch.int32)
    lists = launch.build_key_lists(
        mask.to(DEVICE), seqused.to(DEVICE), b, 50, lk, Band.of(True, (-1, -1)), 16,
        PackFrom(
            k.to(DEVICE), v.to(DEVICE), None if bias is None else bias.to(DEVICE), h, zero_tail
        ),
    )  # fmt: skip
    packed = lists.packed
    per_group = 1 if bias_heads != h else h // hkv
    assert (packed.bias is None) == (bias is None)
    for i in range(b):
        for group in range(hkv):
            hm = group * (h // hkv) // (h // mask_heads)
            n = int(lists.key_count[i, hm])
            assert n == int(mask[i % mask.shape[0], hm, 0, : int(seqused[i])].sum())
            keys = lists.keys[i % mask.shape[0], hm, :n].cpu().long()
            assert torch.equal(packed.key[i, :n, group].cpu(), k[i, keys, group])
            assert torch.equal(packed.value[i, :n, group].cpu(), v[i, keys, group])
            if zero_tail:
                assert (packed.key[i, n:, group] == 0).all()
                assert (packed.value[i, n:, group] == 0).all()
            for j in range(per_group if bias is not None else 0):
                src = bias[i, group * per_group + j if bias_heads == h else group, 0]
                got = packed.bias[i, group * per_group + j, 0, :n].cpu()
                assert torch.equal(got, src[keys])


@pytest.mark.parametrize("is_causal", [False, True])
def test_varlen_key_lists_kernel_matches_direct_counting(is_causal):
    """Sequences of 0, 1300 (two chunks of keys) and 40 keys, query lengths that differ from
    them, a key row past the last sequence; keys stored at each sequence's own positions."""
    hm, block_m = 2, 16
    cu_q = torch.tensor([0, 3, 40, 77], dtype=torch.int32)
    cu_k = torch.tensor([0, 0, 1300, 1340], dtype=torch.int32)
    total_q, total_k = 80, 1345
    mask = torch.rand(hm, total_k, generator=torch.Generator().manual_seed(1)) < 0.3
    nq = -(-40 // block_m)
    got = launch.build_varlen_key_lists(
        mask.to(DEVICE), cu_q.to(DEVICE), cu_k.to(DEVICE), total_q, nq,
        Band.of(is_causal, (-1, -1)), block_m, 1300,
    )  # fmt: skip
    keys = torch.full((hm, total_k), total_k, dtype=torch.int32)
    key_end = torch.zeros((3, hm, nq), dtype=torch.int32)
    key_count = torch.zeros((3, hm), dtype=torch.int32)
    for b in range(3):
        q0, q1, k0, k1 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        lq, n = q1 - q0, k1 - k0
        for h in range(hm):
            allowed = torch.nonzero(mask[h, k0:k1]).flatten()
            keys[h, k0 : k0 + allowed.numel()] = allowed.to(torch.int32)
            key_count[b, h] = allowed.numel()
            for t in range(nq):
                end = n
                if is_causal:
                    end = max(min(n, min((t + 1) * block_m, lq) + n - lq), 0)
                if t * block_m >= lq:
                    end = 0
                key_end[b, h, t] = int((allowed < end).sum())
    assert torch.equal(got.keys.cpu(), keys)
    assert torch.equal(got.key_end.cpu().reshape(key_end.shape), key_end)
    assert torch.equal(got.key_count.cpu().reshape(key_count.shape), key_count)


# The grid order of the causal kernels (kernels/common.py grid_tile).


@triton.jit
def _order_kernel(OUT, TILE_MAJOR: tl.constexpr, LAST_FIRST: tl.constexpr):
    """OUT[launch index] = (tile, row) that grid_tile gives this program."""
    tile, row = grid_tile(TILE_MAJOR, LAST_FIRST)
    launch = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
    tl.store(OUT + 2 * launch, tile)
    tl.store(OUT + 2 * launch + 1, row)


@pytest.mark.parametrize("tile_major", [False, True], ids=["row-major", "tile-major"])
@pytest.mark.parametrize("last_first", [False, True], ids=["first-first", "last-first"])
def test_grid_tile_maps_launch_order_onto_every_tile_once(tile_major, last_first):
    """Each program of a (tiles, rows) grid gets a distinct (tile, row), every pair once; in
    launch order (axis 0 fastest) the tile-major order runs one tile over every row before the
    next, starting from the last tile with last_first, and the row-major one keeps a row's
    tiles together."""
    tiles, rows = 5, 3
    out = torch.full((tiles * rows, 2), -1, dtype=torch.int32, device=DEVICE)
    _order_kernel[(tiles, rows)](out, TILE_MAJOR=tile_major, LAST_FIRST=last_first)
    got = [tuple(p) for p in out.tolist()]  # (tile, row) of each program, in launch order
    assert sorted(got) == [(t, r) for t in range(tiles) for r in range(rows)]
    order = list(range(tiles))[::-1] if last_first else list(range(tiles))
    if tile_major:
        want = [(t, r) for t in order for r in range(rows)]
    else:
        want = [(t, r) for r in range(rows) for t in order]
    assert got == want


# The two runs every kernel walks its tiles in (kernels/common.py run_end, run_tile).


@triton.jit
def _runs_kernel(BOUNDS, LIST, OUT, AFTER_FIRST: tl.constexpr, TABLE: tl.constexpr):
    """OUT: the tiles of the interior run, then those of the boundary run, of tiles [lo, hi)
    with interior tiles [int_lo, int_hi) (BOUNDS), as the kernels walk them; -1 after them.
    AFTER_FIRST: the boundary run takes the tiles after the interior ones first (the forward
    and dq kernels), else those before them (the dk/dv kernel). TABLE: tiles are LIST entries."""
    lo, int_lo = tl.load(BOUNDS), tl.load(BOUNDS + 1)
    int_hi, hi = tl.load(BOUNDS + 2), tl.load(BOUNDS + 3)
    n = 0
    for it in range(int_lo, int_hi):
        tl.store(OUT + n, run_tile(it, 0, 0, LIST, False, TABLE))
        n += 1
    if AFTER_FIRST:
        start, a_end, b_start, b_end = int_hi, hi, lo, int_lo
    else:
        start, a_end, b_start, b_end = lo, int_lo, int_hi, hi
    for it in range(start, run_end(a_end, b_start, b_end)):
        tl.store(OUT + n, run_tile(it, a_end, b_start, LIST, True, TABLE))
        n += 1


@pytest.mark.parametrize("after_first", [True, False], ids=["after-first", "before-first"])
@pytest.mark.parametrize("table", [False, True], ids=["tiles", "table"])
def test_tile_runs_visit_every_tile_once(after_first, table):
    """The interior run visits [int_lo, int_hi) in order; the boundary run visits the tiles on
    both sides of it, each once, in the kernel's order; empty sides and empty runs included.
    With a table the same positions index a list of tiles."""
    cases = [(0, 0, 0, 0), (0, 0, 5, 5), (0, 3, 3, 3), (2, 2, 2, 7), (0, 2, 6, 9), (3, 5, 5, 8),
             (1, 1, 4, 4), (4, 6, 9, 9)]  # fmt: skip
    entries = torch.tensor([17, 3, 11, 8, 0, 5, 14, 2, 9, 6], dtype=torch.int32, device=DEVICE)
    for lo, int_lo, int_hi, hi in cases:
        bounds = torch.tensor([lo, int_lo, int_hi, hi], dtype=torch.int32, device=DEVICE)
        out = torch.full((16,), -1, dtype=torch.int32, device=DEVICE)
        _runs_kernel[(1,)](bounds, entries, out, AFTER_FIRST=after_first, TABLE=table)
        before, inner, after = range(lo, int_lo), range(int_lo, int_hi), range(int_hi, hi)
        want = [*inner, *after, *before] if after_first else [*inner, *before, *after]
        if table:
            want = [entries[i].item() for i in want]
        got = out.tolist()
        assert got[: len(want)] == want, (lo, int_lo, int_hi, hi)
        assert all(t == -1 for t in got[len(want) :]), (lo, int_lo, int_hi, hi)
