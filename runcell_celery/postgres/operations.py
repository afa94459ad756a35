"""The operators' commands as functions over the PostgreSQL limiter's database: status,
storing the configured limits, force release, purging old events.

``celery -A proj runcell ...`` (:mod:`runcell_celery.celery.commands`) and runcell_django's
management commands and admin action call these, so both say and do the same; nothing
here imports Django or Celery. Reads and purges take a :data:`~.connection.Rows` (the
backend's pool by :func:`backend_rows`, or Django's connection); what writes the
limiter's tables goes through :class:`~.backend.PostgresBackend`.

The tables of runcell_django (``runcell_event``, ``runcell_occupancy``) are used when the
database has them: the p95 wait, the ``force-released`` audit event, the purge.
"""

from __future__ import annotations

import datetime
import getpass
import logging
import socket
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal, LiteralString

from ..config import LimiterConfig
from ..errors import ConcurrencyConfigError, ConcurrencyLimiterError
from ..hints import did_you_mean
from ..keys import split_key_name
from ..registry import LimiterRegistry
from . import statements
from .backend import PostgresBackend, ReleasedLease
from .calls import CallFailedError, fetch_rows
from .connection import Rows
from .options import OnConflict
from .status import (
    COLUMNS,
    P95_WINDOW_MINUTES,
    LimiterStatus,
    WorkloadStatus,
    format_ms,
    read_status,
    status_table,
)

__all__ = [
    "COLUMNS",
    "EVENT_TABLE",
    "OCCUPANCY_TABLE",
    "P95_WINDOW_MINUTES",
    "HeldLease",
    "LimiterStatus",
    "LimiterSync",
    "OperatorError",
    "Purged",
    "Rows",
    "WorkloadStatus",
    "backend_rows",
    "default_actor",
    "describe_duration",
    "find_leases",
    "force_release",
    "format_ms",
    "limiter_status",
    "operator_registry",
    "postgres_backend",
    "purge_events",
    "status_table",
    "sync_limiters",
    "tables_present",
]

logger = logging.getLogger("runcell_celery.postgres.operations")

LIMITER_TABLE = "runcell_limiter"
#: runcell_django's tables (its migrations create them beside the limiter's).
EVENT_TABLE = "runcell_event"
OCCUPANCY_TABLE = "runcell_occupancy"

#: Rows deleted per statement by :func:`purge_events` (each its own short transaction).
PURGE_BATCH_SIZE = 10_000


class OperatorError(Exception):
    """A command asked for what cannot be done as asked (a lease not held, or held on
    another limiter); the message names the value, and nothing was changed."""


def backend_rows(backend: PostgresBackend) -> Rows:
    """Run statements on ``backend``'s pool; database failures raise
    :class:`~runcell_celery.ConcurrencyLimiterError`."""
    database = backend.engine.database

    def rows(
        query: LiteralString, params: Mapping[str, Any] | None = None
    ) -> list[tuple[Any, ...]]:
        try:
            return fetch_rows(database, query, params)
        except CallFailedError as exc:
            raise ConcurrencyLimiterError(f"the runcell database failed: {exc}") from exc

    return rows


def tables_present(rows: Rows) -> frozenset[str]:
    """Which of the limiter's ``runcell_limiter`` and runcell_django's tables exist."""
    names = [LIMITER_TABLE, EVENT_TABLE, OCCUPANCY_TABLE]
    return frozenset(str(name) for (name,) in rows(statements.TABLES_PRESENT, {"names": names}))


@contextmanager
def operator_registry(
    settings: Mapping[str, Any],
    *,
    path: str = "RUNCELL",
    resolve_database: Callable[[str], str] | None = None,
    on_conflict: OnConflict | None = None,
) -> Iterator[LimiterRegistry]:
    """The limiters of ``settings`` (the workers' ``RUNCELL`` or ``app.conf.runcell``)
    on a backend fit for a short command (one connection, no ``LISTEN``), closed after.

    :param on_conflict: instead of the settings' ``POSTGRES["on_conflict"]``.
    :raises ConcurrencyConfigError: invalid settings, or no PostgreSQL ``DATABASE``.
    """
    given = settings.get("POSTGRES", {}) if isinstance(settings, Mapping) else None
    if isinstance(given, Mapping):  # else configure() names what is wrong with it
        postgres = {**given, "listen": False, "pool_max_size": 1}
        if on_conflict is not None:
            postgres["on_conflict"] = on_conflict
        settings = {**settings, "POSTGRES": postgres}
    registry = LimiterRegistry(resolve_database=resolve_database)
    registry.configure(settings, path=path)
    try:
        if registry.database_dsn is None:
            raise ConcurrencyConfigError(
                f'{path} has no PostgreSQL database ("DATABASE"): there are no stored '
                "limiters to read or limits to store"
            )
        yield registry
    finally:
        registry.close()


def postgres_backend(registry: LimiterRegistry) -> PostgresBackend:
    """``registry``'s backend, which must be the PostgreSQL one."""
    backend = registry.backend
    if not isinstance(backend, PostgresBackend):
        raise ConcurrencyConfigError(
            f'{registry.settings_path}["BACKEND"] gives {type(backend).__name__}: the '
            "commands need the PostgreSQL backend with a DATABASE"
        )
    return backend


