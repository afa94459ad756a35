"""The PostgreSQL backend: the one port the Celery and Django layers use.

Built once per registry and process from ``DATABASE`` and ``RUNCELL["POSTGRES"]``, it
owns this process's :class:`~.engine.Engine` (pool, waiting room, listener, executor,
keeper, key purgers; a forked child makes its own) and :meth:`PostgresBackend.close`
ends it. Besides limiters it offers the stores of :mod:`runcell_celery.ports` and what
an operator's dashboard needs, so no other layer touches the ``runcell_*`` tables.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import uuid
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, LiteralString

import psycopg
from psycopg_pool import ConnectionPool

from ..config import LimiterConfig
from ..errors import ConcurrencyConfigError, ConcurrencyLimiterError
from ..ports import (
    COUNT_FIELDS,
    AdmissionCount,
    Backend,
    BackendFactory,
    CounterStore,
    ExpiredParked,
    LimitsConflict,
    ParkingStore,
    Republish,
    RevocationStore,
    RunStore,
    SupportsParking,
)
from ..protocol import LimiterStats
from . import statements
from .calls import CallFailedError, call, fetch_rows, lock_timeout_ms, reap_limiter
from .connection import Database, blocking_waits, redacted
from .engine import Engine, engines
from .keyed import counted_stats
from .limiter import PostgresConcurrencyLimiter
from .options import PostgresOptions
from .registration import differing_limits

logger = logging.getLogger("runcell_celery.postgres")

#: Expired parked requests a taker has not completed within this long are handed to
#: another (the first died or is stuck); the taker itself gets them at every call.
RETAKE_EXPIRED_AFTER_MS = 30_000
#: Operation ids are remembered this long: far beyond any retry of a lost reply.
KEEP_OPERATIONS_MS = 15 * 60_000
#: Group passes of parked requests over several limiters per sweep (heads of line).
PARKED_GROUP_PASSES = 8


@dataclass(frozen=True, slots=True)
class ReleasedLease:
    """A lease an operator took back with :meth:`PostgresBackend.force_release`."""

    lease_id: str
    limiter: str
    workload: str
    request_id: str
    fencing_token: int
    run_id: str | None
    root_run_id: str | None
    parent_run_id: str | None
    holder_name: str | None


@dataclass(frozen=True, slots=True)
class LimiterState:
    """One limiter's live counts, read in database time: slots held and requests
    queued (waiting or parked) per workload, and the oldest one's wait (``None``: none).
    """

    limiter: str
    workloads: tuple[str, ...]
    active: Mapping[str, int] = field(default_factory=dict)
    queued: Mapping[str, int] = field(default_factory=dict)
    oldest_wait_ms: float | None = None

    @property
    def total_active(self) -> int:
        return sum(self.active.values())

    @property
    def total_queued(self) -> int:
        return sum(self.queued.values())

    def stats(self) -> LimiterStats:
        """The same counts as the limiter's own :meth:`~PostgresConcurrencyLimiter.stats`."""
        rows = [(w, self.active.get(w, 0), self.queued.get(w, 0)) for w in self.active]
        rows += [(w, 0, n) for w, n in self.queued.items() if w not in self.active]
        return counted_stats(self.workloads, rows)


