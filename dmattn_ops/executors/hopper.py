"""Key-list calls on Hopper through warp-specialised Gluon kernels (kernels/hopper.py).

On an sm_90 GPU, the forward of key-list calls with packed keys (the DMA pattern: a mask shared
by all queries with one key list per KV group, causal or not, a per-key bias or none) of at
least FORWARD_MIN_LK keys runs a FlashAttention-3-shaped kernel: a TMA loader warp and two
consumer warpgroups per program; the backward of those of at least BACKWARD_MIN_LK keys runs
two more, dQ (which also writes the row statistics) and dK/dV. With kernel option hopper=True
(DMATTN_HOPPER=1) every such call's passes do; hopper=False (DMATTN_HOPPER=0) none. The key
lists, the packing and the reduction of split dK/dV parts stay on the Triton kernels; the dQ
kernel reads the forward's lists and packed rows (kept for the backward: launch.KeptLists).

The kernels are persistent: one program per SM loops over work items, longest first (full
rounds of the programs in alternating directions, so that each program's sum is about equal),
and its loader warp fetches the next item's tiles (K, V and, for the forward and dQ, the list
columns: the keys' positions and biases) while the consumers finish the current one.

Where they pay (H200, torch 2.11, Triton 3.6, kernel ms of bench.tune's cases): the forward runs
1.15-1.34x the Triton forward's rate at long lists (M-L32768: 2.02 ms against 2.71) since its
list columns come through shared memory (carried in registers they spilled at 128-key tiles),
the tiles every row sees whole skip the masks, and the consumers' issues alternate. The dQ
kernel, the forward's structure with dO and O beside Q, runs M-L32768 in 2.56 ms against 3.03,
the dK/dV kernel 3.56-3.59 against 5.17 (M-L8192: 0.265 against 0.362); a compiled step of short
calls pays each launch's host time as an extern call (~40-48 us with the launches kept per
operand layout, executors/_gluon.py; Inductor launches a Triton kernel in ~15 us): hence the
thresholds (both passes from 8192 keys).

Gluon kernels cannot go through `torch.library.wrap_triton` (Inductor re-emits a user kernel's
source under `@triton.jit`), so each launch is an op of its own, `dmattn::_hopper_forward`,
`dmattn::_hopper_dq` and `dmattn::_hopper_dkdv`, mutating the buffers the launcher allocated:
eagerly a direct call, and in a compiled graph one extern node each.
"""

from __future__ import annotations

import importlib.util

import torch

from dmattn_ops.core.device import cdiv, sm_count
from dmattn_ops.executors._gluon import kept, launched, tma
from dmattn_ops.executors._library import define_launch
from dmattn_ops.executors._triton import LazyKernel, interpreter_on

