"""Experiment files with a ``sweep:`` (sampled arms), ``sweep:`` and ``race:``, and ``prune:``
section, run end to end by the real ``lab run`` and ``lab sweep`` commands: what
``--dry-run`` says each will do, the progress lines, and what the store holds after.

The sampled values are the random sampler's with seed 0 (tests/test_sweeps_samplers.py
checks the sampler itself); the training functions are set so the results are exact.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from store_rows import rows

from tests import warm

SWEEP_LIB = """
import math

import pydantic

LUCK = [0.004, -0.006, 0.002, -0.003]  # each seed's own luck


class Config(pydantic.BaseModel):
    lr: float = 0.01
    opt: str = "adam"


def train(run):
    loss = (math.log10(run.config.lr) + 2) ** 2 + (0.5 if run.config.opt == "sgd" else 0.0)
    return {"val/loss": loss + LUCK[run.seed % len(LUCK)]}
"""

SWEEP_FILE = """name: sampled
train: sweeplib:train
config: sweeplib:Config
sweep:
  space:
    lr: {float: [0.001, 0.1], log: true}
    opt: {choice: [adam, sgd]}
  sampler: random
  arms: 3
  seed: 0
  metric: val/loss
"""

PRUNE_LIB = """
import pydantic
import torch

from lab import TrainingLoop


class Config(pydantic.BaseModel):
    lr: float = 0.1


