"""The dashboard's read API (`lab.server.dashboard`), on SQLite and PostgreSQL, through the
real app with a real read token: every number equals what `lab.inspect` or the store's own
rows give, and bad input is one line that names what is missing."""

from __future__ import annotations

import json
import math
import os
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pydantic
import pytest
import sqlalchemy as sa
import torch
from fastapi.testclient import TestClient

import lab
import lab.inspect
from lab import Arm, CheckpointConfig, Experiment, RunSpec
from lab._json import finite_json
from lab._stats import spread
from lab.loop import EvalResult, Evaluator
from lab.server import create_app
from lab.server.auth import create_token
from lab.store import Store
from tests import warm
from tests.postgres import new_database
from tests.served import serve

API = "/api/v1/dashboard"
STEPS = 12
SCRIPT = "<script>alert(1)</script>"


class Cfg(pydantic.BaseModel):
    lr: float = 0.1
    task: str = "a"
    fail: bool = False
    note: str = SCRIPT


def _train(run: RunSpec) -> lab.LoopArtifacts:
    """A tiny regression: `loss` every step, `noisy` (NaN at step 3 of repeat 0) every
    other step, a histogram and an image every 4 steps, a checkpoint every 4 (the last one
    kept), and a failure at step 5 when the config says so."""
    cfg = run.config
    torch.manual_seed(run.seed)
    model = torch.nn.Linear(3, 1)
    x = torch.randn(16, 3)
    y = x.sum(1, keepdim=True) + {"a": 0.0, "b": 1.0}[cfg.task]
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    keep = CheckpointConfig(every=4, keep_last=1)
    with lab.RunHandle(run, model, opt, num_steps=STEPS, checkpoint=keep) as loop:
        for step in loop.steps():
            if cfg.fail and step == 5:
                raise RuntimeError(f"diverged: {SCRIPT}")
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            values = {"loss": loss.item()}
            if step % 2 == 1:
                values["noisy"] = math.nan if (run.repeat, step) == (0, 3) else step * 0.5
            loop.end_step(values)
            if step % 4 == 0:
                loop.log_histogram("weights", model.weight.detach(), bins=3, range=(-2, 2))
                loop.log_image("samples/img", torch.full((3, 2, 2), step / STEPS))
    assert loop.artifacts is not None
    return loop.artifacts


def _holdout(model: torch.nn.Module) -> EvalResult:
    """Eight fixed examples, the first with HTML as its input; two slices."""
    x = torch.linspace(-1, 1, 24).reshape(8, 3)
    out = model(x).squeeze(1).detach()
    target = x.sum(1)
    hits = ((out - target).abs() < 0.5).float()
    predictions = [
        {"example_id": f"e{i}", "input": SCRIPT if i == 0 else f"x{i}",
         "output": str(round(out[i].item(), 1)), "target": str(round(target[i].item(), 1)),
         "score": hits[i].item()}
        for i in range(8)
    ]  # fmt: skip
    return EvalResult(
        "holdout",
        {"acc": hits.mean().item()},
        breakdowns={
            "low": {"acc": hits[:4].mean().item()},
            "high": {"acc": hits[4:].mean().item()},
        },
        predictions=predictions,
    )


_CRASH = """
import os, signal, sys
from lab.store import Store
store = Store(sys.argv[1])
exp = store.begin_experiment("crashy", config={}, seed=0, repeats=1)
arm = store.add_arm(exp, "a", overrides={}, config={})
group = store.add_group(exp, "a", arm_id=arm)
run = store.start_run(exp, group, run_key="a-r0", arm_id=arm, repeat=0, stage=0, seed=0,
                      config={}, output_dir=None)
store.log_metrics(run, 1, {"loss": 1.0})
store.flush()
os.kill(os.getpid(), signal.SIGKILL)
"""


def _scripted(store: Store) -> None:
    """An experiment whose name, arm and run key are HTML."""
    exp = store.begin_experiment(SCRIPT, config={"html": SCRIPT}, seed=0, repeats=1)
    arm = store.add_arm(exp, SCRIPT, overrides={}, config={})
    group = store.add_group(exp, SCRIPT, arm_id=arm)
    run = store.start_run(exp, group, run_key=f"{SCRIPT}-r0", arm_id=arm, repeat=0, stage=0,
                          seed=0, config={"html": SCRIPT}, output_dir=None)  # fmt: skip
    for step in range(1, 4):
        store.log_metrics(run, step, {"loss": 1.0 / step})
    store.flush()
    store.finish_run(run, status="completed", summary={"loss": 1.0 / 3})


