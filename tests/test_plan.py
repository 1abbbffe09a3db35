"""plan.py: which path each call takes, decided from shapes, dtypes and devices alone.

The oracle tests elsewhere show each path computes the right values; these show each call
reaches the path it should (a mask shared by all queries on key lists, a per-entry bias without
packing, float64 in PyTorch, ...), and that the launchers run what the plan says.
"""

import pytest
import torch
from helpers import DEVICE

import dmattn_ops
from dmattn_ops.core.problem import Options, Problem
from dmattn_ops.dispatch import launch, plan
from dmattn_ops.dispatch.plan import DECODE, DENSE, EMPTY, KEY_LISTS, PYTORCH, SDPA, TILE_TABLES

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
    problem = Problem(q, k, v, mask, bias, sinks).collapsed()
    return plan.plan(problem, Options(0.25, is_causal, window=window))


def backward(
    q, k, v, mask=None, bias=None, compute_dbias=True, grad_lse=None, det=False, sinks=None
):  # fmt: skip
    dbias = compute_dbias and bias is not None
    problem = Problem(q, k, v, mask, bias, sinks).collapsed(grad_bias=dbias)
    return plan.plan(
        problem, Options(0.25, True, deterministic=det), plan.BACKWARD,
        grad_lse=grad_lse is not None, compute_dbias=dbias,
    )  # fmt: skip


def test_empty_calls_launch_nothing():
    q, k, v = qkv()
    assert forward(q[:, :0], k, v).route == EMPTY
    assert forward(q, k[:, :0], v[:, :0]).route == EMPTY
    assert backward(q[:0], k[:0], v[:0]).route == EMPTY


def test_float64_and_cpu_without_the_interpreter_run_pytorch(monkeypatch):
    q, k, v = qkv(dtype=torch.float64)
    assert forward(q, k, v).route == PYTORCH
    assert backward(q, k, v).route == PYTORCH
    monkeypatch.setattr(plan, "interpreter_on", lambda: False)
    q, k, v = qkv(device="cpu")
    assert forward(q, k, v).route == PYTORCH
    assert backward(q, k, v).route == PYTORCH


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
        assert (fwd.route, fwd.pack) == (KEY_LISTS, True)
        bwd = backward(q, k, v, mask, bias)
        assert (bwd.route, bwd.pack, bwd.dbias) == (KEY_LISTS, True, "group")
        assert fwd.config.block_m == bwd.configs.dq.block_m  # packed tiles on both passes


@needs_triton
def test_masks_per_query_or_per_query_head_under_gqa_take_tile_tables():
    q, k, v = qkv()
    assert forward(q, k, v, mask_of(B, HKV, LQ)).route == TILE_TABLES
    assert forward(q, k, v, mask_of(B, H, 1)).route == TILE_TABLES  # a list per query head
    assert backward(q, k, v, mask_of(B, 1, LQ)).route == TILE_TABLES


@needs_triton
def test_bias_kinds_decide_packing_and_the_dbias_mode():
    q, k, v = qkv()
    mask = mask_of(B, HKV, 1)
    entry = torch.randn(B, H, LQ, LK, device=DEVICE)
    # A bias with query rows is read per score at the keys' own columns: no packed rows.
    assert forward(q, k, v, mask, entry).pack is False
    got = backward(q, k, v, mask, entry)
    assert (got.route, got.pack, got.dbias) == (KEY_LISTS, False, "direct")
    got = backward(q, k, v, mask, torch.randn(1, H, 1, LK, device=DEVICE))
    assert (got.route, got.pack, got.dbias) == (KEY_LISTS, True, "cols")
    # Query rows shared over the batch: dbias has its own kernel, which reads tile tables.
    got = backward(q, k, v, mask, torch.randn(1, H, LQ, LK, device=DEVICE))
    assert (got.route, got.dbias) == (TILE_TABLES, "bcast")
    # Without dbias, the same bias is only read.
    got = backward(q, k, v, mask, torch.randn(1, H, LQ, LK, device=DEVICE), compute_dbias=False)
    assert (got.route, got.dbias) == (KEY_LISTS, None)


@needs_triton
def test_pack_keys_option():
    q, k, v = qkv()
    with dmattn_ops.kernel_options(pack_keys=False):
        got = forward(q, k, v, mask_of(B, HKV, 1), torch.randn(B, HKV, 1, LK, device=DEVICE))
    assert (got.route, got.pack) == (KEY_LISTS, False)


