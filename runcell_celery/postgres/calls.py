"""Sending one operation to the database: bounded, retried when safe, failing closed.

Every operation is one function call sent as one simple-query message that first sets
transaction-local bounds (``SET LOCAL statement_timeout``, ``lock_timeout``), so no
session state stays behind (PgBouncer transaction mode is safe) and a frozen holder of
a limiter row delays others by at most the caller's wait. A dropped connection is
retried at once on another (every operation is idempotent); within a budget (``until``,
by default the run's :func:`~runcell_celery.patience.current_patience`) any transient
failure is retried with backoff (:func:`persist`), so a database restart is a blip.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, LiteralString, TypeVar

import psycopg
from psycopg_pool import PoolTimeout

from ..deadline import Deadline
from ..patience import current_patience
from . import statements
from .connection import Connection, Database, PoolBusy, fetch_all

T = TypeVar("T")

logger = logging.getLogger("runcell_celery.postgres")

#: The longest one statement waits for the limiter row's lock when its caller has no
#: deadline of its own; the caller then simply tries again.
LOCK_WAIT_CAP_MS = 5_000
#: A bounded caller's statement may run this much past its lock wait (the work itself).
STATEMENT_GRACE_MS = 200
#: How long a request whose wait ended waits for its limiter rows to withdraw itself;
#: rows locked longer, it leaves at once and the withdrawal runs in the background
#: (:meth:`~.waiting.WaitRoom.withdraw_later`), so no caller overshoots its budget by
#: a lock wait.
WITHDRAW_GRACE_MS = 100
#: No statement runs longer than this (granting 10,000 waiters at once takes well
#: under a second here).
STATEMENT_TIMEOUT_MS = 60_000
#: The first pause before a transient failure is retried within a budget, and the
#: longest (the pause doubles from the first).
FIRST_BACKOFF_S = 0.05
MAX_BACKOFF_S = 1.0

_BOUNDS: LiteralString = (
    "SET LOCAL statement_timeout = %(statement_timeout_ms)s; "
    "SET LOCAL lock_timeout = %(lock_timeout_ms)s; "
)


class CallFailedError(Exception):
    """The database could not do the operation.

    :param maybe_done: whether it may have committed after all (an attempt was lost with
        its connection); ``False``: it certainly did nothing.
    """

    def __init__(self, message: str, *, maybe_done: bool = True) -> None:
        super().__init__(message)
        self.maybe_done = maybe_done


class RowBusyError(CallFailedError):
    """Nothing was done within the caller's wait: the limiter row stayed locked, or
    every pooled connection stayed in use, for the whole of it."""


class LimiterMissingError(CallFailedError):
    """The limiter's row does not exist (deleted, or the schema was reset)."""


class LimitsReplacedError(CallFailedError):
    """Another worker stored different limits for this limiter (``on_conflict="replace"``)."""


class Stamp:
    """When a call's statement was handed to its connection (monotonic seconds), after
    any wait for a pooled connection: the earliest the database can have acted on it."""

    __slots__ = ("at",)

    def __init__(self) -> None:
        self.at = time.monotonic()


def lock_timeout_ms(remaining_ms: float | None) -> int:
    """How long a statement may wait for the row lock: the caller's remaining wait,
    capped, and at least 1 ms (0 would mean no limit)."""
    if remaining_ms is None:
        return LOCK_WAIT_CAP_MS
    return max(1, min(LOCK_WAIT_CAP_MS, int(remaining_ms)))


def call(
    database: Database,
    query: LiteralString,
    params: Mapping[str, Any],
    *,
    lock_timeout_ms: int = LOCK_WAIT_CAP_MS,
    rows: bool = False,
    stamp: Stamp | None = None,
    until: Deadline | None = None,
) -> Any:
    """Run one bounded function call; return its single value (``rows=True``: every
    row's first column). ``until``: retry transient failures until then (:func:`persist`).

    :raises RowBusyError: the limiter row stayed locked for ``lock_timeout_ms``.
    :raises LimiterMissingError, LimitsReplacedError: the row is gone, or its limits replaced.
    :raises CallFailedError: any other database failure; ``__cause__`` says which.
    """
    bound = {**params, "statement_timeout_ms": STATEMENT_TIMEOUT_MS}
    patience = until if until is not None else current_patience()

    def again(failed: CallFailedError) -> None:
        if failed.maybe_done and "retry" in bound:
            bound["retry"] = True  # the failed attempt may have committed

    def attempt() -> Any:
        return _call_once(database, query, bound, lock_timeout_ms, rows, stamp, patience)

    return persist(patience, attempt, on_retry=again)


