"""Provenance: what produced a run, recorded with it, as W&B and MLflow do.

`collect()` reads, once per experiment (a bare fit's own too), never per step:

- git, from the working directory: the commit, the branch, whether tracked files differ from
  it (`dirty`, as W&B counts it: untracked files are counted apart, in `untracked`), the
  remote (its credentials masked) and the diff against the commit (``git diff HEAD``),
  capped at `DIFF_LIMIT` bytes with a marker line saying so. Outside a repository, or
  without git, `commit` is None and `note` says why; that is not an error;
- the Python and torch versions, the CUDA version and device names (none on CPU), the
  platform;
- the installed packages, name -> version (`importlib.metadata`, as ``pip freeze`` lists
  them);
- the command line (``sys.argv``) with credentials masked (`mask_argv`), the working
  directory and the host.

The SQL logger writes the record into ``runs.provenance`` when each run starts, and the diff
into the run folder as ``git.diff`` (`DIFF_FILE`). Read it back with
`lab.inspect.provenance` or ``lab show``.

>>> record = collect().record
>>> sorted(record)[:4]
['collected_at', 'command', 'cuda', 'cwd']
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import re
import socket
import subprocess
import sys
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from lab._secrets import HIDDEN, SECRET_NAME, mask

#: The diff is cut at this many bytes (UTF-8), and a marker line says so.
DIFF_LIMIT = 1_000_000
#: The diff's file name in the run folder.
DIFF_FILE = "git.diff"
#: What stands in for a masked secret.
MASK = HIDDEN
_GIT_TIMEOUT_S = 10.0

_SECRET_OPTION = re.compile(rf"(?i)^-{{1,2}}[\w.-]*{SECRET_NAME}(?:[_.-][\w.-]*)?$")


def mask_argv(argv: list[str]) -> list[str]:
    """A command line with its credentials masked: each argument through `lab._secrets.mask`
    (``--api-key=abc``, URL passwords, tokens), and the value after an option whose name says
    secret (``--token abc``, ``--password abc``). Why: a command line is recorded for every
    run, and read by everyone who reads the store.

    >>> mask_argv(["train.py", "--wandb-token", "abc", "--lr", "0.1"])
    ['train.py', '--wandb-token', '***', '--lr', '0.1']
    """
    out: list[str] = []
    secret_next = False
    for arg in argv:
        if secret_next and not arg.startswith("-"):
            out.append(MASK)
            secret_next = False
            continue
        secret_next = bool(_SECRET_OPTION.match(arg))
        out.append(mask(arg))
    return out


@dataclass(frozen=True)
class Provenance:
    """What `collect` found: the JSON `record` for ``runs.provenance``, and the (capped)
    `diff` text that goes into each run folder as `DIFF_FILE` ("" when there is none)."""

    record: dict[str, Any]
    diff: str = ""

    def write_diff(self, folder: Path) -> Path | None:
        """Write the diff into a run folder; returns its path, None when there is none."""
        if not self.diff:
            return None
        path = folder / DIFF_FILE
        folder.mkdir(parents=True, exist_ok=True)
        path.write_text(self.diff, encoding="utf-8")
        return path


def collect(
    cwd: str | os.PathLike[str] | None = None, *, diff_limit: int = DIFF_LIMIT
) -> Provenance:
    """Read the provenance of this process now (git state of `cwd`, default the working
    directory; packages, versions, devices, command line, host). Costs a few git calls and a
    walk of the installed packages: call it once per experiment, never per step."""
    folder = Path(cwd) if cwd is not None else Path.cwd()
    git, diff = _git(folder, diff_limit)
    record: dict[str, Any] = {
        "git": git,
        "python": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "platform": platform.platform(),
        **_torch(),
        "packages": _packages(),
        "command": mask_argv(list(sys.argv)),
        "cwd": str(folder.resolve()),
        "host": socket.gethostname(),
        "collected_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    return Provenance(record, diff)


def compact(record: dict[str, Any] | None) -> dict[str, Any]:
    """The few fields ``lab show`` prints: commit, dirty, python, torch, host, command."""
    if not record:
        return {}
    git = record.get("git") or {}
    return {
        "commit": git.get("commit"),
        "dirty": git.get("dirty"),
        "python": record.get("python"),
        "torch": record.get("torch"),
        "host": record.get("host"),
        "command": " ".join(record.get("command") or []),
        "note": git.get("note"),
    }


# ---------------------------------------------------------------------------------------------
def _run_gits(folder: Path, *commands: tuple[str, ...]) -> list[subprocess.CompletedProcess[bytes]]:
    """Run git commands side by side and wait for all of them: they only read, and the
    experiment's start waits for the slowest, not for their sum."""
    env = {**os.environ, "GIT_TERMINAL_PROMPT": "0", "LC_ALL": "C", "GIT_PAGER": "cat"}
    started: list[subprocess.Popen[bytes]] = []
    done: list[subprocess.CompletedProcess[bytes]] = []
    try:
        for args in commands:
            started.append(subprocess.Popen(
                ["git", "-C", str(folder), "--no-pager", *args],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, env=env,
            ))  # fmt: skip
        for proc in started:
            out, err = proc.communicate(timeout=_GIT_TIMEOUT_S)
            done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    finally:
        for proc in started:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return done


