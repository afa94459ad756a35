"""Revoking a root run cancels its waiting children, on every worker.

Celery's ``revoke`` reaches only the workers' main processes, so each copies its
revoked set into the backend's :class:`~runcell_celery.ports.RevocationStore`
(:class:`RevocationPublisher`), and every process running tasks watches its runs'
roots and parents there (:class:`RevocationWatcher`) and cancels them.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable, Iterable

from ..background import BackgroundLoop, ProcessLocal
from ..cancellation import CancellationToken
from ..ports import RevocationStore

__all__ = ["RevocationPublisher", "RevocationWatcher"]

logger = logging.getLogger("runcell_celery.celery.revocation")

CHECK_INTERVAL_S = 0.5
#: Revocations older than this are purged (no child waits that long for a root).
KEEP_MS = 24 * 3600 * 1000
#: The publisher purges old revocations every this many rounds (about hourly).
PURGE_EVERY_N_CHECKS = 7200


class _Watched:
    def __init__(self, owner: RevocationWatcher) -> None:
        self.lock = threading.Lock()
        self.runs: dict[int, tuple[frozenset[str], CancellationToken]] = {}
        self.keys = itertools.count()
        self.loop = BackgroundLoop("runcell-revocation-watcher", owner, RevocationWatcher._step)


class RevocationWatcher:
    """Cancels the tokens of this process's runs whose root or parent gets revoked
    (nothing is watched unless ``store()`` is a RevocationStore)."""

    def __init__(self, store: Callable[[], object]) -> None:
        self._store = store
        self._local: ProcessLocal[_Watched] = ProcessLocal(lambda: _Watched(self))

    def store(self) -> RevocationStore | None:
        store = self._store()
        return store if isinstance(store, RevocationStore) else None

    def watch(self, run_ids: Iterable[str], token: CancellationToken) -> Callable[[], None]:
        """Cancel ``token`` if any of ``run_ids`` is revoked; returns an unwatch function."""
        ids = frozenset(run_id for run_id in run_ids if run_id)
        if not ids:
            return lambda: None
        watched = self._local.get()
        with watched.lock:
            key = next(watched.keys)
            watched.runs[key] = (ids, token)
        watched.loop.start()

        def unwatch() -> None:
            with watched.lock:
                watched.runs.pop(key, None)

        return unwatch

    def check(self) -> int:
        """Look now; return how many runs were cancelled."""
        watched = self._local.peek()
        if watched is None:
            return 0
        with watched.lock:
            runs = list(watched.runs.values())
        store = self.store() if runs else None
        if store is None:
            return 0
        revoked = store.revoked_among(set().union(*(ids for ids, _ in runs)))
        cancelled = 0
        for ids, token in runs:
            if ids & revoked and not token.is_set():
                token.cancel("a parent run was revoked")
                cancelled += 1
        return cancelled

    def _step(self) -> float:
        try:
            self.check()
        except Exception as exc:  # the next look may work; waits keep their deadlines
            logger.warning("runcell: checking revocations failed: %s", exc)
        return CHECK_INTERVAL_S


class RevocationPublisher:
    """Copies a worker's revoked task ids (``revoked()``) into the store."""

    def __init__(self, store: RevocationStore, revoked: Callable[[], Iterable[str]]) -> None:
        self._store = store
        self._revoked = revoked
        self._seen: set[str] = set()
        self._rounds = 0
        self._loop = BackgroundLoop("runcell-revocation-publisher", self, RevocationPublisher._step)

    def start(self) -> None:
        self._loop.start()

    def stop(self, timeout: float | None = None) -> None:
        self._loop.stop(timeout)

    def publish(self) -> int:
        new = [run_id for run_id in self._revoked() if run_id not in self._seen]
        if not new:
            return 0
        self._store.add_revoked(new)
        self._seen.update(new)
        return len(new)

    def _step(self) -> float:
        try:
            self.publish()
            self._rounds += 1
            if self._rounds % PURGE_EVERY_N_CHECKS == 0:
                self._store.purge_revoked(KEEP_MS)
        except Exception as exc:
            logger.warning("runcell: publishing revocations failed: %s", exc)
        return CHECK_INTERVAL_S
