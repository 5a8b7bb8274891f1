"""Races over repeats (`lab.sweeps.racing`): who is dropped after which round, with which
statistic and p-value, and a race rebuilt from its recorded runs after a kill."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
from scipy import stats

from lab.errors import ConfigError
from lab.sweeps import Elimination, Race, RaceState


def _run(state: RaceState, rounds: dict[str, list[float | None]]) -> list[list[Elimination]]:
    """Feed `state` round by round until it is over; the eliminations of each round."""
    out = []
    while not state.over():
        for arm in state.next_round():
            state.record(arm, state.round, rounds[arm][state.round])
        out.append(state.close_round())
    return out


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"metric": ""}, "Race(metric=''): name the metric the arms are compared on, "
         "e.g. Race('val/loss')"),
        ({"mode": "low"}, "Race(mode='low'): use 'min' (lower is better, e.g. a loss) or "
         "'max' (higher is better, e.g. an accuracy)"),
        ({"alpha": 1.0}, "Race(alpha=1.0): use a level strictly between 0 and 1, e.g. 0.05"),
        ({"alpha": 0}, "Race(alpha=0): use a level strictly between 0 and 1, e.g. 0.05"),
        ({"alpha": True}, "Race(alpha=True): use a level strictly between 0 and 1, e.g. 0.05"),
        ({"min_repeats": 1}, "Race(min_repeats=1): use an int >= 2 (a paired test needs two "
         "repeats of each arm)"),
        ({"min_repeats": 2.5}, "Race(min_repeats=2.5): use an int >= 2 (a paired test needs "
         "two repeats of each arm)"),
        ({"min_repeats": 4, "max_repeats": 3}, "Race(max_repeats=3): use an int >= "
         "min_repeats (4)"),
        ({"test": "wilcoxon"}, "Race(test='wilcoxon'): use 'friedman' (ranks, as F-race) or "
         "'t' (the paired t test)"),
        ({"budget": 0}, "Race(budget=0): use an int >= 1 (runs in all), or None for no cap"),
    ],
)  # fmt: skip
def test_a_bad_race_is_one_line_naming_the_fix(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        Race(**{"metric": "val/loss", **kwargs})
    assert str(caught.value) == message


def test_the_defaults() -> None:
    race = Race("val/loss")
    assert (race.mode, race.alpha, race.min_repeats, race.max_repeats, race.test) == (
        "min", 0.05, 2, 10, "friedman")  # fmt: skip
    assert race.budget is None


def test_a_budget_too_small_for_the_first_test_and_arms_that_repeat() -> None:
    with pytest.raises(ConfigError) as caught:
        RaceState(Race("loss", budget=7), ["a", "b", "c", "d"])
    assert str(caught.value) == (
        "Race(budget=7) cannot run 4 arms min_repeats=2 times (8 runs): raise the budget or "
        "lower min_repeats"
    )
    with pytest.raises(ConfigError, match=r"a race needs distinct arms, got \['a', 'a'\]"):
        RaceState(Race("loss"), ["a", "a"])


def test_friedman_drops_every_beaten_arm_once_the_evidence_is_there() -> None:
    rounds: dict[str, list[float | None]] = {
        "a": [1.0, 1.0, 1.0], "b": [2.0, 3.0, 2.0], "c": [3.0, 2.0, 3.0], "d": [4.0, 4.0, 4.0],
    }  # fmt: skip
    state = RaceState(Race("loss"), list(rounds))
    assert state.next_round() == ["a", "b", "c", "d"]
    # round 1 (2 blocks): Friedman 5.4 on 3 df, p = 0.145: nobody is dropped; round 2 (3
    # blocks): rank sums 3, 7, 8, 12, Friedman 8.2 (p = 0.042), then Conover's t of each
    # against a on 6 df, with variance 2(3·90 - 266)/(2·3) = 4/3
    assert _run(state, rounds)[:2] == [[], []]
    scale = math.sqrt(4 / 3)
    ts = {"b": 4 / scale, "c": 5 / scale, "d": 9 / scale}
    raw = {arm: 2 * stats.t.sf(t, 6) for arm, t in ts.items()}
    holm = {"d": 3 * raw["d"], "c": 2 * raw["c"], "b": max(2 * raw["c"], raw["b"])}
    assert state.eliminations == [
        Elimination(arm, 2, "friedman", pytest.approx(ts[arm]), pytest.approx(holm[arm]), "a")
        for arm in ("b", "c", "d")
    ]
    assert holm["b"] == pytest.approx(0.013400, abs=1e-6)
    assert (state.survivors, state.round, state.over(), state.winner()) == (["a"], 3, True, "a")
    assert (state.spent, state.next_round()) == (12, [])
    for late in (lambda: state.record("a", 3, 1.0), state.close_round):
        with pytest.raises(ValueError, match=r"^the race is over after round 2$"):
            late()


def test_with_two_arms_friedman_is_the_comparison() -> None:
    """Two survivors: the Friedman test (its chi-square on 1 df) decides alone; b loses every
    block, so the chi-square after n blocks is n, below 0.05 from n = 4 on."""
    rounds: dict[str, list[float | None]] = {"a": [0.1 * i for i in range(10)],
                                             "b": [0.1 * i + 0.05 for i in range(10)]}  # fmt: skip
    state = RaceState(Race("loss", mode="min"), ["b", "a"])
    assert _run(state, rounds) == [[], [], [], [
        Elimination("b", 3, "friedman", 4.0, pytest.approx(stats.chi2.sf(4.0, 1)), "a")
    ]]  # fmt: skip
    assert state.winner() == "a" and state.spent == 8


def test_t_fills_a_failed_run_with_its_round_s_worst() -> None:
    """mode max: a failed run (None, NaN) takes the lowest value of its round, then the
    paired t of each arm against the best mean, Holm-corrected over the two."""
    rounds: dict[str, list[float | None]] = {
        "a": [0.9, 0.85, 0.95], "b": [0.8, 0.8, None], "c": [math.nan, 0.7, 0.6],
    }  # fmt: skip
    state = RaceState(Race("acc", mode="max", test="t", alpha=0.25, max_repeats=3), list(rounds))
    a, b, c = [0.9, 0.85, 0.95], [0.8, 0.8, 0.6], [0.8, 0.7, 0.6]
    raw_b, raw_c = stats.ttest_rel(a, b), stats.ttest_rel(a, c)
    assert raw_b.pvalue > raw_c.pvalue  # c is the surer loser
    holm_b = max(raw_b.pvalue, 2 * raw_c.pvalue)  # Holm's step-down keeps the order
    assert (raw_b.pvalue, holm_b) == (pytest.approx(0.21433, abs=1e-5), 2 * raw_c.pvalue)
    b_, c_ = (pytest.approx(x) for x in (raw_b.statistic, raw_c.statistic))
    assert _run(state, rounds) == [[], [], [
        Elimination("b", 2, "t", b_, pytest.approx(holm_b), "a"),
        Elimination("c", 2, "t", c_, pytest.approx(2 * raw_c.pvalue), "a"),
    ]]  # fmt: skip
    assert state.winner() == "a"


def test_a_failed_run_ranks_worst_and_a_round_all_failed_says_nothing() -> None:
    rounds: dict[str, list[float | None]] = {
        "a": [1.0, None, 1.0, 1.0, 1.0], "b": [2.0, None, 2.0, None, 2.0],
        "c": [3.0, None, 3.0, 3.0, 3.0],
    }  # fmt: skip
    state = RaceState(Race("loss", max_repeats=5), list(rounds))
    # blocks 0, 2, 3, 4 count; b's failure in round 3 ranks it below c there
    found = _run(state, rounds)
    assert found[:3] == [[], [], []]  # round 2: two blocks (chi-square 4, p = 0.135)
    # round 3: three blocks, rank sums a 3, b 7, c 8: Friedman 4.667 (p = 0.097)
    # round 4: four blocks, rank sums 4, 9, 11: Friedman 6.5 (p = 0.039); Conover on 6 df
    assert found[3] == []
    # variance 2(4·56 - 218)/(3·2) = 2: Conover's t 5/√2 and 7/√2 against a on 6 df
    raw_b, raw_c = (2 * stats.t.sf(gap / math.sqrt(2), 6) for gap in (5, 7))
    t_b, t_c = (pytest.approx(gap / math.sqrt(2)) for gap in (5, 7))
    assert found[4] == [
        Elimination("b", 4, "friedman", t_b, pytest.approx(max(raw_b, 2 * raw_c)), "a"),
        Elimination("c", 4, "friedman", t_c, pytest.approx(2 * raw_c), "a"),
    ]
    assert state.winner() == "a" and state.spent == 15


def test_no_test_before_min_repeats() -> None:
    """Three blocks of a < b < c would drop b and c (Friedman 6, p = 0.0498; Conover's
    variance 0): with min_repeats=4 the first test comes after round 3."""
    rounds: dict[str, list[float | None]] = {"a": [0.0] * 10, "b": [5.0] * 10, "c": [9.0] * 10}
    state = RaceState(Race("loss", min_repeats=4), ["a", "b", "c"])
    assert _run(state, rounds) == [[], [], [], [
        Elimination("b", 3, "friedman", math.inf, 0.0, "a"),
        Elimination("c", 3, "friedman", math.inf, 0.0, "a"),
    ]]  # fmt: skip
    assert (state.over(), state.round, state.spent, state.winner()) == (True, 4, 12, "a")
    state = RaceState(Race("loss", min_repeats=3), ["a", "b", "c"])
    assert [len(found) for found in _run(state, rounds)] == [0, 0, 2]


def test_the_budget_ends_the_race_before_a_round_it_cannot_pay_for_whole() -> None:
    rounds: dict[str, list[float | None]] = {
        "a": [1.0, 2.0, 2.9, 1.0], "b": [2.0, 3.0, 1.0, 2.0], "c": [3.0, 1.0, 2.0, 3.0],
    }  # fmt: skip
    state = RaceState(Race("loss", min_repeats=3, budget=11), ["a", "b", "c"])
    assert _run(state, rounds) == [[], [], []]  # rank sums 6, 6, 6; a 4th round: 12 runs
    assert (state.over(), state.round, state.spent, state.winner()) == (True, 3, 9, "a")


def test_record_refuses_what_is_not_this_round_s() -> None:
    state = RaceState(Race("loss"), ["a", "b"])
    with pytest.raises(ValueError, match=r"arm 'z' is not racing \(survivors: \['a', 'b'\]\)"):
        state.record("z", 0, 1.0)
    with pytest.raises(ValueError, match=r"repeat 1 of arm 'a' is not round 0's"):
        state.record("a", 1, 1.0)
    state.record("a", 0, 2.0)
    state.record("a", 0, 1.0)  # a rerun replaces the value
    assert state.values["a"] == [1.0] and state.next_round() == ["b"]
    with pytest.raises(ValueError, match=r"round 0 is not whole: no value yet for \['b'\]"):
        state.close_round()
    assert state.winner() is None


def _simulated(seed: int) -> dict[str, list[float | None]]:
    rng = random.Random(seed)
    return {
        f"arm{i}": [None if rng.random() < 0.1 else 0.4 * i + rng.gauss(0, 1) for _ in range(10)]
        for i in range(8)
    }


def _facts(state: RaceState) -> tuple[Any, ...]:
    return (state.survivors, state.round, state.eliminations, state.next_round(), state.values,
            state.over(), state.winner())  # fmt: skip


@pytest.mark.parametrize(("seed", "test"), [(0, "friedman"), (1, "friedman"), (2, "t"), (3, "t")])
def test_replay_rebuilds_the_race_after_a_kill_at_any_run(seed: int, test: str) -> None:
    """Killed after any run, a race rebuilt from the runs recorded so far has the same
    survivors, eliminations and next round as the one that was not killed."""
    race = Race("loss", test=test, alpha=0.1)  # type: ignore[arg-type]
    rounds = _simulated(seed)
    straight = RaceState(race, list(rounds))
    recorded: dict[str, list[float | None]] = {arm: [] for arm in rounds}
    kills = 0
    while not straight.over():
        for arm in straight.next_round():
            straight.record(arm, straight.round, rounds[arm][straight.round])
            recorded[arm].append(rounds[arm][straight.round])
            replayed = RaceState.replay(race, list(rounds), recorded)
            if straight.next_round():  # killed mid-round: the arms still to run
                assert _facts(replayed) == _facts(straight)
            else:  # killed before the round was closed: the replay closes it
                straight_copy = RaceState.replay(race, list(rounds), recorded)
                assert _facts(replayed) == _facts(straight_copy)
            kills += 1
        straight.close_round()
        assert _facts(RaceState.replay(race, list(rounds), recorded)) == _facts(straight)
    assert kills == straight.spent and straight.eliminations  # the race dropped arms
