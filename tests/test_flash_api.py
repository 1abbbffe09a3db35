"""flash-attn-style entry points: flash-attn's argument names, order and conventions."""

import pytest
import torch
from helpers import F64, assert_close

import dmattn_ops
from dmattn_ops import reference


def _qkv(b=2, lq=7, lk=9, h=4, hkv=2, d=16):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(b, lq, h, d, generator=g, dtype=torch.float64),
            torch.randn(b, lk, hkv, d, generator=g, dtype=torch.float64),
            torch.randn(b, lk, hkv, d, generator=g, dtype=torch.float64))  # fmt: skip


def test_positional_order_matches_flash_attn():
    q, k, v = _qkv()
    # flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap)
    out = dmattn_ops.flash_attn_func(q, k, v, 0.0, 0.3, True, (-1, -1), 5.0)
    want = reference.attention(q, k, v, scale=0.3, is_causal=True, softcap=5.0)
    assert_close(out, want, F64 * want.abs().max().item(), "flash_attn_func")


def test_keywords_and_dma_operands():
    q, k, v = _qkv()
    bias = torch.randn(2, 2, 1, 9, dtype=torch.float64)
    mask = bias > -0.5
    out = dmattn_ops.flash_attn_func(q, k, v, causal=True, softmax_scale=None, mask=mask, bias=bias)
    want = reference.attention(q, k, v, mask, bias, is_causal=True)
    assert_close(out, want, F64 * want.abs().max().item(), "dma")


def test_window_size_is_flash_attn_s_sliding_window():
    q, k, v = _qkv(lq=9, lk=13)
    out = dmattn_ops.flash_attn_func(q, k, v, 0.0, None, True, (4, 0))
    want = reference.attention(q, k, v, is_causal=True, window_size=(4, 0))
    assert_close(out, want, F64 * want.abs().max().item(), "flash_attn_func window")
    q, k, v = (t[0] for t in _qkv(b=1, lq=12, lk=12))
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    out = dmattn_ops.flash_attn_varlen_func(q, k, v, cu, cu, 7, 7, window_size=(2, 1))
    want = reference.attention_varlen(q, k, v, cu, cu, 7, 7, window_size=(2, 1))
    assert_close(out, want, F64 * want.abs().max().item(), "flash_attn_varlen_func window")


def test_varlen_matches_the_oracle():
    q, k, v = (t[0] for t in _qkv(b=1, lq=12, lk=12))
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    out = dmattn_ops.flash_attn_varlen_func(q, k, v, cu, cu, 7, 7, 0.0, None, True)
    want = reference.attention_varlen(q, k, v, cu, cu, 7, 7, is_causal=True)
    assert_close(out, want, F64 * want.abs().max().item(), "flash_attn_varlen_func")


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(dropout_p=0.1), NotImplementedError, "dropout_p must be 0.0"),
        (dict(window_size=(-2, 0)), ValueError, "window_size left must be >= 0, or -1"),
        (dict(alibi_slopes=torch.ones(4)), NotImplementedError, "alibi_slopes"),
    ],
)
def test_unsupported_arguments_raise_clearly(kwargs, error, match):
    q, k, v = _qkv()
    with pytest.raises(error, match=match):
        dmattn_ops.flash_attn_func(q, k, v, **kwargs)
    cu = torch.tensor([0, 7, 14], dtype=torch.int32)
    with pytest.raises(error, match=match):
        dmattn_ops.flash_attn_varlen_func(q.flatten(0, 1), k[:, :7].flatten(0, 1),
                                          v[:, :7].flatten(0, 1), cu, cu, 7, 7, **kwargs)  # fmt: skip


