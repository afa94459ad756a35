"""The pytest plugin for projects testing their own tasks under their own limits.

Loaded through the ``pytest11`` entry point ``runcell_celery`` (``-p no:runcell_celery``
turns it off). It defines only fixtures named ``runcell_*`` (docs/testing.md) and one
teardown hook, and imports Django, Celery and psycopg only in the fixtures that need
them, so a test that uses none runs exactly as without it.
"""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, get_args

import pytest

from ..redaction import MaskedDSN, dsn_secrets, mask_dsn, scrub
from .capture import EventCapture
from .databases import SERVER_DSN_ENV, server_dsn, throwaway_database
from .limits import BackendChoice, in_memory, on_postgres
from .server import FakeProvider

if TYPE_CHECKING:
    from celery import Celery

    from ..registry import LimiterRegistry
    from .counters import AdmissionCounts

#: Celery's fixtures that make an app (``celery.contrib.pytest``).
_CELERY_APP_FIXTURES = frozenset({"celery_app", "celery_session_app"})


def _django_runcell() -> Mapping[str, Any] | None:
    """Django's ``settings.RUNCELL`` when a settings module is configured, else ``None``."""
    if not os.environ.get("DJANGO_SETTINGS_MODULE") and "django.conf" not in sys.modules:
        return None
    try:
        from django.conf import settings
    except ImportError:
        return None
    if not settings.configured and not os.environ.get("DJANGO_SETTINGS_MODULE"):
        return None
    value = getattr(settings, "RUNCELL", None)
    return value if isinstance(value, Mapping) else None


@pytest.fixture
def runcell_settings() -> Mapping[str, Any]:
    """The project's ``RUNCELL`` settings: Django's ``settings.RUNCELL`` (only the
    settings module is read); override it to return your ``app.conf.runcell``."""
    found = _django_runcell()
    if found is None:
        pytest.fail(
            "runcell_settings: no settings.RUNCELL to test (DJANGO_SETTINGS_MODULE is not "
            "set, or its settings have no RUNCELL dict); override the runcell_settings "
            "fixture in conftest.py to return your app.conf.runcell",
            pytrace=False,
        )
    return found


@pytest.fixture
def runcell_backend() -> BackendChoice:
    """Where ``runcell_test_settings`` puts the limiters: ``"memory"`` (default) or
    ``"postgres"``; override or parametrize it."""
    return "memory"


@pytest.fixture(scope="session")
def runcell_postgres_server() -> str:
    """The server ``runcell_postgres`` creates databases on (``$RUNCELL_TEST_DSN``, else
    the local one); its ``repr``, which pytest prints, masks the password."""
    return MaskedDSN(server_dsn())


@pytest.fixture
def runcell_postgres(runcell_postgres_server: str) -> Iterator[str]:
    """The DSN of an empty database made for this test and dropped after it.

    A server it cannot reach fails the test in one line, password masked, and without
    a traceback (whose frames would show the DSN).
    """
    import psycopg

    server = runcell_postgres_server
    made = throwaway_database(server)
    failure = None
    try:
        database = made.__enter__()
    except psycopg.Error as exc:
        failure = _unreached(server, "create", exc)
    if failure is not None:  # raised outside the except block: no context to show
        pytest.fail(failure, pytrace=False)
    try:
        yield MaskedDSN(database)
    finally:
        # Backends the test dropped without closing close as they are collected: none
        # keeps retrying a database that is gone.
        gc.collect()
        try:
            made.__exit__(None, None, None)
        except psycopg.Error as exc:
            failure = _unreached(server, "drop", exc)
        if failure is not None:
            pytest.fail(failure, pytrace=False)


def _unreached(server: str, doing: str, error: Exception) -> str:
    reason = scrub(" ".join(str(error).split()), dsn_secrets(server))
    return (
        f"runcell_postgres: could not {doing} a test database on the server "
        f"{mask_dsn(server)!r} (${SERVER_DSN_ENV}): {reason}"
    )


@pytest.fixture
def runcell_test_settings(
    request: pytest.FixtureRequest, runcell_settings: Mapping[str, Any], runcell_backend: str
) -> dict[str, Any]:
    """``runcell_settings``' limiters on ``runcell_backend`` (the database of
    ``runcell_postgres`` for ``"postgres"``), for this test only: give it to Celery as
    ``celery_config["runcell"]``."""
    if runcell_backend == "memory":
        return in_memory(runcell_settings, path="runcell_settings")
    if runcell_backend == "postgres":
        database: str = request.getfixturevalue("runcell_postgres")
        return on_postgres(runcell_settings, database, path="runcell_settings")
    raise ValueError(
        f"runcell_backend = {runcell_backend!r} is invalid: must be one of "
        f"{', '.join(repr(b) for b in get_args(BackendChoice))}"
    )


@pytest.fixture
def runcell_limiters(runcell_test_settings: dict[str, Any]) -> Iterator[LimiterRegistry]:
    """A registry of ``runcell_test_settings``' limiters, for code that takes ``slot()``
    itself; closed after the test. (A Celery app builds its own: ``registry_for(app)``.)"""
    from ..registry import LimiterRegistry

    registry = LimiterRegistry()
    registry.configure(runcell_test_settings, path="runcell_test_settings")
    try:
        yield registry
    finally:
        registry.close()


@pytest.fixture
def runcell_provider_options() -> dict[str, Any]:
    """Keyword arguments of ``runcell_provider``: 20 ms a request by default."""
    return {"latency_ms": 20}


@pytest.fixture
def runcell_provider(runcell_provider_options: dict[str, Any]) -> Iterator[FakeProvider]:
    """A fake LLM provider on a free local port that counts its own in-flight requests,
    the independent witness that a limit held: ``.stats().max_in_flight``."""
    with FakeProvider(**runcell_provider_options) as provider:
        yield provider


@pytest.fixture
def runcell_events() -> Iterator[EventCapture]:
    """The concurrency events emitted in this process during the test (an in-process
    worker's included): ``runcell_events.of("acquired", limiter="claude")``."""
    with EventCapture() as capture:
        yield capture


@pytest.fixture
def runcell_counters(celery_app: Celery) -> AdmissionCounts:
    """Admission counts of ``celery_app``'s tasks counted in this process (where
    ``celery_worker`` runs them): ``runcell_counters.of("app.tasks.summarize")``."""
    from .counters import AdmissionCounts

    return AdmissionCounts(celery_app)


def pytest_fixture_post_finalizer(fixturedef: pytest.FixtureDef[Any]) -> None:
    """After Celery's ``celery_app`` fixture closed its app, forget the integration's
    state for it, or its counter listener would count later tests' events and its
    backend retry a dropped database. Imports nothing unless the integration was."""
    if fixturedef.argname not in _CELERY_APP_FIXTURES:
        return
    state = sys.modules.get("runcell_celery.celery.state")
    cached = fixturedef.cached_result
    if state is None or cached is None or cached[2] is not None:
        return
    state.discard_state(cached[0])
