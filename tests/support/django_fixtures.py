"""Fixtures shared by tests/django and tests/browser: the test database, real limiters on
it, a scenario with holders, waiters, a parked task and counters, and logged-in clients.

Limiters write through their own connections (committed at once), so the ORM sees
their rows from inside a ``db`` test's transaction; nothing is mocked.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import psycopg
import pytest
from psycopg_pool import ConnectionPool

from runcell_celery import AcquireRequest, RunLineage, add_event_listener, remove_event_listener
from runcell_celery import run as run_context
from runcell_celery import slot as take_slot
from runcell_celery.ports import Parked
from runcell_celery.postgres import (
    PostgresConcurrencyLimiter,
    create_postgres_concurrency_limiter,
    statements,
)
from runcell_celery.protocol import Member
from tests.conftest import wait_until
from tests.support.pg import ADMIN_DSN

TASK = "app.tasks.summarize"
#: Appears only in a parked task's message (runcell_queue.payload): no page may show it.
SECRET_ARGUMENT = "SECRET-PROMPT-do-not-show"

_RUNCELL_TABLES = (
    "runcell_lease",
    "runcell_queue",
    "runcell_limiter",
    "runcell_admission_counter",
    "runcell_run",
    "runcell_event",
    "runcell_occupancy",
)


@pytest.fixture(scope="session")
def django_db_setup(django_db_setup: None, django_db_blocker: Any) -> Iterator[None]:
    """pytest-django's test database; at the end, end the sessions threads left open
    (limiter pools, recorder threads) so that it can be dropped."""
    from django.db import connection

    name = connection.settings_dict["NAME"]
    yield
    with psycopg.connect(ADMIN_DSN, autocommit=True) as conn:
        conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = %s AND pid <> pg_backend_pid()",
            (name,),
        )


@pytest.fixture(scope="session")
def test_dsn(django_db_setup: None) -> str:
    """The DSN of pytest-django's test database (what ``RUNCELL["DATABASE"]`` resolves to)."""
    from runcell_django import conf

    return conf.resolve_database("default")


@pytest.fixture(autouse=True)
def runcell_cleanup(request: pytest.FixtureRequest) -> None:
    """Start every test with no limiter state and a fresh registry.

    Done before the test (not after): a ``db`` test's transaction is still open at
    teardown, and emptying tables it wrote to would wait for it.
    """
    if request.node.get_closest_marker("django_db") is None and not any(
        name in request.fixturenames
        for name in ("db", "transactional_db", "live_server", "test_dsn")
    ):
        return
    dsn = request.getfixturevalue("test_dsn")
    from runcell_django import conf

    conf.reset()
    with psycopg.connect(dsn, autocommit=True) as conn:
        for table in _RUNCELL_TABLES:
            conn.execute(psycopg.sql.SQL("DELETE FROM {}").format(psycopg.sql.Identifier(table)))


@pytest.fixture
def pg_limiter(test_dsn: str) -> Iterator[Callable[..., PostgresConcurrencyLimiter]]:
    """Create real PostgreSQL limiters on the test database (their pool is closed after)."""
    pool: ConnectionPool[Any] = ConnectionPool(
        test_dsn,
        min_size=1,
        max_size=12,
        kwargs={"autocommit": True, "prepare_threshold": None},
        open=True,
    )

    def make(**options: Any) -> PostgresConcurrencyLimiter:
        options.setdefault("name", f"lim-{uuid.uuid4().hex[:8]}")
        options.setdefault("poll_interval_ms", 20)
        options.setdefault("listen", False)
        return create_postgres_concurrency_limiter(pool, **options)

    try:
        yield make
    finally:
        pool.close()


def add_admission_counts(dsn: str, task: str, limiter: str, **counts: int) -> None:
    """Add to a task's admission counters with the backend's own statement."""
    fields = ("deliveries", "deferrals", "provider_attempts", "provider_failures")
    params: dict[str, Any] = {
        "task_names": [task],
        "limiters": [limiter],
        "batch_id": None,  # not a retried batch: added as it is
        **{name: [counts.get(name, 0)] for name in (*fields, "concurrency_failures")},
    }
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(statements.ADD_ADMISSION_COUNTS, params)


@dataclass
class Scenario:
    """Slots held by tasks, requests waiting, one task parked, admission counts.

    ``claude`` (max 3, interactive reserved 1, background max 2): two background tasks
    and one interactive task hold the three slots; two background and one interactive
    request wait; one background task is parked with a secret in its message.
    """

    limiter: PostgresConcurrencyLimiter
    recorder: Any
    holder_task_ids: dict[str, str]
    waiter_task_ids: list[str]
    parked_task_id: str
    threads: list[threading.Thread] = field(default_factory=list)
    release: threading.Event = field(default_factory=threading.Event)


