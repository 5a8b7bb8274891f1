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
        raise ConfigError(f"{who} needs the {module} package: {pip_install(extra)}")


def pip_install(extra: str) -> str:
    """The command that adds `extra` to the lab this interpreter runs, runnable as printed.

    It names this interpreter (``.venv/bin/lab`` works without an activated venv, where a
    bare ``pip`` is another Python's), and where lab came from, as pip recorded it: a
    checkout installed with ``pip install -e .`` (the README's set-up) gets
    ``python -m pip install -e '/path/to/checkout[server]'``, since ``lab[server]`` from the
    package index would be another project; a folder installed without ``-e`` gets its path;
    anything else ``'lab[server]'``.
    """
    import json
    import shlex
    import sys
    from importlib import metadata
    from urllib.parse import urlparse
    from urllib.request import url2pathname

    try:
        direct = json.loads(metadata.distribution("lab").read_text("direct_url.json") or "{}")
    except (metadata.PackageNotFoundError, ValueError):  # not installed, or unreadable
        direct = {}
    source, editable = "lab", False
    folder = direct.get("dir_info") if isinstance(direct, dict) else None
    url = direct.get("url") if isinstance(direct, dict) else None
    if isinstance(folder, dict) and isinstance(url, str) and url.startswith("file://"):
        source, editable = url2pathname(urlparse(url).path), folder.get("editable") is True
    where = shlex.quote(f"{source}[{extra}]")
    return f"{shlex.quote(sys.executable)} -m pip install {'-e ' if editable else ''}{where}"
