"""What a slot asks for: resolve the run and the ``slot()`` arguments into one request.

:func:`build_request` is the decision half of entering a slot, apart from the waiting
half so it can be tested without a limiter doing I/O; it touches no state.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any, TypeVar

from .cancellation import CancellationToken
from .config import DEFAULT_WORKLOAD
from .context import RunContext
from .errors import (
    ConcurrencyCancelledError,
    ConcurrencyConfigError,
    ConcurrencyError,
    ConcurrencyLeaseLostError,
    ConcurrencyNoLimiterError,
    ConcurrencyQueueFullError,
    ConcurrencyTimeoutError,
)
from .events import ConcurrencyEvent, EventType, describe_error, emit, has_listeners
from .ids import new_request_id
from .protocol import (
    AcquireRequest,
    ConcurrencyLimiter,
    Member,
    QueuePlace,
    RunLineage,
)
from .several import check_members, default_key, has_workload, resolve_workloads
from .tracer import current_tracer

__all__ = [
    "SlotRequest",
    "build_request",
    "failure_event_type",
    "report_failure",
    "report_refusal",
]

E = TypeVar("E", bound=ConcurrencyError)


class SlotRequest:
    """One resolved slot request over its ``members``, granted all together; also the
    limiter's ``on_wait`` (:class:`~runcell_celery.protocol.OnWaitWithPlace`). A plain
    slotted class, not a frozen dataclass: one is built per slot, on the hot path."""

    __slots__ = ("limiter", "limiters", "members", "place", "request", "requests", "run")

    def __init__(
        self,
        run: RunContext | None,
        limiters: tuple[ConcurrencyLimiter, ...],
        requests: tuple[AcquireRequest, ...],
    ) -> None:
        self.run = run
        self.limiters = limiters
        self.requests = requests
        self.limiter = limiters[0]
        self.request = requests[0]
        self.members = tuple(map(Member, limiters, requests))
        self.place: QueuePlace | None = None

    def __repr__(self) -> str:
        names = [limiter.name for limiter in self.limiters]
        return f"SlotRequest({names!r}, {self.request!r})"

    @property
    def key(self) -> str | None:
        return self.request.key

    def names(self) -> tuple[str, ...]:
        return tuple(limiter.name for limiter in self.limiters)

    def with_request_id(self, request_id: str) -> SlotRequest:
        if request_id == self.request.request_id:
            return self
        requests = tuple(dataclasses.replace(r, request_id=request_id) for r in self.requests)
        return SlotRequest(self.run, self.limiters, requests)

    def error(self, cls: type[E], message: str) -> E:
        return self.request.error(cls, message, limiter=self.limiter.name)

    def wait_started(self, deadline: float | None) -> None:
        if has_listeners():
            self.event("wait-started", deadline=deadline)

    __call__ = wait_started

    def wants_place(self) -> bool:
        """Only for a wait span (finding the place may mean counting a line)."""
        return current_tracer() is not None

    def placed(self, place: QueuePlace) -> None:
        self.place = place

    def event(self, type_: EventType, **extra: Any) -> None:
        if not has_listeners():
            return
        request = self.request
        lineage = request.lineage
        emit(
            ConcurrencyEvent(
                type=type_,
                limiter=self.limiter.name,
                limiters=self.names() if len(self.limiters) > 1 else None,
                workload=request.workload,
                run_id=lineage.run_id,
                root_run_id=lineage.root_run_id,
                parent_run_id=lineage.parent_run_id,
                request_id=request.request_id,
                timestamp=time.time(),
                holder_name=request.holder_name,
                key=request.key,
                **extra,
            )
        )


def build_request(
    run: RunContext | None,
    *limiters: ConcurrencyLimiter,
    workload: str | None = None,
    key: str | None = None,
    request_id: str | None = None,
    cancel: CancellationToken | None = None,
) -> SlotRequest:
    """Resolve a ``slot(*limiters)`` call made in ``run`` (``None``: outside any run)
    into one request; a cancelled run or a spent budget never asks. Every error names
    the request; report it with :func:`report_refusal`."""
    resolved_id = request_id or new_request_id()
    lineage = run.lineage if run is not None else RunLineage(resolved_id, resolved_id)
    if not limiters and run is not None:
        limiters = run.limiters
    if not limiters:
        raise ConcurrencyNoLimiterError(
            "slot() has no limiter: pass one, or call it inside run(limiter=...) or a RunCellTask",
            request_id=resolved_id,
            **dataclasses.asdict(lineage),
        )
    one = len(limiters) == 1
    lenient = not one
    if run is not None:
        key = run.key if key is None else key
        if workload is None and (limiters == run.limiters or (one and limiters[0] in run.limiters)):
            workload = run.workload
            lenient = len(run.limiters) > 1
    try:
        if one and lenient and workload is not None and not has_workload(limiters[0], workload):
            workload = None  # the run's workload applies where the limiter has it
        if not one:
            check_members(limiters)
            if key is None:  # a given key was checked where it entered (slot(), run())
                key = default_key(limiters)
        workloads = resolve_workloads(limiters, workload, strict=one)
    except ConcurrencyConfigError as exc:
        raise ConcurrencyConfigError(
            exc.message,
            limiter=limiters[0].name,
            workload=workload or DEFAULT_WORKLOAD if one else workload,
            request_id=resolved_id,
            **dataclasses.asdict(lineage),
        ) from None
    if run is None:
        requests = tuple(AcquireRequest(resolved_id, w, lineage, key=key) for w in workloads)
        remaining = run_cancel = None
    else:
        remaining = run.remaining_ms()
        run_cancel = run.cancel
        in_progress = run.progress.slots_taken > 0
        requests = tuple(
            AcquireRequest(resolved_id, w, lineage, remaining, run.name, in_progress, key)
            for w in workloads
        )
    resolved = SlotRequest(run, limiters, requests)
    if (cancel is not None and cancel.is_set()) or (run_cancel is not None and run_cancel.is_set()):
        raise resolved.error(
            ConcurrencyCancelledError, "the run was cancelled before it asked for a slot"
        )
    if remaining is not None and remaining <= 0:
        shown = ", ".join(repr(name) for name in resolved.names())
        asked = f"limiter {shown} for a slot" if one else f"limiters {shown} for slots"
        raise resolved.error(
            ConcurrencyTimeoutError, f"the run's time budget ended before it asked {asked}"
        )
    return resolved


def report_refusal(
    error: ConcurrencyError,
    run: RunContext | None,
    limiters: Sequence[ConcurrencyLimiter],
    key: str | None,
) -> None:
    """Emit the event for a request :func:`build_request` refused (over several
    ``limiters`` naming them and the ``key``)."""
    several = len(limiters) > 1
    report_failure(
        error,
        limiter=None,
        holder_name=run.name if run is not None else None,
        limiters=tuple(x.name for x in limiters) if several else None,
        key=key if several else None,
    )


def failure_event_type(error: ConcurrencyError) -> EventType:
    if isinstance(error, ConcurrencyConfigError):
        return "config-error"
    if isinstance(error, ConcurrencyTimeoutError):
        return "timed-out"
    if isinstance(error, ConcurrencyQueueFullError):
        return "queue-full"
    if isinstance(error, ConcurrencyLeaseLostError):
        return "lease-lost"
    if isinstance(error, ConcurrencyCancelledError):
        return "wait-cancelled"
    return "limiter-error"


def report_failure(
    error: ConcurrencyError,
    *,
    limiter: str | None,
    workload: str | None = None,
    holder_name: str | None = None,
    limiters: tuple[str, ...] | None = None,
    run_id: str | None = None,
    root_run_id: str | None = None,
    parent_run_id: str | None = None,
    key: str | None = None,
) -> EventType | None:
    """Emit the event of a run that stopped with ``error`` *before* it asked for a slot;
    the arguments name what the error does not. Returns the event's type, if emitted."""
    name = limiter or error.limiter
    if name is None or not has_listeners():
        return None
    type_ = failure_event_type(error)
    extra: dict[str, Any] = {}
    if type_ in ("config-error", "limiter-error"):
        extra["error"] = describe_error(error)
    if type_ != "config-error" and type_ != "lease-lost":
        extra["wait_ms"] = 0.0
    emit(
        ConcurrencyEvent(
            type=type_,
            limiter=name,
            limiters=limiters if limiters and len(limiters) > 1 else None,
            workload=error.workload or workload,
            run_id=error.run_id or run_id,
            root_run_id=error.root_run_id or root_run_id,
            parent_run_id=error.parent_run_id or parent_run_id,
            request_id=error.request_id,
            timestamp=time.time(),
            holder_name=holder_name,
            key=key,
            **extra,
        )
    )
    return type_
