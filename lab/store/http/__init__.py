"""`HttpStore`: a `lab serve` server as a store, behind the same methods as `lab.store.Store`.

A store URL ``http(s)://host:port`` opens one (`lab.store.open_store`), so
``Experiment(store="http://...")``, ``LAB_STORE_URL`` and experiment files record through
the server unchanged, and ``lab ls``, ``lab show`` and `lab.inspect` read through it. Its
parts, one module each: `client` (the connection, the token, errors and retries), `reads`
(the read API: what `Store` reads, and a series downsampled, predictions by the page, a
table as Arrow), `writes` (every write: ids at once, the rest in ordered idempotent
batches), `sender` (the background thread that posts the batches) and `spool` (batches kept
in the run folder while the server is away, replayed when it is back or by ``lab sync``).
"""

from __future__ import annotations

from pathlib import Path

from lab.errors import ConfigError
from lab.store.http.client import HttpClient, retry_window
from lab.store.http.reads import HttpReads
from lab.store.http.sender import post
from lab.store.http.spool import pending
from lab.store.http.writes import HttpWrites

__all__ = ["HttpStore", "retry_window", "sync"]


class HttpStore(HttpReads, HttpWrites, HttpClient):
    """A `lab serve` server at `url`, used as a store.

    >>> store = HttpStore("http://127.0.0.1:8765", token="lab_...")  # doctest: +SKIP
    >>> SqlLogger(store)  # records every experiment, run and metric through the server
    >>> store.series(run_id, "loss", buckets=500)  # min and max per bucket    # doctest: +SKIP
    """


def sync(run_dir: str | Path, url: str | None = None, *, token: str | None = None) -> int:
    """Replay the batches spooled in `run_dir` (``<run dir>/.lab-spool``) to the server at
    `url` (else ``LAB_STORE_URL``), in the order they were first sent; returns how many it
    sent. Each keeps its client id and sequence number, so a batch the server already has
    stores nothing again: running it twice, or after the sender replayed some, is safe.
    Each file is removed once the server acknowledged it."""
    folder = Path(run_dir)
    if not folder.is_dir():
        raise ConfigError(f"{folder} is not a folder; give the run folder that holds .lab-spool")
    batches = pending(folder)
    if not batches:
        return 0
    client = HttpClient(url, token=token)
    try:
        for batch in batches:
            post(client, batch.client_id, batch.seq, batch.kind, batch.path.read_bytes())
            batch.path.unlink(missing_ok=True)
    finally:
        client.close()
    return len(batches)
