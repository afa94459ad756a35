"""The limiter's tables and functions: where the DDL lives and how it is applied."""

from __future__ import annotations

import zlib
from importlib import resources
from typing import Any

import psycopg

from . import statements

__all__ = ["ensure_schema", "postgres_concurrency_schema_sql"]

#: Advisory lock key for schema creation (stable across processes and versions).
_SCHEMA_LOCK_KEY = zlib.crc32(b"runcell_celery.schema")


def postgres_concurrency_schema_sql() -> str:
    """Return the DDL for the limiter's tables and functions.

    Apply it as a migration when the database role may not run DDL, and create the
    limiter with ``ensure_schema=False``. It is idempotent.
    """
    return resources.files(__package__).joinpath("schema.sql").read_text(encoding="utf-8")


def ensure_schema(conn: psycopg.Connection[Any]) -> None:
    """Create the tables and functions unless they exist.

    Workers starting at the same moment on a new database take turns on an advisory
    lock, so concurrent ``CREATE`` statements never collide.
    """
    current = conn.execute(statements.SCHEMA_IS_CURRENT).fetchone()
    if current is not None and current[0]:
        return
    with conn.transaction():
        conn.execute(statements.LOCK_SCHEMA, {"key": _SCHEMA_LOCK_KEY})
        conn.execute(postgres_concurrency_schema_sql().encode())
