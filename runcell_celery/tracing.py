"""OpenTelemetry spans for slot waits and holds (docs/metrics.md, "Tracing").

``runcell.slot.wait`` runs from asking for a slot until the answer, ``runcell.slot.hold``
from the grant until the release (their attributes: that section). With no provider set
(``opentelemetry-api`` missing, its proxy or a no-op provider) nothing is built, and a
wait span only once the wait ends. Neither span is made current: a slot may be held
across a generator's ``yield``, where a current span would leak into the consumer's
code. A tracing failure is logged and never fails a slot.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING

from .background import DEFAULT_REGISTRY
from .errors import ConcurrencyError
from .events import describe_error
from .hold import is_interrupt
from .request import SlotRequest, failure_event_type
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
_FAILED_HOLDS = MappingProxyType(
    {
        "error": "the slot's body raised",
        "timed-out": "the run's time budget ended while the slot was held",
        "max-hold": "the slot was held past max_hold_ms",
        "lease-lost": "the slot's lease was lost",
    }
)


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
    """A slot was granted: record its wait (unless ``waited_ms`` says it was admitted
    before the run's body, its wait recorded then) and open its hold span."""
    tracer = current_tracer()
    if tracer is None:
        return None
    try:
        leases = tuple(hold.leases)
        attributes = _attributes(asked, leases)
        if waited_ms is None:
            _record_wait(asked, started, "granted", tracer=tracer, leases=leases)
        else:
            attributes["runcell.preadmitted"] = True
        return HoldSpan(tracer.start_span(HOLD_SPAN, attributes=attributes))
    except Exception:
        _tracing_failed()
        return None


def wait_granted(asked: SlotRequest, started: float, leases: Sequence[Lease]) -> None:
    """A run's first slot was granted before its body ran (its hold starts later)."""
    _record_wait(asked, started, "granted", leases=leases)


def wait_failed(asked: SlotRequest, exc: BaseException, started: float) -> None:
    """The wait that began at ``started`` ended with ``exc`` instead of a slot."""
    _record_wait(asked, started, _wait_outcome(exc), error=exc)


def wait_deferred(asked: SlotRequest, started: float, parked: Parked | None) -> None:
    """The run was parked instead of waiting in the worker (not a failure)."""
    _record_wait(asked, started, "deferred", parked=parked)


def wait_ended(asked: SlotRequest, started: float, outcome: str) -> None:
    """The wait ended with ``outcome`` and no exception to describe (a grant whose
    lease expired before the body could start)."""
    _record_wait(asked, started, outcome)


def _record_wait(
    asked: SlotRequest,
    started: float,
    outcome: str,
    *,
    tracer: Tracer | None = None,
    leases: Sequence[Lease] = (),
    error: BaseException | None = None,
    parked: Parked | None = None,
) -> None:
    """One finished wait span from ``started`` (monotonic) until now; never raises."""
    tracer = tracer or current_tracer()
    if tracer is None:
        return
    try:
        start_ns = time.time_ns() - int((time.monotonic() - started) * 1e9)
        attributes = _attributes(asked, leases)
        attributes["runcell.outcome"] = outcome
        # Where the request joined the line, as the deferral's answer or the wait told it.
        where = parked if parked is not None and parked.place is not None else asked.place
        if where is not None and where.place is not None:
            attributes["runcell.queue.place"] = where.place
            if where.expected_wait_ms is not None:
                attributes["runcell.queue.expected_wait_ms"] = where.expected_wait_ms
        if error is not None and outcome in _FAILED_WAITS:
            attributes["error.type"] = type(error).__qualname__
        span = tracer.start_span(WAIT_SPAN, start_time=start_ns, attributes=attributes)
        if outcome in _FAILED_WAITS:
            description = describe_error(error) if error is not None else outcome
            span.set_status(otel_trace.StatusCode.ERROR, description)
        span.end()
    except Exception:
        _tracing_failed()


def _attributes(asked: SlotRequest, leases: Sequence[Lease]) -> dict[str, AttributeValue]:
    request = asked.request
    names = list(asked.names())
    if len(asked.limiters) > 1:
        key = asked.key
    else:
        key = request.key if request.key is not None else default_key((asked.limiter,))
    attributes: dict[str, AttributeValue] = {
        "runcell.limiter": names[0],
        "runcell.limiters": names,
        "runcell.workload": request.workload,
        "runcell.workloads": [r.workload for r in asked.requests],
        "runcell.request_id": request.request_id,
        "runcell.run_id": request.lineage.run_id,
    }
    if key is not None:
        attributes["runcell.key"] = key
    if leases:
        attributes["runcell.lease_id"] = leases[0].lease_id
        attributes["runcell.fencing_token"] = leases[0].fencing_token
        attributes["runcell.fencing_tokens"] = [lease.fencing_token for lease in leases]
    return attributes


def _wait_outcome(exc: BaseException) -> str:
    kind = failure_event_type(exc) if isinstance(exc, ConcurrencyError) else None
    if kind in ("timed-out", "queue-full", "config-error"):
        return kind
    # A cancel, SIGTERM, Celery's SoftTimeLimitExceeded...
    return "cancelled" if is_interrupt(exc) else "limiter-error"


def _tracing_failed() -> None:
    """Log a tracing failure: a warning the first time, then at DEBUG."""
    if DEFAULT_REGISTRY.value("tracing.warned", False):
        logger.debug("recording a runcell span failed", exc_info=True)
        return
    DEFAULT_REGISTRY.put("tracing.warned", True)
    logger.warning(
        "recording a runcell span failed (the slot is unaffected; later failures are "
        "logged at DEBUG)",
        exc_info=True,
    )
