"""The PostgreSQL limiter: one limit shared by every worker on every host.

Every operation is one call of a function in ``schema.sql`` (one round trip, one
transaction) over the request's *members*, the limiter rows it needs, locked in name
order (so two requests naming the same limiters in any order cannot deadlock):

* **acquire** grants at once when, in every member, nobody of the request's workload
  waits and the workload has room; else it queues one row per member and holds
  nothing. A single limiter is a group of one, whose row is named by the request id
  (the SQL's fast path); a member of several is ``"<request id>|<limiter>"``.
* **release** frees the slot and grants the next waiters in the same transaction,
  notifying each waiting process on its own channel with the leases.
* a waiting request waits in its process's :class:`~.waiting.WaitRoom` at no cost to
  the database; when its wait ends it **withdraws** under the locks (a grant made at
  that moment wins; a cancelled request gives it back).

Allocation never grants one member of several by itself: a member first in line in
every limiter of its request has its slot set aside, and the transaction that found it
tells its caller to run the request's *group pass* (``runcell_grant_request``), which
grants all its members together. The waiting process runs that pass itself now and
then (:data:`GROUP_PASS_S`), so a pass a releaser could not run is late, never lost.
The rules are :func:`runcell_celery.allocation.allocate`'s. Errors fail closed.
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
from dataclasses import replace
from typing import Any, LiteralString

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
    Member,
    OnWait,
    Outcome,
    QueuePlace,
    announce_wait,
    wants_place,
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
    reap_limiter,
)
from .connection import Database
from .engine import Engine, HasEngine
from .keyed import PURGE_BATCH, KeySet, counted_stats
from .options import OnConflict, PostgresOptions
from .parking import ParkRule
from .registration import (
    Stored,
    StoredLimits,
    announce_stored_limits,
    config_hash,
    read_stored_limits,
    store_limits,
)
from .waiting import Waiter, WaitRoom

logger = logging.getLogger("runcell_celery.postgres")

#: What :meth:`PostgresConcurrencyLimiter.acquire_or_park` may answer besides leases.
AdmissionResult = Parked | Duplicate
_Result = tuple[Lease, ...] | AdmissionResult

#: A lease is taken as lost this much before its TTL would end on the database, so a
#: pause or a slow clock never lets a body run on a lease another holder already has.
MAX_SAFETY_MARGIN_MS = 1_000
#: A release blocked this many times by a busy row gives up (the lease then expires).
RELEASE_ATTEMPTS = 3
#: An acquire takes the stored limits at most this many times (``use_stored``).
ADOPT_ATTEMPTS = 3
#: How often a process waiting on several limiters runs its request's group pass
#: itself (seconds), besides the passes releasers run when they find it first in line.
GROUP_PASS_S = 1.0


def member_id(request_id: str, limiter: str, members: int) -> str:
    """The queue row and lease request id of a request's slot in one limiter."""
    return request_id if members == 1 else f"{request_id}|{limiter}"


