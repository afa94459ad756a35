"""The Django metrics view: who may read it, what it serves, and its settings.

Requests go through Django's test client and the project's middleware (sessions,
authentication) to ``runcell_django.metrics.metrics_view`` mounted at ``/metrics``;
a staff user is a request's user as the authentication middleware would set it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.models import AnonymousUser, User
from django.test import Client, RequestFactory, override_settings

from runcell_celery import ConcurrencyConfigError
from runcell_django import conf
from runcell_django.metrics import metrics_view

from .conftest import TOKEN, Scrape


def mounted(**metrics: Any) -> Any:
    """Settings with the view at ``/metrics`` and ``RUNCELL["METRICS"]`` = ``metrics``
    (limiters in memory: no database)."""
    return override_settings(
        RUNCELL={"METRICS": metrics}, ROOT_URLCONF="tests.metrics.urls", DEBUG=False
    )


@pytest.fixture
def client() -> Client:
    return Client()


def as_user(user: Any, **headers: str) -> Any:
    request = RequestFactory().get("/metrics", headers=headers)
    request.user = user
    return metrics_view(request)


def staff() -> User:
    return User(username="ops", is_staff=True, is_active=True)


def test_a_scrape_bearing_the_token_is_served_the_metrics_text(client: Client) -> None:
    with mounted(TOKEN=TOKEN):
        response = client.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}")
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/plain; version=0.0.4")
    assert "no-cache" in response["Cache-Control"]
    Scrape(response.content.decode())  # parses


def test_an_openmetrics_scraper_gets_openmetrics(client: Client) -> None:
    with mounted(TOKEN=TOKEN):
        response = client.get(
            "/metrics",
            HTTP_AUTHORIZATION=f"Bearer {TOKEN}",
            HTTP_ACCEPT="application/openmetrics-text; version=1.0.0",
        )
    assert response["Content-Type"].startswith("application/openmetrics-text")
    assert response.content.endswith(b"# EOF\n")


def test_a_wrong_or_missing_token_is_refused_with_401(client: Client) -> None:
    with mounted(TOKEN=TOKEN):
        wrong = client.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}x")
        missing = client.get("/metrics")
        basic = client.get("/metrics", HTTP_AUTHORIZATION=f"Basic {TOKEN}")
    for response in (wrong, missing, basic):
        assert response.status_code == 401
        assert response["WWW-Authenticate"].startswith("Bearer")
        assert b"runcell_" not in response.content


def test_without_a_token_setting_only_staff_may_read_it(client: Client) -> None:
    with mounted():
        assert client.get("/metrics").status_code == 403
        # A token is no key when none is configured.
        assert client.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}").status_code == 403
        assert as_user(AnonymousUser()).status_code == 403
        assert as_user(User(username="someone", is_staff=False)).status_code == 403
        assert as_user(staff()).status_code == 200


def test_staff_sessions_can_be_turned_off(client: Client) -> None:
    with mounted(TOKEN=TOKEN, ALLOW_STAFF=False):
        assert as_user(staff()).status_code == 401
        assert as_user(staff(), Authorization=f"Bearer {TOKEN}").status_code == 200


def test_only_get_is_allowed(client: Client) -> None:
    with mounted(TOKEN=TOKEN):
        response = client.post("/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}")
    assert response.status_code == 405


def test_without_a_database_it_serves_this_process_s_event_metrics_and_no_gauges(
    client: Client,
) -> None:
    with mounted(TOKEN=TOKEN):
        got = Scrape(client.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}").content.decode())
    assert "runcell_database_up" not in got.families
    assert "python_info" in got.families  # this process's default registry


def test_the_view_reads_the_workers_multiprocess_directory(client: Client, tmp_path: Path) -> None:
    with mounted(TOKEN=TOKEN, MULTIPROCESS_DIR=str(tmp_path)):
        got = Scrape(client.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}").content.decode())
    assert "python_info" not in got.families  # only what the directory holds (nothing)
    with (
        mounted(TOKEN=TOKEN, MULTIPROCESS_DIR=str(tmp_path / "missing")),
        pytest.raises(ConcurrencyConfigError, match=r"missing'? is invalid: no such directory"),
    ):
        client.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}")


@pytest.mark.parametrize(
    ("metrics", "message"),
    [
        ("token", r'RUNCELL\["METRICS"\] is invalid: a str of 5 characters, must be a dict'),
        (
            {"TOKN": TOKEN},
            r'RUNCELL\["METRICS"\]\["TOKN"\] is invalid: unknown option; did you mean .TOKEN.',
        ),
        (
            {"TOKEN": "tiny-secret"},
            r'RUNCELL\["METRICS"\]\["TOKEN"\] is invalid: 11 characters \(surrounding '
            r"whitespace dropped\) is too short to be secret: must be at least 16",
        ),
        ({"TOKEN": 12345}, r'\["TOKEN"\] is invalid: a number \(int\) is not a token'),
        ({"ALLOW_STAFF": "yes"}, r'\["ALLOW_STAFF"\] = \'yes\' is invalid: must be True or False'),
        ({"CACHE_MS": -1}, r'\["CACHE_MS"\] = -1 is invalid: must be an integer of at least 0'),
        ({"MULTIPROCESS_DIR": 3}, r'\["MULTIPROCESS_DIR"\] = 3 is invalid'),
    ],
)
def test_invalid_metrics_settings_are_refused_naming_the_value(metrics: Any, message: str) -> None:
    with (
        override_settings(RUNCELL={"METRICS": metrics}),
        pytest.raises(ConcurrencyConfigError, match=message) as raised,
    ):
        conf.validate()
    assert "tiny-secret" not in str(raised.value)  # a token is never echoed


def test_valid_metrics_settings_fill_in_defaults() -> None:
    with override_settings(RUNCELL={"METRICS": {"TOKEN": TOKEN}}):
        conf.validate()
        settings = conf.metrics_settings()
    assert settings == conf.MetricsSettings(token=TOKEN)
    assert settings.allow_staff
    assert settings.cache_ms == 1_000
