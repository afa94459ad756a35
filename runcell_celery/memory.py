"""Limiters for one process: threads and asyncio tasks share their slots.

Grants are decided by :mod:`~runcell_celery.allocation` under a lock; each waiter
waits outside it on its own event, so a release wakes exactly the waiters it granted.
A limiter named by a waiting request over several limiters is *coordinated*: until no
such request waits for it, its state is guarded by its :class:`Coordinator`'s lock and
its waiters stand in the coordinator's line (requests over limiters of different
coordinators merge them). Locks: a coordinator's, then a limiter's; the flag changes
only with both held; coordinators being merged are locked in ``id`` order.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import math
import threading
import uuid
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from .allocation import GROUP_AGEING_MS, allocate_members, has_room
from .background import DEFAULT_REGISTRY
from .base import ConfiguredLimiter
from .cancellation import CancellationToken
from .clock import SYSTEM_CLOCK, Clock
from .config import LimiterConfig
from .errors import ConcurrencyConfigError, ConcurrencyError, ConcurrencyTimeoutError
from .protocol import (
    AcquireRequest,
    KeyStats,
    Lease,
    LimiterStats,
    Member,
    OnWait,
    Outcome,
    QueuePlace,
    WorkloadStats,
    announce_wait,
)

__all__ = ["HISTORY_LIMIT", "Coordinator", "InMemoryConcurrencyLimiter", "place_in_line"]

T = TypeVar("T")


#: Keys a round-robin limiter remembers the last grant of (a forgotten key counts as
#: granted longest ago, as it was).
HISTORY_LIMIT = 10_000


def _nothing() -> None:
    return None


@dataclass(slots=True)
class _Held:
    lease: Lease
    expires_at: float


@dataclass(eq=False, slots=True)  # eq=False: a waiter is found in a line by identity
class _Waiter:
    """A waiting request as allocation reads it (``workloads``: the one in each limiter)."""

    workload: str | None
    limiters: tuple[InMemoryConcurrencyLimiter, ...]
    requests: tuple[AcquireRequest, ...]
    workloads: tuple[str, ...]
    queued_at: float
    request: AcquireRequest = field(init=False)
    in_progress: bool = field(init=False)
    key: Hashable | None = field(init=False)
    #: Arrival order across every limiter of the process (a coordinated request's age).
    arrival: int = field(
        init=False,
        default_factory=lambda: next(DEFAULT_REGISTRY.shared("memory.arrivals", itertools.count)),
    )
    aged: bool = False
    deadline: float = math.inf
    leases: tuple[Lease, ...] | None = None
    wake: Callable[[], None] = _nothing

    def __post_init__(self) -> None:
        self.request = self.requests[0]
        self.in_progress = self.request.in_progress
        self.key = self.request.key


class Coordinator:
    """Decides grants for the limiters that requests over several limiters wait for."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.waiting: list[_Waiter] = []  # oldest first
        self.members: dict[int, InMemoryConcurrencyLimiter] = {}
        self.merged_into: Coordinator | None = None

    def root(self) -> Coordinator:
        root = self
        while root.merged_into is not None:
            root = root.merged_into
        return root

    def join_locked(self, limiter: InMemoryConcurrencyLimiter) -> None:
        """Make ``limiter`` coordinated: its waiters move into the coordinator's line."""
        if limiter._coordinated:
            return
        with limiter._lock:
            moved = limiter._waiting
            limiter._waiting = []
            limiter._coordinated = True
            self.members[id(limiter)] = limiter
        if moved:
            self.waiting.extend(moved)
            self.waiting.sort(key=lambda w: w.arrival)

    def _leave_idle_locked(self, limiters: Sequence[InMemoryConcurrencyLimiter]) -> None:
        """Hand limiters no coordinated request waits for back to their own lock."""
        for limiter in limiters:
            if limiter._coordinated and not limiter._queued:
                with limiter._lock:
                    limiter._coordinated = False
                    self.members.pop(id(limiter), None)
                    limiter._idle_locked()

    def enqueue_locked(self, waiter: _Waiter, now: float) -> None:
        for limiter in waiter.limiters:
            self.join_locked(limiter)
            limiter._reap_locked(now)
        _line_up(self.waiting, waiter, now, self.allocate_locked, self.remove_locked)

    def remove_locked(self, waiter: _Waiter, now: float) -> None:
        if waiter not in self.waiting:
            return
        self.waiting.remove(waiter)
        for limiter in waiter.limiters:
            limiter._queued -= 1
        # It may have been anchored (rule 4 of allocate_members), keeping room.
        self.allocate_locked(now)
        self._leave_idle_locked(waiter.limiters)

    def allocate_locked(self, now: float) -> None:
        if self.waiting:
            granted, self.waiting = _allocate(self.waiting, now)
            self._leave_idle_locked(list({id(x): x for w in granted for x in w.limiters}.values()))


