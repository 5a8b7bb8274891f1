"""The same figure reads the same through every door: `ExperimentResult.summary` (Python),
`lab.inspect.summary` (DuckDB), ``lab show`` (a real subprocess) and the dashboard's API (the
real app, as ``lab ui`` serves it): each arm's n, mean, std and 95% interval of the headline
metric, and the best arm. For an RL run whose last episode ended no environment episode, for
the quickstart, and for the PPO and RLHF examples, at small sizes."""

from __future__ import annotations

import contextlib
import math
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient

import lab
import lab.inspect
from lab import Arm, Experiment
from lab._stats import spread
from lab._table import fmt
from lab.demo import quickstart
from lab.loop import EvalResult, Evaluator
from lab.rl import Episodes, Experience, OnPolicyLoop
from lab.server import create_app
from lab.store import Store
from tests import warm

ROOT = Path(__file__).resolve().parent.parent
API = "/api/v1/dashboard"


# -- the doors --------------------------------------------------------------------------------


def _lab(*args: str, cwd: Path | None = None) -> str:
    """A `lab` command's output, run as a user runs it."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("LAB_STORE_URL", None)
    done = warm.run(
        [sys.executable, "-m", "lab.cli", *args], capture_output=True, text=True, timeout=300,
        env=env, cwd=cwd,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


def _table(text: str, metric: str) -> tuple[list[tuple[str, ...]], str | None]:
    """A printed summary's rows of `metric` as (arm, n, mean, std, CI) strings, and its
    best-arm line."""
    rows = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 6 and parts[1] == metric and parts[2].isdigit():
            ci = " ".join(parts[5:])
            rows.append((parts[0], parts[2], parts[3], parts[4], ci))
    verdicts = [line for line in text.splitlines() if "best arm" in line or "best of" in line]
    assert len(verdicts) <= 1, verdicts  # one verdict, never two
    return rows, verdicts[0] if verdicts else None


def _formatted(n: int, mean: Any, std: Any, low: Any, high: Any) -> tuple[str, ...]:
    """An arm's numbers as a printed summary shows them."""
    return (
        str(n),
        fmt(mean if n > 0 else None),
        fmt(std if n > 1 else None),
        f"[{fmt(low)}, {fmt(high)}]" if n > 1 else "-",
    )


@contextlib.contextmanager
def _dashboard(url: str) -> Iterator[TestClient]:
    """The dashboard as `lab ui` serves it: the real app over the store, read-only."""
    store = Store(url, readonly=True)
    try:
        with TestClient(create_app(store, auth=False, writes=False),
                        base_url="http://127.0.0.1") as client:  # fmt: skip
            yield client
    finally:
        store.close()


def assert_doors_agree(
    url: str,
    result: lab.ExperimentResult | None,
    name: str,
    metric: str,
    mode: str,
    printed: str | None = None,
) -> dict[str, Any]:
    """Every door's arms, n, mean, std, interval and best arm of `metric`, held equal: exact
    numbers between Python, DuckDB and the dashboard, the same text in the printed
    summaries (`printed`: what the program printed, and ``lab show``'s). The experiment's
    declared metric is the default of every door. Returns inspect's rows by arm."""
    con = lab.inspect.connect(url)
    relation = lab.inspect.summary(con, name)  # the experiment's metric and mode
    inspect = [dict(zip(relation.columns, row, strict=True)) for row in relation.fetchall()]
    assert inspect == [
        dict(zip(relation.columns, row, strict=True))
        for row in lab.inspect.summary(con, name, metric, mode).fetchall()
    ]
    best = [r["arm"] for r in inspect if r["is_best"]]
    assert len(best) == 1
    by_arm = {r["arm"]: r for r in inspect}
    assert all(r["n"] >= 1 for r in inspect)

    if result is not None:  # Python: the same floats, bit for bit
        summary = result.summary()
        assert (summary.metric, summary.mode, summary.best_arm) == (metric, mode, best[0])
        rows = [r for r in summary.rows if r.metric == metric]
        assert [(r.arm, r.n) for r in rows] == [(r["arm"], r["n"]) for r in inspect]
        for row in rows:
            want = by_arm[row.arm]
            assert row.mean == want["mean"]
            if row.n > 1:
                assert (row.std, row.ci_low, row.ci_high) == (
                    want["std"], want["ci_low"], want["ci_high"],
                )  # fmt: skip

    with _dashboard(url) as client:  # the dashboard: the experiment page and the list
        page = client.get(f"{API}/experiments/{name}").json()
        assert (page["metric"], page["mode"]) == (metric, mode)
        got = [{k: r[k] for k in ("arm", "n", "rank", "is_best")} for r in page["summary"]]
        assert got == [{k: r[k] for k in ("arm", "n", "rank", "is_best")} for r in inspect]
        for r in page["summary"]:
            for key in ("mean", "std", "ci_low", "ci_high"):
                assert r[key] == by_arm[r["arm"]][key], (r, key)
        listed = client.get(f"{API}/experiments", params={"q": name}).json()["rows"]
        assert [(e["best_arm"], e["metric"], e["mode"]) for e in listed if e["name"] == name] == [
            (best[0], metric, mode)
        ]

    shown = _lab("show", name, "--store", url)  # the CLI: its own summary section
    section = shown.split("\nsummary\n", 1)[1]
    table, verdict = _table(section, metric)
    want_rows = [
        (r["arm"], *_formatted(r["n"], r["mean"], r["std"], r["ci_low"], r["ci_high"]))
        for r in inspect
    ]
    assert table == want_rows
    assert verdict is not None and verdict.startswith(
        f"best arm by {metric} ({mode}): {best[0]} ({fmt(by_arm[best[0]]['mean'])})"
    )
    if printed is not None:  # what the program printed: the same rows and verdict
        assert _table(printed, metric) == (table, verdict)
    return by_arm


