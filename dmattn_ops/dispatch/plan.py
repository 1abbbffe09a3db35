"""Which route computes each pass of a call, and every decision that goes with it, made once from
the call's `Problem` and `Options` (problem.py): shapes, dtypes, devices and strides, never data
(no host sync). launch.py only executes the plan; `explain` shows it.

The routes, in the order the automatic choice tries them (xformers' fmha dispatch walks its
operators the same way); each answers `reasons(...)`, empty when it can compute the pass:

* EMPTY: no query row or no key; the results are zeros (lse -inf, or the sinks), no launch.
  Taken whenever it applies, whatever the options.
* SDPA: PyTorch's fused cuDNN or FlashAttention kernels (sdpa.py): dense fp16/bf16 calls on
  CUDA, without a window but a causal one that cuDNN's own graphs take (cudnn_graphs.py, with
  the optional cuDNN frontend) or a long one (chunked calls; the rows after the last whole chunk,
  the plan's `tail`, run on our kernels), sinks joined to the fused forward's result; the
  backward also needs no lse gradient and deterministic=False (they accumulate dq with atomics).
* DECODE (forward only): a few queries against a long cache, split over the keys.
* VARLEN: packed sequences (cu_seqlens), our kernels with key lists of a per-token mask.
* KEY_LISTS: a mask shared by all queries (B|1, Hkv|1, 1, Lk), or one per head without GQA:
  the kernels step over the sorted list of its allowed keys (tiles.build_key_lists); with
  `pack`, the forward and dq kernels read those keys' K, V and per-key bias rows copied in list
  order (packed keys); with `hopper`, the pass runs the warp-specialised Gluon kernels of
  hopper.py on them (sm_90; the backward's dQ and dK/dV).
* TILE_TABLES: any mask: tables of the tiles it allows (tiles.build_tables).
* DENSE: no mask: every key tile the band (causality, a window) lets a query tile see.
* PYTORCH: chunked.py, plain PyTorch on any device and dtype; where Triton cannot run (float64,
  CPU without TRITON_INTERPRET=1) the only route.

Plans are cached by the call's signature (Problem.signature, the options, the resolved kernel
options and PyTorch's global switches the routes read), so repeated calls of one shape decide
nothing again; the backward starts from the forward's plan of the same call and re-decides only
what the backward changes (the fused route's conditions, packing, dbias, its kernels' tiles).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch

from dmattn_ops.core import configs, options
from dmattn_ops.core._compat import sdp_priority_order
from dmattn_ops.core.band import Band
from dmattn_ops.core.configs import Config
from dmattn_ops.core.device import hint, symbolic
from dmattn_ops.core.operands import PER_ENTRY, compactable, is_limit, operand_kind
from dmattn_ops.core.problem import Options, Problem
from dmattn_ops.executors import hopper, sdpa
from dmattn_ops.executors._triton import available, interpreter_on

EMPTY, PYTORCH, SDPA, DECODE, VARLEN, KEY_LISTS, TILE_TABLES, DENSE = (
    "empty", "pytorch", "sdpa", "decode", "varlen", "key_lists", "tile_tables", "dense",
)  # fmt: skip
ROUTES = (SDPA, DECODE, VARLEN, KEY_LISTS, TILE_TABLES, DENSE, PYTORCH)
FORWARD, BACKWARD = "forward", "backward"

TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

DECODE_MAX_ROWS = 64  # G * Lq query rows per program of the decode kernel


def triton_runs_on(t: torch.Tensor) -> bool:
    """Whether the Triton kernels can run on t's device (CUDA, or CPU through the interpreter)
    and Triton is installed."""
    return (t.is_cuda or (t.device.type == "cpu" and interpreter_on())) and available()


def use_triton(query: torch.Tensor) -> bool:
    """Whether our Triton kernels can run these tensors at all (dtype and device)."""
    return query.dtype in TRITON_DTYPES and triton_runs_on(query)


def _triton_reasons(query: torch.Tensor) -> list[str]:
    found = []
    if query.dtype not in TRITON_DTYPES:
        found.append(f"{query.dtype}: the Triton kernels take float16, bfloat16, float32")
    if not available():
        found.append("the triton package is not installed")
    elif not (query.is_cuda or (query.device.type == "cpu" and interpreter_on())):
        found.append(f"tensors on {query.device}: Triton runs CUDA, or CPU with TRITON_INTERPRET=1")
    return found


def decode_block_n() -> int:
    """The decode kernel's key tile: a cache must be longer than one to take the decode path."""
    return 16 if interpreter_on() else 64


