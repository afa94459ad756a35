"""The dashboard's failures chart: runs that failed per time bucket, one line per kind.

A failure is one of the events a run stops with (``timed-out``, ``queue-full``,
``limiter-error``, ``config-error``, ``lease-lost``), whether a slot request emitted it
or a task that stopped before asking for one (its headers, its limiter, its first
start). Read in one query for every limiter (:data:`runcell_django.sql.FAILURES_PER_BUCKET`).

A kind with failures in the window is drawn over every bucket of the axis (a bucket
without any reads 0, so a burst stands out from the line); its legend says how many
failed in the window. A kind without any is in the legend at 0 and not drawn.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
from collections import defaultdict
from collections.abc import Iterable

from django.utils import timezone
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy

from .charts import Chart, line_chart

__all__ = [
    "FAILURE_KINDS",
    "FailureKind",
    "Failures",
    "failure_points",
    "failures_chart",
    "failures_per_limiter",
]


@dataclasses.dataclass(frozen=True, slots=True)
class FailureKind:
    type: str
    label: object
    color: str


#: The kinds in the legend's order, each with its event type and color.
FAILURE_KINDS = (
    FailureKind("timed-out", gettext_lazy("timeout"), "#e6a23c"),
    FailureKind("queue-full", gettext_lazy("queue full"), "#ba2121"),
    FailureKind("limiter-error", gettext_lazy("limiter error"), "#7b3294"),
    FailureKind("config-error", gettext_lazy("config error"), "#264b5d"),
    FailureKind("lease-lost", gettext_lazy("lease lost"), "#8c564b"),
)

#: Per limiter, per event type: failures per bucket.
Failures = dict[str, dict[str, dict[datetime.datetime, float]]]


def failures_per_limiter(rows: Iterable[tuple[object, ...]]) -> Failures:
    """Group ``(limiter, type, bucket, count)`` rows by limiter and type."""
    found: Failures = defaultdict(lambda: defaultdict(dict))
    for limiter, type_, bucket, count in rows:
        assert isinstance(bucket, datetime.datetime)
        found[str(limiter)][str(type_)][bucket] = float(count)  # type: ignore[arg-type]
    return found


def failure_points(failures: Failures) -> dict[str, dict[datetime.datetime, float]]:
    """Per limiter, every bucket with a failure of any kind (to fit the time axis)."""
    return {
        limiter: {at: n for points in per_type.values() for at, n in points.items()}
        for limiter, per_type in failures.items()
    }


def _buckets(
    start: datetime.datetime, end: datetime.datetime, bucket_s: int
) -> list[datetime.datetime]:
    """The buckets of the axis, as the query aligns them (multiples of ``bucket_s``
    seconds since the epoch), in the time zone of ``end``."""
    first = math.floor(start.timestamp() / bucket_s) * bucket_s
    last = end.timestamp()
    aware = timezone.is_aware(end)
    buckets = []
    at = first
    while at <= last:
        moment = datetime.datetime.fromtimestamp(at, tz=datetime.UTC)
        buckets.append(moment if aware else timezone.make_naive(moment))
        at += bucket_s
    return buckets


def failures_chart(
    per_type: dict[str, dict[datetime.datetime, float]],
    *,
    start: datetime.datetime,
    end: datetime.datetime,
    bucket_s: int,
) -> tuple[Chart, int]:
    """One limiter's failures chart over ``start..end``, and its failures in the window."""
    buckets = _buckets(start, end, bucket_s)
    series: dict[str, tuple[str, dict[datetime.datetime, float]]] = {}
    totals: dict[str, int] = {}
    for kind in FAILURE_KINDS:
        points = {at: n for at, n in per_type.get(kind.type, {}).items() if at >= buckets[0]}
        label = str(kind.label)
        totals[label] = int(sum(points.values()))
        series[label] = (kind.color, {at: points.get(at, 0.0) for at in buckets} if points else {})
    per = _("per %(seconds)d s") % {"seconds": bucket_s}
    chart = line_chart(
        _("Runs failed, by kind (%(per)s; legend: in the window)") % {"per": per},
        start=start,
        end=end,
        series=series,
        bucket_s=bucket_s,
    )
    lines = tuple(dataclasses.replace(line, last=str(totals[line.label])) for line in chart.lines)
    chart = dataclasses.replace(
        chart, lines=lines, empty_text=_("No run failed in this window.") if chart.empty else ""
    )
    return chart, sum(totals.values())
