"""The read API of `lab serve`, against a real server on loopback in front of SQLite and
PostgreSQL: every endpoint gives exactly what the local `Store` (or `lab.inspect`) reads
from the same rows."""

from __future__ import annotations

import io
import json
import math
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import sqlalchemy as sa

import lab.inspect
from lab.demo import quickstart
from lab.records import ManifestRow
from lab.store import Store
from lab.store.http import HttpStore
from tests import warm
from tests.served import Served

STEPS = 20


@pytest.fixture(scope="module")
def recorded(
    module_served: Served, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Served, Store]]:
    """The quickstart experiment (2 arms x 3 repeats, evals and 64 predictions a run) recorded
    into the served store, with the local `Store` on the same rows to compare against.
    Recorded once per backend for the module: the tests that take it read it, and what one
    adds (a tag, a run's checkpoint rows) no other one reads."""
    served = module_served
    quickstart(served.store_url, output_dir=tmp_path_factory.mktemp("runs"), steps=STEPS)
    store = Store(served.store_url)
    try:
        yield served, store
    finally:
        store.close()


def _reader(served: Served) -> HttpStore:
    """The store a notebook opens on the server, with the read token."""
    return HttpStore(served.url, token=served.read_token)


def test_experiments_and_one_experiment_equal_the_store(recorded: tuple[Served, Store]) -> None:
    served, store = recorded
    reader = _reader(served)
    assert reader.list_experiments() == store.list_experiments()
    assert reader.get_experiment("quickstart") == store.get_experiment("quickstart")
    with served.client(served.read_token) as c:
        assert (
            c.get("/api/v1/experiments", params={"status": "completed"}).json()[0]["name"]
            == "quickstart"
        )
        assert c.get("/api/v1/experiments", params={"status": "running"}).json() == []
        assert c.get("/api/v1/experiments", params={"tag": "nope"}).json() == []
    store.tag("quickstart", add=["baseline"])
    with served.client(served.read_token) as c:
        tagged = c.get("/api/v1/experiments", params={"tag": "baseline"}).json()
    assert [e["name"] for e in tagged] == ["quickstart"]


def test_runs_filtered_by_status_and_config_fields(recorded: tuple[Served, Store]) -> None:
    served, store = recorded
    reader = _reader(served)
    local = {r["run_key"]: r for r in store.get_experiment("quickstart")["runs"]}
    fast = reader.runs("quickstart", lr=0.1)
    assert [r["run_key"] for r in fast] == ["sgd-lr0.1-r0", "sgd-lr0.1-r1", "sgd-lr0.1-r2"]
    for run in fast:
        assert run["config"]["lr"] == 0.1
        assert {k: v for k, v in run.items() if k != "config"} == local[run["run_key"]]
    assert len(reader.runs("quickstart", status="completed")) == 6
    assert reader.runs("quickstart", status="failed") == []
    assert [r["run_key"] for r in reader.runs("quickstart", lr=0.01, status="completed")] == [
        "sgd-lr0.01-r0",
        "sgd-lr0.01-r1",
        "sgd-lr0.01-r2",
    ]
    assert len(reader.runs("quickstart", hidden=32, steps=STEPS)) == 6
    assert reader.runs("quickstart", hidden=33) == []
    assert reader.runs("quickstart", **{"no.such.field": 1}) == []
    with served.client(served.read_token) as c:
        text = c.get("/api/v1/experiments/quickstart/runs", params={"config.lr": "0.1"})
        assert len(text.json()) == 3  # a value that parses as JSON is compared as JSON
        bad = c.get("/api/v1/experiments/quickstart/runs", params={"arm": "x"})
    assert bad.status_code == 400
    assert bad.json() == {
        "detail": "unknown filter 'arm': filter by status= or by config.<field>=<value>",
        "field": "arm",
    }


