"""Kernel options: how a call is computed, never what it computes.

`KernelOptions` is the documented set of knobs (as FlexAttention's ``FlexKernelOptions``): force a
route, switch a fused path on or off, override a kernel's tiles or the dk/dv split. Every
option changes speed only; every route computes the same function or refuses the call with its
reasons (plan.py, ``dmattn_ops.explain``).

They reach a call three ways, later ones winning:

1. the documented environment switches (``DMATTN_DENSE_SDPA``, ``DMATTN_CUDNN_GRAPHS``,
   ``DMATTN_HOPPER``; "0", "false", "off", "no" mean off), read per call;
2. the ``kernel_options(...)`` context manager, for tests and benchmarks: calls planned while
   it is active (eager calls, and compiled graphs traced while it is active) take its options;
3. ``attention(..., kernel_options={...})``: the options travel through the op schemas as one
   canonical string (`encode`), so a compiled graph carries them as a constant.

`tuning` resolves the three into one frozen `Tuning`, the value the planner reads.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import TypedDict

from dmattn_ops.core.configs import SPLIT_SCRATCH_RATIO, Config
from dmattn_ops.core.switches import getenv, switch

ROUTES = ("pytorch", "sdpa", "decode", "key_lists", "tile_tables", "dense", "varlen")
CONFIG_KINDS = ("fwd", "dq", "dkdv", "decode")


# Windows of fewer keys stay on our kernels, which are faster there: the copies and the merge
# cost the same per row whatever the window, and the fused kernels' work shrinks with it. H100,
# B1 L16384 H32/8 D128, fwd+bwd ms chunked / ours: window 4096 7.69 / 9.33, 2048 5.15 / 5.43,
# 1024 3.83 / 3.20, 512 3.29 / 2.11. Kernel option window_min_keys replaces it
# (executors/sdpa.py window_chunk).
WINDOW_MIN_KEYS = 2048

# Narrower windows stay off cuDNN's own window graphs: their kernels are short, and a graph's run
# costs more host time than our launch (H100, op fwd+bwd ms, graphs / ours: B1 L16384 H32/8 D128
# window 128 1.354 / 1.305, 512 1.691 / 1.982; GPT-OSS's B1 L8192 H64/8 D64 window 128,
# compiled, 1.10 / 0.69-0.86). Kernel option graph_window_min_keys replaces it
# (executors/cudnn_graphs.py window_of).
GRAPH_WINDOW_MIN_KEYS = 512


class KernelOptions(TypedDict, total=False):
    """Options of one call's kernels (all optional; absent means the library's choice).

    route: force each pass onto one route: "pytorch" (chunked PyTorch, any device), "sdpa"
        (PyTorch's fused cuDNN / FlashAttention kernels), "decode" (split-key forward for a
        few queries; the backward plans as without it), "key_lists", "tile_tables", "dense"
        (our Triton kernels by how they visit the mask), "varlen" (packed sequences). A route
        that cannot compute the call raises ValueError with its reasons; an empty call
        (no query row or no key) needs no route and ignores it.
    fused_sdpa: let dense fp16/bf16 CUDA calls take PyTorch's fused kernels (default True;
        environment DMATTN_DENSE_SDPA).
    cudnn_graphs: let causal windows take cuDNN's own graphs (default True; DMATTN_CUDNN_GRAPHS).
    hopper: run packed key-list calls on the Gluon sm_90 kernels: True both passes wherever
        they apply, False never, default: both passes of calls of at least 8192 keys
        (executors/hopper.py FORWARD_MIN_LK, BACKWARD_MIN_LK; DMATTN_HOPPER=1 / 0 set True /
        False).
    pack_keys: key-list calls copy their keys' K, V and per-key bias rows in list order for
        the forward and dq kernels (default True).
    pack_heads: a packed key-list call's forward and dq programs take a KV group's query heads
        together: True wherever the shapes allow, False never (default: from Lq).
    window_min_keys: causal windows of at least this many keys run as chunked fused calls
        (default 2048).
    graph_window_min_keys: causal windows of at least this many keys may run on cuDNN's own
        window graphs (default 512).
    dkdv_split: programs sharing a KV group's query heads in the dk/dv kernel, a divisor of G.
    dkdv_scratch: where the library sizes that split, its float32 scratch stays within this
        many times the call's query bytes (default 4); context parallelism's ring passes 2.
    fwd_config, dq_config, dkdv_config, decode_config: (block_m, block_n, num_warps,
        num_stages) for that kernel instead of the table's (decode's block_m is ignored).
    """

    route: str
    fused_sdpa: bool
    cudnn_graphs: bool
    hopper: bool
    pack_keys: bool
    pack_heads: bool
    window_min_keys: int
    graph_window_min_keys: int
    dkdv_split: int
    dkdv_scratch: int
    fwd_config: tuple[int, int, int, int]
    dq_config: tuple[int, int, int, int]
    dkdv_config: tuple[int, int, int, int]
    decode_config: tuple[int, int, int, int]


_BOOLS = ("fused_sdpa", "cudnn_graphs", "hopper", "pack_keys", "pack_heads")
_INTS = ("window_min_keys", "graph_window_min_keys", "dkdv_split", "dkdv_scratch")
_CONFIGS = tuple(f"{kind}_config" for kind in CONFIG_KINDS)
_KEYS = ("route", *_BOOLS, *_INTS, *_CONFIGS)


@dataclass(frozen=True)
class Tuning:
    """Resolved kernel options (KernelOptions' fields; None: the library decides)."""

    route: str | None = None
    fused_sdpa: bool = True
    cudnn_graphs: bool = True
    hopper: bool | None = None
    pack_keys: bool = True
    pack_heads: bool | None = None
    window_min_keys: int = WINDOW_MIN_KEYS
    graph_window_min_keys: int = GRAPH_WINDOW_MIN_KEYS
    dkdv_split: int | None = None
    dkdv_scratch: int = SPLIT_SCRATCH_RATIO
    fwd_config: Config | None = None
    dq_config: Config | None = None
    dkdv_config: Config | None = None
    decode_config: Config | None = None

    def config(self, kind: str) -> Config | None:
        return getattr(self, f"{kind}_config")


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _checked(name: str, value, fn: str):
    """The option's value in Tuning's form, or a ValueError / TypeError naming it."""
    if name not in _KEYS:
        raise ValueError(f"{fn}: unknown kernel option {name!r}; the options are {list(_KEYS)}")
    if name == "route":
        if value not in ROUTES:
            raise ValueError(
                f"{fn}: kernel_options['route'] must be one of {ROUTES}, got {value!r}"
            )
        return value
    if name in _BOOLS:
        if not isinstance(value, bool):
            raise TypeError(f"{fn}: kernel_options[{name!r}] must be a bool, got {value!r}")
        return value
    if name in _INTS:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(
                f"{fn}: kernel_options[{name!r}] must be a positive int, got {value!r}"
            )
        return value
    if (
        not isinstance(value, (tuple, list, Config))
        or len(tuple(_fields(value))) != 4
        or not all(isinstance(n, int) and not isinstance(n, bool) for n in _fields(value))
    ):
        raise TypeError(
            f"{fn}: kernel_options[{name!r}] must be (block_m, block_n, num_warps, num_stages) "
            f"ints, got {value!r}"
        )
    block_m, block_n, warps, stages = _fields(value)
    blocks_ok = _power_of_two(block_n) and block_n >= 16
    blocks_ok = blocks_ok and (
        name == "decode_config" or (_power_of_two(block_m) and block_m >= 16)
    )
    if not blocks_ok or warps not in (1, 2, 4, 8, 16) or stages < 1:
        raise ValueError(
            f"{fn}: kernel_options[{name!r}] = {tuple(_fields(value))}: block_m and block_n "
            "must be powers of two >= 16, num_warps one of 1, 2, 4, 8, 16, num_stages >= 1"
        )
    return Config(block_m, block_n, warps, stages)


def _fields(value):
    if isinstance(value, Config):
        return (value.block_m, value.block_n, value.num_warps, value.num_stages)
    return tuple(value)


def check(options, fn: str = "dmattn.attention") -> dict:
    """options (a KernelOptions dict or None) validated: {name: Tuning's value}."""
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise TypeError(
            f"{fn}: kernel_options must be a dict (KernelOptions) or None, got {options!r}"
        )
    return {name: _checked(name, value, fn) for name, value in options.items()}


def _text(value) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, Config):
        return "x".join(str(n) for n in _fields(value))
    return str(value)


