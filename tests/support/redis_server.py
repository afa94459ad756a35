"""A ``redis-server`` of a test's own, on a free port, that the test stops and restarts.

Stopping the machine's shared Redis would disturb every other test; a test that needs a
broker (or result backend) outage starts its own. It keeps its data in an append-only
file in the test's directory, so a restart finds the messages a real broker would.
The server runs in a session of its own and is stopped by its PID.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from types import TracebackType
from typing import Self

import redis


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RedisServer:
    """``redis-server`` on ``127.0.0.1:<port>``, data kept in ``directory``."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.port = _free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> None:
        """Start the server (again, on the same port and data) and wait until it answers."""
        assert self.proc is None or self.proc.poll() is not None, "already running"
        log = open(self.directory / f"redis-{self.port}.log", "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(self.directory),
                "--save",
                "",
                "--appendonly",
                "yes",
                "--appendfsync",
                "always",
                "--daemonize",
                "no",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_connect_timeout=0.5)
        deadline = time.monotonic() + timeout
        while True:
            try:
                if client.ping():
                    return
            except redis.ConnectionError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"redis-server on port {self.port} did not start")
            time.sleep(0.05)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the server by its PID (SIGTERM: it writes its data; SIGKILL if stuck)."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)  # a paused server cannot act on SIGTERM
            os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout)

    def pause(self) -> None:
        """Stop the server's process (SIGSTOP): it accepts no command, answers none,
        and connections already open hang, as with a broker that stopped responding."""
        assert self.proc is not None, "not started"
        assert self.proc.poll() is None, "not running"
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """Let a paused server go on (SIGCONT)."""
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGCONT)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
