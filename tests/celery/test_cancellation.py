"""Revocation and time limits stop waits and release held slots (prefork workers)."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from celery.result import AsyncResult

from runcell_celery import ConcurrencyCancelledError, slot
from runcell_celery.celery import registry_for
from tests.conftest import wait_until

LIMITS = {
    "max_concurrent": 1,
    "lease_ttl_ms": 10_000,
    "workloads": {"interactive": {}, "background": {}},
    "default_workload": "background",
}


def _wait(check: Any, what: str, timeout: float = 60.0) -> None:
    wait_until(check, what, timeout, interval=0.05)


def _queued(dsn: str, run_id: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT count(*) FROM runcell_queue WHERE run_id = %s", [run_id])
        return int(row.fetchone()[0])  # type: ignore[index]


def _of(events: list[dict[str, Any]], type_: str, run_id: str) -> list[dict[str, Any]]:
    return [e for e in events if e["type"] == type_ and e.get("run_id") == run_id]


@pytest.fixture
def started(make_app, worker_processes, celery_settings):
    settings = {
        **celery_settings,
        "runcell": {**celery_settings["runcell"], "LIMITERS": {"llm": LIMITS}},
    }
    app = make_app(**settings)
    workers = worker_processes(**settings)
    workers.start(concurrency=2)
    return app, workers


def test_revoke_terminate_stops_a_waiting_task_and_withdraws_its_place(
    started, pg_dsn: str, worker_events
) -> None:
    app, _workers = started
    with slot(registry_for(app).get("llm")):  # the only slot is taken
        result = app.tasks["rc.wait"].delay(5)
        _wait(lambda: _queued(pg_dsn, result.id) == 1, "the task waits for a slot")
        result.revoke(terminate=True)
        _wait(lambda: _of(worker_events(), "wait-cancelled", result.id), "wait-cancelled")
        assert _queued(pg_dsn, result.id) == 0
    _wait(lambda: AsyncResult(result.id, app=app).state == "REVOKED", "the task is revoked")
    assert not _of(worker_events(), "acquired", result.id)


def test_revoke_terminate_releases_a_held_slot_as_cancelled(
    started, provider, worker_events
) -> None:
    app, _workers = started
    result = app.tasks["rc.slow_wait"].delay(60_000)
    _wait(lambda: provider.stats().in_flight == 1, "the task holds its slot in a provider call")
    result.revoke(terminate=True)
    _wait(lambda: _of(worker_events(), "released", result.id), "the slot is released")
    (released,) = _of(worker_events(), "released", result.id)
    assert released["outcome"] == "cancelled"
    # The slot is free again at once, not after the lease TTL.
    with slot(registry_for(app).get("llm")):
        pass


def test_a_soft_time_limit_stops_a_wait_without_a_slot(started, pg_dsn, worker_events) -> None:
    app, _workers = started
    with slot(registry_for(app).get("llm")):
        result = app.tasks["rc.slow_wait"].apply_async((5,), soft_time_limit=1)
        assert result.get(timeout=30) == "soft time limit"
    assert _of(worker_events(), "wait-cancelled", result.id)
    assert not _of(worker_events(), "acquired", result.id)
    assert _queued(pg_dsn, result.id) == 0


def test_revoking_the_root_cancels_its_waiting_children(started, pg_dsn, worker_events) -> None:
    app, _workers = started
    with slot(registry_for(app).get("llm")):
        root = app.tasks["rc.spawn"].delay(2)  # one per pool process, both waiting
        children = [AsyncResult(child, app=app) for child in root.get(timeout=30)]
        _wait(lambda: all(_queued(pg_dsn, c.id) == 1 for c in children), "the children wait")
        root.revoke()
        for child in children:
            with pytest.raises(ConcurrencyCancelledError):
                child.get(timeout=30)
    for child in children:
        assert _of(worker_events(), "wait-cancelled", child.id)
        assert _queued(pg_dsn, child.id) == 0
