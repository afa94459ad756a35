"""Managers: the queries the admin, the dashboard and the commands share.

They read the database ``RUNCELL["DATABASE"]`` names when it is an alias (else Django's
routers choose), and take times from the database (``Now()``), never the web server.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, LiteralString, Self, cast

from django.contrib.postgres.fields import ArrayField
from django.db import connections, models, router
from django.db.models import (
    BooleanField,
    Count,
    DurationField,
    ExpressionWrapper,
    F,
    FloatField,
    IntegerField,
    JSONField,
    OuterRef,
    Q,
    Subquery,
    Sum,
)
from django.db.models.expressions import RawSQL
from django.db.models.functions import Coalesce, Now

from runcell_celery import LimiterConfig
from runcell_celery.postgres.operations import Rows

from . import conf, sql
from .event_types import EVENTS_DROPPED

#: The window of the Limiters page's wait-time percentile.
P95_WINDOW_MINUTES = 15
#: Keys busiest first: most slots held, then most requests waiting, then by name (as
#: the backend's ``key_stats`` orders them); needs ``with_key_usage()``.
BUSIEST_FIRST = ("-held_total", "-waiting_total", "name")


class _RunCellManager(models.Manager[Any]):
    """Reads the database of ``RUNCELL["DATABASE"]`` when it is an alias."""

    def get_queryset(self) -> models.QuerySet[Any]:
        queryset = super().get_queryset()
        alias = conf.database_alias()
        return queryset.using(alias) if alias is not None and self._db is None else queryset


class _CompletedQuerySet(models.QuerySet[Any]):
    """Rows completed by one more read for all of them once fetched (as prefetching is)."""

    _complete = False

    def _completed(self) -> Self:
        queryset = self.all()
        queryset._complete = True
        return queryset

    def _clone(self) -> Any:
        clone = super()._clone()  # type: ignore[misc]
        clone._complete = self._complete
        return clone

    def _fetch_all(self) -> None:
        fetched = self._result_cache is None
        super()._fetch_all()
        if fetched and self._complete and self._result_cache:
            rows = [row for row in self._result_cache if isinstance(row, self.model)]
            if rows:
                self._complete_rows(rows)

    def _complete_rows(self, rows: list[Any]) -> None:
        raise NotImplementedError


class LimiterQuerySet(_CompletedQuerySet):
    def with_live_stats(self) -> LimiterQuerySet:
        """Annotate the p95 wait of the last 15 minutes, and attach each row's live counts
        (``live_state``, a :class:`runcell_celery.postgres.LimiterState`) as the backend
        counts them: one more query on the backend's pool for any number of rows."""
        p95 = RawSQL(sql.P95_WAIT_MS, (P95_WINDOW_MINUTES,), output_field=FloatField())
        return cast(LimiterQuerySet, self.annotate(p95_wait_ms=p95)._completed())

    def _complete_rows(self, rows: list[Any]) -> None:
        states = conf.postgres_backend().limiter_states([row.name for row in rows])
        for row in rows:
            row.live_state = states.get(row.name)

    def without_keys(self) -> LimiterQuerySet:
        """Limiters only, not the rows of keyed limiters' keys (a fleet may have 100,000)."""
        return self.filter(parent__isnull=True)

    def keys_of(self, keyed: str) -> LimiterQuerySet:
        """The key rows of the keyed limiter ``keyed`` (index ``runcell_limiter_keys``)."""
        return self.filter(parent=keyed)

    def with_key_usage(self) -> LimiterQuerySet:
        """Annotate ``held_total`` and ``waiting_total`` (the row's own) and, on a keyed
        limiter's row, ``key_usage`` (:data:`runcell_django.sql.KEY_USAGE`): subqueries of
        the rows' query, bounded by an index."""
        return cast(
            LimiterQuerySet,
            self.annotate(
                held_total=RawSQL(sql.HELD_TOTAL, (), output_field=IntegerField()),
                waiting_total=RawSQL(sql.WAITING_TOTAL, (), output_field=IntegerField()),
                key_usage=RawSQL(sql.KEY_USAGE, (), output_field=JSONField()),
            ),
        )

    def stored_limits(self) -> dict[str, LimiterConfig | None]:
        """Each limiter's parsed stored limits by name (``None``: unreadable), keys left
        out (they have their keyed limiter's limits), in one query."""
        rows = self.without_keys().order_by("name").only("name", "config", "parent")
        return {row.name: row.limits for row in rows}


@dataclass(frozen=True, slots=True)
class GroupLease:
    """A lease held with others for one request over several limiters."""

    lease_id: str
    limiter: str
    workload: str


def group_of(request_id: str) -> str | None:
    """The request over several limiters a lease's request id belongs to
    (``"<request id>|<limiter>"``), or ``None``."""
    group, separator, _limiter = request_id.rpartition("|")
    return group if separator else None