def test_return_attn_probs_returns_out_lse_and_none():
    """flash-attn's return convention: (out, softmax_lse, None), lse float32 (B, H, Lq) and
    (H, total_q) for varlen, -inf on a row that sees no key (flash-attn: +inf)."""
    q, k, v = _qkv(lq=9, lk=5)
    out, lse, probs = dmattn_ops.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    want, want_lse = reference.attention(q, k, v, is_causal=True, return_lse=True)
    assert probs is None and lse.shape == (2, 4, 9)
    assert_close(out, want, F64 * want.abs().max().item(), "out")
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse)) and torch.isneginf(lse).any()
    assert_close(lse, want_lse, F64 * 16, "lse")
    q, k, v = (t[0] for t in _qkv(b=1, lq=12, lk=12))
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    out, lse, probs = dmattn_ops.flash_attn_varlen_func(
        q, k, v, cu, cu, 7, 7, causal=True, return_attn_probs=True
    )
    want, want_lse = reference.attention_varlen(
        q, k, v, cu, cu, 7, 7, is_causal=True, return_lse=True
    )
    assert probs is None and lse.shape == (4, 12)
    assert_close(out, want, F64 * want.abs().max().item(), "varlen out")
    assert_close(lse, want_lse, F64 * 16, "varlen lse")


def test_packed_variants_match_the_unpacked_call():
    q, k, v = _qkv(lq=9, lk=9, hkv=4)
    bias = torch.randn(2, 4, 1, 9, dtype=torch.float64)
    want = reference.attention(q, k, v, None, bias, is_causal=True, scale=0.5)
    qkv = torch.stack([q, k, v], dim=2)
    out = dmattn_ops.flash_attn_qkvpacked_func(qkv, 0.0, 0.5, True, bias=bias)
    assert_close(out, want, F64 * want.abs().max().item(), "qkvpacked")
    out = dmattn_ops.flash_attn_kvpacked_func(
        q, torch.stack([k, v], dim=2), 0.0, 0.5, True, bias=bias
    )
    assert_close(out, want, F64 * want.abs().max().item(), "kvpacked")
    q, k, v = (t[0] for t in _qkv(b=1, lq=12, lk=12, hkv=4))
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    want = reference.attention_varlen(q, k, v, cu, cu, 7, 7, is_causal=True)
    out = dmattn_ops.flash_attn_varlen_qkvpacked_func(torch.stack([q, k, v], 1), cu, 7, causal=True)
    assert_close(out, want, F64 * want.abs().max().item(), "varlen qkvpacked")
    out = dmattn_ops.flash_attn_varlen_kvpacked_func(
        q, torch.stack([k, v], 1), cu, cu, 7, 7, causal=True
    )
    assert_close(out, want, F64 * want.abs().max().item(), "varlen kvpacked")
    with pytest.raises(ValueError, match="qkv must be 5-D with 3 at dim 2"):
        dmattn_ops.flash_attn_qkvpacked_func(q)


def _paged(cache, page):
    """A (B, L, Hkv, D) cache as pages in a shuffled pool and its block table."""
    b, length = cache.shape[:2]
    blocks = length // page
    pool = torch.full((b * blocks + 3, page, *cache.shape[2:]), float("nan"), dtype=cache.dtype)
    order = torch.randperm(pool.shape[0], generator=torch.Generator().manual_seed(1))[: b * blocks]
    pool[order] = cache.reshape(b * blocks, page, *cache.shape[2:])
    return pool, order.view(b, blocks).to(torch.int32)


