"""Waiting for slots: one waiting room per engine, never a poller per request.

A queued request waits here, holding no connection and sending nothing. The room
learns of grants by ``NOTIFY`` on this process's own channel (the granting transaction
sends the leases: no further round trip), and by one safety poll for all the process's
waiters: every ``queue_entry_ttl_ms / 2`` while listening (mostly renewing the process's
liveness, which keeps all its queue rows), every ``poll_interval_ms`` without a listener.
:class:`DatabaseClock` turns a grant's database time into a local deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import socket
import threading
import time
import uuid
import weakref
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..background import BackgroundLoop
from . import statements
from .calls import Stamp, call, reap_limiter
from .connection import Database
from .listener import GrantListener
from .options import PostgresOptions

logger = logging.getLogger("runcell_celery.postgres.waiting")

#: How soon a request found missing is looked at again; it is taken as dropped only
#: once the listener has caught up since (it may not have read its grant yet).
SECOND_LOOK_S = 0.25
#: How many times a withdrawal left to the background is tried before its rows are
#: left to expire with their process (see :meth:`WaitRoom.withdraw_later`).
LATE_WITHDRAW_ATTEMPTS = 3

_HOST = socket.gethostname()


@dataclass(frozen=True, slots=True)
class Grant:
    """A slot granted to a waiting request; ``granted_at``: database time (epoch s)."""

    lease_id: str
    fencing_token: int
    granted_at: float


class DatabaseClock:
    """Turns database instants into local monotonic instants, erring early.

    Each round trip returning ``clock_timestamp()`` bounds the offset from below
    (``local(t) >= t - db_now + sent``), so a lease's local expiry is never later than the
    database's.
    """

    #: Samples older than this no longer count: the two clocks drift apart slowly, so
    #: the bound is kept from recent samples only.
    WINDOW_S = 60.0

    def __init__(self) -> None:
        self._offset: float | None = None  # local monotonic minus database epoch
        # (sent, bound) of recent samples whose bound may still be the best, bounds
        # decreasing: the tightest bound of the window is the first.
        self._samples: deque[tuple[float, float]] = deque()
        self._lock = threading.Lock()

    def sample(self, sent_monotonic: float, db_epoch: float) -> None:
        """Add a sample. Each gives a lower bound of the offset; the tightest one of the
        last minute is kept, so one statement that waited long for the row lock (its
        database time read late) does not make every lease look older than it is."""
        bound = sent_monotonic - db_epoch
        with self._lock:
            samples = self._samples
            while samples and samples[-1][1] <= bound:
                samples.pop()
            samples.append((sent_monotonic, bound))
            while samples[0][0] < sent_monotonic - self.WINDOW_S:
                samples.popleft()
            self._offset = samples[0][1]

    def local(self, db_epoch: float) -> float | None:
        """The earliest local monotonic instant ``db_epoch`` can be; ``None``: no sample yet."""
        offset = self._offset
        return None if offset is None else db_epoch + offset


class Waiter:
    """One waiting request: woken when granted, when gone, or to look again."""

    def __init__(
        self, request_id: str, limiter: str, loop: asyncio.AbstractEventLoop | None
    ) -> None:
        self.request_id = request_id
        self.limiter = limiter
        self.grant: Grant | None = None
        #: Set once the database answered that the request waits: the safety poll
        #: only asks about those (a request still being sent is not missing).
        self.queued = False
        self.missing = False
        self._loop = loop
        self._event = threading.Event() if loop is None else None
        self._future: asyncio.Future[None] | None = loop.create_future() if loop else None

    def wake(self) -> None:
        """Wake the waiting thread or task (from any thread)."""
        if self._event is not None:
            self._event.set()
        elif self._loop is not None:
            with contextlib.suppress(RuntimeError):  # loop closed: nobody waits
                self._loop.call_soon_threadsafe(self._resolve)

    def _resolve(self) -> None:
        if self._future is not None and not self._future.done():
            self._future.set_result(None)

    def granted(self, grant: Grant) -> None:
        if self.grant is None:
            self.grant = grant
        self.wake()

    def wait(self, timeout: float | None) -> None:
        """Block until woken or ``timeout`` seconds pass (then clear the wake-up)."""
        assert self._event is not None
        self._event.wait(timeout)
        self._event.clear()

    async def wait_async(self, timeout: float | None) -> None:
        assert self._future is not None
        assert self._loop is not None
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._future), timeout)
        if self._future.done():
            self._future = self._loop.create_future()


class WaitRoom:
    """Every waiting request of this process on one database, and its one listener."""

    def __init__(self, database: Database, options: PostgresOptions) -> None:
        self.process_id = uuid.uuid4().hex
        self.channel = f"runcell_w_{self.process_id[:24]}"
        self.clock = DatabaseClock()
        #: Who waits, as the database records it (``runcell_process``); a room is one
        #: process's (its engine is).
        self.process = json.dumps(
            {"process_id": self.process_id, "channel": self.channel, "host": _HOST,
             "pid": os.getpid(), "ttl_ms": options.queue_entry_ttl_ms}
        )  # fmt: skip
        self._database = database
        self._queue_ttl_ms = options.queue_entry_ttl_ms
        self._poll_s = options.poll_interval_ms / 1000
        self.listener: GrantListener | None = (
            GrantListener(database, self.channel, on_grants=self.dispatch, on_connect=self.wake_all)
            if options.listen
            else None
        )
        self._lock = threading.Lock()
        self._waiters: dict[str, Waiter] = {}
        self._limiters: Counter[str] = Counter()
        self._reapers: dict[str, weakref.WeakMethod[Callable[[], None]]] = {}
        #: Requests the poll found gone, and when it first did (confirmed at a next look).
        self._suspects: dict[str, float] = {}
        self._heartbeat_due = 0.0
        #: When to look for expired leases next (the earliest lease of a limiter we
        #: wait on would expire then, unless renewed).
        self._check_due = math.inf
        self._wake_poll = threading.Event()
        self._loop = BackgroundLoop("runcell-safety-poll", self, WaitRoom._poll_step)
        #: Withdrawals of requests that left without them (see :meth:`withdraw_later`),
        #: with the attempts made so far.
        self._late: deque[tuple[Callable[[], object], int]] = deque()
        self._late_ready = threading.Event()
        self._late_loop = BackgroundLoop(
            "runcell-late-withdraw", self, WaitRoom._late_step, retry_s=1.0
        )

    def close(self) -> None:
        """Stop the safety poll and the listener (and close its connection). Waiters
        still here are not served any more: close a database nobody waits on."""
        for loop, wake in ((self._loop, self._wake_poll), (self._late_loop, self._late_ready)):
            loop.stop()
            wake.set()  # its wait ends now, not at its next interval
            loop.stop(timeout=5)
        if self.listener is not None:
            self.listener.stop()

    @property
    def listening(self) -> bool:
        """Whether grants reach this process by notification right now."""
        listener = self.listener
        return listener is not None and listener.connected.is_set()

    def add(
        self,
        request_id: str,
        limiter: str,
        loop: asyncio.AbstractEventLoop | None,
        *,
        reap: Callable[[], None],
    ) -> Waiter:
        """Register a waiter *before* its acquire is sent, so no grant finds nobody.
        ``reap``: the limiter's allocation pass (held weakly) the poll runs on expired leases.
        """
        waiter = Waiter(request_id, limiter, loop)
        with self._lock:
            self._waiters[request_id] = waiter
            self._limiters[limiter] += 1
            self._reapers[limiter] = weakref.WeakMethod(reap)
        if self.listener is not None:
            self.listener.start()
        self._loop.start()
        return waiter

    def queued(self, waiter: Waiter) -> None:
        """The database answered that ``waiter`` waits: the safety poll covers it now."""
        waiter.queued = True
        self._wake_poll.set()

    def remove(self, waiter: Waiter) -> None:
        with self._lock:
            if self._waiters.get(waiter.request_id) is waiter:
                del self._waiters[waiter.request_id]
                self._limiters[waiter.limiter] -= 1
                if self._limiters[waiter.limiter] <= 0:
                    del self._limiters[waiter.limiter]

    def waiting(self) -> int:
        with self._lock:
            return len(self._waiters)

    def withdraw_later(self, withdraw: Callable[[], object]) -> None:
        """Run ``withdraw`` (idempotent) in the ``runcell-late-withdraw`` thread, retried a
        few times: for a request whose wait ended while its rows stayed locked. Its rows are
        harmless meanwhile (none is granted past its deadline; a grant is given back), and go
        with this process's liveness if it never succeeds.
        """
        with self._lock:
            self._late.append((withdraw, 0))
        self._late_ready.set()
        self._late_loop.start()

    def _late_step(self) -> float:
        with self._lock:
            item = self._late.popleft() if self._late else None
        if item is None:
            self._late_ready.wait()
            self._late_ready.clear()
            return 0.0
        withdraw, attempts = item
        try:
            withdraw()
        except Exception as exc:
            if attempts + 1 >= LATE_WITHDRAW_ATTEMPTS:
                logger.warning("runcell: a withdrawal failed, rows left to expire: %s", exc)
                return 0.0
            logger.info("runcell: a withdrawal failed, trying again: %s", exc)
            with self._lock:
                self._late.append((withdraw, attempts + 1))
            return 1.0
        return 0.0

    def dispatch(self, payload: str) -> None:
        """Wake the waiters named in a grant notification (see runcell_notify_grants_v4)."""
        try:
            message = json.loads(payload)
        except ValueError:
            message = None
        if not isinstance(message, dict):
            logger.warning("runcell: ignoring a malformed grant notification")
            return
        self.dispatch_grants(message.get("t"), message.get("g"))

    def dispatch_grants(self, granted_at: Any, grants: Any) -> None:
        """Wake this process's waiters among ``grants`` (``[[request_id, lease_id, token]]``
        at database time ``granted_at``); a waiter told twice keeps the first.
        """
        try:
            at = float(granted_at)
            found_grants = [(str(r), str(lease), int(token)) for r, lease, token in grants]
        except (ValueError, KeyError, TypeError):
            logger.warning("runcell: ignoring a malformed grant notification")
            return
        with self._lock:
            found = [(self._waiters.get(r), lease, token) for r, lease, token in found_grants]
        for waiter, lease_id, token in found:
            if waiter is not None:
                waiter.granted(Grant(lease_id, token, at))

    def expiry_in(self, ms: float | None) -> None:
        """A lease of a limiter we wait on expires in ``ms`` unless renewed: look then."""
        if ms is None:
            return
        due = time.monotonic() + max(0.0, ms) / 1000
        if due < self._check_due:
            self._check_due = due
            self._wake_poll.set()

    def wake_all(self) -> None:
        """Let every waiter look again (the listener reconnected: grants may be missed)."""
        self._heartbeat_due = 0.0
        self._wake_poll.set()

    def _poll_step(self) -> float:
        listening = self.listening
        with self._lock:
            ids = [r for r, waiter in self._waiters.items() if waiter.queued]
            limiters = list(self._limiters)
        now = time.monotonic()
        if ids:
            heartbeat = now >= self._heartbeat_due
            if not listening or heartbeat or now >= self._check_due:
                self._poll_once(ids, limiters, heartbeat=heartbeat)
                if heartbeat:
                    self._heartbeat_due = now + self._queue_ttl_ms / 2000
        else:
            # Nobody waits: nothing to poll until a waiter registers (add() wakes us).
            self._check_due = math.inf
            self._heartbeat_due = 0.0
            self._wake_poll.wait()
            self._wake_poll.clear()
            return 0.0
        # Listening, the poll only renews liveness and catches expired leases; without
        # a listener it is how grants are found.
        pause = self._poll_s if not listening else self._queue_ttl_ms / 2000
        next_due = min(self._heartbeat_due, self._check_due, time.monotonic() + pause)
        self._wake_poll.wait(max(0.0, next_due - time.monotonic()))
        self._wake_poll.clear()
        return 0.0

    def _poll_once(self, ids: Sequence[str], limiters: Sequence[str], *, heartbeat: bool) -> None:
        sent = Stamp()
        params = {
            "process": self.process,
            "request_ids": list(ids),
            "limiters": list(limiters),
            "heartbeat": heartbeat,
        }
        answer = call(self._database, statements.POLL, params, stamp=sent)
        self.clock.sample(sent.at, float(answer["now"]))
        next_expiry = answer.get("next_expiry_ms")
        self._check_due = (
            math.inf if next_expiry is None else time.monotonic() + float(next_expiry) / 1000
        )
        with self._lock:
            waiters = dict(self._waiters)
        for request_id, lease_id, token, granted_at in answer["granted"]:
            waiter = waiters.get(request_id)
            if waiter is not None:
                waiter.granted(Grant(str(lease_id), int(token), float(granted_at)))
        missing = {r for r in answer["missing"] if r in waiters}
        if missing and self.listening:
            # After a pause (a stopped or starved process) the poll may run before the
            # listener has read the grants that arrived meanwhile: a request granted
            # then is missing from the tables too (its lease may have expired since).
            # Only what is still missing, ungranted, at a later look, once the listener
            # has caught up since the first one, is taken as dropped.
            now = time.monotonic()
            listener = self.listener
            caught_up = listener.caught_up_at if listener is not None else now
            suspects = {r: self._suspects.get(r, now) for r in missing}
            confirmed = {
                r for r, since in suspects.items() if r in self._suspects and caught_up > since
            }
            self._suspects = {r: since for r, since in suspects.items() if r not in confirmed}
            if self._suspects:
                self._check_due = min(self._check_due, now + SECOND_LOOK_S)
            missing = confirmed
        else:
            self._suspects = {}
        for request_id in missing:
            waiter = waiters[request_id]
            if waiter.grant is None:
                waiter.missing = True
                waiter.wake()
        for limiter in answer["reap"]:
            with self._lock:
                reference = self._reapers.get(limiter)
            reap = reference() if reference is not None else None
            try:
                if reap is not None:
                    reap()
                else:  # its limiter is gone: the sweeper re-publishes what this grants
                    reap_limiter(self._database, limiter)
            except Exception as exc:  # the next poll tries again
                logger.info("runcell: reaping %r failed: %s", limiter, exc)
