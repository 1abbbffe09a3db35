"""FlexAttention path: the same function as `dmattn_ops.attention` through
`torch.nn.attention.flex_attention`, as a fallback backend and as a cross-check in tests.

Builders turn (mask, bias, is_causal, softcap, seqused_k) into a `mask_mod`, a `score_mod` and a
`BlockMask`:

* mask_mod(b, h, q, k) = k < n[b] and mask[b, h, q, k] and (not causal or k <= q + n[b] - Lq),
  reading the mask through its broadcast dims (B|1, H|Hkv|1, Lq|1) -- the mask is never
  expanded. Causal is bottom-right aligned, relative to seqused_k.
* score_mod(s, b, h, q, k) = cap(s) + bias[b, h, q, k], flex having already applied `scale`.
* GQA goes through `enable_gqa`.

Caching and recompiles: a BlockMask is built once per (mask tensor and its version, seqused_k
tensor and its version, is_causal, shapes) and reused while those tensors are alive and
unmodified (at most 16 are kept). On CUDA the compiled flex_attention recompiles for each new
combination of shapes, dtypes, broadcast pattern, causal/softcap/GQA flags and grad mode
(`dynamic=False`); reusing one configuration compiles once.

Limits, all raised as clear errors: FlexAttention has no backward on CPU (use backend="auto",
"triton" or "reference" to train there); its bias gradient is accumulated with atomics, so
`deterministic=True` with a bias that needs a gradient is refused; keys past seqused_k are
zeroed in a copy of K/V first, because flex multiplies masked probabilities (0) with V and
0 * NaN is NaN.
"""

from __future__ import annotations

import functools
import warnings
import weakref

import torch

from dmattn_ops.core.band import fold_causal
from dmattn_ops.core.operands import is_limit, mask_rows
from dmattn_ops.core.problem import Problem
from dmattn_ops.core.validate import (
    NO_WINDOW,
    check_backend,
    check_flags,
    check_problem,
    check_sinks,
    check_sinks_values,
    has_window,
)
from dmattn_ops.executors.chunked import add_sinks, varlen_bounds, zero_unseen_keys


class BlockMaskEntry:
    """A cached BlockMask, valid while its mask/seqused_k tensors are alive and unmodified."""

    def __init__(self, refs, versions, block_mask):
        self.refs = refs
        self.versions = versions
        self.block_mask = block_mask

    def valid_for(self, tensors) -> bool:
        for ref, t, version in zip(self.refs, tensors, self.versions):
            if t is None:
                if ref is not None:
                    return False
                continue
            if ref is None or ref() is not t or t._version != version:
                return False
        return True


_MAX_CACHED = 16
_block_masks: list[tuple[tuple, BlockMaskEntry]] = []


def _head_index(hi, t: torch.Tensor, h: int, hkv: int):
    if t.shape[1] == h:
        return hi
    return hi // (h // hkv) if t.shape[1] == hkv else 0


def make_mask_mod(
    mask, seqused_k, is_causal: bool, h: int, hkv: int, lq: int, lk: int, window=NO_WINDOW
):
    """mask_mod for flex: True where the key is allowed (README "Semantics")."""
    left, right = window
    limit = is_limit(mask)

    def mask_mod(b, hi, qi, kj):
        n = seqused_k[b] if seqused_k is not None else lk
        ok = kj < n
        pos = qi + (n - lq)
        if is_causal:
            ok = ok & (kj <= pos)
        if left >= 0:
            ok = ok & (kj >= pos - left)
        if right >= 0:
            ok = ok & (kj <= pos + right)
        if mask is not None:
            bm = b if mask.shape[0] > 1 else 0
            if limit:  # a row-limit mask: key kj is seen by rows qi < its limit
                ok = ok & (qi < mask[bm, _head_index(hi, mask, h, hkv), 0, kj])
            else:
                qm = qi if mask.shape[2] > 1 else 0
                ok = ok & mask[bm, _head_index(hi, mask, h, hkv), qm, kj]
        return ok

    return mask_mod


