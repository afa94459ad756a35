"""One schema version, recorded in the database and checked by every worker at start."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

from runcell_celery import ConcurrencyConfigError, slot
from runcell_celery.postgres import (
    SCHEMA_VERSION,
    create_postgres_concurrency_limiter,
    postgres_concurrency_schema_sql,
)

ROOT = Path(__file__).resolve().parents[2]


def _record(dsn: str, version: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(postgres_concurrency_schema_sql().encode())
        conn.execute("UPDATE runcell_schema SET version = %s", [version])


def _recorded(dsn: str) -> list[int]:
    with psycopg.connect(dsn) as conn:
        return [row[0] for row in conn.execute("SELECT version FROM runcell_schema")]


def test_a_stale_database_is_refused_naming_both_versions(fresh_dsn: str) -> None:
    _record(fresh_dsn, SCHEMA_VERSION - 1)
    with pytest.raises(ConcurrencyConfigError) as refused:
        create_postgres_concurrency_limiter(
            fresh_dsn, name="stale", max_concurrent=1, ensure_schema=False
        )
    message = str(refused.value)
    assert f"version {SCHEMA_VERSION - 1}, older" in message
    assert f"(version {SCHEMA_VERSION})" in message
    assert "manage.py migrate" in message
    assert _recorded(fresh_dsn) == [SCHEMA_VERSION - 1], "ensure_schema=False ran DDL"


def test_a_database_newer_than_the_code_is_refused_even_with_ensure_schema(
    fresh_dsn: str,
) -> None:
    _record(fresh_dsn, SCHEMA_VERSION + 1)
    for ensure in (False, True):
        with pytest.raises(ConcurrencyConfigError) as refused:
            create_postgres_concurrency_limiter(
                fresh_dsn, name="newer", max_concurrent=1, ensure_schema=ensure
            )
        message = str(refused.value)
        assert f"version {SCHEMA_VERSION + 1}, newer" in message
        assert f"(version {SCHEMA_VERSION})" in message
    assert _recorded(fresh_dsn) == [SCHEMA_VERSION + 1], "a newer schema was overwritten"


def test_a_stale_database_is_upgraded_by_a_worker_that_may_run_ddl(fresh_dsn: str) -> None:
    _record(fresh_dsn, SCHEMA_VERSION - 1)
    limiter = create_postgres_concurrency_limiter(fresh_dsn, name="upgraded", max_concurrent=1)
    with slot(limiter) as held:
        assert held.lease is not None
    assert _recorded(fresh_dsn) == [SCHEMA_VERSION]


def test_a_current_database_serves_a_limiter_without_ddl(fresh_dsn: str) -> None:
    _record(fresh_dsn, SCHEMA_VERSION)
    limiter = create_postgres_concurrency_limiter(
        fresh_dsn, name="current", max_concurrent=1, ensure_schema=False
    )
    with slot(limiter) as held:
        assert held.lease is not None


#: Run in a process where Django cannot be imported.
WITHOUT_DJANGO = """
import sys
sys.modules["django"] = None  # any import of django fails
import psycopg
from runcell_celery.postgres import SCHEMA_VERSION, postgres_concurrency_schema_sql
from runcell_celery.postgres.schema import database_schema_version, ensure_schema

dsn, other = sys.argv[1], sys.argv[2]
with psycopg.connect(dsn, autocommit=True) as conn:
    ensure_schema(conn)
    assert database_schema_version(conn) == SCHEMA_VERSION
with psycopg.connect(other, autocommit=True) as conn:
    conn.execute(postgres_concurrency_schema_sql().encode())
    assert database_schema_version(conn) == SCHEMA_VERSION
assert "django" not in {name.split(".")[0] for name, mod in sys.modules.items() if mod}
print("ok")
"""


def test_without_django_the_schema_sql_and_ensure_schema_work(fresh_dsn: str, pg_dsn: str) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("CREATE SCHEMA IF NOT EXISTS no_django")
    other = psycopg.conninfo.make_conninfo(pg_dsn, options="-c search_path=no_django")
    try:
        done = subprocess.run(
            [sys.executable, "-c", WITHOUT_DJANGO, fresh_dsn, other],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == "ok"
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute("DROP SCHEMA no_django CASCADE")