def test_summaries_equal_the_final_metrics_view(recorded: tuple[Served, Store]) -> None:
    served, _ = recorded
    got = _reader(served).summaries("quickstart")
    con = lab.inspect.connect(served.store_url)
    want = con.sql(
        "select run_id, run_key, arm, repeat, status, key, count, step, value, min_value, "
        "max_value from final_metrics where experiment = 'quickstart' order by run_id, key"
    ).fetchall()
    assert len(got) == len(want) == 6 * 7
    assert [
        (r["run_id"], r["run_key"], r["arm"], r["repeat"], r["status"], r["key"], r["count"],
         r["last_step"], r["last_value"], r["min_value"], r["max_value"])
        for r in got
    ] == want  # fmt: skip
    one = _reader(served).summaries("quickstart", key="val/loss")
    assert [r["key"] for r in one] == ["val/loss"] * 6


def _series_run(store: Store, steps: list[int], values: list[float]) -> int:
    exp = store.begin_experiment("series", config={}, seed=0, repeats=1)
    arm = store.add_arm(exp, "a", overrides={}, config={})
    group = store.add_group(exp, "a", arm_id=arm)
    run = store.start_run(
        exp,
        group,
        run_key="a-r0",
        arm_id=arm,
        repeat=0,
        stage=0,
        seed=0,
        config={},
        output_dir=None,
    )
    for step, value in zip(steps, values, strict=True):
        store.log_metrics(run, step, {"y": value})
    store.flush()
    return run


