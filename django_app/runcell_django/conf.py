"""The app's settings, read lazily from the one ``RUNCELL`` dict in ``settings.py``.

.. code-block:: python

    RUNCELL = {
        "DATABASE": "default",        # a Django database alias, or a PostgreSQL DSN
        "LIMITERS": {"claude": {"max_concurrent": 8, "workloads": {...}}},
        "POSTGRES": {"poll_interval_ms": 100},
        "EVENTS": {"ENABLED": True, "RETENTION_DAYS": 7},
        "METRICS": {"TOKEN": os.environ["RUNCELL_METRICS_TOKEN"]},
        "BROKER": {"URL": CELERY_BROKER_URL, "QUEUES": ["celery", "celery.runcell"]},
    }

Nothing is read at import time: :func:`registry` and :func:`event_settings` read
``settings.RUNCELL`` on first use and again after ``override_settings`` changes it.
Limits are validated by the core (:class:`~runcell_celery.registry.LimiterRegistry`),
so a mistake raises :class:`~runcell_celery.ConcurrencyConfigError` naming the exact
key, e.g. ``RUNCELL["LIMITERS"]["claude"]["workloads"]["interactive"]["reserved"]``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import psycopg
from django.conf import settings
from django.core.signals import setting_changed
from django.db import connections
from django.dispatch import receiver

from runcell_celery import ConcurrencyConfigError
from runcell_celery.background import DEFAULT_REGISTRY
from runcell_celery.hints import did_you_mean
from runcell_celery.postgres import PostgresBackend, check_dsn
from runcell_celery.redaction import TokenError, check_token, looks_like_dsn, shape
from runcell_celery.registry import LimiterRegistry

from . import databases

__all__ = [
    "SETTING",
    "BrokerSettings",
    "EventSettings",
    "MetricsSettings",
    "broker_settings",
    "celery_settings_provider",
    "database_alias",
    "event_settings",
    "metrics_settings",
    "postgres_backend",
    "registry",
    "reset",
    "resolve_database",
    "runcell_settings",
    "validate",
]

#: The name of the one Django setting this app reads.
SETTING = "RUNCELL"


@dataclass(frozen=True, slots=True)
class EventSettings:
    """``RUNCELL["EVENTS"]``: how concurrency events are recorded in PostgreSQL.

    :param enabled: record events (and occupancy samples) in every process that
        loads Django.
    :param buffer_size: most events waiting to be written per process; more are
        dropped and counted, never waited for.
    :param flush_interval_ms: how often the recorder writes what it buffered.
    :param batch_size: most rows per ``INSERT``.
    :param retention_days: ``runcell_purge_events`` deletes what is older.
    :param sample_interval_ms: how often slot occupancy is sampled for the dashboard
        (once per interval for the whole fleet); ``0`` turns sampling off.
    """

    enabled: bool = True
    buffer_size: int = 10_000
    flush_interval_ms: int = 1_000
    batch_size: int = 500
    retention_days: int = 7
    sample_interval_ms: int = 5_000


_EVENT_OPTIONS: Mapping[str, tuple[str, int | None]] = MappingProxyType(
    {
        # setting: (attribute, minimum; None for a boolean)
        "ENABLED": ("enabled", None),
        "BUFFER_SIZE": ("buffer_size", 1),
        "FLUSH_INTERVAL_MS": ("flush_interval_ms", 1),
        "BATCH_SIZE": ("batch_size", 1),
        "RETENTION_DAYS": ("retention_days", 1),
        "SAMPLE_INTERVAL_MS": ("sample_interval_ms", 0),
    }
)


def runcell_settings() -> Mapping[str, Any]:
    """Return ``settings.RUNCELL`` (an empty dict when it is not set)."""
    value = getattr(settings, SETTING, None)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConcurrencyConfigError(f"{SETTING} is invalid: {shape(value)}, must be a dict")
    return value


def event_settings() -> EventSettings:
    """Return ``RUNCELL["EVENTS"]`` validated, with defaults filled in."""
    given = runcell_settings().get("EVENTS", {})
    path = f'{SETTING}["EVENTS"]'
    if not isinstance(given, Mapping):
        raise ConcurrencyConfigError(f"{path} = {given!r} is invalid: must be a dict")
    values: dict[str, Any] = {}
    for key, value in given.items():
        if key not in _EVENT_OPTIONS:
            raise ConcurrencyConfigError(
                f'{path}["{key}"] is invalid: unknown option; {did_you_mean(key, _EVENT_OPTIONS)}'
            )
        attribute, minimum = _EVENT_OPTIONS[key]
        if minimum is None:
            if not isinstance(value, bool):
                raise ConcurrencyConfigError(
                    f'{path}["{key}"] = {value!r} is invalid: must be True or False'
                )
        elif isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            rule = "a positive integer" if minimum == 1 else f"an integer of at least {minimum}"
            raise ConcurrencyConfigError(f'{path}["{key}"] = {value!r} is invalid: must be {rule}')
        values[attribute] = value
    return EventSettings(**values)


@dataclass(frozen=True, slots=True)
class MetricsSettings:
    """``RUNCELL["METRICS"]``: who may read the metrics view, and where it reads.

    :param token: a scrape bearing ``Authorization: Bearer <token>`` is served;
        ``None``: no token is accepted.
    :param allow_staff: a logged-in staff user's session is served too (a look from
        the browser).
    :param cache_ms: how long one read of the limiters' state serves scrapes.
    :param multiprocess_dir: where the workers' event metrics are
        (``PROMETHEUS_MULTIPROC_DIR`` when ``None``; neither: this process's own).
    """

    token: str | None = None
    allow_staff: bool = True
    cache_ms: int = 1_000
    multiprocess_dir: str | None = None


def metrics_settings() -> MetricsSettings:
    """Return ``RUNCELL["METRICS"]`` validated, with defaults filled in."""
    given = runcell_settings().get("METRICS", {})
    path = f'{SETTING}["METRICS"]'
    if not isinstance(given, Mapping):  # never echoed: it may be the token itself
        raise ConcurrencyConfigError(f"{path} is invalid: {shape(given)}, must be a dict")
    options = {
        "TOKEN": "token",
        "ALLOW_STAFF": "allow_staff",
        "CACHE_MS": "cache_ms",
        "MULTIPROCESS_DIR": "multiprocess_dir",
    }
    values: dict[str, Any] = {}
    for key, value in given.items():
        if key not in options:
            raise ConcurrencyConfigError(
                f'{path}["{key}"] is invalid: unknown option; {did_you_mean(key, options)}'
            )
        where = f'{path}["{key}"]'
        if key == "TOKEN" and value is not None:
            try:  # never echoed: it is a secret
                value = check_token(value)
            except TokenError as exc:
                raise ConcurrencyConfigError(f"{where} is invalid: {exc}, or None") from None
        elif key == "ALLOW_STAFF" and not isinstance(value, bool):
            raise ConcurrencyConfigError(f"{where} = {value!r} is invalid: must be True or False")
        elif key == "CACHE_MS" and (
            isinstance(value, bool) or not isinstance(value, int) or value < 0
        ):
            raise ConcurrencyConfigError(
                f"{where} = {value!r} is invalid: must be an integer of at least 0"
            )
        elif key == "MULTIPROCESS_DIR" and value is not None and not isinstance(value, str):
            raise ConcurrencyConfigError(
                f"{where} = {value!r} is invalid: must be a directory path, or None"
            )
        values[options[key]] = value
    return MetricsSettings(**values)


@dataclass(frozen=True, slots=True)
class BrokerSettings:
    """``RUNCELL["BROKER"]``: where the queue page reads the broker's backlog.

    :param url: the Celery broker's URL (``redis://``, ``amqp://``); by default
        Django's ``CELERY_BROKER_URL`` setting. ``None``: the page shows no backlog.
    :param queues: the queues to read; by default Celery's default queue
        (``CELERY_TASK_DEFAULT_QUEUE``, else ``celery``) and its granted queue
        (``celery.runcell``, where re-published parked tasks go).
    :param timeout_ms: the connect and socket timeout of one read.
    :param cache_ms: how long one read's answer (or failure) serves the page.
    """

    url: str | None = None
    queues: tuple[str, ...] = ()
    timeout_ms: int = 1_000
    cache_ms: int = 5_000


def broker_settings() -> BrokerSettings:
    """Return ``RUNCELL["BROKER"]`` validated, with defaults filled in."""
    given = runcell_settings().get("BROKER", {})
    path = f'{SETTING}["BROKER"]'
    if not isinstance(given, Mapping):  # never echoed: it may hold the URL's password
        raise ConcurrencyConfigError(f"{path} is invalid: {shape(given)}, must be a dict")
    options = {"URL": "url", "QUEUES": "queues", "TIMEOUT_MS": "timeout_ms", "CACHE_MS": "cache_ms"}
    values: dict[str, Any] = {}
    for key, value in given.items():
        if key not in options:
            raise ConcurrencyConfigError(
                f'{path}["{key}"] is invalid: unknown option; {did_you_mean(key, options)}'
            )
        where = f'{path}["{key}"]'
        if key == "URL" and value is not None and (not isinstance(value, str) or not value):
            raise ConcurrencyConfigError(
                f"{where} is invalid: {shape(value)}, must be a broker URL or None"
            )
        if key == "QUEUES":
            if (
                isinstance(value, str)
                or not isinstance(value, list | tuple)
                or not all(isinstance(q, str) and q for q in value)
            ):
                raise ConcurrencyConfigError(
                    f"{where} = {value!r} is invalid: must be a list of queue names"
                )
            value = tuple(value)
        if key in ("TIMEOUT_MS", "CACHE_MS"):
            minimum = 1 if key == "TIMEOUT_MS" else 0
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ConcurrencyConfigError(
                    f"{where} = {value!r} is invalid: must be an integer of at least {minimum}"
                )
        values[options[key]] = value
    if "url" not in values:
        default = getattr(settings, "CELERY_BROKER_URL", None)
        values["url"] = default if isinstance(default, str) and default else None
    if "queues" not in values:
        from runcell_celery.celery.message import granted_queue_name

        queue = getattr(settings, "CELERY_TASK_DEFAULT_QUEUE", None) or "celery"
        values["queues"] = (queue, granted_queue_name(queue))
    return BrokerSettings(**values)


def _database_setting() -> str | None:
    value = runcell_settings().get("DATABASE")
    return value if isinstance(value, str) and value else None


def _is_alias(value: str) -> bool:
    return value in connections.settings


def resolve_database(value: str) -> str:
    """Turn ``RUNCELL["DATABASE"]`` into a DSN: an alias gives its database's DSN.

    Read when a limiter is created, so tests that switch the alias to a test
    database get limiters on the test database.
    """
    if not _is_alias(value):
        return value
    connection = connections[value]
    if connection.vendor != "postgresql":
        raise ConcurrencyConfigError(
            f'{SETTING}["DATABASE"] = {value!r} is invalid: that alias uses '
            f"{connection.settings_dict['ENGINE']}; the limiter needs PostgreSQL"
        )
    valid = {d.keyword.decode() for d in psycopg.pq.Conninfo.get_defaults()}
    params = {
        key: given
        for key, given in connection.get_connection_params().items()
        if key in valid and given not in (None, "")
    }
    return psycopg.conninfo.make_conninfo(**params)


def database_alias() -> str | None:
    """The alias of the limiter's database, where the app's models are read and written.

    ``RUNCELL["DATABASE"]`` itself when it is an alias; for a DSN, the alias the app
    registers it under (:data:`runcell_django.databases.DSN_ALIAS`), so that the admin
    and the commands show the database the limiter uses. ``None`` when it is unset:
    then Django's routers choose, by default ``default``.

    :raises ConcurrencyConfigError: a DSN whose alias ``DATABASES`` already defines.
    """
    value = _database_setting()
    if value is None:
        return None
    if _is_alias(value):
        return value
    return databases.register_dsn(value) if looks_like_dsn(value) else None


#: What a database alias looks like: a value that does not is never echoed (it may be
#: a DSN with its password, written wrong).
_ALIAS_LIKE = re.compile(r"[A-Za-z0-9_.-]{1,100}")


def _check_database(config: Mapping[str, Any]) -> None:
    """Refuse a ``DATABASE`` that is neither a PostgreSQL alias nor a DSN that parses,
    never showing what may be a password (:mod:`runcell_celery.redaction`); the core
    refuses other types, by their shape."""
    value = config.get("DATABASE")
    if not isinstance(value, str) or not value or _is_alias(value):
        if isinstance(value, str) and value:
            resolve_database(value)  # rejects an alias that is not PostgreSQL
        return
    where = f'{SETTING}["DATABASE"]'
    if looks_like_dsn(value):
        check_dsn(value, setting=where)  # the core reports connection failures
        return
    aliases = list(connections.settings)
    if _ALIAS_LIKE.fullmatch(value):
        raise ConcurrencyConfigError(
            f"{where} = {value!r} is invalid: neither a database alias nor a "
            f"PostgreSQL DSN; {did_you_mean(value, aliases)}"
        )
    raise ConcurrencyConfigError(
        f"{where} is invalid: {shape(value)}, neither a database alias "
        f"({', '.join(repr(a) for a in aliases)}) nor a PostgreSQL DSN "
        "(postgresql://user:password@host:5432/dbname or 'host=... dbname=...')"
    )


def validate() -> None:
    """Check every part of ``RUNCELL``; raise :class:`ConcurrencyConfigError` if wrong.

    Registers a DSN's database alias too (:func:`database_alias`), so that commands
    such as ``migrate --database runcell`` know it from the start."""
    registry()
    event_settings()
    metrics_settings()
    broker_settings()
    database_alias()


def registry() -> LimiterRegistry:
    """The limiters of ``settings.RUNCELL``, validated on first use (one per process)."""
    found: LimiterRegistry | None = DEFAULT_REGISTRY.value("django.conf.registry", None)
    if found is not None:
        return found
    with DEFAULT_REGISTRY.lock("django.conf"):
        _registry: LimiterRegistry | None = DEFAULT_REGISTRY.value("django.conf.registry", None)
        if _registry is None:
            config = runcell_settings()
            _check_database(config)
            made = LimiterRegistry(resolve_database=resolve_database)
            made.configure(config, path=SETTING)
            DEFAULT_REGISTRY.put("django.conf.registry", made)
            _registry = made
        return _registry


def postgres_backend() -> PostgresBackend:
    """The PostgreSQL backend of ``settings.RUNCELL`` (this process's, with its pool).

    The app reads live counts from it and leaves every write to the limiter's tables
    to it (force release).

    :raises ConcurrencyConfigError: ``RUNCELL`` configures no backend, or another one.
    """
    backend = registry().backend
    if not isinstance(backend, PostgresBackend):
        raise ConcurrencyConfigError(
            f'{SETTING}["BACKEND"] gives {type(backend).__name__}: runcell_django needs '
            f'the PostgreSQL backend with a DATABASE (set {SETTING}["DATABASE"] to a '
            "PostgreSQL alias or DSN)"
        )
    return backend


def reset() -> None:
    """Forget the configured registry; the next :func:`registry` call reads settings."""
    with DEFAULT_REGISTRY.lock("django.conf"):
        DEFAULT_REGISTRY.put("django.conf.registry", None)
    databases.forget_dsn()


@receiver(setting_changed)
def _on_setting_changed(*, setting: str, **_: Any) -> None:
    if setting in (SETTING, "DATABASES"):
        reset()


def celery_settings_provider() -> tuple[Mapping[str, Any], str, Callable[[str], str]] | None:
    """Where :func:`runcell_celery.celery.registry_for` reads settings when the Celery
    app has no ``runcell`` setting of its own: ``settings.RUNCELL``, also when it is not
    set (so that errors name the Django setting, not ``app.conf.runcell``)."""
    return runcell_settings(), SETTING, resolve_database
