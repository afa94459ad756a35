"""Close what this process opened for one database.

A limiter made from a DSN shares this process's pool, listener and safety poll for
that database with every other limiter and store on it, and they live as long as the
process: that suits a worker. A process that is done with a database while it goes on
running — a test suite that drops a throwaway database after each test, a script that
moves to another database — closes them with :func:`close_database`, so no pool or
listener keeps retrying a database that is gone.
"""

from __future__ import annotations

from .connection import Database, close_pools
from .waiting import close_room

__all__ = ["close_database"]


def close_database(dsn: str) -> None:
    """Stop this process's listener and safety poll for ``dsn`` and close its pools.

    Limiters and backends on ``dsn`` must not be used afterwards (a later use opens a
    new pool, but nothing listens for its grants). Other processes are not affected.
    """
    close_room(Database(dsn).key)
    close_pools(dsn)
