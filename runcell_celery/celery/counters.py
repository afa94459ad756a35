"""Admission counters: deliveries, deferrals and failures, counted apart.

Users of other job queues' limiters complain most that an over-limit job "fails" or
burns a retry. Here a deferral is not a failure, and the numbers show it: per task
name and limiter we count

* **deliveries** — times the task started (first delivery, redelivery, re-publication);
* **admission deferrals** — times it was parked because no slot was free;
* **provider attempts** — slots it acquired (one per provider request);
* **provider failures** — slots whose provider call raised;
* **concurrency failures** — runs stopped by a ``ConcurrencyError`` (timeout, full
  queue, limiter down, lost lease, bad workload).

Counts are kept in memory and added to the ``runcell_admission_counter`` table by a
background thread (``runcell-counter-flusher``) about once a second, so the task path
never waits on the database for them; :func:`admission_counts` reads the fleet-wide
totals. A process killed with SIGKILL loses at most its last second of counts.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..events import ConcurrencyEvent
from ..postgres import statements
from ..postgres.connection import Database, fetch_all

__all__ = ["AdmissionCount", "AdmissionCounters", "admission_counts"]

logger = logging.getLogger("runcell_celery.celery.counters")

FLUSH_INTERVAL_S = 1.0
FIELDS = (
    "deliveries",
    "deferrals",
    "provider_attempts",
    "provider_failures",
    "concurrency_failures",
)
_CONCURRENCY_FAILURES = {"timed-out", "queue-full", "limiter-error", "config-error", "lease-lost"}


@dataclass(frozen=True, slots=True)
class AdmissionCount:
    """Fleet-wide counts for one task name and limiter."""

    task_name: str
    limiter: str
    deliveries: int = 0
    deferrals: int = 0
    provider_attempts: int = 0
    provider_failures: int = 0
    concurrency_failures: int = 0


class AdmissionCounters:
    """This process's counts not yet written, and the thread that writes them.

    :param database_factory: returns the database to write to, or ``None`` to keep
        counts in memory only (the in-memory backend).
    """

    def __init__(self, database_factory: Callable[[], Database | None]) -> None:
        self._database_factory = database_factory
        self._lock = threading.Lock()
        self._pending: dict[tuple[str, str], list[int]] = {}
        self._totals: dict[tuple[str, str], list[int]] = {}
        self._flusher: threading.Thread | None = None
        self._flusher_pid: int | None = None
        self._stop = threading.Event()

    def add(self, task_name: str, limiter: str, field: str, n: int = 1) -> None:
        """Count ``n`` of ``field`` for a task and limiter."""
        index = FIELDS.index(field)
        key = (task_name, limiter)
        with self._lock:
            self._pending.setdefault(key, [0] * len(FIELDS))[index] += n
            self._totals.setdefault(key, [0] * len(FIELDS))[index] += n
        self._ensure_flusher()

    def on_event(self, event: ConcurrencyEvent) -> None:
        """Event listener: provider attempts, provider failures, concurrency failures."""
        if event.holder_name is None:
            return
        if event.type == "acquired":
            self.add(event.holder_name, event.limiter, "provider_attempts")
        elif event.type == "released" and event.outcome == "error":
            self.add(event.holder_name, event.limiter, "provider_failures")
        elif event.type in _CONCURRENCY_FAILURES:
            self.add(event.holder_name, event.limiter, "concurrency_failures")

    def local(self) -> list[AdmissionCount]:
        """This process's counts since it started (written or not)."""
        with self._lock:
            items = [(k, list(v)) for k, v in self._totals.items()]
        return [AdmissionCount(task, limiter, *values) for (task, limiter), values in items]

    def flush(self) -> None:
        """Write pending counts now (also done every second in the background)."""
        database = self._database_factory()
        if database is None:
            return
        with self._lock:
            pending, self._pending = self._pending, {}
        if not pending:
            return
        rows = [(task, limiter, *values) for (task, limiter), values in pending.items()]
        columns: dict[str, list[Any]] = {
            name: [row[i] for row in rows]
            for i, name in enumerate(("task_names", "limiters", *FIELDS))
        }
        try:
            with database.connection() as conn:
                fetch_all(conn, statements.ADD_ADMISSION_COUNTS, columns)
        except Exception:
            # Keep them for the next try rather than lose them.
            with self._lock:
                for key, values in pending.items():
                    mine = self._pending.setdefault(key, [0] * len(FIELDS))
                    for i, n in enumerate(values):
                        mine[i] += n
            raise

    def close(self) -> None:
        """Stop the flusher after a last flush (worker shutdown)."""
        self._stop.set()
        try:
            self.flush()
        except Exception:
            logger.exception("runcell: writing the last admission counts failed")

    def _ensure_flusher(self) -> None:
        pid = os.getpid()
        if self._flusher is not None and self._flusher_pid == pid:
            return
        with self._lock:
            if self._flusher is not None and self._flusher_pid == pid:
                return
            if self._flusher_pid is not None and self._flusher_pid != pid:
                # A forked child: the parent's counts are the parent's to write.
                self._pending.clear()
                self._totals.clear()
            self._flusher_pid = pid
            self._flusher = threading.Thread(
                target=_flush_forever,
                args=(weakref.ref(self), self._stop),
                name="runcell-counter-flusher",
                daemon=True,
            )
            self._flusher.start()


def _flush_forever(ref: weakref.ref[AdmissionCounters], stop: threading.Event) -> None:
    while not stop.wait(FLUSH_INTERVAL_S):
        counters = ref()
        if counters is None:
            return
        try:
            counters.flush()
        except Exception as exc:
            logger.warning("runcell: writing admission counts failed (will retry): %s", exc)
        del counters


def admission_counts(database: Database) -> list[AdmissionCount]:
    """Read the fleet-wide counts, per task name and limiter."""
    with database.connection() as conn:
        rows = fetch_all(conn, statements.ADMISSION_COUNTS)
    return [AdmissionCount(*row) for row in rows]
