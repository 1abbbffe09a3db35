"""Which path computes a call, decided once per call from its operands' shapes, dtypes and
devices (no data is read, no host sync). launch.py runs the plan; tests check the choice.

The paths, in the order they are tried:

* EMPTY: no query row or no key; the results are zeros (lse -inf), with no launch.
* PYTORCH: chunked.py, where Triton cannot run (float64, CPU without TRITON_INTERPRET=1).
* SDPA: PyTorch's fused cuDNN or FlashAttention kernels (sdpa.py): dense fp16/bf16 calls on
  CUDA, without a window but a causal one that cuDNN's own graphs take (cudnn_graphs.py, with
  the optional cuDNN frontend) or a long one (sdpa.window_chunk: chunked calls; the rows after
  the last whole chunk run on our kernels), sinks joined to the fused forward's result;
  the backward also needs no lse gradient and deterministic=False (they accumulate dq with
  atomics).
* DECODE (forward only): a few queries against a long cache, split over the keys.
* KEY_LISTS: a mask shared by all queries (B|1, Hkv|1, 1, Lk), or one per head without GQA:
  the kernels step over the sorted list of its allowed keys (tiles.build_key_lists); with
  `pack`, the forward and dq kernels read those keys' K, V and per-key bias rows copied in list
  order (packed keys); with `hopper`, the forward and the dK/dV pass run the warp-specialised
  Gluon kernels of hopper.py on them (sm_90).
* TILE_TABLES: any other mask: tables of the tiles it allows (tiles.build_tables).
* DENSE: no mask: every key tile the band (causality, a window) lets a query tile see.

The tile configs (configs.py) are chosen here too, from the path: a key-list call's tiles
depend on whether it packs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dmattn_ops import configs, hopper, sdpa
from dmattn_ops._triton import available, interpreter_on
from dmattn_ops.configs import Config
from dmattn_ops.tiles import PER_ENTRY, Band, compactable, operand_kind
from dmattn_ops.validate import NO_WINDOW

EMPTY, PYTORCH, SDPA, DECODE, KEY_LISTS, TILE_TABLES, DENSE = (
    "empty", "pytorch", "sdpa", "decode", "key_lists", "tile_tables", "dense",
)  # fmt: skip

TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# Whether batched key-list calls pack K, V and a per-key bias for the forward and dq kernels
# (tiles.build_key_lists packs them in the launch that builds the lists); False keeps them on
# gathers through the lists (tests of that path).
PACK_KEYS = True

DECODE_MAX_ROWS = 64  # G * Lq query rows per program of the decode kernel


def triton_runs_on(t: torch.Tensor) -> bool:
    """Whether the Triton kernels can run on t's device (CUDA, or CPU through the interpreter)
    and Triton is installed."""
    return (t.is_cuda or (t.device.type == "cpu" and interpreter_on())) and available()


def use_triton(query: torch.Tensor) -> bool:
    """The one place where a call chooses between our Triton kernels and chunked PyTorch."""
    return query.dtype in TRITON_DTYPES and triton_runs_on(query)


def _packs(bias) -> bool:
    """Whether a key-list call reads packed keys: PACK_KEYS, and a bias, if any, per key (a bias
    with query rows is read per score at the keys' own columns)."""
    return PACK_KEYS and operand_kind(bias) != PER_ENTRY


def decode_block_n() -> int:
    """The decode kernel's key tile: a cache must be longer than one to take the decode path."""
    return 16 if interpreter_on() else 64


def decode_applies(lq: int, h: int, hkv: int, lk: int, mask) -> bool:
    """Lq <= 16 with the G * Lq rows of a KV group in one tile, a cache longer than one key
    tile, and a mask (if any) with one key list per KV group (head dim 1 or Hkv, no query dim)."""
    g = h // hkv
    if lq > 16 or g * lq > DECODE_MAX_ROWS or lk <= decode_block_n():
        return False
    return mask is None or (mask.shape[2] == 1 and (mask.shape[1] != h or g == 1))


def config(
    kind: str, query, value, mask, bias, lq: int | None = None, band=None, keys=None
) -> Config:
    """The tile config of kernel `kind` for these operands, fitted to the device's shared memory
    (configs.py); every config the launchers use comes from here. band: the call's window, if
    any (a narrow band takes smaller tiles); keys: how a batched key-list call reads its keys,
    "listed" (gathers through the lists) or "packed" (packed rows), else None."""
    d, dv = query.shape[-1], value.shape[-1]
    ops = configs.Operands.of(query, mask, bias, keys)
    interpreted = interpreter_on()
    limit = configs.shared_limit(query.device) if query.is_cuda and not interpreted else None
    window = band.width() if band is not None else None
    return configs.config(
        kind, d, dv, ops, lq=lq, limit=limit, interpreter=interpreted, window=window
    )


@dataclass(frozen=True)
class BackwardConfigs:
    """Tile configs of the dk/dv kernel (key tiles of block_n, stepping over query tiles of
    block_m) and of the dq kernel (the reverse); each reads tile tables of its own grid."""

    dkdv: Config
    dq: Config


def backward_configs(query, value, mask, bias, lq: int, band=None, keys=None):
    """The dk/dv and dq kernels' configs (arguments as for `config`)."""
    return BackwardConfigs(
        config("dkdv", query, value, mask, bias, lq, band, keys),
        config("dq", query, value, mask, bias, lq, band, keys),
    )


def _key_reads(path: str, pack: bool) -> str | None:
    """config's `keys` of a call on `path`: how it reads key lists, if it takes them."""
    if path != KEY_LISTS:
        return None
    return "packed" if pack else "listed"


def _first_paths(
    query, key, value, mask, bias, is_causal, softcap, seqused_k, band, fusable, backward
):  # fmt: skip
    """(path, SDPA's kernel) where EMPTY, PYTORCH or SDPA applies, the paths both passes try
    first, else (None, None). fusable: this pass could take PyTorch's fused kernels at all;
    backward: the pass is the backward (a window's cuDNN graph is checked per pass)."""
    b, lq, h, _ = query.shape
    if b * lq * h == 0 or key.shape[1] == 0:
        return EMPTY, None
    if not use_triton(query):
        return PYTORCH, None
    if fusable and sdpa.may_take(query, key, band):
        fused = sdpa.kernel(query, key, value, mask, bias, is_causal, softcap, seqused_k)
        if fused:
            fused = sdpa.route(query, key, value, band, fused, backward)
        if fused:
            return SDPA, fused
    return None, None


def _mask_path(mask, h: int, hkv: int) -> str:
    if mask is None:
        return DENSE
    return KEY_LISTS if compactable(mask, h, hkv) else TILE_TABLES


@dataclass(frozen=True)
class ForwardPlan:
    """path (above); band: causality and the window as the kernels take them; fused: SDPA's
    kernel ("cudnn" or "flash", or sdpa.GRAPHS: a window on cuDNN's own graphs); pack: a
    key-list call copies its keys' rows; hopper: a packed key-list call runs hopper.py's
    forward; config: the forward kernel's tiles (Triton paths but DECODE, whose launcher picks
    its own); heads: query heads per forward program (_pack_heads)."""

    path: str
    band: Band
    fused: str | None = None
    pack: bool = False
    hopper: bool = False
    config: Config | None = None
    heads: int = 1


# Packed key-list calls with more queries than this take a KV group's query heads per program
# in the forward and dq kernels (_pack_heads).
PACK_HEADS_MIN_LQ = configs.SHORT_PACKED + 1


def _pack_heads(lq: int, h: int, hkv: int, mask, bias, cfg: Config) -> int:
    """How many query heads one program of the forward or dq kernel takes on a packed key-list
    call: G, the KV group's, where the group shares its key list and bias, G divides the
    tile's rows and the call has at least PACK_HEADS_MIN_LQ queries; else 1. The G heads then
    share every K, V and bias tile the program loads, at cfg.block_m // G positions per tile.
    Kernel timing on the H100 (bench/NOTES.md 79), forward / dq ms, one head per program
    against G: the model's B1 L32768 call 3.17 / 3.55 against 2.94 / 3.37, B1 L8192 0.234 /
    0.298 against 0.223 / 0.285, case D (G = 8) 0.915 / 1.064 against 0.845 / 1.021; its
    short calls lose in the forward (B4 L2048 0.092 against 0.110, B16 L512 0.053 against
    0.064) and are level in dq."""
    g = h // hkv
    if g == 1 or lq < PACK_HEADS_MIN_LQ or cfg.block_m % g:
        return 1
    # A packed call's mask has one key list per KV group or one in all (tiles.compactable); a
    # bias per query head would differ between the rows of a tile.
    return 1 if bias is not None and bias.shape[1] == h else g


def forward_plan(
    query, key, value, mask, bias, is_causal, softcap, seqused_k, window=NO_WINDOW, sinks=None
) -> ForwardPlan:
    """The plan of an attention forward on these (already validated, broadcast-collapsed)
    operands."""
    lq, h = query.shape[1], query.shape[2]
    lk, hkv = key.shape[1], key.shape[2]
    band = Band.of(is_causal, window)
    args = (query, key, value, mask, bias, is_causal, softcap, seqused_k, band)
    path, fused = _first_paths(*args, fusable=True, backward=False)
    if path:
        return ForwardPlan(path, band, fused=fused)
    if decode_applies(lq, h, hkv, lk, mask):
        return ForwardPlan(DECODE, band)
    path = _mask_path(mask, h, hkv)
    pack = path == KEY_LISTS and _packs(bias)
    on_hopper = pack and hopper.applies(
        query, key, value, bias, is_causal, softcap, seqused_k, band, sinks, None
    )
    cfg = config("fwd", query, value, mask, bias, lq, band, _key_reads(path, pack))
    heads = _pack_heads(lq, h, hkv, mask, bias, cfg) if pack and not on_hopper else 1
    return ForwardPlan(path, band, pack=pack, hopper=on_hopper, config=cfg, heads=heads)


# How the backward writes dbias (BackwardPlan.dbias), by the bias's shape:
# "group" (B, Hkv, 1, Lk): the dk/dv kernels sum each KV group's heads into dbias itself;
# "cols" any other per-key bias: (B, H, Lk) column sums, then summed to the bias's shape;
# "direct" (B, H, Lq, Lk): the dq kernel writes dS;
# "bcast" a bias with query rows shared over batch or heads: its own kernel (tile tables).
DBIAS_MODES = ("group", "cols", "direct", "bcast")


def _dbias_mode(bias, b: int, hkv: int, h: int) -> str:
    if bias.shape[2] == 1:
        return "group" if bias.shape[:2] == (b, hkv) else "cols"
    return "direct" if bias.shape[0] == b and bias.shape[1] == h else "bcast"


@dataclass(frozen=True)
class BackwardPlan:
    """path (above); band; fused: SDPA's kernel; dbias: DBIAS_MODES or None (no dbias); pack:
    the dq kernel reads packed keys; hopper: the dK/dV pass runs hopper.py's kernel on them;
    configs: the dk/dv and dq kernels' tiles (Triton paths); heads: query heads per dq
    program (_pack_heads)."""

    path: str
    band: Band
    fused: str | None = None
    dbias: str | None = None
    pack: bool = False
    hopper: bool = False
    configs: BackwardConfigs | None = None
    heads: int = 1


def backward_plan(
    query, key, value, mask, bias, is_causal, softcap, seqused_k, grad_lse, deterministic,
    compute_dbias, window=NO_WINDOW, sinks=None,
):  # fmt: skip
    """The plan of an attention backward on these (broadcast-collapsed) operands. A gradient of
    lse or deterministic=True (or torch's deterministic algorithms) keeps dense calls off SDPA.
    A bias with query rows shared over batch or heads (dbias "bcast") keeps the mask on tile
    tables; a dbias per entry ("direct") needs each score's key index: no packing."""
    b, lq, h, _ = query.shape
    hkv = key.shape[2]
    band = Band.of(is_causal, window)
    deterministic = deterministic or torch.are_deterministic_algorithms_enabled()
    args = (query, key, value, mask, bias, is_causal, softcap, seqused_k, band)
    path, fused = _first_paths(*args, fusable=grad_lse is None and not deterministic, backward=True)
    if path:
        return BackwardPlan(path, band, fused=fused)
    dbias = _dbias_mode(bias, b, hkv, h) if compute_dbias else None
    path = _mask_path(mask, h, hkv)
    if path == KEY_LISTS and dbias == "bcast":
        path = TILE_TABLES
    pack = path == KEY_LISTS and _packs(bias) and dbias != "direct"
    on_hopper = pack and hopper.applies(
        query, key, value, bias, is_causal, softcap, seqused_k, band, sinks, dbias
    )
    cfgs = backward_configs(query, value, mask, bias, lq, band, _key_reads(path, pack))
    heads = _pack_heads(lq, h, hkv, mask, bias, cfgs.dq) if pack else 1
    return BackwardPlan(
        path, band, dbias=dbias, pack=pack, hopper=on_hopper, configs=cfgs, heads=heads
    )
