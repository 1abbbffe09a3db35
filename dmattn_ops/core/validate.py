"""Input checks shared by the public functions and the registered ops.

Every check here looks at shapes, dtypes and devices only, so it runs unchanged on fake tensors
while torch.compile traces; `check_seqused_k_values` and `check_cu_seqlens_values` read data and
are skipped where it cannot be read (`data_readable`).
"""

from __future__ import annotations

import math

import torch
from torch.utils.weak import WeakTensorKeyDictionary

from dmattn_ops.core._compat import FakeTensor, FunctionalTensor, functorch
from dmattn_ops.core.problem import Problem

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
MAX_HEAD_DIM = 256
BACKENDS = ("auto", "triton", "flex", "reference")


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def _check_tensor(name: str, t, fn: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")


def check_broadcast_operand(
    name: str, t: torch.Tensor, full: tuple[int, int, int, int], hkv: int, fn: str
) -> None:
    """A mask or bias of shape (B|1, H|Hkv|1, Lq|1, Lk) against full = (B, H, Lq, Lk)."""
    b, h, lq, lk = full

    def expected() -> str:  # built only when raising: formatting a SymInt specializes it
        return f"(B|1, H|Hkv|1, Lq|1, Lk) with B={b}, H={h}, Hkv={hkv}, Lq={lq}, Lk={lk}"

    if t.dim() != 4:
        raise ValueError(f"{fn}: {name} must be 4-D {expected()}; got shape {_shape(t)}")
    tb, th, tq, tk = t.shape
    # Explicit == rather than `in (...)`: dynamo evaluates `symint in tuple` as False.
    ok = (tb == b or tb == 1) and (th == h or th == hkv or th == 1) and (tq == lq or tq == 1)  # noqa: SIM109
    if not ok or tk != lk:
        raise ValueError(
            f"{fn}: {name} of shape {_shape(t)} does not broadcast to the scores; "
            f"expected {expected()}"
        )


def _check_qkv(problem: Problem, rows: tuple[str, str], fn: str) -> None:
    """query, key and value are tensors of one rank, (rows..., heads, head dim): rows ("B, Lq",
    "B, Lk") for a batched call, ("total_q", "total_k") for a packed one; then the operands'
    dtypes and devices."""
    query, key, value = problem.query, problem.key, problem.value
    for name, t in (("query", query), ("key", key), ("value", value)):
        _check_tensor(name, t, fn)
    rank = 2 + len(rows[0].split(","))
    layouts = ((query, "query", rows[0], "H, D"), (key, "key", rows[1], "Hkv, D"),
               (value, "value", rows[1], "Hkv, Dv"))  # fmt: skip
    for t, name, t_rows, tail in layouts:
        if t.dim() != rank:
            raise ValueError(
                f"{fn}: {name} must be {rank}-D ({t_rows}, {tail}); got shape {_shape(t)}"
            )
    _check_dtypes_devices(problem, fn)


def check_inputs(problem: Problem, scale=None, softcap=0.0, fn: str = "dmattn.attention") -> None:
    """Raise TypeError/ValueError for any dense or seqused_k call that breaks the contract
    (README "Semantics"): the shapes, dtypes and devices of the problem's query, key, value,
    mask, bias and seqused_k (not its sinks: check_sinks), and the scalars."""
    _check_qkv(problem, ("B, Lq", "B, Lk"), fn)
    query, key, value = problem.query, problem.key, problem.value
    mask, bias, seqused_k = problem.mask, problem.bias, problem.seqused_k
    b, lq, h, d = query.shape
    bk, lk, hkv, dk = key.shape
    bv, lkv, hv, dv = value.shape
    if bk != b or dk != d:
        raise ValueError(
            f"{fn}: key must have shape (B, Lk, Hkv, D) = ({b}, Lk, Hkv, {d}) to match query "
            f"{_shape(query)}; got {_shape(key)}"
        )
    if bv != b or lkv != lk or hv != hkv:
        raise ValueError(
            f"{fn}: value must have shape (B, Lk, Hkv, Dv) = ({b}, {lk}, {hkv}, Dv) to match key "
            f"{_shape(key)}; got {_shape(value)}"
        )
    _check_heads(query, key, h, hkv, d, dv, fn)
    full = (b, h, lq, lk)
    if mask is not None:
        _check_tensor("mask", mask, fn)
        if mask.dtype not in (torch.bool, torch.int32):
            raise TypeError(
                f"{fn}: mask must be a bool tensor, or an int32 row-limit mask; got {mask.dtype}"
            )
        check_broadcast_operand("mask", mask, full, hkv, fn)
        if mask.dtype == torch.int32 and mask.dim() == 4 and mask.shape[2] != 1:
            raise ValueError(
                f"{fn}: a row-limit mask (int32) holds one limit per key: shape (B|1, H|Hkv|1, "
                f"1, Lk); got {_shape(mask)}"
            )
    if bias is not None:
        _check_tensor("bias", bias, fn)
        if bias.dtype not in (query.dtype, torch.float32):
            raise TypeError(
                f"{fn}: bias dtype must be query's ({query.dtype}) or torch.float32; "
                f"got {bias.dtype}"
            )
        check_broadcast_operand("bias", bias, full, hkv, fn)
    if seqused_k is not None:
        _check_tensor("seqused_k", seqused_k, fn)
        if seqused_k.dtype != torch.int32:
            raise TypeError(f"{fn}: seqused_k must be int32; got {seqused_k.dtype}")
        if seqused_k.dim() != 1 or seqused_k.shape[0] != b:
            raise ValueError(
                f"{fn}: seqused_k must have shape (B,) = ({b},); got {_shape(seqused_k)}"
            )
        if seqused_k.device != query.device:
            raise ValueError(
                f"{fn}: seqused_k is on {seqused_k.device} but query is on {query.device}"
            )
    check_scalars(scale, softcap, fn)


def check_scalars(scale, softcap, fn: str) -> None:
    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise TypeError(f"{fn}: scale must be a float or None; got {type(scale).__name__}")
        # Comparisons, not math.isfinite: under dynamic=True these may be symbolic floats.
        if not (-math.inf < scale < math.inf):
            raise ValueError(f"{fn}: scale must be finite; got {scale}")
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"{fn}: softcap must be a float; got {type(softcap).__name__}")
    if not (0 <= softcap < math.inf):
        raise ValueError(f"{fn}: softcap must be finite and >= 0 (0 disables it); got {softcap}")


