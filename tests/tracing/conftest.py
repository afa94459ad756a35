"""A real OpenTelemetry SDK tracer provider for a test, and none after it.

The provider is the process's global one (what the library and the Celery
instrumentation read); its spans go to the SDK's in-memory exporter. At teardown the
API's globals are put back as they were before anyone set a provider (what
OpenTelemetry's own test utilities do), so the tests after run with no provider.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.util._once import Once

from runcell_celery.tracing import HOLD_SPAN, WAIT_SPAN


class RecordedSpans:
    """The spans a test's provider finished, with lookups by name."""

    def __init__(self, provider: TracerProvider, exporter: InMemorySpanExporter) -> None:
        self.provider = provider
        self.exporter = exporter

    def all(self) -> list[ReadableSpan]:
        return list(self.exporter.get_finished_spans())

    def named(self, name: str) -> list[ReadableSpan]:
        return [span for span in self.all() if span.name == name]

    def waits(self) -> list[ReadableSpan]:
        return self.named(WAIT_SPAN)

    def holds(self) -> list[ReadableSpan]:
        return self.named(HOLD_SPAN)


def unset_tracer_provider() -> None:
    """Back to no provider at all: the API's proxy, as in a process that never set one."""
    trace._TRACER_PROVIDER = None
    trace._TRACER_PROVIDER_SET_ONCE = Once()


def set_tracer_provider() -> RecordedSpans:
    """Set a global SDK provider that keeps every finished span in memory."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    unset_tracer_provider()
    trace.set_tracer_provider(provider)
    return RecordedSpans(provider, exporter)


@pytest.fixture
def spans() -> Iterator[RecordedSpans]:
    """The global tracer provider for this test; no provider again afterwards."""
    recorded = set_tracer_provider()
    try:
        yield recorded
    finally:
        recorded.provider.shutdown()
        unset_tracer_provider()


@pytest.fixture
def no_tracer_provider() -> Iterator[None]:
    """No global tracer provider during the test (and none after it)."""
    unset_tracer_provider()
    try:
        yield
    finally:
        unset_tracer_provider()
