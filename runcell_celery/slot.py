"""The slot runtime: take a slot before a provider request, give it back after.

:func:`slot` owns a slot's whole life (README, "A slot around each provider call"):

1. **Ask**: :func:`~runcell_celery.request.build_request` resolves the limiter,
   workload, request id and remaining budget from the run and the arguments; a
   cancelled run or a spent budget never asks. The run's first request **adopts** the
   slot admitted before the run's body (:func:`preadmit`,
   :mod:`runcell_celery.admission`) when it names the same limiter and workload, and
   skips step 2.
2. **Acquire** with a deadline of ``min(workload max_wait_ms, run's remaining
   timeout_ms)`` and the run's cancellation. A slot granted at the moment of a cancel
   or timeout is returned to the limiter, never leaked.
3. **Hold**: a :class:`~runcell_celery.hold.Hold` is kept by the process's one lease
   keeper, which renews it about every third of its TTL and fires ``max_hold_ms`` and
   the run's deadline. An abort (lease lost, ``max_hold_ms``, cancel, end of budget)
   runs abort callbacks (``slot.on_abort(response.close)``), cancels an ``async with``
   body, and ends the hold with the matching
   :class:`~runcell_celery.errors.ConcurrencyError` instead of its result, so the
   result of a call that ran without a valid slot is never returned as a success.
   A thread cannot be interrupted safely from outside, so a sync body learns of the
   abort through its callbacks or ``slot.aborted`` and is failed when it exits.
4. **Release** exactly once, with an outcome; a failed release emits
   ``release-failed`` and the run continues.

Every step emits its event (see :mod:`runcell_celery.events`).

``slot(a, b, c)`` (or ``slot()`` in a run of several limiters) is one request over
several limiters (README, "Several limits and keys"): resolved by
:func:`~runcell_celery.request.build_several`, acquired all together through the
backend's :class:`~runcell_celery.protocol.SupportsSeveral`, held as one
:class:`~runcell_celery.hold.Hold`. A request over one limiter is a group of one: the
same path, asking its limiter's ``acquire``.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import time
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any, NoReturn, cast

from . import tracing
from .admission import Admission, Deferred, DuplicateDelivery, PreAdmitted
from .arguments import check_slot_arguments
from .cancellation import CancellationToken
from .context import current_run
from .deadline import Deadline
from .errors import (
    ConcurrencyCancelledError,
    ConcurrencyConfigError,
    ConcurrencyError,
    ConcurrencyLeaseLostError,
    ConcurrencyLimiterError,
    ConcurrencyQueueFullError,
    ConcurrencyTimeoutError,
)
from .events import EventType, describe_error, has_listeners
from .hold import Hold, abort_error, is_interrupt, register_interrupt
from .protocol import (
    ConcurrencyLimiter,
    Lease,
    SupportsAsyncAcquire,
    SupportsConfig,
    SupportsSeveral,
    SupportsSeveralAsync,
    supports,
)
from .request import SlotRequest, build_request, build_several, report_refusal

__all__ = ["Slot", "is_interrupt", "preadmit", "register_interrupt", "slot"]

_WAIT_FAILURE_EVENTS: tuple[tuple[type[ConcurrencyError], EventType], ...] = (
    (ConcurrencyTimeoutError, "timed-out"),
    (ConcurrencyQueueFullError, "queue-full"),
    (ConcurrencyCancelledError, "wait-cancelled"),
    (ConcurrencyConfigError, "config-error"),
)


class Slot:
    """One slot for one provider request; a sync and async context manager.

    Use :func:`slot` to make one. Inside the block it is the handle of the held slot:
    ``lease``, ``fencing_token`` (pass it to a provider proxy that fences stale
    holders), ``aborted``, :meth:`on_abort` and :meth:`interruptible`. Over several
    limiters ``lease`` and ``fencing_token`` are the first limiter's; ``leases`` and
    ``fencing_tokens`` have them all.

    Entering is one path for ``with`` and ``async with``: :meth:`_ask` (resolve the
    request), a wait that differs (blocking, or awaiting), then :meth:`_granted` or
    :meth:`_not_granted`.
    """

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
        call: str = "slot",
    ) -> None:
        check_slot_arguments(call, limiters, workload, key, max_hold_ms, cancel, request_id)
        # One limiter (or none: the run's) is the path it always was; several are one
        # request over them all.
        self._several: tuple[ConcurrencyLimiter, ...] | None = None
        if len(limiters) == 1:
            self._limiter_arg = limiters[0]
        elif not limiters:
            self._limiter_arg = None
        else:
            named = tuple(x for x in limiters if x is not None)
            self._several = named if len(named) > 1 else None
            self._limiter_arg = named[0] if len(named) == 1 else None
        self._key_arg = key
        self._workload_arg = workload
        self._max_hold_ms = max_hold_ms
        self._cancel_arg = cancel
        self._request_id = request_id
        self._hold: Hold | None = None
        # Abort callbacks registered before the slot was entered.
        self._early_callbacks: list[Callable[[], object]] | None = None

    # -- the handle ---------------------------------------------------------------

    @property
    def lease(self) -> Lease | None:
        """The lease while held (and after, for the record); ``None`` before."""
        return self._hold.lease if self._hold is not None else None

    @property
    def fencing_token(self) -> int | None:
        """The lease's fencing token while held (increases per lease and limiter)."""
        return self._hold.lease.fencing_token if self._hold is not None else None

    @property
    def leases(self) -> tuple[Lease, ...]:
        """Every lease while held, one per limiter in the order given; ``()`` before."""
        hold = self._hold
        return () if hold is None else tuple(hold.leases)

    @property
    def fencing_tokens(self) -> dict[str, int]:
        """Each limiter's fencing token while held, by limiter name; ``{}`` before."""
        hold = self._hold
        if hold is None:
            return {}
        names = hold.slot_request.names()
        return {n: x.fencing_token for n, x in zip(names, hold.leases, strict=True)}

    @property
    def aborted(self) -> bool:
        """True once the hold was aborted (lease lost, max hold, cancel, budget end)."""
        return self._hold is not None and self._hold.aborted

    def on_abort(self, callback: Callable[[], object]) -> None:
        """Call ``callback`` (from another thread) if the hold is aborted, e.g. to close
        the provider's response so a blocking read ends. Called at once if aborted."""
        if self._hold is None:
            self._early_callbacks = [*(self._early_callbacks or ()), callback]
        else:
            self._hold.on_abort(callback)

    def interruptible(self) -> contextlib.AbstractContextManager[None]:
        """Let an abort cancel the ``async with`` task only while the block runs
        (see :meth:`~runcell_celery.hold.Hold.interruptible`)."""
        if self._hold is None:
            raise RuntimeError("interruptible() needs a held slot: enter the slot first")
        return self._hold.interruptible()

    # -- entering: one path, two ways to wait ---------------------------------------

    def __enter__(self) -> Slot:
        asked, cancel, cleanups = self._ask()
        started = time.monotonic()
        adopted = _adopt(asked, cleanups)
        if adopted is not None:
            asked, leases, waited_ms = adopted
            return self._granted(asked, leases, started, cancel, cleanups, None, waited_ms)
        try:
            leases = _acquire(asked, cancel)
        except BaseException as exc:
            self._not_granted(asked, exc, started, cleanups)
        return self._granted(asked, leases, started, cancel, cleanups, None)

    async def __aenter__(self) -> Slot:
        asked, cancel, cleanups = self._ask()
        started = time.monotonic()
        task = asyncio.current_task()
        adopted = _adopt(asked, cleanups)
        if adopted is not None:
            asked, leases, waited_ms = adopted
            return self._granted(asked, leases, started, cancel, cleanups, task, waited_ms)
        try:
            leases = await _acquire_async(asked, cancel)
        except BaseException as exc:
            self._not_granted(asked, exc, started, cleanups)
        return self._granted(asked, leases, started, cancel, cleanups, task)

    def _ask(
        self,
    ) -> tuple[SlotRequest, CancellationToken | None, list[Callable[[], object]]]:
        if self._hold is not None:
            raise RuntimeError("a Slot is used once; call slot() again for the next request")
        run = current_run()
        limiter = self._limiter_arg
        several = self._several
        if several is None and limiter is None and run is not None and len(run.limiters) > 1:
            several = run.limiters
        try:
            if several is not None:
                asked = build_several(
                    run,
                    several,
                    workload=self._workload_arg,
                    key=self._key_arg,
                    request_id=self._request_id,
                    cancel=self._cancel_arg,
                )
            else:
                asked = build_request(
                    run,
                    limiter,
                    workload=self._workload_arg,
                    request_id=self._request_id,
                    cancel=self._cancel_arg,
                    key=self._key_arg,
                )
        except ConcurrencyError as exc:
            holder = run.name if run is not None else None
            if several is not None:
                names = tuple(x.name for x in several)
                report_refusal(exc, holder, limiters=names, key=self._key_arg)
            else:
                report_refusal(exc, holder)
            raise
        cleanups: list[Callable[[], object]] = []
        own = self._cancel_arg
        inherited = asked.run.cancel if asked.run is not None else None
        if own is None or inherited is None:
            return asked, own or inherited, cleanups
        linked = CancellationToken(own, inherited)
        cleanups.append(linked.detach)
        return asked, linked, cleanups

    @staticmethod
    def _not_granted(
        asked: SlotRequest,
        exc: BaseException,
        started: float,
        cleanups: list[Callable[[], object]],
    ) -> NoReturn:
        for cleanup in cleanups:
            cleanup()
        tracing.wait_failed(asked, exc, started)
        error = _wait_failed(asked, exc, started)
        if error is exc:
            raise exc
        raise error from exc

    def _granted(
        self,
        asked: SlotRequest,
        leases: tuple[Lease, ...],
        started: float,
        cancel: CancellationToken | None,
        cleanups: list[Callable[[], object]],
        task: asyncio.Task[Any] | None,
        waited_ms: float | None = None,
    ) -> Slot:
        for lease in leases:
            if lease.valid_until is not None and lease.valid_until.passed():
                # The process stood still between the grant and here (a pause, a
                # swapped out host) for longer than the lease lives: another holder may
                # have the slot by now. The body must not start on it.
                _expired_before_start(asked, leases, lease, started, cleanups)
        max_hold_ms = self._max_hold_ms
        if max_hold_ms is None:  # the smallest of the limiters'
            configured = [
                cast(SupportsConfig, x).config.max_hold_ms
                for x in asked.limiters
                if supports(x, SupportsConfig)
            ]
            given = [x for x in configured if x is not None]
            max_hold_ms = min(given) if given else None
        max_hold = Deadline.after_ms(max_hold_ms) if max_hold_ms is not None else None
        hold = Hold(asked, leases, max_hold=max_hold, task=task, cleanups=cleanups)
        return self._start_hold(hold, asked, leases[0], started, cancel, waited_ms)

    def _start_hold(
        self,
        hold: Hold,
        asked: SlotRequest,
        lease: Lease,
        started: float,
        cancel: CancellationToken | None,
        waited_ms: float | None,
    ) -> Slot:
        """The hold begins: count the run's slot, say ``acquired`` (naming ``lease``, the
        first of several), keep the lease(s) renewed, and listen for cancellation and
        for aborts asked for before the grant."""
        self._hold = hold
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

    # -- leaving --------------------------------------------------------------------

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
        # A limiter whose release does I/O names the threads to run it on: the exit
        # then never blocks the event loop (nor is the release cut short by a cancel).
        executor = getattr(hold.slot_request.limiter, "release_executor", None)
        if executor is None:
            error = hold.end(exc)
        else:
            ending = contextvars.copy_context().run
            future = asyncio.get_running_loop().run_in_executor(executor, ending, hold.end, exc)
            error = await asyncio.shield(future)
        # The cancellation was ours, to stop the body; do not let it leak out.
        hold.settle_task()
        if error is not None:
            raise error from exc


