"""The DMA layer's learned bias and its gradients (dmattn_ops/dt_bias.py):

    logits[t, h] = x[t] . W[h] + c[h]                       t = b * L + l, a token
    out[b, h, 0, l] = A[h] * softplus(logits[t, h])

Hkv (4 in Doge) is far below a tensor core's tile, so the products are broadcast sums in
float32 registers: both kernels read x once and are meant to be bound by memory. (Inductor's
kernels for the same sums, written as a reduction, ran 5-10x below the bandwidth on an H200;
so did these kernels written as tensor-core products, heads padded to 16, at 5d3b858.)
"""

import triton
import triton.language as tl


@triton.jit
def _softplus(z):
    """F.softplus(z) (beta 1, threshold 20) in float32: z above 20, else max(z, 0) +
    log1p(exp(-|z|)), with log1p(u) = log(1 + u) * u / ((1 + u) - 1) accurate where 1 + u
    rounds (Goldberg's form; u itself where 1 + u rounds to 1)."""
    u = tl.exp(-tl.abs(z))
    w = 1.0 + u
    small = w == 1.0
    log1p = tl.where(small, u, tl.log(w) * (u / tl.where(small, 1.0, w - 1.0)))
    return tl.where(z > 20.0, z, tl.maximum(z, 0.0) + log1p)