def config(kind: str, problem: Problem, tuning=None, lq=None, band=None, keys=None) -> Config:
    """The tile config of kernel `kind` for this problem, fitted to the device's shared memory
    (configs.py), or the kernel option's; every config the launchers use comes from here.
    band: the call's window, if any (a narrow band takes smaller tiles); keys: how a batched
    key-list call reads its keys, "listed" (gathers through the lists) or "packed" (packed
    rows), else None."""
    forced = tuning.config(kind) if tuning is not None else None
    if forced is not None:
        return forced if kind != "decode" else Config(0, *_fields(forced)[1:])
    query, mask, bias = problem.query, problem.mask, problem.bias
    if problem.varlen:
        mask = None if mask is None else mask[None, :, None, :]
        bias = None if bias is None else bias[None, :, None, :]
    ops = configs.Operands.of(query, mask, bias, keys)
    interpreted = interpreter_on()
    limit = configs.shared_limit(query.device) if query.is_cuda and not interpreted else None
    window = band.width() if band is not None else None
    return configs.config(  # tile sizes change speed alone: from the example's Lq (hint)
        kind, problem.head_dim, problem.value_dim, ops, lq=hint(lq), limit=limit,
        interpreter=interpreted, window=window,
    )  # fmt: skip


def _fields(cfg: Config) -> tuple[int, int, int, int]:
    return cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages


@dataclass(frozen=True)
class BackwardConfigs:
    """Tile configs of the dk/dv kernel (key tiles of block_n, stepping over query tiles of
    block_m) and of the dq kernel (the reverse); each reads tile tables of its own grid."""

    dkdv: Config
    dq: Config


@dataclass(frozen=True)
class Plan:
    """Every decision of one pass.

    route: above. band: causality and the window as the kernels take them. fused: SDPA's
    kernel ("cudnn", "flash", or sdpa.GRAPHS: a window on cuDNN's own graphs); chunk: a window
    run as chunked fused calls of `chunk` rows, whose last `tail` rows run on our kernels.
    pack: a key-list call copies its keys' rows; hopper: it runs hopper.py's kernels. config:
    the forward (or decode) kernel's tiles; configs: the backward kernels'. heads: query heads
    per forward / dq program (_pack_heads). list_rows: the query positions per tile of the key
    lists a Triton key-list call builds or reads (_list_rows). dbias: how the backward writes
    dbias (DBIAS_MODES) or None. split: the dk/dv split the options force, or None (the
    launcher sizes it).
    tuning: the resolved kernel options. launches: the launch arguments made for this plan, by
    launch site (_triton.prepared); not part of the plan's value.
    """

    route: str
    band: Band
    direction: str = FORWARD
    fused: str | None = None
    chunk: int | None = None
    tail: int = 0
    pack: bool = False
    hopper: bool = False
    config: Config | None = None
    configs: BackwardConfigs | None = None
    heads: int = 1
    list_rows: int | None = None
    dbias: str | None = None
    split: int | None = None
    tuning: options.Tuning | None = None
    launches: dict = field(default_factory=dict, init=False, compare=False, repr=False)


# Packed key-list calls with more queries than this take a KV group's query heads per program
# in the forward and dq kernels (_pack_heads).
PACK_HEADS_MIN_LQ = configs.SHORT_PACKED + 1


