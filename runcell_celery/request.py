"""What a slot asks for: resolve the run and the ``slot()`` arguments into one request.

:func:`build_request` is the decision half of entering a slot, kept apart from the
waiting half so it can be read and tested without a limiter doing any I/O: which
limiter, which workload (validated before anything waits), which request id, how
much of the run's budget is left, and whether the request may be made at all (a
cancelled run or a spent budget never asks; README, "Errors").

It touches no state: a run's first slot, admitted before the run's body
(:mod:`runcell_celery.admission`), is adopted by :class:`~runcell_celery.slot.Slot`
after the request is resolved.
"""

from __future__ import annotations

import time
from typing import Any, TypeVar, cast

from .cancellation import CancellationToken
from .config import DEFAULT_WORKLOAD
from .context import RunContext
from .errors import (
    ConcurrencyCancelledError,
    ConcurrencyConfigError,
    ConcurrencyError,
    ConcurrencyTimeoutError,
)
from .events import ConcurrencyEvent, EventType, describe_error, emit, has_listeners
from .ids import new_request_id
from .protocol import (
    AcquireRequest,
    ConcurrencyLimiter,
    RunLineage,
    SupportsValidateWorkload,
    supports,
)

__all__ = ["SlotRequest", "build_request", "report_refusal"]

E = TypeVar("E", bound=ConcurrencyError)


class SlotRequest:
    """One resolved slot request: what to ask, of which limiter, for which run.

    :param run: the run the slot belongs to; ``None`` outside any run (the slot is
        then a one-slot run of its own: its run id is its request id).
    :param limiter: the limiter to ask.
    :param request: the request to send it.

    A plain slotted class rather than a frozen dataclass: one is built per slot, on
    the hot path, and a frozen dataclass pays an ``object.__setattr__`` per field.
    """

    __slots__ = ("limiter", "request", "run")

    def __init__(
        self, run: RunContext | None, limiter: ConcurrencyLimiter, request: AcquireRequest
    ) -> None:
        self.run = run
        self.limiter = limiter
        self.request = request

    def __repr__(self) -> str:
        return f"SlotRequest({self.limiter.name!r}, {self.request!r})"

    def error(self, cls: type[E], message: str) -> E:
        """Build an error that names this request, its limiter and its run."""
        return self.request.error(cls, message, limiter=self.limiter.name)

    def wait_started(self, deadline: float | None) -> None:
        """The limiter's ``on_wait``: the request waits (``deadline``: Unix time)."""
        if has_listeners():
            self.event("wait-started", deadline=deadline)

    def event(self, type_: EventType, **extra: Any) -> None:
        """Emit an event about this request (nothing to build when nobody listens)."""
        if not has_listeners():
            return
        request = self.request
        lineage = request.lineage
        emit(
            ConcurrencyEvent(
                type=type_,
                limiter=self.limiter.name,
                workload=request.workload,
                run_id=lineage.run_id,
                root_run_id=lineage.root_run_id,
                parent_run_id=lineage.parent_run_id,
                request_id=request.request_id,
                timestamp=time.time(),
                holder_name=request.holder_name,
                **extra,
            )
        )


def build_request(
    run: RunContext | None,
    limiter: ConcurrencyLimiter | None = None,
    *,
    workload: str | None = None,
    request_id: str | None = None,
    cancel: CancellationToken | None = None,
) -> SlotRequest:
    """Resolve a ``slot()`` call made in ``run`` into the request to send.

    :param run: the current run, or ``None`` outside any run (the slot is then a
        one-slot run of its own, its run id the request id).
    :param limiter: the limiter the slot names; defaults to the run's.
    :param workload: the workload the slot selects; defaults to the run's when the
        slot uses the run's limiter, then to the limiter's default.
    :param request_id: a stable request id; defaults to a new one.
    :param cancel: the slot's own token (only read: a set one refuses the request).
    :raises ConcurrencyConfigError: no limiter, or the workload is invalid.
    :raises ConcurrencyCancelledError: the run or the slot is already cancelled.
    :raises ConcurrencyTimeoutError: the run's budget is already spent.

    Every error names the request (limiter, workload, run lineage, request id); report
    it with :func:`report_refusal`.
    """
    if run is None:
        return _outside_any_run(limiter, workload, request_id, cancel)
    if limiter is None:
        limiter = run.limiter
    resolved_id = request_id or new_request_id()
    if limiter is None:
        raise ConcurrencyConfigError(
            "slot() has no limiter: pass one, or call it inside run(limiter=...) or a RunCellTask",
            run_id=run.run_id,
            root_run_id=run.root_run_id,
            parent_run_id=run.parent_run_id,
            request_id=resolved_id,
        )
    if workload is None and limiter is run.limiter:
        workload = run.workload
    remaining = run.remaining_ms()
    lineage = run.lineage
    request = AcquireRequest(
        request_id=resolved_id,
        workload=_validated(limiter, workload, resolved_id, lineage, run.name),
        lineage=lineage,
        timeout_ms=remaining,
        holder_name=run.name,
        in_progress=run.progress.slots_taken > 0,
    )
    resolved = SlotRequest(run, limiter, request)
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
) -> SlotRequest:
    # A slot outside any run is a one-slot run of its own: its run id is the request
    # id. No RunContext is built for it (the hot path of a bare ``with slot(lim)``).
    resolved_id = request_id or new_request_id()
    lineage = RunLineage(resolved_id, resolved_id)
    if limiter is None:
        raise ConcurrencyConfigError(
            "slot() has no limiter: pass one, or call it inside run(limiter=...) or a RunCellTask",
            run_id=resolved_id,
            root_run_id=resolved_id,
            request_id=resolved_id,
        )
    request = AcquireRequest(
        resolved_id, _validated(limiter, workload, resolved_id, lineage, None), lineage
    )
    resolved = SlotRequest(None, limiter, request)
    if cancel is not None and cancel.is_set():
        raise resolved.error(
            ConcurrencyCancelledError, "the run was cancelled before it asked for a slot"
        )
    return resolved


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


def report_refusal(error: ConcurrencyError, holder_name: str | None) -> None:
    """Emit the event for a request :func:`build_request` refused (none without a
    limiter: there is no limiter to report it under)."""
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
            **extra,
        )
    )