def make_score_mod(bias, softcap: float, h: int, hkv: int, shift=None):
    """score_mod for flex: cap(score) + bias [- shift[b, h, q]], or None when there is nothing
    to add. shift (B|1, H, Lq) moves a row whose allowed biases all lie near finfo.min back
    into range (see row_shift)."""
    if bias is None and softcap <= 0:
        return None

    def score_mod(score, b, hi, qi, kj):
        if softcap > 0:
            score = softcap * torch.tanh(score / softcap)
        if bias is not None:
            bb = b if bias.shape[0] > 1 else 0
            qb = qi if bias.shape[2] > 1 else 0
            score = score + bias[bb, _head_index(hi, bias, h, hkv), qb, kj]
        if shift is not None:
            score = score - shift[b if shift.shape[0] > 1 else 0, hi, qi]
        return score

    return score_mod


# FlexAttention keeps its running max and lse in log2 units: a logit below about -2.4e38
# (finfo(float32).min * log2(e) overflows) becomes -inf there, and a row whose allowed logits all
# lie that low gets lse -inf (its output stays right). Such logits come from biases near
# finfo.min; shifting each such row by its largest allowed bias (softmax is shift-invariant)
# brings it back into range, and the shift is added back to lse.
_SHIFT_BELOW = -1e37


def row_shift(mask, bias, seqused_k, is_causal, b, h, hkv, lq, lk, window=NO_WINDOW):
    """(B|1, H, Lq) float32: the largest bias each row may see where it lies below -1e37, else
    0 (rows untouched), computed on the bias's own broadcast shape."""
    dev = bias.device
    n = seqused_k.long() if seqused_k is not None else torch.full((1,), lk, device=dev)
    j = torch.arange(lk, device=dev)
    allowed = (j[None, :] < n[:, None])[:, None, None, :]  # [B|1, 1, 1, Lk]
    # A row-limit mask with a bias per key: each key's rows form one interval (_limit_max),
    # never an Lq x Lk tensor.
    limits = mask is not None and is_limit(mask) and bias.shape[2] == 1
    if mask is not None and not limits:
        allowed = allowed & _per_head(mask_rows(mask, 0, lq), h, hkv)
    x = torch.where(allowed, _per_head(bias, h, hkv).float(), float("-inf"))
    if limits:
        best = _limit_max(x, _per_head(mask, h, hkv), n, lq, is_causal, window)
    elif has_window(window):
        best = _band_max(x, n, lq, lk, h, is_causal, window)
    elif is_causal:
        i = torch.arange(lq, device=dev)
        last = (i[None, :] + (n - lq)[:, None]).clamp(-1, lk - 1)  # [B|1, Lq]: last key seen
        running = x.cummax(dim=-1).values  # max over keys 0..j
        running = running.expand(*running.shape[:2], lq, lk)
        idx = last.clamp(min=0)[:, None, :, None].expand(running.shape[0], h, lq, 1)
        best = running.expand(idx.shape[0], h, lq, lk).gather(-1, idx).squeeze(-1)
        best = torch.where(last[:, None, :] >= 0, best, float("-inf"))
    else:
        best = x.amax(dim=-1).expand(-1, h, lq)
    return torch.where((best < _SHIFT_BELOW) & best.isfinite(), best, 0.0).contiguous()


def _limit_max(x, limit, n, lq: int, is_causal: bool, window) -> torch.Tensor:
    """Max of x (B|1, H, 1, Lk) over the keys each row sees under the row-limit mask `limit`
    (B|1, H, 1, Lk), causality and the window, as (B|1, H, Lq), in O(Lk log Lq).

    Key j is seen by the rows i of one interval [lo_j, hi_j): i < limit_j, and with p = i + n
    - Lq, p >= j - right (causal: right 0) and p <= j + left. Each interval updates a sparse
    table (level k holds maxima over 2**k rows) at the two level-k blocks that cover it
    exactly, k = floor(log2(hi - lo)); pushing every level down into the one below then leaves
    each row's maximum in level 0."""
    left, right = fold_causal(is_causal, window)
    bx = max(x.shape[0], limit.shape[0], n.shape[0])
    heads, lk = x.shape[1], x.shape[-1]
    x = x.expand(bx, heads, 1, lk).reshape(-1, lk)
    limit = limit.expand(bx, heads, 1, lk).reshape(-1, lk).to(torch.int64)
    j = torch.arange(lk, device=x.device)
    off = (n - lq).expand(bx).repeat_interleave(heads)[:, None]  # p - i, per row of x
    lo = (j - right - off).clamp(min=0) if right >= 0 else torch.zeros_like(limit)
    hi = limit.clamp(max=lq)
    if left >= 0:
        hi = torch.minimum(hi, j + left - off + 1)
    used = (hi > lo) & (x != float("-inf"))  # NaN stays in, as in every other branch
    size = torch.where(used, hi - lo, 1)
    level = torch.frexp(size.double()).exponent.to(torch.int64) - 1  # floor(log2(size))
    levels = max(1, lq.bit_length())
    width = lq + 1  # column lq takes the unused keys' updates
    first = torch.where(used, level * width + lo, lq)
    second = torch.where(used, level * width + hi - 2**level, lq)
    table = x.new_full((x.shape[0], levels * width), float("-inf"))
    table.scatter_reduce_(-1, torch.cat([first, second], -1), torch.cat([x, x], -1), "amax")
    table = table.view(-1, levels, width)
    for k in range(levels - 1, 0, -1):
        half = 1 << (k - 1)
        block = table[:, k, :lq]
        below = table[:, k - 1]
        below[:, :lq] = torch.maximum(below[:, :lq], block)
        below[:, half:lq] = torch.maximum(below[:, half:lq], block[:, : lq - half])
    return table[:, 0, :lq].reshape(bx, heads, lq)