# -- a run's final value: the last value it logged -------------------------------------------


def _bandit_train(run: lab.RunSpec) -> lab.LoopArtifacts:
    """Four episodes of a two-armed bandit whose environment episodes end in episodes 0-2
    only: the last episode logs no return keys (documented). Step metrics: `loss` every step,
    `odd` at odd steps only (NaN at the last odd one), an eval every 2 steps."""
    torch.manual_seed(run.seed)
    policy = torch.nn.Linear(1, 2)
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.1)
    rewards = torch.tensor([0.2, 0.8]) + 0.1 * run.repeat * (1 if run.arm == "good" else -1)

    def make_experience(info: Any) -> Experience:
        logits = policy(torch.ones(8, 1))
        dist = torch.distributions.Categorical(logits=logits)
        actions = torch.multinomial(dist.probs, 1, generator=info.generator).squeeze(1)
        reward = rewards[actions]
        ended = (
            Episodes([float(reward.sum())], [8]) if info.episode < 3 else Episodes()
        )  # the last episode: no environment episode ended
        return Experience(
            action_log_probs=dist.log_prob(actions), rewards=reward,
            observations=torch.ones(8, 1), actions=actions, episodes=ended,
        )  # fmt: skip

    def learn(batch: Experience, info: Any) -> dict[str, Any]:
        dist = torch.distributions.Categorical(logits=policy(batch.observations))
        loss = -(dist.log_prob(batch.actions) * batch.rewards).mean()
        out: dict[str, Any] = {"loss": loss}
        if info.episode % 2 == 1:
            out["odd"] = math.nan if info.episode == 3 else float(info.episode)
        return out

    loop = OnPolicyLoop(
        policy, optimizer, num_episodes=4, make_experience=make_experience, learn=learn,
        batch_size=4, evaluators=[Evaluator("val", lambda m: {"w": float(m.weight.sum())},
                                            every=2)],
    )  # fmt: skip
    return loop.fit(run)


@pytest.fixture(scope="module")
def bandit(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, lab.ExperimentResult]:
    folder = tmp_path_factory.mktemp("bandit")
    url = f"sqlite:///{folder / 'lab.db'}"
    result = Experiment(
        "bandit", _bandit_train, arms=[Arm("good"), Arm("bad")], repeats=2, store=url,
        output_dir=folder / "runs", metric="episode/return_mean", mode="max",
    ).run()  # fmt: skip
    assert [r.status for r in result.runs] == ["completed"] * 4
    return url, result


