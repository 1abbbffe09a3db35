"""flash-attn 2's entry points over `attention` / `attention_varlen`: its names, argument order,
defaults, conventions and returns, plus keyword-only ``mask=`` and ``bias=`` (the DMA operands,
shapes as `attention`'s).

What differs from flash-attn, by design:

* ``return_attn_probs=True`` returns ``(out, softmax_lse, None)``: the log-sum-exp, float32
  (B, H, Lq) (varlen: (H, total_q)), and no probabilities (flash-attn's are for testing and
  come with dropout). A row that sees no key has lse ``-inf`` here (log of an empty sum) and
  ``+inf`` in flash-attn; its output is 0 in both.
* What is not supported raises ``NotImplementedError``, never a silent difference: dropout
  (``dropout_p`` > 0: pass ``dropout_p if self.training else 0.0`` only with 0.0), ALiBi slopes
  (ALiBi is a bias: pass it as ``bias``), rotary embedding inside the kvcache call (apply it to
  q and k before), ``cache_leftpad``.
* Paged caches (``block_table``) are gathered into contiguous keys per call (an allocation of
  the pages the table names); the kernels do not read pages themselves.
"""

from __future__ import annotations

import torch

from dmattn_ops.api import attention, attention_varlen
from dmattn_ops.core.validate import data_readable


def _unsupported(fn: str, dropout_p: float, alibi_slopes) -> None:
    if dropout_p != 0.0:
        raise NotImplementedError(
            f"{fn}: dropout_p must be 0.0 (Dynamic Mask Attention has no dropout); got {dropout_p}"
        )
    if alibi_slopes is not None:
        raise NotImplementedError(
            f"{fn}: alibi_slopes is not supported; express ALiBi as a bias (it is one)"
        )


def _returned(result, return_attn_probs: bool):
    """out, or flash-attn's (out, softmax_lse, None)."""
    if return_attn_probs:
        out, lse = result
        return out, lse, None
    return result


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    mask: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
):
    """`flash_attn.flash_attn_func` over `attention`: q (B, Lq, H, D), k/v (B, Lk, Hkv, D|Dv);
    causal bottom-right aligned (flash-attn >= 2.1); window_size flash-attn's sliding window.
    Returns out (B, Lq, H, Dv), or (out, softmax_lse, None) with return_attn_probs (module
    docstring)."""
    _unsupported("dmattn.flash_attn_func", dropout_p, alibi_slopes)
    result = attention(
        q, k, v, mask, bias, scale=softmax_scale, is_causal=causal, softcap=softcap,
        deterministic=deterministic, window_size=window_size, return_lse=return_attn_probs,
    )  # fmt: skip
    return _returned(result, return_attn_probs)


def flash_attn_qkvpacked_func(
    qkv: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    mask: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
):
    """`flash_attn.flash_attn_qkvpacked_func`: qkv (B, L, 3, H, D), as flash_attn_func."""
    _check_packed("dmattn.flash_attn_qkvpacked_func", "qkv", qkv, 5, 3)
    q, k, v = qkv.unbind(2)
    return flash_attn_func(
        q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
        deterministic, return_attn_probs, mask=mask, bias=bias,
    )  # fmt: skip


def flash_attn_kvpacked_func(
    q: torch.Tensor,
    kv: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    mask: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
):
    """`flash_attn.flash_attn_kvpacked_func`: q (B, Lq, H, D), kv (B, Lk, 2, Hkv, D)."""
    _check_packed("dmattn.flash_attn_kvpacked_func", "kv", kv, 5, 2)
    k, v = kv.unbind(2)
    return flash_attn_func(
        q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
        deterministic, return_attn_probs, mask=mask, bias=bias,
    )  # fmt: skip


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: torch.Tensor | None = None,
    *,
    mask: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
):
    """`flash_attn.flash_attn_varlen_func` over `attention_varlen`: packed q (total_q, H, D),
    k/v (total_k, Hkv, D|Dv), int32 cu_seqlens; ``mask``/``bias`` per key token,
    (H|Hkv|1, total_k). With ``block_table`` (B, max_blocks) int32, k/v are paged caches
    (num_blocks, page_size, Hkv, D|Dv) and sequence b's keys are the first
    cu_seqlens_k[b+1] - cu_seqlens_k[b] rows of its pages (mask/bias then per key token in
    cu_seqlens_k order, as without pages)."""
    fn = "dmattn.flash_attn_varlen_func"
    _unsupported(fn, dropout_p, alibi_slopes)
    if block_table is not None:
        k, v, mask, bias, cu_seqlens_k = _unpage_varlen(
            fn, k, v, block_table, cu_seqlens_k, max_seqlen_k, mask, bias
        )
    result = attention_varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, mask, bias,
        scale=softmax_scale, is_causal=causal, softcap=softcap, deterministic=deterministic,
        window_size=window_size, return_lse=return_attn_probs,
    )  # fmt: skip
    return _returned(result, return_attn_probs)


