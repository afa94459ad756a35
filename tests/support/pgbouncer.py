"""PgBouncer fixtures: a transaction-mode pooler in front of the module's database.

``pgbouncer_server`` starts Debian's ``pgbouncer`` (1.18 on bookworm; ``scripts/test``
installs it) as a subprocess of the test run, on 127.0.0.1 and a free port, with a
generated configuration in a temporary directory: ``pool_mode = transaction`` and a
pool of :data:`POOL_SIZE` server connections per database, so client connections
really share server connections. It serves the module's database (``pg_dsn``) under
its own name and, through a ``*`` entry, any other database on the same server.

PgBouncer refuses to run as root, so when the tests run as root it runs as the
``postgres`` user, and its files belong to that user. It is stopped by PID at the end
of the session (SIGTERM, then SIGKILL). If it is missing or does not start, the
fixture fails with its log: these tests never skip.

A test that runs ``LISTEN`` through the pooler should start its own with
:func:`run_pgbouncer`: in transaction mode nothing resets a server connection between
clients, so the ``LISTEN`` stays on one of the pool's server connections for good,
and every later ``NOTIFY`` on the channel reaches whichever client happens to use it
(and, during PgBouncer 1.18's ``server_check_query``, releases the server connection
before the check's reply: the next client reads ``select 1``'s result as its own).
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, LiteralString

import psycopg
import pytest

__all__ = [
    "POOL_SIZE",
    "AdminView",
    "PgBouncer",
    "pgbouncer_dsn",
    "pgbouncer_server",
    "run_pgbouncer",
]

#: Server connections per database and user: fewer than the limiter's own pool
#: (8 connections per process), so several clients share each server connection.
POOL_SIZE = 4
#: The user PgBouncer runs as when the tests run as root.
RUN_AS = "postgres"
START_TIMEOUT_S = 15.0
STOP_TIMEOUT_S = 10.0
INSTALL_HINT = "install it with: DEBIAN_FRONTEND=noninteractive apt-get install -y pgbouncer"

AdminView = Literal["pools", "stats", "servers", "clients", "config"]
_SHOW: dict[AdminView, LiteralString] = {
    "pools": "SHOW POOLS",
    "stats": "SHOW STATS",
    "servers": "SHOW SERVERS",
    "clients": "SHOW CLIENTS",
    "config": "SHOW CONFIG",
}


@dataclass(frozen=True)
class PgBouncer:
    """A running PgBouncer: where to connect, and its admin console."""

    pid: int
    port: int
    dsn: str
    admin_dsn: str
    logfile: Path

    def with_dbname(self, dbname: str) -> str:
        """The DSN of another database on the same server, through the pooler."""
        params = psycopg.conninfo.conninfo_to_dict(self.dsn)
        params["dbname"] = dbname
        return psycopg.conninfo.make_conninfo(**params)

    def show(self, what: AdminView) -> list[dict[str, Any]]:
        """Run ``SHOW POOLS`` (``STATS``, ...) on the admin console, rows as dicts."""
        with psycopg.connect(self.admin_dsn, autocommit=True) as conn:
            # No parameters: psycopg sends a simple query, all the console speaks.
            cursor = conn.execute(_SHOW[what])
            names = [column.name for column in cursor.description or ()]
            return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]

    def log(self) -> str:
        """Its log file and what it wrote to stderr, for failure messages."""
        texts: dict[str, str] = {}
        for path in (self.logfile, self.logfile.with_name("stderr.log")):
            try:
                text = path.read_text(errors="replace")
            except OSError as exc:
                text = f"({exc})"
            if text not in texts.values():  # both hold the same lines once it runs
                texts[path.name] = text
        return "\n".join(f"--- {name}\n{text}" for name, text in texts.items())


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _port_open(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2):
        return True
    return False


def _ini(*, port: int, directory: Path, server: dict[str, Any]) -> str:
    host = server.get("host", "127.0.0.1")
    backend = f"host={host} port={server.get('port', 5432)} user={server.get('user', 'postgres')}"
    return f"""\