def _pack_heads(problem: Problem, cfg: Config, tuning) -> int:
    """How many query heads one program of the forward or dq kernel takes on a packed key-list
    call: G, the KV group's, where the group shares its key list and bias, G divides the
    tile's rows and the call has at least PACK_HEADS_MIN_LQ queries (kernel option
    pack_heads: always, or never); else 1. The G heads then share every K, V and bias tile
    the program loads, at cfg.block_m // G positions per tile. H100 kernel timing, forward /
    dq ms, one head per program against G: B1 L32768 3.17 / 3.55 against 2.94 / 3.37, B1
    L8192 0.234 / 0.298 against 0.223 / 0.285, G = 8 0.915 / 1.064 against 0.845 / 1.021;
    short calls lose in the forward (B4 L2048 0.092 against 0.110, B16 L512 0.053 against
    0.064) and are level in dq."""
    g = problem.groups
    wanted = tuning.pack_heads
    if wanted is None:
        wanted = hint(problem.lq) >= PACK_HEADS_MIN_LQ  # speed only: no guard on a symbolic Lq
    if g == 1 or not wanted or cfg.block_m % g:
        return 1
    # A packed call's mask has one key list per KV group or one in all (tiles.compactable); a
    # bias per query head would differ between the rows of a tile.
    bias = problem.bias
    return 1 if bias is not None and bias.shape[1] == problem.heads else g


# How the backward writes dbias (Plan.dbias), by the bias's shape:
# "group" (B, Hkv, 1, Lk): the dk/dv kernels sum each KV group's heads into dbias itself;
# "cols" any other per-key bias: (B, H, Lk) column sums, then summed to the bias's shape;
# "direct" (B, H, Lq, Lk): the dq kernel writes dS;
# "bcast" a bias with query rows shared over batch or heads: its own kernel (tile tables).
DBIAS_MODES = ("group", "cols", "direct", "bcast")


def _dbias_mode(problem: Problem) -> str:
    bias = problem.bias
    if bias.shape[2] == 1:
        return "group" if bias.shape[:2] == (problem.batch, problem.kv_heads) else "cols"
    full = bias.shape[0] == problem.batch and bias.shape[1] == problem.heads
    return "direct" if full else "bcast"


@dataclass(frozen=True)
class _Pass:
    """What the pass adds to the problem: its direction, a gradient of lse, dbias wanted."""

    direction: str
    grad_lse: bool = False
    dbias: str | None = None
    deterministic: bool = False


class _Fused(NamedTuple):
    """The SDPA route's decisions for one pass (Plan.fused, chunk, tail), or why it cannot take
    the pass (reasons)."""

    kernel: str | None
    chunk: int | None
    tail: int
    reasons: list


_NOT_FUSED = _Fused(None, None, 0, [])


def _sdpa(problem: Problem, opts: Options, tuning, p: _Pass) -> _Fused:
    """The SDPA route for this pass (_Fused)."""
    found = []
    if problem.varlen:
        found.append("packed sequences (cu_seqlens)")
    if p.direction == BACKWARD and p.grad_lse:
        found.append("a gradient of lse: the fused backwards take none")
    if p.direction == BACKWARD and p.deterministic:
        found.append("deterministic: the fused backwards accumulate dq with atomics")
    band = opts.band
    if band.has_window and problem.symbolic:
        # A compiled graph with dynamic shapes: the fused kernels take a window in whole chunks
        # and a tail of the rest, which would guard the graph on L modulo the window.
        found.append("a window with symbolic sizes: the fused kernels take it in chunks of L")
    if found:
        return _Fused(None, None, 0, found)
    query, key, value = problem.query, problem.key, problem.value
    graphs, chunk, found = sdpa.window_route(
        query, key, value, band, tuning.window_min_keys, tuning.cudnn_graphs,
        tuning.graph_window_min_keys,
    )  # fmt: skip
    if found:
        return _Fused(None, None, 0, found)
    which, found = sdpa.choose(problem, opts, tuning.fused_sdpa)
    if which is None or not band.has_window:
        return _Fused(which, None, 0, found)
    backward = p.direction == BACKWARD
    if graphs and sdpa.graphs_take(
        query, key, value, band, which, backward, tuning.graph_window_min_keys
    ):
        return _Fused(sdpa.GRAPHS, None, 0, [])
    if chunk is None:
        return _Fused(None, None, 0, ["cuDNN's graphs do not build this window"])
    return _Fused(which, chunk, query.shape[1] % chunk, [])


