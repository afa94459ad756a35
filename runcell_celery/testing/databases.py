"""A PostgreSQL database made for one test and dropped after it (``postgres`` extra).

A test's limiters must share tables with neither the project's nor another test's:
leases, queues and counts would leak between them. Creating and dropping a database
costs about a tenth of a second, and ``DROP ... WITH (FORCE)`` ends whatever connection
a test left open.
"""

from __future__ import annotations

import contextlib
import os
import re
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from psycopg import sql

__all__ = [
    "COLLATION_ENV",
    "DEFAULT_SERVER_DSN",
    "SERVER_DSN_ENV",
    "collation_from_env",
    "create_database_statement",
    "server_dsn",
    "throwaway_database",
]

#: A server (any database on it) where tests may create databases.
SERVER_DSN_ENV = "RUNCELL_TEST_DSN"
DEFAULT_SERVER_DSN = "postgresql://postgres@127.0.0.1:5432/postgres"
#: An ICU locale (``en-US``) to create test databases with, as managed services default
#: to: names order differently than in ``C``, and a run there proves nothing depends on
#: the test server's order. Unset, empty or ``C``: the server's default.
COLLATION_ENV = "RUNCELL_TEST_COLLATION"
_ICU_LOCALE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,62}")  # en-US, de-DE-u-co-phonebk, und


def server_dsn() -> str:
    """The DSN of ``$RUNCELL_TEST_DSN``, else the local server's ``postgres`` database."""
    return os.environ.get(SERVER_DSN_ENV) or DEFAULT_SERVER_DSN


def collation_from_env() -> str | None:
    """The ICU locale of ``$RUNCELL_TEST_COLLATION``, or ``None`` (the server's default).

    :raises ValueError: the value is not a locale name (it is shown: it is no secret).
    """
    value = os.environ.get(COLLATION_ENV, "").strip()
    if value in ("", "C", "POSIX", "C.UTF-8", "C.utf8"):
        return None
    if not _ICU_LOCALE.fullmatch(value):
        raise ValueError(
            f"${COLLATION_ENV} must be an ICU locale name such as en-US (or C): got {value!r}"
        )
    return value


def create_database_statement(name: str, collation: str | None = None) -> sql.Composed:
    """``CREATE DATABASE name``, with ICU locale ``collation`` if given: copied from
    ``template0`` (``template1`` has the server's), its libc locale ``C.UTF-8``."""
    from psycopg import sql

    statement = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name))
    if collation is None:
        return statement
    return sql.SQL(
        "{} TEMPLATE template0 ENCODING 'UTF8' LOCALE_PROVIDER icu ICU_LOCALE {} LOCALE 'C.UTF-8'"
    ).format(statement, sql.Literal(collation))


@contextlib.contextmanager
def throwaway_database(
    server: str, *, prefix: str = "runcell_test", collation: str | None = None
) -> Iterator[str]:
    """Create an empty database on ``server``'s server (a DSN, as a role that may create
    databases); yield its DSN; drop it.

    The name is ``prefix`` and a random suffix; ``collation`` defaults to
    :func:`collation_from_env`. An unreachable server raises ``psycopg.OperationalError``.
    """
    import psycopg
    from psycopg import sql

    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    statement = create_database_statement(name, collation or collation_from_env())
    with psycopg.connect(server, autocommit=True) as conn:
        conn.execute(statement)
    try:
        yield psycopg.conninfo.make_conninfo(server, dbname=name)
    finally:
        with psycopg.connect(server, autocommit=True) as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )
