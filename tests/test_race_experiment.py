"""Races in experiments: ``Experiment(race=Race(...))`` runs repeats in rounds and drops
the arms a round's test rules out; they never run their later repeats.

The arms' values are set here, so the race's decisions are known: ``c`` (mean 10) is far
worse than ``a`` and ``b`` (means 0 and 0.001, seed noise below 0.01), so the paired t-test
drops it after round 1 (the first round with ``min_repeats=2`` repeats); ``a`` and ``b`` race
on to ``max_repeats``. The train function is defined at module top level, for the workers.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pydantic
import pytest

from lab import Arm, Experiment, RunSpec
from lab.errors import ConfigError
from lab.hooks import RUNS
from lab.sweeps import Race
from tests.recorder import Labels
from tests.store_rows import rows

MEANS = {"a": 0.0, "b": 0.001, "c": 10.0}
NOISE = {  # by arm and repeat (seed): differences between arms vary, as seed noise does
    "a": [0.004, -0.006, 0.002, -0.003],
    "b": [-0.005, 0.003, -0.002, 0.006],
    "c": [0.002, -0.004, 0.005, -0.001],
}
RACE = Race("score", mode="min", alpha=0.05, min_repeats=2, max_repeats=4, test="t")
#: The runs the race trains, in the lifecycle's order: c stops after round 1.
RACED = ["a-r0", "a-r1", "a-r2", "a-r3", "b-r0", "b-r1", "b-r2", "b-r3", "c-r0", "c-r1"]


class Cfg(pydantic.BaseModel):
    mean: float = 0.0
    sleep: float = 0.0
    stop_at: str = ""  # a run key: an interrupt (Ctrl-C) hits it, once


def train(run: RunSpec) -> dict[str, float]:
    """The arm's mean plus its seed's noise; notes each run trained in ``trained.jsonl``."""
    cfg = run.config
    started = time.time()
    marker = run.dir.parent / f"stopped-{cfg.stop_at}"
    if run.run_key == cfg.stop_at and not marker.exists():
        marker.touch()
        raise KeyboardInterrupt
    time.sleep(cfg.sleep)
    with open(run.dir.parent / "trained.jsonl", "a") as f:
        f.write(json.dumps([run.run_key, started, time.time()]) + "\n")
    return {"score": cfg.mean + NOISE[run.arm][run.repeat]}


def _arms(**extra: Any) -> list[Arm]:
    return [Arm(name, mean=mean, **extra) for name, mean in MEANS.items()]


class Planned(Labels, hooks=("on_experiment_start", "on_group_start", "on_run_start",
                             "on_run_end", "on_experiment_end")):  # fmt: skip
    """Labels each call, and notes the runs planned as each run ends."""

    run_end_in_parent = True

    def note(self, hook: str, *args: Any, **kwargs: Any) -> str:
        if hook == "on_group_start":
            return f"{hook}:{args[1]}"
        label = super().note(hook, *args, **kwargs)
        return f"{label}:{args[0].extras[RUNS]}" if hook == "on_run_end" else label


def _trained(folder: Path) -> list[str]:
    path = folder / "trained.jsonl"
    return [json.loads(line)[0] for line in path.read_text().splitlines()] if path.exists() else []


def _check_race(result: Any) -> None:
    """The race's decisions and counts, as the values make them."""
    race = result.race
    assert [(e.arm, e.round, e.test, e.best) for e in race.eliminations] == [("c", 1, "t", "a")]
    assert race.eliminations[0].p_value < 0.05
    assert (race.rounds, race.survivors, race.winner, race.over) == (4, ["a", "b"], "a", True)
    assert [r.run_key for r in result.runs] == RACED
    assert [r.seed for r in result.runs] == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]
    assert [(a.name, a.planned, len(a.runs)) for a in result.arms] == [
        ("a", 4, 4), ("b", 4, 4), ("c", 2, 2)
    ]  # fmt: skip
    assert (result.planned, result.status) == (10, "completed")
    summary = result.summary()
    assert (summary.metric, summary.mode, summary.best_arm, summary.planned) == (
        "score", "min", "a", 10
    )  # fmt: skip
    p = race.eliminations[0].p_value
    assert summary.eliminated == {"c": f"after round 1 (t, p={_fmt(p)} vs a)"}
    text = str(summary)
    assert "c (eliminated)  score   2" in text
    assert f"eliminated by the race: c after round 1 (t, p={_fmt(p)} vs a)" in text
    assert text.splitlines()[-1].startswith("best arm by score (min): a (-0.00075), ahead of b")


