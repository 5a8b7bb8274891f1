"""How long a small experiment takes through `lab serve`, against into a local SQLite file.

The experiment is the one of docs/experiment-files.md, as a user writes it: 2 arms x 2
repeats x 30 steps, an eval every 10, a console logger. It runs the two ways a user runs it,
each a fresh process:

    cli      ``lab run exp.yaml name=... --store URL``: wall and CPU time of the process
    inproc   ``load_experiment("exp.yaml", ...).run()`` timed inside a Python process that
             ran one experiment before (imports and first calls out of the clock)

into a local SQLite file (``local``) and through a real ``lab serve`` started from the
command line (``http_sqlite``: in front of a SQLite file; ``http_pg`` too when
LAB_TEST_POSTGRES_URL names a PostgreSQL server, where scratch databases are made and
dropped; ``local_pg`` is then the same PostgreSQL store written directly, without a server,
which tells the server's share from PostgreSQL's own). Every store exists before the clock
starts, and each experiment has a new name and
output folder (nothing to reuse). The ways and stores alternate within each round.

Requests per run: what each experiment asked of the server, counted from the server's access
log (cli) and by the client (inproc), divided by its 4 runs. Server CPU: what the server
process spent on each experiment of the cli way. The ratio is http over local (and http_pg
over local_pg), of the median wall times; the target is a ratio of http over local of at
most 1.5 (``target_met`` says it for each way and store).

    python bench/serve_small.py                 # 5 rounds
    python bench/serve_small.py --quick         # 2 rounds
    python bench/serve_small.py --before PATH   # + the same from an older lab source tree

With ``--before``, every arm also runs from another source tree of `lab` (first on
``PYTHONPATH``, its own servers in front of their own stores), alternating with this one in
every round: a before/after in one run. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from _common import alternate, log, machine, scratch_database
from serve_ingest import free_port

ROOT = Path(__file__).resolve().parents[1]
LAB = Path(sys.executable).with_name("lab")  # the console script, as a user runs it
RUNS = 4  # 2 arms x 2 repeats

TRAIN_LIB = """
import pydantic
import torch

from lab import Evaluator, TrainingLoop


class Config(pydantic.BaseModel):
    lr: float = 0.05
    steps: int = 30
    width: int = 8


