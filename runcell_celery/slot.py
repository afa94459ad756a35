"""The slot runtime: take a slot before a provider request, give it back after.

:func:`slot` owns a slot's whole life, as the spec's runtime does:

1. **Acquire** with a deadline of ``min(workload max_wait_ms, run's remaining
   timeout_ms)`` and the run's cancellation. A slot granted at the moment of a cancel
   or timeout is returned to the limiter, never leaked.
2. **Keep** it: the process's one lease keeper renews it about every third of its
   TTL and fires ``max_hold_ms`` and the run's deadline.
3. **Abort** when the lease is lost, ``max_hold_ms`` passes, the run is cancelled or
   its budget ends: abort callbacks run (``slot.on_abort(response.close)``), an
   ``async with`` body is cancelled, and the hold ends with the matching
   :class:`~runcell_celery.errors.ConcurrencyError` instead of its result, so the
   result of a call that ran without a valid slot is never returned as a success.
   A thread cannot be interrupted safely from outside, so a sync body learns of the
   abort through its callbacks or ``slot.aborted`` and is failed when it exits.
4. **Release** exactly once, with an outcome; a failed release emits
   ``release-failed`` and the run continues.

Every step emits its event (see :mod:`runcell_celery.events`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any, Literal, ParamSpec, TypeVar

from .admission import Admission, SlotDeferred
from .cancellation import CancellationToken
from .config import DEFAULT_WORKLOAD
from .context import RunContext, current_run
from .errors import (
    ConcurrencyCancelledError,
    ConcurrencyConfigError,
    ConcurrencyError,
    ConcurrencyLeaseLostError,
    ConcurrencyLimiterError,
    ConcurrencyQueueFullError,
    ConcurrencyTimeoutError,
)
from .events import ConcurrencyEvent, EventType, describe_error, emit, has_listeners
from .ids import new_request_id
from .keeper import get_keeper
from .protocol import AcquireRequest, ConcurrencyLimiter, Lease, Outcome

__all__ = ["Slot", "is_interrupt", "register_interrupt", "slot"]

logger = logging.getLogger("runcell_celery.slot")

P = ParamSpec("P")
R = TypeVar("R")

AbortReason = Literal["lease-lost", "max-hold", "cancelled", "timed-out"]

_WAIT_FAILURE_EVENTS: tuple[tuple[type[ConcurrencyError], EventType], ...] = (
    (ConcurrencyTimeoutError, "timed-out"),
    (ConcurrencyQueueFullError, "queue-full"),
    (ConcurrencyCancelledError, "wait-cancelled"),
    (ConcurrencyConfigError, "config-error"),
)


_interrupts: tuple[type[BaseException], ...] = ()


def register_interrupt(exc_type: type[BaseException]) -> None:
    """Treat ``exc_type`` as a cancellation, not a failure, wherever it interrupts a slot.

    Anything that is not an ``Exception`` (``SystemExit`` from a terminating signal,
    ``KeyboardInterrupt``, asyncio's ``CancelledError``, ``GeneratorExit`` of a stream
    closed early) already is; the Celery integration registers ``SoftTimeLimitExceeded``
    and ``Terminated``.
    """
    global _interrupts
    if exc_type not in _interrupts:
        _interrupts = (*_interrupts, exc_type)


def is_interrupt(exc: BaseException) -> bool:
    """Tell whether ``exc`` stops the run from outside (a cancellation of some kind)."""
    return not isinstance(exc, Exception) or isinstance(
        exc, (ConcurrencyCancelledError, *_interrupts)
    )


def _outcome_of(exc: BaseException | None) -> Outcome:
    if exc is None:
        return "success"
    if is_interrupt(exc):
        return "cancelled"
    return "error"


class Slot:
    """One slot for one provider request; a sync and async context manager.

    Use :func:`slot` to make one. Inside the block it is the handle of the held slot:
    ``lease``, ``fencing_token`` (pass it to a provider proxy that fences stale
    holders), ``aborted`` and :meth:`on_abort`.
    """

    # Set when the slot is entered.
    _run: RunContext
    _admission: Admission | None
    _limiter: ConcurrencyLimiter
    _request: AcquireRequest
    _cancel: CancellationToken | None

    def __init__(
        self,
        limiter: ConcurrencyLimiter | None = None,
        *,
        workload: str | None = None,
        max_hold_ms: int | None = None,
        cancel: CancellationToken | None = None,
        request_id: str | None = None,
    ) -> None:
        self._limiter_arg = limiter
        self._workload_arg = workload
        self._max_hold_ms = max_hold_ms
        self._cancel_arg = cancel
        self._request_id = request_id
        self.lease: Lease | None = None
        self._state = threading.Lock()
        self._phase: Literal["new", "held", "done"] = "new"
        self._abort_reason: AbortReason | None = None
        self._abort_error: BaseException | None = None
        self._released = False
        self._abort_callbacks: list[Callable[[], object]] = []
        self._cleanups: list[Callable[[], object]] = []
        self._task: asyncio.Task[Any] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task_cancelled = False
        # False while an async-generator guard has yielded to its consumer: the task
        # then runs the consumer's code, which an abort must not cancel.
        self._interruptible = True
        self._keeper_key: int | None = None
        self._max_hold_at: float | None = None
        self._held_since = 0.0

    # -- the handle ---------------------------------------------------------------

    @property
    def fencing_token(self) -> int | None:
        """The lease's fencing token while held (increases per lease and limiter)."""
        return self.lease.fencing_token if self.lease is not None else None

    @property
    def aborted(self) -> bool:
        """True once the hold was aborted (lease lost, max hold, cancel, budget end)."""
        return self._abort_reason is not None

    def on_abort(self, callback: Callable[[], object]) -> None:
        """Call ``callback`` (from another thread) if the hold is aborted, e.g. to close
        the provider's response so a blocking read ends. Called at once if aborted."""
        with self._state:
            if self._abort_reason is None:
                self._abort_callbacks.append(callback)
                return
        _call_safely(callback)

    # -- sync ---------------------------------------------------------------------

    def __enter__(self) -> Slot:
        request = self._prepare()
        started = time.monotonic()
        try:
            if self._admission is not None:
                lease = self._admission.acquire(self._limiter, request, self._cancel, self._on_wait)
            else:
                lease = self._limiter.acquire(request, cancel=self._cancel, on_wait=self._on_wait)
        except BaseException as exc:
            self._cleanup()
            error = self._wait_failed(exc, started)
            if error is exc:
                raise
            raise error from exc
        self._hold(lease, started)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        error = self._end(exc)
        if error is not None:
            raise error from exc

    # -- async --------------------------------------------------------------------

    async def __aenter__(self) -> Slot:
        request = self._prepare()
        started = time.monotonic()
        try:
            lease = await _acquire_async(
                self._limiter, request, self._cancel, self._on_wait, self._admission
            )
        except BaseException as exc:
            self._cleanup()
            error = self._wait_failed(exc, started)
            if error is exc:
                raise
            raise error from exc
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.current_task()
        self._hold(lease, started)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        error = self._end(exc)
        if self._task_cancelled and self._task is not None:
            # The cancellation was ours, to stop the body; do not let it leak out.
            self._task.uncancel()
        if error is not None:
            raise error from exc

    # -- steps ----------------------------------------------------------------------

    def _prepare(self) -> AcquireRequest:
        if self._phase != "new":
            raise RuntimeError("a Slot is used once; call slot() again for the next request")
        run = current_run()
        limiter = self._limiter_arg or (run.limiter if run is not None else None)
        request_id = self._request_id or new_request_id()
        if run is None:
            # A slot outside any run is a one-slot run of its own.
            run = RunContext(run_id=request_id, root_run_id=request_id)
        self._run = run
        if limiter is None:
            raise ConcurrencyConfigError(
                "slot() has no limiter: pass one, or call it inside run(limiter=...) "
                "or a RunCellTask",
                run_id=run.run_id,
                root_run_id=run.root_run_id,
                parent_run_id=run.parent_run_id,
                request_id=request_id,
            )
        self._limiter = limiter
        self._admission = run.admission.take(limiter) if run.admission is not None else None
        if self._admission is not None and self._request_id is None:
            request_id = self._admission.request_id
        workload = self._workload_arg
        if workload is None and limiter is run.limiter:
            workload = run.workload
        validate: Callable[[str | None], str] | None = getattr(limiter, "validate_workload", None)
        try:
            resolved = validate(workload) if validate is not None else workload
        except ConcurrencyConfigError as exc:
            self._request = AcquireRequest(
                request_id, workload or DEFAULT_WORKLOAD, run.lineage, None, run.name
            )
            error = self._request.error(ConcurrencyConfigError, exc.message, limiter=limiter.name)
            self._event("config-error", error=describe_error(error))
            raise error from None
        remaining = run.remaining_ms()
        self._request = request = AcquireRequest(
            request_id=request_id,
            workload=resolved or DEFAULT_WORKLOAD,
            lineage=run.lineage,
            timeout_ms=remaining,
            holder_name=run.name,
            in_progress=run.progress.slots_taken > 0,
        )
        self._cancel = self._combined_cancel(run.cancel)
        if self._cancel is not None and self._cancel.is_set():
            self._cleanup()
            self._event("wait-cancelled", wait_ms=0.0)
            raise request.error(
                ConcurrencyCancelledError,
                "the run was cancelled before it asked for a slot",
                limiter=limiter.name,
            )
        if remaining is not None and remaining <= 0:
            self._cleanup()
            self._event("timed-out", wait_ms=0.0)
            raise request.error(
                ConcurrencyTimeoutError,
                f"the run's time budget ended before it asked limiter {limiter.name!r} for a slot",
                limiter=limiter.name,
            )
        return request

    def _combined_cancel(self, inherited: CancellationToken | None) -> CancellationToken | None:
        own = self._cancel_arg
        if own is None or inherited is None:
            return own or inherited
        linked = CancellationToken(own, inherited)
        self._cleanups.append(linked.detach)
        return linked

    def _on_wait(self, deadline: float | None) -> None:
        if has_listeners():
            self._event("wait-started", deadline=deadline)

    def _wait_failed(self, exc: BaseException, started: float) -> BaseException:
        """Emit the event for a failed wait; return the error the caller should see."""
        wait_ms = (time.monotonic() - started) * 1000
        if isinstance(exc, SlotDeferred):
            return exc  # parked by the run's admission: not a failure, no event
        if is_interrupt(exc) and not isinstance(exc, ConcurrencyError):
            self._event("wait-cancelled", wait_ms=wait_ms)
            return exc
        for error_type, event_type in _WAIT_FAILURE_EVENTS:
            if isinstance(exc, error_type):
                extra = {"error": describe_error(exc)} if event_type == "config-error" else {}
                self._event(event_type, wait_ms=None if extra else wait_ms, **extra)
                return exc
        if isinstance(exc, ConcurrencyError):
            self._event("limiter-error", wait_ms=wait_ms, error=describe_error(exc))
            return exc
        # Anything else from the limiter (a driver error, a bug) fails closed.
        error = self._request.error(
            ConcurrencyLimiterError,
            f"limiter {self._limiter.name!r} failed: {describe_error(exc)}",
            limiter=self._limiter.name,
        )
        self._event("limiter-error", wait_ms=wait_ms, error=describe_error(exc))
        return error

    def _hold(self, lease: Lease, started: float) -> None:
        now = time.monotonic()
        self.lease = lease
        self._held_since = now
        self._phase = "held"
        self._run.progress.slots_taken += 1
        if has_listeners():
            self._event(
                "acquired",
                lease_id=lease.lease_id,
                fencing_token=lease.fencing_token,
                wait_ms=(now - started) * 1000,
            )
        max_hold_ms = self._max_hold_ms
        if max_hold_ms is None:
            max_hold_ms = getattr(getattr(self._limiter, "config", None), "max_hold_ms", None)
        if max_hold_ms is not None:
            self._max_hold_at = now + max_hold_ms / 1000
        deadlines = [d for d in (self._max_hold_at, self._run.deadline) if d is not None]
        self._keeper_key = get_keeper().keep(self, lease.ttl_ms, min(deadlines, default=None))
        if self._cancel is not None:
            self._cleanups.append(self._cancel.add_callback(self._cancelled_while_held))

    def _end(self, exc: BaseException | None) -> BaseException | None:
        """Release once and return the error that replaces the body's result, if any."""
        with self._state:
            if self._phase != "held":
                return None
            self._phase = "done"
            reason = self._abort_reason
            already_released = self._released
            self._released = True
        if self._keeper_key is not None:
            get_keeper().forget(self._keeper_key)
        self._cleanup()
        if not already_released:
            self._release(reason or _outcome_of(exc))
        if reason is None:
            return None
        return self._abort_exception(reason)

    def _release(self, outcome: Outcome) -> None:
        lease = self.lease
        assert lease is not None
        hold_ms = (time.monotonic() - self._held_since) * 1000
        try:
            self._limiter.release(lease, outcome)
        except Exception as exc:  # the run continues; the lease TTL returns the slot
            logger.warning("releasing %s failed: %s", lease.lease_id, describe_error(exc))
            self._event("release-failed", lease_id=lease.lease_id, error=describe_error(exc))
            return
        if has_listeners():
            self._event("released", lease_id=lease.lease_id, hold_ms=hold_ms, outcome=outcome)

    def _cleanup(self) -> None:
        for cleanup in self._cleanups:
            cleanup()
        self._cleanups.clear()

    # -- aborts (called from the keeper thread or a cancelling thread) ------------------

    def kept_lease(self) -> tuple[ConcurrencyLimiter, Lease] | None:
        if self._phase != "held" or self._released or self.lease is None:
            return None
        return self._limiter, self.lease

    def lease_renewed(self, lease: Lease) -> None:
        self.lease = lease

    def renewal_failed(self, error: BaseException) -> None:
        lease_id = self.lease.lease_id if self.lease is not None else None
        self._event("renewal-failed", lease_id=lease_id, error=describe_error(error))

    def lease_lost(self, error: BaseException | None) -> None:
        self._abort("lease-lost", error)

    def deadline_passed(self) -> float | None:
        max_hold_at = self._max_hold_at
        if max_hold_at is not None and time.monotonic() >= max_hold_at:
            self._abort("max-hold")
            return None
        self._abort("timed-out")
        # A sync body cannot be stopped: max_hold_ms must still free the slot later.
        return max_hold_at

    def _cancelled_while_held(self) -> None:
        self._abort("cancelled")

    def _abort(self, reason: AbortReason, error: BaseException | None = None) -> None:
        with self._state:
            if self._phase != "held":
                return
            first = self._abort_reason is None
            # max_hold_ms frees the slot even when an earlier abort (cancel, end of
            # budget) could not stop a sync body that is still running.
            release_now = reason == "max-hold" and not self._released
            if not first and not release_now:
                return
            callbacks: list[Callable[[], object]] = []
            if first:
                self._abort_reason = reason
                self._abort_error = error
                callbacks, self._abort_callbacks = self._abort_callbacks, []
            if release_now:
                self._released = True
        if reason in ("lease-lost", "max-hold"):
            self._event(
                "lease-lost",
                lease_id=self.lease.lease_id if self.lease is not None else None,
                hold_ms=(time.monotonic() - self._held_since) * 1000,
                reason="max-hold" if reason == "max-hold" else "renewal",
                error=describe_error(error) if error is not None else None,
            )
        if release_now:
            # max_hold_ms protects the limiter's accounting even if the call never ends.
            self._release("max-hold")
        if not first:
            return
        for callback in callbacks:
            _call_safely(callback)
        if self._loop is not None:
            with contextlib.suppress(RuntimeError):  # loop closed: nothing left to cancel
                self._loop.call_soon_threadsafe(self._cancel_task)

    def _cancel_task(self) -> None:
        # Runs on the event loop, between steps of the task: if the body is still
        # running, the cancellation is delivered inside it.
        with self._state:
            if (
                self._phase == "held"
                and self._task is not None
                and self._interruptible
                and not self._task_cancelled
            ):
                self._task_cancelled = True
                self._task.cancel()

    def _abort_exception(self, reason: AbortReason) -> ConcurrencyError:
        name = self._limiter.name
        lease_id = self.lease.lease_id if self.lease is not None else "?"
        if reason == "lease-lost":
            cls: type[ConcurrencyError] = ConcurrencyLeaseLostError
            message = f"lost slot {lease_id} of limiter {name!r}: it could not be renewed"
        elif reason == "max-hold":
            cls = ConcurrencyLeaseLostError
            message = f"slot {lease_id} of limiter {name!r} was held past max_hold_ms"
        elif reason == "cancelled":
            cls = ConcurrencyCancelledError
            message = f"the run was cancelled while holding slot {lease_id} of limiter {name!r}"
        else:
            cls = ConcurrencyTimeoutError
            message = f"the run's time budget ended while holding slot {lease_id} of {name!r}"
        return self._request.error(cls, message, limiter=name)

    def _event(self, type_: EventType, **extra: Any) -> None:
        if not has_listeners():
            return
        request = self._request
        lineage = request.lineage
        emit(
            ConcurrencyEvent(
                type=type_,
                limiter=self._limiter.name,
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


def _call_safely(callback: Callable[[], object]) -> None:
    try:
        callback()
    except Exception:
        logger.exception("slot abort callback %r failed", callback)


async def _acquire_async(
    limiter: ConcurrencyLimiter,
    request: AcquireRequest,
    cancel: CancellationToken | None,
    on_wait: Callable[[float | None], None],
    admission: Admission | None = None,
) -> Lease:
    """Use the limiter's ``acquire_async``, or run a blocking acquire in a thread.

    In the thread case an asyncio cancellation cancels the thread's wait through a
    token, and a slot the thread was granted meanwhile is released, not leaked.
    """
    native = getattr(limiter, "acquire_async", None)
    if native is not None and admission is None:
        lease: Lease = await native(request, cancel=cancel, on_wait=on_wait)
        return lease
    stop = CancellationToken(cancel) if cancel is not None else CancellationToken()
    if admission is not None:
        blocking = functools.partial(admission.acquire, limiter, request, stop, on_wait)
    else:
        blocking = functools.partial(limiter.acquire, request, cancel=stop, on_wait=on_wait)
    waiting = asyncio.ensure_future(asyncio.to_thread(blocking))
    try:
        return await asyncio.shield(waiting)
    except asyncio.CancelledError:
        stop.cancel("the asyncio task was cancelled")
        try:
            granted = await waiting
        except (ConcurrencyError, SlotDeferred):
            pass
        else:
            limiter.release(granted, "cancelled")
        raise
    finally:
        stop.detach()


def slot(
    limiter: ConcurrencyLimiter | None = None,
    *,
    workload: str | None = None,
    max_hold_ms: int | None = None,
    cancel: CancellationToken | None = None,
    request_id: str | None = None,
) -> Slot:
    """Hold one slot around one provider request (``with`` or ``async with``).

    :param limiter: the limiter; defaults to the current run's.
    :param workload: the workload; defaults to the run's, then the limiter's default.
    :param max_hold_ms: end the hold as a lost lease after this long (defaults to the
        limiter's ``max_hold_ms``).
    :param cancel: a token that cancels this request (the run's still applies).
    :param request_id: a stable id for the request (defaults to a new one).
    :raises ConcurrencyError: see :mod:`runcell_celery.errors`; the provider must not
        be called when entering fails.

    ::

        with slot(claude, workload="background") as s:
            reply = client.messages.create(..., extra_headers={"x-fence": str(s.fencing_token)})
    """
    return Slot(
        limiter, workload=workload, max_hold_ms=max_hold_ms, cancel=cancel, request_id=request_id
    )