def data_readable(t: torch.Tensor) -> bool:
    """Whether t's values can be read on the host now: not while torch.compile traces, not
    during CUDA graph capture, and not through a torch.func wrapper (a vmapped or grad-tracked
    tensor has no storage of its own; the registered ops check it below the transform)."""
    if torch.compiler.is_compiling() or isinstance(t, FakeTensor):
        return False
    if isinstance(t, FunctionalTensor):
        return False  # traced for a compiled graph (inductor.py): fake underneath
    if t.is_cuda and torch.cuda.is_current_stream_capturing():
        return False
    return not (functorch.is_functorch_wrapped_tensor(t) or functorch.is_batchedtensor(t))


def check_flags(fn: str, **flags) -> None:
    """is_causal, deterministic, return_lse: plain bools (TypeError otherwise)."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{fn}: {name} must be a bool; got {type(value).__name__} {value!r}")


def check_seqused_k_values(seqused_k: torch.Tensor | None, lk: int, fn: str) -> None:
    """Range check of seqused_k (one host sync); skipped where the values cannot be read
    (data_readable)."""
    if seqused_k is None or seqused_k.numel() == 0 or not data_readable(seqused_k):
        return
    lo, hi = torch.stack(torch.aminmax(seqused_k)).tolist()  # one host sync
    if lo < 0 or hi > lk:
        raise ValueError(
            f"{fn}: seqused_k values must lie in [0, Lk={lk}]; got values from {lo} to {hi}"
        )


def check_backend(backend, fn: str = "dmattn.attention") -> None:
    if backend not in BACKENDS:
        raise ValueError(f"{fn}: backend must be one of {BACKENDS}; got {backend!r}")


def _check_heads(query, key, h, hkv, d, dv, fn: str) -> None:
    if (hkv == 0 and h != 0) or (hkv != 0 and h % hkv != 0):
        raise ValueError(
            f"{fn}: the number of query heads H={h} must be a multiple of the number of "
            f"key/value heads Hkv={hkv} (query {_shape(query)}, key {_shape(key)})"
        )
    if d > MAX_HEAD_DIM or dv > MAX_HEAD_DIM:
        raise ValueError(
            f"{fn}: head dims must be at most {MAX_HEAD_DIM}; got D={d} (query/key) and "
            f"Dv={dv} (value)"
        )


def _check_dtypes_devices(problem: Problem, fn: str) -> None:
    query, key, value = problem.query, problem.key, problem.value
    mask, bias = problem.mask, problem.bias
    if query.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{fn}: query must be float16, bfloat16, float32 or float64; got {query.dtype}"
        )
    for name, t in (("key", key), ("value", value)):
        if t.dtype != query.dtype:
            raise TypeError(f"{fn}: {name} dtype {t.dtype} differs from query dtype {query.dtype}")
    for name, t in (("key", key), ("value", value), ("mask", mask), ("bias", bias)):
        if t is not None and isinstance(t, torch.Tensor) and t.device != query.device:
            raise ValueError(
                f"{fn}: {name} is on {t.device} but query is on {query.device}; "
                "all tensors must be on one device"
            )


def check_varlen_inputs(
    problem: Problem, scale=None, softcap=0.0, fn: str = "dmattn.attention_varlen"
) -> None:
    """The shape/dtype/device checks of a packed (cu_seqlens) call (README "Variable-length
    batches"); not its sinks (check_sinks)."""
    _check_qkv(problem, ("total_q", "total_k"), fn)
    query, key, value = problem.query, problem.key, problem.value
    mask, bias = problem.mask, problem.bias
    cu_seqlens_q, cu_seqlens_k = problem.cu_seqlens_q, problem.cu_seqlens_k
    max_seqlen_q, max_seqlen_k = problem.max_seqlen_q, problem.max_seqlen_k
    _, h, d = query.shape
    total_k, hkv, dk = key.shape
    if dk != d or value.shape[0] != total_k or value.shape[1] != hkv:
        raise ValueError(
            f"{fn}: key (total_k, Hkv, D) and value (total_k, Hkv, Dv) must agree with each "
            f"other and with query's D={d}; got query {_shape(query)}, key {_shape(key)}, "
            f"value {_shape(value)}"
        )
    _check_heads(query, key, h, hkv, d, value.shape[2], fn)
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        _check_tensor(name, cu, fn)
        if cu.dtype != torch.int32:
            raise TypeError(f"{fn}: {name} must be int32; got {cu.dtype}")
        if cu.dim() != 1 or cu.shape[0] < 1:
            raise ValueError(f"{fn}: {name} must have shape (B + 1,); got {_shape(cu)}")
        if cu.device != query.device:
            raise ValueError(f"{fn}: {name} is on {cu.device} but query is on {query.device}")
    if cu_seqlens_q.shape[0] != cu_seqlens_k.shape[0]:
        raise ValueError(
            f"{fn}: cu_seqlens_q and cu_seqlens_k must both have B + 1 entries; got "
            f"{_shape(cu_seqlens_q)} and {_shape(cu_seqlens_k)}"
        )
    for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(m, bool) or not isinstance(m, (int, torch.SymInt)):
            raise TypeError(f"{fn}: {name} must be an int; got {type(m).__name__}")
        if m < 0:
            raise ValueError(f"{fn}: {name} must be >= 0; got {m}")
    for name, t, dtypes in (
        ("mask", mask, (torch.bool,)),
        ("bias", bias, (query.dtype, torch.float32)),
    ):
        if t is None:
            continue
        _check_tensor(name, t, fn)
        if t.dtype not in dtypes:
            want = "bool" if name == "mask" else f"query's ({query.dtype}) or torch.float32"
            raise TypeError(f"{fn}: {name} dtype must be {want}; got {t.dtype}")
        th = t.shape[0] if t.dim() == 2 else -1
        if t.dim() != 2 or not (th == h or th == hkv or th == 1) or t.shape[1] != total_k:  # noqa: SIM109
            raise ValueError(
                f"{fn}: {name} must be per key token, (H|Hkv|1, total_k) with H={h}, "
                f"Hkv={hkv}, total_k={total_k}; got shape {_shape(t)}"
            )
    check_scalars(scale, softcap, fn)


def check_cu_seqlens_values(
    cu_seqlens_q, cu_seqlens_k, total_q, total_k, max_seqlen_q, max_seqlen_k, fn: str
) -> None:
    """cu_seqlens start at 0, never decrease, end within the packed totals, and no sequence is
    longer than max_seqlen. Reads the tensors (one host sync); skipped where their values cannot
    be read (data_readable)."""
    if cu_seqlens_q.shape[0] < 2:
        return
    if not (data_readable(cu_seqlens_q) and data_readable(cu_seqlens_k)):
        return

    def stats(cu: torch.Tensor) -> torch.Tensor:
        step = cu.diff().long()
        return torch.stack([cu[0].long(), cu[-1].long(), step.max(), step.argmin(), step.min()])

    pairs = (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k))
    values = torch.stack([stats(cu) for _, cu in pairs]).tolist()  # one host sync
    limits = ((total_q, max_seqlen_q), (total_k, max_seqlen_k))
    for (name, _), (first, last, step_max, at, step_min), (total, max_len) in zip(
        pairs, values, limits
    ):
        if first != 0:
            raise ValueError(f"{fn}: {name} must start at 0; got {first}")
        if step_min < 0:
            raise ValueError(
                f"{fn}: {name} must be monotone (non-decreasing); it falls by {-step_min} "
                f"from index {at} to {at + 1}"
            )
        if last > total:
            side = "query" if name.endswith("q") else "key/value"
            raise ValueError(f"{fn}: {name}[-1] = {last} exceeds the packed {side} length {total}")
        if step_max > max_len:
            mname = "max_seqlen_q" if name.endswith("q") else "max_seqlen_k"
            raise ValueError(
                f"{fn}: a sequence in {name} has length {step_max}, more than {mname}={max_len}"
            )


