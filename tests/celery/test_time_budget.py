"""A run's budget counts from its first start, across deferral and redelivery."""

from __future__ import annotations

import time
from typing import Any

import pytest
from celery.result import AsyncResult

from runcell_celery import ConcurrencyTimeoutError, slot
from runcell_celery.celery import registry_for
from tests.conftest import wait_until

LIMITS = {
    "max_concurrent": 1,
    "lease_ttl_ms": 10_000,
    "workloads": {"interactive": {}, "background": {}},
    "default_workload": "background",
}
BUDGET_MS = 4_000  # rc.defer_budget's timeout_ms


def _wait(check: Any, what: str, timeout: float = 60.0) -> None:
    wait_until(check, what, timeout, interval=0.05)


@pytest.fixture
def started(make_app, worker_processes, celery_settings):
    settings = {
        **celery_settings,
        "runcell": {**celery_settings["runcell"], "LIMITERS": {"llm": LIMITS}},
    }
    app = make_app(**settings)
    worker_processes(**settings).start(concurrency=2)
    return app


def _deferred(events: list[dict[str, Any]], run_id: str) -> bool:
    # A parked run emits wait-started and then nothing until it is re-published.
    return any(e["type"] == "wait-started" and e.get("run_id") == run_id for e in events)


def test_deferral_does_not_restart_the_budget(started, worker_events) -> None:
    app = started
    with slot(registry_for(app).get("llm")):
        result = app.tasks["rc.defer_budget"].delay()
        _wait(lambda: _deferred(worker_events(), result.id), "the task is parked")
        time.sleep(1.5)
    info = result.get(timeout=30)
    assert info["retries"] == 0
    assert info["remaining_ms"] < BUDGET_MS - 1_400, "the budget restarted after deferral"


def test_a_redelivered_run_keeps_the_budget_of_its_first_start(started) -> None:
    app = started
    sent = app.tasks["rc.defer_budget"].delay()
    first = sent.get(timeout=30)
    sent.forget()  # so that the next get() waits for the second execution
    time.sleep(1.0)
    # The same task id delivered again, as after a worker died before acking it.
    again = app.tasks["rc.defer_budget"].apply_async(task_id=first["run_id"]).get(timeout=30)
    assert again["remaining_ms"] < first["remaining_ms"] - 900


def test_stale_parked_work_is_dropped_before_it_takes_a_slot(
    started, worker_events, provider
) -> None:
    app = started
    calls_before = provider.stats().total
    with slot(registry_for(app).get("llm")):
        result = app.tasks["rc.defer_budget"].delay()
        _wait(lambda: _deferred(worker_events(), result.id), "the task is parked")
        # Hold the slot past the run's whole budget: the parked run goes stale.
        time.sleep(BUDGET_MS / 1000 + 0.5)
        with pytest.raises(ConcurrencyTimeoutError):
            result.get(timeout=30)
    assert AsyncResult(result.id, app=app).state == "FAILURE"
    timed_out = [e for e in worker_events() if e["type"] == "timed-out"]
    assert [e["run_id"] for e in timed_out] == [result.id]
    assert not [e for e in worker_events() if e["type"] == "acquired" and e["run_id"] == result.id]
    assert provider.stats().total == calls_before
