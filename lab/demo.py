"""The `lab quickstart` experiment: 2 arms x 3 repeats of a small torch regression.

Each run fits a two-layer MLP to a fixed random linear target with noise; the arms differ
in learning rate. In the loop a `val` evaluator scores every 50 steps; after training the
`holdout` benchmark scores 64 fixed examples, the same for every run, and records one
prediction per example (hit or miss within a tolerance) and a breakdown by input size
("small" and "large" inputs), so the predictions and breakdowns tables have rows to
compare arms on. It takes a few seconds on two CPU cores.
"""

from __future__ import annotations

import importlib.util
import os
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

import pydantic
import torch

from lab.errors import ConfigError, NoStore, NotALabStore
from lab.experiment import Arm, Experiment
from lab.hooks import Callback
from lab.loop import EvalResult, Evaluator, LoopArtifacts, TrainingLoop
from lab.records import ExperimentResult, RunSpec

if TYPE_CHECKING:
    import duckdb

HOLDOUT_SIZE = 64
TOLERANCE = 0.2  # a holdout prediction is a hit when it is this close to its target


class DemoConfig(pydantic.BaseModel):
    """The demo's settings; each arm overrides some of them."""

    lr: float = 0.01
    hidden: int = 32
    batch_size: int = 32
    steps: int = 300
    samples: int = 512


def _dataset(seed: int, samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1234)  # the task is the same for every run
    weight = torch.randn(8, 1, generator=gen)
    gen = torch.Generator().manual_seed(seed)  # the sample differs per repeat
    x = torch.randn(samples, 8, generator=gen)
    y = x @ weight + 0.1 * torch.randn(samples, 1, generator=gen)
    return x, y


def holdout(model: torch.nn.Module) -> EvalResult:
    """The post-training benchmark: the same 64 examples for every run, each one scored.

    A prediction within `TOLERANCE` of its target scores 1 (a hit), else 0. The examples
    whose input norm is above the median are the "large" slice, the rest "small": the
    breakdown shows where a model misses, the predictions on which examples arms disagree.
    """
    x, y = _dataset(seed=10_000, samples=HOLDOUT_SIZE)  # no repeat draws this seed
    out = model(x)
    error = (out - y).abs().squeeze(1)
    large = x.norm(dim=1) > x.norm(dim=1).median()
    hits = (error < TOLERANCE).float()
    sq = (out - y).pow(2).squeeze(1)
    slices = {"small": ~large, "large": large}
    predictions = [
        {
            "example_id": f"h{i:02d}",
            "input": [round(v, 3) for v in x[i].tolist()],
            "output": round(out[i, 0].item(), 4),
            "target": round(y[i, 0].item(), 4),
            "score": hits[i].item(),
            "slice": "large" if large[i] else "small",
            "abs_error": round(error[i].item(), 4),
        }
        for i in range(HOLDOUT_SIZE)
    ]
    return EvalResult(
        "holdout",
        {"acc": hits.mean().item(), "mse": sq.mean().item()},
        breakdowns={
            name: {"acc": hits[mask].mean().item(), "mse": sq[mask].mean().item()}
            for name, mask in slices.items()
        },
        tags={"examples": HOLDOUT_SIZE, "tolerance": TOLERANCE},
        predictions=predictions,
    )


