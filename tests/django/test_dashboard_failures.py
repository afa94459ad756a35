"""The dashboard's failures chart: runs that failed, by kind, from recorded events.

Real slot requests on a PostgreSQL limiter (one slot, one queue place) fail two ways —
timed out, and refused because the queue is full — and the recorder writes their
events; the chart draws one line per kind that failed, says in its legend how many of
each, and fits its time axis to them. A kind that did not fail is in the legend at 0.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
from django.test import Client

from runcell_celery import (
    ConcurrencyQueueFullError,
    ConcurrencyTimeoutError,
    add_event_listener,
    remove_event_listener,
    slot,
)
from runcell_celery.postgres import PostgresConcurrencyLimiter
from runcell_django.recorder import EventRecorder
from runcell_django.views import dashboard_panels
from tests.conftest import wait_until
from tests.django.test_admin_pages import _text

pytestmark = pytest.mark.django_db

ADMIN = "/admin/runcell_django"


def _queued(limiter: PostgresConcurrencyLimiter) -> int:
    return int(limiter.stats().queued)


def fail_two_ways(limiter: PostgresConcurrencyLimiter, *, timeouts: int) -> None:
    """With the only slot held: ``timeouts`` requests time out (each waiting in the one
    queue place), and one request meets the full queue while the first of them waits."""
    errors: list[BaseException] = []

    def wait_for_a_slot() -> None:
        try:
            with slot(limiter):
                pass
        except BaseException as exc:
            errors.append(exc)

    with slot(limiter):
        for attempt in range(timeouts):
            waiter = threading.Thread(target=wait_for_a_slot, name=f"waiter-{attempt}")
            waiter.start()
            wait_until(lambda: _queued(limiter) == 1, "a request waits in the queue", 10)
            if attempt == 0:
                with pytest.raises(ConcurrencyQueueFullError), slot(limiter):
                    pass
            waiter.join(10)
    assert [type(e) for e in errors] == [ConcurrencyTimeoutError] * timeouts


@pytest.fixture
def recorded(pg_limiter: Callable[..., PostgresConcurrencyLimiter]) -> Any:
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
    return limiter


def test_the_failures_chart_draws_timeouts_and_a_full_queue_from_real_slot_requests(
    recorded: PostgresConcurrencyLimiter,
) -> None:
    (panel,) = dashboard_panels()
    assert panel.failures is not None
    lines = {line.label: line for line in panel.failures.lines}
    assert list(lines) == ["timeout", "queue full", "limiter error", "config error", "lease lost"]
    assert {label: line.last for label, line in lines.items()} == {
        "timeout": "2",
        "queue full": "1",
        "limiter error": "0",
        "config error": "0",
        "lease lost": "0",
    }
    drawn = [label for label, line in lines.items() if line.path]
    assert drawn == ["timeout", "queue full"]
    # Its own scale (2 timeouts: not 0-250) and a time axis fitted to the run.
    assert [tick.label for tick in panel.failures.y_ticks][-1] == "2.5"
    assert [tick.label for tick in panel.failures.x_ticks][-1] == "now"
    assert "-15 min" not in [tick.label for tick in panel.failures.x_ticks]
    assert panel.failed == 3
    highest = min(y for _x, y in lines["timeout"].dots)  # SVG: up is a smaller y
    assert highest < min(y for _x, y in lines["queue full"].dots)


def test_the_dashboard_page_shows_the_failures_chart_and_how_many_failed(
    recorded: PostgresConcurrencyLimiter, admin_client_for: Callable[..., Client]
) -> None:
    html = _text(admin_client_for(superuser=True), f"{ADMIN}/dashboard/")
    assert 'id="failures-claude" data-chart="failures"' in html
    assert '<g data-line="timeout">' in html
    assert '<g data-line="queue full">' in html
    assert '<g data-line="lease lost">' not in html
    assert 'class="runcell-failed" style="color:#ba2121">3<' in html


def test_the_failures_chart_says_when_nothing_failed(
    pg_limiter: Callable[..., PostgresConcurrencyLimiter],
) -> None:
    limiter = pg_limiter(name="claude", max_concurrent=1)
    with slot(limiter):
        pass
    (panel,) = dashboard_panels()
    assert panel.failures is not None
    assert panel.failures.empty
    assert panel.failures.empty_text == "No run failed in this window."
    assert panel.failed == 0
