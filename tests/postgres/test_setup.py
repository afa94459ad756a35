"""Schema creation, stored limits and conflicts between workers' limits."""

from __future__ import annotations

import multiprocessing
import os
import signal
from collections.abc import Iterator
from multiprocessing.context import SpawnProcess

import psycopg
import pytest

from runcell_celery import ConcurrencyConfigError, slot
from runcell_celery.postgres import (
    SCHEMA_VERSION,
    PostgresOptions,
    create_postgres_concurrency_limiter,
    postgres_concurrency_schema_sql,
)
from tests.support import processes
from tests.support.pg import unique_name

SPAWN = multiprocessing.get_context("spawn")


@pytest.fixture
def children() -> Iterator[list[SpawnProcess]]:
    started: list[SpawnProcess] = []
    yield started
    for child in started:
        if child.is_alive() and child.pid is not None:
            os.kill(child.pid, signal.SIGKILL)
        child.join(10)


def test_workers_starting_together_on_a_new_database_do_not_conflict(
    fresh_dsn: str, children: list[SpawnProcess]
) -> None:
    go = SPAWN.Event()
    pipes = []
    limits = {"name": "shared", "max_concurrent": 2}
    for _ in range(6):
        receive, send = SPAWN.Pipe(duplex=False)
        child = SPAWN.Process(
            target=processes.create_when_told, args=(fresh_dsn, limits, go, send), daemon=True
        )
        child.start()
        children.append(child)
        pipes.append(receive)
    go.set()
    results = [pipe.recv() if pipe.poll(60) else "no answer" for pipe in pipes]
    assert results == ["ok"] * 6
    with psycopg.connect(fresh_dsn) as conn:
        names = conn.execute("SELECT name FROM runcell_limiter").fetchall()
        versions = conn.execute("SELECT version FROM runcell_schema").fetchall()
    assert names == [("shared",)]
    assert versions == [(SCHEMA_VERSION,)]  # recorded once


def test_schema_sql_applied_as_a_migration_serves_a_limiter_without_ddl(fresh_dsn: str) -> None:
    with psycopg.connect(fresh_dsn, autocommit=True) as conn:
        conn.execute(postgres_concurrency_schema_sql().encode())
        conn.execute(postgres_concurrency_schema_sql().encode())  # idempotent
    limiter = create_postgres_concurrency_limiter(
        fresh_dsn, name="migrated", max_concurrent=1, ensure_schema=False
    )
    with slot(limiter) as held:
        assert held.lease is not None


def test_without_the_schema_and_ensure_schema_off_the_error_says_what_to_do(
    fresh_dsn: str,
) -> None:
    with pytest.raises(ConcurrencyConfigError, match="postgres_concurrency_schema_sql"):
        create_postgres_concurrency_limiter(
            fresh_dsn, name="nothing", max_concurrent=1, ensure_schema=False
        )


def test_a_worker_with_different_limits_fails_naming_the_fields(pg_dsn: str) -> None:
    name = unique_name("conflict")
    create_postgres_concurrency_limiter(
        pg_dsn, name=name, max_concurrent=4, workloads={"a": {"reserved": 1}, "b": {}}
    )
    with pytest.raises(ConcurrencyConfigError) as conflict:
        create_postgres_concurrency_limiter(
            pg_dsn, name=name, max_concurrent=5, workloads={"a": {"reserved": 2}, "b": {}}
        )
    message = str(conflict.value)
    assert "max_concurrent (stored 4, given 5)" in message
    assert "workloads.a.reserved (stored 1, given 2)" in message
    assert conflict.value.limiter == name


def test_the_same_limits_in_another_worker_are_accepted(pg_dsn: str) -> None:
    name = unique_name("same")
    first = create_postgres_concurrency_limiter(pg_dsn, name=name, max_concurrent=2)
    second = create_postgres_concurrency_limiter(pg_dsn, name=name, max_concurrent=2)
    with slot(first), slot(second):
        assert first.stats().active == 2


def test_replace_stores_new_limits_and_stops_workers_with_the_old_ones(pg_dsn: str) -> None:
    name = unique_name("replace")
    old = create_postgres_concurrency_limiter(pg_dsn, name=name, max_concurrent=1)
    new = create_postgres_concurrency_limiter(
        pg_dsn, name=name, max_concurrent=3, on_conflict="replace"
    )
    with slot(new), slot(new), slot(new):
        assert new.stats().active == 3
    with pytest.raises(ConcurrencyConfigError, match="replaced by another worker"), slot(old):
        pass


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("poll_interval_ms", 0),
        ("queue_entry_ttl_ms", -5),
        ("connect_timeout_ms", "5s"),
        ("on_conflict", "merge"),
    ],
)
def test_invalid_postgres_options_are_rejected_by_name(
    pg_dsn: str, option: str, value: object
) -> None:
    with pytest.raises(ConcurrencyConfigError, match=f"{option} = {value!r}"):
        create_postgres_concurrency_limiter(
            pg_dsn, name=unique_name(), max_concurrent=1, **{option: value}
        )


def test_db_must_be_a_dsn_or_a_pool() -> None:
    with pytest.raises(TypeError, match=r"DSN string or a psycopg_pool\.ConnectionPool"):
        create_postgres_concurrency_limiter(42, max_concurrent=1)  # type: ignore[arg-type]


def test_a_database_from_an_earlier_revision_is_upgraded_in_place(fresh_dsn: str) -> None:
    # A database made before later columns existed (as an early adopter's would be).
    with psycopg.connect(fresh_dsn, autocommit=True) as conn:
        conn.execute(postgres_concurrency_schema_sql().encode())
        conn.execute(
            "ALTER TABLE runcell_queue DROP COLUMN in_progress, DROP COLUMN publication_id;"
            "ALTER TABLE runcell_lease DROP COLUMN picked_up_at;"
            "UPDATE runcell_schema SET version = version - 1;"
        )
    limiter = create_postgres_concurrency_limiter(fresh_dsn, name="upgraded", max_concurrent=2)
    with slot(limiter), slot(limiter):
        assert limiter.stats().active == 2
    with psycopg.connect(fresh_dsn) as conn:
        columns = {
            row[0]
            for row in conn.execute(
                "SELECT column_name FROM information_schema.columns "
                "WHERE table_name IN ('runcell_queue', 'runcell_lease')"
            )
        }
        versions = conn.execute("SELECT version FROM runcell_schema").fetchall()
    assert {"in_progress", "publication_id", "picked_up_at"} <= columns
    assert versions == [(SCHEMA_VERSION,)]


@pytest.mark.parametrize(
    ("option", "value", "bound"),
    [
        ("queue_entry_ttl_ms", 2**31, "2147483647"),
        ("poll_interval_ms", 10**12, "2147483647"),
        ("connect_timeout_ms", 2**40, "2147483647"),
        ("pool_max_size", 10**6, "10000"),
    ],
)
def test_backend_options_past_their_bound_are_rejected_naming_option_and_bound(
    option: str, value: int, bound: str
) -> None:
    with pytest.raises(ConcurrencyConfigError) as caught:
        PostgresOptions.from_mapping({option: value}, path='RUNCELL["POSTGRES"]')
    assert f'RUNCELL["POSTGRES"]["{option}"] = {value}' in str(caught.value)
    assert f"must be at most {bound}" in str(caught.value)
