"""A PostgreSQL database made for one test and dropped after it.

A test's limiters must not share tables with the project's, nor with another test's:
leases, queues and admission counts would leak between them. A database of its own
costs about a tenth of a second to create and drop, and dropping it ``WITH (FORCE)``
ends whatever connection a test left open. Needs the ``postgres`` extra (psycopg).
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator

__all__ = ["DEFAULT_SERVER_DSN", "SERVER_DSN_ENV", "server_dsn", "throwaway_database"]

#: Environment variable naming a server (any database on it) where tests may create
#: databases.
SERVER_DSN_ENV = "RUNCELL_TEST_DSN"
DEFAULT_SERVER_DSN = "postgresql://postgres@127.0.0.1:5432/postgres"


def server_dsn() -> str:
    """The DSN of ``$RUNCELL_TEST_DSN``, else the local server's ``postgres`` database."""
    return os.environ.get(SERVER_DSN_ENV) or DEFAULT_SERVER_DSN


@contextlib.contextmanager
def throwaway_database(server: str, *, prefix: str = "runcell_test") -> Iterator[str]:
    """Create an empty database on ``server``'s server; yield its DSN; drop it.

    :param server: a DSN of a database on the server, as a role that may create
        databases.
    :param prefix: the new database's name starts with it (a random suffix follows).
    :raises psycopg.OperationalError: the server cannot be reached; its message names
        the server.
    """
    import psycopg
    from psycopg import sql

    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(server, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield psycopg.conninfo.make_conninfo(server, dbname=name)
    finally:
        with psycopg.connect(server, autocommit=True) as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )
