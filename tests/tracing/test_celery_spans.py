"""Under ``opentelemetry-instrumentation-celery``, slot spans are children of the task's.

A real Celery worker (in-process, solo pool, Redis broker on a queue of the test's own)
runs ``RunCellTask`` tasks over a provider limiter and a keyed tenant limiter held in
memory; the SDK's in-memory exporter records what the instrumentation and the library
emit.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import redis
from celery import Celery
from celery.contrib.testing.worker import start_worker
from opentelemetry.instrumentation.celery import CeleryInstrumentor
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import SpanKind

from runcell_celery import create_concurrency_limiter, slot
from runcell_celery.celery import RunCellTask, registry_for
from tests.support.celery_app import REDIS_URL
from tests.tracing.conftest import RecordedSpans


@pytest.fixture
def instrumented(spans: RecordedSpans) -> Iterator[RecordedSpans]:
    """The Celery instrumentation on, writing to the test's provider; off afterwards."""
    instrumentor = CeleryInstrumentor()
    instrumentor.instrument(tracer_provider=spans.provider)
    try:
        yield spans
    finally:
        instrumentor.uninstrument()


@pytest.fixture
def app() -> Iterator[Celery]:
    """An app on a Redis queue of this test's own (deleted afterwards), limits in memory."""
    queue = f"runcell-tracing-{uuid.uuid4().hex[:10]}"
    app = Celery("traced", broker=REDIS_URL, backend="cache+memory://", set_as_current=False)
    app.conf.task_default_queue = queue
    app.conf.runcell = {"BACKEND": "memory"}
    registry = registry_for(app)
    registry.register(
        create_concurrency_limiter(
            4, name="claude", workloads={"interactive": {}, "background": {}}
        )
    )
    registry.register(create_concurrency_limiter(1, name="tenant", keyed=True))
    yield app
    client = redis.Redis.from_url(REDIS_URL)
    client.delete(queue, f"{queue}.runcell", *client.scan_iter(f"_kombu.binding*.{queue}*"))
    client.close()


def _children(parent: ReadableSpan, spans: list[ReadableSpan]) -> list[ReadableSpan]:
    context = parent.get_span_context()
    assert context is not None
    return [
        span
        for span in spans
        if span.parent is not None
        and span.parent.span_id == context.span_id
        and span.context is not None
        and span.context.trace_id == context.trace_id
    ]


def test_slot_waits_and_holds_are_children_of_the_celery_task_span(
    instrumented: RecordedSpans, app: Celery
) -> None:
    @app.task(
        base=RunCellTask,
        name="traced.summarize",
        shared=False,
        concurrency={
            "limiter": ["claude", "tenant"],
            "key": "{tenant_id}",
            "workload": "background",
        },
    )
    def summarize(tenant_id: str) -> list[dict[str, int]]:
        tokens = []
        for _ in range(2):  # two provider requests, one slot each
            with slot() as held:
                tokens.append(held.fencing_tokens)
        return tokens

    app.finalize(auto=True)
    with start_worker(app, pool="solo", perform_ping_check=False, loglevel="WARNING"):
        results = {tenant: summarize.delay(tenant) for tenant in ("acme", "globex")}
        replies = {tenant: result.get(timeout=30) for tenant, result in results.items()}

    recorded = instrumented.all()
    task_spans = [s for s in recorded if s.name == "run/traced.summarize"]
    assert len(task_spans) == 2
    for task_span in task_spans:
        assert task_span.kind is SpanKind.CONSUMER
        assert task_span.attributes is not None
        task_id = task_span.attributes["messaging.conversation_id"]  # Celery: the task id
        (tenant,) = [t for t, r in results.items() if r.id == task_id]
        children = _children(task_span, recorded)
        assert [s.name for s in children] == [
            "runcell.slot.wait",
            "runcell.slot.hold",
            "runcell.slot.wait",
            "runcell.slot.hold",
        ]
        for span, tokens in zip(
            children, [t for t in replies[tenant] for _ in (0, 1)], strict=True
        ):
            assert span.attributes is not None
            assert span.attributes["runcell.limiter"] == "claude"
            assert span.attributes["runcell.limiters"] == ("claude", f"tenant:{tenant}")
            assert span.attributes["runcell.workloads"] == ("background", "default")
            assert span.attributes["runcell.workload"] == "background"
            assert span.attributes["runcell.key"] == tenant
            assert span.attributes["runcell.run_id"] == task_id
            assert span.attributes["runcell.fencing_tokens"] == (
                tokens["claude"],
                tokens[f"tenant:{tenant}"],
            )
            expected = "granted" if span.name == "runcell.slot.wait" else "success"
            assert span.attributes["runcell.outcome"] == expected
