"""A store holding a real race and a sampled sweep, for the dashboard's sweep page tests.

``race <b>``: `Experiment(race=Race(...))` over three explicit arms of a small torch
regression: the paired t test drops ``slow`` (lr 0.001) and ``<i>mid</i>`` (lr 0.05) after
round 3 of at most 5, and ``fast`` (lr 0.2) wins alone. Its name and an arm's name hold
markup.

``search``: six sampled arms recorded through the store's own contract (`add_arm`,
`add_trial`, `tell_trial`, runs with curves), as a sweep records them: four complete, one
pruned at step 3 (its run ``pruned``), one failed; the space recorded in the experiment's
config in a file's form (``lr`` on a log scale, ``width`` an int, ``opt`` a choice,
``momentum`` only with sgd).

``open race``: a race recorded through the store contract while its round 1 is open: both
arms ended round 0, ``a`` ended round 1 and ``b``'s run of it still runs.
"""

from __future__ import annotations

from typing import Any

import pydantic
import torch

from lab import Arm, Experiment, RunHandle, RunSpec
from lab.store import Store
from lab.sweeps import Race

RACE_NAME = "race <b>"
#: The arms of the race; one name is markup.
RACE_ARMS = {"slow": 0.001, "<i>mid</i>": 0.05, "fast": 0.2}
RACE = Race("val/loss", mode="min", alpha=0.05, min_repeats=2, max_repeats=5, test="t")
STEPS = 20

SWEEP_NAME = "search"
SPACE = {
    "lr": {"float": [1e-4, 0.1], "log": True},
    "width": {"int": [16, 256]},
    "opt": {"choice": ["adam", "sgd"]},
    "momentum": {"float": [0.0, 0.99], "when": {"opt": "sgd"}},
}
#: Each sampled arm: its params, how its run ends, and its val/loss curve (steps 1...).
TRIALS = [
    ({"lr": 0.001, "width": 32, "opt": "adam"}, "completed", [2.0, 1.2, 0.9, 0.7, 0.6, 0.55]),
    ({"lr": 0.05, "width": 128, "opt": "sgd", "momentum": 0.9}, "completed",
     [1.5, 0.8, 0.5, 0.35, 0.3, 0.25]),
    ({"lr": 0.0002, "width": 16, "opt": "adam"}, "pruned", [3.0, 2.9, 2.85]),
    ({"lr": 0.02, "width": 64, "opt": "sgd", "momentum": 0.5}, "completed",
     [1.8, 1.0, 0.7, 0.5, 0.42, 0.4]),
    ({"lr": 0.09, "width": 200, "opt": "sgd", "momentum": 0.1}, "failed", [4.0, 9.0]),
    ({"lr": 0.005, "width": 100, "opt": "adam"}, "completed", [1.9, 1.1, 0.8, 0.62, 0.5, 0.45]),
]  # fmt: skip
PRUNED = {"step": 3, "rule": "median", "metric": "val/loss", "value": 2.85}


class Config(pydantic.BaseModel):
    lr: float = 0.05


def train(run: RunSpec) -> object:
    """Twenty SGD steps of a linear regression, val/loss logged at every step."""
    gen = torch.Generator().manual_seed(run.seed)
    x = torch.randn(64, 4, generator=gen)
    y = x @ torch.linspace(-1, 1, 4).unsqueeze(1) + 0.1 * torch.randn(64, 1, generator=gen)
    torch.manual_seed(run.seed)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=run.config.lr)
    with RunHandle(run, model, opt, num_steps=STEPS) as loop:
        for _step in loop.steps():
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            loop.end_step({"val/loss": loss.item()})
    return loop.artifacts


OPEN_NAME = "open race"
#: Each arm of the open race: its runs' values of val/loss (None: the run still runs).
OPEN = {"a": [0.5, 0.4], "b": [0.9, None]}


def record(url: str, folder: object) -> Any:
    """Record the race, the sweep and the open race into the store at `url`; the race's
    `ExperimentResult`."""
    result = Experiment(
        RACE_NAME, train, base_config=Config(),
        arms=[Arm(name, lr=lr) for name, lr in RACE_ARMS.items()],
        race=RACE, store=url, output_dir=folder,
    ).run()  # fmt: skip
    store = Store(url)
    try:
        _sweep(store)
        _open_race(store)
    finally:
        store.close()
    return result


def _sweep(store: Store) -> None:
    config = {"sweep": {"space": SPACE, "sampler": "tpe"},
              "summary": {"metric": "val/loss", "mode": "min", "bounds": {}}}  # fmt: skip
    exp = store.begin_experiment(SWEEP_NAME, config=config, seed=0, repeats=1)
    for number, (params, status, curve) in enumerate(TRIALS):
        name = f"s{number:03d}"
        arm = store.add_arm(exp, name, overrides=params, config=params)
        store.add_trial(exp, number, arm, params, number)  # asked after every earlier tell
        group = store.add_group(exp, name, arm_id=arm)
        run = store.start_run(exp, group, run_key=f"{name}-r0", arm_id=arm, repeat=0, stage=0,
                              seed=0, config=params, output_dir=None)  # fmt: skip
        for step, value in enumerate(curve, start=1):
            store.log_metrics(run, step, {"val/loss": value})
        store.flush()
        if status == "completed":
            store.finish_run(run, status="completed", summary={"val/loss": curve[-1]})
            store.tell_trial(exp, number, told=number, value=curve[-1], state="complete")
        elif status == "pruned":
            store.finish_run(run, status="pruned", summary={"val/loss": curve[-1]}, pruned=PRUNED)
            store.tell_trial(exp, number, told=number, value=curve[-1], state="pruned")
        else:
            store.finish_run(run, status="failed", error="diverged: <b>nan</b>")
            store.tell_trial(exp, number, told=number, value=None, state="failed")
    store.finish_experiment(exp, status="completed")


def _open_race(store: Store) -> None:
    config = {
        "race": dict(vars(RACE)),
        "summary": {"metric": "val/loss", "mode": "min", "bounds": {}},
    }
    exp = store.begin_experiment(OPEN_NAME, config=config, seed=0, repeats=RACE.max_repeats)
    for name, values in OPEN.items():
        arm = store.add_arm(exp, name, overrides={"lr": 0.1}, config={"lr": 0.1})
        group = store.add_group(exp, name, arm_id=arm)
        for repeat, value in enumerate(values):
            run = store.start_run(exp, group, run_key=f"{name}-r{repeat}", arm_id=arm,
                                  repeat=repeat, stage=0, seed=repeat, config={"lr": 0.1},
                                  output_dir=None)  # fmt: skip
            if value is not None:
                store.finish_run(run, status="completed", summary={"val/loss": value})