def encode(options, fn: str = "dmattn.attention") -> str | None:
    """The canonical string of a KernelOptions dict, as the op schemas carry it ("name=value"
    pairs in name order, joined by ","), or None for no options."""
    checked = check(options, fn)
    if not checked:
        return None
    return ",".join(f"{name}={_text(checked[name])}" for name in sorted(checked))


def _parse(name: str, text: str, fn: str):
    if name == "route":
        return _checked(name, text, fn)
    if name in _BOOLS:
        if text not in ("0", "1"):
            raise ValueError(f"{fn}: kernel option {name}={text!r} is not 0 or 1")
        return text == "1"
    try:
        numbers = tuple(int(n) for n in text.split("x"))
    except ValueError:
        raise ValueError(f"{fn}: kernel option {name}={text!r} is not a number") from None
    return _checked(name, numbers[0] if name in _INTS and len(numbers) == 1 else numbers, fn)


_DECODED: dict[str, dict] = {}


def decode(encoded: str | None, fn: str = "dmattn::attention") -> dict:
    """encode's inverse: {name: Tuning's value}, checked (the ops take strings from anyone)."""
    if not encoded:
        return {}
    found = _DECODED.get(encoded)
    if found is None:
        found = {}
        for pair in encoded.split(","):
            name, sep, text = pair.partition("=")
            if not sep:
                raise ValueError(f"{fn}: kernel options {encoded!r}: {pair!r} is not name=value")
            found[name] = _parse(name, text, fn)
        _DECODED[encoded] = found
    return found


