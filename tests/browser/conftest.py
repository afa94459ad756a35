"""Browser tests: Playwright driving Debian's Chromium (headless) against the live admin.

Playwright's sync API keeps an event loop running in the main thread while it is
started, and Django refuses database calls from a thread with a running loop unless
``DJANGO_ALLOW_ASYNC_UNSAFE`` is set. So Playwright is started per module here (not
by pytest-playwright's session fixtures, which would keep the loop running for the
rest of the test session), and the variable is set only while it runs.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.django_fixtures import (
    admin_client_for,
    django_db_setup,
    pg_limiter,
    runcell_cleanup,
    scenario,
    test_dsn,
)
from tests.support.django_setup import configure_django

__all__ = [
    "admin_client_for",
    "django_db_setup",
    "pg_limiter",
    "runcell_cleanup",
    "scenario",
    "test_dsn",
]

CHROMIUM = os.environ.get("RUNCELL_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--headless",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
]
#: Kept by CI (.ci/run prints where); never committed (.gitignore).
SCREENSHOTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "screenshots"


def pytest_configure(config: pytest.Config) -> None:
    configure_django(config)


@pytest.fixture(scope="module")
def chromium() -> Iterator[object]:
    """A headless Chromium for this module's tests."""
    if not (Path(CHROMIUM).exists() or shutil.which(CHROMIUM)):
        pytest.fail(f"{CHROMIUM} is missing: install Debian's chromium (scripts/test does)")
    from playwright.sync_api import sync_playwright

    previous = os.environ.get("DJANGO_ALLOW_ASYNC_UNSAFE")
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"
    playwright = sync_playwright().start()
    try:
        browser = playwright.chromium.launch(
            executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True
        )
        try:
            yield browser
        finally:
            browser.close()
    finally:
        playwright.stop()
        if previous is None:
            os.environ.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)
        else:
            os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = previous


@pytest.fixture
def screenshot_dir(request: pytest.FixtureRequest) -> Path:
    """``test-artifacts/screenshots/<test name>/``, emptied for this run of the test."""
    folder = SCREENSHOTS / request.node.name
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    return folder
