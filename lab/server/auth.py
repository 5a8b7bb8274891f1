"""Tokens: made once, kept only as a hash, compared in constant time.

A token is ``lab_`` + 43 URL-safe random characters (256 bits). The store keeps its SHA-256
hash (`lab.store.tokens`), so a stolen database holds no usable token. A ``read``
token reads; a ``write`` token reads too, and writes the experiments it owns; an ``admin``
token reads and writes every experiment. A token may be limited to one experiment, which
is then all it reads and writes (`lab.server.owners` has the whole model).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from datetime import UTC, datetime
from typing import Any, Literal, NamedTuple

from sqlalchemy.engine import Engine

from lab._names import MAX_NAME, check_name
from lab.errors import ConfigError
from lab.store import tokens
from lab.store.tables import TOKEN_SCOPES

Scope = Literal["read", "write", "admin"]
PREFIX = "lab_"


class Token(NamedTuple):
    """A live token as a request carries it: its name, its scope, and the one experiment
    (by name) it is limited to, or None."""

    name: str
    scope: str
    experiment: str | None = None


def hash_token(token: str) -> str:
    """The hex SHA-256 of `token`: what the store keeps."""
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


def create_token(engine: Engine, name: str, scope: Scope, experiment: str | None = None) -> str:
    """Make a token named `name` with `scope`, store its hash, and return the token: the
    only time it exists in the clear. `experiment` limits it to that one experiment (which
    need not exist yet): how an operator grants a write token an experiment another token
    or a local process recorded."""
    if scope not in TOKEN_SCOPES:
        raise ConfigError(f"scope {scope!r}: use one of {', '.join(TOKEN_SCOPES)}")
    if not name or len(name) > MAX_NAME or not name.isprintable():
        raise ConfigError(f"token name {name!r}: use 1 to {MAX_NAME} printable characters")
    if experiment is not None:
        check_name("experiment", experiment, MAX_NAME)
        if scope == "admin":
            raise ConfigError(
                "an admin token reads and writes every experiment; leave --experiment out, "
                "or make a write token limited to it"
            )
    token = PREFIX + secrets.token_urlsafe(32)
    now = datetime.now(UTC).replace(tzinfo=None)
    tokens.add_token(engine, name, scope, hash_token(token), now, experiment)
    return token


def find_token(engine: Engine, token: str) -> Token | None:
    """The name, scope and experiment of a live (not revoked) `token`, or None for a token
    the store does not know or has revoked. The lookup is by hash, and the hash is compared
    again in constant time, so no timing tells how much of a guess was right."""
    row = _live(engine, token, experiment=True)
    return None if row is None else Token(row.name, row.scope, row.experiment)


def token_scope(engine: Engine, token: str) -> Scope | None:
    """The scope of a live `token`, or None (see `find_token`); it reads only the columns
    every revision with tokens has."""
    row = _live(engine, token, experiment=False)
    return None if row is None else row.scope


def _live(engine: Engine, token: str, *, experiment: bool) -> Any:
    """The row of a live `token` (name, hash, scope, revoked_at, and its experiment with
    `experiment`)."""
    digest = hash_token(token)
    row = tokens.token_by_hash(engine, digest, experiment=experiment)
    if row is None or not hmac.compare_digest(row.token_hash, digest):
        return None
    return None if row.revoked_at is not None else row


def revoke_token(engine: Engine, name: str) -> datetime | None:
    """Revoke the token named `name`: every request that carries it is refused from now on
    (each request looks its token up). Returns when it was revoked before, or None if it
    was live until now; an unknown name raises `NoToken`."""
    return tokens.revoke_token(engine, name, datetime.now(UTC).replace(tzinfo=None))


def has_live_token(engine: Engine) -> bool:
    """Whether the store holds a token that is not revoked: `lab serve` binds an address
    other than loopback only then, so nobody it cannot identify can reach the store."""
    return tokens.has_live_token(engine)
