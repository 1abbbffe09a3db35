"""The DMA layer's learned bias and its gradients (dmattn_ops/dt_bias.py):

    logits[t, h] = x[t] . W[h] + c[h]                       t = b * L + l, a token
    out[b, h, 0, l] = A[h] * softplus(logits[t, h])

Hkv (4 in Doge) is far below a tensor core's tile, so the products are broadcast sums in
float32 registers: both kernels read x once and are bound by memory. (Inductor's kernels for
the same sums, written as a reduction, ran 5-10x below the bandwidth on an H200: NOTES 152.)
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
    X, W, C, A, OUT, LOGITS,
    stride_xb, stride_xl, stride_xc,
    L, N, CH, H,
    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    """BLOCK_T tokens per program: out (B, H, 1, L) contiguous in its dtype, logits (N, H)
    float32 (kept for the backward). W (H, CH), C and A (H,) are float32 and contiguous."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.arange(0, BLOCK_H)
    c = tl.arange(0, BLOCK_C)
    row_ok = t < N
    h_ok = h < H
    b = (t // L).to(tl.int64)
    pos = (t % L).to(tl.int64)
    x_rows = X + b * stride_xb + pos * stride_xl
    acc = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
    for c0 in range(0, CH, BLOCK_C):
        cc = c0 + c
        c_ok = cc < CH
        x = tl.load(x_rows[:, None] + cc[None, :] * stride_xc,
                    mask=row_ok[:, None] & c_ok[None, :], other=0.0).to(tl.float32)  # fmt: skip
        w = tl.load(W + h[:, None] * CH + cc[None, :], mask=h_ok[:, None] & c_ok[None, :],
                    other=0.0)  # fmt: skip
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    logits = acc + tl.load(C + h, mask=h_ok, other=0.0)[None, :]
    out = tl.load(A + h, mask=h_ok, other=0.0)[None, :] * _softplus(logits)
    ok = row_ok[:, None] & h_ok[None, :]
    tl.store(LOGITS + t[:, None] * H + h[None, :], logits, mask=ok)
    tl.store(OUT + (b[:, None] * H + h[None, :]) * L + pos[:, None],
             out.to(OUT.dtype.element_ty), mask=ok)  # fmt: skip


@triton.jit
def dt_bias_bwd_kernel(
    GRAD, X, W, A, LOGITS, DX, PART_W, PART_CA,
    stride_gb, stride_gh, stride_gl,
    stride_xb, stride_xl, stride_xc,
    L, N, CH, H, TOKENS,
    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    """Program (g, j): tokens [g * TOKENS, (g + 1) * TOKENS) and channels [j * BLOCK_C, (j +
    1) * BLOCK_C). With dz = grad * A * sigmoid(logits): dx = dz W, written (N, CH) contiguous
    in its dtype; the program's part of dW = dz^T x in PART_W (G, H, CH) float32; the
    programs j = 0 write their parts of dc = sum dz and dA = sum grad * softplus(logits) in
    PART_CA (G, 2, H). The caller sums the parts over G."""
    group = tl.program_id(0)
    chunk = tl.program_id(1)
    h = tl.arange(0, BLOCK_H)
    cc = chunk * BLOCK_C + tl.arange(0, BLOCK_C)
    h_ok = h < H
    c_ok = cc < CH
    w = tl.load(W + h[:, None] * CH + cc[None, :], mask=h_ok[:, None] & c_ok[None, :], other=0.0)
    a = tl.load(A + h, mask=h_ok, other=0.0)
    dw = tl.zeros((BLOCK_H, BLOCK_C), dtype=tl.float32)
    dc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    da = tl.zeros((BLOCK_H,), dtype=tl.float32)
    start = group * TOKENS
    end = tl.minimum(start + TOKENS, N)
    for t0 in range(start, end, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        row_ok = t < end
        b = (t // L).to(tl.int64)
        pos = (t % L).to(tl.int64)
        ok = row_ok[:, None] & h_ok[None, :]
        g = tl.load(GRAD + b[:, None] * stride_gb + h[None, :] * stride_gh
                    + pos[:, None] * stride_gl, mask=ok, other=0.0).to(tl.float32)  # fmt: skip
        z = tl.load(LOGITS + t[:, None] * H + h[None, :], mask=ok, other=0.0)
        dz = g * a[None, :] * _sigmoid(z)
        x_ok = row_ok[:, None] & c_ok[None, :]
        x = tl.load(X + (b * stride_xb + pos * stride_xl)[:, None] + cc[None, :] * stride_xc,
                    mask=x_ok, other=0.0).to(tl.float32)  # fmt: skip
        dx = tl.sum(dz[:, :, None] * w[None, :, :], axis=1)
        tl.store(DX + t[:, None] * CH + cc[None, :], dx.to(DX.dtype.element_ty), mask=x_ok)
        dw += tl.sum(dz[:, :, None] * x[:, None, :], axis=0)
        dc += tl.sum(dz, axis=0)
        da += tl.sum(g * _softplus(z), axis=0)
    tl.store(PART_W + (group * H + h[:, None]) * CH + cc[None, :], dw,
             mask=h_ok[:, None] & c_ok[None, :])  # fmt: skip
    if chunk == 0:
        tl.store(PART_CA + group * 2 * H + h, dc, mask=h_ok)
        tl.store(PART_CA + (group * 2 + 1) * H + h, da, mask=h_ok)