def _fmt(value: float) -> str:
    from lab._table import fmt

    return fmt(value)


def test_a_race_drops_an_arm_and_never_runs_its_later_repeats(tmp_path: Path) -> None:
    seen = Planned()
    exp = Experiment("race", train, base_config=Cfg(), arms=_arms(), race=RACE,
                     callbacks=[seen], store=False, output_dir=tmp_path)  # fmt: skip
    assert (exp.repeats, exp.declared.metric, exp.declared.mode) == (4, "score", "min")
    result = exp.run()
    _check_race(result)
    # round r runs repeat r of every arm still in; the planned runs shrink as c drops
    assert seen.calls == [
        "on_experiment_start",
        "on_group_start:a", "on_run_start:a-r0", "on_run_end:a-r0:completed:12",
        "on_group_start:b", "on_run_start:b-r0", "on_run_end:b-r0:completed:12",
        "on_group_start:c", "on_run_start:c-r0", "on_run_end:c-r0:completed:12",
        "on_run_start:a-r1", "on_run_end:a-r1:completed:12",
        "on_run_start:b-r1", "on_run_end:b-r1:completed:12",
        "on_run_start:c-r1", "on_run_end:c-r1:completed:12",
        "on_run_start:a-r2", "on_run_end:a-r2:completed:10",
        "on_run_start:b-r2", "on_run_end:b-r2:completed:10",
        "on_run_start:a-r3", "on_run_end:a-r3:completed:10",
        "on_run_start:b-r3", "on_run_end:b-r3:completed:10",
        "on_experiment_end:completed",
    ]  # fmt: skip
    assert _trained(tmp_path / "race") == [
        "a-r0", "b-r0", "c-r0", "a-r1", "b-r1", "c-r1", "a-r2", "b-r2", "a-r3", "b-r3"
    ]  # fmt: skip


def test_a_race_refuses_a_conflicting_repeats_and_staged_arms() -> None:
    with pytest.raises(ConfigError) as info:
        Experiment("race", train, arms=_arms(), repeats=3, race=RACE, base_config=Cfg(),
                   store=False)  # fmt: skip
    assert str(info.value) == (
        "repeats=3 conflicts with race=Race(max_repeats=4): a race runs up to max_repeats "
        "repeats of each arm; drop repeats, or set max_repeats"
    )
    assert Experiment("race", train, arms=_arms(), repeats=4, race=RACE, base_config=Cfg(),
                      store=False).repeats == 4  # fmt: skip
    with pytest.raises(ConfigError, match=r"^race: arm 'x' has stages; a race compares"):
        Experiment("race", train, arms=[Arm("x", stages=[{}, {}])], race=RACE, store=False)
    with pytest.raises(ConfigError, match=r"^race='score': use race=Race\("):
        Experiment("race", train, race="score", store=False)  # type: ignore[arg-type]
    # an experiment's own metric ranks it; the race still decides with its own
    exp = Experiment("race", train, arms=_arms(), race=RACE, base_config=Cfg(), store=False,
                     metric="other", mode="max")  # fmt: skip
    assert (exp.declared.metric, exp.declared.mode) == ("other", "max")