def _expected(steps: list[int], values: list[float], n: int) -> list[tuple]:
    """The buckets by the definition: equal ranges of steps, min and max without NaN."""
    lo, width = steps[0], steps[-1] - steps[0] + 1
    out: dict[int, list[tuple[int, float]]] = {}
    for step, value in zip(steps, values, strict=True):
        out.setdefault((step - lo) * n // width, []).append((step, value))
    rows = []
    for _, points in sorted(out.items()):
        finite = [v for _, v in points if not math.isnan(v)]
        rows.append((points[0][0], points[-1][0], min(finite) if finite else None,
                     max(finite) if finite else None, points[-1][1]))  # fmt: skip
    return rows


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def test_series_downsampled_to_min_and_max_per_bucket(served: Served) -> None:
    steps = list(range(5, 3005, 3))  # 1,000 points, steps 5..3002 with gaps
    values = [math.sin(s / 50) * s for s in steps]
    values[10] = math.nan
    values[500] = math.inf
    values[501] = -math.inf
    for i in range(900, 1000):  # the last buckets hold NaN only
        values[i] = math.nan
    store = Store(served.store_url)
    try:
        run = _series_run(store, steps, values)
    finally:
        store.close()
    reader = _reader(served)
    for n in (1, 7, 10, 333):
        got = reader.series(run, "y", buckets=n)
        want = _expected(steps, values, n)
        rows = list(zip(got["step_min"], got["step_max"], got["min"], got["max"], got["last"],
                        strict=True))  # fmt: skip
        assert len(rows) == len(want) == got["buckets"] <= n
        pairs = [(x, y) for r, w in zip(rows, want, strict=True) for x, y in zip(r, w, strict=True)]
        assert all(_same(x, y) for x, y in pairs)
        assert got["points"] == 1000
    ten = reader.series(run, "y", buckets=10)
    assert ten["max"][5] == math.inf and ten["min"][5] == -math.inf
    assert ten["min"][-1] is None and ten["max"][-1] is None and math.isnan(ten["last"][-1])
    every = reader.series(run, "y", buckets=1000)  # no more points than buckets: all of them
    assert every["step_min"] == every["step_max"] == steps
    assert all(_same(a, b) for a, b in zip(every["last"], values, strict=True))
    points = reader.metric_values(run, "y")
    store = Store(served.store_url)
    try:
        assert all(
            _same(a, b) for p, q in zip(points, store.metric_values(run, "y"), strict=True)
            for a, b in zip(p, q, strict=True)
        )  # fmt: skip
    finally:
        store.close()
    with served.client(served.read_token) as c:
        unknown = c.get(f"/api/v1/runs/{run}/series", params={"key": "nope", "buckets": 5})
        zero = c.get(f"/api/v1/runs/{run}/series", params={"key": "y", "buckets": 0})
    assert unknown.status_code == 404
    assert unknown.json() == {
        "detail": f"run {run} has no metric 'nope'; it has: y",
        "field": "key",
    }
    assert zero.status_code == 400
    assert zero.json() == {"detail": "buckets=0: give 1 to 100000 buckets", "field": "buckets"}


def test_a_series_cut_from_its_blocks_is_the_cut_of_its_points(tmp_path: Path) -> None:
    """`downsample` reads a wide bucket from the metric blocks and its edge points: the same
    buckets as the definition, at widths below, near and far above a block of 32 steps."""
    from lab.server.read import downsample

    steps = list(range(5, 30005, 3))
    values = [math.cos(s / 40) * s for s in steps]
    values[3], values[400], values[401] = math.nan, math.inf, -math.inf
    store = Store(f"sqlite:///{tmp_path / 'blocks.db'}")
    try:
        run = _series_run(store, steps, values)
        for n in (1, 3, 10, 333, 1000, 4000):
            got = downsample(store.engine, run, "y", steps[0], steps[-1], n)
            want = _expected(steps, values, n)
            assert len(got) == len(want)
            assert all(_same(x, y) for r, w in zip(got, want, strict=True)
                       for x, y in zip(r, w, strict=True))  # fmt: skip
    finally:
        store.close()


def test_predictions_paged_every_row_exactly_once(recorded: tuple[Served, Store]) -> None:
    served, store = recorded
    reader = _reader(served)
    with store.engine.connect() as conn:
        want = conn.execute(
            sa.text(
                "select p.eval_id, p.idx, p.example_id, p.output, p.target, p.score from "
                "predictions p join evals e using (eval_id) where e.run_id = 2 "
                "order by p.eval_id, p.idx"
            )
        ).all()
    assert len(want) == 64
    for page in (1, 7, 64, 1000):
        got = list(reader.predictions(2, page=page))
        assert [(r["eval_id"], r["idx"], r["example_id"], r["output"], r["target"], r["score"])
                for r in got] == [tuple(w) for w in want]  # fmt: skip
    first = next(reader.predictions(2, eval="holdout", step="final"))
    assert (first["eval"], first["step"], first["idx"], first["extras"]["slice"]) == (
        "holdout",
        None,
        0,
        first["extras"]["slice"],
    )
    assert list(reader.predictions(2, eval="val")) == []
    assert list(reader.predictions(2, eval="holdout", step=STEPS)) == []
    with served.client(served.read_token) as c:
        page = c.get("/api/v1/runs/2/predictions", params={"limit": 60}).json()
        rest = c.get("/api/v1/runs/2/predictions", params={"limit": 60, "after": page["next"]})
        assert len(page["predictions"]) == 60 and page["next"] == f"{want[59][0]}.59"
        assert len(rest.json()["predictions"]) == 4 and rest.json()["next"] is None
        bad = c.get("/api/v1/runs/2/predictions", params={"after": "x"})
        step = c.get("/api/v1/runs/2/predictions", params={"step": "last"})
    assert bad.status_code == 400
    assert bad.json() == {
        "detail": "after='x' is not a page cursor; pass the 'next' of the page before",
        "field": "after",
    }
    assert step.status_code == 400 and step.json()["field"] == "step"


def test_evals_and_checkpoints_equal_the_store(recorded: tuple[Served, Store]) -> None:
    served, store = recorded
    rows = [
        ManifestRow("sgd-lr0.1-r0", 10, "checkpoints/step_10", "save", 1_700_000_000.5,
                    {"val/loss": 0.25}),
        ManifestRow("sgd-lr0.1-r0", 20, "checkpoints/step_20", "save", 1_700_000_100.0,
                    {"val/loss": math.nan}),
        ManifestRow("sgd-lr0.1-r0", 10, "checkpoints/step_10", "remove", 1_700_000_100.5,
                    {}, reason="keep_last=1"),
    ]  # fmt: skip
    run_id = store.find_run(1, "sgd-lr0.1-r0")
    assert run_id is not None
    for row in rows:
        store.write_checkpoint(run_id, row)
    reader = _reader(served)
    got = reader.checkpoints(run_id)
    assert [(c["step"], c["path"], c["event"], c["reason"], c["created_at"].timestamp())
            for c in got] == [
        (10, "checkpoints/step_10", "save", None, 1_700_000_000.5 - _utc_offset()),
        (20, "checkpoints/step_20", "save", None, 1_700_000_100.0 - _utc_offset()),
        (10, "checkpoints/step_10", "remove", "keep_last=1", 1_700_000_100.5 - _utc_offset()),
    ]  # fmt: skip
    assert got[0]["metrics"] == {"val/loss": 0.25} and math.isnan(got[1]["metrics"]["val/loss"])
    evals = reader.evals(run_id)
    con = lab.inspect.connect(served.store_url)
    want = con.sql(
        f"select name, step, metrics->>'$.loss', (select count(*) from predictions p "
        f"where p.eval_id = e.eval_id) from evals e where run_id = {run_id} order by eval_id"
    ).fetchall()
    assert [(e["name"], e["step"], e["metrics"].get("loss"), e["predictions"]) for e in evals] == [
        (name, step, None if loss is None else float(loss), n) for name, step, loss, n in want
    ]
    assert [(e["name"], e["step"], e["predictions"]) for e in evals] == [
        ("val", STEPS, 0),
        ("holdout", None, 64),
    ]


def _utc_offset() -> float:
    """Naive UTC datetimes read as local time by `.timestamp()`: the shift to undo."""
    import datetime as dt

    naive = dt.datetime.fromtimestamp(0, dt.UTC).replace(tzinfo=None)
    return naive.timestamp()


def test_tables_and_export_carry_the_store_rows(recorded: tuple[Served, Store]) -> None:
    served, store = recorded
    reader = _reader(served)
    con = lab.inspect.connect(served.store_url)
    metrics = reader.table("metrics")
    assert metrics.num_rows == con.sql("select count(*) from metrics").fetchone()[0]
    want = con.sql("select run_id, key, step, value from metrics order by run_id, key, step")
    assert list(zip(*metrics.select(["run_id", "key", "step", "value"]).to_pydict().values(),
                    strict=True)) == want.fetchall()  # fmt: skip
    runs = reader.table("runs", experiment="quickstart")
    assert runs.column("run_key").to_pylist() == [r["run_key"] for r in store.current_runs(
        "quickstart")]  # fmt: skip
    assert reader.table("predictions", experiment="quickstart").num_rows == 6 * 64
    exported = reader.export("quickstart", "predictions")
    parquet_bytes = reader.export("quickstart", "predictions", format="parquet")
    parquet = pq.read_table(io.BytesIO(parquet_bytes))  # type: ignore[arg-type]
    assert exported.num_rows == parquet.num_rows == 6 * 64
    assert exported.equals(parquet)
    with served.client(served.read_token) as c:
        tokens = c.get("/api/v1/tables/tokens")
        fmt = c.get("/api/v1/experiments/quickstart/export", params={"format": "csv"})
    assert tokens.status_code == 404 and tokens.json()["field"] == "table"
    assert fmt.status_code == 400
    assert fmt.json() == {"detail": "format='csv': use arrow or parquet", "field": "format"}
    assert isinstance(exported, pa.Table)


@pytest.mark.parametrize(
    "path",
    [
        "/api/v1/experiments/nope",
        "/api/v1/experiments/nope/runs",
        "/api/v1/experiments/nope/summaries",
        "/api/v1/experiments/nope/export",
        "/api/v1/tables/runs?experiment=nope",
    ],
)
def test_an_unknown_experiment_is_a_404_that_names_the_known_ones(
    recorded: tuple[Served, Store], path: str
) -> None:
    served, _ = recorded
    with served.client(served.read_token) as c:
        answer = c.get(path)
    assert answer.status_code == 404
    assert answer.json() == {
        "detail": "no experiment named 'nope' in the store; known: quickstart",
        "field": None,
    }


@pytest.mark.parametrize("what", ["series?key=loss", "predictions", "evals", "checkpoints"])
def test_an_unknown_run_is_a_404(module_served: Served, what: str) -> None:
    served = module_served
    with served.client(served.read_token) as c:
        answer = c.get(f"/api/v1/runs/999/{what}")
    assert answer.status_code == 404
    assert answer.json() == {
        "detail": "no run with id 999 in the store; list them: GET /experiments/NAME/runs",
        "field": None,
    }


def test_reads_need_a_token_and_a_read_token_cannot_write(served: Served) -> None:
    assert httpx.get(f"{served.url}/api/v1/experiments").status_code == 401
    with served.client("lab_wrong") as c:
        assert c.get("/api/v1/experiments").status_code == 401
    with served.client(served.read_token) as c:
        assert c.get("/api/v1/experiments").json() == []
        refused = c.post(
            "/api/v1/experiments",
            json={"name": "x", "config": {}, "seed": 0, "repeats": 1},
        )
    assert refused.status_code == 403
    assert refused.json()["detail"] == "a read token cannot write; use a write token"
    with served.client(served.write_token) as c:  # a write token reads too
        assert c.get("/api/v1/experiments").json() == []


def _lab(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return warm.run(
        [sys.executable, "-m", "lab.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )


def test_the_best_arm_mean_is_the_same_through_every_door(
    served: Served, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    result = quickstart(served.store_url, output_dir=tmp_path / "runs", steps=STEPS)
    local = result.summary("val/loss")
    best = local.best_arm
    assert best is not None
    mean = local.row(best, "val/loss").mean

    # lab.inspect over HTTP: the same views, the same summary
    monkeypatch.setenv("LAB_TOKEN", served.read_token)
    con = lab.inspect.connect(served.url)
    assert con.sql("select url, mode from lab_source").fetchone() == (served.url, "http")
    ranked = lab.inspect.summary(con, "quickstart", "val/loss").df()
    top = ranked[ranked["is_best"]].iloc[0]
    assert (top["arm"], top["mean"]) == (best, mean)
    assert ranked.equals(lab.inspect.summary(lab.inspect.connect(served.store_url),
                                             "quickstart", "val/loss").df())  # fmt: skip
    assert lab.inspect.predictions(con, "quickstart", "holdout").fetchall() == (
        lab.inspect.predictions(
            lab.inspect.connect(served.store_url), "quickstart", "holdout"
        ).fetchall()
    )
    for table in ("runs", "metrics", "final_metrics", "evals", "predictions"):
        want = lab.inspect.connect(served.store_url).sql(f"select count(*) from {table}")
        assert con.sql(f"select count(*) from {table}").fetchone() == want.fetchone(), table

    # lab show over HTTP: the very text it prints from the store itself
    env = {"LAB_TOKEN": served.read_token, "PYTHONPATH": str(Path(__file__).parents[1])}
    remote = _lab("show", "quickstart", "--store", served.url, "--metrics", "val/loss", env=env)
    here = _lab("show", "quickstart", "--store", served.store_url, "--metrics", "val/loss", env=env)
    assert remote.returncode == 0, remote.stderr
    assert remote.stdout == here.stdout
    values = [float(line.split()[6]) for line in remote.stdout.splitlines()
              if line.startswith(f"{best}-r")]  # fmt: skip
    assert len(values) == 3
    assert sum(values) / 3 == pytest.approx(mean, rel=1e-3)  # printed to 4 digits
    listed = _lab("ls", "--store", served.url, env=env)
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout == _lab("ls", "--store", served.store_url, env=env).stdout
    missing = _lab("show", "nope", "--store", served.url, env=env)
    assert missing.returncode == 1
    assert missing.stderr == "error: no experiment named 'nope' in the store; known: quickstart\n"


def test_the_readme_curl_lines_run(recorded: tuple[Served, Store]) -> None:
    served, store = recorded
    readme = (Path(__file__).parents[1] / "README.md").read_text(encoding="utf-8")
    lines = [line for block in re.findall(r"```bash\n(.*?)```", readme, re.S)
             for line in block.splitlines()
             if line.startswith("curl ") and "$LAB_TOKEN" in line]  # fmt: skip
    assert len(lines) == 2  # the read API's: the experiments, and one series
    env = {**os.environ, "LAB_TOKEN": served.read_token}
    answers = []
    for line in lines:
        command = line.replace("http://127.0.0.1:8765", served.url)
        done = warm.run(["bash", "-c", command], capture_output=True, text=True, env=env)
        assert done.returncode == 0, (line, done.stderr)
        answers.append(json.loads(done.stdout))
    experiments, series = answers
    assert [e["name"] for e in experiments] == ["quickstart"]
    assert (series["run_id"], series["key"], series["points"], series["buckets"]) == (
        1,
        "loss",
        STEPS,
        4,
    )
    assert series["step_min"] == [1, 6, 11, 16] and series["step_max"] == [5, 10, 15, 20]
    values = [v for _, v in store.metric_values(1, "loss")]
    assert series["min"] == [min(values[i : i + 5]) for i in range(0, STEPS, 5)]
    assert series["last"] == [values[i + 4] for i in range(0, STEPS, 5)]


def test_names_with_slashes_quotes_and_dots_are_read_as_names(served: Served) -> None:
    names = ["mnist/lr sweep", "../../etc/passwd", "a'; drop table runs; --", "runs"]
    store = Store(served.store_url)
    try:
        for name in names:
            _series_run_named(store, name)
        want = {name: store.get_experiment(name) for name in names}
    finally:
        store.close()
    reader = _reader(served)
    for name in names:
        assert reader.get_experiment(name) == want[name]
        assert [r["run_key"] for r in reader.runs(name)] == ["a-r0"]
        assert [r["key"] for r in reader.summaries(name)] == ["y"]
        assert reader.table("runs", experiment=name).column("run_key").to_pylist() == ["a-r0"]
    assert sorted(e["name"] for e in reader.list_experiments()) == sorted(names)


def _series_run_named(store: Store, name: str) -> None:
    exp = store.begin_experiment(name, config={}, seed=0, repeats=1)
    arm = store.add_arm(exp, "a", overrides={}, config={})
    group = store.add_group(exp, "a", arm_id=arm)
    run = store.start_run(
        exp, group, run_key="a-r0", arm_id=arm, repeat=0, stage=0, seed=0, config={},
        output_dir=None,
    )  # fmt: skip
    store.log_metrics(run, 1, {"y": 1.0})
    store.flush()


_CRASH = """
import os, signal, sys
from lab.store import Store
store = Store(sys.argv[1])
exp = store.begin_experiment("crashy", config={}, seed=0, repeats=1)
arm = store.add_arm(exp, "a", overrides={}, config={})
group = store.add_group(exp, "a", arm_id=arm)
store.start_run(exp, group, run_key="a-r0", arm_id=arm, repeat=0, stage=0, seed=0, config={},
                output_dir=None)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_run_whose_process_died_shows_crashed_as_lab_show_shows_it(served: Served) -> None:
    done = warm.run([sys.executable, "-c", _CRASH, served.store_url], timeout=120)
    assert done.returncode == -9
    local = Store(served.store_url, readonly=True)
    try:
        want = local.get_experiment("crashy")
        listed = local.list_experiments()
    finally:
        local.close()
    assert want["runs"][0]["status"] == "crashed"
    reader = _reader(served)
    assert reader.get_experiment("crashy") == want
    assert reader.list_experiments() == listed
    assert [r["run_key"] for r in reader.runs("crashy", status="crashed")] == ["a-r0"]
    writer = Store(served.store_url, migrate=False)  # the store itself: nothing was written
    try:
        with writer.engine.connect() as conn:
            status = conn.execute(sa.text("select status from runs")).scalar_one()
    finally:
        writer.close()
    assert status == "running"


def test_the_reading_section_of_docs_serve_runs(capsys: pytest.CaptureFixture[str]) -> None:
    page = (Path(__file__).parents[1] / "docs" / "serve.md").read_text(encoding="utf-8")
    section = page.split("## Reading from it", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 1
    try:
        exec(compile(blocks[0], "docs/serve.md", "exec"), {"__name__": "docs"})
    finally:
        os.environ.pop("LAB_TOKEN", None)
    out = capsys.readouterr().out
    assert out.splitlines() == ["sgd-lr0.1 3", "40 [1, 11, 21, 31] [10, 20, 30, 40]", "64 h00"]
    assert f"```text\n{out}```" in section  # the page shows what it prints
