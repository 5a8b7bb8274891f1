"""The on-policy RL loop: experience, episodes, saves at their boundaries, exact resume,
rollouts in the store, RL hyperparameters across arms, and ColossalChat's callbacks."""

from __future__ import annotations

import math
import os
import signal
import sqlite3
import sys
from pathlib import Path
from typing import Any

import pydantic
import pytest
import torch

import lab
import lab.inspect
from lab import Arm, Callback, CheckpointConfig, Experiment
from lab.errors import ConfigError, ExperienceError, LossError
from lab.loop.checkpoints import CheckpointManager
from lab.loop.handle import RunHandle
from lab.rl import EpisodeInfo, Episodes, Experience, OnPolicyLoop, Rollouts
from tests import warm

sys.path.insert(0, str(Path(__file__).parent))
from rl_chain import ChainWalk, make_loop

CHAIN = Path(__file__).parent / "rl_chain.py"


class RLConfig(pydantic.BaseModel):
    """RL hyperparameters an experiment's arms vary."""

    batch_size: int = 8
    learn_epochs: int = 1


class Steps(Callback):
    """Keeps each step's metrics."""

    def __init__(self) -> None:
        self.metrics: dict[int, dict[str, float]] = {}
        self.due: dict[int, bool] = {}

    def on_step_end(self, state: Any, step_idx: int, batch: Any, metrics: dict) -> None:
        self.metrics[step_idx] = dict(metrics)
        self.due[step_idx] = state.checkpoint_due


# --------------------------------------------------------------------------------------------
# Experience


def test_experience_tensors_that_disagree_in_batch_size_are_one_error() -> None:
    with pytest.raises(ExperienceError) as err:
        Experience(
            action_log_probs=torch.zeros(4),
            rewards=torch.zeros(4),
            values=torch.zeros(3),
            example_ids=["a", "b", "c", "d", "e"],
        )
    assert str(err.value) == (
        "Experience fields disagree in batch size (action_log_probs=4, rewards=4, values=3, "
        "example_ids=5); give every tensor the same size on dim 0"
    )
    assert isinstance(err.value, ConfigError)


def test_an_experience_field_that_is_no_tensor_is_one_error_that_names_torch_tensor() -> None:
    with pytest.raises(ExperienceError) as err:
        Experience(action_log_probs=torch.zeros(4), rewards=[0.0, 0.0, 0.0, 0.0])
    assert str(err.value) == (
        "Experience.rewards is a list; give a torch.Tensor with the batch on dim 0 (or None)"
    )


def test_experience_to_moves_every_tensor_and_keeps_the_missing_ones_missing() -> None:
    exp = Experience(
        action_log_probs=torch.zeros(3), rewards=torch.ones(3), values=torch.arange(3.0)
    )
    moved = exp.to("cpu")
    assert moved is not exp and moved.kl is None and moved.actions is None
    torch.testing.assert_close(moved.values, torch.arange(3.0))
    torch.testing.assert_close(moved.rewards, torch.ones(3))


def test_experience_minibatches_cover_every_row_once_in_the_generators_order() -> None:
    exp = Experience(
        action_log_probs=torch.arange(10.0),
        rewards=torch.arange(10.0).unsqueeze(1).repeat(1, 3),
        example_ids=[f"r{i}" for i in range(10)],
        episodes=Episodes([1.0], [3]),
    )
    assert exp.size == 10 and exp.reward is exp.rewards
    g = torch.Generator().manual_seed(5)
    batches = list(exp.minibatches(4, generator=g))
    assert [b.size for b in batches] == [4, 4, 2] and exp.num_minibatches(4) == 3
    seen = torch.cat([b.action_log_probs for b in batches])
    assert sorted(seen.tolist()) == list(range(10))
    order = torch.randperm(10, generator=torch.Generator().manual_seed(5))
    assert seen.tolist() == order.float().tolist()
    assert batches[0].example_ids == [f"r{i}" for i in order[:4].tolist()]
    assert all(b.episodes is None for b in batches)
    plain = [b.action_log_probs.tolist() for b in exp.minibatches(None, shuffle=False)]
    assert plain == [list(map(float, range(10)))]
    assert exp.row_returns().tolist() == [3.0 * i for i in range(10)]


