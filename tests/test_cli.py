"""Each `lab` command, run as a real subprocess, on a real store."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

import lab.inspect
from lab.store import Store
from lab.store.migrations import head_revision


def lab_cli(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lab.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
        cwd=cwd,
    )


@pytest.fixture(scope="module")
def demo_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One quickstart run (short), shared by the read-only command tests. It runs in its
    own folder: a module's fixture comes before the per-test folder (`_isolated_cwd`), and
    what the checkout holds (a ./quickstart.ipynb a user wrote) changes what it prints."""
    folder = tmp_path_factory.mktemp("demo")
    db = folder / "lab.db"
    out = lab_cli(
        "quickstart", "--store", f"sqlite:///{db}", "--output-dir", str(folder / "runs"),
        "--steps", "60", cwd=folder,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    (folder / "quickstart.out").write_text(out.stdout)
    assert out.stdout.count("best arm by val/loss (min)") == 1
    assert "sgd-lr0.01" in out.stdout and "sgd-lr0.1" in out.stdout
    # it ends with where to go next: commands, queries and the notebook, each runnable as shown
    # (tests/test_cli_ux.py runs them)
    tail = out.stdout.strip().splitlines()[-7:]
    assert tail[:3] == [
        "The final validation loss per arm, and the holdout benchmark's predictions:",
        "  import lab.inspect",
        f'  con = lab.inspect.connect("sqlite:///{db}")',
    ]
    assert tail[-2:] == [
        "The walk-through of arms, curves and predictions, as ./quickstart.ipynb:",
        f"  lab quickstart --store sqlite:///{db} --output-dir {folder / 'runs'} --steps 60 "
        "--notebook",
    ]
    return db


def test_quickstart_records_two_arms_times_three_repeats(demo_db: Path) -> None:
    con = sqlite3.connect(demo_db)
    assert con.execute("select count(*) from arms").fetchone() == (2,)
    assert con.execute("select status, count(*) from runs group by status").fetchall() == [
        ("completed", 6)
    ]
    # 60 steps x 4 step metrics x 6 runs, plus val/loss at step 50 and the holdout
    # benchmark's holdout/acc and holdout/mse at step 60 of each run
    assert con.execute("select count(*) from metrics").fetchone() == (60 * 4 * 6 + 6 + 2 * 6,)


def test_quickstart_records_a_benchmark_with_breakdowns_and_predictions(demo_db: Path) -> None:
    con = lab.inspect.connect(f"sqlite:///{demo_db}")
    evals = con.sql("select name, step, count(*) from evals group by all order by all")
    assert evals.fetchall() == [("holdout", None, 6), ("val", 50, 6)]  # after training: NULL
    (slices,) = con.sql(
        "select distinct json_keys(breakdowns) from evals where name = 'holdout'"
    ).fetchone()
    assert sorted(slices) == ["large", "small"]
    assert con.sql("select count(*) from evals where seconds > 0").fetchone() == (12,)
    # 64 fixed examples per run, each scored 0 or 1, with its slice in the extras
    assert con.sql("select count(*), count(distinct example_id) from predictions").fetchone() == (
        6 * 64,
        64,
    )
    scores = con.sql("select distinct score from predictions order by 1").fetchall()
    assert scores == [(0.0,), (1.0,)]
    per_slice = con.sql(
        "select extras->>'slice', count(*) from predictions group by 1 order by 1"
    ).fetchall()
    assert per_slice == [("large", 6 * 32), ("small", 6 * 32)]


def test_ls_lists_experiments_with_counts(demo_db: Path) -> None:
    out = lab_cli("ls", "--store", f"sqlite:///{demo_db}")
    assert out.returncode == 0, out.stderr
    header, row = out.stdout.strip().splitlines()
    assert header.split()[:5] == ["experiment", "status", "arms", "repeats", "runs"]
    assert row.split()[:7] == ["quickstart", "completed", "2", "3", "6", "6", "completed"]


def test_ls_reads_lab_store_url(demo_db: Path) -> None:
    out = lab_cli("ls", env={"LAB_STORE_URL": f"sqlite:///{demo_db}"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[1].split()[:2] == ["quickstart", "completed"]


def test_quickstart_reads_lab_store_url(tmp_path: Path) -> None:
    db = tmp_path / "elsewhere.db"
    out = lab_cli(
        "quickstart", "--steps", "50", "--output-dir", str(tmp_path / "runs"),
        env={"LAB_STORE_URL": f"sqlite:///{db}"},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert f"quickstart: recorded in sqlite:///{db}. Next:" in out.stdout
    assert not (Path.cwd() / "lab.db").exists()
    con = sqlite3.connect(db)
    assert con.execute("SELECT count(*) FROM runs").fetchone() == (6,)
    con.close()


def test_ls_on_an_empty_store_says_what_to_do(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'empty.db'}"
    Store(url).close()  # a store with lab's schema and no experiment
    out = lab_cli("ls", "--store", url)
    assert out.returncode == 0
    assert out.stdout.strip() == "no experiments yet; try: lab quickstart"


def test_show_prints_arms_runs_and_final_metrics(demo_db: Path) -> None:
    out = lab_cli("show", "quickstart", "--store", f"sqlite:///{demo_db}")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "quickstart: completed, 6 runs, seed 0"
    start = lines.index("runs") + 2
    runs = lines[start : lines.index("", start)]  # the table ends at a blank line
    assert [r.split()[0] for r in runs] == [
        f"{arm}-r{i}" for arm in ("sgd-lr0.01", "sgd-lr0.1") for i in range(3)
    ]
    store = Store(f"sqlite:///{demo_db}")
    try:
        first = store.get_experiment("quickstart")["runs"][0]
    finally:
        store.close()
    assert first["step"] == 60  # the newest step, read from summaries
    assert runs[0].split()[5:7] == ["60", f"{first['summary']['loss']:.4g}"]
    # then where the runs came from: one line, as every run shares the experiment's provenance
    at = lines.index(
        "provenance (full record: lab.inspect.provenance; diff: <run folder>/git.diff)"
    )
    assert lines[at + 1].split() == [
        "commit",
        "dirty",
        "python",
        "torch",
        "host",
        "command",
        "runs",
    ]
    assert lines[at + 2].split()[-2:] == ["all", "6"] and len(lines) == at + 3


def test_show_unknown_experiment_is_one_line(demo_db: Path) -> None:
    out = lab_cli("show", "nope", "--store", f"sqlite:///{demo_db}")
    assert out.returncode == 1
    assert out.stderr.strip() == "error: no experiment named 'nope' in the store; known: quickstart"


def test_export_writes_one_parquet_file_per_table(demo_db: Path, tmp_path: Path) -> None:
    folder = tmp_path / "shared"
    out = lab_cli("export", "quickstart", "--to", str(folder), "--store", f"sqlite:///{demo_db}")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split() == ["table", "rows"]
    counts = {line.split()[0]: int(line.split()[1]) for line in lines[1:10]}
    assert counts == {
        "experiments": 1, "arms": 2, "groups": 2, "runs": 6, "metrics": 60 * 4 * 6 + 6 + 2 * 6,
        "summaries": 6 * 7, "evals": 12, "predictions": 6 * 64, "checkpoints": 0,
    }  # fmt: skip
    assert (
        lines[-1]
        == f'Wrote {folder}/<table>.parquet. Read it back: lab.inspect.connect("{folder}")'
    )
    con = lab.inspect.connect(folder)
    assert con.sql("select count(*) from predictions").fetchone() == (6 * 64,)


def test_export_of_an_unknown_experiment_is_one_line(demo_db: Path, tmp_path: Path) -> None:
    out = lab_cli("export", "nope", "--to", str(tmp_path / "x"), "--store", f"sqlite:///{demo_db}")
    assert out.returncode == 1
    assert out.stdout == ""
    assert out.stderr == "error: no experiment named 'nope' in the store; known: quickstart\n"
    assert not (tmp_path / "x").exists()


def test_db_current_and_upgrade(tmp_path: Path) -> None:
    db = tmp_path / "fresh.db"
    url = f"sqlite:///{db}"
    head = head_revision()
    out = lab_cli("db", "current", "--store", url)  # reads only: never creates the file
    assert (out.returncode, out.stdout) == (1, "")
    assert out.stderr.startswith(f"error: no store at {db} ") and not db.exists()
    db.touch()  # an empty file is an empty SQLite database
    out = lab_cli("db", "current", "--store", url)
    assert out.returncode == 0
    assert out.stdout.strip() == f"empty (no schema yet; head is {head}; run: lab db upgrade)"
    assert db.stat().st_size == 0
    out = lab_cli("db", "upgrade", "--store", url)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"upgraded {url} from empty to {head}"
    assert lab_cli("db", "current", "--store", url).stdout.strip() == f"{head} (head)"
    out = lab_cli("db", "upgrade", "--store", url)
    assert out.stdout.strip() == f"{url} is already at {head} (head)"


def test_db_current_on_a_newer_schema(tmp_path: Path) -> None:
    db = tmp_path / "newer.db"
    Store(f"sqlite:///{db}").close()
    con = sqlite3.connect(db)
    con.execute("update alembic_version set version_num = 'fffffffffff'")
    con.commit()
    con.close()
    out = lab_cli("db", "current", "--store", f"sqlite:///{db}")
    assert out.returncode == 0
    assert "newer than this lab" in out.stdout and "pip install -U lab" in out.stdout
    out = lab_cli("ls", "--store", f"sqlite:///{db}")
    assert out.returncode == 1
    assert out.stderr.count("\n") == 1 and "pip install -U lab" in out.stderr


@pytest.mark.parametrize(
    ("url", "needle"),
    [
        ("mysql://x/y", "store URL scheme 'mysql' is not supported"),
        ("not a url", "is not a URL"),
        ("postgresql://postgres:lab@127.0.0.1:1/x", "cannot reach the store"),
    ],
)
def test_bad_store_urls_are_one_line(url: str, needle: str) -> None:
    out = lab_cli("ls", "--store", url)
    assert out.returncode == 1
    assert out.stdout == ""
    assert out.stderr.startswith("error: ") and needle in out.stderr
    assert out.stderr.count("\n") == 1, out.stderr


def test_console_script_is_installed() -> None:
    script = Path(sys.executable).parent / "lab"
    out = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    commands = out.stdout.split("Commands:\n")[1].splitlines()
    listed = {line.split()[0] for line in commands if line.startswith("  ")}
    assert {"quickstart", "ls", "show", "export", "db"} <= listed, out.stdout


def test_show_lists_callback_errors_recorded_on_runs(tmp_path: Path) -> None:
    from lab import Callback, Experiment

    class Flaky(Callback):
        def on_run_start(self, ctx):  # type: ignore[no-untyped-def]
            if ctx.repeat == 1:
                raise ValueError("bad sink")

    url = f"sqlite:///{tmp_path / 'cb.db'}"
    Experiment(
        "flaky", lambda run: {"loss": 1.0}, repeats=2, callbacks=[Flaky()], store=url,
        strict=False, output_dir=tmp_path / "runs",
    ).run()  # fmt: skip
    out = lab_cli("show", "flaky", "--store", url)
    assert out.returncode == 0, out.stderr
    tail = out.stdout.split("callback errors (the runs went on)\n")[1].splitlines()
    assert tail[0].split() == ["run", "callback", "hook", "error"]
    assert tail[1].split() == ["base-r1", "Flaky", "on_run_start", "ValueError:", "bad", "sink"]
    assert len(tail) == 2


def test_benchmark_metrics_are_final_metrics_everywhere(store_url: str, tmp_path: Path) -> None:
    """holdout/acc (a post-training benchmark) reads the same in the experiment's own
    summary, `lab show`, the final_metrics view and lab.inspect.summary."""
    from lab._table import fmt
    from lab.demo import quickstart

    result = quickstart(store_url, output_dir=tmp_path / "runs", steps=20)
    mine = result.summary("holdout/acc", "max", keys=["holdout/acc"])

    out = lab_cli("show", "quickstart", "--store", store_url, "--metrics", "holdout/acc")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    header = lines.index("runs") + 1
    assert lines[header].split()[:7] == ["run", "arm", "repeat", "seed", "status", "step",
                                         "holdout/acc"]  # fmt: skip
    shown = {line.split()[0]: line.split()[6] for line in lines[header + 1 : header + 7]}
    assert shown == {r.run_key: fmt(r.metrics["holdout/acc"]) for r in result.runs}

    con = lab.inspect.connect(store_url)
    final = dict(
        con.sql(
            "SELECT run_key, value FROM final_metrics WHERE experiment = 'quickstart' "
            "AND key = 'holdout/acc' ORDER BY run_key"
        ).fetchall()
    )
    assert final == {r.run_key: r.metrics["holdout/acc"] for r in result.runs}
    steps = con.sql("SELECT DISTINCT step FROM final_metrics WHERE key = 'holdout/acc'")
    assert steps.fetchall() == [(20,)]  # at each run's last step

    rel = lab.inspect.summary(con, "quickstart", "holdout/acc", mode="max")
    got = {r[0]: r for r in rel.fetchall()}
    assert sorted(got) == ["sgd-lr0.01", "sgd-lr0.1"]
    for arm, (_, n, mean, std, low, high, _rank, is_best, _margin) in got.items():
        row = mine.row(arm, "holdout/acc")
        assert (n, mean, std, low, high) == (row.n, row.mean, row.std, row.ci_low, row.ci_high)
        assert is_best == (arm == mine.best_arm)


def test_quickstart_prints_the_holdout_acc_that_lab_inspect_reads(demo_db: Path) -> None:
    """The summary `lab quickstart` prints for holdout/acc (bounded to [0, 1]) is what
    lab.inspect.summary computes from the store."""
    from lab._table import fmt

    printed = {
        line.split()[0]: line.split(maxsplit=5)[2:]
        for line in (demo_db.parent / "quickstart.out").read_text().splitlines()
        if len(line.split()) > 1 and line.split()[1] == "holdout/acc"
    }
    con = lab.inspect.connect(f"sqlite:///{demo_db}")
    rel = lab.inspect.summary(con, "quickstart", "holdout/acc", "max", bounds=(0, 1))
    expected = {
        arm: [fmt(n), fmt(mean), fmt(std), f"[{fmt(low)}, {fmt(high)}]"]
        for arm, n, mean, std, low, high, *_ in rel.fetchall()
    }
    assert printed == expected
    assert all(0 <= low <= high <= 1 for *_, low, high, _r, _b, _m in rel.fetchall())


#: How pip records where lab came from (direct_url.json), and the line that then adds an
#: extra: a checkout installed editable (the README's venv), a folder, the package index.
INSTALLS = {
    "editable": ('{"url": "file:///home/me/my%20lab", "dir_info": {"editable": true}}',
                 "-e '/home/me/my lab[server]'"),
    "folder": ('{"url": "file:///home/me/lab", "dir_info": {}}', "'/home/me/lab[server]'"),
    "index": (None, "'lab[server]'"),
}  # fmt: skip


@pytest.mark.parametrize("install", sorted(INSTALLS))
@pytest.mark.parametrize(("command", "who"), [("ui", "lab ui"), ("serve", "lab serve")])
def test_without_the_server_extra_the_command_names_itself_and_the_pip_line(
    tmp_path: Path, command: str, who: str, install: str
) -> None:
    """`lab ui` and `lab serve` without FastAPI installed: one line, naming the command the
    user typed, and the pip command that adds the extra to this Python, from where lab was
    installed (`lab[server]` from the package index is another project for a checkout)."""
    direct_url, target = INSTALLS[install]
    info = tmp_path / "site" / "lab-0.1.0.dist-info"  # found first: what pip recorded
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: lab\nVersion: 0.1.0\n")
    if direct_url is not None:
        (info / "direct_url.json").write_text(direct_url)
    code = "import sys; sys.modules['fastapi'] = None; from lab.cli import main; main()"
    path = os.pathsep.join([str(tmp_path / "site"), str(Path(__file__).resolve().parents[1])])
    done = subprocess.run(
        [sys.executable, "-c", code, command, "--store", f"sqlite:///{tmp_path / 'lab.db'}"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": path},
    )  # fmt: skip
    assert done.returncode != 0
    assert done.stderr.strip().splitlines() == [
        f"error: {who} needs the fastapi package: {sys.executable} -m pip install {target}"
    ]