# Tiles: a consumer warpgroup takes BLOCK_M query rows (forward; a program has two) or
# DKDV_BLOCK_N keys (dK/dV); the ring of K/V (forward) or Q/dO (dK/dV) tiles has STAGES slots.
# Shared memory: forward 32 KB of Q + STAGES x (K, V and list columns of a key tile): 4 x 33 KB
# at 64-key tiles, 3 x 65.5 KB at 128 (226.7 KB of 227); dK/dV 64 KB of K and V + 2 x 33 KB of
# Q, dO and row statistics. 64-query dK/dV tiles, since the statistics come through shared
# memory (144 bytes of spills, 880 before; H200 M-L32768 4.740 ms against the Triton dk/dv
# kernel's 5.073, 32-query tiles 5.992; M 0.140 against 0.142).
BLOCK_M = 64
# The forward's (BLOCK_N, STAGES, PINGPONG) by the call's length: 128-key tiles in 3 stages with
# the consumers' issues alternating (ping-pong) from LONG_TILES_MIN_LK keys on (kernel ms on the
# H200 against the Triton forward: M-L32768 2.024 against 2.712, M-L8192 0.183 against 0.210;
# 64-key tiles 2.257 and 0.193), 64-key tiles in 4 stages below it (M: B4 L2048, 0.081 against
# 0.090; 128-key tiles 0.091). A float32 bias's columns take 3 x 256 more bytes of shared memory
# than 3 stages leave: 2.
FWD_SHORT, FWD_LONG = (64, 4, False), (128, 3, True)
LONG_TILES_MIN_LK = 8192
# Key-list calls with at least this many keys run their forward on the Gluon kernel by default
# (kernel option hopper unset): it is 1.15-1.34x the Triton forward there (M-L8192 0.173 ms
# against 0.211 since its stores went 8 bytes a thread, bench/NOTES.md 241 and 245), and its
# extern launch (~65 us of host time then, ~40 since launches are kept per layout: NOTES 263)
# is small beside the call: the compiled B1 L8192 step 7.61 / 7.51 -> 7.37 / 7.38 ms (two
# rounds; at 16384 before NOTES 245).
FORWARD_MIN_LK = 8192
# ... and their backward from this many (dQ and dK/dV kernels): the compiled B1 L32768 step
# 59.47 -> 56.32 ms on the H200. At 8192 keys the dK/dV kernel was behind the Triton one (0.387
# against 0.362 ms) until its programs took their items in a snake order and its row statistics
# stopped going through shared memory (bench/NOTES.md 230-232): now 0.265, with dQ 0.228
# against 0.254 (0.209 since NOTES 239-240), and the compiled B1 L8192 step 8.25 / 8.18 -> 8.10
# / 7.65 ms (two rounds).
BACKWARD_MIN_LK = 8192
DKDV_BLOCK_M, DKDV_BLOCK_N, DKDV_STAGES = 64, 64, 2
# The dQ kernel's (BLOCK_N, STAGES, PINGPONG): the forward's programs and loader with dO beside
# Q; 64-key tiles (its S, dP, dS and dQ in registers: 128-key tiles spill 504 bytes).
DQ_TILES = (64, 4, True)
HEAD_DIMS = (128,)
DTYPES = (torch.float16, torch.bfloat16)
# The forward reads rows of the key lists and of the packed bias (Lk each) by TMA, whose boxes
# must start 16-byte aligned: Lk a multiple of 8 keeps every row's start aligned (int32 lists,
# 16- and 32-bit biases). A box that starts unaligned is an illegal instruction, not a slower
# read (measured on the H200 at Lk 298 and 300).
LK_MULTIPLE = 8
# kernels/hopper.py's register split: the loader warp gives its registers to the consumers.
MAXNREG = 168
# The Triton versions (major.minor) the Gluon kernels ran with on a GPU: the test suite and the
# benchmarks of bench/RESULTS.md, torch 2.11's Triton 3.6. Later versions compile them
# (tests/test_hopper_compile.py compiles them with the Triton installed, in CI the newest) but
# they never ran there, so the default leaves them off; kernel option hopper=True
# (DMATTN_HOPPER=1) takes them.
RAN_ON_TRITON = ("3.6",)


# A layout's first launch goes through LazyKernel's launch cache, which skips Triton's binder
# (~100 us a launch for these kernels' descriptors and ~30 arguments); later ones go straight to
# the compiled kernel (executors/_gluon.py launched).
def _kernels() -> tuple:
    """The Gluon kernels' module, imported (with Triton) at the first launch."""
    from dmattn_ops.kernels import hopper

    return (hopper,)


_FORWARD_KERNEL = LazyKernel(_kernels, "hopper_fwd_kernel")
_DKDV_KERNEL = LazyKernel(_kernels, "hopper_dkdv_kernel")
_DQ_KERNEL = LazyKernel(_kernels, "hopper_dq_kernel")

_GLUON: list[bool] = []  # found or not, once asked (a plain global: see _triton._FOUND)


def _gluon_found() -> bool:
    # find_spec of a submodule imports its parents (Triton): asked only for sm_90 calls.
    if not _GLUON:
        try:
            _GLUON.append(importlib.util.find_spec("triton.experimental.gluon") is not None)
        except ImportError:
            _GLUON.append(False)
    return _GLUON[0]


_TRITON: list[str] = []  # Triton's major.minor, once asked


def _triton_minor() -> str:
    if not _TRITON:
        import triton

        _TRITON.append(".".join(triton.__version__.split(".")[:2]))
    return _TRITON[0]


def untested_triton() -> str | None:
    """Why the default (kernel option hopper unset) leaves the Gluon kernels off with the
    installed Triton, or None where they ran with it (RAN_ON_TRITON)."""
    version = _triton_minor()
    if version in RAN_ON_TRITON:
        return None
    return (
        f"Triton {version}: the Gluon kernels ran on a GPU with Triton "
        f"{', '.join(RAN_ON_TRITON)} only; kernel option hopper=True takes them"
    )


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