def _decode_reasons(problem: Problem, p: _Pass) -> list[str]:
    """Lq <= 16 with the G * Lq rows of a KV group in one tile, a cache longer than one key
    tile, and a mask (if any) with one key list per KV group (head dim 1 or Hkv, no query dim)."""
    if p.direction == BACKWARD:
        return ["the decode kernel is forward only"]
    if problem.varlen:
        return ["packed sequences (cu_seqlens)"]
    found = []
    lq, g = problem.lq, problem.groups
    if symbolic(lq):
        # A graph with dynamic shapes (a decode step's Lq of 1 stays fixed): comparing Lq would
        # guard the graph on it; the other kernels take every Lq.
        found.append(f"Lq {lq} symbolic: decode takes a fixed Lq <= 16")
    elif lq > 16 or g * lq > DECODE_MAX_ROWS:
        found.append(f"Lq {lq} with G {g}: decode takes Lq <= 16, G * Lq <= {DECODE_MAX_ROWS}")
    # Speed only (the kernel computes caches of any length): read without a guard on a
    # symbolic Lk, as a growing cache in a compiled generate loop has.
    if hint(problem.lk) <= decode_block_n():
        found.append(f"Lk {problem.lk}: decode takes caches longer than {decode_block_n()} keys")
    mask = problem.mask
    if mask is not None and not (mask.shape[2] == 1 and (mask.shape[1] != problem.heads or g == 1)):
        found.append("a mask with query rows or per query head under GQA: decode takes key lists")
    if is_limit(mask):
        found.append("a row-limit mask of several query rows: decode tests no row limits")
    return found


def _mask_reasons(route: str, problem: Problem, p: _Pass) -> list[str]:
    """The shape conditions of the three dense-layout Triton routes."""
    if problem.varlen:
        return ["packed sequences (cu_seqlens) take the varlen route"]
    mask = problem.mask
    # A compiled graph with symbolic sizes (registration/inductor.py): the table kernels hold a
    # row of key tiles in one block, sized by the length (a graph per power of two of L / 16),
    # so masks the key lists cannot take are read in the dense kernels instead.
    if route == DENSE:
        if mask is not None and not problem.symbolic:
            return ["a mask: the dense route visits every tile of the band"]
        return []
    if mask is None:
        return ["no mask"]
    if route == TILE_TABLES:
        if problem.symbolic:
            return ["symbolic sizes: the table kernels hold a row of key tiles of a fixed length"]
        return ["a row-limit mask: the key-list route tests its limits"] if is_limit(mask) else []
    found = []
    if not compactable(mask, problem.heads, problem.kv_heads):
        found.append(
            "a mask with query rows, or per query head under GQA: no key list per KV group"
        )
    if p.dbias == "bcast":
        found.append("dbias of a bias with query rows shared over batch or heads needs tile tables")
    return found


def reasons(route: str, problem: Problem, opts: Options, tuning, p: _Pass) -> list[str]:
    """Why `route` cannot compute this pass; empty when it can."""
    if route == SDPA:
        return _sdpa(problem, opts, tuning, p).reasons
    if route == PYTORCH:
        return []
    found = _triton_reasons(problem.query)
    if route == DECODE:
        return found + _decode_reasons(problem, p)
    if route == VARLEN:
        return found + ([] if problem.varlen else ["not packed sequences (no cu_seqlens)"])
    return found + _mask_reasons(route, problem, p)


def _packs(problem: Problem, tuning, p: _Pass) -> bool:
    """Whether a key-list call reads packed keys: the kernel option pack_keys, a bias, if any,
    per key (a bias with query rows is read per score at the keys' own columns), no dbias
    per entry (it needs each score's key index) and no row-limit mask (the kernels read its
    limits at the keys' own columns)."""
    return (
        tuning.pack_keys and operand_kind(problem.bias) != PER_ENTRY and p.dbias != "direct"
        and not is_limit(problem.mask)
    )  # fmt: skip