@needs_triton
def test_long_packed_calls_take_a_kv_groups_heads_per_program():
    """Packed key lists of long calls run G = H / Hkv query heads per forward and dq program,
    where the group shares one key list and bias; short calls, a bias per query head and
    gathered keys keep one head per program."""
    q, k, v = qkv()
    mask, bias = mask_of(B, HKV, 1), torch.randn(B, HKV, 1, LK, device=DEVICE)
    assert forward(q, k, v, mask, bias).heads == 1  # LQ = 40 is short
    assert backward(q, k, v, mask, bias).heads == 1
    g = H // HKV
    with dmattn_ops.kernel_options(pack_heads=True):  # as a call of PACK_HEADS_MIN_LQ queries
        assert forward(q, k, v, mask, bias).heads == g
        assert backward(q, k, v, mask, bias).heads == g
        assert forward(q, k, v, mask_of(1, 1, 1), None).heads == g
        per_head = torch.randn(B, H, 1, LK, device=DEVICE)
        assert forward(q, k, v, mask, per_head).heads == 1
        assert backward(q, k, v, mask, per_head).heads == 1
        with dmattn_ops.kernel_options(pack_keys=False):
            assert forward(q, k, v, mask, bias).heads == 1


@needs_triton
def test_dense_and_decode():
    q, k, v = qkv()
    assert forward(q, k, v).route == DENSE
    assert forward(q, k, v, window=(8, 0)).route == DENSE
    assert forward(q, k, v).band.is_causal and forward(q, k, v, window=(8, 0)).band.has_window
    q1, kc, vc = qkv(lq=1, lk=200)
    assert forward(q1, kc, vc).route == DECODE
    assert forward(q1, kc, vc, mask_of(B, HKV, 1, lk=200)).route == DECODE
    assert forward(q1, kc, vc, mask_of(B, H, 1, lk=200)).route == TILE_TABLES  # per query head
    assert forward(*qkv(lq=17, lk=200)).route == DENSE  # more queries than decode takes
    assert backward(q1, kc, vc).route == DENSE  # the backward has no decode path


@pytest.mark.skipif(not torch.cuda.is_available(), reason="PyTorch's fused kernels need CUDA")
def test_dense_half_precision_calls_take_sdpa_unless_told_not_to(monkeypatch):
    monkeypatch.setenv("DMATTN_DENSE_SDPA", "1")
    q, k, v = qkv(lq=64, lk=64, dtype=torch.bfloat16)
    assert forward(q, k, v).route == SDPA
    assert backward(q, k, v).route == SDPA
    # Sinks are joined to the fused kernels' results (sdpa.py).
    sinks = torch.zeros(H, device=DEVICE)
    assert forward(q, k, v, sinks=sinks).route == SDPA
    assert backward(q, k, v, sinks=sinks).route == SDPA
    # What the fused kernels cannot do keeps the call on ours.
    assert forward(q, k, v, window=(8, 0)).route == DENSE
    assert forward(q, k, v, mask_of(B, HKV, 1, lk=64)).route == KEY_LISTS
    assert backward(q, k, v, grad_lse=torch.ones(B, H, 64, device=DEVICE)).route == DENSE
    assert backward(q, k, v, det=True).route == DENSE
    monkeypatch.setenv("DMATTN_DENSE_SDPA", "0")
    assert forward(q, k, v).route == DENSE


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
    real_plan = plan.plan

    def spied_plan(*args, **kwargs):
        p = real_plan(*args, **kwargs)
        assert p.route == forced[0]
        return p

    monkeypatch.setattr(plan, "plan", spied_plan)
    with torch.no_grad():
        dmattn_ops.attention(q, k, v, mask_of(B, HKV, 1), is_causal=True, backend="triton")
        assert seen == ["build_key_lists"]
        forced[0] = TILE_TABLES
        dmattn_ops.attention(q, k, v, mask_of(B, HKV, LQ), is_causal=True, backend="triton")
        assert seen == ["build_key_lists", "build_tables"]


@needs_triton
def test_the_kernels_read_an_expanded_gradient_densely(monkeypatch):
    """`out.sum().backward()` hands the backward a gradient with every stride 0; the kernels get
    it copied once (unit stride on D: vectorised loads, problem.dense_rows), a dense one as it
    is, and the gradients equal those of the same values contiguous."""
    seen = []
    real = launch._launch_backward

    def spy(ops, grad_out, *args, **kwargs):
        seen.append(grad_out)
        return real(ops, grad_out, *args, **kwargs)

    monkeypatch.setattr(launch, "_launch_backward", spy)
    q, k, v = qkv()
    mask = mask_of(B, HKV, 1)
    grads = []
    for upstream in (torch.ones(()).expand(B, LQ, H, D), torch.ones(B, LQ, H, D)):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = dmattn_ops.attention(*leaves, mask, is_causal=True, backend="triton")
        out.backward(upstream.to(DEVICE))
        grads.append([t.grad for t in leaves])
    expanded, dense = seen
    assert expanded.stride(-1) == 1 and 0 not in expanded.stride()
    assert dense.stride() == (LQ * H * D, H * D, D, 1)
    for a, b in zip(*grads):
        assert torch.equal(a, b)


