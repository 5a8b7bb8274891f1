"""Who may read and write what through `lab serve`: the ownership model, checked here only.

- A token's scope is ``read`` (reads), ``write`` (reads, and writes the experiments it
  owns) or ``admin`` (reads and writes every experiment).
- An experiment created through the server (``POST /api/v1/experiments``) records the name
  of the token that created it (``experiments.created_by``); one a local process created
  records none.
- A ``write`` token writes an experiment (adds its arms and groups; claims, starts,
  finishes, releases, supersedes and truncates its runs; sends batches of metrics and
  operations for them; finishes it) when it created it, or when the token is limited to
  it (``lab token create NAME --scope write --experiment EXP``: how an operator grants a
  token an experiment another token made, or one a local process recorded, which no
  unlimited write token may write).
- A token limited to an experiment (``tokens.experiment``) reads only that experiment, and
  creates only it.

`Access` answers for one request, caching what it looked up (each experiment's name and
creator, each run's experiment) for the rest of the request, so a batch costs one query per
kind of id it names, however many rows name them. An id the store does not hold answers
404; an experiment or run the token may not touch 403, with one line that says who may
write it and how to get a token for it.

`guard` is the dependency every API route runs after the scope check: it checks the ids in
the route's path and query (``experiment_id``, ``run_id``, ``name``, ``experiment``), to
read for GET and to write for every other method. Routes check the ids their bodies carry
(a batch's runs and experiments, a run's group and arm) with the same request's `Access`.
"""

from __future__ import annotations

import functools
import shlex
from collections.abc import Callable, Iterable
from typing import Any, TypeGuard

import fastapi
from fastapi.concurrency import run_in_threadpool
from sqlalchemy.engine import Engine

from lab.server.auth import Token
from lab.server.rejected import Rejected
from lab.store import ownership
from lab.store.engine import connect, transaction

#: Ids looked up in one query at most (SQLite binds at most 32,766 parameters).
CHUNK = 1000


def grant(name: str, scope: str = "write") -> str:
    """The command an operator runs to make a token for experiment `name`."""
    return f"lab token create NAME --scope {scope} --experiment {shlex.quote(name)}"


