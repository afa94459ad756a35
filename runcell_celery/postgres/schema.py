"""The limiter's tables and functions: where the DDL lives, its version, how it is
applied. One version, :data:`SCHEMA_VERSION`, recorded in the database and checked at
start: an older or newer schema is refused naming both versions, unless the worker
may upgrade it (``ensure_schema=True``).
"""

from __future__ import annotations

import zlib
from importlib import resources
from typing import Any

import psycopg

from ..errors import ConcurrencyConfigError
from . import statements
from .connection import fetch_all

#: Advisory lock key for schema creation (stable across processes and versions).
_SCHEMA_LOCK_KEY = zlib.crc32(b"runcell_celery.schema")

#: The schema version this code works with. 4: the first released schema (function
#: names without version suffix, one function per operation); pre-release (0.1.0
#: development) databases recorded 3. Every later change to ``schema.sql`` raises it by
#: one and comes with a delta migration (``scripts/new_schema_migration.py``).
SCHEMA_VERSION = 4
#: Tries of an upgrade that deadlocked with running operations.
DDL_ATTEMPTS = 3


def _schema_file() -> str:
    return resources.files(__package__).joinpath("schema.sql").read_text(encoding="utf-8")


def postgres_concurrency_schema_sql() -> str:
    """Return the idempotent DDL of the tables and functions at :data:`SCHEMA_VERSION`
    (apply it as a migration and create limiters with ``ensure_schema=False``).
    """
    record = (
        "DELETE FROM runcell_schema;\n"
        f"INSERT INTO runcell_schema (version) VALUES ({int(SCHEMA_VERSION)});\n"
    )
    return _schema_file() + "\n" + record


def database_schema_version(conn: psycopg.Connection[Any]) -> int | None:
    """The schema version recorded in the database, or ``None`` without the tables."""
    if not fetch_all(conn, statements.SCHEMA_EXISTS)[0][0]:
        return None
    version = fetch_all(conn, statements.SCHEMA_VERSION_RECORDED)[0][0]
    return None if version is None else int(version)


def ensure_schema(conn: psycopg.Connection[Any], *, create: bool = True) -> None:
    """Check the database's schema version; create or upgrade it when ``create``
    (workers starting together take turns on an advisory lock; a deadlocked upgrade is
    tried again). A missing or older schema without ``create``, or a newer one, raises
    :class:`~runcell_celery.ConcurrencyConfigError`.
    """
    if _checked(conn, database_schema_version(conn), create=create):
        return
    for attempt in range(DDL_ATTEMPTS):
        try:
            with conn.transaction():
                conn.execute(statements.LOCK_SCHEMA, {"key": _SCHEMA_LOCK_KEY})
                if _checked(conn, database_schema_version(conn), create=create):
                    return
                conn.execute(postgres_concurrency_schema_sql().encode())
            return
        except psycopg.errors.DeadlockDetected:
            if attempt + 1 == DDL_ATTEMPTS:
                raise


def _checked(conn: psycopg.Connection[Any], version: int | None, *, create: bool) -> bool:
    """Whether the database is at :data:`SCHEMA_VERSION`; raise when it cannot be made so."""
    if version == SCHEMA_VERSION:
        return True
    if version is not None and version > SCHEMA_VERSION:
        raise ConcurrencyConfigError(
            f"the database's runcell schema is version {version}, newer than this "
            f"runcell_celery supports (version {SCHEMA_VERSION}): upgrade runcell_celery "
            "on this worker"
        )
    if create:
        return False
    if version is None:
        raise ConcurrencyConfigError(
            "the runcell tables do not exist in this database; apply "
            "postgres_concurrency_schema_sql() as a migration (manage.py migrate with "
            "runcell_django), or create the limiter with ensure_schema=True"
        )
    raise ConcurrencyConfigError(
        f"the database's runcell schema is version {version}, older than this "
        f"runcell_celery's (version {SCHEMA_VERSION}): the database is stale; apply the "
        "migrations (manage.py migrate runcell_django) or postgres_concurrency_schema_sql() "
        "(docs/postgres.md, 'Upgrading', says which upgrades need every worker stopped), or create "
        "the limiter with ensure_schema=True"
    )
