"""The Hopper kernels of packed key-list calls (dmattn_ops/executors/hopper.py, kernels/hopper.py) against
the float64 oracle, on an sm_90 GPU; elsewhere only the plan's choice is checked."""

import math

import pytest
import torch
from helpers import Case, assert_close
from test_triton import run_case

import dmattn_ops
from dmattn_ops import reference
from dmattn_ops.core.problem import Options, Problem
from dmattn_ops.dispatch import plan
from dmattn_ops.executors import _gluon
from dmattn_ops.executors import hopper as hopper_exec

ON_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
hopper_only = pytest.mark.skipif(not ON_HOPPER, reason="needs an sm_90 GPU")


@pytest.fixture(autouse=True)
def hopper_on(monkeypatch):
    """The path is opt-in (dmattn_ops/executors/hopper.py): these tests opt in."""
    monkeypatch.setenv("DMATTN_HOPPER", "1")


def topk_mask(b, hkv, lk, k, device, skip_first=0):
    """A DMA mask: the top k of random scores per (batch, KV group), keys below skip_first never
    kept (their rows see no key under causality)."""
    scores = torch.randn(b, hkv, lk, device=device)
    scores[..., :skip_first] = -math.inf
    idx = scores.topk(k, dim=-1).indices
    return torch.zeros(b, hkv, lk, dtype=torch.bool, device=device).scatter_(-1, idx, True)[
        :, :, None
    ]


def forward_plan(q, k, v, mask, bias, is_causal, softcap=0.0, seqused_k=None, window=(-1, -1)):
    problem = Problem(q, k, v, mask, bias, None, seqused_k).collapsed()
    return plan.plan(problem, Options(0.125, is_causal, softcap, window=window))


def backward_plan(q, k, v, mask, bias, is_causal, grad_lse=False):
    problem = Problem(q, k, v, mask, bias).collapsed(grad_bias=bias is not None)
    opts = Options(0.125, is_causal)
    return plan.plan(
        problem, opts, plan.BACKWARD, grad_lse=grad_lse, compute_dbias=bias is not None
    )


def test_plan_takes_hopper_only_where_it_applies(monkeypatch):
    c = Case(2, 300, 304, 8, 2, 128, 128)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    q = torch.randn(c.b, c.lq, c.h, c.d, dtype=torch.bfloat16, device=dev)
    k = torch.randn(c.b, c.lk, c.hkv, c.d, dtype=torch.bfloat16, device=dev)
    mask = topk_mask(c.b, c.hkv, c.lk, 64, dev)
    bias = torch.randn(c.b, c.hkv, 1, c.lk, dtype=torch.bfloat16, device=dev)
    args = (q, k, k, mask, bias, True, 0.0, None)
    p = forward_plan(*args)
    assert p.route == plan.KEY_LISTS and p.pack and p.hopper == ON_HOPPER
    assert backward_plan(*args[:6]).hopper == ON_HOPPER
    # What keeps a call on the Triton kernels: the dQ kernel takes no gradient of lse.
    assert not backward_plan(*args[:6], grad_lse=True).hopper
    assert not forward_plan(*args[:6], 30.0, None).hopper  # softcap
    assert not forward_plan(*args, window=(64, 0)).hopper
    assert not forward_plan(q.float(), k.float(), k.float(), *args[3:]).hopper
    assert not forward_plan(q[..., :64], k[..., :64], k[..., :64], *args[3:]).hopper
    per_entry = bias.expand(c.b, c.hkv, c.lq, c.lk).contiguous()
    assert not forward_plan(*args[:4], per_entry, *args[5:]).hopper
    # Lk not a multiple of 8: the forward's TMA boxes over the list rows would start unaligned.
    k300, bias300 = k[:, :300], bias[..., :300].contiguous()
    assert not forward_plan(q, k300, k300, mask[..., :300], bias300, True, 0.0, None).hopper
    monkeypatch.setenv("DMATTN_HOPPER", "0")
    assert not forward_plan(*args).hopper
    # The default: the forward from FORWARD_MIN_LK keys, the backward from BACKWARD_MIN_LK.
    monkeypatch.delenv("DMATTN_HOPPER")
    assert not forward_plan(*args).hopper and not backward_plan(*args[:6]).hopper

    def long_args(lk):
        k_long = torch.empty(c.b, lk, c.hkv, c.d, dtype=torch.bfloat16, device=dev)
        return (q, k_long, k_long, topk_mask(c.b, c.hkv, lk, 64, dev),
                torch.empty(c.b, c.hkv, 1, lk, dtype=torch.bfloat16, device=dev), True)  # fmt: skip

    fwd_least, bwd_least = hopper_exec.FORWARD_MIN_LK, hopper_exec.BACKWARD_MIN_LK
    # ... with a Triton the kernels ran with (RAN_ON_TRITON)
    default_on = ON_HOPPER and hopper_exec.untested_triton() is None
    for n in {fwd_least - hopper_exec.LK_MULTIPLE, fwd_least, bwd_least - hopper_exec.LK_MULTIPLE,
              bwd_least}:  # fmt: skip
        assert forward_plan(*long_args(n)).hopper == (default_on and n >= fwd_least), n
        assert backward_plan(*long_args(n)).hopper == (default_on and n >= bwd_least), n
    forward_long, backward_long = long_args(fwd_least), long_args(bwd_least)
    assert not backward_plan(*backward_long, grad_lse=True).hopper
    with dmattn_ops.kernel_options(hopper=False):
        assert not forward_plan(*args).hopper and not forward_plan(*forward_long).hopper
        assert not backward_plan(*backward_long).hopper


