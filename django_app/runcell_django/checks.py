"""System checks (``manage.py check``): ``RUNCELL`` valid, the app's tables in PostgreSQL,
and ``migrate`` putting them where the limiter, the admin and the commands use them.

Both mistakes otherwise show up late and far from their cause (a SQLite ``default``
fails in migration 0001 with ``near "(": syntax error``). No check opens a connection.
E001: the tables' database is not PostgreSQL. E002: ``migrate`` would apply the
migrations to a non-PostgreSQL ``default``. E003: ``migrate --database <alias>`` would
not create the tables in the limiter's database. E004: ``RUNCELL`` is invalid. W001:
``migrate`` would create the tables in ``default`` too, where nothing reads them.
W002: no ``RUNCELL`` setting (a typo such as ``RUNCEL``).
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from typing import Any

from django.apps import AppConfig
from django.conf import settings
from django.core.checks import CheckMessage, Error, Warning, register
from django.db import DEFAULT_DB_ALIAS, connections, router

from runcell_celery import ConcurrencyConfigError

from . import conf
from .models import Limiter
from .routers import APP_LABEL

ROUTER = "runcell_django.routers.RunCellRouter"


def _engine(alias: str) -> str:
    return str(connections.settings[alias]["ENGINE"])


def _mine(app_configs: Sequence[AppConfig] | None) -> bool:
    return app_configs is None or any(c.label == APP_LABEL for c in app_configs)


@register()
def check_settings(
    app_configs: Sequence[AppConfig] | None = None, **kwargs: Any
) -> list[CheckMessage]:
    """``RUNCELL`` is set and valid."""
    if not _mine(app_configs):
        return []
    if not hasattr(settings, conf.SETTING):
        names = [name for name in dir(settings) if name.isupper()]
        close = difflib.get_close_matches(conf.SETTING, names, n=1, cutoff=0.7)
        meant = f" (is {close[0]} meant to be {conf.SETTING}?)" if close else ""
        return [
            Warning(
                f"runcell_django is installed but settings have no {conf.SETTING}{meant}: "
                "no limiter is configured, and every task naming a limiter fails.",
                hint=f'Add {conf.SETTING} = {{"DATABASE": "default", "LIMITERS": {{...}}}} '
                "to your settings (see docs/getting-started.md, 'Use it in your Django project').",
                id="runcell_django.W002",
            )
        ]
    try:
        conf.validate()
    except ConcurrencyConfigError as exc:
        return [
            Error(
                exc.message,
                hint=f"Correct {conf.SETTING} in your settings: the message names the "
                "setting and what would be valid (see docs/settings.md).",
                id="runcell_django.E004",
            )
        ]
    return []


@register()
def check_database(
    app_configs: Sequence[AppConfig] | None = None, **kwargs: Any
) -> list[CheckMessage]:
    """Where the app's tables live, and whether ``migrate`` puts them there."""
    if not _mine(app_configs):
        return []
    try:
        alias = conf.database_alias()
    except ConcurrencyConfigError as exc:
        return [Error(exc.message, id="runcell_django.E001")]
    tables = alias if alias is not None else router.db_for_write(Limiter)
    if connections[tables].vendor != "postgresql":
        return [
            Error(
                f"runcell_django's tables are in the database {tables!r} "
                f"({_engine(tables)}), which is not PostgreSQL: its migrations and the "
                "limiter need PostgreSQL.",
                hint=(
                    'Set RUNCELL["DATABASE"] to a PostgreSQL DSN '
                    '("postgresql://user@host:5432/dbname") or to the alias of a '
                    f"PostgreSQL database in DATABASES, add {ROUTER!r} to "
                    "DATABASE_ROUTERS when that is not 'default', and run manage.py "
                    "migrate --database <that alias>."
                ),
                id="runcell_django.E001",
            )
        ]
    if tables == DEFAULT_DB_ALIAS:
        return []
    messages: list[CheckMessage] = []
    where = f'{tables!r} (RUNCELL["DATABASE"])'
    if not router.allow_migrate(tables, APP_LABEL):
        messages.append(
            Error(
                f"manage.py migrate --database {tables} would not create runcell_django's "
                f"tables in {where}, where the limiter, the admin and the management "
                "commands use them: the database routers do not allow it.",
                hint=f"Add {ROUTER!r} to DATABASE_ROUTERS (before routers that answer for "
                "every app).",
                id="runcell_django.E003",
            )
        )
    if router.allow_migrate(DEFAULT_DB_ALIAS, APP_LABEL):
        hint = (
            f"Add {ROUTER!r} to DATABASE_ROUTERS: manage.py migrate then leaves the app "
            f"out of 'default', and manage.py migrate --database {tables} creates its "
            "tables in the limiter's database."
        )
        if connections[DEFAULT_DB_ALIAS].vendor == "postgresql":
            messages.append(
                Warning(
                    "manage.py migrate would create runcell_django's tables in 'default' "
                    f"too, where nothing reads them: the limiter, the admin and the "
                    f"management commands use {where}.",
                    hint=hint,
                    id="runcell_django.W001",
                )
            )
        else:
            messages.append(
                Error(
                    "manage.py migrate would apply runcell_django's migrations to "
                    f"'default' ({_engine(DEFAULT_DB_ALIAS)}), where they fail (they are "
                    f"PostgreSQL DDL), instead of to the limiter's database {where}.",
                    hint=hint,
                    id="runcell_django.E002",
                )
            )
    return messages