@pytest.mark.parametrize("paged", [False, True])
def test_kvcache_appends_in_place_and_attends_to_the_filled_cache(paged):
    """flash_attn_with_kvcache: new k/v are written at cache_seqlens[b] onwards, in place, and the
    call equals attention over cache_seqlens + Lnew keys (causal bottom-right aligned to them);
    unused cache slots (NaN here) never reach the result; paged caches give the same."""
    g = torch.Generator().manual_seed(0)
    b, length, h, hkv, d, new = 3, 16, 4, 2, 8, 2
    k_cache = torch.full((b, length, hkv, d), float("nan"), dtype=torch.float64)
    v_cache = k_cache.clone()
    filled = torch.tensor([5, 0, 11], dtype=torch.int32)
    for i, n in enumerate(filled.tolist()):
        k_cache[i, :n] = torch.randn(n, hkv, d, generator=g, dtype=torch.float64)
        v_cache[i, :n] = torch.randn(n, hkv, d, generator=g, dtype=torch.float64)
    q = torch.randn(b, new, h, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, new, hkv, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, new, hkv, d, generator=g, dtype=torch.float64)
    bias = torch.randn(b, hkv, 1, length, generator=g, dtype=torch.float64)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    for i, n in enumerate(filled.tolist()):
        want_k[i, n : n + new], want_v[i, n : n + new] = k[i], v[i]
    used = filled + new
    want, want_lse = reference.attention(
        q, want_k.nan_to_num(0.0), want_v.nan_to_num(0.0), None, bias, is_causal=True,
        seqused_k=used, return_lse=True,
    )  # fmt: skip
    if paged:
        kc, table = _paged(k_cache, 4)
        vc, _ = _paged(v_cache, 4)
    else:
        kc, vc, table = k_cache, v_cache, None
    out, lse = dmattn_ops.flash_attn_with_kvcache(
        q, kc, vc, k, v, cache_seqlens=filled, block_table=table, causal=True,
        return_softmax_lse=True, bias=bias,
    )  # fmt: skip
    assert not out.isnan().any()
    assert_close(out, want, F64 * want.abs().max().item(), "kvcache out")
    assert_close(lse, want_lse, F64 * 16, "kvcache lse")
    written = kc[table.long()].reshape(b, length, hkv, d) if paged else kc
    for i, n in enumerate(used.tolist()):
        assert torch.equal(written[i, :n], want_k[i, :n])


def test_kvcache_append_needs_cache_seqlens():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="appending k and v needs cache_seqlens"):
        dmattn_ops.flash_attn_with_kvcache(q, k, v, k[:, :1], v[:, :1])


def test_kvcache_batch_index_and_full_cache():
    g = torch.Generator().manual_seed(0)
    k_cache = torch.randn(4, 10, 2, 8, generator=g, dtype=torch.float64)
    v_cache = torch.randn(4, 10, 2, 8, generator=g, dtype=torch.float64)
    q = torch.randn(2, 3, 4, 8, generator=g, dtype=torch.float64)
    idx = torch.tensor([3, 1])
    out = dmattn_ops.flash_attn_with_kvcache(q, k_cache, v_cache, cache_batch_idx=idx, causal=True)
    want = reference.attention(q, k_cache[idx], v_cache[idx], is_causal=True)
    assert_close(out, want, F64 * want.abs().max().item(), "cache_batch_idx")
    out = dmattn_ops.flash_attn_with_kvcache(q, k_cache[:2], v_cache[:2], cache_seqlens=7)
    want = reference.attention(
        q, k_cache[:2], v_cache[:2], seqused_k=torch.tensor([7, 7], dtype=torch.int32)
    )
    assert_close(out, want, F64 * want.abs().max().item(), "int cache_seqlens")


