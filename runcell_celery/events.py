"""Structured events about slots, delivered to listeners.

The runtime emits one event at each step of a slot's life; listeners turn them into
logs, metrics or rows (the Django app records them). Events identify the limiter, the
workload, the run lineage and the request, plus these extra fields (README, "Errors"):

============== ==============================
type           extra fields
============== ==============================
wait-started   deadline
acquired       lease_id, wait_ms, fencing_token
timed-out      wait_ms
queue-full     wait_ms
wait-cancelled wait_ms
limiter-error  wait_ms, error
config-error   error
released       lease_id, hold_ms, outcome
renewal-failed lease_id, error
lease-lost     lease_id, hold_ms, reason
release-failed lease_id, error
============== ==============================

An event of a request over several limiters (``slot(openai, gpt_4o,
tenants.key("acme"))``) is one event per step for the whole request: ``limiter`` is the
first limiter (for listeners that read one), ``limiters`` all of them in the order
given, ``key`` the request's fairness key; ``lease_id`` and ``fencing_token`` are the
first limiter's (a ``lease-lost`` names the lease that was lost). A one-limiter event
has ``limiters`` ``None`` and ``key`` only when the request gave one.

They never carry prompts, task arguments or credentials: ``error`` is the exception's
class and message with anything that looks like a password removed.

Listeners run in the thread that emits (the caller's, or the lease keeper's); one that
raises is logged and skipped, never breaking the run. With no listener registered the
runtime builds no event at all, so events cost nothing until someone listens.
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

EventType = Literal[
    "wait-started",
    "acquired",
    "timed-out",
    "queue-full",
    "wait-cancelled",
    "limiter-error",
    "config-error",
    "released",
    "renewal-failed",
    "lease-lost",
    "release-failed",
]
EVENT_TYPES: tuple[EventType, ...] = get_args(EventType)


@dataclass(frozen=True, slots=True, kw_only=True)
class ConcurrencyEvent:
    """One step in a slot's life. Fields that do not apply to the type are ``None``.

    :param timestamp: Unix time the event happened.
    :param deadline: Unix time the wait gives up (``wait-started``).
    :param wait_ms: how long the request waited before this outcome.
    :param hold_ms: how long the slot was held.
    :param outcome: how the hold ended (``released``): success, error, cancelled,
        timed-out, max-hold.
    :param reason: why a lease was lost: ``renewal`` (the limiter no longer held it or
        renewals failed past expiry), ``max-hold``, or ``expired-before-start`` (the
        process stood still between the grant and the body longer than the lease lives).
    :param error: the error's class and message (``limiter-error``, ``config-error``,
        ``renewal-failed``, ``release-failed``).
    :param limiters: every limiter of a request over several, in the order given
        (``limiter`` is the first); ``None`` for a request over one.
    :param key: the request's fairness key (a tenant), if any.
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
    text = scrub(f"{type(error).__name__}: {error}")
    return text[:2000]
