"""What the on-policy loop costs a learn batch, and how fast its rollouts reach the store.

(a) Per learn batch. The learn step: an MLP policy 32->64->2 on a minibatch of 32 rows
(1 torch thread), a clipped policy-gradient loss, backward, the optimizer step, and a
metrics dict of k keys (loss, then `extra_<i>`). Each episode's experience is made once,
before the clock starts (8 minibatches of 32 rows, 1 learn epoch), so every arm times the
same learn work:

    bare        a plain `for` loop over the episodes and their minibatches, no lab at all
                (it builds its k-key dict and drops it): the baseline
    aa          the same again: the A/A noise floor of the machine at that moment
    rl          `OnPolicyLoop.fit()`, no callbacks (the RL hooks have no listener)
    rl_sql      the same with `SqlLogger` on a fresh SQLite store
    rl_hooks    the same with `SqlLogger` and a callback that listens to all eight RL hooks
                (each does nothing): what the RL hooks cost when someone listens

at k = 8 and 32. How a learn batch is timed: the loss function stamps `perf_counter()` each
time it is called, so a learn batch is the time from one call to the next and spans all the
loop does per batch (the minibatch, `on_learn_batch_start`, `pre_step`, the step,
`end_step`, `on_learn_batch_end`); no arm carries a measuring callback. `per_batch_us` is
the median of those spans inside an episode; `boundary_us` the median span across an
episode's end (its metrics, `on_episode_end`, the next experience handed back, and under
`SqlLogger` the durable flush at the boundary). "Added" is an arm's figure less `bare@k`'s
in the same round; the median over rounds is reported, with the added time per metric
((rl_hooks@32 - rl_hooks@8) / 24).

(b) Rollout prediction rows. An experience of `--rows` RLHF-shaped rows (64 prompt tokens,
32 generated tokens, a reward) sampled whole by `Rollouts(size=rows)` and written through
the run handle (`RunHandle.evaluate`, as the loop does), so `SqlLogger` stores them with
`Store.write_eval`: timed from the sample to the commit (`lab_total`), and the write alone
(`lab_write`). The baseline gets the same list of prediction dicts and writes them with
raw `sqlite3` `executemany` into an equivalent table (WAL, synchronous=NORMAL, one commit).
Rows per second, medians over rounds.

Prints one JSON line.

    python bench/rl_hooks.py [--episodes 60] [--rounds 5] [--rows 20000] [--quick]
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _common import alternate, log, machine

import lab
from lab import Experiment
from lab.loop.evals import Evaluator
from lab.loop.handle import RunHandle
from lab.rl import EpisodeInfo, Experience, OnPolicyLoop, Rollouts
from lab.store import Store

BATCH, BATCHES = 32, 8  # rows per learn batch, learn batches per episode
KS = (8, 32)


class Listens(lab.Callback):
    """A callback on every RL hook, doing nothing: the cost of dispatching them."""

    def on_episode_start(self, state: Any, episode: int) -> None:
        pass

    def on_make_experience_start(self, state: Any, episode: int) -> None:
        pass

    def on_make_experience_end(self, state: Any, episode: int, experience: Any) -> None:
        pass

    def on_learn_epoch_start(self, state: Any, epoch: int) -> None:
        pass

    def on_learn_batch_start(self, state: Any, step_idx: int, batch: Any) -> None:
        pass

    def on_learn_batch_end(self, state: Any, step_idx: int, batch: Any, metrics: Any) -> None:
        pass

    def on_learn_epoch_end(self, state: Any, epoch: int) -> None:
        pass

    def on_episode_end(self, state: Any, episode: int) -> None:
        pass


def setup(episodes: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, list[Experience]]:
    torch.manual_seed(0)
    policy = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))
    rows = BATCH * BATCHES
    made = []
    for _ in range(episodes):
        obs = torch.randn(rows, 32)
        with torch.no_grad():
            dist = torch.distributions.Categorical(logits=policy(obs))
            actions = dist.sample()
            made.append(
                Experience(
                    action_log_probs=dist.log_prob(actions),
                    rewards=torch.randn(rows),
                    observations=obs,
                    actions=actions,
                    advantages=torch.randn(rows),
                )
            )
    return policy, torch.optim.SGD(policy.parameters(), lr=0.01), made


def spans(stamps: list[float], episodes: int) -> dict[str, float]:
    """Median time between learn calls inside an episode, and across an episode's end."""
    inside, boundary = [], []
    for n in range(1, len(stamps)):
        (boundary if n % BATCHES == 0 else inside).append(stamps[n] - stamps[n - 1])
    assert len(stamps) == episodes * BATCHES, len(stamps)
    skip = len(inside) // 10  # warm-up
    return {
        "per_batch_us": statistics.median(inside[skip:]) * 1e6,
        "boundary_us": statistics.median(boundary[1:]) * 1e6,
    }


