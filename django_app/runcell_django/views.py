"""The dashboard: per-limiter occupancy, queue and wait time, as SVG.

Rendered on the server (no JavaScript, nothing from a CDN) and refreshed by the
browser every ``REFRESH_SECONDS``. Five queries whatever the number of limiters:
live state, occupancy samples, waits per 15 s (finished and in progress), failures
by kind (:mod:`.failures`), drops.

Each measure has its own chart and scale: slots held against the limit (a limit of
3 next to 200 queued requests would flatten the held line onto the limit line), the
queue, the waits, the failures. The time axis fits the data (a one-minute run fills
the chart, not its rightmost 3 %), or a window chosen above the charts. The figures said "now" in
the header and at the end of each line are one reading of the live state, so the
header and the legends agree.
"""

from __future__ import annotations

import datetime
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from django.contrib.admin import ModelAdmin
from django.http import HttpRequest
from django.template.response import TemplateResponse
from django.utils import timezone
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy

from .charts import Chart, line_chart
from .failures import failure_points, failures_chart, failures_per_limiter
from .models import ConcurrencyEvent
from .state import LimiterState, format_ms, live_states

__all__ = [
    "REFRESH_SECONDS",
    "WINDOWS",
    "WINDOW_MINUTES",
    "Panel",
    "Window",
    "dashboard_panels",
    "dashboard_view",
]

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


def window_of(request: HttpRequest) -> Window:
    """The window ``?window=`` names; fitted to the data by default."""
    chosen = request.GET.get("window", "")
    return next((w for w in WINDOWS if w.key == chosen), WINDOWS[0])


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


def dashboard_panels(window: Window = WINDOWS[0]) -> list[Panel]:
    """Build each stored limiter's charts over ``window``."""
    end = timezone.now()
    minutes, bucket_s = window.minutes, window.bucket_s
    events = ConcurrencyEvent.objects
    active: Series = defaultdict(dict)
    queued: Series = defaultdict(dict)
    for limiter, at, most_active, most_queued in events.occupancy_per_bucket(minutes, bucket_s):
        active[limiter][at] = float(most_active)
        queued[limiter][at] = float(most_queued)
    p50: Series = defaultdict(dict)
    p95: Series = defaultdict(dict)
    longest: Series = defaultdict(dict)
    acquired: dict[str, int] = defaultdict(int)
    for limiter, at, median, high, _most, count, most_ms in events.wait_per_bucket(
        minutes, bucket_s
    ):
        if count:
            p50[limiter][at] = float(median or 0)
            p95[limiter][at] = float(high or 0)
            acquired[limiter] += int(count)
        if most_ms is not None:
            longest[limiter][at] = float(most_ms)
    failed = failures_per_limiter(events.failures_per_bucket(minutes, bucket_s))
    dropped = events.dropped_per_limiter(minutes)
    states = live_states()
    start = end - datetime.timedelta(minutes=minutes)
    if window.fitted:
        start = _fitted_start(
            start, end, bucket_s, active, queued, p50, longest, failure_points(failed)
        )
    panels = []
    for state in states:
        name = state.name
        # Each line ends now, at the live figure the header says.
        now_held = {**active[name], end: float(state.active)}
        now_queued = {**queued[name], end: float(state.queued)}
        now_longest = {**longest[name], end: float(state.oldest_wait_ms or 0)}
        per = _("per %(seconds)d s") % {"seconds": bucket_s}
        held_chart = line_chart(
            _("Slots held against the limit (most %(per)s; last point: now)") % {"per": per},
            start=start,
            end=end,
            series={_("held"): ("#417690", now_held)},
            limit=(_("limit"), float(state.limit)) if state.limit and not state.keyed else None,
            bucket_s=bucket_s,
        )
        queued_chart = line_chart(
            _("Requests queued: waiting or parked (most %(per)s; last point: now)") % {"per": per},
            start=start,
            end=end,
            series={_("queued"): ("#e6a23c", now_queued)},
            bucket_s=bucket_s,
        )
        waits = line_chart(
            _("Wait for a slot (%(per)s; last point: now)") % {"per": per},
            start=start,
            end=end,
            series={
                _("p50 of waits ended"): ("#79aec8", p50[name]),
                _("p95 of waits ended"): ("#264b5d", p95[name]),
                _("longest, waits in progress included"): ("#ba2121", now_longest),
            },
            value_format=format_ms,
            bucket_s=bucket_s,
        )
        failures, failed_total = failures_chart(
            failed.get(name, {}), start=start, end=end, bucket_s=bucket_s
        )
        panels.append(
            Panel(
                state=state,
                held=held_chart,
                queued=queued_chart,
                waits=waits,
                acquired=acquired[name],
                dropped=dropped.get(name, 0),
                failures=failures,
                failed=failed_total,
            )
        )
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
    window = window_of(request)
    context = {
        **model_admin.admin_site.each_context(request),
        "title": _("Concurrency dashboard"),
        "opts": model_admin.model._meta,
        "panels": dashboard_panels(window),
        "window": window,
        "windows": WINDOWS,
        "window_minutes": window.minutes,
        "refresh_seconds": REFRESH_SECONDS,
        "generated_at": timezone.now(),
    }
    return TemplateResponse(request, "admin/runcell_django/dashboard.html", context)
