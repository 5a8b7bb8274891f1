"""The SQL store: schema, migrations, buffered writes and reads."""

from lab.store.engine import DEFAULT_URL, resolve_url
from lab.store.store import Store

__all__ = ["DEFAULT_URL", "Store", "resolve_url"]