def _key_reads(route: str, pack: bool) -> str | None:
    """config's `keys` of a call on `route`: how it reads key lists, if it takes them."""
    if route != KEY_LISTS:
        return None
    return "packed" if pack else "listed"


def _choose(problem: Problem, opts: Options, tuning, p: _Pass, first=None) -> tuple[str, _Fused]:
    """(route, the SDPA route's _Fused): the forced route, or the first that applies,
    trying `first` (the forward's route, for a backward) before the others: a route ahead of it
    that refused the forward refuses the backward too."""
    if problem.empty:
        return EMPTY, _NOT_FUSED
    forced = tuning.route
    if forced == DECODE and p.direction == BACKWARD:
        forced = None  # the decode kernel is forward only: its backward plans as without it
    order = ROUTES if first in (None, DECODE) else (first, *ROUTES[ROUTES.index(first) + 1 :])
    for route in (forced,) if forced else order:
        if route == SDPA:
            fused = _sdpa(problem, opts, tuning, p)
            found = fused.reasons
        else:
            fused, found = _NOT_FUSED, reasons(route, problem, opts, tuning, p)
        if not found:
            return route, fused
        if forced:
            raise ValueError(
                f"dmattn: kernel option route={forced!r} cannot compute this call's "
                f"{p.direction}: " + "; ".join(found)
            )
    raise AssertionError("the pytorch route computes every call")


def _plan(problem: Problem, opts: Options, tuning, p: _Pass, first: str | None) -> Plan:
    band = opts.band
    route, (fused, chunk, tail, _) = _choose(problem, opts, tuning, p, first)
    if route in (EMPTY, PYTORCH, SDPA, DECODE, VARLEN):
        plan = Plan(route, band, p.direction, fused, chunk, tail, tuning=tuning)
        if route == DECODE:
            plan = replace(plan, config=config("decode", problem, tuning, problem.lq))
        if route == VARLEN:
            lq = min(hint(problem.max_seqlen_q), hint(problem.lq))  # for the configs alone
            if p.direction == FORWARD:
                plan = replace(plan, config=config("fwd", problem, tuning, lq))
            else:
                dkdv = config("dkdv", problem, tuning, lq)
                plan = replace(
                    plan, configs=BackwardConfigs(dkdv, config("dq", problem, tuning, lq))
                )
        return plan
    pack = route == KEY_LISTS and _packs(problem, tuning, p)
    keys = _key_reads(route, pack)
    on_hopper = pack and not hopper.reasons(
        problem, band, opts.softcap, p.dbias, tuning.hopper, p.direction == FORWARD, p.grad_lse
    )
    lq = problem.lq
    listed = route == KEY_LISTS and not on_hopper  # its lists' tiles: _list_rows
    forward = p.direction == FORWARD
    # Each pass's own kernels' tiles, and with key lists the other pass's too (_list_rows).
    fwd = config("fwd", problem, tuning, lq, band, keys) if forward or listed else None
    dq = config("dq", problem, tuning, lq, band, keys) if not forward or listed else None
    rows = _list_rows(problem, tuning, pack, fwd, dq) if listed else None
    if forward:
        heads = _pack_heads(problem, fwd, tuning) if pack and not on_hopper else 1
        return Plan(route, band, FORWARD, pack=pack, hopper=on_hopper, config=fwd, heads=heads,
                    list_rows=rows, tuning=tuning)  # fmt: skip
    cfgs = BackwardConfigs(config("dkdv", problem, tuning, lq, band, keys), dq)
    heads = _pack_heads(problem, cfgs.dq, tuning) if pack and not on_hopper else 1
    return Plan(
        route, band, BACKWARD, pack=pack, hopper=on_hopper, configs=cfgs, heads=heads,
        list_rows=rows, dbias=p.dbias, split=tuning.dkdv_split, tuning=tuning,
    )  # fmt: skip


