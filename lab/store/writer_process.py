"""The metric writer process: batches are encoded and written outside the training process.

A writer thread in the training process shares its interpreter's lock (the GIL) with the
training thread: turning a batch into rows and binding them to SQLite costs ~5-10 µs of
held GIL per point, and the training thread waits for it. So a `Store` that another process
can open (a SQLite file, a PostgreSQL server) hands its batches to a writer process. There
is one per training process, shared by all its stores: its start-up (a fresh interpreter
importing SQLAlchemy, 0.5-2 s of CPU) overlaps what the program does meanwhile, and is paid
once per process, not once per store.

The training process keeps `MetricWriter` (the bounded buffer, back-pressure, flush
markers, retries, the flush at exit) and gives it a `WriterProcess` as its write function.
For each batch, the writer thread pickles the items (one C call), sends them through a pipe
(the GIL is released while the bytes go) and blocks, again without the GIL, until the
process answers: after it committed the batch with the same `lab.store.metric_rows` code on
its own connection to the store, or with the exception that write raised, which the writer
thread raises in turn, so retries, backoff and the `StoreError` messages are those of a
writer thread. `flush` therefore still returns once every row put before it is committed.

Nothing is lost when the process dies (SIGKILL, out of memory): the batch it was writing is
still held by the training process, which starts a new process and sends the same batch
again (the new process opens the store anew). A batch written twice is harmless: a step
logged again replaces its rows, and the summaries and blocks of a batch that steps back
are recomputed from the rows.

By default (``writer="auto"``) a store does not start the process when it opens: its
thread writes its first `AUTO_AFTER_POINTS` points, then it starts the process and goes on
writing until the process says it is ready, and only then sends it its batches. A store
opened while the process is ready sends it every batch. So a program that records a few
rows never starts one, and a long fit never waits for one to start.

The frames: an 8-byte little-endian length, then a pickle. The process's first frame says
it is ready (``("lab metric writer", PROTOCOL)``, sent once it has imported the store); a
process that names another protocol (lab upgraded or replaced on disk while the program
ran, and a writer process started again from the new code) is ended, and the stores write
in their threads, with one line that says so. Each one to the process is
``(store key, URL, active run ids, driving, items)``, the URL with its password (a pipe,
never ``ps``), `driving` the experiments whose heartbeat is due with their driver (or
None), or ``(store key, None, ...)`` when that store is closed; each answer is ``None``
(done) or the exception. The process ignores SIGINT and runs in a session of its own, so a
Ctrl-C or a SIGTERM to the training process's group leaves it writing until the training
process has flushed at exit; it ends when its input closes, when the training process ends
(however it ends: a SIGKILL included).

A child the training process forks (a DataLoader worker, say) would inherit the two pipes and
keep the process's input open after the training process died. So a forked child points
its copies at /dev/null at once (`os.register_at_fork`), and, for children forked past that
hook (by C code), the process also watches its parent: once the training process is gone
(the process's parent changes), it ends after the batch it is writing.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from lab._secrets import logger
from lab.store.writer import MetricItem, _reason, rejected

if TYPE_CHECKING:
    from lab.store.metric_rows import Driving, MetricRows

log = logger("lab.store")

_HEADER = struct.Struct("<Q")
_PROTOCOL = pickle.HIGHEST_PROTOCOL
_CHILD = "from lab.store.writer_process import main; main()"
#: The version of the frames below; the process names it in its first frame.
PROTOCOL = 2
_HELLO = "lab metric writer"
#: In auto mode (`Store`'s default) a store writes its first points in its own writer
#: thread, and asks for the writer process once it has written this many: a short run, a
#: test, a command that records a few rows never pays for starting one (0.5-2 s of CPU).
#: A store opened while the process already runs and is ready hands it every batch.
AUTO_AFTER_POINTS = 2_000


class WriterDied(OSError):
    """The metric writer process ended while it held a batch (that batch is kept)."""


class WriterProcess:
    """A `MetricWriter`'s write function that writes each batch in the writer process.

    `url` must name a store that another process can open (a SQLite file by absolute path,
    or a server); `active` returns the run ids whose heartbeat the store keeps (sent with
    each batch, so that an idle `write([])` still refreshes them), and `driving` the
    experiments whose heartbeat is due, with their driver (None when none is). Each one is
    a channel of the one writer process this process shares among its stores, which it
    starts if none runs yet. `close` tells the process to let go of this store (its connections).

    `fallback` writes a batch in this process: it is used from the start when no writer
    process can run here at all (one that ends before it ever answered, twice: an
    interpreter that cannot import lab, say), and from then on when one speaks another
    protocol (`PROTOCOL`), so the rows are still written.
    """

    def __init__(
        self,
        url: str,
        active: Callable[[], Iterable[int]],
        fallback: Callable[..., None] | None = None,
        *,
        auto: bool = False,
        driving: Callable[[], Driving | None] = lambda: None,
    ) -> None:
        self._url = url
        self._active = active
        self._driving = driving
        self._fallback = fallback
        self._local = False  # True once no writer process could run: `fallback` writes
        self._key = next(_keys)
        self._owner = os.getpid()  # a forked copy of this object must not touch the process
        self._closed = False
        # auto: `fallback` writes until the shared process is up and has said it is ready,
        # which this store asks for once it has written AUTO_AFTER_POINTS points itself
        self._waiting = auto and fallback is not None
        self._points = 0
        if not self._waiting:
            _shared().start()

    @property
    def joined(self) -> bool:
        """Whether this store's batches go to the writer process now."""
        return not self._waiting and not self._local

    @property
    def pid(self) -> int | None:
        """The writer process's id (None when none runs)."""
        return _shared().pid

    @property
    def restarts(self) -> int:
        """How many times the writer process was found dead and started again."""
        return _shared().restarts

    def __call__(self, items: list[MetricItem]) -> None:
        """Write `items` in one transaction in the process; raise what that write raised.
        A process found dead is started again and given the same batch."""
        if self._closed:
            raise WriterDied("this store's metric writer is closed")
        if self._local and self._fallback is not None:
            self._fallback(items)
            return
        if self._waiting and not self._join():
            assert self._fallback is not None
            self._fallback(items)
            self._points += sum(len(metrics) for _, _, metrics, _ in items)
            return
        active = sorted(self._active())
        driving = self._driving()
        if not items and not active and driving is None:
            return  # nothing to write and no heartbeat to keep
        shared = _shared()
        try:
            reply = shared.exchange((self._key, self._url, active, driving, items), len(items))
        except WriterDied:
            if (shared.answered and shared.refused is None) or self._fallback is None:
                raise
            log.warning(shared.why_local())
            self._local = True
            self._fallback(items, driving)
            return
        if reply is not None:
            raise reply

    def warm(self) -> None:
        """Open this store in the writer process now, with an empty batch, if its batches
        go there (or can from now on): its first real batch, which may be the one a fit's
        end waits for, then finds the process's connection open. Run by the writer thread
        as it starts; an error here is left for the first batch to meet."""
        if self._closed or self._local or (self._waiting and not self._join()):
            return
        with contextlib.suppress(OSError):  # no runs: no heartbeat, so nothing is written
            _shared().exchange((self._key, self._url, [], None, []), 0)

    def _join(self) -> bool:
        """Auto mode: whether the writer process is ready to take this store's batches;
        starts it once this store has written enough points itself. Never waits for it."""
        shared = _shared()
        if shared.ready():
            self._waiting = False
            return True
        if shared.failed_to_start():
            log.warning(shared.why_local())
            self._waiting, self._local = False, True
        elif self._points >= AUTO_AFTER_POINTS:
            shared.start()
        return False

    def close(self) -> None:
        """Let the writer process close this store (after the last flush)."""
        if self._closed or os.getpid() != self._owner:
            return
        self._closed = True
        if not self._waiting:
            _shared().forget(self._key)