@needs_triton
def test_each_pass_is_planned_once_and_repeated_calls_reuse_the_plan(monkeypatch):
    """An eager differentiable call decides its forward once and its backward once (the
    backward starting from the forward's route); a second call of the same shapes decides
    nothing: the plans come from the cache."""
    counted = {"window_chunk": 0, "choose": 0}

    def count(module, name):
        real = getattr(module, name)

        def wrapped(*args, **kwargs):
            counted[name.lstrip("_")] += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, wrapped)

    from dmattn_ops.executors import sdpa

    count(sdpa, "window_chunk")
    count(plan, "_choose")
    q, k, v = (t.requires_grad_() for t in qkv(lq=33, lk=57))  # shapes no other test plans
    mask = mask_of(B, HKV, 1, lk=57)
    before = plan.calls["decided"]
    dmattn_ops.attention(q, k, v, mask, is_causal=True, window_size=(9, 0)).sum().backward()
    assert plan.calls["decided"] - before == 2
    # One route choice per pass; the window's fused chunks are weighed once, in the forward:
    # the backward starts from the forward's route (key lists), past the fused kernels.
    assert counted == {"window_chunk": 1, "choose": 2}
    dmattn_ops.attention(q, k, v, mask, is_causal=True, window_size=(9, 0)).sum().backward()
    assert plan.calls["decided"] - before == 2
    assert counted == {"window_chunk": 1, "choose": 2}


@needs_triton
@pytest.mark.parametrize("entry", ["api", "op"])
def test_an_eager_differentiable_call_is_validated_once(monkeypatch, entry):
    """The window and the inputs are checked once per eager call, forward and backward, whether
    it comes through dmattn_ops.attention (which checks and then runs the op's work itself) or
    through the op (whose Autograd kernel checks, and its forward then does not)."""
    from dmattn_ops import api
    from dmattn_ops.core import validate
    from dmattn_ops.registration import ops

    counted = {"check_window": 0, "check_inputs": 0}
    for name in counted:
        real = getattr(validate, name)

        def wrapped(*args, _name=name, _real=real, **kwargs):
            counted[_name] += 1
            return _real(*args, **kwargs)

        for module in (api, ops, validate):  # validate: check_problem's own calls
            if hasattr(module, name):
                monkeypatch.setattr(module, name, wrapped)
    q, k, v = (t.requires_grad_() for t in qkv())
    bias = torch.randn(B, HKV, 1, LK, device=DEVICE, requires_grad=True)
    mask = mask_of(B, HKV, 1)
    if entry == "api":
        out = dmattn_ops.attention(q, k, v, mask, bias, is_causal=True, window_size=(20, 0))
    else:
        out = torch.ops.dmattn.attention(q, k, v, mask, bias, None, True, 0.0, None, False, (20, 0))
    out.sum().backward()
    assert counted == {"check_window": 1, "check_inputs": 1}
    assert all(t.grad is not None for t in (q, k, v, bias))


