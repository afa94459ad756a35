"""Admin pages stay fast with 100,000 events, 1,000 leases and 1,000 queued requests.

No wall-clock assertions: each page's queries are counted (a bound that does not grow
with the data), and the queries that read the big table are checked to use an index.
The count includes the statements the PostgreSQL backend runs on its own pool (the
limiters' live counts), so the data is committed where both connections see it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any, LiteralString

import psycopg
import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext

from runcell_celery.postgres import PostgresBackend, PostgresConcurrencyLimiter
from runcell_django.models import ConcurrencyEvent
from tests.support.page_queries import page_statements, reads

pytestmark = pytest.mark.django_db

ADMIN = "/admin/runcell_django"
EVENTS = 100_000
LEASES = 1_000
QUEUED = 1_000

SEED = [
    # Events over the last ~2 days, three limiters, two workloads, four types.
    """
    INSERT INTO runcell_event (type, occurred_at, limiter, workload, run_id, root_run_id,
        request_id, holder_name, host, pid, lease_id, fencing_token, wait_ms, hold_ms, outcome)
    SELECT (ARRAY['wait-started', 'acquired', 'released', 'timed-out'])[1 + g %% 4],
           clock_timestamp() - g * interval '1.7 second',
           (ARRAY['claude', 'gpt', 'gemini'])[1 + g %% 3],
           (ARRAY['interactive', 'background'])[1 + g %% 2],
           'task-' || g / 4, 'root-' || g / 40, 'req-' || g, 'app.tasks.t' || g %% 20,
           'host-' || g %% 5, 1000 + g %% 50, md5(g::text), g, (g %% 997)::float8,
           (g %% 5003)::float8, 'success'
    FROM generate_series(1, %(events)s) AS g
    """,
    """
    INSERT INTO runcell_lease (limiter, workload, request_id, fencing_token, run_id,
        root_run_id, holder_name, holder_host, holder_pid, ttl_ms, acquired_at, renewed_at,
        expires_at)
    SELECT (ARRAY['claude', 'gpt'])[1 + g %% 2], (ARRAY['interactive', 'background'])[1 + g %% 2],
           'lease-req-' || g, g, 'held-task-' || g, 'root-' || g / 10, 'app.tasks.t' || g %% 20,
           'host-' || g %% 5, 2000 + g, 30000, clock_timestamp() - g * interval '1 second',
           clock_timestamp(), clock_timestamp() + interval '30 seconds'
    FROM generate_series(1, %(leases)s) AS g
    """,
    """
    INSERT INTO runcell_queue (request_id, limiter, workload, run_id, root_run_id, holder_name,
        holder_host, holder_pid, enqueued_at, deadline, expires_at, parked, payload)
    SELECT 'queued-req-' || g, (ARRAY['claude', 'gpt'])[1 + g %% 2],
           (ARRAY['interactive', 'background'])[1 + g %% 2], 'queued-task-' || g,
           'queued-task-' || g, 'app.tasks.t' || g %% 20, 'host-' || g %% 5, 3000 + g,
           clock_timestamp() - g * interval '1 second', clock_timestamp() + interval '5 minutes',
           CASE WHEN g %% 3 = 0 THEN 'infinity'::timestamptz
                ELSE clock_timestamp() + interval '15 seconds' END,
           g %% 3 = 0, CASE WHEN g %% 3 = 0 THEN '{"args": ["x"]}'::jsonb END
    FROM generate_series(1, %(queued)s) AS g
    """,
    """
    INSERT INTO runcell_admission_counter (task_name, limiter, deliveries, deferrals,
        provider_attempts, provider_failures, concurrency_failures)
    SELECT 'app.tasks.t' || g, (ARRAY['claude', 'gpt'])[1 + g %% 2], g, g / 2, g, g / 10, g / 20
    FROM generate_series(1, 500) AS g
    """,
    """
    INSERT INTO runcell_occupancy (limiter, workload, sampled_at, active, queued)
    SELECT l, w, date_trunc('second', clock_timestamp()) - s * interval '10 seconds', s %% 4, s %% 7
    FROM generate_series(0, 359) AS s, unnest(ARRAY['claude', 'gpt', 'gemini']) AS l,
         unnest(ARRAY['interactive', 'background']) AS w
    """,
    # As autovacuum does in production (every allocation updates the limiter's row).
    "ANALYZE runcell_limiter",
    "ANALYZE runcell_event",
    "ANALYZE runcell_lease",
    "ANALYZE runcell_queue",
]

#: Page -> the most queries it may make: 1 to plan without JIT (``SET LOCAL``), 2 for
#: the session and the user, then the page's own (paginator count, total count, rows,
#: the filters' limiter list, and the events page's dropped-events warning; the
#: dashboard's series: occupancy, waits, failures, drops; the limiters' live counts: one
#: statement on the backend's pool; the queue page's summary: its counts grouped in the
#: database, and the limiters they wait on).
PAGES = {
    f"{ADMIN}/limiter/": 7,
    f"{ADMIN}/lease/": 7,
    f"{ADMIN}/lease/?limiter=claude&workload=interactive": 7,
    f"{ADMIN}/lease/?q=held-task-500": 7,
    f"{ADMIN}/queueentry/": 9,
    f"{ADMIN}/queueentry/?state=parked&limiter=gpt": 9,
    f"{ADMIN}/concurrencyevent/": 7,
    f"{ADMIN}/concurrencyevent/?type__exact=acquired": 7,
    f"{ADMIN}/concurrencyevent/?limiter=gpt&workload=background": 7,
    f"{ADMIN}/concurrencyevent/?q=task-1234": 7,
    f"{ADMIN}/concurrencyevent/?occurred_at__gte=2000-01-01+00%3A00%3A00%2B00%3A00": 7,
    f"{ADMIN}/admissioncount/": 7,
    f"{ADMIN}/dashboard/": 9,
}


@pytest.fixture
def seeded(pg_limiter: Callable[..., PostgresConcurrencyLimiter], test_dsn: str) -> None:
    """Committed (the backend's pool reads them too); emptied before the next test."""
    for name in ("claude", "gpt", "gemini"):
        pg_limiter(
            name=name,
            max_concurrent=1_000,
            workloads={"interactive": {"reserved": 10, "priority": 10}, "background": {}},
        )
    with psycopg.connect(test_dsn, autocommit=True) as conn:
        for statement in SEED:
            conn.execute(statement, {"events": EVENTS, "leases": LEASES, "queued": QUEUED})


@pytest.fixture
def backend_statements(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, Any]]:
    """Every statement the PostgreSQL backend runs on its pool for this test's thread (run
    for real, listed): the page is rendered on it, while background threads other tests
    left (counters, recorders) may write through a backend too and are not the page's."""
    sent: list[tuple[str, Any]] = []
    fetch = PostgresBackend._fetch
    page_thread = threading.get_ident()

    def listed(
        self: PostgresBackend, query: LiteralString, params: Mapping[str, Any] | None = None
    ) -> list[tuple[Any, ...]]:
        if threading.get_ident() == page_thread:
            sent.append((query, params))
        return fetch(self, query, params)

    monkeypatch.setattr(PostgresBackend, "_fetch", listed)
    return sent