[databases]
{server["dbname"]} = {backend} dbname={server["dbname"]}
* = {backend}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {port}
unix_socket_dir =
auth_type = trust
auth_file = {directory / "userlist.txt"}
admin_users = postgres
stats_users = postgres
pool_mode = transaction
default_pool_size = {POOL_SIZE}
min_pool_size = 0
reserve_pool_size = 0
max_client_conn = 500
max_db_connections = {POOL_SIZE}
logfile = {directory / "pgbouncer.log"}
pidfile = {directory / "pgbouncer.pid"}
log_connections = 0
log_disconnections = 0
verbose = 0
"""


def _stop(process: subprocess.Popen[bytes]) -> None:
    """Stop PgBouncer by its PID: SIGTERM (immediate shutdown), then SIGKILL."""
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(process.pid, signal.SIGTERM)
    try:
        process.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGKILL)
        process.wait(STOP_TIMEOUT_S)


@contextlib.contextmanager
def run_pgbouncer(server_dsn: str) -> Iterator[PgBouncer]:
    """Run PgBouncer in transaction mode in front of ``server_dsn``'s database."""
    binary = shutil.which("pgbouncer") or shutil.which("/usr/sbin/pgbouncer")
    if binary is None:
        pytest.fail(f"pgbouncer is not installed; {INSTALL_HINT}", pytrace=False)
    server = psycopg.conninfo.conninfo_to_dict(server_dsn)
    as_root = os.geteuid() == 0
    directory = Path(tempfile.mkdtemp(prefix="runcell-pgbouncer-"))
    process: subprocess.Popen[bytes] | None = None
    try:
        port = _free_port()
        (directory / "userlist.txt").write_text('"postgres" ""\n')
        (directory / "pgbouncer.ini").write_text(
            _ini(port=port, directory=directory, server=server)
        )
        user: dict[str, Any] = {}
        if as_root:
            try:
                account = pwd.getpwnam(RUN_AS)
            except KeyError:
                pytest.fail(f"pgbouncer refuses to run as root and there is no {RUN_AS!r} user")
            for path in (directory, *directory.iterdir()):
                os.chown(path, account.pw_uid, account.pw_gid)
            user = {"user": account.pw_uid, "group": account.pw_gid, "extra_groups": []}
        with open(directory / "stderr.log", "wb") as stderr:
            process = subprocess.Popen(
                [binary, str(directory / "pgbouncer.ini")],
                stdin=subprocess.DEVNULL,
                stdout=stderr,
                stderr=stderr,
                start_new_session=True,
                cwd=directory,
                **user,
            )
        dsn = psycopg.conninfo.make_conninfo(
            host="127.0.0.1", port=port, user="postgres", dbname=server["dbname"]
        )
        bouncer = PgBouncer(
            pid=process.pid,
            port=port,
            dsn=dsn,
            admin_dsn=psycopg.conninfo.make_conninfo(dsn, dbname="pgbouncer"),
            logfile=directory / "pgbouncer.log",
        )
        _wait_until_serving(process, bouncer)
        yield bouncer
    finally:
        if process is not None:
            _stop(process)
        shutil.rmtree(directory, ignore_errors=True)


def _wait_until_serving(process: subprocess.Popen[bytes], bouncer: PgBouncer) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not _port_open(bouncer.port):
        if process.poll() is not None:
            pytest.fail(
                f"pgbouncer exited with status {process.returncode} at start:\n{bouncer.log()}",
                pytrace=False,
            )
        if time.monotonic() > deadline:
            pytest.fail(
                f"pgbouncer did not listen on 127.0.0.1:{bouncer.port} within "
                f"{START_TIMEOUT_S:g} s:\n{bouncer.log()}",
                pytrace=False,
            )
        time.sleep(0.05)
    try:
        with psycopg.connect(bouncer.dsn, connect_timeout=5) as conn:
            conn.execute("SELECT 1")
    except psycopg.Error as exc:
        pytest.fail(
            f"pgbouncer listens on {bouncer.port} but cannot reach the database: {exc}\n"
            f"{bouncer.log()}",
            pytrace=False,
        )


@pytest.fixture(scope="module")
def pgbouncer_server(pg_dsn: str) -> Iterator[PgBouncer]:
    """PgBouncer in transaction mode in front of the module's database."""
    with run_pgbouncer(pg_dsn) as bouncer:
        yield bouncer


@pytest.fixture(scope="module")
def pgbouncer_dsn(pgbouncer_server: PgBouncer) -> str:
    """The module database's DSN through PgBouncer (transaction mode)."""
    return pgbouncer_server.dsn
