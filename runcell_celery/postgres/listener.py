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
import os
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from typing import Any

import psycopg

from . import statements
from .connection import Database

__all__ = ["GrantListener", "get_listener"]

logger = logging.getLogger("runcell_celery.postgres.listener")

SELF_CHECK_PREFIX = "?self-check "
SELF_CHECK_TIMEOUT_S = 2.0
RECONNECT_DELAY_S = (0.1, 0.5, 1.0, 2.0, 5.0)
HEALTH_CHECK_S = 5.0

Wake = Callable[[], None]


class GrantListener:
    """Listens on ``runcell_grant`` for one database and wakes registered waiters."""

    def __init__(self, database: Database) -> None:
        self._database = database
        self._waiters: dict[str, Wake] = {}
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._stop = threading.Event()
        #: ``True`` once notifications proved to arrive; ``False`` if they cannot.
        self.available: bool | None = None
        #: Set while the listening connection is up: no notification can be missed.
        self.connected = threading.Event()
        #: Called with (limiter, request ids) for grants to parked requests (lines
        #: ``!request_id``), whose task messages must be re-published.
        self.parked_handlers: list[Callable[[str, list[str]], None]] = []
        self._thread = threading.Thread(
            target=_listen_forever, args=(weakref.ref(self),), name="runcell-listener", daemon=True
        )
        self._thread.start()

    def register(self, request_id: str, wake: Wake) -> None:
        with self._lock:
            self._waiters[request_id] = wake

    def unregister(self, request_id: str) -> None:
        with self._lock:
            self._waiters.pop(request_id, None)

    def wait_ready(self, timeout: float) -> bool | None:
        """Wait until the self-check decided; return :attr:`available`."""
        self._ready.wait(timeout)
        return self.available

    def stop(self) -> None:
        self._stop.set()

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

    def _session(self) -> None:
        """One connection's life: connect, LISTEN, self-check, then dispatch until error."""
        conn = self._database.direct_connection(connect_timeout=5)
        try:
            conn.execute(statements.LISTEN)
            nonce = SELF_CHECK_PREFIX + uuid.uuid4().hex
            # Not from this connection: behind a transaction pooler its NOTIFY can run
            # on the server connection that ran LISTEN and come back in the reply,
            # while nothing reaches this connection between its own statements.
            with self._database.direct_connection(connect_timeout=5) as other:
                other.execute(statements.NOTIFY_SELF_CHECK, {"payload": nonce})
            if not self._self_check(conn, nonce):
                logger.warning(
                    "runcell: LISTEN on %s receives no notifications (a transaction pooler?); "
                    "waiters will poll only",
                    _redacted(self._database.conninfo),
                )
                self.available = False
                self._ready.set()
                self._stop.set()
                return
            self.available = True
            self._ready.set()
            self.connected.set()
            # Grants made while we were away were announced to nobody: let every
            # waiter poll now.
            self.wake_all()
            checked_at = time.monotonic()
            while not self._stop.is_set():
                for notify in conn.notifies(timeout=1.0):
                    if not notify.payload.startswith(SELF_CHECK_PREFIX):
                        self.dispatch(notify.payload)
                if time.monotonic() - checked_at > HEALTH_CHECK_S:
                    # A connection lost without a reset would otherwise look quiet.
                    conn.execute("SELECT 1")
                    checked_at = time.monotonic()
        finally:
            self.connected.clear()
            conn.close()

    def _self_check(self, conn: psycopg.Connection[Any], nonce: str) -> bool:
        for notify in conn.notifies(timeout=SELF_CHECK_TIMEOUT_S):
            if notify.payload == nonce:
                return True
        return False


def _redacted(conninfo: str) -> str:
    try:
        params = psycopg.conninfo.conninfo_to_dict(conninfo)
    except psycopg.ProgrammingError:
        return "the database"
    return (
        f"{params.get('host', 'localhost')}:{params.get('port', 5432)}/{params.get('dbname', '')}"
    )


def _listen_forever(listener_ref: weakref.ref[GrantListener]) -> None:
    failures = 0
    while True:
        listener = listener_ref()
        if listener is None or listener._stop.is_set():
            return
        try:
            listener._session()
            failures = 0
        except Exception as exc:  # reconnect: waiters poll in the meantime
            delay = RECONNECT_DELAY_S[min(failures, len(RECONNECT_DELAY_S) - 1)]
            failures += 1
            logger.info("runcell listener disconnected (%s); retrying in %.1fs", exc, delay)
            if listener.available is None:
                listener._ready.set()
            stop = listener._stop
            del listener
            if stop.wait(delay):
                return
            continue
        del listener


_listeners: dict[tuple[int, str], GrantListener] = {}
_listeners_lock = threading.Lock()


def get_listener(database: Database) -> GrantListener:
    """Return this process's listener for ``database``, starting it on first use."""
    key = (os.getpid(), database.conninfo)
    with _listeners_lock:
        listener = _listeners.get(key)
        if listener is None:
            listener = GrantListener(database)
            _listeners[key] = listener
        return listener


_inherited: list[GrantListener] = []


def _after_fork_in_child() -> None:
    # The parent's listener threads do not exist here. Keep the objects alive so their
    # connections (the parent's sockets) are never closed from this process.
    global _listeners_lock
    _inherited.extend(_listeners.values())
    _listeners.clear()
    _listeners_lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)
