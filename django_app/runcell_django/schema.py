"""Keep the limiter's tables and functions at the installed version on ``migrate``.

Migration ``0001_initial`` applies the limiter's DDL as it is when it runs. A newer
``runcell_celery`` may ship newer DDL (recorded by checksum in ``runcell_schema``);
workers with ``ensure_schema=True`` apply it on first use, but a deployment that runs
them with ``ensure_schema=False`` relies on ``manage.py migrate``. So after every
``migrate`` this applies the installed DDL where the app's tables exist and the
checksum is not current, with the core's own :func:`ensure_schema` (idempotent, under
an advisory lock, so concurrent deploys do not conflict).
"""

from __future__ import annotations

from typing import Any

from django.db import connections

from . import conf

__all__ = ["update_limiter_schema"]


def update_limiter_schema(*, using: str, **_: Any) -> None:
    """``post_migrate`` receiver: bring the limiter's schema on ``using`` up to date."""
    connection = connections[using]
    if connection.vendor != "postgresql":
        return
    with connection.cursor() as cursor:
        if "runcell_schema" not in connection.introspection.table_names(cursor):
            return  # this app is not migrated on that database
    import psycopg

    from runcell_celery.postgres.schema import ensure_schema

    with psycopg.connect(conf.resolve_database(using), autocommit=True) as conn:
        ensure_schema(conn)
