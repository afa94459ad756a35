"""What a slot asks for: resolve the run and the ``slot()`` arguments into one request.

:func:`build_request` is the decision half of entering a slot, kept apart from the
waiting half so it can be read and tested without a limiter doing any I/O: which
limiter, which workload (validated before anything waits), which request id, how
much of the run's budget is left, and whether the request may be made at all (a
cancelled run or a spent budget never asks; README, "Errors").

It touches no state: a run's first slot, admitted before the run's body
(:mod:`runcell_celery.admission`), is adopted by :class:`~runcell_celery.slot.Slot`
after the request is resolved.

A request over several limiters (``slot(openai, gpt_4o, tenants.key("acme"))``) is
resolved by :func:`build_several` into a :class:`SlotRequest` over all of them (a
request over one limiter is a group of one): one request id and
run, one :class:`~runcell_celery.protocol.AcquireRequest` per limiter with the workload
it uses there (:func:`~runcell_celery.several.resolve_workloads`), and the fairness key.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, TypeVar, cast

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
    QueuePlace,
    RunLineage,
    SupportsValidateWorkload,
    supports,
)
from .several import check_several, default_key, resolve_workloads
from .tracer import current_tracer

__all__ = [
    "SlotRequest",
    "build_request",
    "build_several",
    "failure_event_type",
    "report_failure",
    "report_refusal",
]

E = TypeVar("E", bound=ConcurrencyError)


class SlotRequest:
    """One resolved slot request: what to ask, of which limiters, for which run.

    A request over one limiter is a request over a group of one: ``limiters`` and
    ``requests`` are all of them, in the order given (one request per limiter, all with
    one request id, run and key), granted all together or not at all; ``limiter`` and
    ``request`` are the first one's (what errors and one-limiter listeners read).

    :param run: the run the slot belongs to; ``None`` outside any run (the slot is
        then a one-slot run of its own: its run id is its request id).
    :param limiters: the limiters to ask.
    :param requests: the request to send each.

    It is also the limiter's ``on_wait`` for its request (an
    :class:`~runcell_celery.protocol.OnWaitWithPlace`): called, it emits
    ``wait-started``; told the request's place in line, it keeps it in ``place`` for
    the wait span (asked for only while a tracer records spans).

    A plain slotted class rather than a frozen dataclass: one is built per slot, on
    the hot path, and a frozen dataclass pays an ``object.__setattr__`` per field.
    """

    __slots__ = ("limiter", "limiters", "place", "request", "requests", "run")

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
        #: Where the request joined the line, when its limiter told (and a tracer asked).
        self.place: QueuePlace | None = None

    def __repr__(self) -> str:
        names = [limiter.name for limiter in self.limiters]
        return f"SlotRequest({names!r}, {self.request!r})"

    @property
    def key(self) -> str | None:
        """The request's fairness key."""
        return self.request.key

    @property
    def several(self) -> bool:
        """Whether it names more than one limiter."""
        return len(self.limiters) > 1

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
        """Whether the limiter should find the request's place: only for a wait span
        (finding it may mean counting a line)."""
        return current_tracer() is not None

    def placed(self, place: QueuePlace) -> None:
        """The limiter's answer to :meth:`wants_place`: where the request joined the line."""
        self.place = place

    def event(self, type_: EventType, **extra: Any) -> None:
        """Emit an event about this request (nothing to build when nobody listens);
        one over several limiters names them all (``limiters``)."""
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