def _band_max(x, n, lq: int, lk: int, h: int, is_causal: bool, window) -> torch.Tensor:
    """Max of x (B|1, H, Lq|1, Lk) over each row's band [p - left, p + right] (p = i + n - Lq;
    causal caps right at 0), as (B|1, H, Lq). Biases per key (Lq dim 1) take running maxima
    (one side bounded) or a max-pool of the band's width, never an Lq x Lk tensor."""
    left, right = fold_causal(is_causal, window)
    i = torch.arange(lq, device=x.device)
    pos = i[None, :] + (n - lq)[:, None]  # [B|1, Lq]
    lo = pos - left if left >= 0 else torch.zeros_like(pos)
    hi = pos + right if right >= 0 else torch.full_like(pos, lk - 1)
    empty = (lo > hi) | (hi < 0) | (lo > lk - 1)
    lo, hi = lo.clamp(0, lk - 1), hi.clamp(0, lk - 1)
    rows = x.shape[0], h, lq
    if x.shape[2] > 1:
        j = torch.arange(lk, device=x.device)
        band = (j >= lo[..., None]) & (j <= hi[..., None])  # [B|1, Lq, Lk]
        best = torch.where(band[:, None], x, float("-inf")).amax(dim=-1)
    else:
        xk = x[:, :, 0, :].expand(x.shape[0], h, lk)  # [B|1, H, Lk]
        if left < 0:  # [0, hi]
            table, idx = xk.cummax(dim=-1).values, hi
        elif right < 0:  # [lo, Lk - 1]
            table, idx = xk.flip(-1).cummax(dim=-1).values.flip(-1), lo
        else:  # [lo, lo + width - 1], clipped at Lk - 1
            width = min(left + right + 1, lk)
            padded = torch.nn.functional.pad(xk, (0, width - 1), value=float("-inf"))
            table, idx = torch.nn.functional.max_pool1d(padded, width, stride=1), lo
        best = table.gather(-1, idx[:, None, :].expand(rows[0], h, lq).contiguous())
        if left >= 0 and right >= 0:
            # A band clipped at key 0 has fewer than `width` keys: [0, hi], a running max.
            clipped = (pos - left < 0)[:, None, :].expand_as(best)
            head = xk.cummax(dim=-1).values.gather(
                -1, hi[:, None, :].expand(rows[0], h, lq).contiguous()
            )
            best = torch.where(clipped, head, best)
    return torch.where(empty[:, None, :], float("-inf"), best)


