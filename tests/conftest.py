"""Shared fixtures: strict hooks, fresh stores on SQLite and on the real PostgreSQL server.

PostgreSQL tests read ``LAB_TEST_POSTGRES_URL`` (`.ci/run` exports it). Without it they
skip, except under ``CI=true``, where a missing server is a failure (``tests/postgres.py``).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from lab.store import Store
from tests.postgres import new_database
from tests.served import Served, serve

os.environ["LAB_STRICT"] = "1"  # callback errors re-raise in tests unless a test opts out


#: What a module that holds a `serial` test says: ``pytest -m serial`` imports only those.
SERIAL = "pytest.mark.serial"


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Under ``pytest -m serial`` (the README's second command) a test module that marks no
    test `serial` is not imported: collecting the whole suite again costs a process that
    imports torch, wandb, scipy and the rest for 8 tests."""
    if config.getoption("markexpr") != "serial" or not collection_path.name.startswith("test_"):
        return None
    if collection_path.suffix != ".py":
        return None
    return SERIAL not in collection_path.read_text(encoding="utf-8") or None


#: Each test module's seconds, summed over its tests, as a run of the whole suite measured
#: them: `pytest_collection_modifyitems` hands the longest modules out first. Refresh it
#: with ``LAB_RECORD_MODULE_SECONDS=1`` on the README's command (`pytest_sessionfinish`).
MODULE_SECONDS = Path(__file__).with_name("module_seconds.json")
_took: dict[str, float] = {}


def pytest_configure(config: pytest.Config) -> None:
    """Keep the order `pytest_collection_modifyitems` makes: pytest-xdist's `loadfile`
    would otherwise hand the modules out by their number of tests, which left a 64-second
    module of two tests to start last, on one worker, while the other had nothing to do."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: every item is still here
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The longest modules first (`MODULE_SECONDS`), each module's order kept: with the
    README's ``pytest -n 2 --dist loadfile`` each worker takes the next module when it is
    free, and longest-first leaves none running alone at the end (replayed on the measured
    seconds, the two workers end within a second of each other). A module not measured yet
    counts a second per test. A `serial` test in a module that does not spell `SERIAL`
    would be left out of ``pytest -m serial``: that stops the run."""
    for item in items:
        if item.get_closest_marker("serial") and SERIAL not in item.path.read_text("utf-8"):
            raise pytest.UsageError(f"{item.path.name}: mark serial tests with @{SERIAL}")
    seconds = json.loads(MODULE_SECONDS.read_text(encoding="utf-8"))
    counts = Counter(item.path.name for item in items)
    order = {name: -seconds.get(name, float(n)) for name, n in counts.items()}
    items.sort(key=lambda item: order[item.path.name])  # stable: each module's order kept


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Sum each module's seconds (setup, call and teardown), for `pytest_sessionfinish`."""
    name = report.nodeid.split("::", 1)[0].rsplit("/", 1)[-1]
    _took[name] = _took.get(name, 0.0) + report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    """With ``LAB_RECORD_MODULE_SECONDS=1``, write the seconds this run measured into
    `MODULE_SECONDS` (the modules it did not run keep theirs). In the controlling process
    only: pytest-xdist's workers send it every report. Not from ``pytest -m serial``, whose
    few tests would stand for their whole modules."""
    config = session.config
    if not os.environ.get("LAB_RECORD_MODULE_SECONDS") or hasattr(config, "workerinput"):
        return
    if config.getoption("markexpr") == "serial":
        return
    seconds = json.loads(MODULE_SECONDS.read_text(encoding="utf-8"))
    seconds.update({name: round(took, 1) for name, took in _took.items()})
    ranked = dict(sorted(seconds.items(), key=lambda kv: -kv[1]))
    MODULE_SECONDS.write_text(json.dumps(ranked, indent=1) + "\n", encoding="utf-8")


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A URL to a brand-new, empty PostgreSQL database, dropped after the test."""
    with new_database() as url:
        yield url


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    """A URL to a SQLite file in the test's own folder."""
    return f"sqlite:///{tmp_path / 'lab.db'}"


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Each store test runs once on SQLite and once on PostgreSQL."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'lab.db'}"
    return request.getfixturevalue("pg_url")


@pytest.fixture(
    scope="module", params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
def module_store_url(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """`store_url` made once for a module's tests, on each backend: for tests that only read
    what one fixture recorded, so that they do not record it again each."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path_factory.mktemp('store') / 'lab.db'}"
        return
    with new_database() as url:
        yield url


@pytest.fixture
def store(store_url: str) -> Iterator[Store]:
    """An open, migrated store on each backend, closed after the test."""
    s = Store(store_url)
    yield s
    s.close()


@pytest.fixture(autouse=True)
def _isolated_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test runs in its own folder, with no store URL leaking in from outside."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("LAB_STORE_URL", raising=False)


@pytest.fixture
def served(store_url: str) -> Iterator[Served]:
    """A real `lab serve` (uvicorn in a subprocess on loopback) in front of `store_url`, on
    SQLite and on PostgreSQL, with `write_token` and `read_token` made for it."""
    server = serve(store_url)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def module_served(module_store_url: str) -> Iterator[Served]:
    """`served` started once for a module's tests, on each backend (`module_store_url`)."""
    server = serve(module_store_url)
    try:
        yield server
    finally:
        server.stop()