def loss_fn(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def train(run):
    # one weight from 1 towards 0: the loss at step k is (1 - 2 lr) ** (2 (k - 1))
    model = torch.nn.Linear(1, 1, bias=False)
    torch.nn.init.constant_(model.weight, 1.0)
    opt = torch.optim.SGD(model.parameters(), lr=run.config.lr)
    data = [(torch.ones(1, 1), torch.zeros(1, 1))]
    return TrainingLoop(model, opt, data, loss_fn, num_steps=8).fit(run)
"""

PRUNE_FILE = """name: pruned
train: prunelib:train
config: prunelib:Config
arms:
  - {name: fast, lr: 0.1}
  - {name: slow, lr: 0.05}
  - {name: stuck, lr: 0.0}
repeats: 2
prune: {metric: loss, mode: min, rule: median, n_startup_trials: 1, n_warmup_steps: 3}
"""


def lab_in(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return warm.run([sys.executable, "-m", "lab.cli", *args], capture_output=True,
                          text=True, timeout=300, cwd=folder)  # fmt: skip


def _sweep_files(folder: Path) -> None:
    (folder / "sweeplib.py").write_text(SWEEP_LIB)
    (folder / "sampled.yaml").write_text(SWEEP_FILE)
    (folder / "raced.yaml").write_text(
        SWEEP_FILE.replace("name: sampled", "name: raced")
        + "race: {metric: val/loss, min_repeats: 2, max_repeats: 3, test: t}\n"
    )


def test_a_files_sweep_dry_run_says_how_its_arms_are_sampled(tmp_path: Path) -> None:
    _sweep_files(tmp_path)
    out = lab_in(tmp_path, "sweep", "sampled.yaml", "--dry-run")
    assert (out.returncode, out.stderr) == (0, "")
    assert out.stdout.splitlines() == [
        "sampled: 3 sampled arms x 1 repeat = 3 runs (serial)",
        "train: sweeplib:train",
        'config: Config {"lr": 0.01, "opt": "adam"}',
        "store: sqlite:///lab.db",
        "run folders: runs/sampled/<run>",
        "callbacks: RoundsShown, SqlLogger",
        "sweep: 3 arms sampled by random (seed 0), named s000 to s002, asked one at a time, "
        "as each arm's runs end; each told its mean val/loss (min); run again, it continues "
        "from its recorded trials",
        "",
        "param  sampled from",
        'lr     {"float": [0.001, 0.1], "log": true}',
        'opt    {"choice": ["adam", "sgd"]}',
        "",
        "dry run: nothing ran; to run it: lab sweep sampled.yaml",
    ]
    raced = lab_in(tmp_path, "run", "raced.yaml", "--dry-run").stdout.splitlines()
    assert raced[0] == "raced: 3 sampled arms x 3 repeats = 9 runs (serial)"
    assert raced[6:8] == [
        "race: by val/loss (min), t test at alpha 0.05, 2 to 3 repeats per arm: at most 9 "
        "runs, fewer as arms drop",
        "sweep: 3 arms sampled by random (seed 0), named s000 to s002, all asked up front, "
        "then raced; each told its mean val/loss (min); run again, it continues from its "
        "recorded trials",
    ]
    assert not (tmp_path / "lab.db").exists()  # a dry run opens no store


def test_lab_sweep_samples_a_files_arms_showing_each_as_asked_and_continues_it(
    tmp_path: Path,
) -> None:
    _sweep_files(tmp_path)
    out = lab_in(tmp_path, "sweep", "sampled.yaml")
    assert (out.returncode, out.stderr) == (0, "")
    assert out.stdout.splitlines()[:4] == [
        "s000 (lr=0.01477, opt=sgd) asked: 1 of 3 arms asked, 0 of 3 runs done",
        "s001 (lr=0.002392, opt=adam) asked: 2 of 3 arms asked, 1 of 3 runs done",
        "s002 (lr=0.008922, opt=adam) asked: 3 of 3 arms asked, 2 of 3 runs done",
        "sampled: 3 runs (3 completed)",
    ]
    db = tmp_path / "lab.db"
    trials = "SELECT number, asked_after, told, round(value, 4), state FROM sweep_trials"
    assert rows(db, trials) == [
        (0, 0, 0, 0.5327, "complete"),
        (1, 1, 1, 0.3899, "complete"),
        (2, 2, 2, 0.0065, "complete"),
    ]
    # one arm more: the three come back as they were (their runs reused), one is asked
    again = lab_in(tmp_path, "sweep", "sampled.yaml", "sweep.arms=4")
    assert (again.returncode, again.stderr) == (0, "")
    assert again.stdout.splitlines()[:5] == [
        "s000 (lr=0.01477, opt=sgd) asked before: 4 of 4 arms asked, 3 of 4 runs done",
        "s001 (lr=0.002392, opt=adam) asked before: 4 of 4 arms asked, 3 of 4 runs done",
        "s002 (lr=0.008922, opt=adam) asked before: 4 of 4 arms asked, 3 of 4 runs done",
        "s003 (lr=0.004405, opt=adam) asked: 4 of 4 arms asked, 3 of 4 runs done",
        "sampled: 4 runs (4 completed)",
    ]
    assert rows(db, "SELECT count(*) FROM runs") == [(4,)]  # none trained twice
    assert rows(db, trials)[3] == (3, 3, 3, 0.1308, "complete")


def test_lab_sweep_races_a_files_sampled_arms(tmp_path: Path) -> None:
    _sweep_files(tmp_path)
    out = lab_in(tmp_path, "sweep", "raced.yaml")
    assert (out.returncode, out.stderr) == (0, "")
    lines = out.stdout.splitlines()
    assert lines[:6] == [
        "s000 (lr=0.01477, opt=sgd) asked: 3 of 3 arms asked, 0 of 9 runs done",
        "s001 (lr=0.002392, opt=adam) asked: 3 of 3 arms asked, 1 of 9 runs done",
        "s002 (lr=0.008922, opt=adam) asked: 3 of 3 arms asked, 2 of 9 runs done",
        "round 0 closed: 3 of 3 arms left",
        lines[4],
        "raced: 6 runs (6 completed)",
    ]
    assert lines[4].startswith(
        "round 1 closed: 1 of 3 arms left; dropped s000 after round 1 (t, p="
    )
    assert lines[4].endswith("vs s002); the race is over, winner s002")
    db = tmp_path / "lab.db"
    assert rows(db, "SELECT number, told, round(value, 4), state FROM sweep_trials") == [
        (0, 0, 0.5277, "complete"),
        (1, 1, 0.3849, "complete"),
        (2, 2, 0.0015, "complete"),
    ]
    assert rows(db, "SELECT a.name, e.round FROM eliminations e JOIN arms a USING (arm_id) "
                    "ORDER BY a.name") == [("s000", 1), ("s001", 1)]  # fmt: skip


def test_a_files_prune_section_stops_runs_and_says_so_before(tmp_path: Path) -> None:
    (tmp_path / "prunelib.py").write_text(PRUNE_LIB)
    (tmp_path / "pruned.yaml").write_text(PRUNE_FILE)
    dry = lab_in(tmp_path, "sweep", "pruned.yaml", "--dry-run")
    assert (dry.returncode, dry.stderr) == (0, "")
    assert (
        "prune: Optuna's median rule on loss (min, n_startup_trials=1, n_warmup_steps=3) stops "
        "runs early; a pruned run counts toward no arm's mean"
    ) in dry.stdout.splitlines()
    bad = lab_in(tmp_path, "run", "pruned.yaml", "prune.n_startp=1", "--dry-run")
    assert (bad.returncode, bad.stdout) == (1, "")
    assert bad.stderr.strip() == (
        "error: pruned.yaml: prune: Prune(rule='median', n_startup_trials=1, n_warmup_steps=3, "
        "n_startp=1): got an unexpected keyword argument 'n_startp'"
    )
    out = lab_in(tmp_path, "run", "pruned.yaml")
    assert (out.returncode, out.stderr) == (0, "")
    assert out.stdout.splitlines()[0] == "pruned: 6 runs (2 completed, 4 pruned)"
    db = tmp_path / "lab.db"
    stops = "SELECT run_key, status, json_extract(pruned, '$.step') FROM runs ORDER BY run_key"
    assert rows(db, stops) == [
        ("fast-r0", "completed", None),
        ("fast-r1", "completed", None),
        ("slow-r0", "pruned", 3),
        ("slow-r1", "pruned", 3),
        ("stuck-r0", "pruned", 3),
        ("stuck-r1", "pruned", 3),
    ]


def test_the_sweeps_pages_sweep_and_prune_file_runs_as_the_page_shows(tmp_path: Path) -> None:
    page = (Path(__file__).resolve().parent.parent / "docs" / "sweeps.md").read_text()
    section = page[page.index("## From the command line and in files") : page.index("## Pruning")]
    (tmp_path / "searchlib.py").write_text(section.split("```python\n")[2].split("```")[0])
    (tmp_path / "search.yaml").write_text(section.split("```yaml\n")[2].split("```")[0])
    shown = section.split("```text\n")[2].split("```")[0].splitlines()
    dry = lab_in(tmp_path, "sweep", "search.yaml", "--dry-run")
    assert dry.stdout.splitlines()[6].startswith(
        "sweep: 4 arms sampled by random (seed 0), named s000 to s003, "
    )
    out = lab_in(tmp_path, "sweep", "search.yaml")
    assert (out.returncode, out.stderr) == (0, "")
    assert out.stdout.splitlines()[: len(shown)] == shown
    assert rows(tmp_path / "lab.db", "SELECT number, state FROM sweep_trials") == [
        (0, "complete"), (1, "pruned"), (2, "pruned"), (3, "pruned"),
    ]  # fmt: skip


def test_the_experiment_files_pages_sweep_example_plans_and_runs_as_shown(tmp_path: Path) -> None:
    page = (Path(__file__).resolve().parent.parent / "docs" / "experiment-files.md").read_text()
    section = page[page.index("## Sweeps, races and pruning") :]
    start = page.index("```python\n") + len("```python\n")
    (tmp_path / "train_lib.py").write_text(page[start : page.index("```", start)])
    (tmp_path / "lr-search.yaml").write_text(section.split("```yaml\n")[1].split("```")[0])
    shown = section.split("```text\n")[1].split("```")[0]
    dry = lab_in(tmp_path, "run", "lr-search.yaml", "--dry-run")
    assert (dry.returncode, dry.stdout, dry.stderr) == (0, shown, "")
    out = lab_in(tmp_path, "run", "lr-search.yaml")
    assert (out.returncode, out.stderr) == (0, "")
    states = rows(tmp_path / "lab.db", "SELECT state FROM sweep_trials ORDER BY number")
    assert states == [("complete",)] * 5 + [("pruned",)] * 3  # seeded: the same every time
