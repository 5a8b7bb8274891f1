"""Where runs execute: in the experiment's own process, or each in a fresh worker process.

``Experiment(executor="serial")`` (the default) runs one run after another in its own
process. ``Experiment(executor="processes", workers=N)`` hands each run to `ProcessPool`:
at most N at a time, each in a process of its own, forked from a server process that imported
torch and nothing else (``forkserver``: a ``fork`` of the experiment's own process would copy
its threads and locks), and ended with its run, so no state leaks from one run into the next.

What runs where, with ``executor="processes"``::

    parent:  on_experiment_start, on_group_start     (ctx.ids filled here ...)
    worker:  a pickled copy of the callbacks and of ctx (... reach the worker intact)
             on_run_start ... every loop hook ... on_error, on_run_end, then close()
             -> sends back the RunResult (artifacts=None: the model stays in the worker)
    parent:  on_experiment_end, close

``Experiment(executor="ray")`` hands each run to `RayPool` instead: one Ray task per run,
with the CPUs and GPUs its arm asks for, on a local ``ray.init()`` or on a cluster. The
same hooks fire in the same places (the parent is the Ray driver, the worker a Ray worker
process, which Ray reuses from one run to the next); see docs/ray.md.

This module only starts processes and brings their answers back; `lab.experiment` decides
what a run is, `lab.lifecycle` which hooks fire. A worker that dies (SIGKILL, ``os._exit``,
an OOM kill, its node lost) comes back as an `Outcome` whose `died` says how, and the other
workers go on.
Both pools offer the same calls (`Pool`), so one scheduler (`lab.scheduler`) drives either.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import sys
import time
import traceback
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Protocol

from lab._distributed import portable
from lab._imports import require
from lab.errors import ConfigError, LabError

#: The start method of every worker process: each is forked from a server process that
#: imported torch and nothing else happened in (no thread, no CUDA), so a worker starts
#: without importing torch again; ``fork`` of the experiment's own process would copy its
#: threads and locks.
START_METHOD: Final = "forkserver"
#: What the fork server imports before it forks any worker: what every run imports, and
#: torch._dynamo, which a run's first optimizer step would import (about a second of CPU).
PRELOAD: Final = ("__main__", "torch", "torch._dynamo", "lab.lifecycle", "lab.loop")
#: How long a worker that has answered may take to exit before it is killed.
EXIT_GRACE_S = 30.0


class WorkerDied(LabError):
    """A worker process ended before it sent back its run's result."""


@dataclass
class Outcome:
    """How one submitted call ended: its return value, what it raised, or how its process died.

    `progress` is the last message the call sent with ``progress(...)`` before it ended
    (None if it sent none): what the parent knows of a run whose process died.
    """

    key: Any
    pid: int | None
    value: Any = None
    error: BaseException | None = None
    traceback: str | None = None
    died: str | None = None
    unloadable: str | None = None
    progress: Any = None
    seconds: float = 0.0
    #: A run in the experiment's own process that an interrupt ended: it is recorded, then
    #: the interrupt propagates.
    interrupt: BaseException | None = None

    @property
    def ok(self) -> bool:
        """Whether the call returned a value."""
        return self.error is None and self.died is None and self.unloadable is None


class Pool(Protocol):
    """Where an experiment's runs execute, one call per run: `ProcessPool` or `RayPool`."""

    @property
    def free(self) -> int:
        """How many more calls can start now."""
        ...

    @property
    def running(self) -> int:
        """How many calls are running."""
        ...

    def submit(
        self, key: Any, fn: Callable[..., Any], *args: Any, resources: Mapping[str, float] = ...
    ) -> None:
        """Start ``fn(*args, progress=...)``; its `Outcome` carries `key`."""
        ...

    def wait(self, timeout: float | None = None) -> list[Outcome]:
        """Block until at least one call ended (or `timeout` passed); return what ended."""
        ...

    def stop(self, grace_s: float = 30.0) -> list[Outcome]:
        """Interrupt every running call and return their outcomes."""
        ...


@dataclass
class _Worker:
    key: Any
    process: Any  # multiprocessing's SpawnProcess
    conn: multiprocessing.connection.Connection
    started: float
    progress: Any = None
    answer: tuple[Any, ...] | None = None


