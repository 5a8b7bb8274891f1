"""Tokens: made once, kept only as a hash, compared in constant time.

A token is ``lab_`` + 43 URL-safe random characters (256 bits). The store keeps its SHA-256
hash (`lab.store.schema.SqlToken`), so a stolen database holds no usable token. A ``read``
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

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from lab._names import MAX_NAME, check_name
from lab.errors import ConfigError, NoToken
from lab.store.engine import transaction
from lab.store.schema import TOKEN_SCOPES, SqlToken

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
    with transaction(engine) as conn:
        taken = conn.execute(sa.select(SqlToken.revoked_at).where(SqlToken.name == name)).first()
        if taken is not None:
            # a revoked token keeps its name, so that `lab token list` still shows it
            state = "a revoked token" if taken.revoked_at is not None else "a token"
            raise ConfigError(f"{state} named {name!r} exists; pick another name")
        conn.execute(
            sa.insert(SqlToken).values(
                name=name,
                scope=scope,
                token_hash=hash_token(token),
                created_at=datetime.now(UTC).replace(tzinfo=None),
                revoked_at=None,
                # only when given: a store migrated up to an older revision has no column
                **({} if experiment is None else {"experiment": experiment}),
            )
        )
    return token


def find_token(engine: Engine, token: str) -> Token | None:
    """The name, scope and experiment of a live (not revoked) `token`, or None for a token
    the store does not know or has revoked. The lookup is by hash, and the hash is compared
    again in constant time, so no timing tells how much of a guess was right."""
    row = _live(engine, token, SqlToken.experiment)
    return None if row is None else Token(row.name, row.scope, row.experiment)


def token_scope(engine: Engine, token: str) -> Scope | None:
    """The scope of a live `token`, or None (see `find_token`); it reads only the columns
    every revision with tokens has."""
    row = _live(engine, token)
    return None if row is None else row.scope


def _live(engine: Engine, token: str, *more: Any) -> Any:
    """The row of a live `token` (name, hash, scope, revoked_at and `more` columns)."""
    digest = hash_token(token)
    with engine.connect() as conn:
        row = conn.execute(
            sa.select(
                SqlToken.name, SqlToken.token_hash, SqlToken.scope, SqlToken.revoked_at, *more
            ).where(SqlToken.token_hash == digest)
        ).first()
    if row is None or not hmac.compare_digest(row.token_hash, digest):
        return None
    return None if row.revoked_at is not None else row


def list_tokens(engine: Engine) -> list[dict[str, Any]]:
    """Every token's name, scope, the experiment it is limited to (None: all), and when it
    was made and revoked (None: live), oldest first. Never the hash: what an operator needs
    to decide what to revoke, nothing that helps a guess."""
    with engine.connect() as conn:
        rows = conn.execute(
            sa.select(
                SqlToken.name, SqlToken.scope, SqlToken.experiment, SqlToken.created_at,
                SqlToken.revoked_at,
            ).order_by(SqlToken.token_id)
        ).all()  # fmt: skip
    return [row._asdict() for row in rows]


def revoke_token(engine: Engine, name: str) -> datetime | None:
    """Revoke the token named `name`: every request that carries it is refused from now on
    (each request looks its token up). Returns when it was revoked before, or None if it
    was live until now; an unknown name raises `NoToken`."""
    now = datetime.now(UTC).replace(tzinfo=None)
    with transaction(engine) as conn:
        row = conn.execute(
            sa.select(SqlToken.token_id, SqlToken.revoked_at).where(SqlToken.name == name)
        ).first()
        if row is None:
            raise NoToken(f"no token named {name!r}; lab token list shows the tokens")
        if row.revoked_at is not None:
            return row.revoked_at
        conn.execute(
            sa.update(SqlToken).where(SqlToken.token_id == row.token_id).values(revoked_at=now)
        )
    return None


def has_live_token(engine: Engine) -> bool:
    """Whether the store holds a token that is not revoked: `lab serve` binds an address
    other than loopback only then, so nobody it cannot identify can reach the store."""
    with engine.connect() as conn:
        live = conn.execute(
            sa.select(SqlToken.token_id).where(SqlToken.revoked_at.is_(None)).limit(1)
        ).first()
    return live is not None
