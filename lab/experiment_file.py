"""Experiment files: an `Experiment` written down as YAML or JSON, run with ``lab run FILE``.

A file names its `train(run)` function and its config class as ``module:name``; the module
is imported by name, with the file's own folder first on ``sys.path`` (as ``python
script.py`` puts the script's folder there), so the functions stay picklable for
``executor: processes``, whose workers start with the same ``sys.path``. Everything
else maps to one `Experiment` argument::

    name: lr-sweep
    train: train_lib:train              # module:function, looked up next to the file first
    config: train_lib:Config            # the pydantic model of the base config
    base_config: {lr: 0.01, steps: 50}  # its values, checked by that model
    arms:                               # name, then overrides (and stages, carry)
      - {name: small, lr: 0.001}
      - {name: large, lr: 0.01}
    repeats: 2
    callbacks:                          # built by lab.callbacks.build
      - {kind: metric_saver, params: {every: 10}}
    tags: [baseline, sweep]             # the experiment's tags and notes, in the store
    notes: first sweep of the learning rate

``lab run FILE key=value ...`` overrides the file's values first (`lab._overrides`), and an
arm entry ``{grid: {lr: [...], wd: [...]}}`` is one arm per combination (`lab._arm_grid`).

Every problem is one `ConfigError` line that starts with the file's path and says what to
change: a parse error with its line and column, an unknown field with the valid ones, an
import with where it looked. Relative paths (``output_dir``, a ``sqlite:///`` store) are
relative to the working directory, as everywhere in `lab`. docs/experiment-files.md is the
reference.
"""

from __future__ import annotations

import fnmatch
import importlib
import inspect
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import pydantic
import yaml

from lab._arm_grid import expand_arms
from lab._overrides import apply_overrides
from lab._sweep_arms import sweep_config, sweep_size
from lab._table import plural, render
from lab._validation import describe, unknown_field
from lab.callbacks.registry import build
from lab.errors import ConfigError, StoreError
from lab.experiment import Arm, Experiment, safe_name
from lab.hooks import Callback
from lab.loggers import store_sink
from lab.loop.metric_names import LOOP_METRICS, close_matches, logged_by, needed_by
from lab.records import FAILED, ExperimentResult, Summary
from lab.sinks import StoreSink
from lab.store.urls import resolve_url

__all__ = ["ArmEntry", "ExperimentFile", "SummaryEntry", "load_experiment", "plan",
           "read_experiment_file"]  # fmt: skip

#: The suffixes an experiment file may have, and the format each one means.
FORMATS = {".yaml": "yaml", ".yml": "yaml", ".json": "json"}
_REF = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
_FORBID = pydantic.ConfigDict(extra="forbid")


def _check_ref(value: str) -> str:
    if not _REF.fullmatch(value):
        raise ValueError(f"{value!r} is not module:name; write e.g. train_lib:train")
    return value


#: ``module:name``, e.g. ``train_lib:train`` or ``mypkg.tasks:Config``.
Ref = Annotated[str, pydantic.AfterValidator(_check_ref)]


class ArmEntry(pydantic.BaseModel):
    """One arm: its name, its overrides of the base config, and optionally continual stages.

    Every key besides `name`, `stages`, `carry` and `resources` is an override, as in
    ``Arm(name, **overrides)``; the config's own model checks them, naming its valid fields.
    """

    model_config = pydantic.ConfigDict(extra="allow")

    name: str = pydantic.Field(min_length=1)
    stages: list[dict[str, Any]] | None = None
    carry: Literal["weights", "full"] = "weights"
    resources: dict[str, float] | None = None

    @property
    def overrides(self) -> dict[str, Any]:
        """The arm's overrides: its keys other than name, stages, carry and resources."""
        return dict(self.model_extra or {})


class SummaryEntry(pydantic.BaseModel):
    """How the experiment's summaries rank the arms (its `Experiment`'s `metric`, `mode` and
    `bounds`, which every door reads), and the metrics ``lab run`` prints (`keys`)."""

    model_config = _FORBID

    metric: str | None = None
    mode: Literal["min", "max"] = "min"
    keys: list[str] | None = None
    bounds: dict[str, tuple[float, float]] | None = None


