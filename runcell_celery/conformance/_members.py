"""The cases of a backend that holds several limiters in one slot
(:func:`~runcell_celery.conformance.members_conformance_cases`)."""

# Test code shipped in the package: it asserts on the exceptions it catches.

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from ..allocation import GROUP_AGEING_MS
from ..cancellation import CancellationToken
from ..errors import (
    ConcurrencyCancelledError,
    ConcurrencyConfigError,
    ConcurrencyQueueFullError,
    ConcurrencyTimeoutError,
)
from ..protocol import (
    AcquireRequest,
    ConcurrencyLimiter,
    KeyStats,
    Lease,
    Member,
    OnWait,
    Outcome,
    SupportsMembers,
)
from ..slot import slot
from ._keys import ReportsKeys, assert_no_key_in_use, assert_slot_refused, keyed_limiter
from ._support import (
    SOON_S,
    WAIT_MS,
    Cases,
    ConformanceCase,
    CreateLimiter,
    E,
    Witness,
    assert_idle,
    assert_times_out,
    new_request,
    new_requests,
    raises,
    run_threads,
    start_waiting,
    stats_of,
)

#: How long a churning thread holds its slot, in the ageing case.
HOLD_S = 0.02
#: Scheduling slack on top of a documented bound (threads, a database round trip).
SLACK_S = 1.0


def acquire_members(
    limiters: Sequence[ConcurrencyLimiter],
    requests: Sequence[AcquireRequest] | None = None,
    *,
    timeout_ms: float | None = None,
    cancel: CancellationToken | None = None,
    on_wait: OnWait | None = None,
) -> Sequence[Lease]:
    first = limiters[0]
    assert isinstance(first, SupportsMembers), (
        f"{first!r} cannot hold one request over several limiters (no acquire_members)"
    )
    asked = requests or new_requests(["default"] * len(limiters), timeout_ms)
    members = [Member(x, r) for x, r in zip(limiters, asked, strict=True)]
    leases = first.acquire_members(members, cancel=cancel, on_wait=on_wait)
    names = [lease.limiter for lease in leases]
    assert names == [x.name for x in limiters], f"leases of {names}, in the wrong order?"
    return leases


def wait_members(
    pool: ThreadPoolExecutor,
    limiters: Sequence[ConcurrencyLimiter],
    what: str,
    requests: Sequence[AcquireRequest] | None = None,
    cancel: CancellationToken | None = None,
) -> Future[Sequence[Lease]]:
    """Start ``acquire_members`` (budget ``WAIT_MS``) in ``pool``; return once it waits."""
    return start_waiting(
        pool,
        lambda on_wait: acquire_members(
            limiters, requests, timeout_ms=WAIT_MS, cancel=cancel, on_wait=on_wait
        ),
        what,
    )


def assert_refused(
    limiters: Sequence[ConcurrencyLimiter], error: type[E], why: str, timeout_ms: float
) -> E:
    """The ``error`` a request over ``limiters`` is refused with (granted: ``why``)."""
    return raises(
        error, why, lambda: release_all(limiters, acquire_members(limiters, timeout_ms=timeout_ms))
    )


def release_all(limiters: Sequence[ConcurrencyLimiter], leases: Sequence[Lease]) -> None:
    for limiter, lease in zip(limiters, leases, strict=True):
        limiter.release(lease)


def active_of(limiter: ConcurrencyLimiter) -> int | None:
    stats = stats_of(limiter)
    return None if stats is None else stats.active


class Foreign:
    """A limiter of no backend: no backend can hold it together with its own."""

    name = "conformance-foreign"

    def acquire(
        self,
        request: AcquireRequest,
        *,
        cancel: CancellationToken | None = None,
        on_wait: OnWait | None = None,
    ) -> Lease:
        return Lease("foreign-lease", self.name, request.workload, request.request_id, 1, 60_000)

    def renew(self, lease: Lease) -> Lease | None:
        return lease

    def release(self, lease: Lease, outcome: Outcome = "success") -> None:
        return None