def reap_limiter(database: Database, limiter: str) -> Any:
    """Run one allocation pass on ``limiter``; return the parked leases it granted."""
    return call(database, statements.REAP, {"limiter": limiter})


def _call_once(
    database: Database,
    query: LiteralString,
    bound: dict[str, Any],
    lock_timeout_ms: int,
    rows: bool,
    stamp: Stamp | None,
    until: Deadline | None,
) -> Any:
    """One round of :func:`call`: a dropped connection retried at once on a fresh one
    (up to the pool's size), every other failure raised."""
    attempts = database.pool_max_size + 1
    lost = False
    attempt = -1
    while attempt + 1 < attempts:
        attempt += 1
        broken = False
        try:
            # A bounded caller waits for a pooled connection and then the lock no longer
            # than its wait, both together.
            asked = time.monotonic()
            pool_wait = lock_timeout_ms / 1000 if lock_timeout_ms < LOCK_WAIT_CAP_MS else None
            with database.connection(timeout=pool_wait_s(database, pool_wait, until)) as conn:
                waited_ms = (time.monotonic() - asked) * 1000
                left_ms = max(1, int(lock_timeout_ms - waited_ms))
                bound["lock_timeout_ms"] = left_ms
                if lock_timeout_ms < LOCK_WAIT_CAP_MS:
                    # lock_timeout bounds each lock wait, and a row lock queued behind
                    # other waiters is two waits: the statement as a whole is bounded too.
                    bound["statement_timeout_ms"] = left_ms + STATEMENT_GRACE_MS
                if stamp is not None:
                    stamp.at = time.monotonic()
                try:
                    return _send(conn, _BOUNDS + query, bound, rows=rows)
                finally:
                    broken = conn.broken
        except PoolTimeout as exc:  # (a psycopg.Error too: caught first)
            if lock_timeout_ms < LOCK_WAIT_CAP_MS:
                raise RowBusyError(_describe(exc), maybe_done=lost) from exc
            if isinstance(exc, PoolBusy) and (until is None or not until.passed()):
                # Every connection is open and in use by this process's other calls
                # (thousands of threads asking at once) and the database answers: a
                # caller without a deadline waits its turn instead of failing. (A pool
                # that only looks full while the database is down fails closed.)
                attempt -= 1
                continue
            raise CallFailedError(_describe(exc), maybe_done=lost) from exc
        except psycopg.errors.LockNotAvailable as exc:
            raise RowBusyError(str(exc), maybe_done=lost) from exc
        except psycopg.errors.QueryCanceled as exc:
            if lock_timeout_ms < LOCK_WAIT_CAP_MS:
                # Our own bound: this attempt was rolled back.
                raise RowBusyError(str(exc), maybe_done=lost) from exc
            raise CallFailedError(_describe(exc)) from exc
        except psycopg.errors.DeadlockDetected as exc:
            # The server rolled the transaction back to break a lock cycle (a schema
            # upgrade running beside operations): nothing was done; do it again.
            if attempt + 1 < attempts:
                continue
            raise CallFailedError(_describe(exc), maybe_done=lost) from exc
        except psycopg.errors.UniqueViolation as exc:
            # The request is known already (another delivery, or our own first attempt
            # whose answer was lost): ask again as a retry, which finds what it has.
            if bound.get("retry") is False and attempt + 1 < attempts:
                bound["retry"] = True
                continue
            raise CallFailedError(_describe(exc)) from exc
        except psycopg.Error as exc:
            if exc.sqlstate == "RC001":
                raise LimiterMissingError(exc.diag.message_primary or str(exc)) from exc
            if exc.sqlstate == "RC002":
                raise LimitsReplacedError(exc.diag.message_primary or str(exc)) from exc
            if broken and attempt + 1 < attempts:
                lost = True  # sent on a connection that broke: it may have committed
                logger.info("runcell: retrying on a fresh connection after: %s", exc)
                if "retry" in bound:
                    bound["retry"] = True  # the first attempt may have committed
                continue
            raise CallFailedError(_describe(exc)) from exc
    raise AssertionError("unreachable")  # pragma: no cover


