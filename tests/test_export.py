"""`lab.export`: one experiment out of the store as Parquet, and back in through DuckDB.

The round trip is checked table by table: every row the store's views hold for the
experiment comes back from the export's views, value for value (NaN, inf, JSON, NULL and
timestamps included), and no row of another experiment goes with it.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import duckdb
import pydantic
import pytest
import torch

import lab.inspect
from lab import (
    Arm,
    Callback,
    CheckpointConfig,
    EvalResult,
    Evaluator,
    Experiment,
    LoopArtifacts,
    RunSpec,
    TrainingLoop,
)
from lab.errors import ConfigError, NoExperiment, StoreError
from lab.export import export
from lab.media import histogram, write_image
from lab.store import Store
from lab.store.schema import TABLES, Base


class Cfg(pydantic.BaseModel):
    lr: float = 0.1
    fail: bool = False


def _loss(model: torch.nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, float]]:
    x, y = batch
    loss = torch.nn.functional.mse_loss(model(x), y)
    return loss, {"odd": math.nan, "big": math.inf}  # non-finite metrics must survive too


def _bench(model: torch.nn.Module) -> EvalResult:
    out = model(torch.ones(3, 2)).squeeze(1).tolist()
    return EvalResult(
        "bench",
        {"acc": 0.5, "nan": math.nan},
        breakdowns={"small": {"acc": 1.0}, "large": {"acc": 0.0}},
        tags={"suite": "🧪"},
        predictions=[
            {"example_id": f"e{i}", "input": "字" * 50, "output": out[i], "target": None,
             "score": [1.0, math.nan, -math.inf][i], "slice": "small"}
            for i in range(3)
        ],
    )  # fmt: skip


class _Media(Callback):
    """A histogram (NaN and inf counted apart) and an image at step 2, through `on_media`."""

    def __init__(self, run: RunSpec) -> None:
        self.run = run

    def on_step_end(self, state: Any, step_idx: int, batch: Any, metrics: Any) -> None:
        if step_idx == 2:
            image = write_image(state.ctx.folder, "img", 2, torch.ones(3, 2, 2))
            media = {"w": histogram([0.5, math.nan, math.inf], bins=2), "img": image}
            self.run.dispatcher.fire("on_media", state, step_idx, media)


def _train(run: RunSpec) -> LoopArtifacts:
    if run.config.fail:
        raise RuntimeError("this arm fails")
    torch.manual_seed(run.seed)
    model = torch.nn.Linear(2, 1)
    x = torch.randn(8, 2)
    return TrainingLoop(
        model,
        torch.optim.SGD(model.parameters(), lr=run.config.lr),
        [(x, x.sum(1, keepdim=True))],
        _loss,
        num_steps=4,
        evaluators=[
            Evaluator("val", lambda m: {"loss": 0.5}, every=2),
            Evaluator("bench", _bench, at_end=True),
        ],
        checkpoint=CheckpointConfig(every=2, keep_last=1),
        callbacks=[_Media(run)],
    ).fit(run)


def _record(url: str, tmp_path: Path) -> None:
    """Two experiments in one store: `keep` (to export) and `other` (to leave behind)."""
    for name in ("other", "keep", "third"):
        Experiment(
            name,
            _train,
            base_config=Cfg(),
            arms=[Arm("a", lr=0.1), Arm("b", lr=0.05), Arm("bad", fail=True)],
            repeats=2,
            benchmarks=[Evaluator("bench", _bench)],
            store=url,
            output_dir=tmp_path / "runs" / name,
        ).run()
    store = Store(url)  # a sweep's records: arm `a`'s trial, arm `b` dropped by a race
    try:
        for name in ("other", "keep", "third"):
            with store.engine.connect() as conn:
                exp_id = store.experiment_id(conn, name)
                arm = dict(conn.exec_driver_sql(
                    f"SELECT name, arm_id FROM arms WHERE experiment_id = {exp_id}"
                ).all())  # fmt: skip
            store.add_trial(exp_id, 0, arm["a"], {"lr": 0.1}, 0)
            store.tell_trial(exp_id, 0, told=0, value=0.5, state="complete")
            store.add_elimination(exp_id, arm["b"], round=1, test="t", statistic=-3.25,
                                  p_value=0.03, alpha=0.05, best="a")  # fmt: skip
    finally:
        store.close()


def _order(table: str) -> str:
    return ", ".join(f'"{c.name}"' for c in Base.metadata.tables[table].primary_key.columns)


def _same(value: Any) -> Any:
    """A value that compares equal to itself: NaN becomes a marker."""
    return "<NaN>" if isinstance(value, float) and math.isnan(value) else value


def _table(con: duckdb.DuckDBPyConnection, table: str, where: str = "") -> list[tuple]:
    rows = con.sql(f'SELECT * FROM "{table}" {where} ORDER BY {_order(table)}').fetchall()
    return [tuple(_same(v) for v in row) for row in rows]


_OF_KEEP = {
    "experiments": "WHERE name = 'keep'",
    "arms": "WHERE experiment_id = {id}",
    "groups": "WHERE experiment_id = {id}",
    "runs": "WHERE experiment_id = {id}",
    "sweep_trials": "WHERE experiment_id = {id}",
    "eliminations": "WHERE experiment_id = {id}",
    "predictions": "WHERE eval_id IN (SELECT eval_id FROM evals WHERE run_id IN "
    "(SELECT run_id FROM runs WHERE experiment_id = {id}))",
}
_OF_KEEP_RUNS = "WHERE run_id IN (SELECT run_id FROM runs WHERE experiment_id = {id})"


def test_an_export_reads_back_equal_table_by_table(store_url: str, tmp_path: Path) -> None:
    _record(store_url, tmp_path)
    folder = tmp_path / "export"
    counts = export("keep", folder, store=store_url)
    assert list(counts) == list(TABLES)
    assert sorted(p.name for p in folder.iterdir()) == sorted(f"{t}.parquet" for t in TABLES)

    source = lab.inspect.connect(store_url)
    (keep_id,) = source.sql("select experiment_id from experiments where name = 'keep'").fetchone()
    back = lab.inspect.connect(folder)
    assert back.sql("select mode, url from lab_source").fetchone() == ("parquet", str(folder))
    for table in TABLES:
        where = _OF_KEEP.get(table, _OF_KEEP_RUNS).format(id=keep_id)
        want = _table(source, table, where)
        assert want, f"the test should give {table} some rows"
        assert _table(back, table) == want, table
        assert counts[table] == len(want)
        # the same column names and types, so a notebook's SQL runs on either
        assert back.sql(f'DESCRIBE "{table}"').fetchall() == [
            (name, kind, "YES", None, None, None)
            for name, kind, *_ in source.sql(f'DESCRIBE "{table}"').fetchall()
        ], table

    # what makes the round trip worth checking is there: NaN, inf, JSON, NULL, unicode
    odd = back.sql("select value from metrics where key = 'odd'").fetchall()
    assert odd and all(math.isnan(v) for (v,) in odd)
    assert back.sql("select distinct value from metrics where key = 'big'").fetchall() == [
        (math.inf,)
    ]
    scores = back.sql("select distinct score from predictions order by score nulls last")
    assert scores.fetchall() == [(-math.inf,), (1.0,), (None,)]
    assert back.sql(
        "select distinct tags->>'suite' from evals where name = 'bench'"
    ).fetchall() == [("🧪",)]
    assert back.sql("select count(*) from runs where status = 'failed'").fetchone() == (2,)
    assert back.sql("select count(*) from evals where step is null").fetchone() == (4,)
    # final_metrics and history read the export like the store
    final = "select arm, repeat, key, value from final_metrics where key = 'loss' order by all"
    assert (
        back.sql(final).fetchall()
        == source.sql(final.replace("where", "where experiment = 'keep' and")).fetchall()
    )
    history = lab.inspect.history(back, "a-r0", "loss").fetchall()
    assert history == lab.inspect.history(source, "a-r0", "loss", experiment="keep").fetchall()
    assert [s for s, _ in history] == [1, 2, 3, 4]


def test_exporting_again_replaces_the_files_and_leaves_no_temporaries(
    sqlite_url: str, tmp_path: Path
) -> None:
    _record(sqlite_url, tmp_path)
    folder = tmp_path / "export"
    export("other", folder, store=sqlite_url)
    counts = export("keep", folder, store=sqlite_url)
    assert sorted(p.name for p in folder.iterdir()) == sorted(f"{t}.parquet" for t in TABLES)
    back = lab.inspect.connect(str(folder))
    assert back.sql("select name from experiments").fetchall() == [("keep",)]
    assert back.sql("select count(*) from runs").fetchone() == (counts["runs"],) == (6,)
    # an export folder is itself a source to export from
    again = export("keep", tmp_path / "again", store=str(folder))
    assert again == counts


def test_an_unknown_experiment_names_the_known_ones(sqlite_url: str, tmp_path: Path) -> None:
    _record(sqlite_url, tmp_path)
    with pytest.raises(NoExperiment) as caught:
        export("nope", tmp_path / "x", store=sqlite_url)
    assert str(caught.value) == (
        "no experiment named 'nope' in the store; known: keep, other, third"
    )
    assert not (tmp_path / "x").exists()  # nothing is written for a name that is not there


def test_a_folder_that_is_not_an_export_is_one_clear_error(tmp_path: Path) -> None:
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "runs.parquet").write_bytes(b"")
    with pytest.raises(StoreError, match=r"is not a lab export: it lacks experiments\.parquet"):
        lab.inspect.connect(tmp_path / "half")
    with pytest.raises(ConfigError, match="mode='arrow' applies to a store URL"):
        lab.inspect.connect(tmp_path / "half", mode="arrow")
