"""flash-attn-style entry points: flash-attn's argument names, order and conventions."""

import pytest
import torch
from helpers import assert_close

import dmattn_ops
from dmattn_ops import reference

# float64 results against the float64 oracle: 64 ulps of the largest value.
F64 = 64 * torch.finfo(torch.float64).eps


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
        (dict(dropout_p=0.1), ValueError, "dropout_p must be 0.0"),
        (dict(window_size=(-2, 0)), ValueError, "window_size left must be >= 0, or -1"),
        (dict(alibi_slopes=torch.ones(4)), NotImplementedError, "alibi_slopes"),
        (dict(return_attn_probs=True), NotImplementedError, "return_attn_probs"),
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