def loss_of(
    policy: torch.nn.Module, batch: Experience, k: int, stamps: list[float]
) -> dict[str, Any]:
    stamps.append(time.perf_counter())
    dist = torch.distributions.Categorical(logits=policy(batch.observations))
    ratio = torch.exp(dist.log_prob(batch.actions) - batch.action_log_probs)
    adv = batch.advantages
    loss = -torch.min(ratio * adv, torch.clamp(ratio, 0.8, 1.2) * adv).mean()
    return {"loss": loss, **{f"extra_{i}": float(i) for i in range(k - 1)}}


def fit_bare(k: int, episodes: int) -> dict[str, float]:
    policy, opt, made = setup(episodes)
    generator = torch.Generator().manual_seed(0)
    stamps: list[float] = []
    t0 = time.perf_counter()
    for experience in made:
        for batch in experience.minibatches(BATCH, generator=generator):
            out = loss_of(policy, batch, k, stamps)
            opt.zero_grad(set_to_none=True)
            out["loss"].backward()
            opt.step()
            metrics = {"loss": out["loss"].item()}
            metrics.update((key, value) for key, value in out.items() if key != "loss")
    seconds = time.perf_counter() - t0
    assert len(metrics) == k
    return {"s": seconds, **spans(stamps, episodes)}


def fit_rl(k: int, episodes: int, callbacks: list[Any], url: str | None) -> dict[str, float]:
    policy, opt, made = setup(episodes)
    seconds: list[float] = []
    stamps: list[float] = []

    def make_experience(info: EpisodeInfo) -> Experience:
        return made[info.episode]

    def learn(batch: Experience, info: EpisodeInfo) -> dict[str, Any]:
        return loss_of(policy, batch, k, stamps)

    def train(run: Any) -> Any:
        loop = OnPolicyLoop(
            policy, opt, num_episodes=episodes, make_experience=make_experience, learn=learn,
            batch_size=BATCH, callbacks=callbacks,
        )  # fmt: skip
        t0 = time.perf_counter()
        art = loop.fit(run)
        seconds.append(time.perf_counter() - t0)
        return art

    if url is None:
        train(None)
    else:
        with tempfile.TemporaryDirectory() as folder:
            Experiment(
                "rl-bench", train, store=url, output_dir=folder, callbacks=[], fresh=True
            ).run()
    return {"s": seconds[0], **spans(stamps, episodes)}


def hooks_round(k: int, episodes: int, arm: str, folder: Path, i: int) -> dict[str, float]:
    if arm in ("bare", "aa"):
        return fit_bare(k, episodes)
    if arm == "rl":
        return fit_rl(k, episodes, [], None)
    url = f"sqlite:///{folder / f'{arm}-{k}-{i}.db'}"  # a fresh store per fit
    store = Store(url)
    store.close()
    callbacks = [Listens()] if arm == "rl_hooks" else []
    return fit_rl(k, episodes, callbacks, url)


# -- (b) rollouts ----------------------------------------------------------------------------
def rollout_experience(rows: int) -> Experience:
    g = torch.Generator().manual_seed(0)
    seq = torch.randint(0, 50_000, (rows, 96), generator=g)
    return Experience(
        action_log_probs=torch.zeros(rows, 32),
        rewards=torch.rand(rows, 32, generator=g),
        sequences=seq,
        attention_mask=torch.ones(rows, 96, dtype=torch.long),
        action_mask=torch.ones(rows, 32, dtype=torch.bool),
        example_ids=[f"prompt-{i:06d}" for i in range(rows)],
    )


def lab_rollouts(experience: Experience, folder: Path, i: int) -> dict[str, float]:
    url = f"sqlite:///{folder / f'rollouts-{i}.db'}"
    store = Store(url)
    store.close()
    out: dict[str, float] = {}
    model = torch.nn.Linear(1, 1)

    def train(run: Any) -> Any:
        with RunHandle(run, model, num_steps=None) as loop:
            t0 = time.perf_counter()
            sample = Rollouts(size=experience.size).sample(experience, seed=0, episode=0)
            t1 = time.perf_counter()
            loop.evaluate(Evaluator("rollouts", lambda _m: sample))
            t2 = time.perf_counter()
        out.update(s=t2 - t0, write_s=t2 - t1, predictions=sample.predictions)  # type: ignore[arg-type]
        return loop.artifacts

    Experiment("rollouts", train, store=url, output_dir=folder / f"runs-{i}", fresh=True).run()
    con = sqlite3.connect(folder / f"rollouts-{i}.db")
    count = con.execute("select count(*) from predictions").fetchone()[0]
    con.close()
    assert count == experience.size, count
    return out


