"""examples/rlhf.py, ColossalChat's GRPO loop in miniature: its pieces on hand-made sequences,
then a short Experiment of two KL arms x 2 repeats into a SQLite file, whose reward rises and
whose rollouts `lab.inspect` reads back across the arms."""

from __future__ import annotations

import importlib.util
import os
import sys
from collections import defaultdict
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

import lab.inspect
from lab import Arm, Callback, Experiment
from lab.errors import ConfigError
from lab.rl import Experience, Rollouts
from tests import warm

ROOT = Path(__file__).resolve().parent.parent
EPISODES, ROLLOUTS, PROMPTS, GROUP = 40, 16, 8, 8


@pytest.fixture(scope="module")
def rlhf() -> ModuleType:
    """examples/rlhf.py as a module (its folder on sys.path, as `python examples/rlhf.py`
    has it, for `_lab`)."""
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        spec = importlib.util.spec_from_file_location("rlhf_example", ROOT / "examples/rlhf.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(ROOT / "examples"))


def _tokens(rlhf: ModuleType, text: str) -> list[int]:
    return [rlhf.EOS if t == "<eos>" else rlhf.PAD if t == "_" else int(t) for t in text.split()]


def test_the_reward_scores_each_answer_position_against_the_sequence(rlhf: ModuleType) -> None:
    sequences = torch.tensor(
        [
            _tokens(rlhf, "3 5 7 9 11 1 <eos>"),  # right
            _tokens(rlhf, "0 3 6 9 0 3 <eos>"),  # right, across 12
            _tokens(rlhf, "3 5 7 9 <eos> _ _"),  # ends early: 1 of 4
            _tokens(rlhf, "3 5 7 9 11 2 1"),  # two right, no end token
            _tokens(rlhf, "4 5 6 8 7 8 9"),  # right terms one position late: 0
        ]
    )
    assert rlhf.reward(sequences).tolist() == [1.0, 1.0, 0.25, 0.5, 0.0]
    assert rlhf.decode(torch.tensor(_tokens(rlhf, "9 <eos> _ _"))) == "9 <eos>"


def test_prompts_are_the_same_in_every_run_and_cycle_through_all_36(rlhf: ModuleType) -> None:
    seen = torch.cat([rlhf.episode_prompts(e, 8) for e in range(9)])  # 72 = 2 x 36
    assert len({tuple(p) for p in seen[:36].tolist()}) == 36
    assert torch.equal(seen[:36], seen[36:])
    torch.manual_seed(123)  # the global RNG does not choose them
    assert torch.equal(rlhf.episode_prompts(3, 8), seen[24:32])


def test_generation_masks_the_answer_and_the_padding_after_its_end(rlhf: ModuleType) -> None:
    torch.manual_seed(0)
    policy = rlhf.Policy()
    with torch.no_grad():  # an end token after exactly one answer token, in every row
        policy.head.bias.fill_(-1e4)
        policy.head.bias[rlhf.EOS] = 0.0
    prompts = rlhf.episode_prompts(0, 4)
    generator = torch.Generator().manual_seed(0)
    sequences, attention, action_mask = rlhf.generate(policy, prompts, generator)
    assert sequences.shape == (4, rlhf.PROMPT_LEN + rlhf.MAX_NEW)
    assert torch.equal(sequences[:, :3], prompts)
    assert sequences[:, 3:].tolist() == [[rlhf.EOS, rlhf.PAD, rlhf.PAD, rlhf.PAD]] * 4
    assert action_mask.tolist() == [[1, 0, 0, 0]] * 4
    assert torch.equal(attention, torch.cat([torch.ones(4, 3, dtype=torch.long), action_mask], 1))
    log_probs = rlhf.token_log_probs(policy, sequences, attention)
    assert log_probs.shape == (4, rlhf.MAX_NEW)
    torch.testing.assert_close(log_probs[:, 0], torch.zeros(4))  # the end token: p = 1


def test_a_describe_functions_extras_are_the_rows_extras(rlhf: ModuleType) -> None:
    experience = Experience(
        action_log_probs=torch.zeros(2, rlhf.MAX_NEW),
        rewards=torch.tensor([1.0, 0.25]),
        sequences=torch.tensor(
            [_tokens(rlhf, "3 5 7 9 11 1 <eos>"), _tokens(rlhf, "0 3 6 9 <eos> _ _")]
        ),
        action_mask=torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]]),
        example_ids=["3 5 7", "0 3 6"],
    )
    sample = Rollouts(size=2, describe=rlhf.describe).sample(experience, seed=0, episode=0)
    assert sample.predictions == [
        {"example_id": "3 5 7", "input": "3 5 7", "output": "9 11 1 <eos>", "target": None,
         "score": 1.0, "right_answer": "9 11 1 <eos>"},
        {"example_id": "0 3 6", "input": "0 3 6", "output": "9 <eos>", "target": None,
         "score": 0.25, "right_answer": "9 0 3 <eos>"},
    ]  # fmt: skip
    clash = Rollouts(size=1, describe=lambda e, i: {"output": "x", "extras": {"score": 2}})
    with pytest.raises(ConfigError) as info:
        clash.sample(experience, seed=0, episode=0)
    assert str(info.value) == (
        "Rollouts(describe=...) gave extras named like a prediction's own fields: score; "
        "rename them"
    )


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--group-size", "1"],
            "--group-size: give 2 or more; GRPO scores each answer against the others",
        ),
        (
            ["--rollouts", "65"],
            "--rollouts: give 1 to 64 (--prompts x --group-size, the answers an episode makes)",
        ),
    ],
)
def test_flags_that_cannot_run_are_one_line_before_any_run(
    flags: list[str], message: str, tmp_path: Path
) -> None:
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    proc = warm.run(
        [sys.executable, str(ROOT / "examples/rlhf.py"), *flags],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[-1] == f"rlhf.py: error: {message}"
    assert list(tmp_path.iterdir()) == []  # no store, no run folder


class Experiences(Callback):
    """Keeps what each run's episodes made: the prompts' ids and the first Experience."""

    def __init__(self) -> None:
        self.ids: dict[tuple[str, int], list[list[str]]] = defaultdict(list)
        self.first: dict[tuple[str, int], Experience] = {}

    def on_make_experience_end(self, state: Any, episode: int, experience: Experience) -> None:
        run = (state.ctx.arm, state.ctx.repeat)
        self.ids[run].append(list(experience.example_ids or []))
        self.first.setdefault(run, experience)


@pytest.fixture(scope="module")
def experiment(
    rlhf: ModuleType, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Any, str, Experiences]:
    """Two KL arms x 2 repeats of EPISODES episodes, into a SQLite file."""
    folder = tmp_path_factory.mktemp("rlhf")
    url = f"sqlite:///{folder / 'lab.db'}"
    seen = Experiences()
    config = rlhf.Config(episodes=EPISODES, rollouts=ROLLOUTS, save_every=20)
    result = Experiment(
        "rlhf",
        rlhf.train_run,
        base_config=config,
        arms=[Arm("kl-0.04", kl_coef=0.04), Arm("kl-0.4", kl_coef=0.4)],
        repeats=2,
        seed=1,
        callbacks=[seen],
        store=url,
        output_dir=folder / "runs",
    ).run()
    return result, url, seen


@pytest.mark.slow
def test_the_experience_holds_what_grpo_needs_and_every_arm_sees_the_same_prompts(
    rlhf: ModuleType, experiment: tuple[Any, str, Experiences]
) -> None:
    result, _, seen = experiment
    assert [r.status for r in result.runs] == ["completed"] * 4
    rows = PROMPTS * GROUP
    for experience in seen.first.values():
        assert experience.size == rows
        assert experience.sequences.shape == (rows, rlhf.PROMPT_LEN + rlhf.MAX_NEW)
        assert experience.attention_mask.shape == experience.sequences.shape
        # padding only after an answer's end token: the policy never generates it
        assert torch.equal(experience.attention_mask.bool(), experience.sequences != rlhf.PAD)
        assert torch.equal(experience.action_mask, experience.attention_mask[:, 3:])
        assert experience.action_mask.shape == (rows, rlhf.MAX_NEW)
        assert experience.action_log_probs.shape == (rows, rlhf.MAX_NEW)
        assert experience.kl.shape == (rows, rlhf.MAX_NEW)
        assert experience.rewards.shape == experience.advantages.shape == (rows,)
        # the first episode acts with the reference itself: no KL yet
        assert experience.kl.abs().max().item() < 1e-5
        group_sums = experience.advantages.view(PROMPTS, GROUP).sum(dim=1)
        torch.testing.assert_close(group_sums, torch.zeros(PROMPTS), atol=1e-4, rtol=0)
        assert experience.example_ids[::GROUP] == [
            rlhf.decode(p) for p in rlhf.episode_prompts(0, PROMPTS)
        ]
    ids = list(seen.ids.values())
    assert len(ids) == 4 and all(len(run) == EPISODES for run in ids)
    assert all(run == ids[0] for run in ids)  # the same prompts, episode by episode


@pytest.mark.slow
def test_the_reward_rises_in_every_run(experiment: tuple[Any, str, Experiences]) -> None:
    _, url, _ = experiment
    con = lab.inspect.connect(url)
    try:
        rows = con.sql(
            "SELECT r.run_key, m.value FROM metrics m JOIN runs r USING (run_id) "
            "WHERE m.key = 'episode/return_mean' ORDER BY r.run_key, m.step"
        ).fetchall()
    finally:
        con.close()
    curves: dict[str, list[float]] = defaultdict(list)
    for run_key, value in rows:
        curves[run_key].append(value)
    assert sorted(curves) == ["kl-0.04-r0", "kl-0.04-r1", "kl-0.4-r0", "kl-0.4-r1"]
    late = {}
    for run_key, curve in curves.items():
        assert len(curve) == EPISODES
        first, late[run_key] = sum(curve[:10]) / 10, sum(curve[-10:]) / 10
        assert late[run_key] > first + 0.05, (run_key, first, late[run_key])
    # the loose leash to the reference learns faster than the tight one
    assert min(late["kl-0.04-r0"], late["kl-0.04-r1"]) > max(late["kl-0.4-r0"], late["kl-0.4-r1"])


@pytest.mark.slow
def test_rollouts_are_prediction_rows_that_inspect_reads_across_arms(
    rlhf: ModuleType, experiment: tuple[Any, str, Experiences]
) -> None:
    _, url, _ = experiment
    con = lab.inspect.connect(url)
    try:
        predictions = lab.inspect.predictions(con, "rlhf", "rollouts").df()
        disagreements = lab.inspect.disagreements(
            con, "rlhf", "rollouts", "kl-0.04", "kl-0.4", limit=None
        ).df()
        breakdown = lab.inspect.breakdown(con, "rlhf", "rollouts").df()
    finally:
        con.close()

    assert len(predictions) == 4 * EPISODES * ROLLOUTS  # runs x episodes x Rollouts.size
    per_run = predictions.groupby("run_key").size().to_dict()
    assert per_run == dict.fromkeys(per_run, EPISODES * ROLLOUTS) and len(per_run) == 4
    # each episode's sample sits at the step of the policy that acted: 2 learn batches an
    # episode, so episodes 0, 1, ... at steps 0, 2, ...
    steps = sorted(set(predictions["step"].tolist()))
    assert steps == [2 * e for e in range(EPISODES)]
    # a row: the prompt, the decoded answer, its reward as score, the right answer beside it
    assert (predictions["example_id"] == predictions["input"]).all()
    assert predictions["target"].isna().all()
    for row in predictions.itertuples():
        sequence = torch.tensor([_tokens(rlhf, f"{row.input} {row.output}") + [rlhf.PAD] * 4])
        assert row.score == rlhf.reward(sequence[:, : rlhf.PROMPT_LEN + rlhf.MAX_NEW]).item()
        right = rlhf.decode(rlhf.answer_key(sequence[:, : rlhf.PROMPT_LEN])[0])
        assert row.extras == f'{{"right_answer": "{right}"}}'

    # disagreements: the prompts both arms' latest samples hold, per arm the mean score
    last = predictions[predictions["step"] == 2 * (EPISODES - 1)]
    by_arm = {arm: rows.groupby("example_id")["score"].mean() for arm, rows in last.groupby("arm")}
    both = sorted(set(by_arm["kl-0.04"].index) & set(by_arm["kl-0.4"].index))
    assert both and sorted(disagreements["example_id"]) == both
    for row in disagreements.itertuples():
        assert row.score_a == pytest.approx(by_arm["kl-0.04"][row.example_id])
        assert row.score_b == pytest.approx(by_arm["kl-0.4"][row.example_id])
        assert row.diff == pytest.approx(row.score_a - row.score_b)

    # breakdown: per arm, the mean over its repeats of the latest sample's mean return
    assert breakdown[["arm", "slice", "metric", "n"]].values.tolist() == [
        ["kl-0.04", "all", "return_mean", 2],
        ["kl-0.4", "all", "return_mean", 2],
    ]
    means = last.groupby(["arm", "run_key"])["score"].mean().groupby("arm").mean()
    assert breakdown["mean"].tolist() == pytest.approx(means[["kl-0.04", "kl-0.4"]].tolist())