def persist(
    until: Deadline | None,
    attempt: Callable[[], T],
    *,
    on_retry: Callable[[CallFailedError], None] | None = None,
) -> T:
    """Run ``attempt``, and again after each transient failure while ``until`` lasts
    (pausing 50 ms doubling to 1 s); ``on_retry(failure)`` runs before each new attempt.
    """
    delay = FIRST_BACKOFF_S
    retried = 0
    while True:
        try:
            return attempt()
        except CallFailedError as exc:
            if until is None or not transient(exc) or until.passed():
                raise
            if retried == 0:
                logger.info(
                    "runcell: the database failed (%s); retrying for up to %.1f s",
                    exc,
                    until.remaining_s(),
                )
            time.sleep(min(delay, until.remaining_s()))
            if until.passed():
                raise
            delay = min(delay * 2, MAX_BACKOFF_S)
            retried += 1
            if on_retry is not None:
                on_retry(exc)


def transient(exc: CallFailedError) -> bool:
    """Whether a failure may pass by itself: the connection or the server went away or
    is not up yet, or no connection could be had. A locked row, a missing limiter,
    replaced limits or an error in the statement are not."""
    if type(exc) is not CallFailedError:
        return False
    cause = exc.__cause__
    if isinstance(cause, PoolTimeout):
        return True
    if isinstance(cause, psycopg.errors.QueryCanceled | psycopg.errors.LockNotAvailable):
        return False
    return isinstance(cause, psycopg.OperationalError | psycopg.InterfaceError)


def fetch_rows(
    database: Database, query: LiteralString, params: Mapping[str, Any] | None = None
) -> list[tuple[Any, ...]]:
    """Run one plain statement, safe to repeat, and return its rows (retried as
    :func:`call` is: within the run's :func:`~runcell_celery.patience.current_patience`).

    :raises CallFailedError: the database failed; ``__cause__`` says how.
    """
    patience = current_patience()

    def attempt() -> list[tuple[Any, ...]]:
        lost = False
        attempts = database.pool_max_size + 1
        for number in range(attempts):
            broken = False
            try:
                with database.connection(timeout=pool_wait_s(database, None, patience)) as conn:
                    try:
                        return fetch_all(conn, query, params)
                    finally:
                        broken = conn.broken
            except PoolTimeout as exc:
                raise CallFailedError(_describe(exc), maybe_done=lost) from exc
            except psycopg.Error as exc:
                if broken and number + 1 < attempts:
                    lost = True
                    logger.info("runcell: retrying on a fresh connection after: %s", exc)
                    continue
                raise CallFailedError(_describe(exc)) from exc
        raise AssertionError("unreachable")  # pragma: no cover

    return persist(patience, attempt)


def pool_wait_s(database: Database, wait_s: float | None, until: Deadline | None) -> float | None:
    """How long to wait for a pooled connection: ``wait_s`` (``None``: the pool's
    timeout), never past ``until``."""
    if until is None:
        return wait_s
    left = max(0.001, until.remaining_s())
    return min(wait_s if wait_s is not None else database.timeout, left)


def _send(conn: Connection, query: LiteralString, params: Mapping[str, Any], *, rows: bool) -> Any:
    cursor = psycopg.ClientCursor(conn)
    if conn.autocommit:  # the hot path: no context manager to enter
        return _read(cursor, query, params, rows=rows)
    # A caller's pool may not be in autocommit mode: make the call its own transaction
    # all the same (SET LOCAL needs one).
    with conn.transaction():
        return _read(cursor, query, params, rows=rows)


def _read(
    cursor: psycopg.ClientCursor[Any],
    query: LiteralString,
    params: Mapping[str, Any],
    *,
    rows: bool,
) -> Any:
    cursor.execute(query, params)
    cursor.nextset()  # past SET statement_timeout
    cursor.nextset()  # past SET lock_timeout
    if rows:
        return [row[0] for row in cursor.fetchall()]
    row = cursor.fetchone()
    return row[0] if row is not None else None


def _describe(exc: BaseException) -> str:
    """The error and its cause (``couldn't get a connection`` says why it couldn't)."""
    text = str(exc).strip() or type(exc).__name__
    cause = exc.__cause__ or exc.__context__
    if cause is not None and str(cause) and str(cause) not in text:
        text += f" ({str(cause).strip()})"
    return text
