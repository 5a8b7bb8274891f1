"""`ConsoleLogger`: plain lines off a terminal, rich bars on one, and the summaries."""

from __future__ import annotations

import io
import os
import pickle
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from rich.console import Console

import lab
from lab import Arm, Evaluator, Experiment, TrainingLoop
from lab.callbacks import build
from lab.errors import ConfigError
from lab.loggers.console import ConsoleLogger
from tests import warm

STEPS = 5


def _mse(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def _loop(steps: int = STEPS, callbacks: tuple[lab.Callback, ...] = ()) -> TrainingLoop:
    x = torch.randn(8, 2)
    data = [(x, x.sum(1, keepdim=True))]
    model = torch.nn.Linear(2, 1)
    return TrainingLoop(
        model,
        torch.optim.SGD(model.parameters(), lr=0.05),
        data,
        _mse,
        steps,
        evaluators=[Evaluator("val", lambda m: {"loss": _mse(m, data[0]).item()}, every=2)],
        callbacks=callbacks,
    )


def _train(run: lab.RunSpec) -> lab.LoopArtifacts:
    if run.arm == "broken":
        raise ValueError("bad batch")
    return _loop().fit(run)


def _run(logger: ConsoleLogger, arms: tuple[str, ...] = ("a", "b")) -> lab.ExperimentResult:
    return Experiment(
        "cs",
        _train,
        arms=[Arm(name) for name in arms],
        repeats=2,
        callbacks=[logger],
        store=False,
        strict=True,
    ).run()


def test_plain_lines_at_the_step_interval_then_run_and_experiment_summaries() -> None:
    out = io.StringIO()
    result = _run(ConsoleLogger(every=2, metrics=("loss", "val/loss"), stream=out))
    lines = out.getvalue().splitlines()
    assert lines[0] == "cs: 4 runs (2 arms x 2 repeats)"
    steps = [line for line in lines if line.startswith("a-r0  step")]
    assert [s.split()[2] for s in steps] == ["2/5", "4/5", "5/5"]  # every 2nd, and the last
    assert re.fullmatch(
        r"a-r0  step 4/5  loss=\S+  val/loss=\S+  [\d.]+ steps/s  ETA \d+\.\ds", steps[1]
    )
    ends = [line for line in lines if "  completed  " in line]
    assert [e.split()[0] for e in ends] == ["a-r0", "a-r1", "b-r0", "b-r1"]
    assert ends[0].endswith("[1/4 runs]") and ends[3].endswith("[4/4 runs]")
    loss = result.runs[0].metrics["loss"]
    assert f"loss={loss:.4g}" in ends[0]
    text = out.getvalue()
    assert "best arm by val/loss (min)" in text  # the default: val/loss, else loss
    assert text.rstrip().splitlines()[-1].startswith("cs: completed in ")


def test_a_seconds_interval_adds_lines_between_step_intervals() -> None:
    out = io.StringIO()
    loop = _loop(callbacks=(ConsoleLogger(every=1000, every_s=1e-9, stream=out),))
    loop.fit()
    steps = [
        line.split()[2] for line in out.getvalue().splitlines() if line.startswith("loop  step")
    ]
    assert steps == ["1/5", "2/5", "3/5", "4/5", "5/5"]
    out = io.StringIO()
    _loop(callbacks=(ConsoleLogger(every=1000, stream=out),)).fit()
    lines = out.getvalue().splitlines()
    assert [line.split()[2] for line in lines if line.startswith("loop  step")] == [
        "5/5"
    ]  # only the last
    # a bare fit is an experiment of one run: its header, its run line, its summary
    name = lines[0].removesuffix(": 1 run")
    assert re.fullmatch(r"loop-\d{8}-\d{6}-[0-9a-f]{6}", name)
    ends = [line for line in lines if line.startswith("loop  completed")]
    assert len(ends) == 1 and re.fullmatch(
        r"loop  completed  loss=\S+  [\d.]+s  \[1/1 run\]", ends[0]
    )
    assert f"{name}: 1 run (1 completed)" in lines
    assert re.fullmatch(rf"{name}: completed in [\d.]+s", lines[-1])


def test_failed_runs_show_their_error_and_the_summary_still_prints() -> None:
    out = io.StringIO()
    result = _run(ConsoleLogger(every=10, stream=out, summary_metric="acc"), arms=("broken",))
    assert result.status == "failed"
    text = out.getvalue()
    assert "broken-r0  failed  0.0s  error: ValueError: bad batch  [1/2 runs]" in text
    assert "cs: 2 runs (2 failed)" in text  # no run has "acc": the summary falls back
    assert text.rstrip().splitlines()[-1].startswith("cs: failed in ")


def test_a_terminal_gets_rich_bars_and_the_same_summaries() -> None:
    buffer = io.StringIO()
    console = Console(file=buffer, force_terminal=True, width=120, color_system=None)
    logger = ConsoleLogger(metrics=("loss", "val/loss"), console=console)
    assert logger._use_bars()
    result = _run(logger)
    assert result.status == "completed"
    text = buffer.getvalue()
    assert "a-r0  completed  loss=" in text and "[4/4 runs]" in text
    assert "best arm by val/loss (min)" in text  # the default: val/loss, else loss
    assert logger._bars is None  # stopped: no refresh thread left behind
    # A bare loop on a terminal draws its own bars and closes them.
    bare = ConsoleLogger(console=console)
    _loop(callbacks=(bare,)).fit()
    assert "loop  completed  loss=" in buffer.getvalue() and "[1/1 run]" in buffer.getvalue()
    assert bare._bars is None


def test_a_run_bar_shows_step_rate_eta_and_metrics_and_the_experiment_bar_counts_runs() -> None:
    buffer = io.StringIO()
    console = Console(file=buffer, force_terminal=True, width=160, color_system=None)
    logger = ConsoleLogger(metrics=("loss", "val/loss"), console=console)
    frames: list[str] = []

    class Snap(lab.Callback):
        priority = -20  # after the logger updated its bar for the step

        def on_step_end(self, state: Any, step_idx: int, batch: Any, metrics: Any) -> None:
            if step_idx == 3 and logger._bars is not None:
                before = len(buffer.getvalue())
                logger._bars.refresh()  # draw now, not at the refresh thread's next tick
                frames.append(buffer.getvalue()[before:])

    def train(run: lab.RunSpec) -> lab.LoopArtifacts:
        return _loop(callbacks=(Snap(),)).fit(run)

    Experiment("cs", train, arms=[Arm("a")], repeats=2, callbacks=[logger], store=False).run()
    assert len(frames) == 2
    lines = [
        [line.strip() for line in re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", f).strip().splitlines()]
        for f in frames
    ]
    experiment_bar, run_bar = lines[0]
    assert re.fullmatch(r"cs\s+0/2", experiment_bar)  # runs done / total
    assert re.fullmatch(
        r"a-r0 ━+\s+3/5 [\d.]+ steps/s  ETA 0\.0s loss=\S+  val/loss=\S+", run_bar
    )  # the eval at step 2 is shown beside the step metrics
    experiment_bar, run_bar = lines[1]
    assert re.fullmatch(r"cs\s+━+\s+1/2", experiment_bar) and run_bar.startswith("a-r1 ")


def test_auto_mode_prints_plain_lines_off_a_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    logger = ConsoleLogger(every=5)
    assert not logger._use_bars()  # pytest's captured stdout is not a terminal
    _loop(callbacks=(logger,)).fit()
    assert "loop  step 5/5  loss=" in capsys.readouterr().out


def test_a_worker_copy_prints_plain_lines() -> None:
    console = Console(file=io.StringIO(), force_terminal=True)
    copy = pickle.loads(pickle.dumps(ConsoleLogger(console=console, progress=True)))
    assert copy.console is None and not copy._use_bars()


def test_config_is_checked_and_registered() -> None:
    (built,) = build([{"kind": "console_logger", "params": {"every": 7, "every_s": 30}}])
    assert isinstance(built, ConsoleLogger) and built.every == 7 and built.every_s == 30
    with pytest.raises(ConfigError, match="every"):
        build([{"kind": "console_logger", "params": {"every": 0}}])
    with pytest.raises(ConfigError, match="every_s"):
        ConsoleLogger(every_s=0)
    with pytest.raises(ConfigError, match="summary_mode"):
        ConsoleLogger(summary_mode="best")  # type: ignore[arg-type]


FAIL_ONCE: set[str] = set()  # run keys whose first attempt fails


def _train_flaky(run: lab.RunSpec) -> lab.LoopArtifacts:
    if run.run_key in FAIL_ONCE:
        FAIL_ONCE.discard(run.run_key)
        raise RuntimeError("preempted")
    return _loop().fit(run)


def test_a_continued_experiment_counts_the_runs_an_earlier_attempt_finished(
    sqlite_url: str,
) -> None:
    def attempt() -> list[str]:
        out = io.StringIO()
        Experiment(
            "again", _train_flaky, arms=[Arm("a"), Arm("b")], repeats=2, store=sqlite_url,
            callbacks=[ConsoleLogger(every=100, stream=out)],
        ).run()  # fmt: skip
        return out.getvalue().splitlines()

    FAIL_ONCE.add("b-r1")
    first = attempt()
    assert first[0] == "again: 4 runs (2 arms x 2 repeats)"
    assert [line.split()[0] for line in first if line.endswith("runs]")] == [
        "a-r0", "a-r1", "b-r0", "b-r1",
    ]  # fmt: skip
    second = attempt()  # only b-r1 runs again; the other three are skipped without hooks
    assert second[0] == "again: 4 runs (2 arms x 2 repeats; 3 finished before)"
    (ended,) = [line for line in second if line.endswith("runs]")]
    assert ended.startswith("b-r1  completed  ") and ended.endswith("[4/4 runs]")


def _train_plain(run: lab.RunSpec) -> lab.LoopArtifacts:
    return _loop().fit(run)


@pytest.mark.slow
def test_under_a_process_pool_the_parent_prints_the_plan_and_counts_runs_as_they_end(
    capfd: pytest.CaptureFixture[str],
) -> None:
    console = Console(force_terminal=True, width=120, color_system=None)  # bars if it could
    result = Experiment(
        "pool", _train_plain, arms=[Arm("a"), Arm("b")], repeats=2, store=False,
        executor="processes", workers=2,
        callbacks=[ConsoleLogger(every=100, console=console)],
    ).run()  # fmt: skip
    assert [r.status for r in result.runs] == ["completed"] * 4
    lines = [line.strip() for line in capfd.readouterr().out.splitlines()]
    assert "pool: 4 runs (2 arms x 2 repeats)" in lines  # a plain line: no bar that never moves
    ends = [line for line in lines if "  completed  " in line]  # from the parent alone
    assert sorted(line.split()[0] for line in ends) == ["a-r0", "a-r1", "b-r0", "b-r1"]
    assert [line.split("  ")[-1] for line in ends] == [f"[{k}/4 runs]" for k in range(1, 5)]
    assert "━" not in "".join(lines)
    assert any(line.startswith("pool: completed in ") for line in lines)


class EvalSteps(lab.Callback):
    """Keeps each in-loop eval's value by the step it ran at."""

    def __init__(self) -> None:
        self.values: dict[int, float] = {}

    def on_eval(self, state: Any, step_idx: int, eval_name: str, metrics: dict) -> None:
        self.values[step_idx] = metrics["loss"]


def test_a_step_line_shows_an_eval_value_with_the_step_it_was_measured_at() -> None:
    out = io.StringIO()
    evals = EvalSteps()
    logger = ConsoleLogger(every=1, metrics=("loss", "val/loss"), stream=out)
    Experiment("stale", lambda run: _loop(callbacks=(evals,)).fit(run), callbacks=[logger],
               store=False, strict=True).run()  # fmt: skip
    assert sorted(evals.values) == [2, 4]  # every=2, and each eval runs after its step's line
    shown: dict[int, str | None] = {}
    for line in out.getvalue().splitlines():
        step = re.match(r"base-r0  step (\d+)/5  loss=\S+(?:  val/loss=(\S+))?  ", line)
        if step:
            shown[int(step[1])] = step[2]
    assert shown == {
        1: None,
        2: None,  # the eval of step 2 has not run yet when step 2's line is printed
        3: f"{evals.values[2]:.4g}@2",
        4: f"{evals.values[2]:.4g}@2",  # never step 2's value as if it were step 4's
        5: f"{evals.values[4]:.4g}@4",
    }
    (end,) = [line for line in out.getvalue().splitlines() if "  completed  " in line]
    assert f"  val/loss={evals.values[4]:.4g}@4  " in end  # the final value, from step 4


# -- one summary, ranked by the metric the user named -----------------------------------------

ROOT = Path(__file__).resolve().parent.parent


def _python(code: str, cwd: Path) -> str:
    """`code` run as a script in `cwd`, as a user runs it; its output."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("LAB_STORE_URL", None)
    done = warm.run(
        [sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def _verdicts(out: str) -> list[str]:
    return [line for line in out.splitlines() if "best arm" in line or "best of" in line]


def _block(page: Path, after: str, lang: str = "python", nth: int = 0) -> str:
    """The `nth` code block in `lang` after the line `after` of a page."""
    text = page.read_text(encoding="utf-8")
    return re.findall(rf"```{lang}\n(.*?)```", text[text.index(after) :], re.S)[nth]


def test_the_readmes_first_tour_block_prints_one_summary_by_its_metric(tmp_path: Path) -> None:
    code = _block(ROOT / "README.md", "### An experiment")
    assert "ConsoleLogger(" in code  # the case at hand: a console logger is attached
    out = _python(code, tmp_path)
    verdicts = _verdicts(out)
    assert len(verdicts) == 1, out
    assert verdicts[0].startswith("best arm by val/loss (min): ")
    assert out.count("lr-sweep: 6 runs (6 completed)") == 1  # one summary, not two


def test_an_experiment_file_run_from_python_prints_one_summary_by_its_metric(
    tmp_path: Path,
) -> None:
    page = ROOT / "docs" / "experiment-files.md"
    (tmp_path / "train_lib.py").write_text(_block(page, "## An example"))
    (tmp_path / "lr-sweep.yaml").write_text(_block(page, "## An example", "yaml"))
    out = _python(_block(page, "## From Python"), tmp_path)
    verdicts = _verdicts(out)
    assert len(verdicts) == 1, out
    assert verdicts[0].startswith("best arm by val/loss (min): ")  # the file's summary.metric
    assert out.splitlines()[-1] == f"{verdicts[0].split()[5]} val/loss"  # what summarize says
    again = _python(  # the plain form: load_experiment(...).run(), nothing printed by hand
        "from lab.experiment_file import load_experiment\n"
        "load_experiment('lr-sweep.yaml', store='sqlite:///other.db').run()\n",
        tmp_path,
    )
    assert len(_verdicts(again)) == 1 and _verdicts(again)[0].startswith(
        "best arm by val/loss (min): "
    )
