"""The suite's own machinery: one PostgreSQL helper, one recorder callback, and a CI that
runs the README's test command, the type checker, and says how long the suite took."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
import torch

from lab import TrainingLoop
from tests.recorder import EVERY_HOOK, Recorder

ROOT = Path(__file__).resolve().parents[1]


def test_only_tests_postgres_reads_the_servers_url() -> None:
    readers = sorted(
        path.name
        for path in (ROOT / "tests").glob("*.py")
        if path.name not in ("postgres.py", "test_suite.py")
        and re.search(r"environ(\.get\(|\[)\s*['\"]LAB_TEST_POSTGRES_URL", path.read_text())
    )
    assert readers == [], "use tests/postgres.py (admin_url, new_database) or the pg_url fixture"


class Steps(Recorder, hooks=("on_train_start", "on_step_end", "close")):
    def note(self, hook: str, *args: Any, **kwargs: Any) -> Any:
        return (hook, args[1]) if hook == "on_step_end" else hook


def _fit(*callbacks: Any) -> None:
    model = torch.nn.Linear(2, 1)
    data = [torch.ones(4, 2)] * 2
    loop = TrainingLoop(
        model, torch.optim.SGD(model.parameters(), lr=0.1), data,
        lambda m, b: m(b).pow(2).mean(), 3, callbacks=list(callbacks),
    )  # fmt: skip
    loop.fit()


def test_a_recorder_notes_the_hooks_it_names_in_order_and_no_other() -> None:
    steps = Steps()
    _fit(steps)
    assert steps.calls == [
        "on_train_start", ("on_step_end", 1), ("on_step_end", 2), ("on_step_end", 3), "close"
    ]  # fmt: skip
    assert "on_train_end" not in vars(Steps) and "on_step_end" in vars(Steps)


def test_recorders_may_share_one_trace() -> None:
    trace: list[Any] = []
    _fit(Steps(trace), Steps(trace))
    assert trace[:2] == ["on_train_start", "on_train_start"]
    assert trace[-2:] == ["close", "close"]


def test_a_recorder_names_only_hooks_and_takes_only_their_arguments() -> None:
    with pytest.raises(TypeError, match=r"^Typo: 'on_stepend' is no hook of lab\.hooks\.HOOKS$"):

        class Typo(Recorder, hooks=("on_stepend",)):
            pass

    class Every(Recorder, hooks=EVERY_HOOK):
        pass

    with pytest.raises(TypeError, match="missing a required argument: 'metrics'"):
        Every().on_step_end(None, 1, None)
    with pytest.raises(TypeError, match="too many positional arguments"):
        Every().on_benchmark_eval(None, None, [], 3)  # `step` is keyword-only


def test_ci_runs_the_readmes_test_command_mypy_and_prints_the_suites_time() -> None:
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    command = re.search(r"&& \.venv/bin/python -m pytest(.*)\n", readme)
    assert command is not None
    assert f"\n.venv/bin/python -m pytest{command[1]} || status=$?\n" in ci
    assert '-n 2 --dist loadfile -m "not serial"' in command[1]
    assert command[1].endswith("&& .venv/bin/python -m pytest -m serial")
    assert ci.endswith('\nexit "$status"\n')  # a failing test fails CI
    assert "\n.venv/bin/mypy" in ci or "if .venv/bin/mypy" in ci
    assert "the test suite took" in ci
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    dev = " ".join(pyproject["project"]["optional-dependencies"]["dev"])
    assert "pytest-xdist" in dev and "mypy" in dev
    assert pyproject["tool"]["mypy"]["files"] == ["lab"]


def test_a_type_error_in_lab_fails_ci() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    assert "\nMYPY_FAILS_CI=1\n" in ci
