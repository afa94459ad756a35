"""OpenTelemetry spans for slot waits and holds (README, "Tracing").

Two spans per provider request, both children of whatever span is current when the
slot is entered (the Celery task's span under ``opentelemetry-instrumentation-celery``):

* ``runcell.slot.wait`` — from asking for the slot until the answer: granted,
  timed-out, queue-full, cancelled, config-error, limiter-error, deferred (the Celery
  run was parked; not a failure) or expired-before-start;
* ``runcell.slot.hold`` — from the grant until the slot is released, with the
  release's outcome (success, error, cancelled, timed-out, max-hold, lease-lost).

Attributes (all under ``runcell.``): ``limiter`` (the first limiter's name, a key's
limiter as ``tenant:acme``), ``limiters`` and ``workloads`` (every limiter of the
request, in the order given, and the workload used in each), ``workload``, ``key``,
``request_id``, ``run_id``, ``outcome``; once granted ``lease_id``,
``fencing_token`` (the first limiter's) and ``fencing_tokens`` (one per limiter);
on a wait that queued, ``queue.place`` (its place in its workload's line when it
joined it, from 1; over several limiters the largest of its places) and
``queue.expected_wait_ms`` when the limiter told them; ``preadmitted`` on a hold whose
slot was admitted before the run's body (its wait is the admission's wait span).

The place comes from the limiter, through the request's ``on_wait``
(:class:`~runcell_celery.protocol.OnWaitWithPlace`): the in-memory limiter counts its
line, the PostgreSQL limiter reads it from its acquire's answer (no extra round trip).
The request asks for it only while :func:`current_tracer` has a tracer, so nobody
counts a line for a span that will not be built.

Only ``opentelemetry-api`` is used, and only if installed (the ``otel`` extra). With
no tracer provider set (the API's default proxy, or a no-op provider) no span is
built: the runtime asks :func:`current_tracer`, which compares one module global of
the API with the answer it cached, so a provider set later is seen at the next slot.
The wait span is built when the wait ends, with the wait's start as its start time:
a granted wait costs nothing until then, and the runtime has one hook per outcome.

Neither span is made the current span: a slot may be held across a generator's
``yield`` (``guard`` around a stream), where a current span would leak into the
consumer's code. Spans of the provider call are siblings of the hold, inside its
time window. A tracing failure (a broken exporter) is logged and never fails a slot.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from .errors import (
    ConcurrencyConfigError,
    ConcurrencyQueueFullError,
    ConcurrencyTimeoutError,
)
from .events import describe_error
from .hold import is_interrupt
from .request import SlotRequest
from .several import default_key
from .tracer import OTEL_AVAILABLE, current_tracer

if OTEL_AVAILABLE:
    from opentelemetry import trace as otel_trace

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer
    from opentelemetry.util.types import AttributeValue

    from .hold import Hold
    from .ports import Parked
    from .protocol import Lease

__all__ = [
    "HOLD_SPAN",
    "OTEL_AVAILABLE",
    "WAIT_SPAN",
    "HoldSpan",
    "current_tracer",
    "start_hold",
    "wait_deferred",
    "wait_ended",
    "wait_failed",
    "wait_granted",
]

logger = logging.getLogger("runcell_celery.tracing")

WAIT_SPAN = "runcell.slot.wait"
HOLD_SPAN = "runcell.slot.hold"

#: Wait outcomes that are failures of the wait (the span's status is ERROR).
_FAILED_WAITS = frozenset(
    {"timed-out", "queue-full", "config-error", "limiter-error", "expired-before-start"}
)
#: Hold outcomes that end the provider call as a failure.
_FAILED_HOLDS = {
    "error": "the slot's body raised",
    "timed-out": "the run's time budget ended while the slot was held",
    "max-hold": "the slot was held past max_hold_ms",
    "lease-lost": "the slot's lease was lost",
}

# -- the hooks the slot runtime calls ------------------------------------------------------


class HoldSpan:
    """The open ``runcell.slot.hold`` span of one :class:`~runcell_celery.hold.Hold`."""

    __slots__ = ("_span",)

    def __init__(self, span: Span) -> None:
        self._span = span

    def end(self, outcome: str) -> None:
        """End the span with the release's ``outcome`` (never raises)."""
        try:
            span = self._span
            span.set_attribute("runcell.outcome", outcome)
            problem = _FAILED_HOLDS.get(outcome)
            if problem is not None:
                span.set_status(otel_trace.StatusCode.ERROR, problem)
            span.end()
        except Exception:
            _tracing_failed()


def start_hold(
    asked: SlotRequest, hold: Hold, started: float, waited_ms: float | None
) -> HoldSpan | None:
    """A slot was granted (``started``: when it asked, monotonic): record its wait and
    open its hold span. ``waited_ms`` set means the slot was admitted before the run's
    body: its wait was recorded then (:func:`wait_granted`), only the hold starts."""
    tracer = current_tracer()
    if tracer is None:
        return None
    try:
        leases = _leases_of(hold)
        if waited_ms is None:
            _record_wait(tracer, asked, started, "granted", leases=leases)
        attributes = _attributes(asked)
        attributes.update(_lease_attributes(leases))
        if waited_ms is not None:
            attributes["runcell.preadmitted"] = True
        return HoldSpan(tracer.start_span(HOLD_SPAN, attributes=attributes))
    except Exception:
        _tracing_failed()
        return None