class Access:
    """What the token of one request may read and write (see the module docstring)."""

    def __init__(self, engine: Engine, token: Token) -> None:
        self.engine, self.token = engine, token
        self._experiments: dict[int, tuple[str, str | None]] = {}  # id -> (name, created_by)
        self._runs: dict[int, int] = {}  # run id -> experiment id

    @property
    def only(self) -> str | None:
        """The one experiment this token reads and writes, or None for all it may."""
        return None if self.token.scope == "admin" else self.token.experiment

    # -- reads ---------------------------------------------------------------------------
    def readable(self, name: str) -> bool:
        """Whether this token reads experiment `name`."""
        return self.only is None or name == self.only

    def check_read(self, name: str, field: str | None) -> None:
        """403 unless this token reads experiment `name`."""
        if not self.readable(name):
            raise Rejected(
                403,
                f"token {self.token.name!r} may read only experiment {self.only!r}, not "
                f"{name!r}; an operator makes a token for it with: {grant(name, 'read')}",
                field,
            )

    def check_read_ids(
        self, *, runs: Iterable[int] = (), experiments: Iterable[int] = (), field: str | None
    ) -> None:
        """403 unless this token reads the experiments of these runs and experiments (404
        for one the store does not hold); no query for a token that reads everything."""
        if self.only is None:
            return
        for name, _created_by in self._resolve(runs, experiments, field):
            self.check_read(name, field)

    # -- writes --------------------------------------------------------------------------
    def check_begin(self, name: str, field: str | None = "body.name") -> None:
        """403 unless this token may create experiment `name`, or reopen it when it exists
        (inside the transaction that creates it, when one is open, so what it checked is
        what it writes)."""
        with transaction(self.engine) as conn:
            row = ownership.experiment_named(conn, name)
        if row is None:
            if self.only is not None and name != self.only:
                raise Rejected(
                    403,
                    f"token {self.token.name!r} may create and write only experiment "
                    f"{self.only!r}, not {name!r}; an operator makes a token for it with: "
                    f"{grant(name)}",
                    field,
                )
            return
        experiment_id, created_by = row
        self._experiments[experiment_id] = (name, created_by)
        if not self.may_write(name, created_by):
            self._refuse(name, created_by, field)

    def check_write(
        self, *, runs: Iterable[int] = (), experiments: Iterable[int] = (), field: str | None
    ) -> None:
        """404 for a run or experiment the store does not hold, 403 for one this token may
        not write; one query per kind of id not looked up yet in this request."""
        for name, created_by in self._resolve(runs, experiments, field):
            if not self.may_write(name, created_by):
                self._refuse(name, created_by, field)

    def may_write(self, name: str, created_by: str | None) -> bool:
        """The rule: admin writes all; a limited token its experiment; any other write
        token the experiments it created (never those recorded locally)."""
        token = self.token
        if token.scope == "admin":
            return True
        if token.scope != "write":
            return False
        if token.experiment is not None:
            return name == token.experiment
        return created_by is not None and created_by == token.name

    def check_parts(
        self,
        experiment_id: int,
        *,
        group_id: int | None = None,
        arm_id: int | None = None,
        runs: dict[str, int | None] | None = None,
    ) -> None:
        """404 unless the group, the arm and the runs (field -> run id) a body names belong
        to experiment `experiment_id`: a run is started, claimed or chained only inside the
        experiment the path names. One query."""
        wanted: list[tuple[str, str, Any]] = []
        if group_id is not None:
            wanted.append(("body.group_id", "group", group_id))
        if arm_id is not None:
            wanted.append(("body.arm_id", "arm", arm_id))
        wanted += [(f"body.{f}", "run", i) for f, i in (runs or {}).items() if i is not None]
        if not wanted:
            return
        with connect(self.engine) as conn:
            found = ownership.parts_found(conn, experiment_id, [(k, v) for _f, k, v in wanted])
        for i, (field, kind, value) in enumerate(wanted):
            if i not in found:
                raise Rejected(404, f"experiment {experiment_id} has no {kind} {value}", field)

    def _refuse(self, name: str, created_by: str | None, field: str | None) -> None:
        token = self.token
        limited = (
            f"token {token.name!r} may write only experiment {token.experiment!r}; "
            if token.scope == "write" and token.experiment not in (None, name)
            else ""
        )
        if created_by is None:
            owner = (
                f"experiment {name!r} was recorded by a local process or before the server "
                "kept owners, so through the server only an admin token or a token limited "
                "to it may write it"
            )
        else:
            owner = (
                f"experiment {name!r} belongs to token {created_by!r}: only that token, an "
                "admin token or a token limited to it may write it"
            )
        raise Rejected(403, f"{limited}{owner}; an operator makes one with: {grant(name)}", field)

    # -- lookups -------------------------------------------------------------------------
    def _resolve(
        self, runs: Iterable[int], experiments: Iterable[int], field: str | None
    ) -> list[tuple[str, str | None]]:
        """The (name, created_by) of the experiments these runs and experiments belong to,
        each once; 404 for an id the store does not hold."""
        runs, experiments = set(runs), set(experiments)
        new_runs = sorted(runs - self._runs.keys())
        new_experiments = sorted(experiments - self._experiments.keys())
        if new_runs or new_experiments:
            with connect(self.engine) as conn:
                for chunk in _chunks(new_runs):
                    for run_id, exp_id, name, created_by in ownership.run_owners(conn, chunk):
                        self._runs[run_id] = exp_id
                        self._experiments[exp_id] = (name, created_by)
                for chunk in _chunks(new_experiments):
                    for exp_id, name, created_by in ownership.experiment_owners(conn, chunk):
                        self._experiments[exp_id] = (name, created_by)
        for run_id in sorted(runs - self._runs.keys()):
            raise Rejected(
                404, f"no run with id {run_id} in the store; an experiment's runs: GET "
                     "/api/v1/experiments/NAME/runs", field,
            )  # fmt: skip
        for exp_id in sorted(experiments - self._experiments.keys()):
            raise Rejected(
                404, f"no experiment with id {exp_id} in the store; the experiments: GET "
                     "/api/v1/experiments", field,
            )  # fmt: skip
        ids = {self._runs[r] for r in runs} | experiments
        return [self._experiments[i] for i in sorted(ids)]