def _list_rows(problem: Problem, tuning, pack: bool, fwd: Config, dq: Config) -> int:
    """The query positions per tile of a Triton key-list call's lists: the finer of the
    forward's and the dQ kernel's (powers of two, so it divides both), each kernel reading its
    tile's ends from those of its list tiles (kernels/common.py key_tile_bounds, LIST_R). One
    build then serves both passes, where lists made for one tiling could not serve the other:
    on an H200 a D64 forward takes 128-row tiles and its dQ 64, a D256 one 16 and 8, and the
    backward built its lists again (one key_lists launch, seven buffers and the packed rows
    copied again). (The Hopper kernels read lists of hopper.BLOCK_M rows.)"""

    def positions(cfg: Config) -> int:
        return cfg.block_m // (_pack_heads(problem, cfg, tuning) if pack else 1)

    return min(positions(fwd), positions(dq))


_CACHE: dict = {}
_CACHE_SIZE = 512
calls = {"decided": 0}  # plans made (not taken from the cache): tests count them


def _globals() -> tuple:
    """PyTorch's switches the routes read: SDPA's backends and the order SDPA tries them in
    (the fused kernel is the one SDPA would pick), deterministic algorithms."""
    backends = torch.backends.cuda
    return (
        backends.flash_sdp_enabled(), backends.cudnn_sdp_enabled(),
        backends.mem_efficient_sdp_enabled(), backends.math_sdp_enabled(),
        sdp_priority_order(), torch.are_deterministic_algorithms_enabled(), interpreter_on(),
    )  # fmt: skip


def _pass(problem: Problem, opts: Options, direction: str, grad_lse: bool, compute_dbias: bool):
    deterministic = opts.deterministic or torch.are_deterministic_algorithms_enabled()
    backward = direction == BACKWARD
    # Packed sequences write dbias per key token, their one mode (launch._varlen_backward).
    dbias = _dbias_mode(problem) if backward and compute_dbias and not problem.varlen else None
    return _Pass(direction, grad_lse and backward, dbias, deterministic and backward)


def plan(
    problem: Problem,
    opts: Options,
    direction: str = FORWARD,
    *,
    grad_lse: bool = False,
    compute_dbias: bool = False,
) -> Plan:
    """The plan of one pass of this (validated, broadcast-collapsed) call. The backward's
    grad_lse says whether a gradient of lse arrives, compute_dbias whether dbias is wanted.
    Made once per call signature and pass (module docstring)."""
    tuning = options.tuning(opts.kernel)
    p = _pass(problem, opts, direction, grad_lse, compute_dbias)
    signature = problem.signature()
    key = None
    if signature is not None:
        key = (signature, opts, tuning, p, _globals())
        found = _CACHE.get(key)
        if found is not None:
            return found
    first = None
    if direction == BACKWARD and key is not None:
        forward = _CACHE.get((signature, opts, tuning, _Pass(FORWARD), key[-1]))
        first = forward.route if forward is not None else None
    calls["decided"] += 1
    made = _plan(problem, opts, tuning, p, first)
    if key is not None:
        if len(_CACHE) >= _CACHE_SIZE:
            _CACHE.clear()
        _CACHE[key] = made
    return made


_FUSED: dict = {}
_UNDECIDED = object()


def fused_kernel(problem: Problem, opts: Options, both: bool) -> tuple[str | None, bool]:
    """(kernel, native): the fused kernel (sdpa.CUDNN or sdpa.FLASH) where the plan puts this
    dense call's forward, and with `both` its backward on the same kernel, None where it puts
    either elsewhere; native: that kernel is the one scaled_dot_product_attention itself picks
    (sdpa.picks). The eager fast path (api._fused_eager) reads this one cached answer, keyed as
    the plans are, instead of looking up both plans."""
    signature = problem.signature()
    key = None
    if signature is not None:
        key = (signature, opts, both, options.tuning(opts.kernel), _globals())
        found = _FUSED.get(key, _UNDECIDED)
        if found is not _UNDECIDED:
            return found
    forward = plan(problem, opts)
    fused = (sdpa.CUDNN, sdpa.FLASH)
    found = forward.fused if forward.route == SDPA and forward.fused in fused else None
    if found is not None and both:
        backward = plan(problem, opts, BACKWARD)
        if backward.route != SDPA or backward.fused != found:
            found = None
    native = found is not None and sdpa.picks(
        problem.query, problem.key, problem.value, opts.is_causal, found
    )
    found = (found, native)
    if key is not None:
        if len(_FUSED) >= _CACHE_SIZE:
            _FUSED.clear()
        _FUSED[key] = found
    return found


