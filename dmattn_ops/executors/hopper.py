"""Key-list calls on Hopper through warp-specialised Gluon kernels (kernels/hopper.py): opt-in.

On an sm_90 GPU with DMATTN_HOPPER=1, the forward and the dK/dV pass of key-list calls with
packed keys (the DMA pattern: a mask shared by all queries with one key list per KV group,
causal or not, a per-key bias or none) run FlashAttention-3-shaped kernels: a TMA loader warp
and two consumer warpgroups per program. The dq pass, the key lists, the packing and the
reduction of split dK/dV parts stay on the Triton kernels.

Both kernels are persistent: one program per SM loops over work items, longest first, and its
loader warp fetches the next item's tiles while the consumers finish the current one.

Why opt-in: on dense calls these kernels' prototypes run 1.25-1.35x the
TFLOP/s of our Triton kernels (the forward at cuDNN's rate). On key-list calls they are now level
with the Triton kernels at the model's call (kernel ms, Triton's in parentheses: forward 0.096
(0.097), dK/dV 0.179 (0.206)) and behind at long lists (case C: 0.478 (0.439) and 1.31 (1.07)),
and a compiled model step that takes them is not faster (B4 L2048: 8.49 ms against 6.86 in
one run, level to +1.7 ms in others): each launch is an extern call of ~65 us of host time
where Inductor launches a Triton kernel in ~15, and the rest of the difference is not yet
explained. They are exact (tests/test_hopper.py, on the GPU), and the plumbing (plan flag, ops,
packed V rows zeroed past each list) is what the next kernels plug into.

Gluon kernels cannot go through `torch.library.wrap_triton` (Inductor re-emits a user kernel's
source under `@triton.jit`), so each launch is an op of its own, `dmattn::_hopper_forward` and
`dmattn::_hopper_dkdv`, mutating the buffers the launcher allocated: eagerly a direct call, and
in a compiled graph one extern node each.
"""

from __future__ import annotations

import importlib.util

import torch

from dmattn_ops.core.device import cdiv, sm_count
from dmattn_ops.core.switches import switch
from dmattn_ops.executors._triton import LazyKernel, interpreter_on

# Tiles: a consumer warpgroup takes BLOCK_M query rows (forward; a program has two) or
# DKDV_BLOCK_N keys (dK/dV); the ring of K/V (forward) or Q/dO (dK/dV) tiles has STAGES slots.
# Shared memory: forward 32 KB of Q + 4 x 32 KB of K and V; dK/dV 64 KB of K and V + 2 x 16 KB.
# 32-query dK/dV tiles: at 64 the consumers spill 880 bytes.
BLOCK_M = 64
FWD_BLOCK_N, FWD_STAGES = 64, 4
DKDV_BLOCK_M, DKDV_BLOCK_N, DKDV_STAGES = 32, 64, 2
HEAD_DIMS = (128,)
DTYPES = (torch.float16, torch.bfloat16)
# kernels/hopper.py's register split: the loader warp gives its registers to the consumers.
MAXNREG = 168


def enabled() -> bool:
    """On where DMATTN_HOPPER=1 (read per call); off by default (module docstring)."""
    return switch("DMATTN_HOPPER", False)


# Eager launches go through LazyKernel's launch cache, which skips Triton's binder (~100 us a
# launch for these kernels' descriptors and ~30 arguments).
def _kernels() -> tuple:
    """The Gluon kernels' module, imported (with Triton) at the first launch."""
    from dmattn_ops.kernels import hopper

    return (hopper,)


_FORWARD_KERNEL = LazyKernel(_kernels, "hopper_fwd_kernel")
_DKDV_KERNEL = LazyKernel(_kernels, "hopper_dkdv_kernel")

_GLUON: list[bool] = []  # found or not, once asked (a plain global: see _triton._FOUND)


def _gluon_found() -> bool:
    # find_spec of a submodule imports its parents (Triton): asked only for sm_90 calls.
    if not _GLUON:
        try:
            _GLUON.append(importlib.util.find_spec("triton.experimental.gluon") is not None)
        except ImportError:
            _GLUON.append(False)
    return _GLUON[0]


def _sm90(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) == (9, 0)


def _tma_ready(t: torch.Tensor) -> bool:
    """A 4-D operand a TMA descriptor can take: unit stride on the last dim, other strides and
    the storage offset multiples of 16 bytes."""
    size = t.element_size()
    return (
        t.stride(3) == 1
        and all(s * size % 16 == 0 for s in t.stride()[:3])
        and t.storage_offset() * size % 16 == 0
    )


