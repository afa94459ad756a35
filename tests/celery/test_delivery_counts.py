"""Every delivery is counted, including one that fails before its run starts.

An operator compares deliveries with what was sent; a delivery that failed before it
asked for a slot (its limiter could not be created) is counted by the task itself, or,
for a configuration error, through the ``config-error`` event it emits; either way
exactly once, or the numbers stop adding up. Here the limiter cannot be created, once
because its stored limits were changed to conflict with the running worker's and once
because the database is unreachable, and each delivery must show as one delivery and
one concurrency failure.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from celery import Celery

from runcell_celery import ConcurrencyConfigError, ConcurrencyLimiterError
from runcell_celery.celery import AdmissionCount, admission_counts, registry_for
from tests.conftest import wait_until

TASKS = 5
WORKLOADS = {"interactive": {}, "background": {}}  # the test app's tasks name both
STORED = {"max_concurrent": 2, "workloads": WORKLOADS, "default_workload": "background"}
CONFLICTING = {**STORED, "max_concurrent": 3}
#: A port nothing listens on (privileged, never a test service's).
UNREACHABLE_DSN = "postgresql://postgres@127.0.0.1:1/test"


def _counts(rows: list[AdmissionCount]) -> AdmissionCount:
    mine = [c for c in rows if (c.task_name, c.limiter) == ("rc.wait", "llm")]
    return mine[0] if mine else AdmissionCount("rc.wait", "llm")


def _runcell(settings: dict[str, Any], **changes: Any) -> dict[str, Any]:
    return {**settings, "runcell": {**settings["runcell"], **changes}}


def test_deliveries_whose_limiter_limits_conflict_are_each_counted_as_a_failure(
    make_app, worker_processes, celery_settings
) -> None:
    # A worker whose limits conflict at start refuses to start (test_conflicting_limits_
    # at_start.py): the conflict comes once it runs, when other limits are stored.
    worker_settings = _runcell(
        celery_settings,
        LIMITERS={"llm": CONFLICTING},
        POSTGRES={"poll_interval_ms": 50, "on_conflict": "error"},
    )
    registry_for(make_app(**_runcell(celery_settings, LIMITERS={"llm": CONFLICTING}))).get("llm")
    group = worker_processes(**worker_settings)
    app = make_app(**_runcell(celery_settings, LIMITERS={"llm": STORED}))
    group.start(concurrency=2, answering=app)
    registry_for(app).get("llm")  # stores other limits (on_conflict "replace" here)
    before = _counts(admission_counts(app))
    results = [app.tasks["rc.wait"].delay(5) for _ in range(TASKS)]
    for result in results:
        with pytest.raises(ConcurrencyConfigError):
            result.get(timeout=60)
    wait_until(
        lambda: _counts(admission_counts(app)).deliveries - before.deliveries >= TASKS,
        "the workers wrote their counts",
        30,
        interval=0.2,
    )
    time.sleep(1.5)  # a count written late would show up as an excess
    after = _counts(admission_counts(app))
    assert after.deliveries - before.deliveries == TASKS
    assert after.concurrency_failures - before.concurrency_failures == TASKS
    assert after.provider_attempts == before.provider_attempts


@pytest.mark.stress  # waits out connection timeouts (about 17 s); CI runs it in stress
def test_deliveries_that_cannot_reach_the_database_are_each_counted_as_a_failure(
    make_app, worker_processes, celery_settings
) -> None:
    # The worker cannot write its counts anywhere: they stay in its process, which
    # reports them (one pool process, so one process ran every delivery).
    settings = _runcell(
        celery_settings,
        DATABASE=UNREACHABLE_DSN,
        POSTGRES={"poll_interval_ms": 50, "connect_timeout_ms": 1_000},
    )
    app: Celery = make_app(**settings)
    group = worker_processes(**settings)
    group.start(concurrency=1)
    try:
        assert app.tasks["rc.local_counts"].delay().get(timeout=60) == []
    except Exception:
        print(group.logs())
        raise
    results = [app.tasks["rc.wait"].delay(5) for _ in range(TASKS)]
    for result in results:
        with pytest.raises(ConcurrencyLimiterError):
            result.get(timeout=60)
    counts = _counts(
        [AdmissionCount(**row) for row in app.tasks["rc.local_counts"].delay().get(timeout=60)]
    )
    assert counts.deliveries == TASKS
    assert counts.concurrency_failures == TASKS
    assert counts.provider_attempts == 0
