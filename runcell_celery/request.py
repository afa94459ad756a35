"""What a slot asks for: resolve the run and the ``slot()`` arguments into one request.

:func:`build_request` is the decision half of entering a slot, kept apart from the
waiting half so it can be tested without a limiter doing any I/O: which limiters,
which workload in each (validated before anything waits), which request id, how much
of the run's budget is left, and whether the request may be made at all (a cancelled
run or a spent budget never asks; README, "Errors"). A request over one limiter is a
group of one. It touches no state: the slot adopts a pre-admitted slot afterwards.
"""

from __future__ import annotations

import dataclasses
import time
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
    """One resolved slot request: its ``members`` (``limiters`` and ``requests``, one
    request id, run and key; one limiter is a group of one), granted all together;
    ``limiter`` and ``request`` are the first's. ``run`` is ``None`` outside any run.

    It is also the limiter's ``on_wait`` (an
    :class:`~runcell_celery.protocol.OnWaitWithPlace`): it emits ``wait-started`` and
    keeps the place in line for the wait span. A plain slotted class, not a frozen
    dataclass: one is built per slot, on the hot path.
    """

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
        #: Where the request joined the line, when its limiter told (and a tracer asked).
        self.place: QueuePlace | None = None

    def __repr__(self) -> str:
        names = [limiter.name for limiter in self.limiters]
        return f"SlotRequest({names!r}, {self.request!r})"

    @property
    def key(self) -> str | None:
        """The request's fairness key."""
        return self.request.key

    def names(self) -> tuple[str, ...]:
        return tuple(limiter.name for limiter in self.limiters)

    def with_request_id(self, request_id: str) -> SlotRequest:
        """The same request under another request id (a pre-admitted lease's)."""
        if request_id == self.request.request_id:
            return self
        requests = tuple(dataclasses.replace(r, request_id=request_id) for r in self.requests)
        return SlotRequest(self.run, self.limiters, requests)

    def error(self, cls: type[E], message: str) -> E:
        """Build an error that names this request, its limiter and its run."""
        return self.request.error(cls, message, limiter=self.limiter.name)

    def wait_started(self, deadline: float | None) -> None:
        """The limiter's ``on_wait``: the request waits (``deadline``: Unix time)."""
        if has_listeners():
            self.event("wait-started", deadline=deadline)

    __call__ = wait_started

    def wants_place(self) -> bool:
        """Only for a wait span (finding the place may mean counting a line)."""
        return current_tracer() is not None

    def placed(self, place: QueuePlace) -> None:
        self.place = place

    def event(self, type_: EventType, **extra: Any) -> None:
        """Emit an event about this request (over several limiters naming them all)."""
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
    """Resolve a ``slot(*limiters)`` call made in ``run`` (``None``: outside any run, a
    one-slot run of its own) into one request over its members.

    ``limiters`` default to the run's. The workload defaults to the run's when the slot
    uses the run's limiters; over several limiters it applies in each that has it, the
    default elsewhere. ``key`` defaults to the run's (over several limiters, then to
    the key of a key's limiter among them). ``cancel`` is only read.

    :raises ConcurrencyNoLimiterError: no limiter.
    :raises ConcurrencyConfigError: an invalid workload, or limiters that cannot be held
        together (:func:`~runcell_celery.several.check_members`).
    :raises ConcurrencyCancelledError, ConcurrencyTimeoutError: the run (or slot) is
        already cancelled, or its budget spent.

    Every error names the request; report it with :func:`report_refusal`.
    """
    resolved_id = request_id or new_request_id()
    lineage = run.lineage if run is not None else RunLineage(resolved_id, resolved_id)
    if not limiters and run is not None:
        limiters = run.limiters
    if not limiters:
        raise ConcurrencyNoLimiterError(
            "slot() has no limiter: pass one, or call it inside run(limiter=...) or a RunCellTask",
            run_id=lineage.run_id,
            root_run_id=lineage.root_run_id,
            parent_run_id=lineage.parent_run_id,
            request_id=resolved_id,
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
            run_id=lineage.run_id,
            root_run_id=lineage.root_run_id,
            parent_run_id=lineage.parent_run_id,
            request_id=resolved_id,
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
        names = ", ".join(repr(name) for name in resolved.names())
        asked = f"limiter {names} for a slot" if one else f"limiters {names} for slots"
        raise resolved.error(
            ConcurrencyTimeoutError, f"the run's time budget ended before it asked {asked}"
        )
    return resolved


def report_refusal(
    error: ConcurrencyError,
    holder_name: str | None,
    *,
    limiters: tuple[str, ...] | None = None,
    key: str | None = None,
) -> None:
    """Emit the event for a request :func:`build_request` refused (none without a
    limiter: there is no limiter to report it under)."""
    report_failure(error, limiter=None, holder_name=holder_name, limiters=limiters, key=key)


def failure_event_type(error: ConcurrencyError) -> EventType:
    """The event that says a run stopped with ``error``: ``config-error``,
    ``timed-out``, ``queue-full``, ``lease-lost``, ``wait-cancelled``, else
    ``limiter-error`` (the limiter or its database failed)."""
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
    """Emit the event of a run that stopped with ``error`` *before* it asked for a slot
    (its first start, its options, its headers, or a refused request).

    ``limiter``, ``workload`` and the lineage name what the run was to use when the
    error names none. Returns the event's type, or ``None`` when none was emitted
    (nobody listens, or there is no limiter to report it under).
    """
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
