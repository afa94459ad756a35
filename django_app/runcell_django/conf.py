"""The app's settings, read lazily from the one ``RUNCELL`` dict in ``settings.py``.

Nothing is read at import time: :func:`registry` and the ``*_settings`` functions read
``settings.RUNCELL`` on first use and again after ``override_settings`` changes it. Every
mistake raises :class:`~runcell_celery.ConcurrencyConfigError` naming the exact key, e.g.
``RUNCELL["LIMITERS"]["claude"]["workloads"]["interactive"]["reserved"]``, and never
echoes what may be a secret (a DSN's password, the metrics token).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
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

#: The name of the one Django setting this app reads.
SETTING = "RUNCELL"

#: Checks one option's value (given its path for the message); returns what to keep.
_Check = Callable[[str, Any], Any]


def _flag(where: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConcurrencyConfigError(f"{where} = {value!r} is invalid: must be True or False")
    return value


def _integer(minimum: int, rule: str | None = None) -> _Check:
    rule = rule or f"an integer of at least {minimum}"

    def check(where: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ConcurrencyConfigError(f"{where} = {value!r} is invalid: must be {rule}")
        return value

    return check


def _token(where: str, value: Any) -> str | None:
    try:  # never echoed: it is a secret
        return None if value is None else check_token(value)
    except TokenError as exc:
        raise ConcurrencyConfigError(f"{where} is invalid: {exc}, or None") from None


def _directory(where: str, value: Any) -> str | None:
    if value is not None and not isinstance(value, str):
        raise ConcurrencyConfigError(
            f"{where} = {value!r} is invalid: must be a directory path, or None"
        )
    return value


def _broker_url(where: str, value: Any) -> str | None:
    if value is not None and (not isinstance(value, str) or not value):  # never echoed
        raise ConcurrencyConfigError(
            f"{where} is invalid: {shape(value)}, must be a broker URL or None"
        )
    return value


def _queues(where: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str) or not (
        isinstance(value, list | tuple) and all(isinstance(q, str) and q for q in value)
    ):
        raise ConcurrencyConfigError(
            f"{where} = {value!r} is invalid: must be a list of queue names"
        )
    return tuple(value)


def _section(name: str, options: Mapping[str, tuple[str, _Check]]) -> dict[str, Any]:
    """``RUNCELL[name]`` checked option by option: ``{attribute: value}`` of those given."""
    given = runcell_settings().get(name, {})
    path = f'{SETTING}["{name}"]'
    if not isinstance(given, Mapping):  # never echoed: it may be a secret itself
        raise ConcurrencyConfigError(f"{path} is invalid: {shape(given)}, must be a dict")
    values: dict[str, Any] = {}
    for key, value in given.items():
        if key not in options:
            raise ConcurrencyConfigError(
                f'{path}["{key}"] is invalid: unknown option; {did_you_mean(key, options)}'
            )
        attribute, check = options[key]
        values[attribute] = check(f'{path}["{key}"]', value)
    return values


def runcell_settings() -> Mapping[str, Any]:
    """Return ``settings.RUNCELL`` (an empty dict when it is not set)."""
    value = getattr(settings, SETTING, None)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConcurrencyConfigError(f"{SETTING} is invalid: {shape(value)}, must be a dict")
    return value


@dataclass(frozen=True, slots=True)
class EventSettings:
    """``RUNCELL["EVENTS"]``: how concurrency events are recorded (docs/settings.md)."""

    enabled: bool = True
    #: Most events waiting to be written per process; more are dropped and counted.
    buffer_size: int = 10_000
    flush_interval_ms: int = 1_000
    #: Most rows per ``INSERT``.
    batch_size: int = 500
    #: ``runcell_purge_events`` deletes what is older.
    retention_days: int = 7
    #: How often slot occupancy is sampled for the dashboard; ``0``: never.
    sample_interval_ms: int = 5_000


def event_settings() -> EventSettings:
    """Return ``RUNCELL["EVENTS"]`` validated, with defaults filled in."""
    positive = _integer(1, "a positive integer")
    options = {
        "ENABLED": ("enabled", _flag),
        "BUFFER_SIZE": ("buffer_size", positive),
        "FLUSH_INTERVAL_MS": ("flush_interval_ms", positive),
        "BATCH_SIZE": ("batch_size", positive),
        "RETENTION_DAYS": ("retention_days", positive),
        "SAMPLE_INTERVAL_MS": ("sample_interval_ms", _integer(0)),
    }
    return EventSettings(**_section("EVENTS", options))


@dataclass(frozen=True, slots=True)
class MetricsSettings:
    """``RUNCELL["METRICS"]``: who may read the metrics view, and where it reads."""

    #: A scrape bearing ``Authorization: Bearer <token>`` is served (``None``: none is).
    token: str | None = None
    #: A logged-in staff user's session is served too.
    allow_staff: bool = True
    #: How long one read of the limiters' state serves scrapes.
    cache_ms: int = 1_000
    #: Where the workers' event metrics are (``None``: ``PROMETHEUS_MULTIPROC_DIR``).
    multiprocess_dir: str | None = None


def metrics_settings() -> MetricsSettings:
    """Return ``RUNCELL["METRICS"]`` validated, with defaults filled in."""
    options = {
        "TOKEN": ("token", _token),
        "ALLOW_STAFF": ("allow_staff", _flag),
        "CACHE_MS": ("cache_ms", _integer(0)),
        "MULTIPROCESS_DIR": ("multiprocess_dir", _directory),
    }
    return MetricsSettings(**_section("METRICS", options))


@dataclass(frozen=True, slots=True)
class BrokerSettings:
    """``RUNCELL["BROKER"]``: where the queue page reads the broker's backlog."""

    #: The broker's URL (by default ``CELERY_BROKER_URL``; ``None``: no backlog shown).
    url: str | None = None
    #: By default Celery's default queue and its granted queue (``celery.runcell``).
    queues: tuple[str, ...] = ()
    #: The connect and socket timeout of one read.
    timeout_ms: int = 1_000
    #: How long one read's answer (or failure) serves the page.
    cache_ms: int = 5_000


