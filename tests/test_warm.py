"""A child forked from the tests' zygote (`tests/warm.py`) behaves as a cold interpreter
started with the same command: the same output, status, argv, working folder, environment,
path, atexit handlers, threads and signals. Each case runs both ways and compares."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests import warm

ROOT = Path(__file__).resolve().parents[1]

PROBE = textwrap.dedent(
    """
    import atexit, json, os, sys, threading, time
    atexit.register(lambda: print("atexit ran", flush=True))
    def later():
        time.sleep(0.2)
        print("thread ended", flush=True)
    threading.Thread(target=later).start()  # not a daemon: the exit waits for it
    print(json.dumps({
        "argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0],
        "extra": os.environ.get("LAB_PROBE"), "on_path": "/opt/probe" in sys.path,
        "main_file": getattr(sys.modules["__main__"], "__file__", None),
        "stdin": sys.stdin.read(),
    }))
    sys.stderr.write("to stderr\\n")
    sys.exit(int(sys.argv[-1]))
    """
)


def _both(args: list[str], **kwargs: object) -> tuple[subprocess.CompletedProcess, ...]:
    """The command run cold (`subprocess.run`), then warm (`warm.run`)."""
    return subprocess.run(args, **kwargs), warm.run(args, **kwargs)  # type: ignore[call-overload]


@pytest.mark.parametrize("how", ["-c", "script", "-m"])
def test_a_warm_child_prints_exits_and_sees_what_a_cold_one_does(how: str, tmp_path: Path) -> None:
    (tmp_path / "probe.py").write_text(PROBE)
    command = {
        "-c": [sys.executable, "-c", PROBE, "x", "3"],
        "script": [sys.executable, str(tmp_path / "probe.py"), "x", "3"],
        "-m": [sys.executable, "-m", "probe", "x", "3"],
    }[how]
    cold, hot = _both(
        command, input="from stdin", capture_output=True, text=True, cwd=tmp_path,
        env={**os.environ, "LAB_PROBE": "yes", "PYTHONPATH": f"/opt/probe{os.pathsep}{ROOT}"},
        timeout=60,
    )  # fmt: skip
    assert cold.returncode == 3, cold.stderr
    assert (hot.returncode, hot.stdout, hot.stderr) == (cold.returncode, cold.stdout, cold.stderr)
    assert cold.stdout.splitlines()[1:] == ["thread ended", "atexit ran"]
    assert warm.warm_command(command) is not None


def test_a_script_named_relative_to_its_folder_starts_pool_workers_from_it(tmp_path: Path) -> None:
    """`__main__.__file__` is absolute and multiprocessing knows the child's folder, so a
    spawned worker finds the script a relative path named (as `docs/ddp.md` runs it)."""
    (tmp_path / "pool_main.py").write_text(
        "import multiprocessing as mp\n"
        "def square(x):\n    return x * x\n"
        "if __name__ == '__main__':\n"
        "    with mp.get_context('spawn').Pool(1) as pool:\n"
        "        print(pool.map(square, [2, 3]), __file__)\n"
    )
    cold, hot = _both(
        [sys.executable, "pool_main.py"], capture_output=True, text=True, cwd=tmp_path, timeout=120
    )
    assert cold.returncode == 0 and cold.stdout == f"[4, 9] {tmp_path / 'pool_main.py'}\n"
    assert (hot.returncode, hot.stdout, hot.stderr) == (0, cold.stdout, cold.stderr)


def test_an_uncaught_exception_prints_the_same_traceback_and_exits_1(tmp_path: Path) -> None:
    code = "def f():\n    raise ValueError('boom')\nf()\n"
    cold, hot = _both([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert cold.returncode == 1 and cold.stderr.endswith("ValueError: boom\n")
    assert (hot.returncode, hot.stderr) == (cold.returncode, cold.stderr)


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT])
def test_a_signal_ends_a_warm_child_with_the_status_a_cold_one_gets(
    signum: int, tmp_path: Path
) -> None:
    code = "import time; print('ready', flush=True); time.sleep(60)"
    statuses = []
    for start in (subprocess.Popen, warm.popen):
        process = start(
            [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        assert process.stdout is not None and process.stdout.readline() == b"ready\n"
        assert process.poll() is None
        process.send_signal(signum)
        statuses.append(process.wait(timeout=30))
        process.communicate()
    assert statuses == [-signum, -signum]


def test_a_signal_before_the_command_starts_is_not_lost() -> None:
    process = warm.popen([sys.executable, "-c", "import time; time.sleep(60)"])
    process.send_signal(signal.SIGTERM)
    started = time.monotonic()
    assert process.wait(timeout=30) == -signal.SIGTERM
    assert time.monotonic() - started < 30


def test_the_environments_lab_command_starts_warm_and_answers_as_a_cold_one() -> None:
    lab = Path(sys.executable).parent / "lab"  # the console script pip wrote
    assert warm.warm_command([str(lab), "--help"]) == [str(lab), "--help"]
    cold, hot = _both([str(lab), "--help"], capture_output=True, text=True, timeout=60)
    assert cold.returncode == 0 and "Usage" in cold.stdout
    assert (hot.returncode, hot.stdout, hot.stderr) == (0, cold.stdout, cold.stderr)


def test_a_missing_script_or_folder_fails_as_on_a_cold_start(tmp_path: Path) -> None:
    missing = [sys.executable, "no_such_script.py"]
    cold, hot = _both(missing, capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert cold.returncode == 2 and "can't open file" in cold.stderr
    assert (hot.returncode, hot.stderr) == (cold.returncode, cold.stderr)
    for start in (subprocess.Popen, warm.popen):
        with pytest.raises(FileNotFoundError):
            start([sys.executable, "-c", "pass"], cwd=tmp_path / "gone")


def test_commands_a_warm_child_cannot_run_start_cold() -> None:
    assert warm.warm_command([sys.executable, "-X", "importtime", "-c", "pass"]) is None
    assert warm.warm_command(["bash", "-c", "true"]) is None
    assert warm.warm_command(f"{sys.executable} -c pass") is None
    assert type(warm.popen(["true"])) is subprocess.Popen
    cold = warm.popen([sys.executable, "-c", "pass"], pass_fds=())
    assert type(cold) is subprocess.Popen and cold.wait() == 0
