"""Connections for the PostgreSQL limiter: one pool per :class:`Database` object.

Connections are in autocommit mode with server-side prepared statements off
(``prepare_threshold=None``): the limiter keeps no session state, so transaction-mode
poolers such as PgBouncer work.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from types import MappingProxyType
from typing import Any, LiteralString

import psycopg
from psycopg_pool import ConnectionPool, PoolTimeout

from ..errors import ConcurrencyConfigError
from ..redaction import dsn_secrets, mask_dsn, scrub
from .options import DEFAULT_CONNECT_TIMEOUT_MS, DEFAULT_POOL_MAX_SIZE

logger = logging.getLogger("runcell_celery.postgres")

Connection = psycopg.Connection[Any]

#: Runs one statement and returns its rows: on a backend's pool
#: (:func:`~runcell_celery.postgres.operations.backend_rows`), or on a caller's
#: connection to the same database (Django's, for its management commands).
Rows = Callable[[LiteralString, Mapping[str, Any] | None], list[tuple[Any, ...]]]

#: TCP keepalives on every connection: a peer that vanished (a partition, a frozen
#: host) is noticed within about 20 s without sending a statement.
KEEPALIVES: Mapping[str, Any] = MappingProxyType(
    {"keepalives": 1, "keepalives_idle": 10, "keepalives_interval": 3, "keepalives_count": 3}
)


class PoolBusy(PoolTimeout):
    """No connection within the wait because every one the pool may open is lent out,
    while the database itself answers (many threads at once, not an outage)."""


def fetch_all(
    conn: Connection, query: LiteralString, params: Mapping[str, Any] | None = None
) -> list[tuple[Any, ...]]:
    """Run one statement as its own transaction and return its rows (a caller's pool
    may not be in autocommit mode: the statement is wrapped then).
    """
    context = contextlib.nullcontext() if conn.autocommit else conn.transaction()
    with context:
        return conn.execute(query, params).fetchall()


#: How long one direct attempt's finding stands for the calls that fail after it.
DIAGNOSIS_TTL_S = 1.0


class Database:
    """Where a limiter gets its connections: a DSN (pool made here) or the caller's pool
    (which should use ``autocommit=True``, and ``prepare_threshold=None`` behind PgBouncer).

    :param setting: how errors name where ``db`` came from.
    :raises ConcurrencyConfigError: ``db`` is a string but not a DSN.
    """

    def __init__(
        self,
        db: str | ConnectionPool[Any],
        *,
        pool_max_size: int = DEFAULT_POOL_MAX_SIZE,
        timeout: float = DEFAULT_CONNECT_TIMEOUT_MS / 1000,
        setting: str = "db",
    ) -> None:
        if isinstance(db, str):
            check_dsn(db, setting=setting)
            self._dsn: str | None = db
            self._given_pool: ConnectionPool[Any] | None = None
            self.conninfo = db
        elif isinstance(db, ConnectionPool):
            self._dsn = None
            self._given_pool = db
            conninfo = db.conninfo
            self.conninfo = conninfo if isinstance(conninfo, str) else conninfo()
        else:
            raise TypeError(
                f"db must be a PostgreSQL DSN string or a psycopg_pool.ConnectionPool, "
                f"not {type(db).__name__}"
            )
        self.pool_max_size = pool_max_size
        self._timeout = timeout
        self._setting = setting
        self._pool: ConnectionPool[Connection] | None = None
        self._closed = False
        self._lock = threading.Lock()
        self._diagnosis_lock = threading.Lock()
        #: The latest finding of a direct attempt: (when, why no connection could be had).
        self._diagnosis: tuple[float, str | None] | None = None

    @property
    def identity(self) -> object:
        """What makes two of these the same database: the DSN, or the caller's pool."""
        given = self._given_pool
        return str(self._dsn) if given is None else id(given)

    def fresh(self) -> Database:
        """The same database with no pool of its own opened yet (for a forked child)."""
        given = self._given_pool
        return Database(
            given if given is not None else str(self._dsn),
            pool_max_size=self.pool_max_size,
            timeout=self._timeout,
            setting=self._setting,
        )

    def close(self) -> None:
        """Close the pool made here (a caller's pool stays open: it is the caller's);
        later calls fail closed (:class:`psycopg_pool.PoolClosed`), opening nothing."""
        with self._lock:
            self._closed = True
            pool = self._pool
        if pool is not None:
            pool.close()

    @property
    def timeout(self) -> float:
        """How long a call waits for a pooled connection by default (seconds)."""
        return self._timeout

    @property
    def pool(self) -> ConnectionPool[Any]:
        if self._given_pool is not None:
            return self._given_pool
        pool = self._pool
        if pool is not None:
            return pool
        with self._lock:
            if self._pool is None:
                assert self._dsn is not None
                self._pool = ConnectionPool(
                    self._dsn,
                    min_size=1,
                    max_size=self.pool_max_size,
                    timeout=self._timeout,
                    kwargs={
                        "autocommit": True,
                        "prepare_threshold": None,
                        "connect_timeout": max(1, int(self._timeout)),
                        **KEEPALIVES,
                    },
                    name=f"runcell-{os.getpid()}",
                    open=not self._closed,
                )
            return self._pool

    @contextmanager
    def connection(self, timeout: float | None = None) -> Iterator[Connection]:
        """Lend a connection for one operation (at most ``timeout`` s to wait for one)."""
        pool = self.pool
        lent = False
        try:
            with pool.connection(timeout=timeout) as conn:
                lent = True
                yield conn
        except PoolTimeout as exc:
            if lent:
                raise
            raise self._explained(exc, pool) from exc

    def _explained(self, exc: PoolTimeout, pool: ConnectionPool[Any]) -> PoolTimeout:
        """``couldn't get a connection`` with why: one direct attempt finds the cause (at most
        one a second); a pool all lent out while the database answers is :class:`PoolBusy`.
        """
        cause = self._cause()
        if cause is not None:
            return PoolTimeout(f"{exc} ({cause})")
        stats = pool.get_stats()
        if stats.get("pool_size", 0) >= pool.max_size and stats.get("pool_available", 0) == 0:
            return PoolBusy(f"{exc} (all {pool.max_size} connections of the pool in use)")
        return PoolTimeout(str(exc))

    def direct_connection(self, **kwargs: Any) -> Connection:
        """Open an autocommit connection outside the pool (the listener's).

        :raises psycopg.OperationalError: it failed; neither the message nor its context holds
            the password.
        """
        failure: psycopg.Error | None = None
        try:
            return psycopg.connect(self.conninfo, autocommit=True, **{**KEEPALIVES, **kwargs})
        except psycopg.Error as exc:
            message = scrubbed(exc, self.conninfo)
            if message == str(exc):
                raise
            failure = type(exc)(message)
        raise failure  # outside the except block: no context holds the original

    def _cause(self) -> str | None:
        """The error a direct connection attempt gets now (``None``: it connected, so
        the database came back or the pool was only slow); one attempt stands for
        :data:`DIAGNOSIS_TTL_S`."""
        with self._diagnosis_lock:
            found = self._diagnosis
            if found is not None and time.monotonic() - found[0] < DIAGNOSIS_TTL_S:
                return found[1]
            conninfo = self.conninfo
            try:
                timeout = max(1, min(2, int(self._timeout)))
                psycopg.connect(conninfo, autocommit=True, connect_timeout=timeout).close()
                cause = None
            except psycopg.Error as exc:
                cause = " ".join(scrubbed(exc, conninfo).split()) or type(exc).__name__
            self._diagnosis = (time.monotonic(), cause)
            return cause