def limiter_status(rows: Rows, *, window_minutes: int = P95_WINDOW_MINUTES) -> list[LimiterStatus]:
    """Every stored limiter's status (none on a database without the limiter's tables)."""
    tables = tables_present(rows)
    if LIMITER_TABLE not in tables:
        return []
    return read_status(rows, events=EVENT_TABLE in tables, window_minutes=window_minutes)


@dataclass(frozen=True, slots=True)
class LimiterSync:
    """What :func:`sync_limiters` did with one limiter: ``differences`` are the fields
    whose stored values differed; ``error`` says why ``"differs"`` was not replaced."""

    name: str
    outcome: Literal["stored", "unchanged", "replaced", "differs", "not-configured"]
    differences: tuple[str, ...] = ()
    error: str | None = None

    def describe(self, path: str = "RUNCELL") -> str:
        """``claude: replaced (max_concurrent)``, as the commands print it."""
        if self.outcome == "not-configured":
            return f"{self.name}: stored, not in {path} (left as is)"
        changed = f" ({', '.join(self.differences)})" if self.differences else ""
        return f"{self.name}: {self.outcome}{changed}"


def sync_limiters(
    settings: Mapping[str, Any],
    *,
    path: str = "RUNCELL",
    resolve_database: Callable[[str], str] | None = None,
    replace: bool = False,
) -> list[LimiterSync]:
    """Store the limits of every limiter ``settings`` configures, as a deploy would
    before the workers start, and say what differed; stored limits that differ are left
    as they are (``"differs"``) unless ``replace``. Stored limiters that ``settings`` does
    not name are listed and left alone.

    :raises ConcurrencyConfigError: invalid settings, or no PostgreSQL ``DATABASE``.
    """
    results: list[LimiterSync] = []
    conflict: OnConflict = "replace" if replace else "error"
    with operator_registry(
        settings, path=path, resolve_database=resolve_database, on_conflict=conflict
    ) as registry:
        stored = _stored_limits(backend_rows(postgres_backend(registry)))
        for name in registry.names():
            mine = registry.config(name)
            assert mine is not None  # configured from settings
            before = stored.get(name)
            differences = tuple(mine.differences(before)) if before is not None else ()
            try:
                registry.get(name)  # stores the limits, or checks the stored ones
            except ConcurrencyConfigError as exc:
                results.append(LimiterSync(name, "differs", differences, exc.message))
                continue
            if name not in stored:
                results.append(LimiterSync(name, "stored"))
            elif differences or before is None:
                results.append(LimiterSync(name, "replaced", differences))
            else:
                results.append(LimiterSync(name, "unchanged"))
        for name in sorted(set(stored) - set(registry.names())):
            results.append(LimiterSync(name, "not-configured"))
    return results


def _stored_limits(rows: Rows) -> dict[str, LimiterConfig | None]:
    """The stored limits of every limiter not a key, by name (``None``: unreadable)."""
    if LIMITER_TABLE not in tables_present(rows):
        return {}  # a new database: the first limiter stored creates the tables
    found: dict[str, LimiterConfig | None] = {}
    for name, config, *_ in rows(statements.LIMITERS_NOT_KEYS, None):
        try:
            found[str(name)] = LimiterConfig.from_mapping(config, name=str(name))
        except ConcurrencyConfigError:
            found[str(name)] = None
    return found


@dataclass(frozen=True, slots=True)
class HeldLease:
    """A slot held now, as :func:`find_leases` finds it."""

    lease_id: str
    limiter: str
    workload: str
    run_id: str | None
    holder_name: str | None
    holder_host: str | None
    holder_pid: int | None
    fencing_token: int


def find_leases(
    rows: Rows, *, limiter: str, lease_ids: Sequence[str] = (), run_ids: Sequence[str] = ()
) -> list[HeldLease]:
    """The leases of ``limiter`` (or of its keys) that a force release of ``lease_ids``
    and of the slots of the runs ``run_ids`` (Celery task ids) would take back.

    :raises OperatorError: a lease id that is not a UUID, an unknown limiter, or a lease
        or run that holds no slot of ``limiter``: all named, before anything is released.
    """
    if not lease_ids and not run_ids:
        raise OperatorError("name the slots to release: lease ids, or run (task) ids")
    ids = [_lease_id(value) for value in lease_ids]
    names = []
    if LIMITER_TABLE in tables_present(rows):
        names = [str(row[0]) for row in rows(statements.LIMITERS_NOT_KEYS, None)]
    if limiter not in names:
        hint = did_you_mean(limiter, names, label="stored") if names else "none is stored yet"
        raise OperatorError(f"no limiter named {limiter!r} is stored; {hint}")
    params = {"lease_ids": ids, "run_ids": list(run_ids)}
    found = [HeldLease(*row) for row in rows(statements.HELD_LEASES, params)]
    problems: list[str] = []
    for lease_id in ids:
        lease = next((x for x in found if x.lease_id == lease_id), None)
        if lease is None:
            problems.append(f"lease {lease_id} is not held (released, expired, or never granted)")
        elif not _belongs(lease.limiter, limiter):
            problems.append(f"lease {lease_id} is a slot of {lease.limiter!r}, not of {limiter!r}")
    for run_id in run_ids:
        if not any(x.run_id == run_id and _belongs(x.limiter, limiter) for x in found):
            elsewhere = sorted({x.limiter for x in found if x.run_id == run_id})
            where = f" (it holds slots of {', '.join(map(repr, elsewhere))})" if elsewhere else ""
            problems.append(f"run {run_id!r} holds no slot of {limiter!r}{where}")
    if problems:
        raise OperatorError("; ".join(problems) + "; nothing was released")
    return [
        x
        for x in found
        if _belongs(x.limiter, limiter) and (x.lease_id in ids or x.run_id in run_ids)
    ]


