"""`lab.sweeps.Prune`: its arguments, and the decision rebuilt from recorded points, which
must equal the decision of one live Optuna study deciding step by step."""

from __future__ import annotations

import random

import pytest

optuna = pytest.importorskip("optuna")

from lab.errors import ConfigError  # noqa: E402
from lab.sweeps import Prune  # noqa: E402
from lab.sweeps.pruning import RunPoints, should_prune  # noqa: E402

STEPS = 12


def _value(trial: int, step: int) -> float:
    """A curve per trial: its own level, falling with the steps, with some noise."""
    rng = random.Random(f"{trial}:{step}")
    return (1 + trial % 5) / (1 + 0.3 * step) + rng.gauss(0, 0.05)


def _live_and_rebuilt(prune: Prune, trials: int = 14, at_once: int = 3, every: int = 1):
    """Run `trials` trials, `at_once` at a time, in lockstep, each reporting at every
    `every`-th step to one live Optuna study and asking it `should_prune`; at each report,
    rebuild the decision from the points as the store would hold them. Returns both lists of
    (trial, step, pruned) decisions and the trials' end states."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(
        study_name="exp", direction="minimize" if prune.mode == "min" else "maximize",
        pruner=prune.pruner(), sampler=optuna.samplers.RandomSampler(seed=0),
    )  # fmt: skip
    status: dict[str, str] = {}
    points: dict[str, list[tuple[int, float]]] = {}
    live, rebuilt = [], []
    waiting = list(range(trials))
    running: dict[int, tuple[optuna.Trial, int]] = {}
    while waiting or running:
        while waiting and len(running) < at_once:
            number = waiting.pop(0)
            trial = study.ask()
            assert trial.number == number
            running[number] = (trial, 0)
            status[f"t{number:02d}"], points[f"t{number:02d}"] = "running", []
        for number in sorted(running):
            trial, step = running[number]
            key, step = f"t{number:02d}", step + every
            value = _value(number, step)
            if number == 4 and step > 3 * every:  # one trial fails midway
                study.tell(trial, state=optuna.trial.TrialState.FAIL)
                status[key] = "failed"
                del running[number]
                continue
            trial.report(value, step)
            points[key].append((step, value))
            decided = trial.should_prune()
            runs = [RunPoints(k, status[k], list(points[k])) for k in sorted(points)]
            live.append((number, step, decided))
            rebuilt.append((number, step, should_prune(prune, "exp", runs, key)))
            if decided:
                study.tell(trial, state=optuna.trial.TrialState.PRUNED)
                status[key] = "pruned"
                del running[number]
            elif step >= STEPS:
                study.tell(trial, value)
                status[key] = "completed"
                del running[number]
            else:
                running[number] = (trial, step)
    return live, rebuilt, status


@pytest.mark.parametrize(
    ("prune", "every"),
    [
        (Prune("loss", rule="median", n_startup_trials=2, n_warmup_steps=2), 1),
        (Prune("loss", rule="median"), 3),
        (Prune("loss", mode="max", rule="median", n_startup_trials=1), 1),
        (Prune("loss", rule="halving", reduction_factor=2), 1),
        (Prune("loss", rule="halving", min_resource=2, reduction_factor=3), 2),
        (Prune("loss", rule="hyperband", max_resource=STEPS, reduction_factor=2), 1),
        (Prune("loss", rule="hyperband", min_resource=2, max_resource=STEPS), 1),
        (Prune("loss", rule=optuna.pruners.PercentilePruner(25.0, n_startup_trials=2)), 1),
    ],
    ids=[
        "median",
        "median-every-3",
        "median-max",
        "halving",
        "halving-min2",
        "hyperband",
        "hyperband-min2",
        "percentile",
    ],
)
def test_the_rebuilt_decision_is_the_live_study_s(prune: Prune, every: int) -> None:
    live, rebuilt, status = _live_and_rebuilt(prune, every=every)
    assert rebuilt == live
    assert any(decided for *_, decided in live)  # the rule pruned some: a real comparison
    assert "completed" in status.values()


def test_the_rebuilt_decision_is_stable_at_each_step_and_prunes_the_worse_run() -> None:
    """Two finished runs at 1.0 and 3.0 per step: median 2.0; a run at 2.5 is pruned once
    past the warm-up (step 2), one at 1.5 is not; in max mode, the other way round."""
    done = [RunPoints("a", "completed", [(1, 1.0), (2, 1.0)]),
            RunPoints("b", "stopped", [(1, 3.0), (2, 3.0)])]  # fmt: skip
    rule = Prune("loss", rule="median", n_startup_trials=2, n_warmup_steps=2)
    worse = [*done, RunPoints("c", "running", [(1, 2.5)])]
    assert should_prune(rule, "e", worse, "c") is False
    worse = [*done, RunPoints("c", "running", [(1, 2.5), (2, 2.5)])]
    assert should_prune(rule, "e", worse, "c") is True
    running = [done[0], RunPoints("b", "running", [(1, 3.0), (2, 3.0)]), worse[-1]]
    assert should_prune(rule, "e", running, "c") is False  # one finished run: still starting up
    better = [*done, RunPoints("c", "running", [(1, 1.5), (2, 1.5)])]
    assert should_prune(rule, "e", better, "c") is False
    maxing = Prune("acc", mode="max", rule="median", n_startup_trials=2, n_warmup_steps=2)
    assert should_prune(maxing, "e", better, "c") is True


@pytest.mark.parametrize(
    ("args", "options", "message"),
    [
        ((1,), {}, "Prune(metric=1): name the metric runs are compared on, e.g. Prune('val/loss')"),
        (("loss", "low"), {}, "Prune(mode='low'): use 'min' or 'max'"),
        (("loss",), {"rule": "asha"},
         "Prune(rule='asha'): write one of median, halving, hyperband, or pass an Optuna pruner"),
        (("loss",), {"rule": 3},
         "Prune(rule=3): pass 'median', 'halving', 'hyperband' or an Optuna pruner such as "
         "optuna.pruners.MedianPruner()"),
        (("loss",), {"rule": "hyperband"},
         "Prune(rule='hyperband') needs max_resource: the last step a run logs the metric at, "
         "e.g. Prune('val/loss', rule='hyperband', max_resource=100)"),
        (("loss",), {"rule": "median", "n_startup": 2},
         "Prune(rule='median', n_startup=2): got an unexpected keyword argument 'n_startup'"),
        (("loss",), {"rule": "median", "n_warmup_steps": -1},
         "Prune(rule='median', n_warmup_steps=-1): Number of warmup steps cannot be negative, "
         "but got n_warmup_steps=-1."),
    ],
)  # fmt: skip
def test_bad_arguments_are_refused_in_one_line(args, options, message) -> None:
    with pytest.raises(ConfigError) as err:
        Prune(*args, **options)
    assert str(err.value) == message


def test_an_optuna_pruner_takes_its_options_itself() -> None:
    with pytest.raises(ConfigError) as err:
        Prune("loss", rule=optuna.pruners.MedianPruner(), n_warmup_steps=3)
    assert str(err.value) == (
        "Prune(rule=MedianPruner(...), n_warmup_steps=...): give the options to the Optuna "
        "pruner itself"
    )
    rule = Prune("loss", rule=optuna.pruners.MedianPruner(n_warmup_steps=3))
    assert rule.rule_name == "MedianPruner"
    assert repr(rule) == "Prune('loss', mode='min', rule=MedianPruner(...))"
    assert repr(Prune("loss", rule="halving")) == (
        "Prune('loss', mode='min', rule='halving', min_resource=1)"
    )
