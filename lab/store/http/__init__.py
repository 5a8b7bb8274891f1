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
from lab.store.http.sender import replay
from lab.store.http.spool import describe, pending, unfinished
from lab.store.http.writes import HttpWrites

__all__ = ["HttpStore", "Synced", "retry_window", "sync"]


class HttpStore(HttpReads, HttpWrites, HttpClient):
    """A `lab serve` server at `url`, used as a store.

    >>> store = HttpStore("http://127.0.0.1:8765", token="lab_...")  # doctest: +SKIP
    >>> SqlLogger(store)  # records every experiment, run and metric through the server
    >>> store.series(run_id, "loss", buckets=500)  # min and max per bucket    # doctest: +SKIP
    """


class Synced(int):
    """What `sync` did: the number of batches sent (an int, as before), and `left`: one
    line for each spooled file it did not send (a ``.part`` a killed process left, a file
    that is not a whole batch) or that the server refused as bad data (set aside)."""

    left: list[str]

    def __new__(cls, sent: int, left: list[str]) -> Synced:
        self = super().__new__(cls, sent)
        self.left = left
        return self


def sync(run_dir: str | Path, url: str | None = None, *, token: str | None = None) -> Synced:
    """Replay the batches spooled in `run_dir` (``<run dir>/.lab-spool``) to the server at
    `url` (else ``LAB_STORE_URL``), in the order they were first sent; returns how many it
    sent. Each keeps its client id and sequence number, so a batch the server already has
    stores nothing again: running it twice, or after the sender replayed some, is safe.
    Each file is removed once the server acknowledged it.

    Nothing is sent as what it is not: a ``.part`` file (a write never finished) and a file
    that is not a whole batch of its kind (empty, cut short) are left where they are, and a
    batch the server refuses as bad data is renamed ``.rejected``; `Synced.left` has one line
    for each. A server that does not take batches now (away, 503, the token refused) stops
    the replay with its error, and what is not sent stays spooled."""
    folder = Path(run_dir)
    if not folder.is_dir():
        raise ConfigError(f"{folder} is not a folder; give the run folder that holds .lab-spool")
    left = [f"{p} (an unfinished write: part of a batch at most)" for p in unfinished(folder)]
    batches = []
    for batch in pending(folder):
        try:
            describe(batch.kind, batch.path.read_bytes())
        except ValueError as exc:
            left.append(f"{batch.path} (not a whole batch: {exc})")
        else:
            batches.append(batch)
    if not batches:
        return Synced(0, left)
    client = HttpClient(url, token=token)
    sent = 0
    try:
        for batch in batches:
            refused = replay(client, batch, None)
            if refused is None:
                sent += 1
            else:
                left.append(refused)
    finally:
        client.close()
    return Synced(sent, left)
