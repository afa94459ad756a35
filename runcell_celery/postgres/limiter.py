"""The PostgreSQL limiter: one limit shared by every worker on every host.

Each allocation is one short transaction holding the limiter row's lock (see
:mod:`.transaction`); the decision is :func:`runcell_celery.allocation.allocate`, as
in every limiter. No transaction or connection is held while a request waits or while
a slot is held: a waiter polls every ``poll_interval_ms`` with one lock-free
statement, and is woken at once by ``LISTEN/NOTIFY`` when the process's listener
connection is up (then it polls ten times less often, as a safety net). Expiry and
deadlines use database time. Errors fail closed: the caller gets
:class:`~runcell_celery.errors.ConcurrencyLimiterError` and no slot.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import psycopg
from psycopg_pool import ConnectionPool, PoolTimeout

from ..base import ConfiguredLimiter
from ..cancellation import CancellationToken
from ..config import LimiterConfig
from ..deadline import Deadline
from ..errors import (
    ConcurrencyConfigError,
    ConcurrencyError,
    ConcurrencyLimiterError,
)
from ..protocol import AcquireRequest, Lease, LimiterStats, OnWait, Outcome, WorkloadStats
from . import statements
from .connection import (
    Connection,
    Database,
    fetch_all,
    fetch_one,
)
from .listener import GrantListener, get_listener
from .options import (
    DEFAULT_POLL_INTERVAL_MS,
    DEFAULT_QUEUE_ENTRY_TTL_MS,
    OnConflict,
    PostgresOptions,
)
from .registration import config_hash, store_limits
from .transaction import (
    Caller,
    Decision,
    Limits,
    allocation_transaction,
    lock_and_commit,
    would_grant,
)

__all__ = ["DEFAULT_POLL_INTERVAL_MS", "DEFAULT_QUEUE_ENTRY_TTL_MS", "PostgresConcurrencyLimiter"]

logger = logging.getLogger("runcell_celery.postgres")

T = TypeVar("T")

#: A waiter also runs a full allocation pass every this many polls, as a safety net.
ALLOCATE_EVERY_N_POLLS = 10
#: While the listener is connected no grant goes unannounced, so waiters poll this
#: many times less often (a safety net only); they poll at the full rate otherwise.
NOTIFIED_POLL_FACTOR = 10


@dataclass(frozen=True, slots=True)
class _Park:
    """Park the request instead of waiting past ``until``."""

    until: Deadline
    payload: str


#: What :meth:`PostgresConcurrencyLimiter.acquire_or_park` may answer besides a lease.
AdmissionResult = Literal["parked", "duplicate"]


class PostgresConcurrencyLimiter(ConfiguredLimiter):
    """Slots shared through PostgreSQL by every process that uses the same name.

    Create it with :meth:`PostgresBackend.create_limiter
    <runcell_celery.postgres.PostgresBackend.create_limiter>` or
    :func:`create_postgres_concurrency_limiter`.
    """

    def __init__(
        self,
        database: Database,
        config: LimiterConfig,
        options: PostgresOptions = PostgresOptions(),  # noqa: B008 - frozen, shared safely
    ) -> None:
        self._db = database
        super().__init__(config)
        self._options = options
        self._limits = Limits(config.name, config, config_hash(config), options.queue_entry_ttl_ms)
        self._poll_s = options.poll_interval_ms / 1000
        self._queue_ttl_ms = options.queue_entry_ttl_ms
        self._listen = options.listen
        self._on_parked_granted: Callable[[list[str]], None] | None = None

    @property
    def options(self) -> PostgresOptions:
        return self._options

    @property
    def pool(self) -> ConnectionPool[Any]:
        """The connection pool this limiter uses in this process (shared per database)."""
        return self._db.pool

    def set_parked_granted_handler(self, handler: Callable[[list[str]], None] | None) -> None:
        """Call ``handler(lease_ids)`` after an allocation in this process granted
        parked requests, so their tasks are re-published at once (the Celery
        integration installs it; without it, listeners and the sweeper do it)."""
        self._on_parked_granted = handler

    # -- setup ------------------------------------------------------------------------

    def register(self, *, ensure: bool = True, on_conflict: OnConflict = "error") -> None:
        """Create the schema if asked, then store the limits or check the stored ones.

        :raises ConcurrencyConfigError: the stored limits differ (``on_conflict="error"``),
            or the tables are missing and ``ensure`` is false.
        :raises ConcurrencyLimiterError: the database failed.
        """
        config = self._config
        try:
            self._run(
                None,
                lambda conn: store_limits(conn, config, ensure=ensure, on_conflict=on_conflict),
                retry=False,
            )
        except ConcurrencyLimiterError as exc:
            missing = psycopg.errors.UndefinedTable | psycopg.errors.UndefinedFunction
            if isinstance(exc.__cause__, missing):
                raise ConcurrencyConfigError(
                    f"limiter {self.name!r}: the runcell tables do not exist in this database; "
                    "apply postgres_concurrency_schema_sql() as a migration, or create the "
                    "limiter with ensure_schema=True",
                    limiter=self.name,
                ) from exc
            raise

    # -- acquire ----------------------------------------------------------------------

    def acquire(
        self,
        request: AcquireRequest,
        *,
        cancel: CancellationToken | None = None,
        on_wait: OnWait | None = None,
    ) -> Lease:
        """Wait for a slot; see :class:`~runcell_celery.protocol.ConcurrencyLimiter`."""
        result = self._acquire(request, cancel, on_wait, park=None)
        assert isinstance(result, Lease)
        return result

    def acquire_or_park(
        self,
        request: AcquireRequest,
        *,
        admission_wait_ms: float,
        payload: str,
        cancel: CancellationToken | None = None,
        on_wait: OnWait | None = None,
    ) -> Lease | AdmissionResult:
        """Wait up to ``admission_wait_ms`` for a slot, then park the request.

        A parked request keeps its place in the queue, with ``payload`` (the task
        message to re-publish) and no process polling for it. When allocation grants
        it, the lease is held for it and the message is re-published (see
        :mod:`runcell_celery.postgres.parking`); the re-published task takes the lease
        with :meth:`claim_parked`.

        :returns: the lease if one was granted in time; ``"parked"`` once the request
            is parked; ``"duplicate"`` if this request already had a lease granted
            while parked (another delivery of the same task owns it).
        """
        park = _Park(Deadline.after_ms(admission_wait_ms), payload)
        return self._acquire(request, cancel, on_wait, park=park)

    def _acquire(
        self,
        request: AcquireRequest,
        cancel: CancellationToken | None,
        on_wait: OnWait | None,
        *,
        park: _Park | None,
    ) -> Lease | AdmissionResult:
        workload = self._resolve(request)
        if cancel is not None and cancel.is_set():
            raise self._cancelled(request)
        wait_ms = self._wait_ms(request, workload)
        decision = self._allocate(caller=request, workload=workload, wait_ms=wait_ms)
        if decision.lease is not None:
            return decision.lease
        if decision.parked_lease:
            return "duplicate"
        if decision.refused == "queue-full":
            raise self._queue_full(request)
        if decision.refused == "no-wait":
            raise self._timed_out(request, wait_ms)
        deadline = None
        if decision.wait_ms_left is not None:
            deadline = Deadline.after_ms(decision.wait_ms_left)
        return self._wait(request, workload, wait_ms, deadline, cancel, on_wait, park)

    def _wait(
        self,
        request: AcquireRequest,
        workload: str,
        wait_ms: float | None,
        deadline: Deadline | None,
        cancel: CancellationToken | None,
        on_wait: OnWait | None,
        park: _Park | None = None,
    ) -> Lease | AdmissionResult:
        wake = threading.Event()
        listener = self._get_listener()
        if listener is not None:
            listener.register(request.request_id, wake.set)
        unlink = cancel.add_callback(wake.set) if cancel is not None else _nothing
        settled = False
        try:
            if on_wait is not None:
                on_wait(None if deadline is None else deadline.to_unix())
            polls = 0
            while True:
                notified = listener is not None and listener.connected.is_set()
                pause = self._poll_s * NOTIFIED_POLL_FACTOR if notified else self._poll_s
                if park is not None:
                    pause = min(pause, park.until.remaining_s())
                wake.wait(pause)
                wake.clear()
                if cancel is not None and cancel.is_set():
                    self._allocate(withdraw=request.request_id)
                    settled = True
                    raise self._cancelled(request)
                polls += 1
                status, lease = self._poll(request)
                if lease is not None:
                    settled = True
                    return lease
                if status == "timed-out":
                    settled = True
                    raise self._timed_out(request, wait_ms)
                if status == "missing":
                    # Our queue row was reaped (this process stalled past
                    # queue_entry_ttl_ms): take a new place, with the time left.
                    remaining = None if deadline is None else deadline.remaining_ms()
                    decision = self._allocate(caller=request, workload=workload, wait_ms=remaining)
                    if decision.lease is not None:
                        settled = True
                        return decision.lease
                    if decision.refused is not None:
                        settled = True
                        raise self._timed_out(request, wait_ms)
                elif status == "needs-allocation" or polls % ALLOCATE_EVERY_N_POLLS == 0:
                    self._allocate()
                if park is not None and park.until.passed():
                    parked = self._park(request, park.payload)
                    if parked is not None:
                        settled = True
                        return parked
        finally:
            unlink()
            if listener is not None:
                listener.unregister(request.request_id)
            if not settled:
                # Leaving on an unexpected error or interrupt: give up our place, and
                # a slot granted meanwhile, so nothing leaks until a TTL expires.
                with contextlib.suppress(Exception):
                    self._allocate(withdraw=request.request_id)

    def _park(self, request: AcquireRequest, payload: str) -> Lease | AdmissionResult | None:
        """Turn the waiting row into a parked one; ``None`` if the row is gone."""
        params = {"limiter": self.name, "request_id": request.request_id, "payload": payload}
        result = self._run(request, lambda conn: fetch_one(conn, statements.PARK, params)[0])
        if result["status"] == "parked":
            return "parked"
        if result["status"] == "granted":
            return self._limits.lease(result["lease"])
        return None

    def claim_parked(self, request_id: str, publication_id: str) -> Lease | None:
        """Take the lease granted to a parked request, from its re-published message.

        :returns: the lease, renewed; ``None`` if this publication cannot claim it
            (another publication did, or the grant expired and the request is back in
            line, or it was never granted).
        """
        params = {
            "limiter": self.name,
            "request_id": request_id,
            "publication_id": publication_id,
        }
        rows = self._run(None, lambda conn: fetch_all(conn, statements.CLAIM_PARKED, params))
        if not rows:
            return None
        lease_id, granted_request, workload, token = rows[0]
        return self._limits.lease(
            {
                "lease_id": lease_id,
                "request_id": granted_request,
                "workload": workload,
                "fencing_token": token,
            }
        )

    def _poll(self, request: AcquireRequest) -> tuple[str, Lease | None]:
        params = {
            "limiter": self.name,
            "request_id": request.request_id,
            "queue_ttl_ms": self._queue_ttl_ms,
        }

        def work(conn: Connection) -> Any:
            return fetch_one(conn, statements.POLL, params)[0]

        result = self._run(request, work)
        status = result["status"]
        if status == "granted":
            return status, self._limits.lease(result["lease"])
        if status == "waiting" and result["needs_allocation"]:
            return "needs-allocation", None
        return status, None

    def _allocate(
        self,
        *,
        caller: AcquireRequest | None = None,
        workload: str | None = None,
        wait_ms: float | None = None,
        release: str | None = None,
        withdraw: str | None = None,
    ) -> Decision:
        """Run one allocation transaction under the limiter row's lock.

        A release or withdrawal first tries the one-round-trip form (lock, apply,
        commit); only if the freed slot can go to a waiter does a second transaction
        hand it over. Nobody can take the slot in between out of turn: whoever locks
        the row next allocates over every waiter, by the same rules.
        """
        limits = self._limits
        request_id = caller.request_id if caller is not None else None
        params = limits.lock_params(release=release, withdraw=withdraw, request_id=request_id)
        if caller is None and (release is not None or withdraw is not None):
            state = limits.check(self._run(None, lambda conn: lock_and_commit(conn, params)))
            if not would_grant(limits, state):
                return Decision()
            params = limits.lock_params(release=None, withdraw=None, request_id=None)
        who = None
        if caller is not None:
            assert workload is not None
            who = Caller(caller, workload, wait_ms)
        decision = self._run(caller, lambda conn: allocation_transaction(conn, limits, params, who))
        handler = self._on_parked_granted
        if decision.parked_granted and handler is not None:
            # After commit and with the connection returned: publishing may be slow.
            try:
                handler(decision.parked_granted)
            except Exception:  # listeners and the sweeper re-publish them later
                logger.exception("runcell: re-publishing granted parked tasks failed")
        return decision

    # -- renew, release, stats ----------------------------------------------------------

    def renew(self, lease: Lease) -> Lease | None:
        """Extend ``lease`` by its TTL (database time); ``None`` if no longer held."""
        return self.renew_many([lease])[lease.lease_id]

    def renew_many(self, leases: Sequence[Lease]) -> Mapping[str, Lease | None]:
        """Renew several leases of this limiter in one statement."""
        if not leases:
            return {}
        params = {"limiter": self.name, "lease_ids": [lease.lease_id for lease in leases]}

        def work(conn: Connection) -> set[str]:
            return {row[0] for row in fetch_all(conn, statements.RENEW, params)}

        renewed = self._run(None, work)
        return {lease.lease_id: lease if lease.lease_id in renewed else None for lease in leases}

    def release(self, lease: Lease, outcome: Outcome = "success") -> None:
        """Return the slot and hand it to the next waiter by the allocation rules."""
        self._allocate(release=lease.lease_id)

    def withdraw(self, request_id: str) -> None:
        """Take a request out of the queue (parked or waiting) and return any slot it
        was granted; used when its run is cancelled before it starts waiting."""
        self._allocate(withdraw=request_id)

    def reap(self) -> None:
        """Run one allocation pass: reap expired leases and queue rows, grant what frees.

        Waiters do this as they poll; when nobody waits (every request parked, the
        holders dead) a worker's sweeper calls it, so parked runs still get the slots
        that expired leases give back.
        """
        self._allocate()

    def stats(self) -> LimiterStats:
        """Return active and queued counts, in total and per workload (database view)."""
        params = {"limiter": self.name}

        def work(conn: Connection) -> list[tuple[Any, ...]]:
            return fetch_all(conn, statements.STATS, params)

        counts: dict[str, dict[str, int]] = {"active": {}, "queued": {}}
        for kind, workload, n in self._run(None, work):
            counts[kind][workload] = n
        names = list(self._config.workloads)
        names += [w for kind in counts.values() for w in kind if w not in names]
        return LimiterStats(
            active=sum(counts["active"].values()),
            queued=sum(counts["queued"].values()),
            workloads={
                w: WorkloadStats(
                    active=counts["active"].get(w, 0), queued=counts["queued"].get(w, 0)
                )
                for w in names
            },
        )

    @property
    def listening(self) -> bool | None:
        """Whether waiters of this process are woken by ``LISTEN/NOTIFY``.

        ``None`` until the listener has checked itself; ``False`` when polling alone.
        """
        listener = self._get_listener()
        return listener.available if listener is not None else False

    # -- plumbing -----------------------------------------------------------------------

    def _get_listener(self) -> GrantListener | None:
        """This process's listener (one per process and database), unless off or useless."""
        if not self._listen:
            return None
        listener = get_listener(self._db)
        return None if listener.available is False else listener

    def _run(
        self,
        request: AcquireRequest | None,
        work: Callable[[Connection], T],
        *,
        retry: bool = True,
    ) -> T:
        """Run ``work`` on a pooled connection; fail closed on database errors.

        A connection the database dropped (restart, ``pg_terminate_backend``) is only
        found out when used; the work is then retried on another connection, so the
        limiter recovers by itself. Retrying is safe because every operation is
        idempotent: releases and withdrawals by lease and request id, and an acquire
        whose first attempt committed finds its lease or queue row again (``mine``).
        """
        attempts = self._db.pool_max_size + 1 if retry else 1
        for attempt in range(attempts):
            broken = False
            try:
                with self._db.connection() as conn:
                    try:
                        return work(conn)
                    finally:
                        broken = conn.broken
            except ConcurrencyError as exc:
                if request is not None and exc.request_id is None:
                    raise request.error(type(exc), exc.message, limiter=self.name) from exc
                raise
            except (psycopg.Error, PoolTimeout) as exc:
                if broken and attempt + 1 < attempts:
                    logger.info("runcell: retrying on a fresh connection after: %s", exc)
                    continue
                message = f"limiter {self.name!r}: the database failed: {exc}"
                if request is not None:
                    raise request.error(
                        ConcurrencyLimiterError, message, limiter=self.name
                    ) from exc
                raise ConcurrencyLimiterError(message, limiter=self.name) from exc
        raise AssertionError("unreachable")  # pragma: no cover


def _nothing() -> None:
    return None
