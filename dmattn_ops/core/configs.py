"""Tile configurations of the attention kernels, and the shared memory they need.

`config` maps (kernel, head dims, mask and bias kinds, dtypes, query length, device) to a tile
configuration whose shared memory fits the device: the table below holds what was measured
fastest on an H100 (`python -m bench.tune`), and `fit` lowers the pipeline
depth, then the key tile, until `shared_bytes` fits the device's per-block limit, read from the
device at run time (232,448 bytes on sm_90, 166,912 on sm_80).

`shared_bytes` is a model, not a measurement: every pipeline stage holds each tile the kernel
loads per step of its loop (Triton 3.6 pipelines them all through shared memory), plus the tiles
that stay resident for the whole loop. tests/test_hopper_fit.py compiles the kernels for sm_90
and sm_80 with every configuration `config` can return and checks the compiled size against
the limits, so the model cannot drift below what Triton allocates.

The kernel options (options.py: fwd_config, dq_config, dkdv_config, decode_config, dkdv_split)
replace the table's choice for one call; bench.tune times candidates through them. `dkdv_split`
picks how many programs share a KV group's query heads in the dk/dv kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dmattn_ops.core.device import head_block, hint

SM90_SHARED = 232_448  # H100 / H200: cudaDevAttrMaxSharedMemoryPerBlockOptin
SM80_SHARED = 166_912  # A100
KINDS = ("fwd", "dkdv", "dq", "decode")


@dataclass(frozen=True)
class Config:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class Operands:
    """What the kernel loads besides Q/K/V: mask and bias kinds ("none", "key" for one value per
    key broadcast over queries, "entry" for a value per score) and their element sizes. A mask
    "listed" is a "key" mask of a batched call that reads its keys through key lists (gathers
    of K, V and bias rows; tiles.build_key_lists), and "packed" one whose call reads packed
    keys (the lists' launch copies them): contiguous K, V and bias rows in the forward and dq
    kernels."""

    mask: str = "none"
    bias: str = "none"
    itemsize: int = 2
    bias_itemsize: int = 2

    @staticmethod
    def of(query: torch.Tensor, mask, bias, keys: str | None = None) -> Operands:
        """keys: "listed" or "packed" for a batched key-list call (the mask's kind), else None."""
        return Operands(
            keys or _kind(mask),
            _kind(bias),
            query.element_size(),
            bias.element_size() if bias is not None else 2,
        )


def _kind(t) -> str:
    if t is None:
        return "none"
    return "key" if t.shape[-2] == 1 or t.stride(-2) == 0 else "entry"


INTERPRETER_CONFIG = Config(16, 16, 1, 1)


# Windows of at most this many keys (left + right + 1) take narrow-band tiles in dense calls.
NARROW_WINDOW = 256
# Packed key-list calls of at most this many queries take the short lists' tiles (measured at
# Lq 512 and 2048 against 8192 and up; the lists' lengths are unknown on the host).
SHORT_PACKED = 2048


def _table(kind: str, width: int, ops: Operands, lq: int | None, window=None) -> Config:
    """The measured configurations (H100, bf16/fp16); fp32 tiles take twice the memory and get
    narrower key tiles. Decode-sized query tiles shrink to the query length. window: the keys a
    query may see at most, when a window bounds both sides."""
    itemsize, masked = ops.itemsize, ops.mask != "none"
    # Dense tiles (no mask; causal, a window band or none) against masked ones: the causal
    # window of 4096 at L16384 (B1 H32/8 D128) ran its dq kernel in 2.59 ms at (128, 64, 8, 3)
    # against 2.81 at (64, 64, 4, 2). The dk/dv kernel takes (32, 64, 4, 3) everywhere since
    # its 32-row tiles hold 32-bit offsets: dense causal B2 H16 L4096
    # 0.615 ms against 0.749 at (64, 64, 4, 2), B1 H32/8 L16384 9.05 against 9.72, the window
    # of 4096 4.20 against 4.36. Key lists: (32, 128, 8, 3) won on case M (0.262 against 0.277
    # ms) but lost on case C (1.282 against 1.137).
    dense = not masked and ops.bias != "entry" and itemsize <= 2
    if kind == "decode":
        return Config(0, 64, 4, 2 if itemsize > 2 else 3)
    if dense and window is not None and window <= NARROW_WINDOW and width <= 128:
        # A narrow band (GPT-OSS's 128 keys) spans few key tiles per query tile, most of them
        # cut by the band: smaller tiles waste less. `bench.tune W128` (B1 H64/8 L8192 D64,
        # causal window 128), ms, against the general table's: forward 0.157 at (64, 32, 4,
        # 3) against 0.196, dq 0.185 against 0.328, dk/dv 0.288 against 0.370.
        cfg = Config(32, 64, 4, 3) if kind == "dkdv" else Config(64, 32, 4, 3)
    elif kind == "dkdv":
        cfg = Config(32, 32, 4, 1) if width > 128 else Config(32, 64, 4, 3)
    elif kind == "dq":
        if width > 128:
            cfg = Config(32, 32, 4, 1)
        elif ops.mask == "packed" and lq is not None and lq <= SHORT_PACKED:
            # `bench.tune` on packed keys: M 0.129 ms at (64, 32, 4, 2) against 0.134 at
            # (64, 64, 4, 2), M-L512 0.083 against 0.094; C, D and M-L32768 lose 12-17% with it.
            cfg = Config(64, 32, 4, 2)
        else:
            cfg = Config(128, 64, 8, 3) if dense else Config(64, 64, 4, 2)
    elif width <= 64:
        cfg = Config(128, 64, 4, 3)
    elif width <= 128:
        # With a mask, wider key tiles amortise the table lookup and the mask loads. Packed
        # keys read contiguous rows: case M 0.096-0.101 ms at (64, 64, 4, 2) against 0.131 at
        # (128, 128, 8, 2), C 0.443 against 0.465, D 0.901 against 1.004, B1 L32768 top-8192
        # 3.009 against 3.003.
        # Short key lists give each query tile a few key tiles: small tiles. `bench.tune`, the
        # model's calls, gathered: M-L512 (B16 L512, 128 listed keys) 0.058 ms at (64, 32, 4,
        # 3) against 0.084 at (128, 128, 8, 2), M (B4 L2048, 512 keys) 0.114 against 0.123
        # (their dq kernel keeps (64, 64, 4, 2): 0.151 ms on M against 0.170 at (64, 32, 4, 3),
        # which wins on M-L512 by 0.007); packed: M 0.097 against 0.101 at (64,
        # 64, 4, 2), M-L512 0.053 against 0.064, where C, D and M-L32768 lose 5-10%.
        short = lq is not None and lq <= SHORT_PACKED
        if ops.mask == "packed" and not short:
            cfg = Config(64, 64, 4, 2)
        elif ops.mask in ("listed", "packed"):
            cfg = Config(64, 32, 4, 3)
        else:
            cfg = Config(128, 128, 8, 2) if masked else Config(128, 128, 8, 3)
    else:
        cfg = Config(64, 32, 4, 1)
    if itemsize > 2:
        cfg = Config(cfg.block_m, min(cfg.block_n, 64), cfg.num_warps, min(cfg.num_stages, 2))
    if lq is not None and lq < cfg.block_m:
        # A 128-row tile for Lq = 1 would be 127/128 padding.
        block_m = head_block(lq)
        if kind == "dkdv" and itemsize <= 2 and width <= 128:
            # A dk/dv program then steps over one query tile per head: wider key tiles and
            # 2 stages (case E: 1.70 ms against 2.25 for 64-key tiles, 3 stages).
            return Config(block_m, 128, 8, 2)
        cfg = Config(block_m, cfg.block_n, cfg.num_warps, cfg.num_stages)
    return cfg


def _operand_tile(kind: str, rows: int, cols: int, itemsize: int) -> int:
    if kind == "none":
        return 0
    return (rows * cols if kind == "entry" else cols) * itemsize


def shared_bytes(kind: str, cfg: Config, d: int, dv: int, ops: Operands) -> int:
    """Modelled shared memory of one program: num_stages copies of the tiles loaded per loop
    step, plus the tiles resident across the loop."""
    bd = bdv = head_block(max(d, dv))  # launch._head_blocks: both take the larger size
    bm, bn, it = cfg.block_m, cfg.block_n, ops.itemsize
    operands = _operand_tile(ops.mask, bm, bn, 1)
    operands += _operand_tile(ops.bias, bm, bn, ops.bias_itemsize)
    if kind in ("fwd", "dq", "decode"):
        # Per key tile: K, V (and mask/bias); resident: Q (dq: also dO).
        step = bn * (bd + bdv) * it + operands
        resident = bm * bd * it + (bm * bdv * it if kind == "dq" else 0)
    else:
        # dk/dv, per query tile: Q, dO, lse and delta rows (and mask/bias); resident: K, V.
        step = bm * (bd + bdv) * it + 8 * bm + operands
        resident = bn * (bd + bdv) * it
    if kind in ("dkdv", "dq"):
        resident += 2 * bm * bn * it  # P and dS staged for their second MMA
    return cfg.num_stages * step + resident


def fit(kind: str, cfg: Config, d: int, dv: int, ops: Operands, limit: int) -> Config:
    """cfg with fewer pipeline stages, then narrower key tiles, until shared_bytes <= limit."""
    while shared_bytes(kind, cfg, d, dv, ops) > limit and cfg.num_stages > 1:
        cfg = Config(cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages - 1)
    while shared_bytes(kind, cfg, d, dv, ops) > limit and cfg.block_n > 16:
        cfg = Config(cfg.block_m, cfg.block_n // 2, cfg.num_warps, cfg.num_stages)
    return cfg


_LIMITS: dict[int, int] = {}


def shared_limit(device: torch.device) -> int:
    """Shared memory one block may use on device (opt-in maximum), asked of the device once."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _LIMITS:
        props = torch.cuda.get_device_properties(index)
        _LIMITS[index] = getattr(props, "shared_memory_per_block_optin", SM80_SHARED)
    return _LIMITS[index]


def config(
    kind: str,
    d: int,
    dv: int,
    ops: Operands,
    *,
    lq: int | None = None,
    limit: int | None = None,
    interpreter: bool = False,
    window: int | None = None,
) -> Config:
    """The configuration of kernel `kind` ("fwd", "dkdv", "dq", "decode") for these head dims
    and operands that fits `limit` bytes of shared memory (None: no limit). Decode's block_m is
    0: its launcher sizes the query rows itself."""
    if interpreter:
        return INTERPRETER_CONFIG if kind != "decode" else Config(0, 16, 1, 1)
    cfg = _table(kind, max(d, dv), ops, lq, window)
    if limit is None:
        return cfg
    sized = cfg if kind != "decode" else Config(64, cfg.block_n, cfg.num_warps, cfg.num_stages)
    fitted = fit(kind, sized, d, dv, ops, limit)
    return (
        fitted
        if kind != "decode"
        else Config(0, fitted.block_n, fitted.num_warps, fitted.num_stages)
    )


# The dk/dv kernel's programs per SM below which its query heads are split across programs,
# and the float32 scratch the split may take, in units of the query's own bytes.
SPLIT_PROGRAMS_PER_SM = 4
SPLIT_SCRATCH_RATIO = 4
# A key-list call's split leaves each dk/dv program at least this many query tiles to step over
# (its heads times the query tiles of one head).
SPLIT_MIN_STEPS = 32


def dkdv_split(
    g: int,
    programs: int,
    sms: int,
    bytes_per_split: int,
    query_bytes: int,
    *,
    listed: bool = False,
    query_tiles: int | None = None,
    scratch_ratio: int = SPLIT_SCRATCH_RATIO,
) -> int:
    """How many programs share the G query heads of one KV group in the dk/dv kernel (a divisor
    of G): 1 when its grid of `programs` key tiles x (batch, KV head) already holds
    SPLIT_PROGRAMS_PER_SM programs per SM, else the smallest split that reaches it, or the
    largest whose float32 parts (`bytes_per_split` each) stay within `scratch_ratio` times the
    query's bytes (SPLIT_SCRATCH_RATIO unless kernel option dkdv_scratch says otherwise).

    `listed`: a key-list call, whose active tiles are unknown on the host (the list lengths
    are on the GPU) and usually a fraction of `programs` (a top-k mask); the programs of
    unlisted tiles only store zeros. It takes the largest split the scratch allows: at the
    model's B1 L32768 call (top-8192, 512 listed tiles of 2048) split 4 ran dk/dv in 6.03 ms
    against 7.79 unsplit, which counting all tiles chose. Short calls stop
    where a program would step over fewer than SPLIT_MIN_STEPS query tiles (`query_tiles`
    per head): at the model's B16 L512 call (16 query tiles of 32 rows per head) split 2 ran
    dk/dv and its reduce in 0.144 ms, split 4 in 0.168."""
    # Sizes read as their example's under symbolic sizes: the split only changes speed.
    programs, query_tiles = hint(programs), hint(query_tiles)
    bytes_per_split, query_bytes = hint(bytes_per_split), hint(query_bytes)
    split = 1
    for s in range(2, g + 1):
        if not listed and programs * split >= SPLIT_PROGRAMS_PER_SM * sms:
            break
        if listed and query_tiles is not None and (g // s) * query_tiles < SPLIT_MIN_STEPS:
            break
        if g % s == 0 and s * bytes_per_split <= scratch_ratio * query_bytes:
            split = s
    return split