def _expired_before_start(
    asked: SlotRequest,
    leases: tuple[Lease, ...],
    expired: Lease,
    started: float,
    cleanups: list[Callable[[], object]],
) -> NoReturn:
    for cleanup in cleanups:
        cleanup()
    tracing.wait_ended(asked, started, "expired-before-start")
    asked.event(
        "lease-lost",
        lease_id=expired.lease_id,
        hold_ms=0.0,
        reason="expired-before-start",
        error=None,
    )
    for limiter, lease in zip(asked.limiters, leases, strict=True):
        with contextlib.suppress(Exception):  # expired already: the limiter may know it
            limiter.release(lease, "lease-lost")
    waited_ms = (time.monotonic() - started) * 1000
    raise asked.request.error(
        ConcurrencyLeaseLostError,
        f"slot {expired.lease_id} of limiter {expired.limiter!r} expired before its body "
        f"could start ({waited_ms:.0f} ms after asking; the process was paused longer "
        "than the lease lives), so the body did not run",
        limiter=asked.limiter.name,
    )


def _wait_failed(asked: SlotRequest, exc: BaseException, started: float) -> BaseException:
    """Emit the event for a failed wait; return the error the caller should see."""
    wait_ms = (time.monotonic() - started) * 1000
    if is_interrupt(exc) and not isinstance(exc, ConcurrencyError):
        asked.event("wait-cancelled", wait_ms=wait_ms)
        return exc
    for error_type, event_type in _WAIT_FAILURE_EVENTS:
        if isinstance(exc, error_type):
            extra = {"error": describe_error(exc)} if event_type == "config-error" else {}
            asked.event(event_type, wait_ms=None if extra else wait_ms, **extra)
            return exc
    if isinstance(exc, ConcurrencyError):
        asked.event("limiter-error", wait_ms=wait_ms, error=describe_error(exc))
        return exc
    # Anything else from the limiter (a driver error, a bug) fails closed.
    name = asked.limiter.name
    asked.event("limiter-error", wait_ms=wait_ms, error=describe_error(exc))
    return asked.error(ConcurrencyLimiterError, f"limiter {name!r} failed: {describe_error(exc)}")


