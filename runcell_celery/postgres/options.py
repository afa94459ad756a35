"""The PostgreSQL backend's own settings (``RUNCELL["POSTGRES"]``), validated in one place.

The registry does not know these options: it hands the section to
:class:`~runcell_celery.postgres.PostgresBackend`, which validates it here, and
:func:`~runcell_celery.postgres.create_postgres_concurrency_limiter` validates its
keyword arguments through the same function, so both report a bad value alike.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Literal

from ..config import MAX_DURATION_MS
from ..errors import ConcurrencyConfigError
from ..hints import did_you_mean

__all__ = [
    "DEFAULT_CONNECT_TIMEOUT_MS",
    "DEFAULT_POLL_INTERVAL_MS",
    "DEFAULT_POOL_MAX_SIZE",
    "DEFAULT_QUEUE_ENTRY_TTL_MS",
    "ON_CONFLICT_VALUES",
    "OnConflict",
    "PostgresOptions",
]

#: What a worker does when the stored limits differ from its settings.
OnConflict = Literal["error", "replace", "use_stored"]
ON_CONFLICT_VALUES: tuple[OnConflict, ...] = ("error", "replace", "use_stored")

DEFAULT_POLL_INTERVAL_MS = 100
DEFAULT_QUEUE_ENTRY_TTL_MS = 15_000
#: Connections a pool made from a DSN may open (waiters hold one only while polling).
DEFAULT_POOL_MAX_SIZE = 8
#: How long to wait for a pooled connection before failing closed.
DEFAULT_CONNECT_TIMEOUT_MS = 5_000

#: More connections than PostgreSQL's own max_connections could ever give.
MAX_POOL_SIZE = 10_000
_POSITIVE_INTS = ("poll_interval_ms", "queue_entry_ttl_ms", "pool_max_size", "connect_timeout_ms")
_BOOLS = ("ensure_schema", "listen")


@dataclass(frozen=True, slots=True)
class PostgresOptions:
    """How the PostgreSQL backend talks to its database (not the limits themselves).

    :param poll_interval_ms: how often a waiting request checks for a slot. The
        database load is about (waiting requests / poll interval) short statements.
    :param queue_entry_ttl_ms: how long a crashed waiter's queue row survives.
    :param ensure_schema: create tables and functions on first use; ``False`` after
        applying :func:`~runcell_celery.postgres.postgres_concurrency_schema_sql` as a
        migration.
    :param on_conflict: when stored limits differ: ``"error"`` raises
        :class:`~runcell_celery.errors.ConcurrencyConfigError` naming the fields (a
        Celery worker checks at start and refuses to start, :mod:`runcell_celery.celery.conflicts`),
        ``"replace"`` stores the new limits instead, ``"use_stored"`` works on the
        stored limits (at startup, and when another worker replaces them while this
        one runs) with a warning and a ``config-error`` event
        (:mod:`~runcell_celery.postgres.stored_limits`). Under ``"error"`` and
        ``"replace"`` a worker whose limits were replaced while it runs fails every
        acquire until it restarts.
    :param listen: wake waiters by ``LISTEN/NOTIFY`` (polling stays the fallback);
        turn off behind a transaction pooler to skip the self-check.
    :param pool_max_size: connections the pool made from a DSN may open (per process).
    :param connect_timeout_ms: how long to wait for a connection before a call fails
        closed with :class:`~runcell_celery.errors.ConcurrencyLimiterError`.
    """

    poll_interval_ms: int = DEFAULT_POLL_INTERVAL_MS
    queue_entry_ttl_ms: int = DEFAULT_QUEUE_ENTRY_TTL_MS
    ensure_schema: bool = True
    on_conflict: OnConflict = "error"
    listen: bool = True
    pool_max_size: int = DEFAULT_POOL_MAX_SIZE
    connect_timeout_ms: int = DEFAULT_CONNECT_TIMEOUT_MS

    @classmethod
    def from_mapping(cls, options: object, *, path: str | None = None) -> PostgresOptions:
        """Validate a settings section and return the options with defaults filled in.

        :param path: how the caller's settings spell the section (``RUNCELL["POSTGRES"]``);
            errors then name ``RUNCELL["POSTGRES"]["option"]``. Without it they name
            the bare option (keyword arguments).
        :raises ConcurrencyConfigError: naming the option and its value.
        """
        if not isinstance(options, Mapping):
            where = path or "options"
            raise ConcurrencyConfigError(f"{where} = {options!r} is invalid: must be a dict")
        known = tuple(f.name for f in fields(cls))
        for key in options:
            if key not in known:
                raise ConcurrencyConfigError(
                    f"{_name(path, key)} is invalid: unknown option; {did_you_mean(key, known)}"
                )
        for key in _POSITIVE_INTS:
            value = options.get(key, 1)
            maximum = MAX_POOL_SIZE if key == "pool_max_size" else MAX_DURATION_MS
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConcurrencyConfigError(
                    f"{_name(path, key)} = {value!r} is invalid: must be a positive integer"
                )
            if value > maximum:
                raise ConcurrencyConfigError(
                    f"{_name(path, key)} = {value!r} is invalid: must be at most {maximum}"
                )
        for key in _BOOLS:
            value = options.get(key, True)
            if not isinstance(value, bool):
                raise ConcurrencyConfigError(
                    f"{_name(path, key)} = {value!r} is invalid: must be True or False"
                )
        on_conflict = options.get("on_conflict", "error")
        if on_conflict not in ON_CONFLICT_VALUES:
            raise ConcurrencyConfigError(
                f"{_name(path, 'on_conflict')} = {on_conflict!r} is invalid: "
                "must be 'error', 'replace' or 'use_stored'"
            )
        return cls(**options)


def _name(path: str | None, key: object) -> str:
    return f'{path}["{key}"]' if path else str(key)