def _per_head(t, h: int, hkv: int):
    """(B|1, H|Hkv|1, Lq|1, Lk) -> (B|1, H, Lq|1, Lk), a view where it can be."""
    if t.shape[1] == hkv and hkv != h:
        return t.repeat_interleave(h // hkv, dim=1)
    return t.expand(t.shape[0], h, *t.shape[2:])


def block_mask_for(mask, seqused_k, is_causal, b, h, hkv, lq, lk, device, window=NO_WINDOW):
    """The cached BlockMask of this mask/seqused_k/causal/window combination (None if nothing
    masks)."""
    from torch.nn.attention.flex_attention import create_block_mask

    if mask is None and seqused_k is None and not (is_causal and lq > 0) and not has_window(window):
        return None
    batch = b if (seqused_k is not None or (mask is not None and mask.shape[0] > 1)) else 1
    heads = h if (mask is not None and mask.shape[1] > 1) else 1
    mask_mod = make_mask_mod(mask, seqused_k, is_causal, h, hkv, lq, lk, window)
    if torch.compiler.is_compiling():
        # Inside a compiled model: traced inline, no cache (tensor identities and versions are
        # not traceable) and no nested compiled callable.
        return create_block_mask(mask_mod, batch, heads, lq, lk, device=device)
    key = (b, h, hkv, lq, lk, bool(is_causal), tuple(window), str(device))
    tensors = (mask, seqused_k)
    for k, entry in _block_masks:
        if k == key and entry.valid_for(tensors):
            return entry.block_mask
    build = create_block_mask
    if device.type == "cuda":
        build = _compiled_create_block_mask()
    block_mask = build(mask_mod, batch, heads, lq, lk, device=device)
    refs = tuple(weakref.ref(t) if t is not None else None for t in tensors)
    versions = tuple(t._version if t is not None else None for t in tensors)
    _block_masks.insert(0, (key, BlockMaskEntry(refs, versions, block_mask)))
    del _block_masks[_MAX_CACHED:]
    return block_mask


@functools.cache
def _compiled_create_block_mask():
    from torch.nn.attention.flex_attention import create_block_mask

    # Static shapes: with symbolic lengths, `n - Lq` mixes a SymInt into vmapped tensors.
    return torch.compile(create_block_mask, dynamic=False)


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


_COMPILE_ERRORS = (torch._inductor.exc.InductorError, torch._dynamo.exc.BackendCompilerFailed)


def _eager_flex(q, k, v, kwargs):
    """flex_attention outside torch.compile. torch 2.15 runs it through a dynamic compile of
    its own with an eager backend, which lifts a float the score_mod closes over (softcap) as a
    SymFloat, and the flex op then refuses it ("can only be of (Tensor, int, SymInt)"): floats
    are specialised there (each softcap a constant, as in torch 2.11-2.14)."""
    from torch.nn.attention.flex_attention import flex_attention

    with warnings.catch_warnings(), torch._dynamo.config.patch(specialize_float=True):
        warnings.filterwarnings("ignore", message="flex_attention called without torch")
        return flex_attention(q, k, v, **kwargs)


def run_compiled(q, k, v, options, kwargs):
    """Compiled flex with our kernel options, then with flex's defaults, then eager flex.

    On an H100 with torch 2.11, compiled flex finds no kernel at all for some fp32 inputs
    (D=16 with a 4-D bias at Lq = 33 or 40: NoValidChoicesError, whatever the options). The
    eager path computes the same function, unfused (it materialises the scores); we warn.
    """
    with torch._dynamo.config.patch(recompile_limit=64):
        for opts in (options, None) if options is not None else (None,):
            try:
                return _compiled_flex()(q, k, v, kernel_options=opts, **kwargs)
            except _COMPILE_ERRORS as e:
                error = e
    warnings.warn(
        "dmattn.flex: compiled FlexAttention could not build a kernel for these inputs "
        f"({type(error).__name__}: {str(error).splitlines()[0][:160]}); running it eagerly "
        "(unfused, O(Lq * Lk) memory)",
        stacklevel=3,
    )
    return _eager_flex(q, k, v, kwargs)


# Inductor's CPU flex template computes q @ k^T with a micro-GEMM whose transposed-B kernel
# mishandles a tail of keys: when the head dim K is a multiple of the fp32 vector width and
# below 24 (K = 8 or 16 on AVX2; 16 on AVX-512; 4..20 in steps of 4 for float64), a tail of N
# keys that is itself a multiple of the vector width (Lk % 16 == 8 on AVX2) runs the full
# 16-wide block, reading keys past Lk and writing past the row (torch 2.13: cpp_micro_gemm.py,
# CppMicroGemmFP32Vec, "First implementation" of the ntail transpose_b kernel). The result is
# wrong or NaN, differently on each run. Zero columns appended to q and k leave every q . k
# exact and put K out of that branch's reach. Minimal repro: torch.compile(flex_attention) on
# (1, 1, 40, 16) float32 q, k, v on an AVX2 CPU gives an error of ~0.5 or NaN.
CPU_FLEX_MIN_HEAD_DIM = 24


def _pad_head_dim_for_cpu(q, k, kwargs):
    d = q.shape[-1]
    if q.device.type != "cpu" or d >= CPU_FLEX_MIN_HEAD_DIM:
        return q, k, kwargs
    pad = (0, CPU_FLEX_MIN_HEAD_DIM - d)
    scale = kwargs["scale"]
    kwargs = {**kwargs, "scale": d**-0.5 if scale is None else scale}
    return torch.nn.functional.pad(q, pad), torch.nn.functional.pad(k, pad), kwargs


def _flex_call(q, k, v, score_mod, block_mask, scale, return_lse, bias):
    """flex_attention of (B, H, L, D) q, k, v (GQA where k has fewer heads) with the kernel
    options flex_kernel_options picks for `bias` (the tensor its score_mod reads per query row,
    or None)."""
    kwargs = dict(
        score_mod=score_mod,
        block_mask=block_mask,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
        **_lse_request(return_lse),
    )
    options = flex_kernel_options(bias, max(q.shape[-1], v.shape[-1]), q.device)
    result = _flex(q, k, v, options, kwargs)
    if "return_aux" in kwargs:  # (out, AuxOutput): its lse
        return result[0], result[1].lse
    return result


def _lse_request(want: bool) -> dict:
    """flex_attention's keyword asking for lse, where `want`: return_aux=AuxRequest(lse=True)
    on a torch that has it (return_lse=True is deprecated there: a FutureWarning on every call,
    and announced for removal), else return_lse=True."""
    if not want:
        return {}
    from torch.nn.attention import flex_attention as flex_module

    request = getattr(flex_module, "AuxRequest", None)
    return {"return_aux": request(lse=True)} if request is not None else {"return_lse": True}


def _flex(q, k, v, options, kwargs):
    """flex_attention as each context needs it: traced inline inside torch.compile (a compiled
    callable cannot be called there), compiled on CUDA, compiled on CPU (eager when lse is
    asked for or the inputs are float64: compiled CPU flex takes neither). On CPU, q and k
    get zero columns up to `CPU_FLEX_MIN_HEAD_DIM` (see there)."""
    device = q.device
    q, k, kwargs = _pad_head_dim_for_cpu(q, k, kwargs)
    if torch.compiler.is_compiling():
        from torch.nn.attention.flex_attention import flex_attention

        # On CPU, Inductor's flex template rejects q/k/v that are views of a 2-D buffer (a
        # projection's output): "not enough values to unpack (expected 4, got 2)" from
        # cpp_flex_attention_template.py choose_flex_template, and mask/bias tensors computed
        # inside the graph (NoValidChoicesError; cf. pytorch#175545). Both fail loudly at
        # compile time; README "Backends" says what compiles on CPU.
        return flex_attention(q, k, v, kernel_options=options, **kwargs)
    if device.type == "cuda":
        return run_compiled(q, k, v, options, kwargs)
    if "return_aux" in kwargs or kwargs.get("return_lse") or q.dtype == torch.float64:
        # Inductor's CPU flex template takes neither lse nor float64; eager flex does.
        return _eager_flex(q, k, v, kwargs)
    return _compiled_flex()(q, k, v, **kwargs)


def flex_kernel_options(bias, d: int, device) -> dict | None:
    """Flex kernel options that compile on an H100: with a bias read per query row, flex's
    default backward asks for more shared memory than Hopper has; one stage fits."""
    if device.type != "cuda":
        return None
    options = {}
    if bias is not None and bias.shape[2] > 1:
        options["num_stages"] = 1
    if d > 128:
        options.update(BLOCK_M=32, BLOCK_N=32, num_stages=1)
    return options or None


def _check_trainable(problem: Problem, deterministic: bool, fn: str) -> None:
    """What FlexAttention cannot differentiate: any call on CPU, and a deterministic bias
    gradient (it sums it with atomics). Checked where a gradient is wanted."""
    bias = problem.bias
    operands = (problem.query, problem.key, problem.value, bias)
    if not torch.is_grad_enabled() or not any(t is not None and t.requires_grad for t in operands):
        return
    if problem.query.device.type != "cuda":
        raise RuntimeError(
            f"{fn}: FlexAttention has no backward on CPU; use backend='auto' (or 'triton' with "
            "TRITON_INTERPRET=1, or 'reference') to train on CPU"
        )
    if deterministic and bias is not None and bias.requires_grad:
        raise ValueError(
            f"{fn}: FlexAttention accumulates the bias gradient with atomics, so it cannot be "
            "deterministic; use backend='triton' for deterministic=True"
        )


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    softcap: float = 0.0,
    seqused_k: torch.Tensor | None = None,
    deterministic: bool = False,
    return_lse: bool = False,
    backend: str = "flex",
    sinks: torch.Tensor | None = None,
    window_size: tuple[int, int] = NO_WINDOW,
    kernel_options=None,
):
    """`dmattn_ops.attention` through FlexAttention (same signature, shapes and semantics;
    sinks join Flex's (out, lse) in PyTorch, chunked.add_sinks; kernel_options choose among
    this library's kernels, so any raises here;
    ``backend`` keeps the signature: this function is the "flex" backend whatever its value,
    and an unknown name raises as there).

    Compiled flex on CUDA (forward and backward, including the bias gradient); on CPU the
    forward runs compiled, or eager when lse is asked for (compiled CPU flex cannot return it),
    and there is no backward. See the module docstring for caching, recompiles and limits.
    """

    check_backend(backend, "dmattn.flex")
    check_flags(
        "dmattn.flex", is_causal=is_causal, deterministic=deterministic, return_lse=return_lse
    )
    if kernel_options is not None:
        raise ValueError(
            "dmattn.flex: kernel_options choose among this library's kernels (backend 'auto' "
            "or 'triton'); FlexAttention runs none of them"
        )
    if sinks is not None:
        check_sinks(sinks, query, "dmattn.flex")
        check_sinks_values(sinks, "dmattn.flex")
        out, lse = attention(
            query, key, value, mask, bias, scale=scale, is_causal=is_causal, softcap=softcap,
            seqused_k=seqused_k, deterministic=deterministic, return_lse=True,
            window_size=window_size,
        )  # fmt: skip
        out, lse = add_sinks(out, lse, sinks)
        return (out, lse.float()) if return_lse else out
    problem = Problem(query, key, value, mask, bias, seqused_k=seqused_k)
    window = check_problem(problem, scale, softcap, window_size, "dmattn.flex")
    b, lq, h, d = query.shape
    lk, hkv = key.shape[1], key.shape[2]
    _check_trainable(problem, deterministic, "dmattn.flex")
    device = query.device
    if b * lq * h == 0 or lk == 0 or d == 0:
        # Flex has nothing to launch (or, for D = 0, cannot): the registered op computes it.
        out, lse, _ = torch.ops.dmattn.attention_forward(
            query, key, value, mask, bias, (d**-0.5 if d > 0 else 1.0) if scale is None else scale,
            is_causal, softcap, seqused_k, deterministic, window,
        )  # fmt: skip
        return (out, lse.float()) if return_lse else out
    if seqused_k is not None:
        j = torch.arange(lk, device=device)
        used = (j[None, :] < seqused_k[:, None].to(torch.int64))[:, :, None, None]
        key = torch.where(used, key, 0)
        value = torch.where(used, value, 0)
    # flex multiplies whole blocks of keys too (0 * NaN is NaN).
    key, value = zero_unseen_keys(key, value, mask)

    block_mask = block_mask_for(mask, seqused_k, is_causal, b, h, hkv, lq, lk, device, window)
    shift = None
    if return_lse and bias is not None:
        shift = row_shift(mask, bias, seqused_k, is_causal, b, h, hkv, lq, lk, window)
    score_mod = make_score_mod(bias, softcap, h, hkv, shift)
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    result = _flex_call(q, k, v, score_mod, block_mask, scale, return_lse, bias)
    if return_lse:
        out, lse = result
        lse = lse.float() if shift is None else lse.float() + shift.expand(b, h, lq)
        return out.transpose(1, 2), lse
    return result.transpose(1, 2)