def wait_granted(asked: SlotRequest, started: float, leases: Sequence[Lease]) -> None:
    """A run's first slot (``leases``: one per limiter) was granted before its body
    ran; the hold starts when a ``slot()`` adopts it."""
    tracer = current_tracer()
    if tracer is not None:
        _record_safely(tracer, asked, started, "granted", leases=leases)


def wait_failed(asked: SlotRequest, exc: BaseException, started: float) -> None:
    """The wait that began at ``started`` ended with ``exc`` instead of a slot."""
    tracer = current_tracer()
    if tracer is not None:
        _record_safely(tracer, asked, started, _wait_outcome(exc), error=exc)


def wait_deferred(asked: SlotRequest, started: float, parked: Parked | None) -> None:
    """The run was parked instead of waiting in the worker (Celery admission deferral):
    not a failure. ``parked`` tells its place in line when the limiter gave it."""
    tracer = current_tracer()
    if tracer is not None:
        _record_safely(tracer, asked, started, "deferred", parked=parked)


def wait_ended(asked: SlotRequest, started: float, outcome: str) -> None:
    """The wait ended with ``outcome`` and no exception of its own to describe (a
    grant whose lease expired before the body could start)."""
    tracer = current_tracer()
    if tracer is not None:
        _record_safely(tracer, asked, started, outcome)


# -- building spans ----------------------------------------------------------------------


def _record_safely(
    tracer: Tracer,
    asked: SlotRequest,
    started: float,
    outcome: str,
    *,
    leases: Sequence[Lease] = (),
    error: BaseException | None = None,
    parked: Parked | None = None,
) -> None:
    try:
        _record_wait(tracer, asked, started, outcome, leases=leases, error=error, parked=parked)
    except Exception:
        _tracing_failed()


def _record_wait(
    tracer: Tracer,
    asked: SlotRequest,
    started: float,
    outcome: str,
    *,
    leases: Sequence[Lease] = (),
    error: BaseException | None = None,
    parked: Parked | None = None,
) -> None:
    """One finished wait span: from ``started`` (monotonic, converted to wall time
    now) until now."""
    start_ns = time.time_ns() - int((time.monotonic() - started) * 1e9)
    attributes = _attributes(asked)
    attributes["runcell.outcome"] = outcome
    attributes.update(_lease_attributes(leases))
    attributes.update(_place_attributes(asked, parked))
    if error is not None and outcome in _FAILED_WAITS:
        attributes["error.type"] = type(error).__qualname__
    span = tracer.start_span(WAIT_SPAN, start_time=start_ns, attributes=attributes)
    if outcome in _FAILED_WAITS:
        description = describe_error(error) if error is not None else outcome
        span.set_status(otel_trace.StatusCode.ERROR, description)
    span.end()


def _attributes(asked: SlotRequest) -> dict[str, AttributeValue]:
    """What identifies the request: its limiters, workloads, key, request and run."""
    request = asked.request
    names = list(asked.names())
    workloads = [r.workload for r in asked.requests]
    if len(asked.limiters) > 1:
        key = asked.key
    else:
        key = request.key if request.key is not None else default_key((asked.limiter,))
    attributes: dict[str, AttributeValue] = {
        "runcell.limiter": names[0],
        "runcell.limiters": names,
        "runcell.workload": request.workload,
        "runcell.workloads": workloads,
        "runcell.request_id": request.request_id,
        "runcell.run_id": request.lineage.run_id,
    }
    if key is not None:
        attributes["runcell.key"] = key
    return attributes


def _place_attributes(asked: SlotRequest, parked: Parked | None) -> dict[str, AttributeValue]:
    """Where the request joined the line: as its limiter told the wait (``asked.place``),
    or as a deferral's answer told it (the same figures, kept with the parked run)."""
    if parked is not None and parked.place is not None:
        place, expected = parked.place, parked.expected_wait_ms
    elif asked.place is not None:
        place, expected = asked.place.place, asked.place.expected_wait_ms
    else:
        return {}
    attributes: dict[str, AttributeValue] = {"runcell.queue.place": place}
    if expected is not None:
        attributes["runcell.queue.expected_wait_ms"] = expected
    return attributes


def _lease_attributes(leases: Sequence[Lease]) -> dict[str, AttributeValue]:
    if not leases:
        return {}
    return {
        "runcell.lease_id": leases[0].lease_id,
        "runcell.fencing_token": leases[0].fencing_token,
        "runcell.fencing_tokens": [lease.fencing_token for lease in leases],
    }


def _leases_of(hold: Hold) -> Sequence[Lease]:
    return tuple(hold.leases)


def _wait_outcome(exc: BaseException) -> str:
    """The wait span's outcome for a wait that ended with ``exc`` (as its event says)."""
    if isinstance(exc, ConcurrencyTimeoutError):
        return "timed-out"
    if isinstance(exc, ConcurrencyQueueFullError):
        return "queue-full"
    if isinstance(exc, ConcurrencyConfigError):
        return "config-error"
    if is_interrupt(exc):  # a cancel, SIGTERM, Celery's SoftTimeLimitExceeded...
        return "cancelled"
    return "limiter-error"


_warned = False


def _tracing_failed() -> None:
    """Log a tracing failure: as a warning the first time, then quietly."""
    global _warned
    if _warned:
        logger.debug("recording a runcell span failed", exc_info=True)
        return
    _warned = True
    logger.warning(
        "recording a runcell span failed (the slot is unaffected; later failures are "
        "logged at DEBUG)",
        exc_info=True,
    )