def test_an_untested_triton_leaves_the_default_off(monkeypatch):
    """The Gluon kernels are on by default only with a Triton they ran with on a GPU; another
    names itself in the reason (and kernel option hopper=True still takes them)."""
    monkeypatch.setattr(hopper_exec, "_TRITON", ["3.6"])
    assert hopper_exec.untested_triton() is None
    monkeypatch.setattr(hopper_exec, "_TRITON", ["3.9"])
    reason = hopper_exec.untested_triton()
    assert reason.startswith("Triton 3.9: ") and "hopper=True" in reason


def test_kept_lists_keep_zero_tails_apart():
    """A forward's packed lists whose rows past each list are unwritten (the Triton kernels')
    never serve a backward that reads those rows as zeros (the Hopper dQ kernel: dS = 0 meets
    them in dS K), whatever the query rows per tile: KeptLists keys on the zero tail."""
    from dmattn_ops.core.band import Band
    from dmattn_ops.dispatch.launch import KeptLists
    from dmattn_ops.executors.tiles import PackFrom

    q, k = torch.zeros(1, 8, 2, 16), torch.zeros(1, 8, 1, 16)
    problem = Problem(q, k, k, torch.ones(1, 1, 1, 8, dtype=torch.bool), None)
    band, lists = Band.of(True, (-1, -1)), object()
    kept = KeptLists()
    kept.put(problem, band, 64, PackFrom(k, k, None, 2), lists)
    assert kept.take(problem, band, 64, PackFrom(k, k, None, 2, zero_tail=True)) is None
    assert kept.take(problem, band, 64, PackFrom(k, k, None, 2)) is lists
    kept.put(problem, band, 64, PackFrom(k, k, None, 2, zero_tail=True), lists)
    assert kept.take(problem, band, 64, PackFrom(k, k, None, 2, zero_tail=True)) is lists


def test_descriptors_made_once_per_shape_equal_fresh_ones(monkeypatch):
    """A launch's TMA descriptors come from one made and checked per (shape, strides, dtype,
    box, base alignment), copied with the call's tensor: field for field Triton's own, the
    cache holding no tensor, and a tensor of other strides, alignment or dtype gets its own."""
    pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    monkeypatch.setattr(_gluon, "_DESCRIPTORS", {})
    buf = torch.zeros(2 * 40 * 4 * 64 + 8, dtype=torch.bfloat16)
    a, b = (buf[:-8].view(2, 40, 4, 64).clone() for _ in range(2))
    first, second = hopper_exec._descriptor(a, 16), hopper_exec._descriptor(b, 16)
    assert len(_gluon._DESCRIPTORS) == 1
    assert all(kept.base is None for kept in _gluon._DESCRIPTORS.values())
    fresh = TensorDescriptor(b, [2, 40, 4, 64], [10240, 256, 64, 1], [1, 16, 1, 64],
                             _gluon.shared_layout(torch.bfloat16, (1, 16, 1, 64)))  # fmt: skip
    assert type(second) is TensorDescriptor and second.base is b and first.base is a
    assert vars(second) == vars(fresh)
    # A transposed copy (other strides) and a float16 one get their own; a base 8 bytes off,
    # which Triton refuses, is never served the kept one.
    heads_outer = a.transpose(1, 2).contiguous().transpose(1, 2)
    made = [hopper_exec._descriptor(t, 16) for t in (heads_outer, a.half())]
    assert made[0].strides == [10240, 64, 2560, 1] and made[0].base is heads_outer
    assert made[1].base.dtype == torch.float16 and made[1].strides == [10240, 256, 64, 1]
    assert len(_gluon._DESCRIPTORS) == 3
    off = buf[4:].view(-1)[: a.numel()].view(2, 40, 4, 64)
    assert off.data_ptr() % 16 != 0 and _gluon.kept(off, (1, 16, 1, 64)) is None


