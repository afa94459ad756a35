"""A PostgreSQL server of the test's own, to restart, stop and start at will.

The shared server (127.0.0.1:5432) must never be restarted by a test: tests that need
a database outage get a throwaway cluster instead, made with ``initdb`` in a temporary
directory and run with ``pg_ctl`` on a free port (trust authentication, user
``postgres``). PostgreSQL refuses to run as root, so when the tests run as root the
binaries run as the ``postgres`` user (``runuser``) and the directory is chowned to it.

``stop`` and ``restart`` are ``pg_ctl -m fast``: the server ends every session with
``terminating connection due to administrator command``, as an operator's restart
does. At teardown the server is stopped (its postmaster killed by PID if ``pg_ctl``
cannot stop it) and its directory removed.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

__all__ = ["ThrowawayCluster", "throwaway_cluster"]

BIN_DIRS = tuple(f"/usr/lib/postgresql/{version}/bin" for version in (15, 16, 17))


def _bin_dir() -> Path | None:
    for candidate in (os.environ.get("RUNCELL_PG_BIN"), *BIN_DIRS):
        if candidate and (Path(candidate) / "pg_ctl").exists():
            return Path(candidate)
    found = shutil.which("pg_ctl")
    return Path(found).parent if found else None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ThrowawayCluster:
    """One ``initdb`` cluster in a temporary directory, served by ``pg_ctl``."""

    def __init__(self) -> None:
        bin_dir = _bin_dir()
        if bin_dir is None:
            raise RuntimeError("no PostgreSQL server binaries (pg_ctl, initdb) found")
        self.bin_dir = bin_dir
        self.root = Path(tempfile.mkdtemp(prefix="runcell-pg-"))
        self.data = self.root / "data"
        self.log = self.root / "server.log"
        self.port = _free_port()
        self._as_postgres = os.geteuid() == 0
        if self._as_postgres:
            entry = pwd.getpwnam("postgres")
            os.chown(self.root, entry.pw_uid, entry.pw_gid)
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "-A", "trust", "--no-sync")
        with open(self.data / "postgresql.conf", "a") as conf:
            conf.write(
                f"\nport = {self.port}\nlisten_addresses = '127.0.0.1'\n"
                f"unix_socket_directories = '{self.root}'\nfsync = off\n"
                "max_connections = 100\n"
            )

    @property
    def dsn(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def start(self) -> None:
        """Start the server; return once it accepts connections."""
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-w", "-t", "30", "start")
        self._wait_ready()

    def stop(self) -> None:
        """Stop the server (``-m fast``: every session is terminated)."""
        self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "-t", "30", "stop")

    def restart(self) -> None:
        """Restart the server as an operator does (``pg_ctl restart -m fast``)."""
        self._run(
            "pg_ctl", "-D", str(self.data), "-l", str(self.log), "-m", "fast", "-w", "-t", "30",
            "restart",
        )  # fmt: skip
        self._wait_ready()

    def running(self) -> bool:
        return self._postmaster_pid() is not None

    def remove(self) -> None:
        """Stop the server (by PID if need be) and delete its directory."""
        if self.running():
            with contextlib.suppress(subprocess.CalledProcessError):
                self.stop()
        pid = self._postmaster_pid()
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.root, ignore_errors=True)

    def _postmaster_pid(self) -> int | None:
        try:
            pid = int((self.data / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        return pid

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + 30
        while True:
            try:
                psycopg.connect(self.dsn, connect_timeout=2).close()
                return
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def _run(self, program: str, *args: str) -> None:
        command = [str(self.bin_dir / program), *args]
        if self._as_postgres:
            command = ["runuser", "-u", "postgres", "--", *command]
        subprocess.run(command, check=True, capture_output=True, timeout=60, cwd=self.root)


@pytest.fixture(scope="session")
def throwaway_cluster() -> Iterator[ThrowawayCluster]:
    """A PostgreSQL server of the session's own (started), removed at the end. A test
    that stops it must leave it running again (or start it) when it ends."""
    cluster = ThrowawayCluster()
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.remove()
