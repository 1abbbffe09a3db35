"""The documented ``DMATTN_*`` environment switches, read in one place.

A switch is on for "1", "true", "on", "yes" and off for "0", "false", "off", "no" (any case,
surrounding spaces ignored); unset or empty leaves its default; anything else raises, so that a
typo never leaves a path silently on. Each is read when the code that needs it runs, so a test or
a benchmark may set it for one call.
"""

from __future__ import annotations

import os

ON = frozenset({"1", "true", "on", "yes"})
OFF = frozenset({"0", "false", "off", "no"})


def switch(name: str, default: bool) -> bool:
    """The boolean value of environment variable `name` (see the module docstring)."""
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    value = raw.strip().lower()
    if value in ON:
        return True
    if value in OFF:
        return False
    raise ValueError(f"{name}={raw!r}: expected one of {sorted(ON)} (on) or {sorted(OFF)} (off)")
