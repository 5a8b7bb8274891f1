"""Histograms and images: made by `lab.media`, carried by `on_media`, stored as rows (images as
PNG files in the run folder), read back with plain SQL and through `lab.inspect`.

The loop-level tests run real experiments with a real `TrainingLoop`; a callback fires
`on_media` through the run's dispatcher after each step, as the run handle does.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pydantic
import pytest
import sqlalchemy as sa
import torch
from alembic import command
from hypothesis import given, settings
from hypothesis import strategies as st
from matplotlib.figure import Figure
from PIL import Image as PILImage

import lab
import lab.inspect
from lab import Arm, Callback, CheckpointConfig, Experiment, LoopState, RunSpec, TrainingLoop
from lab.errors import ConfigError, MetricError
from lab.loggers.jsonl import JsonlLogger, read_hooks, replay
from lab.media import (
    Histogram,
    Image,
    _tensor_histogram,
    histogram,
    image_path,
    key_folder,
    write_image,
)
from lab.store import Store
from lab.store.engine import make_engine, resolve_url, transaction
from lab.store.media import MediaRows
from lab.store.migrations import alembic_config, current_revision, upgrade

NAN, INF = math.nan, math.inf


# --------------------------------------------------------------------------------------------
# lab.media.histogram


def test_histogram_bins_finite_values_and_counts_nan_and_inf_apart() -> None:
    values = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, NAN, NAN, INF, -INF, -INF])
    h = histogram(values, bins=4)
    assert h == Histogram(
        edges=(0.0, 0.5, 1.0, 1.5, 2.0), counts=(1, 1, 1, 2), nan=2, posinf=1, neginf=2
    )
    # the same from numpy and from a list; a 2-D tensor is flattened
    assert histogram(values.numpy(), bins=4) == h
    assert histogram(values.tolist(), bins=4) == h
    assert histogram(values.reshape(2, 5), bins=4) == h
    json.dumps(h.__dict__)  # JSON-friendly as it is: plain numbers in tuples


def test_histogram_range_ints_empty_and_constant_values() -> None:
    # values outside a given range are not counted (as numpy.histogram)
    h = histogram([-5, 0, 1, 2, 3, 4, 99], bins=2, range=(0, 4))
    assert (h.edges, h.counts) == ((0.0, 2.0, 4.0), (2, 3))
    every_nan = histogram([NAN, NAN], bins=2)  # no finite value: edges over [0, 1]
    assert every_nan == Histogram((0.0, 0.5, 1.0), (0, 0), nan=2)
    assert histogram(torch.full((3,), 5.0), bins=2) == Histogram((4.5, 5.0, 5.5), (0, 3))
    assert histogram(torch.tensor([1, 2], dtype=torch.bfloat16), bins=1).counts == (2,)
    assert histogram(np.array([True, False, True]), bins=2).counts == (1, 2)


finite = st.floats(allow_nan=False, allow_infinity=False, width=32)


@settings(max_examples=150, deadline=None)
@given(
    values=st.lists(
        st.one_of(finite, st.sampled_from([NAN, INF, -INF, 0.0, 1.0, 0.1, 0.3, -0.7])),
        max_size=40,
    ),
    bins=st.integers(1, 12),
    ranged=st.booleans(),
)
def test_a_tensor_is_counted_exactly_as_numpy_counts_it(
    values: list[float], bins: int, ranged: bool
) -> None:
    """A tensor off the CPU is counted on its device (here the same code runs on the CPU);
    it must give numpy's counts, values on the edges included, the same NaN and inf counts,
    and the same error where float64 cannot make the bins."""
    range_ = (-0.7, 0.3) if ranged else None

    def outcome(values: Any, count: Any = histogram) -> Histogram | str:
        try:
            return count(values, bins, range_)
        except MetricError as exc:
            return str(exc)

    from_numpy = outcome(np.array(values, dtype=np.float32))
    assert outcome(torch.tensor(values, dtype=torch.float32), _tensor_histogram) == from_numpy
    assert outcome(torch.tensor(values, dtype=torch.float32)) == from_numpy
    if isinstance(from_numpy, Histogram):
        assert (from_numpy.nan, from_numpy.posinf, from_numpy.neginf) == (
            sum(math.isnan(v) for v in values), values.count(INF), values.count(-INF)
        )  # fmt: skip
    else:
        assert from_numpy.startswith(f"histogram: {bins} equal bins from ")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_tensor_is_counted_on_its_device_as_numpy_counts_it() -> None:
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(1_000_003, generator=gen)
    values[::1000] = torch.tensor([NAN, INF, -INF, 0.5]).repeat(251)[: values[::1000].numel()]
    for bins, range_ in ((64, None), (7, (-1.0, 0.5)), (1, None)):
        on_gpu = histogram(values.cuda(), bins=bins, range=range_)
        assert on_gpu == histogram(values.numpy(), bins=bins, range=range_)
    assert (on_gpu.nan, on_gpu.posinf, on_gpu.neginf) == (251, 250, 250)
    assert sum(on_gpu.counts) == 1_000_003 - 751


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda: histogram([1.0], bins=0), ConfigError,
         "histogram bins=0: give a whole number of bins, 1 or more"),
        (lambda: histogram([1.0], range=(2, 1)), ConfigError,
         "histogram range=(2, 1): give finite numbers with low < high"),
        (lambda: histogram([1.0], range=(0, INF)), ConfigError,
         "histogram range=(0, inf): give finite numbers with low < high"),
        (lambda: histogram(["a", "b"]), MetricError,
         "histogram values must be numbers; got an array of <U1 (['a', 'b']): log a tensor, "
         "an array or a list of numbers"),
        (lambda: histogram(torch.tensor([1j])), MetricError,
         "histogram values are complex numbers; log .real, .imag or .abs()"),
        (lambda: histogram([2.0**50], bins=6), MetricError,
         "histogram: 6 equal bins from 1125899906842623.5 to 1125899906842624.5 cannot be "
         "told apart in float64; give fewer bins or a narrower range=(low, high)"),
        (lambda: histogram(torch.tensor([-1.7e308, 1.7e308], dtype=torch.float64)), MetricError,
         "histogram: 64 equal bins from -1.7e+308 to 1.7e+308 cannot be told apart in float64; "
         "give fewer bins or a narrower range=(low, high)"),
        (lambda: Histogram((0.0, 1.0), (1, 2)), ConfigError,
         "a histogram needs one more edge than counts; got 2 edges and 2 counts"),
    ],
)  # fmt: skip
def test_histogram_bad_input_is_one_line(call: Any, error: type, message: str) -> None:
    with pytest.raises(error) as info:
        call()
    assert str(info.value) == message


# --------------------------------------------------------------------------------------------
# lab.media.write_image


def _png(path: Path) -> tuple[str, np.ndarray]:
    with PILImage.open(path) as img:
        return img.mode, np.asarray(img)


def test_write_image_writes_the_pixels_as_given(tmp_path: Path) -> None:
    rgb = np.arange(2 * 3 * 3, dtype=np.uint8).reshape(2, 3, 3) * 10  # HxWxC
    image = write_image(tmp_path, "samples", 7, rgb)
    assert image == Image(tmp_path / "media" / "samples" / "step_000007.png", width=3, height=2)
    mode, pixels = _png(image.path)
    assert mode == "RGB" and np.array_equal(pixels, rgb)

    # a tensor is CxHxW (torch's order): the same pixels
    again = write_image(tmp_path, "samples", 7, torch.from_numpy(rgb).permute(2, 0, 1))
    assert again == image and np.array_equal(_png(image.path)[1], rgb)
    assert sorted(p.name for p in image.path.parent.iterdir()) == ["step_000007.png"]

    # floats in [0, 1]: clipped, NaN and -inf black, +inf white; 1xHxW is grayscale
    floats = torch.tensor([[[0.0, 0.5, 1.0, 2.0, -1.0, NAN, INF, -INF]]])
    gray = write_image(tmp_path, "gray", 0, floats)
    assert (gray.width, gray.height) == (8, 1)
    mode, pixels = _png(gray.path)
    assert mode == "L"
    assert pixels.tolist() == [[0, 128, 255, 255, 0, 0, 255, 0]]
    # bools and small ints; RGBA
    assert _png(write_image(tmp_path, "b", 0, np.array([[True, False]])).path)[1].tolist() == [
        [255, 0]
    ]
    rgba = write_image(tmp_path, "rgba", 0, np.full((2, 2, 4), 7, dtype=np.int64))
    assert _png(rgba.path)[0] == "RGBA" and _png(rgba.path)[1].max() == 7


def test_write_image_takes_a_matplotlib_figure(tmp_path: Path) -> None:
    fig = Figure(figsize=(2, 1), dpi=50)
    fig.add_subplot().plot([0, 1], [1, 0])
    image = write_image(tmp_path, "curve", 3, fig)
    assert (image.width, image.height) == (100, 50)
    with PILImage.open(image.path) as img:
        assert img.size == (100, 50)


def test_a_key_never_becomes_a_path_as_it_is(tmp_path: Path) -> None:
    run = tmp_path / "run"
    for key in ("../../escape", "/etc/passwd", "..", "a/b", "a-b", "ünï cødé"):
        image = write_image(run, key, 1, np.zeros((1, 1)))
        assert image.path.parent.parent == run / "media", key
        assert image.path == image_path(run, key, 1)
    names = sorted(p.name for p in (run / "media").iterdir())
    assert len(names) == 6  # distinct keys, distinct folders
    assert "a-b" in names and key_folder("a/b") != "a-b"
    assert key_folder("a/b").startswith("a-b-") and key_folder("..").startswith("x-")
    assert [p for p in tmp_path.iterdir()] == [run]


@pytest.mark.parametrize(
    ("image", "message"),
    [
        (np.zeros((2, 3, 5)), "image 'x' at step 2 has shape (2, 3, 5); give HxW, HxWxC or "
         "CxHxW with C = 1, 3 or 4"),
        (np.zeros(4), "image 'x' at step 2 has shape (4,); give HxW, HxWxC or CxHxW with C = "
         "1, 3 or 4"),
        (np.zeros((0, 3)), "image 'x' at step 2 has shape (0, 3), with no pixels; give HxW, "
         "HxWxC or CxHxW with C = 1, 3 or 4"),
        (np.array([[0, 256]]), "image 'x' at step 2 holds integers from 0 to 256; give uint8 "
         "(0-255), or floats in [0, 1]"),
        (np.array([["a"]]), "image 'x' at step 2 holds <U1 values; give uint8 (0-255), bools or "
         "floats in [0, 1]"),
    ],
)  # fmt: skip
def test_bad_pixels_are_one_line_and_write_nothing(
    tmp_path: Path, image: Any, message: str
) -> None:
    with pytest.raises(MetricError) as info:
        write_image(tmp_path / "run", "x", 2, image)
    assert str(info.value) == message
    assert not (tmp_path / "run").exists()


# --------------------------------------------------------------------------------------------
# the store


def _a_run(store: Store, name: str = "exp", run_key: str = "r0", folder: Path | None = None) -> int:
    exp = store.begin_experiment(name, config={}, seed=0, repeats=1)
    group = store.add_group(exp, "g")
    return store.start_run(
        exp, group, run_key=run_key, arm_id=None, repeat=0, stage=0, seed=0, config={},
        output_dir=str(folder) if folder else None,
    )  # fmt: skip


def _rows(url: str, table: str, columns: str | None = None) -> list[tuple]:
    engine = make_engine(resolve_url(url))
    columns = columns or f'run_id, "key", step, {_COLUMNS[table]}'
    try:
        with engine.connect() as conn:
            return [tuple(r) for r in conn.execute(sa.text(
                f"SELECT {columns} FROM {table} "
                'ORDER BY run_id, "key", step'
            ))]  # fmt: skip
    finally:
        engine.dispose()


_COLUMNS = {"histograms": "edges, counts, nan, posinf, neginf", "images": "path, width, height"}


def _json(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str) else value


def test_rows_round_trip_and_logging_a_step_again_replaces_it(
    store_url: str, tmp_path: Path
) -> None:
    store = Store(store_url)
    try:
        folder = tmp_path / "runs" / "r0"
        run_id = _a_run(store, folder=folder)
        h1 = histogram([0.0, 1.0, NAN, INF, -INF, -INF], bins=2)
        img = write_image(folder, "x/y", 1, np.zeros((2, 3)))
        outside = write_image(tmp_path / "elsewhere", "z", 1, np.zeros((4, 5)))
        store.media.put(run_id, 1, {"w": h1, "x/y": img, "z": outside}, folder)
        store.media.put(run_id, 2, {"w": histogram([5.0], bins=1)}, folder)
        store.media.put(run_id, 2, {"w": histogram([7.0, 8.0], bins=1)}, folder)  # same batch
        store.flush()
        store.media.put(run_id, 1, {"w": histogram([3.0], bins=1)}, folder)  # a later batch
        store.flush()

        rows = [(r[0], r[1], r[2], _json(r[3]), _json(r[4]), *r[5:]) for r in
                _rows(store_url, "histograms")]  # fmt: skip
        assert rows == [
            (run_id, "w", 1, [2.5, 3.5], [1], 0, 0, 0),
            (run_id, "w", 2, [7.0, 8.0], [2], 0, 0, 0),
        ]
        assert _rows(store_url, "images") == [
            (run_id, "x/y", 1, "media/x-y-748fdbd6/step_000001.png", 3, 2),
            (run_id, "z", 1, str((tmp_path / "elsewhere/media/z/step_000001.png").resolve()), 5, 4),
        ]
        # the store's own reads: plain dicts in (key, step) order
        first = {**store.media.histograms(run_id, "w")[0], "wall_time": None}
        assert first == {"key": "w", "step": 1, "edges": [2.5, 3.5], "counts": [1], "nan": 0,
                         "posinf": 0, "neginf": 0, "wall_time": None}  # fmt: skip
        assert [(r["key"], r["path"]) for r in store.media.images(run_id, "x/y")] == [
            ("x/y", "media/x-y-748fdbd6/step_000001.png")
        ]
        # the store keeps each PNG's bytes: what a server serves, without opening a path
        assert [bytes(d) for (d,) in _rows(store_url, "images", "data")] == [
            img.path.read_bytes(), outside.path.read_bytes(),
        ]  # fmt: skip
        assert store.media.image_data(run_id, "z", 1) == outside.path.read_bytes()
        assert store.media.image_data(run_id, "z", 2) is None

        # the view: a path inside the run folder made absolute, one outside kept as it is
        con = lab.inspect.connect(store_url)
        assert con.sql("select key, path from images order by key").fetchall() == [
            ("x/y", str(img.path)),
            ("z", str(outside.path.resolve())),
        ]
        con.close()

        # NaN and inf survive as counts
        store.media.put(run_id, 3, {"w": h1}, folder)
        assert store.media.histograms(run_id, "w")[-1]["nan"] == 1
        assert [(r["posinf"], r["neginf"]) for r in store.media.histograms(run_id)][-1] == (1, 2)
    finally:
        store.close()


def test_bad_media_is_one_line_and_queues_nothing_of_its_step(sqlite_url: str) -> None:
    store = Store(sqlite_url)
    try:
        run_id = _a_run(store)
        good = histogram([1.0], bins=1)
        with pytest.raises(MetricError) as info:
            store.media.put(run_id, 4, {"ok": good, "bad": torch.ones(3)})  # type: ignore[dict-item]
        assert str(info.value) == (
            "media 'bad' at step 4 is a Tensor; log a lab.media.Histogram or lab.media.Image "
            "(lab.media.histogram, lab.media.write_image make them)"
        )
        with pytest.raises(MetricError, match="metric key '' at step 4 is not a non-empty"):
            store.media.put(run_id, 4, {"": good})
        store.flush()
        assert store.media.histograms(run_id) == []
    finally:
        store.close()


def test_truncating_a_run_drops_its_media_after_the_step_and_rm_cascades(
    store_url: str, tmp_path: Path
) -> None:
    store = Store(store_url)
    try:
        run_id = _a_run(store, folder=tmp_path)
        other = _a_run(store, "other", folder=tmp_path)
        for step in (1, 2, 3, 4):
            media = {"w": histogram([float(step)], bins=1),
                     "img": write_image(tmp_path, "img", step, np.zeros((1, 1)))}  # fmt: skip
            store.media.put(run_id, step, media, tmp_path)
            store.media.put(other, step, media, tmp_path)
        store.truncate_run(run_id, 2)  # resumed from the checkpoint at step 2
        assert [r["step"] for r in store.media.histograms(run_id)] == [1, 2]
        assert [r["step"] for r in store.media.images(run_id)] == [1, 2]
        assert len(store.media.images(other)) == 4  # another run's rows stay
        store.truncate_run(run_id)  # started again from nothing
        assert store.media.histograms(run_id) == [] and store.media.images(run_id) == []

        store.finish_run(other, status="completed")
        store.delete_experiment("other")  # lab rm: the rows go with the run (ON DELETE CASCADE)
        assert _rows(store_url, "histograms") == [] and _rows(store_url, "images") == []
    finally:
        store.close()


def test_0004_upgrades_and_downgrades_with_data(store_url: str) -> None:
    engine = make_engine(resolve_url(store_url))
    try:
        assert upgrade(engine, "0003") == (None, "0003")
        with transaction(engine) as conn:
            conn.execute(
                sa.text(
                    "INSERT INTO experiments (experiment_id, name, status, config, seed, repeats, "
                    "created_at) VALUES (1, 'e', 'completed', '{}', 0, 1, '2026-11-25 10:00:00')"
                )
            )
            conn.execute(
                sa.text(
                    'INSERT INTO "groups" (group_id, experiment_id, name, kind) '
                    "VALUES (1, 1, 'g', 'repeats')"
                )
            )
            conn.execute(
                sa.text(
                    "INSERT INTO runs (run_id, experiment_id, group_id, run_key, repeat, stage, "
                    "seed, config, status, started_at) VALUES (1, 1, 1, 'r0', 0, 0, 0, '{}', "
                    "'completed', '2026-11-25 10:00:00')"
                )
            )
            conn.execute(sa.text(
                "INSERT INTO metrics (run_id, \"key\", step, value, wall_time) "
                "VALUES (1, 'loss', 3, 0.5, 1.0)"
            ))  # fmt: skip
        assert upgrade(engine, "0004") == ("0003", "0004")
        media = MediaRows(engine)
        media.put(1, 3, {"w": histogram([1.0, NAN], bins=1)})
        media.flush()
        with transaction(engine) as conn:  # as 0004 had it: no bytes (0008 added them)
            conn.execute(sa.text(
                "INSERT INTO images (run_id, \"key\", step, path, width, height, wall_time) "
                "VALUES (1, 'img', 3, '/abs/step_000003.png', 4, 2, 1.0)"
            ))  # fmt: skip
        assert [(r["step"], r["counts"], r["nan"]) for r in media.histograms(1)] == [(3, [1], 1)]
        assert [r["path"] for r in media.images(1)] == ["/abs/step_000003.png"]
        media.close()

        with transaction(engine) as conn:
            command.downgrade(alembic_config(conn), "0003")
        assert current_revision(engine) == "0003"
        tables = set(sa.inspect(engine).get_table_names())
        assert "histograms" not in tables and "images" not in tables
        with engine.connect() as conn:
            assert conn.execute(sa.text("SELECT run_key FROM runs")).all() == [("r0",)]
            assert conn.execute(sa.text("SELECT step, value FROM metrics")).all() == [(3, 0.5)]

        assert upgrade(engine, "0004") == ("0003", "0004")
        with engine.connect() as conn:
            assert conn.execute(sa.text("SELECT count(*) FROM histograms")).scalar_one() == 0
            assert conn.execute(sa.text("SELECT count(*) FROM runs")).scalar_one() == 1
    finally:
        engine.dispose()


def test_a_store_from_before_0004_reads_with_empty_media_views(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'old.db'}"
    Store(url).close()
    engine = make_engine(resolve_url(url))
    try:
        with transaction(engine) as conn:
            command.downgrade(alembic_config(conn), "0003")
    finally:
        engine.dispose()
    for mode in ("attach", "arrow"):
        con = lab.inspect.connect(url, mode=mode)  # type: ignore[arg-type]
        assert con.sql("select count(*) from histograms").fetchone() == (0,)
        assert con.sql("select count(*) from images").fetchone() == (0,)
        con.close()


# --------------------------------------------------------------------------------------------
# through a real loop: SqlLogger, JsonlLogger and lab.inspect

STEPS = 4
CRASH: set[str] = set()  # run keys whose training raises in step 4 (after the save at 2)


class Cfg(pydantic.BaseModel):
    lr: float = 0.1


class LogMedia(Callback):
    """After each even step: a histogram of the weights and an image of them, fired as
    `on_media` through the run's dispatcher (what the run handle's log_* calls do)."""

    def __init__(self, run: RunSpec) -> None:
        self.run = run

    def on_step_end(self, state: LoopState, step_idx: int, batch: Any, metrics: Any) -> None:
        crashing = self.run.run_key in CRASH  # logs step 3 too, which no resume logs again
        if step_idx % 2 and not (crashing and step_idx == 3):
            return
        weight = state.model.weight.detach()  # type: ignore[union-attr]
        pixels = torch.full((3, 2, 2), step_idx / 10)
        media = {
            "weights": histogram(weight.abs(), bins=2, range=(-10, 10)),
            "samples/img": write_image(state.ctx.folder, "samples/img", step_idx, pixels),
        }
        self.run.dispatcher.fire("on_media", state, step_idx, media)


def _train(run: RunSpec) -> lab.LoopArtifacts:
    torch.manual_seed(run.seed)
    model = torch.nn.Linear(3, 1)
    x = torch.randn(8, 3)
    calls = [0]

    def loss_fn(m: torch.nn.Module, batch: Any) -> torch.Tensor:
        calls[0] += 1
        if run.run_key in CRASH and calls[0] == 4:
            raise RuntimeError("node lost")
        return torch.nn.functional.mse_loss(m(batch[0]), batch[1])

    return TrainingLoop(
        model,
        torch.optim.SGD(model.parameters(), lr=run.config.lr),
        [(x, x.sum(1, keepdim=True))],
        loss_fn,
        num_steps=STEPS,
        checkpoint=CheckpointConfig(every=2),
        callbacks=[LogMedia(run)],
    ).fit(run)


def _train_by_hand(run: RunSpec) -> lab.LoopArtifacts:
    """The same run as `_train`, in a loop of the user's own: the run handle logs the media."""
    torch.manual_seed(run.seed)
    model = torch.nn.Linear(3, 1)
    x = torch.randn(8, 3)
    opt = torch.optim.SGD(model.parameters(), lr=run.config.lr)
    crashing = run.run_key in CRASH
    every_2 = CheckpointConfig(every=2)
    with lab.RunHandle(run, model, opt, num_steps=STEPS, checkpoint=every_2) as loop:
        for step in loop.steps():
            if crashing and step == 4:
                raise RuntimeError("node lost")
            loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
            opt.zero_grad()
            loss.backward()
            opt.step()
            loop.end_step({"loss": loss.item()})
            if step % 2 == 0 or (crashing and step == 3):
                loop.log_histogram("weights", model.weight.abs(), bins=2, range=(-10, 10))
                loop.log_image("samples/img", torch.full((3, 2, 2), step / 10))
    assert loop.artifacts is not None
    return loop.artifacts


