"""End to end: prefork worker processes defer tasks instead of blocking or failing."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from celery import Celery
from celery.result import AsyncResult

from runcell_celery.celery import admission_counts
from runcell_celery.postgres import ensure_schema
from runcell_celery.testing import FakeProvider
from tests.conftest import settled_counts, wait_until

LIMITS = {
    "max_concurrent": 3,
    "lease_ttl_ms": 5_000,
    "workloads": {"interactive": {"priority": 10}, "background": {}},
    "default_workload": "background",
}


def _wait(check: Any, what: str, timeout: float = 60.0) -> None:
    wait_until(check, what, timeout, interval=0.05)


def _counts(app: Celery, task_name: str) -> dict[str, int]:
    for count in admission_counts(app):
        if count.task_name == task_name:
            return {
                "deliveries": count.deliveries,
                "deferrals": count.deferrals,
                "provider_attempts": count.provider_attempts,
                "provider_failures": count.provider_failures,
                "concurrency_failures": count.concurrency_failures,
            }
    return {}


def _parked(pg_dsn: str) -> int:
    with psycopg.connect(pg_dsn) as conn:
        row = conn.execute("SELECT count(*) FROM runcell_queue WHERE parked").fetchone()
        return int(row[0]) if row else 0


@pytest.fixture(autouse=True)
def schema(pg_dsn: str) -> None:
    """The tables exist before a test reads counts or parked rows (run alone, no earlier
    test nor worker has made them yet)."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        ensure_schema(conn)


def test_two_hundred_deferred_tasks_complete_within_the_limit_with_no_retry_or_failure(
    make_app, worker_processes, provider: FakeProvider, pg_dsn: str, celery_settings
) -> None:
    settings = {
        **celery_settings,
        "runcell": {**celery_settings["runcell"], "LIMITERS": {"llm": LIMITS}},
    }
    app = make_app(**settings)
    workers = worker_processes(**settings)
    workers.start(concurrency=4)
    workers.start(concurrency=4)
    # The counts are the database's, per task name and limiter: earlier tests of the
    # session ran rc.defer on "llm" too, so this run's are what it adds.
    before = _counts(app, "rc.defer")

    results = [app.tasks["rc.defer"].delay(20) for _ in range(200)]
    try:
        replies = [result.get(timeout=180) for result in results]
    except Exception:
        print(workers.logs())
        raise
    assert len(replies) == 200
    assert {AsyncResult(r.id, app=app).state for r in results} == {"SUCCESS"}
    assert [reply["retries"] for reply in replies] == [0] * 200

    witness = provider.stats()
    assert witness.max_in_flight <= 3, f"the provider saw {witness.max_in_flight} in flight"
    assert witness.max_in_flight == 3, "the limit was never reached; the test proves nothing"
    assert witness.completed == 200

    def added() -> dict[str, int]:
        now = _counts(app, "rc.defer")
        return {name: value - before.get(name, 0) for name, value in now.items()}

    counts = settled_counts(
        added, lambda counts: counts.get("provider_attempts", 0) >= 200, "counts flushed"
    )
    assert counts["deferrals"] > 0, counts
    assert counts["deliveries"] == 200 + counts["deferrals"], counts
    assert counts["provider_failures"] == 0, counts
    assert counts["concurrency_failures"] == 0, counts
    assert _parked(pg_dsn) == 0


def test_a_worker_killed_while_tasks_are_parked_and_in_flight_loses_no_task(
    make_app, worker_processes, provider: FakeProvider, pg_dsn: str, celery_settings
) -> None:
    queue = celery_settings["queue"]
    conf = {
        "broker_transport_options": {
            "visibility_timeout": 8,
            "unacked_key": f"{queue}-unacked",
            "unacked_index_key": f"{queue}-unacked-index",
            "unacked_mutex_key": f"{queue}-unacked-mutex",
            "unacked_mutex_expire": 30,
            "unacked_restore_interval": 2,
            "unacked_restore_throttle": 1,
        }
    }
    settings = {
        **celery_settings,
        "runcell": {**celery_settings["runcell"], "LIMITERS": {"llm": LIMITS}},
        "conf": conf,
    }
    app = make_app(**settings)
    workers = worker_processes(**settings)
    doomed = workers.start(concurrency=4)
    workers.start(concurrency=4)

    results = [app.tasks["rc.defer"].delay(150) for _ in range(60)]
    _wait(
        lambda: _parked(pg_dsn) > 0 and provider.stats().in_flight > 0,
        "tasks parked and in flight",
    )
    workers.kill(doomed)

    try:
        replies = [result.get(timeout=240) for result in results]
    except Exception:
        print(workers.logs())
        raise
    assert len(replies) == 60
    assert {AsyncResult(r.id, app=app).state for r in results} == {"SUCCESS"}
    assert provider.stats().max_in_flight <= 3
    assert _parked(pg_dsn) == 0


def test_agents_needing_a_second_slot_are_not_starved_by_parked_tasks(
    make_app, worker_processes, provider: FakeProvider, pg_dsn: str, celery_settings
) -> None:
    # More agents than worker processes: while both processes hold agents that wait for
    # their second call's slot, freed slots must go to them, not to parked agents that
    # no process is free to run (their grants would expire unused, again and again).
    limits = {**LIMITS, "max_concurrent": 2, "lease_ttl_ms": 3_000}
    settings = {
        **celery_settings,
        "runcell": {**celery_settings["runcell"], "LIMITERS": {"llm": limits}},
    }
    app = make_app(**settings)
    workers = worker_processes(**settings)
    workers.start(concurrency=4)
    results = [app.tasks["rc.agent"].delay(100, 400) for _ in range(12)]
    try:
        retries = [result.get(timeout=90) for result in results]
    except Exception:
        print(workers.logs())
        raise
    assert retries == [0] * 12
    assert provider.stats().completed == 24
    assert provider.stats().max_in_flight <= 2
    assert _parked(pg_dsn) == 0
