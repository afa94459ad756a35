"""A PostgreSQL database made for one test and dropped after it.

A test's limiters must not share tables with the project's, nor with another test's:
leases, queues and admission counts would leak between them. A database of its own
costs about a tenth of a second to create and drop, and dropping it ``WITH (FORCE)``
ends whatever connection a test left open. Needs the ``postgres`` extra (psycopg).

``$RUNCELL_TEST_COLLATION`` names an ICU locale (``en-US``) the databases are created
with instead of the server's default: managed PostgreSQL services default to
``en-US``, where names order differently than in ``C`` (``gpt-4o`` before ``OpenAI``),
and a suite run there proves nothing depends on the order of the test server.
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

#: Environment variable naming a server (any database on it) where tests may create
#: databases.
SERVER_DSN_ENV = "RUNCELL_TEST_DSN"
DEFAULT_SERVER_DSN = "postgresql://postgres@127.0.0.1:5432/postgres"
#: Environment variable naming the ICU locale (``en-US``) test databases are created
#: with; unset, empty or ``C``: the server's default (a copy of ``template1``).
COLLATION_ENV = "RUNCELL_TEST_COLLATION"
#: What an ICU locale name may look like (``en-US``, ``de-DE-u-co-phonebk``, ``und``).
_ICU_LOCALE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,62}")


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
    """``CREATE DATABASE name``, with ICU locale ``collation`` if one is given.

    A database with an ICU collation is copied from ``template0`` (``template1`` has
    the server's collation); its libc locale stays ``C.UTF-8``, so only the collation
    differs from the default test database.
    """
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
    """Create an empty database on ``server``'s server; yield its DSN; drop it.

    :param server: a DSN of a database on the server, as a role that may create
        databases.
    :param prefix: the new database's name starts with it (a random suffix follows).
    :param collation: an ICU locale (``en-US``) for the database's collation; default:
        ``$RUNCELL_TEST_COLLATION`` (:func:`collation_from_env`), else the server's.
    :raises psycopg.OperationalError: the server cannot be reached; its message names
        the server.
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