def reasons(
    problem, band, softcap: float, dbias: str | None, on: bool | None, forward: bool,
    grad_lse: bool = False,
) -> list[str]:  # fmt: skip
    """Why a key-list call with packed keys (the plan's KEY_LISTS with pack) does not take the
    Hopper kernels; empty when it does: the kernel option hopper (`on`: True, or unset for the
    forward of a call of at least FORWARD_MIN_LK keys and the backward of one of at least
    BACKWARD_MIN_LK with a Triton of RAN_ON_TRITON; DMATTN_HOPPER sets it), CUDA sm_90
    with Gluon, fp16/bf16, D = Dv = 128, no window, softcap, sinks or seqused_k, a per-key bias
    shared by a KV group's heads or per head, dbias none or "group", and TMA-ready Q (the
    packed K/V are), Lk a multiple of LK_MULTIPLE, fixed sizes (not a compiled graph's
    symbolic ones). dbias: the backward's mode, or None;
    forward: the plan is the forward's; grad_lse: the backward's has a gradient of lse."""
    query = problem.query
    if on is False:
        return ["off (kernel option hopper=False, DMATTN_HOPPER=0)"]
    if problem.symbolic:
        # A compiled graph with dynamic shapes (registration/inductor.py): the Gluon launches
        # (TMA descriptors, their grids) are traced and tested with fixed sizes only.
        return ["symbolic sizes: the Gluon kernels are traced for fixed sizes only"]
    least = FORWARD_MIN_LK if forward else BACKWARD_MIN_LK
    if on is None and problem.lk < least:
        pass_ = "forward" if forward else "backward"
        return [f"a {pass_} of Lk < {least} takes the Gluon kernels with hopper=True only"]
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
        ("a gradient of lse (the dQ kernel's delta has none)", grad_lse),
    ):  # fmt: skip
        if present:
            found.append(f"{name}: not in the Hopper kernels")
    if problem.lk % LK_MULTIPLE:
        found.append(f"Lk {problem.lk}: takes Lk a multiple of {LK_MULTIPLE} (TMA list rows)")
    bias = problem.bias
    if bias is not None and bias.shape[1] not in (1, problem.kv_heads, problem.heads):
        found.append("a bias head dim other than 1, Hkv or H")
    if not found and not (_tma_ready(query) and _sm90(query.device) and _gluon_found()):
        found.append("needs sm_90, Gluon and a TMA-ready query (16-byte strides and offset)")
    if not found and on is None:
        reason = untested_triton()
        if reason is not None:
            found.append(reason)
    return found


def _descriptor(t: torch.Tensor, rows: int):
    """A TMA descriptor of 4-D t (B, L, heads, D) with [1, rows, 1, D] boxes."""
    block = (1, rows, 1, t.shape[3])
    desc = kept(t, block)
    if desc is not None:  # a kept key is a TMA-ready layout (_gluon.kept)
        return desc
    return tma(t if _tma_ready(t) else t.contiguous(), block)


def _flat_descriptor(t: torch.Tensor, block: int):
    """A TMA descriptor of contiguous t read as one flat row, with [block] boxes: the key lists
    (Bm, Hm, Lk) and the packed bias (B, Hkv * heads, 1, Lk). A box may run into the next row
    (the kernel masks those columns); each must start 16-byte aligned, which Lk a multiple of
    LK_MULTIPLE gives (reasons)."""
    return tma(t.view(-1), (block,))


def _rows_descriptor(stats: torch.Tensor, block: int):
    """A TMA descriptor of the backward's row statistics (B, H, Lq, 4) float32 (launch.RowStats)
    as rows of 16 bytes, with [block, 4] boxes."""
    return tma(stats.view(-1, 4), (block, 4))


def _key_tiles(key, value, keys, bias, block_n: int) -> tuple:
    """The forward's and dQ kernel's descriptors of their key tiles: packed K and V, the key
    lists and the packed bias as flat rows (without a bias, the lists' descriptor again,
    unread)."""
    keys_desc = _flat_descriptor(keys, block_n)
    return (
        _descriptor(key, block_n), _descriptor(value, block_n), keys_desc,
        keys_desc if bias is None else _flat_descriptor(bias, block_n),
    )  # fmt: skip


def _batch_stride(t: torch.Tensor) -> int:
    """A key-list tensor's batch stride (tiles.KeyLists), 0 on a broadcast batch."""
    return t.stride(0) if t.shape[0] > 1 else 0


