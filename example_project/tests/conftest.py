"""The example project's tests: ``agents.tasks`` under the project's own ``RUNCELL``.

Only fixtures of runcell_celery's pytest plugin (``runcell_*``) and Celery's
(``celery_*``, from ``celery.contrib.pytest``) are used: Celery's ``celery_app`` gets
the project's limits for this test (in memory, or on a throwaway PostgreSQL database
when a test sets ``runcell_backend``), Celery's ``celery_worker`` runs the tasks in
this process, and the fake provider counts the requests it has in flight.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
from django.conf import settings
from django.test import override_settings

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "example_project.settings")


@pytest.fixture
def celery_config(runcell_test_settings: dict[str, Any]) -> dict[str, Any]:
    """Celery's test app (memory broker and results) with the project's limiters."""
    return {
        "runcell": runcell_test_settings,
        # The in-process worker notices it should stop at its next poll of the broker.
        "broker_transport_options": {"polling_interval": 0.05},
    }


@pytest.fixture(scope="session")
def celery_parameters() -> dict[str, Any]:
    # The tests never use Django's database: leave out Celery's Django fixup, which
    # would set Django up in the worker (and start the admin's event recorder).
    return {"fixups": []}


@pytest.fixture(scope="session")
def celery_includes() -> list[str]:
    return ["agents.tasks"]


@pytest.fixture(scope="session")
def celery_worker_pool() -> str:
    return "threads"


@pytest.fixture(scope="session")
def celery_worker_parameters() -> dict[str, Any]:
    # More worker threads than the provider's limit, so the limit is what holds them.
    return {"concurrency": 8, "perform_ping_check": False}


@pytest.fixture
def runcell_provider_options() -> dict[str, Any]:
    # Long enough calls that the tasks overlap and the limit is reached.
    return {"latency_ms": 60}


@pytest.fixture(autouse=True)
def provider_is_the_fake(runcell_provider: Any) -> Iterator[None]:
    """``agents.provider`` calls the test's fake provider (``settings.PROVIDER_URL``)."""
    assert settings.PROVIDER_URL  # the settings module loaded: override_settings wraps it
    with override_settings(PROVIDER_URL=runcell_provider.url):
        yield