def test_rows_are_episodes_without_episodes_and_the_action_mask_counts() -> None:
    exp = Experience(
        action_log_probs=torch.zeros(2, 3),
        rewards=torch.tensor([[1.0, 2.0, 4.0], [1.0, float("nan"), 8.0]]),
        action_mask=torch.tensor([[1, 1, 0], [1, 0, 1]]),
    )
    ended = exp.ended_episodes()
    assert ended.returns == [3.0, 9.0] and ended.lengths == [2, 2]


# --------------------------------------------------------------------------------------------
# the loop


def test_episode_metrics_join_each_episodes_last_step(tmp_path: Path) -> None:
    steps = Steps()
    env = ChainWalk()
    loop = make_loop(env, num_episodes=3, learn_epochs=2, batch_size=8, callbacks=[steps])
    art = loop.fit()
    assert art.step == 18  # 3 episodes x 2 epochs x 3 batches of 24 rows
    episode_steps = [s for s, m in steps.metrics.items() if "episode" in m]
    assert episode_steps == [6, 12, 18]
    last = steps.metrics[18]
    assert last["episode"] == 2.0 and last["env_steps"] == 72.0
    for key in ("loss", "loss/policy", "entropy", "approx_kl", "clip_fraction"):
        assert all(key in m for m in steps.metrics.values())
    assert {k for k in last if k.startswith(("episode/", "throughput/"))} == {
        "episode/return_mean", "episode/return_std", "episode/return_min",
        "episode/return_max", "episode/length_mean", "episode/count",
        "episode/nonfinite_rewards", "throughput/experience_per_s", "throughput/learn_per_s",
    }  # fmt: skip
    assert last["episode/nonfinite_rewards"] == 0.0
    assert last["episode/return_min"] <= last["episode/return_mean"] <= last["episode/return_max"]
    assert "episode" not in steps.metrics[5]


def test_nan_rewards_are_data_flagged_in_the_episode_metrics(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'lab.db'}"

    def train(run: lab.RunSpec) -> Any:
        env = ChainWalk(nan_reward_at=8)  # in episode 1 (6 env steps per episode)
        return make_loop(env, num_episodes=3, batch_size=12).fit(run)

    result = Experiment("nan", train, store=url, output_dir=tmp_path / "runs").run()
    assert result.runs[0].status == "completed"
    con = sqlite3.connect(tmp_path / "lab.db")
    flagged = con.execute(
        "select step, value from metrics where key = 'episode/nonfinite_rewards' order by step"
    ).fetchall()
    assert flagged == [(2, 0.0), (4, 1.0), (6, 0.0)]


def test_learn_must_return_a_scalar_loss() -> None:
    env = ChainWalk()
    loop = make_loop(env, num_episodes=1)
    loop._learn = lambda batch, info: {"loss/policy": torch.tensor(1.0)}
    with pytest.raises(LossError, match="learn returned dict; return a dict with a scalar 'loss'"):
        loop.fit()


def test_a_rollout_sample_larger_than_the_experience_is_one_error_and_the_run_is_kept(
    tmp_path: Path,
) -> None:
    url = f"sqlite:///{tmp_path / 'lab.db'}"

    def train(run: lab.RunSpec) -> Any:
        return make_loop(ChainWalk(), num_episodes=2, rollouts=Rollouts(size=25)).fit(run)

    result = Experiment("big", train, store=url, output_dir=tmp_path / "runs").run()
    run = result.runs[0]
    assert run.status == "failed"
    message = (
        "Rollouts(size=25) is larger than episode 0's experience (24 rows); sample at most 24 rows"
    )
    assert run.error == f"ConfigError: {message}"
    con = sqlite3.connect(tmp_path / "lab.db")
    assert con.execute("select status, error from runs").fetchall() == [
        ("failed", f"ConfigError: {message}")
    ]


# --------------------------------------------------------------------------------------------
# saves at episode boundaries, and resume


def _saved_steps(folder: Path) -> list[tuple[int, str]]:
    manager = CheckpointManager(folder / "checkpoints")
    return [(row.step, row.kind) for row in manager.history() if row.event == "save"]


