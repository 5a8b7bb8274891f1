"""MLflow's peer figure for bench/serve_ingest.py, run in an interpreter that has MLflow.

Starts ``mlflow server`` on loopback with a fresh SQLite backend in FOLDER, creates RUNS
runs, then times `MlflowClient.log_batch` of the same rows bench/ingest.py makes (RUNS x
STEPS x KEYS points, 1,000 metrics a call: MLflow's limit per batch), run after run; the
clock stops when the last call returned (each call is committed before it answers).
Prints one JSON line: {"s", "points", "version"}.

    python bench/_mlflow_peer.py FOLDER RUNS STEPS KEYS
"""

from __future__ import annotations

import json
import random
import socket
import subprocess
import sys
import time
from pathlib import Path


def main() -> None:
    import mlflow
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    folder, runs, steps, keys = Path(sys.argv[1]), *map(int, sys.argv[2:5])
    folder.mkdir(parents=True, exist_ok=True)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
         "--backend-store-uri", f"sqlite:///{folder / 'mlflow.db'}",
         "--default-artifact-root", str(folder / "artifacts"), "--workers", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        client = MlflowClient(tracking_uri=f"http://127.0.0.1:{port}")
        deadline = time.monotonic() + 120
        while True:
            try:
                exp = client.create_experiment("ingest")
                break
            except Exception:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise
                time.sleep(0.5)
        rng = random.Random(0)  # bench/ingest.py's make_steps
        names = [f"metric_{k:02d}" for k in range(keys)]
        data = [[{n: rng.random() for n in names} for _ in range(steps)] for _ in range(runs)]
        run_ids = [client.create_run(exp).info.run_id for _ in range(runs)]
        t0 = time.perf_counter()
        for run_id, run_steps in zip(run_ids, data, strict=True):
            batch: list[Metric] = []
            for step, metrics in enumerate(run_steps, 1):
                now = int(time.time() * 1000)
                batch += [Metric(k, v, now, step) for k, v in metrics.items()]
                if len(batch) >= 1000:
                    client.log_batch(run_id, metrics=batch[:1000])
                    batch = batch[1000:]
            if batch:
                client.log_batch(run_id, metrics=batch)
        seconds = time.perf_counter() - t0
        stored = sum(
            len(client.get_metric_history(run_ids[0], n)) for n in names[:1]
        )  # spot check: one key of one run holds every step
        assert stored == steps, (stored, steps)
    finally:
        server.terminate()
        server.wait(timeout=30)
    print(json.dumps({"s": seconds, "points": runs * steps * keys, "version": mlflow.__version__}))


if __name__ == "__main__":
    main()
