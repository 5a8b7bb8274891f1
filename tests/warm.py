"""Python children of the tests, started from a warm interpreter instead of a cold one.

A test that runs ``python -m lab ...``, ``python script.py`` or ``python -c ...`` pays for
the child's imports each time: torch alone is 1.2 CPU-seconds, the server's and the command
line's modules 0.3 to 0.5, and the suite starts some 600 such children on two cores. Here,
each test process keeps one *zygote*: a Python process that has imported them once
(`PRELOAD`) and forks a child for each command. The child is a real process, with its own
pid, its own memory, the command's argv, environment, working folder, session and stdio,
and it ends as the interpreter would: atexit handlers, flushed streams, the exit status
(a signal's death included) read by `WarmPopen` as `subprocess.Popen` reads its own.

Between the zygote and each child sits a small *waiter* that forks the child, waits for it
and writes its pid and then its raw wait status to a pipe the test holds: the zygote never
waits for anyone, and the test reads a status no other process can reap first.

What a warm child cannot show, the tests that need it start a cold one with
`subprocess`: which modules a command imports (`tests/test_architecture.py`,
`tests/test_cli_startup.py`), and anything run under other interpreter flags.
`popen` and `run` fall back to `subprocess` for any command other than this interpreter
with ``-c``, ``-m``, a script, an optional ``-u``, and for the keywords `WarmPopen`
does not carry (``pass_fds``, ``preexec_fn``, a user or group, ``shell``).
"""

from __future__ import annotations

import atexit
import builtins
import contextlib
import errno
import gc
import importlib
import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import threading
import types
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
#: What the zygote imports before it forks anyone: what most children import first.
PRELOAD = (
    "numpy",
    "torch",
    "sqlalchemy",
    "lab",
    "lab.cli",
    "lab.store",
    "lab.server.app",
    "uvicorn",
    "httpx",
)
#: Keywords of `subprocess.Popen` a warm child carries (others start a cold one).
_HELD = {signal.SIGINT, signal.SIGTERM}
_CARRIED = {
    "stdin", "stdout", "stderr", "env", "cwd", "text", "universal_newlines", "encoding",
    "errors", "bufsize", "start_new_session", "close_fds",
}  # fmt: skip


def warm_command(args: Any) -> list[str] | None:
    """`args` as the zygote runs it (``[-u] -c CODE ...``, ``-m NAME ...`` or a script),
    or None when a cold interpreter must run it."""
    if isinstance(args, (str, bytes)) or not args:
        return None
    args = [os.fspath(a) for a in args]
    if args[0] != sys.executable:
        if not _is_python_script(args[0]):
            return None
        return args  # a console script of this environment (``.venv/bin/lab``)
    rest = args[1:]
    if rest[:1] == ["-u"]:
        rest = rest[1:]
    if (rest[:1] in (["-c"], ["-m"]) and len(rest) >= 2) or (rest and not rest[0].startswith("-")):
        return args[1:]
    return None


