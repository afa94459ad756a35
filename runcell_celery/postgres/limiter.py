"""The PostgreSQL limiter: one limit shared by every worker on every host.

Every operation is one call of a function in ``schema.sql`` (one round trip, one
transaction) under the limiter row's lock:

* **acquire** grants at once when nobody of the request's workload waits and the
  workload has room, else queues the request (one synchronous commit);
* **release** frees the slot and grants the next waiters in the same transaction,
  notifying each waiting process on its own channel with the leases (asynchronous
  commit when it grants nobody);
* a waiting request waits in its process's :class:`~.waiting.WaitRoom` and costs the
  database nothing; when its wait ends it **withdraws** under the lock (a grant made
  at that moment wins; a cancelled request gives it back).

The allocation rules are those of :func:`runcell_celery.allocation.allocate`, which
``runcell_allocate_v4`` carries out over kept counts and the head of each workload's
line (``tests/postgres/test_allocation_in_sql.py`` checks the two agree). No
connection is held while a request waits or a slot is held. Errors fail closed: the
caller gets :class:`~runcell_celery.errors.ConcurrencyLimiterError` and no slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Executor
from typing import Any, LiteralString, cast

import psycopg
from psycopg_pool import ConnectionPool, PoolTimeout

from ..base import ConfiguredLimiter
from ..cancellation import CancellationToken
from ..config import LimiterConfig
from ..deadline import Deadline
from ..errors import ConcurrencyConfigError, ConcurrencyError, ConcurrencyLimiterError
from ..keeper import LeaseKeeper
from ..keys import config_for_key
from ..patience import current_patience
from ..ports import DEFAULT_DEFER_AFTER_MS, ClaimMiss, Duplicate, Parked, WaitEstimate
from ..protocol import (
    AcquireRequest,
    ConcurrencyLimiter,
    KeyStats,
    Lease,
    LimiterStats,
    OnWait,
    Outcome,
    QueuePlace,
    WorkloadStats,
    announce_wait,
)
from . import statements
from .calls import (
    LOCK_WAIT_CAP_MS,
    WITHDRAW_GRACE_MS,
    CallFailedError,
    LimiterMissingError,
    LimitsReplacedError,
    RowBusyError,
    Stamp,
    call,
    lock_timeout_ms,
    persist,
    pool_wait_s,
)
from .connection import Database
from .engine import Engine, HasEngine
from .keyed import PURGE_BATCH, KeySet
from .options import OnConflict, PostgresOptions
from .parking import ParkRule
from .registration import Stored, config_hash, store_limits
from .several import acquire_several, claim_parked_group, run_group_pass, withdraw_group
from .stored_limits import StoredLimits, announce_stored_limits, read_stored_limits
from .waiting import Grant, Waiter, WaitRoom

__all__ = ["AdmissionResult", "PostgresConcurrencyLimiter"]

logger = logging.getLogger("runcell_celery.postgres")

#: What :meth:`PostgresConcurrencyLimiter.acquire_or_park` may answer besides a lease.
AdmissionResult = Parked | Duplicate

#: A lease is taken as lost this much before its TTL would end on the database, so a
#: pause or a slow clock never lets a body run on a lease another holder already has.
MAX_SAFETY_MARGIN_MS = 1_000
#: A release blocked this many times by a busy row gives up (the lease then expires).
RELEASE_ATTEMPTS = 3
#: An acquire takes the stored limits at most this many times (``use_stored``) before
#: it fails: limits replaced again and again while it asks.
ADOPT_ATTEMPTS = 3


class _Waiting:
    """One waiting request's state while the limiter drives it (sync or async)."""

    __slots__ = (
        "cancel",
        "deadline",
        "estimate",
        "park",
        "request",
        "sent",
        "settled",
        "wait_ms",
        "waiter",
        "workload",
    )

    def __init__(
        self,
        request: AcquireRequest,
        workload: str,
        wait_ms: float | None,
        cancel: CancellationToken | None,
        park: ParkRule | None,
        waiter: Waiter,
    ) -> None:
        self.request = request
        self.workload = workload
        self.wait_ms = wait_ms
        self.deadline = Deadline.after_ms(wait_ms) if wait_ms is not None else None
        self.cancel = cancel
        self.park = park
        self.waiter = waiter
        self.sent = time.monotonic()
        #: What the limiter said of its wait when it joined the line.
        self.estimate: WaitEstimate | None = None
        #: Nothing is left in the database for this request but what it returned (a
        #: lease, a parked row) or nothing at all: no withdrawal needed on the way out.
        self.settled = False

    def pause_s(self) -> float | None:
        """How long to sleep before something is due (``None``: until woken)."""
        due = [d for d in (self.deadline, self.park.until if self.park else None) if d]
        return min(d.remaining_s() for d in due) if due else None