def reasons(problem, band, softcap: float, dbias: str | None, on: bool) -> list[str]:
    """Why a key-list call with packed keys (the plan's KEY_LISTS with pack) does not take the
    Hopper kernels; empty when it does: the kernel option hopper (DMATTN_HOPPER=1), CUDA sm_90
    with Gluon, fp16/bf16, D = Dv = 128, no window, softcap, sinks or seqused_k, a per-key bias
    shared by a KV group's heads or per head, dbias none or "group", and TMA-ready Q (the
    packed K/V are). dbias: the backward's mode, or None."""
    query = problem.query
    if not on:
        return ["off (kernel option hopper, DMATTN_HOPPER=1 turns it on)"]
    if not query.is_cuda or interpreter_on():
        return ["needs CUDA without the Triton interpreter"]
    found = []
    if query.dtype not in DTYPES:
        found.append(f"{query.dtype}: takes fp16/bf16")
    if problem.head_dim not in HEAD_DIMS or problem.value_dim != problem.head_dim:
        found.append(f"D {problem.head_dim}, Dv {problem.value_dim}: takes D = Dv in {HEAD_DIMS}")
    for name, present in (
        ("a window", band.has_window), ("softcap", softcap > 0),
        ("sinks", problem.sinks is not None), ("seqused_k", problem.seqused_k is not None),
        (f"dbias mode {dbias!r}", dbias not in (None, "group")),
    ):  # fmt: skip
        if present:
            found.append(f"{name}: not in the Hopper kernels")
    bias = problem.bias
    if bias is not None and bias.shape[1] not in (1, problem.kv_heads, problem.heads):
        found.append("a bias head dim other than 1, Hkv or H")
    if not found and not (_tma_ready(query) and _sm90(query.device) and _gluon_found()):
        found.append("needs sm_90, Gluon and a TMA-ready query (16-byte strides and offset)")
    return found


_LAYOUTS: dict = {}  # (dtype, rows, D) -> the shared-memory layout of a [1, rows, 1, D] box


def _descriptor(t: torch.Tensor, rows: int):
    """A TMA descriptor of 4-D t (B, L, heads, D) with [1, rows, 1, D] boxes. Layouts are made
    once per box (Gluon's get_default_for takes ~10 us a call)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    if not _tma_ready(t):
        t = t.contiguous()
    block = [1, rows, 1, t.shape[3]]
    layout = _LAYOUTS.get((t.dtype, rows, t.shape[3]))
    if layout is None:
        from triton.experimental.gluon import language as gl

        gdt = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[t.dtype]
        layout = _LAYOUTS[(t.dtype, rows, t.shape[3])] = gl.NVMMASharedLayout.get_default_for(
            block, gdt
        )
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block, layout)


def _batch_stride(t: torch.Tensor) -> int:
    """A key-list tensor's batch stride (tiles.KeyLists), 0 on a broadcast batch."""
    return t.stride(0) if t.shape[0] > 1 else 0


def _or(t: torch.Tensor | None, stand_in: torch.Tensor) -> torch.Tensor:
    """An absent operand's pointer argument: Gluon's worker partitions take no None, and the
    kernel's constexpr flags keep it unread."""
    return stand_in if t is None else t


def _bias_rows(bias, hkv: int) -> tuple[int, int]:
    """(bias_heads, bias_head_mul) of a packed bias (B, Hkv * bias_heads, 1, Lk)."""
    if bias is None:
        return 1, 0
    heads = bias.shape[1] // hkv
    return heads, int(heads > 1)


def _hopper_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bias: torch.Tensor | None,
    keys: torch.Tensor,
    key_end: torch.Tensor,
    key_count: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    lse_rem: torch.Tensor,
    scale: float,
    is_causal: bool,
    mask_div: int,
) -> None:
    """kernels/hopper.py hopper_fwd_kernel: query (B, Lq, H, D); key, value the packed rows
    (B, Lk, Hkv, D) with V zero past each list; bias the packed (B, Hkv * heads, 1, Lk) or None;
    the key lists (tiles.KeyLists, key_end per BLOCK_M-row tile); out (B, Lq, H, D) contiguous,
    lse and lse_rem (B, H, Lq) float32."""
    b, lq, h, d = query.shape
    lk, hkv = key.shape[1], key.shape[2]
    bias_heads, bias_mul = _bias_rows(bias, hkv)
    n_items = cdiv(lq, 2 * BLOCK_M) * b * h
    _FORWARD_KERNEL[(min(n_items, sm_count(query.device)),)](
        _descriptor(query, BLOCK_M), _descriptor(key, FWD_BLOCK_N),
        _descriptor(value, FWD_BLOCK_N), out, lse, lse_rem, _or(bias, keys), keys, key_end,
        key_count,
        out.stride(0), out.stride(1), out.stride(2), _batch_stride(keys), keys.stride(1),
        _batch_stride(key_end), _batch_stride(key_count),
        bias_heads, bias_mul, h, h // hkv, lq, lk, key_end.shape[2], mask_div, float(scale),
        n_items, IS_CAUSAL=is_causal, HAS_BIAS=bias is not None, BLOCK_M=BLOCK_M,
        BLOCK_N=FWD_BLOCK_N, D=d, STAGES=FWD_STAGES, num_warps=4, maxnreg=MAXNREG,
    )  # fmt: skip


