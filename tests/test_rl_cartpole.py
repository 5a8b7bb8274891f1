"""examples/ppo_cartpole.py on real gymnasium CartPole-v1: what it records in the SQL store,
a real SIGKILL mid-episode and the resume that ends as if it had never stopped, and a resume
into other environment settings refused in one line."""

from __future__ import annotations

import importlib
import math
import os
import signal
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import lab.inspect
from lab.errors import ConfigError
from tests import warm

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
# 512 env steps in rollouts of 2 envs x 16 steps: 16 episodes, each 2 epochs of 2 minibatches
# of 16 rows (4 optimizer steps), so 64 steps a run; a checkpoint every 4 episodes (16 steps)
FLAGS = [
    *("--n-timesteps", "512", "--n-envs", "2", "--n-steps", "16", "--batch-size", "16"),
    *("--n-epochs", "2", "--save-every", "4", "--rollouts", "5", "--repeats", "1"),
]
RUNS = ["lambda-0.95-r0", "zoo-r0"]


def _start(folder: Path, *flags: str) -> subprocess.Popen[str]:
    folder.mkdir(exist_ok=True)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    env.pop("LAB_STORE_URL", None)
    return warm.popen(
        [sys.executable, str(EXAMPLES / "ppo_cartpole.py"), *FLAGS, *flags],
        cwd=folder,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _rows(folder: Path, sql: str) -> list[tuple]:
    con = lab.inspect.connect(f"sqlite:///{folder / 'lab.db'}")
    try:
        return [
            tuple("nan" if isinstance(v, float) and math.isnan(v) else v for v in row)
            for row in con.sql(sql).fetchall()
        ]
    finally:
        con.close()


def _steps(folder: Path) -> list[tuple]:
    """Every metric of every step of every run, but the wall times."""
    return _rows(
        folder,
        "SELECT r.run_key, m.step, m.key, m.value FROM metrics m JOIN runs r USING (run_id) "
        "WHERE m.key <> 'step_time' AND m.key NOT LIKE 'throughput/%' ORDER BY ALL",
    )


def _final_weights(folder: Path, run_key: str) -> dict[str, torch.Tensor]:
    checkpoints = folder / "runs" / "ppo_cartpole" / run_key / "checkpoints"
    assert (checkpoints / "latest").read_text() == "step_000064"
    state = torch.load(checkpoints / "step_000064" / "state.pt", weights_only=True)
    return state["model"]


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The example run through, uninterrupted."""
    folder = tmp_path_factory.mktemp("straight")
    proc = _start(folder)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert "ppo_cartpole: 2 runs (2 completed)" in out
    return folder


@pytest.mark.slow
def test_the_example_records_episode_and_learn_batch_metrics_and_rollouts(straight: Path) -> None:
    counts = _rows(
        straight,
        "SELECT r.run_key, m.key, count(*), min(m.step), max(m.step) FROM metrics m "
        "JOIN runs r USING (run_id) GROUP BY ALL ORDER BY ALL",
    )
    per_step = {"loss", "loss/policy", "loss/value", "entropy", "approx_kl", "clip_fraction"}
    per_step |= {"explained_variance", "grad_norm"}
    per_episode = {"episode", "env_steps", "episode/count", "episode/nonfinite_rewards"}
    per_episode |= {"throughput/experience_per_s", "throughput/learn_per_s"}
    for run_key in RUNS:
        mine = {key: tuple(rest) for rk, key, *rest in counts if rk == run_key}
        returns = {f"episode/{k}" for k in ("return_mean", "return_std", "return_min")}
        returns |= {"episode/return_max", "episode/length_mean"}
        ours = {key for key in mine if not key.startswith("rollouts/")}  # the eval's own
        assert ours == per_step | per_episode | returns
        for key in per_step:
            assert mine[key] == (64, 1, 64), key  # every optimizer step
        for key in per_episode:
            assert mine[key] == (16, 4, 64), key  # the last step of each of 16 episodes
    episodes = _rows(
        straight,
        "SELECT m.step, m.value FROM metrics m JOIN runs r USING (run_id) "
        "WHERE r.run_key = 'zoo-r0' AND m.key IN ('episode', 'env_steps') ORDER BY m.key, m.step",
    )
    assert episodes == [(4 * (e + 1), 32.0 * (e + 1)) for e in range(16)] + [
        (4 * (e + 1), float(e)) for e in range(16)
    ]  # env_steps, then the episode index
    ended = _rows(
        straight,
        "SELECT m.step, m.key, m.value FROM metrics m JOIN runs r USING (run_id) "
        "WHERE r.run_key = 'zoo-r0' AND m.key IN ('episode/count', 'episode/return_mean', "
        "'episode/length_mean', 'episode/return_min') ORDER BY ALL",
    )
    by_step: dict[int, dict[str, float]] = {}
    for step, key, value in ended:
        by_step.setdefault(step, {})[key.removeprefix("episode/")] = value
    # the returns are those of the CartPole episodes that ended in the rollout, if any did
    assert {s for s, v in by_step.items() if v["count"] > 0} == {
        s for s, v in by_step.items() if "return_mean" in v
    }
    assert sum(v["count"] for v in by_step.values()) >= 16  # random play: ~20 steps each
    for values in by_step.values():
        if values["count"]:  # CartPole pays 1 a step, and no episode reaches the TimeLimit
            assert values["return_mean"] == values["length_mean"]
            assert values["return_min"] >= 8  # it cannot fall sooner
    # the rollouts: 5 rows of each episode's experience, at the step of the policy that acted
    rollouts = _rows(
        straight,
        "SELECT r.run_key, e.step, count(*), min(p.score), max(p.score) FROM predictions p "
        "JOIN evals e USING (eval_id) JOIN runs r USING (run_id) WHERE e.name = 'rollouts' "
        "GROUP BY ALL ORDER BY ALL",
    )
    assert [(k, s, n) for k, s, n, _, _ in rollouts] == [
        (run_key, 4 * e, 5) for run_key in RUNS for e in range(16)
    ]
    # a row's score is its return (GAE's: the reward to come as the critic estimates it), not
    # its reward, which is 1 on every row: the scores differ from row to row
    assert all(math.isfinite(low) and math.isfinite(high) for *_, low, high in rollouts)
    assert sum(low != high for *_, low, high in rollouts) >= len(rollouts) // 2


@pytest.mark.slow
def test_sigkilled_mid_episode_then_resumed_gives_the_same_losses_and_weights(
    straight: Path, tmp_path: Path
) -> None:
    killed = tmp_path / "killed"
    proc = _start(killed, "--stop-at", "38")  # episode 9 learns at steps 37-40
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == -signal.SIGKILL, err[-3000:]
    checkpoints = killed / "runs" / "ppo_cartpole" / "lambda-0.95-r0" / "checkpoints"
    assert (checkpoints / "latest").read_text() == "step_000032"  # after episode 7
    (recorded,) = _rows(
        killed,
        "SELECT max(m.step) FROM metrics m JOIN runs r USING (run_id) "
        "WHERE r.run_key = 'lambda-0.95-r0'",
    )
    assert 32 <= recorded[0] <= 38  # durable up to the checkpoint; the rest as the kill fell

    proc = _start(killed)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert "lambda-0.95-r0: resumed from step_000032" in out

    assert _steps(killed) == _steps(straight)  # every loss, KL, clip fraction, return...
    for run_key in RUNS:
        want, got = _final_weights(straight, run_key), _final_weights(killed, run_key)
        assert list(got) == list(want)
        for name, tensor in want.items():
            assert torch.equal(got[name], tensor), name  # bit-identical


def test_a_resume_into_other_env_settings_is_one_config_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(EXAMPLES))
    example = importlib.import_module("ppo_cartpole")
    folder = tmp_path / "run"

    def fit(n_envs: int) -> None:
        config = example.Config(n_timesteps=64, n_envs=n_envs, n_steps=8, batch_size=16)
        config.n_epochs, config.rollouts = 1, 0
        loop = example.ppo_loop(types.SimpleNamespace(config=config, seed=0))
        loop.run_dir = folder
        try:
            loop.fit()
        finally:
            loop.stateful["env"].close()

    fit(2)  # 4 episodes of 16 rows, saved at the end
    saved = sorted(p.name for p in (folder / "checkpoints").iterdir())
    with pytest.raises(ConfigError) as info:
        fit(4)
    message = str(info.value)
    assert "\n" not in message
    assert "num_envs" in message and "2 -> 4" in message
    assert sorted(p.name for p in (folder / "checkpoints").iterdir()) == saved  # nothing lost
