"""`lab serve` against a hostile or broken world, on a real server: a client that names a
file of the server's host, bodies that decode to far more than they weigh, slow clients
that hold connections, and a store that goes away under it (a real PostgreSQL behind a
real TCP proxy that is cut)."""

from __future__ import annotations

import base64
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pydantic
import pytest
import sqlalchemy as sa
import torch

import lab
import lab.inspect
from lab.server.dashboard import NO_BYTES
from tests.served import Served

OPS = "/api/v1/batches/ops"


def _rows(url: str, sql: str) -> list[tuple[Any, ...]]:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            return [tuple(r) for r in conn.exec_driver_sql(sql).all()]
    finally:
        engine.dispose()


def _run(http: Any, output_dir: str | None, name: str = "attack") -> int:
    """An experiment, arm, group and run made over the write API, as the issue's steps do."""
    exp = http.post("/api/v1/experiments", json={"name": name}).json()["experiment_id"]
    arm = http.post(f"/api/v1/experiments/{exp}/arms", json={"name": "a"}).json()["arm_id"]
    group = http.post(
        f"/api/v1/experiments/{exp}/groups", json={"name": "a", "arm_id": arm}
    ).json()["group_id"]
    body = {"group_id": group, "run_key": "a-r0", "arm_id": arm, "output_dir": output_dir}
    return http.post(f"/api/v1/experiments/{exp}/runs", json=body).json()["run_id"]


def _media(client_id: str, seq: int, rows: list[dict[str, Any]]) -> dict[str, Any]:
    return {"client_id": client_id, "seq": seq, "ops": [{"op": "media", "args": {"rows": rows}}]}


# -- 1. a server never opens a file a client names ----------------------------------------------
def test_no_path_a_client_sends_makes_the_server_read_a_file(
    served: Served, tmp_path: Path
) -> None:
    """The reproduction: a run whose folder is ``/`` and image rows whose paths lead to the
    server's command line (its store URL, password included) and to a file outside any run
    folder. The rows are kept (a path is data), and the image route reads none of them."""
    secret = tmp_path / "elsewhere" / "secret.txt"
    secret.parent.mkdir()
    secret.write_text("a file of the server's host")
    paths = ["proc/self/cmdline", str(secret)[1:], str(secret), "../../.." + str(secret)]
    with served.client() as http:
        run_id = _run(http, "/")
        rows = [
            {"table": "images", "run_id": run_id, "key": "k", "step": step, "path": path,
             "width": 1, "height": 1, "wall_time": 0}
            for step, path in enumerate(paths)
        ]  # fmt: skip
        answer = http.post(OPS, json=_media("attacker", 1, rows))
        assert (answer.status_code, answer.json()["rows"]) == (200, 1), answer.text
    assert _rows(served.store_url, "select step, path, data from images order by step") == [
        (step, path, None) for step, path in enumerate(paths)
    ]
    with served.client(served.read_token) as http:
        for step in range(len(paths)):
            got = http.get(f"/api/v1/dashboard/runs/{run_id}/image?key=k&step={step}")
            assert got.status_code == 404, f"step {step} served {got.content[:120]!r}"
            assert (got.status_code, got.json()) == (404, {
                "detail": NO_BYTES.format(run_id=run_id, key="k", step=step), "field": "key",
            })  # fmt: skip
            assert "secret" not in got.text and "python" not in got.text


class _Cfg(pydantic.BaseModel):
    lr: float = 0.1


def _images(run: lab.RunSpec) -> lab.LoopArtifacts:
    """Four steps; an image of the weights at steps 2 and 4."""
    torch.manual_seed(run.seed)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=run.config.lr)
    x = torch.randn(8, 4)
    with lab.RunHandle(run, model, opt, num_steps=4) as loop:
        for step in loop.steps():
            loss = torch.nn.functional.mse_loss(model(x), x[:, :2])
            opt.zero_grad()
            loss.backward()
            opt.step()
            loop.end_step({"loss": loss.item()})
            if step % 2 == 0:
                loop.log_image("weights", (model.weight.detach() + 1) / 2)
    assert loop.artifacts is not None
    return loop.artifacts


def test_an_image_logged_through_the_server_is_kept_and_served_from_the_store(
    served: Served, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client sends the PNG's bytes; the store keeps them; the dashboard serves them,
    the same bytes, after the run's folder is gone."""
    monkeypatch.setenv("LAB_TOKEN", served.write_token)
    folder = tmp_path / "runs"
    lab.Experiment("pictures", _images, base_config=_Cfg(), store=served.url,
                   output_dir=str(folder)).run()  # fmt: skip
    files = sorted((folder / "pictures" / "base-r0" / "media").rglob("*.png"))
    assert [f.name for f in files] == ["step_000002.png", "step_000004.png"]
    written = [f.read_bytes() for f in files]
    stored = _rows(served.store_url, "select step, width, height, data from images order by step")
    assert [(s, w, h, bytes(d)) for s, w, h, d in stored] == [
        (2, 4, 2, written[0]), (4, 4, 2, written[1]),
    ]  # fmt: skip
    shutil.rmtree(folder)
    with served.client(served.read_token) as http:
        (run,) = http.get("/api/v1/dashboard/experiments/pictures/runs").json()["runs"]
        page = http.get(f"/api/v1/dashboard/runs/{run['run_id']}").json()
        got = [http.get(image["url"]) for image in page["images"]]
    assert [(g.status_code, g.headers["content-type"]) for g in got] == [(200, "image/png")] * 2
    assert [g.content for g in got] == written
    # the analysis copies leave the bytes out: over HTTP, and through Arrow locally
    for con in (
        lab.inspect.connect(served.url),
        lab.inspect.connect(served.store_url, mode="arrow"),
    ):
        assert con.sql("select key, step, width from images order by step").fetchall() == [
            ("weights", 2, 4), ("weights", 4, 4),
        ]  # fmt: skip
        con.close()


def test_image_bytes_a_client_sends_must_be_a_png(served: Served, tmp_path: Path) -> None:
    """Bytes that are not base64 or not a PNG are one line and store nothing; a PNG's size is
    read from it, not taken from the row."""
    from lab.media import write_image

    png = write_image(tmp_path, "k", 0, np.zeros((3, 5), dtype=np.uint8)).path.read_bytes()
    with served.client() as http:
        run_id = _run(http, None)
        row = {"table": "images", "run_id": run_id, "key": "k", "step": 0, "path": "x.png",
               "width": 99, "height": 99, "wall_time": 0.0}  # fmt: skip
        gif = base64.b64encode(b"GIF89a").decode()
        refused = [http.post(OPS, json=_media("c", 1, [{**row, "data": data}]))
                   for data in ("%%%", gif)]  # fmt: skip
        kept = http.post(
            OPS, json=_media("c", 1, [{**row, "data": base64.b64encode(png).decode()}])
        )
    assert [(r.status_code, r.json()["detail"]) for r in refused] == [
        (400, "media rows: an image's data must be its PNG's bytes in base64"),
        (400, "media rows: an image's data is not a PNG; send the PNG's bytes"),
    ]
    assert kept.status_code == 200, kept.text
    assert [(w, h, bytes(d)) for w, h, d in _rows(
        served.store_url, "select width, height, data from images"
    )] == [(5, 3, png)]  # fmt: skip
