"""A held slot between its grant and its release (exactly once, with an outcome).

The keeper tells a :class:`Hold` what happened to its leases; the hold owns the abort
state machine. A lease is lost the moment its local validity has passed, whoever looks
first: a process paused past its lease must not end with success, as another holder
may have had the slot meanwhile. ``max_hold_ms`` frees the slot even when an abort
could not stop a sync body, so the accounting never depends on the body.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal, Protocol, cast

from .background import DEFAULT_REGISTRY
from .deadline import Deadline
from .errors import (
    ConcurrencyCancelledError,
    ConcurrencyError,
    ConcurrencyLeaseLostError,
    ConcurrencyTimeoutError,
)
from .events import describe_error, has_listeners
from .keeper import LeaseHolder, LeaseTakenBackError, get_keeper, local_validity
from .protocol import ConcurrencyLimiter, Lease, Outcome
from .request import SlotRequest

__all__ = ["AbortReason", "Hold", "KeptLeases", "is_interrupt", "register_interrupt"]

logger = logging.getLogger("runcell_celery.slot")

AbortReason = Literal["lease-lost", "max-hold", "cancelled", "timed-out"]


class HoldTrace(Protocol):
    def end(self, outcome: str) -> None: ...


_NO_INTERRUPTS: tuple[type[BaseException], ...] = ()


def register_interrupt(exc_type: type[BaseException]) -> None:
    """Treat ``exc_type`` as a cancellation, not a failure, wherever it interrupts a
    slot (Celery registers ``SoftTimeLimitExceeded`` and ``Terminated``)."""
    interrupts = DEFAULT_REGISTRY.value("hold.interrupts", _NO_INTERRUPTS)
    if exc_type not in interrupts:
        DEFAULT_REGISTRY.put("hold.interrupts", (*interrupts, exc_type))


def is_interrupt(exc: BaseException) -> bool:
    return not isinstance(exc, Exception) or isinstance(
        exc, (ConcurrencyCancelledError, *DEFAULT_REGISTRY.value("hold.interrupts", _NO_INTERRUPTS))
    )


def outcome_of(exc: BaseException | None) -> Outcome:
    if exc is None:
        return "success"
    return "cancelled" if is_interrupt(exc) else "error"


class KeptLeases:
    """One lease per limiter of a request, each kept by the keeper under its index (so
    renewals batch per limiter); the deadline is watched once, on the first."""

    def __init__(self, slot_request: SlotRequest, leases: Sequence[Lease]) -> None:
        self.slot_request = slot_request
        self.leases = list(leases)  # in the order of the request's limiters
        self._keeper = get_keeper(slot_request.limiter)
        self._keys: list[int] = []
        now = self._keeper.clock.monotonic()
        self._valid_until = [local_validity(lease, now).at for lease in self.leases]

    @property
    def lease(self) -> Lease:
        return self.leases[0]

    @property
    def limiters(self) -> tuple[ConcurrencyLimiter, ...]:
        return self.slot_request.limiters

    def _keep(self, deadline: Deadline | None) -> None:
        keeper, holder = self._keeper, cast(LeaseHolder, self)  # a subclass answers the keeper
        self._keys = [
            keeper.keep(holder, index, lease.ttl_ms, None if index else deadline, Deadline(until))
            for index, (lease, until) in enumerate(zip(self.leases, self._valid_until, strict=True))
        ]

    def _forget(self) -> None:
        for key in self._keys:
            self._keeper.forget(key)

    def _first_invalid(self) -> int | None:
        """The first lease whose local validity has passed (the keeper may not have run:
        a paused or starved process)."""
        now = self._keeper.clock.monotonic()
        return next((i for i, until in enumerate(self._valid_until) if now >= until), None)

    def _release_all(self, outcome: Outcome) -> bool:
        """Release every lease (the TTL frees one that fails); ``False`` if one failed."""
        request = self.slot_request
        failed = False
        for limiter, lease in zip(request.limiters, list(self.leases), strict=True):
            try:
                limiter.release(lease, outcome)
            except Exception as exc:
                failed = True
                logger.warning("releasing %s failed: %s", lease.lease_id, describe_error(exc))
                request.event("release-failed", lease_id=lease.lease_id, error=describe_error(exc))
        return not failed

    def lease_renewed(self, index: int, lease: Lease, valid_until: Deadline) -> None:
        self.leases[index] = lease
        self._valid_until[index] = valid_until.at


class Hold(KeptLeases):
    """A held slot, released by :meth:`end`. Losing any lease aborts it (over several
    limiters also releasing the others at once); ``task``: what an abort cancels."""

    def __init__(
        self,
        slot_request: SlotRequest,
        leases: tuple[Lease, ...],
        *,
        max_hold: Deadline | None = None,
        task: asyncio.Task[Any] | None = None,
        cleanups: list[Callable[[], object]] | None = None,
    ) -> None:
        super().__init__(slot_request, leases)
        self.max_hold = max_hold
        self.held_since = time.monotonic()
        self._state = threading.Lock()
        self._ended = False
        self._released = False
        self._abort_reason: AbortReason | None = None
        self._abort_callbacks: list[Callable[[], object]] = []
        self._cleanups = cleanups if cleanups is not None else []
        self._task = task
        self._task_cancelled = False
        self._interruptible = True
        self._lost_lease: Lease | None = None
        self._lost_why: str | None = None  # ``force-released by alice``
        self.trace: HoldTrace | None = None

    def keep(self, deadline: Deadline | None) -> None:
        self._keep(Deadline.earliest(self.max_hold, deadline))

    def add_cleanup(self, cleanup: Callable[[], object]) -> None:
        self._cleanups.append(cleanup)

    @property
    def aborted(self) -> bool:
        return self.abort_reason is not None

    @property
    def abort_reason(self) -> AbortReason | None:
        if self._abort_reason is None:
            self._check_validity()
        return self._abort_reason

    def on_abort(self, callback: Callable[[], object]) -> None:
        if self._abort_reason is None:
            self._check_validity()
        with self._state:
            if self._abort_reason is None:
                self._abort_callbacks.append(callback)
                return
        _call_safely(callback)

    @contextlib.contextmanager
    def interruptible(self) -> Iterator[None]:
        """Let an abort cancel the asyncio task only while the block runs (a streaming
        guard wraps each of its own steps, not the consumer's)."""
        self._interruptible = True
        try:
            yield
        finally:
            self._interruptible = False

    def end(self, exc: BaseException | None) -> ConcurrencyError | None:
        """Release once; return the error that replaces the body's result, if any."""
        self._check_validity()
        with self._state:
            if self._ended:
                return None
            self._ended = True
            reason = self._abort_reason
            already_released = self._released
            self._released = True
        self._forget()
        for cleanup in self._cleanups:
            cleanup()
        self._cleanups.clear()
        if not already_released:
            self._release(reason or outcome_of(exc))
        if self.trace is not None:
            self.trace.end(reason or outcome_of(exc))
        if reason is None:
            return None
        lease = self._lost_lease or self.lease
        return abort_error(self.slot_request, lease, reason, why=self._lost_why)

    def _check_validity(self) -> None:
        index = None if self._ended or self._released else self._first_invalid()
        if index is not None:
            self.lease_lost(index, None)

    def settle_task(self) -> None:
        if self._task_cancelled and self._task is not None:
            self._task.uncancel()

    def _release(self, outcome: Outcome) -> None:
        hold_ms = (time.monotonic() - self.held_since) * 1000
        if self._release_all(outcome) and has_listeners():
            lease_id = self.lease.lease_id
            self.slot_request.event("released", lease_id=lease_id, hold_ms=hold_ms, outcome=outcome)

    def kept_lease(self, index: int) -> tuple[ConcurrencyLimiter, Lease] | None:
        return None if self._ended or self._released else (self.limiters[index], self.leases[index])

    def renewal_failed(self, index: int, error: BaseException) -> None:
        self.slot_request.event(
            "renewal-failed", lease_id=self.leases[index].lease_id, error=describe_error(error)
        )

    def lease_lost(self, index: int, error: BaseException | None) -> None:
        with self._state:
            if self._lost_lease is None and self._abort_reason is None:
                self._lost_lease = self.leases[index]
        self.abort("lease-lost", error)

    def deadline_passed(self) -> Deadline | None:
        if self.max_hold is not None and self.max_hold.passed():
            self.abort("max-hold")
            return None
        self.abort("timed-out")
        # A sync body cannot be stopped: max_hold_ms must still free the slot later.
        return self.max_hold

    def cancelled(self) -> None:
        self.abort("cancelled")

    def abort(self, reason: AbortReason, error: BaseException | None = None) -> None:
        taken_back = error.reason if isinstance(error, LeaseTakenBackError) else None
        with self._state:
            if self._ended:
                return
            first = self._abort_reason is None
            release_now = (
                reason == "max-hold" or (reason == "lease-lost" and len(self.leases) > 1)
            ) and not self._released
            if not first and not release_now:
                return
            callbacks: list[Callable[[], object]] = []
            if first:
                self._abort_reason = reason
                self._lost_why = taken_back
                callbacks, self._abort_callbacks = self._abort_callbacks, []
            if release_now:
                self._released = True
        if reason in ("lease-lost", "max-hold"):
            self.slot_request.event(
                "lease-lost",
                lease_id=(self._lost_lease or self.lease).lease_id,
                hold_ms=(time.monotonic() - self.held_since) * 1000,
                reason="max-hold" if reason == "max-hold" else taken_back or "renewal",
                error=describe_error(error) if error is not None else None,
            )
        if release_now:  # reason is "max-hold" or "lease-lost"
            self._release(reason)
        if not first:
            return
        for callback in callbacks:
            _call_safely(callback)
        if self._task is not None:
            with contextlib.suppress(RuntimeError):  # loop closed: nothing left to cancel
                self._task.get_loop().call_soon_threadsafe(self._cancel_task)

    def _cancel_task(self) -> None:
        # On the event loop, between steps: the cancellation lands inside the body.
        with self._state:
            if (
                not self._ended
                and self._task is not None
                and self._interruptible
                and not self._task_cancelled
            ):
                self._task_cancelled = True
                self._task.cancel()


def abort_error(
    slot_request: SlotRequest, lease: Lease, reason: AbortReason, *, why: str | None = None
) -> ConcurrencyError:
    name = slot_request.limiter.name
    if len(slot_request.limiters) > 1:
        name = lease.limiter  # the lease lost, of whichever limiter
    lease_id = lease.lease_id
    cls: type[ConcurrencyError]
    if reason == "lease-lost":
        cls = ConcurrencyLeaseLostError
        message = f"lost slot {lease_id} of limiter {name!r}: {why or 'it could not be renewed'}"
    elif reason == "max-hold":
        cls = ConcurrencyLeaseLostError
        message = f"slot {lease_id} of limiter {name!r} was held past max_hold_ms"
    elif reason == "cancelled":
        cls = ConcurrencyCancelledError
        message = f"the run was cancelled while holding slot {lease_id} of limiter {name!r}"
    else:
        cls = ConcurrencyTimeoutError
        message = f"the run's time budget ended while holding slot {lease_id} of {name!r}"
    return slot_request.error(cls, message)


def _call_safely(callback: Callable[[], object]) -> None:
    try:
        callback()
    except Exception:
        logger.exception("slot abort callback %r failed", callback)
