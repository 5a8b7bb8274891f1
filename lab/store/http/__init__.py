"""`HttpStore`: a `lab serve` server as a store, behind the same methods as `lab.store.Store`.

A store URL ``http(s)://host:port`` opens one (`lab.store.open_store`), so
``Experiment(store="http://...")``, ``LAB_STORE_URL`` and experiment files record through
the server unchanged. Its parts, one module each: `client` (the connection, the token,
errors and retries), `writes` (every write: ids at once, the rest in ordered idempotent
batches), `sender` (the background thread that posts the batches) and `spool` (batches kept
in the run folder while the server is away, replayed when it is back or by ``lab sync``).
"""

from __future__ import annotations

from lab.store.http.client import HttpClient, retry_window

__all__ = ["HttpStore", "retry_window"]


class HttpStore(HttpClient):
    """A `lab serve` server at `url`, used as a store.

    >>> store = HttpStore("http://127.0.0.1:8765", token="lab_...")  # doctest: +SKIP
    >>> SqlLogger(store)  # records every experiment, run and metric through the server
    """