def _or(t: torch.Tensor | None, stand_in: torch.Tensor) -> torch.Tensor:
    """An absent operand's pointer argument: Gluon's worker partitions take no None, and the
    kernel's constexpr flags keep it unread."""
    return stand_in if t is None else t


def _contiguous(t: torch.Tensor | None) -> torch.Tensor | None:
    """An output buffer the launcher allocated contiguous (or None): the kernels derive its
    strides from its shape."""
    assert t is None or t.is_contiguous(), "the Hopper kernels write contiguous outputs"
    return t


def _bias_heads(bias, hkv: int) -> int:
    """The bias rows per KV group of a packed bias (B, Hkv * bias_heads, 1, Lk): 1 or G (the
    kernels read a row per query head where it is above 1)."""
    return 1 if bias is None else bias.shape[1] // hkv


@launched
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
) -> tuple:
    """kernels/hopper.py hopper_fwd_kernel: query (B, Lq, H, D); key, value the packed rows
    (B, Lk, Hkv, D) with V zero past each list; bias the packed (B, Hkv * heads, 1, Lk) or None;
    the key lists (tiles.KeyLists, key_end per BLOCK_M-row tile); out (B, Lq, H, D) contiguous,
    lse and lse_rem (B, H, Lq) float32. The launch, as (kernel, grid, args, meta):
    _gluon.launched."""
    b, lq, h, d = query.shape
    lk, hkv = key.shape[1], key.shape[2]
    bias_heads = _bias_heads(bias, hkv)
    n_items = cdiv(lq, 2 * BLOCK_M) * b * h
    block_n, stages, pingpong = FWD_LONG if lk >= LONG_TILES_MIN_LK else FWD_SHORT
    if bias is not None and bias.element_size() > 2:
        stages = min(stages, 2)
    args = (
        _descriptor(query, BLOCK_M), *_key_tiles(key, value, keys, bias, block_n),
        _contiguous(out), lse, lse_rem, key_end, key_count, _batch_stride(keys) // lk,
        _batch_stride(key_end), _batch_stride(key_count), bias_heads, mask_div, float(scale),
    )  # fmt: skip
    meta = dict(
        IS_CAUSAL=is_causal, HAS_BIAS=bias is not None, PINGPONG=pingpong, BLOCK_M=BLOCK_M,
        BLOCK_N=block_n, D=d, STAGES=stages, num_warps=4, maxnreg=MAXNREG,
    )  # fmt: skip
    return _FORWARD_KERNEL, (min(n_items, sm_count(query.device)),), args, meta


@launched
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
) -> tuple:
    """kernels/hopper.py hopper_dkdv_kernel: key, value and bias the packed rows; stats the dq
    kernel's (B, H, Lq, 4) row statistics; dk, dv (B, Lk, Hkv, D) and dbias (B, Hkv, 1, Lk)
    written at the keys (zeros at keys no list holds), or with split > 1 the float32 parts
    (split, B * Hkv, Lk, D) at list positions for attention_bwd_dkdv_reduce_kernel. The launch:
    _gluon.launched."""
    b, d = query.shape[0], query.shape[3]
    lk, hkv = key.shape[1], key.shape[2]
    bias_heads = _bias_heads(bias, hkv)
    n_items = dkdv_programs(lk) * b * hkv * split
    assert keys.stride(1) == lk, "key lists (Bm, Hm, Lk) with contiguous rows"
    args = (
        _descriptor(query, DKDV_BLOCK_M), _descriptor(key, DKDV_BLOCK_N),
        _descriptor(value, DKDV_BLOCK_N), _descriptor(grad_out, DKDV_BLOCK_M),
        _rows_descriptor(stats, DKDV_BLOCK_M),
        _or(bias, keys), keys, key_count, _contiguous(dk), _contiguous(dv),
        _or(_contiguous(dbias), dk), _or(part_dk, stats),
        _or(part_dv, stats), _or(part_db, stats), _batch_stride(keys),
        _batch_stride(key_count), bias_heads, int(bias_heads > 1), mask_div, float(scale),
        split,
    )  # fmt: skip
    meta = dict(
        IS_CAUSAL=is_causal, HAS_BIAS=bias is not None,
        DBIAS_COLS=dbias is not None or part_db is not None, PARTIAL=split > 1,
        BLOCK_M=DKDV_BLOCK_M, BLOCK_N=DKDV_BLOCK_N, D=d, STAGES=DKDV_STAGES, num_warps=4,
        maxnreg=MAXNREG,
    )  # fmt: skip
    return _DKDV_KERNEL, (min(n_items, sm_count(query.device)),), args, meta


