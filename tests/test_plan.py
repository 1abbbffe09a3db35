"""plan.py: which path each call takes, decided from shapes, dtypes and devices alone.

The oracle tests elsewhere show each path computes the right values; these show each call
reaches the path it should (a mask shared by all queries on key lists, a per-entry bias without
packing, float64 in PyTorch, ...), and that the launchers run what the plan says.
"""

import pytest
import torch

import dmattn_ops
from dmattn_ops import launch, plan
from dmattn_ops.plan import DECODE, DENSE, EMPTY, KEY_LISTS, PYTORCH, SDPA, TILE_TABLES

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(
    not plan.triton_runs_on(torch.empty(0, device=DEVICE)), reason="needs CUDA or the interpreter"
)
B, LQ, LK, H, HKV, D = 2, 40, 48, 4, 2, 16


def qkv(lq=LQ, lk=LK, dtype=torch.float32, device=DEVICE, b=B):
    q = torch.randn(b, lq, H, D, dtype=dtype, device=device)
    k = torch.randn(b, lk, HKV, D, dtype=dtype, device=device)
    return q, k, torch.randn_like(k)


def mask_of(*shape, lk=LK):
    return torch.rand(*shape, lk, device=DEVICE) < 0.5


def forward(q, k, v, mask=None, bias=None, is_causal=True, window=(-1, -1), sinks=None):
    mask, bias = launch.collapse_broadcast(mask), launch.collapse_broadcast(bias)
    return plan.forward_plan(q, k, v, mask, bias, is_causal, 0.0, None, window, sinks)


def backward(
    q, k, v, mask=None, bias=None, compute_dbias=True, grad_lse=None, det=False, sinks=None
):  # fmt: skip
    return plan.backward_plan(
        q, k, v, launch.collapse_broadcast(mask), bias, True, 0.0, None, grad_lse, det,
        compute_dbias and bias is not None, sinks=sinks,
    )  # fmt: skip


def test_empty_calls_launch_nothing():
    q, k, v = qkv()
    assert forward(q[:, :0], k, v).path == EMPTY
    assert forward(q, k[:, :0], v[:, :0]).path == EMPTY
    assert backward(q[:0], k[:0], v[:0]).path == EMPTY


def test_float64_and_cpu_without_the_interpreter_run_pytorch(monkeypatch):
    q, k, v = qkv(dtype=torch.float64)
    assert forward(q, k, v).path == PYTORCH
    assert backward(q, k, v).path == PYTORCH
    monkeypatch.setattr(plan, "interpreter_on", lambda: False)
    q, k, v = qkv(device="cpu")
    assert forward(q, k, v).path == PYTORCH
    assert backward(q, k, v).path == PYTORCH


@needs_triton
def test_masks_shared_by_all_queries_take_key_lists():
    q, k, v = qkv()
    bias = torch.randn(B, HKV, 1, LK, device=DEVICE)
    for mask in (
        mask_of(B, HKV, 1),  # one list per KV group
        mask_of(1, 1, 1),  # one for everything
        mask_of(B, 1, 1).expand(B, H, LQ, LK),  # expanded views are the same mask
    ):
        fwd = forward(q, k, v, mask, bias)
        assert (fwd.path, fwd.pack) == (KEY_LISTS, True)
        bwd = backward(q, k, v, mask, bias)
        assert (bwd.path, bwd.pack, bwd.dbias) == (KEY_LISTS, True, "group")
        assert fwd.config.block_m == bwd.configs.dq.block_m  # packed tiles on both passes


@needs_triton
def test_masks_per_query_or_per_query_head_under_gqa_take_tile_tables():
    q, k, v = qkv()
    assert forward(q, k, v, mask_of(B, HKV, LQ)).path == TILE_TABLES
    assert forward(q, k, v, mask_of(B, H, 1)).path == TILE_TABLES  # a list per query head
    assert backward(q, k, v, mask_of(B, 1, LQ)).path == TILE_TABLES


@needs_triton
def test_bias_kinds_decide_packing_and_the_dbias_mode():
    q, k, v = qkv()
    mask = mask_of(B, HKV, 1)
    entry = torch.randn(B, H, LQ, LK, device=DEVICE)
    # A bias with query rows is read per score at the keys' own columns: no packed rows.
    assert forward(q, k, v, mask, entry).pack is False
    got = backward(q, k, v, mask, entry)
    assert (got.path, got.pack, got.dbias) == (KEY_LISTS, False, "direct")
    got = backward(q, k, v, mask, torch.randn(1, H, 1, LK, device=DEVICE))
    assert (got.path, got.pack, got.dbias) == (KEY_LISTS, True, "cols")
    # Query rows shared over the batch: dbias has its own kernel, which reads tile tables.
    got = backward(q, k, v, mask, torch.randn(1, H, LQ, LK, device=DEVICE))
    assert (got.path, got.dbias) == (TILE_TABLES, "bcast")
    # Without dbias, the same bias is only read.
    got = backward(q, k, v, mask, torch.randn(1, H, LQ, LK, device=DEVICE), compute_dbias=False)
    assert (got.path, got.dbias) == (KEY_LISTS, None)