class _Process:
    """The one writer process of this process, started on first use and again whenever it
    is found dead; `exchange` sends one frame and waits for the answer, one at a time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._ready = False  # the running process has said it is ready (its first frame)
        #: Why no writer process is used any more: one spoke another protocol (None: none did).
        self.refused: str | None = None
        self.restarts = 0
        self.answered = 0  # frames answered, by every process started so far

    @property
    def pid(self) -> int | None:
        proc = self._proc
        return None if proc is None or proc.poll() is not None else proc.pid

    def start(self) -> None:
        """Start the process unless it runs; start it again if it died after it had been
        ready (one that never was is left dead: the stores write in their threads)."""
        with self._lock:
            if self.refused is not None:
                return
            if self._proc is None:
                self._start()
            elif self._proc.poll() is not None and self._ready:
                self._replace()

    def _start(self) -> None:
        package_root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            close_fds=True,
            start_new_session=True,  # a signal to the training process's group passes it by
        )
        self._ready = False

    def ready(self) -> bool:
        """Whether the process runs and has said it is ready; never waits for it."""
        with self._lock:
            proc = self._proc
            if proc is None or proc.poll() is not None:
                return False
            try:
                return self._await_ready(block=False)
            except WriterDied:
                return False

    def why_local(self) -> str:
        """The line a store logs as it starts writing its batches in its own thread."""
        return self.refused or "no metric writer process could start; metrics are written here"

    def failed_to_start(self) -> bool:
        """Whether a process was started and ended before it ever said it was ready."""
        with self._lock:
            proc = self._proc
            return self.refused is not None or (
                proc is not None and proc.poll() is not None and not self._ready
            )

    def _await_ready(self, *, block: bool) -> bool:
        """Read the process's first frame (it sends it once it can write) if not yet read;
        without `block`, only when it is there already."""
        if self._ready:
            return True
        proc = self._proc
        assert proc is not None and proc.stdout is not None
        if not block and not select.select([proc.stdout], [], [], 0)[0]:
            return False
        hello = _receive(proc.stdout)
        if hello is None:
            raise WriterDied("the metric writer process ended before it was ready")
        said = pickle.loads(hello)
        if said != (_HELLO, PROTOCOL):
            self.refused = (
                f"the metric writer process (pid {proc.pid}) speaks another protocol "
                f"({said!r}; this program speaks {PROTOCOL}): was lab upgraded or replaced "
                "while this program ran? Its metrics are written in this process instead"
            )
            _end(proc, wait_s=1.0)
            raise WriterDied(self.refused)
        self._ready = True
        return True

    def exchange(self, message: tuple[Any, ...], rows: int) -> BaseException | None:
        payload = pickle.dumps(message, _PROTOCOL)
        with self._lock:
            if self.refused is not None:
                raise WriterDied(self.refused)
            if self._proc is None:
                self._start()
            try:
                return self._send_and_wait(payload)
            except OSError:
                if self.refused is not None:
                    raise
                self._restart(rows)
                try:
                    return self._send_and_wait(payload)
                except OSError as exc:
                    if self.refused is not None:
                        raise
                    raise WriterDied(
                        f"the metric writer process ended twice while writing ({exc})"
                    ) from exc

    def _send_and_wait(self, payload: bytes) -> BaseException | None:
        # (no poll for a process that exited: a dead one fails the write or ends the read,
        # and every system call here hands the GIL to the training thread and back)
        proc = self._proc
        assert proc is not None and proc.stdin is not None and proc.stdout is not None
        self._await_ready(block=True)
        _send(proc.stdin, payload)
        answer = _receive(proc.stdout)
        if answer is None:
            raise WriterDied("the metric writer process ended before it answered")
        self.answered += 1
        return pickle.loads(answer)

    def _restart(self, rows: int) -> None:
        old = self._replace()
        log.warning(
            "the metric writer process (pid %s) ended (%s); started another, which writes "
            "the batch again (%d steps)",
            old.pid,
            old.returncode,
            rows,
        )

    def _replace(self) -> subprocess.Popen[bytes]:
        """Reap the process that ended and start another; returns the old one."""
        old = self._proc
        assert old is not None
        _end(old, wait_s=1.0)
        self.restarts += 1
        self._start()
        return old

    def forget(self, key: int) -> None:
        """The process closes store `key`; nothing to do when it is not running."""
        with self._lock:
            proc = self._proc
            if proc is None or proc.poll() is not None or not self._ready:
                return  # a process not ready yet was never sent a store
            with contextlib.suppress(OSError):
                self._send_and_wait(pickle.dumps((key, None, (), None, ()), _PROTOCOL))


_keys = itertools.count(1)
_process: tuple[int, _Process] | None = None
_process_lock = threading.Lock()


def _forget_after_fork() -> None:
    """In a forked child: forget the parent's writer process, and point the child's copies
    of its pipes at /dev/null, so that they never keep it alive after the parent died (nor
    take a frame: the file objects stay, and whatever they flush goes nowhere)."""
    global _process, _process_lock
    inherited, _process, _process_lock = _process, None, threading.Lock()
    proc = inherited[1]._proc if inherited is not None else None
    if proc is None:
        return
    try:
        null = os.open(os.devnull, os.O_RDWR)
    except OSError:
        return
    try:
        for pipe in (proc.stdin, proc.stdout):
            with contextlib.suppress(OSError, ValueError):  # a pipe closed already
                if pipe is not None:
                    os.dup2(null, pipe.fileno())
    finally:
        os.close(null)


os.register_at_fork(after_in_child=_forget_after_fork)


def _shared() -> _Process:
    """This process's writer process (a forked child gets its own, never its parent's)."""
    global _process
    pid = os.getpid()
    current = _process
    if current is None or current[0] != pid:
        with _process_lock:
            current = _process
            if current is None or current[0] != pid:
                current = _process = (pid, _Process())
    return current[1]


def _end(proc: subprocess.Popen[bytes], *, wait_s: float) -> None:
    """Close the pipes (the process ends at the end of its input) and reap it."""
    for pipe in (proc.stdin, proc.stdout):
        if pipe is not None:
            with contextlib.suppress(OSError):
                pipe.close()
    try:
        proc.wait(wait_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _send(pipe: IO[bytes] | None, payload: bytes) -> None:
    """One frame, in one system call when it fits the pipe (header and body written apart
    would be two: a batch is larger than the writer's buffer)."""
    assert pipe is not None
    pipe.write(_HEADER.pack(len(payload)) + payload)
    pipe.flush()


def _receive(pipe: IO[bytes]) -> bytes | None:
    """One frame, or None at the end of the stream (the other side is gone)."""
    head = pipe.read(_HEADER.size)
    if len(head) < _HEADER.size:
        return None
    (size,) = _HEADER.unpack(head)
    body = pipe.read(size)
    return body if len(body) == size else None


# -- the process ------------------------------------------------------------------------------
def main() -> None:
    """The writer process: write each batch it is sent in its store, and answer."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the training process
    source, sink = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # the frames own stdout: a stray print must not corrupt them
    import lab.store.metric_rows  # noqa: F401  (the slow part of the start, before "ready")

    try:
        _send(sink, pickle.dumps((_HELLO, PROTOCOL), _PROTOCOL))  # ready: the first frame
    except OSError:
        return  # the training process ended before this one was ready: nothing to write
    stores: dict[int, MetricRows] = {}
    writing = threading.Lock()  # held while a frame is handled: the watch ends us between
    threading.Thread(target=_watch_parent, args=(os.getppid(), writing), daemon=True).start()
    while (frame := _receive(source)) is not None:
        writing.acquire()
        key, url, active, driving, items = pickle.loads(frame)
        reply: BaseException | None = None
        closed: MetricRows | None = None
        try:
            if url is None:  # the store was closed in the training process
                closed = stores.pop(key, None)
            else:
                store = stores.get(key)
                if store is None:
                    store = stores[key] = _open(url)
                store.active = set(active)
                store.write(items, driving)
        except Exception as exc:
            reply = exc
        try:
            _send(sink, _answer(reply))
        except OSError:
            break  # the training process is gone
        finally:
            try:
                if closed is not None:
                    # After the answer: the training process closed its connections first,
                    # so this one is a SQLite file's last, and copies the WAL into the file
                    # here (milliseconds per megabyte) while the training process goes on.
                    closed.engine.dispose()
            finally:
                writing.release()
    with writing:
        for store in stores.values():
            store.engine.dispose()


#: How often the writer process looks whether the training process is still its parent.
PARENT_POLL_S = 0.2


def _watch_parent(parent: int, writing: threading.Lock) -> None:
    """End the writer process once the training process that started it is gone, after the
    frame being handled: a child it forked past `_forget_after_fork` (a C library's) could
    otherwise hold the input open for as long as it lives. Every answered frame is
    committed, so nothing the training process was told is written is lost."""
    while os.getppid() == parent:
        time.sleep(PARENT_POLL_S)
    with writing:
        os._exit(0)


def _open(url: str) -> MetricRows:
    """The metric rows of a store, in this process; its schema is the training process's
    business."""
    from lab.store.engine import check_reachable, make_engine
    from lab.store.metric_rows import MetricRows

    engine = make_engine(url)
    check_reachable(engine)
    return MetricRows(engine)


def _answer(error: BaseException | None) -> bytes:
    """The reply to one batch: None, or the exception as the training process can raise
    it (a stand-in of the same kind, with the same reason, when it does not pickle)."""
    if error is None:
        return pickle.dumps(None, _PROTOCOL)
    try:
        text = pickle.dumps(error, _PROTOCOL)
        pickle.loads(text)
        return text
    except Exception:
        kind: type[Exception] = ValueError if rejected(error) else OSError
        return pickle.dumps(kind(_reason(error)), _PROTOCOL)