def check_sinks(sinks, query: torch.Tensor, fn: str) -> None:
    """sinks: None or a float tensor (H,) in query's dtype or float32, on query's device."""
    if sinks is None:
        return
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"{fn}: sinks must be a tensor (H,) or None; got {type(sinks).__name__}")
    h = query.shape[2]
    if tuple(sinks.shape) != (h,):
        raise ValueError(f"{fn}: sinks must have shape (H,) = ({h},); got {tuple(sinks.shape)}")
    if sinks.dtype not in (query.dtype, torch.float32):
        raise TypeError(
            f"{fn}: sinks dtype must be query's ({query.dtype}) or torch.float32; got {sinks.dtype}"
        )
    if sinks.device != query.device:
        raise ValueError(f"{fn}: sinks is on {sinks.device}, query on {query.device}")


# The sinks tensors found finite or -inf, with their version counter then: a model passes the
# same parameter every call, and reading it each time was one host sync a layer a token.
_SINKS_CHECKED = WeakTensorKeyDictionary()


def check_sinks_values(sinks, fn: str) -> None:
    """sinks finite or -inf (one host sync); skipped where the values cannot be read
    (data_readable), and for a tensor found so before whose version counter has not moved
    since (no in-place write through autograd's view of it: an optimizer's step moves it). NaN
    would poison every row of its head and +inf would take all of it."""
    if sinks is None or sinks.numel() == 0 or not data_readable(sinks):
        return
    # Inference tensors keep no version counter: checked every call.
    version = None if sinks.is_inference() else sinks._version
    if version is not None and _SINKS_CHECKED.get(sinks) == version:
        return
    bad = sinks.isnan() | (sinks == float("inf"))
    if bool(bad.any()):  # one host sync
        heads = bad.nonzero().flatten().tolist()
        raise ValueError(
            f"{fn}: sinks must be finite or -inf (no sink); got {sinks[bad].tolist()} at "
            f"head(s) {heads[:8]}"
        )
    if version is not None:
        _SINKS_CHECKED[sinks] = version