def _adopt(
    asked: SlotRequest, cleanups: list[Callable[[], object]]
) -> tuple[SlotRequest, tuple[Lease, ...], float] | None:
    """The run's pre-admitted first slot, when this request is the run's first and
    names its limiters with the same workloads (in any order): the request (with the
    leases' request id), the leases in ``asked``'s order and how long its admission
    waited. ``None``: acquire as usual. Slots admitted for anything else are given back
    first: a run never holds part of its slots while it waits for others.

    :raises ConcurrencyLeaseLostError: a pre-admitted lease was lost before now.
    """
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
        for cleanup in cleanups:
            cleanup()
        lost = leases[0]
        asked.event("lease-lost", lease_id=lost.lease_id, hold_ms=0.0, reason="renewal", error=None)
        for limiter, lease in zip(asked.limiters, leases, strict=True):
            with contextlib.suppress(Exception):  # lost already: the limiter may know it
                limiter.release(lease, "lease-lost")
        raise abort_error(asked, lost, "lease-lost")
    return asked, leases, admitted.wait_ms


def preadmit(admission: Admission) -> PreAdmitted | Deferred | DuplicateDelivery:
    """Decide the current run's first slot before its body runs.

    Asks through ``admission`` (which may park the run) for the slot the run's first
    ``slot()`` would ask for: the run's limiter and workload, the admission's request
    id. A granted slot is kept (renewed, released on cancellation or at the end of the
    budget) as ``admission.admitted`` until a slot adopts it or the run ends
    (:meth:`~runcell_celery.admission.Admission.end`).

    :returns: the slot admitted; or :class:`~runcell_celery.admission.Deferred` (the
        run was parked; no event: it is not a failure) or
        :class:`~runcell_celery.admission.DuplicateDelivery`.
    :raises ConcurrencyError: as entering a slot would, with the same events.
    """
    run = current_run()
    if run is None:
        raise RuntimeError("preadmit() needs the run whose first slot it admits")
    several = len(admission.limiters) > 1
    asked: SlotRequest
    answer: Sequence[Lease] | Deferred | DuplicateDelivery
    try:
        if several:
            asked = build_several(run, admission.limiters, request_id=admission.request_id)
        else:
            asked = build_request(run, admission.limiter, request_id=admission.request_id)
    except ConcurrencyError as exc:
        if several:
            names = tuple(x.name for x in admission.limiters)
            report_refusal(exc, run.name, limiters=names, key=run.key)
        else:
            report_refusal(exc, run.name)
        raise
    started = time.monotonic()
    try:
        answer = admission.acquire(asked.limiters, asked.requests, run.cancel, asked)
        if isinstance(answer, Deferred | DuplicateDelivery):
            parked = answer.parked if isinstance(answer, Deferred) else None
            tracing.wait_deferred(asked, started, parked)
            return answer
        leases = _check_leases(asked, tuple(answer))
    except BaseException as exc:
        Slot._not_granted(asked, exc, started, [])
    tracing.wait_granted(asked, started, leases)
    waited_ms = _whole_wait_ms(leases, started)
    admitted = PreAdmitted(asked, leases if several else leases[0], wait_ms=waited_ms)
    admission.hold(admitted, run.deadline, run.cancel)
    return admitted


