"""``create_postgres_concurrency_limiter``: validate the options, build, register."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from psycopg_pool import ConnectionPool

from ..config import DEFAULT_LEASE_TTL_MS, WorkloadConfig, limiter_config
from ..errors import ConcurrencyConfigError
from .connection import DEFAULT_CONNECT_TIMEOUT_MS, DEFAULT_POOL_MAX_SIZE, Database
from .limiter import (
    DEFAULT_POLL_INTERVAL_MS,
    DEFAULT_QUEUE_ENTRY_TTL_MS,
    PostgresConcurrencyLimiter,
)
from .registration import OnConflict

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
    :param poll_interval_ms: how often a waiting request checks for a slot. The
        database load is about (waiting requests / poll interval) short statements.
    :param queue_entry_ttl_ms: how long a crashed waiter's queue row survives.
    :param ensure_schema: create tables and functions on first use; pass ``False``
        after applying :func:`postgres_concurrency_schema_sql` as a migration.
    :param on_conflict: when stored limits differ: ``"error"`` raises
        :class:`~runcell_celery.errors.ConcurrencyConfigError` naming the fields,
        ``"replace"`` stores these limits instead.
    :param listen: wake waiters by ``LISTEN/NOTIFY`` (polling stays the fallback);
        turn off behind a transaction pooler to skip the self-check.
    :param pool_max_size: connections the pool made from a DSN may open (per process).
    :param connect_timeout_ms: how long to wait for a database connection before the
        call fails closed with :class:`~runcell_celery.errors.ConcurrencyLimiterError`.
    The remaining options are those of :class:`~runcell_celery.config.LimiterConfig`.
    """
    for option, value, minimum in (
        ("poll_interval_ms", poll_interval_ms, 1),
        ("queue_entry_ttl_ms", queue_entry_ttl_ms, 1),
        ("pool_max_size", pool_max_size, 1),
        ("connect_timeout_ms", connect_timeout_ms, 1),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ConcurrencyConfigError(
                f"{option} = {value!r} is invalid: must be a positive integer", limiter=name
            )
    if on_conflict not in ("error", "replace"):
        raise ConcurrencyConfigError(
            f"on_conflict = {on_conflict!r} is invalid: must be 'error' or 'replace'", limiter=name
        )
    config = limiter_config(
        max_concurrent,
        max_queued=max_queued,
        workloads=workloads,
        default_workload=default_workload,
        name=name,
        lease_ttl_ms=lease_ttl_ms,
        max_hold_ms=max_hold_ms,
    )
    limiter = PostgresConcurrencyLimiter(
        Database(db, pool_max_size=pool_max_size, timeout=connect_timeout_ms / 1000),
        config,
        poll_interval_ms=poll_interval_ms,
        queue_entry_ttl_ms=queue_entry_ttl_ms,
        listen=listen,
    )
    limiter.register(ensure=ensure_schema, on_conflict=on_conflict)
    return limiter