class ProcessPool:
    """Runs calls ``fn(*args, progress=send)``, each in a fresh process, at most `workers` at
    a time.

    A process per call (not a long-lived worker) is what makes runs independent: each run
    starts from the same clean interpreter, forked from the fork server (`PRELOAD` imported,
    nothing run), with this process's environment, ``sys.path`` and working folder as they
    are at `submit`, as a ``spawn`` process would get them, without importing torch again.
    `fn` and `args` are pickled in the parent at `submit`, so a later change to them reaches
    no worker.
    """

    def __init__(self, workers: int) -> None:
        if workers < 1:
            raise ValueError(f"workers={workers}: use an int >= 1")
        self.workers = workers
        # torch's intra-op threads per worker: N workers each using every core would
        # oversubscribe the machine N times over. OMP_NUM_THREADS, when set, wins.
        self.threads = max(1, (os.cpu_count() or 1) // workers)
        self._mp = multiprocessing.get_context(START_METHOD)
        self._mp.set_forkserver_preload(list(PRELOAD))  # read when the server starts
        self._running: dict[Any, _Worker] = {}

    @property
    def free(self) -> int:
        """How many more calls can start now."""
        return self.workers - len(self._running)

    @property
    def running(self) -> int:
        """How many calls are running."""
        return len(self._running)

    def submit(
        self,
        key: Any,
        fn: Callable[..., Any],
        *args: Any,
        resources: Mapping[str, float] | None = None,
    ) -> None:
        """Start ``fn(*args, progress=...)`` in a new process; its `Outcome` carries `key`.
        `resources` (what a Ray task would ask for) mean nothing here: every worker shares
        this machine.

        Raises `pickle.PicklingError` (or whatever pickling raised) when `fn` or `args`
        cannot be sent; nothing is started then.
        """
        if key in self._running:
            raise ValueError(f"{key!r} is running already")
        payload = pickle.dumps((fn, args), protocol=pickle.HIGHEST_PROTOCOL)
        reader, writer = self._mp.Pipe(duplex=False)
        # not a daemon: a run may start processes of its own (a DataLoader's workers)
        process = self._mp.Process(
            target=_child,
            args=(payload, writer, self.threads, dict(os.environ)),
            name=f"lab-worker-{key}",
            daemon=False,
        )
        try:
            process.start()
        finally:
            writer.close()  # the child holds its own end; EOF then means the child is gone
            if process.pid is not None:  # started, even if an interrupt came right after
                self._running[key] = _Worker(key, process, reader, time.perf_counter())

    def wait(self, timeout: float | None = None) -> list[Outcome]:
        """Block until at least one call ended (or `timeout` passed); return what ended."""
        if not self._running:
            return []
        ready = set(
            multiprocessing.connection.wait(
                [w.conn for w in self._running.values()]
                + [w.process.sentinel for w in self._running.values()],
                timeout,
            )
        )
        ended = []
        for worker in list(self._running.values()):
            if worker.conn in ready:
                self._drain(worker)
            if worker.answer is None and worker.process.sentinel in ready:
                self._drain(worker)  # its last words may have come with its exit
                if worker.answer is None:
                    worker.answer = ("died",)
            if worker.answer is not None:
                ended.append(self._finish(worker))
        return ended

    def stop(self, grace_s: float = 30.0) -> list[Outcome]:
        """Interrupt every running call, wait up to `grace_s` for them to answer, then kill
        what is left; returns the outcomes of every call that was running.

        A call that has sent progress gets one SIGINT (a `KeyboardInterrupt` in the worker,
        so it can record that); one that has sent none has not begun, and is killed at once.
        A second Ctrl-C while waiting kills the workers at once.
        """
        for worker in self._running.values():
            self._drain(worker)  # what it has said so far: has it begun, has it answered?
            if worker.answer is None:
                begun = worker.progress is not None
                _signal(worker.process, signal.SIGINT if begun else signal.SIGKILL)
        ended: list[Outcome] = []
        deadline = time.monotonic() + grace_s
        try:
            while self._running and time.monotonic() < deadline:
                ended += self.wait(timeout=max(0.0, deadline - time.monotonic()))
        except KeyboardInterrupt:
            pass
        for worker in list(self._running.values()):
            worker.process.kill()
            worker.process.join(5)
            self._drain(worker)
            if worker.answer is None:
                worker.answer = ("died",)
            ended.append(self._finish(worker))
        return ended

    # ------------------------------------------------------------------------------------
    def _drain(self, worker: _Worker) -> None:
        """Read every message the worker has sent so far."""
        while worker.answer is None:
            try:
                if not worker.conn.poll():
                    return
                message = worker.conn.recv()
            except (EOFError, OSError):
                return  # the worker is gone; its sentinel says so
            except Exception as exc:  # pickled in the worker, but it won't load here
                message = ("raised", RuntimeError(f"the worker's answer did not load: {exc}"), None)
            if message[0] == "progress":
                worker.progress = message[1]
            else:
                worker.answer = message

    def _finish(self, worker: _Worker) -> Outcome:
        del self._running[worker.key]
        process = worker.process
        process.join(EXIT_GRACE_S)  # it answered: what is left is the interpreter's exit
        if process.exitcode is None:
            process.kill()
            process.join()
        worker.conn.close()
        outcome = Outcome(
            worker.key,
            process.pid,
            progress=worker.progress,
            seconds=time.perf_counter() - worker.started,
        )
        answer = worker.answer or ("died",)
        if answer[0] == "returned":
            outcome.value = answer[1]
        elif answer[0] == "raised":
            outcome.error, outcome.traceback = answer[1], answer[2]
        elif answer[0] == "unloadable":
            outcome.unloadable = answer[1]
        else:
            outcome.died = _how_it_ended(process.exitcode)
        process.close()
        return outcome


def _how_it_ended(code: int | None) -> str:
    if code is None:
        return "it did not exit"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _signal(process: Any, signum: int) -> None:
    if process.pid is None or process.exitcode is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(process.pid, signum)


#: The environment variable that names the Ray cluster of ``executor="ray"`` (``ray://...``
#: or ``host:port``); unset, a local cluster starts (or the one this process joined is used).
RAY_ADDRESS_ENV = "LAB_RAY_ADDRESS"
#: What a run asks of Ray when neither its experiment nor its arm says otherwise.
DEFAULT_RESOURCES: dict[str, float] = {"num_cpus": 1.0}
#: The resources a run may ask for, as `ray.remote` names them (memory in bytes).
RESOURCE_NAMES = ("num_cpus", "num_gpus", "memory")
_KV_NAMESPACE = "lab"


def check_resources(resources: Mapping[str, float] | None, who: str) -> dict[str, float]:
    """`resources` as Ray task options, checked now: a typo must not reach a cluster that
    would queue the run forever for a resource no node has."""
    if resources is None:
        return {}
    if not isinstance(resources, Mapping):
        raise ConfigError(f"{who}: resources={resources!r}; use a dict such as "
                          "{'num_cpus': 2, 'num_gpus': 1}")  # fmt: skip
    checked: dict[str, float] = {}
    for name, value in resources.items():
        if name not in RESOURCE_NAMES:
            raise ConfigError(f"{who}: resources has {name!r}; use {', '.join(RESOURCE_NAMES)}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise ConfigError(f"{who}: resources[{name!r}]={value!r}; use a number >= 0")
        checked[name] = float(value) if name != "memory" else int(value)
    return checked


def check_shared_store(url: str | None, nodes: int) -> None:
    """Refuse a SQLite store for runs spread over several machines.

    Each node would open its own file at that path (or one file over a network filesystem,
    whose locks SQLite cannot trust): the runs would be recorded apart, or the file
    corrupted. One node (a local ``ray.init()``) shares one file safely.
    """
    if url is None or nodes <= 1 or not str(url).startswith("sqlite"):
        return
    raise ConfigError(
        f"executor='ray' on a cluster of {nodes} nodes cannot record into the SQLite store "
        f"{url}: each node would write a file of its own; use a PostgreSQL URL "
        "(postgresql://user:password@host/db) or a lab serve URL (http://host:port) as store"
    )


def connect_ray(address: str | None = None) -> Any:
    """The `ray` module, joined to a cluster: the one this process joined already, else
    `address`, else ``LAB_RAY_ADDRESS``, else a local cluster that ``ray.init()`` starts."""
    require("ray", "ray", "executor='ray'")
    import ray

    if not ray.is_initialized():
        address = address or os.environ.get(RAY_ADDRESS_ENV) or None
        ray.init(address=address, include_dashboard=False, log_to_driver=True)
    return ray


def ray_nodes(ray: Any) -> int:
    """How many live nodes the cluster has."""
    return sum(1 for node in ray.nodes() if node.get("Alive"))


@dataclass
class _RayCall:
    key: Any
    ref: Any  # the ObjectRef of the task's answer
    started: float
    progress_key: str


class RayPool:
    """Runs calls ``fn(*args, progress=send)``, each as one Ray task, on a Ray cluster.

    The calls go to Ray as soon as they are submitted (with `workers`, at most that many at
    once); Ray starts each when a node has the resources it asks for. `fn` and `args` are
    pickled here (cloudpickle: a `train` defined in a script or a notebook travels by value)
    with this process's ``sys.path`` and working folder, as a ``spawn`` worker would get
    them. Ray never retries a task itself (``max_retries=0``): a run whose worker died is
    the experiment's to record and resubmit (``Experiment(max_retries=N)``), so its store
    row goes through `crashed` and the retry resumes from its newest checkpoint.

    `progress` messages travel through Ray's key-value store in the cluster's GCS, so the
    driver still knows what a run had recorded when its worker dies.
    """

    def __init__(self, workers: int | None = None, address: str | None = None) -> None:
        if workers is not None and workers < 1:
            raise ValueError(f"workers={workers}: use an int >= 1, or None")
        self.ray = connect_ray(address)
        self.workers = workers
        self.nodes = ray_nodes(self.ray)
        self._token = uuid.uuid4().hex
        self._task: Any = None
        self._running: dict[Any, _RayCall] = {}

    @property
    def free(self) -> int:
        """How many more calls can start now (Ray queues what the cluster cannot start)."""
        if self.workers is None:
            return sys.maxsize
        return self.workers - len(self._running)

    @property
    def running(self) -> int:
        """How many calls are submitted and not ended."""
        return len(self._running)

    def submit(
        self,
        key: Any,
        fn: Callable[..., Any],
        *args: Any,
        resources: Mapping[str, float] | None = None,
    ) -> None:
        """Submit ``fn(*args, progress=...)`` as a Ray task that asks for `resources`
        (``num_cpus``, ``num_gpus``, ``memory``); its `Outcome` carries `key`.

        Raises what pickling raised when `fn` or `args` cannot be sent; nothing is
        submitted then.
        """
        if key in self._running:
            raise ValueError(f"{key!r} is running already")
        from ray import cloudpickle

        payload = cloudpickle.dumps((fn, args), protocol=pickle.HIGHEST_PROTOCOL)
        if self._task is None:
            self._task = self.ray.remote(_ray_child)
        progress_key = f"{self._token}/{uuid.uuid4().hex}"
        options = {**DEFAULT_RESOURCES, **(resources or {})}
        ref = self._task.options(
            **options, max_retries=0, retry_exceptions=False, name=f"lab-run-{key}"
        ).remote(payload, list(sys.path), os.getcwd(), progress_key)
        self._running[key] = _RayCall(key, ref, time.perf_counter(), progress_key)

    def wait(self, timeout: float | None = None) -> list[Outcome]:
        """Block until at least one call ended (or `timeout` passed); return what ended."""
        if not self._running:
            return []
        refs = {call.ref: call for call in self._running.values()}
        ready, _ = self.ray.wait(list(refs), num_returns=1, timeout=timeout)
        if ready:  # and whatever else has ended by now
            ready, _ = self.ray.wait(list(refs), num_returns=len(refs), timeout=0)
        return [self._finish(refs[ref]) for ref in ready]

    def stop(self, grace_s: float = 30.0) -> list[Outcome]:
        """Interrupt every running call, wait up to `grace_s` for them to answer, then kill
        what is left; returns the outcomes of every call that was running.

        ``ray.cancel`` raises `KeyboardInterrupt` in a task that runs (it records its run as
        interrupted and answers) and drops one that waits for resources. A second Ctrl-C
        while waiting kills the workers at once.
        """
        for call in self._running.values():
            self.ray.cancel(call.ref, force=False)
        ended: list[Outcome] = []
        deadline = time.monotonic() + grace_s
        try:
            while self._running and time.monotonic() < deadline:
                ended += self.wait(timeout=max(0.0, deadline - time.monotonic()))
        except KeyboardInterrupt:
            pass
        for call in list(self._running.values()):
            with contextlib.suppress(Exception):
                self.ray.cancel(call.ref, force=True)
            outcome = self._finish(call, answer=("died", "killed: it did not answer the interrupt"))
            ended.append(outcome)
        return ended

    # ------------------------------------------------------------------------------------
    def _finish(self, call: _RayCall, answer: tuple[Any, ...] | None = None) -> Outcome:
        del self._running[call.key]
        if answer is None:
            answer = self._answer(call)
        pid, progress = self._progress(call)
        outcome = Outcome(
            call.key, pid, progress=progress, seconds=time.perf_counter() - call.started
        )
        if answer[0] == "returned":
            outcome.value = answer[1]
        elif answer[0] == "raised":
            outcome.error, outcome.traceback = answer[1], answer[2]
        elif answer[0] == "unloadable":
            outcome.unloadable = answer[1]
        else:
            outcome.died = answer[1]
        with contextlib.suppress(Exception):
            from ray.experimental.internal_kv import _internal_kv_del

            _internal_kv_del(call.progress_key, namespace=_KV_NAMESPACE)
        return outcome

    def _answer(self, call: _RayCall) -> tuple[Any, ...]:
        """What the task answered, or how Ray says it ended without an answer."""
        from ray import exceptions

        try:
            return self.ray.get(call.ref)
        except exceptions.TaskCancelledError:  # cancelled before it started
            return ("raised", KeyboardInterrupt("cancelled"), None)
        except exceptions.RayTaskError as exc:  # raised outside fn: its answer did not travel
            return ("raised", RuntimeError(str(exc).splitlines()[-1]), str(exc))
        except exceptions.RayError as exc:  # the worker process or its node died
            return ("died", _ray_death(exc))

    def _progress(self, call: _RayCall) -> tuple[int | None, Any]:
        """(pid, last progress message) the task left in the cluster's key-value store."""
        try:
            from ray.experimental.internal_kv import _internal_kv_get

            raw = _internal_kv_get(call.progress_key, namespace=_KV_NAMESPACE)
        except Exception:
            return None, None
        if raw is None:
            return None, None
        try:
            return pickle.loads(raw)
        except Exception:
            return None, None


def _ray_death(exc: BaseException) -> str:
    """How Ray says a task's worker ended, in a few words."""
    first = next((line for line in str(exc).splitlines() if line.strip()), "")
    return f"{type(exc).__name__}: {first}".rstrip(": ")


# -- inside the worker process -----------------------------------------------------------------
def _interrupt_once(signum: int, frame: Any) -> None:
    """The worker's SIGINT handler: one `KeyboardInterrupt`, later ones ignored.

    A Ctrl-C in a terminal reaches the parent and every worker, and the parent then
    interrupts its workers too: the second signal must not break the worker while it
    records its interrupted run.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


def _child(
    payload: bytes,
    conn: multiprocessing.connection.Connection,
    threads: int,
    environ: dict[str, str],
) -> None:
    """A worker's whole life: load the call, run it, send back how it ended.

    The fork server started with the environment of its own start: the worker takes the
    experiment's as it is now (`environ`), as a spawned process would."""
    os.environ.clear()
    os.environ.update(environ)
    signal.signal(signal.SIGINT, _interrupt_once)
    import torch

    omp = os.environ.get("OMP_NUM_THREADS", "")
    torch.set_num_threads(int(omp) if omp.isdigit() and int(omp) > 0 else threads)
    answer: tuple[Any, ...]
    try:
        try:
            fn, args = pickle.loads(payload)
        except Exception as exc:  # e.g. train defined where this process cannot import it
            answer = ("unloadable", f"{type(exc).__name__}: {exc}".splitlines()[0])
        else:
            value = fn(*args, progress=lambda message: conn.send(("progress", message)))
            answer = ("returned", value)
    except BaseException as exc:
        answer = ("raised", portable(exc), traceback.format_exc())
    try:
        conn.send(answer)
    except Exception as exc:  # an answer that cannot be pickled: say so, in plain text
        error = RuntimeError(f"the worker could not send its answer back: {exc}")
        conn.send(("raised", error, traceback.format_exc()))
    finally:
        conn.close()


def _ray_child(payload: bytes, sys_path: list[str], cwd: str, progress_key: str) -> tuple:
    """A Ray task: load the call where the driver's paths lead, run it, answer how it ended.

    The driver's ``sys.path`` entries join this worker's and its working folder becomes this
    worker's (when the node has them), so a run finds its modules and relative paths as a
    ``spawn`` worker would. Progress (with this worker's pid) goes to the cluster's
    key-value store, where the driver reads it if this process dies.
    """
    from ray import cloudpickle
    from ray.experimental.internal_kv import _internal_kv_put

    for path in sys_path:
        if path not in sys.path:
            sys.path.append(path)
    if os.path.isdir(cwd):
        os.chdir(cwd)
    pid = os.getpid()

    def progress(message: Any) -> None:
        data = pickle.dumps((pid, message), protocol=pickle.HIGHEST_PROTOCOL)
        _internal_kv_put(progress_key, data, overwrite=True, namespace=_KV_NAMESPACE)

    try:
        progress(None)  # begun: the driver knows the pid from here on
        try:
            fn, args = cloudpickle.loads(payload)
        except Exception as exc:  # e.g. a module this node cannot import
            return ("unloadable", f"{type(exc).__name__}: {exc}".splitlines()[0])
        return ("returned", fn(*args, progress=progress))
    except BaseException as exc:
        return ("raised", portable(exc), traceback.format_exc())