def test_sdpas_priority_order_is_part_of_the_plans_key():
    """The fused route runs the kernel SDPA itself would pick; sdpa_kernel(...,
    set_priority=True) changes that pick without switching a backend off, so a call planned
    under it is planned anew, not read from the plan made outside."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = qkv(lq=37, lk=37)  # shapes no other test plans
    before = plan.calls["decided"]
    forward(q, k, v)
    forward(q, k, v)
    assert plan.calls["decided"] - before == 1
    every = [SDPBackend.MATH, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION,
             SDPBackend.CUDNN_ATTENTION]  # fmt: skip
    with sdpa_kernel(every, set_priority=True):
        forward(q, k, v)
    assert plan.calls["decided"] - before == 2
    forward(q, k, v)
    assert plan.calls["decided"] - before == 2


@needs_triton
def test_forced_routes_and_their_refusals():
    q, k, v = qkv()
    shared = mask_of(B, HKV, 1)
    with dmattn_ops.kernel_options(route="tile_tables"):
        assert forward(q, k, v, shared).route == TILE_TABLES
        assert backward(q, k, v, shared).route == TILE_TABLES
    with (
        dmattn_ops.kernel_options(route="key_lists"),
        pytest.raises(ValueError, match=r"route='key_lists'.*no key list per KV group"),
    ):
        forward(q, k, v, mask_of(B, H, LQ))
    with dmattn_ops.kernel_options(route="decode"):
        with pytest.raises(ValueError, match="decode takes Lq <= 16"):
            forward(q, k, v)
        assert backward(q, k, v).route == DENSE  # decode is forward only: auto backward
    with (
        dmattn_ops.kernel_options(route="varlen"),
        pytest.raises(ValueError, match="no cu_seqlens"),
    ):
        forward(q, k, v)
    # The call's own options win over the block's.
    with dmattn_ops.kernel_options(route="key_lists"):
        told = dmattn_ops.explain(q, k, v, shared, kernel_options={"route": "pytorch"})
        assert (told.forward.route, told.backward.route) == (PYTORCH, PYTORCH)


def test_explain_names_the_route_and_every_other_routes_reasons():
    q, k, v = qkv(dtype=torch.float64)
    told = dmattn_ops.explain(q, k, v, mask_of(B, HKV, 1), is_causal=True)
    assert (told.forward.route, told.backward.route) == (PYTORCH, PYTORCH)
    assert any("float64" in why for why in told.forward.reasons[KEY_LISTS])
    assert told.forward.reasons[PYTORCH] == []
    text = str(told)
    assert text.startswith("forward: pytorch") and "\nbackward: pytorch" in text
    assert "key_lists: torch.float64: the Triton kernels take" in text
    assert "flex.py" in str(dmattn_ops.explain(q, k, v, backend="flex"))
    empty = dmattn_ops.explain(q[:, :0], k, v)
    assert empty.forward.route == EMPTY


@pytest.mark.skipif(not torch.cuda.is_available(), reason="PyTorch's fused kernels need CUDA")
def test_explain_shows_why_a_dense_call_left_the_fused_kernels(monkeypatch):
    monkeypatch.setenv("DMATTN_DENSE_SDPA", "1")
    q, k, v = qkv(lq=64, lk=64, dtype=torch.bfloat16)
    told = dmattn_ops.explain(q, k, v, is_causal=True, return_lse=True)
    assert told.forward.route == SDPA and told.backward.route == DENSE
    assert "a gradient of lse" in told.backward.reasons[SDPA][0]
    told = dmattn_ops.explain(q, k, v, kernel_options={"fused_sdpa": False})
    assert told.forward.route == DENSE and "switched off" in told.forward.reasons[SDPA][-1]


def test_kernel_options_are_checked():
    q, k, v = qkv(dtype=torch.float64)
    for bad, error in (
        ({"route": "fast"}, "route'] must be one of"),
        ({"speed": 1}, "unknown kernel option 'speed'"),
        ({"fwd_config": (48, 64, 4, 2)}, "powers of two"),
        ({"dkdv_split": 0}, "positive int"),
        ({"dkdv_scratch": 0}, "positive int"),
    ):
        with pytest.raises(ValueError, match=error):
            dmattn_ops.attention(q, k, v, kernel_options=bad)
    with pytest.raises(TypeError, match="must be a bool"):
        dmattn_ops.attention(q, k, v, kernel_options={"pack_keys": 1})
    with pytest.raises(ValueError, match="backend 'auto' or 'triton'"):
        dmattn_ops.attention(q, k, v, backend="flex", kernel_options={"route": "pytorch"})
    with pytest.raises(ValueError, match="unknown kernel option"):
        dmattn_ops.kernel_options(speed=1).__enter__()
    with pytest.raises(ValueError, match="not name=value"):
        torch.ops.dmattn.attention_forward(
            q, k, v, None, None, 0.25, False, 0.0, None, kernel_options="route"
        )


@needs_triton
def test_kernel_options_reach_the_ops_inside_compiled_graphs():
    """The options travel through the op schemas as a constant string: a fullgraph compile
    keeps them, and the forced route computes the same values."""
    q, k, v = qkv()
    mask = mask_of(B, HKV, 1)

    def f(q, k, v):
        return dmattn_ops.attention(
            q, k, v, mask, is_causal=True, kernel_options={"route": "tile_tables"}
        )

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    want = dmattn_ops.attention(q, k, v, mask, is_causal=True)
    assert (compiled(q, k, v) - want).abs().max() < 1e-5