def test_a_runs_final_values_are_the_last_logged_in_python_and_in_the_store(
    bandit: tuple[str, lab.ExperimentResult],
) -> None:
    url, result = bandit
    con = lab.inspect.connect(url)
    stored = {
        (run_key, key): value
        for run_key, key, value in con.sql(
            "SELECT run_key, key, value FROM final_metrics WHERE experiment = 'bandit'"
        ).fetchall()
    }
    last = con.sql(  # the last episode's step logged no return: the value is the one before
        "SELECT DISTINCT f.step < r.last FROM final_metrics f JOIN (SELECT run_id, max(step) "
        "AS last FROM metrics GROUP BY run_id) r USING (run_id) "
        "WHERE f.key = 'episode/return_mean'"
    ).fetchall()
    assert last == [(True,)]
    for run in result.runs:
        mine = {key: value for (run_key, key), value in stored.items() if run_key == run.run_key}
        assert sorted(run.metrics) == sorted(mine)  # every key, in both
        for key, value in run.metrics.items():
            assert value == mine[key] or (math.isnan(value) and math.isnan(mine[key])), key
        assert math.isnan(run.metrics["odd"])  # NaN at its last step: data, kept
        assert run.metrics["episode/return_mean"] == run.metrics["episode/return_max"]


def test_rl_episode_metrics_read_the_same_through_every_door(
    bandit: tuple[str, lab.ExperimentResult],
) -> None:
    url, result = bandit
    rows = assert_doors_agree(url, result, "bandit", "episode/return_mean", "max")
    assert {arm: r["n"] for arm, r in rows.items()} == {"good": 2, "bad": 2}
    assert rows["good"]["is_best"]


def test_a_summary_ranks_no_arm_when_a_run_lacks_the_metric(tmp_path: Path) -> None:
    def train(run: lab.RunSpec) -> dict[str, float]:
        return {"loss": 1.0} if run.run_key == "a-r1" else {"loss": 2.0, "acc": 0.5}

    result = Experiment(
        "lacking", train, arms=[Arm("a"), Arm("b")], repeats=2, store=False
    ).run()  # fmt: skip
    summary = result.summary("acc", "max")
    assert (summary.best_arm, summary.runner_up, summary.margin) == (None, None, None)
    assert str(summary).splitlines()[-1] == (
        "no best arm: metric 'acc' is missing from 1 of 4 runs of experiment 'lacking': a-r1"
    )
    assert summary.row("a", "acc").n == 1  # the rows still show what there is


# -- the quickstart and the examples ---------------------------------------------------------


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, lab.ExperimentResult]:
    """The quickstart at 60 steps (the experiment `lab quickstart` runs)."""
    folder = tmp_path_factory.mktemp("quickstart")
    url = f"sqlite:///{folder / 'lab.db'}"
    return url, quickstart(url, output_dir=folder / "runs", steps=60)


def test_the_quickstart_reads_the_same_through_every_door(
    quick: tuple[str, lab.ExperimentResult],
) -> None:
    url, result = quick
    rows = assert_doors_agree(url, result, "quickstart", "val/loss", "min", str(result.summary()))
    assert {arm: r["n"] for arm, r in rows.items()} == {"sgd-lr0.01": 3, "sgd-lr0.1": 3}
    con = lab.inspect.connect(url)  # holdout/acc, declared (0, 1): inside it in every door
    acc = lab.inspect.summary(con, "quickstart", "holdout/acc", "max").fetchall()
    assert all(0 <= r[4] <= r[5] <= 1 for r in acc)
    python = [r for r in result.summary().rows if r.metric == "holdout/acc"]
    assert [(r.ci_low, r.ci_high) for r in python] == [(r[4], r[5]) for r in acc]


