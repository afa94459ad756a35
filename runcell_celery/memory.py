"""A limiter for one process: threads and asyncio tasks share its slots.

State lives behind one lock; every decision about who is granted goes through
:func:`runcell_celery.allocation.allocate`. Waiting happens outside the lock: a
thread waits on its own ``threading.Event``, a coroutine on an ``asyncio.Event`` that
is set thread-safely, so a waiting coroutine never blocks its event loop and a release
wakes exactly the waiters it granted.

The wait loops are thin: :meth:`InMemoryConcurrencyLimiter._enqueue` decides whether a
request is granted at once, and :meth:`~InMemoryConcurrencyLimiter._settle` decides
after each wake-up whether it was granted, cancelled or timed out.

Several limiters in one request (``slot(openai, gpt_4o, tenants.key("acme"))``) are
decided by the process's one :mod:`coordinator <runcell_celery.memory_several>`: a
limiter named by a waiting several-limiter request is *coordinated* until no such
request waits for it, and meanwhile its state is guarded by the coordinator's lock
instead of its own, and every grant in it goes through
:func:`~runcell_celery.allocation.allocate_several`. Every other moment (the usual
one) a limiter decides alone under its own lock; the flag is read under that lock, so
the fast path costs one attribute read more. A limiter with ``fairness:
"round_robin"`` allocates with :func:`~runcell_celery.allocation.allocate_several` and
keeps, per key, when it last granted it (a bounded history).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import math
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, cast, overload

from .allocation import Waiting, allocate, allocate_several, has_room
from .base import ConfiguredLimiter
from .cancellation import CancellationToken
from .clock import SYSTEM_CLOCK, Clock
from .config import (
    DEFAULT_LEASE_TTL_MS,
    Fairness,
    LimiterConfig,
    WorkloadConfig,
    limiter_config,
)
from .protocol import (
    AcquireRequest,
    ConcurrencyLimiter,
    Lease,
    LimiterStats,
    OnWait,
    Outcome,
    QueuePlace,
    WorkloadStats,
    announce_wait,
)

if TYPE_CHECKING:
    from .memory_keys import KeyedInMemoryConcurrencyLimiter

__all__ = ["InMemoryConcurrencyLimiter", "create_concurrency_limiter"]

#: Arrival order across every limiter of the process (a coordinated request's age).
_arrivals = itertools.count()
#: Grant order across every limiter of the process (``last_granted`` for round robin).
_grants = itertools.count()
#: Keys a round-robin limiter remembers the last grant of. Forgetting the oldest keeps
#: the order of the rest: a forgotten key counts as granted longest ago, as it was.
HISTORY_LIMIT = 10_000


class _Held:
    __slots__ = ("expires_at", "lease")

    def __init__(self, lease: Lease, expires_at: float) -> None:
        self.lease = lease
        self.expires_at = expires_at


class _Waiter:
    """One waiting request, of one limiter or of several (then ``limiters`` has them all).

    What :func:`~runcell_celery.allocation.allocate` and
    :func:`~runcell_celery.allocation.allocate_several` read: ``workload`` (for several,
    the one the run selected; ``workloads`` has the one used in each limiter),
    ``in_progress``, ``limiters`` and ``key``.
    """

    __slots__ = (
        "arrival",
        "deadline",
        "in_progress",
        "key",
        "lease",
        "leases",
        "limiters",
        "request",
        "requests",
        "wake",
        "workload",
        "workloads",
    )

    def __init__(
        self,
        request: AcquireRequest,
        workload: str | None,
        limiters: tuple[InMemoryConcurrencyLimiter, ...],
        requests: tuple[AcquireRequest, ...] | None = None,
        workloads: tuple[str, ...] | None = None,
    ) -> None:
        self.request = request
        self.workload = workload
        self.in_progress = request.in_progress
        self.key: Hashable | None = request.key
        self.limiters = limiters
        self.requests = (request,) if requests is None else requests
        self.workloads: tuple[str, ...] = (request.workload,) if workloads is None else workloads
        self.arrival = next(_arrivals)
        self.deadline = math.inf
        self.lease: Lease | None = None
        self.leases: tuple[Lease, ...] | None = None
        self.wake: Callable[[], None] = _nothing


def _nothing() -> None:
    return None


class InMemoryConcurrencyLimiter(ConfiguredLimiter):
    """Slots shared by the threads and coroutines of one process.

    Create it with :func:`create_concurrency_limiter`. For several processes or hosts
    use :func:`runcell_celery.postgres.create_postgres_concurrency_limiter`.

    :param config: the limits.
    :param clock: monotonic and wall clocks; tests pass a fake one to expire leases
        without waiting.
    """

    def __init__(self, config: LimiterConfig, *, clock: Clock = SYSTEM_CLOCK) -> None:
        super().__init__(config)
        self._clock = clock
        self._lock = threading.Lock()
        self._held: dict[str, _Held] = {}
        self._active: dict[str, int] = dict.fromkeys(config.workloads, 0)
        self._waiting: list[_Waiter] = []
        self._tokens = itertools.count(1)
        self._id_prefix = f"{config.name}:{uuid.uuid4().hex[:12]}:"
        self._next_expiry = math.inf
        #: True while the coordinator decides for this limiter (memory_several).
        self._coordinated = False
        #: Coordinated requests waiting for a slot here.
        self._coordinated_waiting = 0
        #: Round robin: per key, the grant sequence number of its latest grant here.
        self._history: OrderedDict[Hashable | None, int] | None = (
            OrderedDict() if config.fairness == "round_robin" else None
        )
        #: The keyed limiter this is a key of (told when this key is busy or idle).
        self._owner: KeyedInMemoryConcurrencyLimiter | None = None
        self._key: str | None = None
        self._busy = False
        #: Something to do on each grant: round-robin history or telling the owner.
        self._watch_grants = self._history is not None

    # -- acquire --------------------------------------------------------------------

    def acquire(
        self,
        request: AcquireRequest,
        *,
        cancel: CancellationToken | None = None,
        on_wait: OnWait | None = None,
    ) -> Lease:
        """Wait (blocking this thread) for a slot; see :class:`ConcurrencyLimiter`."""
        waiter = self._enqueue(request, cancel)
        if isinstance(waiter, Lease):
            return waiter
        event = threading.Event()
        waiter.wake = event.set
        unlink = cancel.add_callback(event.set) if cancel is not None else _nothing
        try:
            self._announce(waiter, on_wait)
            while True:
                lease = self._settle(waiter, cancel)
                if lease is not None:
                    return lease
                event.wait(self._sleep_seconds(waiter))
                event.clear()
        except BaseException:
            self._abandon(waiter)
            raise
        finally:
            unlink()

    async def acquire_async(
        self,
        request: AcquireRequest,
        *,
        cancel: CancellationToken | None = None,
        on_wait: OnWait | None = None,
    ) -> Lease:
        """Wait for a slot without blocking the event loop; asyncio-cancellation safe."""
        waiter = self._enqueue(request, cancel)
        if isinstance(waiter, Lease):
            return waiter
        loop = asyncio.get_running_loop()
        event = asyncio.Event()

        def wake() -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed; waiter abandoned
                loop.call_soon_threadsafe(event.set)

        waiter.wake = wake
        unlink = cancel.add_callback(wake) if cancel is not None else _nothing
        try:
            self._announce(waiter, on_wait)
            while True:
                lease = self._settle(waiter, cancel)
                if lease is not None:
                    return lease
                # Not ``wait_for``: on Python 3.11 it swallows a cancellation that
                # arrives as the event is set, and the cancelled task would get a slot.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self._sleep_seconds(waiter)):
                        await event.wait()
                event.clear()
        except BaseException:
            self._abandon(waiter)
            raise
        finally:
            unlink()

    def acquire_several(
        self,
        limiters: Sequence[ConcurrencyLimiter],
        requests: Sequence[AcquireRequest],
        *,
        cancel: CancellationToken | None = None,
        on_wait: OnWait | None = None,
    ) -> tuple[Lease, ...]:
        """Wait for one slot in each of ``limiters`` (this one among them), granted
        together; see :class:`~runcell_celery.protocol.SupportsSeveral`."""
        from .memory_several import acquire_several

        return acquire_several(limiters, requests, cancel=cancel, on_wait=on_wait)

    async def acquire_several_async(
        self,
        limiters: Sequence[ConcurrencyLimiter],
        requests: Sequence[AcquireRequest],
        *,
        cancel: CancellationToken | None = None,
        on_wait: OnWait | None = None,
    ) -> tuple[Lease, ...]:
        """As :meth:`acquire_several`, without blocking the event loop or a thread."""
        from .memory_several import acquire_several_async

        return await acquire_several_async(limiters, requests, cancel=cancel, on_wait=on_wait)

    def _enqueue(
        self, request: AcquireRequest, cancel: CancellationToken | None
    ) -> Lease | _Waiter:
        """Grant at once if the rules allow; otherwise queue the request or refuse it."""
        workload = self._resolve(request)
        if cancel is not None and cancel.is_set():
            raise self._cancelled(request)
        now = self._clock.monotonic()
        with self._lock:
            if not self._coordinated:
                self._reap_locked(now)
                if not self._waiting and has_room(self._config, self._active, workload):
                    return self._grant_locked(request, workload, now)
                return self._queue_locked(request, workload, now)
        return COORDINATOR.call(self, self._queue_locked, request, workload, now)

    def _queue_locked(self, request: AcquireRequest, workload: str, now: float) -> Lease | _Waiter:
        waiter = _Waiter(request, workload, (self,))
        if self._coordinated:
            return COORDINATOR.enqueue_locked(waiter, now)
        self._reap_locked(now)
        self._waiting.append(waiter)
        self._busy_locked()
        self._allocate_locked(now)
        if waiter.lease is not None:
            return waiter.lease
        max_queued = self._config.max_queued
        if max_queued is not None and len(self._waiting) > max_queued:
            self._waiting.remove(waiter)
            self._idle_locked()
            raise self._queue_full(request)
        wait_ms = self._wait_ms(request, workload)
        if wait_ms is not None and wait_ms <= 0:
            self._waiting.remove(waiter)
            self._idle_locked()
            raise self._timed_out(request, wait_ms)
        if wait_ms is not None:
            waiter.deadline = now + wait_ms / 1000
        return waiter

    def _announce(self, waiter: _Waiter, on_wait: OnWait | None) -> None:
        if on_wait is None:
            return
        deadline = waiter.deadline
        clock = self._clock
        at = None if math.isinf(deadline) else clock.time() + (deadline - clock.monotonic())
        announce_wait(on_wait, at, functools.partial(self._place, waiter))

    def _place(self, waiter: _Waiter) -> QueuePlace:
        """The waiter's place in its workload's line here (counted only when asked)."""
        with self._lock:
            if not self._coordinated:
                return place_in_line(waiter, self._waiting)
        return COORDINATOR.call(self, self._place_locked, waiter)

    def _place_locked(self, waiter: _Waiter) -> QueuePlace:
        return place_in_line(waiter, COORDINATOR.waiting if self._coordinated else self._waiting)

    def _settle(self, waiter: _Waiter, cancel: CancellationToken | None) -> Lease | None:
        """After a wake-up: return the lease, raise cancel/timeout, or ``None`` to wait on."""
        now = self._clock.monotonic()
        with self._lock:
            if not self._coordinated:
                return self._settle_locked(waiter, cancel, now)
        return COORDINATOR.call(self, self._settle_locked, waiter, cancel, now)

    def _settle_locked(
        self, waiter: _Waiter, cancel: CancellationToken | None, now: float
    ) -> Lease | None:
        if cancel is not None and cancel.is_set():
            self._drop_locked(waiter, now)
            raise self._cancelled(waiter.request)
        if waiter.lease is None:
            self._reap_locked(now)
        if waiter.lease is not None:
            return waiter.lease
        if now >= waiter.deadline:
            self._drop_locked(waiter, now)
            assert waiter.workload is not None
            waited = self._wait_ms(waiter.request, waiter.workload)
            raise self._timed_out(waiter.request, waited)
        return None

    def _abandon(self, waiter: _Waiter) -> None:
        """Leave the queue after an unexpected exit, returning a slot granted meanwhile."""
        now = self._clock.monotonic()
        with self._lock:
            if not self._coordinated:
                self._drop_locked(waiter, now)
                return
        COORDINATOR.call(self, self._drop_locked, waiter, now)

    def _drop_locked(self, waiter: _Waiter, now: float) -> None:
        if waiter.lease is not None:
            # Granted at the same moment as the cancel or timeout: give it back.
            self._release_locked(waiter.lease.lease_id, now)
        elif self._coordinated:
            COORDINATOR.remove_locked(waiter, now)
        elif waiter in self._waiting:
            self._waiting.remove(waiter)
            self._allocate_locked(now)
            self._idle_locked()

    def _sleep_seconds(self, waiter: _Waiter) -> float | None:
        now = self._clock.monotonic()
        wake_at = min(waiter.deadline, self._next_expiry)
        return None if math.isinf(wake_at) else max(0.0, wake_at - now)

    # -- renew and release ----------------------------------------------------------

    def renew(self, lease: Lease) -> Lease | None:
        """Extend ``lease`` by its TTL; ``None`` if it expired or was released."""
        with self._lock:
            if not self._coordinated:
                return self._renew_locked(lease, self._clock.monotonic())
        return COORDINATOR.call(self, self._renew_locked, lease, self._clock.monotonic())

    def renew_many(self, leases: Sequence[Lease]) -> Mapping[str, Lease | None]:
        """Renew several leases under one lock acquisition."""
        with self._lock:
            if not self._coordinated:
                return self._renew_many_locked(leases)
        return COORDINATOR.call(self, self._renew_many_locked, leases)

    def _renew_many_locked(self, leases: Sequence[Lease]) -> Mapping[str, Lease | None]:
        now = self._clock.monotonic()
        return {lease.lease_id: self._renew_locked(lease, now) for lease in leases}

    def release(self, lease: Lease, outcome: Outcome = "success") -> None:
        """Return the slot; releasing twice or after expiry does nothing."""
        with self._lock:
            if not self._coordinated:
                self._release_locked(lease.lease_id, self._clock.monotonic())
                return
        COORDINATOR.call(self, self._release_locked, lease.lease_id, self._clock.monotonic())

    def stats(self) -> LimiterStats:
        """Return active and queued counts, in total and per workload."""
        with self._lock:
            if not self._coordinated:
                return self._stats_locked()
        return COORDINATOR.call(self, self._stats_locked)

    def _stats_locked(self) -> LimiterStats:
        self._reap_locked(self._clock.monotonic())
        queued = dict.fromkeys(self._config.workloads, 0)
        for workload in self._waiting_workloads_locked():
            queued[workload] += 1
        return LimiterStats(
            active=sum(self._active.values()),
            queued=sum(queued.values()),
            workloads={
                name: WorkloadStats(active=self._active[name], queued=queued[name])
                for name in self._config.workloads
            },
        )

    def _waiting_workloads_locked(self) -> list[str]:
        """The workload here of every request waiting for a slot here."""
        if self._coordinated:
            return COORDINATOR.workloads_waiting_locked(self)
        return [waiter.workloads[0] for waiter in self._waiting]

    def reap(self) -> int:
        """Drop expired leases now (normally done lazily); return how many."""
        with self._lock:
            if not self._coordinated:
                self._next_expiry = -math.inf
                return self._reap_locked(self._clock.monotonic())
        return COORDINATOR.call(self, self._reap_now_locked)

    def _reap_now_locked(self) -> int:
        self._next_expiry = -math.inf
        return self._reap_locked(self._clock.monotonic())

    # -- under the lock (the coordinator's while coordinated) --------------------------

    def _grant_locked(self, request: AcquireRequest, workload: str, now: float) -> Lease:
        token = next(self._tokens)
        ttl_ms = self._config.lease_ttl_ms
        lease = Lease(
            lease_id=f"{self._id_prefix}{token}",
            limiter=self._config.name,
            workload=workload,
            request_id=request.request_id,
            fencing_token=token,
            ttl_ms=ttl_ms,
        )
        expires_at = now + ttl_ms / 1000
        self._held[lease.lease_id] = _Held(lease, expires_at)
        self._active[workload] += 1
        self._next_expiry = min(self._next_expiry, expires_at)
        if self._watch_grants:
            self._granted_locked(request.key)
        return lease

    def _granted_locked(self, key: Hashable | None) -> None:
        history = self._history
        if history is not None:
            history[key] = next(_grants)
            history.move_to_end(key)
            if len(history) > HISTORY_LIMIT:
                history.popitem(last=False)
        self._busy_locked()

    def _allocate_locked(self, now: float) -> None:
        if self._coordinated:
            COORDINATOR.allocate_locked(now)
            return
        if not self._waiting:
            return
        if self._history is None:
            granted = allocate(self._config, self._active, cast("list[Waiting]", self._waiting))
        else:
            granted = allocate_several(
                {self: self._config},
                {self: self._active},
                self._waiting,
                last_granted={self: self._history},
            )
        if not granted:
            return
        for position in granted:
            waiter = self._waiting[position]
            waiter.lease = self._grant_locked(waiter.request, waiter.workloads[0], now)
        chosen = set(granted)
        woken = [self._waiting[p] for p in granted]
        self._waiting = [w for p, w in enumerate(self._waiting) if p not in chosen]
        for waiter in woken:
            waiter.wake()

    def _release_locked(self, lease_id: str, now: float) -> None:
        held = self._held.pop(lease_id, None)
        if held is None:
            return
        self._active[held.lease.workload] -= 1
        self._allocate_locked(now)
        if self._owner is not None:
            self._idle_locked()

    def _renew_locked(self, lease: Lease, now: float) -> Lease | None:
        held = self._held.get(lease.lease_id)
        if held is None:
            return None
        if held.expires_at <= now:
            self._release_locked(lease.lease_id, now)
            return None
        held.expires_at = now + held.lease.ttl_ms / 1000
        return held.lease

    def _reap_locked(self, now: float) -> int:
        if now < self._next_expiry:
            return 0
        expired = [lease_id for lease_id, h in self._held.items() if h.expires_at <= now]
        for lease_id in expired:
            held = self._held.pop(lease_id)
            self._active[held.lease.workload] -= 1
        self._next_expiry = min((h.expires_at for h in self._held.values()), default=math.inf)
        if expired:
            self._allocate_locked(now)
            self._idle_locked()
        return len(expired)

    # -- a key of a keyed limiter: busy keys are kept, idle ones forgotten -------------

    def _busy_locked(self) -> None:
        if self._owner is not None and not self._busy:
            self._busy = True
            self._owner._key_busy(self)

    def _idle_locked(self) -> None:
        if (
            self._owner is not None
            and self._busy
            and not (self._held or self._waiting or self._coordinated)
        ):
            self._busy = False
            self._owner._key_idle(self)


@overload
def create_concurrency_limiter(
    max_concurrent: int,
    *,
    max_queued: int | None = ...,
    workloads: Mapping[str, WorkloadConfig | Mapping[str, Any]] | None = ...,
    default_workload: str | None = ...,
    name: str = ...,
    lease_ttl_ms: int = ...,
    max_hold_ms: int | None = ...,
    fairness: Fairness = ...,
    keyed: Literal[False] = ...,
    clock: Clock = ...,
) -> InMemoryConcurrencyLimiter: ...


@overload
def create_concurrency_limiter(
    max_concurrent: int,
    *,
    max_queued: int | None = ...,
    workloads: Mapping[str, WorkloadConfig | Mapping[str, Any]] | None = ...,
    default_workload: str | None = ...,
    name: str = ...,
    lease_ttl_ms: int = ...,
    max_hold_ms: int | None = ...,
    fairness: Fairness = ...,
    keyed: Literal[True],
    clock: Clock = ...,
) -> KeyedInMemoryConcurrencyLimiter: ...


def create_concurrency_limiter(
    max_concurrent: int,
    *,
    max_queued: int | None = None,
    workloads: Mapping[str, WorkloadConfig | Mapping[str, Any]] | None = None,
    default_workload: str | None = None,
    name: str = "default",
    lease_ttl_ms: int = DEFAULT_LEASE_TTL_MS,
    max_hold_ms: int | None = None,
    fairness: Fairness = "fifo",
    keyed: bool = False,
    clock: Clock = SYSTEM_CLOCK,
) -> InMemoryConcurrencyLimiter | KeyedInMemoryConcurrencyLimiter:
    """Create a limiter shared by the threads and coroutines of this process.

    The options are those of :class:`~runcell_celery.config.LimiterConfig`; workloads
    may be given as dicts. Invalid settings raise
    :class:`~runcell_celery.errors.ConcurrencyConfigError` naming the field.
    ``keyed=True`` gives each key its own limit with these settings: it returns a
    :class:`~runcell_celery.memory_keys.KeyedInMemoryConcurrencyLimiter`, whose
    ``key("acme")`` is the limiter of that key.

    >>> claude = create_concurrency_limiter(
    ...     8, name="claude", workloads={"interactive": {"reserved": 2}, "background": {}}
    ... )
    """
    config = limiter_config(
        max_concurrent,
        max_queued=max_queued,
        workloads=workloads,
        default_workload=default_workload,
        name=name,
        lease_ttl_ms=lease_ttl_ms,
        max_hold_ms=max_hold_ms,
        fairness=fairness,
        keyed=keyed,
    )
    if config.keyed:
        from .memory_keys import KeyedInMemoryConcurrencyLimiter

        return KeyedInMemoryConcurrencyLimiter(config, clock=clock)
    return InMemoryConcurrencyLimiter(config, clock=clock)


from .memory_several import COORDINATOR, place_in_line  # noqa: E402 - it needs the classes above