TABLE = """CREATE TABLE raw_predictions (
    eval_id INTEGER NOT NULL, idx INTEGER NOT NULL, example_id TEXT, input TEXT,
    output TEXT, target TEXT, score DOUBLE, extras JSON, PRIMARY KEY (eval_id, idx))"""
INSERT = "INSERT INTO raw_predictions VALUES (?, ?, ?, ?, ?, ?, ?, ?)"


def raw_rollouts(predictions: list[dict[str, Any]], folder: Path, i: int) -> dict[str, float]:
    con = sqlite3.connect(folder / f"raw-{i}.db", isolation_level=None)
    con.execute("PRAGMA journal_mode=WAL")
    con.execute("PRAGMA synchronous=NORMAL")
    con.execute(TABLE)
    t0 = time.perf_counter()
    rows = [
        (1, n, p["example_id"], p["input"], p["output"], p["target"], float(p["score"]), None)
        for n, p in enumerate(predictions)
    ]
    con.execute("BEGIN IMMEDIATE")
    con.executemany(INSERT, rows)
    con.execute("COMMIT")
    seconds = time.perf_counter() - t0
    count = con.execute("select count(*) from raw_predictions").fetchone()[0]
    con.close()
    assert count == len(predictions)
    return {"s": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--quick", action="store_true", help="a smoke run of a few seconds")
    args = parser.parse_args()
    if args.quick:
        args.episodes, args.rounds, args.rows = 5, 2, 2_000
    torch.set_num_threads(1)
    arms = ("bare", "aa", "rl", "rl_sql", "rl_hooks")
    out: dict[str, Any] = {"bench": "rl_hooks", "machine": machine(torch_threads=1)}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        per_k: dict[str, Any] = {}
        counter = iter(range(10**6))
        for k in KS:
            results = alternate(
                args.rounds,
                {
                    arm: (lambda i, arm=arm, k=k: hooks_round(k, args.episodes, arm, folder,
                                                             next(counter)))
                    for arm in arms
                },
            )  # fmt: skip
            bare = [r["per_batch_us"] for r in results["bare"]]
            edge = [r["boundary_us"] for r in results["bare"]]
            per_k[str(k)] = {
                "bare_us": statistics.median(bare),
                "bare_boundary_us": statistics.median(edge),
                **{
                    f"{arm}_boundary_added_us": statistics.median(
                        r["boundary_us"] - b for r, b in zip(results[arm], edge, strict=True)
                    )
                    for arm in arms[1:]
                },
                **{
                    f"{arm}_added_us": statistics.median(
                        r["per_batch_us"] - b for r, b in zip(results[arm], bare, strict=True)
                    )
                    for arm in arms[1:]
                },
                **{
                    f"{arm}_added_pct": 100
                    * statistics.median(
                        r["per_batch_us"] / b - 1 for r, b in zip(results[arm], bare, strict=True)
                    )
                    for arm in arms[1:]
                },
            }
        out["learn_batch"] = per_k
        lo, hi = per_k[str(KS[0])], per_k[str(KS[1])]
        out["rl_hooks_us_per_metric"] = (hi["rl_hooks_added_us"] - lo["rl_hooks_added_us"]) / (
            KS[1] - KS[0]
        )
        out["rl_hooks_us_per_metric_at_8"] = lo["rl_hooks_added_us"] / KS[0]
        experience = rollout_experience(args.rows)
        lab_runs: list[dict[str, float]] = []
        raw_runs: list[dict[str, float]] = []
        for i in range(args.rounds):
            order = [0, 1] if i % 2 == 0 else [1, 0]
            for which in order:
                if which == 0:
                    lab_runs.append(lab_rollouts(experience, folder, i))
                    log(f"round {i + 1}: lab {lab_runs[-1]['s']:.3f} s")
                else:
                    preds = lab_runs[-1]["predictions"] if lab_runs else None
                    if preds is None:
                        preds = (
                            Rollouts(size=experience.size)
                            .sample(experience, seed=0, episode=0)
                            .predictions
                        )
                    raw_runs.append(raw_rollouts(preds, folder, i))  # type: ignore[arg-type]
                    log(f"round {i + 1}: raw {raw_runs[-1]['s']:.3f} s")
        rows = experience.size
        lab_total = statistics.median(rows / r["s"] for r in lab_runs)
        lab_write = statistics.median(rows / r["write_s"] for r in lab_runs)
        raw = statistics.median(rows / r["s"] for r in raw_runs)
        out["rollouts"] = {
            "rows": rows,
            "lab_total_rows_per_s": lab_total,
            "lab_write_rows_per_s": lab_write,
            "raw_rows_per_s": raw,
            "ratio_total": lab_total / raw,
            "ratio_write": lab_write / raw,
        }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
