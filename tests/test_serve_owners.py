"""Who may write what through `lab serve`: tokens own the experiments they create, a token
may be limited to one experiment, an admin token writes everything, and writes naming runs
or experiments the store does not hold are refused (`lab.server.owners`).

Every test runs against a real `lab serve` subprocess (tests/served.py) on SQLite and on
PostgreSQL, with tokens made in its store as an operator makes them.
"""

from __future__ import annotations

import io
from typing import Any

import httpx
import pyarrow as pa
import sqlalchemy as sa

from lab.server.auth import create_token
from lab.store import Store
from tests.served import Served

API = "/api/v1"
LOSS_ROWS = 40


def _token(served: Served, name: str, scope: str = "write", experiment: str | None = None) -> str:
    store = Store(served.store_url)
    try:
        limit = {} if experiment is None else {"experiment": experiment}
        return create_token(store.engine, name, scope, **limit)  # type: ignore[arg-type]
    finally:
        store.close()


def _client(served: Served, token: str) -> httpx.Client:
    return served.client(token)


def _arrow(run_id: int, steps: int, key: str = "loss") -> bytes:
    table = pa.table(
        {
            "run_id": pa.array([run_id] * steps, pa.int64()),
            "step": pa.array(range(steps), pa.int64()),
            "key": pa.array([key] * steps, pa.string()),
            "value": pa.array([float(s) for s in range(steps)], pa.float64()),
        }
    )
    sink = io.BytesIO()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue()


def _metrics(http: httpx.Client, client_id: str, seq: int, body: bytes) -> httpx.Response:
    headers = {"X-Lab-Client": client_id, "X-Lab-Seq": str(seq)}
    return http.post(f"{API}/batches/metrics", content=body, headers=headers)


def _ops(http: httpx.Client, client_id: str, seq: int, *ops: dict[str, Any]) -> httpx.Response:
    return http.post(f"{API}/batches/ops", json={"client_id": client_id, "seq": seq,
                                                 "ops": list(ops)})  # fmt: skip


def _recorded(http: httpx.Client, name: str) -> tuple[int, int, int]:
    """An experiment with an arm, a group and one running run holding 40 `loss` rows, made
    through `http`: (experiment id, group id, run id)."""
    exp = http.post(f"{API}/experiments", json={"name": name})
    assert exp.status_code == 200, exp.text
    exp_id = exp.json()["experiment_id"]
    arm = http.post(f"{API}/experiments/{exp_id}/arms", json={"name": "a"}).json()["arm_id"]
    group = http.post(f"{API}/experiments/{exp_id}/groups", json={"name": "g", "arm_id": arm})
    group_id = group.json()["group_id"]
    run = http.post(
        f"{API}/experiments/{exp_id}/runs",
        json={"group_id": group_id, "run_key": "a-r0", "arm_id": arm},
    )
    run_id = run.json()["run_id"]
    answer = _metrics(http, f"maker-{name}", 1, _arrow(run_id, LOSS_ROWS))
    assert answer.json()["rows"] == LOSS_ROWS
    return exp_id, group_id, run_id


def _rows(url: str, sql: str, **params: Any) -> list[tuple[Any, ...]]:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            return [tuple(r) for r in conn.execute(sa.text(sql), params).all()]
    finally:
        engine.dispose()


def _loss_rows(url: str, run_id: int) -> int:
    return _rows(url, "SELECT count(*) FROM metrics WHERE run_id = :r AND key = 'loss'",
                 r=run_id)[0][0]  # fmt: skip


def _refused(answer: httpx.Response, status: int, detail: str, field: str | None) -> None:
    assert (answer.status_code, answer.json()) == (status, {"detail": detail, "field": field})


def _belongs(name: str, owner: str) -> str:
    return (
        f"experiment {name!r} belongs to token {owner!r}: only that token, an admin token "
        "or a token limited to it may write it; an operator makes one with: lab token "
        f"create NAME --scope write --experiment {name}"
    )


