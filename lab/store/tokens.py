"""The `lab serve` tokens' rows: their hashes added, looked up, revoked and counted
(`lab.server.auth` makes the tokens, hashes them and compares them; only the hash reaches
the store)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from lab.errors import ConfigError, NoToken
from lab.store.engine import transaction
from lab.store.schema import SqlToken


def add_token(
    engine: Engine, name: str, scope: str, digest: str, created_at: datetime, experiment: str | None
) -> None:
    """Keep a token named `name` with `scope` and hash `digest` (limited to `experiment`
    when given); a name taken already, by a live or a revoked token, is a `ConfigError`."""
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
                token_hash=digest,
                created_at=created_at,
                revoked_at=None,
                # only when given: a store migrated up to an older revision has no column
                **({} if experiment is None else {"experiment": experiment}),
            )
        )


def token_by_hash(engine: Engine, digest: str, *, experiment: bool) -> Any:
    """The row of the token whose hash is `digest` (name, token_hash, scope, revoked_at,
    and its experiment with `experiment`: a store at an older revision lacks that
    column), or None."""
    more = [SqlToken.experiment] if experiment else []
    with engine.connect() as conn:
        return conn.execute(
            sa.select(
                SqlToken.name, SqlToken.token_hash, SqlToken.scope, SqlToken.revoked_at, *more
            ).where(SqlToken.token_hash == digest)
        ).first()


def revoke_token(engine: Engine, name: str, now: datetime) -> datetime | None:
    """Mark the token named `name` revoked at `now`; when it was revoked before, when
    (and nothing changes); an unknown name raises `NoToken`."""
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
    """Whether the store holds a token that is not revoked."""
    with engine.connect() as conn:
        live = conn.execute(
            sa.select(SqlToken.token_id).where(SqlToken.revoked_at.is_(None)).limit(1)
        ).first()
    return live is not None
