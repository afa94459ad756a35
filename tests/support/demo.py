"""Run ``./demo`` from tests: a home, a database and queues of each run's own.

``demo_environment`` gives a run its own ``RUNCELL_DEMO_HOME`` (a directory every
user may traverse: as root the embedded PostgreSQL runs as another user), its own
Celery queue names, and by default its own database on the test server; the caller
may point the services elsewhere. ``private_checkout`` is the other case: a copy of the
checkout, with a virtualenv of its own, inside a directory only its owner may enter.
``DemoProcess`` starts ``./demo`` in a session of its own, reads its output line by line
and knows the processes it recorded.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.support.pg import create_database, drop_database

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "demo"


@contextlib.contextmanager
def demo_environment(*, own_database: bool = True) -> Iterator[dict[str, str]]:
    """Environment variables for one ``./demo`` run; its files are removed afterwards."""
    home = Path(tempfile.mkdtemp(prefix="runcell-demo-test-"))
    home.chmod(0o755)
    tag = uuid.uuid4().hex[:8]
    env = {
        **os.environ,
        "RUNCELL_DEMO_HOME": str(home),
        "RUNCELL_DEMO_QUEUE_PREFIX": f"runcell-demo-test-{tag}",
        "PYTHONUNBUFFERED": "1",
    }
    database = create_database("runcell_demo_test") if own_database else None
    if database is not None:
        env["RUNCELL_DEMO_DATABASE_URL"] = database
    try:
        yield env
    finally:
        if database is not None:
            drop_database(database)
        shutil.rmtree(home, ignore_errors=True)


@contextlib.contextmanager
def private_checkout() -> Iterator[tuple[Path, dict[str, str]]]:
    """A fresh copy of the checkout (its tracked files, as a clone has them) inside a
    0700 temporary directory, and the environment for running its ``./demo``.

    Its ``.venv`` (``RUNCELL_VENV``) lies inside too, and holds its own copy of the
    ``pgserver`` package, so the embedded PostgreSQL's binaries are out of reach of any
    other user, as in a clone under ``/root``; the other packages come from this
    checkout's virtualenv (a ``.pth`` line), so nothing is downloaded. The demo's files
    are in the copy's ``.runcell/``, its default. Everything is removed afterwards.
    """
    outer = Path(tempfile.mkdtemp(prefix="runcell-private-"))  # mode 0700
    checkout = outer / "runcell_celery"
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
        ).stdout
        for name in filter(None, listed.decode().split("\0")):
            source = ROOT / name
            if source.is_file():
                (checkout / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source, checkout / name)
        venv = checkout / ".venv"
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
        site_packages = Path(
            sysconfig.get_path("purelib", vars={"base": str(venv), "platbase": str(venv)})
        )
        ours = Path(sysconfig.get_path("purelib"))
        for package in ("pgserver", "pgserver.libs"):  # the binaries load the libs
            shutil.copytree(ours / package, site_packages / package, symlinks=True)
        (site_packages / "runcell-checkout.pth").write_text(
            f"import site; site.addsitedir({str(ours)!r})\n"
        )
        # ./demo installs the package when this stamp differs from pyproject.toml's cksum.
        cksum = subprocess.run(
            ["cksum", str(checkout / "pyproject.toml")], capture_output=True, text=True, check=True
        )
        (venv / ".runcell-demo-installed").write_text(cksum.stdout.split()[0] + "\n")
        env = {
            key: value for key, value in os.environ.items() if not key.startswith("RUNCELL_DEMO_")
        }
        env.update(
            RUNCELL_VENV=str(venv),
            RUNCELL_DEMO_QUEUE_PREFIX=f"runcell-demo-test-{uuid.uuid4().hex[:8]}",
            PYTHONUNBUFFERED="1",
        )
        yield checkout, env
    finally:
        shutil.rmtree(outer, ignore_errors=True)


def run_demo(
    args: list[str], env: dict[str, str], timeout: float = 240, demo: Path = DEMO
) -> tuple[int, str]:
    """Run ``./demo ARGS`` (of this checkout, or ``demo``) to its end; return its exit
    code and output."""
    done = subprocess.run(
        [str(demo), *args],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        timeout=timeout,
        check=False,
    )
    return done.returncode, done.stdout.decode(errors="replace")


def summary(env: dict[str, str]) -> dict[str, Any]:
    """The summary the last run wrote (``summary.json`` in its home)."""
    data: dict[str, Any] = json.loads((Path(env["RUNCELL_DEMO_HOME"]) / "summary.json").read_text())
    return data


class DemoProcess:
    """``./demo`` running in the background (serving), its output collected."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        self.env = env
        self.home = Path(env["RUNCELL_DEMO_HOME"])
        self.popen = subprocess.Popen(
            [str(DEMO), *args],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # like a terminal's job: Ctrl-C reaches the demo only
        )
        self._lines: list[str] = []
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for raw in self.popen.stdout:
            with self._cond:
                self._lines.append(raw.decode(errors="replace").rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    @property
    def output(self) -> str:
        with self._cond:
            return "\n".join(self._lines)

    def wait_for_line(self, prefix: str, timeout: float = 180) -> str:
        """Return the first output line starting with ``prefix`` (fail if it never comes)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for line in self._lines:
                    if line.strip().startswith(prefix):
                        return line.strip()
                left = deadline - time.monotonic()
                if left <= 0 or (self.popen.poll() is not None and not self._reader.is_alive()):
                    raise AssertionError(f"./demo never printed {prefix!r}:\n{self.output}")
                self._cond.wait(min(left, 0.5))

    def state(self) -> dict[str, Any]:
        """The demo's state file: the processes it started, the admin URL and login."""
        data: dict[str, Any] = json.loads((self.home / "state.json").read_text())
        return data

    def interrupt(self, timeout: float = 60) -> int:
        """Send SIGINT (a terminal's Ctrl-C) and wait for the demo to exit."""
        os.kill(self.popen.pid, signal.SIGINT)
        code = self.popen.wait(timeout)
        self._reader.join(5)
        return code

    def kill(self) -> None:
        """Last resort when a test failed midway: stop the demo and its process groups."""
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(40)
            except subprocess.TimeoutExpired:
                os.kill(self.popen.pid, signal.SIGKILL)
                self.popen.wait(10)


def process_groups(pids: list[int]) -> list[int]:
    """Every live process whose process group is one of ``pids`` (the demo's children)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        state, pgid = fields[0], int(fields[2])
        if pgid in pids and state != "Z":
            found.append(int(entry.name))
    return found


def processes_mentioning(text: str) -> list[str]:
    """Command lines of live processes that contain ``text``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if text in cmdline:
            found.append(f"{entry.name}: {cmdline}")
    return found