def test_a_second_write_token_cannot_touch_a_run_it_did_not_create(served: Served) -> None:
    alice = served.write_token  # "tests-write"
    bob = _token(served, "bob")
    with _client(served, alice) as http:
        exp_id, group_id, run_id = _recorded(http, "alices")
    refusal = _belongs("alices", "tests-write")
    with _client(served, bob) as http:
        _refused(http.post(f"{API}/runs/{run_id}/truncate", json={"after_step": 0}),
                 403, refusal, "path.run_id")  # fmt: skip
        _refused(http.post(f"{API}/runs/{run_id}/release", json={"error": "x"}),
                 403, refusal, "path.run_id")  # fmt: skip
        _refused(http.post(f"{API}/runs/{run_id}/supersede", json={"run_key": "x"}),
                 403, refusal, "path.run_id")  # fmt: skip
        for path, body in [
            ("arms", {"name": "b"}),
            ("groups", {"name": "h"}),
            ("claims", {"group_id": group_id, "run_key": "b-r0"}),
            ("runs", {"group_id": group_id, "run_key": "b-r0"}),
            ("finish", {"status": "failed"}),
        ]:
            answer = http.post(f"{API}/experiments/{exp_id}/{path}", json=body)
            field = "path.experiment" if path == "runs" else "path.experiment_id"
            _refused(answer, 403, refusal, field)
        # the same name again: reopening it is writing it
        _refused(http.post(f"{API}/experiments", json={"name": "alices"}), 403, refusal,
                 "body.name")  # fmt: skip
        # batches naming its run or its experiment store nothing and are not recorded
        _refused(_metrics(http, "bob", 1, _arrow(run_id, 3, "stolen")), 403, refusal,
                 "body.run_id")  # fmt: skip
        for op in [
            {"op": "finish_run", "args": {"run_id": run_id, "status": "failed"}},
            {"op": "set_provenance", "args": {"run_id": run_id, "provenance": {}}},
            {"op": "heartbeat", "args": {"run_ids": [run_id]}},
            {"op": "finish_experiment", "args": {"experiment_id": exp_id, "status": "failed"}},
            {"op": "truncate_run", "args": {"run_id": run_id, "after_step": 0}},
            {"op": "metrics", "args": {"steps": [{"run_id": run_id, "step": 0,
             "wall_time": 0.0, "values": {"stolen": 1.0}}]}},
            {"op": "media", "args": {"rows": [{"table": "histograms", "run_id": run_id,
             "key": "h", "step": 0, "edges": [0, 1], "counts": [1], "nan": 0, "posinf": 0,
             "neginf": 0, "wall_time": 0}]}},
        ]:  # fmt: skip
            _refused(_ops(http, "bob", 2, op), 403, refusal, "body.ops")
    url = served.store_url
    assert _loss_rows(url, run_id) == LOSS_ROWS
    assert _rows(url, "SELECT status FROM runs") == [("running",)]
    assert _rows(url, "SELECT status FROM experiments") == [("running",)]
    assert _rows(url, "SELECT count(*) FROM arms") == [(1,)]
    assert _rows(url, "SELECT count(*) FROM metrics WHERE key = 'stolen'") == [(0,)]
    assert _rows(url, "SELECT count(*) FROM histograms") == [(0,)]
    assert _rows(url, "SELECT client_id FROM ingest_batches") == [("maker-alices",)]
    assert _rows(url, "SELECT name, created_by FROM experiments") == [("alices", "tests-write")]
    # its own token still writes it; the other writes its own experiment
    with _client(served, alice) as http:
        assert http.post(f"{API}/runs/{run_id}/truncate", json={"after_step": 9}).json() == {
            "ok": True
        }
    assert _loss_rows(url, run_id) == 10
    with _client(served, bob) as http:
        _recorded(http, "bobs")
    assert _rows(url, "SELECT name, created_by FROM experiments ORDER BY name") == [
        ("alices", "tests-write"), ("bobs", "bob")
    ]  # fmt: skip


def test_a_batch_mixing_an_own_run_with_another_stores_nothing(served: Served) -> None:
    bob = _token(served, "bob")
    with _client(served, served.write_token) as http:
        _exp, _group, theirs = _recorded(http, "theirs")
    with _client(served, bob) as http:
        _exp, _group, mine = _recorded(http, "mine")
        both = pa.concat_tables(
            [pa.ipc.open_stream(_arrow(r, 2, "mixed")).read_all() for r in (mine, theirs)]
        )
        sink = io.BytesIO()
        with pa.ipc.new_stream(sink, both.schema) as writer:
            writer.write_table(both)
        _refused(_metrics(http, "bob", 5, sink.getvalue()), 403,
                 _belongs("theirs", "tests-write"), "body.run_id")  # fmt: skip
        finish_mine = {"op": "finish_run", "args": {"run_id": mine, "status": "completed"}}
        finish_theirs = {"op": "finish_run", "args": {"run_id": theirs, "status": "failed"}}
        _refused(_ops(http, "bob", 6, finish_mine, finish_theirs), 403,
                 _belongs("theirs", "tests-write"), "body.ops")  # fmt: skip
        assert _ops(http, "bob", 7, finish_mine).json() == {
            "client_id": "bob", "seq": 7, "rows": 1
        }  # fmt: skip
    url = served.store_url
    assert _rows(url, "SELECT count(*) FROM metrics WHERE key = 'mixed'") == [(0,)]
    assert _rows(url, "SELECT run_id, status FROM runs ORDER BY run_id") == [
        (theirs, "running"), (mine, "completed")
    ]  # fmt: skip
    assert _rows(url, "SELECT client_id, seq FROM ingest_batches WHERE client_id = 'bob'") == [
        ("bob", 7)
    ]