class ExperimentFile(pydantic.BaseModel):
    """The fields of an experiment file, checked before anything is imported or run.

    Each field is the `Experiment` argument of the same name, except `train`, `config` and
    `benchmarks`, which name importable objects (``module:name``) instead of holding them.
    """

    model_config = _FORBID

    name: str = pydantic.Field(min_length=1)
    train: Ref
    config: Ref | None = None
    base_config: dict[str, Any] | None = None
    arms: list[ArmEntry] | None = None
    repeats: int = pydantic.Field(default=1, ge=1, strict=True)
    seed: int = pydantic.Field(default=0, strict=True)
    store: Any = None
    output_dir: str = "runs"
    executor: Literal["serial", "processes", "ray"] = "serial"
    workers: int | None = pydantic.Field(default=None, ge=1, strict=True)
    resources: dict[str, float] | None = None
    ray_address: str | None = None
    max_retries: int = pydantic.Field(default=0, ge=0, strict=True)
    strict: bool | None = None
    callbacks: list[Any] = pydantic.Field(default_factory=list)
    benchmarks: dict[str, Ref] = pydantic.Field(default_factory=dict)
    summary: SummaryEntry = pydantic.Field(default_factory=SummaryEntry)
    tags: list[str] = pydantic.Field(default_factory=list)
    notes: str | None = None
    #: `Sweep`'s fields, its space in `lab.sweeps.parse_space`'s form
    sweep: dict[str, Any] | None = None
    race: dict[str, Any] | None = None  # `Race`'s fields
    prune: dict[str, Any] | None = None  # `Prune`'s fields

    _source: Path | None = pydantic.PrivateAttr(default=None)
    _overrides: tuple[str, ...] = pydantic.PrivateAttr(default=())

    @pydantic.field_validator("arms", mode="before")
    @classmethod
    def _grids(cls, value: Any) -> Any:
        return expand_arms(value)  # a grid entry: one arm per combination (lab._arm_grid)

    @pydantic.field_validator("store")
    @classmethod
    def _store(cls, value: Any) -> Any:
        if value is None or value is False or isinstance(value, str):
            return value
        raise ValueError(
            f"{value!r} is not a store; write a URL such as sqlite:///lab.db, or false to "
            "record nothing"
        )

    @pydantic.model_validator(mode="after")
    def _needs_config(self) -> ExperimentFile:
        if self.config is not None:
            return self
        if self.base_config:
            raise ValueError(
                "base_config needs config: the module:Class of its pydantic model, "
                "e.g. config: train_lib:Config"
            )
        for arm in self.arms or []:
            if arm.overrides or arm.stages:
                what = f"overrides {sorted(arm.overrides)}" if arm.overrides else "has stages"
                raise ValueError(
                    f"arm {arm.name!r} {what} but the file names no config; add config: "
                    "module:Class (the pydantic model of the base config)"
                )
        return self

    def build(
        self, *, store: str | Literal[False] | None = None, fresh: bool = False
    ) -> Experiment:
        """Import what the file names and build its `Experiment`, ready to `run()`.

        Everything is checked here, before any run: the imports, the base config and every
        arm's overrides, the callbacks. `store` (``lab run --store``) wins over the file's
        own ``store``, which wins over ``LAB_STORE_URL``; nothing is opened until `run()`.
        `fresh` (``lab run --fresh``) supersedes the runs recorded before (see `Experiment`).
        """
        label = self._label()
        folder = self._source.resolve().parent if self._source is not None else Path.cwd()

        train = _function(self.train, folder, label, "train")
        base = None
        if self.config is not None:
            model = _model_class(self.config, folder, label)
            data = self.base_config or {}
            typo = unknown_field(model, data, at=("base_config",))
            if typo is not None:
                raise ConfigError(f"{label}: {typo}{self._from_overrides('base_config')}")
            try:
                base = model.model_validate(data)
            except pydantic.ValidationError as exc:
                where = describe(exc, model, at=("base_config",))
                raise ConfigError(
                    f"{label}: {where}{self._from_overrides('base_config')}"
                ) from None
        functions = {name: _function(ref, folder, label, f"benchmarks.{name}")
                     for name, ref in self.benchmarks.items()}  # fmt: skip
        try:
            callbacks = build(self.callbacks)
        except ConfigError as exc:
            raise ConfigError(f"{label}: callbacks: {exc}") from None
        metric = self.summary.metric
        if metric is not None and metric.partition("/")[0] not in self.benchmarks:
            callbacks.append(SummaryMetric(metric, f"{label}: summary.metric {metric!r}"))
        try:
            benchmarks = _evaluators(functions)
            arms = [Arm(a.name, stages=a.stages, carry=a.carry, resources=a.resources,
                        **a.overrides) for a in self.arms or []]  # fmt: skip
            repeats: int | None = self.repeats
            if self.race is not None and "repeats" not in self.model_fields_set:
                repeats = None  # the race's max_repeats
            return Experiment(
                self.name, train, arms=arms, repeats=repeats, base_config=base,
                callbacks=callbacks, store=store if store is not None else self.store,
                output_dir=self.output_dir, seed=self.seed, benchmarks=benchmarks,
                strict=self.strict, executor=self.executor, workers=self.workers,
                tags=self.tags, notes=self.notes, fresh=fresh, resources=self.resources,
                ray_address=self.ray_address, max_retries=self.max_retries,
                metric=metric, mode=self.summary.mode if metric is not None else None,
                bounds=self.summary.bounds, **self.sections(),
            )  # fmt: skip
        except ConfigError as exc:  # an arm's override, a duplicate arm name, ...
            raise ConfigError(f"{label}: {exc}") from None
        except StoreError as exc:  # a URL of an unknown scheme: say which one was wrong
            if store is not None or not isinstance(self.store, str):
                raise  # the URL came from --store or LAB_STORE_URL, which the error names
            raise type(exc)(f"{label}: store: {exc}") from None

    def summarize(self, result: ExperimentResult, *, all_metrics: bool = False) -> Summary:
        """The result's summary, ranked as the file's ``summary`` says (`all_metrics`: its
        text shows the routine metrics too).

        When every run failed there are no metrics to rank by; the summary then only counts
        the runs, rather than calling the file's metric unknown.
        """
        if all(r.status in FAILED for r in result.runs):
            return result.summary(all_metrics=all_metrics)
        try:
            return result.summary(
                self.summary.metric, self.summary.mode, keys=self.summary.keys,
                all_metrics=all_metrics,
            )  # fmt: skip
        except ConfigError as exc:  # a metric no run logged: a typo in the file
            raise ConfigError(f"{self._label()}: summary: {exc}") from None

    def sections(self) -> dict[str, Any]:
        """The file's ``sweep:``, ``race:`` and ``prune:`` sections as the `Sweep`, `Race`
        and `Prune` they describe (only those it has), checked: each mistake is one line
        that names the file and the field."""
        return {
            field: _section(getattr(self, field), field, self._label())
            for field in _SECTIONS
            if getattr(self, field) is not None
        }

    def _from_overrides(self, field: str) -> str:
        """`` (overrides: base_config.lr=x)``: the overrides of `field`, where a bad value of
        it may have come from."""
        mine = [o for o in self._overrides if o.partition("=")[0].split(".")[0] == field]
        return f" (overrides: {' '.join(mine)})" if mine else ""

    def _label(self) -> str:
        """How messages name the file: its path as given."""
        return str(self._source) if self._source is not None else "experiment file"


