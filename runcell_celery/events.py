"""Structured events about slots, delivered to listeners.

One event per step of a slot's life (the fields each type carries: docs/slots.md,
"Errors and events"; over several limiters, "Several limits and keys"); listeners turn
them into logs, metrics or rows. Events never carry prompts, arguments or credentials
(``error`` is scrubbed). Listeners run in the emitting thread; one that raises is
logged, never breaking the run. With no listener no event is built at all.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Literal, get_args

from .background import DEFAULT_REGISTRY
from .redaction import scrub

__all__ = [
    "EVENT_TYPES",
    "ConcurrencyEvent",
    "EventListener",
    "EventType",
    "add_event_listener",
    "describe_error",
    "emit",
    "has_listeners",
    "remove_event_listener",
]

logger = logging.getLogger("runcell_celery.events")

# fmt: off
EventType = Literal[
    "wait-started", "acquired", "timed-out", "queue-full", "wait-cancelled", "limiter-error",
    "config-error", "released", "renewal-failed", "lease-lost", "release-failed",
]
# fmt: on
#: Every event type, in the order of a slot's life (see :class:`ConcurrencyEvent`).
EVENT_TYPES: tuple[EventType, ...] = get_args(EventType)


@dataclass(frozen=True, slots=True, kw_only=True)
class ConcurrencyEvent:
    """One step in a slot's life; fields that do not apply to the type are ``None``.

    :param timestamp: Unix time of the event (``deadline``: when the wait gives up).
    :param outcome: how the hold ended (``released``).
    :param reason: why a lease was lost: ``renewal``, ``max-hold`` or
        ``expired-before-start`` (the process stood still past the lease's life).
    :param limiters: every limiter of a request over several; ``None`` over one.
    """

    type: EventType
    limiter: str
    workload: str | None
    run_id: str | None
    root_run_id: str | None
    parent_run_id: str | None
    request_id: str | None
    timestamp: float
    deadline: float | None = None
    lease_id: str | None = None
    fencing_token: int | None = None
    wait_ms: float | None = None
    hold_ms: float | None = None
    outcome: str | None = None
    reason: str | None = None
    error: str | None = None
    holder_name: str | None = None
    limiters: tuple[str, ...] | None = None
    key: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """Return the event's fields, leaving out those that do not apply."""
        return {k: v for k, v in asdict(self).items() if v is not None}


EventListener = Callable[[ConcurrencyEvent], object]

_NONE: tuple[EventListener, ...] = ()


def _listeners() -> tuple[EventListener, ...]:
    # A tuple replaced whole (under the lock), so emit() reads it without locking.
    return DEFAULT_REGISTRY.value("events.listeners", _NONE)


def add_event_listener(listener: EventListener) -> None:
    """Deliver every event of this process to ``listener`` (added once)."""
    with DEFAULT_REGISTRY.lock("events.listeners"):
        if listener not in (listeners := _listeners()):
            DEFAULT_REGISTRY.put("events.listeners", (*listeners, listener))


def remove_event_listener(listener: EventListener) -> None:
    """Stop delivering events to ``listener``; unknown listeners are ignored."""
    with DEFAULT_REGISTRY.lock("events.listeners"):
        kept = tuple(x for x in _listeners() if x != listener)
        DEFAULT_REGISTRY.put("events.listeners", kept)


def has_listeners() -> bool:
    """Tell whether anyone listens (the runtime skips building events otherwise)."""
    return bool(_listeners())


def emit(event: ConcurrencyEvent) -> None:
    """Deliver ``event`` to every listener; a listener that raises is logged, not fatal."""
    for listener in _listeners():
        try:
            listener(event)
        except Exception:
            logger.exception("runcell event listener %r failed on %s", listener, event.type)


def describe_error(error: BaseException) -> str:
    """Return ``"ClassName: message"`` with anything that looks like a secret removed
    (:func:`runcell_celery.redaction.scrub`)."""
    return scrub(f"{type(error).__name__}: {error}")[:2000]
