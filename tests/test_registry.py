"""Every built-in callback is registered with a pydantic Config that matches its constructor,
and `build` makes callbacks from YAML or JSON, rejecting what it does not know by name."""

from __future__ import annotations

import importlib
import inspect
import json
import pkgutil

import pydantic
import pytest
import yaml

import lab.callbacks
import lab.loggers
from lab import Callback
from lab._imports import pip_install
from lab.callbacks import REGISTRY, build, register
from lab.callbacks.params import PositiveInt
from lab.callbacks.registry import _BUILTIN_KINDS, _load_builtins
from lab.errors import ConfigError

# Constructor arguments that are live objects, not configuration: a file cannot hold them.
LIVE_ARGUMENTS = {("ConsoleLogger", "stream"), ("ConsoleLogger", "console")}


def _builtin_callback_classes() -> list[type[Callback]]:
    found: dict[str, type[Callback]] = {}
    for package in (lab.callbacks, lab.loggers):
        for info in pkgutil.iter_modules(package.__path__, f"{package.__name__}."):
            module = importlib.import_module(info.name)
            for obj in vars(module).values():
                if (
                    inspect.isclass(obj)
                    and issubclass(obj, Callback)
                    and obj is not Callback
                    and obj.__module__ == module.__name__
                ):
                    found[obj.__qualname__] = obj
    return sorted(found.values(), key=lambda c: c.__name__)


def test_every_builtin_callback_is_registered_with_a_config_built_from_its_signature() -> None:
    _load_builtins()
    classes = _builtin_callback_classes()
    assert len(classes) >= 14
    registered = {cls: (kind, config) for kind, (cls, config) in REGISTRY.items()}
    missing = [c.__name__ for c in classes if c not in registered]
    assert not missing, f"register these callbacks: {missing}"
    for cls in classes:
        kind, config = registered[cls]
        assert issubclass(config, pydantic.BaseModel)
        assert config.model_config.get("extra") == "forbid", kind
        assert cls.Config is config  # type: ignore[attr-defined]
        signature = inspect.signature(cls.__init__).parameters
        plain = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
        params = {name for name, p in signature.items() if name != "self" and p.kind not in plain}
        live = {name for c, name in LIVE_ARGUMENTS if c == cls.__name__}
        assert set(config.model_fields) == params - live, kind
        for name, field in config.model_fields.items():  # the signature's defaults, as is
            default = signature[name].default
            if default is inspect.Parameter.empty:
                assert field.is_required(), (kind, name)
            else:
                assert field.default == default, (kind, name)


def test_build_finds_each_builtin_kind_where_it_registers() -> None:
    """`build` imports only the modules of the kinds it is given; its table of where each
    kind registers is what importing every module of lab.callbacks and lab.loggers
    registers."""
    _builtin_callback_classes()
    registered = {k: cls.__module__ for k, (cls, _) in REGISTRY.items()
                  if cls.__module__.startswith("lab.")}  # fmt: skip
    assert registered == _BUILTIN_KINDS


YAML = """
- kind: console_logger
  params: {every: 25, metrics: [loss, val/loss]}
- kind: early_stopping
  params: {metric: val/loss, patience: 4, mode: min}
- kind: speed_monitor
- kind: sql_logger
  params: {store: "sqlite:///from-yaml.db"}
"""


def test_build_from_yaml_and_from_json_gives_the_same_callbacks() -> None:
    specs = yaml.safe_load(YAML)
    from_yaml = build(specs)
    from_json = build(json.loads(json.dumps(specs)))
    assert [type(c).__name__ for c in from_yaml] == [
        "ConsoleLogger",
        "EarlyStopping",
        "SpeedMonitor",
        "SqlLogger",
    ]
    assert [type(c) for c in from_json] == [type(c) for c in from_yaml]
    console, stopping, speed, sql = from_yaml
    assert console.every == 25 and console.metrics == ("loss", "val/loss")
    assert (stopping.metric, stopping.patience, stopping.mode) == ("val/loss", 4, "min")
    assert speed.every == 1  # params left out: the Config's defaults
    assert sql._store_arg == "sqlite:///from-yaml.db"


def test_an_unknown_kind_lists_every_known_kind() -> None:
    with pytest.raises(ConfigError) as info:
        build([{"kind": "tensorboard_logger"}])
    message = str(info.value)
    assert message.startswith("unknown callback kind 'tensorboard_logger'; known: ")
    assert message.split("known: ")[1].split(", ") == sorted(REGISTRY)
    assert "\n" not in message


def test_an_unknown_param_lists_the_valid_ones() -> None:
    with pytest.raises(ConfigError) as info:
        build([{"kind": "early_stopping", "params": {"metric": "loss", "patiance": 3}}])
    assert str(info.value) == (
        "early_stopping: unknown params ['patiance']; "
        "valid: eval_name, metric, min_delta, mode, patience"
    )