def _is_python_script(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            first = f.readline(200)
    except OSError:
        return False
    if not first.startswith(b"#!"):
        return False
    interpreter = os.fsdecode(first[2:].strip())  # pip writes .../bin/python3, say
    here = os.path.dirname(sys.executable)
    return os.path.dirname(interpreter) == here and os.path.basename(interpreter).startswith(
        "python"
    )


class _Zygote:
    """The test process's zygote, started at its first use and ended with the process."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(_pythonpath(os.environ, ROOT))}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.warm", str(theirs.fileno()), *PRELOAD],
            pass_fds=[theirs.fileno()],
            env=env,
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
        )
        theirs.close()
        self.sock = ours
        self.lock = threading.Lock()
        if self.sock.recv(16) != b"ready":
            raise RuntimeError("the tests' zygote did not start (see its output above)")
        atexit.register(self.close)

    def fork(self, request: dict[str, Any], fds: list[int]) -> None:
        with self.lock:
            socket.send_fds(self.sock, [json.dumps(request).encode()], fds)

    def close(self) -> None:
        self.sock.close()  # the zygote reads the end of its socket and exits
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()


_zygote: _Zygote | None = None
_zygote_lock = threading.Lock()


def _the_zygote() -> _Zygote:
    global _zygote
    with _zygote_lock:
        if _zygote is None or _zygote.process.poll() is not None:
            _zygote = _Zygote()
        return _zygote


def _pythonpath(env: Any, *first: Path | str) -> list[str]:
    entries = [str(p) for p in first]
    return entries + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]


class WarmPopen(subprocess.Popen):
    """`subprocess.Popen` whose child the zygote forks: every method a test calls
    (`poll`, `wait`, `communicate`, `send_signal`, `kill`, the pipes) works as on a cold
    one; the exit status arrives over a pipe from the waiter, not from `os.waitpid`."""

    def _execute_child(  # type: ignore[override]
        self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
        creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite,
        restore_signals, gid, gids, uid, umask, start_new_session, process_group,
    ) -> None:  # fmt: skip
        command = warm_command(args)
        assert command is not None
        if cwd is not None and not os.path.isdir(cwd):  # where a cold start fails: here
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), os.fspath(cwd))
        status_r, status_w = os.pipe()
        # What the child gets as its stdin, stdout and stderr: the pipe or file Popen made,
        # or this process's own, as a cold child inherits it.
        given = (p2cread, c2pwrite, errwrite)
        stdio = [fd if fd != -1 else own for fd, own in zip(given, range(3), strict=True)]
        request = {
            "command": command,
            "env": dict(os.environ if env is None else env),
            "cwd": os.fspath(cwd) if cwd is not None else os.getcwd(),
            "new_session": bool(start_new_session),
        }
        try:
            _the_zygote().fork(request, [status_w, *stdio])
        finally:
            os.close(status_w)
            self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)
        self._status_file = os.fdopen(status_r, "rb", buffering=0)
        line = _read_line(self._status_file)
        if not line:
            raise OSError(f"the tests' zygote could not start {command!r}")
        self.pid = int(line)
        self._child_created = True

    def _try_wait(self, wait_flags: int) -> tuple[int, int]:
        if wait_flags & os.WNOHANG and not select.select([self._status_file], [], [], 0)[0]:
            return (0, 0)
        line = _read_line(self._status_file)
        self._status_file.close()
        return (self.pid, int(line))

    def _internal_poll(self, _deadstate: int | None = None, **_: Any) -> int | None:
        if self.returncode is None and self._waitpid_lock.acquire(False):
            try:
                if self.returncode is None and not self._status_file.closed:
                    pid, sts = self._try_wait(os.WNOHANG)
                    if pid == self.pid:
                        self._handle_exitstatus(sts)
            finally:
                self._waitpid_lock.release()
        return self.returncode


def _read_line(f: Any) -> bytes:
    line = b""
    while not line.endswith(b"\n"):
        chunk = f.read(1)
        if not chunk:
            break
        line += chunk
    return line


def popen(args: Any, **kwargs: Any) -> subprocess.Popen:
    """`subprocess.Popen(args, **kwargs)`, the child forked warm when it can be."""
    if warm_command(args) is None or not set(kwargs) <= _CARRIED:
        return subprocess.Popen(args, **kwargs)
    return WarmPopen(args, **kwargs)


def run(
    args: Any,
    *,
    input: Any = None,
    capture_output: bool = False,
    timeout: float | None = None,
    check: bool = False,
    **kwargs: Any,
) -> subprocess.CompletedProcess:
    """`subprocess.run` on `popen`."""
    if input is not None:
        kwargs["stdin"] = subprocess.PIPE
    if capture_output:
        kwargs["stdout"] = kwargs["stderr"] = subprocess.PIPE
    with popen(args, **kwargs) as process:
        try:
            stdout, stderr = process.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            raise
        except BaseException:
            process.kill()
            raise
    done = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
    if check:
        done.check_returncode()
    return done


# The zygote's side -----------------------------------------------------------------------


def _serve(sock_fd: int, preload: list[str]) -> None:
    """Import `preload`, then fork a waiter for each request until the socket closes."""
    for name in preload:
        importlib.import_module(name)
    gc.collect()
    gc.freeze()  # the children's collections leave the zygote's objects (and pages) alone
    sock = socket.socket(fileno=sock_fd)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the waiters
    # A SIGINT or SIGTERM to the tests' process group ends the children, never the zygote
    # or a waiter, which would lose a child's status.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sock.sendall(b"ready")
    base_path = [p for p in sys.path[1:] if p not in _pythonpath(os.environ)]
    while True:
        msg, fds, _, _ = socket.recv_fds(sock, 1 << 20, 4)
        if not msg:
            os._exit(0)
        sys.stdout.flush()
        sys.stderr.flush()
        if os.fork() == 0:
            sock.close()
            _wait_for(json.loads(msg), fds, base_path)
        for fd in fds:
            os.close(fd)


def _wait_for(request: dict[str, Any], fds: list[int], base_path: list[str]) -> None:
    """The waiter: fork the child, tell the test its pid, then its raw wait status."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    # SIGINT and SIGTERM held back from here on, with their default actions: the waiter
    # never takes them, and the child takes one sent before it was ready once it is.
    signal.pthread_sigmask(signal.SIG_BLOCK, _HELD)
    for signum in _HELD:
        signal.signal(signum, signal.SIG_DFL)
    status_w, *given = fds
    pid = os.fork()
    if pid == 0:
        os.close(status_w)
        _become(request, given, base_path)
    for fd in given:
        os.close(fd)
    os.write(status_w, b"%d\n" % pid)
    _, status = os.waitpid(pid, 0)
    os.write(status_w, b"%d\n" % status)
    os._exit(0)


def _become(request: dict[str, Any], given: list[int], base_path: list[str]) -> None:
    """Turn this forked process into the command, as a cold interpreter would start it."""
    if request["new_session"]:
        os.setsid()
    for target, fd in enumerate(given):
        os.dup2(fd, target)
    for fd in set(given) - {0, 1, 2}:
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.dont_write_bytecode = bool(os.environ.get("PYTHONDONTWRITEBYTECODE"))
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    import numpy

    numpy.random.seed()  # a cold interpreter's global numpy state is its own
    command = list(request["command"])
    unbuffered = command[:1] == ["-u"] or bool(os.environ.get("PYTHONUNBUFFERED"))
    if command[:1] == ["-u"]:
        command = command[1:]
    if "multiprocessing.process" in sys.modules:  # it noted the zygote's folder at import
        sys.modules["multiprocessing.process"].ORIGINAL_DIR = os.getcwd()  # type: ignore[attr-defined]
    if unbuffered:
        sys.stdout.reconfigure(write_through=True)
        sys.stderr.reconfigure(write_through=True)
    if command[0] == "-c":
        first: str = ""
    elif command[0] == "-m":
        first = os.getcwd()
    else:
        first = os.path.dirname(os.path.realpath(command[0]))
    sys.path[:] = [first, *_pythonpath(os.environ), *base_path]
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _HELD)
    _exit_as_python_does(lambda: _run(command))


