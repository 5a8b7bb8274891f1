"""Logger callbacks: each records the lifecycle somewhere (the store, the console, wandb, a
hook log file)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lab._lazy import lazy_names
from lab.loggers.sql import SqlLogger
from lab.store.urls import resolve_url

if TYPE_CHECKING:
    from lab.loggers.console import ConsoleLogger
    from lab.loggers.jsonl import JsonlLogger
    from lab.loggers.wandb import WandbLogger
    from lab.store.http import HttpStore
    from lab.store.store import Store

__all__ = ["ConsoleLogger", "JsonlLogger", "SqlLogger", "WandbLogger", "store_sink"]

# Imported when first named: an experiment records through `store_sink` alone, and the
# console logger's rich (about 50 ms) is not what a run's start should wait for.
_WHERE = {
    "ConsoleLogger": "lab.loggers.console",
    "JsonlLogger": "lab.loggers.jsonl",
    "WandbLogger": "lab.loggers.wandb",  # wandb itself is imported only when a run starts
}
__getattr__, __dir__ = lazy_names(__name__, _WHERE, globals(), __all__)


def store_sink(store: Store | HttpStore | str | None = None) -> SqlLogger:
    """The callback that records into `store` (a `Store`, a URL, or None for
    ``LAB_STORE_URL``, else ``sqlite:///lab.db``): the one place that maps a store to the
    logger that writes it, so `Experiment` never names a backend. `SqlLogger` writes a SQL
    store and a ``lab serve`` server (an http(s) URL, through `lab.store.http.HttpStore`)
    alike; it is a callback and a `lab.sinks.StoreSink` both."""
    if store is None or isinstance(store, str):
        return SqlLogger(resolve_url(store))
    return SqlLogger(store)
