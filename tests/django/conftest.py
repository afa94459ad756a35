"""pytest-django on PostgreSQL for the Django app's tests (settings: ``settings.py``)."""

from __future__ import annotations

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


def pytest_configure(config: pytest.Config) -> None:
    configure_django(config)