def _hopper_dkdv(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    grad_out: torch.Tensor,
    stats: torch.Tensor,
    bias: torch.Tensor | None,
    keys: torch.Tensor,
    key_count: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    dbias: torch.Tensor | None,
    part_dk: torch.Tensor | None,
    part_dv: torch.Tensor | None,
    part_db: torch.Tensor | None,
    scale: float,
    is_causal: bool,
    mask_div: int,
    split: int,
) -> None:
    """kernels/hopper.py hopper_dkdv_kernel: key, value and bias the packed rows; stats the dq
    kernel's (B, H, Lq, 4) row statistics; dk, dv (B, Lk, Hkv, D) and dbias (B, Hkv, 1, Lk)
    written at the keys (zeros at keys no list holds), or with split > 1 the float32 parts
    (split, B * Hkv, Lk, D) at list positions for attention_bwd_dkdv_reduce_kernel."""
    b, lq, h, d = query.shape
    lk, hkv = key.shape[1], key.shape[2]
    bias_heads, bias_mul = _bias_rows(bias, hkv)
    db_strides = (dbias.stride(0), dbias.stride(1)) if dbias is not None else (0, 0)
    n_parts = b * hkv * split
    n_items = dkdv_programs(lk) * n_parts
    _DKDV_KERNEL[(min(n_items, sm_count(query.device)),)](
        _descriptor(query, DKDV_BLOCK_M), _descriptor(key, DKDV_BLOCK_N),
        _descriptor(value, DKDV_BLOCK_N), _descriptor(grad_out, DKDV_BLOCK_M), stats,
        _or(bias, keys), keys, key_count, dk, dv, _or(dbias, dk), _or(part_dk, stats),
        _or(part_dv, stats), _or(part_db, stats),
        dk.stride(0), dk.stride(1), dk.stride(2), dv.stride(0), dv.stride(1), dv.stride(2),
        *db_strides, _batch_stride(keys), keys.stride(1), _batch_stride(key_count), bias_heads,
        bias_mul, h, h // hkv, lq, lk, mask_div, float(scale), split, n_items, n_parts,
        IS_CAUSAL=is_causal,
        HAS_BIAS=bias is not None, DBIAS_COLS=dbias is not None or part_db is not None,
        PARTIAL=split > 1, BLOCK_M=DKDV_BLOCK_M, BLOCK_N=DKDV_BLOCK_N, D=d,
        STAGES=DKDV_STAGES, num_warps=4, maxnreg=MAXNREG,
    )  # fmt: skip


# Registered through torch.library.Library rather than custom_op, whose Python wrappers around
# mutated arguments cost ~60 us a call, paid again at each launch that a
# compiled graph makes.
_lib = torch.library.Library("dmattn", "FRAGMENT")
_lib.define(
    "_hopper_forward(Tensor query, Tensor key, Tensor value, Tensor? bias, Tensor keys, "
    "Tensor key_end, Tensor key_count, Tensor(a!) out, Tensor(b!) lse, Tensor(c!) lse_rem, "
    "float scale, bool is_causal, int mask_div) -> ()"
)
_lib.define(
    "_hopper_dkdv(Tensor query, Tensor key, Tensor value, Tensor grad_out, Tensor stats, "
    "Tensor? bias, Tensor keys, Tensor key_count, Tensor(a!) dk, Tensor(b!) dv, "
    "Tensor(c!)? dbias, Tensor(d!)? part_dk, Tensor(e!)? part_dv, Tensor(f!)? part_db, "
    "float scale, bool is_causal, int mask_div, int split) -> ()"
)
_lib.impl("_hopper_forward", _hopper_forward, "CUDA")
_lib.impl("_hopper_dkdv", _hopper_dkdv, "CUDA")


@torch.library.register_fake("dmattn::_hopper_forward")
def _(*args) -> None:
    return None


@torch.library.register_fake("dmattn::_hopper_dkdv")
def _(*args) -> None:
    return None


def forward(query, lists, out, lse, lse_rem, scale, is_causal, mask_div) -> None:
    """The forward of a key-list call whose lists were built with BLOCK_M-row tiles and packed
    with PackFrom(zero_tail=True)."""
    packed = lists.packed
    torch.ops.dmattn._hopper_forward(
        query, packed.key, packed.value, packed.bias, lists.keys, lists.key_end,
        lists.key_count, out, lse, lse_rem, float(scale), bool(is_causal), int(mask_div),
    )  # fmt: skip


def dkdv(query, grad_out, stats, lists, dk, dv, dbias, parts, scale, is_causal, mask_div, split):
    """The dK/dV pass of a key-list call with packed keys; parts: (part_dk, part_dv, part_db)
    with split > 1, else Nones."""
    packed = lists.packed
    torch.ops.dmattn._hopper_dkdv(
        query, packed.key, packed.value, grad_out, stats, packed.bias, lists.keys,
        lists.key_count, dk, dv, dbias, *parts, float(scale), bool(is_causal), int(mask_div),
        int(split),
    )  # fmt: skip


def dkdv_programs(lk: int) -> int:
    """Key tiles of the dK/dV grid per (batch, KV group)."""
    return cdiv(lk, 2 * DKDV_BLOCK_N)