class _Asked:
    """One request over its members (in lock order) while it is asked for and waits."""

    def __init__(
        self,
        limiters: list[PostgresConcurrencyLimiter],
        requests: list[AcquireRequest],
        workloads: list[str],
        order: list[int],
        cancel: CancellationToken | None,
        park: ParkRule | None,
    ) -> None:
        self.limiters = limiters
        self.names = [x.name for x in limiters]
        self.array = _array(self.names)
        self.several = len(limiters) > 1
        self.requests = requests
        self.lead = requests[0]
        self.workloads = workloads
        #: Where each member stands in the caller's order.
        self.order = order
        self.ids = [member_id(self.request_id, x.name, len(limiters)) for x in limiters]
        waits = [x._wait_ms(r, w) for x, r, w in zip(limiters, requests, workloads, strict=True)]
        given = [w for w in waits if w is not None]
        self.wait_ms = min(given) if given else None
        self.deadline = Deadline.after_ms(self.wait_ms) if self.wait_ms is not None else None
        self.cancel = cancel
        self.park = park
        self.sent = self.last_pass = time.monotonic()
        self.waiters: list[Waiter] = []
        #: Each unregisters a wake-up of its waiters by its cancellation (see ``_begin``).
        self.unlinks: list[Callable[[], None]] = []
        #: What the acquire said of its wait (one member), or of each line (several,
        #: asked only for a tracer that records the place).
        self.estimate: WaitEstimate | None = None
        self.lines: list[WaitEstimate] | None = None
        #: Nothing is left in the database for it but what it returned (or what the
        #: room withdraws in the background): no withdrawal on the way out.
        self.settled = False

    @property
    def request_id(self) -> str:
        return self.lead.request_id

    def remaining_ms(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline.remaining_ms())

    def pause_s(self) -> float | None:
        """How long to sleep before something is due (``None``: until woken)."""
        park = self.park.until if self.park is not None else None
        due = [d.remaining_s() for d in (self.deadline, park) if d is not None]
        if self.several:
            due.append(GROUP_PASS_S - (time.monotonic() - self.last_pass))
        return max(0.0, min(due)) if due else None

    def waiter(self) -> Waiter:
        """The waiter to sleep on: the first not granted yet."""
        return next((w for w in self.waiters if w.grant is None), self.waiters[0])

    def place(self) -> QueuePlace | None:
        """Its place: the largest of its lines' (it is granted when every line lets it
        through), with the longest expected wait when every line has one."""
        lines = self.lines or ([self.estimate] if self.estimate is not None else None)
        if not lines:
            return None
        expected = [line.expected_ms for line in lines]
        known = [ms for ms in expected if ms is not None]
        return QueuePlace(
            place=max(line.place for line in lines),
            expected_wait_ms=max(known) if len(known) == len(expected) else None,
        )

    def leases(self, pairs: Sequence[Any], sent: float | None) -> tuple[Lease, ...]:
        """The leases of an answer (``[[lease_id, token], ...]`` in lock order)."""
        return tuple(
            x._lease(rid, w, pair, sent)
            for x, rid, w, pair in zip(self.limiters, self.ids, self.workloads, pairs, strict=True)
        )

    def granted(self) -> tuple[Lease, ...] | None:
        """Its leases once every member was told of its grant, else ``None``."""
        if any(w.grant is None for w in self.waiters):
            return None
        return tuple(
            x._granted(w, workload, self.sent)
            for x, w, workload in zip(self.limiters, self.waiters, self.workloads, strict=True)
        )

    def member(self, name: object) -> tuple[PostgresConcurrencyLimiter, AcquireRequest, str]:
        i = next((i for i, x in enumerate(self.limiters) if x.name == name), 0)
        return self.limiters[i], self.requests[i], self.workloads[i]

    def for_caller(self, result: _Result) -> _Result:
        return _for_caller(self.order, result) if isinstance(result, tuple) else result