def test_a_token_limited_to_an_experiment_reads_and_writes_only_it(served: Served) -> None:
    with _client(served, served.write_token) as http:
        exp_id, _group, run_id = _recorded(http, "granted")
        _other_exp, _g, other_run = _recorded(http, "private")
    limited = _token(served, "helper", experiment="granted")
    reader = _token(served, "viewer", "read", experiment="granted")
    with _client(served, limited) as http:
        assert http.get(f"{API}/token").json() == {
            "name": "helper", "scope": "write", "experiment": "granted"
        }  # fmt: skip
        # writes the experiment it is limited to, though another token created it
        assert http.post(f"{API}/runs/{run_id}/truncate", json={"after_step": 4}).json() == {
            "ok": True
        }
        assert http.post(f"{API}/experiments", json={"name": "granted"}).json() == {
            "experiment_id": exp_id
        }
        # ... and nothing else: not another's, not a new one
        _refused(http.post(f"{API}/runs/{other_run}/truncate", json={}), 403,
                 "token 'helper' may write only experiment 'granted'; "
                 + _belongs("private", "tests-write"), "path.run_id")  # fmt: skip
        _refused(http.post(f"{API}/experiments", json={"name": "new one"}), 403,
                 "token 'helper' may create and write only experiment 'granted', not 'new "
                 "one'; an operator makes a token for it with: lab token create NAME --scope "
                 "write --experiment 'new one'", "body.name")  # fmt: skip
        _refused(http.get(f"{API}/records/experiments/private/run_keys"), 403,
                 "token 'helper' may read only experiment 'granted', not 'private'; an "
                 "operator makes a token for it with: lab token create NAME --scope read "
                 "--experiment private", "path.name")  # fmt: skip
    for token in (limited, reader):
        with _client(served, token) as http:
            listed = http.get(f"{API}/experiments").json()
            assert [e["name"] for e in listed] == ["granted"]
            board = http.get(f"{API}/dashboard/experiments").json()
            assert (board["total"], [e["name"] for e in board["rows"]]) == (1, ["granted"])
            assert http.get(f"{API}/experiments/granted").status_code == 200
            name = "helper" if token == limited else "viewer"
            refusal = (
                f"token {name!r} may read only experiment 'granted', not 'private'; an "
                "operator makes a token for it with: lab token create NAME --scope read "
                "--experiment private"
            )
            _refused(http.get(f"{API}/experiments/private"), 403, refusal, "path.name")
            _refused(http.get(f"{API}/dashboard/experiments/private/runs"), 403, refusal,
                     "path.name")  # fmt: skip
            _refused(http.get(f"{API}/runs/{other_run}/evals"), 403, refusal, "path.run_id")
            _refused(http.get(f"{API}/dashboard/runs/{other_run}"), 403, refusal,
                     "path.run_id")  # fmt: skip
            _refused(http.get(f"{API}/tables/runs", params={"experiment": "private"}), 403,
                     refusal, "query.experiment")  # fmt: skip
            runs = pa.ipc.open_stream(http.get(f"{API}/tables/runs").content).read_all()
            assert runs.column("run_id").to_pylist() == [run_id]
            metrics = pa.ipc.open_stream(http.get(f"{API}/tables/metrics").content).read_all()
            assert set(metrics.column("run_id").to_pylist()) == {run_id}
    assert _loss_rows(served.store_url, run_id) == 5
    assert _loss_rows(served.store_url, other_run) == LOSS_ROWS


