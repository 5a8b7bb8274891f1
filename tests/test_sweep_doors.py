"""What every door shows of a sweep: the race table (`lab.sweeps.report.race_table`) from a
real raced experiment, the sampled arms and pruned runs of a recorded sweep, read back
through `Store`, the `Reader` that ``lab show`` opens, `lab.inspect` and the ``lab show`` and
``lab ls`` commands, on SQLite and PostgreSQL, with exact values.

The race's values are set (as in tests/test_race_experiment.py): ``c`` (mean 10) is far
worse than ``a`` and ``b`` (means 0 and 0.001, seed noise below 0.01), so the paired t test
drops it after round 1; ``a`` and ``b`` race on to round 3, and ``a`` has the better mean.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path

import pydantic
import pytest

import lab.inspect
from lab import Arm, Experiment, RunSpec
from lab._stats import spread
from lab.errors import ConfigError
from lab.store import Store
from lab.store.reader import Reader
from lab.sweeps import Race
from lab.sweeps.report import best_trials, race_table, trials_table

NOISE = {
    "a": [0.004, -0.006, 0.002, -0.003],
    "b": [-0.005, 0.003, -0.002, 0.006],
    "c": [0.002, -0.004, 0.005, -0.001],
}
MEANS = {"a": 0.0, "b": 0.001, "c": 10.0}
RACE = Race("score", mode="min", alpha=0.05, min_repeats=2, max_repeats=4, test="t")
RACE_FIELDS = {"metric": "score", "mode": "min", "alpha": 0.05, "min_repeats": 2,
               "max_repeats": 4, "test": "t", "budget": None}  # fmt: skip
PRUNED = {"step": 3, "rule": "median", "metric": "val/loss", "value": 1.5}


class Cfg(pydantic.BaseModel):
    mean: float = 0.0


def train(run: RunSpec) -> dict[str, float]:
    """The arm's mean plus its seed's noise."""
    return {"score": run.config.mean + NOISE[run.arm][run.repeat]}


def _record_sweep(url: str) -> None:
    """A sweep recorded through the store contract: two sampled arms, s000's run completes,
    s001's is pruned at step 3 and s002 is still running."""
    with closing(Store(url)) as store:
        exp = store.begin_experiment("search", config={"sweep": {"arms": 3}}, seed=0, repeats=1)
        params = {"s000": {"lr": 0.01}, "s001": {"lr": 0.1, "opt": "sgd"}, "s002": {"lr": 0.5}}
        for number, (name, p) in enumerate(params.items()):
            arm = store.add_arm(exp, name, overrides=p, config={})
            group = store.add_group(exp, name, arm_id=arm)
            run = store.start_run(exp, group, run_key=f"{name}-r0", arm_id=arm, repeat=0,
                                  stage=0, seed=0, config={}, output_dir=None)  # fmt: skip
            store.add_trial(exp, number, arm, p, 0)
            if name == "s000":
                store.finish_run(run, status="completed", summary={"val/loss": 0.25})
                store.tell_trial(exp, number, told=1, value=0.25, state="complete")
            elif name == "s001":
                store.finish_run(run, status="pruned", summary={"val/loss": 1.5}, pruned=PRUNED)
                store.tell_trial(exp, number, told=0, value=1.5, state="pruned")
        store.finish_experiment(exp, status="completed")


