"""The demo's dashboard, as a new user sees it while the workload runs.

Runs ``./demo`` (serving, a small workload against a slower provider), logs in with
the login it prints, opens the dashboard URL it prints while the workload is under
way, and saves
``test-artifacts/screenshots/demo-dashboard.png`` (kept by CI, never committed). Then
Ctrl-C stops the demo. Playwright drives Debian's Chromium; nothing is downloaded.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.demo import DemoProcess, demo_environment

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[2]
SCREENSHOT = ROOT / "test-artifacts" / "screenshots" / "demo-dashboard.png"
CHROMIUM = os.environ.get("RUNCELL_CHROMIUM", "/usr/bin/chromium")
ADMIN_LINE = re.compile(r"admin: (?P<url>\S+)\s+login: (?P<user>\S+) / (?P<password>\S+)")


@pytest.fixture
def demo_browser() -> Iterator[Any]:
    """A headless Chromium of this test's own."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=CHROMIUM,
            args=["--no-sandbox", "--headless", "--disable-gpu"],
            headless=True,
        )
        try:
            yield browser
        finally:
            browser.close()


# A whole demo run under a browser (about 30 s): in the stress suite, which CI runs too.
@pytest.mark.stress
def test_dashboard_shows_the_demo_limiter_while_the_workload_runs(demo_browser: Any) -> None:
    with demo_environment() as env:
        # A small workload made slower, so the screenshot catches it under way.
        demo = DemoProcess(["--size", "small", "--latency-ms", "300-600", "--port", "0"], env)
        try:
            match = ADMIN_LINE.search(demo.wait_for_line("admin:"))
            assert match, demo.output
            dashboard_url = demo.wait_for_line("dashboard (live").split()[-1]
            page = demo_browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(f"{match['url']}login/")
            page.fill("#id_username", match["user"])
            page.fill("#id_password", match["password"])
            page.click("input[type=submit]")
            page.wait_for_selector("#user-tools")  # logged in
            demo.wait_for_line("sending the workload")
            time.sleep(3)  # let slots fill up and a few occupancy samples land
            page.goto(dashboard_url)
            page.wait_for_load_state("networkidle")
            SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(SCREENSHOT), full_page=True)
            title = page.title()
            body = page.inner_text("body")
            demo.wait_for_line("admin is up")
            code = demo.interrupt()
        finally:
            demo.kill()
    assert "dashboard" in title.lower()
    assert "provider" in body  # the demo's limiter has its panel
    assert SCREENSHOT.stat().st_size > 10_000
    assert code == 130, demo.output
