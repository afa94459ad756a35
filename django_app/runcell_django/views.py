"""The dashboard: per limiter, occupancy, queue, waits and failures, as SVG.

Rendered on the server (no JavaScript, nothing from a CDN), refreshed every
``REFRESH_SECONDS``; five queries whatever the number of limiters. Each measure has its
own chart and scale (a limit of 3 beside 200 queued would flatten the held line), the
time axis fits the data or a chosen window, and each line ends at the live figure the
header says "now".

Failures are the events a run stops with, one line per kind; a kind with failures is
drawn over every bucket (a bucket without any reads 0, so a burst stands out), its
legend saying how many failed in the window.
"""

from __future__ import annotations

import datetime
import math
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from django.contrib.admin import ModelAdmin
from django.http import HttpRequest
from django.template.response import TemplateResponse
from django.utils import timezone
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy

from . import sql
from .charts import Chart, line_chart
from .models import ConcurrencyEvent
from .state import LimiterState, format_ms, live_states

#: The longest window the fitted axis looks back over.
WINDOW_MINUTES = 60
#: One point every 15 s: a short run already draws lines, an hour is 240 points.
BUCKET_SECONDS = 15
#: At most this many points per line (longer windows take longer buckets).
MAX_BUCKETS = 240
#: A fitted axis spans at least this long, so that a few points do not fill it.
MIN_FITTED_SECONDS = 60
REFRESH_SECONDS = 15

Series = dict[str, dict[datetime.datetime, float]]


