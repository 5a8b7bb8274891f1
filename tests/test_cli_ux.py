"""What a newcomer meets first: how fast `lab` answers, its help, what it prints and when.

Every command runs as a real subprocess, on a real store.
"""

from __future__ import annotations

import os
import pty
import re
import select
import shlex
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from lab import Arm, Experiment
from lab._table import plural
from lab.experiment import ExperimentResult

ROOT = Path(__file__).resolve().parent.parent
LAB = Path(sys.executable).parent / "lab"


def lab_cli(
    *args: str, cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lab.cli", *args], capture_output=True, text=True, timeout=300,
        cwd=cwd, env={**os.environ, **(env or {})},
    )  # fmt: skip


def _loss(run) -> dict[str, float]:  # type: ignore[no-untyped-def]
    return {"loss": 0.5 + run.repeat, "lr": 0.1, "step_time": 0.01, "acc": 0.25 * run.repeat}


@pytest.fixture(scope="module")
def small_store(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A store with one experiment of 2 arms x 2 repeats (no torch training needed)."""
    folder = tmp_path_factory.mktemp("small")
    url = f"sqlite:///{folder / 'lab.db'}"
    Experiment("tiny", _loss, arms=[Arm("a"), Arm("b")], repeats=2, store=url,
               output_dir=folder / "runs").run()  # fmt: skip
    return url


# -------------------------------------------------------------------------------------------
# start-up: no torch for the commands that only read


READ_ONLY = [
    ["--help"],
    ["ls"],
    ["show", "tiny"],
    ["show", "tiny", "--run", "a-r0"],
    ["export", "tiny", "--to", "{tmp}/export"],
    ["db", "current"],
    ["db", "upgrade"],
    ["tag", "tiny", "+baseline", "--note", "first"],
    ["tag", "tiny", "a-r0", "+best"],
]


@pytest.mark.parametrize("argv", READ_ONLY, ids=lambda a: " ".join(a[:2]))
def test_read_only_commands_never_import_torch(
    argv: list[str], small_store: str, tmp_path: Path
) -> None:
    args = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    # Alembic too (~70 ms) is left to the command that changes a schema
    heavy = ("torch", "lab.experiment", "lab.loop", *(() if argv[0] == "db" else ("alembic",)))
    if args != ["--help"]:
        args += ["--store", small_store]
    code = textwrap.dedent(f"""
        import sys
        sys.argv = ["lab", *{args!r}]
        import lab.cli
        try:
            lab.cli.main()
        except SystemExit as exc:
            assert not exc.code, exc.code
        heavy = sorted(m for m in {heavy!r} if m in sys.modules)
        print("imported:", heavy)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == "imported: []"


def test_import_lab_is_lazy_and_every_public_name_still_imports() -> None:
    code = textwrap.dedent("""
        import sys
        import lab
        from lab import Store, LabError
        assert "torch" not in sys.modules, "import lab, Store, LabError pulled in torch"
        from lab import *  # noqa: F403
        import lab as again
        names = [n for n in again.__all__ if getattr(again, n).__name__ != n]
        print(sorted(again.__all__) == sorted(set(dir(again)) & set(again.__all__)), names,
              "torch" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True [] True"
    with pytest.raises(AttributeError, match="module 'lab' has no attribute 'Nope'"):
        import lab

        lab.Nope  # noqa: B018


# -------------------------------------------------------------------------------------------
# help text


def _help(*argv: str) -> str:
    out = lab_cli(*argv, "--help", env={"COLUMNS": "200"})
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_help_shows_the_store_default_and_flags_without_metavars() -> None:
    run = _help("run")
    store = next(line for line in run.splitlines() if "--store" in line)
    assert store.split() == [
        "--store", "URL", "Store", "URL", "[default:", "$LAB_STORE_URL,", "else", "sqlite:///lab.db]"
    ]  # fmt: skip
    for flag in ("--dry-run", "--all-metrics", "--help"):
        line = next(line for line in run.splitlines() if line.strip().startswith(flag))
        assert line.split()[1][0].isupper(), line  # help text follows: no "<bool>" in between
    assert "<bool>" not in run and "<bool>" not in _help("quickstart")
    quick = _help("quickstart")
    assert re.search(r"--steps N +Optimizer steps per run +\[default: 300; x>=1\]", quick)
    assert re.search(r"--notebook +Also write the analysis notebook", quick)
    assert "[default: $LAB_STORE_URL, else sqlite:///lab.db]" in _help("ls")
    assert "[default: $LAB_STORE_URL, else sqlite:///lab.db]" in _help("db", "upgrade")


def test_plural_is_right_for_one() -> None:
    assert [plural(n, "run") for n in (0, 1, 2)] == ["0 runs", "1 run", "2 runs"]
    one = Experiment("one", lambda run: {"loss": 1.0}, store=False).run()
    assert str(one.summary()).splitlines()[0] == "one: 1 run (1 completed)"


def test_show_says_1_run(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'one.db'}"
    Experiment("one", lambda run: {"loss": 1.0}, store=url, output_dir=tmp_path / "r").run()
    out = lab_cli("show", "one", "--store", url)
    assert out.stdout.splitlines()[0] == "one: completed, 1 run, seed 0"


# -------------------------------------------------------------------------------------------
# lab show: duration, host, and one run's traceback


def _boom(run) -> dict[str, float]:  # type: ignore[no-untyped-def]
    if run.repeat == 1:
        raise ValueError("boom at repeat 1")
    return {"loss": 1.0}


def test_show_has_duration_and_host_and_prints_a_failed_runs_traceback(tmp_path: Path) -> None:
    import socket

    url = f"sqlite:///{tmp_path / 'fail.db'}"
    Experiment("fails", _boom, repeats=2, store=url, output_dir=tmp_path / "r").run()
    out = lab_cli("show", "fails", "--store", url)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    start = lines.index("runs") + 1
    header, *runs = lines[start : lines.index("", start)]  # the provenance section follows
    assert header.split() == [
        "run", "arm", "repeat", "seed", "status", "step", "loss", "val/loss", "duration", "host",
        "tags", "error",
    ]  # fmt: skip
    assert [r.split()[0] for r in runs] == ["base-r0", "base-r1"]
    host = socket.gethostname()
    at = header.index("duration")
    assert re.fullmatch(r"\d+\.\ds", runs[0][at:].split()[0])
    assert runs[0][header.index("host") :].split()[0] == host
    assert runs[1].endswith("ValueError: boom at repeat 1")

    out = lab_cli("show", "fails", "--run", "base-r1", "--store", url)
    assert out.returncode == 0, out.stderr
    text = out.stdout.splitlines()
    assert text[0] == "fails / base-r1: failed"
    assert text[1] == "arm base, repeat 1, stage 0, seed 1, step -"
    assert text[2].startswith(f"host {host}, pid ") and ", duration " in text[2]
    assert text[3] == "error: ValueError: boom at repeat 1"
    assert text[5] == "Traceback (most recent call last):"
    assert text[-2].strip() == 'raise ValueError("boom at repeat 1")'
    assert text[-1] == "ValueError: boom at repeat 1"

    out = lab_cli("show", "fails", "--run", "base-r7", "--store", url)
    assert out.returncode == 1
    assert out.stderr == ("error: no run 'base-r7' in experiment 'fails'; runs: base-r0, base-r1\n")


# -------------------------------------------------------------------------------------------
# the summary: once, ranked as asked, without routine rows unless asked


def test_summary_text_leaves_out_routine_metrics_unless_asked() -> None:
    result = Experiment("routine", _loss, repeats=2, store=False).run()
    text = str(result.summary("acc", mode="max"))
    shown = [line.split()[1] for line in text.splitlines()[2:4]]
    assert shown == ["acc", "loss"]
    assert "not shown: lr, step_time (all_metrics=True, or --all-metrics, shows them)" in text
    full = result.summary("acc", mode="max", all_metrics=True)
    assert [line.split()[1] for line in str(full).splitlines()[2:6]] == [
        "acc", "loss", "lr", "step_time",
    ]  # fmt: skip
    assert "not shown" not in str(full)
    assert full.format(all_metrics=False) == text
    # the data keeps every metric either way; a metric asked for by name is always shown
    assert [r.metric for r in result.summary().rows] == ["acc", "loss", "lr", "step_time"]
    assert "base  lr " in str(result.summary("lr"))


# -------------------------------------------------------------------------------------------
# Ctrl-C: what finished, no best claim from unfinished arms, the command that continues


def _partial(name: str, error: str | None, runs: dict[str, list[str]]) -> ExperimentResult:
    """A result as an interrupted experiment leaves it: per arm, its runs' statuses."""
    from lab.experiment import ArmResult, RunResult

    arms = []
    for arm, statuses in runs.items():
        arm_runs = [
            RunResult(f"{arm}-r{i}", arm, i, 0, i, s, {"loss": 1.0 + i} if s != "failed" else {},
                      1.0, error=None if s != "failed" else "interrupted (KeyboardInterrupt)")
            for i, s in enumerate(statuses)
        ]  # fmt: skip
        arms.append(ArmResult(arm, {}, arm_runs, planned=3))
    return ExperimentResult(name, arms, error=error, planned=3 * len(runs))


def test_an_interrupted_summary_ranks_only_arms_that_finished() -> None:
    one = _partial("x", "KeyboardInterrupt", {"a": ["completed"] * 3, "b": ["failed"], "c": []})
    lines = str(one.summary()).splitlines()
    assert lines[0] == "x: interrupted; 3 of 9 runs finished (3 completed, 1 failed)"
    assert lines[-1] == "no best arm: not every arm finished its runs (unfinished: b, c)"
    assert [line.split()[:4] for line in lines[2:]][:3] == [
        ["a", "loss", "3", "2"], ["b", "loss", "0", "-"], ["c", "loss", "0", "-"],
    ]  # fmt: skip
    assert "nan" not in "\n".join(lines)
    two = _partial("y", "KeyboardInterrupt", {"a": ["completed"] * 3, "b": ["completed"] * 3,
                                              "c": ["completed", "failed"]})  # fmt: skip
    summary = two.summary()
    assert summary.unfinished_arms == ["c"] and summary.best_arm == "a"
    assert str(summary).splitlines()[-1] == (
        "best of the finished arms by loss (min): a (2), ahead of b by 0; not ranked, unfinished: c"
    )
    # not interrupted: every arm is ranked as before
    done = _partial("z", None, {"a": ["completed"] * 3, "b": ["completed", "completed"]})
    assert str(done.summary()).splitlines()[-1].startswith("best arm by loss (min): b")


INTERRUPTING_LIB = """
import os, signal, time
from pathlib import Path

def train(run):
    marker = Path(os.environ["MARKER"])
    if run.run_key == "b-r0" and not marker.exists():
        marker.write_text("interrupted once")
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C, as a terminal sends it
        time.sleep(30)
    return {"loss": 1.0 + run.repeat + (run.arm == "b"), "lr": 0.1}
"""


@pytest.mark.slow
@pytest.mark.serial
def test_ctrl_c_says_what_finished_and_the_command_that_continues(tmp_path: Path) -> None:
    (tmp_path / "intr_lib.py").write_text(INTERRUPTING_LIB)
    file = tmp_path / "intr.yaml"
    file.write_text("name: intr\ntrain: intr_lib:train\narms: [{name: a}, {name: b}]\n"
                    "repeats: 2\nsummary: {metric: loss}\n")  # fmt: skip
    url = f"sqlite:///{tmp_path / 'lab.db'}"
    env = {**os.environ, "MARKER": str(tmp_path / "marker")}
    first = subprocess.run([str(LAB), "run", str(file), "--store", url], capture_output=True,
                           text=True, timeout=300, cwd=tmp_path, env=env)  # fmt: skip
    assert first.returncode == 130, first.stderr
    lines = first.stdout.splitlines()
    assert lines[0] == "intr: interrupted; 2 of 4 runs finished (2 completed, 1 failed)"
    assert lines[-1] == "no best arm: not every arm finished its runs (unfinished: b)"
    assert "best arm by" not in first.stdout and "nan" not in first.stdout
    again = f"lab run {file} --store {url}"
    assert first.stderr.splitlines()[-1] == (
        "interrupted: 2 of 4 runs finished; the same command continues it (finished runs are "
        f"kept, the others run again): {again}"
    )
    path = f"{LAB.parent}{os.pathsep}{env['PATH']}"  # `lab` as the message names it
    second = subprocess.run(again.split(), capture_output=True, text=True, timeout=300,
                            cwd=tmp_path, env={**env, "PATH": path})  # fmt: skip
    assert second.returncode == 0, second.stderr
    assert second.stdout.splitlines()[0] == "intr: 4 runs (4 completed)"
    assert second.stdout.splitlines()[-1] == "best arm by loss (min): a (1.5), ahead of b by 1"
    assert second.stdout.count("best arm") == 1


HELD_LIB = """
import os, time
from pathlib import Path

def train(run):
    out = Path(os.environ["OUT"])
    with open(out / "trained.txt", "a") as fh:
        fh.write(run.run_key + "\\n")
    if run.run_key == os.environ.get("HOLD_AT"):
        (out / "holding").write_text(run.run_key)
        time.sleep(120)  # until the test sends its signal
    return {"loss": 1.0 + run.repeat + (run.arm == "b") * run.config.lr}
"""


def _held_file(tmp_path: Path) -> Path:
    """An experiment file of 2 arms x 2 repeats whose train function waits at a run."""
    (tmp_path / "held_lib.py").write_text(HELD_LIB)
    (tmp_path / "held_config.py").write_text(
        "import pydantic\n\nclass Config(pydantic.BaseModel):\n    lr: float = 0.1\n"
    )
    file = tmp_path / "sweep.yaml"
    file.write_text(
        "name: sweep\ntrain: held_lib:train\nconfig: held_config:Config\n"
        "arms: [{name: a}, {name: b}]\nrepeats: 2\nsummary: {metric: loss}\n"
    )
    return file


def _interrupted(argv: list[str], tmp_path: Path, hold_at: str, sig: int) -> tuple[int, str, str]:
    """Run `argv` until it trains `hold_at`, send it `sig` from outside (as a terminal's
    Ctrl-C or a scheduler's SIGTERM does), and return its exit status, stdout and stderr."""
    env = {**os.environ, "OUT": str(tmp_path), "HOLD_AT": hold_at}
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=tmp_path, env=env)  # fmt: skip
    deadline = time.monotonic() + 120
    while not (tmp_path / "holding").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert (tmp_path / "holding").exists(), proc.communicate(timeout=60)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    (tmp_path / "holding").unlink()
    return proc.returncode, out, err


@pytest.mark.slow
@pytest.mark.serial
@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_the_continue_line_is_the_whole_command_and_continues_the_same_experiment(
    sig: str, tmp_path: Path
) -> None:
    file = _held_file(tmp_path)
    folder = tmp_path / "my store"  # a space: the line must quote it
    folder.mkdir()
    url = f"sqlite:///{folder / 'lab.db'}"
    args = ["run", str(file), "name=sweep-x", "base_config.lr=0.5", "notes=a second try",
            "--store", url, "--all-metrics"]  # fmt: skip
    code, out, err = _interrupted([str(LAB), *args], tmp_path, "b-r0", getattr(signal, sig))
    assert code == 130, err
    assert out.splitlines()[0] == (
        "sweep-x: interrupted; 2 of 4 runs finished (2 completed, 1 failed)"
    )
    again = shlex.join(["lab", *args])
    assert err.splitlines()[-1] == (
        "interrupted: 2 of 4 runs finished; the same command continues it (finished runs are "
        f"kept, the others run again): {again}"
    )
    assert "name=sweep-x base_config.lr=0.5 'notes=a second try'" in again
    assert f"--store 'sqlite:///{folder}/lab.db' --all-metrics" in again
    # the printed line, run as printed: the same experiment, its finished runs kept
    path = f"{LAB.parent}{os.pathsep}{os.environ['PATH']}"
    second = subprocess.run(shlex.split(err.splitlines()[-1].split(": ", 2)[2]),
                            capture_output=True, text=True, timeout=300, cwd=tmp_path,
                            env={**os.environ, "OUT": str(tmp_path), "PATH": path})  # fmt: skip
    assert second.returncode == 0, second.stderr
    assert second.stdout.splitlines()[0] == "sweep-x: 4 runs (4 completed)"
    assert second.stdout.splitlines()[-1] == "best arm by loss (min): a (1.5), ahead of b by 0.5"
    trained = (tmp_path / "trained.txt").read_text().split()
    assert trained == ["a-r0", "a-r1", "b-r0", "b-r0", "b-r1"]  # a's runs were not trained twice
    con = sqlite3.connect(folder / "lab.db")
    try:
        assert con.execute("SELECT name, notes FROM experiments").fetchall() == [
            ("sweep-x", "a second try")
        ]
    finally:
        con.close()


def test_a_dry_run_names_the_whole_command_that_runs_it(tmp_path: Path) -> None:
    file = _held_file(tmp_path)
    url = f"sqlite:///{tmp_path / 'lab.db'}"
    out = lab_cli("run", str(file), "name=sweep x", "--store", url, "--fresh", "--dry-run")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == (
        f"dry run: nothing ran; to run it: lab run {file} 'name=sweep x' --store {url} --fresh"
    )


@pytest.mark.slow
@pytest.mark.serial
def test_an_interrupt_before_any_run_finished_prints_one_line(tmp_path: Path) -> None:
    file = _held_file(tmp_path)
    url = f"sqlite:///{tmp_path / 'lab.db'}"
    code, out, err = _interrupted([str(LAB), "run", str(file), "--store", url], tmp_path,
                                  "a-r0", signal.SIGINT)  # fmt: skip
    assert code == 130, err
    assert out == ""  # no table of arms that have no finished run
    assert err.splitlines()[-1] == (
        "interrupted: none of 4 runs finished; the same command continues it (finished runs "
        f"are kept, the others run again): lab run {file} --store {url}"
    )


# -------------------------------------------------------------------------------------------
# progress on a terminal


def _on_a_terminal(argv: list[str], cwd: Path, env: dict[str, str]) -> tuple[int, str]:
    """Run `argv` with its stdout on a pseudo-terminal, as a user at a shell runs it."""
    leader, follower = pty.openpty()
    proc = subprocess.Popen(argv, stdout=follower, stderr=follower, stdin=subprocess.DEVNULL,
                            cwd=cwd, env={**env, "COLUMNS": "160", "TERM": "xterm"})  # fmt: skip
    os.close(follower)
    chunks = []
    while True:
        ready, _, _ = select.select([leader], [], [], 300)
        if not ready:
            proc.kill()
            break
        try:
            data = os.read(leader, 65536)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(leader)
    text = b"".join(chunks).decode(errors="replace")
    return proc.wait(timeout=60), re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text)