def test_saves_fall_only_at_episode_boundaries_counted_in_episodes(tmp_path: Path) -> None:
    steps = Steps()
    config = CheckpointConfig(every=2, fixed_steps=[1], save_at_end=True)
    loop = make_loop(
        ChainWalk(), num_episodes=5, batch_size=8, checkpoint=config, run_dir=tmp_path / "r",
        callbacks=[steps],
    )  # fmt: skip
    loop.fit()
    # 3 steps per episode; episodes 1 (fixed), 2, 4 (every=2) and 5 (the end)
    assert _saved_steps(tmp_path / "r") == [(3, "fixed"), (6, "regular"), (12, "regular"),
                                            (15, "regular")]  # fmt: skip
    assert [s for s, due in steps.due.items() if due] == [3, 6, 12, 15]


def test_saves_counted_in_steps_fall_at_the_end_of_the_episode_that_crossed_them(
    tmp_path: Path,
) -> None:
    config = CheckpointConfig(every=4, save_at_end=False)
    loop = make_loop(
        ChainWalk(), num_episodes=4, batch_size=8, checkpoint=config, checkpoint_unit="steps",
        run_dir=tmp_path / "r",
    )  # fmt: skip
    loop.fit()
    # episodes end at steps 3, 6, 9, 12: (3, 6] holds 4, (6, 9] holds 8, (9, 12] holds 12
    assert _saved_steps(tmp_path / "r") == [(6, "regular"), (9, "regular"), (12, "regular")]


def test_a_resume_with_other_settings_is_one_error_naming_each_difference(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "r"
    kw: dict[str, Any] = {"checkpoint": CheckpointConfig(every=1), "run_dir": folder}
    make_loop(ChainWalk(), num_episodes=2, batch_size=8, **kw).fit()
    other = make_loop(
        ChainWalk(num_envs=3), num_episodes=3, batch_size=6, learn_epochs=2, n_steps=8, **kw
    )
    with pytest.raises(ConfigError) as err:
        other.fit()
    assert str(err.value) == (
        f"cannot resume from {folder / 'checkpoints' / 'step_000006'}: the loop's settings "
        "differ from those it was saved with (settings['num_envs'] 4 -> 3; "
        "settings['n_steps'] 6 -> 8; learn_epochs 1 -> 2; batch_size 8 -> 6); resume with "
        "the saved settings, or start fresh with resume=False (or a new run)"
    )
    assert _saved_steps(folder) == [(3, "regular"), (6, "regular")]  # nothing lost


def test_a_resume_continues_the_episodes(tmp_path: Path) -> None:
    kw: dict[str, Any] = {"checkpoint": CheckpointConfig(every=1), "run_dir": tmp_path / "r"}
    make_loop(ChainWalk(), num_episodes=2, batch_size=8, **kw).fit()
    steps = Steps()
    env = ChainWalk()
    art = make_loop(env, num_episodes=3, batch_size=8, callbacks=[steps], **kw).fit()
    assert art.step == 9 and sorted(steps.metrics) == [7, 8, 9]
    assert steps.metrics[9]["episode"] == 2.0 and steps.metrics[9]["env_steps"] == 72.0
    assert env.steps == 18  # the restored environment went on from its 12th step


def test_a_resume_continues_the_per_episode_schedule(tmp_path: Path) -> None:
    """The scheduler steps before the save at an episode's end (as TrainingLoop steps an
    epoch's before its save), so a resumed run learns its next episode at the rate an
    uninterrupted one has there."""

    def rates(folder: Path, num_episodes: int) -> list[float]:
        policy = torch.nn.Linear(1, 1)
        optimizer = torch.optim.SGD(policy.parameters(), lr=1.0)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda episode: 0.5**episode)
        seen: list[float] = []

        def make_experience(info: EpisodeInfo) -> Experience:
            seen.append(optimizer.param_groups[0]["lr"])
            return Experience(torch.zeros(2), torch.ones(2), observations=torch.ones(2, 1))

        OnPolicyLoop(
            policy,
            optimizer,
            num_episodes=num_episodes,
            make_experience=make_experience,
            learn=lambda batch, info: {"loss": policy(batch.observations).sum()},
            scheduler=scheduler,
            checkpoint=CheckpointConfig(every=1),
            run_dir=folder,
        ).fit()
        return seen

    assert rates(tmp_path / "straight", 4) == [1.0, 0.5, 0.25, 0.125]
    assert rates(tmp_path / "resumed", 2) == [1.0, 0.5]
    assert rates(tmp_path / "resumed", 4) == [0.25, 0.125]


