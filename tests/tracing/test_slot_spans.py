"""Spans of slot waits and holds, recorded by the OpenTelemetry SDK's in-memory exporter.

Real in-memory limiters, real threads for contention; the only thing replaced is the
exporter (spans kept in memory instead of sent).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
from opentelemetry.trace import StatusCode

from runcell_celery import (
    CancellationToken,
    ConcurrencyCancelledError,
    ConcurrencyLeaseLostError,
    ConcurrencyQueueFullError,
    ConcurrencyTimeoutError,
    Lease,
    create_concurrency_limiter,
    run,
    slot,
    tracer,
)
from runcell_celery.admission import Admission, Deferred, DuplicateDelivery
from runcell_celery.background import DEFAULT_REGISTRY
from runcell_celery.ports import Parked, WaitEstimate
from runcell_celery.protocol import ConcurrencyLimiter, Member, OnWait
from runcell_celery.slot import preadmit
from runcell_celery.tracing import current_tracer
from tests.conftest import wait_until
from tests.tracing.conftest import RecordedSpans, set_tracer_provider, unset_tracer_provider

_names = iter(range(1, 1_000_000))


def _limiter(max_concurrent: int = 1, **options: Any) -> Any:
    return create_concurrency_limiter(max_concurrent, name=f"trace-{next(_names)}", **options)


def _only(spans: list[ReadableSpan]) -> ReadableSpan:
    assert len(spans) == 1, [(s.name, s.attributes) for s in spans]
    return spans[0]


@pytest.fixture
def holding() -> Iterator[Any]:
    """``holding(limiter)``: a thread holds one slot of ``limiter`` until ``let_go()``."""
    threads: list[threading.Thread] = []
    releases: list[threading.Event] = []

    def start(limiter: ConcurrencyLimiter) -> threading.Event:
        entered, let_go = threading.Event(), threading.Event()

        def hold() -> None:
            with slot(limiter):
                entered.set()
                let_go.wait(30)

        thread = threading.Thread(target=hold, name="test-holder")
        thread.start()
        threads.append(thread)
        releases.append(let_go)
        assert entered.wait(10), "the holder never got its slot"
        return let_go

    yield start
    for let_go in releases:
        let_go.set()
    for thread in threads:
        thread.join(10)


def test_a_granted_slot_records_its_wait_then_its_hold_as_children_of_the_current_span(
    spans: RecordedSpans,
) -> None:
    limiter = _limiter(2, workloads={"chat": {}, "batch": {}})
    tracer = trace.get_tracer("test")
    with (
        tracer.start_as_current_span("provider-call-site") as parent,
        slot(limiter, workload="chat") as held,
    ):
        fencing_token, lease_id = held.fencing_token, held.lease.lease_id  # type: ignore[union-attr]
        assert spans.holds() == []  # open until the slot is released
    wait, hold = _only(spans.waits()), _only(spans.holds())
    for span in (wait, hold):
        assert span.parent is not None
        assert span.parent.span_id == parent.get_span_context().span_id
        assert span.context.trace_id == parent.get_span_context().trace_id
        assert span.attributes is not None
        assert span.attributes["runcell.limiter"] == limiter.name
        assert span.attributes["runcell.limiters"] == (limiter.name,)
        assert span.attributes["runcell.workload"] == "chat"
        assert span.attributes["runcell.workloads"] == ("chat",)
        assert span.attributes["runcell.fencing_token"] == fencing_token
        assert span.attributes["runcell.fencing_tokens"] == (fencing_token,)
        assert span.attributes["runcell.lease_id"] == lease_id
        assert "runcell.key" not in span.attributes
        assert span.status.status_code is StatusCode.UNSET
    assert wait.attributes is not None
    assert hold.attributes is not None
    assert wait.attributes["runcell.outcome"] == "granted"
    assert hold.attributes["runcell.outcome"] == "success"
    assert wait.attributes["runcell.request_id"] == hold.attributes["runcell.request_id"]
    assert wait.end_time is not None
    assert hold.start_time is not None
    assert wait.end_time <= hold.start_time


def test_a_wait_span_runs_from_the_request_to_the_grant(spans: RecordedSpans, holding: Any) -> None:
    limiter = _limiter(1)
    let_go = holding(limiter)
    asked_at = time.time_ns()
    waiter = threading.Thread(target=lambda: slot(limiter).__enter__().__exit__(None, None, None))
    waiter.start()
    wait_until(lambda: limiter.stats().queued == 1, "the second request waits")
    released_at = time.time_ns()
    let_go.set()
    waiter.join(10)
    waits = [s for s in spans.waits() if s.start_time is not None and s.start_time >= asked_at]
    wait = _only(waits)
    assert wait.start_time is not None
    assert wait.end_time is not None
    # Started when it asked (before the holder let go), ended once it was granted.
    assert wait.start_time < released_at <= wait.end_time


def test_a_timed_out_wait_is_an_error_span_and_no_hold_is_recorded(
    spans: RecordedSpans, holding: Any
) -> None:
    limiter = _limiter(1, workloads={"default": {"max_wait_ms": 20}})
    holding(limiter)
    spans.exporter.clear()  # the holder's wait
    with pytest.raises(ConcurrencyTimeoutError):
        slot(limiter).__enter__()
    wait = _only(spans.waits())
    assert wait.attributes is not None
    assert wait.attributes["runcell.outcome"] == "timed-out"
    assert wait.attributes["error.type"] == "ConcurrencyTimeoutError"
    assert "runcell.fencing_token" not in wait.attributes
    assert wait.status.status_code is StatusCode.ERROR
    assert wait.status.description is not None
    assert wait.status.description.startswith("ConcurrencyTimeoutError: ")
    assert spans.holds() == []


def test_a_full_queue_is_an_error_span(spans: RecordedSpans, holding: Any) -> None:
    limiter = _limiter(1, max_queued=0)
    holding(limiter)
    spans.exporter.clear()
    with pytest.raises(ConcurrencyQueueFullError):
        slot(limiter).__enter__()
    wait = _only(spans.waits())
    assert wait.attributes is not None
    assert wait.attributes["runcell.outcome"] == "queue-full"
    assert wait.status.status_code is StatusCode.ERROR


def test_a_cancelled_wait_is_recorded_as_cancelled_not_as_an_error(
    spans: RecordedSpans, holding: Any
) -> None:
    limiter = _limiter(1)
    holding(limiter)
    spans.exporter.clear()
    token = CancellationToken()
    failures: list[BaseException] = []

    def wait() -> None:
        try:
            slot(limiter, cancel=token).__enter__()
        except BaseException as exc:
            failures.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    wait_until(lambda: limiter.stats().queued == 1, "the request waits")
    token.cancel("the user went away")
    waiter.join(10)
    assert [type(exc) for exc in failures] == [ConcurrencyCancelledError]
    span = _only(spans.waits())
    assert span.attributes is not None
    assert span.attributes["runcell.outcome"] == "cancelled"
    assert span.status.status_code is StatusCode.UNSET


def test_a_hold_whose_body_raises_ends_with_the_error_outcome(spans: RecordedSpans) -> None:
    limiter = _limiter(1)
    with pytest.raises(ValueError, match="provider said no"), slot(limiter):
        raise ValueError("provider said no")
    hold = _only(spans.holds())
    assert hold.attributes is not None
    assert hold.attributes["runcell.outcome"] == "error"
    assert hold.status.status_code is StatusCode.ERROR
    # The body's own message (it may quote a prompt) is not copied into the span.
    assert "provider said no" not in (hold.status.description or "")
    assert limiter.stats().active == 0


def test_a_hold_past_max_hold_ms_ends_with_the_max_hold_outcome(spans: RecordedSpans) -> None:
    limiter = _limiter(1)
    with pytest.raises(ConcurrencyLeaseLostError), slot(limiter, max_hold_ms=20) as held:
        wait_until(lambda: held.aborted, "max_hold_ms aborts the hold")
    hold = _only(spans.holds())
    assert hold.attributes is not None
    assert hold.attributes["runcell.outcome"] == "max-hold"
    assert hold.status.status_code is StatusCode.ERROR


def test_several_limiters_and_a_key_are_named_on_both_spans(spans: RecordedSpans) -> None:
    openai = _limiter(3, workloads={"chat": {}, "batch": {}})
    gpt = _limiter(2)
    tenants = create_concurrency_limiter(1, name=f"tenant-{next(_names)}", keyed=True)
    acme = tenants.key("acme")
    with slot(openai, gpt, acme, workload="chat") as held:
        tokens = held.fencing_tokens
    names = (openai.name, gpt.name, acme.name)
    for span in (_only(spans.waits()), _only(spans.holds())):
        assert span.attributes is not None
        assert span.attributes["runcell.limiter"] == openai.name
        assert span.attributes["runcell.limiters"] == names
        assert span.attributes["runcell.workload"] == "chat"
        assert span.attributes["runcell.workloads"] == ("chat", "default", "default")
        assert span.attributes["runcell.key"] == "acme"
        assert span.attributes["runcell.fencing_tokens"] == tuple(tokens[n] for n in names)
        assert span.attributes["runcell.fencing_token"] == tokens[openai.name]
    assert acme.name == f"{tenants.name}:acme"


def test_a_keys_limiter_alone_names_its_key(spans: RecordedSpans) -> None:
    tenants = create_concurrency_limiter(1, name=f"tenant-{next(_names)}", keyed=True)
    with slot(tenants.key("globex")):
        pass
    hold = _only(spans.holds())
    assert hold.attributes is not None
    assert hold.attributes["runcell.limiter"] == f"{tenants.name}:globex"
    assert hold.attributes["runcell.key"] == "globex"


def test_an_async_slot_records_both_spans(spans: RecordedSpans) -> None:
    limiter = _limiter(1)

    async def call() -> None:
        async with slot(limiter):
            await asyncio.sleep(0)

    asyncio.run(call())
    assert _only(spans.waits()).attributes["runcell.outcome"] == "granted"  # type: ignore[index]
    assert _only(spans.holds()).attributes["runcell.outcome"] == "success"  # type: ignore[index]


def _admission(limiter: ConcurrencyLimiter, parked: Parked | None = None) -> Admission:
    def acquire(
        members: tuple[Member, ...], cancel: CancellationToken | None, on_wait: OnWait
    ) -> tuple[Lease, ...] | Deferred | DuplicateDelivery:
        if parked is not None:
            return Deferred(parked)
        return (members[0].limiter.acquire(members[0].request, cancel=cancel, on_wait=on_wait),)

    return Admission(acquire, limiters=(limiter,), request_id="delivery-1")


def test_a_slot_admitted_before_the_body_has_its_wait_at_admission_and_its_hold_in_the_body(
    spans: RecordedSpans,
) -> None:
    limiter = _limiter(1)
    admission = _admission(limiter)
    with run(limiter=limiter, admission=admission):
        preadmit(admission)
        wait = _only(spans.waits())
        assert spans.holds() == []
        with slot():
            pass
    assert _only(spans.waits()) == wait  # adopting it waits no more
    hold = _only(spans.holds())
    assert wait.attributes is not None
    assert hold.attributes is not None
    assert wait.attributes["runcell.outcome"] == "granted"
    assert wait.attributes["runcell.request_id"] == "delivery-1"
    assert hold.attributes["runcell.preadmitted"] is True
    assert hold.attributes["runcell.lease_id"] == wait.attributes["runcell.lease_id"]
    assert "runcell.preadmitted" not in wait.attributes


def test_a_deferred_admission_records_its_place_in_line_and_is_not_an_error(
    spans: RecordedSpans,
) -> None:
    limiter = _limiter(1)
    estimate = WaitEstimate(ahead=2, hold_ms=300.0, slots=1)
    parked = Parked(limiter=limiter.name, workload="default", estimate=estimate)
    admission = _admission(limiter, parked)
    with run(limiter=limiter, admission=admission):
        assert preadmit(admission) == Deferred(parked)
    wait = _only(spans.waits())
    assert wait.attributes is not None
    assert wait.attributes["runcell.outcome"] == "deferred"
    assert wait.attributes["runcell.queue.place"] == 3
    assert wait.attributes["runcell.queue.expected_wait_ms"] == pytest.approx(900.0)
    assert wait.status.status_code is StatusCode.UNSET
    assert spans.holds() == []


def test_without_a_tracer_provider_no_span_is_built(no_tracer_provider: None) -> None:
    limiter = _limiter(1)
    assert current_tracer() is None
    with slot(limiter) as held:
        assert held._hold is not None
        assert held._hold.trace is None


def test_a_provider_set_after_slots_ran_is_used_from_the_next_slot_and_dropped_once_unset(
    no_tracer_provider: None,
) -> None:
    limiter = _limiter(1)
    with slot(limiter):
        pass
    recorded = set_tracer_provider()
    try:
        with slot(limiter):
            pass
        assert len(recorded.holds()) == 1
        unset_tracer_provider()
        with slot(limiter):
            pass
        assert len(recorded.holds()) == 1
        assert current_tracer() is None
    finally:
        recorded.provider.shutdown()


class _BrokenExporter(SpanProcessor):
    def on_end(self, span: ReadableSpan) -> None:
        raise RuntimeError("the collector is down")


def test_a_failing_span_processor_never_fails_a_slot_nor_keeps_its_slot(
    spans: RecordedSpans, caplog: pytest.LogCaptureFixture
) -> None:
    spans.provider.add_span_processor(_BrokenExporter())
    limiter = _limiter(1)
    with caplog.at_level(logging.DEBUG, logger="runcell_celery.tracing"):
        for _ in range(2):
            with slot(limiter):
                pass
    assert limiter.stats().active == 0
    assert any("recording a runcell span failed" in r.getMessage() for r in caplog.records)


def test_an_api_without_the_provider_global_is_asked_at_every_slot(
    no_tracer_provider: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fallback for an opentelemetry-api that renamed its private global: slower
    (get_tracer_provider() per slot), still right."""
    monkeypatch.setattr(tracer, "_peek", trace.get_tracer_provider)
    monkeypatch.setitem(DEFAULT_REGISTRY._values, "tracer", (object(), None))
    limiter = _limiter(1)
    with slot(limiter):
        pass
    assert current_tracer() is None
    recorded = set_tracer_provider()
    try:
        with slot(limiter):
            pass
        assert len(recorded.holds()) == 1
    finally:
        recorded.provider.shutdown()