def _call_coordinated(limiter: InMemoryConcurrencyLimiter, fn: Callable[..., T], *args: Any) -> T:
    while True:  # the root may be merged into another while we wait for its lock
        root = limiter._coordinator.root()
        root.lock.acquire()
        if root.merged_into is None:
            break
        root.lock.release()
    limiter._coordinator = root
    try:
        if limiter._coordinated:
            return fn(*args)
        with limiter._lock:
            return fn(*args)
    finally:
        root.lock.release()


def _merge_and_lock(limiters: Sequence[InMemoryConcurrencyLimiter]) -> Coordinator:
    while True:
        roots = sorted(
            {id(r): r for r in (x._coordinator.root() for x in limiters)}.values(), key=id
        )
        for root in roots:
            root.lock.acquire()
        if any(root.merged_into is not None for root in roots):
            for root in roots:
                root.lock.release()
            continue
        keep = max(roots, key=lambda r: len(r.members))
        for other in roots:
            if other is keep:
                continue
            other.merged_into = keep
            keep.members.update(other.members)
            keep.waiting = sorted([*keep.waiting, *other.waiting], key=lambda w: w.arrival)
            other.members, other.waiting = {}, []
            other.lock.release()
        for limiter in limiters:
            limiter._coordinator = keep
        return keep


class _KeyOwner(Protocol):
    def _key_busy(self, limiter: InMemoryConcurrencyLimiter) -> None: ...

    def _key_idle(self, limiter: InMemoryConcurrencyLimiter) -> None: ...