def read_experiment_file(path: str | Path, overrides: Sequence[str] = ()) -> ExperimentFile:
    """Parse and check an experiment file without importing or running anything, so a
    mistake in it costs one line, not a run that dies later.

    The suffix picks the format: ``.yaml``/``.yml`` (YAML, loaded safely; a key written twice
    is an error rather than silently the last) or ``.json``. `overrides` change the file's
    values before it is checked, as ``lab run FILE repeats=5 base_config.lr=0.1`` does
    (dotted keys, YAML values; see `lab._overrides`).
    """
    path = Path(path)
    fmt = FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise ConfigError(f"{path}: an experiment file ends in .yaml, .yml or .json")
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read it ({exc}); give a UTF-8 text file") from None
    data = _load_yaml(text, path) if fmt == "yaml" else _load_json(text, path)
    if data is None:
        raise ConfigError(f"{path}: the file is empty; write at least name: and train:")
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path}: the file holds a {type(data).__name__}, not fields; write name:, train:, "
            "... at the top level"
        )
    if overrides:
        try:
            data = apply_overrides(data, overrides, fields=_override_fields)
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc}") from None
    try:
        spec = ExperimentFile.model_validate(data)
    except pydantic.ValidationError as exc:
        raise ConfigError(
            f"{path}: {describe(exc, ExperimentFile)}{_from(exc, overrides)}"
        ) from None
    spec._source = path
    spec._overrides = tuple(overrides)
    spec.sections()  # a bad sweep:, race: or prune: section: one line now, before any run
    return spec


