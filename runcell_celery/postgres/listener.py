"""Wake-ups by ``LISTEN/NOTIFY``: one listener connection per process serves all waiters.

When an allocation grants a slot to a request that waits in another process, the
granting transaction sends ``NOTIFY runcell_grant`` with the limiter name and the
granted request ids. This module keeps one direct (non-pooled) autocommit connection
per process and database listening on that channel (thread ``runcell-listener``) and
wakes exactly the local waiters whose request ids it names.

Polling is never switched off: notifications sent while the listener is disconnected
are lost. While it is connected, waiters poll ten times less often (a safety net);
while it is not, at the full ``poll_interval_ms``, and when it reconnects it wakes
every waiter to poll at once. Behind a transaction pooler ``LISTEN`` silently receives nothing,
so the listener checks itself at start by notifying its channel from a second
connection, as grants are sent; if that notification does not arrive it gives up and
waiters rely on polling alone.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import psycopg

from ..background import BackgroundLoop, ProcessLocal
from . import statements
from .connection import Database, redacted

__all__ = ["GrantListener", "get_listener"]

logger = logging.getLogger("runcell_celery.postgres.listener")

SELF_CHECK_PREFIX = "?self-check "
SELF_CHECK_TIMEOUT_S = 2.0
RECONNECT_DELAY_S = (0.1, 0.5, 1.0, 2.0, 5.0)
HEALTH_CHECK_S = 5.0
#: How long one step waits for notifications before checking whether to stop.
NOTIFIES_TIMEOUT_S = 1.0

Wake = Callable[[], None]


class GrantListener:
    """Listens on ``runcell_grant`` for one database and wakes registered waiters.

    Its thread (``runcell-listener``) is a :class:`~runcell_celery.background.BackgroundLoop`
    whose step either (re)connects or dispatches the notifications of one second.
    """

    def __init__(self, database: Database) -> None:
        self._database = database
        self._waiters: dict[str, Wake] = {}
        self._lock = threading.Lock()
        self._conn: psycopg.Connection[Any] | None = None
        self._failures = 0
        self._checked_at = 0.0
        #: ``True`` once notifications proved to arrive; ``False`` if they cannot.
        self.available: bool | None = None
        #: Set while the listening connection is up: no notification can be missed.
        self.connected = threading.Event()
        #: Called with (limiter, request ids) for grants to parked requests (lines
        #: ``!request_id``), whose task messages must be re-published.
        self.parked_handlers: list[Callable[[str, list[str]], None]] = []
        self._loop = BackgroundLoop("runcell-listener", self, GrantListener._step)
        self._loop.start()

    def register(self, request_id: str, wake: Wake) -> None:
        with self._lock:
            self._waiters[request_id] = wake

    def unregister(self, request_id: str) -> None:
        with self._lock:
            self._waiters.pop(request_id, None)

    def stop(self) -> None:
        """End the thread (after its current step) and close the listening connection."""
        self._loop.stop(timeout=NOTIFIES_TIMEOUT_S + SELF_CHECK_TIMEOUT_S + 5)
        if not self._loop.running:
            self._disconnect()

    def wake_all(self) -> None:
        with self._lock:
            wakes = list(self._waiters.values())
        for wake in wakes:
            wake()

    def dispatch(self, payload: str) -> None:
        """Wake the waiters named in a ``runcell_grant`` payload (limiter, then ids)."""
        limiter, _, ids = payload.partition("\n")
        lines = ids.split("\n")
        parked = [line[1:] for line in lines if line.startswith("!")]
        with self._lock:
            wakes = [self._waiters.get(line) for line in lines if not line.startswith("!")]
        for wake in wakes:
            if wake is not None:
                wake()
        if parked:
            for handler in list(self.parked_handlers):
                try:
                    handler(limiter, parked)
                except Exception:
                    logger.exception("runcell: a parked-grant handler failed")

    def _step(self) -> float | None:
        """Connect if needed, else dispatch what arrives within a second.

        :returns: the pause before the next step (a back-off after a failure), or
            ``None`` once ``LISTEN`` proved useless here (waiters then poll only).
        """
        try:
            if self._conn is None:
                return self._connect()
            self._listen_once(self._conn)
        except Exception as exc:  # reconnect: waiters poll in the meantime
            self._disconnect()
            if self.available is False:
                return None
            delay = RECONNECT_DELAY_S[min(self._failures, len(RECONNECT_DELAY_S) - 1)]
            self._failures += 1
            logger.info("runcell listener disconnected (%s); retrying in %.1fs", exc, delay)
            return delay
        return 0

    def _connect(self) -> float | None:
        """Connect, LISTEN and check that notifications from other sessions arrive."""
        conn = self._database.direct_connection(connect_timeout=5)
        try:
            conn.execute(statements.LISTEN)
            nonce = SELF_CHECK_PREFIX + uuid.uuid4().hex
            # Not from this connection: behind a transaction pooler its NOTIFY can run
            # on the server connection that ran LISTEN and come back in the reply,
            # while nothing reaches this connection between its own statements.
            with self._database.direct_connection(connect_timeout=5) as other:
                other.execute(statements.NOTIFY_SELF_CHECK, {"payload": nonce})
            arrived = self._self_check(conn, nonce)
        except BaseException:
            conn.close()
            raise
        if not arrived:
            conn.close()
            logger.warning(
                "runcell: LISTEN on %s receives no notifications (a transaction pooler?); "
                "waiters will poll only",
                redacted(self._database.conninfo),
            )
            self.available = False
            return None
        self._conn = conn
        self._failures = 0
        self._checked_at = time.monotonic()
        self.available = True
        self.connected.set()
        # Grants made while we were away were announced to nobody: let every
        # waiter poll now.
        self.wake_all()
        return 0

    def _listen_once(self, conn: psycopg.Connection[Any]) -> None:
        for notify in conn.notifies(timeout=NOTIFIES_TIMEOUT_S):
            if not notify.payload.startswith(SELF_CHECK_PREFIX):
                self.dispatch(notify.payload)
        if time.monotonic() - self._checked_at > HEALTH_CHECK_S:
            # A connection lost without a reset would otherwise look quiet.
            conn.execute("SELECT 1")
            self._checked_at = time.monotonic()

    def _disconnect(self) -> None:
        self.connected.clear()
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def _self_check(self, conn: psycopg.Connection[Any], nonce: str) -> bool:
        for notify in conn.notifies(timeout=SELF_CHECK_TIMEOUT_S):
            if notify.payload == nonce:
                return True
        return False


class _Listeners:
    """This process's listeners, one per database."""

    def __init__(self) -> None:
        self.by_conninfo: dict[str, GrantListener] = {}
        self.lock = threading.Lock()


_listeners: ProcessLocal[_Listeners] = ProcessLocal(_Listeners)


def get_listener(database: Database) -> GrantListener:
    """Return this process's listener for ``database``, starting it on first use."""
    listeners = _listeners.get()
    with listeners.lock:
        listener = listeners.by_conninfo.get(database.conninfo)
        if listener is None:
            listener = listeners.by_conninfo[database.conninfo] = GrantListener(database)
        return listener
