"""A task execution is a run; runs nest across task messages (in-process worker).

The tasks run on Celery's ``celery_worker`` (threads) in this process, on Celery's
``celery_app`` configured as the test app (``tests/support/celery_fixtures.py``).
"""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery
from celery.signals import task_failure

from runcell_celery import ConcurrencyTimeoutError, slot
from runcell_celery.celery import registry_for
from runcell_celery.celery.state import state_for
from tests.conftest import wait_until

#: The test's limiter with a single slot, shared by two workloads.
ONE_SLOT = {
    "LIMITERS": {
        "llm": {
            "max_concurrent": 1,
            "workloads": {"interactive": {}, "background": {}},
            "default_workload": "background",
        }
    }
}


def test_a_task_is_a_run_whose_id_is_the_task_id(celery_app: Celery, celery_worker: Any) -> None:
    result = celery_app.tasks["rc.wait"].delay(5)
    info = result.get(timeout=30)
    assert info["run_id"] == result.id
    assert info["root_run_id"] == result.id
    assert info["parent_run_id"] is None
    assert info["limiter"] == "llm"
    assert info["workload"] == "background"  # the limiter's default


def test_a_child_inherits_the_parents_workload_over_its_own_default(
    celery_app: Celery, celery_worker: Any
) -> None:
    result = celery_app.tasks["rc.parent"].apply_async(concurrency={"workload": "interactive"})
    info = result.get(timeout=60)
    parent, child = info["parent"], info["child"]
    assert parent["workload"] == "interactive"
    assert child["workload"] == "interactive", "rc.child declares background; the parent's wins"
    assert child["parent_run_id"] == parent["run_id"] == result.id
    assert child["root_run_id"] == result.id


def test_an_explicit_choice_for_the_child_wins_over_the_parents_workload(
    celery_app: Celery, celery_worker: Any
) -> None:
    result = celery_app.tasks["rc.parent"].apply_async(
        ({"concurrency": {"workload": "background"}},),
        concurrency={"workload": "interactive"},
    )
    info = result.get(timeout=60)
    assert info["parent"]["workload"] == "interactive"
    assert info["child"]["workload"] == "background"


def test_a_child_never_outlives_its_parents_budget(celery_app: Celery, celery_worker: Any) -> None:
    result = celery_app.tasks["rc.parent"].delay({"concurrency": {"timeout_ms": 600_000}})
    info = result.get(timeout=60)
    child_remaining = info["child"]["remaining_ms"]
    assert child_remaining is not None
    assert 0 < child_remaining <= 60_000, "the child got more than the parent's 60 s budget"


@pytest.mark.celery(runcell=ONE_SLOT)
def test_with_one_slot_a_parent_that_waits_for_its_child_completes(
    celery_app: Celery, celery_worker: Any, provider
) -> None:
    info = celery_app.tasks["rc.parent"].delay().get(timeout=60)
    assert info["child"]["parent_run_id"] == info["parent"]["run_id"]
    assert provider.stats().max_in_flight == 1
    assert provider.stats().completed == 3  # parent, child, parent again


def test_a_concurrency_error_stops_the_run_and_autoretry_never_retries_it(
    celery_app: Celery, celery_worker: Any
) -> None:
    failures: list[Any] = []

    def on_failure(sender: Any = None, exception: BaseException | None = None, **_: Any) -> None:
        failures.append(exception)

    task_failure.connect(on_failure, weak=False)
    limiter = registry_for(celery_app).get("llm")
    try:
        with slot(limiter), slot(limiter):  # background is full (2 of 3)
            result = celery_app.tasks["rc.flaky"].delay()
            with pytest.raises(ConcurrencyTimeoutError):
                result.get(timeout=30)
            assert result.state == "FAILURE"
        # Celery stores the failure, then sends task_failure: the worker still runs.
        wait_until(lambda: failures, "task_failure is sent")
    finally:
        task_failure.disconnect(on_failure)
    assert len(failures) == 1
    assert isinstance(failures[0], ConcurrencyTimeoutError)
    counts = {c.task_name: c for c in state_for(celery_app).counters.local()}
    assert counts["rc.flaky"].deliveries == 1, "autoretry_for=(Exception,) retried it"
    assert counts["rc.flaky"].concurrency_failures == 1
    assert counts["rc.flaky"].provider_failures == 0


@pytest.mark.celery(runcell=ONE_SLOT)
def test_deferred_tasks_fire_no_task_failure_and_keep_retries_at_zero(
    celery_app: Celery, celery_worker: Any, provider
) -> None:
    failures: list[Any] = []

    def on_failure(**kwargs: Any) -> None:
        failures.append(kwargs)

    task_failure.connect(on_failure, weak=False)
    try:
        results = [celery_app.tasks["rc.defer"].delay(60) for _ in range(8)]
        replies = [r.get(timeout=60) for r in results]
    finally:
        task_failure.disconnect(on_failure)
    assert failures == []
    assert [reply["retries"] for reply in replies] == [0] * 8
    counts = {c.task_name: c for c in state_for(celery_app).counters.local()}["rc.defer"]
    assert counts.deferrals > 0
    assert counts.deliveries == 8 + counts.deferrals
    assert counts.concurrency_failures == 0
    assert provider.stats().max_in_flight == 1


@pytest.mark.celery(runcell=ONE_SLOT)
def test_hold_task_runs_the_whole_body_inside_one_slot(
    celery_app: Celery, celery_worker: Any, provider
) -> None:
    results = [celery_app.tasks["rc.hold_task"].delay(30) for _ in range(4)]
    infos = [r.get(timeout=60) for r in results]
    assert [info["run_id"] for info in infos] == [r.id for r in results]
    assert provider.stats().max_in_flight == 1
