"""dmattn_ops.masks: selection semantics of topk_mask and relu_mask."""

import math

import pytest
import torch
from helpers import DEVICE, TRITON

import dmattn_ops
from dmattn_ops import masks
from dmattn_ops.masks import relu_mask, topk_mask


def test_topk_picks_the_largest_per_row_and_keeps_the_broadcast_shape():
    bias = torch.randn(2, 4, 1, 50)
    sel = topk_mask(bias, 7)
    assert sel.shape == (2, 4, 1, 50) and sel.dtype == torch.bool
    assert (sel.sum(-1) == 7).all()
    kth = bias.topk(7, dim=-1).values[..., -1:]
    assert torch.equal(sel, bias >= kth)


def test_disallowed_keys_are_never_selected_whatever_the_bias_holds():
    bias = torch.randn(1, 2, 1, 20)
    mask = torch.ones(1, 1, 1, 20, dtype=torch.bool)
    mask[..., :6] = False
    bias[..., 0], bias[..., 1], bias[..., 2] = math.inf, math.nan, 1e30
    bias[..., 3], bias[..., 4] = -math.inf, torch.finfo(torch.float32).min
    sel = topk_mask(bias, 5, mask)
    assert not sel[..., :6].any() and (sel.sum(-1) == 5).all()
    assert not relu_mask(bias, mask)[..., :6].any()


def test_fewer_allowed_than_window_keeps_only_the_allowed():
    bias = torch.full((1, 1, 1, 12), -math.inf)  # ties everywhere: -inf at allowed keys too
    mask = torch.zeros(1, 1, 1, 12, dtype=torch.bool)
    mask[..., [2, 7, 9]] = True
    sel = topk_mask(bias, 8, mask)
    assert torch.equal(sel, mask)
    assert torch.equal(topk_mask(bias, 20, mask), mask)  # window >= Lk


def test_nan_at_allowed_keys_ranks_last():
    bias = torch.tensor([[[[0.5, math.nan, -3.0, 2.0]]]])
    assert topk_mask(bias, 3).tolist() == [[[[True, False, True, True]]]]
    assert relu_mask(bias).tolist() == [[[[True, False, False, True]]]]


def test_two_d_padding_mask_broadcasts_without_lq_by_lk():
    bias = torch.randn(1, 3, 1, 30)
    pad = torch.ones(2, 30, dtype=torch.bool)
    pad[1, 20:] = False
    sel = topk_mask(bias, 10, pad)
    assert sel.shape == (2, 3, 1, 30)
    assert not sel[1, ..., 20:].any() and (sel.sum(-1) == 10).all()


def test_block_smoothing_majority_edges_and_never_readmits():
    bias = torch.full((1, 1, 1, 10), -1.0)
    bias[..., [0, 1, 4, 8, 9]] = 1.0  # blocks of 4: [0-3] 2/4, [4-7] 1/4, [8-9] 2/2 (tail)
    mask = torch.ones(1, 1, 1, 10, dtype=torch.bool)
    mask[..., 3] = False  # block 0 has 3 allowed keys, 2 selected: kept, but key 3 stays out
    sel = relu_mask(bias, mask, block_size=4)
    assert sel[0, 0, 0].tolist() == [
        True,
        True,
        True,
        False,
        False,
        False,
        False,
        False,
        True,
        True,
    ]
    sel_topk = topk_mask(bias, 5, mask, block_size=4)
    assert torch.equal(sel_topk, sel)


def test_selection_carries_no_gradient():
    bias = torch.randn(1, 2, 1, 16, requires_grad=True)
    q = torch.randn(1, 5, 2, 8)
    k = torch.randn(1, 16, 2, 8)
    v = torch.randn(1, 16, 2, 8)
    sel = topk_mask(bias, 4)
    assert not sel.requires_grad
    out = dmattn_ops.attention(q, k, v, sel, bias)
    (g,) = torch.autograd.grad(out.sum(), bias)
    ref = dmattn_ops.reference.attention(q, k, v, sel, bias)
    (rg,) = torch.autograd.grad(ref.sum(), bias)
    assert torch.allclose(g, rg, atol=1e-5)
    assert (g[~sel] == 0).all()  # unselected keys get no gradient


