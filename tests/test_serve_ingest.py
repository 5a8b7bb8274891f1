"""The write path of `lab serve`: a real uvicorn server (the `served` fixture, on SQLite and
PostgreSQL), real `HttpStore` clients in this process and in subprocesses, SIGKILL, spools.
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pydantic
import pytest
import sqlalchemy as sa
import torch

from lab import Arm, Callback, Experiment
from lab.errors import (
    ConfigError,
    SchemaTooNew,
    StoreUnreachable,
    TokenRejected,
    UnknownScheme,
)
from lab.loop import CheckpointConfig, Evaluator, TrainingLoop
from lab.records import EvalResult, RunSpec
from lab.store import Store, open_store
from lab.store.http import HttpStore
from lab.store.http.spool import SPOOL_DIR, describe
from tests import warm
from tests.served import Served

ROOT = Path(__file__).resolve().parents[1]
STEPS = 12


# -- a real experiment, recorded locally and through the server ------------------------------
def _loss(m: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.mse_loss(m(x), y)


def train(run: RunSpec) -> Any:
    gen = torch.Generator().manual_seed(run.seed)
    x = torch.randn(16, 3, generator=gen)
    y = x.sum(1, keepdim=True)
    torch.manual_seed(run.seed)
    model = torch.nn.Linear(3, 1)

    def bench(m: torch.nn.Module) -> EvalResult:
        out = m(x[:3]).squeeze(1)
        preds = [
            {"example_id": i, "input": f"x{i}", "output": round(float(out[i]), 6),
             "target": float(y[i, 0]), "score": float("nan") if i == 1 else -float(i),
             "difficulty": "hard" if i else "easy"}
            for i in range(3)
        ]  # fmt: skip
        return EvalResult(
            "bench", {"mae": 0.5, "odd": math.inf}, breakdowns={"easy": {"mae": 0.25}},
            tags={"suite": "tiny"}, predictions=preds,
        )  # fmt: skip

    loop = TrainingLoop(
        model,
        torch.optim.SGD(model.parameters(), lr=run.config.lr),
        [(x[:8], y[:8]), (x[8:], y[8:])],
        _loss,
        STEPS,
        evaluators=[
            Evaluator("val", lambda m: {"loss": _loss(m, (x, y)).item(), "nan": math.nan}, every=4),
            Evaluator("bench", bench, every=6),
        ],
        checkpoint=CheckpointConfig(every=5, keep_last=1),
    )
    return loop.fit(run)


class Config(pydantic.BaseModel):
    lr: float = 0.05


def _experiment(store: Any, folder: Path, **kw: Any) -> Experiment:
    return Experiment(
        "through-http",
        train=train,
        base_config=Config(),
        arms=[Arm("slow", lr=0.01), Arm("fast", lr=0.1)],
        repeats=2,
        store=store,
        output_dir=str(folder),
        **kw,
    )


def _contents(url: str) -> dict[str, list[tuple[Any, ...]]]:
    """Every table's rows, by natural keys (run key, eval name, step...), without ids, times,
    folders and process identities: what must be the same however the rows arrived."""
    queries = {
        "experiments": "select name, status, config, seed, repeats, callback_errors "
        "from experiments",
        "arms": "select a.name, a.overrides, a.config from arms a",
        "groups": "select g.name, g.kind, a.name from groups g left join arms a using (arm_id)",
        "runs": "select run_key, status, repeat, stage, seed, config, summary, error, "
        "callback_errors, config_hash from runs",
        "metrics": "select r.run_key, m.key, m.step, m.value from metrics m join runs r "
        "using (run_id) where m.key != 'step_time'",
        "summaries": 'select r.run_key, s.key, s."count", s.first_step, s.last_step, '
        "s.last_value, s.min_value, s.max_value from summaries s join runs r using (run_id) "
        "where s.key != 'step_time'",
        "evals": "select r.run_key, e.name, e.step, e.metrics, e.breakdowns, e.tags, e.error "
        "from evals e join runs r using (run_id)",
        "predictions": "select r.run_key, e.name, e.step, p.idx, p.example_id, p.input, "
        "p.output, p.target, p.score, p.extras from predictions p join evals e "
        "using (eval_id) join runs r using (run_id)",
        "checkpoints": "select r.run_key, c.step, c.event, c.metrics, c.reason "
        "from checkpoints c join runs r using (run_id)",
    }
    engine = sa.create_engine(url)
    out = {}
    try:
        with engine.connect() as conn:
            for table, sql in queries.items():
                rows = [tuple(_norm(v) for v in row) for row in conn.exec_driver_sql(sql)]
                out[table] = sorted(rows, key=repr)
    finally:
        engine.dispose()
    return out


def _timeless(value: Any) -> Any:
    """`value` without the wall time a step took (it differs from one run to the next)."""
    if isinstance(value, dict):
        return {k: _timeless(v) for k, v in value.items() if k != "step_time"}
    return value


def _norm(value: Any) -> Any:
    if isinstance(value, str) and value[:1] in "[{":
        try:
            return json.dumps(_timeless(json.loads(value)), sort_keys=True)
        except ValueError:
            return value
    if isinstance(value, dict | list):
        return json.dumps(_timeless(value), sort_keys=True)
    if isinstance(value, float) and math.isnan(value):
        return "NaN"
    return value


def _fresh_like(store_url: str, tmp_path: Path) -> tuple[str, Any]:
    """A second, empty store on the same backend as `store_url` (and its clean-up)."""
    if not store_url.startswith("postgresql"):
        return f"sqlite:///{tmp_path / 'local.db'}", lambda: None
    base = sa.engine.make_url(store_url)
    name = base.database + "_local"
    admin = sa.create_engine(base, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.exec_driver_sql(f'CREATE DATABASE "{name}"')

    def drop() -> None:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.dispose()

    return base.set(database=name).render_as_string(hide_password=False), drop


def test_an_experiment_through_http_records_the_same_rows_as_the_local_store(
    served: Served, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LAB_TOKEN", served.write_token)
    local_url, drop = _fresh_like(served.store_url, tmp_path)
    try:
        remote = _experiment(served.url, tmp_path / "remote").run()
        local = _experiment(local_url, tmp_path / "local").run()
        assert [r.status for r in remote.runs] == ["completed"] * 4
        assert repr([(r.run_key, _timeless(r.metrics)) for r in remote.runs]) == repr(
            [(r.run_key, _timeless(r.metrics)) for r in local.runs]
        )
        got, want = _contents(served.store_url), _contents(local_url)
    finally:
        drop()
    assert len(got["metrics"]) > 4 * STEPS
    assert len(got["predictions"]) == 4 * 3 * 2
    for table in want:
        assert got[table] == want[table], table
    assert list((tmp_path / "remote").rglob(f"{SPOOL_DIR}/*")) == []


# -- how many requests an experiment makes ---------------------------------------------------
FAIL_AFTER: dict[str, int | None] = {"steps": None}


def _fit_30(run: RunSpec, lr: float, fail_after: int | None = None, **kw: Any) -> Any:
    """30 steps and an eval every 10; the loss raises after `fail_after` steps if given."""
    torch.manual_seed(run.seed)
    x = torch.randn(32, 4)
    y = x.sum(1, keepdim=True)
    model = torch.nn.Linear(4, 1)
    taken = [0]

    def loss(m: torch.nn.Module, batch: Any) -> torch.Tensor:
        taken[0] += 1
        if fail_after is not None and taken[0] > fail_after:
            raise RuntimeError("the machine went away")
        return _loss(m, batch)

    evaluators = [Evaluator("val", lambda m: {"loss": _loss(m, (x, y)).item()}, every=10)]
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    return TrainingLoop(model, opt, [(x, y)], loss, 30, evaluators=evaluators, **kw).fit(run)


def train_30(run: RunSpec) -> Any:
    """The small experiment's run."""
    return _fit_30(run, run.config.lr)