class PostgresConcurrencyLimiter(ConfiguredLimiter):
    """Slots shared through PostgreSQL by every process that uses the same name.

    Create it with :meth:`PostgresBackend.create_limiter
    <runcell_celery.postgres.PostgresBackend.create_limiter>` or
    :func:`create_postgres_concurrency_limiter`.
    """

    def __init__(
        self,
        engines: HasEngine,
        config: LimiterConfig,
        options: PostgresOptions = PostgresOptions(),  # noqa: B008 - frozen, shared safely
        *,
        stored_hash: str | None = None,
        owns_backend: bool = False,
    ) -> None:
        self._engines = engines
        self._owns_backend = owns_backend
        super().__init__(config)
        self._options = options
        #: The limits this worker was given; ``config`` may be the stored ones instead.
        self._given = config
        # A key's row carries its keyed limiter's limits and checksum.
        self._hash = stored_hash or config_hash(config)
        self._margin_s = self._safety_margin_s(config)
        self._on_parked_granted: Callable[[list[str]], None] | None = None
        self._keys: KeySet[PostgresConcurrencyLimiter] | None = None

    @property
    def options(self) -> PostgresOptions:
        return self._options

    @property
    def engines(self) -> HasEngine:
        """Its backend: gives each process its engine."""
        return self._engines

    @property
    def _engine(self) -> Engine:
        """This process's engine of the limiter's backend (pool, room, executor, keeper)."""
        return self._engines.engine

    @property
    def _db(self) -> Database:
        return self._engine.database

    @property
    def pool(self) -> ConnectionPool[Any]:
        """The connection pool this limiter uses in this process (its backend's)."""
        return self._db.pool

    @property
    def room(self) -> WaitRoom:
        """This process's waiting room of the limiter's backend."""
        return self._engine.room

    @property
    def database(self) -> Database:
        """The pool and listener this limiter shares with its backend's other limiters."""
        return self._db

    @property
    def keeper(self) -> LeaseKeeper:
        """The lease keeper of its backend in this process (renews its held slots)."""
        return self._engine.keeper

    @property
    def release_executor(self) -> Executor:
        """Where an ``async with slot(...)`` exit runs its release: off the event loop."""
        return self._engine.executor

    def close(self) -> None:
        """Close the backend this limiter owns (one made by
        :func:`create_postgres_concurrency_limiter`): its threads end and its
        connections close. A backend's limiter leaves that to ``backend.close()``."""
        if self._owns_backend:
            self._engines.close()

    @property
    def stored_hash(self) -> str:
        """The checksum of the stored limits this limiter checks at every operation."""
        return self._hash

    @property
    def parked_granted_handler(self) -> Callable[[list[str]], None] | None:
        return self._on_parked_granted

    @property
    def given_config(self) -> LimiterConfig:
        """The limits this limiter was created with (``config`` is what it works on:
        the stored limits instead, once it took them under ``on_conflict="use_stored"``)."""
        return self._given

    # -- the stored limits (on_conflict="use_stored", :mod:`.stored_limits`) --------------

    def use_stored_limits(self, request: AcquireRequest | None = None) -> bool:
        """Take the limits stored in the database as this limiter's own, after an
        operation found them replaced by another worker.

        Only under ``on_conflict="use_stored"``: otherwise, or when the limiter has no
        row, nothing changes and the caller fails as before.

        :returns: whether the limits were taken (the caller may ask again).
        :raises ConcurrencyLimiterError: the database failed while reading them.
        """
        if self._options.on_conflict != "use_stored":
            return False
        with _failing_closed(self, request), self._db.connection() as conn:
            stored = read_stored_limits(conn, self.name)
        if stored is None:
            return False
        self._take(stored, request)
        return True

    def _take(self, stored: StoredLimits, request: AcquireRequest | None) -> None:
        announce_stored_limits(self._given, stored, self._engine.first_time, request=request)
        self._config = stored.config
        self._hash = stored.config_hash
        self._margin_s = self._safety_margin_s(stored.config)

    @staticmethod
    def _safety_margin_s(config: LimiterConfig) -> float:
        return min(MAX_SAFETY_MARGIN_MS, config.lease_ttl_ms / 10) / 1000

    # -- keys -------------------------------------------------------------------------

    def key(self, key: str) -> PostgresConcurrencyLimiter:
        """The limiter of ``key`` of this keyed limiter (its row appears on first use).

        :raises ConcurrencyConfigError: this limiter is not keyed, or the key is invalid
            (:func:`runcell_celery.keys.check_key`).
        """
        return self._key_set().get(key)

    def purge_idle_keys(self, limit: int = PURGE_BATCH) -> int:
        """Delete up to ``limit`` idle keys now (a loop does it every few seconds in a
        process that uses keys); return how many went."""
        return self._key_set().purge(limit)

    def key_stats(self, limit: int | None = 100, *, search: str | None = None) -> list[KeyStats]:
        """The keys in use, busiest first (most slots held, then most waiting), at most
        ``limit`` (``None``: all); ``search``: only keys containing it (any case)."""
        return self._key_set().stats(limit=limit, search=search)

    def keys_in_use(self) -> int:
        """How many keys hold a slot or have a request waiting."""
        return self._key_set().in_use()

    def for_key(self, key: str) -> PostgresConcurrencyLimiter:
        """A new limiter of ``key`` (no I/O; :meth:`key` caches them)."""
        limiter = PostgresConcurrencyLimiter(
            self._engines, config_for_key(self._config, key), self._options, stored_hash=self._hash
        )
        limiter.set_parked_granted_handler(self._on_parked_granted)
        return limiter

    def _key_set(self) -> KeySet[PostgresConcurrencyLimiter]:
        if not self._config.keyed:
            raise ConcurrencyConfigError(
                f"limiter {self.name!r} is not keyed: declare it with keyed=True to give "
                "each key its own limit",
                limiter=self.name,
            )
        if self._keys is None:
            self._keys = KeySet(self)
        return self._keys

    # -- several limiters in one slot (:mod:`.several`) ----------------------------------

    def acquire_several(
        self,
        limiters: Sequence[ConcurrencyLimiter],
        requests: Sequence[AcquireRequest],
        *,
        cancel: CancellationToken | None = None,
        on_wait: OnWait | None = None,
    ) -> tuple[Lease, ...]:
        """One slot in every limiter of ``limiters`` (all of this database), granted
        together; see :class:`~runcell_celery.protocol.SupportsSeveral`."""
        result = acquire_several(self, limiters, requests, cancel=cancel, on_wait=on_wait)
        assert isinstance(result, tuple)  # it parks only when asked to
        return result

    def acquire_several_or_park(
        self,
        limiters: Sequence[ConcurrencyLimiter],
        requests: Sequence[AcquireRequest],
        *,
        payload: str,
        broker: str | None = None,
        admission_wait_ms: float | None = None,
        defer_after_ms: float = DEFAULT_DEFER_AFTER_MS,
        cancel: CancellationToken | None = None,
        on_wait: OnWait | None = None,
    ) -> tuple[Lease, ...] | AdmissionResult:
        """:meth:`acquire_or_park` for one request over several limiters: it waits,
        then parks as one request (every limiter keeps its place; the first in name
        order carries ``payload``), and is granted all its slots together as a parked
        request, its message re-published once. The acquire over several limiters
        gives no wait estimate, so the rule waits up to ``defer_after_ms`` and then
        parks (or waits ``admission_wait_ms``, when given).

        :returns: the leases, in ``limiters``' order; :class:`~runcell_celery.ports.Parked`;
            or :class:`~runcell_celery.ports.Duplicate` (already parked and granted: its
            publication carries it).
        """
        park = ParkRule.of(payload, admission_wait_ms, defer_after_ms, broker)
        return acquire_several(self, limiters, requests, cancel=cancel, on_wait=on_wait, park=park)

    def claim_parked_several(
        self, limiters: Sequence[ConcurrencyLimiter], request_id: str, publication_id: str
    ) -> tuple[Lease, ...] | ClaimMiss:
        """:meth:`claim_parked` for a request over several limiters: every lease, or
        none; in ``limiters``' order."""
        return claim_parked_group(self, limiters, request_id, publication_id)

    def withdraw_several(self, limiters: Sequence[ConcurrencyLimiter], request_id: str) -> None:
        """Give up the places or unclaimed parked grants of a request over several
        limiters, in all of them."""
        withdraw_group(self, limiters, request_id)

    def call_request(
        self,
        request: AcquireRequest,
        query: LiteralString,
        params: Mapping[str, Any],
        *,
        lock_ms: int,
        stamp: Stamp | None = None,
    ) -> Any:
        """One bounded call on behalf of ``request`` (failing closed, naming it; a row
        that stayed locked raises :class:`~.calls.RowBusyError`)."""
        return self._call(request, query, params, lock_ms=lock_ms, busy_ok=True, stamp=stamp)

    def _run_due_groups(self, answer: Mapping[str, Any]) -> None:
        """Run the group pass of each request over several limiters the operation found
        first in line everywhere (``"grp"``): it may be granted now. Its own process
        runs one now and then anyway, so a failure here only delays it."""
        for group_id in answer.get("grp") or ():
            try:
                run_group_pass(self, str(group_id))
            except ConcurrencyError as exc:
                logger.info("runcell: the group pass of %s failed: %s", group_id, exc)

    def republish(self, lease_ids: Any) -> None:
        """Re-publish the parked tasks an operation granted (see :meth:`release`)."""
        self._republish(lease_ids)

    def make_lease(
        self,
        request_id: str,
        workload: str,
        lease: Sequence[Any],
        sent: float | None,
        *,
        waited_ms: float | None = None,
    ) -> Lease:
        """A lease the database answered with (``[lease_id, token]``); ``waited_ms``
        the request's whole wait when the database measured it (a parked claim)."""
        return self._lease(request_id, workload, lease, sent, waited_ms=waited_ms)

    def granted_lease(self, request_id: str, workload: str, grant: Grant, sent: float) -> Lease:
        """A lease a notification (or a release) granted: valid for its TTL from the
        grant's database time turned into local time (erring early), or from ``sent``
        when the clock has no sample yet."""
        start = self.room.clock.local(grant.granted_at)
        return Lease(
            lease_id=grant.lease_id,
            limiter=self.name,
            workload=workload,
            request_id=request_id,
            fencing_token=grant.fencing_token,
            ttl_ms=self._config.lease_ttl_ms,
            valid_until=self._valid_until(start if start is not None else sent),
        )

    def call_database(self, query: LiteralString, params: Mapping[str, Any]) -> Any:
        """Run one bounded function call on this limiter's pool (failing closed)."""
        return self._call(None, query, params, lock_ms=lock_timeout_ms(None))

    def fetch(self, query: LiteralString, params: Mapping[str, Any]) -> list[tuple[Any, ...]]:
        """Read rows on this limiter's pool (failing closed)."""
        with _failing_closed(self, None), self._db.connection() as conn:
            return list(conn.execute(query, params).fetchall())

    def set_parked_granted_handler(self, handler: Callable[[list[str]], None] | None) -> None:
        """Call ``handler(lease_ids)`` after an operation in this process granted
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
        patience = current_patience()  # a limiter made on a run's first use: its budget

        def attempt() -> Stored:
            try:
                with self._db.connection(timeout=pool_wait_s(self._db, None, patience)) as conn:
                    return store_limits(conn, config, ensure=ensure, on_conflict=on_conflict)
            except PoolTimeout as exc:
                raise CallFailedError(str(exc), maybe_done=False) from exc
            except psycopg.OperationalError as exc:
                if isinstance(exc, psycopg.errors.QueryCanceled | psycopg.errors.LockNotAvailable):
                    raise
                # Dropped or refused: storing the limits again is safe (same hash, same row).
                raise CallFailedError(str(exc)) from exc

        try:
            stored = persist(patience, attempt)
            if stored.adopted is not None:
                adopted, adopted_hash = stored.adopted
                self._take(StoredLimits(config=adopted, config_hash=adopted_hash), None)
            if stored.allocated:
                # New limits granted waiting requests: their processes were notified;
                # parked tasks and requests over several limiters are ours to move on.
                self._republish(stored.allocated.get("parked"))
                self._run_due_groups(stored.allocated)
        except ConcurrencyError:
            raise
        except CallFailedError as exc:
            raise ConcurrencyLimiterError(
                f"limiter {self.name!r}: the database failed: {exc}", limiter=self.name
            ) from exc.__cause__
        except psycopg.Error as exc:
            missing = psycopg.errors.UndefinedTable | psycopg.errors.UndefinedFunction
            if isinstance(exc, missing):
                raise ConcurrencyConfigError(
                    f"limiter {self.name!r}: the runcell tables do not exist in this database; "
                    "apply postgres_concurrency_schema_sql() as a migration, or create the "
                    "limiter with ensure_schema=True",
                    limiter=self.name,
                ) from exc
            raise ConcurrencyLimiterError(
                f"limiter {self.name!r}: the database failed: {exc}", limiter=self.name
            ) from exc
        except Exception as exc:
            raise ConcurrencyLimiterError(
                f"limiter {self.name!r}: the database failed: {exc}", limiter=self.name
            ) from exc

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
        payload: str,
        broker: str | None = None,
        admission_wait_ms: float | None = None,
        defer_after_ms: float = DEFAULT_DEFER_AFTER_MS,
        cancel: CancellationToken | None = None,
        on_wait: OnWait | None = None,
    ) -> Lease | AdmissionResult:
        """Wait for a slot while waiting is cheaper than parking, then park the request.

        By default the rule decides: when the request joins the line, the acquire's
        answer gives its place and the limiter's mean hold time, and a request whose
        expected wait (:class:`~runcell_celery.ports.WaitEstimate`) exceeds
        ``defer_after_ms`` parks at once; any other waits up to ``defer_after_ms``
        and then parks. So a worker process is never blocked longer than
        ``defer_after_ms``, and never for a wait expected to be longer. An explicit
        ``admission_wait_ms`` replaces the rule: wait that long, then park.

        A parked request keeps its place in the queue, with ``payload`` (the task
        message to re-publish) and no process waiting for it. When allocation grants
        it, the lease is held for it and the message is re-published (see
        :mod:`runcell_celery.postgres.parking`) by a publisher of ``broker`` (an
        identity of the broker it must go back to; ``None``: any publisher); the
        re-published task takes the lease with :meth:`claim_parked`.

        :returns: the lease if one was granted in time; :class:`~runcell_celery.ports.Parked`
            (with the place and expected wait) once the request is parked;
            :class:`~runcell_celery.ports.Duplicate` if this request already had a lease
            granted while parked (another delivery of the same task owns it).
        :raises ConcurrencyConfigError: ``admission_wait_ms`` or ``defer_after_ms`` is
            not a duration (naming which, and the bound).
        """
        park = ParkRule.of(payload, admission_wait_ms, defer_after_ms, broker)
        return self._acquire(request, cancel, on_wait, park=park, retry=True)

    def _acquire(
        self,
        request: AcquireRequest,
        cancel: CancellationToken | None,
        on_wait: OnWait | None,
        *,
        park: ParkRule | None,
        retry: bool = False,
    ) -> Lease | AdmissionResult:
        waiting = self._begin(request, cancel, park, loop=None)
        unlink = cancel.add_callback(waiting.waiter.wake) if cancel is not None else _nothing
        try:
            result = self._first(waiting, on_wait, retry=retry)
            while result is None:
                waiting.waiter.wait(waiting.pause_s())
                result = self._step(waiting)
            waiting.settled = True
            return result
        finally:
            unlink()
            self.room.remove(waiting.waiter)
            if not waiting.settled:
                # Interrupted (SIGTERM of a revoked task, KeyboardInterrupt) or failed:
                # leave the queue; a slot granted meanwhile is given back, never leaked.
                self._withdraw_quietly(request)

    async def acquire_async(
        self,
        request: AcquireRequest,
        *,
        cancel: CancellationToken | None = None,
        on_wait: OnWait | None = None,
    ) -> Lease:
        """Wait for a slot in the event loop: the wait occupies no thread.

        The round trips run in this process's small ``runcell-db`` thread pool (never
        the loop's default executor, which the caller's own I/O needs); the wait is a
        future the process's listener resolves.
        """
        loop = asyncio.get_running_loop()
        waiting = self._begin(request, cancel, None, loop=loop)
        unlink = cancel.add_callback(waiting.waiter.wake) if cancel is not None else _nothing
        executor = self._engine.executor
        try:
            result = await loop.run_in_executor(executor, self._first, waiting, on_wait, False)
            while result is None:
                await waiting.waiter.wait_async(waiting.pause_s())
                result = await loop.run_in_executor(executor, self._step, waiting)
            assert isinstance(result, Lease)
            waiting.settled = True
            return result
        finally:
            unlink()
            self.room.remove(waiting.waiter)
            if not waiting.settled:
                # Leave the queue; a slot granted meanwhile is given back, never leaked.
                await asyncio.shield(
                    loop.run_in_executor(executor, self._withdraw_quietly, waiting.request)
                )

    def _begin(
        self,
        request: AcquireRequest,
        cancel: CancellationToken | None,
        park: ParkRule | None,
        *,
        loop: asyncio.AbstractEventLoop | None,
    ) -> _Waiting:
        if self._config.keyed:
            raise request.error(
                ConcurrencyConfigError,
                f"limiter {self.name!r} is keyed: a slot names one of its keys, "
                f"{self.name}.key(...), not the keyed limiter itself",
                limiter=self.name,
            )
        workload = self._resolve(request)
        if cancel is not None and cancel.is_set():
            raise self._cancelled(request)
        wait_ms = self._wait_ms(request, workload)
        # Registered before the request is sent, so a grant that arrives before the
        # answer finds its waiter.
        waiter = self.room.add(request.request_id, self.name, loop, reap=self.reap)
        return _Waiting(request, workload, wait_ms, cancel, park, waiter)

    def _first(
        self, waiting: _Waiting, on_wait: OnWait | None, retry: bool
    ) -> Lease | AdmissionResult | None:
        """Send the acquire; return its lease, or ``None`` when the request now waits."""
        answer = self._send_acquire(waiting, retry=retry)
        if answer is None:
            if on_wait is not None:
                deadline = waiting.deadline.to_unix() if waiting.deadline is not None else None
                announce_wait(on_wait, deadline, functools.partial(_place, waiting.estimate))
            return self._step(waiting)
        return answer

    def _send_acquire(self, waiting: _Waiting, *, retry: bool) -> Lease | AdmissionResult | None:
        request = waiting.request
        lineage = request.lineage
        params: dict[str, Any] = {
            "limiter": self.name,
            "config_hash": self._hash,
            "request": json.dumps(
                {
                    "request_id": request.request_id,
                    "workload": waiting.workload,
                    "run_id": lineage.run_id,
                    "root_run_id": lineage.root_run_id,
                    "parent_run_id": lineage.parent_run_id,
                    "holder_name": request.holder_name,
                    "in_progress": request.in_progress,
                    "key": request.key,
                }
            ),
            "process": json.dumps(self.room.process()),
            "retry": retry,
        }
        # Whether the request may already be in the database (a retry, a redelivered
        # deferral): then leaving means withdrawing it.
        written = retry
        adopted = 0
        while True:
            # How long the request may still wait: in the queue, and for the row lock.
            remaining = None
            if waiting.deadline is not None:
                remaining = max(0.0, waiting.deadline.remaining_ms())
            params["wait_ms"] = remaining
            sent = Stamp()
            try:
                answer = self._call(
                    request,
                    statements.ACQUIRE,
                    params,
                    lock_ms=lock_timeout_ms(remaining),
                    busy_ok=True,
                    stamp=sent,
                    until=waiting.deadline,  # a dropped connection is retried while it lasts
                )
                break
            except RowBusyError as exc:
                # Nothing was done (a frozen holder of the row lock, a full pool).
                written = written or exc.maybe_done
                if waiting.deadline is not None and waiting.deadline.passed():
                    waiting.settled = True
                    if written:  # else nothing of ours to take back
                        self._withdraw_in_time(request, give_back=True)
                    raise self._timed_out(request, waiting.wait_ms) from None
                params["retry"] = written
            except ConcurrencyConfigError as exc:
                # Refused before anything was written: the stored limits were replaced.
                replaced = isinstance(exc.__cause__, LimitsReplacedError)
                if replaced and adopted < ADOPT_ATTEMPTS and self.use_stored_limits(request):
                    adopted += 1
                    params["config_hash"] = self._hash
                    continue
                raise
            except ConcurrencyLimiterError as exc:
                failed = exc.__cause__
                if isinstance(failed, CallFailedError) and not failed.maybe_done:
                    # No connection could be had, so nothing was done. A request with a
                    # budget keeps trying while it lasts (a database restart is a blip
                    # to it); one without fails closed after connect_timeout_ms.
                    if waiting.deadline is not None and not waiting.deadline.passed():
                        continue
                    waiting.settled = not written
                raise
        self.room.clock.sample(sent.at, float(answer["now"]))
        self._republish(answer.get("parked"))
        self._run_due_groups(answer)
        status = answer["s"]
        if status == "granted":
            return self._lease(request.request_id, waiting.workload, answer["lease"], sent.at)
        if status == "queued":
            self.room.queued(waiting.waiter)
            self.room.expiry_in(answer.get("expiry_ms"))
            if "ahead" in answer:  # a new place (a retry finding its row tells none)
                waiting.estimate = _estimate(answer)
                if waiting.park is not None:
                    waiting.park.estimated(waiting.estimate)
            return None
        if status == "duplicate":
            return Duplicate()
        if status in ("no-wait", "queue-full", "unknown-workload"):
            waiting.settled = True  # nothing was written
        if status == "no-wait":
            raise self._timed_out(request, waiting.wait_ms)
        if status == "queue-full":
            raise self._queue_full(request)
        raise request.error(
            ConcurrencyConfigError,
            f"limiter {self.name!r} has no workload {waiting.workload!r} in its stored limits",
            limiter=self.name,
        )

    def _step(self, waiting: _Waiting) -> Lease | AdmissionResult | None:
        """Act on what happened since the last look; ``None``: keep waiting."""
        request = waiting.request
        grant = waiting.waiter.grant
        if grant is not None:
            return self._granted(waiting, grant)
        if waiting.cancel is not None and waiting.cancel.is_set():
            self._withdraw_quietly(request)
            waiting.settled = True
            raise self._cancelled(request)
        if waiting.park is not None and waiting.park.until.passed():
            parked = self._park(waiting)
            if parked is not None:
                return parked
        if waiting.deadline is not None and waiting.deadline.passed():
            waiting.settled = True  # withdrawn now, or in the background
            answer = self._withdraw_in_time(request, give_back=False)
            if answer is not None and answer["s"] == "granted":
                # Allocation chose us just before the deadline: the grant wins.
                return self._lease(request.request_id, waiting.workload, answer["lease"], None)
            raise self._timed_out(request, waiting.wait_ms)
        if waiting.waiter.missing:
            # Our queue row was dropped (this process stalled past queue_entry_ttl_ms):
            # take a new place, with the time left.
            waiting.waiter.missing = False
            waiting.waiter.queued = False
            return self._send_acquire(waiting, retry=True)
        return None

    def _granted(self, waiting: _Waiting, grant: Grant) -> Lease:
        return self.granted_lease(waiting.request.request_id, waiting.workload, grant, waiting.sent)

    def _lease(
        self,
        request_id: str,
        workload: str,
        lease: Sequence[Any],
        sent: float | None,
        *,
        waited_ms: float | None = None,
    ) -> Lease:
        lease_id, token = lease
        return Lease(
            lease_id=str(lease_id),
            limiter=self.name,
            workload=workload,
            request_id=request_id,
            fencing_token=int(token),
            ttl_ms=self._config.lease_ttl_ms,
            valid_until=self._valid_until(sent) if sent is not None else None,
            waited_ms=waited_ms,
        )

    def _valid_until(self, start: float) -> Deadline:
        return Deadline(start + self._config.lease_ttl_ms / 1000 - self._margin_s)

    def _park(self, waiting: _Waiting) -> Lease | AdmissionResult | None:
        """Turn the waiting row into a parked one; ``None`` if it is gone.

        The operation id is made once, so the retry :func:`~.calls.call` sends after a
        lost reply gets the first attempt's answer: a grant made in between must not
        read as "missing".
        """
        assert waiting.park is not None
        request = waiting.request
        answer = self._call(
            request,
            statements.PARK,
            {
                "limiter": self.name,
                "request_id": request.request_id,
                "payload": waiting.park.payload,
                "broker": waiting.park.broker,
                "op_id": _op_id(),
            },
            lock_ms=lock_timeout_ms(None),
        )
        if answer["s"] == "parked":
            return Parked(
                limiter=self.name,
                workload=waiting.workload,
                estimate=waiting.estimate,
                waited_ms=(time.monotonic() - waiting.sent) * 1000,
            )
        if answer["s"] == "granted":
            return self._lease(request.request_id, waiting.workload, answer["lease"], None)
        # Neither waiting nor granted: let the next step ask again what it has (a new
        # place if need be) rather than try to park a row that is not there.
        waiting.waiter.missing = True
        return None

    def claim_parked(self, request_id: str, publication_id: str) -> Lease | ClaimMiss:
        """Take the lease granted to a parked request, from its re-published message.

        :returns: the lease, renewed, whose ``waited_ms`` is the request's whole wait
            (from its first ask, before it was parked, to this claim: database time);
            else ``"stale"`` when the request is still
            stored for another publication (this message is an outdated copy), or
            ``"missing"`` when nothing is stored for it (another copy claimed it, or it
            was withdrawn or failed). A retry after a lost reply gets the same answer.
        """
        params = {
            "limiter": self.name,
            "request_id": request_id,
            "publication_id": publication_id,
            "op_id": _op_id(),
        }
        sent = time.monotonic()  # before any attempt: the lease is renewed after it
        answer = self._call(None, statements.CLAIM_PARKED, params)
        status = answer["s"]
        if status == "claimed":
            waited = answer.get("waited_ms")
            return self._lease(
                request_id,
                str(answer["workload"]),
                answer["lease"],
                sent,
                waited_ms=None if waited is None else float(waited),
            )
        return "stale" if status == "stale" else "missing"

    # -- renew, release, withdraw, reap, stats -------------------------------------------

    def renew(self, lease: Lease) -> Lease | None:
        """Extend ``lease`` by its TTL (database time); ``None`` if no longer held."""
        return self.renew_many([lease])[lease.lease_id]

    def loss_reason(self, lease: Lease) -> str | None:
        """Why ``lease`` is no longer held, when an operator took it back:
        ``"force-released by alice"`` (:meth:`PostgresBackend.force_release
        <runcell_celery.postgres.PostgresBackend.force_release>`); ``None`` otherwise."""
        rows = self.fetch(statements.FORCE_RELEASED_BY, {"lease_id": lease.lease_id})
        return f"force-released by {rows[0][0]}" if rows and rows[0][0] else None

    def renew_many(self, leases: Sequence[Lease]) -> Mapping[str, Lease | None]:
        """Renew several leases of this limiter in one statement."""
        if not leases:
            return {}
        sent = Stamp()
        params = {"limiter": self.name, "lease_ids": [lease.lease_id for lease in leases]}
        renewed = set(self._call(None, statements.RENEW, params, rows=True, stamp=sent))
        valid_until = self._valid_until(sent.at)
        return {
            lease.lease_id: (
                Lease(
                    lease.lease_id,
                    lease.limiter,
                    lease.workload,
                    lease.request_id,
                    lease.fencing_token,
                    lease.ttl_ms,
                    valid_until,
                )
                if lease.lease_id in renewed
                else None
            )
            for lease in leases
        }

    def release(self, lease: Lease, outcome: Outcome = "success") -> None:
        """Return the slot and hand it to the next waiters by the allocation rules."""
        params = {"limiter": self.name, "lease_id": lease.lease_id}
        # A release has no budget of its own: a dropped connection is retried while the
        # lease is still valid here (past that its TTL returns the slot anyway), never
        # for the rest of the run's budget (the task's result would wait for it).
        until = lease.valid_until or Deadline.after_ms(self._db.timeout * 1000)
        for attempt in range(RELEASE_ATTEMPTS):
            try:
                answer = self._call(None, statements.RELEASE, params, busy_ok=True, until=until)
            except RowBusyError:
                if attempt + 1 < RELEASE_ATTEMPTS:
                    continue
                raise _limiter_error(self.name, "the limiter row stayed locked") from None
            if answer.get("g"):
                # Waiters of this process that the release granted start now; the
                # others learn it from their notification.
                self.room.dispatch_grants(answer["t"], answer["g"])
            self._republish(answer.get("parked"))
            self._run_due_groups(answer)
            return

    def withdraw(self, request_id: str) -> None:
        """Take a request out of the queue (parked or waiting) and give back any slot
        it was granted; used when its run ends before it uses its place."""
        params = {
            "limiter": self.name,
            "request_id": request_id,
            "give_back": True,
            "op_id": _op_id(),  # a retry re-publishes what the first attempt granted
        }
        answer = self._call(None, statements.WITHDRAW, params, lock_ms=lock_timeout_ms(None))
        self._republish(answer.get("parked"))

    def _withdraw_in_time(
        self, request: AcquireRequest, *, give_back: bool
    ) -> Mapping[str, Any] | None:
        """Withdraw a request whose wait ended, waiting for the row at most
        :data:`~.calls.WITHDRAW_GRACE_MS`; the answer, or ``None`` when the row stayed
        locked: this process's room withdraws it later then, giving back any grant.
        A grant made just before (``give_back=False``) is in the answer."""
        params = {
            "limiter": self.name,
            "request_id": request.request_id,
            "give_back": give_back,
            "op_id": None,  # repeating it gives the same outcome: nothing to record
        }
        try:
            answer = self._call(
                request, statements.WITHDRAW, params, lock_ms=WITHDRAW_GRACE_MS, busy_ok=True
            )
        except RowBusyError:
            self.room.withdraw_later(functools.partial(self.withdraw, request.request_id))
            return None
        self._republish(answer.get("parked"))
        return cast(Mapping[str, Any], answer)

    def _withdraw_quietly(self, request: AcquireRequest) -> None:
        try:
            self.withdraw(request.request_id)
        except ConcurrencyError as exc:  # the row is dropped with the process later
            logger.warning("runcell: withdrawing %s failed: %s", request.request_id, exc)

    def reap(self) -> None:
        """Run one allocation pass: reap expired leases and abandoned queue rows, and
        grant what frees (the waiting room and the sweeper call it). For a keyed
        limiter: a pass on each of its keys that has an expired lease (the sweeper
        knows only the keyed limiter's name; a key's parked tasks wait on the key)."""
        if self._config.keyed:
            self._key_set().reap_expired()
            return
        parked = self._call(
            None, statements.REAP, {"limiter": self.name}, lock_ms=lock_timeout_ms(None)
        )
        self._republish(parked)

    def stats(self, *, per_key: bool = False, limit: int | None = 100) -> LimiterStats:
        """Slots held and requests waiting, in total and per workload, as allocation
        counts them (a crashed holder's slot counts until its lease is reaped). For a
        keyed limiter: over every key, and with ``per_key=True`` the keys in use too
        (:meth:`key_stats`, at most ``limit``)."""
        if self._config.keyed:
            return self._key_set().totals(per_key=per_key, limit=limit)
        with _failing_closed(self, None), self._db.connection() as conn:
            row = conn.execute(statements.STATS, {"limiter": self.name}).fetchone()
        names: list[str] = list(self._config.workloads)
        active: dict[str, int] = {}
        queued: dict[str, int] = {}
        if row is not None:
            workloads, held, waiting = row
            for i, name in enumerate(workloads or ()):
                active[name] = int(held[i]) if held and i < len(held) else 0
                queued[name] = int(waiting[i]) if waiting and i < len(waiting) else 0
                if name not in names:
                    names.append(name)
        return LimiterStats(
            active=sum(active.values()),
            queued=sum(queued.values()),
            workloads={
                w: WorkloadStats(active=active.get(w, 0), queued=queued.get(w, 0)) for w in names
            },
        )

    @property
    def listening(self) -> bool | None:
        """Whether waiters of this process are woken by ``LISTEN/NOTIFY``.

        ``None`` until the listener has checked itself; ``False`` when polling alone.
        """
        listener = self.room.listener
        if listener is None:
            return False
        listener.start()  # asking starts it, as a first waiter would
        return listener.available

    # -- plumbing -----------------------------------------------------------------------

    def _republish(self, lease_ids: Any) -> None:
        if not lease_ids or self._on_parked_granted is None:
            return
        try:
            self._on_parked_granted([str(lease_id) for lease_id in lease_ids])
        except Exception:  # listeners and the sweeper re-publish them later
            logger.exception("runcell: re-publishing granted parked tasks failed")

    def _call(
        self,
        request: AcquireRequest | None,
        query: LiteralString,
        params: Mapping[str, Any],
        *,
        lock_ms: int = LOCK_WAIT_CAP_MS,
        rows: bool = False,
        busy_ok: bool = False,
        stamp: Stamp | None = None,
        until: Deadline | None = None,
    ) -> Any:
        with _failing_closed(self, request, busy_ok=busy_ok):
            return call(
                self._db, query, params, lock_timeout_ms=lock_ms, rows=rows, stamp=stamp,
                until=until,
            )  # fmt: skip


@contextlib.contextmanager
def _failing_closed(
    limiter: PostgresConcurrencyLimiter,
    request: AcquireRequest | None,
    *,
    busy_ok: bool = False,
) -> Iterator[None]:
    """Turn database failures into :class:`ConcurrencyLimiterError` (or a config error)
    naming the limiter and the request; ``busy_ok`` lets :class:`RowBusyError` through."""
    try:
        yield
    except ConcurrencyError:
        raise
    except RowBusyError:
        if busy_ok:
            raise
        error: ConcurrencyError = _limiter_error(limiter.name, "the limiter row stayed locked")
        raise _for(error, request, limiter.name) from None
    except LimitsReplacedError as exc:
        error = ConcurrencyConfigError(
            f"the limits of limiter {limiter.name!r} were replaced by another worker; "
            "restart this worker with the new limits (with on_conflict='use_stored' it "
            "would work on the stored limits instead)",
            limiter=limiter.name,
        )
        raise _for(error, request, limiter.name) from exc
    except LimiterMissingError as exc:
        error = _limiter_error(
            limiter.name,
            "it is not registered in the database (its row was deleted?); "
            "restart the workers to register it",
        )
        raise _for(error, request, limiter.name) from exc
    except (CallFailedError, psycopg.Error, PoolTimeout) as exc:
        error = _limiter_error(limiter.name, f"the database failed: {exc}")
        raise _for(error, request, limiter.name) from exc


def _limiter_error(name: str, what: str) -> ConcurrencyLimiterError:
    return ConcurrencyLimiterError(f"limiter {name!r}: {what}", limiter=name)


def _for(error: ConcurrencyError, request: AcquireRequest | None, name: str) -> ConcurrencyError:
    return error if request is None else request.error(type(error), error.message, limiter=name)


def _nothing() -> None:
    return None


def _estimate(answer: Mapping[str, Any]) -> WaitEstimate:
    """The wait estimate of a queued acquire's answer."""
    hold_ms = answer.get("hold_ms")
    return WaitEstimate(
        ahead=int(answer["ahead"]),
        hold_ms=float(hold_ms) if hold_ms is not None else None,
        slots=int(answer.get("slots") or 0),
    )


def _place(estimate: WaitEstimate | None) -> QueuePlace | None:
    """A queued request's place, from its acquire's answer (``None``: the answer told
    none, as a retry that found its row already waiting)."""
    if estimate is None:
        return None
    return QueuePlace(place=estimate.place, expected_wait_ms=estimate.expected_ms)


def _op_id() -> str:
    """A new operation id: one per operation, the same for each of its attempts."""
    return str(uuid.uuid4())