def test_every_admin_list_page_makes_a_bounded_number_of_queries(
    seeded: None,
    backend_statements: list[tuple[str, Any]],
    admin_client_for: Callable[..., Client],
    test_dsn: str,
    record_property: Callable[[str, object], None],
) -> None:
    assert ConcurrencyEvent.objects.count() == EVENTS
    client = admin_client_for(superuser=True)
    counts: dict[str, int] = {}
    for url, most in PAGES.items():
        backend_statements.clear()
        with CaptureQueriesContext(connection) as captured:
            response = client.get(url)
        assert response.status_code == 200, url
        counts[url] = len(page_statements(captured)) + len(backend_statements)
        assert counts[url] <= most, (url, page_statements(captured), backend_statements)
        # Bounded work per query too: no plan big enough for PostgreSQL to JIT-compile.
        for sql in reads(captured):
            assert "JIT:" not in _explain(sql), (url, sql)
        for statement, params in backend_statements:
            with psycopg.connect(test_dsn) as conn:
                plan = conn.execute(b"EXPLAIN " + statement.encode(), params).fetchall()
            assert "JIT:" not in "\n".join(row[0] for row in plan), (url, statement)
    record_property("queries per page", counts)
    width = max(map(len, counts))
    print("\n".join(f"{url.ljust(width)}  {n} queries" for url, n in counts.items()))


