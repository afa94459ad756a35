"""close_database: a process done with a database leaves no pool or listener on it."""

from __future__ import annotations

import os
import time

import psycopg

from runcell_celery import AcquireRequest, RunLineage
from runcell_celery.postgres import close_database, create_postgres_concurrency_limiter
from tests.support.pg import ADMIN_DSN, create_database, drop_database, unique_name


def _our_connections(dsn: str) -> int:
    name = psycopg.conninfo.conninfo_to_dict(dsn)["dbname"]
    with psycopg.connect(ADMIN_DSN, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = %s "
            "AND application_name <> 'close-check' AND client_port IS NOT NULL "
            "AND pid <> pg_backend_pid()",
            [name],
        ).fetchone()
    return int(row[0]) if row else 0


def test_closing_a_database_ends_this_processs_pool_and_listener_on_it() -> None:
    dsn = create_database("runcell_close")
    try:
        limiter = create_postgres_concurrency_limiter(
            dsn, name=unique_name("close"), max_concurrent=1
        )
        request_id = unique_name("request")
        lease = limiter.acquire(
            AcquireRequest(
                request_id=request_id,
                workload="default",
                lineage=RunLineage(request_id, request_id),
            )
        )
        limiter.release(lease)
        assert limiter.room.listener is not None
        limiter.room.listener.start()
        deadline = time.monotonic() + 10
        while _our_connections(dsn) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)  # the pool's connection, and the listener's
        assert _our_connections(dsn) >= 2, "nothing was open: the test proves nothing"

        close_database(dsn)

        deadline = time.monotonic() + 15
        while _our_connections(dsn) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _our_connections(dsn) == 0, f"process {os.getpid()} kept connections open"
    finally:
        drop_database(dsn)
