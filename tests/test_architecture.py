"""How `lab` is put together: one reading of a store URL, and stores that plug in by role."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy.engine

import lab
import lab.store.engine as engine_module
from lab.errors import UnknownScheme
from lab.hooks import Callback, LogContext
from lab.loggers import SqlLogger, store_sink
from lab.sinks import StoreSink
from lab.store import Store, resolve_url


def _train(run: Any) -> dict[str, float]:
    return {"loss": float(run.seed)}


def test_a_store_url_is_parsed_once_from_experiment_to_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    parsed: list[str] = []
    real = sqlalchemy.engine.make_url

    def counting(url: Any) -> Any:
        parsed.append(str(url))
        return real(url)

    monkeypatch.setattr(engine_module, "make_url", counting)
    url = f"sqlite:///{tmp_path / 'lab.db'}"
    exp = lab.Experiment("once", _train, repeats=2, store=url)
    result = exp.run()
    assert [r.status for r in result.runs] == ["completed", "completed"]
    assert parsed == [url]
    assert resolve_url(exp.store) is exp.store
    store = Store(exp.store)
    try:
        assert store.url is exp.store
        assert [e["name"] for e in store.list_experiments()] == ["once"]
    finally:
        store.close()
    assert parsed == [url]


def test_a_resolved_url_shows_no_password_and_pickles_as_its_text() -> None:
    url = resolve_url("postgresql://me:secret@db.example:5433/lab")
    assert url == "postgresql+psycopg://me:secret@db.example:5433/lab"
    assert url.shown == "postgresql+psycopg://me:***@db.example:5433/lab"
    assert url.backend == "postgresql"
    copy = pickle.loads(pickle.dumps(url))
    assert copy == url and copy.parsed == url.parsed and copy.shown == url.shown
    with pytest.raises(UnknownScheme, match="scheme 'mysql' is not supported"):
        resolve_url("mysql://x/y")


class DictSink(Callback):
    """A store sink for a backend that is not SQL: run records in a dict."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.runs: dict[str, dict[str, Any]] = {}

    def open(self) -> DictSink:
        self.calls.append("open")
        return self

    def mark_crashed(self) -> list[str]:
        self.calls.append("mark_crashed")
        return []

    def previous_runs(self, experiment: str) -> dict[str, dict[str, Any]]:
        self.calls.append(f"previous_runs {experiment}")
        return {}

    def current_runs(self, experiment: str) -> list[dict[str, Any]]:
        return []

    def run_keys(self, experiment: str) -> list[str]:
        return []

    def supersede_run(self, run_id: int, run_key: str, output_dir: str | None) -> None:
        raise AssertionError("nothing to supersede")

    def claim(self, ctx: LogContext) -> dict[str, Any] | None:
        self.calls.append(f"claim {ctx.run_key}")
        return None

    def release(self, run_key: str, error: str) -> None:
        self.calls.append(f"release {run_key}")

    def on_run_end(self, ctx: LogContext, run_result: Any, arm: Any) -> None:
        self.calls.append(f"on_run_end {run_result.run_key} {run_result.status}")


def test_an_experiment_asks_any_store_sink_and_adds_no_sql_logger(tmp_path: Path) -> None:
    sink = DictSink()
    assert isinstance(sink, StoreSink)
    exp = lab.Experiment("dict", _train, repeats=2, callbacks=[sink])
    result = exp.run()
    assert [r.status for r in result.runs] == ["completed", "completed"]
    run_keys = [r.run_key for r in result.runs]
    assert sink.calls == [
        "open",
        "mark_crashed",
        "previous_runs dict",
        f"claim {run_keys[0]}",
        f"on_run_end {run_keys[0]} completed",
        f"release {run_keys[0]}",
        f"claim {run_keys[1]}",
        f"on_run_end {run_keys[1]} completed",
        f"release {run_keys[1]}",
    ]
    assert not (tmp_path / "lab.db").exists()  # no SqlLogger was added beside it


def test_store_sink_maps_every_store_url_to_its_logger(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'x.db'}"
    sink = store_sink(url)
    assert type(sink) is SqlLogger and isinstance(sink, StoreSink)
    store = Store(url)
    try:
        assert store_sink(store).store is store
    finally:
        store.close()
