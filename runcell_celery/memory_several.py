"""Several in-memory limiters in one request: the process's one coordinator.

``slot(openai, gpt_4o, tenants.key("acme"))`` takes one slot in each limiter, all
together or none, and never holds part of them while it waits (README, "Several limits
and keys"). The decision is :func:`~runcell_celery.allocation.allocate_several`; this
module stores what it reads and carries out what it says.

One process-wide :class:`Coordinator` with one lock decides for every limiter a
several-limiter request waits for. Such a limiter is *coordinated*: from the moment the
first such request queues for it until none waits for it any more, its state (held
leases, counts, waiters) is guarded by the coordinator's lock instead of its own, its
single-limiter waiters are in the coordinator's line too (in arrival order), and every
grant in it is decided over all the coordinated limiters at once. Every other moment a
limiter decides alone under its own lock, as before; that is the fast path, and it
only reads one flag more.

Locks: the coordinator's, then a limiter's (to switch it in or out), then a keyed
limiter's. The flag changes only with both of the first two held, and a limiter's own
lock holder reads it first thing, so a state is never guarded by two locks at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import threading
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from .allocation import allocate_several, has_room
from .cancellation import CancellationToken
from .errors import ConcurrencyConfigError, ConcurrencyTimeoutError
from .protocol import (
    AcquireRequest,
    ConcurrencyLimiter,
    Lease,
    OnWait,
    QueuePlace,
    announce_wait,
)

if TYPE_CHECKING:
    from .memory import InMemoryConcurrencyLimiter, _Waiter

__all__ = [
    "COORDINATOR",
    "Coordinator",
    "acquire_several",
    "acquire_several_async",
    "place_in_line",
]

T = TypeVar("T")


class Coordinator:
    """Decides grants for the limiters several-limiter requests wait for."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        #: Every waiting request of the coordinated limiters, oldest first.
        self.waiting: list[_Waiter] = []
        self.members: dict[int, InMemoryConcurrencyLimiter] = {}

    def call(self, limiter: InMemoryConcurrencyLimiter, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn`` under the lock that guards ``limiter``'s state now: the
        coordinator's if it is coordinated, else its own (taken after ours)."""
        with self.lock:
            if limiter._coordinated:
                return fn(*args)
            with limiter._lock:
                return fn(*args)

    # -- under the coordinator's lock --------------------------------------------------

    def join_locked(self, limiter: InMemoryConcurrencyLimiter) -> None:
        """Make ``limiter`` coordinated: its waiters move into the coordinator's line."""
        if limiter._coordinated:
            return
        with limiter._lock:
            moved = limiter._waiting
            limiter._waiting = []
            limiter._coordinated = True
            limiter._coordinated_waiting += len(moved)
            self.members[id(limiter)] = limiter
        if moved:
            self.waiting.extend(moved)
            self.waiting.sort(key=lambda w: w.arrival)

    def _leave_idle_locked(self, limiters: Sequence[InMemoryConcurrencyLimiter]) -> None:
        """Hand limiters no coordinated request waits for back to their own lock."""
        for limiter in limiters:
            if limiter._coordinated and not limiter._coordinated_waiting:
                with limiter._lock:
                    limiter._coordinated = False
                    self.members.pop(id(limiter), None)
                    limiter._idle_locked()

    def enqueue_locked(self, waiter: _Waiter, now: float) -> Lease | _Waiter:
        """Queue ``waiter`` (one limiter or several), grant what the rules allow, and
        return its lease if granted at once; raise queue-full or timed-out."""
        for limiter in waiter.limiters:
            self.join_locked(limiter)
            limiter._reap_locked(now)
        self.waiting.append(waiter)
        for limiter in waiter.limiters:
            limiter._coordinated_waiting += 1
            limiter._busy_locked()
        self.allocate_locked(now)
        if waiter.lease is not None:
            return waiter.lease
        for limiter, request in zip(waiter.limiters, waiter.requests, strict=True):
            max_queued = limiter.config.max_queued
            if max_queued is not None and limiter._coordinated_waiting > max_queued:
                self.remove_locked(waiter, now)
                raise limiter._queue_full(request)
        wait_ms = _wait_ms(waiter)
        if wait_ms is not None and wait_ms <= 0:
            self.remove_locked(waiter, now)
            raise _timed_out(waiter, wait_ms)
        if wait_ms is not None:
            waiter.deadline = now + wait_ms / 1000
        return waiter

    def remove_locked(self, waiter: _Waiter, now: float) -> None:
        """Take a waiter that was not granted out of line; grant what that frees."""
        if waiter not in self.waiting:
            return
        self.waiting.remove(waiter)
        for limiter in waiter.limiters:
            limiter._coordinated_waiting -= 1
        # It may have been anchored (rule 4 of allocate_several), keeping room.
        self.allocate_locked(now)
        self._leave_idle_locked(waiter.limiters)

    def allocate_locked(self, now: float) -> None:
        """Grant every request the rules allow now, in the order they say."""
        waiting = self.waiting
        if not waiting:
            return
        limits: dict[Hashable, Any] = {}
        active: dict[Hashable, Mapping[str, int]] = {}
        history: dict[Hashable, Mapping[Hashable | None, int]] = {}
        for waiter in waiting:
            for limiter in waiter.limiters:
                if limiter not in limits:
                    limits[limiter] = limiter.config
                    active[limiter] = limiter._active
                    if limiter._history is not None:
                        history[limiter] = limiter._history
        granted = allocate_several(limits, active, waiting, last_granted=history)
        if not granted:
            return
        touched: dict[int, InMemoryConcurrencyLimiter] = {}
        for position in granted:
            waiter = waiting[position]
            leases = tuple(
                limiter._grant_locked(request, workload, now)
                for limiter, request, workload in zip(
                    waiter.limiters, waiter.requests, waiter.workloads, strict=True
                )
            )
            waiter.leases = leases
            waiter.lease = leases[0]
            for limiter in waiter.limiters:
                limiter._coordinated_waiting -= 1
                touched[id(limiter)] = limiter
        chosen = set(granted)
        woken = [waiting[p] for p in granted]
        self.waiting = [w for p, w in enumerate(waiting) if p not in chosen]
        for waiter in woken:
            waiter.wake()
        self._leave_idle_locked(list(touched.values()))

    def workloads_waiting_locked(self, limiter: InMemoryConcurrencyLimiter) -> list[str]:
        """The workload in ``limiter`` of every coordinated request waiting for it."""
        return [
            workload
            for waiter in self.waiting
            for member, workload in zip(waiter.limiters, waiter.workloads, strict=True)
            if member is limiter
        ]


#: The process's coordinator (in-memory limiters are per process).
COORDINATOR = Coordinator()


def _wait_ms(waiter: _Waiter) -> float | None:
    """The longest a several-limiter request may wait: the shortest of its limits."""
    limits = [
        limiter._wait_ms(request, workload)
        for limiter, request, workload in zip(
            waiter.limiters, waiter.requests, waiter.workloads, strict=True
        )
    ]
    given = [x for x in limits if x is not None]
    return min(given) if given else None


def _timed_out(waiter: _Waiter, wait_ms: float | None) -> ConcurrencyTimeoutError:
    """No slot in time: the error names the limiters that had no room."""
    if len(waiter.limiters) == 1:
        return waiter.limiters[0]._timed_out(waiter.request, wait_ms)
    full = [
        limiter.name
        for limiter, workload in zip(waiter.limiters, waiter.workloads, strict=True)
        if not has_room(limiter.config, limiter._active, workload)
    ]
    shown = "no time" if wait_ms is None else f"{wait_ms:g} ms"
    names = ", ".join(repr(limiter.name) for limiter in waiter.limiters)
    lacking = ", ".join(repr(name) for name in full) or "none (others were served first)"
    return waiter.request.error(
        ConcurrencyTimeoutError,
        f"no slots in limiters {names} together within {shown} (no room in: {lacking})",
        limiter=waiter.limiters[0].name,
    )


def acquire_several(
    limiters: Sequence[ConcurrencyLimiter],
    requests: Sequence[AcquireRequest],
    *,
    cancel: CancellationToken | None = None,
    on_wait: OnWait | None = None,
) -> tuple[Lease, ...]:
    """Wait (blocking this thread) for one slot in every in-memory limiter of
    ``limiters``, granted together.

    See :class:`~runcell_celery.protocol.SupportsSeveral`; nothing is held while waiting,
    and a slot set granted at the moment of a cancel or timeout is given back.
    """
    waiter = _enqueue(limiters, requests, cancel)
    if isinstance(waiter, tuple):
        return waiter
    clock = waiter.limiters[0]._clock
    event = threading.Event()
    waiter.wake = event.set
    unlink = cancel.add_callback(event.set) if cancel is not None else _nothing
    try:
        _announce(waiter, on_wait)
        while True:
            leases = _settle(waiter, cancel, clock.monotonic())
            if leases is not None:
                return leases
            event.wait(_sleep_seconds(waiter, clock.monotonic()))
            event.clear()
    except BaseException:
        _abandon(waiter, clock.monotonic())
        raise
    finally:
        unlink()


async def acquire_several_async(
    limiters: Sequence[ConcurrencyLimiter],
    requests: Sequence[AcquireRequest],
    *,
    cancel: CancellationToken | None = None,
    on_wait: OnWait | None = None,
) -> tuple[Lease, ...]:
    """As :func:`acquire_several`, waiting without blocking the event loop (and without
    a thread); asyncio-cancellation safe."""
    waiter = _enqueue(limiters, requests, cancel)
    if isinstance(waiter, tuple):
        return waiter
    clock = waiter.limiters[0]._clock
    loop = asyncio.get_running_loop()
    event = asyncio.Event()

    def wake() -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed; waiter abandoned
            loop.call_soon_threadsafe(event.set)

    waiter.wake = wake
    unlink = cancel.add_callback(wake) if cancel is not None else _nothing
    try:
        _announce(waiter, on_wait)
        while True:
            leases = _settle(waiter, cancel, clock.monotonic())
            if leases is not None:
                return leases
            # Not ``wait_for``: on Python 3.11 it swallows a cancellation that arrives
            # as the event is set, and the cancelled task would get the slots.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_sleep_seconds(waiter, clock.monotonic())):
                    await event.wait()
            event.clear()
    except BaseException:
        _abandon(waiter, clock.monotonic())
        raise
    finally:
        unlink()


def _enqueue(
    limiters: Sequence[ConcurrencyLimiter],
    requests: Sequence[AcquireRequest],
    cancel: CancellationToken | None,
) -> tuple[Lease, ...] | _Waiter:
    """Check the request, then grant it at once or queue it (or refuse it)."""
    from .memory import InMemoryConcurrencyLimiter, _Waiter

    members: list[InMemoryConcurrencyLimiter] = []
    for limiter in limiters:
        if not isinstance(limiter, InMemoryConcurrencyLimiter):
            names = ", ".join(repr(x.name) for x in limiters)
            raise ConcurrencyConfigError(
                f"limiters {names} cannot be held together: {limiter.name!r} is not an "
                "in-memory limiter of this process",
                limiter=limiter.name,
            )
        members.append(limiter)
    if len(members) != len(requests) or not members:
        raise ValueError("acquire_several needs one request per limiter")
    if len({id(x) for x in members}) != len(members):
        raise ConcurrencyConfigError(
            "a request names the same limiter twice", limiter=members[0].name
        )
    workloads = tuple(x._resolve(r) for x, r in zip(members, requests, strict=True))
    first = requests[0]
    if cancel is not None and cancel.is_set():
        raise members[0]._cancelled(first)
    selected = _selected(members, workloads)
    waiter = _Waiter(first, selected, tuple(members), tuple(requests), workloads)
    with COORDINATOR.lock:
        queued = COORDINATOR.enqueue_locked(waiter, members[0]._clock.monotonic())
    if isinstance(queued, Lease):
        assert waiter.leases is not None
        return waiter.leases
    return waiter


def _announce(waiter: _Waiter, on_wait: OnWait | None) -> None:
    if on_wait is None:
        return
    clock = waiter.limiters[0]._clock
    deadline = waiter.deadline
    at = None if math.isinf(deadline) else clock.time() + (deadline - clock.monotonic())
    announce_wait(on_wait, at, functools.partial(_place, waiter))


def _place(waiter: _Waiter) -> QueuePlace:
    with COORDINATOR.lock:  # its limiters are coordinated while it waits
        return place_in_line(waiter, COORDINATOR.waiting)


def place_in_line(waiter: _Waiter, line: Sequence[_Waiter]) -> QueuePlace:
    """Where ``waiter`` stands in ``line`` (a limiter's, or the coordinator's): in each
    of its limiters, one more than the requests of its workload there that joined
    before it and still wait; over several limiters the largest (it is granted when
    every line lets it through). Allocation may serve some later arrivals first (a run
    in progress, a round-robin key): like the PostgreSQL limiter's, it is the place by
    arrival. The in-memory limiter knows no mean hold time: no expected wait."""
    ahead = [0] * len(waiter.limiters)
    for other in line:
        if other.arrival >= waiter.arrival:
            continue
        for member, workload in zip(other.limiters, other.workloads, strict=True):
            for i, (mine, wanted) in enumerate(zip(waiter.limiters, waiter.workloads, strict=True)):
                if member is mine and workload == wanted:
                    ahead[i] += 1
    return QueuePlace(place=max(ahead) + 1)


def _selected(
    limiters: Sequence[InMemoryConcurrencyLimiter], workloads: Sequence[str]
) -> str | None:
    """The one workload a run selected that resolves to ``workloads``: in each limiter
    that workload where it exists, else that limiter's default (allocation's rule)."""
    for candidate in (None, *dict.fromkeys(workloads)):
        resolved = [
            candidate
            if candidate is not None and candidate in limiter.config.workloads
            else limiter.config.default_workload
            for limiter in limiters
        ]
        if resolved == list(workloads):
            return candidate
    raise ConcurrencyConfigError(
        f"workloads {list(workloads)!r} are not one selection: a request uses the workload "
        "it selects in every limiter that has it, and the default in the others",
        limiter=limiters[0].name,
    )


def _nothing() -> None:
    return None


def _settle(
    waiter: _Waiter, cancel: CancellationToken | None, now: float
) -> tuple[Lease, ...] | None:
    """After a wake-up: the leases, a cancel or timeout raised, or ``None`` to wait on."""
    with COORDINATOR.lock:
        if waiter.leases is None and not (cancel is not None and cancel.is_set()):
            for limiter in waiter.limiters:
                if limiter._coordinated:
                    limiter._reap_locked(now)
        leases = waiter.leases
        if cancel is not None and cancel.is_set():
            COORDINATOR.remove_locked(waiter, now)
            error: BaseException = waiter.limiters[0]._cancelled(waiter.request)
        elif leases is not None:
            return leases
        elif now >= waiter.deadline:
            COORDINATOR.remove_locked(waiter, now)
            error = _timed_out(waiter, _wait_ms(waiter))
        else:
            return None
    # Granted at the same moment as the cancel: give every slot back.
    _release_all(waiter, leases)
    raise error


def _abandon(waiter: _Waiter, now: float) -> None:
    """Leave the line after an unexpected exit, returning slots granted meanwhile."""
    with COORDINATOR.lock:
        COORDINATOR.remove_locked(waiter, now)
        leases = waiter.leases
    _release_all(waiter, leases)


def _release_all(waiter: _Waiter, leases: tuple[Lease, ...] | None) -> None:
    if leases is None:
        return
    for limiter, lease in zip(waiter.limiters, leases, strict=True):
        limiter.release(lease, "cancelled")


def _sleep_seconds(waiter: _Waiter, now: float) -> float | None:
    """Until the deadline or the next lease expiry in one of its limiters."""
    wake_at = min([waiter.deadline, *(x._next_expiry for x in waiter.limiters)])
    return None if math.isinf(wake_at) else max(0.0, wake_at - now)
