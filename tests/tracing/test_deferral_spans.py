"""A deferred Celery run's wait span says so, with its place in line from PostgreSQL.

Celery's in-process ``celery_worker`` (threads) on the PostgreSQL limiter, limit 1, runs three
``admission: defer`` tasks sent at once under the Celery instrumentation: the runs
that find the slot taken are parked (their wait span ends ``deferred``, with the
place the database gave them), then re-published and run (their wait span ends
``granted`` and their hold is the pre-admitted slot's), every one of them succeeding.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from opentelemetry.instrumentation.celery import CeleryInstrumentor
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import StatusCode

from tests.conftest import wait_until
from tests.support.celery_fixtures import (
    celery_app,
    celery_config,
    celery_settings,
    celery_worker_parameters,
    celery_worker_pool,
    provider,
)
from tests.support.pg import pg_dsn
from tests.tracing.conftest import RecordedSpans

__all__ = [
    "celery_app",
    "celery_config",
    "celery_settings",
    "celery_worker_parameters",
    "celery_worker_pool",
    "pg_dsn",
    "provider",
]

LIMITS = {
    "max_concurrent": 1,
    "lease_ttl_ms": 5_000,
    "workloads": {"background": {}},
    "default_workload": "background",
}


@pytest.fixture
def instrumented(spans: RecordedSpans) -> Iterator[RecordedSpans]:
    instrumentor = CeleryInstrumentor()
    instrumentor.instrument(tracer_provider=spans.provider)
    try:
        yield spans
    finally:
        instrumentor.uninstrument()


def _parent_id(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


@pytest.mark.celery(runcell={"LIMITERS": {"llm": LIMITS}})
def test_a_parked_run_has_a_deferred_wait_with_its_place_and_then_runs_on_its_admitted_slot(
    instrumented: RecordedSpans, celery_app: Celery, celery_worker: Any
) -> None:
    # The instrumentation is on before the worker starts, and off after it stopped.
    defer_task: Any = celery_app.tasks["rc.defer"]
    results = [defer_task.delay(300) for _ in range(3)]
    replies = [result.get(timeout=60) for result in results]
    assert len(replies) == 3
    # A delivery's task span ends after its result is stored, one wait span a delivery.
    wait_until(
        lambda: len(instrumented.named("run/rc.defer")) == len(instrumented.waits()),
        "every delivery's task span has ended",
    )

    recorded = instrumented.all()
    runs = {s.context.span_id: s for s in recorded if s.name == "run/rc.defer"}
    waits = [s for s in recorded if s.name == "runcell.slot.wait"]
    holds = [s for s in recorded if s.name == "runcell.slot.hold"]
    assert all(_parent_id(s) in runs for s in [*waits, *holds]), "every slot span is a task's"
    outcomes = Counter(s.attributes["runcell.outcome"] for s in waits)  # type: ignore[index]
    assert outcomes["granted"] == 3, outcomes  # one per run that went on to its body
    assert outcomes["deferred"] >= 1, outcomes  # limit 1, three at once: some parked
    assert set(outcomes) <= {"granted", "deferred"}, outcomes
    for wait in waits:
        attributes = wait.attributes
        assert attributes is not None
        assert attributes["runcell.limiter"] == "llm"
        assert attributes["runcell.workload"] == "background"
        if attributes["runcell.outcome"] == "deferred":
            assert wait.status.status_code is StatusCode.UNSET  # a deferral is no failure
            assert isinstance(attributes["runcell.queue.place"], int)
            assert attributes["runcell.queue.place"] >= 1
    # Each run's hold is on the slot admitted before its body, under the same task span.
    assert len(holds) == 3
    tokens = [reply["fencing_token"] for reply in replies]
    for hold in holds:
        attributes = hold.attributes
        assert attributes is not None
        assert attributes["runcell.preadmitted"] is True
        assert attributes["runcell.outcome"] == "success"
        assert attributes["runcell.fencing_token"] in tokens
        granted = [
            w
            for w in waits
            if _parent_id(w) == _parent_id(hold) and w.attributes["runcell.outcome"] == "granted"  # type: ignore[index]
        ]
        assert len(granted) == 1
        assert granted[0].attributes["runcell.lease_id"] == attributes["runcell.lease_id"]  # type: ignore[index]
