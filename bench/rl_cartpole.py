"""PPO on CartPole-v1 with rl-baselines3-zoo's hyperparameters: how soon it is solved.

For each seed, `examples/ppo_cartpole.py`'s run (an OnPolicyLoop recording into a SQLite store
in a temporary folder, with its checkpoints and rollout predictions) for the full
`--n-timesteps` environment steps, and, in the same process when stable-baselines3 is
installed (it is not a dependency of lab: ``pip install stable-baselines3``), SB3's PPO with
the same hyperparameters. Both with one torch thread, on the CPU.

"Solved" is the first rollout after which the mean return of the last 100 finished episodes is
>= 475 (CartPole-v1's reward threshold), checked at the end of each rollout (8 x 32 steps) for
both. Reported per seed and implementation: the episodes finished and the environment steps
made by then, the wall seconds from the start of training to then (None: never solved), the
best and the final mean of the last 100 episodes, and the whole run's wall seconds. Prints
one JSON line.

    python bench/rl_cartpole.py [--seeds 1 2 3] [--n-timesteps 100000] [--no-sb3] [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Any

import torch
from _common import log, machine

from lab import Arm, Callback, Experiment

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))

import ppo_cartpole  # noqa: E402  (examples/ppo_cartpole.py)

THRESHOLD = 475.0
WINDOW = 100


class Solved:
    """The running record both implementations feed: episodes ended, env steps, the window."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.window: deque[float] = deque(maxlen=WINDOW)
        self.episodes = 0
        self.env_steps = 0
        self.best = float("nan")
        self.at: dict[str, Any] | None = None

    def add(self, returns: list[float], env_steps: int) -> None:
        """The episodes that ended in one rollout, and the env steps made so far."""
        self.window.extend(returns)
        self.episodes += len(returns)
        self.env_steps = env_steps
        if len(self.window) < WINDOW:
            return
        mean = statistics.fmean(self.window)
        self.best = mean if not mean <= self.best else self.best
        if self.at is None and mean >= THRESHOLD:
            self.at = {
                "episodes": self.episodes,
                "env_steps": env_steps,
                "wall_s": round(time.perf_counter() - self.started, 2),
            }

    def result(self) -> dict[str, Any]:
        final = statistics.fmean(self.window) if len(self.window) == WINDOW else None
        return {
            "solved": self.at,
            "best_mean_100": None if math.isnan(self.best) else round(self.best, 2),
            "final_mean_100": None if final is None else round(final, 2),
            "episodes": self.episodes,
            "env_steps": self.env_steps,
            "wall_s": round(time.perf_counter() - self.started, 2),
        }


class SolvedCallback(Callback):
    """Feeds `Solved` from each rollout of the lab run."""

    def on_train_start(self, state) -> None:
        self.solved = Solved()

    def on_make_experience_end(self, state, episode, experience) -> None:
        self.solved.add(list(experience.episodes.returns), (episode + 1) * experience.size)


def run_lab(seed: int, n_timesteps: int, folder: Path) -> dict[str, Any]:
    watch = SolvedCallback()
    experiment = Experiment(
        "rl-cartpole-bench",
        ppo_cartpole.train_run,
        base_config=ppo_cartpole.Config(n_timesteps=n_timesteps),
        arms=[Arm("zoo")],
        repeats=1,
        seed=seed,
        callbacks=[watch],
        store=f"sqlite:///{folder / 'lab.db'}",
        output_dir=str(folder / "runs"),
    )
    result = experiment.run()
    assert [r.status for r in result.runs] == ["completed"], result.runs
    return watch.solved.result()


def run_sb3(seed: int, n_timesteps: int) -> dict[str, Any]:
    from stable_baselines3 import PPO
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.env_util import make_vec_env

    config = ppo_cartpole.Config()

    def linear(start: float):
        return lambda progress_remaining: progress_remaining * start

    class Watch(BaseCallback):
        def _on_training_start(self) -> None:
            self.solved = Solved()
            self.returns: list[float] = []

        def _on_step(self) -> bool:
            self.returns += [i["episode"]["r"] for i in self.locals["infos"] if "episode" in i]
            return True

        def _on_rollout_end(self) -> None:
            self.solved.add(self.returns, self.model.num_timesteps)
            self.returns = []

    env = make_vec_env(config.env_id, n_envs=config.n_envs, seed=seed)
    model = PPO(
        "MlpPolicy",
        env,
        n_steps=config.n_steps,
        batch_size=config.batch_size,
        n_epochs=config.n_epochs,
        gamma=config.gamma,
        gae_lambda=config.gae_lambda,
        ent_coef=config.ent_coef,
        learning_rate=linear(config.learning_rate),
        clip_range=linear(config.clip_range),
        seed=seed,
        device="cpu",
    )
    watch = Watch()
    model.learn(n_timesteps, callback=watch)
    env.close()
    return watch.solved.result()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--n-timesteps", type=int, default=100_000)
    parser.add_argument("--no-sb3", action="store_true", help="run lab's PPO only")
    parser.add_argument("--quick", action="store_true", help="one seed, 5,000 steps: a smoke run")
    args = parser.parse_args()
    if args.quick:
        args.seeds, args.n_timesteps = args.seeds[:1], 5_000
    torch.set_num_threads(1)
    try:
        import stable_baselines3

        sb3_version = None if args.no_sb3 else stable_baselines3.__version__
    except ImportError:
        sb3_version = None
    import gymnasium

    torch.optim.Adam(torch.nn.Linear(1, 1).parameters())  # its first use imports torch._dynamo

    def lab_run(seed: int) -> dict[str, Any]:
        with tempfile.TemporaryDirectory() as folder:
            return run_lab(seed, args.n_timesteps, Path(folder))

    def sb3_run(seed: int) -> dict[str, Any]:
        return run_sb3(seed, args.n_timesteps)

    arms = {"lab": lab_run} if sb3_version is None else {"lab": lab_run, "sb3": sb3_run}
    results: dict[str, dict[str, Any]] = {name: {} for name in arms}
    for i, seed in enumerate(args.seeds):  # the order rotates each seed, so drift hits both
        names = list(arms)[i % len(arms) :] + list(arms)[: i % len(arms)]
        for name in names:
            results[name][str(seed)] = arms[name](seed)
            log(f"seed {seed} {name}: {results[name][str(seed)]}")
    summary = {}
    for name, runs in results.items():
        if not runs:
            continue
        solved = [r["solved"] for r in runs.values() if r["solved"] is not None]
        summary[name] = {
            "solved": f"{len(solved)}/{len(runs)}",
            "median_env_steps_to_solve": (
                statistics.median(s["env_steps"] for s in solved) if solved else None
            ),
            "median_wall_s_to_solve": (
                statistics.median(s["wall_s"] for s in solved) if solved else None
            ),
            "median_wall_s_full_run": statistics.median(r["wall_s"] for r in runs.values()),
        }
    print(
        json.dumps(
            {
                "bench": "rl_cartpole",
                "machine": machine(gymnasium=gymnasium.__version__, sb3=sb3_version),
                "n_timesteps": args.n_timesteps,
                "threshold": THRESHOLD,
                "window": WINDOW,
                "summary": summary,
                "runs": results,
            }
        )
    )


if __name__ == "__main__":
    main()