def _explain(sql: str) -> str:
    with connection.cursor() as cursor:
        cursor.execute(f"EXPLAIN {sql}")
        return "\n".join(row[0] for row in cursor.fetchall())


def _plans_of_event_queries(client: Client, url: str) -> list[str]:
    """EXPLAIN every query a page sends that reads ``runcell_event`` for its rows."""
    with CaptureQueriesContext(connection) as captured:
        assert client.get(url).status_code == 200
    plans = [
        _explain(query["sql"])
        for query in captured.captured_queries
        if 'FROM "runcell_event"' in query["sql"] and "ORDER BY" in query["sql"]
    ]
    assert plans, url
    return plans


@pytest.mark.parametrize(
    ("query", "index"),
    [
        ("", "runcell_event_for_list"),
        ("?q=task-1234", "runcell_event_for_run"),
        ("?q=root-77", "runcell_event_for_root"),
        ("?q=req-4242", "runcell_event_for_request"),
    ],
)
def test_the_events_page_reads_its_rows_through_an_index(
    seeded: None, admin_client_for: Callable[..., Client], query: str, index: str
) -> None:
    client = admin_client_for(superuser=True)
    for plan in _plans_of_event_queries(client, f"{ADMIN}/concurrencyevent/{query}"):
        assert "Seq Scan on runcell_event" not in plan, plan
        assert index in plan, plan


@pytest.mark.django_db(transaction=True)
def test_the_pages_plan_their_reads_without_jit_and_leave_the_connection_as_it_was(
    pg_limiter: Callable[..., PostgresConcurrencyLimiter],
    admin_client_for: Callable[..., Client],
) -> None:
    """Stale statistics (autovacuum off, thousands of keys gone since the last ANALYZE)
    can make any page's estimate pass ``jit_above_cost``: here the cost is set to 0, so
    that every plan of the connection would JIT-compile. The page plans its reads with
    JIT off all the same, and the setting ends with the page."""
    pg_limiter(name="claude", max_concurrent=3, keyed=True)
    client = admin_client_for(superuser=True)
    planned_with: list[str] = []

    def jit_of_each_read(execute: Any, sql: str, *args: Any) -> Any:
        if sql.lstrip().startswith("SELECT"):
            planned_with.append(_show_jit())  # below this wrapper: not wrapped again
        return execute(sql, *args)

    with connection.cursor() as cursor:
        cursor.execute("SET jit_above_cost = 0")
    try:
        with CaptureQueriesContext(connection) as captured:
            assert client.get(f"{ADMIN}/limiter/").status_code == 200
        rows = [sql for sql in reads(captured) if 'FROM "runcell_limiter"' in sql]
        assert rows
        assert "JIT:" in _explain(rows[-1]), "this server plans no JIT"

        for page in ("limiter", "lease", "queueentry", "concurrencyevent", "dashboard"):
            planned_with.clear()
            with connection.execute_wrapper(jit_of_each_read):
                assert client.get(f"{ADMIN}/{page}/").status_code == 200
            assert planned_with, page
            assert set(planned_with) == {"off"}, (page, planned_with)
            assert _show_jit() == "on"  # the page's setting, not the connection's
    finally:
        with connection.cursor() as cursor:
            cursor.execute("RESET jit_above_cost")


def _show_jit() -> str:
    with connection.cursor() as cursor:
        cursor.execute("SHOW jit")
        return str(cursor.fetchone()[0])
