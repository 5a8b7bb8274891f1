"""Optional dependencies: say which extra to install, before anything runs."""

from __future__ import annotations

import importlib.util

from lab.errors import ConfigError


def require(module: str, extra: str, who: str) -> None:
    """Fail with the ``pip install`` line when `module` is missing, without importing it.

    Heavy backends (wandb) are imported only when a run starts, so without this check a
    missing package would surface as a bare ``ModuleNotFoundError`` in the middle of an
    experiment; a callback calls this when it is constructed instead.
    """
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or sys.modules[name] = None
        found = False
    if not found:
        raise ConfigError(f"{who} needs the {module} package: pip install 'lab[{extra}]'")
