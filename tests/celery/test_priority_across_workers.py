"""Priority across worker processes: interactive work is served at the next hand-off."""

from __future__ import annotations

from typing import Any

import psycopg

from runcell_celery.testing import FakeProvider
from tests.conftest import wait_until

LIMITS = {
    "max_concurrent": 3,
    "lease_ttl_ms": 10_000,
    # No reservation: background may take every slot; only priority can help.
    "workloads": {"interactive": {"priority": 10}, "background": {}},
    "default_workload": "background",
}

#: Background requests in line on this test's limiter (other tests leave limiters of
#: their own in the same database).
BACKGROUND_QUEUED = (
    "SELECT count(*) FROM runcell_queue WHERE limiter = 'llm' AND workload = 'background'"
)


def _wait(check: Any, what: str, timeout: float = 60.0) -> None:
    wait_until(check, what, timeout, interval=0.05)


def _scalar(dsn: str, query: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(query).fetchone()  # type: ignore[call-overload]
        return int(row[0]) if row and row[0] is not None else 0


def test_an_interactive_task_takes_the_next_freed_slot_while_background_saturates(
    make_app,
    worker_processes,
    provider: FakeProvider,
    pg_dsn: str,
    celery_settings,
    worker_events,
) -> None:
    settings = {
        **celery_settings,
        "runcell": {**celery_settings["runcell"], "LIMITERS": {"llm": LIMITS}},
    }
    app = make_app(**settings)
    workers = worker_processes(**settings)
    workers.start(concurrency=4)
    workers.start(concurrency=4)

    # Long holds: slots free about every 400 ms, so the test sees the interactive
    # request queued before the next hand-off.
    background = [app.tasks["rc.background"].delay(1_200) for _ in range(18)]
    _wait(lambda: provider.stats().in_flight == 3, "background holds every slot")
    _wait(
        lambda: _scalar(pg_dsn, BACKGROUND_QUEUED) >= 10,
        "a background backlog",
    )
    interactive = app.tasks["rc.wait"].apply_async((5,), concurrency={"workload": "interactive"})
    _wait(
        lambda: any(
            e["type"] == "wait-started" and e.get("run_id") == interactive.id
            for e in worker_events()
        ),
        "the interactive request queued",
    )
    # Every lease gets the next fencing token, so tokens count hand-offs.
    # (Other tests leave limiters of their own in this database: read this one's.)
    token_when_queued = _scalar(
        pg_dsn, "SELECT last_fencing_token FROM runcell_limiter WHERE name = 'llm'"
    )
    backlog = _scalar(pg_dsn, BACKGROUND_QUEUED)

    try:
        reply = interactive.get(timeout=60)
        for result in background:
            result.get(timeout=120)
    except Exception:
        print(workers.logs())
        raise
    assert reply["workload"] == "interactive"
    handoffs = reply["fencing_token"] - token_when_queued
    assert handoffs <= 1, (
        f"{handoffs - 1} background grants went first, with {backlog} background queued ahead"
    )
    assert provider.stats().max_in_flight <= 3