def build_several(
    run: RunContext | None,
    limiters: tuple[ConcurrencyLimiter, ...],
    *,
    workload: str | None = None,
    key: str | None = None,
    request_id: str | None = None,
    cancel: CancellationToken | None = None,
) -> SlotRequest:
    """Resolve ``slot(a, b, ...)`` made in ``run`` into one request over the limiters.

    :param limiters: at least two limiters, in the order given.
    :param workload: the workload the request selects (defaults to the run's when the
        limiters are the run's); it applies in every limiter that has it, the
        limiter's default in the others.
    :param key: the fairness key (defaults to the run's, then to the key of a key's
        limiter among ``limiters``, ``tenants.key("acme")`` -> ``"acme"``).
    :raises ConcurrencyConfigError: a keyed limiter itself, the same limiter twice,
        limiters that cannot be held together, or a workload none of them has.
    :raises ConcurrencyCancelledError, ConcurrencyTimeoutError: as :func:`build_request`.
    """
    resolved_id = request_id or new_request_id()
    lineage = run.lineage if run is not None else RunLineage(resolved_id, resolved_id)
    if run is not None and workload is None and limiters == run.limiters:
        workload = run.workload
    if key is None and run is not None:
        key = run.key
    try:
        check_several(limiters)
        if key is None:  # a given key was checked where it entered (slot(), run())
            key = default_key(limiters)
        workloads = resolve_workloads(limiters, workload)
    except ConcurrencyConfigError as exc:
        raise ConcurrencyConfigError(
            exc.message,
            limiter=limiters[0].name,
            workload=workload,
            run_id=lineage.run_id,
            root_run_id=lineage.root_run_id,
            parent_run_id=lineage.parent_run_id,
            request_id=resolved_id,
        ) from None
    remaining = run.remaining_ms() if run is not None else None
    requests = tuple(
        AcquireRequest(
            request_id=resolved_id,
            workload=name,
            lineage=lineage,
            timeout_ms=remaining,
            holder_name=run.name if run is not None else None,
            in_progress=run is not None and run.progress.slots_taken > 0,
            key=key,
        )
        for name in workloads
    )
    resolved = SlotRequest(run, limiters, requests)
    run_cancel = run.cancel if run is not None else None
    if (cancel is not None and cancel.is_set()) or (run_cancel is not None and run_cancel.is_set()):
        raise resolved.error(
            ConcurrencyCancelledError, "the run was cancelled before it asked for a slot"
        )
    if remaining is not None and remaining <= 0:
        names = ", ".join(repr(name) for name in resolved.names())
        raise resolved.error(
            ConcurrencyTimeoutError,
            f"the run's time budget ended before it asked limiters {names} for slots",
        )
    return resolved


def build_request(
    run: RunContext | None,
    limiter: ConcurrencyLimiter | None = None,
    *,
    workload: str | None = None,
    request_id: str | None = None,
    cancel: CancellationToken | None = None,
    key: str | None = None,
) -> SlotRequest:
    """Resolve a ``slot()`` call made in ``run`` into the request to send.

    :param run: the current run, or ``None`` outside any run (the slot is then a
        one-slot run of its own, its run id the request id).
    :param limiter: the limiter the slot names; defaults to the run's.
    :param workload: the workload the slot selects; defaults to the run's when the
        slot uses the run's limiter, then to the limiter's default.
    :param request_id: a stable request id; defaults to a new one.
    :param cancel: the slot's own token (only read: a set one refuses the request).
    :param key: the request's fairness key (defaults to the run's).
    :raises ConcurrencyConfigError: no limiter, or the workload is invalid.
    :raises ConcurrencyCancelledError: the run or the slot is already cancelled.
    :raises ConcurrencyTimeoutError: the run's budget is already spent.

    Every error names the request (limiter, workload, run lineage, request id); report
    it with :func:`report_refusal`.
    """
    if run is None:
        return _outside_any_run(limiter, workload, request_id, cancel, key)
    if limiter is None:
        limiter = run.limiter
    resolved_id = request_id or new_request_id()
    if limiter is None:
        raise ConcurrencyNoLimiterError(
            "slot() has no limiter: pass one, or call it inside run(limiter=...) or a RunCellTask",
            run_id=run.run_id,
            root_run_id=run.root_run_id,
            parent_run_id=run.parent_run_id,
            request_id=resolved_id,
        )
    if workload is None and limiter is run.limiter:
        workload = run.workload
        if workload is not None and len(run.limiters) > 1:
            # The run's workload applies where this limiter has it, else its default.
            workload = _workload_here(limiter, workload)
    elif workload is None and len(run.limiters) > 1 and limiter in run.limiters:
        workload = None if run.workload is None else _workload_here(limiter, run.workload)
    remaining = run.remaining_ms()
    lineage = run.lineage
    request = AcquireRequest(
        request_id=resolved_id,
        workload=_validated(limiter, workload, resolved_id, lineage, run.name),
        lineage=lineage,
        timeout_ms=remaining,
        holder_name=run.name,
        in_progress=run.progress.slots_taken > 0,
        key=key if key is not None else run.key,
    )
    resolved = SlotRequest(run, (limiter,), (request,))
    if (cancel is not None and cancel.is_set()) or (run.cancel is not None and run.cancel.is_set()):
        raise resolved.error(
            ConcurrencyCancelledError, "the run was cancelled before it asked for a slot"
        )
    if remaining is not None and remaining <= 0:
        raise resolved.error(
            ConcurrencyTimeoutError,
            f"the run's time budget ended before it asked limiter {limiter.name!r} for a slot",
        )
    return resolved


