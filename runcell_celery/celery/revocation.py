"""Revoking a root run cancels its waiting children, on every worker.

Celery broadcasts ``revoke`` to every worker's main process, which only stops that
task id. A child task waiting for a slot in a pool process of another worker never
hears of it. So each worker's main process copies its revoked set into the
``runcell_revoked`` table (:class:`RevocationPublisher`), and every process running
tasks watches the roots and parents of its runs there (:class:`RevocationWatcher`):
a run whose root (or parent) was revoked is cancelled — its wait stops with
``wait-cancelled``, a slot it holds is aborted and released as cancelled.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Callable, Iterable

from ..cancellation import CancellationToken
from ..postgres import statements
from ..postgres.connection import Database, fetch_all

__all__ = ["RevocationPublisher", "RevocationWatcher", "revoked_among"]

logger = logging.getLogger("runcell_celery.celery.revocation")

CHECK_INTERVAL_S = 0.5
#: Revocations older than this are purged (no child waits that long for a root).
KEEP_MS = 24 * 3600 * 1000


def revoked_among(database: Database, run_ids: Iterable[str]) -> set[str]:
    """Return which of ``run_ids`` were revoked."""
    ids = [run_id for run_id in run_ids if run_id]
    if not ids:
        return set()
    with database.connection() as conn:
        return {row[0] for row in fetch_all(conn, statements.REVOKED_AMONG, {"run_ids": ids})}


class RevocationWatcher:
    """Cancels the tokens of this process's runs whose root or parent gets revoked."""

    def __init__(self, database_factory: Callable[[], Database | None]) -> None:
        self._database_factory = database_factory
        self._lock = threading.Lock()
        self._watched: dict[int, tuple[frozenset[str], CancellationToken]] = {}
        self._next = 0
        self._thread: threading.Thread | None = None
        self._pid: int | None = None

    def watch(self, run_ids: Iterable[str], token: CancellationToken) -> Callable[[], None]:
        """Cancel ``token`` if any of ``run_ids`` is revoked; returns an unwatch function."""
        ids = frozenset(run_id for run_id in run_ids if run_id)
        if not ids:
            return lambda: None
        with self._lock:
            key = self._next
            self._next += 1
            self._watched[key] = (ids, token)
            self._ensure_thread_locked()
        return lambda: self._unwatch(key)

    def _unwatch(self, key: int) -> None:
        with self._lock:
            self._watched.pop(key, None)

    def check(self) -> int:
        """Look now; return how many runs were cancelled."""
        with self._lock:
            watched = list(self._watched.values())
        if not watched:
            return 0
        database = self._database_factory()
        if database is None:
            return 0
        revoked = revoked_among(database, set().union(*(ids for ids, _ in watched)))
        cancelled = 0
        for ids, token in watched:
            if ids & revoked and not token.is_set():
                token.cancel("a parent run was revoked")
                cancelled += 1
        return cancelled

    def _ensure_thread_locked(self) -> None:
        if self._thread is not None and self._pid == os.getpid():
            return
        self._pid = os.getpid()
        self._thread = threading.Thread(
            target=_watch_forever,
            args=(weakref.ref(self),),
            name="runcell-revocation-watcher",
            daemon=True,
        )
        self._thread.start()


def _watch_forever(ref: weakref.ref[RevocationWatcher]) -> None:
    stop = threading.Event()
    while not stop.wait(CHECK_INTERVAL_S):
        watcher = ref()
        if watcher is None:
            return
        try:
            watcher.check()
        except Exception as exc:  # the next look may work; waits keep their deadlines
            logger.warning("runcell: checking revocations failed: %s", exc)
        del watcher


class RevocationPublisher:
    """Copies a worker's revoked task ids into ``runcell_revoked`` (worker main process)."""

    def __init__(self, database: Database, revoked: Callable[[], Iterable[str]]) -> None:
        self._database = database
        self._revoked = revoked
        self._seen: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="runcell-revocation-publisher", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def publish(self) -> int:
        """Write revocations not written yet; return how many."""
        new = [run_id for run_id in self._revoked() if run_id not in self._seen]
        if not new:
            return 0
        with self._database.connection() as conn:
            fetch_all(conn, statements.ADD_REVOKED, {"run_ids": new})
        self._seen.update(new)
        return len(new)

    def _run(self) -> None:
        purged_at = 0
        while not self._stop.wait(CHECK_INTERVAL_S):
            try:
                self.publish()
                purged_at += 1
                if purged_at % 7200 == 0:  # about hourly
                    with self._database.connection() as conn:
                        fetch_all(conn, statements.PURGE_REVOKED, {"keep_ms": KEEP_MS})
            except Exception as exc:
                logger.warning("runcell: publishing revocations failed: %s", exc)
