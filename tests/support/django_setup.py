"""Django for tests/django and tests/browser only, configured in-process.

``settings.configure`` (not ``DJANGO_SETTINGS_MODULE``): the environment variable
would be inherited by the ``celery worker`` processes other test directories start,
and Celery would then set Django up in them. pytest-django sets Django up from its own
``pytest_configure``, which runs before these directories' conftests are loaded, so
:func:`configure_django` finishes the job it would have done (``django.setup()`` and
blocking database access outside ``django_db`` tests).
"""

from __future__ import annotations

import threading

import pytest

_lock = threading.Lock()


def configure_django(config: pytest.Config) -> None:
    """Configure Django from ``tests/django/settings.py`` (once per test run)."""
    import django
    from django.conf import settings

    with _lock:
        if settings.configured:
            return
        from tests.django import settings as test_settings

        settings.configure(
            **{name: getattr(test_settings, name) for name in dir(test_settings) if name.isupper()}
        )
        django.setup()
    try:
        from pytest_django.plugin import blocking_manager_key
    except ImportError:  # pragma: no cover - a pytest-django without it
        return
    config.stash[blocking_manager_key].block()
