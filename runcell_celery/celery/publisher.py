"""One thread per process sends granted parked tasks to the broker, on its own connection.

Nothing in ``release()`` or a slot's exit waits for the broker: they only hand lease
ids to this process's :class:`GrantPublisher`, which claims them in the database and
publishes them. A publication the broker refused is given back, so the sweeper sends it
again once the broker returns; the database stays the source of truth.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import weakref
from collections.abc import Callable, Sequence

from celery import Celery
from kombu import Connection, Producer

from ..background import BackgroundLoop, ProcessLocal
from ..ports import ParkingStore, Republish
from .brokers import broker_identity

__all__ = ["GrantPublisher"]

logger = logging.getLogger("runcell_celery.celery.publisher")

#: How long the loop waits for work before it looks again (it is woken at once).
IDLE_WAIT_S = 1.0
#: After the broker failed, how long the loop waits before it tries again.
RETRY_AFTER_S = 0.5
#: ``stale_ms`` that matches no grant: only the lease ids asked for are claimed.
_NONE_STALE_MS = 2**31 - 1

#: Publishes claimed grants; returns those the broker did not take (``send_grants``).
Send = Callable[[Celery, Producer, Sequence[Republish]], list[Republish]]


class _Work:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.lease_ids: list[str] = []
        #: The smallest ``stale_ms`` asked for since the last round (``None``: none).
        self.stale_ms: int | None = None
        self.connection: Connection | None = None
        self.broker_down = False


class GrantPublisher:
    """Publishes one app's (held weakly) granted parked tasks from one thread per process."""

    def __init__(self, app: Celery, store: Callable[[], ParkingStore | None], send: Send) -> None:
        self._app = weakref.ref(app)
        self._store = store
        self._send = send
        self._work: ProcessLocal[_Work] = ProcessLocal(_Work)
        self._left_to_others: set[str] = set()
        self._loop: BackgroundLoop[GrantPublisher] = BackgroundLoop(
            "runcell-publisher", self, GrantPublisher._step
        )

    def request(self, lease_ids: Sequence[str] = (), *, stale_ms: int | None = None) -> None:
        """Ask for these grants (and, with ``stale_ms``, any left unpublished that
        long) to be published; return at once, doing no I/O."""
        work = self._work.get()
        with work.lock:
            work.lease_ids.extend(lease_ids)
            if stale_ms is not None:
                work.stale_ms = stale_ms if work.stale_ms is None else min(work.stale_ms, stale_ms)
        work.wake.set()
        if not self._loop.running:
            self._loop.start()

    def stop(self, timeout: float | None = None) -> None:
        self._loop.stop(timeout)
        work = self._work.peek()
        if work is not None:
            work.wake.set()
            self._close(work)

    def _step(self) -> float:
        work = self._work.get()
        work.wake.wait(IDLE_WAIT_S)
        if self._loop.stopping.is_set():
            return 0
        return self.publish_pending()

    def publish_pending(self) -> float:
        """Publish what was asked for so far, on the calling thread; return how soon to
        try again (0: nothing left)."""
        work = self._work.get()
        with work.lock:
            work.wake.clear()
            lease_ids, work.lease_ids = work.lease_ids, []
            stale_ms, work.stale_ms = work.stale_ms, None
        if not lease_ids and stale_ms is None:
            return 0
        app, store = self._app(), self._store()
        if app is None or store is None:
            return 0
        # Grants of tasks parked for another broker are left to that broker's workers.
        others: set[str] = set()
        claimed = store.claim_republish(
            lease_ids,
            stale_ms=_NONE_STALE_MS if stale_ms is None else stale_ms,
            broker=broker_identity(app),
            others=others,
        )
        for broker in sorted(others - self._left_to_others):  # said once per broker
            self._left_to_others.add(broker)
            logger.info(
                "runcell: this limiter database holds tasks parked for another broker "
                "(%s); this worker publishes to %s and leaves them to the workers of theirs",
                broker,
                broker_identity(app),
            )
        if not claimed:
            return 0
        try:
            if work.connection is None:
                work.connection = app.connection_for_write()
            unsent = self._send(app, Producer(work.connection), claimed)
        except Exception as exc:  # no connection at all: nothing was sent
            logger.debug("runcell publisher: no broker connection: %r", exc)
            unsent = list(claimed)
        if not unsent:
            if work.broker_down:
                work.broker_down = False
                logger.warning("runcell: the broker is back; granted parked tasks are sent")
            return 0
        self._close(work)  # a new connection next time
        try:
            store.unclaim_republish(unsent)
        except Exception as exc:  # their claim window ends and they are granted again
            logger.warning("runcell: could not give back unsent publications: %s", exc)
        if not work.broker_down:
            work.broker_down = True
            logger.warning(
                "runcell: the broker is unreachable; %d granted parked task(s) stay "
                "granted and are sent once it is back",
                len(unsent),
            )
        return RETRY_AFTER_S

    def _close(self, work: _Work) -> None:
        connection, work.connection = work.connection, None
        if connection is not None and work is self._work.peek():
            with contextlib.suppress(Exception):  # closing a dead connection may fail
                connection.release()

    def __repr__(self) -> str:
        return f"<GrantPublisher pid={os.getpid()} running={self._loop.running}>"