def test_bad_specs_and_bad_values_are_one_line_each() -> None:
    with pytest.raises(ConfigError, match=r"callback spec #0 is 'speed_monitor'; write"):
        build(["speed_monitor"])  # type: ignore[list-item]
    with pytest.raises(ConfigError, match=r"callback spec #1 has unknown fields \['args'\]"):
        build([{"kind": "speed_monitor"}, {"kind": "speed_monitor", "args": {}}])
    with pytest.raises(ConfigError) as info:
        build([{"kind": "early_stopping", "params": {"metric": "loss", "patience": "soon"}}])
    assert str(info.value) == "EarlyStopping(patience='soon'): use an int >= 1"
    with pytest.raises(ConfigError) as info:
        build([{"kind": "early_stopping"}])
    assert str(info.value) == (
        "early_stopping: missing params ['metric']; write params: {metric: ...}"
    )


def test_critical_in_a_spec_makes_that_callback_fail_the_run() -> None:
    import torch

    from lab import Experiment, TrainingLoop

    critical, relaxed = build(
        [
            {"kind": "metric_saver", "params": {"fname": "a.json"}, "critical": True},
            {"kind": "metric_saver", "params": {"fname": "b.json"}},
        ]
    )
    assert critical.critical is True and relaxed.critical is False
    assert type(critical).critical is False  # the instance, not the class

    class Unwritable(type(critical)):  # type: ignore[misc]
        def on_train_end(self, state: object, artifacts: object) -> None:
            raise OSError("disk full")

    def train(run: object) -> object:
        model = torch.nn.Linear(2, 1)
        data = [torch.ones(4, 2)]
        loop = TrainingLoop(
            model, torch.optim.SGD(model.parameters(), lr=0.1), data,
            lambda m, b: m(b).pow(2).mean(), 3,
        )  # fmt: skip
        return loop.fit(run)  # type: ignore[arg-type]

    for is_critical, status in ((True, "failed"), (False, "completed")):
        saver = Unwritable()
        saver.critical = is_critical
        result = Experiment("crit", train, callbacks=[saver], store=False, strict=False).run()
        assert [r.status for r in result.runs] == [status]
        assert [r.error for r in result.runs] == (["OSError: disk full"] if is_critical else [None])
    with pytest.raises(ConfigError, match=r"critical='yes'; use true or false"):
        build([{"kind": "speed_monitor", "critical": "yes"}])