def test_kvcache_lengths_and_indices_out_of_range_raise_before_writing():
    """cache_seqlens that leave no room for the new rows (or are negative), cache_batch_idx
    outside the caches, and block-table pages outside the pool within the filled length raise
    ValueError before the caches are written (index_put_ raised IndexError, a device-side
    assert on a GPU, and a negative length wrote at the cache's end and attended to nothing)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 1, 4, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 1, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
    k_cache = torch.randn(2, 8, 2, 8, generator=g, dtype=torch.float64)
    v_cache = k_cache.clone()
    before = k_cache.clone()
    i32 = torch.int32
    for lengths in (torch.tensor([8, 3], dtype=i32), torch.tensor([-1, 3], dtype=i32), 8):
        with pytest.raises(ValueError, match="cache_seqlens"):
            dmattn_ops.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths)
        assert torch.equal(k_cache, before)
    with pytest.raises(ValueError, match=r"cache_batch_idx values must lie in \[0, 2\)"):
        dmattn_ops.flash_attn_with_kvcache(
            q, k_cache, v_cache, cache_batch_idx=torch.tensor([0, 2])
        )
    with pytest.raises(ValueError, match="cache_batch_idx must be"):
        dmattn_ops.flash_attn_with_kvcache(
            q, k_cache, v_cache, cache_batch_idx=torch.tensor([0.0, 1])
        )
    pool, table = _paged(k_cache, 4)  # 2 pages a sequence, a pool of 7
    filled = torch.tensor([3, 2], dtype=i32)  # with one new row: the first page of each
    bad = table.clone()
    bad[1, 0] = pool.shape[0]
    with pytest.raises(ValueError, match="block_table names pages outside"):
        dmattn_ops.flash_attn_with_kvcache(
            q, pool, pool.clone(), k, v, cache_seqlens=filled, block_table=bad
        )  # fmt: skip
    # Entries past the filled length may hold anything, as flash-attn never reads them.
    unused = table.clone()
    unused[:, 1] = torch.tensor([-1, 2**20], dtype=i32)
    got = dmattn_ops.flash_attn_with_kvcache(
        q, pool.clone(), pool.clone(), k, v, cache_seqlens=filled, block_table=unused, causal=True
    )  # fmt: skip
    want = dmattn_ops.flash_attn_with_kvcache(
        q, pool.clone(), pool.clone(), k, v, cache_seqlens=filled, block_table=table, causal=True
    )  # fmt: skip
    assert torch.equal(got, want)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(rotary_cos=torch.ones(1), rotary_sin=torch.ones(1)), "rotary"),
        (dict(cache_leftpad=torch.zeros(2, dtype=torch.int32)), "cache_leftpad"),
        (dict(alibi_slopes=torch.ones(4)), "alibi_slopes"),
    ],
)
def test_kvcache_unsupported_options_raise(kwargs, match):
    q, k, v = _qkv()
    with pytest.raises(NotImplementedError, match=match):
        dmattn_ops.flash_attn_with_kvcache(q, k, v, **kwargs)


def test_paged_varlen_matches_the_packed_call():
    """flash_attn_varlen_func with block_table: each sequence's keys read from its pages."""
    g = torch.Generator().manual_seed(0)
    cu_q = torch.tensor([0, 3, 5], dtype=torch.int32)
    cu_k = torch.tensor([0, 7, 12], dtype=torch.int32)
    q = torch.randn(5, 4, 8, generator=g, dtype=torch.float64)
    k = torch.randn(12, 2, 8, generator=g, dtype=torch.float64)
    v = torch.randn(12, 2, 8, generator=g, dtype=torch.float64)
    bias = torch.randn(2, 12, generator=g, dtype=torch.float64)
    want = reference.attention_varlen(q, k, v, cu_q, cu_k, 3, 7, None, bias, is_causal=True)
    page = 4
    dense = torch.full((2, 8, 2, 8), float("nan"), dtype=torch.float64)
    dv = dense.clone()
    dense[0, :7], dense[1, :5] = k[:7], k[7:]
    dv[0, :7], dv[1, :5] = v[:7], v[7:]
    kc, table = _paged(dense, page)
    vc, _ = _paged(dv, page)
    out = dmattn_ops.flash_attn_varlen_func(
        q, kc, vc, cu_q, cu_k, 3, 7, causal=True, block_table=table, bias=bias
    )
    assert_close(out, want, F64 * want.abs().max().item(), "paged varlen")
    # Shorter sequences of keys (7 and 2): the second one's keys lie on its first page, and
    # its second entry may hold anything, as flash-attn never reads it (the rows past the
    # last sequence reached it: IndexError, a device-side assert on a GPU); an entry that
    # keys lie on must be in the pool.
    short = torch.tensor([0, 7, 9], dtype=torch.int32)
    want = reference.attention_varlen(q, k[:9], v[:9], cu_q, short, 3, 7, None, bias[:, :9],
                                      is_causal=True)  # fmt: skip
    unused = table.clone()
    unused[1, 1] = 2**20
    got = dmattn_ops.flash_attn_varlen_func(
        q, kc, vc, cu_q, short, 3, 7, causal=True, block_table=unused, bias=bias[:, :9]
    )
    assert_close(got, want, F64 * want.abs().max().item(), "paged varlen, unused entries")
    bad = table.clone()
    bad[1, 1] = kc.shape[0]
    with pytest.raises(ValueError, match="block_table names pages outside"):
        dmattn_ops.flash_attn_varlen_func(
            q, kc, vc, cu_q, cu_k, 3, 7, causal=True, block_table=bad, bias=bias
        )