def _varlen_layout(cu, total: int):
    """Per packed row: its sequence (B past the last one) and its index within the sequence;
    per sequence (padded with one empty entry for the rows past the last): its length."""
    start, end = varlen_bounds(cu, total)
    rows = torch.arange(total, device=cu.device)
    seq = torch.searchsorted(end, rows, right=True)
    starts = torch.cat([start, end[-1:] if end.numel() else start.new_zeros(1)])
    lengths = torch.cat([end - start, start.new_zeros(1)])
    return seq, rows - starts[seq], lengths


def make_varlen_mask_mod(mask, cu_q, cu_k, total_q, total_k, is_causal, h, hkv, window=NO_WINDOW):
    """Document mask_mod over packed rows: query and key in the same sequence, the key allowed
    by the per-key-token mask, and causal and the window bottom-right within the sequence."""
    left, right = window
    q_seq, q_pos, q_len = _varlen_layout(cu_q, total_q)
    k_seq, k_pos, k_len = _varlen_layout(cu_k, total_k)
    n_sequences = cu_q.shape[0] - 1

    def mask_mod(b, hi, qi, kj):
        s = q_seq[qi]
        ok = (s == k_seq[kj]) & (s < n_sequences)
        pos = q_pos[qi] + (k_len[s] - q_len[s])
        if is_causal:
            ok = ok & (k_pos[kj] <= pos)
        if left >= 0:
            ok = ok & (k_pos[kj] >= pos - left)
        if right >= 0:
            ok = ok & (k_pos[kj] <= pos + right)
        if mask is not None:
            ok = ok & mask[_head_index(hi, mask[None], h, hkv), kj]
        return ok

    return mask_mod, k_seq < n_sequences