@pytest.mark.slow
def test_quickstart_on_a_terminal_shows_progress_and_one_summary(tmp_path: Path) -> None:
    env = {**os.environ, "LAB_STORE_URL": f"sqlite:///{tmp_path / 'lab.db'}"}
    code, text = _on_a_terminal([str(LAB), "quickstart", "--steps", "20"], tmp_path, env)
    assert code == 0, text
    for k in range(1, 7):  # each run's end, counted against the total
        assert re.search(rf"sgd-lr0\.0?1-r\d  completed  loss=\S+  \S+  \[{k}/6 runs\]", text), k
    assert text.count("best arm by val/loss (min)") == 1
    assert text.count("quickstart: 6 runs (6 completed)") == 1


# -------------------------------------------------------------------------------------------
# what quickstart prints runs as printed


@pytest.mark.slow
def test_every_snippet_quickstart_prints_runs_right_after_it(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "LAB_STORE_URL"}
    out = subprocess.run([str(LAB), "quickstart", "--steps", "20"], capture_output=True,
                         text=True, timeout=300, cwd=tmp_path, env=env)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("best arm by val/loss (min)") == 1
    tail = out.stdout.split("\nquickstart: recorded in sqlite:///lab.db. Next:\n")[1]
    snippets = [line[2:] for line in tail.splitlines() if line.startswith("  ")]
    commands = [s for s in snippets if s.startswith("lab ")]
    python = [s for s in snippets if not s.startswith("lab ")]
    # the notebook's command repeats the settings, so it reuses the runs instead of refusing
    assert commands == ["lab ls", "lab show quickstart", "lab quickstart --steps 20 --notebook"]
    assert len(python) == 4 and python[0] == "import lab.inspect"
    for command in commands:
        ran = subprocess.run([str(LAB), *command.split()[1:]], capture_output=True, text=True,
                             timeout=300, cwd=tmp_path, env=env)  # fmt: skip
        assert ran.returncode == 0, (command, ran.stderr)
    # `lab quickstart --notebook` wrote the notebook it names, as shipped, and never overwrites
    shipped = (ROOT / "notebooks" / "quickstart.ipynb").read_text(encoding="utf-8")
    assert (tmp_path / "quickstart.ipynb").read_text(encoding="utf-8") == shipped
    again = subprocess.run([str(LAB), "quickstart", "--notebook"], capture_output=True,
                           text=True, timeout=300, cwd=tmp_path, env=env)  # fmt: skip
    assert again.returncode == 1 and again.stdout == ""
    assert again.stderr == (
        "error: quickstart.ipynb exists; remove it, or write the notebook elsewhere with "
        "--notebook-to PATH\n"
    )
    elsewhere = subprocess.run([str(LAB), "quickstart", "--steps", "20", "--notebook-to",
                                "nb/q.ipynb"],
                               capture_output=True, text=True, timeout=300, cwd=tmp_path,
                               env=env)  # fmt: skip
    assert elsewhere.returncode == 0, elsewhere.stderr
    assert elsewhere.stdout.splitlines()[-1] == "  jupyter lab nb/q.ipynb"
    assert (tmp_path / "nb" / "q.ipynb").read_text(encoding="utf-8") == shipped
    assert "quickstart: 6 runs (6 completed)" in elsewhere.stdout  # finished runs were kept
    # The Python lines, in a fresh interpreter of the same environment, without pandas:
    # `lab` does not depend on it, so what it prints must not need it.
    script = "import sys\nsys.modules['pandas'] = None\n" + "\n".join(python)
    ran = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=300, cwd=tmp_path, env=env)  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    assert "sgd-lr0.1" in ran.stdout and "example_id" in ran.stdout
    blocked = subprocess.run([sys.executable, "-c", "import sys\nsys.modules['pandas'] = None\n"
                              "import lab.inspect\nlab.inspect.connect('sqlite:///lab.db')"
                              ".sql('select 1').df()"], capture_output=True, text=True,
                             timeout=300, cwd=tmp_path, env=env)  # fmt: skip
    assert blocked.returncode != 0  # the check above would catch a snippet that needs pandas
    # The notebook's first cell, from a kernel started in notebooks/ below, without pandas:
    # it names the store it found above, and says what its .df() tables need.
    (tmp_path / "notebooks").mkdir()
    cell = ("import sys\nsys.modules['pandas'] = None\nfrom lab.demo import open_quickstart\n"
            "print(open_quickstart().sql('select count(*) from runs').fetchone())")  # fmt: skip
    ran = subprocess.run([sys.executable, "-c", cell], capture_output=True, text=True,
                         timeout=300, cwd=tmp_path / "notebooks", env=env)  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.splitlines() == [
        f"store: sqlite:///{tmp_path / 'lab.db'} (in a folder above)",
        "the cells below show tables with .df(), which needs pandas: pip install pandas",
        "(6,)",
    ]


POOL_SCRIPT = """
from lab import Arm, ConsoleLogger, Experiment


def train(run):
    return {"loss": 1.0 + run.repeat}


if __name__ == "__main__":
    Experiment("pool", train, arms=[Arm("a"), Arm("b")], repeats=2, store=False,
               executor="processes", workers=2, callbacks=[ConsoleLogger(summary=False)]).run()
"""


@pytest.mark.slow
def test_a_process_pool_shows_runs_done_out_of_total_as_they_end(tmp_path: Path) -> None:
    (tmp_path / "pool_main.py").write_text(POOL_SCRIPT)
    out = subprocess.run([sys.executable, "pool_main.py"], capture_output=True, text=True,
                         timeout=300, cwd=tmp_path)  # fmt: skip
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "pool: 4 runs (2 arms x 2 repeats)"
    ends = [line for line in lines if "  completed  " in line]
    assert len(ends) == 4  # one line per run, from the parent: none from the workers
    assert [line.split("  ")[-1] for line in ends] == [f"[{k}/4 runs]" for k in range(1, 5)]
    assert sorted(line.split()[0] for line in ends) == ["a-r0", "a-r1", "b-r0", "b-r1"]
    assert lines[-1].startswith("pool: completed in ")