def flash_attn_varlen_qkvpacked_func(
    qkv: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    mask: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
):
    """`flash_attn.flash_attn_varlen_qkvpacked_func`: qkv (total, 3, H, D)."""
    _check_packed("dmattn.flash_attn_varlen_qkvpacked_func", "qkv", qkv, 4, 3)
    q, k, v = qkv.unbind(1)
    return flash_attn_varlen_func(
        q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale,
        causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
        mask=mask, bias=bias,
    )  # fmt: skip


def flash_attn_varlen_kvpacked_func(
    q: torch.Tensor,
    kv: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    mask: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
):
    """`flash_attn.flash_attn_varlen_kvpacked_func`: q (total_q, H, D), kv (total_k, 2, Hkv, D)."""
    _check_packed("dmattn.flash_attn_varlen_kvpacked_func", "kv", kv, 4, 2)
    k, v = kv.unbind(1)
    return flash_attn_varlen_func(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
        softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
        return_attn_probs, mask=mask, bias=bias,
    )  # fmt: skip


def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    rotary_cos: torch.Tensor | None = None,
    rotary_sin: torch.Tensor | None = None,
    cache_seqlens: int | torch.Tensor | None = None,
    cache_batch_idx: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: torch.Tensor | None = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
    *,
    mask: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
):
    """`flash_attn.flash_attn_with_kvcache` over `attention` with ``seqused_k``.

    q (B, Lq, H, D); k_cache/v_cache (B_cache, L_cache, Hkv, D|Dv), or with ``block_table``
    (B, max_blocks) int32 paged caches (num_blocks, page_size, Hkv, D|Dv). ``cache_seqlens``
    (int, or int32 (B,)): the filled length of each cache (None: full). ``k``/``v``
    (B, Lnew, Hkv, D|Dv), if given, are written into the caches in place at positions
    cache_seqlens[b] onwards before attending, so the call sees cache_seqlens + Lnew keys
    (cache_seqlens, cache_batch_idx and the table's pages in use are checked first: one host
    read eagerly, _check_cache_values);
    ``cache_batch_idx`` (B,) picks which cache rows batch b uses.
    causal and window_size align the last query with the last key of each sequence (SPEC).
    ``mask``/``bias`` index cache positions: (B|1, H|Hkv|1, Lq|1, L) with L = L_cache, or
    max_blocks * page_size when paged. ``num_splits`` is accepted and ignored (the library
    picks its own split-K for decoding). Returns out (B, Lq, H, Dv), or (out, softmax_lse)
    with ``return_softmax_lse``. Rotary, cache_leftpad and ALiBi raise NotImplementedError.
    """
    fn = "dmattn.flash_attn_with_kvcache"
    _unsupported(fn, 0.0, alibi_slopes)
    if rotary_cos is not None or rotary_sin is not None:
        raise NotImplementedError(
            f"{fn}: rotary embedding is not applied here; apply it to q and k before the call"
        )
    if cache_leftpad is not None:
        raise NotImplementedError(f"{fn}: cache_leftpad is not supported")
    if (k is None) != (v is None):
        raise ValueError(f"{fn}: pass both k and v (new keys and values to append), or neither")
    if k is not None and cache_seqlens is None:
        raise ValueError(
            f"{fn}: appending k and v needs cache_seqlens (where each cache's new rows go)"
        )
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{fn}: {name} must be a 4-D tensor; got {getattr(t, 'shape', t)}")
    b = q.shape[0]
    paged = block_table is not None
    if paged:
        if cache_batch_idx is not None:
            raise ValueError(f"{fn}: cache_batch_idx and block_table exclude each other")
        _check_table(fn, block_table, b)
        length = block_table.shape[1] * k_cache.shape[1]
    else:
        length = k_cache.shape[1]
    new = 0
    if k is not None:
        if k.dim() != 4 or v.dim() != 4 or k.shape[0] != b or v.shape[:2] != k.shape[:2]:
            raise ValueError(
                f"{fn}: k and v must be (B, Lnew, Hkv, D) with B={b}; got {tuple(k.shape)} and "
                f"{tuple(v.shape)}"
            )
        new = k.shape[1]
    filled = _lengths(fn, cache_seqlens, b, length - new, q.device)
    if cache_batch_idx is not None:
        _check_batch_index(fn, cache_batch_idx, b)
    _check_cache_values(
        fn, cache_seqlens, filled, new, length, cache_batch_idx, block_table, k_cache
    )
    if k is not None:
        _append(k_cache, v_cache, k, v, filled, cache_batch_idx, block_table)
        filled = filled + new
    if paged:
        key, value = _gather_pages(k_cache, block_table), _gather_pages(v_cache, block_table)
    elif cache_batch_idx is not None:
        key, value = k_cache[cache_batch_idx], v_cache[cache_batch_idx]
    else:
        key, value = k_cache, v_cache
    # The lengths were checked above (before the write): the call reads them no second time.
    return attention(
        q, key, value, mask, bias, scale=softmax_scale, is_causal=causal, softcap=softcap,
        seqused_k=filled, window_size=window_size, return_lse=return_softmax_lse,
        _seqused_k_in_range=True,
    )  # fmt: skip


