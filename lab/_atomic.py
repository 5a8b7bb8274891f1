"""Small files written whole or not at all."""

from __future__ import annotations

import os
from pathlib import Path


def write_text_atomic(path: Path, text: str) -> None:
    """Write `path` through a temporary file and `os.replace`, so a reader (or a kill in the
    middle) never sees half of it: run-folder files are read by scripts while runs write."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
