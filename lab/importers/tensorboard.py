"""TensorBoard log folders, read with TensorBoard's own `EventMultiplexer`: each folder that
holds event files is a run (as TensorBoard shows it), with every scalar's step, value and
wall time, and the hparams plugin's data where ``add_hparams`` wrote it (the run's config
and its end status). A run folder that holds only what ``add_hparams`` wrote under its own
name (torch's default ``run_name``, a sub-folder) is folded into the run folder above it.
Event files record no start, end nor status: a run without hparams is `completed`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lab.importers.core import Source, SourceError, SourceRun, status_of

#: The hparams plugin's session end statuses, as the source statuses `lab` maps.
_ENDS = {0: "finished", 1: "finished", 2: "failed", 3: "running"}


def read_tensorboard(logdir: str | Path) -> Source:
    """Every run under `logdir` (the folder itself too, when it holds event files)."""
    from lab._imports import require

    require("tensorboard", "import", "lab import tensorboard")
    from tensorboard.backend.event_processing import event_accumulator, event_multiplexer

    root = Path(logdir)
    if not root.is_dir():
        raise SourceError(f"no such folder: {logdir}")
    everything = {event_accumulator.SCALARS: 0, event_accumulator.TENSORS: 0}
    mux = event_multiplexer.EventMultiplexer(size_guidance=everything)
    mux.AddRunsFromDirectory(str(root))
    mux.Reload()
    runs = {name: _run(name, mux.GetAccumulator(name)) for name in sorted(mux.Runs())}
    if not runs:
        raise SourceError(
            f"{logdir} holds no TensorBoard event files (events.out.tfevents.*): give the "
            "folder SummaryWriter wrote to"
        )
    for name in sorted(runs, key=lambda n: -n.count("/")):
        parent = name.rpartition("/")[0] or "."
        if parent != name and parent in runs and _hparams_only(runs[name]):
            _fold(runs.pop(name), runs[parent])
    return Source("tensorboard", root.resolve().name, str(root), list(runs.values()))


def _run(name: str, acc: Any) -> SourceRun:
    metrics = {}
    walls = []
    for tag in sorted(acc.Tags()["scalars"]):
        by_step = {e.step: (e.step, float(e.value), e.wall_time) for e in acc.Scalars(tag)}
        metrics[tag] = [by_step[s] for s in sorted(by_step)]
        walls += [p[2] for p in metrics[tag]]
    config, raw, metric_tags = _hparams(acc)
    return SourceRun(
        source_id=name,
        name=name,
        config=config,
        metrics=metrics,
        status="completed" if raw is None else status_of(raw, "tensorboard")[0],
        started_at=min(walls) if walls else None,
        ended_at=max(walls) if walls else None,
        extra={"hparams_metrics": metric_tags} if metric_tags else {},
    )


def _hparams(acc: Any) -> tuple[dict[str, Any], str | None, list[str]]:
    """The hparams a run's ``add_hparams`` wrote, its end status (None when it wrote none)
    and the tags of the metrics it named."""
    from tensorboard.plugins.hparams import plugin_data_pb2

    try:
        content = acc.PluginTagToContent("hparams")
    except KeyError:
        return {}, None, []
    config: dict[str, Any] = {}
    end: str | None = None
    metric_tags: list[str] = []
    for raw in content.values():
        data = plugin_data_pb2.HParamsPluginData.FromString(raw)
        kind = data.WhichOneof("data")
        if kind == "session_start_info":
            for key, value in sorted(data.session_start_info.hparams.items()):
                config[key] = _value(value)
            end = end or "finished"
        elif kind == "session_end_info":
            end = _ENDS.get(data.session_end_info.status, "finished")
        elif kind == "experiment":
            metric_tags = [m.name.tag for m in data.experiment.metric_infos]
    return config, end, metric_tags


def _value(value: Any) -> Any:
    """An hparam (a protobuf `Value`) as data: the plugin keeps numbers as doubles (a seed
    of 1 reads 1.0), text and booleans as such."""
    from google.protobuf import json_format

    return json_format.MessageToDict(value)


def _hparams_only(run: SourceRun) -> bool:
    return bool(run.config) and set(run.metrics) <= set(run.extra.get("hparams_metrics", []))


def _fold(child: SourceRun, parent: SourceRun) -> None:
    """A run folder of ``add_hparams`` alone, folded into the run it describes."""
    parent.config = {**parent.config, **child.config}
    parent.status = child.status
    parent.extra = {**parent.extra, **child.extra}
    for key, points in child.metrics.items():
        parent.metrics.setdefault(key, points)
