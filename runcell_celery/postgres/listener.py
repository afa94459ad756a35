"""Wake-ups by ``LISTEN/NOTIFY``: one listener connection per process and database.

A transaction that grants slots notifies each waiting process on its own channel
(``runcell_w_...``) with the leases, and grants to parked tasks on ``runcell_parked``.
The listener (thread ``runcell-listener``, one direct autocommit connection) hands each
payload to its owner. Notifications sent while it is away are lost, so the waiting room
keeps a safety poll and looks at once on reconnect; behind a transaction pooler
``LISTEN`` receives nothing, so the listener checks itself at start (a notification
from a second connection) and gives up if it never arrives: waiters then poll.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import psycopg
from psycopg import sql

from ..background import BackgroundLoop
from . import statements
from .connection import Database, redacted

logger = logging.getLogger("runcell_celery.postgres.listener")

SELF_CHECK_PREFIX = "?self-check "
SELF_CHECK_TIMEOUT_S = 2.0
RECONNECT_DELAY_S = (0.1, 0.5, 1.0, 2.0, 5.0)
#: How long one step waits for notifications before checking whether to stop.
NOTIFIES_TIMEOUT_S = 1.0
#: A wait longer than its timeout by this much was paused: it does not count as having
#: read every notification (see ``GrantListener.caught_up_at``).
PAUSED_WAIT_SLACK_S = 0.5

ParkedHandler = Callable[[str, list[str]], None]


class GrantListener:
    """Listens on a process's own channel (and, on request, on ``runcell_parked``);
    ``on_connect`` runs at each (re)connect: grants made meanwhile reached nobody.
    """

    def __init__(
        self,
        database: Database,
        channel: str,
        *,
        on_grants: Callable[[str], None],
        on_connect: Callable[[], None],
    ) -> None:
        self._database = database
        self.channel = channel
        self._on_grants = on_grants
        self._on_connect = on_connect
        self._parked_handlers: list[ParkedHandler] = []
        self._parked_listened = False
        self._parked_ready = threading.Event()
        self._conn: psycopg.Connection[Any] | None = None
        self._failures = 0
        #: ``True`` once notifications proved to arrive; ``False`` if they cannot.
        self.available: bool | None = None
        #: Set while the listening connection is up: no notification can be missed.
        self.connected = threading.Event()
        #: When the listener last finished a wait with every notification that had
        #: arrived handed on (monotonic): the safety poll waits for a later one before
        #: it takes a request it found gone for dropped.
        self.caught_up_at = 0.0
        self._loop = BackgroundLoop("runcell-listener", self, GrantListener._step)

    def start(self) -> None:
        """Start listening in this process (once; a no-op when LISTEN proved useless)."""
        if self.available is not False:
            self._loop.start()

    def add_parked_handler(self, handler: ParkedHandler) -> None:
        """Call ``handler(limiter, request_ids)`` for grants to parked requests made by any
        process (starts listening on ``runcell_parked``)."""
        self._parked_handlers.append(handler)
        self.start()
        # Once this returns, grants are heard: wait for the listener thread to have
        # run LISTEN (at most one notification wait plus a connection's self-check).
        deadline = time.monotonic() + NOTIFIES_TIMEOUT_S + SELF_CHECK_TIMEOUT_S + 5
        while not self._parked_ready.wait(0.05):
            if self.available is False or time.monotonic() > deadline:
                return

    def stop(self) -> None:
        """End the thread (after its current step) and close the listening connection."""
        self._loop.stop(timeout=NOTIFIES_TIMEOUT_S + SELF_CHECK_TIMEOUT_S + 5)
        if not self._loop.running:
            self._disconnect()

    def dispatch(self, channel: str, payload: str) -> None:
        """Hand one notification to its owner."""
        if payload.startswith(SELF_CHECK_PREFIX):
            return
        if channel == statements.PARKED_CHANNEL:
            self._dispatch_parked(payload)
        else:
            self._on_grants(payload)

    def _dispatch_parked(self, payload: str) -> None:
        try:
            message = json.loads(payload)
            limiter = str(message["l"])
            request_ids = [str(request_id) for request_id in message["p"]]
        except (ValueError, KeyError, TypeError):
            logger.warning("runcell: ignoring a malformed parked-grant notification")
            return
        for handler in list(self._parked_handlers):
            try:
                handler(limiter, request_ids)
            except Exception:
                logger.exception("runcell: a parked-grant handler failed")

    def _step(self) -> float | None:
        """Connect if needed, else dispatch what arrives within a second; return the pause
        before the next step, or ``None`` once ``LISTEN`` proved useless here.
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
            conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self.channel)))
            self._parked_listened = False
            self._listen_parked(conn)
            nonce = SELF_CHECK_PREFIX + uuid.uuid4().hex
            # Not from this connection: behind a transaction pooler its NOTIFY can run
            # on the server connection that ran LISTEN and come back in the reply,
            # while nothing reaches this connection between its own statements.
            with self._database.direct_connection(connect_timeout=5) as other:
                other.execute(
                    statements.NOTIFY_SELF_CHECK, {"channel": self.channel, "payload": nonce}
                )
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
        self.available = True
        self.connected.set()
        self._on_connect()
        return 0

    def _listen_parked(self, conn: psycopg.Connection[Any]) -> None:
        if self._parked_handlers and not self._parked_listened:
            conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(statements.PARKED_CHANNEL)))
            self._parked_listened = True
        if self._parked_listened and self.available is not False:
            self._parked_ready.set()

    def _listen_once(self, conn: psycopg.Connection[Any]) -> None:
        self._listen_parked(conn)
        # A connection lost without a reset is found by TCP keepalives (see
        # connection.KEEPALIVES), not by statements: a quiet listener costs nothing.
        started = time.monotonic()
        for notify in conn.notifies(timeout=NOTIFIES_TIMEOUT_S):
            self.dispatch(notify.channel, notify.payload)
        ended = time.monotonic()
        # Every notification that reached the connection before now has been handed on,
        # unless this wait outlasted its timeout by far: the process was paused
        # (SIGSTOP) or starved, and a wait whose time ran out while it stood still may
        # end without reading what arrived meanwhile. The next wait reads it first.
        if ended - started <= NOTIFIES_TIMEOUT_S + PAUSED_WAIT_SLACK_S:
            self.caught_up_at = ended

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