def mse(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def train(run):
    cfg = run.config
    x = torch.randn(128, cfg.width)
    y = x.sum(dim=1, keepdim=True)
    model = torch.nn.Linear(cfg.width, 1)
    loop = TrainingLoop(
        model,
        torch.optim.SGD(model.parameters(), lr=cfg.lr),
        data=[(x[i : i + 32], y[i : i + 32]) for i in range(0, 128, 32)],
        loss_fn=mse,
        num_steps=cfg.steps,
        evaluators=[Evaluator("val", lambda m: {"loss": mse(m, (x, y)).item()}, every=10)],
    )
    return loop.fit(run)
"""

EXPERIMENT = """
name: small
train: train_lib:train
config: train_lib:Config
base_config: {steps: 30}
arms:
  - {name: small, lr: 0.01}
  - {name: large, lr: 0.1}
repeats: 2
seed: 0
callbacks:
  - kind: console_logger
    params: {every: 10, metrics: [loss, val/loss]}
summary: {metric: val/loss, mode: min}
"""

# The in-process way: one experiment out of the clock, then the timed one; the requests the
# timed one sent, counted by the client.
INPROC = """
import json, sys, time
import httpx
sent = [0]
send = httpx.Client.send
def counted(self, request, **kw):
    sent[0] += 1
    return send(self, request, **kw)
httpx.Client.send = counted
sys.path.insert(0, ".")
from lab.experiment_file import load_experiment
def run(name):
    overrides = [f"name={name}", f"output_dir=runs/{name}"]
    load_experiment("exp.yaml", store=sys.argv[1], overrides=overrides).run()
run(sys.argv[2] + "-warm")
sent[0] = 0
wall, cpu = time.perf_counter(), time.process_time()
run(sys.argv[2])
wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
print(json.dumps({"s": wall, "cpu": cpu, "requests": sent[0]}))
"""

MAKE_STORE = """
import sys
from lab.store import Store
store = Store(sys.argv[1])
if len(sys.argv) > 2:
    from lab.server.auth import create_token
    print(create_token(store.engine, sys.argv[2], "write"))
store.close()
"""


class Tree:
    """A `lab` source tree: what runs, its stores and its servers."""

    def __init__(self, label: str, path: Path, folder: Path) -> None:
        self.label, self.path = label, path
        self.folder = folder / label
        self.folder.mkdir(parents=True)
        (self.folder / "train_lib.py").write_text(TRAIN_LIB)
        (self.folder / "exp.yaml").write_text(EXPERIMENT)
        self.env = {**os.environ, "PYTHONPATH": str(path), "LAB_QUIET": "1"}
        self.env.pop("LAB_STORE_URL", None)
        self.stores: dict[str, str] = {}  # written directly, by kind
        self.servers: dict[str, Server] = {}
        self.store("local", f"sqlite:///{self.folder / 'local.db'}")
        self.names = 0

    def python(self, code: str, *args: str) -> str:
        done = subprocess.run(
            [sys.executable, "-c", code, *args],
            env=self.env,
            cwd=self.folder,
            capture_output=True,
            text=True,
            check=True,
        )
        return done.stdout

    def store(self, kind: str, store_url: str) -> None:
        self.python(MAKE_STORE, store_url)  # made now: no round pays for its schema
        self.stores[kind] = store_url

    def serve(self, kind: str, store_url: str) -> None:
        token = self.python(MAKE_STORE, store_url, "bench").strip().splitlines()[-1]
        self.servers[kind] = Server(self, store_url, token)

    def name(self) -> str:
        self.names += 1
        return f"small-{self.names}"

    def cli(self, kind: str) -> dict[str, float]:
        """`lab run` as a fresh process: its wall and CPU time, and what the server did."""
        server = self.servers.get(kind)
        url = self.stores[kind] if server is None else server.url
        env = self.env if server is None else {**self.env, "LAB_TOKEN": server.token}
        name = self.name()
        argv = [str(LAB), "run", "exp.yaml", f"name={name}", f"output_dir=runs/{name}"]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        seen = server.seen() if server is not None else (0, 0.0)
        started = time.perf_counter()
        subprocess.run([*argv, "--store", url], env=env, cwd=self.folder, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        wall = time.perf_counter() - started
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
        result = {"s": wall, "cpu": cpu}
        if server is not None:
            now = server.seen()
            result.update(requests=now[0] - seen[0], server_cpu=now[1] - seen[1])
        return result

    def inproc(self, kind: str) -> dict[str, float]:
        """The experiment timed inside a process that ran one before it."""
        server = self.servers.get(kind)
        url = self.stores[kind] if server is None else server.url
        env = self.env if server is None else {**self.env, "LAB_TOKEN": server.token}
        done = subprocess.run(
            [sys.executable, "-c", INPROC, url, self.name()],
            env=env,
            cwd=self.folder,
            capture_output=True,
            text=True,
            check=True,
        )
        result = json.loads(done.stdout.strip().splitlines()[-1])
        if server is None:
            result.pop("requests")
        return result

    def stop(self) -> None:
        for server in self.servers.values():
            server.stop()


class Server:
    """``lab serve`` from the command line, from a tree, in front of `store_url`; its access
    log counts the requests, /proc its CPU."""

    def __init__(self, tree: Tree, store_url: str, token: str) -> None:
        import httpx

        self.token, self.port = token, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tree.folder / f"serve-{self.port}.log"
        with self.log.open("w") as out:
            self.process = subprocess.Popen(
                [str(LAB), "serve", "--store", store_url, "--port", str(self.port)],
                env={**tree.env, "PYTHONUNBUFFERED": "1"}, cwd=tree.folder, stdout=out,
                stderr=subprocess.STDOUT,
            )  # fmt: skip
        deadline = time.monotonic() + 60
        while self.process.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{self.url}/api/v1/health", timeout=1).status_code == 200:
                    return
            time.sleep(0.1)
        raise RuntimeError(f"lab serve did not start; its log: {self.log.read_text()}")

    def seen(self) -> tuple[int, float]:
        """Requests answered so far (once the log has settled: its line for a request may
        follow the answer), and the CPU seconds the process has spent."""
        answered = -1
        while answered != (answered := self.log.read_text().count('HTTP/1.1" ')):
            time.sleep(0.05)
        fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks = os.sysconf("SC_CLK_TCK")
        return answered, (int(fields[11]) + int(fields[12])) / ticks

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)


@contextlib.contextmanager
def stores(trees: list[Tree], postgres: str | None) -> Iterator[list[str]]:
    """Each tree's stores and servers: SQLite-backed, and PostgreSQL-backed with `postgres`
    (with a PostgreSQL store written directly); yields the kinds of store."""
    kinds = ["local", "http_sqlite"]
    if postgres is not None:
        kinds[1:1] = ["local_pg"]
        kinds.append("http_pg")
    try:
        with contextlib.ExitStack() as stack:
            for tree in trees:
                tree.serve("http_sqlite", f"sqlite:///{tree.folder / 'served.db'}")
                if postgres is not None:
                    direct, _ = stack.enter_context(scratch_database(postgres, tree.label))
                    tree.store("local_pg", direct)
                    served, _ = stack.enter_context(scratch_database(postgres, tree.label))
                    tree.serve("http_pg", served)
            yield kinds
            for tree in trees:
                tree.stop()
    finally:
        for tree in trees:
            with contextlib.suppress(Exception):
                tree.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="how many rounds (5)")
    parser.add_argument("--quick", dest="rounds", action="store_const", const=2, help="2 rounds")
    parser.add_argument("--before", type=Path, help="an older lab source tree to time too")
    rounds, before = (args := parser.parse_args()).rounds, args.before
    postgres = os.environ.get("LAB_TEST_POSTGRES_URL")

    with tempfile.TemporaryDirectory() as scratch:
        trees = [Tree("after", ROOT, Path(scratch))]
        if before is not None:
            trees.append(Tree("before", before.resolve(), Path(scratch)))
        with stores(trees, postgres) as kinds:
            arms = {}
            for tree in trees:
                tag = "" if tree.label == "after" else "_before"
                for way in ("cli", "inproc"):
                    for kind in kinds:
                        measure = getattr(tree, way)
                        arms[f"{way}_{kind}{tag}"] = lambda i, m=measure, k=kind: m(k)
            log(f"{rounds} rounds of {len(arms)} arms; each runs 2 arms x 2 repeats x 30 steps")
            results = alternate(rounds, arms)

    def median(name: str, field: str) -> float:
        return round(statistics.median(r[field] for r in results[name]), 4)

    out: dict[str, Any] = {
        "bench": "serve_small",
        "rounds": rounds,
        "experiment": "2 arms x 2 repeats x 30 steps, an eval every 10",
    }
    out["seconds_median"] = {name: median(name, "s") for name in results}
    out["cpu_median"] = {name: median(name, "cpu") for name in results}
    seconds = out["seconds_median"]
    ratios, over_pg, per_run, server_cpu = {}, {}, {}, {}
    for name in results:
        if "_http_" not in name:
            continue
        way, tag = name.split("_http_")[0], "_before" * name.endswith("_before")
        ratios[name] = round(seconds[name] / seconds[f"{way}_local{tag}"], 3)
        if "_http_pg" in name:
            over_pg[name] = round(seconds[name] / seconds[f"{way}_local_pg{tag}"], 3)
        per_run[name] = round(median(name, "requests") / RUNS, 2)
        if name.startswith("cli_"):
            server_cpu[name] = median(name, "server_cpu")
    out.update(ratio_http_over_local=ratios, ratio_http_pg_over_local_pg=over_pg,
               requests_per_run=per_run,
               server_cpu_median=server_cpu)  # fmt: skip
    out["target_met"] = {n: r <= 1.5 for n, r in ratios.items() if not n.endswith("_before")}
    out["machine"] = machine(load=os.getloadavg()[0])
    print(json.dumps(out))


if __name__ == "__main__":
    main()