@triton.jit
def _sigmoid(z):
    """1 / (1 + exp(-z)) without overflowing exp: exp(-|z|) on both sides."""
    e = tl.exp(-tl.abs(z))
    return tl.where(z >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


@triton.jit
def dt_bias_fwd_kernel(
    X, W, C, A, OUT, LOGITS, VALUES,
    stride_xb, stride_xl, stride_xc,
    L, N, CH,
    H: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
    COPY: tl.constexpr = False,
):  # fmt: skip
    """BLOCK_T tokens per program: out (B, H, 1, L) contiguous in its dtype, logits (N, H)
    float32 (kept for the backward). W (H, CH), C and A (H,) are contiguous, in any float
    dtype (the parameters' own: read in float32, no conversion launched for them).
    x is read once; each head's products are reduced over the channels and land in its
    column of the (BLOCK_T, BLOCK_H) accumulator by a select: no reduction runs over an
    axis of H's few elements: the first version of these kernels summed the products over
    that axis, and its dx, right in the interpreter, was wrong on the H200 (Triton 3.6).
    COPY: the x tiles read are also stored to VALUES (N, CH) contiguous, in x's dtype
    (dt_bias_values: the layer's values handed on)."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.arange(0, BLOCK_C)
    hh = tl.arange(0, BLOCK_H)
    row_ok = t < N
    b = (t // L).to(tl.int64)
    pos = (t % L).to(tl.int64)
    x_rows = X + b * stride_xb + pos * stride_xl
    acc = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
    for c0 in range(0, CH, BLOCK_C):
        cc = c0 + c
        c_ok = cc < CH
        x_ok = row_ok[:, None] & c_ok[None, :]
        x_in = tl.load(x_rows[:, None] + cc[None, :] * stride_xc, mask=x_ok, other=0.0)
        if COPY:
            tl.store(VALUES + t[:, None] * CH + cc[None, :], x_in, mask=x_ok)
        x = x_in.to(tl.float32)
        for j in tl.static_range(H):
            w = tl.load(W + j * CH + cc, mask=c_ok, other=0.0).to(tl.float32)
            part = tl.sum(x * w[None, :], axis=1)
            acc = tl.where(hh[None, :] == j, acc + part[:, None], acc)
    h_ok = hh < H
    logits = acc + tl.load(C + hh, mask=h_ok, other=0.0).to(tl.float32)[None, :]
    out = tl.load(A + hh, mask=h_ok, other=0.0).to(tl.float32)[None, :] * _softplus(logits)
    ok = row_ok[:, None] & h_ok[None, :]
    tl.store(LOGITS + t[:, None] * H + hh[None, :], logits, mask=ok)
    tl.store(OUT + (b[:, None] * H + hh[None, :]) * L + pos[:, None],
             out.to(OUT.dtype.element_ty), mask=ok)  # fmt: skip


@triton.jit
def dt_bias_bwd_kernel(
    GRAD, X, W, A, LOGITS, DX, PARTS, GRAD_V,
    stride_gb, stride_gh, stride_gl,
    stride_xb, stride_xl, stride_xc,
    stride_vb, stride_vl, stride_vc,
    L, N, CH, TOKENS,
    H: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
    HAS_GRAD_V: tl.constexpr = False,
):  # fmt: skip
    """Program (g, k): tokens [g * TOKENS, (g + 1) * TOKENS) and channels [k * BLOCK_C, (k +
    1) * BLOCK_C). With dz = grad * A * sigmoid(logits): dx = dz W, written (N, CH) contiguous
    in its dtype; PARTS (G, H * CH + 2 * H) float32 holds each program's part of dW = dz^T x
    (H, CH) and, from the programs k = 0, of dc = sum dz and dA = sum grad * softplus(logits)
    (2, H), which the caller sums over G in one reduction.

    dW's products accumulate elementwise in a (BLOCK_T, BLOCK_H, BLOCK_C) register tile and
    are summed over the tokens once, at the program's end: f1d799b summed each head's
    products over the tile's tokens on every step, a cross-warp reduction per head per tile,
    and took 31 us at 8192 tokens on an H200 where the bandwidth allows ~4; the same sums as
    one product per step on the tensor cores (5d3b858: heads padded to 16, tf32x3 operands)
    were slower still. A sum over the tokens' axis of such a 3-D tile is right on the H200
    (`bench.glue --probe`), one over the heads' axis is not: dx = dz W stays one (BLOCK_T,
    BLOCK_C) update per head, unrolled (H is a constexpr), as in the forward.

    HAS_GRAD_V: GRAD_V (B, L, CH), the gradient of the values dt_bias_values handed on (the
    attention's dV), joins dx here: x's whole gradient in one store, no separate sum."""
    group = tl.program_id(0)
    chunk = tl.program_id(1)
    cc = chunk * BLOCK_C + tl.arange(0, BLOCK_C)
    hh = tl.arange(0, BLOCK_H)
    c_ok = cc < CH
    h_ok = hh < H
    a = tl.load(A + hh, mask=h_ok, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK_T, BLOCK_H, BLOCK_C), dtype=tl.float32)
    dc = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
    da = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
    start = group * TOKENS
    end = tl.minimum(start + TOKENS, N)
    for t0 in range(start, end, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        row_ok = t < end
        b = (t // L).to(tl.int64)
        pos = (t % L).to(tl.int64)
        grad_rows = GRAD + b * stride_gb + pos * stride_gl
        x_ok = row_ok[:, None] & c_ok[None, :]
        x = tl.load(X + (b * stride_xb + pos * stride_xl)[:, None] + cc[None, :] * stride_xc,
                    mask=x_ok, other=0.0).to(tl.float32)  # fmt: skip
        th_ok = row_ok[:, None] & h_ok[None, :]
        g2 = tl.load(grad_rows[:, None] + hh[None, :] * stride_gh, mask=th_ok,
                     other=0.0).to(tl.float32)  # fmt: skip
        z2 = tl.load(LOGITS + t[:, None] * H + hh[None, :], mask=th_ok, other=0.0)
        dz2 = g2 * a[None, :] * _sigmoid(z2)
        dw += dz2[:, :, None] * x[:, None, :]
        dc += dz2
        da += g2 * _softplus(z2)
        dx = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
        # Each head's dz again, from loads the cache holds: taking column j of dz2 would be a
        # sum over the heads' axis, the pattern Triton 3.6 gets wrong on sm_90.
        for j in tl.static_range(H):
            g = tl.load(grad_rows + j * stride_gh, mask=row_ok, other=0.0).to(tl.float32)
            z = tl.load(LOGITS + t * H + j, mask=row_ok, other=0.0)
            dz = g * tl.load(A + j).to(tl.float32) * _sigmoid(z)
            w = tl.load(W + j * CH + cc, mask=c_ok, other=0.0).to(tl.float32)
            dx += dz[:, None] * w[None, :]
        if HAS_GRAD_V:
            gv_rows = GRAD_V + b * stride_vb + pos * stride_vl
            gv = tl.load(gv_rows[:, None] + cc[None, :] * stride_vc, mask=x_ok, other=0.0)
            dx += gv.to(tl.float32)
        tl.store(DX + t[:, None] * CH + cc[None, :], dx.to(DX.dtype.element_ty), mask=x_ok)
    part = PARTS + group.to(tl.int64) * (H * CH + 2 * H)
    tl.store(part + hh[:, None] * CH + cc[None, :], tl.sum(dw, axis=0),
             mask=h_ok[:, None] & c_ok[None, :])  # fmt: skip
    if chunk == 0:
        tl.store(part + H * CH + hh, tl.sum(dc, axis=0), mask=h_ok)
        tl.store(part + H * CH + H + hh, tl.sum(da, axis=0), mask=h_ok)