class InMemoryConcurrencyLimiter(ConfiguredLimiter):
    """Slots shared by the threads and coroutines of one process (a keyed limiter's keys
    share their owner's ``coordinator``)."""

    def __init__(
        self,
        config: LimiterConfig,
        *,
        clock: Clock = SYSTEM_CLOCK,
        coordinator: Coordinator | None = None,
    ) -> None:
        super().__init__(config)
        self._clock = clock
        self._lock = threading.Lock()
        self._held: dict[str, _Held] = {}
        self._active: dict[str, int] = dict.fromkeys(config.workloads, 0)
        self._waiting: list[_Waiter] = []
        self._tokens = itertools.count(1)
        self._id_prefix = f"{config.name}:{uuid.uuid4().hex[:12]}:"
        self._next_expiry = math.inf
        self._coordinator = Coordinator() if coordinator is None else coordinator
        self._coordinated = False
        #: Requests waiting here, in its own line or (coordinated) its coordinator's.
        self._queued = 0
        #: Round robin: per key, the sequence number of its latest grant here.
        self._history: OrderedDict[Hashable | None, int] | None = (
            OrderedDict() if config.fairness == "round_robin" else None
        )
        self._owner: _KeyOwner | None = None  # the keyed limiter this is a key of
        self._key: str | None = None
        self._busy = False

    def _root(self) -> Coordinator:
        return self._coordinator.root()

    def _call(self, fn: Callable[..., T], *args: Any) -> T:
        with self._lock:
            if not self._coordinated:
                return fn(*args)
        return _call_coordinated(self, fn, *args)

    def acquire(
        self,
        request: AcquireRequest,
        *,
        cancel: CancellationToken | None = None,
        on_wait: OnWait | None = None,
    ) -> Lease:
        return self.acquire_members((Member(self, request),), cancel=cancel, on_wait=on_wait)[0]

    def acquire_members(
        self,
        members: Sequence[Member],
        *,
        cancel: CancellationToken | None = None,
        on_wait: OnWait | None = None,
    ) -> tuple[Lease, ...]:
        waiter = _enqueue(members, cancel)
        if isinstance(waiter, tuple):
            return waiter
        event = threading.Event()
        with _waiting(waiter, event.set, cancel, on_wait):
            while (leases := _settle(waiter, cancel)) is None:
                event.wait(_sleep_seconds(waiter))
                event.clear()
            return leases

    async def acquire_members_async(
        self,
        members: Sequence[Member],
        *,
        cancel: CancellationToken | None = None,
        on_wait: OnWait | None = None,
    ) -> tuple[Lease, ...]:
        waiter = _enqueue(members, cancel)
        if isinstance(waiter, tuple):
            return waiter
        loop = asyncio.get_running_loop()
        event = asyncio.Event()

        def wake() -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed; waiter abandoned
                loop.call_soon_threadsafe(event.set)

        with _waiting(waiter, wake, cancel, on_wait):
            while (leases := _settle(waiter, cancel)) is None:
                # Not ``wait_for``: on Python 3.11 it swallows a cancellation that
                # arrives as the event is set, and the cancelled task would get a slot.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(_sleep_seconds(waiter)):
                        await event.wait()
                event.clear()
            return leases

    def _queue_locked(self, waiter: _Waiter, now: float) -> tuple[Lease, ...] | _Waiter:
        if self._coordinated:
            self._root().enqueue_locked(waiter, now)
        else:
            self._reap_locked(now)
            if not self._waiting and has_room(self._config, self._active, waiter.workloads[0]):
                return (self._grant_locked(waiter.request, waiter.workloads[0], now),)
            _line_up(self._waiting, waiter, now, self._allocate_locked, self._drop_locked)
        return waiter if waiter.leases is None else waiter.leases

    def _drop_locked(self, waiter: _Waiter, now: float) -> None:
        if self._coordinated:
            self._root().remove_locked(waiter, now)
        elif waiter in self._waiting:
            self._waiting.remove(waiter)
            self._queued -= 1
            self._allocate_locked(now)
            self._idle_locked()

    def _line_locked(self) -> list[_Waiter]:
        return self._root().waiting if self._coordinated else self._waiting

    def _place_locked(self, waiter: _Waiter) -> QueuePlace:
        return place_in_line(waiter, self._line_locked())

    def renew(self, lease: Lease) -> Lease | None:
        return self._call(self._renew_locked, lease, self._clock.monotonic())

    def renew_many(self, leases: Sequence[Lease]) -> Mapping[str, Lease | None]:
        now = self._clock.monotonic()
        return self._call(lambda: {x.lease_id: self._renew_locked(x, now) for x in leases})

    def release(self, lease: Lease, outcome: Outcome = "success") -> None:
        self._call(self._release_locked, lease.lease_id, self._clock.monotonic())

    def stats(self) -> LimiterStats:
        return self._call(self._stats_locked)

    def _stats_locked(self) -> LimiterStats:
        self._reap_locked(self._clock.monotonic())
        waiting = Counter(
            workload
            for waiter in self._line_locked()
            for member, workload in zip(waiter.limiters, waiter.workloads, strict=True)
            if member is self
        )
        return stats_of(self._active, waiting)

    def reap(self) -> int:
        return self._call(self._reap_now_locked)

    def _reap_now_locked(self) -> int:
        self._next_expiry = -math.inf
        return self._reap_locked(self._clock.monotonic())

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
        history = self._history
        if history is not None:  # grant order across the process's limiters
            history[request.key] = next(DEFAULT_REGISTRY.shared("memory.grants", itertools.count))
            history.move_to_end(request.key)
            if len(history) > HISTORY_LIMIT:
                history.popitem(last=False)
        self._busy_locked()
        return lease

    def _allocate_locked(self, now: float) -> None:
        if self._coordinated:
            self._root().allocate_locked(now)
        elif self._waiting:
            _, self._waiting = _allocate(self._waiting, now)

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