CASES = [
    # (case, mask batch, bias pattern, causal)
    # Lk a multiple of 8 (hopper.LK_MULTIPLE), none of 64: every list ends in a partial tile.
    pytest.param(Case(2, 296, 296, 8, 2, 128, 128), 2, "group", True, id="gqa-causal"),
    pytest.param(Case(1, 200, 336, 4, 1, 128, 128), 1, "head", True, id="lq<lk-bias-per-head"),
    pytest.param(Case(2, 257, 200, 4, 4, 128, 128), 1, None, False, id="mha-full-shared-mask"),
    pytest.param(Case(1, 700, 712, 16, 4, 128, 128), 1, "group", True, id="long-lists"),
]


@hopper_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case, mask_b, bias_kind, is_causal", CASES)
@pytest.mark.parametrize("split", [1, 2], ids=["split1", "split2"])
def test_hopper_key_lists_match_the_oracle(case, mask_b, bias_kind, is_causal, split, dtype,
                                           kernel_options):  # fmt: skip
    """out, lse, dq, dk, dv and dbias within the bounds of PyTorch's own error in the dtype;
    causal rows whose position precedes every listed key are empty (out 0, lse -inf)."""
    c = case
    if split > c.h // c.hkv:
        pytest.skip("split must divide G")
    kernel_options(dkdv_split=split)
    mask = topk_mask(mask_b, c.hkv, c.lk, max(1, c.lk // 4), "cuda", skip_first=20)
    bias = None
    if bias_kind is not None:
        heads = c.hkv if bias_kind == "group" else c.h
        bias = torch.randn(c.b, heads, 1, c.lk, dtype=dtype, device="cuda")
    p = forward_plan(
        torch.empty(c.b, c.lq, c.h, c.d, dtype=dtype, device="cuda"),
        torch.empty(c.b, c.lk, c.hkv, c.d, dtype=dtype, device="cuda"),
        torch.empty(c.b, c.lk, c.hkv, c.dv, dtype=dtype, device="cuda"),
        mask, bias, is_causal, 0.0, None,
    )  # fmt: skip
    assert p.hopper
    out, lse, _ = run_case(c, dtype, mask=mask, bias=bias, is_causal=is_causal)
    if is_causal and c.lq == c.lk:  # bottom-right aligned, Lq < Lk leaves no row empty
        empty = lse == -math.inf
        assert empty.any() and (out.transpose(1, 2)[empty] == 0).all()


@hopper_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_hopper_never_reads_unlisted_keys(dtype):
    """K and V hold NaN at every key outside the lists, the bias finfo.min at some listed keys:
    a finite result equal to the oracle's (run on clean K/V) shows the unlisted rows never
    reached a product, and the packed K and V rows past each list are zeros (conftest fills
    fresh buffers with NaN; the dQ kernel's dS = 0 there meets K)."""
    c = Case(2, 384, 384, 8, 2, 128, 128)
    mask = topk_mask(c.b, c.hkv, c.lk, 100, "cuda", skip_first=3)
    k = torch.randn(c.b, c.lk, c.hkv, c.d, dtype=dtype, device="cuda")
    v = torch.randn(c.b, c.lk, c.hkv, c.dv, dtype=dtype, device="cuda")
    unlisted = (~mask[:, :, 0, :]).transpose(1, 2)[..., None]
    k_bad, v_bad = torch.where(unlisted, math.nan, k), torch.where(unlisted, math.nan, v)
    q = torch.randn(c.b, c.lq, c.h, c.d, dtype=dtype, device="cuda", requires_grad=True)
    bias = torch.randn(c.b, c.hkv, 1, c.lk, dtype=torch.float32, device="cuda")
    listed = mask[:, :, 0, :].nonzero()
    bias[listed[::7, 0], listed[::7, 1], 0, listed[::7, 2]] = torch.finfo(torch.float32).min
    bias.requires_grad_()
    go = torch.randn(c.b, c.lq, c.h, c.dv, dtype=dtype, device="cuda")
    out = dmattn_ops.attention(q, k_bad, v_bad, mask, bias, is_causal=True, backend="triton")
    dq, dbias = torch.autograd.grad(out, (q, bias), go)
    q64, b64 = q.detach().double().requires_grad_(), bias.detach().double().requires_grad_()
    ref = reference.attention(q64, k.double(), v.double(), mask, b64, is_causal=True)
    rdq, rdb = torch.autograd.grad(ref, (q64, b64), go.double())
    for name, got, want in (("out", out, ref), ("dq", dq, rdq), ("dbias", dbias, rdb)):
        assert not got.isnan().any(), name
        tol = 0.03 * want.abs().max().item() + 1e-3
        assert_close(got, want, tol, name)
    kk, vv = k.clone().requires_grad_(), v.clone().requires_grad_()
    out = dmattn_ops.attention(q, kk, vv, mask, bias, is_causal=True, backend="triton")
    dk, dv = torch.autograd.grad(out, (kk, vv), go)
    assert (dk[unlisted.expand_as(dk)] == 0).all() and (dv[unlisted.expand_as(dv)] == 0).all()


@hopper_only
def test_hopper_matches_the_triton_kernels_at_the_model_shape(monkeypatch):
    """The DMA model's call (B4 L2048 H16/4, top-512, per-key bias, causal) on both paths: the
    same results within bf16 roundings of each other; a second call through the kept Gluon
    launches computes the first's bitwise."""
    torch.manual_seed(3)
    b, L, h, hkv, d = 4, 2048, 16, 4, 128
    q = torch.randn(b, L, h, d, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    k = torch.randn(b, L, hkv, d, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    v = torch.randn(b, L, hkv, d, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    mask = topk_mask(b, hkv, L, 512, "cuda")
    bias = torch.randn(b, hkv, 1, L, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    go = torch.randn_like(q)

    def run():
        out = dmattn_ops.attention(q, k, v, mask, bias, is_causal=True, backend="triton")
        return (out, *torch.autograd.grad(out, (q, k, v, bias), go))

    assert forward_plan(q, k, v, mask, bias, True).hopper
    monkeypatch.setattr(_gluon, "_READY", {})
    ours = run()
    again = run()  # through the kept launches (checked against fresh ones: the tests' setting)
    # The model's three launches are kept (_gluon.launched), none left to the slow path.
    kept = list(_gluon._READY.values())
    assert len(kept) == 3 and _gluon._UNKEPT not in kept
    monkeypatch.setenv("DMATTN_HOPPER", "0")
    triton = run()
    for name, a, a2, t in zip(("out", "dq", "dk", "dv", "dbias"), ours, again, triton):
        assert not a.isnan().any(), name
        assert torch.equal(a, a2), f"{name}: a kept launch computed otherwise"
        err = (a.float() - t.float()).abs().max().item()
        assert err <= 0.02 * t.float().abs().max().item(), f"{name}: {err}"


@hopper_only
@pytest.mark.parametrize("bias_dtype", [torch.bfloat16, torch.float32, None], ids=str)
@pytest.mark.parametrize(
    "least", sorted({hopper_exec.FORWARD_MIN_LK, hopper_exec.BACKWARD_MIN_LK}), ids="Lk{}".format
)
def test_hopper_at_long_lists(least, bias_dtype, monkeypatch):
    """The long-list tiles (FWD_LONG: 128 keys, ping-pong; 2 stages under a float32 bias) of the
    forward, taken by default from FORWARD_MIN_LK keys, and the dQ and dK/dV kernels, from
    BACKWARD_MIN_LK, with NaN in K and V past each list and a bias of finfo.min at some listed
    keys: out, lse and the gradients within bf16 roundings of the all-Triton path's (which
    test_triton checks against the float64 oracle at 16384 keys,
    test_long_sequence_broadcast_bias_and_mask), the same entries non-finite, no NaN, rows
    before every listed key empty, dK and dV zero at the unlisted keys."""
    monkeypatch.delenv("DMATTN_HOPPER")
    torch.manual_seed(5)
    b, L, h, hkv, d = 1, least + 72, 8, 2, 128
    q = torch.randn(b, L, h, d, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    k = torch.randn(b, L, hkv, d, dtype=torch.bfloat16, device="cuda")
    v = torch.randn(b, L, hkv, d, dtype=torch.bfloat16, device="cuda")
    mask = topk_mask(b, hkv, L, L // 4 + 5, "cuda", skip_first=150)
    unlisted = (~mask[:, :, 0, :]).transpose(1, 2)[..., None]
    k = torch.where(unlisted, math.nan, k).requires_grad_()
    v = torch.where(unlisted, math.nan, v).requires_grad_()
    bias = None
    if bias_dtype is not None:
        bias = torch.randn(b, hkv, 1, L, dtype=bias_dtype, device="cuda")
        listed = mask[:, :, 0, :].nonzero()
        bias[listed[::11, 0], listed[::11, 1], 0, listed[::11, 2]] = torch.finfo(bias_dtype).min
        bias.requires_grad_()
    leaves = [t for t in (q, k, v, bias) if t is not None]
    go = torch.randn_like(q)
    assert forward_plan(q, k, v, mask, bias, True).hopper == (L >= hopper_exec.FORWARD_MIN_LK)
    assert backward_plan(q, k, v, mask, bias, True).hopper == (L >= hopper_exec.BACKWARD_MIN_LK)

    def run():
        out, lse = dmattn_ops.attention(q, k, v, mask, bias, is_causal=True, return_lse=True,
                                        backend="triton")  # fmt: skip
        return out, lse, *torch.autograd.grad(out, leaves, go)

    ours = run()
    with dmattn_ops.kernel_options(hopper=False):
        assert not forward_plan(q, k, v, mask, bias, True).hopper
        triton = run()
    unlisted_rows = unlisted.expand_as(k)
    assert (ours[3][unlisted_rows] == 0).all() and (ours[4][unlisted_rows] == 0).all()
    for name, a, t in zip(("out", "lse", "dq", "dk", "dv", "dbias"), ours, triton):
        finite = t.isfinite()
        assert not a.isnan().any() and torch.equal(finite, a.isfinite()), name
        err = (a[finite].float() - t[finite].float()).abs().max().item()
        assert err <= 0.02 * t[finite].float().abs().max().item(), f"{name}: {err}"
    empty = ours[1] == -math.inf
    assert empty.any() and (ours[0].transpose(1, 2)[empty] == 0).all()


@hopper_only
def test_hopper_in_a_compiled_graph():
    """Under torch.compile(fullgraph=True) the Gluon launches are custom ops in the graph: the
    compiled forward and its backward equal the eager ones."""
    b, L, h, hkv, d = 2, 512, 8, 2, 128
    mask = topk_mask(b, hkv, L, 128, "cuda")
    inputs = (
        torch.randn(b, L, h, d, dtype=torch.bfloat16, device="cuda"),
        torch.randn(b, L, hkv, d, dtype=torch.bfloat16, device="cuda"),
        torch.randn(b, L, hkv, d, dtype=torch.bfloat16, device="cuda"),
        torch.randn(b, hkv, 1, L, dtype=torch.bfloat16, device="cuda"),
    )
    go = torch.randn_like(inputs[0])

    def call(q, k, v, bias):
        return dmattn_ops.attention(q, k, v, mask, bias, is_causal=True, backend="triton")

    results = []
    for fn in (call, torch.compile(call, fullgraph=True)):
        leaves = [t.clone().requires_grad_() for t in inputs]
        out = fn(*leaves)
        out.backward(go)
        results.append((out, *(t.grad for t in leaves)))
    for name, a, e in zip(("out", "dq", "dk", "dv", "dbias"), *results):
        assert torch.equal(a, e), name