def _experiment(url: str, tmp_path: Path, train: Any = _train, **kw: Any) -> lab.ExperimentResult:
    return Experiment(
        "media",
        train,
        base_config=Cfg(),
        arms=[Arm("a", lr=0.1), Arm("b", lr=0.01)],
        repeats=1,
        store=url,
        output_dir=tmp_path / "runs",
        **kw,
    ).run()


@pytest.mark.parametrize("train", [_train, _train_by_hand], ids=["TrainingLoop", "RunHandle"])
def test_a_loop_records_media_and_a_resumed_run_replaces_what_it_trains_again(
    store_url: str, tmp_path: Path, train: Any
) -> None:
    CRASH.add("b-r0")
    try:
        first = _experiment(store_url, tmp_path, train, callbacks=[JsonlLogger()])
    finally:
        CRASH.clear()
    assert [r.status for r in first.runs] == ["completed", "failed"]

    con = lab.inspect.connect(store_url)
    assert con.sql(
        "select experiment, arm, repeat, run_key, key, step, counts, nan from histograms "
        "order by run_key, step"
    ).fetchall() == [
        ("media", "a", 0, "a-r0", "weights", 2, [0, 3], 0),  # the 3 weights, not the bias
        ("media", "a", 0, "a-r0", "weights", 4, [0, 3], 0),
        ("media", "b", 0, "b-r0", "weights", 2, [0, 3], 0),
        ("media", "b", 0, "b-r0", "weights", 3, [0, 3], 0),
    ]
    a_r0 = (tmp_path / "runs" / "media" / "a-r0").resolve()
    folder = key_folder("samples/img")
    assert con.sql(
        "select run_key, key, step, path, width, height from images order by run_key, step"
    ).fetchall() == [
        ("a-r0", "samples/img", 2, f"{a_r0}/media/{folder}/step_000002.png", 2, 2),
        ("a-r0", "samples/img", 4, f"{a_r0}/media/{folder}/step_000004.png", 2, 2),
        *[("b-r0", "samples/img", step, str(a_r0.parent / "b-r0" / "media" / folder /
                                             f"step_00000{step}.png"), 2, 2) for step in (2, 3)],
    ]  # fmt: skip
    path = con.sql("select path from images where run_key = 'a-r0' and step = 4").fetchone()[0]
    assert _png(Path(path))[1][0, 0].tolist() == [102, 102, 102]  # 0.4 * 255, rounded
    con.close()

    # JsonlLogger: one line per on_media (the handle fires one per log_* call), the records
    # as plain JSON
    logged: dict[int, dict[str, Any]] = {}
    for line in read_hooks(a_r0 / "hooks.jsonl"):
        if line["hook"] == "on_media":
            logged.setdefault(line["step_idx"], {}).update(line["media"])
    assert sorted(logged) == [2, 4]
    assert logged[2]["weights"] == {
        "type": "Histogram", "total": 3, "edges": [-10.0, 0.0, 10.0], "counts": [0, 3],
        "nan": 0, "posinf": 0, "neginf": 0,
    }  # fmt: skip
    assert logged[2]["samples/img"] == {
        "type": "Image", "path": str(a_r0 / "media" / folder / "step_000002.png"), "width": 2,
        "height": 2,
    }  # fmt: skip
    # replayed into a callback: the records as they were logged
    replayed: dict[int, dict[str, Any]] = {}

    class Keep(Callback):
        def on_media(self, state: LoopState, step_idx: int, media: Any) -> None:
            replayed.setdefault(step_idx, {}).update(media)

    assert "on_media" in replay(a_r0 / "hooks.jsonl", Keep(), hooks=["on_media"])
    assert replayed[4] == {
        "weights": Histogram((-10.0, 0.0, 10.0), (0, 3)),
        "samples/img": Image(a_r0 / "media" / folder / "step_000004.png", 2, 2),
    }

    # the failed run resumes from its checkpoint at step 2: the rows after it are gone (step
    # 3, which this attempt does not log), and step 4 is logged once
    again = _experiment(store_url, tmp_path, train)
    assert [r.status for r in again.runs] == ["completed", "completed"]
    con = lab.inspect.connect(store_url)
    assert con.sql(
        "select run_key, step from histograms where run_key = 'b-r0' order by step"
    ).fetchall() == [("b-r0", 2), ("b-r0", 4)]
    assert lab.inspect.histograms(con, "b-r0", "weights").fetchall() == [
        (2, [-10.0, 0.0, 10.0], [0, 3], 0, 0, 0),
        (4, [-10.0, 0.0, 10.0], [0, 3], 0, 0, 0),
    ]
    assert [(k, s, w) for k, s, _, w, _ in lab.inspect.images(con, "b-r0").fetchall()] == [
        ("samples/img", 2, 2),
        ("samples/img", 4, 2),
    ]
    with pytest.raises(ConfigError) as info:
        lab.inspect.histograms(con, "b-r0", "weight")
    assert str(info.value) == "run 'b-r0' has no histogram 'weight'; it has: weights"
    con.close()
