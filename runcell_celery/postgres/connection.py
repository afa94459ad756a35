"""Connections for the PostgreSQL limiter: a pool per process, safe across ``fork``.

Celery's prefork pool forks worker children from a parent that may already have
created limiters. A connection (or a pool's threads) inherited through ``fork`` must
never be used by the child, nor closed by it (closing sends a terminate message on
the parent's socket). So pools made from a DSN live in a
:class:`~runcell_celery.background.ProcessLocal`: a forked child leaves the parent's
untouched and opens its own.

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

from ..background import ProcessLocal
from .options import DEFAULT_CONNECT_TIMEOUT_MS, DEFAULT_POOL_MAX_SIZE

__all__ = ["Database", "fetch_all", "fetch_one", "redacted"]

logger = logging.getLogger("runcell_celery.postgres")

Connection = psycopg.Connection[Any]

#: TCP keepalives on every connection: a peer that vanished (a partition, a frozen
#: host) is noticed within about 20 s without sending a statement.
KEEPALIVES: dict[str, Any] = {
    "keepalives": 1,
    "keepalives_idle": 10,
    "keepalives_interval": 3,
    "keepalives_count": 3,
}


class _Pools:
    """This process's pools, one per (DSN, size, timeout): every limiter and store on
    the same database shares one."""

    def __init__(self) -> None:
        self.by_key: dict[tuple[str, int, float], ConnectionPool[Connection]] = {}
        self.lock = threading.Lock()

    def get(self, conninfo: str, max_size: int, timeout: float) -> ConnectionPool[Connection]:
        key = (conninfo, max_size, timeout)
        with self.lock:
            pool = self.by_key.get(key)
            if pool is None:
                pool = self.by_key[key] = ConnectionPool(
                    conninfo,
                    min_size=1,
                    max_size=max_size,
                    timeout=timeout,
                    kwargs={
                        "autocommit": True,
                        "prepare_threshold": None,
                        "connect_timeout": max(1, int(timeout)),
                        **KEEPALIVES,
                    },
                    name=f"runcell-{os.getpid()}",
                    open=True,
                )
            return pool


_pools: ProcessLocal[_Pools] = ProcessLocal(_Pools)


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
    def key(self) -> object:
        """What identifies this database's connections in this process: its DSN when
        the pool is ours (one per DSN and process), the caller's pool itself otherwise."""
        return self.conninfo if self._given_pool is None else ("pool", id(self._given_pool))

    @property
    def pool(self) -> ConnectionPool[Any]:
        if self._given_pool is not None:
            return self._given_pool
        assert self._dsn is not None
        return _pools.get().get(self._dsn, self.pool_max_size, self._timeout)

    @contextmanager
    def connection(self, timeout: float | None = None) -> Iterator[Connection]:
        """Lend a connection for one operation; broken ones are discarded by the pool.

        :param timeout: wait at most this long for one (default: the pool's timeout,
            ``connect_timeout_ms``).
        """
        with self.pool.connection(timeout=timeout) as conn:
            yield conn

    def direct_connection(self, **kwargs: Any) -> Connection:
        """Open a connection outside the pool (the listener's), in autocommit mode."""
        return psycopg.connect(self.conninfo, autocommit=True, **{**KEEPALIVES, **kwargs})


def redacted(conninfo: str) -> str:
    """``host:port/dbname`` of a DSN, for logs and reprs (never the password)."""
    try:
        params = psycopg.conninfo.conninfo_to_dict(conninfo)
    except psycopg.ProgrammingError:
        return "the database"
    return (
        f"{params.get('host', 'localhost')}:{params.get('port', 5432)}/{params.get('dbname', '')}"
    )