def explain(
    problem: Problem, opts: Options, direction: str, *, grad_lse=False, compute_dbias=False
) -> dict:
    """{route: reasons} for every route of this pass: an empty list where the route could
    compute it."""
    tuning = options.tuning(opts.kernel)
    p = _pass(problem, opts, direction, grad_lse, compute_dbias)
    if problem.empty:
        return {route: ["an empty call (no query row or no key) runs no route"] for route in ROUTES}
    return {route: reasons(route, problem, opts, tuning, p) for route in ROUTES}


@dataclass(frozen=True)
class PassExplanation:
    """One pass: the plan made (None where the kernel options force a route that cannot run
    it: `error` is then what the call would raise), and for every route the reasons it could
    not run the pass (empty where it could)."""

    plan: Plan | None
    reasons: dict
    error: str | None = None

    @property
    def route(self) -> str | None:
        return None if self.plan is None else self.plan.route


@dataclass(frozen=True)
class Explanation:
    """What `dmattn_ops.explain` returns: the backend, and each pass's PassExplanation (None for
    the "reference" and "flex" backends, which run no route of ours)."""

    backend: str
    forward: PassExplanation | None
    backward: PassExplanation | None

    def __str__(self) -> str:
        if self.forward is None:
            return f"backend {self.backend!r}: computed by {self.backend}.py, no route of ours"
        lines = []
        for name, part in ((FORWARD, self.forward), (BACKWARD, self.backward)):
            if part.plan is None:
                lines.append(f"{name}: raises {part.error}")
            else:
                lines.append(f"{name}: {part.route}" + _details(part.plan))
            for route, found in part.reasons.items():
                if route == part.route:
                    continue
                why = "could run, but comes later in the order" if not found else "; ".join(found)
                lines.append(f"  {route}: {why}")
        return "\n".join(lines)


def _details(p: Plan) -> str:
    shown = []
    if p.fused:
        shown.append(f"fused {p.fused}")
    if p.chunk:
        shown.append(f"chunks of {p.chunk} rows, {p.tail} tail rows on ours")
    if p.pack:
        shown.append("packed keys")
    if p.hopper:
        shown.append("Hopper kernels")
    if p.heads > 1:
        shown.append(f"{p.heads} heads per program")
    if p.list_rows:
        shown.append(f"key lists of {p.list_rows}-position tiles")
    if p.dbias:
        shown.append(f"dbias {p.dbias}")
    if p.config is not None:
        shown.append(f"tiles {_fields(p.config)}")
    if p.configs is not None:
        shown.append(f"dq tiles {_fields(p.configs.dq)}, dk/dv tiles {_fields(p.configs.dkdv)}")
    return f" ({', '.join(shown)})" if shown else ""


def explanation(
    problem: Problem, opts: Options, backend="auto", *, grad_lse=False, compute_dbias=False
) -> Explanation:
    """The Explanation of both passes of this call (see dmattn_ops.explain)."""

    def one(problem: Problem, direction: str, **args) -> PassExplanation:
        found = explain(problem, opts, direction, **args)
        try:
            return PassExplanation(plan(problem, opts, direction, **args), found)
        except ValueError as refused:
            return PassExplanation(None, found, str(refused))

    args = dict(grad_lse=grad_lse, compute_dbias=compute_dbias)
    return Explanation(
        backend,
        one(problem.collapsed(), FORWARD),
        one(problem.collapsed(grad_bias=compute_dbias), BACKWARD, **args),
    )
