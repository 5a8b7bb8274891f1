"""The SQL store: schema, migrations, buffered writes and reads."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lab.store.engine import DEFAULT_URL, HTTP_SCHEMES, resolve_url
from lab.store.store import Store

if TYPE_CHECKING:
    from lab.store.http import HttpStore

__all__ = ["DEFAULT_URL", "Store", "open_store", "resolve_url"]


def open_store(url: str | None = None, **kwargs: Any) -> Store | HttpStore:
    """The store at `url` (else ``LAB_STORE_URL``, else ``sqlite:///lab.db``): a `Store` for
    a SQL URL, an `lab.store.http.HttpStore` for a ``lab serve`` server's http(s) URL (its
    token from ``LAB_TOKEN``). The one place that picks the backend from the URL."""
    resolved = resolve_url(url)
    if resolved.backend in HTTP_SCHEMES:
        from lab.store.http import HttpStore

        return HttpStore(resolved, **kwargs)
    return Store(resolved, **kwargs)