def stats_of(
    active: Mapping[str, int], queued: Mapping[str, int], keys: Sequence[KeyStats] = ()
) -> LimiterStats:
    """The stats of slots held and requests waiting per workload (``active``'s order)."""
    workloads = {name: WorkloadStats(active=n, queued=queued[name]) for name, n in active.items()}
    return LimiterStats(sum(active.values()), sum(queued.values()), workloads, keys)


def _allocate(waiting: list[_Waiter], now: float) -> tuple[list[_Waiter], list[_Waiter]]:
    """Grant what allocation gives ``waiting`` (a line, oldest first) and wake them:
    (those granted, the others still in line)."""
    limits: dict[Hashable, LimiterConfig] = {}
    active: dict[Hashable, Mapping[str, int]] = {}
    history: dict[Hashable, Mapping[Hashable | None, int]] = {}
    ageing_s = GROUP_AGEING_MS / 1000
    for waiter in waiting:
        waiter.aged = now - waiter.queued_at >= ageing_s
        for limiter in waiter.limiters:
            if limiter not in limits:
                limits[limiter] = limiter.config
                active[limiter] = limiter._active
                if limiter._history is not None:
                    history[limiter] = limiter._history
    granted = allocate_members(limits, active, waiting, last_granted=history)
    for position in granted:
        waiter = waiting[position]
        waiter.leases = tuple(
            limiter._grant_locked(request, workload, now)
            for limiter, request, workload in zip(
                waiter.limiters, waiter.requests, waiter.workloads, strict=True
            )
        )
        for limiter in waiter.limiters:
            limiter._queued -= 1
        waiter.wake()
    if not granted:
        return [], waiting
    chosen = set(granted)
    return [waiting[p] for p in granted], [w for p, w in enumerate(waiting) if p not in chosen]


def _line_up(
    line: list[_Waiter],
    waiter: _Waiter,
    now: float,
    allocate: Callable[[float], None],
    remove: Callable[[_Waiter, float], None],
) -> None:
    """Put ``waiter`` at the end of ``line`` and serve the line: it is granted, refused
    (a queue full, no time to wait) or waits with its deadline set."""
    line.append(waiter)
    for limiter in waiter.limiters:
        limiter._queued += 1
        limiter._busy_locked()
    allocate(now)
    if waiter.leases is not None:
        return
    for limiter, request in zip(waiter.limiters, waiter.requests, strict=True):
        max_queued = limiter.config.max_queued
        if max_queued is not None and limiter._queued > max_queued:
            remove(waiter, now)
            raise limiter._queue_full(request)
    wait_ms = _wait_ms(waiter)
    if wait_ms is not None and wait_ms <= 0:
        remove(waiter, now)
        raise _timed_out(waiter, wait_ms)
    if wait_ms is not None:
        waiter.deadline = now + wait_ms / 1000


@contextlib.contextmanager
def _waiting(
    waiter: _Waiter,
    wake: Callable[[], None],
    cancel: CancellationToken | None,
    on_wait: OnWait | None,
) -> Iterator[None]:
    """While a queued waiter waits: a cancel wakes it, any exit but a return leaves the
    line and gives back what was granted meanwhile."""
    waiter.wake = wake
    unlink = cancel.add_callback(wake) if cancel is not None else _nothing
    try:
        if on_wait is not None:
            first, deadline = waiter.limiters[0], waiter.deadline
            clock = first._clock
            at = None if math.isinf(deadline) else clock.time() + (deadline - clock.monotonic())
            announce_wait(on_wait, at, functools.partial(first._call, first._place_locked, waiter))
        yield
    except BaseException:
        first = waiter.limiters[0]
        first._call(first._drop_locked, waiter, first._clock.monotonic())
        _release_all(waiter, waiter.leases)
        raise
    finally:
        unlink()