@needs_triton
def test_pack_keys_switch(monkeypatch):
    q, k, v = qkv()
    monkeypatch.setattr(plan, "PACK_KEYS", False)
    got = forward(q, k, v, mask_of(B, HKV, 1), torch.randn(B, HKV, 1, LK, device=DEVICE))
    assert (got.path, got.pack) == (KEY_LISTS, False)


@needs_triton
def test_long_packed_calls_take_a_kv_groups_heads_per_program(monkeypatch):
    """Packed key lists of long calls run G = H / Hkv query heads per forward and dq program,
    where the group shares one key list and bias; short calls, a bias per query head and
    gathered keys keep one head per program."""
    q, k, v = qkv()
    mask, bias = mask_of(B, HKV, 1), torch.randn(B, HKV, 1, LK, device=DEVICE)
    assert forward(q, k, v, mask, bias).heads == 1  # LQ = 40 is short
    assert backward(q, k, v, mask, bias).heads == 1
    monkeypatch.setattr(plan, "PACK_HEADS_MIN_LQ", LQ)
    g = H // HKV
    assert forward(q, k, v, mask, bias).heads == g
    assert backward(q, k, v, mask, bias).heads == g
    assert forward(q, k, v, mask_of(1, 1, 1), None).heads == g
    per_head = torch.randn(B, H, 1, LK, device=DEVICE)
    assert forward(q, k, v, mask, per_head).heads == 1
    assert backward(q, k, v, mask, per_head).heads == 1
    monkeypatch.setattr(plan, "PACK_KEYS", False)
    assert forward(q, k, v, mask, bias).heads == 1


@needs_triton
def test_dense_and_decode():
    q, k, v = qkv()
    assert forward(q, k, v).path == DENSE
    assert forward(q, k, v, window=(8, 0)).path == DENSE
    assert forward(q, k, v).band.is_causal and forward(q, k, v, window=(8, 0)).band.has_window
    q1, kc, vc = qkv(lq=1, lk=200)
    assert forward(q1, kc, vc).path == DECODE
    assert forward(q1, kc, vc, mask_of(B, HKV, 1, lk=200)).path == DECODE
    assert forward(q1, kc, vc, mask_of(B, H, 1, lk=200)).path == TILE_TABLES  # per query head
    assert forward(*qkv(lq=17, lk=200)).path == DENSE  # more queries than decode takes
    assert backward(q1, kc, vc).path == DENSE  # the backward has no decode path


@pytest.mark.skipif(not torch.cuda.is_available(), reason="PyTorch's fused kernels need CUDA")
def test_dense_half_precision_calls_take_sdpa_unless_told_not_to(monkeypatch):
    monkeypatch.setenv("DMATTN_DENSE_SDPA", "1")
    q, k, v = qkv(lq=64, lk=64, dtype=torch.bfloat16)
    assert forward(q, k, v).path == SDPA
    assert backward(q, k, v).path == SDPA
    # Sinks are joined to the fused kernels' results (sdpa.py).
    sinks = torch.zeros(H, device=DEVICE)
    assert forward(q, k, v, sinks=sinks).path == SDPA
    assert backward(q, k, v, sinks=sinks).path == SDPA
    # What the fused kernels cannot do keeps the call on ours.
    assert forward(q, k, v, window=(8, 0)).path == DENSE
    assert forward(q, k, v, mask_of(B, HKV, 1, lk=64)).path == KEY_LISTS
    assert backward(q, k, v, grad_lse=torch.ones(B, H, 64, device=DEVICE)).path == DENSE
    assert backward(q, k, v, det=True).path == DENSE
    monkeypatch.setenv("DMATTN_DENSE_SDPA", "0")
    assert forward(q, k, v).path == DENSE


@needs_triton
def test_the_launcher_runs_the_plan(monkeypatch):
    """A call runs the path its plan names: the plan is not a second copy of the decision."""
    seen = []

    def spy(name):
        real = getattr(launch, name)

        def wrapped(*args, **kwargs):
            seen.append(name)
            return real(*args, **kwargs)

        monkeypatch.setattr(launch, name, wrapped)

    spy("build_key_lists")
    spy("build_tables")
    q, k, v = qkv()
    forced = [KEY_LISTS]
    real_plan = plan.forward_plan

    def forward_plan(*args):
        p = real_plan(*args)
        assert p.path == forced[0]
        return p

    monkeypatch.setattr(plan, "forward_plan", forward_plan)
    with torch.no_grad():
        dmattn_ops.attention(q, k, v, mask_of(B, HKV, 1), is_causal=True, backend="triton")
        assert seen == ["build_key_lists"]
        forced[0] = TILE_TABLES
        dmattn_ops.attention(q, k, v, mask_of(B, HKV, LQ), is_causal=True, backend="triton")
        assert seen == ["build_key_lists", "build_tables"]
