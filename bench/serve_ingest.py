"""Metric ingest through a `lab serve` server, and what an HTTP store costs the training thread.

Ingest: the workload of bench/ingest.py (4 runs x 5,000 steps x 20 metrics = 400,000 points),
one step's dict per `log_metrics` call on an `HttpStore`, then `flush()`: the clock stops
when the server has acknowledged every batch, so every point is committed in its SQLite
store. The server is a real `lab serve` (uvicorn in a subprocess on loopback, one worker) in
front of a fresh SQLite file, started before the clock. Arms, rotated each round:

    http    the client above
    local   the same through a local `Store` (bench/ingest.py's lab arm)
    raw     bare `sqlite3` `executemany` of the same rows in this process, one commit
            (bench/ingest.py's raw arm): the baseline of the target (http >= 30% of raw)
    mlflow  MLflow's tracking server (`mlflow server`, SQLite backend) and `log_batch` of
            rows made the same way, 1,000 metrics a call (its limit), when an MLflow is
            installed in the interpreter given by --mlflow-python (kept out of lab's
            environment: it pins other versions of lab's dependencies); skipped otherwise.
            It is slow (about 1,000 points/s here), so it logs --mlflow-steps steps per
            run (default 500: 40,000 points) and its rate is compared

Step cost: bench/overhead.py's measure (a batch drawn stamps the clock; a step is the time
between two draws; the first 10% dropped) on its `RunHandle` loop at k metrics per step:
`bare` (no lab), `handle` (no callbacks), `handle_sql` (`SqlLogger` on a local SQLite store)
and `handle_http` (`SqlLogger` on an `HttpStore` to a local `lab serve`). "Added" is the
median step less bare's median, per round, then the median over rounds.

Prints one JSON line.

    python bench/serve_ingest.py [--rounds 3] [--quick] [--mlflow-python PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import alternate, log, machine
from ingest import Steps, lab_round, make_runs, make_steps, raw_sqlite_round
from overhead import one_fit

from lab.server.auth import create_token
from lab.store import Store
from lab.store.http import HttpStore

ROOT = Path(__file__).resolve().parents[1]
SERVE = (
    "import sys, uvicorn; from lab.server import create_app; "
    "uvicorn.run(create_app(sys.argv[1]), host='127.0.0.1', port=int(sys.argv[2]), "
    "log_level='warning')"
)
MLFLOW_PEER = Path(__file__).with_name("_mlflow_peer.py")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """A `lab serve` subprocess in front of a fresh SQLite file, with a write token."""

    def __init__(self, path: Path) -> None:
        self.store_url = f"sqlite:///{path}"
        store = Store(self.store_url)
        try:
            self.token = create_token(store.engine, "bench", "write")
        finally:
            store.close()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.process = subprocess.Popen(
            [sys.executable, "-c", SERVE, self.store_url, str(self.port)], env=env
        )
        import httpx

        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{self.url}/api/v1/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("lab serve did not start")
            time.sleep(0.05)

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)


def http_round(path: Path, data: list[Steps]) -> dict[str, float]:
    """Time log_metrics of every step through an HttpStore, and the flush (all acknowledged)."""
    server = Server(path)
    try:
        store = HttpStore(server.url, token=server.token)
        try:
            run_ids = make_runs(store, len(data))  # type: ignore[arg-type]
            cpu0, t0 = time.process_time(), time.perf_counter()
            for run_id, steps in zip(run_ids, data, strict=True):
                for step, metrics in enumerate(steps, 1):
                    store.log_metrics(run_id, step, metrics)
            logged = time.perf_counter()
            store.flush()
            seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        finally:
            store.close()
    finally:
        server.stop()
    with sqlite3.connect(path) as con:
        count = con.execute("SELECT count(*) FROM metrics").fetchone()[0]
    expected = sum(len(s) * len(s[0]) for s in data)
    assert count == expected, f"lab serve stored {count} rows, expected {expected}"
    return {"s": seconds, "cpu_s": cpu, "log_calls_s": logged - t0}


def mlflow_round(python: str, folder: Path, data_args: list[str]) -> dict[str, float] | None:
    """MLflow's tracking server and log_batch, in MLflow's own interpreter."""
    out = subprocess.run(
        [python, str(MLFLOW_PEER), str(folder), *data_args],
        capture_output=True,
        text=True,
        timeout=3600,
    )
    if out.returncode != 0:
        log(f"mlflow round failed: {out.stderr.strip().splitlines()[-1:]}")
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])


def step_costs(steps: int, rounds: int, k: int, folder: Path) -> dict[str, Any]:
    """bench/overhead.py's step measure for bare, handle, handle_sql and handle_http."""
    added: dict[str, list[float]] = {"handle": [], "handle_sql": [], "handle_http": []}
    bare_medians: list[float] = []
    for i in range(rounds):
        server = Server(folder / f"steps-http{i}.db")
        try:
            medians = {}
            order = ["bare", "handle", "handle_sql", "handle_http"]
            for arm in order[i % 4 :] + order[: i % 4]:
                store: Any = None
                if arm == "handle_sql":
                    store = Store(f"sqlite:///{folder / f'steps-local{i}.db'}")
                elif arm == "handle_http":
                    store = HttpStore(server.url, token=server.token)
                try:
                    fit = one_fit("bare" if arm == "bare" else "handle", k, steps, store)
                finally:
                    if store is not None:
                        store.close()
                medians[arm] = statistics.median(fit["step_s"])
                log(f"steps round {i + 1}/{rounds} {arm}@{k}: {medians[arm] * 1e6:.1f} us")
        finally:
            server.stop()
        bare_medians.append(medians["bare"])
        for arm in added:
            added[arm].append(medians[arm] - medians["bare"])
    bare = statistics.median(bare_medians)
    out: dict[str, Any] = {"k": k, "bare_step_us": round(bare * 1e6, 2)}
    for arm, values in added.items():
        us = statistics.median(values) * 1e6
        out[arm] = {
            "added_us_per_step": round(us, 2),
            "added_us_per_metric": round(us / k, 3),
            "added_pct_of_bare_step": round(100 * us / (bare * 1e6), 2),
            "added_us_per_round": [round(v * 1e6, 2) for v in values],
        }
    http = out["handle_http"]
    out["meets_target"] = http["added_us_per_metric"] <= 10 and http["added_pct_of_bare_step"] <= 5
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--keys", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--step-steps", type=int, default=2000, help="steps per fit (cost)")
    parser.add_argument("--mlflow-python", default=os.environ.get("LAB_BENCH_MLFLOW_PYTHON"))
    parser.add_argument("--mlflow-rounds", type=int, default=1)
    parser.add_argument(
        "--mlflow-steps", type=int, default=500, help="steps per run for MLflow (it is slow)"
    )
    parser.add_argument("--quick", action="store_true", help="4 x 500 x 20, 2 rounds")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.rounds, args.step_steps = 500, 2, 500
    data = make_steps(args.runs, args.steps, args.keys)
    points = args.runs * args.steps * args.keys
    out: dict[str, Any] = {"bench": "serve_ingest", "runs": args.runs, "steps": args.steps,
                           "keys": args.keys, "points": points, "rounds": args.rounds}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="lab-bench-serve-") as tmp:
        folder = Path(tmp)
        results = alternate(
            args.rounds,
            {
                "http": lambda i: http_round(folder / f"http{i}.db", data),
                "local": lambda i: lab_round(f"sqlite:///{folder / f'local{i}.db'}", data),
                "raw": lambda i: raw_sqlite_round(folder / f"raw{i}.db", data),
            },
        )
        med = {arm: statistics.median(r["s"] for r in rs) for arm, rs in results.items()}
        paired = [r["s"] / h["s"] for h, r in zip(results["http"], results["raw"], strict=True)]
        out["ingest"] = {
            **{f"{arm}_points_per_s": round(points / s) for arm, s in med.items()},
            **{f"{arm}_s": [round(r["s"], 3) for r in rs] for arm, rs in results.items()},
            "http_log_calls_s_median": round(
                statistics.median(r["log_calls_s"] for r in results["http"]), 3
            ),
            "ratio_http_vs_raw": round(med["raw"] / med["http"], 3),
            "ratio_per_round": [round(r, 3) for r in paired],
            "ratio_http_vs_local": round(med["local"] / med["http"], 3),
            "target_ratio": 0.3,
            "meets_target": med["raw"] / med["http"] >= 0.3,
        }
        if args.mlflow_python:
            mlflow_points = args.runs * args.mlflow_steps * args.keys
            data_args = [str(args.runs), str(args.mlflow_steps), str(args.keys)]
            peer = [mlflow_round(args.mlflow_python, folder / f"mlflow{i}", data_args)
                    for i in range(args.mlflow_rounds)]  # fmt: skip
            done = [p for p in peer if p is not None]
            if done:
                s = statistics.median(p["s"] for p in done)
                rate = mlflow_points / s
                out["mlflow"] = {
                    "points": mlflow_points,
                    "points_per_s": round(rate),
                    "s": [round(p["s"], 3) for p in done],
                    "version": done[0]["version"],
                    "http_rate_vs_mlflow": round(points / med["http"] / rate, 1),
                }
        else:
            out["mlflow"] = "skipped: no --mlflow-python (an interpreter with mlflow installed)"
        out["step_cost"] = step_costs(args.step_steps, args.rounds, 8, folder)
    out["machine"] = machine()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
