"""PostgreSQL fixtures: a database of our own per test module, dropped at its end.

Reads ``RUNCELL_TEST_DSN`` (default: the local server's ``postgres`` database) to
reach a server where it may create databases, and ``RUNCELL_TEST_COLLATION`` (an ICU
locale such as ``en-US``; default: the server's) for the collation of those databases.
"""

from __future__ import annotations

import gc
import os
import random
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql

from runcell_celery.postgres import PostgresConcurrencyLimiter, create_postgres_concurrency_limiter
from runcell_celery.testing.databases import collation_from_env, create_database_statement

ADMIN_DSN = os.environ.get("RUNCELL_TEST_DSN", "postgresql://postgres@127.0.0.1:5432/postgres")


def _with_dbname(dsn: str, dbname: str) -> str:
    params = psycopg.conninfo.conninfo_to_dict(dsn)
    params["dbname"] = dbname
    return psycopg.conninfo.make_conninfo(**params)


def create_database(prefix: str, *, collation: str | None = None) -> str:
    """Create an empty database and return its DSN.

    :param collation: an ICU locale (``en-US``) for its collation; default:
        ``$RUNCELL_TEST_COLLATION``, else the server's.
    """
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    statement = create_database_statement(name, collation or collation_from_env())
    with psycopg.connect(ADMIN_DSN, autocommit=True) as conn:
        conn.execute(statement)
    return _with_dbname(ADMIN_DSN, name)


def drop_database(dsn: str) -> None:
    """Drop a database made by :func:`create_database`, ending its sessions first (the
    backends dropped without being closed close as they are collected, not left
    retrying it)."""
    gc.collect()
    name = psycopg.conninfo.conninfo_to_dict(dsn)["dbname"]
    with psycopg.connect(ADMIN_DSN, autocommit=True) as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )


@pytest.fixture(scope="module")
def pg_dsn() -> Iterator[str]:
    """A fresh database with the limiter schema, shared by the module's tests. Dropped
    when the module ends, not the session: the pools of limiters a test did not close
    then end with it instead of adding up, module after module, towards the shared
    server's ``max_connections`` (three test processes and their workers share it)."""
    dsn = create_database("runcell_test")
    try:
        yield dsn
    finally:
        drop_database(dsn)


@pytest.fixture
def fresh_dsn() -> Iterator[str]:
    """A database of this test's own (for schema-creation tests)."""
    dsn = create_database("runcell_fresh")
    try:
        yield dsn
    finally:
        drop_database(dsn)


def unique_name(prefix: str = "limiter") -> str:
    """A name no other test uses. Under ``$RUNCELL_TEST_COLLATION`` some of its letters
    are capitals, so that about one pair of names in four sorts one way in ``C`` (and
    Python) and the other way in the collation (``B`` before ``a``, but ``a`` before
    ``B`` in en-US): every test over several limiters then meets both orders."""
    suffix = uuid.uuid4().hex[:12]
    if collation_from_env() is not None:
        suffix = "".join(c.upper() if random.random() < 0.5 else c for c in suffix)
    return f"{prefix}-{suffix}"


@pytest.fixture
def make_limiter(pg_dsn: str) -> Iterator[Callable[..., PostgresConcurrencyLimiter]]:
    """Create limiters with unique names on the module's database (each with its own
    backend, closed after the test)."""
    made: list[PostgresConcurrencyLimiter] = []

    def make(**options: Any) -> PostgresConcurrencyLimiter:
        options.setdefault("name", unique_name())
        options.setdefault("poll_interval_ms", 20)
        made.append(create_postgres_concurrency_limiter(pg_dsn, **options))
        return made[-1]

    yield make
    for limiter in made:
        limiter.close()