class PostgresConcurrencyLimiter(ConfiguredLimiter):
    """Slots shared through PostgreSQL by every process that uses the same name (made by
    ``PostgresBackend.create_limiter`` or :func:`create_postgres_concurrency_limiter`).
    """

    def __init__(
        self,
        engines: HasEngine,
        config: LimiterConfig,
        options: PostgresOptions,
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
        """Its backend, which gives each process its engine."""
        return self._engines

    @property
    def _engine(self) -> Engine:
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
    def keeper(self) -> LeaseKeeper:
        """The lease keeper of its backend in this process (renews its held slots)."""
        return self._engine.keeper

    @property
    def release_executor(self) -> Executor:
        """Where an ``async with slot(...)`` exit runs its release: off the event loop."""
        return self._engine.executor

    def close(self) -> None:
        """Close the backend this limiter owns (one made by
        :func:`create_postgres_concurrency_limiter`); a backend's limiter leaves that
        to ``backend.close()``."""
        if self._owns_backend:
            self._engines.close()

    @property
    def stored_hash(self) -> str:
        """The checksum of the stored limits this limiter checks at every operation."""
        return self._hash

    @property
    def given_config(self) -> LimiterConfig:
        """The limits this limiter was created with (``config`` is what it works on)."""
        return self._given

    def use_stored_limits(self, request: AcquireRequest | None = None) -> bool:
        """Under ``on_conflict="use_stored"``, take the stored limits as this limiter's own
        (another worker replaced them); return whether they were taken.
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

    def key(self, key: str) -> PostgresConcurrencyLimiter:
        """The limiter of ``key`` of this keyed limiter (its row appears on first use).

        :raises ConcurrencyConfigError: this limiter is not keyed, or the key is invalid.
        """
        return self._key_set().get(key)

    def purge_idle_keys(self, limit: int = PURGE_BATCH) -> int:
        """Delete up to ``limit`` idle keys now; return how many went."""
        return self._key_set().purge(limit)

    def key_stats(self, limit: int | None = 100, *, search: str | None = None) -> list[KeyStats]:
        """The keys in use, busiest first, at most ``limit`` (``None``: all);
        ``search``: only keys containing it (any case)."""
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

    def register(self, *, ensure: bool = True, on_conflict: OnConflict = "error") -> None:
        """Create the schema if asked, then store the limits or check the stored ones.

        :raises ConcurrencyConfigError: the stored limits differ, or the tables are missing.
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

        with _failing_closed(self, None):
            stored = persist(patience, attempt)
        if stored.adopted is not None:
            self._take(stored.adopted, None)
        if stored.allocated:
            # New limits granted waiting requests: their processes were notified;
            # parked tasks and requests over several limiters are ours to move on.
            self._moved_on(stored.allocated)

    def acquire(
        self,
        request: AcquireRequest,
        *,
        cancel: CancellationToken | None = None,
        on_wait: OnWait | None = None,
    ) -> Lease:
        """Wait for a slot; see :class:`~runcell_celery.protocol.ConcurrencyLimiter`."""
        return self.acquire_members((Member(self, request),), cancel=cancel, on_wait=on_wait)[0]

    def acquire_members(
        self,
        members: Sequence[Member],
        *,
        cancel: CancellationToken | None = None,
        on_wait: OnWait | None = None,
    ) -> tuple[Lease, ...]:
        """One slot in every member's limiter (all of this database), granted together;
        see :class:`~runcell_celery.protocol.SupportsMembers`."""
        result = self._admit(members, cancel, on_wait, park=None)
        assert isinstance(result, tuple)  # it parks only when asked to
        return result

    def acquire_or_park(
        self,
        members: Sequence[Member],
        *,
        payload: str,
        broker: str | None = None,
        admission_wait_ms: float | None = None,
        defer_after_ms: float = DEFAULT_DEFER_AFTER_MS,
        cancel: CancellationToken | None = None,
        on_wait: OnWait | None = None,
    ) -> _Result:
        """Wait for the slots while waiting is cheaper than parking, then park the request
        (:class:`~runcell_celery.ports.SupportsParking`): a one-limiter request whose expected
        wait exceeds ``defer_after_ms`` parks at once. Parked, it keeps its place in every
        line with ``payload`` and is re-published once all its slots are granted.
        """
        park = ParkRule.of(payload, admission_wait_ms, defer_after_ms, broker)
        return self._admit(members, cancel, on_wait, park=park)

    async def acquire_members_async(
        self,
        members: Sequence[Member],
        *,
        cancel: CancellationToken | None = None,
        on_wait: OnWait | None = None,
    ) -> tuple[Lease, ...]:
        """:meth:`acquire_members` in the event loop: the wait occupies no thread. The
        round trips run in this process's ``runcell-db`` threads (never the loop's
        default executor); the wait is a future the process's listener resolves."""
        loop = asyncio.get_running_loop()
        asked = self._begin(members, cancel, None, loop)
        executor = self._engine.executor
        try:
            result = await loop.run_in_executor(executor, self._first, asked, on_wait)
            while result is None:
                await asked.waiter().wait_async(asked.pause_s())
                result = await loop.run_in_executor(executor, self._step, asked)
            asked.settled = True
            leases = asked.for_caller(result)
            assert isinstance(leases, tuple)
            return leases
        finally:
            self._leave(asked, withdraw=False)
            if not asked.settled:
                # Leave every line; slots granted meanwhile are given back, never leaked.
                await asyncio.shield(loop.run_in_executor(executor, self._withdraw_quietly, asked))

    def _admit(
        self,
        members: Sequence[Member],
        cancel: CancellationToken | None,
        on_wait: OnWait | None,
        *,
        park: ParkRule | None,
    ) -> _Result:
        asked = self._begin(members, cancel, park, None)
        try:
            result = self._first(asked, on_wait)
            while result is None:
                asked.waiter().wait(asked.pause_s())
                result = self._step(asked)
            asked.settled = True
            return asked.for_caller(result)
        finally:
            # Interrupted (SIGTERM of a revoked task, KeyboardInterrupt) or failed:
            # leave every line; a slot granted meanwhile is given back, never leaked.
            self._leave(asked, withdraw=True)

    def _begin(
        self,
        members: Sequence[Member],
        cancel: CancellationToken | None,
        park: ParkRule | None,
        loop: asyncio.AbstractEventLoop | None,
    ) -> _Asked:
        own = self._own([m.limiter for m in members])
        order = [0] if len(own) == 1 else sorted(range(len(own)), key=lambda i: own[i].name)
        limiters = [own[i] for i in order]
        requests = [members[i].request for i in order]
        workloads = []
        for limiter, request in zip(limiters, requests, strict=True):
            if limiter._config.keyed:
                raise request.error(
                    ConcurrencyConfigError,
                    f"limiter {limiter.name!r} is keyed: a slot names one of its keys, "
                    f"{limiter.name}.key(...), not the keyed limiter itself",
                    limiter=limiter.name,
                )
            workloads.append(limiter._resolve(request))
        if cancel is not None and cancel.is_set():
            raise self._cancelled(requests[0])
        asked = _Asked(limiters, requests, workloads, order, cancel, park)
        # Registered before the request is sent, so a grant that arrives before the
        # answer finds its waiter.
        room = self.room
        asked.waiters = [
            room.add(rid, x.name, loop, reap=x.reap)
            for rid, x in zip(asked.ids, limiters, strict=True)
        ]
        if cancel is not None:  # cancelling wakes every waiter
            asked.unlinks = [cancel.add_callback(w.wake) for w in asked.waiters]
        return asked

    def _own(self, limiters: Sequence[ConcurrencyLimiter]) -> list[PostgresConcurrencyLimiter]:
        """``limiters`` as limiters of this database, or a configuration error."""
        if len(limiters) == 1 and limiters[0] is self:
            return [self]
        names = [getattr(limiter, "name", repr(limiter)) for limiter in limiters]
        own = [x for x in limiters if isinstance(x, PostgresConcurrencyLimiter)]
        conninfo = self._db.conninfo
        if len(own) != len(limiters) or any(x._db.conninfo != conninfo for x in own):
            raise ConcurrencyConfigError(
                "limiters " + ", ".join(repr(n) for n in names) + " cannot be held together: "
                "several PostgreSQL limiters in one slot must share one database",
                limiter=self.name,
            )
        if len(set(names)) != len(names):
            raise ConcurrencyConfigError(
                f"limiters {names!r} name one limiter twice", limiter=self.name
            )
        return own

    def _leave(self, asked: _Asked, *, withdraw: bool) -> None:
        for unlink in asked.unlinks:
            unlink()
        for waiter in asked.waiters:
            self.room.remove(waiter)
        if withdraw and not asked.settled:
            self._withdraw_quietly(asked)

    def _first(self, asked: _Asked, on_wait: OnWait | None) -> _Result | None:
        """Send the acquire; the leases, or ``None`` when the request now waits. A
        deferrable request may have been written already (a lost reply): it asks as a
        retry, which also finds a parked grant that is not its to take."""
        with_lines = asked.several and wants_place(on_wait)
        result = self._ask(asked, retry=asked.park is not None, with_lines=with_lines)
        if result is not None:
            return result
        deadline = asked.deadline.to_unix() if asked.deadline is not None else None
        announce_wait(on_wait, deadline, asked.place)
        return self._step(asked)

    def _ask(self, asked: _Asked, *, retry: bool, with_lines: bool = False) -> _Result | None:
        """Send the acquire; the leases when granted at once, ``None`` when it waits,
        :class:`~runcell_celery.ports.Duplicate` when a retry finds it parked and
        granted (its own re-published message carries it)."""
        lead = asked.lead
        room = self.room
        lineage = lead.lineage
        asking = {"request_id": lead.request_id, "run_id": lineage.run_id,
                   "root_run_id": lineage.root_run_id, "parent_run_id": lineage.parent_run_id,
                   "holder_name": lead.holder_name, "in_progress": lead.in_progress,
                   "key": lead.key}  # fmt: skip
        params: dict[str, Any] = {
            "limiters": asked.array,
            "hashes": _array([x._hash for x in asked.limiters]),
            "workloads": _array(asked.workloads),
            "request": json.dumps(asking),
            "process": room.process,
            "retry": retry,
        }
        query = statements.ACQUIRE_WITH_LINES if with_lines else statements.ACQUIRE
        # Whether the request may already be in the database (a retry, a redelivered
        # deferral): then leaving means withdrawing it.
        written = retry
        adopted = 0
        while True:
            remaining = params["wait_ms"] = asked.remaining_ms()
            sent = Stamp()
            try:
                # A dropped connection is retried while its deadline lasts.
                answer = self._call(lead, query, params, lock_ms=lock_timeout_ms(remaining),
                                    busy_ok=True, stamp=sent, until=asked.deadline)  # fmt: skip
                break
            except RowBusyError as exc:
                # Nothing was done (a frozen holder of a row lock, a full pool).
                written = written or exc.maybe_done
                if asked.deadline is not None and asked.deadline.passed():
                    asked.settled = True
                    if written:  # else nothing of ours to take back
                        self._withdraw_in_time(asked, give_back=True)
                    raise self._timed_out(lead, asked.wait_ms) from None
                params["retry"] = written
            except ConcurrencyConfigError as exc:
                # Refused before anything was written: some stored limits were replaced.
                # Under on_conflict="use_stored" each takes its stored limits and asks again.
                pairs = zip(asked.limiters, asked.requests, strict=True)
                replaced = isinstance(exc.__cause__, LimitsReplacedError)
                if (
                    replaced
                    and adopted < ADOPT_ATTEMPTS
                    and all(x.use_stored_limits(r) for x, r in pairs)
                ):
                    adopted += 1
                    params["hashes"] = _array([x._hash for x in asked.limiters])
                    continue
                raise
            except ConcurrencyLimiterError as exc:
                failed = exc.__cause__
                if isinstance(failed, CallFailedError) and not failed.maybe_done:
                    # No connection could be had, so nothing was done. A request with a
                    # budget keeps trying while it lasts (a database restart is a blip
                    # to it); one without fails closed after connect_timeout_ms.
                    if asked.deadline is not None and not asked.deadline.passed():
                        continue
                    asked.settled = not written
                raise
        room.clock.sample(sent.at, float(answer["now"]))
        self._moved_on(answer)
        status = answer["s"]
        if status == "granted":
            return asked.leases(answer["leases"], sent.at)
        if status == "duplicate":
            return Duplicate()
        if status == "queued":
            for waiter in asked.waiters:
                room.queued(waiter)
            room.expiry_in(answer.get("expiry_ms"))
            if "ahead" in answer:  # a new place (a retry finding its row tells none)
                hold_ms, slots = answer.get("hold_ms"), answer.get("slots")
                asked.estimate = _estimate(answer["ahead"], hold_ms, slots)
                if asked.park is not None:
                    asked.park.estimated(asked.estimate)
            if "lines" in answer:
                asked.lines = _lines(answer["lines"])
            if asked.several:
                # Others of its lines wait ahead of it, but they may all be requests
                # over several limiters waiting elsewhere: its group pass tells at once.
                with contextlib.suppress(ConcurrencyError):
                    self._group_pass(asked.request_id, asked)
            return None
        asked.settled = True  # refused: nothing of it is left in the database
        limiter, request, workload = asked.member(answer.get("limiter"))
        if status == "no-wait":
            raise self._timed_out(lead, asked.wait_ms)
        if status == "queue-full":
            raise limiter._queue_full(request)
        raise request.error(
            ConcurrencyConfigError,
            f"limiter {limiter.name!r} has no workload {workload!r} in its stored limits",
            limiter=limiter.name,
        )

    def _step(self, asked: _Asked) -> _Result | None:
        """Act on what happened since the last look; ``None``: keep waiting."""
        leases = asked.granted()
        if leases is not None:
            return leases
        if asked.cancel is not None and asked.cancel.is_set():
            asked.settled = True  # withdrawn now, or in the background
            with contextlib.suppress(ConcurrencyError):
                self._withdraw_in_time(asked, give_back=True)
            raise self._cancelled(asked.lead)
        if asked.park is not None and asked.park.until.passed():
            parked = self._park(asked)
            if parked is not None:
                return parked
        if asked.deadline is not None and asked.deadline.passed():
            asked.settled = True  # withdrawn now, or in the background
            leases = self._withdraw_in_time(asked, give_back=False)
            if leases is not None:
                return leases  # allocation chose it just before the deadline: the grant wins
            raise self._timed_out(asked.lead, asked.wait_ms)
        if any(w.missing for w in asked.waiters):
            # Its rows were dropped (this process stalled past queue_entry_ttl_ms):
            # take a new place, with the time left.
            for waiter in asked.waiters:
                waiter.missing = waiter.queued = False
            return self._ask(asked, retry=True)
        if asked.several and time.monotonic() - asked.last_pass >= GROUP_PASS_S:
            self._group_pass(asked.request_id, asked)
            asked.last_pass = time.monotonic()
            return asked.granted()
        return None

    def _park(self, asked: _Asked) -> _Result | None:
        """Park the waiting request as one (every member keeps its place); ``None`` when
        not all of it waits any more. The operation id is made once: a retry after a lost
        reply gets the first answer (a grant made in between must not read as "missing").
        """
        assert asked.park is not None
        params = {
            "limiters": asked.array,
            "request_id": asked.request_id,
            "payload": asked.park.payload,
            "broker": asked.park.broker,
            "op_id": _op_id(),
        }
        answer = self._call(asked.lead, statements.PARK, params, lock_ms=lock_timeout_ms(None))
        if answer["s"] == "parked":
            return Parked(
                limiter=" + ".join(asked.names),
                workload=asked.workloads[0],
                estimate=asked.estimate,
                waited_ms=(time.monotonic() - asked.sent) * 1000,
            )
        if answer["s"] == "granted":
            return asked.leases(answer["leases"], None)
        for waiter in asked.waiters:
            waiter.missing = True
        return None

    def _group_pass(self, group_id: str, asked: _Asked | None = None) -> None:
        """Run one request's group pass, waiting for its rows no longer than its budget
        (rows that stay locked: the next pass tries again); wake this process's
        members it granted, re-publish a parked request's task."""
        remaining = asked.remaining_ms() if asked is not None else None
        try:
            answer = self._call(
                asked.lead if asked is not None else None,
                statements.ALLOCATE_GROUP,
                {"group_id": group_id},
                lock_ms=lock_timeout_ms(remaining),
                busy_ok=True,
            )
        except RowBusyError:
            return
        if answer and answer.get("g"):
            self.room.dispatch_grants(answer["t"], answer["g"])
        if answer:
            self._republish(answer.get("parked"))

    def _moved_on(self, answer: Mapping[str, Any]) -> None:
        """Re-publish the parked tasks an operation granted, and run the group pass of each
        request it found first in line everywhere (``"grp"``); a failure only delays it.
        """
        self._republish(answer.get("parked"))
        for group_id in answer.get("grp") or ():
            try:
                self._group_pass(str(group_id))
            except ConcurrencyError as exc:
                logger.info("runcell: the group pass of %s failed: %s", group_id, exc)

    def _granted(self, waiter: Waiter, workload: str, sent: float) -> Lease:
        """A lease a notification (or a release) granted: valid for its TTL from the
        grant's database time turned into local time (erring early), or from ``sent``
        when the clock has no sample yet."""
        grant = waiter.grant
        assert grant is not None
        start = self.room.clock.local(grant.granted_at)
        lease = (grant.lease_id, grant.fencing_token)
        return self._lease(waiter.request_id, workload, lease, sent if start is None else start)

    def _lease(
        self,
        request_id: str,
        workload: str,
        lease: Sequence[Any],
        sent: float | None,
        *,
        waited_ms: float | None = None,
    ) -> Lease:
        lease_id, token = lease[:2]
        valid_until = self._valid_until(sent) if sent is not None else None
        ttl_ms = self._config.lease_ttl_ms
        return Lease(str(lease_id), self.name, workload, request_id, int(token), ttl_ms,
                     valid_until, waited_ms)  # fmt: skip

    def _valid_until(self, start: float) -> Deadline:
        return Deadline(start + self._config.lease_ttl_ms / 1000 - self._margin_s)

    def claim_parked(
        self, limiters: Sequence[ConcurrencyLimiter], request_id: str, publication_id: str
    ) -> tuple[Lease, ...] | ClaimMiss:
        """Take every lease granted to a parked request, from its re-published message.

        :returns: the leases, renewed, in ``limiters``' order (``waited_ms``: the whole wait
            from the first ask); ``"stale"`` (still stored for another publication) or
            ``"missing"`` (claimed by another copy, withdrawn or failed). Idempotent.
        """
        own = self._own(limiters)
        order = sorted(range(len(own)), key=lambda i: own[i].name)
        ordered = [own[i] for i in order]
        params = {
            "limiters": _array([x.name for x in ordered]),
            "request_id": request_id,
            "publication_id": publication_id,
            "op_id": _op_id(),
        }
        sent = time.monotonic()  # before any attempt: the leases are renewed after it
        answer = self._call(None, statements.CLAIM_PARKED, params)
        status = answer["s"]
        if status != "claimed":
            return "stale" if status == "stale" else "missing"
        waited = answer.get("waited_ms")
        leases = [
            x._lease(
                member_id(request_id, x.name, len(ordered)),
                str(workload),
                (lease, token),
                sent,
                waited_ms=None if waited is None else float(waited),
            )
            for x, (lease, token, workload) in zip(ordered, answer["leases"], strict=True)
        ]
        return _for_caller(order, leases)

    def renew(self, lease: Lease) -> Lease | None:
        """Extend ``lease`` by its TTL (database time); ``None`` if no longer held."""
        return self.renew_many([lease])[lease.lease_id]

    def loss_reason(self, lease: Lease) -> str | None:
        """Why ``lease`` is no longer held, when an operator took it back:
        ``"force-released by alice"``; ``None`` otherwise."""
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
                replace(lease, valid_until=valid_until, waited_ms=None)
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
            self._moved_on(answer)
            return

    def withdraw_members(self, limiters: Sequence[ConcurrencyLimiter], request_id: str) -> None:
        """Take a request out of every line (parked or waiting) and give back any slot
        it was granted; used when its run ends before it uses its place."""
        params = {
            "limiters": _array(sorted(x.name for x in self._own(limiters))),
            "request_id": request_id,
            "give_back": True,
            "op_id": _op_id(),  # a retry re-publishes what the first attempt granted
        }
        answer = self._call(None, statements.WITHDRAW, params, lock_ms=lock_timeout_ms(None))
        self._republish(answer.get("parked"))

    def _withdraw_in_time(self, asked: _Asked, *, give_back: bool) -> tuple[Lease, ...] | None:
        """Withdraw a request whose wait ended, waiting for its rows at most
        :data:`~.calls.WITHDRAW_GRACE_MS` (longer: the room withdraws it later); a grant made
        just before is returned unless ``give_back``.
        """
        params = {
            "limiters": asked.array,
            "request_id": asked.request_id,
            "give_back": give_back,
            "op_id": None,  # repeating it gives the same outcome: nothing to record
        }
        try:
            answer = self._call(
                asked.lead, statements.WITHDRAW, params, lock_ms=WITHDRAW_GRACE_MS, busy_ok=True
            )
        except RowBusyError:
            later = functools.partial(self.withdraw_members, asked.limiters, asked.request_id)
            self.room.withdraw_later(later)
            return None
        self._republish(answer.get("parked"))
        return asked.leases(answer["leases"], None) if answer["s"] == "granted" else None

    def _withdraw_quietly(self, asked: _Asked) -> None:
        try:
            self.withdraw_members(asked.limiters, asked.request_id)
        except ConcurrencyError as exc:  # the rows are dropped with the process later
            logger.warning("runcell: withdrawing %s failed: %s", asked.request_id, exc)

    def reap(self) -> None:
        """Run one allocation pass: reap expired leases and abandoned queue rows, and
        grant what frees (the waiting room and the sweeper call it). For a keyed
        limiter: a pass on each of its keys that has an expired lease."""
        if self._config.keyed:
            self._key_set().reap_expired()
            return
        with _failing_closed(self, None):
            parked = reap_limiter(self._db, self.name)
        self._republish(parked)

    def stats(self, *, per_key: bool = False, limit: int | None = 100) -> LimiterStats:
        """Slots held and requests waiting, in total and per workload, as allocation
        counts them. For a keyed limiter: over every key, and with ``per_key=True`` the
        keys in use too (:meth:`key_stats`, at most ``limit``)."""
        if self._config.keyed:
            return self._key_set().totals(per_key=per_key, limit=limit)
        found = self.fetch(statements.STATS, {"limiter": self.name})
        workloads, held, waiting = found[0] if found else ((), (), ())
        rows = zip(workloads or (), held or (), waiting or (), strict=False)
        return counted_stats(self._config.workloads, rows)

    @property
    def listening(self) -> bool | None:
        """Whether waiters of this process are woken by ``LISTEN/NOTIFY`` (``None``
        until the listener has checked itself; ``False`` when polling alone)."""
        listener = self.room.listener
        if listener is None:
            return False
        listener.start()  # asking starts it, as a first waiter would
        return listener.available

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


def _for_caller(order: Sequence[int], leases: Sequence[Lease]) -> tuple[Lease, ...]:
    """``leases`` (in lock order) in the caller's order (``order[i]``: where the i-th goes)."""
    out = list(leases)
    for position, lease in zip(order, leases, strict=True):
        out[position] = lease
    return tuple(out)


@contextlib.contextmanager
def _failing_closed(
    limiter: PostgresConcurrencyLimiter,
    request: AcquireRequest | None,
    *,
    busy_ok: bool = False,
) -> Iterator[None]:
    """Turn database failures into :class:`ConcurrencyLimiterError` (or a config error)
    naming the limiter and the request; ``busy_ok`` lets :class:`RowBusyError` through."""
    name = limiter.name
    try:
        yield
    except ConcurrencyError:
        raise
    except RowBusyError:
        if busy_ok:
            raise
        raise _for(_limiter_error(name, "the limiter row stayed locked"), request, name) from None
    except LimitsReplacedError as exc:
        error: ConcurrencyError = ConcurrencyConfigError(
            f"the limits of limiter {name!r} were replaced by another worker; "
            "restart this worker with the new limits (with on_conflict='use_stored' it "
            "would work on the stored limits instead)",
            limiter=name,
        )
        raise _for(error, request, name) from exc
    except LimiterMissingError as exc:
        error = _limiter_error(
            name,
            "it is not registered in the database (its row was deleted?); "
            "restart the workers to register it",
        )
        raise _for(error, request, name) from exc
    except (psycopg.errors.UndefinedTable, psycopg.errors.UndefinedFunction) as exc:
        error = ConcurrencyConfigError(
            f"limiter {name!r}: the runcell tables do not exist in this database; apply "
            "postgres_concurrency_schema_sql() as a migration, or create the limiter with "
            "ensure_schema=True",
            limiter=name,
        )
        raise _for(error, request, name) from exc
    except (CallFailedError, psycopg.Error, PoolTimeout) as exc:
        raise _for(_limiter_error(name, f"the database failed: {exc}"), request, name) from exc


def _limiter_error(name: str, what: str) -> ConcurrencyLimiterError:
    return ConcurrencyLimiterError(f"limiter {name!r}: {what}", limiter=name)


def _for(error: ConcurrencyError, request: AcquireRequest | None, name: str) -> ConcurrencyError:
    return error if request is None else request.error(type(error), error.message, limiter=name)


def _estimate(ahead: Any, hold_ms: Any, slots: Any) -> WaitEstimate:
    return WaitEstimate(
        ahead=int(ahead),
        hold_ms=float(hold_ms) if hold_ms is not None else None,
        slots=int(slots or 0),
    )


def _lines(lines: Sequence[Any] | None) -> list[WaitEstimate] | None:
    """The ``"lines"`` of :data:`~.statements.ACQUIRE_WITH_LINES`' answer, or ``None``
    if one is missing (a limiter row not found)."""
    if not lines or any(line is None or line[0] is None for line in lines):
        return None
    return [_estimate(*line) for line in lines]


def _array(values: Sequence[str]) -> str:
    """``values`` as a PostgreSQL ``text[]`` literal: dumped as one string, much cheaper
    on the hot path than psycopg's list adaptation."""
    quoted = [v.replace("\\", "\\\\").replace('"', '\\"') for v in values]
    return '{"' + '","'.join(quoted) + '"}' if quoted else "{}"


def _op_id() -> str:
    """A new operation id: one per operation, the same for each of its attempts."""
    return str(uuid.uuid4())
