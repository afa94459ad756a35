"""A keyed limiter's keys in the admin read at 1280 px: names on one line, no sideways
scrolling. Chromium against the live server, with the busy keys of
``tests/django/test_admin_keyed_limiters.py`` and a few long key names; screenshots go
to ``test-artifacts/screenshots/<test>/``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.django.test_admin_keyed_limiters import _make_keys, no_purge, tenant

__all__ = ["no_purge", "tenant"]

pytestmark = pytest.mark.django_db(transaction=True)

LONG_KEYS = ["acme-corporation-eu-west-1", "globex-international-us-east-2", "initech-42"]
WIDTH = 1280
#: A line of the admin's text is about 17 px high; two lines would be 34 or more.
ONE_LINE_PX = 26


def _login(page: Any, base_url: str) -> None:
    from django.contrib.auth.models import User

    User.objects.create_superuser("keys-operator", "ops@example.com", "operator-pw")
    page.goto(f"{base_url}/admin/login/?next=/admin/")
    page.fill("#id_username", "keys-operator")
    page.fill("#id_password", "operator-pw")
    page.click("input[type=submit]")
    page.wait_for_url(f"{base_url}/admin/")


def _fits(page: Any) -> None:
    """Nothing scrolls sideways: not the page, nor the list inside it (the admin puts
    the list in a box that scrolls on its own)."""
    scroll = page.evaluate("document.documentElement.scrollWidth")
    assert scroll <= WIDTH, f"the page is {scroll} px wide at {WIDTH} px"
    hidden = page.evaluate(
        "Array.from(document.querySelectorAll('#changelist .results, fieldset'))"
        ".map(e => e.scrollWidth - e.clientWidth)"
    )
    assert all(extra <= 0 for extra in hidden), f"cut off by {hidden} px at {WIDTH} px"


def _one_line_each(page: Any, selector: str) -> list[str]:
    """The text of each cell ``selector`` finds, each checked to fit on one line, once
    the page has loaded (a click's navigation may have just begun)."""
    page.wait_for_load_state()
    page.locator(selector).first.wait_for()
    cells = page.locator(selector).all()
    assert cells, selector
    names = []
    for cell in cells:
        box = cell.bounding_box()
        assert box is not None, selector
        assert box["height"] <= ONE_LINE_PX, (cell.inner_text(), box)
        names.append(cell.inner_text())
    return names


def test_keys_read_on_one_line_at_1280_px(
    live_server: Any, tenant: Any, test_dsn: str, chromium: Any, screenshot_dir: Path
) -> None:
    _make_keys(test_dsn, "tenant", LONG_KEYS)
    base = live_server.url
    context = chromium.new_context(viewport={"width": WIDTH, "height": 900})
    page = context.new_page()
    try:
        _login(page, base)

        page.goto(f"{base}/admin/runcell_django/limiter/")
        assert _one_line_each(page, "#result_list th.field-name a") == ["claude", "tenant"]
        page.screenshot(path=str(screenshot_dir / "01-limiters.png"), full_page=True)
        _fits(page)

        page.get_by_role("link", name="busiest keys").click()
        page.wait_for_url(f"{base}/admin/runcell_django/limiter/?keys_of=tenant")
        names = _one_line_each(page, "#result_list th.field-name a")
        assert names[:3] == ["tenant:zeta", "tenant:alpha", "tenant:mid"]
        assert {f"tenant:{key}" for key in LONG_KEYS} <= set(names)
        _one_line_each(page, "#result_list td.field-limits .runcell-keys")
        page.screenshot(path=str(screenshot_dir / "02-keys-of-tenant.png"), full_page=True)
        _fits(page)

        page.goto(f"{base}/admin/runcell_django/limiter/tenant/change/")
        keys = _one_line_each(page, ".runcell-busiest-keys td.runcell-key-name a")
        assert keys[:3] == ["zeta", "alpha", "mid"]
        page.screenshot(path=str(screenshot_dir / "03-tenant.png"), full_page=True)
        _fits(page)

        page.get_by_role("link", name="zeta", exact=True).click()
        page.wait_for_url("**/limiter/tenant_3Azeta/change/")
        page.get_by_role("link", name="tenant", exact=True).first.wait_for()
        page.screenshot(path=str(screenshot_dir / "04-key-zeta.png"), full_page=True)
        _fits(page)
    finally:
        context.close()