def mse(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Mean squared error of the model on one batch."""
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def train(run: RunSpec) -> LoopArtifacts:
    """Train one run of the demo: the function an Experiment calls per arm x repeat."""
    cfg: DemoConfig = run.config
    x, y = _dataset(run.seed, cfg.samples)
    split = cfg.samples * 3 // 4
    train_x, train_y, val_x, val_y = x[:split], y[:split], x[split:], y[split:]
    batches = [
        (train_x[i : i + cfg.batch_size], train_y[i : i + cfg.batch_size])
        for i in range(0, split, cfg.batch_size)
    ]
    model = torch.nn.Sequential(
        torch.nn.Linear(8, cfg.hidden), torch.nn.ReLU(), torch.nn.Linear(cfg.hidden, 1)
    )
    loop = TrainingLoop(
        model,
        torch.optim.SGD(model.parameters(), lr=cfg.lr),
        data=batches,
        loss_fn=mse,
        num_steps=cfg.steps,
        evaluators=[  # every 50 steps, or once at the end of a shorter run
            Evaluator(
                "val", lambda m: {"loss": mse(m, (val_x, val_y)).item()}, every=min(50, cfg.steps)
            )
        ],
    )
    return loop.fit(run)


def quickstart_experiment(
    store: str | None = None,
    *,
    output_dir: str | Path = "runs",
    callbacks: list[Callback] | None = None,
    steps: int = 300,
    fresh: bool = False,
) -> Experiment:
    """The demo experiment, built and not yet run (`lab quickstart` runs it); `fresh`
    supersedes the runs recorded before (``lab quickstart --fresh``)."""
    return Experiment(
        "quickstart",
        train,
        base_config=DemoConfig(steps=steps),
        arms=[Arm("sgd-lr0.01", lr=0.01), Arm("sgd-lr0.1", lr=0.1)],
        repeats=3,
        callbacks=callbacks or [],
        store=store,
        output_dir=output_dir,
        benchmarks=[Evaluator("holdout", holdout)],
        fresh=fresh,
        metric="val/loss",  # the arms are ranked by the validation loss, lower is better
        bounds={"holdout/acc": (0, 1)},  # a fraction of the holdout examples
    )


def quickstart(
    store: str | None = None,
    *,
    output_dir: str | Path = "runs",
    callbacks: list[Callback] | None = None,
    steps: int = 300,
    fresh: bool = False,
) -> ExperimentResult:
    """Run the demo experiment into `store` (default: as every store URL) and return it:
    its val curves, and the holdout benchmark's metrics, breakdowns and predictions."""
    exp = quickstart_experiment(
        store, output_dir=output_dir, callbacks=callbacks, steps=steps, fresh=fresh
    )
    return exp.run()


# -- the notebook ------------------------------------------------------------------------
NOTEBOOK = "quickstart.ipynb"


def notebook_text() -> str:
    """The analysis notebook of the quickstart, as shipped: inside the installed package
    (``lab/_notebooks``), or in the source checkout's ``notebooks/`` (an editable install)."""
    shipped = resources.files("lab").joinpath("_notebooks").joinpath(NOTEBOOK)
    if shipped.is_file():
        return shipped.read_text(encoding="utf-8")
    return (Path(__file__).resolve().parent.parent / "notebooks" / NOTEBOOK).read_text(
        encoding="utf-8"
    )


def write_notebook(path: str | Path = NOTEBOOK) -> Path:
    """Write the quickstart's analysis notebook to `path` (``lab quickstart --notebook``),
    so that a pip-installed lab, which has no ``notebooks/`` folder, still hands it over.

    An existing file is never overwritten: that is one `ConfigError` naming it.
    """
    path = Path(path)
    if path.is_dir():
        path = path / NOTEBOOK
    if path.exists():
        raise ConfigError(f"{path} exists; remove it, or write the notebook elsewhere with "
                          "--notebook-to PATH")  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(notebook_text(), encoding="utf-8")
    return path


def find_store(start: str | Path | None = None) -> tuple[str, str]:
    """The store a notebook reads, found as the `lab` command finds it, and why that one.

    ``LAB_STORE_URL`` if set; else ``lab.db`` in the working directory, as the command
    looks for it; else the nearest ``lab.db`` in a folder above it (a notebook's kernel
    starts in the notebook's folder, e.g. ``notebooks/`` below where ``lab quickstart`` ran);
    else ``lab.db`` in the working directory, which does not exist yet.
    Returns (URL, how it was found).
    """
    env = os.environ.get("LAB_STORE_URL")
    if env:
        return env, "from $LAB_STORE_URL"
    here = Path(start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        if (folder / "lab.db").is_file():
            how = "in the working directory" if folder == here else "in a folder above"
            return f"sqlite:///{folder / 'lab.db'}", how
    return f"sqlite:///{here / 'lab.db'}", "not found: a new store in the working directory"


def open_quickstart(url: str | None = None) -> duckdb.DuckDBPyConnection:
    """A DuckDB connection to the store that holds the quickstart, for its notebook.

    Prints which store it opened. Without `url`, the store is found by `find_store`. If that
    store holds no ``quickstart`` experiment, it says so and runs it there first, as
    ``lab quickstart`` would (same settings, so the same numbers): the notebook never
    shows results it made up quietly.
    """
    import lab.inspect

    url, how = (url, "as given") if url is not None else find_store()
    print(f"store: {url} ({how})")
    if importlib.util.find_spec("pandas") is None:  # lab does not depend on it; .df() does
        print("the cells below show tables with .df(), which needs pandas: pip install pandas")
    try:
        con = lab.inspect.connect(url)
    except (NoStore, NotALabStore):  # nothing recorded there yet: the quickstart creates it
        pass
    else:
        query = "select count(*) from experiments where name = 'quickstart'"
        row = con.sql(query).fetchone()
        if row is not None and row[0]:
            return con
        con.close()
    runs = Path(url.removeprefix("sqlite:///")).parent / "runs" if url.startswith(
        "sqlite:///") else Path("runs")  # fmt: skip
    print(f"it holds no quickstart experiment: running it now, as `lab quickstart` does "
          f"(2 arms x 3 repeats, 300 steps; run folders in {runs})")  # fmt: skip
    quickstart(url, output_dir=runs)
    return lab.inspect.connect(url)