@dataclass
class Filled:
    url: str
    client: TestClient
    token: str
    con: Any  # lab.inspect's connection to the same store
    store: Store  # the store, opened read-only as the server reads it

    def get(self, path: str, **params: Any) -> Any:
        answer = self.client.get(f"{API}{path}", params=params)
        assert answer.status_code == 200, answer.text
        return answer.json()

    def refused(self, path: str, **params: Any) -> tuple[int, dict[str, Any]]:
        answer = self.client.get(f"{API}{path}", params=params)
        return answer.status_code, answer.json()


def _database(kind: str, folder: Path) -> Iterator[str]:
    if kind == "sqlite":
        yield f"sqlite:///{folder / 'lab.db'}"
        return
    with new_database() as url:
        yield url


@pytest.fixture(
    scope="module", params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
def filled(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Filled]:
    """One store, filled once per backend: experiment ``dash`` (arms small and big, 2
    repeats each, the holdout benchmark with predictions and breakdowns; arm broken, whose
    runs fail; arm cl, a chain of two stages per repeat), a run whose process died, and an
    experiment whose names are HTML. Read through the real app with a real read token."""
    folder = tmp_path_factory.mktemp("dashboard")
    databases = _database(request.param, folder)
    url = next(databases)
    result = Experiment(
        "dash", _train, base_config=Cfg(),
        arms=[Arm("small", lr=0.05), Arm("big", lr=0.2), Arm("broken", fail=True),
              Arm("cl", stages=[{"task": "a"}, {"task": "b"}])],
        repeats=2, store=url, output_dir=folder / "runs",
        benchmarks=[Evaluator("holdout", _holdout)],
    ).run()  # fmt: skip
    assert [r.status for r in result.runs].count("failed") == 2
    done = warm.run([sys.executable, "-c", _CRASH, url], timeout=120)
    assert done.returncode == -9
    writer = Store(url)
    try:
        _scripted(writer)
        token = create_token(writer.engine, "dashboard-read", "read")
    finally:
        writer.close()
    app = create_app(url)
    store = Store(url, readonly=True)
    try:
        with TestClient(app, headers={"Authorization": f"Bearer {token}"}) as client:
            yield Filled(url, client, token, lab.inspect.connect(url), store)
    finally:
        store.close()
        for _ in databases:
            pass


def _as_json(value: Any) -> Any:
    """`value` as the API writes it (NaN and inf as strings, times as ISO 8601)."""
    return json.loads(json.dumps(finite_json(value), default=lambda d: d.isoformat()))


def _rows(relation: Any) -> list[dict[str, Any]]:
    return _as_json([dict(zip(relation.columns, r, strict=True)) for r in relation.fetchall()])


# -- the experiments list ---------------------------------------------------------------------


def test_the_list_is_newest_first_searchable_paged_and_ranks_as_the_summary(
    filled: Filled,
) -> None:
    page = filled.get("/experiments")
    assert (page["total"], page["offset"], page["limit"]) == (3, 0, 50)
    assert [r["name"] for r in page["rows"]] == [SCRIPT, "crashy", "dash"]
    dash = page["rows"][2]
    best = [
        r["arm"] for r in _rows(lab.inspect.summary(filled.con, "dash", "loss")) if r["is_best"]
    ]
    assert (dash["best_arm"], dash["metric"], dash["mode"]) == (best[0], "loss", "min")
    assert dash["status"] == "failed"  # two of its runs failed
    assert (dash["runs_done"], dash["runs_total"]) == (10, 10)  # 3 arms x 2, and 2 chains of 2
    assert dash["duration_s"] == pytest.approx(
        (_iso(dash["ended_at"]) - _iso(dash["started_at"])).total_seconds()
    )
    crashy = page["rows"][1]
    # its process died: the experiment reads as crashed, as its run does
    assert (crashy["status"], crashy["runs_done"], crashy["runs_total"]) == ("crashed", 1, 1)
    assert crashy["best_arm"] is None  # nothing completed: no arm to rank
    assert [r["name"] for r in filled.get("/experiments", q="DaSh")["rows"]] == ["dash"]
    assert filled.get("/experiments", q="%")["rows"] == []  # a wildcard is a character
    assert [r["name"] for r in filled.get("/experiments", q="<scr")["rows"]] == [SCRIPT]
    second = filled.get("/experiments", offset=1, limit=1)
    assert (second["total"], [r["name"] for r in second["rows"]]) == (3, ["crashy"])
    assert filled.refused("/experiments", limit=0) == (
        400, {"detail": "limit=0: a page holds 1 to 500 rows", "field": "limit"},
    )  # fmt: skip
    assert filled.refused("/experiments", offset=-1)[0] == 400


def _iso(text: str) -> Any:
    from datetime import datetime

    return datetime.fromisoformat(text)


# -- one experiment ---------------------------------------------------------------------------


def test_the_experiment_page_carries_the_summary_of_lab_inspect(filled: Filled) -> None:
    exp = filled.get("/experiments/dash")
    assert exp["summary"] == _rows(lab.inspect.summary(filled.con, "dash", "loss", "min"))
    assert [r["arm"] for r in exp["summary"]] == ["small", "big", "broken", "cl"]
    assert exp["summary"][2]["n"] == 0 and exp["summary"][2]["rank"] is None
    assert (exp["metric"], exp["mode"], exp["summary_error"]) == ("loss", "min", None)
    assert exp["metrics"] == ["holdout/acc", "loss", "noisy"]
    assert exp["evals"] == ["holdout"]
    assert [a["name"] for a in exp["arms"]] == ["small", "big", "broken", "cl"]
    assert exp["arms"][1]["overrides"] == {"lr": 0.2}
    assert exp["config"]["base_config"]["note"] == SCRIPT
    assert (exp["repeats"], exp["live"], exp["status"]) == (2, False, "failed")
    assert exp["runs"] == filled.get("/experiments/dash/runs")["runs"]
    keys = {r["run_id"]: r["run_key"] for r in exp["runs"]}
    assert [(c["group"], c["arm"], [keys[i] for i in c["runs"]]) for c in exp["chains"]] == [
        ("cl-r0", "cl", ["cl-r0-s0", "cl-r0-s1"]),
        ("cl-r1", "cl", ["cl-r1-s0", "cl-r1-s1"]),
    ]
    other = filled.get("/experiments/dash", metric="noisy", mode="max")
    assert other["summary"] == _rows(lab.inspect.summary(filled.con, "dash", "noisy", "max"))
    assert filled.refused("/experiments/dash", metric="nope") == (404, {
        "detail": "experiment 'dash' has no metric 'nope'; it has: holdout/acc, loss, noisy",
        "field": "metric",
    })  # fmt: skip
    assert filled.refused("/experiments/dash", mode="best") == (
        400, {"detail": "mode='best': use min (lower is better) or max", "field": "mode"},
    )  # fmt: skip
    assert filled.refused("/experiments/nope") == (404, {
        "detail": f"no experiment named 'nope' in the store; known: {SCRIPT}, crashy, dash",
        "field": None,
    })  # fmt: skip


def test_the_runs_table_equals_the_store(filled: Filled) -> None:
    runs = filled.get("/experiments/dash/runs")["runs"]
    want = filled.store.get_experiment("dash")["runs"]
    assert [r["run_key"] for r in runs] == [r["run_key"] for r in want]
    assert [r["run_key"] for r in runs] == [
        "small-r0", "small-r1", "big-r0", "big-r1", "broken-r0", "broken-r1",
        "cl-r0-s0", "cl-r0-s1", "cl-r1-s0", "cl-r1-s1",
    ]  # fmt: skip
    for got, run in zip(runs, want, strict=True):
        assert got["final"] == _as_json(run["summary"])
        assert (got["arm"], got["repeat"], got["stage"], got["seed"], got["status"]) == (
            run["arm"], run["repeat"], run["stage"], run["seed"], run["status"],
        )  # fmt: skip
        assert got["duration_s"] == (run["ended_at"] - run["started_at"]).total_seconds()
    broken = runs[4]
    assert broken["status"] == "failed" and SCRIPT in broken["error"]
    assert broken["config"] == {"lr": 0.1, "task": "a", "fail": True, "note": SCRIPT}
    assert runs[7]["config"]["task"] == "b"
    crashed = filled.get("/experiments/crashy/runs")["runs"]
    assert [(r["run_key"], r["status"]) for r in crashed] == [("a-r0", "crashed")]
    assert filled.refused("/experiments/nope/runs")[0] == 404


# -- curves -----------------------------------------------------------------------------------


def test_curves_with_a_bucket_per_step_are_lab_inspect_curves(filled: Filled) -> None:
    got = filled.get("/experiments/dash/curves", metric="loss", buckets=1000)
    assert (got["metric"], got["buckets"], got["runs"]) == ("loss", 1000, [])
    want: dict[str, list[tuple]] = {}
    for arm, step, n, mean, _std, low, high in lab.inspect.curves(
        filled.con, "dash", "loss"
    ).fetchall():
        want.setdefault(arm, []).append((step, n, mean, low, high))
    assert [a["arm"] for a in got["arms"]] == ["small", "big", "cl"]  # broken: no run counts
    for arm in got["arms"]:
        rows = want[arm["arm"]]
        assert arm["step"] == [r[0] for r in rows] == list(range(1, STEPS + 1))
        assert arm["n"] == [r[1] for r in rows] == [2] * STEPS
        assert arm["mean"] == pytest.approx([r[2] for r in rows], rel=1e-12)
        assert arm["ci_low"] == pytest.approx([r[3] for r in rows], rel=1e-12)
        assert arm["ci_high"] == pytest.approx([r[4] for r in rows], rel=1e-12)
        assert arm["min"] == [min(x) for x in _points(filled, "dash", arm["arm"], "loss")]


def _points(filled: Filled, experiment: str, arm: str, key: str) -> list[list[float]]:
    """Per step, the values of the arm's counted runs (its last stage's, completed)."""
    runs = [r for r in filled.store.get_experiment(experiment)["runs"]
            if r["arm"] == arm and r["status"] == "completed"]  # fmt: skip
    last = max(r["stage"] for r in runs)
    series = [dict(filled.store.metric_values(r["run_id"], key)) for r in runs
              if r["stage"] == last]  # fmt: skip
    return [[s[step] for s in series] for step in sorted(series[0])]


def test_curves_cut_into_buckets_equal_the_raw_rows(filled: Filled) -> None:
    """Three buckets of the steps 1..12 of `noisy` (logged at odd steps, NaN once): each
    run's min, max and last per bucket, and each arm's mean of the runs' means with the t
    interval of `lab._stats.spread`, computed here from the rows themselves."""
    got = filled.get("/experiments/dash/curves", metric="noisy", buckets=3, runs="true")
    lo, hi = 1, 11  # the odd steps: the experiment's range of noisy
    edges = [lo + -(-i * (hi - lo + 1) // 3) for i in range(4)]  # 1, 5, 9, 12
    runs = {r["run_key"]: r for r in filled.store.get_experiment("dash")["runs"]}
    assert [r["run_key"] for r in got["runs"]] == list(runs)  # every run, failed ones too
    means: dict[str, list[list[float]]] = {}
    for run in got["runs"]:
        points = filled.store.metric_values(runs[run["run_key"]]["run_id"], "noisy")
        cells = [[(s, v) for s, v in points if edges[i] <= s < edges[i + 1]] for i in range(3)]
        cells = [c for c in cells if c]
        finite = [[v for _, v in c if not math.isnan(v)] for c in cells]
        assert run["step"] == [c[-1][0] for c in cells]  # each bucket's last point's step
        assert run["min"] == [min(f) for f in finite]
        assert run["max"] == [max(f) for f in finite]
        assert run["last"] == _as_json([c[-1][1] for c in cells])
        info = runs[run["run_key"]]
        if info["status"] == "completed" and (info["arm"] != "cl" or info["stage"] == 1):
            means.setdefault(info["arm"], []).append([sum(f) / len(f) for f in finite])
    assert got["runs"][0]["last"] == ["NaN", 3.5, 5.5]  # a NaN last value stays NaN
    for arm in got["arms"]:
        per_bucket = list(zip(*means[arm["arm"]], strict=True))
        stats = [spread(list(values)) for values in per_bucket]
        assert arm["step"] == [3, 7, 11]  # the last step logged in each bucket
        assert arm["n"] == [s.n for s in stats] == [2, 2, 2]
        assert arm["mean"] == pytest.approx([s.mean for s in stats], rel=1e-12)
        assert arm["ci_low"] == pytest.approx([s.ci_low for s in stats], rel=1e-12)
        assert arm["ci_high"] == pytest.approx([s.ci_high for s in stats], rel=1e-12)
    small = next(a for a in got["arms"] if a["arm"] == "small")
    assert small["min"][0] == 0.5  # repeat 0's NaN at step 3 is left out; repeat 1 has 0.5
    assert small["max"] == [1.5, 3.5, 5.5]


@pytest.mark.parametrize("kind", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_curve_points_sit_at_the_steps_that_were_logged(kind: str, tmp_path: Path) -> None:
    """`val/loss` logged every 50 steps beside `loss` logged every step: at any bucket
    count, each point of an arm's curve and of a run's sits at a step its runs logged, and
    where a bucket holds one logged step the point is that step's value (the arm's: the
    mean of its runs' values there). With `buckets=200` (docs/dashboard.md's URL) the point
    of step 50 was once drawn at step 51, the end of its bucket."""
    databases = _database(kind, tmp_path)
    url = next(databases)
    try:
        store = Store(url)
        try:
            exp = store.begin_experiment("sparse", config={}, seed=0, repeats=2)
            arm = store.add_arm(exp, "a", overrides={}, config={})
            group = store.add_group(exp, "a", arm_id=arm)
            logged: dict[str, dict[int, float]] = {}
            for repeat in range(2):
                run = store.start_run(
                    exp, group, run_key=f"a-r{repeat}", arm_id=arm, repeat=repeat, stage=0,
                    seed=repeat, config={}, output_dir=None,
                )  # fmt: skip
                mine = logged[f"a-r{repeat}"] = {}
                for step in range(0, 301):
                    values = {"loss": 1.0 / (step + 1)}
                    if step % 50 == 0:
                        values["val/loss"] = mine[step] = 2.0 / (step + 1) + repeat
                    store.log_metrics(run, step, values)
                store.flush()
                store.finish_run(run, status="completed")
        finally:
            store.close()
        app = create_app(url, auth=False, writes=False)
        with TestClient(app, base_url="http://127.0.0.1") as client:
            for buckets in (3, 7, 13, 200, 301, 600, 1000):
                got = client.get(f"{API}/experiments/sparse/curves", params={
                    "metric": "val/loss", "buckets": buckets, "runs": "true"}).json()  # fmt: skip
                (curve,) = got["arms"]
                steps = sorted(logged["a-r0"])
                assert set(curve["step"]) <= set(steps), buckets
                assert curve["step"] == sorted(curve["step"])
                for run in got["runs"]:  # each run's last point in a bucket, at its step
                    mine = logged[run["run_key"]]
                    assert [mine[s] for s in run["step"]] == run["last"], buckets
                if buckets >= 7:  # every bucket holds one logged step: the points themselves
                    assert curve["step"] == steps, buckets
                    assert curve["n"] == [2] * len(steps)
                    want = [(logged["a-r0"][s] + logged["a-r1"][s]) / 2 for s in steps]
                    assert curve["mean"] == pytest.approx(want, rel=1e-12), buckets
                    assert curve["min"] == [logged["a-r0"][s] for s in steps]
                    assert curve["max"] == [logged["a-r1"][s] for s in steps]
            dense = client.get(f"{API}/experiments/sparse/curves",
                               params={"metric": "loss", "buckets": 200}).json()  # fmt: skip
            assert set(dense["arms"][0]["step"]) <= set(range(301))
            assert dense["arms"][0]["step"][-1] == 300
    finally:
        for _ in databases:
            pass


def test_curves_refuse_an_unknown_metric_naming_the_known_ones(filled: Filled) -> None:
    assert filled.refused("/experiments/dash/curves", metric="nope") == (404, {
        "detail": "experiment 'dash' has no metric 'nope'; it has: holdout/acc, loss, noisy",
        "field": "metric",
    })  # fmt: skip
    assert filled.refused("/experiments/dash/curves", metric="loss", buckets=0) == (
        400, {"detail": "buckets=0: give 1 to 10000 buckets", "field": "buckets"},
    )  # fmt: skip
    assert filled.refused("/experiments/nope/curves", metric="loss")[0] == 404
    missing = filled.client.get(f"{API}/experiments/dash/curves")
    assert (missing.status_code, missing.json()["field"]) == (422, "query.metric")


# -- one run ----------------------------------------------------------------------------------


def test_the_run_page_equals_the_read_api_and_the_store(filled: Filled) -> None:
    run_id = next(r["run_id"] for r in filled.store.get_experiment("dash")["runs"]
                  if r["run_key"] == "big-r1")  # fmt: skip
    got = filled.get(f"/runs/{run_id}")
    assert (got["experiment"], got["run_key"], got["arm"], got["repeat"], got["stage"]) == (
        "dash", "big-r1", "big", 1, 0,
    )  # fmt: skip
    assert (got["status"], got["live"], got["error"], got["parent_run_id"]) == (
        "completed", False, None, None,
    )  # fmt: skip
    read = filled.client.get("/api/v1/experiments/dash/summaries").json()
    assert got["metrics"] == [
        {"key": s["key"], "count": s["count"], "first_step": s["first_step"],
         "last_step": s["last_step"], "last": s["last_value"], "min": s["min_value"],
         "max": s["max_value"]}
        for s in read if s["run_id"] == run_id
    ]  # fmt: skip
    evals = filled.client.get(f"/api/v1/runs/{run_id}/evals").json()
    assert got["evals"] == [{k: v for k, v in e.items() if k != "created_at"} for e in evals]
    assert [(e["name"], e["step"], e["predictions"]) for e in got["evals"]] == [
        ("holdout", None, 8)
    ]
    manifest = filled.client.get(f"/api/v1/runs/{run_id}/checkpoints").json()
    assert got["checkpoints"] == [
        {k: v for k, v in c.items() if k != "checkpoint_id"} for c in manifest
    ]
    removed = [c for c in got["checkpoints"] if c["event"] == "remove"]
    assert removed and all(c["reason"] for c in removed)
    (weights,) = got["histograms"]
    want = filled.store.media.histograms(run_id, "weights")[-1]
    assert (weights["key"], weights["step"], weights["counts"], weights["edges"]) == (
        "weights", 12, want["counts"], want["edges"],
    )  # fmt: skip
    assert [(i["key"], i["step"], i["width"], i["height"]) for i in got["images"]] == [
        ("samples/img", step, 2, 2) for step in (4, 8, 12)
    ]
    image = filled.client.get(got["images"][-1]["url"])
    assert image.status_code == 200 and image.headers["content-type"] == "image/png"
    folder = filled.store.current_runs("dash")[3]["output_dir"]
    stored = filled.store.media.images(run_id, "samples/img")[-1]["path"]
    assert image.content == (Path(folder) / stored).read_bytes()


def test_a_failed_run_shows_its_error_and_traceback_and_a_dead_one_crashed(filled: Filled) -> None:
    runs = {r["run_key"]: r["run_id"] for r in filled.store.get_experiment("dash")["runs"]}
    failed = filled.get(f"/runs/{runs['broken-r0']}")
    assert failed["status"] == "failed"
    assert failed["error"] == f"RuntimeError: diverged: {SCRIPT}"
    assert "raise RuntimeError" in failed["traceback"]
    stage = filled.get(f"/runs/{runs['cl-r1-s1']}")
    assert stage["parent_run_id"] == runs["cl-r1-s0"] and stage["config"]["task"] == "b"
    (crashy,) = filled.store.get_experiment("crashy")["runs"]
    dead = filled.get(f"/runs/{crashy['run_id']}")
    assert (dead["status"], dead["live"], dead["error"]) == ("crashed", False, crashy["error"])
    assert filled.refused("/runs/999") == (404, {
        "detail": "no run with id 999 in the store; list them: GET "
                  "/api/v1/dashboard/experiments/NAME/runs", "field": None,
    })  # fmt: skip


def test_the_image_endpoint_serves_the_stored_bytes_and_lab_ui_alone_reads_a_folder(
    filled: Filled,
) -> None:
    """An image row keeps its PNG's bytes, and both servers serve them. A row without bytes
    (recorded before the store kept them) is 404 with one line at `lab serve`, whatever its
    path; `lab ui` reads it from its run's folder, and only from inside it."""
    from lab.server.dashboard import NO_BYTES

    run = next(r for r in filled.store.current_runs("dash") if r["run_key"] == "small-r0")
    folder = Path(run["output_dir"])
    outside = folder.parent / "outside.png"
    outside.write_bytes(b"\x89PNG secret")
    link = folder / "link.png"
    link.symlink_to(outside)
    logged = filled.store.media.images(run["run_id"], "samples/img")[0]
    inside = (folder / logged["path"]).read_bytes()
    paths = ["../outside.png", str(outside), "link.png", "nope.png", logged["path"]]
    writer = Store(filled.url)
    try:
        with writer.engine.begin() as conn:
            for step, path in enumerate(paths):
                conn.execute(sa.insert(sa.table(
                    "images", sa.column("run_id"), sa.column("key"), sa.column("step"),
                    sa.column("path"), sa.column("width"), sa.column("height"),
                    sa.column("wall_time"),
                )).values(run_id=run["run_id"], key="old", step=100 + step, path=path,
                          width=1, height=1, wall_time=0.0))  # fmt: skip
    finally:
        writer.close()
    image = f"{API}/runs/{run['run_id']}/image"
    local = Store(filled.url, readonly=True)
    ui = TestClient(create_app(local, auth=False, writes=False), base_url="http://127.0.0.1")
    with ui:
        for step in range(100, 104):
            assert filled.refused(f"/runs/{run['run_id']}/image", key="old", step=step) == (404, {
                "detail": NO_BYTES.format(run_id=run["run_id"], key="old", step=step),
                "field": "key",
            })  # fmt: skip
            answer = ui.get(image, params={"key": "old", "step": step})
            assert (answer.status_code, answer.json()) == (404, {
                "detail": f"run {run['run_id']} has no image 'old' at step {step} in its folder",
                "field": "key",
            })  # fmt: skip
        assert filled.refused(f"/runs/{run['run_id']}/image", key="old", step=104)[0] == 404
        answer = ui.get(image, params={"key": "old", "step": 104})
        assert (answer.status_code, answer.content) == (200, inside)
        for client in (filled.client, ui):  # a row with its bytes: served from the store
            answer = client.get(image, params={"key": "samples/img", "step": logged["step"]})
            assert (answer.status_code, answer.content) == (200, inside)
            assert client.get(image, params={"key": "samples/img", "step": 5}).json() == {
                "detail": f"run {run['run_id']} has no image 'samples/img' at step 5",
                "field": "key",
            }
    assert filled.refused("/runs/999/image", key="samples/img", step=4)[0] == 404


# -- predictions ------------------------------------------------------------------------------


def test_disagreements_and_breakdown_are_lab_inspect_s(filled: Filled) -> None:
    got = filled.get("/experiments/dash/disagreements", eval="holdout", arm_a="big",
                     arm_b="small", limit=5)["rows"]  # fmt: skip
    want = _rows(lab.inspect.disagreements(filled.con, "dash", "holdout", "big", "small", 5))
    assert got == want and len(got) == 5
    every = filled.get("/experiments/dash/disagreements", eval="holdout", arm_a="big",
                       arm_b="small", limit=100)["rows"]  # fmt: skip
    assert SCRIPT in [r["input"] for r in every]  # HTML in a prediction stays data
    breakdown = filled.get("/experiments/dash/breakdown", eval="holdout")["rows"]
    assert breakdown == _rows(lab.inspect.breakdown(filled.con, "dash", "holdout"))
    assert [(r["arm"], r["slice"]) for r in breakdown][:2] == [("small", "high"), ("small", "low")]


@pytest.mark.parametrize(
    ("path", "params", "status", "field", "detail"),
    [
        ("disagreements", {"eval": "nope", "arm_a": "big", "arm_b": "small"}, 404, "eval",
         "experiment 'dash' has no eval 'nope'; it has: holdout"),
        ("disagreements", {"eval": "holdout", "arm_a": "big", "arm_b": "huge"}, 404, "arm_b",
         "experiment 'dash' has no arm 'huge'; arms: small, big, broken, cl"),
        ("disagreements", {"eval": "holdout", "arm_a": "big", "arm_b": "small", "limit": 0},
         400, "limit", "limit=0: give 1 to 10000 rows"),
        ("disagreements", {"eval": "holdout", "arm_a": "big", "arm_b": "big"}, 400, None,
         "disagreements needs two different arms, got 'big' twice"),
        ("breakdown", {"eval": "nope"}, 404, "eval",
         "experiment 'dash' has no eval 'nope'; it has: holdout"),
    ],
)  # fmt: skip
def test_predictions_refuse_bad_input_in_one_line(
    filled: Filled, path: str, params: dict[str, Any], status: int, field: str | None, detail: str
) -> None:
    assert filled.refused(f"/experiments/dash/{path}", **params) == (
        status, {"detail": detail, "field": field},
    )  # fmt: skip


# -- names, tokens and the real server --------------------------------------------------------


def test_html_in_names_comes_back_as_the_same_text(filled: Filled) -> None:
    from urllib.parse import quote

    path = f"/experiments/{quote(SCRIPT, safe='')}"
    exp = filled.get(path)
    assert (exp["name"], [a["name"] for a in exp["arms"]]) == (SCRIPT, [SCRIPT])
    assert exp["config"] == {"html": SCRIPT}
    assert [(r["run_key"], r["config"]) for r in exp["runs"]] == [
        (f"{SCRIPT}-r0", {"html": SCRIPT})
    ]
    assert exp["summary"][0]["arm"] == SCRIPT and exp["summary"][0]["is_best"] is True
    curves = filled.get(f"{path}/curves", metric="loss", runs="true")
    assert [a["arm"] for a in curves["arms"]] == [SCRIPT]
    assert [r["run_key"] for r in curves["runs"]] == [f"{SCRIPT}-r0"]
    listed = filled.get("/experiments", q=SCRIPT)["rows"]
    assert [(r["name"], r["best_arm"]) for r in listed] == [(SCRIPT, SCRIPT)]


def test_the_dashboard_api_needs_a_token(filled: Filled) -> None:
    bare = filled.client.get(f"{API}/experiments", headers={"Authorization": ""})
    assert bare.status_code == 401
    wrong = filled.client.get(f"{API}/experiments", headers={"Authorization": "Bearer lab_no"})
    assert (wrong.status_code, wrong.json()["detail"]) == (401, "the token is wrong or revoked")


def test_a_real_lab_serve_answers_the_curl_line_of_docs_serve(filled: Filled) -> None:
    """The dashboard section's curl line, against a real server on loopback: what it
    prints is what the in-process app answers."""
    page = (Path(__file__).parents[1] / "docs" / "serve.md").read_text(encoding="utf-8")
    section = page.split("## The dashboard's API", 1)[1].split("\n## ", 1)[0]
    (line,) = [ln for block in re.findall(r"```bash\n(.*?)```", section, re.S)
               for ln in block.splitlines() if ln.startswith("curl ")]  # fmt: skip
    server = serve(filled.url)
    try:
        command = line.replace("http://127.0.0.1:8765", server.url)
        env = {**os.environ, "LAB_TOKEN": server.read_token}
        done = warm.run(["bash", "-c", command], capture_output=True, text=True, env=env)
    finally:
        server.stop()
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == filled.get("/experiments/dash/curves", metric="loss",
                                                 buckets=4)  # fmt: skip


def test_curves_cut_from_blocks_are_the_cut_of_the_points(sqlite_url: str) -> None:
    """On SQLite every run's buckets cut from the metric blocks and the edge points, or
    from the points packed in the blocks (`_cut`), are the cut of every point: min, max and
    last exactly, the mean to rounding (it adds block sums), at bucket widths below and far
    above a block of 32 steps. (PostgreSQL's is checked above.)"""
    from lab.server.read import bucket_bounds
    from lab.store import blocks
    from lab.store.curves import cut as _cut

    store = Store(sqlite_url)
    try:
        exp = store.begin_experiment("wide", config={}, seed=0, repeats=2)
        arm = store.add_arm(exp, "a", overrides={}, config={})
        group = store.add_group(exp, "a", arm_id=arm)
        ids = []
        for r in range(2):
            run = store.start_run(exp, group, run_key=f"a-r{r}", arm_id=arm, repeat=r, stage=0,
                                  seed=r, config={}, output_dir=None)  # fmt: skip
            for step in range(r * 7, 6000, 1 + r):
                value = math.nan if step % 501 == 0 else math.sin(step / (50 + r)) + step * 1e-4
                store.log_metrics(run, step, {"noisy": value})
            ids.append(run)
        store.flush()
        for n in (1, 3, 50, 600, 3000):
            bounds = bucket_bounds(0, 5999, n)
            got = _cut(store.engine, ids, "noisy", bounds, last=True)
            with store.engine.connect() as conn:
                points = blocks.cut(conn, "noisy", ids, bounds, last=True, from_points=True)
            cells = list(zip(got.run_id.tolist(), got.i.tolist(), strict=True))
            assert cells == sorted(points)
            for k, (run_id, i) in enumerate(cells):
                c = points[(run_id, i)]
                low, high, mean = got.low[k], got.high[k], got.mean[k]
                if c[5]:
                    assert got.counted[k] and (low, high) == (c[2], c[3])
                    assert mean == pytest.approx(c[4] / c[5], rel=1e-12)
                else:
                    assert not got.counted[k] and math.isnan(low) and math.isnan(mean)
                last = got.last[k]
                assert last == c[6] or (math.isnan(last) and math.isnan(c[6]))
    finally:
        store.close()


def test_the_apps_duckdb_connection_closes_with_the_app(sqlite_url: str) -> None:
    """The DuckDB connection the experiment page opens (it attaches the store) is closed
    when the app shuts down, with the store."""
    import duckdb

    store = Store(sqlite_url)
    try:
        exp = store.begin_experiment("tiny", config={}, seed=0, repeats=1)
        arm = store.add_arm(exp, "a", overrides={}, config={})
        group = store.add_group(exp, "a", arm_id=arm)
        run = store.start_run(exp, group, run_key="a-r0", arm_id=arm, repeat=0, stage=0,
                              seed=0, config={}, output_dir=None)  # fmt: skip
        store.log_metrics(run, 1, {"loss": 0.5})
        store.finish_run(run, status="completed")
        store.finish_experiment(exp, status="completed")
        token = create_token(store.engine, "tiny-read", "read")
    finally:
        store.close()
    app = create_app(sqlite_url)
    with TestClient(app, headers={"Authorization": f"Bearer {token}"}) as client:
        assert client.get("/api/v1/dashboard/experiments/tiny").status_code == 200
        con = app.state.inspect
        assert con.execute("SELECT 1").fetchone() == (1,)
    with pytest.raises(duckdb.ConnectionException):
        con.execute("SELECT 1")
