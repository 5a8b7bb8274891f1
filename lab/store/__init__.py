"""The SQL store: schema, migrations, buffered writes and reads.

`Store` is imported on first use (PEP 562): it brings SQLAlchemy, which commands that only
read (`lab.store.reader.Reader`) never import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lab.store.urls import DEFAULT_URL, HTTP_SCHEMES, resolve_url

if TYPE_CHECKING:
    from lab.store.http import HttpStore
    from lab.store.store import Store

__all__ = ["DEFAULT_URL", "Store", "open_store", "resolve_url"]


def __getattr__(name: str) -> Any:
    """`Store`, imported the first time it is used."""
    if name == "Store":
        from lab.store.store import Store

        return Store
    raise AttributeError(f"module 'lab.store' has no attribute {name!r}")


def open_store(url: str | None = None, **kwargs: Any) -> Store | HttpStore:
    """The store at `url` (else ``LAB_STORE_URL``, else ``sqlite:///lab.db``): a `Store` for
    a SQL URL, an `lab.store.http.HttpStore` for a ``lab serve`` server's http(s) URL (its
    token from ``LAB_TOKEN``). The one place that picks the backend from the URL."""
    resolved = resolve_url(url)
    if resolved.backend in HTTP_SCHEMES:
        from lab.store.http import HttpStore

        return HttpStore(resolved, **kwargs)
    from lab.store.store import Store

    return Store(resolved, **kwargs)