def _run(command: list[str]) -> None:
    main = types.ModuleType("__main__")
    main.__builtins__ = builtins  # type: ignore[attr-defined]
    sys.modules["__main__"] = main
    if command[0] == "-c":
        sys.argv = ["-c", *command[2:]]
        exec(compile(command[1], "<string>", "exec"), main.__dict__)
    elif command[0] == "-m":
        sys.argv = [command[1], *command[2:]]
        sys.modules.pop(command[1], None)  # a cold one has not imported it: runpy would warn
        runpy._run_module_as_main(command[1])  # type: ignore[attr-defined]
    else:
        sys.argv = command
        main.__file__ = os.path.abspath(command[0])  # as a cold one has it since 3.9
        try:
            source = Path(command[0]).read_bytes()
        except OSError as exc:  # the line and the status a cold interpreter gives
            sys.stderr.write(
                f"{sys.executable}: can't open file {main.__file__!r}: "
                f"[Errno {exc.errno}] {exc.strerror}\n"
            )
            raise SystemExit(2) from None
        exec(compile(source, command[0], "exec"), main.__dict__)


def _exit_as_python_does(run: Any) -> None:
    """Run, then end as the interpreter ends: the traceback of what escaped (from the
    command's own frames), the non-daemon threads joined, the atexit handlers, the streams
    flushed, and the status; a KeyboardInterrupt ends the process by SIGINT. The modules
    are not torn down: what the zygote imported would take 0.2 s to free."""
    interrupted = False
    try:
        run()
        code = 0
    except SystemExit as exit:
        code = _exit_code(exit.code)
    except BaseException as exc:
        interrupted = isinstance(exc, KeyboardInterrupt)
        tb = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
            tb = tb.tb_next
        sys.excepthook(type(exc), exc.with_traceback(tb), tb)
        code = 1
    try:
        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        if interrupted:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        os._exit(code)


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


if __name__ == "__main__":
    _serve(int(sys.argv[1]), sys.argv[2:])
