"""What claiming a run costs: one transaction per run, paid once before its first hook.

Times `Store.claim_run` for N new run keys (the insert that wins), for the same keys again
while their rows are `running` under this process (the refusal: the conditional upsert, the
read of the row and the liveness check), and the old plain `start_run` path of a bare
logger for comparison, on SQLite and, with ``--postgres``, on a scratch PostgreSQL database.
Prints one JSON line; per-run milliseconds, never per step.

    python bench/claim.py                      # SQLite, 200 runs
    python bench/claim.py --runs 50 --postgres postgresql://postgres:lab@127.0.0.1/lab_test
"""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from _common import add_postgres_option, log, machine, scratch_database

FIELDS: dict[str, Any] = {
    "arm_id": None, "repeat": 0, "stage": 0, "seed": 0, "config": {"lr": 0.1},
    "output_dir": None, "config_hash": "0" * 64,
}  # fmt: skip


def measure(url: str, runs: int) -> dict[str, float]:
    from lab.errors import RunBusy
    from lab.store import Store

    store = Store(url)
    try:
        exp = store.begin_experiment(f"claim-{uuid.uuid4().hex[:6]}", config={}, seed=0, repeats=1)
        group = store.add_group(exp, "g")
        out: dict[str, float] = {}
        t = time.perf_counter()
        for i in range(runs):
            store.claim_run(exp, group, run_key=f"r{i}", **FIELDS)
        out["claim_ms"] = (time.perf_counter() - t) / runs * 1e3
        t = time.perf_counter()
        for i in range(runs):
            with contextlib.suppress(RunBusy):
                store.claim_run(exp, group, run_key=f"r{i}", **FIELDS)
        out["refused_busy_ms"] = (time.perf_counter() - t) / runs * 1e3
        t = time.perf_counter()
        for i in range(runs):
            run_id = store.start_run(exp, group, run_key=f"s{i}", **FIELDS)
            store.finish_run(run_id, status="completed")
        out["start_and_finish_ms"] = (time.perf_counter() - t) / runs * 1e3
        return {k: round(v, 2) for k, v in out.items()}
    finally:
        store.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200)
    add_postgres_option(parser)
    args = parser.parse_args()
    result: dict[str, Any] = {"runs": args.runs}
    with tempfile.TemporaryDirectory() as folder:
        log("sqlite")
        result["sqlite"] = measure(f"sqlite:///{Path(folder) / 'claim.db'}", args.runs)
    if args.postgres:
        log("postgresql")
        with scratch_database(args.postgres, "claim") as (url, _libpq):
            result["postgresql"] = measure(url, args.runs)
    print(json.dumps({"bench": "claim", "machine": machine(), **result}))


if __name__ == "__main__":
    main()
