"""The slot runtime: take a slot before a provider request, give it back after.

:func:`slot` owns a slot's whole life: ask (the run's first request adopts the slot
admitted before its body, :func:`preadmit`), acquire within the run's budget (a slot
granted at the moment of a cancel goes back), hold (:class:`~runcell_celery.hold.Hold`)
and release exactly once, emitting every step's event. ``slot(a, b)`` is one decision
over its members; one limiter is a group of one.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any, NoReturn, cast

from . import tracing
from .admission import Admission, Deferred, DuplicateDelivery, PreAdmitted
from .arguments import check_slot_arguments
from .cancellation import CancellationToken
from .context import current_run
from .deadline import Deadline
from .errors import (
    ConcurrencyError,
    ConcurrencyLeaseLostError,
    ConcurrencyLimiterError,
)
from .events import describe_error, has_listeners
from .hold import Hold, abort_error, is_interrupt, register_interrupt
from .protocol import (
    ConcurrencyLimiter,
    Lease,
    SupportsConfig,
    SupportsMembersAsync,
    SupportsReleaseExecutor,
    acquire_members,
    supports,
)
from .request import SlotRequest, build_request, failure_event_type, report_refusal

__all__ = ["Slot", "is_interrupt", "preadmit", "register_interrupt", "slot"]


class Slot:
    """One slot for one provider request, and inside the block its handle (over several
    limiters ``lease`` and ``fencing_token`` are the first's)."""

    def __init__(
        self,
        *limiters: ConcurrencyLimiter | None,
        workload: str | None = None,
        key: str | None = None,
        max_hold_ms: int | None = None,
        cancel: CancellationToken | None = None,
        request_id: str | None = None,
    ) -> None:
        self._setup(limiters, workload, key, max_hold_ms, cancel, request_id)

    def _setup(
        self,
        limiters: tuple[ConcurrencyLimiter | None, ...],
        workload: str | None,
        key: str | None,
        max_hold_ms: int | None,
        cancel: CancellationToken | None,
        request_id: str | None,
        call: str | None = "slot",
    ) -> Slot:
        if call is not None:  # None: checked already (guard, when decorating)
            check_slot_arguments(call, limiters, workload, key, max_hold_ms, cancel, request_id)
        self._limiters = tuple(x for x in limiters if x is not None)
        self._key_arg = key
        self._workload_arg = workload
        self._max_hold_ms = max_hold_ms
        self._cancel_arg = cancel
        self._request_id = request_id
        self._hold: Hold | None = None
        self._early_callbacks: list[Callable[[], object]] | None = None
        return self

    @property
    def lease(self) -> Lease | None:
        return self._hold.lease if self._hold is not None else None

    @property
    def fencing_token(self) -> int | None:
        return self._hold.lease.fencing_token if self._hold is not None else None

    @property
    def leases(self) -> tuple[Lease, ...]:
        return () if self._hold is None else tuple(self._hold.leases)

    @property
    def fencing_tokens(self) -> dict[str, int]:
        hold = self._hold
        if hold is None:
            return {}
        names = hold.slot_request.names()
        return {n: x.fencing_token for n, x in zip(names, hold.leases, strict=True)}

    @property
    def aborted(self) -> bool:
        return self._hold is not None and self._hold.aborted

    def on_abort(self, callback: Callable[[], object]) -> None:
        """Call ``callback`` (from another thread) on an abort, e.g. to close the
        provider's response so a blocking read ends."""
        if self._hold is None:
            self._early_callbacks = [*(self._early_callbacks or ()), callback]
        else:
            self._hold.on_abort(callback)

    def interruptible(self) -> contextlib.AbstractContextManager[None]:
        if self._hold is None:
            raise RuntimeError("interruptible() needs a held slot: enter the slot first")
        return self._hold.interruptible()

    def __enter__(self) -> Slot:
        asked, cancel, cleanups, started = self._ask()
        if (adopted := _adopt(asked, cleanups)) is not None:
            return self._granted(*adopted, started, cancel, cleanups, None)
        try:
            leases = _acquire(asked, cancel)
        except BaseException as exc:
            _not_granted(asked, exc, started, cleanups)
        return self._granted(asked, leases, None, started, cancel, cleanups, None)

    async def __aenter__(self) -> Slot:
        asked, cancel, cleanups, started = self._ask()
        task = asyncio.current_task()
        if (adopted := _adopt(asked, cleanups)) is not None:
            return self._granted(*adopted, started, cancel, cleanups, task)
        try:
            leases = await _acquire_async(asked, cancel)
        except BaseException as exc:
            _not_granted(asked, exc, started, cleanups)
        return self._granted(asked, leases, None, started, cancel, cleanups, task)

    def _ask(
        self,
    ) -> tuple[SlotRequest, CancellationToken | None, list[Callable[[], object]], float]:
        if self._hold is not None:
            raise RuntimeError("a Slot is used once; call slot() again for the next request")
        run = current_run()
        try:
            asked = build_request(
                run,
                *self._limiters,
                workload=self._workload_arg,
                key=self._key_arg,
                request_id=self._request_id,
                cancel=self._cancel_arg,
            )
        except ConcurrencyError as exc:
            report_refusal(exc, run, self._limiters or (run.limiters if run else ()), self._key_arg)
            raise
        own = self._cancel_arg
        inherited = asked.run.cancel if asked.run is not None else None
        if own is None or inherited is None:
            return asked, own or inherited, [], time.monotonic()
        linked = CancellationToken(own, inherited)
        return asked, linked, [linked.detach], time.monotonic()

    def _granted(
        self,
        asked: SlotRequest,
        leases: tuple[Lease, ...],
        waited_ms: float | None,
        started: float,
        cancel: CancellationToken | None,
        cleanups: list[Callable[[], object]],
        task: asyncio.Task[Any] | None,
    ) -> Slot:
        for lease in leases:
            if lease.valid_until is not None and lease.valid_until.passed():
                # Paused longer than the lease lives since the grant: another holder
                # may have the slot by now, the body must not start on it.
                _expired_before_start(asked, leases, lease, started, cleanups)
        max_hold_ms = self._max_hold_ms
        if max_hold_ms is None:  # the smallest of the limiters'
            configured = [
                cast(SupportsConfig, x).config.max_hold_ms
                for x in asked.limiters
                if supports(x, SupportsConfig)
            ]
            max_hold_ms = min([x for x in configured if x is not None], default=None)
        max_hold = Deadline.after_ms(max_hold_ms) if max_hold_ms is not None else None
        lease = leases[0]
        hold = self._hold = Hold(asked, leases, max_hold=max_hold, task=task, cleanups=cleanups)
        hold.trace = tracing.start_hold(asked, hold, started, waited_ms)
        run = asked.run
        if run is not None:
            run.progress.slots_taken += 1
        if has_listeners():
            asked.event(
                "acquired",
                lease_id=lease.lease_id,
                fencing_token=lease.fencing_token,
                wait_ms=(hold.held_since - started) * 1000 if waited_ms is None else waited_ms,
            )
        hold.keep(run.deadline if run is not None else None)
        if cancel is not None:
            hold.add_cleanup(cancel.add_callback(hold.cancelled))
        if self._early_callbacks is not None:
            for callback in self._early_callbacks:
                hold.on_abort(callback)
            self._early_callbacks = None
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        error = self._hold.end(exc) if self._hold is not None else None
        if error is not None:
            raise error from exc

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        hold = self._hold
        if hold is None:
            return
        # A release doing I/O runs on the limiter's threads (never blocking the loop,
        # never cut short by a cancel).
        limiter = hold.slot_request.limiter
        if not supports(limiter, SupportsReleaseExecutor):
            error = hold.end(exc)
        else:
            executor = cast(SupportsReleaseExecutor, limiter).release_executor
            ending = contextvars.copy_context().run
            future = asyncio.get_running_loop().run_in_executor(executor, ending, hold.end, exc)
            error = await asyncio.shield(future)
        # The cancellation was ours, to stop the body; do not let it leak out.
        hold.settle_task()
        if error is not None:
            raise error from exc


def _lost_before_start(
    asked: SlotRequest,
    leases: tuple[Lease, ...],
    lost: Lease,
    reason: str,
    cleanups: list[Callable[[], object]],
) -> None:
    for cleanup in cleanups:
        cleanup()
    asked.event("lease-lost", lease_id=lost.lease_id, hold_ms=0.0, reason=reason, error=None)
    for limiter, lease in zip(asked.limiters, leases, strict=True):
        with contextlib.suppress(Exception):  # lost already: the limiter may know it
            limiter.release(lease, "lease-lost")


def _expired_before_start(
    asked: SlotRequest,
    leases: tuple[Lease, ...],
    expired: Lease,
    started: float,
    cleanups: list[Callable[[], object]],
) -> NoReturn:
    tracing.wait_ended(asked, started, "expired-before-start")
    _lost_before_start(asked, leases, expired, "expired-before-start", cleanups)
    waited_ms = (time.monotonic() - started) * 1000
    raise asked.request.error(
        ConcurrencyLeaseLostError,
        f"slot {expired.lease_id} of limiter {expired.limiter!r} expired before its body "
        f"could start ({waited_ms:.0f} ms after asking; the process was paused longer "
        "than the lease lives), so the body did not run",
        limiter=asked.limiter.name,
    )


def _not_granted(
    asked: SlotRequest,
    exc: BaseException,
    started: float,
    cleanups: list[Callable[[], object]],
) -> NoReturn:
    for cleanup in cleanups:
        cleanup()
    tracing.wait_failed(asked, exc, started)
    wait_ms = (time.monotonic() - started) * 1000
    if is_interrupt(exc) and not isinstance(exc, ConcurrencyError):
        asked.event("wait-cancelled", wait_ms=wait_ms)
        raise exc
    type_ = failure_event_type(exc) if isinstance(exc, ConcurrencyError) else "limiter-error"
    if type_ == "config-error":
        asked.event(type_, wait_ms=None, error=describe_error(exc))
    elif type_ in ("timed-out", "queue-full", "wait-cancelled"):
        asked.event(type_, wait_ms=wait_ms)
    else:
        asked.event("limiter-error", wait_ms=wait_ms, error=describe_error(exc))
    if isinstance(exc, ConcurrencyError):
        raise exc
    # Anything else from the limiter (a driver error, a bug) fails closed.
    name = asked.limiter.name
    error = asked.error(ConcurrencyLimiterError, f"limiter {name!r} failed: {describe_error(exc)}")
    raise error from exc


def _adopt(
    asked: SlotRequest, cleanups: list[Callable[[], object]]
) -> tuple[SlotRequest, tuple[Lease, ...], float] | None:
    """The run's pre-admitted first slot, if this request asks for the same limiters and
    workloads (else it was given back): the request under the leases' id, the leases in
    ``asked``'s order and the admission's wait."""
    run = asked.run
    admission = run.admission if run is not None else None
    if not isinstance(admission, Admission):
        return None
    admitted = admission.first_slot(asked.limiters, [r.workload for r in asked.requests])
    if admitted is None:
        return None
    kept = admitted.hand_over()
    if kept is None:  # released meanwhile (cancelled, budget ended): ask as usual
        return None
    by_limiter = {id(x): lease for x, lease in zip(admitted.limiters, admitted.leases, strict=True)}
    leases = tuple(by_limiter[id(x)] for x in asked.limiters)
    asked = asked.with_request_id(admitted.slot_request.request.request_id)
    if kept == "lost":
        _lost_before_start(asked, leases, leases[0], "renewal", cleanups)
        raise abort_error(asked, leases[0], "lease-lost")
    return asked, leases, admitted.wait_ms


def preadmit(admission: Admission) -> PreAdmitted | Deferred | DuplicateDelivery:
    """Decide the current run's first slot before its body runs, through ``admission``
    (which may park the run); raises as entering a slot would, with the same events.
    The slot is kept until the run's first ``slot()`` adopts it or the run ends."""
    run = current_run()
    if run is None:
        raise RuntimeError("preadmit() needs the run whose first slot it admits")
    try:
        asked = build_request(run, *admission.limiters, request_id=admission.request_id)
    except ConcurrencyError as exc:
        report_refusal(exc, run, admission.limiters, run.key)
        raise
    started = time.monotonic()
    try:
        answer = admission.acquire(asked.members, run.cancel, asked)
        if isinstance(answer, Deferred | DuplicateDelivery):
            parked = answer.parked if isinstance(answer, Deferred) else None
            tracing.wait_deferred(asked, started, parked)
            return answer
        leases = _check_leases(asked, tuple(answer))
    except BaseException as exc:
        _not_granted(asked, exc, started, [])
    tracing.wait_granted(asked, started, leases)
    # What the limiter measured when it knows (a parked request's claim), else ours.
    known = [lease.waited_ms for lease in leases if lease.waited_ms is not None]
    waited_ms = max(known) if known else (time.monotonic() - started) * 1000
    admission.admitted = admitted = PreAdmitted(asked, leases, wait_ms=waited_ms)
    admitted.keep(run.deadline, run.cancel)
    return admitted


def _acquire(asked: SlotRequest, cancel: CancellationToken | None) -> tuple[Lease, ...]:
    # The request is its own on_wait; no SupportsMembers: one member (build_request checked).
    return _check_leases(asked, acquire_members(asked.members, cancel=cancel, on_wait=asked))


def _check_leases(asked: SlotRequest, leases: tuple[Lease, ...]) -> tuple[Lease, ...]:
    if len(leases) != len(asked.limiters):
        for limiter, lease in zip(asked.limiters, leases, strict=False):
            with contextlib.suppress(Exception):
                limiter.release(lease, "error")
        raise asked.error(
            ConcurrencyLimiterError,
            f"limiter {asked.limiter.name!r} returned {len(leases)} leases for "
            f"{len(asked.limiters)} limiters",
        )
    return leases


async def _acquire_async(asked: SlotRequest, cancel: CancellationToken | None) -> tuple[Lease, ...]:
    """Native, or a blocking acquire in a thread that an asyncio cancellation cancels
    through a token (slots granted meanwhile are released)."""
    first = asked.limiter
    if supports(first, SupportsMembersAsync):
        native = cast(SupportsMembersAsync, first)
        leases = await native.acquire_members_async(asked.members, cancel=cancel, on_wait=asked)
        return _check_leases(asked, tuple(leases))
    stop = CancellationToken(cancel) if cancel is not None else CancellationToken()
    waiting = asyncio.ensure_future(asyncio.to_thread(_acquire, asked, stop))
    try:
        return await asyncio.shield(waiting)
    except asyncio.CancelledError:
        stop.cancel("the asyncio task was cancelled")
        try:
            granted = await waiting
        except ConcurrencyError:
            pass
        else:
            for limiter, lease in zip(asked.limiters, granted, strict=True):
                limiter.release(lease, "cancelled")
        raise
    finally:
        stop.detach()


def slot(
    *limiters: ConcurrencyLimiter,
    workload: str | None = None,
    key: str | None = None,
    max_hold_ms: int | None = None,
    cancel: CancellationToken | None = None,
    request_id: str | None = None,
) -> Slot:
    """Hold one slot around one provider request (``with`` or ``async with``).

    :param limiters: default: the current run's. Several limiters
        (``slot(openai, gpt_4o, tenants.key("acme"))``): one slot in each, granted
        together or not at all.
    :param workload: default: the run's, then the limiter's (over several limiters:
        in each that has it, the default elsewhere).
    :param key: the fairness key; default: the run's, then a key's limiter's.
    :param max_hold_ms: end the hold as a lost lease after this long.
    :param cancel: cancels this request (the run's token still applies).
    :raises ConcurrencyError: see :mod:`runcell_celery.errors`; the provider must not
        be called when entering fails.

    ::

        with slot(claude, workload="background") as s:
            reply = client.messages.create(..., extra_headers={"x-fence": str(s.fencing_token)})
    """
    # Not Slot(*limiters, ...): no second unpacking per call.
    return Slot.__new__(Slot)._setup(limiters, workload, key, max_hold_ms, cancel, request_id)