#: Where each section's class lives, and the field that is parsed before it is built.
_SECTIONS = {
    "sweep": ("lab.sweeps.sweep", "Sweep"),
    "race": ("lab.sweeps.racing", "Race"),
    "prune": ("lab.sweeps.pruning", "Prune"),
}


def _section(data: Any, field: str, label: str) -> Any:
    """The `Sweep`, `Race` or `Prune` of a file's section `field` (a mapping of its
    fields); a ConfigError naming the file and the field for anything wrong."""
    import importlib

    module, name = _SECTIONS[field]
    try:
        cls = getattr(importlib.import_module(module), name)
    except ImportError:
        raise ConfigError(f"{label}: {field}: this version of lab has no {name}") from None
    params = inspect.signature(cls).parameters.values()
    fields = [p.name for p in params if p.kind is not p.VAR_KEYWORD]
    options = any(p.kind is p.VAR_KEYWORD for p in params)  # Prune's: its rule's options
    listed = ", ".join(fields) + (", and its rule's options" if options else "")
    if not isinstance(data, dict):
        raise ConfigError(f"{label}: {field}: {data!r}; write a mapping of {name}'s fields "
                          f"({listed})")  # fmt: skip
    unknown = sorted(str(k) for k in data if k not in fields)
    if unknown and not options:
        raise ConfigError(
            f"{label}: {field}.{unknown[0]}: {name} has no such field; its fields: {listed}"
        )
    values = dict(data)
    if field == "sweep":
        from lab.sweeps.space import parse_space

        values["space"] = parse_space(values.get("space"), f"{label}: sweep.space")
    try:
        return cls(**values)
    except ConfigError as exc:
        raise ConfigError(f"{label}: {field}: {exc}") from None
    except TypeError as exc:  # a required field left out
        raise ConfigError(f"{label}: {field}: {exc}") from None


def _override_fields(path: tuple[str, ...]) -> list[str] | None:
    """The keys an override may set at `path`: the file's fields, the summary's; any key
    elsewhere (a base config's or an arm's, which the config's model checks at build)."""
    if path == ():
        return list(ExperimentFile.model_fields)
    if path == ("summary",):
        return list(SummaryEntry.model_fields)
    return None


def _from(exc: pydantic.ValidationError, overrides: Sequence[str]) -> str:
    """`` (from the override 'repeats=many')`` when the bad value came from one."""
    loc = tuple(str(p) for p in exc.errors()[0]["loc"])
    for text in reversed(overrides):
        key = tuple(text.partition("=")[0].strip().split("."))
        if loc[: len(key)] == key or key[: len(loc)] == loc:
            return f" (from the override {text!r})"
    return ""


def load_experiment(
    path: str | Path,
    *,
    store: str | Literal[False] | None = None,
    overrides: Sequence[str] = (),
) -> Experiment:
    """The `Experiment` an experiment file describes, built and checked, not yet run: the same
    study from a file that a launcher, a sweep tool or a colleague can edit without code.

    `store` wins over the file's ``store``, which wins over ``LAB_STORE_URL``. `overrides`
    (``["repeats=5", "base_config.lr=0.1"]``) change the file's values first. The file's
    folder stays on ``sys.path`` (for the worker processes of ``executor: processes``).
    """
    return read_experiment_file(path, overrides).build(store=store)


