"""Failures in plain sight, at laptop width (1280x800), in Chromium on the live admin.

A real run on a PostgreSQL limiter (one slot, one queue place) fails two ways — slot
requests that time out and one refused by the full queue — and the recorder writes
their events: the dashboard's failures chart draws both kinds (a line each, read from
the SVG) with their counts in its legend, and fits the viewport. Messages published
into a real Redis queue show on the queue page as the broker's backlog, beside the
database's queue. Screenshots go to ``test-artifacts/screenshots/<test>/``.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from django.test import override_settings

from runcell_celery import add_event_listener, remove_event_listener
from runcell_celery.postgres import PostgresConcurrencyLimiter
from runcell_django import backlog
from runcell_django.recorder import EventRecorder
from tests.django.test_broker_backlog import REDIS_URL, publish
from tests.django.test_dashboard_failures import fail_two_ways

pytestmark = pytest.mark.django_db(transaction=True)

WIDTH, HEIGHT = 1280, 800
ADMIN = "/admin/runcell_django"


@pytest.fixture
def page(live_server: Any, chromium: Any) -> Iterator[Any]:
    """A logged-in superuser's page, 1280x800."""
    from django.contrib.auth.models import User

    User.objects.create_superuser("operator", "operator@example.com", "operator-pw")
    context = chromium.new_context(viewport={"width": WIDTH, "height": HEIGHT})
    page = context.new_page()
    try:
        page.goto(f"{live_server.url}/admin/login/?next=/admin/")
        page.fill("#id_username", "operator")
        page.fill("#id_password", "operator-pw")
        page.click("input[type=submit]")
        page.wait_for_url(f"{live_server.url}/admin/")
        yield page
    finally:
        context.close()


def _on_screen(page: Any, selector: str) -> None:
    box = page.locator(selector).bounding_box()
    assert box is not None, selector
    assert box["x"] >= 0
    assert box["x"] + box["width"] <= WIDTH, (selector, box)
    scroll = page.evaluate("document.documentElement.scrollWidth")
    assert scroll <= WIDTH, f"the page scrolls sideways: {scroll} px wide"


def test_the_dashboard_failures_chart_shows_timeouts_and_a_full_queue_from_a_real_run(
    page: Any,
    live_server: Any,
    pg_limiter: Callable[..., PostgresConcurrencyLimiter],
    screenshot_dir: Path,
) -> None:
    recorder = EventRecorder(buffer_size=1_000, batch_size=100)
    add_event_listener(recorder)
    limiter = pg_limiter(
        name="claude",
        max_concurrent=1,
        max_queued=1,
        workloads={"background": {"max_wait_ms": 300}},
    )
    try:
        fail_two_ways(limiter, timeouts=2)
    finally:
        remove_event_listener(recorder)
    recorder.flush()

    page.goto(f"{live_server.url}{ADMIN}/dashboard/")
    chart = "#failures-claude"
    page.locator(chart).scroll_into_view_if_needed()
    page.screenshot(path=str(screenshot_dir / "dashboard.png"), full_page=True)
    page.locator(chart).screenshot(path=str(screenshot_dir / "failures-chart.png"))
    legend = {
        label: page.locator(f'{chart} [data-legend="{label}"]').inner_text().strip()
        for label in ("timeout", "queue full", "limiter error", "config error", "lease lost")
    }
    assert legend == {
        "timeout": "timeout: 2",
        "queue full": "queue full: 1",
        "limiter error": "limiter error: 0",
        "config error": "config error: 0",
        "lease lost": "lease lost: 0",
    }
    drawn = page.eval_on_selector_all(
        f"{chart} > svg g[data-line]",
        "groups => groups.map(g => [g.dataset.line, g.querySelector('path').getAttribute('d'),"
        " g.querySelectorAll('circle').length])",
    )
    assert [label for label, _d, _dots in drawn] == ["timeout", "queue full"]
    for label, path, dots in drawn:
        assert path.startswith("M"), (label, path)
        assert dots >= 1, label
    # Each series is drawn where the browser can see it: inside the chart's plot.
    for label in ("timeout", "queue full"):
        line = page.locator(f'{chart} g[data-line="{label}"] path').bounding_box()
        svg = page.locator(f"{chart} > svg").bounding_box()
        assert line is not None
        assert svg is not None
        assert svg["x"] <= line["x"] <= line["x"] + line["width"] <= svg["x"] + svg["width"]
    _on_screen(page, chart)
    assert page.locator(".runcell-failed").first.inner_text() == "3"


def test_the_queue_page_shows_the_broker_backlog_of_messages_published_into_redis(
    page: Any, live_server: Any, screenshot_dir: Path
) -> None:
    from django.conf import settings

    queue = f"runcell-backlog-browser-{uuid.uuid4().hex[:8]}"
    backlog.forget_cached()
    publish(REDIS_URL, queue, 6, priorities=(0, 9))
    runcell = {**settings.RUNCELL, "BROKER": {"URL": REDIS_URL, "QUEUES": [queue]}}
    try:
        with override_settings(RUNCELL=runcell):
            page.goto(f"{live_server.url}{ADMIN}/queueentry/")
            page.screenshot(path=str(screenshot_dir / "queue-page.png"), full_page=True)
            section = ".runcell-broker-backlog"
            assert page.locator(section).get_attribute("data-available") == "true"
            cells = page.locator(f'{section} tr[data-queue="{queue}"] .backlog-messages')
            assert cells.inner_text().strip() == "6"
            assert "Broker backlog" in page.locator(f"{section} h2").inner_text()
            _on_screen(page, section)
    finally:
        backlog.forget_cached()
        client = redis.Redis.from_url(REDIS_URL)
        keys = list(client.scan_iter(f"{queue}*"))
        if keys:
            client.delete(*keys)
