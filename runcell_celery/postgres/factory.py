"""``create_postgres_concurrency_limiter``: one limiter from keyword arguments.

A thin wrapper: the limits go through :func:`~runcell_celery.config.limiter_config`,
the PostgreSQL options through :class:`PostgresOptions`, and a
:class:`~runcell_celery.postgres.PostgresBackend` builds and registers the limiter.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from typing import Any

from psycopg_pool import ConnectionPool

from ..config import DEFAULT_LEASE_TTL_MS, Fairness, WorkloadConfig, limiter_config
from .backend import PostgresBackend
from .limiter import PostgresConcurrencyLimiter
from .options import (
    DEFAULT_CONNECT_TIMEOUT_MS,
    DEFAULT_POLL_INTERVAL_MS,
    DEFAULT_POOL_MAX_SIZE,
    DEFAULT_QUEUE_ENTRY_TTL_MS,
    OnConflict,
    PostgresOptions,
)

__all__ = ["create_postgres_concurrency_limiter"]


def create_postgres_concurrency_limiter(
    db: str | ConnectionPool[Any],
    *,
    max_concurrent: int,
    name: str = "default",
    max_queued: int | None = None,
    workloads: Mapping[str, WorkloadConfig | Mapping[str, Any]] | None = None,
    default_workload: str | None = None,
    lease_ttl_ms: int = DEFAULT_LEASE_TTL_MS,
    max_hold_ms: int | None = None,
    claim_window_ms: int | None = None,
    keyed: bool = False,
    fairness: Fairness = "fifo",
    poll_interval_ms: int = DEFAULT_POLL_INTERVAL_MS,
    queue_entry_ttl_ms: int = DEFAULT_QUEUE_ENTRY_TTL_MS,
    ensure_schema: bool = True,
    on_conflict: OnConflict = "error",
    listen: bool = True,
    pool_max_size: int = DEFAULT_POOL_MAX_SIZE,
    connect_timeout_ms: int = DEFAULT_CONNECT_TIMEOUT_MS,
) -> PostgresConcurrencyLimiter:
    """Create a limiter whose slots every process using ``name`` on ``db`` shares.

    :param db: a PostgreSQL DSN, or a :class:`psycopg_pool.ConnectionPool`.

    ``poll_interval_ms``, ``queue_entry_ttl_ms``, ``ensure_schema``, ``on_conflict``,
    ``listen``, ``pool_max_size`` and ``connect_timeout_ms`` are the fields of
    :class:`~runcell_celery.postgres.PostgresOptions` (documented there); the others
    those of :class:`~runcell_celery.config.LimiterConfig`. With ``keyed=True`` the
    limiter is a template: ``limiter.key("acme")`` is the limiter of that key, with the
    same limits (:mod:`runcell_celery.postgres.keyed`). Limiters made this way for one
    database share one backend (:class:`StandaloneBackends`); it ends its threads
    and closes its connections once every one of them is closed (``limiter.close()``).

    :raises ConcurrencyConfigError: an option or limit is invalid, or the stored
        limits differ (``on_conflict="error"``).
    """
    options = PostgresOptions.from_mapping(
        {
            "poll_interval_ms": poll_interval_ms,
            "queue_entry_ttl_ms": queue_entry_ttl_ms,
            "ensure_schema": ensure_schema,
            "on_conflict": on_conflict,
            "listen": listen,
            "pool_max_size": pool_max_size,
            "connect_timeout_ms": connect_timeout_ms,
        }
    )
    config = limiter_config(
        max_concurrent,
        max_queued=max_queued,
        workloads=workloads,
        default_workload=default_workload,
        name=name,
        lease_ttl_ms=lease_ttl_ms,
        max_hold_ms=max_hold_ms,
        claim_window_ms=claim_window_ms,
        keyed=keyed,
        fairness=fairness,
    )
    backend = STANDALONE.take(db, options)
    try:
        return backend.create_limiter(config, owns=True)
    except BaseException:
        backend.release_owner()  # nothing keeps retrying a database it could not use
        raise


class StandaloneBackends:
    """The backends of :func:`create_postgres_concurrency_limiter`: one per database
    and options in a process, shared by every limiter made for them.

    Limiters made one by one for the same database share one pool, waiting room and
    listener, as a registry's limiters share their backend: three limiters cost a
    process the connections of one, not three. The backend closes with the last of
    its limiters (:meth:`~runcell_celery.postgres.PostgresConcurrencyLimiter.close`);
    the next limiter for that database then makes a new one. A forked child shares
    its parent's entries, whose backends make the child an engine of its own.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._backends: dict[tuple[object, PostgresOptions], PostgresBackend] = {}
        os.register_at_fork(after_in_child=self._after_fork)

    def _after_fork(self) -> None:
        self._lock = threading.Lock()  # a parent's thread may have held it

    def take(self, db: str | ConnectionPool[Any], options: PostgresOptions) -> PostgresBackend:
        """The backend for ``db`` and ``options``, counted as one more limiter's."""
        where: object = db if isinstance(db, str) else id(db)
        key = (where, options)
        with self._lock:
            backend = self._backends.get(key)
            if backend is None:
                backend = self._backends[key] = PostgresBackend.from_options(db, options)
            backend.add_owner(lambda: self._forget(key, backend))
        return backend

    def _forget(self, key: tuple[object, PostgresOptions], backend: PostgresBackend) -> None:
        with self._lock:
            if self._backends.get(key) is backend:
                del self._backends[key]


#: The process's standalone backends (the default registry of
#: :func:`create_postgres_concurrency_limiter`, as a LimiterRegistry is a worker's).
STANDALONE = StandaloneBackends()