def plan(exp: Experiment) -> str:
    """What ``exp.run()`` would run, as text, without running anything, opening the store or
    writing a file: what ``lab run --dry-run`` prints, to check a study before it costs hours.
    """
    if exp.sweep is None:
        runs = exp.repeats * sum(max(1, len(arm.stages or ())) for arm in exp.arms)
        arms = plural(len(exp.arms), "arm")
    else:  # sampled as it runs: how many it will ask
        runs = exp.repeats * sweep_size(exp.sweep)
        arms = plural(sweep_size(exp.sweep), "sampled arm")
    where = {
        "serial": "serial",
        "processes": f"processes, {exp.workers} at a time",
        "ray": "ray" if exp.workers is None else f"ray, {exp.workers} at a time",
    }[exp.executor]
    lines = [f"{exp.name}: {arms} x {plural(exp.repeats, 'repeat')} = {plural(runs, 'run')} "
             f"({where})"]  # fmt: skip
    module = getattr(exp.train, "__module__", None)
    name = getattr(exp.train, "__qualname__", None)
    lines.append(f"train: {module}:{name}" if module and name else f"train: {exp.train!r}")
    if exp.base_config is not None:
        config = json.dumps(exp.base_config.model_dump(mode="json"))
        lines.append(f"config: {type(exp.base_config).__name__} {config}")
    sinks = [type(cb).__name__ for cb in exp.callbacks if not isinstance(cb, SummaryMetric)]
    if exp.store is False:
        lines.append("store: none (store: false)")
    else:
        if not any(isinstance(cb, StoreSink) for cb in exp.callbacks):
            sinks.append(type(store_sink(exp.store)).__name__)
        url = exp.store if isinstance(exp.store, str) else getattr(exp.store, "url", exp.store)
        shown = resolve_url(url).shown if isinstance(url, str) else url
        lines.append(f"store: {shown}")
    lines.append(f"run folders: {exp.output_dir / safe_name(exp.name)}/<run>")
    lines.append(f"callbacks: {', '.join(sinks) or 'none'}")
    lines += _metric_lines(exp)
    if exp.race is not None:
        r = exp.race
        lines.append(
            f"race: by {r.metric} ({r.mode}), {r.test} test at alpha {r.alpha}, "
            f"{r.min_repeats} to {r.max_repeats} repeats per arm: at most "
            f"{plural(runs if r.budget is None else min(runs, r.budget), 'run')}, fewer as "
            "arms drop"
        )
    lines += _search_lines(exp)
    if exp.benchmarks:
        lines.append(f"benchmarks: {', '.join(b.name for b in exp.benchmarks)}")
    if exp.sweep is not None:  # the arms are not known before they are asked: the space
        space = sweep_config(exp.sweep)["space"]
        params = [(key, json.dumps(param)) for key, param in space.items()]
        return "\n".join([*lines, "", render(("param", "sampled from"), params)])
    rows = []
    for arm in exp.arms:
        stages = [f"-s{k}" for k in range(len(arm.stages))] if arm.stages is not None else [""]
        keys = [f"{safe_name(arm.name)}-r{r}{s}" for r in range(exp.repeats) for s in stages]
        cell = json.dumps(arm.overrides, default=str)
        if arm.stages is not None:
            cell += f", stages {json.dumps(arm.stages, default=str)} (carry {arm.carry})"
        rows.append((arm.name, cell, ", ".join(keys)))
    lines += ["", render(("arm", "overrides", "runs"), rows)]
    return "\n".join(lines)