def broker_settings() -> BrokerSettings:
    """Return ``RUNCELL["BROKER"]`` validated, with defaults filled in."""
    options = {
        "URL": ("url", _broker_url),
        "QUEUES": ("queues", _queues),
        "TIMEOUT_MS": ("timeout_ms", _integer(1)),
        "CACHE_MS": ("cache_ms", _integer(0)),
    }
    values = _section("BROKER", options)
    if "url" not in values:
        default = getattr(settings, "CELERY_BROKER_URL", None)
        values["url"] = default if isinstance(default, str) and default else None
    if "queues" not in values:
        from runcell_celery.celery.message import granted_queue_name

        queue = getattr(settings, "CELERY_TASK_DEFAULT_QUEUE", None) or "celery"
        values["queues"] = (queue, granted_queue_name(queue))
    return BrokerSettings(**values)


def resolve_database(value: str) -> str:
    """Turn ``RUNCELL["DATABASE"]`` into a DSN: an alias gives its database's DSN, read
    when a limiter is created (so tests switching the alias to a test database work)."""
    if value not in connections.settings:
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
    """The alias of the limiter's database, where the app's models are read and written:
    ``RUNCELL["DATABASE"]`` if it is an alias, the alias registered for a DSN
    (:data:`~runcell_django.databases.DSN_ALIAS`), ``None`` (Django's routers choose)."""
    value = runcell_settings().get("DATABASE")
    if not isinstance(value, str) or not value:
        return None
    if value in connections.settings:
        return value
    return databases.register_dsn(value) if looks_like_dsn(value) else None


#: What a database alias looks like: a value that does not is never echoed (it may be
#: a DSN with its password, written wrong).
_ALIAS_LIKE = re.compile(r"[A-Za-z0-9_.-]{1,100}")


def _check_database(config: Mapping[str, Any]) -> None:
    """Refuse a ``DATABASE`` that is neither a PostgreSQL alias nor a DSN that parses
    (the core refuses other types)."""
    value = config.get("DATABASE")
    if not isinstance(value, str) or not value or value in connections.settings:
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
    """Check every part of ``RUNCELL``, and register a DSN's database alias (so that
    ``migrate --database runcell`` knows it from the start)."""
    registry()
    event_settings()
    metrics_settings()
    broker_settings()
    database_alias()


def registry() -> LimiterRegistry:
    """The limiters of ``settings.RUNCELL``, validated on first use (one per process)."""
    found: LimiterRegistry | None = DEFAULT_REGISTRY.value("django.conf.registry", None)
    if found is None:
        with DEFAULT_REGISTRY.lock("django.conf"):
            found = DEFAULT_REGISTRY.value("django.conf.registry", None)
            if found is None:
                config = runcell_settings()
                _check_database(config)
                found = LimiterRegistry(resolve_database=resolve_database)
                found.configure(config, path=SETTING)
                DEFAULT_REGISTRY.put("django.conf.registry", found)
    return found


def postgres_backend() -> PostgresBackend:
    """The PostgreSQL backend of ``settings.RUNCELL``: the app reads live counts from it
    and leaves every write to the limiter's tables to it (force release)."""
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
    """Where :func:`runcell_celery.celery.registry_for` reads settings when the Celery app
    has none: ``settings.RUNCELL``, even unset (so that errors name the Django setting)."""
    return runcell_settings(), SETTING, resolve_database
