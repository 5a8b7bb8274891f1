"""The scripts in examples/ run, and each one SIGKILLed mid-run and run again ends as if it had
never stopped: the same metrics at every step of every run, read back with lab.inspect."""

from __future__ import annotations

import math
import os
import runpy
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import lab.inspect
from tests import warm

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"

# Each example at tiny sizes: its flags, the step of its last run to SIGKILL it at (between
# two checkpoints), that run's key, and the checkpoint its resume starts from.
CASES = {
    "mnist.py": (
        ["--epochs", "2", "--n-train", "256", "--n-test", "64", "--batch-size", "32"],
        12,  # 8 steps an epoch: in the second epoch
        "no-dropout-r1",
        "step_000008",
    ),
    "dcgan.py": (
        ["--niter", "2", "--n-images", "128", "--batchSize", "16", "--save-every", "5"],
        12,  # 8 steps an epoch, saved every 5: resumed mid-epoch, at its data position
        "beta1-0.9-r1",
        "step_000010",
    ),
    "accumulate.py": (
        ["--num_epochs", "2", "--n-train", "256", "--save-every", "3"],
        6,  # 4 steps of 4 micro-batches an epoch: resumed from step 3, 12 micro-batches in
        "accumulate-r1",
        "step_000003",
    ),
    "lightning_classifier.py": (
        ["--max_epochs", "2", "--n-train", "264"],
        12,  # 8 steps an epoch, Lightning's last.ckpt at each epoch's end: resumed from step 8
        "lr-0.01-r1",
        "last.ckpt",
    ),
    "rlhf.py": (
        ["--episodes", "16", "--save-every", "5"],
        25,  # 2 learn batches an episode, saved every 5 episodes: killed in episode 12
        "kl-0.4-r1",
        "step_000020",
    ),
    "accelerate_tracker.py": (
        ["--steps", "12", "--save-every", "4"],
        6,  # saved every 4 steps: resumed from checkpoint-4, accelerate's own save_state
        "lr-1e-2-r1",
        "checkpoint-4",
    ),
    "transformers_trainer.py": (
        ["--max-steps", "6", "--n-train", "32", "--save-every", "2"],
        5,  # saved every 2 steps: resumed from checkpoint-4, the Trainer's own
        "lr-1e-3-r1",
        "checkpoint-4",
    ),
    "ppo_cartpole.py": (
        [
            *("--n-timesteps", "512", "--n-envs", "2", "--n-steps", "16", "--batch-size", "16"),
            *("--n-epochs", "2", "--save-every", "4"),
        ],
        38,  # 4 steps an episode (2 epochs of 2 minibatches), saved every 4: mid-episode 9
        "lambda-0.95-r1",
        "step_000032",
    ),
}


