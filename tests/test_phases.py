"""Hooks are named by the `Hook` enum, and callbacks are ordered by named phases.

Inside a phase the attachment order holds; the produce phase runs first in `on_step_end`
alone; a `priority` number a callback still sets places it among the phases as before.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from lab.callbacks.files import ConfigSaver
from lab.callbacks.notify import Notifier
from lab.dispatch import Dispatcher
from lab.hooks import HOOKS, PHASE_PRIORITY, Callback, Hook, Phase, phase_of, priority_of
from lab.loggers import ConsoleLogger, JsonlLogger, SqlLogger, WandbLogger

LAB = Path(__file__).resolve().parent.parent / "lab"


def _tracer(name: str, calls: list[str], **attrs: Any) -> Callback:
    def record(self: Any, *args: Any, **kwargs: Any) -> None:
        calls.append(name)

    cls = type(name, (Callback,), {"on_train_start": record, "on_step_end": record, **attrs})
    return cls()


def test_the_hook_enum_is_the_list_of_hooks_and_names_the_callback_methods() -> None:
    assert tuple(Hook) == HOOKS
    assert [hook.value for hook in Hook][:3] == ["on_experiment_start", "on_group_start",
                                                 "on_run_start"]  # fmt: skip
    assert all(callable(getattr(Callback, hook.value)) for hook in Hook)
    assert Hook.STEP_END == "on_step_end" and f"{Hook.CLOSE}" == "close"


def test_callbacks_run_by_phase_and_in_attachment_order_inside_a_phase() -> None:
    calls: list[str] = []
    d = Dispatcher(
        [
            _tracer("trace", calls, phase=Phase.TRACE),
            _tracer("notify", calls, phase=Phase.NOTIFY),
            _tracer("act_1", calls),
            _tracer("report_1", calls, phase=Phase.REPORT),
            _tracer("record", calls, phase=Phase.RECORD),
            _tracer("produce", calls, metrics_logged=("x/*",)),
            _tracer("report_2", calls, phase=Phase.REPORT),
            _tracer("act_2", calls, phase=Phase.ACT),
            _tracer("legacy", calls, priority=-20),  # between report (-10) and notify (-50)
        ]
    )
    d.fire(Hook.TRAIN_START, None)
    assert calls == ["record", "act_1", "produce", "act_2", "report_1", "report_2", "legacy",
                     "notify", "trace"]  # fmt: skip
    calls.clear()
    d.fire(Hook.STEP_END, None, 1, None, {})  # the produce phase first, in this hook only
    assert calls == ["produce", "record", "act_1", "act_2", "report_1", "report_2", "legacy",
                     "notify", "trace"]  # fmt: skip


def test_the_built_in_callbacks_declare_phases_and_no_priority_number() -> None:
    phases = {
        SqlLogger: Phase.RECORD,
        ConfigSaver: Phase.ATTACH,
        WandbLogger: Phase.MIRROR,
        ConsoleLogger: Phase.REPORT,
        Notifier: Phase.NOTIFY,
        JsonlLogger: Phase.TRACE,
    }
    for cls, phase in phases.items():
        assert cls.phase is phase, cls
        assert priority_of(cls.__new__(cls)) == PHASE_PRIORITY[phase]
    assert phase_of(Callback()) is Phase.ACT
    numbered = [
        f"{path.relative_to(LAB.parent)}:{n}"
        for path in sorted(LAB.rglob("*.py"))
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if re.match(r"\s+priority\s*(:.*)?=\s*-?\d", line) and path.name != "hooks.py"
    ]
    assert numbered == []


def test_every_hook_is_fired_by_its_enum_member() -> None:
    by_string = [
        f"{path.relative_to(LAB.parent)}:{n}"
        for path in sorted(LAB.rglob("*.py"))
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if re.search(r"\.(fire|listens)\(\s*[\"']|\.fire, [\"']", line)
    ]
    assert by_string == []


LIFECYCLE_HOOKS = ("EXPERIMENT_START", "GROUP_START", "RUN_START", "RUN_END", "EXPERIMENT_END")


def test_one_file_fires_the_experiment_group_and_run_hooks() -> None:
    """`lab.lifecycle` alone fires the experiment, group and run hooks, for an Experiment
    (serial, a pool, Ray), a bare fit, `lab.start_run` and the ranks of a run alike."""
    fired = re.compile(r"\.fire\(\s*(?:Hook\.(\w+)|[\"'](\w+)[\"'])")
    names = {hook.name for hook in Hook if hook.name in LIFECYCLE_HOOKS}
    values = {hook.value for hook in Hook if hook.name in LIFECYCLE_HOOKS}
    where = sorted(
        {
            str(path.relative_to(LAB.parent))
            for path in LAB.rglob("*.py")
            for m in fired.finditer(path.read_text(encoding="utf-8"))
            if m.group(1) in names or m.group(2) in values
        }
    )
    assert where == ["lab/lifecycle.py"]