def _check_packed(fn: str, name: str, t, dims: int, parts: int) -> None:
    axis = dims - 3
    if not isinstance(t, torch.Tensor) or t.dim() != dims or t.shape[axis] != parts:
        raise ValueError(
            f"{fn}: {name} must be {dims}-D with {parts} at dim {axis}; "
            f"got {tuple(getattr(t, 'shape', ()))}"
        )


def _check_table(fn: str, table, b: int) -> None:
    if not isinstance(table, torch.Tensor) or table.dtype != torch.int32 or table.dim() != 2:
        raise ValueError(f"{fn}: block_table must be int32 (B, max_blocks); got {table!r:.80}")
    if table.shape[0] != b:
        raise ValueError(f"{fn}: block_table has {table.shape[0]} rows for a batch of {b}")


def _check_batch_index(fn: str, index, b: int) -> None:
    if (
        not isinstance(index, torch.Tensor)
        or index.dtype not in (torch.int32, torch.int64)
        or tuple(index.shape) != (b,)
    ):
        raise ValueError(f"{fn}: cache_batch_idx must be int32 or int64 ({b},); got {index!r:.80}")


def _check_cache_values(
    fn: str, cache_seqlens, filled, new: int, length: int, index, table, k_cache
):
    """Before anything is written: cache_seqlens (a tensor) in [0, length - new], so that the
    new rows land inside each cache, cache_batch_idx in [0, B_cache), and the block table's
    entries that the filled length (`filled`, _lengths' (B,) form of cache_seqlens) reaches with
    the new rows in [0, num_blocks). One host read for all of them (a sync on a GPU), where
    there is a tensor to read; skipped where the values cannot be read (while torch.compile
    traces, during CUDA graph capture), as the ops' own value checks are. Out of range,
    flash-attn writes and reads out of bounds; index_put_ raised IndexError (a device-side
    assert on a GPU) or, for a negative length, wrote at the cache's end and attended to
    nothing."""
    tensors = [t for t in (cache_seqlens, index, table) if isinstance(t, torch.Tensor)]
    if not tensors or not all(data_readable(t) for t in tensors):
        return
    found = []
    if isinstance(cache_seqlens, torch.Tensor):
        found += [cache_seqlens.min(), cache_seqlens.max()]
    if index is not None:
        found += [index.min(), index.max()]
    if table is not None:
        page, blocks = k_cache.shape[1], table.shape[1]
        reached = torch.arange(blocks, device=table.device) * page < (filled + new)[:, None]
        found += [(reached & ((table < 0) | (table >= k_cache.shape[0]))).any()]
    values = iter(torch.stack([t.to(torch.int64) for t in found]).tolist())  # the one read
    if isinstance(cache_seqlens, torch.Tensor):
        lo, hi = next(values), next(values)
        if lo < 0 or hi > length - new:
            raise ValueError(
                f"{fn}: cache_seqlens values must lie in [0, {length - new}] (a cache of {length} "
                f"slots{f' and {new} new rows' if new else ''}); got values from {lo} to {hi}"
            )
    if index is not None:
        lo, hi = next(values), next(values)
        if lo < 0 or hi >= k_cache.shape[0]:
            raise ValueError(
                f"{fn}: cache_batch_idx values must lie in [0, {k_cache.shape[0]}) (k_cache's "
                f"batch); got values from {lo} to {hi}"
            )
    if table is not None and next(values):
        raise ValueError(
            f"{fn}: block_table names pages outside [0, {k_cache.shape[0]}) (k_cache's pages) "
            "within the filled length"
        )