def _hold(
    limiter: PostgresConcurrencyLimiter,
    workload: str,
    task_id: str,
    release: threading.Event,
    errors: list[BaseException],
) -> None:
    try:
        with (
            run_context(
                limiter=limiter, workload=workload, run_id=task_id, name=TASK, timeout_ms=120_000
            ),
            take_slot(),
        ):
            release.wait(60)
    except BaseException as exc:  # reported by the fixture
        errors.append(exc)


@pytest.fixture
def scenario(
    pg_limiter: Callable[..., PostgresConcurrencyLimiter], test_dsn: str
) -> Iterator[Scenario]:
    from django.conf import settings

    from runcell_django.recorder import EventRecorder

    limits = dict(settings.RUNCELL["LIMITERS"]["claude"])
    limiter = pg_limiter(name="claude", **limits)
    recorder = EventRecorder(buffer_size=10_000, batch_size=500, sample_interval_ms=10_000)
    add_event_listener(recorder)
    release = threading.Event()
    errors: list[BaseException] = []
    holders = {
        f"task-bg-1-{uuid.uuid4().hex[:6]}": "background",
        f"task-bg-2-{uuid.uuid4().hex[:6]}": "background",
        f"task-int-1-{uuid.uuid4().hex[:6]}": "interactive",
    }
    waiters = {
        f"wait-bg-1-{uuid.uuid4().hex[:6]}": "background",
        f"wait-bg-2-{uuid.uuid4().hex[:6]}": "background",
        f"wait-int-1-{uuid.uuid4().hex[:6]}": "interactive",
    }
    state = Scenario(
        limiter=limiter,
        recorder=recorder,
        holder_task_ids=dict(holders),
        waiter_task_ids=list(waiters),
        parked_task_id=f"parked-{uuid.uuid4().hex[:6]}",
        release=release,
    )

    def present(table: str, run_id: str) -> bool:
        query = psycopg.sql.SQL("SELECT EXISTS (SELECT 1 FROM {} WHERE run_id = %s)")
        with psycopg.connect(test_dsn, autocommit=True) as conn:
            row = conn.execute(query.format(psycopg.sql.Identifier(table)), (run_id,)).fetchone()
        return bool(row and row[0])

    try:
        # One at a time, so that leases and queue places follow the listed order.
        for group, table in ((holders, "runcell_lease"), (waiters, "runcell_queue")):
            for task_id, workload in group.items():
                thread = threading.Thread(
                    target=_hold,
                    args=(limiter, workload, task_id, release, errors),
                    name=f"scenario-{task_id}",
                    daemon=True,
                )
                thread.start()
                state.threads.append(thread)
                wait_until(
                    lambda t=table, r=task_id: present(t, r) or bool(errors),
                    f"{task_id} in {table}",
                )
        assert not errors, errors
        parked = limiter.acquire_or_park(
            [
                Member(
                    limiter,
                    AcquireRequest(
                        request_id=f"req-{state.parked_task_id}",
                        workload="background",
                        lineage=RunLineage(state.parked_task_id, state.parked_task_id),
                        timeout_ms=600_000,
                        holder_name=TASK,
                    ),
                )
            ],
            admission_wait_ms=0,
            payload=json.dumps({"args": [SECRET_ARGUMENT], "kwargs": {}}),
        )
        assert isinstance(parked, Parked)
        add_admission_counts(
            test_dsn,
            TASK,
            "claude",
            deliveries=9,
            deferrals=4,
            provider_attempts=5,
            provider_failures=1,
            concurrency_failures=0,
        )
        recorder.flush()
        recorder.sample_occupancy()
        yield state
    finally:
        release.set()
        for thread in state.threads:
            thread.join(30)
        remove_event_listener(recorder)


@pytest.fixture
def admin_client_for(db: None) -> Callable[..., Any]:
    """``admin_client_for(*perms, staff=True)``: a test client logged in as a new user
    with exactly these permissions (``"view_lease"``, ``"force_release_lease"``...)."""
    from django.contrib.auth.models import Permission, User
    from django.test import Client

    def make(*perms: str, staff: bool = True, superuser: bool = False) -> Client:
        user = User.objects.create_user(
            username=f"user-{uuid.uuid4().hex[:8]}",
            password="pw",
            is_staff=staff,
            is_superuser=superuser,
        )
        if perms:
            user.user_permissions.set(
                Permission.objects.filter(
                    content_type__app_label="runcell_django", codename__in=perms
                )
            )
        client = Client()
        client.force_login(user)
        return client

    return make