def _start(script: str, folder: Path, *flags: str) -> subprocess.Popen[str]:
    """Start an example as a user would, in `folder` (its store and runs go there)."""
    folder.mkdir(exist_ok=True)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    for name in ("LAB_STORE_URL", "OMP_NUM_THREADS"):  # the defaults a user gets
        env.pop(name, None)
    return warm.popen(
        [sys.executable, str(EXAMPLES / script), *flags],
        cwd=folder,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _run(script: str, folder: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    proc = _start(script, folder, *flags)
    out, err = proc.communicate(timeout=300)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


# The metrics a resumed run records otherwise than an uninterrupted one: wall times, and the
# Trainer's closing `train_loss` (its mean over the steps the last process trained).
RESUMED_OTHERWISE = (
    "key <> 'step_time' AND key NOT LIKE 'throughput/%' AND key NOT LIKE '%runtime' "
    "AND key NOT LIKE '%per_second' AND key <> 'train/loss'"
)


def _history(folder: Path) -> tuple[list[tuple], ...]:
    """Every run's status, every metric at every step, every run's final metrics, and every
    image; leaving out those `RESUMED_OTHERWISE` names, with NaN as "nan" (a NaN equals no
    other)."""
    con = lab.inspect.connect(f"sqlite:///{folder / 'lab.db'}")

    def rows(sql: str) -> list[tuple]:
        return [
            tuple("nan" if isinstance(v, float) and math.isnan(v) else v for v in row)
            for row in con.sql(sql).fetchall()
        ]

    try:
        runs = rows("SELECT run_key, status FROM runs ORDER BY run_key")
        metrics = rows(
            "SELECT r.run_key, m.step, m.key, m.value FROM metrics m JOIN runs r USING (run_id) "
            f"WHERE {RESUMED_OTHERWISE} ORDER BY ALL"
        )
        final = rows(
            f"SELECT run_key, key, step, value FROM final_metrics WHERE {RESUMED_OTHERWISE} "
            "ORDER BY ALL"
        )
        images = rows(
            "SELECT r.run_key, i.key, i.step, i.path, i.width, i.height FROM images i "
            "JOIN runs r USING (run_id) ORDER BY ALL"
        )
    finally:
        con.close()
    images = [(*row[:3], _inside(folder, row[3]), *row[4:]) for row in images]
    return runs, metrics, final, images


def _latest(run_folder: Path) -> str:
    """The checkpoint the run in `run_folder` resumes from: lab's ``checkpoints/latest``, or
    Lightning's ``checkpoints/last.ckpt``, or the newest ``checkpoint-N`` the framework saved
    (the Trainer in ``trainer/``, accelerate's ``save_state`` in ``accelerate/``)."""
    latest = run_folder / "checkpoints" / "latest"
    if latest.exists():
        return latest.read_text()
    last = run_folder / "checkpoints" / "last.ckpt"  # Lightning's, where Lightning put it
    if last.is_file():
        return last.name
    saved = [p.name for p in run_folder.glob("*/checkpoint-*")]
    return max(saved, key=lambda name: int(name.rsplit("-", 1)[1]))


def _inside(folder: Path, path: str) -> str:
    """An image's path as lab.inspect gives it (absolute), relative to the store's folder."""
    return str(Path(path).relative_to(folder))


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(CASES))
def test_example_resumed_after_sigkill_ends_as_if_never_stopped(
    script: str, tmp_path: Path
) -> None:
    flags, stop_at, killed_run, checkpoint = CASES[script]
    straight = _start(script, tmp_path / "straight", *flags)  # both at once: half the wait
    killed = _start(script, tmp_path / "killed", *flags, "--stop-at", str(stop_at))
    out, err = straight.communicate(timeout=300)
    assert straight.returncode == 0, err[-3000:]
    assert "4 runs (4 completed)" in out  # the experiment summary, at the end
    _, err = killed.communicate(timeout=300)
    assert killed.returncode == -signal.SIGKILL, err[-3000:]
    assert _latest(tmp_path / "killed" / "runs" / Path(script).stem / killed_run) == checkpoint

    resumed = _run(script, tmp_path / "killed", *flags)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"{killed_run}: resumed from {checkpoint}" in resumed.stdout
    assert "4 runs (4 completed)" in resumed.stdout

    runs, metrics, final, images = _history(tmp_path / "straight")
    assert [status for _, status in runs] == ["completed"] * 4
    assert _history(tmp_path / "killed") == (runs, metrics, final, images)
    assert bool(images) == (script == "dcgan.py")  # its samples, as PNGs in the run folder
    for _, _, _, path, _, _ in images:
        want = (tmp_path / "straight" / path).read_bytes()
        assert (tmp_path / "killed" / path).read_bytes() == want
    steps = {(key, step) for key, step, _, _ in metrics if key == killed_run}
    assert len(steps) > stop_at  # every step of the killed run is recorded, once


@pytest.mark.slow
def test_the_rlhf_page_quotes_the_line_a_short_run_prints(tmp_path: Path) -> None:
    page = (ROOT / "docs" / "rl-rlhf.md").read_text(encoding="utf-8")
    command = "python examples/rlhf.py --episodes 16"
    assert f"`{command}`" in page
    out = _run("rlhf.py", tmp_path, "--episodes", "16")
    assert out.returncode == 0, out.stderr[-3000:]
    last = out.stdout.splitlines()[-1]
    assert last.startswith("best arm by episode/return_mean (max): kl-0.04 (")
    assert "\n".join(["```text", last, "```"]) in page.split(command, 1)[1]


@pytest.mark.parametrize("script", sorted(CASES))
def test_example_help_names_its_flags(
    script: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "argv", [script, "--help"])
    monkeypatch.syspath_prepend(str(EXAMPLES))  # as `python examples/X.py` has it, for _lab
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(EXAMPLES / script), run_name="__main__")
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    common = ["--store", "--output-dir", "--repeats", "--fresh", "--stop-at"]
    missing = [flag for flag in [*common, *CASES[script][0][::2]] if flag not in out]
    assert not missing


def test_every_example_is_in_the_readme_with_its_command() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    scripts = sorted(p.name for p in EXAMPLES.glob("*.py") if not p.name.startswith("_"))
    assert scripts == sorted(CASES)  # each example is run by the tests above
    missing = [name for name in scripts if f"python examples/{name}" not in readme]
    assert not missing, f"give each example its command in README.md's Examples: {missing}"