def _git(folder: Path, diff_limit: int) -> tuple[dict[str, Any], str]:
    """The git part of the record, and the capped diff text."""
    empty: dict[str, Any] = {"commit": None, "branch": None, "dirty": None, "remote": None,
                             "untracked": None, "diff_file": None, "diff_bytes": 0,
                             "diff_truncated": False, "root": None, "note": None}  # fmt: skip
    # binary files show as "Binary files ... differ"; no external diff or textconv runs
    plain = ("--no-color", "--no-ext-diff", "--no-textconv")
    try:  # all at once, the root, commit and branch in one: one wave of four processes
        first, remote_of, untracked_of, diff_head = _run_gits(
            folder,
            ("rev-parse", "--show-toplevel", "HEAD", "--abbrev-ref", "HEAD"),
            ("config", "--get", "remote.origin.url"),
            ("ls-files", "--others", "--exclude-standard", "-z"),
            ("diff", "HEAD", *plain),
        )
        if first.returncode == 0:
            root, commit, branch = first.stdout.decode().split("\n")[:3]
            raw = diff_head.stdout
        else:  # outside a repository, or in one with no commit yet (HEAD names nothing)
            (top,) = _run_gits(folder, ("rev-parse", "--show-toplevel"))
            if top.returncode != 0:
                reason = top.stderr.decode(errors="replace").strip().splitlines()
                line = reason[0] if reason else "git rev-parse failed"
                if "not a git repository" in line:
                    return {**empty, "note": f"{folder} is not in a git repository"}, ""
                return {**empty, "note": f"git: {mask(line)}"}, ""
            root, commit, branch = top.stdout.decode().strip(), None, ""
            raw = _run_gits(folder, ("diff", "--cached", *plain))[0].stdout  # what is staged
    except FileNotFoundError:
        return {**empty, "note": "git is not installed"}, ""
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {**empty, "note": f"git did not answer: {exc}"}, ""
    remote = remote_of.stdout.decode().strip()
    untracked = untracked_of.stdout
    text, truncated = _cap(raw, diff_limit)
    git = {
        "commit": commit,
        "branch": branch if branch and branch != "HEAD" else None,
        "dirty": bool(raw),
        "remote": mask(remote) if remote else None,
        "untracked": untracked.count(b"\0"),
        "diff_file": DIFF_FILE if raw else None,
        "diff_bytes": len(raw),
        "diff_truncated": truncated,
        "root": root,
        "note": None if commit is not None else "the repository has no commit yet",
    }
    return git, text


def _cap(raw: bytes, limit: int) -> tuple[str, bool]:
    """The diff as text, cut at `limit` bytes with a marker line when it is longer."""
    if len(raw) <= limit:
        return raw.decode("utf-8", errors="replace"), False
    head = raw[:limit].decode("utf-8", errors="ignore")
    if not head.endswith("\n"):
        head += "\n"
    return head + f"# lab: diff truncated at {limit} of {len(raw)} bytes\n", True


def _torch() -> dict[str, Any]:
    try:
        import torch
    except ImportError:
        return {"torch": None, "cuda": None, "devices": []}
    devices: list[str] = []
    if torch.cuda.is_available():
        devices = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "devices": devices}


def _packages() -> dict[str, str]:
    """Installed distributions, name -> version, sorted by name (as ``pip freeze``).

    Why it is cheap: only the header of each METADATA is read, not parsed as e-mail (that
    cost 50-90 ms per experiment, the slowest part of a fit's start), and the list is kept
    for the process until a folder on ``sys.path`` changes (an install or an uninstall adds
    or removes a ``.dist-info`` folder there, which changes the folder's mtime)."""
    global _PACKAGES
    stamp = _path_stamp()
    if _PACKAGES is not None and _PACKAGES[0] == stamp:
        return dict(_PACKAGES[1])
    found: dict[str, str] = {}
    for dist in importlib.metadata.distributions():
        name, version = _name_version(dist)
        if name and name not in found:
            found[name] = version or ""
    packages = dict(sorted(found.items(), key=lambda item: item[0].lower()))
    _PACKAGES = (stamp, packages)
    return dict(packages)


_PACKAGES: tuple[tuple[tuple[str, int | None], ...], dict[str, str]] | None = None


def _path_stamp() -> tuple[tuple[str, int | None], ...]:
    """Each ``sys.path`` entry with its mtime: what the distributions are found in."""
    stamp: list[tuple[str, int | None]] = []
    for entry in sys.path:
        try:
            stamp.append((entry, os.stat(entry or ".").st_mtime_ns))
        except OSError:
            stamp.append((entry, None))
    return tuple(stamp)


def _name_version(dist: importlib.metadata.Distribution) -> tuple[str | None, str | None]:
    """The Name and Version fields of a distribution's core metadata (its header: the lines
    before the first blank one; both fields are single-line by the specification)."""
    text = dist.read_text("METADATA") or dist.read_text("PKG-INFO") or ""
    name = version = None
    for line in text.partition("\n\n")[0].splitlines():
        if line.startswith("Name:"):
            name = line[5:].strip()
        elif line.startswith("Version:"):
            version = line[8:].strip()
    return name, version
