"""A real `lab serve` server for the tests: uvicorn in a subprocess on a free loopback port,
in front of a real store, with a write token and a read token made for it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from lab.server.app import MAX_BODY
from lab.server.auth import create_token
from lab.store import Store
from tests import warm

_SERVE = (
    "import sys, uvicorn; from lab.server import create_app; "
    "uvicorn.run(create_app(sys.argv[1], max_body=int(sys.argv[3])), host='127.0.0.1', "
    "port=int(sys.argv[2]), log_level='warning')"
)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Served:
    """One server process in front of `store_url`; `url` is what a client is given."""

    store_url: str
    port: int = field(default_factory=free_port)
    write_token: str = ""
    read_token: str = ""
    process: subprocess.Popen | None = None
    max_body: int = MAX_BODY  # lab serve's --max-body

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> Served:
        """Start the server (again, on the same port) and wait until its health check answers."""
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
        self.process = warm.popen(
            [sys.executable, "-c", _SERVE, self.store_url, str(self.port), str(self.max_body)],
            env=env,
        )
        deadline = time.monotonic() + timeout
        while True:
            try:
                if httpx.get(f"{self.url}/api/v1/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"lab serve did not start on {self.url}")
            time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL the server: no shutdown, no flush."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()

    def stop(self) -> None:
        """Stop the server cleanly (SIGTERM), as an operator would."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill()

    def client(self, token: str | None = None) -> httpx.Client:
        """An httpx client with `token` (the write token by default) as its bearer."""
        token = self.write_token if token is None else token
        return httpx.Client(
            base_url=self.url, headers={"Authorization": f"Bearer {token}"}, timeout=30.0
        )


def serve(store_url: str, *, max_body: int = MAX_BODY) -> Served:
    """Create the store's schema, make a write and a read token, and start a server that
    takes bodies of up to `max_body` bytes."""
    store = Store(store_url)
    try:
        write = create_token(store.engine, "tests-write", "write")
        read = create_token(store.engine, "tests-read", "read")
    finally:
        store.close()
    return Served(store_url, write_token=write, read_token=read, max_body=max_body).start()
