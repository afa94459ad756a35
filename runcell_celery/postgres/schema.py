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


SCHEMA_VERSION = 1


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
    """Create the tables and functions unless they exist.

    Workers starting at the same moment on a new database take turns on an advisory
    lock, so concurrent ``CREATE`` statements never collide.
    """
    if fetch_one(conn, statements.SCHEMA_EXISTS)[0]:
        current = fetch_one(conn, statements.SCHEMA_IS_CURRENT, {"checksum": schema_checksum()})
        if current[0]:
            return
    with conn.transaction():
        conn.execute(statements.LOCK_SCHEMA, {"key": _SCHEMA_LOCK_KEY})
        conn.execute(postgres_concurrency_schema_sql().encode())
