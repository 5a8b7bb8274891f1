"""Small helpers every part of the store uses: the time a row is stamped with, and text
and tags made storable."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from lab._names import storable_text
from lab._secrets import mask
from lab.store.engine import dumps_json


def _now() -> datetime:
    return datetime.now(UTC).replace(tzinfo=None)


def _text(value: Any) -> str | None:
    """A prediction's text field: a string as it is, anything else as its JSON text.

    PostgreSQL text cannot hold NUL, and an insert that holds one fails the whole eval (and,
    through the SQL logger, the run); so NUL becomes U+FFFD, on both backends alike.
    """
    if value is None:
        return None
    return storable_text(value if isinstance(value, str) else dumps_json(value))


def _free_text(text: str | None) -> str | None:
    """An error or a traceback as the store keeps it: credentials masked, NUL as U+FFFD."""
    return storable_text(mask(text)) if text else text


def _failures(failures: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Callback failures as the store keeps them: their error and traceback masked."""
    if not failures:
        return None
    return [
        {k: mask(v) if k in ("error", "traceback") and isinstance(v, str) else v
         for k, v in f.items()}
        for f in failures
    ]  # fmt: skip
