"""Settings read from the environment."""

from __future__ import annotations

import os

from lab.errors import LabError


def seconds_from_env(name: str, default: float, error: type[LabError]) -> float:
    """The number of seconds environment variable `name` gives, else `default`; a value
    that is not a number >= 0 raises `error` with one line naming it, so a typo in a retry
    window fails loudly instead of silently retrying forever or never."""
    raw = os.environ.get(name)
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise error(f"{name}={raw!r} is not a number of seconds") from None
    if value < 0:
        raise error(f"{name}={raw!r} must be >= 0 seconds")
    return value