def test_bad_arguments():
    with pytest.raises(TypeError, match="bias must be a 4-D floating tensor"):
        topk_mask(torch.ones(3, 4), 2)
    with pytest.raises(ValueError, match="window must be an int >= 0"):
        topk_mask(torch.ones(1, 1, 1, 4), -1)
    with pytest.raises(ValueError, match="does not broadcast"):
        topk_mask(torch.ones(2, 1, 1, 4), 2, torch.ones(3, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="block_size must be a positive int"):
        relu_mask(torch.ones(1, 1, 1, 4), block_size=0)


def _chunked(monkeypatch, chunk: int) -> None:
    """Rows longer than `chunk` keys take the kernel's chunked path, `chunk` keys a pass."""
    monkeypatch.setattr(masks, "FUSED_MAX_KEYS", chunk)
    monkeypatch.setattr(masks, "ROW_CHUNK", chunk)


@pytest.mark.parametrize("layout", ["in-registers", "chunked", "chunked-fits"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_fused_kernel_matches_torch_topk(monkeypatch, dtype, layout):
    """The fused selection against torch.topk on rows without ties, with a padding mask, a
    broadcast 4-D mask, NaN/-inf/finfo.min at allowed and disallowed keys; chunked: the rows
    read 64 keys at a time (5 chunks, the last partial), fewer rows (the interpreter runs a
    program a row); chunked-fits: the chunked kernel, as a symbolic length launches it, on
    rows that fit its block (held in registers, a branch at run time)."""
    # Distinct values per row (integers in [-150, 150) are exact in every dtype): no ties.
    bias = (torch.rand(2, 3, 5, 300).argsort(dim=-1) - 150).to(dtype)
    bias[0, 0, 0, :7] = torch.tensor([math.nan, -math.inf, math.inf, 1e30, -1e30, 0.5, 2.5])
    bias[1, 2, 4, 10] = torch.finfo(dtype).min
    mask4 = torch.rand(1, 3, 5, 300) < 0.7
    if layout == "chunked":
        _chunked(monkeypatch, 64)
    if layout == "chunked-fits":
        monkeypatch.setattr(masks, "symbolic", lambda n: True)
    if layout != "in-registers":
        bias, mask4 = bias[:, 1:, 3:], mask4[:, 1:, 3:]  # 8 rows, bias[1, 2, 4] among them
    pad = torch.ones(2, 300, dtype=torch.bool)
    pad[1, 250:] = False
    for mask in (None, mask4, pad):
        for window, block_size in ((1, None), (17, 16), (128, None), (128, 5), (299, 64)):
            fused = masks.topk_mask(bias, window, mask, block_size=block_size)
            with monkeypatch.context() as m:
                m.setattr(masks, "_fused_applies", lambda score, k: False)
                plain = masks.topk_mask(bias, window, mask, block_size=block_size)
            assert fused.shape == plain.shape
            assert torch.equal(fused, plain), (mask is None, window, block_size)


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "in-registers"])
def test_fused_ties_go_to_the_lowest_key_indices(monkeypatch, chunked):
    if chunked:
        _chunked(monkeypatch, 16)  # the ties below span three chunks of 16 keys
    bias = torch.zeros(1, 1, 3, 40)
    bias[0, 0, 1, 5:9] = 1.0
    bias[0, 0, 2, 30:] = 1.0
    got = masks.topk_mask(bias, 6)
    if not masks._fused_applies(bias, 6):
        pytest.skip("the fused kernel does not run here")
    assert got[0, 0, 0].nonzero().flatten().tolist() == [0, 1, 2, 3, 4, 5]
    assert got[0, 0, 1].nonzero().flatten().tolist() == [0, 1, 5, 6, 7, 8]
    got = masks.topk_mask(bias, 30)
    assert got[0, 0, 2].nonzero().flatten().tolist() == [*range(20), *range(30, 40)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_chunked_selection_splits_ties_inside_one_byte_of_the_images(monkeypatch, dtype):
    """The chunked kernel's threshold search on rows whose values share their images' high
    bytes (all in [1, 2), 32 distinct values, many ties: the case a search a byte of the images
    at a time, as a radix select, must split), with k landing inside a run of ties, across
    chunk ends, with and without a padding mask, and k past the allowed keys: the k largest
    allowed keys, ties to the lowest key indices (a stable descending sort), as the kernel's
    contract says."""
    _chunked(monkeypatch, 32)
    g = torch.Generator().manual_seed(5)
    bias = (1 + torch.randint(0, 32, (1, 2, 3, 200), generator=g) / 32).to(dtype)
    pad = torch.rand(1, 200, generator=g) < 0.8
    if not masks._fused_applies(bias, 7):
        pytest.skip("the fused kernel does not run here")
    for mask in (None, pad):
        allowed = torch.ones(200, dtype=torch.bool) if mask is None else mask[0]
        scores = bias.float().masked_fill(~allowed, -math.inf)
        order = scores.sort(dim=-1, descending=True, stable=True).indices
        for window in (1, 7, 33, 100, 199, 250):
            want = torch.zeros(bias.shape, dtype=torch.bool)
            want.scatter_(-1, order[..., :window], True)
            want &= allowed
            got = masks.topk_mask(bias, window, mask)
            assert torch.equal(got, want), (mask is None, window)


def test_long_rows_take_the_fused_kernel_and_match_torch_topk(monkeypatch):
    """Rows past FUSED_MAX_KEYS (the model's L32768 calls) with the real chunk: float32 biases
    of distinct values (no ties), a padding mask, smoothing."""
    n, k = masks.FUSED_MAX_KEYS + 3000, (masks.FUSED_MAX_KEYS + 3000) // 4
    bias = torch.randperm(2 * n)[:n].float().view(1, 1, 1, n).repeat(1, 2, 1, 1)
    bias[0, 1] = -bias[0, 1]
    pad = torch.ones(1, n, dtype=torch.bool)
    pad[0, -700:] = False
    if not masks._fused_applies(bias, k):
        pytest.skip("the fused kernel does not run here")
    for mask, block_size in ((None, None), (pad, 64)):
        fused = masks.topk_mask(bias, k, mask, block_size=block_size)
        with monkeypatch.context() as m:
            m.setattr(masks, "_fused_applies", lambda score, k: False)
            plain = masks.topk_mask(bias, k, mask, block_size=block_size)
        assert torch.equal(fused, plain), block_size
    assert fused[0, :, 0, -700:].sum() == 0
    assert (masks.topk_mask(bias, k).sum(-1) == k).all()


def test_opcheck_topk_select():
    bias = torch.randn(2, 1, 3, 50)
    allowed = torch.rand(1, 2, 1, 50) < 0.8
    torch.library.opcheck(torch.ops.dmattn.topk_select.default, (bias, allowed, 7, 0))
    torch.library.opcheck(torch.ops.dmattn.topk_select.default, (bias, allowed, 7, 16))
    torch.library.opcheck(torch.ops.dmattn.topk_select.default, (bias, None, 7, 0))


@pytest.mark.skipif(not TRITON, reason="the fused top-k kernel needs CUDA or TRITON_INTERPRET=1")
def test_compiled_topk_with_symbolic_lengths_does_not_recompile_at_the_window():
    """Compiled with dynamic=True, the selection takes k = window whatever the length (the
    fused kernel keeps every allowed key where the window covers the row), so a length below
    the window does not compile the graph again, and each length selects as eagerly."""
    torch._dynamo.reset()
    fn = torch.compile(lambda b, m: topk_mask(b, 8, m), fullgraph=True, dynamic=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for n in (20, 6, 40, 8):
            bias = torch.randn(2, 3, 1, n, dtype=torch.float32, device=DEVICE)
            allowed = torch.rand(2, 1, 1, n, device=DEVICE) < 0.7
            got = fn(bias, allowed)
            assert torch.equal(got, topk_mask(bias, 8, allowed)), n
            if n <= 8:
                assert torch.equal(got, allowed.expand_as(got)), n


@pytest.mark.skipif(not TRITON, reason="the fused top-k kernel needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_topk_select_with_k_past_the_row_keeps_every_allowed_key(monkeypatch, chunked, dtype):
    """A compiled selection passes the window as k whatever the length (select_topk): where k
    exceeds the row the kernel keeps every allowed key, NaN and -inf scores included, smoothed
    or not, as the unfused path does with k = Lk; rows read whole or in chunks."""
    if chunked:
        monkeypatch.setattr(masks, "FUSED_MAX_KEYS", 8)
        monkeypatch.setattr(masks, "ROW_CHUNK", 8)
    torch.manual_seed(0)
    for smooth in (0, 4):
        bias = torch.randn(2, 3, 1, 20, dtype=dtype, device=DEVICE)
        bias[0, 0, 0, 3], bias[1, 1, 0, 5] = float("nan"), float("-inf")
        allowed = torch.rand(2, 1, 1, 20, device=DEVICE) < 0.6
        got = torch.ops.dmattn.topk_select(bias, allowed, 25, smooth, False)
        want = topk_mask(bias, 20, allowed, block_size=smooth or None)
        assert torch.equal(got, want), smooth
