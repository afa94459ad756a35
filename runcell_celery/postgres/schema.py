"""The limiter's tables and functions: where the DDL lives and how it is applied."""

from __future__ import annotations

import hashlib
import zlib
from importlib import resources
from typing import Any

import psycopg

from . import statements
from .connection import fetch_one

__all__ = ["ensure_schema", "postgres_concurrency_schema_sql", "schema_checksum"]

#: Advisory lock key for schema creation (stable across processes and versions).
_SCHEMA_LOCK_KEY = zlib.crc32(b"runcell_celery.schema")


SCHEMA_VERSION = 3
#: Tries of an upgrade that deadlocked with running operations.
DDL_ATTEMPTS = 3


def _schema_file() -> str:
    return resources.files(__package__).joinpath("schema.sql").read_text(encoding="utf-8")


def schema_checksum() -> str:
    """The checksum of the DDL this version ships (recorded in ``runcell_schema``)."""
    return hashlib.sha256(_schema_file().encode()).hexdigest()[:16]


def postgres_concurrency_schema_sql() -> str:
    """Return the DDL for the limiter's tables and functions.

    Apply it as a migration when the database role may not run DDL, and create the
    limiter with ``ensure_schema=False``. It is idempotent, and records its own
    checksum so that workers know the database is current.
    """
    checksum = schema_checksum()
    # Only the revision applied last is kept: workers compare their own against it.
    record = (
        f"DELETE FROM runcell_schema WHERE checksum IS DISTINCT FROM '{checksum}';\n"
        "INSERT INTO runcell_schema (checksum, version) "
        f"VALUES ('{checksum}', {SCHEMA_VERSION}) ON CONFLICT DO NOTHING;\n"
    )
    return _schema_file() + "\n" + record


def ensure_schema(conn: psycopg.Connection[Any]) -> None:
    """Create the tables and functions unless they exist and are current.

    Workers starting at the same moment on a new database take turns on an advisory
    lock, so concurrent ``CREATE`` statements never collide; whoever gets the lock
    after another worker applied the DDL finds it current and applies nothing (the
    DDL takes table locks that running operations would otherwise queue behind). An
    upgrade that deadlocks with running operations is tried again.
    """
    if _is_current(conn):
        return
    for attempt in range(DDL_ATTEMPTS):
        try:
            with conn.transaction():
                conn.execute(statements.LOCK_SCHEMA, {"key": _SCHEMA_LOCK_KEY})
                if _is_current(conn):
                    return
                conn.execute(postgres_concurrency_schema_sql().encode())
            return
        except psycopg.errors.DeadlockDetected:
            if attempt + 1 == DDL_ATTEMPTS:
                raise


def _is_current(conn: psycopg.Connection[Any]) -> bool:
    if not fetch_one(conn, statements.SCHEMA_EXISTS)[0]:
        return False
    return bool(fetch_one(conn, statements.SCHEMA_IS_CURRENT, {"checksum": schema_checksum()})[0])
