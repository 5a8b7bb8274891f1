"""Store URLs: read once (`resolve_url`), shown without their password, without SQLAlchemy.

A store URL is read here as SQLAlchemy reads one (`sqlalchemy.engine.make_url`: the same
pattern, the same unquoting, the same rendering), so that commands which only read
(``lab ls``, ``lab show``) need not import SQLAlchemy, about 0.2 s of CPU, to learn which
file or server a URL names. The SQLAlchemy `URL` itself (`StoreURL.parsed`) is made from the
text when an engine is made. tests/test_architecture.py holds the two readings equal.
"""

from __future__ import annotations

import functools
import os
import re
from typing import TYPE_CHECKING, Any, NamedTuple
from urllib.parse import parse_qsl, quote, quote_plus, unquote

from lab._secrets import mask
from lab.errors import ConfigError, UnknownScheme

if TYPE_CHECKING:
    from sqlalchemy.engine import URL

DEFAULT_URL = "sqlite:///lab.db"
#: The schemes of a `lab serve` server's URL.
HTTP_SCHEMES = ("http", "https")

# SQLAlchemy's own pattern for a URL (sqlalchemy.engine.url._parse_url)
_URL = re.compile(
    r"""
        (?P<name>[\w\+]+)://
        (?:
            (?P<username>[^:/]*)
            (?::(?P<password>[^@]*))?
        @)?
        (?:
            (?:
                \[(?P<ipv6host>[^/\?]+)\] |
                (?P<ipv4host>[^/:\?]+)
            )?
            (?::(?P<port>[^/\?]*))?
        )?
        (?:/(?P<database>[^\?]*))?
        (?:\?(?P<query>.*))?
    """,
    re.X,
)


class Parts(NamedTuple):
    """A URL's parts, as SQLAlchemy's `URL` holds them (a query value that repeats is a
    tuple of its values)."""

    drivername: str
    username: str | None
    password: str | None
    host: str | None
    port: int | None
    database: str | None
    query: dict[str, str | tuple[str, ...]]

    @property
    def backend(self) -> str:
        """The part of the driver name before ``+``: ``postgresql`` of ``postgresql+psycopg``."""
        return self.drivername.split("+")[0]

    def render(self, *, hide_password: bool) -> str:
        """The URL as text, as `URL.render_as_string` writes it."""
        text = self.drivername + "://"
        if self.username is not None:
            text += quote(self.username, safe=" +")
            if self.password is not None:
                text += ":" + ("***" if hide_password else quote(self.password, safe=" +"))
            text += "@"
        if self.host is not None:
            text += f"[{self.host}]" if ":" in self.host else self.host
        if self.port is not None:
            text += f":{self.port}"
        if self.database is not None:
            text += "/" + quote(self.database, safe=" +/")
        if self.query:
            text += "?" + "&".join(
                f"{quote_plus(key)}={quote_plus(value)}"
                for key in sorted(self.query)
                for value in _values(self.query[key])
            )
        return text


def _values(value: str | tuple[str, ...]) -> tuple[str, ...]:
    return (value,) if isinstance(value, str) else value


def parse(text: str) -> Parts:
    """The parts of a URL, as `sqlalchemy.engine.make_url` reads them; ValueError when it
    is not a URL or its port is not a number."""
    found = _URL.match(text)
    if found is None:
        raise ValueError(f"not a URL: {text!r}")
    given = found.groupdict()
    query: dict[str, str | tuple[str, ...]] = {}
    for key, value in parse_qsl(given["query"] or ""):
        query[key] = (*_values(query[key]), value) if key in query else value
    username, password, database = (
        None if given[k] is None else unquote(given[k])
        for k in ("username", "password", "database")
    )
    port = given["port"]
    return Parts(
        drivername=given["name"],
        username=username,
        password=password,
        host=given["ipv4host"] or given["ipv6host"],
        port=None if port is None else int(port),  # "" is no number either
        database=database,
        query=query,
    )


class StoreURL(str):
    """A store URL resolved once: the text (password included) and its parts.

    `resolve_url` returns one, and gives one it is handed back as it is, so an
    `Experiment`, its `SqlLogger`, the `Store` and its engine share one reading of the URL.
    It pickles as its text, resolved again on arrival (a worker process).
    """

    parts: Parts

    def __new__(cls, text: str, parts: Parts) -> StoreURL:
        self = super().__new__(cls, text)
        self.parts = parts
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        return (resolve_url, (str(self),))

    def __copy__(self) -> StoreURL:
        return self  # immutable, as a str is

    def __deepcopy__(self, memo: dict[int, Any]) -> StoreURL:
        return self

    @functools.cached_property
    def parsed(self) -> URL:
        """The URL as SQLAlchemy's `URL`, for an engine: made once, when first asked for."""
        from sqlalchemy.engine import make_url

        return make_url(str(self))

    @functools.cached_property
    def shown(self) -> str:
        """The URL as it may be printed: its password hidden."""
        return self.parts.render(hide_password=True)

    @property
    def backend(self) -> str:
        """``sqlite``, ``postgresql``, or ``http``/``https`` (a `lab serve` server)."""
        return self.parts.backend

    @property
    def database(self) -> str | None:
        """The database part: a SQLite file's path, a PostgreSQL database's name."""
        return self.parts.database


def resolve_url(url: str | None = None) -> StoreURL:
    """The store URL to use: the argument, else ``LAB_STORE_URL``, else ``sqlite:///lab.db``.

    The one place a store URL is read: everything that opens a store (`Store`, the CLI,
    `lab.inspect`, `SqlLogger`, `Experiment`) passes its argument through here, and a
    `StoreURL` passes through unchanged. ``postgresql://`` is read as psycopg 3, the driver
    `lab` ships with. ``http(s)://host:port`` names a `lab serve` server; its token comes
    from ``LAB_TOKEN``, never from the URL, so a URL with a user or password is refused.
    """
    if isinstance(url, StoreURL):
        return url
    chosen = url or os.environ.get("LAB_STORE_URL") or DEFAULT_URL
    try:
        parts = parse(chosen)
    except ValueError:
        raise UnknownScheme(
            f"store URL {mask(chosen)!r} is not a URL; use sqlite:///path/to/lab.db "
            "or postgresql://user:password@host/dbname"
        ) from None
    backend = parts.backend
    if backend in HTTP_SCHEMES:  # a `lab serve` server: lab.store.http.HttpStore
        if parts.username is not None or parts.password is not None:
            raise ConfigError(
                f"store URL {mask(chosen)!r} carries a user or password; give the server's "
                "URL without them and the token in LAB_TOKEN"
            )
        text = chosen.rstrip("/")
        return StoreURL(text, parse(text))
    if backend in ("postgresql", "postgres"):  # SQLAlchemy itself no longer reads postgres://
        if parts.drivername in ("postgresql", "postgres"):
            parts = parts._replace(drivername="postgresql+psycopg")
        elif parts.drivername != "postgresql+psycopg":
            raise UnknownScheme(
                f"store URL driver {parts.drivername!r} is not supported; "
                "use postgresql:// (psycopg 3)"
            )
    elif backend != "sqlite":
        raise UnknownScheme(
            f"store URL scheme {parts.drivername!r} is not supported; "
            "use sqlite:///path/to/lab.db, postgresql://user:password@host/dbname or "
            "http(s)://host:port (a lab serve server)"
        )
    return StoreURL(parts.render(hide_password=False), parts)


def shown(url: str) -> str:
    """A store URL as it may be printed: its password hidden."""
    return resolve_url(url).shown