def _lease_id(value: str) -> str:
    try:
        return str(uuid.UUID(str(value)))
    except ValueError:
        raise OperatorError(
            f"{value!r} is not a lease id: a lease id is a UUID "
            "(such as 0b7c3e2a-5d1f-4c8e-9a60-2f4d1e8b7c90)"
        ) from None


def _belongs(lease_limiter: str, limiter: str) -> bool:
    """A lease of ``limiter``, or of one of its keys (``"tenant:acme"`` of ``"tenant"``)."""
    return lease_limiter == limiter or split_key_name(lease_limiter)[0] == limiter


def force_release(
    backend: PostgresBackend, lease_ids: Sequence[str], *, actor: str
) -> list[ReleasedLease]:
    """Take slots back from their holders now, give them to the next waiters, and say
    who did it: each holder's error names ``actor`` at its next renewal, a warning is
    logged per lease and, where the database has runcell_django's ``runcell_event``, a
    ``force-released`` event naming ``actor`` is recorded with the release. Returns the
    leases released (those already gone left out).

    The holder's call may still run until its next renewal: the fencing token is what
    protects the provider.
    """
    if not actor.strip():
        raise OperatorError("the actor (who releases the slots) must not be empty")
    record = EVENT_TABLE in tables_present(backend_rows(backend))
    released = backend.force_release([str(i) for i in lease_ids], actor=actor, record=record)
    for lease in released:
        logger.warning(
            "runcell: %s force-released lease %s of %s/%s (run %s, token %s)",
            actor,
            lease.lease_id,
            lease.limiter,
            lease.workload,
            lease.run_id,
            lease.fencing_token,
        )
    return released


def default_actor() -> str:
    """``user@host``: who runs this command, for the record of a force release."""
    try:
        user = getpass.getuser()
    except (OSError, KeyError):  # no user name in the environment or the password file
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


@dataclass(frozen=True, slots=True)
class Purged:
    """What :func:`purge_events` deleted; ``tables``: whether the database has
    runcell_django's tables at all (without them there is nothing to purge)."""

    events: int
    samples: int
    tables: bool

    def describe(self, older_than: datetime.timedelta) -> str:
        """``Deleted 3 events and 1 occupancy sample older than 7 days.``"""
        return (
            f"Deleted {_count(self.events, 'event')} and "
            f"{_count(self.samples, 'occupancy sample')} "
            f"older than {describe_duration(older_than)}."
        )


def describe_duration(value: datetime.timedelta) -> str:
    """``7 days``, ``36 hours``, ``1 minute``: in the largest unit that divides it."""
    seconds = value.total_seconds()
    for noun, size in (("day", 86_400), ("hour", 3_600), ("minute", 60)):
        if seconds and seconds % size == 0:
            return _count(int(seconds // size), noun)
    return _count(int(seconds), "second") if seconds == int(seconds) else f"{seconds:g} seconds"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def purge_events(
    rows: Rows, *, older_than: datetime.timedelta, batch_size: int = PURGE_BATCH_SIZE
) -> Purged:
    """Delete the recorded events and occupancy samples older than ``older_than`` (from
    one cutoff in database time), ``batch_size`` rows per statement: no long
    transaction, however many there are.
    """
    if older_than < datetime.timedelta(0):
        raise OperatorError(f"older_than = {older_than} is invalid: must not be negative")
    if batch_size < 1:
        raise OperatorError(f"batch_size = {batch_size!r} is invalid: must be at least 1")
    tables = tables_present(rows)
    if EVENT_TABLE not in tables and OCCUPANCY_TABLE not in tables:
        return Purged(0, 0, tables=False)
    older_than_ms = older_than / datetime.timedelta(milliseconds=1)
    [(before,)] = rows(statements.CUTOFF, {"older_than_ms": older_than_ms})
    counts = []
    for table, query in ((EVENT_TABLE, statements.PURGE_EVENTS),
                         (OCCUPANCY_TABLE, statements.PURGE_OCCUPANCY)):  # fmt: skip
        total = 0
        deleted = batch_size if table in tables else 0
        while deleted >= batch_size:
            [(deleted,)] = rows(query, {"before": before, "limit": batch_size})
            total += int(deleted)
        counts.append(total)
    return Purged(counts[0], counts[1], tables=True)
