"""An operator opens the admin while tasks hold every slot and others wait.

Real PostgreSQL limiter on the test database, threads holding and waiting, a parked
task, admission counters written with the backend's statement, events recorded by
the recorder; Chromium drives the live server. Full-page screenshots of every page go
to ``test-artifacts/screenshots/<test>/``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support.django_fixtures import SECRET_ARGUMENT, TASK, Scenario

pytestmark = pytest.mark.django_db(transaction=True)
#: A list shows a task's name by its last part (the whole name is its tooltip).
SHORT_TASK = TASK.rpartition(".")[2]


def _login(page: Any, base_url: str) -> None:
    from django.contrib.auth.models import User

    User.objects.create_superuser("operator", "operator@example.com", "operator-pw")
    page.goto(f"{base_url}/admin/login/?next=/admin/")
    page.fill("#id_username", "operator")
    page.fill("#id_password", "operator-pw")
    page.click("input[type=submit]")
    page.wait_for_url(f"{base_url}/admin/")


def _shoot(page: Any, folder: Path, name: str) -> None:
    path = folder / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    assert path.stat().st_size > 0


def _cells(page: Any, text: str) -> dict[str, str]:
    """The cells of the changelist row containing ``text``, by field (``field-<name>``)."""
    row = page.locator("#result_list tbody tr", has_text=text).first
    cells = {}
    for cell in row.locator(":scope > td, :scope > th").all():
        classes = (cell.get_attribute("class") or "").split()
        for name in classes:
            if name.startswith("field-"):
                cells[name.removeprefix("field-")] = " ".join(cell.inner_text().split())
    return cells


def test_an_operator_sees_who_holds_the_slots_what_waits_and_deferrals_apart_from_failures(
    live_server: Any, scenario: Scenario, chromium: Any, screenshot_dir: Path
) -> None:
    from playwright.sync_api import expect

    base = live_server.url
    context = chromium.new_context(viewport={"width": 1600, "height": 900})
    page = context.new_page()
    try:
        _login(page, base)

        # The index lists every page of the app, the dashboard included.
        app = page.locator("#content-main .app-runcell_django")
        titles = (
            "Dashboard",
            "Events",
            "Leases",
            "Limiters",
            "Queued requests",
            "Admission counts",
        )
        for title in titles:
            expect(app.get_by_role("link", name=title, exact=True)).to_be_visible()
        _shoot(page, screenshot_dir, "01-index")

        # Limiters: every slot of claude is held, three requests wait, a fourth is parked.
        page.goto(f"{base}/admin/runcell_django/limiter/")
        claude = _cells(page, "claude")
        assert "3/3" in claude["occupancy"]
        assert claude["queued"].startswith("4")
        assert claude["settings_status"] == "same as RUNCELL"
        expect(page.locator("svg[aria-label='background: 2/2 slots held']")).to_be_visible()
        _shoot(page, screenshot_dir, "02-limiters")

        # Leases: the holders' task ids, their task name, host and process.
        page.goto(f"{base}/admin/runcell_django/lease/")
        for task_id, workload in scenario.holder_task_ids.items():
            cells = _cells(page, task_id)
            assert cells["limiter_workload"] == f"claude / {workload}"
            assert cells["task"] == f"{SHORT_TASK} {task_id}"
            assert "pid" in cells["holder"]
        expect(page.locator("#result_list tbody tr")).to_have_count(3)
        _shoot(page, screenshot_dir, "03-leases")

        # The filter by workload narrows the list.
        page.get_by_role("link", name="interactive", exact=True).first.click()
        expect(page.locator("#result_list tbody tr")).to_have_count(1)

        # Queue: the waiters in order, and the parked task without its arguments.
        page.goto(f"{base}/admin/runcell_django/queueentry/")
        expect(page.locator("#result_list tbody tr")).to_have_count(4)
        first, second = scenario.waiter_task_ids[:2]
        assert _cells(page, first)["place"] == "#1"
        assert _cells(page, second)["place"] == "#2"
        assert _cells(page, scenario.parked_task_id)["state"] == "parked"
        assert SECRET_ARGUMENT not in page.content()
        _shoot(page, screenshot_dir, "04-queue")

        # Events: filter by type, search by a task id, open one and read every field.
        page.goto(f"{base}/admin/runcell_django/concurrencyevent/")
        page.locator("#changelist-filter").get_by_role("link", name="acquired").click()
        holder = next(iter(scenario.holder_task_ids))
        page.fill("#searchbar", holder)
        page.press("#searchbar", "Enter")
        expect(page.locator("#result_list tbody tr")).to_have_count(1)
        _shoot(page, screenshot_dir, "05-events")
        page.locator("#result_list tbody tr a").first.click()
        for field in ("type", "occurred", "workload", "root_run_id", "request_id", "lease_id"):
            expect(page.locator(f".field-{field} label")).to_be_visible()
        expect(page.locator(".field-run_id .readonly")).to_have_text(holder)
        _shoot(page, screenshot_dir, "06-event-detail")

        # Admission: deferrals in their own column, apart from failures.
        page.goto(f"{base}/admin/runcell_django/admissioncount/")
        counts = _cells(page, TASK)
        assert counts["deferrals"] == "4"
        assert counts["provider_failures"] == "1"
        assert counts["concurrency_failures"] == "0"
        expect(page.locator(".runcell-admission-help")).to_contain_text("not a failure")
        _shoot(page, screenshot_dir, "07-admission")

        # Dashboard: charts drawn on the server, the page refreshes itself.
        page.goto(f"{base}/admin/runcell_django/dashboard/")
        panel = page.locator("#limiter-claude")
        expect(panel.locator(".runcell-held")).to_have_text("3")
        expect(panel.locator(".runcell-queued")).to_have_text("4")
        expect(panel.locator("figure > svg")).to_have_count(4)  # held, queued, waits, failures
        assert page.locator("meta[http-equiv=refresh]").count() == 1
        _shoot(page, screenshot_dir, "08-dashboard")

        # Force release: select a holder's lease, confirm, and its slot goes to a waiter.
        page.goto(f"{base}/admin/runcell_django/lease/?workload=interactive")
        page.locator("#result_list tbody input[type=checkbox]").first.check()
        page.select_option("select[name=action]", "force_release")
        page.click("button[name=index]")
        expect(page.get_by_role("heading", name="Force-release leases?")).to_be_visible()
        _shoot(page, screenshot_dir, "09-force-release-confirmation")
        page.get_by_role("button", name="Yes, release them").click()
        expect(page.locator(".messagelist")).to_contain_text("Released 1 lease")
        # The interactive waiter took the slot, with a newer fencing token.
        waiter = next(t for t in scenario.waiter_task_ids if t.startswith("wait-int"))
        assert _cells(page, waiter)["fencing_token"] == "4"
        _shoot(page, screenshot_dir, "10-force-released")
    finally:
        context.close()