@dataclass(frozen=True, slots=True)
class Window:
    """A choice of time window: ``minutes`` back from now, or fitted to the data."""

    key: str
    label: Any
    minutes: int
    fitted: bool = False

    @property
    def bucket_s(self) -> int:
        return max(BUCKET_SECONDS, -(-self.minutes * 60 // MAX_BUCKETS))


WINDOWS = (
    Window("fit", gettext_lazy("fitted to the data (last hour)"), WINDOW_MINUTES, fitted=True),
    Window("5m", gettext_lazy("5 min"), 5),
    Window("15m", gettext_lazy("15 min"), 15),
    Window("1h", gettext_lazy("1 hour"), 60),
    Window("6h", gettext_lazy("6 hours"), 360),
)


@dataclass(frozen=True, slots=True)
class Panel:
    """One limiter on the dashboard."""

    state: LimiterState
    held: Chart
    queued: Chart
    waits: Chart
    acquired: int
    dropped: int
    #: Runs failed by kind (timeout, queue full, limiter error, config error, lease lost).
    failures: Chart | None = None
    #: How many runs failed in the window, all kinds together.
    failed: int = 0

    @property
    def oldest_wait(self) -> str:
        """The oldest wait now (the last point of the waits chart's longest line)."""
        return format_ms(self.state.oldest_wait_ms) if self.state.oldest_wait_ms else "-"


#: The kinds of failure in the legend's order: event type, label, color.
FAILURE_KINDS = (
    ("timed-out", gettext_lazy("timeout"), "#e6a23c"),
    ("queue-full", gettext_lazy("queue full"), "#ba2121"),
    ("limiter-error", gettext_lazy("limiter error"), "#7b3294"),
    ("config-error", gettext_lazy("config error"), "#264b5d"),
    ("lease-lost", gettext_lazy("lease lost"), "#8c564b"),
)


def _buckets(
    start: datetime.datetime, end: datetime.datetime, bucket_s: int
) -> list[datetime.datetime]:
    """The buckets of the axis as the query aligns them (multiples of ``bucket_s``
    seconds since the epoch), in the time zone of ``end``."""
    first = math.floor(start.timestamp() / bucket_s) * bucket_s
    every = range(first, math.floor(end.timestamp()) + 1, bucket_s)
    moments = [datetime.datetime.fromtimestamp(at, tz=datetime.UTC) for at in every]
    return moments if timezone.is_aware(end) else [timezone.make_naive(m) for m in moments]


def failures_chart(
    per_type: Mapping[str, Mapping[datetime.datetime, float]], **axis: Any
) -> tuple[Chart, int]:
    """One limiter's failures chart over the ``axis``, and its failures in the window."""
    buckets = _buckets(axis["start"], axis["end"], axis["bucket_s"])
    series: dict[str, tuple[str, dict[datetime.datetime, float]]] = {}
    totals: dict[str, int] = {}
    for type_, label, color in FAILURE_KINDS:
        points = {at: n for at, n in per_type.get(type_, {}).items() if at >= buckets[0]}
        totals[str(label)] = int(sum(points.values()))
        series[str(label)] = (color, {at: points.get(at, 0.0) for at in buckets} if points else {})
    per = _("per %(seconds)d s") % {"seconds": axis["bucket_s"]}
    title = _("Runs failed, by kind (%(per)s; legend: in the window)") % {"per": per}
    chart = line_chart(title, series=series, **axis)
    lines = tuple(replace(line, last=str(totals[line.label])) for line in chart.lines)
    empty_text = _("No run failed in this window.") if chart.empty else ""
    return replace(chart, lines=lines, empty_text=empty_text), sum(totals.values())


def dashboard_panels(window: Window = WINDOWS[0]) -> list[Panel]:
    """Build each stored limiter's charts over ``window``."""
    end = timezone.now()
    minutes, bucket_s = window.minutes, window.bucket_s
    events = ConcurrencyEvent.objects
    active: Series = defaultdict(dict)
    queued: Series = defaultdict(dict)
    for limiter, at, most_active, most_queued in events.per_bucket(
        sql.OCCUPANCY_PER_BUCKET, minutes, bucket_s
    ):
        active[limiter][at] = float(most_active)
        queued[limiter][at] = float(most_queued)
    p50: Series = defaultdict(dict)
    p95: Series = defaultdict(dict)
    longest: Series = defaultdict(dict)
    acquired: dict[str, int] = defaultdict(int)
    for limiter, at, median, high, _most, count, most_ms in events.per_bucket(
        sql.WAIT_PER_BUCKET, minutes, bucket_s
    ):
        if count:
            p50[limiter][at] = float(median or 0)
            p95[limiter][at] = float(high or 0)
            acquired[limiter] += int(count)
        if most_ms is not None:
            longest[limiter][at] = float(most_ms)
    failed: dict[str, Series] = defaultdict(lambda: defaultdict(dict))
    for limiter, type_, at, count in events.per_bucket(sql.FAILURES_PER_BUCKET, minutes, bucket_s):
        failed[limiter][type_][at] = float(count)
    dropped = events.dropped_per_limiter(minutes)
    start = end - datetime.timedelta(minutes=minutes)
    if window.fitted:
        # Failures of any kind fit it too (each limiter's are per kind).
        start = _fitted_start(start, end, bucket_s, active, queued, p50, longest, *failed.values())
    axis: dict[str, Any] = {"start": start, "end": end, "bucket_s": bucket_s}
    per = _("per %(seconds)d s") % {"seconds": bucket_s}
    panels = []
    for state in live_states():
        name = state.name
        # Each line ends now, at the live figure the header says.
        held = line_chart(
            _("Slots held against the limit (most %(per)s; last point: now)") % {"per": per},
            series={_("held"): ("#417690", {**active[name], end: float(state.active)})},
            limit=(_("limit"), float(state.limit)) if state.limit and not state.keyed else None,
            **axis,
        )
        waiting = line_chart(
            _("Requests queued: waiting or parked (most %(per)s; last point: now)") % {"per": per},
            series={_("queued"): ("#e6a23c", {**queued[name], end: float(state.queued)})},
            **axis,
        )
        now_longest = {**longest[name], end: float(state.oldest_wait_ms or 0)}
        waits = line_chart(
            _("Wait for a slot (%(per)s; last point: now)") % {"per": per},
            series={
                _("p50 of waits ended"): ("#79aec8", p50[name]),
                _("p95 of waits ended"): ("#264b5d", p95[name]),
                _("longest, waits in progress included"): ("#ba2121", now_longest),
            },
            value_format=format_ms,
            **axis,
        )
        failures = failures_chart(failed.get(name, {}), **axis)
        dropped_here = dropped.get(name, 0)
        panels.append(Panel(state, held, waiting, waits, acquired[name], dropped_here, *failures))
    return panels


def _fitted_start(
    start: datetime.datetime,
    end: datetime.datetime,
    bucket_s: int,
    *series: Mapping[str, Mapping[datetime.datetime, float]],
) -> datetime.datetime:
    """The earliest point of any series (one bucket before it), at least
    :data:`MIN_FITTED_SECONDS` before ``end`` and never before ``start``."""
    points = [at for per_limiter in series for points in per_limiter.values() for at in points]
    if not points:
        return end - datetime.timedelta(seconds=MIN_FITTED_SECONDS)
    earliest = min(points) - datetime.timedelta(seconds=bucket_s)
    return max(start, min(earliest, end - datetime.timedelta(seconds=MIN_FITTED_SECONDS)))


def dashboard_view(request: HttpRequest, model_admin: ModelAdmin[Any]) -> TemplateResponse:
    """Render the dashboard inside the admin (permissions are the caller's to check)."""
    chosen = request.GET.get("window", "")  # the window ?window= names; by default fitted
    window = next((w for w in WINDOWS if w.key == chosen), WINDOWS[0])
    context = {
        **model_admin.admin_site.each_context(request),
        "title": _("Concurrency dashboard"),
        "opts": model_admin.model._meta,
        "panels": dashboard_panels(window),
        "window": window,
        "windows": WINDOWS,
        "refresh_seconds": REFRESH_SECONDS,
        "generated_at": timezone.now(),
    }
    return TemplateResponse(request, "admin/runcell_django/dashboard.html", context)