def _search_lines(exp: Experiment) -> list[str]:
    """The plan's word on a sweep (how many arms, by which sampler, named how, asked when,
    told what) and on pruning (the rule, its metric and options)."""
    lines = []
    sweep = exp.sweep
    if sweep is not None:
        n = sweep_size(sweep)
        sampler = sweep.sampler if isinstance(sweep.sampler, str) else type(sweep.sampler).__name__
        names = (
            "named by their values"
            if sweep.sampler == "grid"
            else f"named {sweep.arm_name(0, {})} to {sweep.arm_name(n - 1, {})}"
        )
        if exp.race is not None:
            when = "all asked up front, then raced"
        elif sweep.batch is not None:
            when = f"asked {sweep.batch} at a time"
        elif exp.executor == "serial":
            when = "asked one at a time, as each arm's runs end"
        else:
            when = "asked as workers free"
        metric = sweep.metric or exp.declared.metric
        mode = sweep.mode or exp.declared.mode or "min"
        lines.append(
            f"sweep: {plural(n, 'arm')} sampled by {sampler} (seed {sweep.seed}), {names}, "
            f"{when}; each told its mean {metric} ({mode}); run again, it continues from its "
            "recorded trials"
        )
    prune = exp.prune
    if prune is not None:
        options = "".join(f", {k}={v!r}" for k, v in prune.options.items())
        lines.append(
            f"prune: Optuna's {prune.rule_name} rule on {prune.metric} ({prune.mode}{options}) "
            "stops runs early; a pruned run counts toward no arm's mean"
        )
    return lines


class SummaryMetric(Callback):
    """The file's ``summary.metric``, handed to every fit as a needed metric name, so a typo
    shows at the first step or eval of the first run (a WARNING with the close matches), not
    after the last run, when the summary cannot rank by it. It fires no hook."""

    def __init__(self, metric: str, who: str) -> None:
        self.metrics_needed = {metric: who}


def _metric_lines(exp: Experiment) -> list[str]:
    """The plan's word on the metric names its callbacks and summary need: which ones the
    known sources declare, and a warning for each that looks like a typo of one of them.

    ``train(run)`` builds the loop, its evaluators and loss function, so before the runs
    only the loop's own metrics, the callbacks' and declared benchmark metrics are known;
    a name beyond them is looked for at each run's first step or eval.
    """
    needed = needed_by(exp.callbacks)
    if not needed:
        return []
    known = [*LOOP_METRICS, *logged_by(exp.callbacks)]
    known += [f"{b.name}/{k}" for b in exp.benchmarks for k in b.metrics or ()]
    lines, later = [], []
    for name, who in needed.items():
        if any(fnmatch.fnmatchcase(name, p) for p in known):
            continue
        later.append(name)
        prefix = name.rpartition("/")[0]  # a typo of a name of the same kind: 'los', not 'val/x'
        matches = close_matches(name, [k for k in known if k.rpartition("/")[0] == prefix])
        if matches:
            guess = " or ".join(repr(m) for m in matches)
            lines.append(f"warning: {who}: no known source logs {name!r}; did you mean {guess}?")
    if later:
        lines.append(f"metrics looked for at each run's first step or eval: {', '.join(later)}")
    return lines


# -- parsing ---------------------------------------------------------------------------------
class _DuplicateKey(yaml.constructor.ConstructorError):
    """A key written twice in one YAML mapping."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """`yaml.safe_load`'s loader, except that a key written twice in one mapping is an error:
    YAML would keep the last one, and a second ``callbacks:`` would hide the first."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag.endswith(":merge"):
                continue  # `<<: *defaults` merges may be overridden: that is their point
            key = self.construct_object(key_node)
            if key in seen:
                raise _DuplicateKey(None, None, f"key {key!r} appears twice (also on line "
                                    f"{seen[key]}); keep one", key_node.start_mark)  # fmt: skip
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


def _load_yaml(text: str, path: Path) -> Any:
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # safe: a SafeLoader subclass
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        problem = " ".join(str(getattr(exc, "problem", None) or exc).split())
        if isinstance(exc, _DuplicateKey):
            raise ConfigError(f"{at}: {problem}") from None
        raise ConfigError(f"{at}: not valid YAML: {problem}; fix the file there") from None


def _load_json(text: str, path: Path) -> Any:
    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        keys = [k for k, _ in pairs]
        twice = sorted({k for k in keys if keys.count(k) > 1})
        if twice:
            raise ConfigError(f"{path}: key {twice[0]!r} appears twice in one object; keep one")
        return dict(pairs)

    try:
        return json.loads(text, object_pairs_hook=unique)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"{path}:{exc.lineno}:{exc.colno}: not valid JSON: {exc.msg}; fix the file there"
        ) from None