def _losses(db: Path) -> list[tuple[int, float]]:
    con = sqlite3.connect(db)
    try:
        return con.execute(
            "select step, value from metrics where key = 'loss' order by step"
        ).fetchall()
    finally:
        con.close()


def _final_weights(folder: Path) -> dict[str, torch.Tensor]:
    manager = CheckpointManager(folder / "kill" / "base-r0" / "checkpoints")
    return manager.load(manager.get_latest_checkpoint_path())["model"]


def _child(folder: Path, episodes: int, kill_at: int | None = None) -> int:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)}
    if kill_at is not None:
        env["RL_CHAIN_KILL_AT"] = str(kill_at)
    proc = warm.run(
        [sys.executable, str(CHAIN), str(folder), str(episodes)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return proc.returncode


def test_sigkill_mid_episode_then_resume_equals_an_uninterrupted_run(tmp_path: Path) -> None:
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    assert _child(straight, 4) == 0
    # 6 steps per episode: step 16 is the 4th learn batch of episode 2 (saved after step 12)
    assert _child(killed, 4, kill_at=16) == -signal.SIGKILL
    assert _saved_steps(killed / "kill" / "base-r0")[-1] == (12, "regular")
    assert _child(killed, 4) == 0
    reference = _losses(straight / "lab.db")
    assert [step for step, _ in reference] == list(range(1, 25))
    assert _losses(killed / "lab.db") == reference
    want, got = _final_weights(straight), _final_weights(killed)
    assert want.keys() == got.keys()
    for key in want:
        assert torch.equal(want[key], got[key]), key


# --------------------------------------------------------------------------------------------
# RunHandle: saves where the loop says


def test_end_step_save_overrides_the_schedule(tmp_path: Path) -> None:
    steps = Steps()
    model = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    config = CheckpointConfig(every=2)
    with RunHandle(
        None, model, opt, num_steps=4, checkpoint=config, run_dir=tmp_path / "h",
        callbacks=[steps],
    ) as loop:  # fmt: skip
        loop.end_step({"loss": 1.0}, save=True)  # step 1: saved though not due
        loop.end_step({"loss": 1.0}, save=False)  # step 2: due, not saved
        loop.end_step({"loss": 1.0})  # step 3: the schedule: nothing
        loop.end_step({"loss": 1.0}, save=False)  # step 4: the last; finish saves it
    assert steps.due == {1: True, 2: False, 3: False, 4: False}
    assert _saved_steps(tmp_path / "h") == [(1, "regular"), (4, "regular")]


# --------------------------------------------------------------------------------------------
# rollouts in the store, arms over RL hyperparameters


def test_rollouts_across_arms_read_by_inspect_and_a_summary_by_final_return(
    tmp_path: Path,
) -> None:
    url = f"sqlite:///{tmp_path / 'lab.db'}"

    def train(run: lab.RunSpec) -> Any:
        env = ChainWalk(seed=run.seed)
        loop = make_loop(
            env, num_episodes=3, batch_size=run.config.batch_size,
            learn_epochs=run.config.learn_epochs, rollouts=Rollouts(size=4, every=2),
        )  # fmt: skip
        return loop.fit(run)

    exp = Experiment(
        "rl-arms", train, base_config=RLConfig(),
        arms=[Arm("one", learn_epochs=1), Arm("two", learn_epochs=2, batch_size=12)],
        repeats=2, store=url, output_dir=tmp_path / "runs",
    )  # fmt: skip
    result = exp.run()
    assert [r.status for r in result.runs] == ["completed"] * 4
    summary = result.summary("episode/return_mean", mode="max")
    rows = [r for r in summary.rows if r.metric == "episode/return_mean"]
    assert [(r.arm, r.n) for r in rows] == [("one", 2), ("two", 2)]
    assert all(r.ci_low <= r.mean <= r.ci_high for r in rows)

    con = lab.inspect.connect(url)
    ranked = lab.inspect.summary(con, "rl-arms", "episode/return_mean", "max").df()
    assert ranked["arm"].tolist() == ["one", "two"] and ranked["n"].tolist() == [2, 2]
    assert ranked["mean"].tolist() == pytest.approx([r.mean for r in rows])
    preds = lab.inspect.predictions(con, "rl-arms", "rollouts").df()
    # episodes 0 and 2 sampled, 4 rows each, in 4 runs; steps: before episode 0 and 2
    assert len(preds) == 32
    steps = sorted(set(zip(preds["arm"], preds["step"], strict=True)))
    assert steps == [("one", 0), ("one", 6), ("two", 0), ("two", 8)]
    assert set(preds["example_id"]) <= {f"env{i}" for i in range(4)}
    first = preds.iloc[0]
    assert first["input"].count(" ") == 4 and first["output"] in {"0", "1"}
    assert first["target"] is None or (
        isinstance(first["target"], float) and math.isnan(first["target"])
    )
    dis = lab.inspect.disagreements(con, "rl-arms", "rollouts", "one", "two", None).df()
    assert list(dis.columns)[:3] == ["example_id", "input", "target"] and len(dis) >= 1
    br = lab.inspect.breakdown(con, "rl-arms", "rollouts").df()
    assert br[["arm", "slice", "metric", "n"]].values.tolist() == [
        ["one", "all", "return_mean", 2], ["two", "all", "return_mean", 2]
    ]  # fmt: skip


def test_a_rollout_rows_score_is_its_return_at_its_first_step() -> None:
    """CartPole: every reward is 1.0, so a row's rewards summed say nothing; its return
    (the discounted reward to come, from `returns`) is its score. Without `returns`, the
    rewards summed; a sequence's return is read at its first step `action_mask` keeps."""
    returns = torch.tensor([9.5, 1.0, 5.25, 3.0, 7.75, 2.5])
    cartpole = Experience(
        action_log_probs=torch.zeros(6), rewards=torch.ones(6), returns=returns,
        observations=torch.zeros(6, 4), actions=torch.zeros(6, dtype=torch.long),
    )  # fmt: skip
    sample = Rollouts(size=6).sample(cartpole, seed=0, episode=0)
    assert [p["score"] for p in sample.predictions] == returns.tolist()
    assert sample.metrics["return_mean"] == pytest.approx(sum(returns.tolist()) / 6)
    plain = Experience(
        action_log_probs=torch.zeros(2), rewards=torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    )
    assert [p["score"] for p in Rollouts(size=2).sample(plain, seed=0, episode=0).predictions] == [
        3.0, 7.0,
    ]  # fmt: skip
    tokens = Experience(
        action_log_probs=torch.zeros(2, 3), rewards=torch.zeros(2, 3),
        returns=torch.tensor([[0.9, 0.8, 0.7], [0.6, 0.5, 0.4]]),
        action_mask=torch.tensor([[1, 1, 1], [0, 1, 1]]),
    )  # fmt: skip
    scores = [p["score"] for p in Rollouts(size=2).sample(tokens, seed=0, episode=0).predictions]
    assert scores == pytest.approx([0.9, 0.5])


def test_the_rollout_sample_never_changes_training() -> None:
    plain, sampled = Steps(), Steps()
    make_loop(ChainWalk(), num_episodes=2, batch_size=8, callbacks=[plain]).fit()
    make_loop(
        ChainWalk(), num_episodes=2, batch_size=8, callbacks=[sampled], rollouts=Rollouts(size=5)
    ).fit()
    assert [m["loss"] for m in plain.metrics.values()] == [
        m["loss"] for m in sampled.metrics.values()
    ]


# --------------------------------------------------------------------------------------------
# ColossalChat's callbacks, ported by renaming the import


def _token_loop(callbacks: list[Any], episodes: int = 3) -> OnPolicyLoop:
    """A tiny RLHF-shaped loop: 6 prompts of 3 tokens, 4 generated tokens, reward: 1s."""
    torch.manual_seed(0)
    vocab = 5
    policy = torch.nn.Sequential(torch.nn.Embedding(vocab, 8), torch.nn.Linear(8, vocab))

    def make_experience(info: EpisodeInfo) -> Experience:
        seq = torch.randint(0, vocab, (6, 3))
        log_probs = []
        for _ in range(4):
            dist = torch.distributions.Categorical(logits=policy(seq[:, -1]))
            token = dist.sample()
            log_probs.append(dist.log_prob(token))
            seq = torch.cat([seq, token[:, None]], 1)
        mask = torch.ones(6, 4, dtype=torch.bool)
        return Experience(
            action_log_probs=torch.stack(log_probs, 1), rewards=(seq[:, 3:] == 1).float(),
            sequences=seq, attention_mask=torch.ones_like(seq), action_mask=mask,
        )  # fmt: skip

    def learn(batch: Experience, info: EpisodeInfo) -> dict[str, Any]:
        logits = policy(batch.sequences[:, 2:-1])
        new = torch.distributions.Categorical(logits=logits).log_prob(batch.sequences[:, 3:])
        adv = batch.rewards - batch.rewards.mean()
        return {"loss": -(new * adv).mean()}

    opt = torch.optim.Adam(policy.parameters(), lr=0.01)
    return OnPolicyLoop(
        policy, opt, num_episodes=episodes, make_experience=make_experience, learn=learn,
        learn_epochs=2, batch_size=3, callbacks=callbacks, rollouts=Rollouts(size=2),
    )  # fmt: skip


def test_a_colossalchat_callback_runs_on_the_loop_by_renaming_its_import() -> None:
    from lab.rl.coati import Callback as CoatiCallback

    calls: list[tuple] = []

    class Counts(CoatiCallback):
        def on_fit_start(self) -> None:
            calls.append(("fit_start",))

        def on_episode_start(self, episode: int) -> None:
            calls.append(("episode_start", episode))

        def on_make_experience_end(self, experience: Any) -> None:
            calls.append(("made", experience.sequences.shape[0]))

        def on_learn_batch_end(self, experience: Any) -> None:
            calls.append(("learned", experience.sequences.shape[0]))

        def on_fit_end(self) -> None:
            calls.append(("fit_end",))

    _token_loop([Counts()], episodes=2).fit()
    per_episode = [("made", 6)] + [("learned", 3)] * 4
    assert calls == [
        ("fit_start",), ("episode_start", 0), *per_episode, ("episode_start", 1),
        *per_episode, ("fit_end",),
    ]  # fmt: skip


def test_the_ported_performance_evaluator_measures_both_throughputs(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from perf_evaluator import PerformanceEvaluator

    policy_params = 5 * 8 + 8 * 5 + 5
    perf = PerformanceEvaluator(policy_params, 0, 0, 0, ignore_episodes=1)
    _token_loop([perf], episodes=3).fit()
    assert perf.make_experience_num_samples == 12  # episodes 1 and 2, 6 prompts each
    assert perf.learn_num_samples == 24  # 2 epochs of 6 rows, twice
    assert perf.make_experience_duration > 0 and perf.learn_duration > 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "Performance summary:"
    assert out[1].startswith("Generate 12 samples, throughput: ")
    assert out[2].startswith("Train 24 samples, throughput: ")


def test_docs_show_the_ported_performance_evaluator_as_the_tests_run_it() -> None:
    port = (Path(__file__).parent / "perf_evaluator.py").read_text(encoding="utf-8")
    page = (Path(__file__).parent.parent / "docs" / "rl.md").read_text(encoding="utf-8")
    assert port[port.index("from time import time") :] in page


def test_the_coati_adapter_is_resolved_once_and_ordinary_callbacks_get_their_own_methods() -> None:
    from lab.dispatch import Dispatcher
    from lab.rl.coati import Callback as CoatiCallback

    class Ordinary(Callback):
        def on_episode_start(self, state: Any, episode: int) -> None:
            pass

    class Ported(CoatiCallback):
        def on_episode_start(self, episode: int) -> None:
            self.seen = episode

        def on_step_end(self, state: Any, step_idx: int, batch: Any, metrics: dict) -> None:
            self.step = step_idx

    ordinary, ported = Ordinary(), Ported()
    d = Dispatcher([ordinary, ported])
    (_, first, _), (_, second, _) = d._listeners["on_episode_start"]
    assert first == ordinary.on_episode_start  # the bound method itself: nothing in between
    assert second.__self__ is ported and second.method == ported.on_episode_start
    assert [name for name, _, _ in d._listeners["on_step_end"]] == ["Ported"]
    assert d._listeners["on_make_experience_start"] == ()  # overridden by neither
    assert [name for name, _, _ in d._listeners["on_train_start"]] == []  # no on_fit_start
    d.fire("on_episode_start", None, 3)
    assert ported.seen == 3