def _whole_wait_ms(leases: Sequence[Lease], started: float) -> float:
    """How long a run's first slot was waited for: what the limiter measured when it
    knows (a parked request's claim answers its wait since its first delivery asked, in
    database time), else this delivery's own wait since ``started``."""
    known = [lease.waited_ms for lease in leases if lease.waited_ms is not None]
    return max(known) if known else (time.monotonic() - started) * 1000


def _acquire(asked: SlotRequest, cancel: CancellationToken | None) -> tuple[Lease, ...]:
    # The request is its own on_wait (it emits wait-started and keeps its place).
    if not asked.several:
        return (asked.limiter.acquire(asked.request, cancel=cancel, on_wait=asked),)
    first = cast(SupportsSeveral, asked.limiter)
    leases = first.acquire_several(asked.limiters, asked.requests, cancel=cancel, on_wait=asked)
    return _check_leases(asked, tuple(leases))


def _check_leases(asked: SlotRequest, leases: tuple[Lease, ...]) -> tuple[Lease, ...]:
    """One lease per limiter, or none kept (a backend's bug fails closed)."""
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
    """Use the backend's ``acquire_async`` (``acquire_several_async``), or run a
    blocking acquire in a thread: then an asyncio cancellation cancels the thread's
    wait through a token, and slots granted meanwhile are released, not leaked."""
    first = asked.limiter
    if not asked.several and supports(first, SupportsAsyncAcquire):
        native = cast(SupportsAsyncAcquire, first)
        return (await native.acquire_async(asked.request, cancel=cancel, on_wait=asked),)
    if asked.several and supports(first, SupportsSeveralAsync):
        several = cast(SupportsSeveralAsync, first)
        leases = await several.acquire_several_async(
            asked.limiters, asked.requests, cancel=cancel, on_wait=asked
        )
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

    :param limiters: the limiter; defaults to the current run's. Several limiters
        (``slot(openai, gpt_4o, tenants.key("acme"))``): one slot in each, granted
        together or not at all, never some held while waiting for the others.
    :param workload: the workload; defaults to the run's, then the limiter's default.
        Over several limiters it applies in each that has it, the default elsewhere.
    :param key: the fairness key (a tenant) for limiters with ``fairness:
        "round_robin"``; defaults to the run's, then to the key of a key's limiter
        among ``limiters`` (``tenants.key("acme")`` -> ``"acme"``).
    :param max_hold_ms: end the hold as a lost lease after this long (defaults to the
        limiter's ``max_hold_ms``).
    :param cancel: a token that cancels this request (the run's still applies).
    :param request_id: a stable id for the request (defaults to a new one).
    :raises ConcurrencyConfigError: at once, naming the argument and the value, for an
        argument that is not what it must be: a limiter that is not a limiter, a
        blank workload or request id, a key :func:`~runcell_celery.keys.check_fair_key`
        refuses, ``max_hold_ms`` not a positive finite number, ``cancel`` not a token.
    :raises ConcurrencyError: see :mod:`runcell_celery.errors`; the provider must not
        be called when entering fails. ``ConcurrencyConfigError`` for a keyed limiter
        itself (name ``limiter.key(...)``), the same limiter twice, or limiters that
        cannot be held together (different backends).

    ::

        with slot(claude, workload="background") as s:
            reply = client.messages.create(..., extra_headers={"x-fence": str(s.fencing_token)})
    """
    made = Slot.__new__(Slot)  # not Slot(*limiters, ...): no second unpacking per call
    made._setup(limiters, workload, key, max_hold_ms, cancel, request_id)
    return made