def test_each_elimination_is_recorded_once_and_an_interrupted_race_continues(
    tmp_path: Path,
) -> None:
    """Ctrl-C hits b-r2 (round 2, after c was dropped); running again reuses every
    recorded run, replays round 1's decision without recording it again, and trains only
    what never finished."""
    db = tmp_path / "lab.db"

    def experiment() -> Experiment:
        return Experiment("race", train, base_config=Cfg(stop_at="b-r2"), arms=_arms(),
                          race=RACE, store=f"sqlite:///{db}", output_dir=tmp_path)  # fmt: skip

    first = experiment()
    with pytest.raises(KeyboardInterrupt):
        first.run()
    assert first.result is not None
    assert [(e.arm, e.round) for e in first.result.race.eliminations] == [("c", 1)]
    assert first.result.planned == 10
    result = experiment().run()
    _check_race(result)
    trained = _trained(tmp_path / "race")
    assert trained == ["a-r0", "b-r0", "c-r0", "a-r1", "b-r1", "c-r1", "a-r2",  # first
                       "b-r2", "a-r3", "b-r3"]  # fmt: skip
    assert len(trained) == len(set(trained))  # no run trained twice
    elimination = result.race.eliminations[0]
    assert rows(db, "SELECT a.name, e.round, e.test, e.statistic, e.p_value, e.alpha, "
                    "e.best_arm FROM eliminations e JOIN arms a USING (arm_id)") == [
        ("c", 1, "t", elimination.statistic, elimination.p_value, 0.05, "a")
    ]  # fmt: skip
    assert rows(db, "SELECT run_key, status FROM runs ORDER BY run_key") == [
        (key, "completed") for key in sorted(RACED)
    ]


def test_a_race_run_afresh_shows_its_own_eliminations_not_the_old_ones(
    tmp_path: Path, store_url: str
) -> None:
    """``fresh=True`` starts the race over: the old race dropped c, the new one (c now as
    good as the others) drops nothing, and the store, through every reader, says so."""
    from lab.store import open_store

    def experiment(c_mean: float, fresh: bool) -> Experiment:
        arms = [Arm("a", mean=0.0), Arm("b", mean=0.001), Arm("c", mean=c_mean)]
        return Experiment("race", train, base_config=Cfg(), arms=arms, race=RACE,
                          store=store_url, output_dir=tmp_path, fresh=fresh)  # fmt: skip

    first = experiment(10.0, fresh=False).run()
    assert [(e.arm, e.round) for e in first.race.eliminations] == [("c", 1)]
    again = experiment(0.0005, fresh=True).run()
    assert (again.race.eliminations, again.race.survivors) == ([], ["a", "b", "c"])
    store = open_store(store_url)
    try:
        assert store.eliminations("race") == []
        assert len(store.current_runs("race")) == 12  # every arm's 4 repeats, afresh
    finally:
        store.close()


def went_out_in_rounds(folder: Path, sizes: list[int]) -> None:
    """The runs `trained.jsonl` in `folder` notes went out round by round: `sizes[r]` runs
    in round r, all started before the first of them ended (together), and none before the
    last run of the round before ended (after)."""
    times: dict[int, list[tuple[float, float]]] = {}
    for line in (folder / "trained.jsonl").read_text().splitlines():
        key, start, end = json.loads(line)
        times.setdefault(int(key.rsplit("-r", 1)[1]), []).append((start, end))
    assert [len(times[r]) for r in range(len(sizes))] == sizes
    for r in range(len(sizes)):
        assert max(s for s, _ in times[r]) < min(e for _, e in times[r])  # together
    for r in range(1, len(sizes)):
        assert min(s for s, _ in times[r]) >= max(e for _, e in times[r - 1])  # after


@pytest.mark.slow
def test_under_a_pool_a_round_goes_out_together(tmp_path: Path) -> None:
    """Three workers: each round's runs overlap (all start before the first ends), and a
    round starts only once the one before it ended."""
    race = Race("score", mode="min", alpha=0.05, min_repeats=2, max_repeats=3, test="t")
    seen = Planned()
    exp = Experiment("pool", train, base_config=Cfg(sleep=3.0), arms=_arms(), race=race,
                     callbacks=[seen], store=False, output_dir=tmp_path,
                     executor="processes", workers=3)  # fmt: skip
    result = exp.run()
    assert [r.run_key for r in result.runs] == ["a-r0", "a-r1", "a-r2", "b-r0", "b-r1",
                                                "b-r2", "c-r0", "c-r1"]  # fmt: skip
    assert (result.planned, result.race.winner) == (8, "b")  # over 3 repeats
    went_out_in_rounds(tmp_path / "pool", [3, 3, 2])
    assert sorted(seen.calls[-3:-1]) == ["on_run_end:a-r2:completed:8",
                                         "on_run_end:b-r2:completed:8"]  # fmt: skip
