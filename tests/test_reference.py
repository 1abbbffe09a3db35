"""The oracle itself, checked against a per-element loop written straight from README "Semantics"."""

import math

import pytest
import torch
from helpers import Case, make_bias, make_mask, make_qkv, param

from dmattn_ops import reference


def loop_attention(q, k, v, mask, bias, scale, is_causal, softcap, seqused_k):
    b_, lq, h, d = q.shape
    lk, hkv, dv = k.shape[1], k.shape[2], v.shape[3]
    out = torch.zeros(b_, lq, h, dv, dtype=torch.float64)
    lse = torch.full((b_, h, lq), -math.inf, dtype=torch.float64)

    def pick(t, b, hh, i, j):
        hi = hh if t.shape[1] == h else (hh // (h // hkv) if t.shape[1] == hkv else 0)
        return t[b if t.shape[0] > 1 else 0, hi, i if t.shape[2] > 1 else 0, j]

    for b in range(b_):
        n = int(seqused_k[b]) if seqused_k is not None else lk
        for hh in range(h):
            g = hh // (h // hkv)
            for i in range(lq):
                scores = {}
                for j in range(lk):
                    if j >= n or (mask is not None and not pick(mask, b, hh, i, j)):
                        continue
                    if is_causal and j > i + n - lq:
                        continue
                    x = scale * float(q[b, i, hh] @ k[b, j, g])
                    if softcap > 0:
                        x = softcap * math.tanh(x / softcap)
                    if bias is not None:
                        x += float(pick(bias, b, hh, i, j))
                    scores[j] = x
                finite = [s for s in scores.values() if s != -math.inf]
                if not finite:
                    continue
                m = max(finite)
                total = sum(math.exp(s - m) for s in finite)
                lse[b, hh, i] = m + math.log(total)
                for j, s in scores.items():
                    out[b, i, hh] += math.exp(s - m) / total * v[b, j, g]
    return out, lse


CASES = [
    param(Case(1, 1, 1, 1, 1, 3, 2)),
    param(Case(2, 3, 5, 2, 1, 4, 3)),
    param(Case(1, 6, 4, 4, 2, 5, 5)),
    param(Case(2, 4, 7, 3, 3, 2, 6)),
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("softcap", [0.0, 2.0], ids=["nocap", "cap2"])
def test_oracle_matches_loop(case, is_causal, softcap):
    c = case
    q, k, v = make_qkv(c)
    mask = make_mask((c.b, c.hkv, c.lq, c.lk), density=0.7)
    bias = make_bias((1, c.h, 1, c.lk))
    seqused = torch.randint(0, c.lk + 1, (c.b,), dtype=torch.int32)
    scale = 0.7
    out, lse = reference.attention(
        q,
        k,
        v,
        mask,
        bias,
        scale=scale,
        is_causal=is_causal,
        softcap=softcap,
        seqused_k=seqused,
        return_lse=True,
    )
    out_l, lse_l = loop_attention(q, k, v, mask, bias, scale, is_causal, softcap, seqused)
    assert torch.allclose(out, out_l, atol=1e-12, rtol=0)
    assert torch.equal(lse.isinf(), lse_l.isinf())
    fin = lse_l.isfinite()
    assert torch.allclose(lse[fin].double(), lse_l[fin], atol=1e-5, rtol=0)  # lse is float32


def test_oracle_gradients_finite_for_empty_rows_and_neg_inf_bias():
    c = Case(1, 4, 6, 2, 2, 8, 8)
    q, k, v = make_qkv(c, requires_grad=True)
    bias = make_bias((1, c.h, c.lq, c.lk), requires_grad=True)
    with torch.no_grad():
        bias[:, :, 0] = -math.inf  # row 0: every key -inf
        bias[:, :, 1, :3] = -math.inf
    mask = torch.ones(1, 1, c.lq, c.lk, dtype=torch.bool)
    mask[..., 2, :] = False  # row 2: nothing allowed
    out, lse = reference.attention(q, k, v, mask, bias, return_lse=True)
    (out.sum() + lse[lse.isfinite()].sum()).backward()
    for t in (q, k, v, bias):
        assert torch.isfinite(t.grad).all()
    assert (out[:, 0] == 0).all() and (out[:, 2] == 0).all()
    assert torch.isneginf(lse[..., 0]).all() and torch.isneginf(lse[..., 2]).all()
    assert (q.grad[:, 0] == 0).all() and (q.grad[:, 2] == 0).all()
    assert (bias.grad[:, :, 0] == 0).all()