@pytest.mark.parametrize(
    ("specs", "message"),
    [
        (
            {"kind": "speed_monitor"},
            "callbacks must be a list of {kind, params} specs, got dict; write "
            "[{kind: ..., params: {...}}, ...]",
        ),
        (
            "speed_monitor",
            "callbacks must be a list of {kind, params} specs, got str; write "
            "[{kind: ..., params: {...}}, ...]",
        ),
        (
            [{"kind": "speed_monitor", "params": ["every", 5]}],
            "speed_monitor: params must be a mapping of name: value, got list ['every', 5]; "
            "write params: {name: value}",
        ),
        (
            [{"kind": "speed_monitor", "params": "every=5"}],
            "speed_monitor: params must be a mapping of name: value, got str 'every=5'; "
            "write params: {name: value}",
        ),
    ],
)
def test_a_spec_of_the_wrong_shape_is_one_line(specs: object, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        build(specs)  # type: ignore[arg-type]
    assert str(info.value) == message


def test_a_kind_that_is_not_a_string_lists_the_known_kinds() -> None:
    with pytest.raises(ConfigError, match=r"^unknown callback kind \['speed_monitor'\]; known: "):
        build([{"kind": ["speed_monitor"]}])


@pytest.mark.parametrize(
    ("module", "spec", "message"),
    [
        (
            "wandb",
            {"kind": "wandb_logger", "params": {"project": "p"}},
            f"WandbLogger needs the wandb package: {pip_install('wandb')}",
        ),
        (
            "httpx",
            {"kind": "notifier", "params": {"url": "http://127.0.0.1:9/hook"}},
            f"Notifier needs the httpx package: {pip_install('notify')}",
        ),
    ],
)
def test_a_missing_extra_is_named_with_its_pip_line_before_anything_runs(
    module: str, spec: dict, message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    monkeypatch.setitem(sys.modules, module, None)  # as if the package were not installed
    with pytest.raises(ConfigError) as info:
        build([spec])
    assert str(info.value) == message


@pytest.mark.parametrize(
    ("kind", "params", "message"),
    [
        ("early_stopping", {"metric": "loss", "patience": "soon"},
         "EarlyStopping(patience='soon'): use an int >= 1"),
        ("early_stopping", {"metric": "loss", "patience": True},
         "EarlyStopping(patience=True): use an int >= 1"),
        ("early_stopping", {"metric": ""}, "EarlyStopping(metric=''): use a non-empty string"),
        ("early_stopping", {"metric": "loss", "mode": "avg"},
         "EarlyStopping(mode='avg'): use 'min' or 'max'"),
        ("early_stopping", {"metric": "loss", "min_delta": -1},
         "EarlyStopping(min_delta=-1): use a number >= 0"),
        ("speed_monitor", {"every": 2.0}, "SpeedMonitor(every=2.0): use an int >= 1"),
        ("speed_monitor", {"peak_flops": 0},
         "SpeedMonitor(peak_flops=0): use a number > 0, or None"),
        ("stability_monitor", {"window": 5, "min_history": 6},
         "StabilityMonitor(min_history=6): use 2 <= min_history <= window (5)"),
        ("stability_monitor", {"threshold": float("nan")},
         "StabilityMonitor(threshold=nan): use a number > 0"),
        ("garbage_collector", {"generation": 3},
         "GarbageCollector(generation=3): use 0, 1 or 2"),
        ("profiler", {"active": 0}, "ProfilerCallback(active=0): use an int >= 1"),
        ("metric_saver", {"fname": "sub/m.json"},
         "MetricSaver(fname='sub/m.json'): give a file name, not a path"),
        ("console_logger", {"every_s": -1}, "ConsoleLogger(every_s=-1): use a number > 0, or None"),
        ("console_logger", {"metrics": "loss"},
         "ConsoleLogger(metrics='loss'): use a list of strings"),
        ("notifier", {"url": "ftp://x"}, "Notifier(url='ftp://x'): give an http(s) webhook URL"),
        ("notifier", {"url": "http://h/x", "on": "never"},
         "Notifier(on='never'): use 'end', 'failure' or 'both'"),
        ("model_averager", {"window": 2, "every": 0},
         "ModelAverager(every=0): use an int >= 1, or None"),
        ("sql_logger", {"store": 5},
         "SqlLogger(store=5): use a Store or a HttpStore or a string, or None"),
    ],
)  # fmt: skip
def test_a_bad_value_is_the_same_line_from_python_and_from_yaml(
    kind: str, params: dict, message: str
) -> None:
    _load_builtins()
    cls, _ = REGISTRY[kind]
    with pytest.raises(ConfigError) as from_python:
        cls(**params)
    with pytest.raises(ConfigError) as from_yaml:
        build(yaml.safe_load(yaml.safe_dump([{"kind": kind, "params": params}])))
    assert str(from_python.value) == str(from_yaml.value) == message


def test_values_are_converted_the_same_way_from_both_doors() -> None:
    from lab.callbacks.monitors import EarlyStopping, StabilityMonitor
    from lab.loggers.console import ConsoleLogger

    (built,) = build([{"kind": "console_logger", "params": {"metrics": ["loss", "val/loss"]}}])
    assert built.metrics == ConsoleLogger(metrics=["loss", "val/loss"]).metrics
    assert built.metrics == ("loss", "val/loss")
    # YAML 1.1 reads 1e-3 as a string; a number parameter takes it as the number it spells.
    (stopping,) = build(yaml.safe_load("[{kind: early_stopping, params: {metric: loss, "
                                       "min_delta: 1e-3}}]"))  # fmt: skip
    assert stopping.min_delta == EarlyStopping("loss", min_delta="1e-3").min_delta == 0.001
    assert StabilityMonitor(keys="loss").keys == ("loss",)


def test_a_callback_written_once_is_checked_from_both_doors_and_pickles() -> None:
    import pickle

    @register("test_every_n")
    class EveryN(Callback):
        """A callback as a user writes one: the signature is the only statement of params."""

        def __init__(self, every: PositiveInt = 5, name: str = "n") -> None:
            self.every, self.name = every, name

    try:
        assert list(EveryN.Config.model_fields) == ["every", "name"]  # type: ignore[attr-defined]
        spec = {"kind": "test_every_n", "params": {"every": 0}}
        for door in (lambda: EveryN(every=0), lambda: build([spec])):
            with pytest.raises(ConfigError) as info:
                door()
            assert str(info.value) == "EveryN(every=0): use an int >= 1"
        (made,) = build([{"kind": "test_every_n", "params": {"every": 7}}])
        assert (made.every, made.name) == (7, "n")
        with pytest.raises(TypeError, match="unexpected keyword argument 'evry'"):
            EveryN(evry=3)  # a wrong call stays Python's TypeError
    finally:
        del REGISTRY["test_every_n"]
    early = build([{"kind": "early_stopping", "params": {"metric": "val/loss", "patience": 2}}])
    copy = pickle.loads(pickle.dumps(early[0]))
    assert (copy.metric, copy.patience) == ("val/loss", 2)
    config = pickle.loads(pickle.dumps(type(early[0]).Config))  # by reference
    assert config is type(early[0]).Config


def test_a_given_config_model_checks_the_python_door_too() -> None:
    """`register(kind, Config)` with a hand-written model: both doors still agree."""

    class Params(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="forbid")
        interval_s: float = pydantic.Field(default=1.0, gt=0)

    @register("test_given_config", Params)
    class Polling(Callback):
        def __init__(self, interval_s: float = 1.0) -> None:
            self.interval_s = interval_s

    try:
        assert Polling.Config is Params  # type: ignore[attr-defined]
        with pytest.raises(ConfigError) as from_python:
            Polling(interval_s=0)
        with pytest.raises(ConfigError) as from_yaml:
            build([{"kind": "test_given_config", "params": {"interval_s": 0}}])
        assert str(from_python.value) == str(from_yaml.value)
        assert str(from_python.value) == "Polling(interval_s=0): use a number > 0"
    finally:
        del REGISTRY["test_given_config"]