def make_varlen_score_mod(bias, softcap: float, h: int, hkv: int):
    """score_mod for a per-key-token bias (H|Hkv|1, total_k): make_score_mod's, the packed
    sequences being one batch row whose bias every query shares, (1, H|Hkv|1, 1, total_k)."""
    return make_score_mod(None if bias is None else bias[None, :, None, :], softcap, h, hkv)


def attention_varlen(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    mask: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    softcap: float = 0.0,
    deterministic: bool = False,
    return_lse: bool = False,
    backend: str = "flex",
    window_size: tuple[int, int] = NO_WINDOW,
):
    """`dmattn_ops.attention_varlen` through FlexAttention: the packed batch is one flex batch
    with a document mask_mod (query and key in the same sequence). Limits as in `attention`;
    besides, its BlockMask is rebuilt on every call (cu_seqlens change from batch to batch) and
    covers total_q x total_k, where the Triton kernels only visit each sequence's own tiles."""
    fn = "dmattn.flex.attention_varlen"
    check_backend(backend, fn)
    check_flags(fn, is_causal=is_causal, deterministic=deterministic, return_lse=return_lse)
    problem = Problem(
        query, key, value, mask, bias, None, None, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
        max_seqlen_k,
    )  # fmt: skip
    window = check_problem(problem, scale, softcap, window_size, fn)
    total_q, h, d = query.shape
    total_k, hkv = key.shape[0], key.shape[1]
    _check_trainable(problem, deterministic, fn)
    device = query.device
    if total_q * h == 0 or total_k == 0 or cu_seqlens_q.shape[0] < 2 or d == 0:
        out, lse, _ = torch.ops.dmattn.attention_varlen_forward(
            query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, mask,
            bias, (d**-0.5 if d > 0 else 1.0) if scale is None else scale, is_causal, softcap,
            deterministic, window,
        )  # fmt: skip
        return (out, lse.float()) if return_lse else out
    from torch.nn.attention.flex_attention import create_block_mask

    mask_mod, key_used = make_varlen_mask_mod(
        mask, cu_seqlens_q, cu_seqlens_k, total_q, total_k, is_causal, h, hkv, window
    )
    # Rows past the last sequence may hold NaN: flex would multiply them by 0.
    key = torch.where(key_used[:, None, None], key, 0)
    value = torch.where(key_used[:, None, None], value, 0)
    if mask is not None:  # and keys no query may see (a per-key-token mask)
        key, value = (t[0] for t in zero_unseen_keys(key[None], value[None], mask[None, :, None]))
    build = create_block_mask
    if device.type == "cuda" and not torch.compiler.is_compiling():
        build = _compiled_create_block_mask()
    block_mask = build(mask_mod, 1, 1, total_q, total_k, device=device)
    q, k, v = (t.transpose(0, 1)[None] for t in (query, key, value))
    score_mod = make_varlen_score_mod(bias, softcap, h, hkv)
    result = _flex_call(q, k, v, score_mod, block_mask, scale, return_lse, None)
    if return_lse:
        out, lse = result
        return out[0].transpose(0, 1), lse[0].float()
    return result[0].transpose(0, 1)
