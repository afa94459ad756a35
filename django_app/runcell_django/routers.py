"""A database router for a limiter database other than Django's ``default``.

.. code-block:: python

    DATABASE_ROUTERS = ["runcell_django.routers.RunCellRouter"]

With ``RUNCELL["DATABASE"]`` a DSN (alias ``"runcell"``) or another alias than
``default``, the app's tables belong there: ``manage.py migrate`` then leaves the app out
of ``default`` (where its PostgreSQL DDL may fail), and ``manage.py migrate --database
runcell`` creates them. The system checks say when the router is missing.
"""

from __future__ import annotations

import sys
from typing import Any

from django.db import models

from . import conf, databases

__all__ = ["APP_LABEL", "RunCellRouter", "say_where_the_tables_go"]

#: The app whose models and migrations are routed.
APP_LABEL = "runcell_django"


class RunCellRouter:
    """Send ``runcell_django``'s reads, writes and migrations to the limiter's database,
    with no opinion (``None``) on anything else: it stands beside any other router."""

    def db_for_read(self, model: type[models.Model], **hints: Any) -> str | None:
        return conf.database_alias() if model._meta.app_label == APP_LABEL else None

    db_for_write = db_for_read

    def allow_relation(self, obj1: models.Model, obj2: models.Model, **hints: Any) -> bool | None:
        labels = {obj1._meta.app_label, obj2._meta.app_label}
        return True if labels == {APP_LABEL} else None

    def allow_migrate(self, db: str, app_label: str, **hints: Any) -> bool | None:
        """The app's migrations only in the limiter's database; no other app's in the
        database registered for a DSN."""
        alias = conf.database_alias()
        if alias is None:
            return None
        if app_label == APP_LABEL:
            return db == alias
        if databases.is_registered_dsn(db):
            return False
        return None


def say_where_the_tables_go(
    *, using: str, plan: list[tuple[Any, bool]] | None = None, verbosity: int = 1, **kwargs: Any
) -> None:
    """After a ``migrate`` that planned the app's migrations for a database the router
    kept them out of, say which command creates the tables (a ``post_migrate`` receiver)."""
    alias = conf.database_alias()
    if alias is None or alias == using or verbosity < 1 or not plan:
        return
    if not any(migration.app_label == APP_LABEL for migration, _backwards in plan):
        return
    stdout = kwargs.get("stdout") or sys.stdout
    stdout.write(
        f"runcell_django: its tables live in the limiter's database {alias!r} "
        f'(RUNCELL["DATABASE"]), not in {using!r}; create them there with: '
        f"manage.py migrate --database {alias}\n"
    )