def test_an_admin_token_writes_every_experiment_a_local_one_included(served: Served) -> None:
    with _client(served, served.write_token) as http:
        _exp, _group, run_id = _recorded(http, "someones")
    local = Store(served.store_url)
    try:  # recorded by a local process: no token created it
        local_exp = local.begin_experiment("local", config={}, seed=0, repeats=1)
        local.finish_experiment(local_exp, status="completed")
    finally:
        local.close()
    admin = _token(served, "root", "admin")
    with _client(served, served.write_token) as http:
        _refused(http.post(f"{API}/experiments/{local_exp}/arms", json={"name": "x"}), 403,
                 "experiment 'local' was recorded by a local process or before the server "
                 "kept owners, so through the server only an admin token or a token limited "
                 "to it may write it; an operator makes one with: lab token create NAME "
                 "--scope write --experiment local", "path.experiment_id")  # fmt: skip
    with _client(served, admin) as http:
        assert http.get(f"{API}/token").json() == {
            "name": "root", "scope": "admin", "experiment": None
        }  # fmt: skip
        assert http.post(f"{API}/runs/{run_id}/truncate", json={}).json() == {"ok": True}
        arm = http.post(f"{API}/experiments/{local_exp}/arms", json={"name": "x"})
        assert arm.status_code == 200
        assert http.post(f"{API}/experiments", json={"name": "local"}).json() == {
            "experiment_id": local_exp
        }
    with _client(served, _token(served, "local-helper", experiment="local")) as http:
        assert http.post(f"{API}/experiments/{local_exp}/groups", json={"name": "g"}).json()
    url = served.store_url
    assert _loss_rows(url, run_id) == 0
    assert _rows(url, "SELECT name, created_by FROM experiments ORDER BY name") == [
        ("local", None), ("someones", "tests-write")
    ]  # fmt: skip


#: A checkpoint row as the OpenAPI document declares it.
CHECKPOINT = {"run_key": "r0", "step": 1, "path": "p", "event": "save", "time": 0.0}


def test_writes_naming_runs_or_experiments_the_store_lacks_answer_404_and_store_nothing(
    served: Served,
) -> None:
    with _client(served, served.write_token) as http:
        exp_id, group_id, run_id = _recorded(http, "real")
    admin = _token(served, "root", "admin")
    missing_run = (
        "no run with id 987654321 in the store; an experiment's runs: GET "
        "/api/v1/experiments/NAME/runs"
    )
    missing_exp = (
        "no experiment with id 987654321 in the store; the experiments: GET /api/v1/experiments"
    )
    for token in (served.write_token, admin):
        with _client(served, token) as http:
            for path, body in [
                ("truncate", {}),
                ("release", {"error": "x"}),
                ("supersede", {"run_key": "x"}),
            ]:
                _refused(http.post(f"{API}/runs/987654321/{path}", json=body), 404,
                         missing_run, "path.run_id")  # fmt: skip
            _refused(http.post(f"{API}/experiments/987654321/finish", json={"status": "failed"}),
                     404, missing_exp, "path.experiment_id")  # fmt: skip
            _refused(_metrics(http, "c404", 1, _arrow(987654321, 2)), 404, missing_run,
                     "body.run_id")  # fmt: skip
            for op in [
                {"op": "finish_run", "args": {"run_id": 987654321, "status": "completed"}},
                {"op": "write_checkpoint", "args": {"run_id": 987654321, "row": CHECKPOINT}},
                {"op": "heartbeat", "args": {"run_ids": [run_id, 987654321]}},
                {"op": "truncate_run", "args": {"run_id": 987654321, "after_step": None}},
                {
                    "op": "metrics",
                    "args": {
                        "steps": [
                            {"run_id": run_id, "step": 1, "wall_time": 0.0, "values": {"x": 1.0}},
                            {
                                "run_id": 987654321,
                                "step": 1,
                                "wall_time": 0.0,
                                "values": {"x": 1.0},
                            },
                        ]
                    },
                },
            ]:
                _refused(_ops(http, "c404", 2, op), 404, missing_run, "body.ops")
            _refused(_ops(http, "c404", 2, {"op": "finish_experiment", "args": {
                "experiment_id": 987654321, "status": "failed"}}), 404, missing_exp,
                "body.ops")  # fmt: skip
            # a run is started, claimed or chained only inside the experiment of the path
            _refused(http.post(f"{API}/experiments/{exp_id}/runs", json={
                "group_id": group_id, "run_key": "b", "claimed": 987654321}), 404,
                f"experiment {exp_id} has no run 987654321", "body.claimed")  # fmt: skip
            _refused(http.post(f"{API}/experiments/{exp_id}/claims", json={
                "group_id": 987654321, "run_key": "b"}), 404,
                f"experiment {exp_id} has no group 987654321", "body.group_id")  # fmt: skip
    url = served.store_url
    assert _rows(url, "SELECT client_id FROM ingest_batches") == [("maker-real",)]
    assert _rows(url, "SELECT run_id, status FROM runs") == [(run_id, "running")]
    assert _loss_rows(url, run_id) == LOSS_ROWS
