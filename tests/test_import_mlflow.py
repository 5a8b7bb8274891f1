"""`lab import mlflow`: runs written by MLflow itself (a file store and a SQLite database),
read back from the lab store row for row against MLflow's own client."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import pytest

import lab.inspect
from lab.errors import ConfigError
from lab.importers import SourceError, import_mlflow
from lab.importers.core import run_key
from tests.importing import imported, lab_import, nan_safe

mlflow = pytest.importorskip("mlflow")

#: (lr, seed, status, final loss offset): started in this order; lr 0.1's seeds out of order.
RUNS = [
    (0.1, 1, "FINISHED"),
    (0.1, 0, "FINISHED"),
    (0.2, 0, "FINISHED"),
    (0.2, 1, "KILLED"),
    (0.3, 0, "FAILED"),
]


def _write(uri: str) -> list[str]:
    """The runs of RUNS in MLflow experiment 'sweep' (and an empty 'other'), their ids."""
    client = mlflow.MlflowClient(uri)
    exp_id = client.create_experiment("sweep")
    client.create_experiment("other")
    ids = []
    for i, (lr, seed, status) in enumerate(RUNS):
        run = client.create_run(exp_id, run_name=f"run{i}", tags={"team": "a b", "k": "v"})
        rid = run.info.run_id
        for name, value in {"lr": lr, "seed": seed, "opt": "sgd", "layers": [1, 2]}.items():
            client.log_param(rid, name, value)
        for step in range(3):
            client.log_metric(rid, "loss", lr + seed / 10 + (2 - step), step=step * 10)
        client.log_metric(rid, "weird", math.nan, step=0)
        client.set_terminated(rid, status=status)
        ids.append(rid)
    return ids


@pytest.fixture(scope="module", params=["file", "sqlite"])
def source(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """An MLflow file store or SQLite database with RUNS written in it, read only."""
    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    folder = tmp_path_factory.mktemp(f"mlflow-{request.param}")
    uri = folder.as_uri() + "/mlruns" if request.param == "file" else f"sqlite:///{folder}/m.db"
    return uri, _write(uri)


def test_each_run_comes_over_with_its_params_metrics_tags_and_status(
    source: Any, sqlite_url: str
) -> None:
    uri, ids = source
    result = import_mlflow(uri, experiment="sweep", store=sqlite_url)
    assert result.line() == ("imported 5 new runs (20 points) from mlflow into experiment 'sweep'")
    runs = imported(sqlite_url, "sweep")
    client = mlflow.MlflowClient(uri)
    assert sorted(runs) == sorted(run_key("mlflow", i) for i in ids)
    for i, rid in enumerate(ids):
        run = runs[run_key("mlflow", rid)]
        lr, seed, status = RUNS[i]
        assert run["config"] == {"layers": [1, 2], "lr": lr, "opt": "sgd", "seed": seed}
        assert (run["arm"], run["repeat"], run["seed"]) == (f"run{i}", 0, seed)
        expected = {"FINISHED": "completed", "KILLED": "stopped", "FAILED": "failed"}[status]
        assert (run["status"], run["error"]) == (expected, None)
        assert run["tags"] == ["k=v"]  # "team=a b" holds a space: only in the provenance
        source_info = run["provenance"]["imported_from"]
        assert source_info["tags"]["team"] == "a b" and source_info["run_id"] == rid
        for key in ("loss", "weird"):
            history = client.get_metric_history(rid, key)
            assert run["points"][key] == [
                (m.step, nan_safe(m.value), m.timestamp / 1000) for m in history
            ]


def test_importing_again_adds_nothing_and_says_so(source: Any, sqlite_url: str) -> None:
    uri, _ids = source
    import_mlflow(uri, experiment="sweep", store=sqlite_url)
    before = imported(sqlite_url, "sweep")
    again = import_mlflow(uri, experiment="sweep", store=sqlite_url)
    assert again.line() == "nothing new: the 5 runs from mlflow are in experiment 'sweep' already"
    assert imported(sqlite_url, "sweep") == before
    with pytest.raises(ConfigError) as other:
        import_mlflow(uri, experiment="sweep", store=sqlite_url, arm_by="lr")
    assert str(other.value) == (
        "experiment 'sweep' was imported with --arm-by none (a run per arm); import again with "
        "the same --arm-by, or into another experiment with --name NAME"
    )


def test_arm_by_makes_arms_of_repeats_ordered_by_seed(source: Any, sqlite_url: str) -> None:
    uri, ids = source
    import_mlflow(uri, experiment="sweep", name="by-lr", store=sqlite_url, arm_by="lr")
    runs = imported(sqlite_url, "by-lr")
    placed = {rid: (runs[run_key("mlflow", rid)]["arm"], runs[run_key("mlflow", rid)]["repeat"])
              for rid in ids}  # fmt: skip
    assert list(placed.values()) == [
        ("lr=0.1", 1), ("lr=0.1", 0), ("lr=0.2", 0), ("lr=0.2", 1), ("lr=0.3", 0)
    ]  # fmt: skip
    con = lab.inspect.connect(sqlite_url)
    rows = lab.inspect.summary(con, "by-lr", "loss").fetchall()
    con.close()
    means = {row[0]: (row[1], round(row[2], 9) if row[2] is not None else None) for row in rows}
    # lr 0.2's killed run counts (stopped), lr 0.3's failed one does not
    assert means == {"lr=0.1": (2, 0.15), "lr=0.2": (2, 0.25), "lr=0.3": (0, None)}


def test_a_run_that_grew_gets_its_new_points_and_status(tmp_path: Path, sqlite_url: str) -> None:
    uri = f"sqlite:///{tmp_path}/grow.db"
    client = mlflow.MlflowClient(uri)
    rid = client.create_run(client.create_experiment("live")).info.run_id
    client.log_metric(rid, "loss", 1.0, step=0)
    assert import_mlflow(uri, store=sqlite_url).line() == (
        "imported 1 new run (1 point) from mlflow into experiment 'live'"
    )
    run = imported(sqlite_url, "live")[run_key("mlflow", rid)]
    assert (run["status"], run["error"]) == (
        "crashed",
        "the run was running in MLflow when it was imported; import it again once it ends",
    )
    client.log_metric(rid, "loss", 0.5, step=1)
    client.set_terminated(rid)
    assert import_mlflow(uri, store=sqlite_url).line() == (
        "imported 0 new runs, 1 run with new points (1 point) from mlflow into experiment 'live'"
    )
    run = imported(sqlite_url, "live")[run_key("mlflow", rid)]
    assert run["status"] == "completed"
    assert [(s, v) for s, v, _w in run["points"]["loss"]] == [(0, 1.0), (1, 0.5)]


def test_bad_sources_are_one_line_and_write_nothing(source: Any, tmp_path: Path) -> None:
    uri, _ids = source
    url = f"sqlite:///{tmp_path / 'never.db'}"
    with pytest.raises(SourceError) as no_name:
        import_mlflow(uri, experiment="nope", store=url)
    assert str(no_name.value) == f"no MLflow experiment named 'nope' at {uri}; known: " + (
        "Default, other, sweep"
    )
    with pytest.raises(SourceError) as scheme:
        import_mlflow("bogus://x", store=url)
    assert str(scheme.value).startswith("MLflow cannot read bogus://x: ")
    assert not (tmp_path / "never.db").exists()


def test_the_command_imports_once_and_refuses_a_bad_name(source: Any, tmp_path: Path) -> None:
    uri, _ids = source
    if not uri.startswith("sqlite"):
        pytest.skip("the command runs once, on the SQLite source (each start loads MLflow)")
    store = f"sqlite:///{tmp_path / 'cli.db'}"
    first = lab_import("mlflow", uri, "--experiment", "sweep", "--arm-by", "lr", "--store", store)
    assert (first.returncode, first.stdout) == (
        0,
        "imported 5 new runs (20 points) from mlflow into experiment 'sweep'\n",
    )
    again = lab_import("mlflow", uri, "--experiment", "sweep", "--arm-by", "lr", "--store", store)
    assert again.stdout == "nothing new: the 5 runs from mlflow are in experiment 'sweep' already\n"
    missing = lab_import("mlflow", uri, "--experiment", "nope", "--store", store)
    assert (missing.returncode, missing.stderr) == (
        1,
        f"error: no MLflow experiment named 'nope' at {uri}; known: Default, other, sweep\n",
    )