def train_resumable(run: RunSpec) -> Any:
    """A checkpoint every 5 steps; fails after `FAIL_AFTER` steps if set."""
    checkpoint = CheckpointConfig(every=5, keep_last=1)
    return _fit_30(run, 0.05, FAIL_AFTER["steps"], checkpoint=checkpoint)


def _counted(served: Served, monkeypatch: pytest.MonkeyPatch, sent: list[str]) -> HttpStore:
    """An `HttpStore` whose httpx client records each request it sends in `sent`, and whose
    writer sends only when asked (a flush, the close), never on its own clock: the count
    is then the protocol's, whatever the machine's speed."""
    import functools

    import httpx

    import lab.store.http.writes as writes

    class Counted(httpx.Client):
        def __init__(self, **kw: Any) -> None:
            record = lambda r: sent.append(f"{r.method} {r.url.path.removeprefix('/api/v1')}")  # noqa: E731
            super().__init__(event_hooks={"request": [record]}, **kw)

    monkeypatch.setattr(httpx, "Client", Counted)
    paced = functools.partial(writes.MetricWriter, interval_s=3600.0)
    monkeypatch.setattr(writes, "MetricWriter", paced)
    return HttpStore(served.url, token=served.write_token, heartbeat_s=3600.0)


@pytest.mark.serial  # slowed past 15 s (half the heartbeat), it sends one heartbeat more
def test_a_small_experiment_makes_one_request_to_start_a_run_and_one_to_end_it(
    served: Served, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """2 arms x 2 repeats x 30 steps: a run is claimed (which starts it: no start, no
    truncate of its own), and its rows, evals, truncation, provenance and end go in one
    batch at its end; opening the store is one request."""
    from lab.loggers import SqlLogger

    sent: list[str] = []
    store = _counted(served, monkeypatch, sent)
    try:
        result = Experiment(
            "small", train=train_30, base_config=Config(), repeats=2, store=False,
            arms=[Arm("slow", lr=0.01), Arm("fast", lr=0.1)], output_dir=str(tmp_path),
            callbacks=[SqlLogger(store)],
        ).run()  # fmt: skip
    finally:
        store.close()
    assert [r.status for r in result.runs] == ["completed"] * 4
    run = ["POST /experiments/1/claims", "POST /batches/ops"]
    assert sent == [
        "GET /batches/check",
        "POST /records/mark_crashed",
        "GET /records/experiments/small/previous_runs",
        "POST /experiments",
        "POST /experiments/1/arms",
        "POST /experiments/1/arms",
        "POST /experiments/1/groups", *run, *run,
        "POST /experiments/1/groups", *run, *run,
        "POST /batches/ops",  # the last run's end, the experiment's end
    ]  # fmt: skip
    steps = "select r.run_key, count(*) from metrics m join runs r using (run_id) "
    assert _count(served.store_url, steps + "where key = 'loss' group by 1 order by 1") == [
        ("fast-r0", 30), ("fast-r1", 30), ("slow-r0", 30), ("slow-r1", 30),
    ]  # fmt: skip
    evals = "select count(*), count(distinct run_id) from evals where name = 'val'"
    assert _count(served.store_url, evals) == [(12, 4)]
    assert _count(served.store_url, "select count(*) from runs where provenance is null") == [(0,)]


def test_few_metric_rows_travel_among_the_writes_and_many_as_arrow() -> None:
    """`Sender._batches` for a server that takes the metrics op: steps between two writes
    join their JSON batch as one metrics op (a step each, NaN and inf kept), in order; a
    run of steps over `MAX_JSON_POINTS` points is an Arrow batch."""
    from lab.store.http.sender import MAX_JSON_POINTS, Op, Sender

    sender = Sender(None, "c", lambda run_id: None, heartbeat_s=60.0, json_points=MAX_JSON_POINTS)  # type: ignore[arg-type]
    few = [(1, 0, {"loss": 0.5}, 10.0), (1, 1, {"loss": math.nan, "lr": math.inf}, 11.0)]
    evaluated = Op("write_eval", {"run_id": 1, "result": {"name": "val", "step": 1}}, 1)
    wide = {f"k{i}": 0.25 for i in range(MAX_JSON_POINTS // 2 + 1)}
    many = [(1, 2, wide, 12.0), (1, 3, wide, 13.0)]
    ended = Op("finish_run", {"run_id": 1, "status": "completed"}, 1)
    cut = [sender._number(b) for b in sender._batches([*few, evaluated, *many, ended])]
    assert [(b.kind, b.seq, b.run_id) for b in cut] == [("json", 1, 1), ("arrow", 2, 1),
                                                       ("json", 3, 1)]  # fmt: skip
    first = json.loads(cut[0].body)
    assert first["ops"][0]["op"] == "metrics" and first["ops"][1:] == [
        {"op": "write_eval", "args": {"run_id": 1, "result": {"name": "val", "step": 1}}}
    ]
    assert repr(first["ops"][0]["args"]) == repr({"steps": [
        {"run_id": 1, "step": 0, "wall_time": 10.0, "values": {"loss": 0.5}},
        {"run_id": 1, "step": 1, "wall_time": 11.0, "values": {"loss": math.nan, "lr": math.inf}},
    ]})  # fmt: skip
    assert describe("json", cut[0].body) == "3 metric rows and 1 write (write_eval) of run 1"
    assert describe("arrow", cut[1].body) == f"{2 * len(wide)} metric rows of run 1"
    assert json.loads(cut[2].body)["ops"] == [
        {"op": "finish_run", "args": {"run_id": 1, "status": "completed"}}
    ]
    assert sender.last_steps == {1: 3}


def test_a_client_of_a_server_that_names_no_ops_sends_what_every_server_takes(
    served: Served, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server from before the write check named its operations: metric rows go as Arrow
    batches and a run's truncation as a request of its own, and the rows are the same."""
    from lab.loggers import SqlLogger
    from lab.store.http.client import HttpClient

    opened = HttpClient._open

    def older(client: HttpClient) -> None:
        opened(client)
        client.ops = frozenset()  # what the write check of an older server leaves it knowing

    monkeypatch.setattr(HttpClient, "_open", older)
    sent: list[str] = []
    store = _counted(served, monkeypatch, sent)
    local_url, drop = _fresh_like(served.store_url, tmp_path)
    try:
        try:
            remote = _experiment(False, tmp_path / "remote", callbacks=[SqlLogger(store)]).run()
        finally:
            store.close()
        local = _experiment(local_url, tmp_path / "local").run()
        got, want = _contents(served.store_url), _contents(local_url)
    finally:
        drop()
    assert [r.status for r in remote.runs] == [r.status for r in local.runs] == ["completed"] * 4
    assert sent.count("POST /batches/metrics") >= 4
    truncated = [f"POST /runs/{run_id}/truncate" for run_id in range(1, 5)]
    assert [s for s in sent if s.endswith("/truncate")] == truncated
    for table in want:
        assert got[table] == want[table], table


def test_a_resumed_run_drops_its_rows_after_the_checkpoint_in_order_with_its_writes(
    served: Served, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run fails at step 18 and resumes from its checkpoint at 15: its truncation rides
    in its first batch, before the steps it trains again, and the store ends as a local one
    does."""
    from lab.loggers import SqlLogger

    sent: list[str] = []
    store = _counted(served, monkeypatch, sent)
    local_url, drop = _fresh_like(served.store_url, tmp_path)

    def twice(callbacks: list[Callback], folder: Path) -> list[str]:
        statuses = []
        for fail_after in (17, None):
            FAIL_AFTER["steps"] = fail_after
            exp = Experiment("resumed", train=train_resumable, output_dir=str(folder),
                             store=False, callbacks=callbacks)  # fmt: skip
            statuses += [r.status for r in exp.run().runs]
        return statuses

    try:
        try:
            remote = twice([SqlLogger(store)], tmp_path / "remote")
        finally:
            store.close()
            FAIL_AFTER["steps"] = None
        local = twice([SqlLogger(local_url)], tmp_path / "local")
        got, want = _contents(served.store_url), _contents(local_url)
    finally:
        drop()
    assert remote == local == ["failed", "completed"]
    assert not [s for s in sent if s.endswith("/truncate") or s.endswith("/runs")]
    loss = [(m[2], m[3]) for m in got["metrics"] if m[1] == "loss"]
    assert sorted(step for step, _ in loss) == list(range(1, 31))
    for table in want:
        assert got[table] == want[table], table


def test_a_run_another_client_trains_is_refused_with_the_line_a_local_store_gives(
    served: Served, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The runs an experiment finds are read with their times as `datetime`, as from a local
    store, so the line that names the process training one says since when."""
    import socket

    from lab.errors import RunBusy

    monkeypatch.setenv("LAB_TOKEN", served.write_token)
    other = HttpStore(served.url)
    try:
        exp = other.begin_experiment("busy", config={}, seed=0, repeats=1)
        group = other.add_group(exp, "base")
        other.start_run(exp, group, run_key="base-r0", arm_id=None, repeat=0, stage=0, seed=0,
                        config={}, output_dir=None)  # fmt: skip
        with pytest.raises(RunBusy) as busy:
            Experiment("busy", train=train_30, output_dir=str(tmp_path), store=served.url).run()
    finally:
        other.close()
    assert re.fullmatch(
        rf"run base-r0 of experiment 'busy' is being trained by pid {os.getpid()} on "
        rf"{re.escape(socket.gethostname())} since \d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d UTC; "
        r"wait for it to end and run again \(finished runs are reused\), or use another "
        r"experiment name",
        str(busy.value),
    ), str(busy.value)


def test_provenance_read_after_a_run_started_reaches_the_server(
    served: Served, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run that starts while git is still being read sends its provenance afterwards
    (the `set_provenance` op); the server's row has it once the run has ended."""
    import lab.loggers.sql

    monkeypatch.setenv("LAB_TOKEN", served.write_token)
    release = threading.Event()
    real = lab.loggers.sql.collect

    def slow() -> Any:
        assert release.wait(10), "the run never started"
        return real()

    def quick(run: RunSpec) -> dict[str, float]:
        started.append(_count(served.store_url, "SELECT provenance FROM runs"))
        release.set()
        return {"loss": 1.0}

    started: list[Any] = []
    monkeypatch.setattr(lab.loggers.sql, "collect", slow)
    Experiment("late-prov", quick, store=served.url, output_dir=str(tmp_path)).run()
    assert started == [[(None,)]]
    ((prov,),) = _count(served.store_url, "SELECT provenance FROM runs")
    prov = json.loads(prov) if isinstance(prov, str) else prov  # JSON text on SQLite
    assert prov["python"] == sys.version.split()[0]


# -- idempotent batches ------------------------------------------------------------------------
def _arrow(rows: list[tuple[int, int, str, float]]) -> bytes:
    table = pa.table(
        {
            "run_id": pa.array([r[0] for r in rows], pa.int64()),
            "step": pa.array([r[1] for r in rows], pa.int64()),
            "key": pa.array([r[2] for r in rows], pa.string()),
            "value": pa.array([r[3] for r in rows], pa.float64()),
            "wall_time": pa.array([1.5] * len(rows), pa.float64()),
        }
    )
    sink = io.BytesIO()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue()


def _one_run(served: Served) -> int:
    with served.client() as http:
        exp = http.post("/api/v1/experiments", json={"name": "batches"}).json()["experiment_id"]
        group = http.post(f"/api/v1/experiments/{exp}/groups", json={"name": "g"}).json()
        run = http.post(
            f"/api/v1/experiments/{exp}/runs",
            json={"group_id": group["group_id"], "run_key": "r0"},
        )
        return run.json()["run_id"]


def _count(url: str, sql: str) -> Any:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            return conn.exec_driver_sql(sql).all()
    finally:
        engine.dispose()


def test_a_batch_sent_again_with_the_same_client_and_seq_stores_nothing_twice(
    served: Served,
) -> None:
    run_id = _one_run(served)
    body = _arrow([(run_id, s, "loss", v) for s, v in enumerate([3.0, math.nan, -math.inf])])
    headers = {"X-Lab-Client": "c1", "X-Lab-Seq": "1", "Content-Type": "application/octet-stream"}
    ops = {
        "client_id": "c1",
        "seq": 2,
        "ops": [{"op": "write_checkpoint", "args": {"run_id": run_id, "row": {
            "run_key": "r0", "step": 2, "path": "step_2", "event": "save", "time": 1.0}}}],
    }  # fmt: skip
    with served.client() as http:
        answers = [http.post("/api/v1/batches/metrics", content=body, headers=headers)
                   for _ in range(3)]  # fmt: skip
        again = [http.post("/api/v1/batches/ops", json=ops) for _ in range(2)]
    assert [a.status_code for a in answers + again] == [200] * 5
    assert [a.json()["rows"] for a in answers] == [3, 0, 0]
    assert [a.json()["rows"] for a in again] == [1, 0]
    url = served.store_url
    (s0, v0), (s1, v1), (s2, v2) = _count(url, "select step, value from metrics order by step")
    assert (s0, v0, s1, s2, v2) == (0, 3.0, 1, 2, -math.inf)
    assert v1 is None if url.startswith("sqlite") else math.isnan(v1)  # SQLite: NaN as NULL
    assert _count(url, 'select "count", first_step, last_step from summaries') == [(3, 0, 2)]
    assert _count(url, "select step, event from checkpoints") == [(2, "save")]
    assert _count(url, "select client_id, seq, rows from ingest_batches order by seq") == [
        ("c1", 1, 3),
        ("c1", 2, 1),
    ]


def test_malformed_batches_are_refused_with_one_line_and_store_nothing(served: Served) -> None:
    run_id = _one_run(served)
    with served.client() as http:
        not_arrow = http.post(
            "/api/v1/batches/metrics",
            content=b"not arrow",
            headers={"X-Lab-Client": "c1", "X-Lab-Seq": "1"},
        )
        no_seq = http.post(
            "/api/v1/batches/metrics",
            content=_arrow([(run_id, 0, "loss", 1.0)]),
            headers={"X-Lab-Client": "c1"},
        )
        bad_key = http.post(
            "/api/v1/batches/metrics",
            content=_arrow([(run_id, 0, "", 1.0)]),
            headers={"X-Lab-Client": "c1", "X-Lab-Seq": "1"},
        )
        no_run = http.post(
            "/api/v1/batches/metrics",
            content=_arrow([(run_id + 99, 0, "loss", 1.0)]),
            headers={"X-Lab-Client": "c1", "X-Lab-Seq": "1"},
        )
        bad_op = http.post(
            "/api/v1/batches/ops",
            json={"client_id": "c1", "seq": 1, "ops": [{"op": "drop_table", "args": {}}]},
        )
    assert [r.status_code for r in (not_arrow, no_seq, bad_key, no_run, bad_op)] == [
        400, 422, 400, 404, 400,
    ]  # fmt: skip
    assert not_arrow.json()["detail"].startswith("the body is not an Arrow IPC stream")
    assert no_seq.json() == {"detail": "header.x-lab-seq: Field required",
                             "field": "header.x-lab-seq"}  # fmt: skip
    assert bad_op.json()["detail"].startswith('ops.0: each op is {"op": one of write_eval')
    assert _count(served.store_url, "select count(*) from metrics") == [(0,)]
    assert _count(served.store_url, "select count(*) from ingest_batches") == [(0,)]


# -- bad input at the client -------------------------------------------------------------------
def test_a_metrics_op_that_is_not_metric_rows_is_refused_with_one_line_and_stores_nothing(
    served: Served,
) -> None:
    run_id = _one_run(served)
    good = [
        {"run_id": run_id, "step": 0, "wall_time": 0.0, "values": {"loss": 1.0}},
        {"run_id": run_id, "step": 1, "wall_time": 0.0, "values": {"loss": 0.5}},
    ]
    declared = "body.ops.0.metrics.args.steps.1."  # what the OpenAPI document declares: a 422
    bad = [
        ({"step": True}, 422, "Input should be a valid integer", declared + "step"),
        ({"step": 2**63}, 422, "Input should be less than or equal to 9007199254740992",
         declared + "step"),
        ({"run_id": "1"}, 422, "Input should be a valid integer", declared + "run_id"),
        ({"values": {"a\x00b": 0.5}}, 400, "metric key 'a\\x00b' at step 1 holds a NUL "
         "character", "body"),
        ({"values": {"loss": "0.5"}}, 422, "Input should be a valid number",
         declared + "values.loss"),
        ({"wall_time": None}, 422, "Input should be a valid number", declared + "wall_time"),
        ({"loss": 0.5}, 422, "Extra inputs are not permitted", declared + "loss"),
    ]  # fmt: skip
    with served.client() as http:
        for seq, (change, status, line, field) in enumerate(bad, start=1):
            ops = [{"op": "metrics", "args": {"steps": [good[0], {**good[1], **change}]}}]
            answer = http.post(
                "/api/v1/batches/ops", json={"client_id": "m", "seq": seq, "ops": ops}
            )
            detail = line if status == 400 else f"{field}: {line}"
            assert (answer.status_code, answer.json()) == (
                status, {"detail": detail, "field": field}
            )  # fmt: skip
        good_op = {"op": "metrics", "args": {"steps": good}}
        body = {"client_id": "m", "seq": 99, "ops": [good_op]}
        taken = http.post("/api/v1/batches/ops", json=body)
        assert taken.json() == {"client_id": "m", "seq": 99, "rows": 1}
    rows = "select step, value from metrics where key = 'loss' order by step"
    assert _count(served.store_url, rows) == [(0, 1.0), (1, 0.5)]
    assert _count(served.store_url, "select client_id, seq from ingest_batches "
                  "where client_id = 'm'") == [("m", 99)]  # fmt: skip


def test_a_wrong_token_a_read_token_and_a_url_with_a_password_are_one_line_each(
    served: Served,
) -> None:
    with pytest.raises(TokenRejected) as wrong:
        HttpStore(served.url, token="lab_not-a-token")
    assert str(wrong.value) == (
        f"lab serve at {served.url} refused the token in LAB_TOKEN: it is wrong or revoked; "
        "make one with lab token create NAME --scope write on the server's store"
    )
    assert "lab_not-a-token" not in str(wrong.value)
    reader = HttpStore(served.url, token=served.read_token)
    try:
        assert reader.scope == "read"
        with pytest.raises(TokenRejected, match="is a read token; writing needs one made with"):
            reader.begin_experiment("x", config={}, seed=0, repeats=1)
    finally:
        reader.close()
    with pytest.raises(ConfigError) as password:
        HttpStore(served.url.replace("http://", "http://me:s3cret@"), token=served.write_token)
    assert "s3cret" not in str(password.value)
    assert str(password.value).endswith("carries a user or password; give the server's URL "
                                        "without them and the token in LAB_TOKEN")  # fmt: skip


def test_a_server_url_is_no_sql_store_and_open_store_picks_the_backend(served: Served) -> None:
    with pytest.raises(UnknownScheme) as refused:
        Store(served.url)
    assert str(refused.value) == (
        f"{served.url} is a lab serve server, not a SQL store; open it with "
        "lab.store.open_store(url) or lab.store.http.HttpStore(url)"
    )
    opened = open_store(served.url + "/", token=served.write_token)
    try:
        assert isinstance(opened, HttpStore) and str(opened.url) == served.url
        assert opened.scope == "write"
    finally:
        opened.close()


def test_an_unreachable_server_stops_the_experiment_before_any_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.served import free_port

    monkeypatch.setenv("LAB_TOKEN", "lab_whatever")
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(StoreUnreachable) as gone:
        _experiment(url, tmp_path / "runs").run()
    assert str(gone.value).startswith(f"lab serve at {url} did not answer (")
    assert str(gone.value).endswith("); start it (lab serve --store URL) or check the URL and "
                                    "the network")  # fmt: skip
    assert not (tmp_path / "runs").exists()


def test_a_server_with_a_newer_schema_is_refused_with_the_upgrade_line() -> None:
    import http.server

    class Newer(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # a lab serve of a later lab: its health names its schema
            body = b'{"status": "ok", "schema": "9999_from_the_future"}'
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Newer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        want = (
            r"at schema revision 9999_from_the_future, newer than this lab knows \(\w+\); "
            r"upgrade lab: pip install -U lab"
        )
        with pytest.raises(SchemaTooNew, match=want):
            HttpStore(url, token="lab_x")
    finally:
        server.shutdown()


# -- many clients, a killed server -------------------------------------------------------------
CLIENT = """
import os, sys
from lab.store import Store, open_store
from lab.store.http import HttpStore
i, steps, keys = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
store = HttpStore(os.environ["LAB_STORE_URL"])
exp = store.begin_experiment("many", config={}, seed=0, repeats=16)
group = store.add_group(exp, "clients")
run = store.start_run(exp, group, run_key=f"c{i:02d}", arm_id=None, repeat=i, stage=0, seed=i,
                      config={}, output_dir=None)
for step in range(steps):
    store.log_metrics(run, step, {f"k{k}": i * 1e6 + step * 100 + k for k in range(keys)})
store.finish_run(run, status="completed")
store.close()
"""


def test_sixteen_client_processes_at_once_lose_and_duplicate_nothing(
    served: Served, tmp_path: Path
) -> None:
    steps, keys = 200, 10
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LAB_STORE_URL": served.url,
           "LAB_TOKEN": served.write_token}  # fmt: skip
    procs = [
        warm.popen(
            [sys.executable, "-c", CLIENT, str(i), str(steps), str(keys)],
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(16)
    ]
    errors = [p.communicate(timeout=300)[1] for p in procs]
    assert [p.returncode for p in procs] == [0] * 16, errors
    url = served.store_url
    assert _count(url, "select count(*), count(distinct run_id) from metrics") == [
        (16 * steps * keys, 16)
    ]
    # each value is where it belongs; a batch applied twice would double a summary's count
    assert _count(url, "select count(*) from metrics m join runs r using (run_id) where "
                  "m.value != r.repeat * 1e6 + m.step * 100 + cast(substr(m.key, 2) as int)"
                  ) == [(0,)]  # fmt: skip
    assert _count(url, 'select distinct "count", first_step, last_step from summaries') == [
        (steps, 0, steps - 1)
    ]
    assert _count(url, "select status, count(*) from runs group by status") == [("completed", 16)]


def test_a_server_sigkilled_during_ingestion_and_restarted_loses_and_duplicates_nothing(
    served: Served,
) -> None:
    steps, keys = 3000, 10
    store = HttpStore(served.url, token=served.write_token, retry_s=60)
    exp = store.begin_experiment("killed", config={}, seed=0, repeats=1)
    group = store.add_group(exp, "g")
    run = store.start_run(exp, group, run_key="r0", arm_id=None, repeat=0, stage=0, seed=0,
                          config={}, output_dir=None)  # fmt: skip
    killed = threading.Event()
    try:
        for step in range(steps):
            store.log_metrics(run, step, {f"k{k}": step * 100.0 + k for k in range(keys)})
            if step % 100 == 99:
                time.sleep(0.02)  # batches go out while the loop runs
            if step == 1500:
                deadline = time.monotonic() + 30
                while store._sender.sent_batches == 0 and time.monotonic() < deadline:
                    time.sleep(0.01)  # ingestion is under way...
                store.writer._wake.set()  # ...and a batch goes out now, as the server dies
                served.kill()
                killed.set()
                threading.Timer(0.5, served.start).start()
        store.finish_run(run, status="completed")
        store.flush()
    finally:
        store.close()
    assert killed.is_set() and store.spooled == []
    url = served.store_url
    assert _count(url, "select count(*), min(step), max(step) from metrics") == [
        (steps * keys, 0, steps - 1)
    ]
    assert _count(url, "select count(*) from metrics where value != step * 100 + "
                  "cast(substr(key, 2) as int)") == [(0,)]  # fmt: skip
    assert _count(url, 'select distinct "count" from summaries') == [(steps,)]
    assert _count(url, "select status from runs") == [("completed",)]


# -- the server away longer than the retry window: the spool ---------------------------------
SLOW_STEPS = 120


class ServerTrouble(Callback):
    """Kills the server at one step and, when `back_at` is set, starts it again at another;
    five steps later it waits (up to 30 s) for the sender to empty the spool while the run
    is still going, and notes whether it did."""

    def __init__(self, served: Served, down_at: int, back_at: int | None) -> None:
        self.served, self.down_at, self.back_at = served, down_at, back_at
        self.spooled_while_down: list[Path] = []
        self.replayed_during_run = False

    def on_step_end(self, state: Any, step_idx: int, batch: Any, metrics: Any) -> None:
        time.sleep(0.02)  # a step that takes a while, so the run outlives the outage
        spool = state.ctx.run_dir / SPOOL_DIR
        if step_idx == self.down_at:
            self.served.kill()
        if self.back_at is not None and step_idx == self.back_at:
            self.spooled_while_down = sorted(spool.iterdir())
            self.served.start()
        if self.back_at is not None and step_idx == self.back_at + 5:
            deadline = time.monotonic() + 30
            while any(spool.iterdir()) and time.monotonic() < deadline:
                time.sleep(0.05)
            self.replayed_during_run = not any(spool.iterdir())


def slow_train(run: RunSpec) -> Any:
    torch.manual_seed(run.seed)
    x = torch.randn(8, 3)
    y = x.sum(1, keepdim=True)
    model = torch.nn.Linear(3, 1)
    loop = TrainingLoop(
        model,
        torch.optim.SGD(model.parameters(), lr=0.05),
        [(x, y)],
        _loss,
        SLOW_STEPS,
        evaluators=[Evaluator("val", lambda m: {"loss": _loss(m, (x, y)).item()}, every=25)],
        checkpoint=CheckpointConfig(every=30, keep_last=1),
    )
    return loop.fit(run)


def _slow_experiment(served: Served, folder: Path, trouble: ServerTrouble) -> Experiment:
    return Experiment(
        "offline", train=slow_train, store=served.url, output_dir=str(folder),
        callbacks=[trouble],
    )  # fmt: skip


def _every_row_once(url: str) -> None:
    """The slow run's rows, each exactly once: a batch stored twice would double a summary's
    count, and one lost would leave a step or a row out."""
    steps = "select count(*), count(distinct step), min(step), max(step) from metrics "
    assert _count(url, steps + "where key = 'loss'") == [(SLOW_STEPS, SLOW_STEPS, 1, SLOW_STEPS)]
    counts = "select key, \"count\" from summaries where key in ('loss', 'val/loss') order by key"
    assert _count(url, counts) == [("loss", SLOW_STEPS), ("val/loss", SLOW_STEPS // 25)]
    assert _count(url, "select step from evals order by step") == [(25,), (50,), (75,), (100,)]
    saves = _count(url, "select step from checkpoints where event = 'save' order by step")
    assert saves == [(30,), (60,), (90,), (120,)]
    assert _count(url, "select status from runs") == [("completed",)]
    assert _count(url, "select status from experiments") == [("completed",)]


def test_a_server_away_past_the_retry_window_spools_and_the_sender_replays(
    served: Served,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setenv("LAB_TOKEN", served.write_token)
    monkeypatch.setenv("LAB_HTTP_RETRY_S", "0.3")
    trouble = ServerTrouble(served, down_at=20, back_at=70)
    with caplog.at_level(logging.WARNING, logger="lab.store.http"):
        result = _slow_experiment(served, tmp_path / "runs", trouble).run()
    assert len(trouble.spooled_while_down) > 2 and trouble.replayed_during_run
    assert result.runs[0].status == "completed"
    spooled = [r.getMessage() for r in caplog.records if "batches are spooled to" in r.getMessage()]
    assert len(spooled) == 1
    assert spooled[0].startswith(f"lab: lab serve at {served.url} did not answer (")
    assert f"{SPOOL_DIR} from batch " in spooled[0]
    assert spooled[0].endswith("the run goes on, and they are replayed when the server answers "
                               "(or: lab sync RUN_DIR)")  # fmt: skip
    assert any("answers again;" in r.getMessage() for r in caplog.records)
    assert list((tmp_path / "runs").rglob(f"{SPOOL_DIR}/*")) == []  # all replayed
    _every_row_once(served.store_url)


def test_lab_sync_replays_a_spool_once_however_often_it_runs(
    served: Served,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setenv("LAB_TOKEN", served.write_token)
    monkeypatch.setenv("LAB_HTTP_RETRY_S", "0.3")
    trouble = ServerTrouble(served, down_at=20, back_at=None)
    with caplog.at_level(logging.WARNING, logger="lab.store.http"):
        result = _slow_experiment(served, tmp_path / "runs", trouble).run()
    assert result.runs[0].status == "completed"  # the run went on without its server
    files = sorted((tmp_path / "runs").rglob(f"{SPOOL_DIR}/*"))
    held = [describe(f.suffix[1:], f.read_bytes()) for f in files]  # metric rows and writes
    assert any("metric row" in h for h in held) and any("finish_run" in h for h in held)
    run_dir = files[0].parent.parent
    left = [r.getMessage() for r in caplog.records if "stay spooled" in r.getMessage()]
    assert left == [
        f"lab: {len(files)} batches stay spooled (the server at {served.url} does not answer); "
        f"send them when it is back with: lab sync {run_dir} --store {served.url}"
    ]
    kept = {f.name: f.read_bytes() for f in files}
    served.start()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    sync = [sys.executable, "-m", "lab.cli", "sync", str(run_dir), "--store", served.url]
    first = warm.run(sync, env=env, capture_output=True, text=True, timeout=120)
    assert (first.returncode, first.stdout) == (
        0, f"sent {len(files)} spooled batches to {served.url}\n",
    ), first.stderr  # fmt: skip
    assert list(run_dir.rglob(f"{SPOOL_DIR}/*")) == []
    _every_row_once(served.store_url)
    for name, body in kept.items():  # the same spool sent again: stored nothing twice
        (run_dir / SPOOL_DIR / name).write_bytes(body)
    again = warm.run(sync, env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    _every_row_once(served.store_url)
    assert _count(served.store_url, "select sum(rows) from ingest_batches where seq > 0") != [
        (None,)
    ]


def test_runs_in_worker_processes_record_through_the_server(
    served: Served, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The logger crosses to each worker as the server's URL (never the token, which each
    worker reads from LAB_TOKEN) and opens its own HttpStore there."""
    monkeypatch.setenv("LAB_TOKEN", served.write_token)
    result = _experiment(served.url, tmp_path / "runs", executor="processes", workers=2).run()
    assert sorted((r.run_key, r.status) for r in result.runs) == [
        ("fast-r0", "completed"), ("fast-r1", "completed"),
        ("slow-r0", "completed"), ("slow-r1", "completed"),
    ]  # fmt: skip
    pids = _count(served.store_url, "select distinct pid from runs")
    assert os.getpid() not in {pid for (pid,) in pids}  # each run recorded under its worker
    assert _count(served.store_url, "select count(*) from predictions") == [(4 * 3 * 2,)]