def _lengths(fn: str, cache_seqlens, b: int, length: int, device) -> torch.Tensor:
    """cache_seqlens as int32 (B,) (a full cache where None); an int checked against `length`,
    the slots that may be filled before the new rows."""
    if cache_seqlens is None:
        return torch.full((b,), length, dtype=torch.int32, device=device)
    if isinstance(cache_seqlens, int):
        if not 0 <= cache_seqlens <= length:
            raise ValueError(f"{fn}: cache_seqlens={cache_seqlens} outside [0, {length}]")
        return torch.full((b,), cache_seqlens, dtype=torch.int32, device=device)
    if (
        not isinstance(cache_seqlens, torch.Tensor)
        or cache_seqlens.dtype != torch.int32
        or tuple(cache_seqlens.shape) != (b,)
    ):
        raise ValueError(
            f"{fn}: cache_seqlens must be an int or int32 ({b},); got {cache_seqlens!r:.80}"
        )
    return cache_seqlens


def _positions(filled: torch.Tensor, new: int) -> torch.Tensor:
    """(B, new) int64 cache positions filled[b] + t."""
    return filled.to(torch.int64)[:, None] + torch.arange(new, device=filled.device)


def _append(k_cache, v_cache, k, v, filled, batch_idx, table) -> None:
    """Writes k/v into the caches in place at positions filled[b] onwards."""
    pos = _positions(filled, k.shape[1])
    if table is not None:
        page = k_cache.shape[1]
        blocks = table.to(torch.int64).gather(1, pos // page)
        index = (blocks, pos % page)
    else:
        rows = torch.arange(k.shape[0], device=k.device) if batch_idx is None else batch_idx
        index = (rows.to(torch.int64)[:, None].expand_as(pos), pos)
    with torch.no_grad():
        k_cache.index_put_(index, k.to(k_cache.dtype))
        v_cache.index_put_(index, v.to(v_cache.dtype))


def _gather_pages(cache: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """(B, max_blocks * page, Hkv, D): batch b's pages in table order. Entries past the filled
    length may hold anything, as flash-attn never reads them: clamped into the pool, the pages
    they gather lie beyond seqused_k, which no query sees."""
    b, blocks = table.shape
    index = table.to(torch.int64).clamp(0, cache.shape[0] - 1)
    return cache[index].reshape(b, blocks * cache.shape[1], *cache.shape[2:])


def _unpage_varlen(fn, k, v, table, cu_k, max_k, mask, bias):
    """Packed keys of a paged varlen call, at the rows cu_seqlens_k gives them (rows past
    cu_seqlens_k[-1], up to B * max_seqlen_k, belong to no sequence: the row count is known
    without reading cu_seqlens_k on the host), and mask/bias padded to those rows."""
    b = cu_k.shape[0] - 1
    _check_table(fn, table, b)
    rows = torch.arange(b * max_k, device=cu_k.device)
    seq = torch.searchsorted(cu_k[1:].to(torch.int64), rows, right=True).clamp(max=b - 1)
    pos = (rows - cu_k.to(torch.int64)[seq]).clamp(0, table.shape[1] * k.shape[1] - 1)
    page = k.shape[1]
    blocks = table.to(torch.int64)[seq, pos // page]
    if data_readable(blocks) and data_readable(cu_k):
        # The pages the sequences' keys lie on must be in the pool (one host read); entries
        # past a sequence's length may hold anything, as flash-attn never reads them.
        inside = rows < cu_k[-1]
        if bool((inside & ((blocks < 0) | (blocks >= k.shape[0]))).any()):
            raise ValueError(
                f"{fn}: block_table names pages outside [0, {k.shape[0]}) (k's pages) within "
                "the sequences' lengths"
            )
    blocks = blocks.clamp(0, k.shape[0] - 1)  # the rows past every sequence's keys
    key, value = k[blocks, pos % page], v[blocks, pos % page]

    def padded(t):
        if t is None or t.shape[-1] >= rows.shape[0]:
            return t
        tail = t.new_zeros((*t.shape[:-1], rows.shape[0] - t.shape[-1]))
        return torch.cat([t, tail], dim=-1)

    return key, value, padded(mask), padded(bias), cu_k