def blocking_waits() -> str | None:
    """Why psycopg's waits for the server would block a gevent hub, or ``None``.

    psycopg chooses its wait function once, when first imported: its C one (with the
    ``binary`` or ``c`` speedups) unless gevent had patched ``select`` by then; that one
    never yields to other greenlets.
    """
    from psycopg import waiting

    if waiting.wait is getattr(waiting, "wait_c", None):
        return (
            "psycopg waits for the database in C (psycopg.waiting.wait is wait_c), which "
            "blocks every greenlet: psycopg was imported before gevent monkey-patched the "
            "process (or PSYCOPG_WAIT_FUNC chose it). Patch first: `celery worker -P gevent`, "
            "or gevent.monkey.patch_all() before anything imports psycopg or Django"
        )
    return None


def redacted(conninfo: str) -> str:
    """``host:port/dbname`` of a DSN, for logs and reprs (never the password)."""
    try:
        params = psycopg.conninfo.conninfo_to_dict(conninfo)
    except psycopg.ProgrammingError:
        return "the database"
    return (
        f"{params.get('host', 'localhost')}:{params.get('port', 5432)}/{params.get('dbname', '')}"
    )


def scrubbed(error: BaseException, conninfo: str) -> str:
    """``str(error)`` without the password of ``conninfo`` (nor anything that looks like
    one): libpq's and psycopg's messages may echo parts of a DSN."""
    return scrub(str(error), dsn_secrets(conninfo))


def check_dsn(dsn: str, *, setting: str = "DATABASE") -> dict[str, Any]:
    """Parse the PostgreSQL DSN ``dsn``; return its parameters.

    :raises ConcurrencyConfigError: it cannot be parsed; the message masks the password
        and has no cause or context (psycopg's own message quotes the DSN).
    """
    try:
        return psycopg.conninfo.conninfo_to_dict(dsn)
    except psycopg.ProgrammingError as exc:
        reason = " ".join(scrubbed(exc, dsn).split())
    given = f"{setting} = {mask_dsn(dsn)!r}" if setting else repr(mask_dsn(dsn))
    raise ConcurrencyConfigError(
        f"{given} is invalid: not a PostgreSQL DSN ({reason}); "
        "write postgresql://user:password@host:5432/dbname or "
        "'host=... dbname=... user=...'"
    )
