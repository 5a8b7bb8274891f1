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
from lab.callbacks import REGISTRY, build
from lab.callbacks.registry import _load_builtins
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


def test_every_builtin_callback_is_registered_with_a_config_matching_its_constructor() -> None:
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
        params = {
            name
            for name, p in inspect.signature(cls.__init__).parameters.items()
            if name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        }
        fields = set(config.model_fields)
        assert fields <= params, f"{kind}: Config fields the constructor lacks: {fields - params}"
        live = {name for c, name in LIVE_ARGUMENTS if c == cls.__name__}
        assert params - fields == live, f"{kind}: constructor params the Config lacks"


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
    assert str(info.value).startswith("early_stopping: patience: Input should be a valid integer")
    with pytest.raises(ConfigError, match=r"early_stopping: metric: Field required"):
        build([{"kind": "early_stopping"}])


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
            "WandbLogger needs the wandb package: pip install 'lab[wandb]'",
        ),
        (
            "httpx",
            {"kind": "notifier", "params": {"url": "http://127.0.0.1:9/hook"}},
            "Notifier needs the httpx package: pip install 'lab[notify]'",
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
