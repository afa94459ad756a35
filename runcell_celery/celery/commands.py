"""``celery -A proj runcell status|sync-limiters|release|purge``: the operators' commands.

A Celery command plugin (entry point group ``celery.commands``) reading the settings
``proj``'s workers read; the work is :mod:`runcell_celery.postgres.operations`'s, as for
the Django management commands. Errors are one line (exit status 1; 2 for a bad
option), never a traceback.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import logging
import re
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

import click
from celery import Celery
from celery.bin.base import CeleryCommand, CLIContext

from ..errors import ConcurrencyError
from .state import app_settings

if TYPE_CHECKING:
    from ..registry import LimiterRegistry

# runcell_celery.postgres (psycopg) is imported by the commands when they run: every
# `celery` command loads this plugin, and `celery worker` should not pay for it.

__all__ = ["runcell"]

_P = ParamSpec("_P")
_R = TypeVar("_R")

Settings = tuple[Mapping[str, Any], str, Callable[[str], str] | None]

#: Without ``RUNCELL["EVENTS"]["RETENTION_DAYS"]``, ``purge`` keeps this many days.
DEFAULT_RETENTION_DAYS = 7


def _clearly(command: Callable[_P, _R]) -> Callable[_P, _R]:
    """Report the library's errors as one line (``Error: ...``, exit status 1)."""

    @functools.wraps(command)
    def run(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        from ..postgres.operations import OperatorError

        try:
            return command(*args, **kwargs)
        except (ConcurrencyError, OperatorError) as exc:
            raise click.ClickException(str(exc)) from None

    return run


def _settings(ctx: click.Context) -> Settings:
    """The app's runcell settings, as its workers read them."""
    found = ctx.find_object(CLIContext)
    if found is None:  # called outside the celery command
        raise click.UsageError("run it as: celery -A proj runcell ...")
    app: Celery = found.app
    settings, path, resolve = app_settings(app)
    if settings is None:
        # A Django project's app has none of its own: loading the app's modules sets
        # Django up (Celery's Django fixup), and runcell_django shares settings.RUNCELL.
        app.loader.import_default_modules()
        settings, path, resolve = app_settings(app)
    if settings is None:
        raise click.ClickException(
            f"the app {app.main or '(unnamed)'!r} has no runcell settings: set "
            'app.conf.runcell = {"DATABASE": "postgresql://...", "LIMITERS": {...}}, or '
            "with Django settings.RUNCELL and 'runcell_django' in INSTALLED_APPS"
        )
    return settings, path, resolve


@contextmanager
def _registry(ctx: click.Context) -> Iterator[LimiterRegistry]:
    from ..postgres import operations

    settings, path, resolve = _settings(ctx)
    with operations.operator_registry(settings, path=path, resolve_database=resolve) as registry:
        yield registry


def _json(value: object) -> None:
    click.echo(json.dumps(value, indent=2, default=str))


_JSON = click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")


@click.group(name="runcell")
def runcell() -> None:
    """Concurrency limits: status, stored limits, force release, event purge."""
    # A database that cannot be reached is reported once, as the command's error; the
    # pool's own warnings would repeat it on stderr, a line per attempt.
    logging.getLogger("psycopg.pool").setLevel(logging.CRITICAL)


@runcell.command(cls=CeleryCommand)
@_JSON
@click.pass_context
@_clearly
def status(ctx: click.Context, as_json: bool) -> None:
    """Each limiter's slots held against its limit, requests queued (parked among
    them: deferred Celery tasks) and waits, per workload."""
    from ..postgres import operations

    with _registry(ctx) as registry:
        rows = operations.backend_rows(operations.postgres_backend(registry))
        statuses = operations.limiter_status(rows)
    if as_json:
        _json({"limiters": [s.to_dict() for s in statuses]})
    elif not statuses:
        click.echo("No limiter is stored in the database yet.")
    else:
        for line in operations.status_table(statuses):
            click.echo(line)


@runcell.command(name="sync-limiters", cls=CeleryCommand)
@click.option("--replace", is_flag=True, help="Replace stored limits that differ.")
@_JSON
@click.pass_context
@_clearly
def sync_limiters(ctx: click.Context, replace: bool, as_json: bool) -> None:
    """Store the configured limits (as a deploy would, before the workers start) and
    say what differs; stored limits that differ are an error unless --replace."""
    from ..postgres import operations

    settings, path, resolve = _settings(ctx)
    results = operations.sync_limiters(
        settings, path=path, resolve_database=resolve, replace=replace
    )
    if as_json:
        _json({"limiters": [dataclasses.asdict(r) for r in results]})
    else:
        for result in results:
            click.echo(result.describe(path))
    conflicts = [r for r in results if r.outcome == "differs"]
    if conflicts:
        raise click.ClickException(
            "stored limits differ from the settings; run again with --replace to store "
            "the settings' limits:\n" + "\n".join(f"{r.name}: {r.error}" for r in conflicts)
        )


@runcell.command(cls=CeleryCommand)
@click.argument("lease_ids", nargs=-1, metavar="[LEASE_ID]...")
@click.option(
    "--limiter",
    "-l",
    required=True,
    help="The limiter whose slots to release (a keyed limiter: any of its keys').",
)
@click.option(
    "--task",
    "run_ids",
    multiple=True,
    metavar="TASK_ID",
    help="Release the limiter's slots held by this task (run) id; may be repeated.",
)
@click.option("--actor", help="Who releases them, for the record (default: user@host).")
@_JSON
@click.pass_context
@_clearly
def release(
    ctx: click.Context,
    lease_ids: tuple[str, ...],
    limiter: str,
    run_ids: tuple[str, ...],
    actor: str | None,
    as_json: bool,
) -> None:
    """Force-release slots now: the next waiters get them at once, each holder learns
    it at its next renewal (its error names the actor) and its call is aborted then.
    Nothing is released unless every lease and task named holds a slot of the limiter."""
    from ..postgres import operations

    who = operations.default_actor() if actor is None else actor
    with _registry(ctx) as registry:
        backend = operations.postgres_backend(registry)
        leases = operations.find_leases(
            operations.backend_rows(backend), limiter=limiter, lease_ids=lease_ids, run_ids=run_ids
        )
        released = operations.force_release(backend, [x.lease_id for x in leases], actor=who)
    done = {lease.lease_id for lease in released}
    gone = [lease.lease_id for lease in leases if lease.lease_id not in done]
    if as_json:
        _json({"actor": who, "released": [dataclasses.asdict(x) for x in released], "gone": gone})
        return
    for lease in released:
        click.echo(
            f"Released lease {lease.lease_id} of {lease.limiter}/{lease.workload} (task "
            f"{lease.run_id or '-'}, fencing token {lease.fencing_token}) as {who}."
        )
    for lease_id in gone:
        click.echo(f"Lease {lease_id} was no longer held (released or expired meanwhile).")


if TYPE_CHECKING:
    _DurationBase = click.ParamType[datetime.timedelta]
else:  # click before 8.2 has no generic ParamType
    _DurationBase = click.ParamType


class Duration(_DurationBase):
    """``7d``, ``36h``, ``90m``, ``30s``, ``2w``: a number and a unit."""

    name = "duration"
    UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86_400, "w": 604_800}

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> datetime.timedelta:
        if isinstance(value, datetime.timedelta):
            return value
        found = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*", str(value))
        if found is None:
            self.fail(
                f"{value!r} is not a duration: give a number and a unit, s, m, h, d or w "
                "(7d, 36h, 90m)",
                param,
                ctx,
            )
        return datetime.timedelta(seconds=float(found[1]) * self.UNITS[found[2]])