NO_WINDOW = (-1, -1)
MAX_WINDOW = 2**62


def check_window(window_size, fn: str) -> tuple[int, int]:
    """window_size: (left, right), two ints >= -1 (-1: unbounded on that side), or None (no
    window). Returns them as a tuple of Python ints; a side above MAX_WINDOW, wider than any
    sequence, comes back as -1."""
    if window_size is None:
        return NO_WINDOW
    if isinstance(window_size, torch.Tensor) or not hasattr(window_size, "__len__"):
        raise TypeError(
            f"{fn}: window_size must be a pair (left, right) of ints; got "
            f"{type(window_size).__name__}"
        )
    if len(window_size) != 2:
        raise ValueError(
            f"{fn}: window_size must be a pair (left, right); got {len(window_size)} values"
        )
    left, right = window_size
    for name, v in (("left", left), ("right", right)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(
                f"{fn}: window_size {name} must be an int (-1 for unbounded); got "
                f"{type(v).__name__}"
            )
        if v < -1:
            raise ValueError(f"{fn}: window_size {name} must be >= 0, or -1 for unbounded; got {v}")
    # A side wider than any sequence (the schemas hold int64) bounds nothing: it is unbounded.
    left, right = (-1 if v > MAX_WINDOW else int(v) for v in (left, right))
    return left, right


def has_window(window_size) -> bool:
    """Whether a checked window bounds either side."""
    return window_size[0] >= 0 or window_size[1] >= 0


def check_problem(
    problem: Problem, scale, softcap, window_size, fn: str, values: bool = True
) -> tuple[int, int]:
    """Every check of one call, dense, seqused_k or packed: shapes, dtypes, devices, scalars,
    sinks and the window; with `values` also what reads tensor data (seqused_k's range, the
    sinks', cu_seqlens'), which fake tensors do not have (check_values). Returns the window as
    check_window does. The registered ops (registration/ops.check_call) and the Flex backend
    run this same function."""
    window = check_window(window_size, fn)
    if problem.varlen:
        check_varlen_inputs(problem, scale, softcap, fn)
    else:
        check_inputs(problem, scale, softcap, fn)
        check_sinks(problem.sinks, problem.query, fn)
    if values:
        check_values(problem, fn)
    return window


def check_values(problem: Problem, fn: str, seqused_k_in_range: bool = False) -> None:
    """The checks that read tensor values: cu_seqlens' (packed calls), or seqused_k's range and
    the sinks' (dense calls). `seqused_k_in_range`: the caller vouches for seqused_k (one of
    the library's own, api.attention's `_seqused_k_in_range`), whose check is left out."""
    if problem.varlen:
        check_cu_seqlens_values(
            problem.cu_seqlens_q, problem.cu_seqlens_k, problem.lq, problem.lk,
            problem.max_seqlen_q, problem.max_seqlen_k, fn,
        )  # fmt: skip
    else:
        if not seqused_k_in_range:
            check_seqused_k_values(problem.seqused_k, problem.lk, fn)
        check_sinks_values(problem.sinks, fn)
