"""Connections for the PostgreSQL limiter: a pool per process, safe across ``fork``.

Celery's prefork pool forks worker children from a parent that may already have
created limiters. A connection (or a pool's threads) inherited through ``fork`` must
never be used by the child, nor closed by it (closing sends a terminate message on
the parent's socket). So a pool made from a DSN belongs to the process that made it:
a child that finds a pool from another PID leaves it untouched and opens its own.

Connections are in autocommit mode with server-side prepared statements off
(``prepare_threshold=None``): the limiter keeps no session state, so transaction-mode
poolers such as PgBouncer work.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, LiteralString

import psycopg
from psycopg_pool import ConnectionPool

__all__ = ["Database", "fetch_all", "fetch_one"]

logger = logging.getLogger("runcell_celery.postgres")

Connection = psycopg.Connection[Any]

#: Connections a pool made from a DSN may open (waiters hold one only while polling).
DEFAULT_POOL_MAX_SIZE = 8
#: How long to wait for a pooled connection before failing closed.
DEFAULT_CONNECT_TIMEOUT_MS = 5_000

_pools: dict[tuple[int, str, int, float], ConnectionPool[Connection]] = {}
_inherited: list[object] = []  # kept alive after fork so they are never closed here
_pools_lock = threading.Lock()


def _after_fork_in_child() -> None:
    global _pools_lock
    _inherited.extend(_pools.values())
    _pools.clear()
    _pools_lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _shared_pool(conninfo: str, max_size: int, timeout: float) -> ConnectionPool[Connection]:
    key = (os.getpid(), conninfo, max_size, timeout)
    with _pools_lock:
        pool = _pools.get(key)
        if pool is None:
            pool = ConnectionPool(
                conninfo,
                min_size=1,
                max_size=max_size,
                timeout=timeout,
                kwargs={
                    "autocommit": True,
                    "prepare_threshold": None,
                    "connect_timeout": max(1, int(timeout)),
                },
                name=f"runcell-{os.getpid()}",
                open=True,
            )
            _pools[key] = pool
        return pool


def fetch_all(
    conn: Connection, query: LiteralString, params: Mapping[str, Any] | None = None
) -> list[tuple[Any, ...]]:
    """Run one statement as its own transaction and return its rows.

    In autocommit mode (pools made here) a statement is its own transaction; a
    caller's pool may not be in autocommit mode, and a pool rolls back whatever a
    returned connection left open, so the statement is wrapped then.
    """
    context = contextlib.nullcontext() if conn.autocommit else conn.transaction()
    with context:
        return conn.execute(query, params).fetchall()


def fetch_one(
    conn: Connection, query: LiteralString, params: Mapping[str, Any] | None = None
) -> tuple[Any, ...]:
    """Run one statement that returns exactly one row (see :func:`fetch_all`)."""
    return fetch_all(conn, query, params)[0]


class Database:
    """Where a limiter gets its connections: a DSN (pool made here) or the caller's pool.

    :param db: a PostgreSQL DSN, or a :class:`psycopg_pool.ConnectionPool` the caller
        owns. A caller's pool should use ``autocommit=True`` and, behind PgBouncer
        before 1.21 in transaction mode, ``prepare_threshold=None``.
    """

    def __init__(
        self,
        db: str | ConnectionPool[Any],
        *,
        pool_max_size: int = DEFAULT_POOL_MAX_SIZE,
        timeout: float = DEFAULT_CONNECT_TIMEOUT_MS / 1000,
    ) -> None:
        if isinstance(db, str):
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

    @property
    def pool(self) -> ConnectionPool[Any]:
        if self._given_pool is not None:
            return self._given_pool
        assert self._dsn is not None
        return _shared_pool(self._dsn, self.pool_max_size, self._timeout)

    @contextmanager
    def connection(self) -> Iterator[Connection]:
        """Lend a connection for one operation; broken ones are discarded by the pool."""
        with self.pool.connection() as conn:
            yield conn

    def direct_connection(self, **kwargs: Any) -> Connection:
        """Open a connection outside the pool (the listener's), in autocommit mode."""
        return psycopg.connect(self.conninfo, autocommit=True, **kwargs)