@launched
def _hopper_dq(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    grad_out: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    lse_rem: torch.Tensor,
    bias: torch.Tensor | None,
    keys: torch.Tensor,
    key_end: torch.Tensor,
    key_count: torch.Tensor,
    dq: torch.Tensor,
    stats: torch.Tensor,
    scale: float,
    is_causal: bool,
    mask_div: int,
) -> tuple:
    """kernels/hopper.py hopper_dq_kernel: the forward's operands (_hopper_forward; K and V
    packed with zero tails) with grad_out and the forward's out (B, Lq, H, D), lse and lse_rem;
    writes dq (B, Lq, H, D) and the row statistics stats (B, H, Lq, 4) (launch.RowStats). The
    launch: _gluon.launched."""
    b, lq, h, d = query.shape
    lk, hkv = key.shape[1], key.shape[2]
    bias_heads = _bias_heads(bias, hkv)
    n_items = cdiv(lq, 2 * BLOCK_M) * b * h
    block_n, stages, pingpong = DQ_TILES
    args = (
        _descriptor(query, BLOCK_M), _descriptor(grad_out, BLOCK_M),
        _descriptor(out, BLOCK_M), *_key_tiles(key, value, keys, bias, block_n),
        _contiguous(dq), stats, lse, lse_rem, key_end, key_count, _batch_stride(keys) // lk,
        _batch_stride(key_end), _batch_stride(key_count), bias_heads, mask_div, float(scale),
    )  # fmt: skip
    meta = dict(
        IS_CAUSAL=is_causal, HAS_BIAS=bias is not None, PINGPONG=pingpong, BLOCK_M=BLOCK_M,
        BLOCK_N=block_n, D=d, STAGES=stages, num_warps=4, maxnreg=MAXNREG,
    )  # fmt: skip
    return _DQ_KERNEL, (min(n_items, sm_count(query.device)),), args, meta


define_launch(
    "_hopper_forward(Tensor query, Tensor key, Tensor value, Tensor? bias, Tensor keys, "
    "Tensor key_end, Tensor key_count, Tensor(a!) out, Tensor(b!) lse, Tensor(c!) lse_rem, "
    "float scale, bool is_causal, int mask_div) -> ()",
    _hopper_forward,
)
define_launch(
    "_hopper_dkdv(Tensor query, Tensor key, Tensor value, Tensor grad_out, Tensor stats, "
    "Tensor? bias, Tensor keys, Tensor key_count, Tensor(a!) dk, Tensor(b!) dv, "
    "Tensor(c!)? dbias, Tensor(d!)? part_dk, Tensor(e!)? part_dv, Tensor(f!)? part_db, "
    "float scale, bool is_causal, int mask_div, int split) -> ()",
    _hopper_dkdv,
)
define_launch(
    "_hopper_dq(Tensor query, Tensor key, Tensor value, Tensor grad_out, Tensor out, Tensor lse, "
    "Tensor lse_rem, Tensor? bias, Tensor keys, Tensor key_end, Tensor key_count, "
    "Tensor(a!) dq, Tensor(b!) stats, float scale, bool is_causal, int mask_div) -> ()",
    _hopper_dq,
)


def forward(query, lists, out, lse, lse_rem, scale, is_causal, mask_div) -> None:
    """The forward of a key-list call whose lists were built with BLOCK_M-row tiles and packed
    with PackFrom(zero_tail=True)."""
    packed = lists.packed
    torch.ops.dmattn._hopper_forward(
        query, packed.key, packed.value, packed.bias, lists.keys, lists.key_end,
        lists.key_count, out, lse, lse_rem, float(scale), bool(is_causal), int(mask_div),
    )  # fmt: skip


def dq(query, grad_out, rows, lists, dq, scale, is_causal, mask_div) -> None:
    """The dq pass of a key-list call whose lists were built as the forward's (forward), and
    the row statistics rows.stats (launch.RowStats; no gradient of lse: reasons)."""
    packed = lists.packed
    torch.ops.dmattn._hopper_dq(
        query, packed.key, packed.value, grad_out, rows.out, rows.lse, rows.lse_rem, packed.bias,
        lists.keys, lists.key_end, lists.key_count, dq, rows.stats, float(scale),
        bool(is_causal), int(mask_div),
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