def members_conformance_cases(create_limiter: CreateLimiter) -> list[ConformanceCase]:
    """The cases of a backend that holds one request over several of its limiters
    (:class:`~runcell_celery.protocol.SupportsMembers`); one asks ``keyed=True`` too."""
    case = cases = Cases(create_limiter)

    @case
    def a_request_over_many_limiters_holds_none_while_it_waits(create: CreateLimiter) -> None:
        a, b = create(max_concurrent=1), create(max_concurrent=1)
        held = b.acquire(new_request())
        with ThreadPoolExecutor(1) as pool:
            waiting = wait_members(pool, [a, b], "a and b")
            time.sleep(0.05)  # time to take a's slot early, if it would
            assert active_of(a) in (0, None), f"a's slot was taken while b was full: {stats_of(a)}"
            assert active_of(b) in (1, None), f"b: {stats_of(b)}"
            assert not waiting.done(), "granted while b was full"
            b.release(held)
            release_all([a, b], waiting.result(SOON_S))

    @case
    def a_young_request_over_many_limiters_holds_no_room_and_ages_within_its_bound(
        create: CreateLimiter,
    ) -> None:
        """``[a, b]`` waits on ``b``: ``a`` alone is granted at once; then, with three
        threads churning ``a`` and ``b`` freed, ``[a, b]`` is granted within
        ``GROUP_AGEING_MS`` + one hold of ``a`` (+ slack)."""
        a, b = create(max_concurrent=1), create(max_concurrent=1)
        held_b = b.acquire(new_request())
        stop = threading.Event()

        def churn(_: int) -> None:
            while not stop.is_set():
                lease = a.acquire(new_request(timeout_ms=WAIT_MS))
                time.sleep(HOLD_S)
                a.release(lease)

        with ThreadPoolExecutor(1) as pool, ThreadPoolExecutor(3) as churners:
            waiting = wait_members(pool, [a, b], "a and b")
            began = time.monotonic()
            try:
                alone = a.acquire(new_request(timeout_ms=GROUP_AGEING_MS / 4))
            except ConcurrencyTimeoutError as exc:
                raise AssertionError(f"a's slot was kept for [a, b] waiting on b: {exc}") from exc
            took = time.monotonic() - began
            assert took < GROUP_AGEING_MS / 4000, f"a alone waited {took:.3f} s"
            a.release(alone)
            running = [churners.submit(churn, i) for i in range(3)]
            time.sleep(HOLD_S * 3)  # the churn is under way
            b.release(held_b)
            freed = time.monotonic()
            bound_s = GROUP_AGEING_MS / 1000 + HOLD_S + SLACK_S
            try:
                leases = waiting.result(bound_s)
            except TimeoutError as exc:
                raise AssertionError(f"[a, b] not granted within {bound_s:g} s") from exc
            finally:
                stop.set()
            waited = time.monotonic() - freed
            release_all([a, b], leases)
            for future in running:
                future.result(SOON_S)
        assert waited <= bound_s, f"[a, b] waited {waited:.3f} s after b freed"

    @case
    def many_limiters_are_granted_together_once_the_last_frees(create: CreateLimiter) -> None:
        a, b, c = (create(max_concurrent=1) for _ in range(3))
        held_b, held_c = b.acquire(new_request()), c.acquire(new_request())
        with ThreadPoolExecutor(1) as pool:
            waiting = wait_members(pool, [a, b, c], "a, b, c")
            b.release(held_b)
            time.sleep(0.05)
            assert not waiting.done(), "granted while c was still full"
            assert active_of(b) in (0, None), f"b's slot was taken while c was full: {stats_of(b)}"
            c.release(held_c)
            leases = waiting.result(SOON_S)
            for limiter in (a, b, c):
                assert active_of(limiter) in (1, None), f"{limiter.name}: {stats_of(limiter)}"
                assert_times_out(limiter, "the request over all three holds its slot")
            release_all([a, b, c], leases)
        assert_idle(a, b, c)
        again = acquire_members([c, a, b], timeout_ms=WAIT_MS)
        release_all([c, a, b], again)

    @case
    def requests_in_opposite_orders_never_deadlock(create: CreateLimiter) -> None:
        first, second = create(max_concurrent=1), create(max_concurrent=1)
        witness = Witness()

        def work(i: int) -> None:
            pair = [first, second] if i % 2 == 0 else [second, first]
            for _ in range(25):  # 8 threads x 25 = 200 calls
                with slot(*pair), witness.holding(pair):
                    time.sleep(0.0005)

        run_threads(work, 8)
        assert witness.calls == 200, f"{witness.calls} of 200 calls ran"
        assert witness.peak == {first.name: 1, second.name: 1}, f"in flight: {witness.peak}"

    @case
    def single_and_member_requests_keep_every_limit_under_threads(create: CreateLimiter) -> None:
        a, b = create(max_concurrent=2), create(max_concurrent=3)
        witness = Witness()
        shapes: list[list[ConcurrencyLimiter]] = [[a, b], [b, a], [a], [b]]

        def work(i: int) -> None:
            for n in range(30):
                chosen = shapes[(i + n) % len(shapes)]
                with slot(*chosen), witness.holding(chosen):
                    time.sleep(0.001)

        run_threads(work, 10)
        assert witness.peak[a.name] <= 2, f"{witness.peak[a.name]} holders of a at once"
        assert witness.peak[b.name] <= 3, f"{witness.peak[b.name]} holders of b at once"
        assert witness.peak[a.name] == 2, "a never reached its limit: the case proves nothing"

    @case
    def a_keys_limiter_is_held_together_with_an_ordinary_one(create: CreateLimiter) -> None:
        provider = create(max_concurrent=2)
        tenants = keyed_limiter(create, max_concurrent=1)
        acme = tenants.key("acme")
        with slot(provider, acme) as held:
            assert [lease.limiter for lease in held.leases] == [provider.name, acme.name]
            assert set(held.fencing_tokens) == {provider.name, acme.name}
            assert active_of(provider) in (1, None), f"{stats_of(provider)}"
            if isinstance(tenants, ReportsKeys):
                assert list(tenants.key_stats()) == [KeyStats("acme", 1, 0)]
            # The key's limit applies to a request over both.
            why = "a second slot of a key with max_concurrent=1"
            assert_refused([provider, acme], ConcurrencyTimeoutError, why, 50)
            other = acquire_members([provider, tenants.key("globex")], timeout_ms=1000)
            release_all([provider, tenants.key("globex")], other)
        assert_slot_refused(tenants, provider)
        assert_idle(provider, acme)
        assert_no_key_in_use(tenants)

    @case
    def cancelling_a_request_for_many_limiters_leaves_nothing_held(create: CreateLimiter) -> None:
        a, b = create(max_concurrent=1), create(max_concurrent=1)
        held = b.acquire(new_request())
        cancel = CancellationToken()
        with ThreadPoolExecutor(1) as pool:
            waiting = wait_members(pool, [a, b], "a and b", cancel=cancel)
            cancel.cancel()
            why = "a cancelled request over several limiters got its slots"
            raises(
                ConcurrencyCancelledError, why, lambda: release_all([a, b], waiting.result(SOON_S))
            )
        assert_idle(a)
        stats = stats_of(b)
        assert stats is None or (stats.active, stats.queued) == (1, 0), f"b: {stats}"
        b.release(held)
        release_all([a, b], acquire_members([a, b], timeout_ms=1000))

    @case
    def a_request_for_many_limiters_times_out_holding_nothing(create: CreateLimiter) -> None:
        a, b = create(max_concurrent=1), create(max_concurrent=1)
        held = b.acquire(new_request())
        why = "granted a and b while b was full"
        exc = assert_refused([a, b], ConcurrencyTimeoutError, why, 100)
        assert exc.limiter in (a.name, b.name), f"the timeout names {exc.limiter!r}"
        assert_idle(a)
        a.release(a.acquire(new_request(timeout_ms=50)))  # a's one slot is free
        b.release(held)

    @case
    def cancel_at_the_moment_of_a_grant_over_many_limiters_leaks_no_slot(
        create: CreateLimiter,
    ) -> None:
        a, b = create(max_concurrent=1), create(max_concurrent=1)
        with ThreadPoolExecutor(2) as pool:
            for _ in range(20):
                held = b.acquire(new_request())
                cancel = CancellationToken()
                waiting = wait_members(pool, [a, b], "a and b", cancel=cancel)
                release = pool.submit(b.release, held)
                cancel.cancel()
                release.result(SOON_S)
                try:
                    leases = waiting.result(SOON_S)
                except ConcurrencyCancelledError:
                    pass
                else:
                    release_all([a, b], leases)  # granted before the cancel was seen
                again = acquire_members([a, b], timeout_ms=WAIT_MS)
                release_all([a, b], again)

    @case
    def each_limiter_keeps_its_own_workload_ceiling(create: CreateLimiter) -> None:
        a = create(max_concurrent=2, workloads={"batch": {"max_concurrent": 1}, "default": {}})
        b = create(max_concurrent=2)
        held = a.acquire(new_request("batch"))
        with ThreadPoolExecutor(1) as pool:
            asked = new_requests(["batch", "default"], WAIT_MS)
            waiting = wait_members(pool, [a, b], "batch in a, default in b", asked)
            assert active_of(b) in (0, None), "b's slot was taken while a's batch was full"
            a.release(held)
            leases = waiting.result(SOON_S)
            assert [lease.workload for lease in leases] == ["batch", "default"]
            release_all([a, b], leases)

    @case
    def a_full_queue_in_any_limiter_refuses_the_request(create: CreateLimiter) -> None:
        a, b = create(max_concurrent=1), create(max_concurrent=1, max_queued=0)
        held = b.acquire(new_request())
        why = "b's max_queued=0 let a request wait"
        full = assert_refused([a, b], ConcurrencyQueueFullError, why, 1000)
        assert full.limiter == b.name, f"the error names {full.limiter!r}, not b"
        assert_idle(a)
        b.release(held)

    @case
    def a_limiter_it_cannot_hold_with_its_own_is_refused(create: CreateLimiter) -> None:
        a = create(max_concurrent=1)
        foreign = Foreign()
        why = "held a limiter of no backend together with its own"
        error = assert_refused([a, foreign], ConcurrencyConfigError, why, 1000)
        assert foreign.name in str(error), f"the error does not name the limiter: {error}"
        assert_idle(a)
        a.release(a.acquire(new_request(timeout_ms=50)))

    return list(cases)