def _chunks(ids: list[int]) -> Iterable[list[int]]:
    return (ids[i : i + CHUNK] for i in range(0, len(ids), CHUNK))


def access(request: fastapi.Request) -> Access:
    """The request's `Access`, made on first use (its lookups are kept for the request)."""
    found = getattr(request.state, "access", None)
    if found is None:
        found = request.state.access = Access(request.app.state.store.engine, request.state.token)
    return found


def as_id(value: Any, field: str) -> int:
    """An id a body carries as a whole number, or a 400 naming its field."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise Rejected(400, f"{field} must be a whole number (an id), not {value!r}", field)
    return value


def _whole(text: Any) -> TypeGuard[str]:
    """Whether a path or query value is an id the store can hold (a 64-bit whole number)."""
    return (
        isinstance(text, str)
        and text.isascii()
        and text.isdigit()
        and len(text) <= 19
        and (int(text) < 2**63)
    )


def scoped(scope: str) -> Callable[..., None]:
    """A dependency that lets a request through when its token (checked by
    `lab.server.app.TokenGate`) has `scope`; a write or admin token reads too. The bearer
    scheme is declared so that the OpenAPI schema says how to authenticate."""
    import fastapi.security

    bearer = fastapi.security.HTTPBearer(auto_error=False)

    def check(request: fastapi.Request, _credentials: Any = fastapi.Depends(bearer)) -> None:
        if scope == "write" and request.state.token.scope not in ("write", "admin"):
            raise Rejected(
                403, "a read token cannot write; use a write token", "header.authorization"
            )

    return check


def checked(scope: str) -> list[Any]:
    """The dependencies of a route behind `scope`: the scope, then the ids the request
    names (`guard`)."""
    return [fastapi.Depends(scoped(scope)), fastapi.Depends(guard)]


async def guard(request: fastapi.Request) -> None:
    """The check every API route runs after its scope check (see the module docstring):
    the ids in its path and query, to read for GET and HEAD, to write otherwise. An id that
    is not a whole number is left to the route's validation (422). It waits on the store
    only when there is something to look up (async: a request that names no id, or a read
    by a token that reads everything, costs no thread).

    ``/experiments/{experiment}/runs`` is one path for two routes (the OpenAPI document
    holds one template per path): its ``experiment`` is the experiment's name to read its
    runs (GET), its id to start one (POST)."""
    found = access(request)
    reading = request.method in ("GET", "HEAD")
    path, query = request.path_params, request.query_params
    for place, name in (
        ("path.name", path.get("name")),
        ("path.experiment", path.get("experiment") if reading else None),
        ("query.experiment", query.get("experiment")),
    ):
        if isinstance(name, str):
            found.check_read(name, place)
    ids: dict[str, list[int]] = {"runs": [], "experiments": []}
    field: str | None = None
    for where, key, kind in (
        ("path.run_id", path.get("run_id"), "runs"),
        ("path.experiment_id", path.get("experiment_id"), "experiments"),
        ("path.experiment", None if reading else path.get("experiment"), "experiments"),
        ("query.experiment_id", query.get("experiment_id"), "experiments"),
    ):
        if _whole(key):
            ids[kind].append(int(key))
            field = where
    if not (ids["runs"] or ids["experiments"]) or (reading and found.only is None):
        return
    check = found.check_read_ids if reading else found.check_write
    await run_in_threadpool(functools.partial(check, **ids, field=field))
