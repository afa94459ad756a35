"""The processes the demo starts: each in a session of its own, tracked by PID, stopped on exit.

Every process is started with ``start_new_session=True`` (so a Ctrl-C in the terminal
reaches only the demo, which then stops them in order) and recorded in
``state.json`` with its start time, which tells it apart from a later process that
reuses the PID. Stopping sends the process its stop signal, waits, then kills its
process group (the group is the demo's: its ID is the PID of a process it started).
A demo that was killed outright leaves a state file behind; the next run stops what
it lists, after checking each start time. Nothing else is ever signalled.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from .paths import Paths

__all__ = ["AlreadyRunningError", "Processes", "Started", "lock_demo"]

#: Stop order: the fleet (workers, web server, provider) first, then the servers it uses.
FLEET, SERVICES = 1, 0


class AlreadyRunningError(RuntimeError):
    """Another ``./demo`` holds this demo home's lock."""


def lock_demo(paths: Paths) -> IO[str]:
    """Take the demo's lock for this process's lifetime, or raise ``AlreadyRunningError``."""
    handle = open(paths.lock, "a+")  # noqa: SIM115 - held until the process exits
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        owner = handle.read().strip() or "?"
        handle.close()
        raise AlreadyRunningError(
            f"another ./demo (pid {owner}) is running with {paths.home}; stop it first"
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(str(os.getpid()))
    handle.flush()
    return handle


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (``None`` if it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # Fields after the command name, which may itself hold spaces and parentheses.
    return int(stat.rsplit(")", 1)[1].split()[19])


@dataclass
class Started:
    """A process the demo started (what ``state.json`` lists)."""

    name: str
    pid: int
    start_time: int | None
    tier: int
    stop_signal: int = signal.SIGTERM
    log: str | None = None
    popen: subprocess.Popen[bytes] | None = field(default=None, repr=False, compare=False)

    def is_ours(self) -> bool:
        """Still running, and still the process we started (not a reused PID)."""
        if self.popen is not None:
            return self.popen.poll() is None
        return self.start_time is not None and start_time(self.pid) == self.start_time

    def to_json(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in self.__dataclass_fields__ if f != "popen"}


class Processes:
    """Start, record and stop the demo's processes."""

    def __init__(self, paths: Paths) -> None:
        self.paths = paths
        self.started: list[Started] = []
        self.extra: dict[str, Any] = {}

    # -- starting ---------------------------------------------------------------------

    def start(
        self,
        name: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        tier: int = FLEET,
        stop_signal: int = signal.SIGTERM,
        user: int | None = None,
        group: int | None = None,
        stdout_pipe: bool = False,
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` in a new session, its output in ``logs/<name>.log``."""
        log_path = self.paths.logs / f"{name}.log"
        with open(log_path, "ab") as log:
            kwargs: dict[str, Any] = {}
            if user is not None:
                kwargs.update(user=user, group=group, extra_groups=[])
            popen = subprocess.Popen(
                list(argv),
                cwd=cwd,
                env=dict(env) if env is not None else None,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE if stdout_pipe else log,
                stderr=log,
                start_new_session=True,
                **kwargs,
            )
        record = Started(
            name=name,
            pid=popen.pid,
            start_time=start_time(popen.pid),
            tier=tier,
            stop_signal=int(stop_signal),
            log=str(log_path),
            popen=popen,
        )
        self.started.append(record)
        self.save()
        return popen

    def run(
        self,
        name: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        timeout: float = 300,
        user: int | None = None,
        group: int | None = None,
    ) -> None:
        """Run a short command to its end (tracked meanwhile); raise if it fails."""
        popen = self.start(name, argv, env=env, cwd=cwd, user=user, group=group)
        try:
            code = popen.wait(timeout)
        finally:
            self.stop([r for r in self.started if r.popen is popen])
        if code != 0:
            log = self.paths.logs / f"{name}.log"
            tail = log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{' '.join(argv)} failed (exit {code}); {log}:\n{tail}")

    # -- the state file -------------------------------------------------------------------

    def save(self) -> None:
        data = {
            "demo_pid": os.getpid(),
            "demo_start_time": start_time(os.getpid()),
            "processes": [r.to_json() for r in self.started],
            **self.extra,
        }
        tmp = self.paths.state.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=2))
        tmp.replace(self.paths.state)

    def reap_leftovers(self) -> list[str]:
        """Stop processes an earlier run listed but never stopped (it was killed)."""
        try:
            data = json.loads(self.paths.state.read_text())
        except (OSError, ValueError):
            return []
        records = [
            Started(**{k: v for k, v in item.items() if k in Started.__dataclass_fields__})
            for item in data.get("processes", [])
        ]
        left = [r for r in records if r.is_ours()]
        self.stop(left)
        self.paths.state.unlink(missing_ok=True)
        return [f"{r.name} (pid {r.pid})" for r in left]

    # -- stopping -------------------------------------------------------------------------

    def stop_all(self, timeout: float = 15) -> None:
        """Stop everything started, the fleet first, then the servers it used."""
        for tier in (FLEET, SERVICES):
            self.stop([r for r in self.started if r.tier == tier], timeout=timeout)
        self.started.clear()
        self.paths.state.unlink(missing_ok=True)

    def stop(self, records: Sequence[Started], timeout: float = 15) -> None:
        """Signal each process, wait up to ``timeout``, then kill its process group."""
        for record in records:
            if record.is_ours():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(record.pid, record.stop_signal)
        deadline = time.monotonic() + timeout
        for record in records:
            while record.is_ours() and time.monotonic() < deadline:
                time.sleep(0.05)
            if record.is_ours():
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(record.pid, signal.SIGKILL)
                if record.popen is not None:
                    record.popen.wait(10)
            # Leftover members of its group (a worker's pool processes): the group ID is
            # the PID we started, which the kernel does not reuse while the group exists.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(record.pid, signal.SIGKILL)
        gone = {id(r) for r in records}
        self.started = [r for r in self.started if id(r) not in gone]
        self.save()