def _outside_any_run(
    limiter: ConcurrencyLimiter | None,
    workload: str | None,
    request_id: str | None,
    cancel: CancellationToken | None,
    key: str | None,
) -> SlotRequest:
    # A slot outside any run is a one-slot run of its own: its run id is the request
    # id. No RunContext is built for it (the hot path of a bare ``with slot(lim)``).
    resolved_id = request_id or new_request_id()
    lineage = RunLineage(resolved_id, resolved_id)
    if limiter is None:
        raise ConcurrencyNoLimiterError(
            "slot() has no limiter: pass one, or call it inside run(limiter=...) or a RunCellTask",
            run_id=resolved_id,
            root_run_id=resolved_id,
            request_id=resolved_id,
        )
    workload = _validated(limiter, workload, resolved_id, lineage, None)
    if key is None:  # the hot path: no keyword to pass
        request = AcquireRequest(resolved_id, workload, lineage)
    else:
        request = AcquireRequest(resolved_id, workload, lineage, key=key)
    resolved = SlotRequest(None, (limiter,), (request,))
    if cancel is not None and cancel.is_set():
        raise resolved.error(
            ConcurrencyCancelledError, "the run was cancelled before it asked for a slot"
        )
    return resolved


def _workload_here(limiter: ConcurrencyLimiter, workload: str) -> str | None:
    """``workload`` if ``limiter`` has it, else ``None`` (its default)."""
    try:
        return resolve_workloads((limiter,), workload)[0]
    except ConcurrencyConfigError:
        return None


def _validated(
    limiter: ConcurrencyLimiter,
    workload: str | None,
    request_id: str,
    lineage: RunLineage,
    holder_name: str | None,
) -> str:
    """The workload the limiter resolves ``workload`` to (an error names the request)."""
    try:
        if supports(limiter, SupportsValidateWorkload):
            workload = cast(SupportsValidateWorkload, limiter).validate_workload(workload)
    except ConcurrencyConfigError as exc:
        request = AcquireRequest(
            request_id, workload or DEFAULT_WORKLOAD, lineage, holder_name=holder_name
        )
        raise request.error(ConcurrencyConfigError, exc.message, limiter=limiter.name) from None
    return workload or DEFAULT_WORKLOAD


def report_refusal(
    error: ConcurrencyError,
    holder_name: str | None,
    *,
    limiters: tuple[str, ...] | None = None,
    key: str | None = None,
) -> None:
    """Emit the event for a request :func:`build_request` (or :func:`build_several`,
    with its ``limiters`` and ``key``) refused (none without a limiter: there is no
    limiter to report it under)."""
    if error.limiter is None or not has_listeners():
        return
    extra: dict[str, Any]
    if isinstance(error, ConcurrencyConfigError):
        type_: EventType = "config-error"
        extra = {"error": describe_error(error)}
    elif isinstance(error, ConcurrencyCancelledError):
        type_, extra = "wait-cancelled", {"wait_ms": 0.0}
    else:
        type_, extra = "timed-out", {"wait_ms": 0.0}
    emit(
        ConcurrencyEvent(
            type=type_,
            limiter=error.limiter,
            workload=error.workload,
            run_id=error.run_id,
            root_run_id=error.root_run_id,
            parent_run_id=error.parent_run_id,
            request_id=error.request_id,
            timestamp=time.time(),
            holder_name=holder_name,
            limiters=limiters,
            key=key,
            **extra,
        )
    )


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
) -> EventType | None:
    """Emit the event of a run that stopped with ``error`` *before* it asked for a slot
    (its first start, its options, its headers): a slot's own failures emit theirs.

    ``limiter``, ``workload`` and the run lineage name what the run was to use, and
    which run it was, when the error names none (a limiter that could not be built
    knows no run). Returns the event's type, or ``None`` when none was emitted (nobody listens,
    or there is no limiter to report it under).
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
            **extra,
        )
    )
    return type_
