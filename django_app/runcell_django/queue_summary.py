"""The queue page's summary: per limiter and workload, how many wait, how long, and why.

A medium demo run queues thousands of near-identical rows; the summary above them says
in a few lines what an operator asks first. Two queries whatever the number of rows:
the counts over the page's filtered rows (grouped in the database), and the stored
limits and live counts of the limiters they wait on. A keyed limiter's keys are
summed under it (a fleet may have 100,000): each key has its own limit, so there is
no one reason to give for them.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

from django.db.models import Count, DurationField, ExpressionWrapper, F, Max, Q, QuerySet
from django.db.models.functions import Coalesce, Now
from django.utils.translation import gettext as _
from django.utils.translation import ngettext

from .models import Limiter
from .state import format_duration
from .waiting import Reason, counts, why_it_waits

__all__ = ["SummaryRow", "queue_summary"]


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
            oldest=Max(
                ExpressionWrapper(Now() - F("enqueued_at"), output_field=DurationField()),
                filter=not_granted,
            ),
            keys=Count("limiter", distinct=True, filter=Q(limiter__parent__isnull=False)),
        )
        .order_by("group", "workload")
    )
    rows = list(groups)
    names = {row["group"] for row in rows if not row["keys"]}
    limiters = {
        limiter.name: limiter
        for limiter in Limiter.objects.using(queryset.db).filter(name__in=names)
    }
    return [_row(row, limiters.get(row["group"])) for row in rows]


def _row(row: dict[str, Any], limiter: Limiter | None) -> SummaryRow:
    workload = row["workload"]
    held = ceiling = None
    reason = None
    limits = limiter.limits if limiter is not None else None
    if row["keys"]:
        text = ngettext(
            "%(n)d key waits: each key has its own limit (see the rows)",
            "%(n)d keys wait: each key has its own limit (see the rows)",
            row["keys"],
        ) % {"n": row["keys"]}
        reason = Reason("keys", text)
    elif limiter is not None and limits is not None:
        active = counts(limiter.workloads, limiter.active)
        held = active.get(workload, 0)
        ceiling = limits.ceiling(workload) if workload in limits.workloads else None
        if row["waiting"] or row["parked"]:
            waiting = counts(limiter.workloads, limiter.waiting)
            reason = why_it_waits(limits, active, waiting, workload)
    elif row["waiting"] or row["parked"]:
        reason = Reason("unknown", _("limits not readable"))
    return SummaryRow(
        limiter=row["group"],
        workload=workload,
        waiting=row["waiting"],
        parked=row["parked"],
        granted=row["granted"],
        oldest_wait=row["oldest"],
        held=held,
        ceiling=ceiling,
        reason=reason,
        keys=row["keys"],
    )