def _enqueue(
    asked: Sequence[Member], cancel: CancellationToken | None
) -> tuple[Lease, ...] | _Waiter:
    if not asked:
        raise ValueError("acquire_members needs at least one member")
    members: list[InMemoryConcurrencyLimiter] = []
    for member in asked:
        limiter = member.limiter
        if not isinstance(limiter, InMemoryConcurrencyLimiter):
            names = ", ".join(repr(x.limiter.name) for x in asked)
            raise ConcurrencyConfigError(
                f"limiters {names} cannot be held together: {limiter.name!r} is not an "
                "in-memory limiter of this process",
                limiter=limiter.name,
            )
        members.append(limiter)
    if len({id(x) for x in members}) != len(members):
        raise ConcurrencyConfigError(
            "a request names the same limiter twice", limiter=members[0].name
        )
    requests = tuple(member.request for member in asked)
    workloads = tuple(x._resolve(r) for x, r in zip(members, requests, strict=True))
    first = members[0]
    if cancel is not None and cancel.is_set():
        raise first._cancelled(requests[0])
    now = first._clock.monotonic()
    selected = workloads[0] if len(members) == 1 else _selected(members, workloads)
    waiter = _Waiter(selected, tuple(members), requests, workloads, now)
    if len(members) == 1:
        return first._call(first._queue_locked, waiter, now)
    root = _merge_and_lock(members)
    try:
        root.enqueue_locked(waiter, now)
    finally:
        root.lock.release()
    return waiter if waiter.leases is None else waiter.leases


def _selected(
    limiters: Sequence[InMemoryConcurrencyLimiter], workloads: Sequence[str]
) -> str | None:
    """The workload a run selected that resolves to ``workloads`` (allocation's rule)."""
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


def place_in_line(waiter: _Waiter, line: Sequence[_Waiter]) -> QueuePlace:
    """Where ``waiter`` stands in ``line`` by arrival, as the PostgreSQL limiter tells it
    (over several limiters the largest place)."""
    ahead = [0] * len(waiter.limiters)
    for other in line:
        if other.arrival >= waiter.arrival:
            continue
        for member, workload in zip(other.limiters, other.workloads, strict=True):
            for i, (mine, wanted) in enumerate(zip(waiter.limiters, waiter.workloads, strict=True)):
                if member is mine and workload == wanted:
                    ahead[i] += 1
    return QueuePlace(place=max(ahead) + 1)


def _settle(waiter: _Waiter, cancel: CancellationToken | None) -> tuple[Lease, ...] | None:
    """After a wake-up: the leases, a cancel or timeout raised, or ``None`` to wait on."""
    first = waiter.limiters[0]  # coordinated together: its lock guards them all
    leases, error = first._call(_settle_locked, waiter, cancel, first._clock.monotonic())
    if error is None:
        return leases
    _release_all(waiter, leases)  # granted at the same moment as the cancel: give back
    raise error


def _settle_locked(
    waiter: _Waiter, cancel: CancellationToken | None, now: float
) -> tuple[tuple[Lease, ...] | None, ConcurrencyError | None]:
    cancelled = cancel is not None and cancel.is_set()
    if waiter.leases is None and not cancelled:
        for limiter in waiter.limiters:
            limiter._reap_locked(now)
    first, leases = waiter.limiters[0], waiter.leases
    if cancelled:
        first._drop_locked(waiter, now)
        return leases, first._cancelled(waiter.request)
    if leases is not None:
        return leases, None
    if now >= waiter.deadline:
        first._drop_locked(waiter, now)
        return None, _timed_out(waiter, _wait_ms(waiter))
    return None, None


def _release_all(waiter: _Waiter, leases: tuple[Lease, ...] | None) -> None:
    if leases is None:
        return
    for limiter, lease in zip(waiter.limiters, leases, strict=True):
        limiter.release(lease, "cancelled")


def _wait_ms(waiter: _Waiter) -> float | None:
    limits = [
        limiter._wait_ms(request, workload)
        for limiter, request, workload in zip(
            waiter.limiters, waiter.requests, waiter.workloads, strict=True
        )
    ]
    given = [x for x in limits if x is not None]
    return min(given) if given else None


def _timed_out(waiter: _Waiter, wait_ms: float | None) -> ConcurrencyTimeoutError:
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


def _sleep_seconds(waiter: _Waiter) -> float | None:
    now = waiter.limiters[0]._clock.monotonic()
    wake_at = min([waiter.deadline, *(x._next_expiry for x in waiter.limiters)])
    return None if math.isinf(wake_at) else max(0.0, wake_at - now)