class LeaseQuerySet(_CompletedQuerySet):
    def with_group_leases(self) -> LeaseQuerySet:
        """Attach to each lease of a request over several limiters the others held with it
        (``group_leases``; ``[]`` for any other lease), in one query when one is needed."""
        return self._completed()

    def _complete_rows(self, rows: list[Any]) -> None:
        groups = {group for row in rows if (group := group_of(row.request_id)) is not None}
        held: dict[str, list[GroupLease]] = {}
        if groups:
            with connections[self.db].cursor() as cursor:
                cursor.execute(sql.GROUP_LEASES, {"groups": sorted(groups)})
                for group, lease_id, limiter, workload in cursor.fetchall():
                    held.setdefault(group, []).append(GroupLease(str(lease_id), limiter, workload))
        for row in rows:
            group = group_of(row.request_id)
            others = held.get(group, []) if group is not None else []
            row.group_leases = [lease for lease in others if lease.lease_id != str(row.lease_id)]

    def with_age(self) -> LeaseQuerySet:
        """Annotate ``age`` (since acquired) and ``expires_in``, in database time."""
        return cast(
            LeaseQuerySet,
            self.annotate(
                age=ExpressionWrapper(Now() - F("acquired_at"), output_field=DurationField()),
                expires_in=ExpressionWrapper(F("expires_at") - Now(), output_field=DurationField()),
            ),
        )


class QueueEntryQuerySet(models.QuerySet[Any]):
    def with_group_waits(self) -> QueueEntryQuerySet:
        """Annotate ``waits_on``: the limiters a waiting member of a request over several
        waits on (:data:`runcell_django.sql.GROUP_WAITS_ON`); ``None`` on any other row."""
        return cast(
            QueueEntryQuerySet,
            self.annotate(
                waits_on=RawSQL(sql.GROUP_WAITS_ON, (), output_field=ArrayField(models.TextField()))
            ),
        )

    def with_place(self) -> QueueEntryQuerySet:
        """Annotate ``ahead`` (requests of the same workload served first: runs in
        progress, then by arrival, as allocation serves them), ``waited`` (so far),
        ``deadline_in`` and ``stale`` (its waiter stopped polling)."""
        live = Q(granted_lease_id__isnull=True) & (Q(parked=True) | Q(expires_at__gt=Now()))
        served_first = Q(in_progress=True, in_progress__gt=OuterRef("in_progress")) | Q(
            in_progress=OuterRef("in_progress"), position__lt=OuterRef("position")
        )
        ahead = (
            self.model._default_manager.filter(
                live, served_first, limiter=OuterRef("limiter"), workload=OuterRef("workload")
            )
            .order_by()
            .values("limiter")
            .annotate(n=Count("*"))
            .values("n")
        )
        return cast(
            QueueEntryQuerySet,
            self.annotate(
                ahead=Coalesce(Subquery(ahead, output_field=IntegerField()), 0),
                waited=ExpressionWrapper(Now() - F("enqueued_at"), output_field=DurationField()),
                deadline_in=ExpressionWrapper(F("deadline") - Now(), output_field=DurationField()),
                stale=ExpressionWrapper(
                    Q(parked=False) & Q(expires_at__lte=Now()), output_field=BooleanField()
                ),
            ),
        )


LimiterManager = _RunCellManager.from_queryset(LimiterQuerySet)
LeaseManager = _RunCellManager.from_queryset(LeaseQuerySet)
QueueEntryManager = _RunCellManager.from_queryset(QueueEntryQuerySet)
AdmissionCountManager = _RunCellManager


class OccupancyManager(_RunCellManager):
    def sample(self, interval_ms: int) -> None:
        """Record slots held and queued per workload, once per interval for the fleet."""
        with connections[write_alias(self.model)].cursor() as cursor:
            cursor.execute(sql.SAMPLE_OCCUPANCY, {"interval_ms": interval_ms})


class EventManager(_RunCellManager):
    def per_bucket(self, query: Any, minutes: int, bucket_s: int) -> list[tuple[Any, ...]]:
        """The rows of a ``*_PER_BUCKET`` query of :mod:`.sql` over the last ``minutes``."""
        return database_rows(self.model)(query, {"minutes": minutes, "bucket_s": bucket_s})

    def dropped_per_limiter(self, minutes: int) -> dict[str, int]:
        """Events dropped by full recorder buffers in the window, per limiter."""
        rows = database_rows(self.model)(sql.DROPPED_PER_LIMITER, {"minutes": minutes})
        return {limiter: int(n) for limiter, n in rows}

    def dropped_since(self, since: datetime.datetime) -> int:
        """Events full recorder buffers dropped since ``since``, all limiters together."""
        found = self.filter(type=EVENTS_DROPPED, occurred_at__gte=since).aggregate(n=Sum("dropped"))
        return int(found["n"] or 0)


def write_alias(model: type[models.Model]) -> str:
    """The alias to write ``model``'s rows to (the recorder's inserts)."""
    return conf.database_alias() or router.db_for_write(model)


def database_rows(model: type[models.Model], *, write: bool = False) -> Rows:
    """Run the statements of :mod:`runcell_celery.postgres.operations` on the connection
    the app reads ``model`` from (or writes it to): in its transaction, if one is open."""
    alias = write_alias(model) if write else model._default_manager.all().db

    def rows(
        query: LiteralString, params: Mapping[str, Any] | None = None
    ) -> list[tuple[Any, ...]]:
        with connections[alias].cursor() as cursor:
            cursor.execute(query, params)
            return list(cursor.fetchall()) if cursor.description is not None else []

    return rows