def without_route(encoded: str | None) -> str | None:
    """The encoded options less a forced route (for a part of a call that another route runs,
    as the rows after a chunked window's last whole chunk)."""
    if not encoded:
        return encoded
    kept = {name: value for name, value in decode(encoded).items() if name != "route"}
    return ",".join(f"{name}={_text(kept[name])}" for name in sorted(kept)) or None


_ACTIVE: list[dict] = []


@contextlib.contextmanager
def kernel_options(**options):
    """Calls planned inside take these KernelOptions (nested blocks merge, inner wins; a call's
    own ``kernel_options=`` wins over both). For tests and benchmarks::

        with dmattn_ops.kernel_options(route="tile_tables", fwd_config=(32, 32, 4, 1)):
            out = dmattn_ops.attention(q, k, v, mask)
    """
    checked = check(options, "dmattn_ops.kernel_options")
    _ACTIVE.append(checked)
    try:
        yield
    finally:
        _ACTIVE.pop()
        _TUNINGS.clear()


def _blocks() -> dict:
    """The active kernel_options blocks merged, inner wins."""
    merged: dict = {}
    for layer in _ACTIVE:
        merged.update(layer)
    return merged


def with_active(options) -> dict:
    """The active kernel_options blocks merged with `options` (a KernelOptions dict or None,
    which wins over them), checked: what a call planned now would take."""
    return {**_blocks(), **check(options)}


def blocks_active() -> bool:
    """Whether any kernel_options block is in force (read while Dynamo traces, a guard)."""
    return len(_ACTIVE) > 0


# The switches Tuning's defaults come from (tuning), and with Inductor's own, those a compiled
# graph's kernels depend on: the launchers and Inductor's lowering read them below the op,
# where Dynamo does not see them.
_SWITCHES = ("DMATTN_DENSE_SDPA", "DMATTN_CUDNN_GRAPHS", "DMATTN_HOPPER")
GRAPH_SWITCHES = (*_SWITCHES, "DMATTN_INDUCTOR_KERNELS", "DMATTN_SYMBOLIC_KERNELS")


def read_graph_switches() -> None:
    """Read GRAPH_SWITCHES while Dynamo traces a call (api._encoded), so that the graph is
    guarded on each and compiled again when one changes. Through `switch`, which branches on
    each raw value: Dynamo guards a value a branch uses, not one merely read (the default
    passed is immaterial here)."""
    for name in GRAPH_SWITCHES:
        switch(name, False)


def active() -> str:
    """The kernel_options blocks in force, as text (a key of compiled graphs' caches)."""
    return repr(_ACTIVE)


# (switch values, encoded options, active blocks) -> Tuning. A block is keyed by its dict's id,
# alive while the block is active; a later block reusing a freed id holds a different dict, so
# blocks clear their entries when they end.
_TUNINGS: dict = {}


def tuning(encoded: str | None = None) -> Tuning:
    """The options a call runs with: environment switches, then the active kernel_options
    blocks, then the call's own (encoded)."""
    get = getenv
    key = (get(_SWITCHES[0]), get(_SWITCHES[1]), get(_SWITCHES[2]), encoded, *map(id, _ACTIVE))
    found = _TUNINGS.get(key)
    if found is None:
        base = Tuning(
            fused_sdpa=switch("DMATTN_DENSE_SDPA", True),
            cudnn_graphs=switch("DMATTN_CUDNN_GRAPHS", True),
            hopper=switch("DMATTN_HOPPER", None),
        )
        merged = {**_blocks(), **decode(encoded)}
        found = replace(base, **merged) if merged else base
        if len(_TUNINGS) > 256:
            _TUNINGS.clear()
        _TUNINGS[key] = found
    return found
