"""The pytest plugin for projects testing their own tasks under their own limits.

Installed with the package and loaded by pytest through the ``pytest11`` entry point
``runcell_celery`` (turn it off with ``-p no:runcell_celery``). It only defines
fixtures, all named ``runcell_*``, and one teardown hook; a test that uses none of
them runs exactly as without it. Django, Celery and psycopg are imported by the
fixtures that need them, never when pytest loads the plugin.

Fixtures (README, "Testing your tasks"):

* ``runcell_settings`` — the project's ``RUNCELL`` settings: Django's
  ``settings.RUNCELL`` by default; override it to return your ``app.conf.runcell``.
* ``runcell_backend`` — ``"memory"`` (default) or ``"postgres"``; override or
  parametrize it to run a test on either or both.
* ``runcell_test_settings`` — those limiters on that backend, for this test only:
  put it in Celery's ``celery_config`` as ``"runcell"``.
* ``runcell_postgres`` — the DSN of a database made for this test and dropped after
  it, on the server ``runcell_postgres_server`` names (``$RUNCELL_TEST_DSN``).
* ``runcell_limiters`` — a limiter registry of ``runcell_test_settings``, for code
  that takes ``slot()`` outside Celery.
* ``runcell_provider`` — a fake LLM provider counting its own in-flight requests
  (options from ``runcell_provider_options``).
* ``runcell_events`` — the concurrency events emitted during the test.
* ``runcell_counters`` — admission counts of Celery's ``celery_app``'s tasks.

It composes with Celery's own fixtures (``celery.contrib.pytest``: ``celery_app``,
``celery_worker``, ``celery_config``...). When Celery's ``celery_app`` fixture ends,
the hook below forgets the integration's state for that app (its counter listener,
its backend's pool and listener), so nothing of one test's app outlives it.
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
from .provider import FakeProvider

if TYPE_CHECKING:
    from celery import Celery

    from ..registry import LimiterRegistry
    from .counters import AdmissionCounts

__all__ = [
    "pytest_fixture_post_finalizer",
    "runcell_backend",
    "runcell_counters",
    "runcell_events",
    "runcell_limiters",
    "runcell_postgres",
    "runcell_postgres_server",
    "runcell_provider",
    "runcell_provider_options",
    "runcell_settings",
    "runcell_test_settings",
]

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
    """The project's ``RUNCELL`` settings whose limiters the test runs.

    Django's ``settings.RUNCELL`` when ``DJANGO_SETTINGS_MODULE`` is set (the settings
    module is read; Django's apps need not be loaded). Override this fixture in
    ``conftest.py`` to return your Celery ``app.conf.runcell`` instead.
    """
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
    """Where ``runcell_test_settings`` puts the limiters: ``"memory"`` or ``"postgres"``.

    ``"memory"`` by default (one process: an in-process ``celery_worker``). Return
    ``"postgres"`` to test what only PostgreSQL does (admission deferral parks tasks,
    admission counts stored fleet-wide), or parametrize:
    ``@pytest.mark.parametrize("runcell_backend", ["memory", "postgres"])``.
    """
    return "memory"


@pytest.fixture(scope="session")
def runcell_postgres_server() -> str:
    """A DSN of the PostgreSQL server where ``runcell_postgres`` creates databases:
    ``$RUNCELL_TEST_DSN``, else ``postgresql://postgres@127.0.0.1:5432/postgres``.

    Its ``repr`` (what pytest prints of a fixture's value) masks the password."""
    return MaskedDSN(server_dsn())


@pytest.fixture
def runcell_postgres(runcell_postgres_server: str) -> Iterator[str]:
    """The DSN of an empty database made for this test, dropped after it (its
    connections ended), so leases, queues and counts never leak between tests.

    A server that cannot be reached fails the test with one line naming it, its
    password masked: no traceback, whose frames would show the DSN."""
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
    dsn = MaskedDSN(database)
    try:
        yield dsn
    finally:
        # Backends the test dropped without closing close as they are collected: none
        # keeps retrying a database that is gone (registries and apps close theirs).
        gc.collect()
        try:
            made.__exit__(None, None, None)
        except psycopg.Error as exc:
            failure = _unreached(server, "drop", exc)
        if failure is not None:
            pytest.fail(failure, pytrace=False)


def _unreached(server: str, doing: str, error: Exception) -> str:
    """One line saying the server failed, its password masked, psycopg's text scrubbed
    (a traceback would show the DSN in its frames)."""
    reason = scrub(" ".join(str(error).split()), dsn_secrets(server))
    return (
        f"runcell_postgres: could not {doing} a test database on the server "
        f"{mask_dsn(server)!r} (${SERVER_DSN_ENV}): {reason}"
    )


@pytest.fixture
def runcell_test_settings(
    request: pytest.FixtureRequest,
    runcell_settings: Mapping[str, Any],
    runcell_backend: str,
) -> dict[str, Any]:
    """``runcell_settings``' limiters on ``runcell_backend``, for this test only.

    The limits are the project's; ``DATABASE`` is this test's ``runcell_postgres``
    (made only when the backend is ``"postgres"``). Give it to Celery's app in
    ``celery_config`` (``{"runcell": runcell_test_settings}``).
    """
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
    """The limiters of ``runcell_test_settings``, for code that takes ``slot()``
    itself (``slot(runcell_limiters.get("claude"))``); closed after the test.

    A Celery app configured from the same settings builds its own registry: read
    its limiters with ``runcell_celery.celery.registry_for(celery_app)``.
    """
    from ..registry import LimiterRegistry

    registry = LimiterRegistry()
    registry.configure(runcell_test_settings, path="runcell_test_settings")
    try:
        yield registry
    finally:
        registry.close()


@pytest.fixture
def runcell_provider_options() -> dict[str, Any]:
    """Keyword arguments of the ``runcell_provider``
    (:class:`~runcell_celery.testing.FakeProvider`): 20 ms a request by default."""
    return {"latency_ms": 20}


@pytest.fixture
def runcell_provider(runcell_provider_options: dict[str, Any]) -> Iterator[FakeProvider]:
    """A fake LLM provider on a free local port, stopped after the test.

    It counts the requests it has in flight, the independent witness that a limit
    held: ``runcell_provider.stats().max_in_flight``. Point your client at
    ``runcell_provider.url``.
    """
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
    """Admission counts of Celery's ``celery_app``'s tasks, counted in this process
    (where ``celery_worker`` runs them): ``runcell_counters.of("app.tasks.summarize")``
    gives deliveries, deferrals, provider attempts and failures."""
    from .counters import AdmissionCounts

    return AdmissionCounts(celery_app)


def pytest_fixture_post_finalizer(fixturedef: pytest.FixtureDef[Any]) -> None:
    """After Celery's ``celery_app`` fixture closed its app, forget the integration's
    state for it (:func:`runcell_celery.celery.state.discard_state`).

    Without this, each test's app would leave its counter listener counting later
    tests' events, and a PostgreSQL backend retrying a dropped test database. Does
    nothing (and imports nothing) unless the integration was imported.
    """
    if fixturedef.argname not in _CELERY_APP_FIXTURES:
        return
    state = sys.modules.get("runcell_celery.celery.state")
    cached = fixturedef.cached_result
    if state is None or cached is None or cached[2] is not None:
        return
    state.discard_state(cached[0])
