"""The DMA layer's learned bias and its gradients (dmattn_ops/dt_bias.py):

    logits[t, h] = x[t] . W[h] + c[h]                       t = b * L + l, a token
    out[b, h, 0, l] = A[h] * softplus(logits[t, h])

Both products run on the tensor cores, Hkv (4 in Doge) zero-padded to their smallest tile
side, 16: the padding costs nothing where a kernel is bound by reading x. Broadcast sums in
float32 registers (the kernels of f1d799b: x times each head's row of W, summed over the
channels, selected into the head's column) were right but took 32 us for the backward at
8192 tokens on an H200, 8x the bandwidth's time: a cross-warp reduction per head per tile.
(Inductor's kernels for the same sums, written as a reduction, ran 5-10x below the bandwidth.)
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
    L, N, CH,
    H: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """BLOCK_T tokens per program: out (B, H, 1, L) contiguous in its dtype, logits (N, H)
    float32 (kept for the backward). W (H, CH), C and A (H,) are float32 and contiguous.
    x is read once; the logits are one product on the tensor cores, x (BLOCK_T, BLOCK_C) by
    W^T (BLOCK_C, BLOCK_H), the heads zero-padded to BLOCK_H (16 at least, the instruction's
    smallest side), in float32 operands at PRECISION: "tf32x3" (each operand split into two
    tf32 parts, three products) where x is 16-bit, whose values the high part holds exactly,
    so only W's split rounds, at 2^-22; "ieee" (exact products) where x is float32."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.arange(0, BLOCK_C)
    hh = tl.arange(0, BLOCK_H)
    row_ok = t < N
    h_ok = hh < H
    b = (t // L).to(tl.int64)
    pos = (t % L).to(tl.int64)
    x_rows = X + b * stride_xb + pos * stride_xl
    acc = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
    for c0 in range(0, CH, BLOCK_C):
        cc = c0 + c
        c_ok = cc < CH
        x = tl.load(x_rows[:, None] + cc[None, :] * stride_xc,
                    mask=row_ok[:, None] & c_ok[None, :], other=0.0).to(tl.float32)  # fmt: skip
        w = tl.load(W + hh[None, :] * CH + cc[:, None], mask=c_ok[:, None] & h_ok[None, :],
                    other=0.0)  # fmt: skip
        acc = tl.dot(x, w, acc, input_precision=PRECISION)
    logits = acc + tl.load(C + hh, mask=h_ok, other=0.0)[None, :]
    out = tl.load(A + hh, mask=h_ok, other=0.0)[None, :] * _softplus(logits)
    ok = row_ok[:, None] & h_ok[None, :]
    tl.store(LOGITS + t[:, None] * H + hh[None, :], logits, mask=ok)
    tl.store(OUT + (b[:, None] * H + hh[None, :]) * L + pos[:, None],
             out.to(OUT.dtype.element_ty), mask=ok)  # fmt: skip


@triton.jit
def dt_bias_bwd_kernel(
    GRAD, X, W, A, LOGITS, DX, PART_W, PART_CA,
    stride_gb, stride_gh, stride_gl,
    stride_xb, stride_xl, stride_xc,
    L, N, CH, TOKENS,
    H: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """Program (g, k): tokens [g * TOKENS, (g + 1) * TOKENS) and channels [k * BLOCK_C, (k +
    1) * BLOCK_C). With dz = grad * A * sigmoid(logits), (BLOCK_T, BLOCK_H): dx = dz W, written
    (N, CH) contiguous in its dtype; the program's part of dW = dz^T x in PART_W (G, H, CH)
    float32; the programs k = 0 write their parts of dc = sum dz and dA = sum grad *
    softplus(logits) in PART_CA (G, 2, H). The caller sums the parts over G. Both products run
    on the tensor cores at PRECISION, as in the forward; padded heads and tokens past N load
    a zero gradient, so their dz is 0 and they add nothing."""
    group = tl.program_id(0)
    chunk = tl.program_id(1)
    cc = chunk * BLOCK_C + tl.arange(0, BLOCK_C)
    hh = tl.arange(0, BLOCK_H)
    c_ok = cc < CH
    h_ok = hh < H
    w = tl.load(W + hh[:, None] * CH + cc[None, :], mask=h_ok[:, None] & c_ok[None, :],
                other=0.0)  # fmt: skip
    a = tl.load(A + hh, mask=h_ok, other=0.0)
    dw = tl.zeros((BLOCK_H, BLOCK_C), dtype=tl.float32)
    dc = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
    da = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
    start = group * TOKENS
    end = tl.minimum(start + TOKENS, N)
    for t0 in range(start, end, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        row_ok = t < end
        b = (t // L).to(tl.int64)
        pos = (t % L).to(tl.int64)
        th_ok = row_ok[:, None] & h_ok[None, :]
        g = tl.load(GRAD + (b * stride_gb + pos * stride_gl)[:, None] + hh[None, :] * stride_gh,
                    mask=th_ok, other=0.0).to(tl.float32)  # fmt: skip
        z = tl.load(LOGITS + t[:, None] * H + hh[None, :], mask=th_ok, other=0.0)
        dz = g * a[None, :] * _sigmoid(z)
        x_ok = row_ok[:, None] & c_ok[None, :]
        x = tl.load(X + (b * stride_xb + pos * stride_xl)[:, None] + cc[None, :] * stride_xc,
                    mask=x_ok, other=0.0).to(tl.float32)  # fmt: skip
        dx = tl.dot(dz, w, input_precision=PRECISION)
        tl.store(DX + t[:, None] * CH + cc[None, :], dx.to(DX.dtype.element_ty), mask=x_ok)
        dw = tl.dot(tl.trans(dz), x, dw, input_precision=PRECISION)
        dc += dz
        da += g * _softplus(z)
    tl.store(PART_W + (group * H + hh[:, None]) * CH + cc[None, :], dw,
             mask=h_ok[:, None] & c_ok[None, :])  # fmt: skip
    if chunk == 0:
        tl.store(PART_CA + group * 2 * H + hh, tl.sum(dc, axis=0), mask=h_ok)
        tl.store(PART_CA + (group * 2 + 1) * H + hh, tl.sum(da, axis=0), mask=h_ok)
