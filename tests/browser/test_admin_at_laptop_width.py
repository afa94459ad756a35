"""The admin at laptop width (1280x800): what an operator on call needs is on screen.

The scenario's limiter holds every slot, requests wait, a task is parked, admission
counts include failures and the events include an error. Chromium drives the live
server at 1280 px; each check reads where the browser laid a column out (its cells'
right edge within the viewport, so nothing needs horizontal scrolling). Screenshots
go to ``test-artifacts/screenshots/<test>/`` (kept by CI, never committed).
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.utils import timezone

from tests.support.django_fixtures import Scenario

pytestmark = pytest.mark.django_db(transaction=True)

WIDTH, HEIGHT = 1280, 800
#: A long provider error, as a real one reads: the events list shows its start.
ERROR = "RateLimitError: 429 Too Many Requests from api.example.com: retry after 20 s " * 3


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


def _shoot(page: Any, folder: Path, name: str) -> None:
    path = folder / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    assert path.stat().st_size > 0


def _right_edges(page: Any, field: str) -> list[float]:
    """The right edge (px) of every changelist cell of ``field`` and of its header."""
    boxes = page.locator(f"#result_list .column-{field}, #result_list .field-{field}")
    edges = [box["x"] + box["width"] for box in (b.bounding_box() for b in boxes.all()) if box]
    assert edges, f"no column {field}"
    return edges


def _assert_on_screen(page: Any, *fields: str) -> None:
    """Each column ends inside the viewport, and the page does not scroll sideways."""
    for field in fields:
        assert max(_right_edges(page, field)) <= WIDTH, (field, _right_edges(page, field))
    scroll = page.evaluate("document.documentElement.scrollWidth")
    assert scroll <= WIDTH, f"the page scrolls sideways: {scroll} px wide"


def _add_failed_event(scenario: Scenario) -> None:
    from runcell_django.models import ConcurrencyEvent

    ConcurrencyEvent.objects.create(
        type="released",
        occurred_at=timezone.now(),
        limiter="claude",
        limiters=["claude"],
        workload="background",
        holder_name="example_project.tasks.summarize_a_long_document",
        run_id=str(uuid.uuid4()),
        request_id=str(uuid.uuid4()),
        hold_ms=1234.0,
        wait_ms=85_000.0,
        outcome="error",
        error=ERROR,
    )


def test_failure_counts_errors_and_times_fit_at_1280_px(
    page: Any, live_server: Any, scenario: Scenario, screenshot_dir: Path
) -> None:
    from playwright.sync_api import expect

    base = f"{live_server.url}/admin/runcell_django"
    _add_failed_event(scenario)

    page.goto(f"{base}/admissioncount/")
    _shoot(page, screenshot_dir, "01-admission")
    _assert_on_screen(
        page, "task_label", "deferrals", "provider_failures", "concurrency_failures", "last_counted"
    )

    page.goto(f"{base}/concurrencyevent/")
    _shoot(page, screenshot_dir, "02-events")
    _assert_on_screen(page, "occurred", "type", "task", "wait", "hold", "detail")
    detail = page.locator("#result_list .field-detail", has_text="RateLimitError").first
    expect(detail).to_be_visible()
    assert "RateLimitError: 429" in (detail.get_attribute("title") or detail.inner_html())

    page.goto(f"{base}/lease/")
    _shoot(page, screenshot_dir, "03-leases")
    _assert_on_screen(page, "task", "holder", "age", "expires_in", "parked_task")
    # A task id is cut to its start, on one line; the whole id is its tooltip.
    task_id = next(iter(scenario.holder_task_ids))
    short = page.locator(f"#result_list .runcell-id[title='{task_id}']")
    expect(short).to_have_count(1)
    line_height = page.evaluate(
        "e => parseFloat(getComputedStyle(e).lineHeight) || 16", short.element_handle()
    )
    assert short.bounding_box()["height"] <= line_height * 1.5

    page.goto(f"{base}/queueentry/")
    _shoot(page, screenshot_dir, "04-queue")
    _assert_on_screen(page, "place", "why", "waited", "task")

    page.goto(f"{base}/limiter/")
    _shoot(page, screenshot_dir, "05-limiters")
    _assert_on_screen(page, "occupancy", "queued", "oldest_wait", "settings_status")


def test_a_lease_page_shows_times_with_seconds_and_releases_the_lease(
    page: Any, live_server: Any, scenario: Scenario, screenshot_dir: Path
) -> None:
    from playwright.sync_api import expect

    from runcell_django.models import Lease

    lease = Lease.objects.get(workload="interactive")
    page.goto(f"{live_server.url}/admin/runcell_django/lease/{lease.pk}/change/")
    _shoot(page, screenshot_dir, "01-lease")
    for field in ("acquired", "renewed", "expires"):
        text = page.locator(f".field-{field} .readonly").inner_text()
        # "Dec. 1, 2026, 8:13:05 p.m. (in 27.9 s)": hours, minutes and seconds.
        assert re.search(r"\d{1,2}:\d{2}:\d{2}", text), (field, text)
        assert re.search(r"\((in [\d.]+ (ms|s)|[\d.]+ (ms|s) ago)\)", text), (field, text)
    expect(page.locator(".field-run_id .readonly")).to_have_text(lease.run_id)

    page.get_by_role("button", name="Force release…").click()
    expect(page.get_by_role("heading", name="Force-release leases?")).to_be_visible()
    page.get_by_role("button", name="Yes, release them").click()
    expect(page.locator(".messagelist")).to_contain_text("Released 1 lease")
    assert not Lease.objects.filter(pk=lease.pk).exists()


def test_the_dashboard_draws_held_on_its_own_scale_above_the_limit_and_agrees_with_its_header(
    page: Any, live_server: Any, scenario: Scenario, screenshot_dir: Path
) -> None:
    page.goto(f"{live_server.url}/admin/runcell_django/dashboard/")
    _shoot(page, screenshot_dir, "01-dashboard")
    panel = page.locator("#limiter-claude")
    held = panel.locator("figure[data-chart=held] > svg")
    # Every slot is held: the held line ends on the limit line, drawn over it, in the
    # top part of its own scale (not squashed under the queue's).
    limit_y = float(held.locator("g[data-line=limit] path").get_attribute("d").split()[1])
    last = held.locator("g[data-line=held] circle").last
    held_x, held_y = float(last.get_attribute("cx")), float(last.get_attribute("cy"))
    assert held_y == pytest.approx(limit_y, abs=0.5)
    assert held_y < 180 * 0.4, "the held line is low on its chart: not its own scale"
    box = held.bounding_box()
    scale = box["width"] / 560
    on_top = page.evaluate(
        "([x, y]) => document.elementFromPoint(x, y).closest('g[data-line]').dataset.line",
        [box["x"] + held_x * scale, box["y"] + held_y * scale],
    )
    assert on_top == "held"
    # The header and the legends say the same figures.
    queued_now = panel.locator(".runcell-queued").inner_text()
    legend = panel.locator("figure[data-chart=queued] [data-legend=queued] .runcell-legend-value")
    assert legend.inner_text() == queued_now == "4"
    held_legend = panel.locator("figure[data-chart=held] [data-legend=held] .runcell-legend-value")
    assert held_legend.inner_text() == panel.locator(".runcell-held").inner_text() == "3"
    _assert_on_screen_page(page)


def _assert_on_screen_page(page: Any) -> None:
    scroll = page.evaluate("document.documentElement.scrollWidth")
    assert scroll <= WIDTH, f"the page scrolls sideways: {scroll} px wide"
