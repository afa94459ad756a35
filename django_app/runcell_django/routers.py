"""A database router for a limiter database other than Django's ``default``.

.. code-block:: python

    DATABASE_ROUTERS = ["runcell_django.routers.RunCellRouter"]

With ``RUNCELL["DATABASE"]`` a PostgreSQL DSN (registered as the alias ``"runcell"``,
see :mod:`runcell_django.databases`) or an alias other than ``default``, the app's
tables belong in that database: the limiter writes them there and the admin reads them
there. Without this router ``manage.py migrate`` would apply the app's migrations to
``default`` (and fail there if it is not PostgreSQL: they are PostgreSQL DDL). With it,
``manage.py migrate`` leaves the app out of ``default`` and ``manage.py migrate
--database runcell`` creates the tables in the limiter's database, and no other app's.
The system checks (:mod:`runcell_django.checks`) say when it is missing.
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
    """Send ``runcell_django``'s reads, writes and migrations to the limiter's database.

    Every method answers ``None`` ("no opinion") for what is not its business, so it can
    stand beside the project's own routers in any order.
    """

    def db_for_read(self, model: type[models.Model], **hints: Any) -> str | None:
        return conf.database_alias() if model._meta.app_label == APP_LABEL else None

    def db_for_write(self, model: type[models.Model], **hints: Any) -> str | None:
        return conf.database_alias() if model._meta.app_label == APP_LABEL else None

    def allow_relation(self, obj1: models.Model, obj2: models.Model, **hints: Any) -> bool | None:
        labels = {obj1._meta.app_label, obj2._meta.app_label}
        return True if labels == {APP_LABEL} else None

    def allow_migrate(self, db: str, app_label: str, **hints: Any) -> bool | None:
        """The app's migrations only in the limiter's database; no other app's in the
        database registered for a DSN (the project never asked for it)."""
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
    """After ``manage.py migrate`` applied the app's migrations to a database the router
    kept them out of, say which command creates the tables (a ``post_migrate`` receiver).

    Only a migration run that planned the app's migrations (not ``flush``, not a run with
    nothing to do) says it, on the command's own output.
    """
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
