"""A release or renewal never queues behind other calls for a pooled connection: the
others share all but the last connection of the pool (``Database.connection``)."""

from __future__ import annotations

import time

import pytest

from runcell_celery.postgres.connection import Database, PoolBusy


def test_an_urgent_call_gets_the_last_connection_while_the_others_wait(pg_dsn: str) -> None:
    database = Database(pg_dsn, pool_max_size=3, timeout=5)
    try:
        with database.connection() as first, database.connection() as second:
            assert first is not second
            started = time.monotonic()
            # A third ordinary call waits at the gate, then fails.
            with pytest.raises(PoolBusy, match="all 2 connections"), database.connection(0.2):
                pass
            assert time.monotonic() - started >= 0.2
            with database.connection(timeout=0.2, urgent=True) as urgent:
                assert urgent.execute("SELECT 1").fetchone() == (1,)
        with database.connection(timeout=0.2):  # the gate let them go
            pass
    finally:
        database.close()


def test_a_pool_of_one_has_no_gate(pg_dsn: str) -> None:
    database = Database(pg_dsn, pool_max_size=1, timeout=5)
    try:
        with database.connection(timeout=1) as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)
    finally:
        database.close()