@pytest.fixture(scope="module")
def recorded(module_store_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The race run for real, and the sweep recorded, once per backend."""
    folder = tmp_path_factory.mktemp("race")
    arms = [Arm(name, mean=mean) for name, mean in MEANS.items()]
    Experiment("race", train, base_config=Cfg(), arms=arms, race=RACE,
               store=module_store_url, output_dir=folder).run()  # fmt: skip
    _record_sweep(module_store_url)
    yield module_store_url


def _round(arm: str, r: int, eliminated: bool = False) -> dict[str, object]:
    s = spread([MEANS[arm] + v for v in NOISE[arm][: r + 1]])
    nan = math.isnan
    return {"arm": arm, "round": r, "status": "completed", "value": MEANS[arm] + NOISE[arm][r],
            "n": r + 1, "mean": s.mean,
            "ci_low": None if nan(s.ci_low) else s.ci_low,
            "ci_high": None if nan(s.ci_high) else s.ci_high, "eliminated": eliminated}  # fmt: skip


ROWS = [_round("a", r) for r in range(4)] + [_round("b", r) for r in range(4)]
ROWS += [_round("c", 0), _round("c", 1, eliminated=True)]


def test_the_race_table_holds_each_arm_per_round_its_elimination_and_the_winner(
    recorded: str,
) -> None:
    with closing(Store(recorded, readonly=True)) as store:
        table = race_table(store.get_experiment("race"), store.eliminations("race"))
    assert table is not None
    (elimination,) = table["eliminations"]
    assert elimination["statistic"] > 0 and 0 < elimination["p_value"] < 0.05
    assert elimination == {"arm": "c", "round": 1, "test": "t", "alpha": 0.05, "best": "a",
                           "statistic": elimination["statistic"],
                           "p_value": elimination["p_value"]}  # fmt: skip
    assert table == {
        "experiment": "race", "race": RACE_FIELDS, "arms": ["a", "b", "c"], "rounds": 4,
        "rows": ROWS, "eliminations": [elimination], "survivors": ["a", "b"], "over": True,
        "winner": "a", "runs": 10, "pruned": 0,
    }  # fmt: skip
    with closing(Store(recorded, readonly=True)) as store:  # no race: no table
        assert race_table(store.get_experiment("search"), []) is None


def test_the_reader_reads_trials_and_eliminations_as_the_store_does(recorded: str) -> None:
    with closing(Store(recorded, readonly=True)) as store:
        expected = (store.trials("search"), store.eliminations("race"), store.trials("race"))
    reader = Reader(recorded)
    try:
        got = (reader.trials("search"), reader.eliminations("race"), reader.trials("race"))
    finally:
        reader.close()
    assert got == expected
    assert [t["intermediate"] for t in got[0]] == [{}, {3: 1.5}, {}]
    assert got[2] == []


def test_the_trials_table_lists_sampled_arms_and_the_best_complete_ones(recorded: str) -> None:
    with closing(Store(recorded, readonly=True)) as store:
        rows = trials_table(store.trials("search"))
    assert rows == [
        {"number": 0, "arm": "s000", "params": {"lr": 0.01}, "value": 0.25, "state": "complete"},
        {"number": 1, "arm": "s001", "params": {"lr": 0.1, "opt": "sgd"}, "value": 1.5,
         "state": "pruned"},
        {"number": 2, "arm": "s002", "params": {"lr": 0.5}, "value": None, "state": "running"},
    ]  # fmt: skip
    assert best_trials(rows, "min") == [rows[0]]


def test_inspect_race_and_trials_are_the_tables_as_frames(recorded: str) -> None:
    con = lab.inspect.connect(recorded)
    with closing(Store(recorded, readonly=True)) as store:
        (e,) = store.eliminations("race")
    race = lab.inspect.race(con, "race")
    got = race.fetchall()
    expected = [
        (r["arm"], r["round"], r["status"], r["value"], r["n"], r["mean"], r["ci_low"],
         r["ci_high"], r["eliminated"],
         *((e["test"], e["statistic"], e["p_value"], 0.05, "a") if r["eliminated"]
           else (None,) * 5), r["arm"] == "a")
        for r in ROWS
    ]  # fmt: skip
    assert got == expected
    assert race.columns == ["arm", "round", "status", "value", "n", "mean", "ci_low", "ci_high",
                            "eliminated", "test", "statistic", "p_value", "alpha", "best",
                            "winner"]  # fmt: skip
    assert lab.inspect.trials(con, "search").fetchall() == [
        (0, "s000", '{"lr": 0.01}', 0.25, "complete"),
        (1, "s001", '{"lr": 0.1, "opt": "sgd"}', 1.5, "pruned"),
        (2, "s002", '{"lr": 0.5}', None, "running"),
    ]
    assert lab.inspect.trials(con, "race").fetchall() == []
    with pytest.raises(ConfigError, match=r"^experiment 'search' ran no race; Experiment\(race="):
        lab.inspect.race(con, "search")
    with pytest.raises(ConfigError, match=r"^no experiment named 'nope' in the store; known: "):
        lab.inspect.trials(con, "nope")


def _lab(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "lab.cli", *args], capture_output=True,
                          text=True, timeout=300, env=dict(os.environ))  # fmt: skip


def test_lab_show_prints_the_race_table_and_its_eliminations(recorded: str) -> None:
    with closing(Store(recorded, readonly=True)) as store:
        (e,) = store.eliminations("race")
    out = _lab("show", "race", "--store", recorded)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    start = text.index("race by score")
    block = text[start : text.index("\nprovenance")].rstrip("\n").split("\n")
    cells = {r["arm"]: [] for r in ROWS}
    for r in ROWS:
        cell = f"{r['mean']:.4g}"
        if r["ci_low"] is not None:
            cell += f" [{r['ci_low']:.4g}, {r['ci_high']:.4g}]"
        cells[r["arm"]].append(cell + (" x" if r["eliminated"] else ""))
    assert block[0] == (
        "race by score (min), t test at alpha 0.05: 4 of 4 rounds closed, 2 of 3 arms left, "
        "over, winner a"
    )
    assert [line.split("  ")[0] for line in block[1:5]] == ["arm", "a", "b", "c"]
    for line, arm, status in zip(block[2:5], "abc", ("winner", "survived", "out after round 1"),
                                 strict=True):  # fmt: skip
        parts = [p.strip() for p in line.split("  ") if p.strip()]
        assert parts == [arm, status, *cells[arm], *(["-", "-"] if arm == "c" else [])]
    assert block[5:] == [
        "",
        "eliminated (x: after that round; p: Holm-corrected, against alpha)",
        "arm  round  test  statistic  p          alpha  against",
        f"c    1      t     {e['statistic']:<9.4g}  {e['p_value']:<9.4g}  0.05   a",
    ]
    assert "c (eliminated)  score   2" in text
    assert "eliminated by the race: c after round 1 (t, p=" in text


def test_lab_show_prints_sampled_arms_and_counts_pruned_runs_and_lab_ls_too(
    recorded: str,
) -> None:
    out = _lab("show", "search", "--store", recorded)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "search: completed, 3 runs (1 pruned), seed 0"
    start = lines.index("sampled arms")
    assert lines[start : start + 5] == [
        "sampled arms",
        "trial  arm   params                     value  state",
        '0      s000  {"lr": 0.01}               0.25   complete',
        '1      s001  {"lr": 0.1, "opt": "sgd"}  1.5    pruned',
        '2      s002  {"lr": 0.5}                -      running',
    ]
    assert "race by" not in out.stdout
    listed = _lab("ls", "--store", recorded)
    assert listed.returncode == 0, listed.stderr
    (row,) = [line for line in listed.stdout.splitlines() if line.startswith("search ")]
    assert "1 completed, 1 pruned, 1 running" in row


def test_sweep_tables_need_no_sqlalchemy_for_lab_show(recorded: str, tmp_path: Path) -> None:
    """``lab show`` of a race reads it without importing SQLAlchemy (as for any experiment)."""
    code = (
        "import sys, runpy; sys.argv = ['lab', 'show', 'race', '--store', sys.argv[1]]\n"
        "try:\n    runpy.run_module('lab.cli', run_name='__main__')\n"
        "except SystemExit: pass\n"
        "print('sqlalchemy' in sys.modules, file=sys.stderr)"
    )
    out = subprocess.run([sys.executable, "-c", code, recorded], capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert out.stderr.strip().splitlines()[-1] == "False"
    assert "race by score" in out.stdout


RACE_LIB = """
import pydantic

NOISE = {"a": [0.004, -0.006, 0.002, -0.003], "b": [-0.005, 0.003, -0.002, 0.006],
         "c": [0.002, -0.004, 0.005, -0.001]}


class Cfg(pydantic.BaseModel):
    mean: float = 0.0


def train(run):
    return {"score": run.config.mean + NOISE[run.arm][run.repeat]}
"""
RACE_FILE = """name: race
train: racelib:train
config: racelib:Cfg
arms:
  - {name: a, mean: 0.0}
  - {name: b, mean: 0.001}
  - {name: c, mean: 10.0}
"""


def _files(folder: Path) -> Path:
    (folder / "racelib.py").write_text(RACE_LIB)
    (folder / "plain.yaml").write_text(RACE_FILE)
    race = folder / "race.yaml"
    race.write_text(RACE_FILE + "race: {metric: score, min_repeats: 2, max_repeats: 4, test: t}\n")
    return race


def test_lab_sweep_races_a_files_arms_round_by_round_and_prints_the_race(tmp_path: Path) -> None:
    race = _files(tmp_path)
    url = f"sqlite:///{tmp_path / 'lab.db'}"
    out = subprocess.run([sys.executable, "-m", "lab.cli", "sweep", str(race), "--store", url],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)  # fmt: skip
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[:4] == [
        "round 0 closed: 3 of 3 arms left",
        lines[1],
        "round 2 closed: 2 of 3 arms left",
        "round 3 closed: 2 of 3 arms left; the race is over, winner a",
    ]
    assert lines[1].startswith("round 1 closed: 2 of 3 arms left; dropped c after round 1 (t, p=")
    assert lines[1].endswith(" vs a)")
    start = lines.index(
        "race by score (min), t test at alpha 0.05: 4 of 4 rounds closed, 2 of 3 arms left, "
        "over, winner a"
    )
    shown = _lab("show", "race", "--store", url).stdout.splitlines()
    at = shown.index(lines[start])
    assert lines[start:] == shown[at : at + len(lines) - start]  # lab show's very table


def test_a_files_race_section_is_checked_in_one_line_and_lab_sweep_needs_one(
    tmp_path: Path,
) -> None:
    race = _files(tmp_path)

    def lab_in(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "lab.cli", *args], capture_output=True,
                              text=True, timeout=300, cwd=tmp_path)  # fmt: skip

    cases = {
        ("run", str(race), "race.alpah=0.1"): f"error: {race}: race.alpah: Race has no such "
        "field; its fields: metric, mode, alpha, min_repeats, max_repeats, test, budget",
        ("run", str(race), "race.alpha=3"): f"error: {race}: race: Race(alpha=3): use a level "
        "strictly between 0 and 1, e.g. 0.05",
        ("sweep", "plain.yaml"): "error: plain.yaml: no sweep:, race: or prune: section, so "
        "there is nothing to search, race or prune; run it with: lab run plain.yaml",
    }
    for args, line in cases.items():
        out = lab_in(*args, "--dry-run")
        assert (out.returncode, out.stderr.strip(), out.stdout) == (1, line, ""), args
    out = lab_in("sweep", str(race), "--dry-run")
    assert out.returncode == 0, out.stderr
    assert (
        "race: by score (min), t test at alpha 0.05, 2 to 4 repeats per arm: at most 12 runs, "
        "fewer as arms drop"
    ) in out.stdout.splitlines()


def test_the_sweeps_pages_file_example_races_as_the_page_shows(tmp_path: Path) -> None:
    page = (Path(__file__).resolve().parent.parent / "docs" / "sweeps.md").read_text()
    section = page[page.index("## From the command line and in files") :]
    (tmp_path / "racelib.py").write_text(section.split("```python\n")[1].split("```")[0])
    (tmp_path / "race.yaml").write_text(section.split("```yaml\n")[1].split("```")[0])
    shown = section.split("```text\n")[1].split("```")[0].splitlines()
    out = subprocess.run([sys.executable, "-m", "lab.cli", "sweep", "race.yaml"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)  # fmt: skip
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[lines.index(shown[0]) :] == shown
