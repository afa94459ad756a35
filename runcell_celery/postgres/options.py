"""The PostgreSQL backend's own settings (``RUNCELL["POSTGRES"]``), validated in one
place for the settings section and for ``create_postgres_concurrency_limiter``'s arguments.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Literal

from ..config import MAX_DURATION_MS
from ..errors import ConcurrencyConfigError
from ..hints import did_you_mean

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

    ``poll_interval_ms``: how often waiters poll without a listener; ``queue_entry_ttl_ms``:
    how long a crashed waiter's row survives; ``ensure_schema``: create or upgrade the
    schema on first use; ``on_conflict``: when stored limits differ, refuse (``"error"``),
    store these (``"replace"``) or work on the stored ones (``"use_stored"``);
    ``listen``: wake waiters by ``LISTEN/NOTIFY``; ``pool_max_size``: connections per
    process; ``connect_timeout_ms``: how long a call waits for a connection.
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
        """Validate a settings section and return the options with defaults filled in;
        errors name ``path["option"]`` (or the bare option without ``path``) and the value.
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