class PostgresBackend:
    """Limiters and stores on one PostgreSQL database, sharing one engine per process.

    :param database: a DSN, or a caller's :class:`psycopg_pool.ConnectionPool`; ``None``:
        options checked only (a database call raises ``ConcurrencyConfigError``).
    :param path: how the settings spell the options section, for error messages.
    :raises ConcurrencyConfigError, TypeError: an invalid option or ``database``.
    """

    def __init__(
        self,
        *,
        database: str | ConnectionPool[Any] | None,
        options: Mapping[str, Any] = {},
        path: str = 'RUNCELL["POSTGRES"]',
    ) -> None:
        self.options = PostgresOptions.from_mapping(options, path=path)
        self._taker_tag = uuid.uuid4().hex[:8]
        self._db: Database | None = None
        self._engine: Engine | None = None
        self._pid = os.getpid()
        self._lock = threading.Lock()
        #: Engines of the process this one was forked from: kept, never used nor closed.
        self._inherited: list[Engine] = []
        self._closed = False
        self._finalizer: weakref.finalize[Any, Any] | None = None
        if database is not None:
            section = '["POSTGRES"]'
            setting = path[: -len(section)] if path.endswith(section) else "RUNCELL"
            self._db = Database(
                database,
                pool_max_size=self.options.pool_max_size,
                timeout=self.options.connect_timeout_ms / 1000,
                setting=f'{setting}["DATABASE"]',
            )

    def __repr__(self) -> str:
        where = "no database" if self._db is None else redacted(self._db.conninfo)
        return f"<PostgresBackend {where}>"

    @property
    def engine(self) -> Engine:
        """This process's engine, taken on first use (in a forked child: its own);
        backends on one database with the same options share it (:func:`~.engine.engines`).
        """
        engine, pid = self._engine, os.getpid()
        if engine is not None and self._pid == pid and not self._closed:
            return engine
        if self._pid != pid:  # forked: a parent's thread may hold the lock, not here
            self._lock = threading.Lock()
        with self._lock:
            if self._closed and self._pid == pid:
                raise ConcurrencyLimiterError(f"{self!r} was closed")
            if self._engine is not None and self._pid != pid:
                self._inherited.append(self._engine)
                self._engine = None
                self._closed = False
            if self._engine is None:
                database = self._database()
                self._engine = engines().take(database, self.options)
                self._pid = pid
                # A backend dropped unclosed (a script's, a test's limiter) gives its
                # share back as it is collected; the engine closes with its last share.
                self._finalizer = weakref.finalize(self, engines().give_back_later, self._engine)
                self._finalizer.atexit = False
            return self._engine

    @property
    def pool(self) -> ConnectionPool[Any]:
        """This process's connection pool (every limiter and store call uses it)."""
        return self.engine.database.pool

    def create_limiter(
        self, config: LimiterConfig, *, owns: bool = False
    ) -> PostgresConcurrencyLimiter:
        """Build a limiter on this backend; store its limits or check the stored ones.

        :param owns: the limiter's ``close()`` closes this backend (made for it alone).
        :raises ConcurrencyConfigError: the stored limits differ, or the tables are missing.
        :raises ConcurrencyLimiterError: the database failed.
        """
        limiter = PostgresConcurrencyLimiter(self, config, self.options, owns_backend=owns)
        limiter.register(ensure=self.options.ensure_schema, on_conflict=self.options.on_conflict)
        return limiter

    def limit_conflicts(self, configs: Sequence[LimiterConfig]) -> list[LimitsConflict]:
        """The limiters of ``configs`` stored with other limits (``on_conflict="error"``
        only), read on a connection closed at once: a prefork parent leaves its children nothing.
        """
        if self.options.on_conflict != "error" or not configs:
            return []
        database = self._database()
        timeout_s = max(1, round(self.options.connect_timeout_ms / 1000))
        try:
            with database.direct_connection(
                connect_timeout=timeout_s, prepare_threshold=None
            ) as conn:
                found = differing_limits(conn, configs)
        except psycopg.errors.UndefinedTable:
            return []  # no limiter stored on this database yet
        except psycopg.Error as exc:
            raise ConcurrencyLimiterError(
                f"could not read the stored limits: the database failed: {exc}"
            ) from exc
        return [LimitsConflict(limiter, differences) for limiter, differences in found]

    def green_io_problem(self) -> str | None:
        """Why this backend's queries would block a gevent hub (:class:`~runcell_celery.
        ports.GreenIOCheck`), or ``None``."""
        return blocking_waits()

    def close(self) -> None:
        """End every thread this backend started here and close every connection it opened
        (a caller's pool stays open); its limiters then fail closed. A forked child's close
        leaves the parent's engine alone.
        """
        with self._lock:
            if self._pid != os.getpid() or self._closed:
                return
            self._closed = True
            finalizer, self._finalizer = self._finalizer, None
        if finalizer is not None and finalizer.detach() is not None and self._engine is not None:
            engines().give_back(self._engine)

    def first_start(self, run_id: str, timeout_ms: float) -> float:
        """Record the run's first start (or find it); return the ms left in its budget.

        A redelivered run finds its first start's deadline, computed in database time; keyed
        by the run id, so a retry after a lost reply finds what the first attempt stored.
        """
        params = {"run_id": run_id, "timeout_ms": timeout_ms}
        return float(self._fetch(statements.FIRST_START, params)[0][0])

    def add_revoked(self, run_ids: Sequence[str]) -> int:
        """Record revoked runs; return how many were new."""
        if not run_ids:
            return 0
        return len(self._fetch(statements.ADD_REVOKED, {"run_ids": list(run_ids)}))

    def revoked_among(self, run_ids: Iterable[str]) -> set[str]:
        """Return those of ``run_ids`` that any worker recorded as revoked."""
        ids = list(run_ids)
        if not ids:
            return set()
        return {row[0] for row in self._fetch(statements.REVOKED_AMONG, {"run_ids": ids})}

    def purge_revoked(self, keep_ms: int) -> int:
        """Forget revocations older than ``keep_ms``; return how many went."""
        return len(self._fetch(statements.PURGE_REVOKED, {"keep_ms": keep_ms}))

    def add_counts(self, counts: Sequence[AdmissionCount], *, batch_id: str | None = None) -> None:
        """Add a batch of counts to the fleet-wide totals in one statement; a batch sent
        again with its ``batch_id`` (a retry after a lost reply) is not added twice.
        """
        if not counts:
            return
        params: dict[str, Any] = {
            "task_names": [c.task_name for c in counts],
            "limiters": [c.limiter for c in counts],
            "batch_id": batch_id,
        }
        for name in COUNT_FIELDS:
            params[name] = [getattr(c, name) for c in counts]
        self._fetch(statements.ADD_ADMISSION_COUNTS, params)

    def admission_counts(self) -> list[AdmissionCount]:
        """Every worker's counts summed, per task name and limiter."""
        return [AdmissionCount(*row) for row in self._fetch(statements.ADMISSION_COUNTS)]

    def claim_republish(
        self,
        lease_ids: Sequence[str] = (),
        *,
        stale_ms: int,
        broker: str | None = None,
        others: set[str] | None = None,
    ) -> list[Republish]:
        """Take the right to publish these grants (and any unpublished past ``stale_ms``),
        only those parked for ``broker``; exactly one caller gets each. Other brokers with
        grants due are added to ``others``.
        """
        params = {"lease_ids": list(lease_ids), "stale_ms": stale_ms, "broker": broker}
        claimed: list[Republish] = []
        for *row, other in self._fetch(statements.CLAIM_REPUBLISH, params):
            if other is None:
                claimed.append(Republish(*row))
            elif others is not None:
                others.add(other)
        return claimed

    def unclaim_republish(self, items: Sequence[Republish]) -> int:
        """Give back the right to publish grants whose publication failed, so a later
        :meth:`claim_republish` takes them again; return how many were still granted
        to that publication."""
        if not items:
            return 0
        params = {
            "limiters": [item.limiter for item in items],
            "request_ids": [item.request_id for item in items],
            "publication_ids": [item.publication_id for item in items],
        }
        return len(self._fetch(statements.UNCLAIM_REPUBLISH, params))

    def take_expired_parked(self, *, broker: str | None = None) -> list[ExpiredParked]:
        """Take parked requests whose deadline passed out of line, for this process to
        record their failure (phase one); they stay stored until
        :meth:`complete_expired_parked` (another taker gets them after ``RETAKE_EXPIRED_AFTER_MS``).
        """
        params = {
            # This process, whichever host: a forked child is another taker.
            "taker": f"{socket.gethostname()}/{os.getpid()}/{self._taker_tag}",
            "retake_after_ms": RETAKE_EXPIRED_AFTER_MS,
            "keep_ops_ms": KEEP_OPERATIONS_MS,
            "lock_timeout_ms": lock_timeout_ms(None),
            "broker": broker,
        }
        taken = [ExpiredParked(*row) for row in self._fetch(statements.TAKE_EXPIRED_PARKED, params)]
        # A request over several limiters expires as one: its first member carries the
        # task message and stands for it; the others have nothing to record.
        members = [e for e in taken if e.payload is None]
        if members:
            self.complete_expired_parked(members)
        return [e for e in taken if e.payload is not None]

    def complete_expired_parked(self, expired: Sequence[ExpiredParked]) -> int:
        """Delete expired parked requests whose failure is recorded (phase two), in one
        round trip; return how many were still stored. A retry after a lost reply gets
        the first attempt's answer."""
        if not expired:
            return 0
        params = {
            "items": json.dumps([[e.limiter, e.request_id] for e in expired]),
            "op_id": str(uuid.uuid4()),
        }
        try:
            answer = call(self.engine.database, statements.COMPLETE_EXPIRED, params)
        except CallFailedError as exc:
            raise ConcurrencyLimiterError(f"the runcell database failed: {exc}") from exc
        return int(answer["n"])

    def pass_parked_groups(self, limit: int = PARKED_GROUP_PASSES) -> list[str]:
        """Run the group passes of up to ``limit`` parked requests over several limiters
        (heads of line first: no process waits for them) and return the lease ids granted.
        """
        rows = self._fetch(statements.PARKED_GROUPS, {"limit": limit * 4})
        database = self.engine.database
        granted: list[str] = []
        for group_id in list(dict.fromkeys(str(row[0]) for row in rows))[:limit]:
            try:
                answer = call(database, statements.ALLOCATE_GROUP, {"group_id": group_id})
            except CallFailedError as exc:  # the next sweep tries again
                logger.info("runcell: the group pass of parked %s failed: %s", group_id, exc)
                continue
            granted.extend(str(x) for x in (answer or {}).get("parked") or ())
        return granted

    def on_parked_granted(self, handler: Callable[[str, list[str]], None]) -> None:
        """Call ``handler(limiter, request_ids)`` when any process grants parked requests:
        hooks this process's ``LISTEN`` connection (started if need be). Without
        ``listen`` the sweeper's periodic pass finds them instead."""
        listener = self.engine.room.listener
        if listener is not None:
            listener.add_parked_handler(handler)

    def force_release(
        self, lease_ids: Sequence[str], *, actor: str | None = None, record: bool = False
    ) -> list[ReleasedLease]:
        """Take slots back from their holders now and give them to the next waiters, as
        when a crashed holder's lease runs out; the holder learns it at its next renewal (its
        error names ``actor``). Returns the leases released (those already gone left out).

        :param record: also write a ``force-released`` event per lease, naming ``actor``
            and this process, to ``runcell_event`` (runcell_django's table: the database
            must have it), in the same statement.
        """
        params = {
            "lease_ids": [str(lease_id) for lease_id in lease_ids],
            "actor": actor,
            "host": socket.gethostname(),
            "pid": os.getpid(),
        }
        query = statements.EXPIRE_LEASES_RECORDED if record else statements.EXPIRE_LEASES
        released = [ReleasedLease(*row) for row in self._fetch(query, params)]
        self.reap(sorted({lease.limiter for lease in released}))
        return released

    def reap(self, limiter_names: Sequence[str]) -> None:
        """Run one allocation pass on each named limiter now (freed slots go to waiters at
        once); a limiter that fails is logged and the others still run.
        """
        database = self.engine.database
        for name in limiter_names:
            try:
                reap_limiter(database, name)
            except Exception:
                logger.exception("runcell: an allocation pass on %r failed", name)

    def stored_limits(self, names: Sequence[str] | None = None) -> dict[str, LimiterConfig]:
        """The limits stored for each limiter (or the named ones), by name; a row that no
        longer parses is left out and logged.
        """
        params = {"names": None if names is None else list(names)}
        found: dict[str, LimiterConfig] = {}
        for name, stored in self._fetch(statements.STORED_LIMITS, params):
            try:
                found[name] = LimiterConfig.from_mapping(stored, name=name)
            except ConcurrencyConfigError as exc:
                logger.warning("runcell: the stored limits of %r are unreadable: %s", name, exc)
        return found

    def limiter_states(self, names: Sequence[str] | None = None) -> dict[str, LimiterState]:
        """Live counts of every stored limiter (or the named ones), in one query."""
        params = {"names": None if names is None else list(names)}
        return {
            name: LimiterState(
                limiter=name,
                workloads=tuple(workloads),
                active={w: int(n) for w, n in zip(workloads, active, strict=False) if n},
                queued={w: int(n) for w, n in zip(workloads, waiting, strict=False) if n},
                oldest_wait_ms=None if oldest is None else float(oldest),
            )
            for name, workloads, active, waiting, oldest in self._fetch(
                statements.LIMITER_STATES, params
            )
        }

    def _database(self) -> Database:
        if self._db is None:
            raise ConcurrencyConfigError(
                "the PostgreSQL backend has no database: set DATABASE to a PostgreSQL DSN "
                "(or, with Django, a database alias)"
            )
        return self._db

    def _fetch(
        self, query: LiteralString, params: Mapping[str, Any] | None = None
    ) -> list[tuple[Any, ...]]:
        """Run one statement on a pooled connection (retried as :func:`.calls.fetch_rows`
        says: within the run's budget, if any); fail closed on database errors."""
        try:
            return fetch_rows(self.engine.database, query, params)
        except CallFailedError as exc:
            raise ConcurrencyLimiterError(f"the runcell database failed: {exc}") from exc


if TYPE_CHECKING:  # mypy checks that the backend fills every port it claims

    def _ports(backend: PostgresBackend, limiter: PostgresConcurrencyLimiter) -> None:
        factory: BackendFactory = PostgresBackend
        stores: tuple[Backend, RunStore, RevocationStore, CounterStore, ParkingStore] = (
            backend,
            backend,
            backend,
            backend,
            backend,
        )
        parking: SupportsParking = limiter
        del factory, stores, parking
