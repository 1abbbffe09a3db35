"""The documented ``DMATTN_*`` environment switches, read in one place.

A switch is on for "1", "true", "on", "yes" and off for "0", "false", "off", "no" (any case,
surrounding spaces ignored); unset or empty leaves its default; anything else raises, so that a
typo never leaves a path silently on. Each is read when the code that needs it runs, so a test or
a benchmark may set it for one call.

`getenv` reads the environment as `os.environ.get` does, from the dict behind `os.environ`
where CPython keeps one (POSIX: bytes keys and values, which `os.environ`'s own writes keep up
to date): an eager call reads some 25 variables, and `os.environ.get` costs about 0.5 us on a
laptop core (1.5 us on an H100's host) against 0.03 us for the dict lookup.

While Dynamo traces, `getenv` reads that dict without the lookup tables below: Dynamo guards a
compiled graph on each lookup of a plain dict by its key, a key absent when traced included,
so a graph is compiled again exactly when a variable it read changes, appears or goes. Through
the tables, its guards broke whenever they grew (an eager call reading a variable for the first
time, anywhere), and every graph that had read a switch was compiled again (bench.model's first
shape recompiled this way while timed); through `os.environ.get`, a variable absent when
traced and set later was not guarded at all (torch 2.13).
"""

from __future__ import annotations

import os
import sys

import torch

ON = frozenset({"1", "true", "on", "yes"})
OFF = frozenset({"0", "false", "off", "no"})

_ENVIRON = os.environ
_DATA = getattr(os.environ, "_data", None)
_FAST = os.name == "posix" and isinstance(_DATA, dict)
_KEYS: dict[str, bytes] = {}
_VALUES: dict[bytes, str] = {}
_FS_ENCODING = sys.getfilesystemencoding()
_TRACING = torch.compiler.is_dynamo_compiling  # False eagerly; Dynamo folds it to True


def getenv(name: str) -> str | None:
    """os.environ.get(name), read from os.environ's own dict where it keeps one (module
    docstring), without its lookup tables while Dynamo traces; through os.environ.get where it
    keeps none or where os.environ was replaced."""
    if not _FAST or os.environ is not _ENVIRON:
        return os.environ.get(name)
    if _TRACING():  # str and bytes methods on constants, which Dynamo folds (os.fsencode is
        # standard-library code that Dynamo may refuse to trace)
        raw = _DATA.get(name.encode(_FS_ENCODING, "surrogateescape"))
        return None if raw is None else raw.decode(_FS_ENCODING, "surrogateescape")
    key = _KEYS.get(name)
    if key is None:
        key = _KEYS[name] = os.fsencode(name)
    raw = _DATA.get(key)
    if raw is None:
        return None
    value = _VALUES.get(raw)
    if value is None:
        if len(_VALUES) > 256:
            _VALUES.clear()
        value = _VALUES[raw] = os.fsdecode(raw)
    return value


def switch(name: str, default: bool | None) -> bool | None:
    """The boolean value of environment variable `name` (see the module docstring); `default`
    where it is unset (None for a tri-state option such as kernel option hopper)."""
    raw = getenv(name)
    if raw is None or not raw.strip():
        return default
    value = raw.strip().lower()
    if value in ON:
        return True
    if value in OFF:
        return False
    raise ValueError(f"{name}={raw!r}: expected one of {sorted(ON)} (on) or {sorted(OFF)} (off)")