def _example(script: str, folder: Path, *flags: str) -> str:
    """Run an example as a user would, in `folder`; its printed summary."""
    paths = [str(ROOT), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    env.pop("LAB_STORE_URL", None)
    folder.mkdir(exist_ok=True)
    done = warm.run(
        [sys.executable, str(ROOT / "examples" / script), *flags], cwd=folder, env=env,
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_the_ppo_example_reads_the_same_through_every_door(tmp_path: Path) -> None:
    out = _example(
        "ppo_cartpole.py", tmp_path, "--n-timesteps", "192", "--n-envs", "1", "--n-steps", "8",
        "--batch-size", "8", "--n-epochs", "1", "--rollouts", "2",
    )  # fmt: skip
    url = f"sqlite:///{tmp_path / 'lab.db'}"
    con = lab.inspect.connect(url)
    lacking = con.sql(  # runs whose last episode ended no CartPole episode: the case at hand
        "SELECT count(*) FROM (SELECT run_id, max(step) AS last FROM metrics GROUP BY run_id) r "
        "JOIN final_metrics f USING (run_id) WHERE f.key = 'episode/return_mean' "
        "AND f.step < r.last"
    ).fetchone()
    assert lacking is not None and lacking[0] >= 1
    rows = assert_doors_agree(url, None, "ppo_cartpole", "episode/return_mean", "max", out)
    assert {arm: r["n"] for arm, r in rows.items()} == {"zoo": 2, "lambda-0.95": 2}


def test_the_rlhf_example_reads_the_same_through_every_door(tmp_path: Path) -> None:
    out = _example("rlhf.py", tmp_path, "--episodes", "6", "--save-every", "5")
    url = f"sqlite:///{tmp_path / 'lab.db'}"
    rows = assert_doors_agree(url, None, "rlhf", "episode/return_mean", "max", out)
    assert {arm: r["n"] for arm, r in rows.items()} == {"kl-0.04": 2, "kl-0.4": 2}
    assert all(0 <= r["ci_low"] <= r["ci_high"] <= 1 for r in rows.values())  # declared (0, 1)


# -- declared ranges: every interval of a bounded metric stays inside them -------------------


def _accurate(run: lab.RunSpec) -> lab.LoopArtifacts:
    """Accuracies of 1, 1 and 0.9375 over the repeats (a t interval reaches above 1), kept
    in the model's bias for the benchmark to read."""
    acc = [1.0, 1.0, 0.9375][run.repeat]
    model = torch.nn.Linear(1, 1)
    torch.nn.init.constant_(model.bias, acc)
    with lab.RunHandle(run, model, None, num_steps=3) as loop:
        for _ in loop.steps():
            loop.end_step({"acc": acc, "loss": 1.0 - acc})
    assert loop.artifacts is not None
    return loop.artifacts


def _holdout(model: torch.nn.Module) -> EvalResult:
    acc = float(model.bias)
    return EvalResult("holdout", {"acc": acc}, breakdowns={"all": {"acc": acc}})


def test_declared_bounds_hold_in_every_door(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'lab.db'}"

    result = Experiment(
        "bounded", _accurate, repeats=3, store=url, output_dir=tmp_path / "runs",
        benchmarks=[Evaluator("holdout", _holdout)],
        metric="acc", mode="max",
        bounds={"acc": (0, 1), "holdout/acc": (0, 1), "loss": (0, math.inf)},
    ).run()  # fmt: skip
    assert spread([1.0, 1.0, 0.9375]).ci_high > 1  # what an undeclared interval reaches
    python = result.summary()
    assert [(r.metric, r.ci_high) for r in python.rows if r.metric.endswith("acc")] == [
        ("acc", 1.0), ("holdout/acc", 1.0),
    ]  # fmt: skip
    assert python.row("base", "loss").ci_low == 0.0  # (0, inf): a loss, clipped at 0 only
    con = lab.inspect.connect(url)
    assert lab.inspect.summary(con, "bounded").fetchall()[0][5] == 1.0
    loss = lab.inspect.summary(con, "bounded", "loss").fetchall()[0]
    assert (loss[4], loss[5]) == (0.0, python.row("base", "loss").ci_high)
    breakdown = lab.inspect.breakdown(con, "bounded", "holdout").fetchall()
    assert [(r[1], r[2], r[7]) for r in breakdown] == [("all", "acc", 1.0)]
    assert 0 < breakdown[0][6] < 1
    curves = lab.inspect.curves(con, "bounded", "acc").fetchall()
    assert [r[6] for r in curves] == [1.0, 1.0, 1.0]
    with _dashboard(url) as client:
        page = client.get(f"{API}/experiments/bounded").json()
        assert [r["ci_high"] for r in page["summary"]] == [1.0]
        table = client.get(f"{API}/experiments/bounded/breakdown",
                           params={"eval": "holdout"}).json()["rows"]  # fmt: skip
        assert [(r["ci_low"], r["ci_high"]) for r in table] == [breakdown[0][6:8]]
        curve = client.get(f"{API}/experiments/bounded/curves",
                           params={"metric": "acc", "buckets": 10}).json()  # fmt: skip
        assert curve["arms"][0]["ci_high"] == [1.0, 1.0, 1.0]
    shown = _lab("show", "bounded", "--store", url).split("\nsummary\n", 1)[1]
    assert _table(shown, "acc")[0] == [
        (
            "base",
            "3",
            fmt(python.row("base", "acc").mean),
            fmt(python.row("base", "acc").std),
            f"[{fmt(python.row('base', 'acc').ci_low)}, 1]",
        )
    ]


def test_breakdown_takes_bounds_and_refuses_a_value_outside_them(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'lab.db'}"
    Experiment(
        "plain", _accurate, repeats=3, store=url, output_dir=tmp_path / "runs",
        benchmarks=[Evaluator("holdout", _holdout)],
    ).run()  # fmt: skip
    con = lab.inspect.connect(url)
    assert lab.inspect.breakdown(con, "plain", "holdout").fetchall()[0][7] > 1  # undeclared
    for bounds in ({"acc": (0, 1)}, (0, 1)):
        assert lab.inspect.breakdown(con, "plain", "holdout", bounds=bounds).fetchall()[0][7] == 1
    with pytest.raises(lab.errors.ConfigError) as err:
        lab.inspect.breakdown(con, "plain", "holdout", bounds={"acc": (0, 0.5)})
    assert str(err.value) == (
        "metric 'holdout/acc' has 1.0 outside bounds=(0, 0.5); declare the metric's real range, "
        "or leave bounds out"
    )


# -- "correct": defined for a discrete target only --------------------------------------------


def test_correct_is_null_for_a_regression_and_a_fraction_for_a_classification(
    quick: tuple[str, lab.ExperimentResult], tmp_path: Path
) -> None:
    url, _ = quick  # the quickstart's holdout: a regression, its score a hit within 0.2
    con = lab.inspect.connect(url)
    rows = lab.inspect.disagreements(
        con, "quickstart", "holdout", "sgd-lr0.01", "sgd-lr0.1", None
    ).fetchall()  # fmt: skip
    assert len(rows) == 64
    assert {(r[7], r[8]) for r in rows} == {(None, None)}  # correct_a, correct_b
    scores = [r[5] for r in rows] + [r[6] for r in rows]  # hit rates over 3 repeats say it
    assert all(round(3 * score, 9) in (0, 1, 2, 3) for score in scores)
    with _dashboard(url) as client:
        answer = client.get(f"{API}/experiments/quickstart/disagreements", params={
            "eval": "holdout", "arm_a": "sgd-lr0.01", "arm_b": "sgd-lr0.1"}).json()  # fmt: skip
        assert {(r["correct_a"], r["correct_b"]) for r in answer["rows"]} == {(None, None)}

    def classify(model: torch.nn.Module) -> EvalResult:
        right = float(model.bias) > 0  # arm "a" gets every example right, "b" none
        return EvalResult("test", {"acc": float(right)}, predictions=[
            {"example_id": f"s{i}", "output": "pos" if right else "neg", "target": "pos",
             "score": float(right)} for i in range(2)
        ] + [
            {"example_id": f"n{i}", "output": 3 if right else 1, "target": 3} for i in range(2)
        ])  # fmt: skip

    def train(run: lab.RunSpec) -> lab.LoopArtifacts:
        model = torch.nn.Linear(1, 1)
        torch.nn.init.constant_(model.bias, 1.0 if run.arm == "a" else -1.0)
        with lab.RunHandle(run, model, None, num_steps=1) as loop:
            for _ in loop.steps():
                loop.end_step({"loss": 0.0})
        assert loop.artifacts is not None
        return loop.artifacts

    other = f"sqlite:///{tmp_path / 'lab.db'}"
    Experiment(
        "classes", train, arms=[Arm("a"), Arm("b")], store=other, output_dir=tmp_path / "runs",
        benchmarks=[Evaluator("test", classify)],
    ).run()  # fmt: skip
    con = lab.inspect.connect(other)
    got = lab.inspect.disagreements(con, "classes", "test", "a", "b", None).fetchall()
    assert sorted((r[0], r[7], r[8], r[9]) for r in got) == [
        ("n0", 1.0, 0.0, 1.0), ("n1", 1.0, 0.0, 1.0),  # integer classes: no score, correct
        ("s0", 1.0, 0.0, 1.0), ("s1", 1.0, 0.0, 1.0),
    ]  # fmt: skip
