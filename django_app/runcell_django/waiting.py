"""Why queued requests wait, in the words of the allocation rules, and the queue page's
summary per limiter and workload.

The rules live in :mod:`runcell_celery.allocation`; this module decides nothing. It asks
allocation's own :func:`~runcell_celery.allocation.has_room` and
:meth:`~runcell_celery.LimiterConfig.ceiling`, over a limiter row's stored limits and
live counts, which rule holds a workload's line back. The summary costs two queries
whatever the number of rows; a keyed limiter's keys are summed under it (each key has
its own limit, so there is no one reason to give for them).
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from django.db.models import Count, DurationField, ExpressionWrapper, F, Max, Q, QuerySet
from django.db.models.functions import Coalesce, Now
from django.utils.translation import gettext as _
from django.utils.translation import ngettext

from runcell_celery import LimiterConfig
from runcell_celery.allocation import has_room

from .models import Limiter
from .state import format_duration

#: Reason codes (a page's ``data-reason``): what holds the line back.
BEHIND = "behind"
CEILING = "ceiling"
RESERVED = "reservation"
LIMIT = "limit"
PRIORITY = "priority"
NEXT = "next"
UNKNOWN = "unknown-workload"


@dataclass(frozen=True, slots=True)
class Reason:
    """Why a request (or a workload's line) waits: ``code`` for machines, ``text``
    for people."""

    code: str
    text: str


def counts(names: Sequence[str] | None, values: Sequence[int] | None) -> dict[str, int]:
    """Per workload, from a limiter row's arrays (``workloads`` with ``active`` or
    ``waiting``)."""
    return {name: int(n) for name, n in zip(names or (), values or (), strict=False) if n}


def why_it_waits(
    config: LimiterConfig,
    active: Mapping[str, int],
    waiting: Mapping[str, int],
    workload: str,
    *,
    ahead: int = 0,
) -> Reason:
    """Say why a request of ``workload`` with ``ahead`` requests before it in its
    workload's line is not granted now.

    :param active: slots held per workload now.
    :param waiting: requests waiting (or parked) per workload now.
    """
    head = _why_the_head_waits(config, active, waiting, workload)
    if not ahead:
        return head
    behind = ngettext("%(n)d ahead in line", "%(n)d ahead in line", ahead) % {"n": ahead}
    return Reason(BEHIND, behind if head.code == NEXT else f"{behind} · {head.text}")


def _why_the_head_waits(
    config: LimiterConfig,
    active: Mapping[str, int],
    waiting: Mapping[str, int],
    workload: str,
) -> Reason:
    settings = config.workloads.get(workload)
    if settings is None:
        return Reason(UNKNOWN, _("no workload %(name)s in the stored limits") % {"name": workload})
    held = active.get(workload, 0)
    ceiling = config.ceiling(workload)
    if held >= ceiling and ceiling < config.max_concurrent:  # else the limit is said
        text = _("workload at its ceiling (%(held)d/%(ceiling)d)")
        return Reason(CEILING, text % {"held": held, "ceiling": ceiling})
    if not has_room(config, active, workload):
        total = sum(active.values())
        if total >= config.max_concurrent:
            text = _("limit reached (%(held)d/%(limit)d)")
            return Reason(LIMIT, text % {"held": total, "limit": config.max_concurrent})
        kept = {
            name: other.reserved - active.get(name, 0)
            for name, other in sorted(config.workloads.items())
            if name != workload and other.reserved > active.get(name, 0)
        }
        parts = ", ".join(f"{name} {n}" for name, n in kept.items())
        return Reason(RESERVED, _("free slots reserved for %(others)s") % {"others": parts})
    first = _served_first(config, active, waiting, workload)
    if first is not None:
        return Reason(PRIORITY, _("%(other)s has priority") % {"other": first})
    return Reason(NEXT, _("granted next"))


def _served_first(
    config: LimiterConfig, active: Mapping[str, int], waiting: Mapping[str, int], workload: str
) -> str | None:
    """A workload of higher priority with requests waiting and room: allocation serves
    it first (:func:`runcell_celery.allocation.allocate`)."""
    mine = config.workloads[workload].priority
    for name, other in sorted(config.workloads.items(), key=lambda item: -item[1].priority):
        if other.priority <= mine:
            return None
        if name != workload and waiting.get(name, 0) and has_room(config, active, name):
            return name
    return None


@dataclass(frozen=True, slots=True)
class SummaryRow:
    """One limiter's workload on the queue page."""

    limiter: str
    workload: str
    #: Waiting in a process, parked (a deferred Celery task), granted and re-published.
    waiting: int
    parked: int
    granted: int
    oldest_wait: datetime.timedelta | None
    #: Slots the workload holds, and its ceiling (``None`` for a keyed limiter's keys).
    held: int | None
    ceiling: int | None
    #: Why the line's first request waits (``None``: nothing waits).
    reason: Reason | None
    #: A keyed limiter's keys with requests in this line (0 for any other limiter).
    keys: int = 0

    @property
    def oldest_wait_text(self) -> str:
        return format_duration(self.oldest_wait)


def queue_summary(queryset: QuerySet[Any]) -> list[SummaryRow]:
    """Summarize the queued requests of ``queryset`` (the page's rows, filters applied)."""
    model = queryset.model
    not_granted = Q(granted_lease_id__isnull=True)
    groups = (
        model._default_manager.using(queryset.db)
        .filter(pk__in=queryset.order_by().values("pk"))
        .annotate(group=Coalesce("limiter__parent", "limiter_id"))
        .values("group", "workload")
        .annotate(
            waiting=Count("pk", filter=not_granted & Q(parked=False)),
            parked=Count("pk", filter=not_granted & Q(parked=True)),
            granted=Count("pk", filter=Q(granted_lease_id__isnull=False)),
            oldest_wait=Max(
                ExpressionWrapper(Now() - F("enqueued_at"), output_field=DurationField()),
                filter=not_granted,
            ),
            keys=Count("limiter", distinct=True, filter=Q(limiter__parent__isnull=False)),
        )
        .order_by("group", "workload")
    )
    rows = list(groups)
    names = {row["group"] for row in rows if not row["keys"]}
    limiters = Limiter.objects.using(queryset.db).in_bulk(names)
    return [_row(row, limiters.get(row["group"])) for row in rows]


def _row(row: dict[str, Any], limiter: Limiter | None) -> SummaryRow:
    workload = row["workload"]
    held = ceiling = reason = None
    if row["keys"]:
        text = ngettext(
            "%(n)d key waits: each key has its own limit (see the rows)",
            "%(n)d keys wait: each key has its own limit (see the rows)",
            row["keys"],
        ) % {"n": row["keys"]}
        reason = Reason("keys", text)
    elif limiter is not None and (limits := limiter.limits) is not None:
        active = counts(limiter.workloads, limiter.active)
        held = active.get(workload, 0)
        ceiling = limits.ceiling(workload) if workload in limits.workloads else None
        if row["waiting"] or row["parked"]:
            waiting = counts(limiter.workloads, limiter.waiting)
            reason = why_it_waits(limits, active, waiting, workload)
    elif row["waiting"] or row["parked"]:
        reason = Reason("unknown", _("limits not readable"))
    return SummaryRow(limiter=row.pop("group"), **row, held=held, ceiling=ceiling, reason=reason)