# -- imports ---------------------------------------------------------------------------------
def _import(ref: str, folder: Path, label: str, field: str) -> tuple[Any, Any]:
    """The module and the object that ``module:name`` names, the file's folder searched first."""
    module_name, _, attr = ref.partition(":")
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))  # stays: workers copy sys.path at their start
    importlib.invalidate_caches()  # a module written since the folder was last listed
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or module_name
        if module_name == missing or module_name.startswith(f"{missing}."):
            raise ConfigError(
                f"{label}: {field}: no module named {missing!r} in {folder} (the file's folder) "
                f"or on sys.path; put {missing.replace('.', '/')}.py next to the file, or "
                "install it"
            ) from None
        raise ConfigError(
            f"{label}: {field}: module {module_name!r} imports {missing!r}, which is not "
            f"installed; pip install it"
        ) from None
    _check_origin(module_name, folder, label, field)
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(
                f"{label}: {field}: module {module_name!r} ({_location(module)}) has no "
                f"{attr!r}; {_offer(module, field)}"
            )
        obj = getattr(obj, part)
    return module, obj


def _evaluators(functions: dict[str, Any]) -> list[Any]:
    """The post-training benchmarks, an `Evaluator` each; the loop (and torch) is imported
    only for a file that names some, so checking one that names none stays quick."""
    if not functions:
        return []
    from lab.loop.evals import Evaluator

    return [Evaluator(name, fn) for name, fn in functions.items()]


def _function(ref: str, folder: Path, label: str, field: str) -> Any:
    module, obj = _import(ref, folder, label, field)
    if not callable(obj) or isinstance(obj, type):
        what = "a class" if isinstance(obj, type) else f"a {type(obj).__name__}"
        raise ConfigError(f"{label}: {field}: {ref} is {what}, not a function; "
                          f"{_offer(module, field)}")  # fmt: skip
    return obj


def _model_class(ref: str, folder: Path, label: str) -> type[pydantic.BaseModel]:
    module, obj = _import(ref, folder, label, "config")
    if not (isinstance(obj, type) and issubclass(obj, pydantic.BaseModel)):
        what = "a class" if isinstance(obj, type) else f"a {type(obj).__name__}"
        raise ConfigError(
            f"{label}: config: {ref} is {what}, not a pydantic model class; name a class "
            f"derived from pydantic.BaseModel ({_offer(module, 'config')})"
        )
    return obj


def _offer(module: Any, field: str) -> str:
    """The names in `module` that `field` could use: its pydantic models for ``config``, its
    functions for the rest."""
    own = [
        (n, v)
        for n, v in vars(module).items()
        if not n.startswith("_") and getattr(v, "__module__", None) == module.__name__
    ]
    if field == "config":
        names = [n for n, v in own if isinstance(v, type) and issubclass(v, pydantic.BaseModel)]
        return f"its pydantic models: {', '.join(names)}" if names else "it defines no models"
    names = [n for n, v in own if inspect.isfunction(v)]
    return f"its functions: {', '.join(names)}" if names else "it defines no functions"


def _location(module: Any) -> str:
    file = getattr(module, "__file__", None)
    if file:
        return str(file)
    return ", ".join(str(p) for p in getattr(module, "__path__", [])) or "built in"


def _check_origin(module_name: str, folder: Path, label: str, field: str) -> None:
    """Fail when the module beside the file lost to another of the same name: one imported
    earlier in this process, or one found earlier on ``sys.path``. A process holds one module
    per name, and pickling (``executor: processes``) finds functions by that name."""
    top = module_name.split(".")[0]
    if not ((folder / f"{top}.py").is_file() or (folder / top).is_dir()):
        return  # not beside the file: an installed module, wherever it is
    module = sys.modules[top]
    places = [getattr(module, "__file__", None), *getattr(module, "__path__", [])]
    if any(p and Path(p).resolve().is_relative_to(folder) for p in places):
        return
    raise ConfigError(
        f"{label}: {field}: module {top!r} is {_location(module)}, not the one in {folder}; "
        f"a process holds one module per name, so rename {top!r} beside the file"
    )
