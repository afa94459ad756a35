"""Who sees what: nothing for anonymous and non-staff users, model permissions for staff,
no adding, changing or deleting live state, and force release behind its own permission."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from django.test import Client

from runcell_django.models import AdmissionCount, ConcurrencyEvent, Lease, QueueEntry
from tests.support.django_fixtures import Scenario

pytestmark = pytest.mark.django_db

ADMIN = "/admin/runcell_django"

#: Each page and the permission that opens it.
PAGES = {
    f"{ADMIN}/limiter/": "view_limiter",
    f"{ADMIN}/lease/": "view_lease",
    f"{ADMIN}/queueentry/": "view_queueentry",
    f"{ADMIN}/concurrencyevent/": "view_concurrencyevent",
    f"{ADMIN}/admissioncount/": "view_admissioncount",
    f"{ADMIN}/dashboard/": "view_dashboard",
}


def _detail_pages() -> dict[str, str]:
    lease = Lease.objects.get(workload="interactive")
    entry = QueueEntry.objects.get(parked=True)
    event = ConcurrencyEvent.objects.filter(type="acquired").first()
    count = AdmissionCount.objects.get()
    assert event is not None
    return {
        f"{ADMIN}/limiter/claude/change/": "view_limiter",
        f"{ADMIN}/lease/{lease.pk}/change/": "view_lease",
        f"{ADMIN}/queueentry/{entry.pk}/change/": "view_queueentry",
        f"{ADMIN}/concurrencyevent/{event.pk}/change/": "view_concurrencyevent",
        f"{ADMIN}/admissioncount/{count.pk}/change/": "view_admissioncount",
    }


def test_anonymous_users_are_sent_to_the_login_page(client: Client, scenario: Scenario) -> None:
    for url in [*PAGES, *_detail_pages()]:
        response = client.get(url)
        assert response.status_code == 302, url
        assert response["Location"].startswith("/admin/login/"), url


def test_users_who_are_not_staff_see_nothing(
    admin_client_for: Callable[..., Client], scenario: Scenario
) -> None:
    client = admin_client_for(*PAGES.values(), "force_release_lease", staff=False)
    for url in [*PAGES, *_detail_pages()]:
        response = client.get(url)
        assert response.status_code == 302, url
        assert response["Location"].startswith("/admin/login/"), url


@pytest.mark.parametrize("permission", sorted(set(PAGES.values())))
def test_staff_see_only_what_their_permissions_allow(
    admin_client_for: Callable[..., Client], scenario: Scenario, permission: str
) -> None:
    client = admin_client_for(permission)
    for url, needed in [*PAGES.items(), *_detail_pages().items()]:
        expected = 200 if needed == permission else 403
        assert client.get(url).status_code == expected, url
    index = client.get("/admin/").content.decode()
    listed = [url for url in PAGES if f'href="{url}"' in index]
    assert listed == [url for url, needed in PAGES.items() if needed == permission]


def test_staff_without_permissions_see_no_page_of_the_app(
    admin_client_for: Callable[..., Client], scenario: Scenario
) -> None:
    client = admin_client_for()
    for url in [*PAGES, *_detail_pages()]:
        assert client.get(url).status_code == 403, url
    assert client.get(f"{ADMIN}/").status_code == 404  # no app page without a model to show


def test_nobody_adds_changes_or_deletes_live_state_in_the_admin(
    admin_client_for: Callable[..., Client], scenario: Scenario
) -> None:
    client = admin_client_for(superuser=True)
    for url in PAGES:
        if url.endswith("/dashboard/"):
            continue
        assert client.get(f"{url}add/").status_code == 403, url
        assert "delete_selected" not in client.get(url).content.decode(), url
    for url in _detail_pages():
        assert client.post(url, {}).status_code == 403, url
        assert client.get(url.replace("/change/", "/delete/")).status_code == 403, url
    lease = Lease.objects.first()
    assert lease is not None
    client.post(f"{ADMIN}/lease/", {"action": "delete_selected", "_selected_action": [lease.pk]})
    assert Lease.objects.filter(pk=lease.pk).exists()


def test_force_release_is_offered_only_with_its_own_permission(
    admin_client_for: Callable[..., Client], scenario: Scenario
) -> None:
    lease = Lease.objects.get(workload="interactive")
    viewer = admin_client_for("view_lease")
    assert 'value="force_release"' not in viewer.get(f"{ADMIN}/lease/").content.decode()
    response = viewer.post(
        f"{ADMIN}/lease/",
        {"action": "force_release", "_selected_action": [lease.pk], "post": "yes"},
    )
    assert response.status_code in (200, 302)
    assert Lease.objects.filter(pk=lease.pk).exists()
    assert not ConcurrencyEvent.objects.filter(type="force-released").exists()

    operator = admin_client_for("view_lease", "force_release_lease")
    assert 'value="force_release"' in operator.get(f"{ADMIN}/lease/").content.decode()
