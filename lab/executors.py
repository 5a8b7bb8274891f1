"""Where runs execute: in the experiment's own process, or each in a fresh worker process.

``Experiment(executor="serial")`` (the default) runs one run after another in its own
process. ``Experiment(executor="processes", workers=N)`` hands each run to `ProcessPool`:
at most N at a time, each in a process of its own, started with ``spawn`` (torch and
``fork`` don't mix) and ended with its run, so no state leaks from one run into the next.

What runs where, with ``executor="processes"``::

    parent:  on_experiment_start, on_group_start     (ctx.ids filled here ...)
    worker:  a pickled copy of the callbacks and of ctx (... reach the worker intact)
             on_run_start ... every loop hook ... on_error, on_run_end, then close()
             -> sends back the RunResult (artifacts=None: the model stays in the worker)
    parent:  on_experiment_end, close

This module only starts processes and brings their answers back; `lab.experiment` decides
what a run is and which hooks fire. A worker that dies (SIGKILL, ``os._exit``, an OOM kill)
comes back as an `Outcome` whose `died` says how, and the other workers go on.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lab.errors import LabError

#: The start method of every worker process; ``fork`` would copy torch's threads and locks.
START_METHOD = "spawn"
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

    @property
    def ok(self) -> bool:
        """Whether the call returned a value."""
        return self.error is None and self.died is None and self.unloadable is None


@dataclass
class _Worker:
    key: Any
    process: Any  # multiprocessing's SpawnProcess
    conn: multiprocessing.connection.Connection
    started: float
    progress: Any = None
    answer: tuple[Any, ...] | None = None


class ProcessPool:
    """Runs calls ``fn(*args, progress=send)``, each in a fresh ``spawn`` process, at most
    `workers` at a time.

    A process per call (not a long-lived worker) is what makes runs independent: each run
    starts from a fresh interpreter, as it would from the command line. `fn` and `args` are
    pickled in the parent at `submit`, so a later change to them reaches no worker.
    """

    def __init__(self, workers: int) -> None:
        if workers < 1:
            raise ValueError(f"workers={workers}: use an int >= 1")
        self.workers = workers
        # torch's intra-op threads per worker: N workers each using every core would
        # oversubscribe the machine N times over. OMP_NUM_THREADS, when set, wins.
        self.threads = max(1, (os.cpu_count() or 1) // workers)
        self._mp = multiprocessing.get_context(START_METHOD)
        self._running: dict[Any, _Worker] = {}

    @property
    def free(self) -> int:
        """How many more calls can start now."""
        return self.workers - len(self._running)

    @property
    def running(self) -> int:
        """How many calls are running."""
        return len(self._running)

    def submit(self, key: Any, fn: Callable[..., Any], *args: Any) -> None:
        """Start ``fn(*args, progress=...)`` in a new process; its `Outcome` carries `key`.

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
            args=(payload, writer, self.threads),
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


# -- inside the worker process -----------------------------------------------------------------
def _interrupt_once(signum: int, frame: Any) -> None:
    """The worker's SIGINT handler: one `KeyboardInterrupt`, later ones ignored.

    A Ctrl-C in a terminal reaches the parent and every worker, and the parent then
    interrupts its workers too: the second signal must not break the worker while it
    records its interrupted run.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


def _portable(exc: BaseException) -> BaseException:
    """`exc`, or a RuntimeError with its text when it would not survive pickling."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")
    return exc


def _child(payload: bytes, conn: multiprocessing.connection.Connection, threads: int) -> None:
    """A worker's whole life: load the call, run it, send back how it ended."""
    signal.signal(signal.SIGINT, _interrupt_once)
    if "OMP_NUM_THREADS" not in os.environ:
        import torch

        torch.set_num_threads(threads)
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
        answer = ("raised", _portable(exc), traceback.format_exc())
    try:
        conn.send(answer)
    except Exception as exc:  # an answer that cannot be pickled: say so, in plain text
        error = RuntimeError(f"the worker could not send its answer back: {exc}")
        conn.send(("raised", error, traceback.format_exc()))
    finally:
        conn.close()
