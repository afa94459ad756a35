"""The Django database alias of ``RUNCELL["DATABASE"]`` when it is a PostgreSQL DSN.

The limiter connects to the DSN itself, but the admin, the commands and the recorder go
through Django's ORM, which knows databases only by alias: the app registers the DSN as
:data:`DSN_ALIAS` when it first needs it (``ready()`` does, so that ``manage.py migrate
--database runcell`` accepts it), and :class:`~runcell_django.routers.RunCellRouter`
sends the app's models and migrations there.
"""

from __future__ import annotations

import getpass
from types import MappingProxyType
from typing import Any

from django.db import DEFAULT_DB_ALIAS, connections

from runcell_celery import ConcurrencyConfigError
from runcell_celery.background import DEFAULT_REGISTRY
from runcell_celery.postgres import check_dsn

#: The alias a DSN in ``RUNCELL["DATABASE"]`` is registered under.
DSN_ALIAS = "runcell"

#: libpq keywords with a field of their own in a ``DATABASES`` entry; the rest go to
#: ``OPTIONS``, which Django's PostgreSQL backend passes on to ``psycopg.connect``.
_FIELDS = MappingProxyType(
    {"dbname": "NAME", "user": "USER", "password": "PASSWORD", "host": "HOST", "port": "PORT"}
)

#: The DSN registered and the entry this module put in ``connections.settings`` (the
#: entry compared by identity: an alias of that name the project defines is not ours).
Registered = tuple[str, dict[str, Any]] | None
_REGISTERED = "django.databases.registered"


def database_settings(dsn: str) -> dict[str, Any]:
    """A ``DATABASES`` entry for the PostgreSQL DSN ``dsn`` (URI or ``key=value``)."""
    params = check_dsn(dsn, setting='RUNCELL["DATABASE"]')  # masked if it is not one
    entry: dict[str, Any] = {"ENGINE": "django.db.backends.postgresql", "OPTIONS": {}}
    for keyword, value in params.items():
        if keyword in _FIELDS:
            entry[_FIELDS[keyword]] = str(value)
        else:
            entry["OPTIONS"][keyword] = value
    if "NAME" not in entry and "service" not in entry["OPTIONS"]:
        # libpq's default database is the user's name; Django needs a NAME to connect.
        entry["NAME"] = entry.get("USER") or getpass.getuser()
    return entry


def register_dsn(dsn: str) -> str:
    """Register ``dsn`` as the database alias :data:`DSN_ALIAS` (again after a change, which
    closes this thread's connection); refuse an alias ``DATABASES`` already defines."""
    with DEFAULT_REGISTRY.lock(_REGISTERED):
        _registered: Registered = DEFAULT_REGISTRY.value(_REGISTERED, None)
        current = connections.settings.get(DSN_ALIAS)
        ours = _registered[1] if _registered is not None else None
        if current is not None and current is not ours:
            raise ConcurrencyConfigError(
                f'RUNCELL["DATABASE"] is a DSN, and runcell_django registers it as the '
                f"database alias {DSN_ALIAS!r}, which DATABASES already defines: set "
                f'RUNCELL["DATABASE"] = {DSN_ALIAS!r} to use that database, or rename it'
            )
        if _registered is not None and _registered[0] == dsn and current is ours:
            return DSN_ALIAS
        wanted = database_settings(dsn)
        # Django's defaults for every other key (AUTOCOMMIT, TEST, ...), as for an
        # entry of settings.DATABASES.
        entry = connections.configure_settings({DEFAULT_DB_ALIAS: {}, DSN_ALIAS: wanted})[DSN_ALIAS]
        _close(DSN_ALIAS)
        connections.settings[DSN_ALIAS] = entry
        DEFAULT_REGISTRY.put(_REGISTERED, (dsn, entry))
        return DSN_ALIAS


def is_registered_dsn(alias: str) -> bool:
    """Whether ``alias`` is the alias this app registered for a DSN."""
    return alias == DSN_ALIAS and DEFAULT_REGISTRY.value(_REGISTERED, None) is not None


def forget_dsn() -> None:
    """Unregister the DSN's alias (when ``RUNCELL`` changes; tests)."""
    with DEFAULT_REGISTRY.lock(_REGISTERED):
        _registered: Registered = DEFAULT_REGISTRY.value(_REGISTERED, None)
        if _registered is not None and connections.settings.get(DSN_ALIAS) is _registered[1]:
            _close(DSN_ALIAS)
            del connections.settings[DSN_ALIAS]
        DEFAULT_REGISTRY.put(_REGISTERED, None)


def _close(alias: str) -> None:
    """Close this thread's connection to ``alias``, if it opened one."""
    for connection in connections.all(initialized_only=True):
        if connection.alias == alias:
            connection.close()
            del connections[alias]
