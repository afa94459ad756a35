"""The dashboard: per-limiter occupancy and wait time over the last hour, as SVG.

Rendered on the server (no JavaScript, nothing from a CDN) and refreshed by the
browser every ``REFRESH_SECONDS``. Four queries whatever the number of limiters:
live state, occupancy samples and waits of acquired slots per 15 s, drops.
"""

from __future__ import annotations

import datetime
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from django.contrib.admin import ModelAdmin
from django.http import HttpRequest
from django.template.response import TemplateResponse
from django.utils import timezone
from django.utils.translation import gettext as _

from .charts import Chart, line_chart
from .models import ConcurrencyEvent
from .state import LimiterState, live_states

__all__ = ["REFRESH_SECONDS", "WINDOW_MINUTES", "Panel", "dashboard_panels", "dashboard_view"]

WINDOW_MINUTES = 60
#: One point every 15 s: a short run already draws lines, an hour is 240 points.
BUCKET_SECONDS = 15
REFRESH_SECONDS = 15


@dataclass(frozen=True, slots=True)
class Panel:
    """One limiter on the dashboard."""

    state: LimiterState
    occupancy: Chart
    waits: Chart
    acquired: int
    dropped: int


def dashboard_panels(minutes: int = WINDOW_MINUTES) -> list[Panel]:
    """Build each stored limiter's charts over the last ``minutes``."""
    end = timezone.now()
    start = end - datetime.timedelta(minutes=minutes)
    events = ConcurrencyEvent.objects
    active: dict[str, dict[datetime.datetime, float]] = defaultdict(dict)
    queued: dict[str, dict[datetime.datetime, float]] = defaultdict(dict)
    for limiter, at, most_active, most_queued in events.occupancy_per_bucket(
        minutes, BUCKET_SECONDS
    ):
        active[limiter][at] = float(most_active)
        queued[limiter][at] = float(most_queued)
    p50: dict[str, dict[datetime.datetime, float]] = defaultdict(dict)
    p95: dict[str, dict[datetime.datetime, float]] = defaultdict(dict)
    acquired: dict[str, int] = defaultdict(int)
    for limiter, at, median, high, _most, count in events.wait_per_bucket(minutes, BUCKET_SECONDS):
        p50[limiter][at] = float(median or 0)
        p95[limiter][at] = float(high or 0)
        acquired[limiter] += int(count)
    dropped = events.dropped_per_limiter(minutes)
    panels = []
    for state in live_states():
        name = state.name
        occupancy = line_chart(
            _("Slots held and requests queued (most per 15 s)"),
            start=start,
            end=end,
            series={_("held"): ("#417690", active[name]), _("queued"): ("#e6a23c", queued[name])},
            limit=(_("limit"), float(state.limit)) if state.limit else None,
            bucket_s=BUCKET_SECONDS,
        )
        waits = line_chart(
            _("Wait for a slot (per 15 s)"),
            start=start,
            end=end,
            series={_("p50"): ("#79aec8", p50[name]), _("p95"): ("#264b5d", p95[name])},
            unit="ms",
            bucket_s=BUCKET_SECONDS,
        )
        panels.append(
            Panel(
                state=state,
                occupancy=occupancy,
                waits=waits,
                acquired=acquired[name],
                dropped=dropped.get(name, 0),
            )
        )
    return panels


def dashboard_view(request: HttpRequest, model_admin: ModelAdmin[Any]) -> TemplateResponse:
    """Render the dashboard inside the admin (permissions are the caller's to check)."""
    context = {
        **model_admin.admin_site.each_context(request),
        "title": _("Concurrency dashboard"),
        "opts": model_admin.model._meta,
        "panels": dashboard_panels(),
        "window_minutes": WINDOW_MINUTES,
        "refresh_seconds": REFRESH_SECONDS,
        "generated_at": timezone.now(),
    }
    return TemplateResponse(request, "admin/runcell_django/dashboard.html", context)