def _retention(settings: Mapping[str, Any], path: str) -> datetime.timedelta:
    """``RUNCELL["EVENTS"]["RETENTION_DAYS"]`` (the Django recorder's setting), else 7 days."""
    events = settings.get("EVENTS", {})
    days: object = DEFAULT_RETENTION_DAYS
    if isinstance(events, Mapping):
        days = events.get("RETENTION_DAYS", DEFAULT_RETENTION_DAYS)
    if isinstance(days, bool) or not isinstance(days, int) or days < 1:
        raise click.ClickException(
            f'{path}["EVENTS"]["RETENTION_DAYS"] = {days!r} is invalid: must be a positive '
            "integer (or give --older-than)"
        )
    return datetime.timedelta(days=days)


@runcell.command(cls=CeleryCommand)
@click.option(
    "--older-than",
    type=Duration(),
    help='Delete what is older: 7d, 36h, 90m (default: RUNCELL["EVENTS"]["RETENTION_DAYS"], '
    "else 7 days).",
)
@click.option(
    "--batch-size",
    type=click.IntRange(min=1),
    help="Rows deleted per statement, each its own transaction (default: 10000).",
)
@_JSON
@click.pass_context
@_clearly
def purge(
    ctx: click.Context,
    older_than: datetime.timedelta | None,
    batch_size: int | None,
    as_json: bool,
) -> None:
    """Delete recorded events and occupancy samples older than the retention, in
    batches (no long transaction). Run it daily (cron, Celery beat)."""
    from ..postgres import operations

    settings, path, resolve = _settings(ctx)
    keep = older_than if older_than is not None else _retention(settings, path)
    with operations.operator_registry(settings, path=path, resolve_database=resolve) as registry:
        rows = operations.backend_rows(operations.postgres_backend(registry))
        batch = operations.PURGE_BATCH_SIZE if batch_size is None else batch_size
        purged = operations.purge_events(rows, older_than=keep, batch_size=batch)
    if as_json:
        _json({**dataclasses.asdict(purged), "older_than_s": keep.total_seconds()})
    elif not purged.tables:
        click.echo(
            "This database has no recorded events: runcell_django records them (its "
            "migrations create runcell_event and runcell_occupancy). Nothing to purge."
        )
    else:
        click.echo(purged.describe(keep))
