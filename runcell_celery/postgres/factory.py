"""``create_postgres_concurrency_limiter``: one limiter from keyword arguments."""

from __future__ import annotations

import dataclasses
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
    """Create a limiter whose slots every process using ``name`` on ``db`` (a DSN or a
    :class:`psycopg_pool.ConnectionPool`) shares; the options are those of
    :class:`~runcell_celery.postgres.PostgresOptions` and
    :class:`~runcell_celery.config.LimiterConfig`. The limiter owns a backend of its own:
    ``limiter.close()`` ends its threads and connections.

    :raises ConcurrencyConfigError: an option is invalid, or the stored limits differ.
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
    backend = PostgresBackend(database=db, options=dataclasses.asdict(options))
    try:
        return backend.create_limiter(config, owns=True)
    except BaseException:
        backend.close()  # nothing keeps retrying a database it could not use
        raise
