"""The cases every limiter must pass
(:func:`~runcell_celery.conformance.concurrency_conformance_cases`)."""

# Test code shipped in the package: it asserts on the exceptions it catches.

from __future__ import annotations

import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

from ..cancellation import CancellationToken
from ..errors import (
    ConcurrencyCancelledError,
    ConcurrencyConfigError,
    ConcurrencyQueueFullError,
    ConcurrencyTimeoutError,
)
from ..protocol import Lease
from ._support import (
    SOON_S,
    WAIT_MS,
    Cases,
    ConformanceCase,
    CreateLimiter,
    Witness,
    assert_fresh,
    assert_times_out,
    new_request,
    queued,
    raises,
    run_threads,
    stats_of,
)


def concurrency_conformance_cases(create_limiter: CreateLimiter) -> list[ConformanceCase]:
    """The named cases every :class:`ConcurrencyLimiter` must pass."""
    case = cases = Cases(create_limiter)

    @case
    def grants_up_to_max_concurrent_then_times_out(create: CreateLimiter) -> None:
        limiter = create(max_concurrent=3)
        leases = [limiter.acquire(new_request()) for _ in range(3)]
        why = "a fourth slot was granted with max_concurrent=3"
        exc = raises(ConcurrencyTimeoutError, why, limiter.acquire, new_request(timeout_ms=50))
        assert (exc.limiter, exc.workload) == (limiter.name, "default")
        for lease in leases:
            limiter.release(lease)

    @case
    def allocates_atomically_under_threads(create: CreateLimiter) -> None:
        limiter = create(max_concurrent=3)
        witness = Witness()
        full = threading.Event()

        def work(_: int) -> None:
            for _ in range(15):
                lease = limiter.acquire(new_request())
                with witness.holding([limiter]):
                    if witness.peak[limiter.name] == 3:
                        full.set()
                    # Hold a moment, and until the limit was reached once: a slow backend
                    # (connections still opening) must still be seen at its limit.
                    full.wait(0.05)
                    time.sleep(0.001)
                limiter.release(lease)

        run_threads(work, 12)
        most = witness.peak[limiter.name]
        assert most <= 3, f"{most} holders at once with max_concurrent=3"
        assert most == 3, f"never reached the limit (most={most}); the test proves nothing"

    @case
    def leases_expire_without_renewal(create: CreateLimiter) -> None:
        limiter = create(max_concurrent=1, lease_ttl_ms=300)
        stale = limiter.acquire(new_request())
        fresh = limiter.acquire(new_request(timeout_ms=WAIT_MS))
        assert fresh.lease_id != stale.lease_id
        assert limiter.renew(stale) is None, "renewing an expired lease must answer None"
        limiter.release(stale)  # releasing an expired lease does nothing ...
        assert_times_out(limiter, "releasing an expired lease freed someone else's slot")
        limiter.release(fresh)

    @case
    def renewal_keeps_a_lease_alive(create: CreateLimiter) -> None:
        limiter = create(max_concurrent=1, lease_ttl_ms=400)
        lease = limiter.acquire(new_request())
        for _ in range(6):
            time.sleep(0.1)
            renewed = limiter.renew(lease)
            assert renewed is not None, "a held lease was not renewed"
            assert renewed.lease_id == lease.lease_id
        assert limiter.renew(lease) is not None, "renewing twice must work too"
        assert_times_out(limiter, "a renewed lease expired")
        limiter.release(lease)
        assert limiter.renew(lease) is None, "renewing a released lease must answer None"

    @case
    def release_is_idempotent(create: CreateLimiter) -> None:
        limiter = create(max_concurrent=1)
        first = limiter.acquire(new_request())
        limiter.release(first)
        limiter.release(first)
        second = limiter.acquire(new_request(timeout_ms=1000))
        limiter.release(first)
        assert_times_out(limiter, "a repeated release freed a slot twice")
        limiter.release(second)

    @case
    def lease_ids_are_never_reused_and_tokens_increase(create: CreateLimiter) -> None:
        limiter = create(max_concurrent=2)
        leases: list[Lease] = []
        for _ in range(40):
            leases.append(limiter.acquire(new_request()))
            limiter.release(leases[-1])
        assert_fresh(leases, repr(limiter.name))

    @case
    def cancel_stops_a_waiting_acquire(create: CreateLimiter) -> None:
        limiter = create(max_concurrent=1)
        held = limiter.acquire(new_request())
        cancel = CancellationToken()
        with ThreadPoolExecutor(1) as pool:
            waiter = queued(pool, limiter, new_request(), cancel)
            cancel.cancel()
            why = "a cancelled acquire got a lease"
            raises(ConcurrencyCancelledError, why, waiter.result, SOON_S)
        stats = stats_of(limiter)
        assert stats is None or stats.queued == 0, f"the cancelled request still waits: {stats}"
        limiter.release(held)

    @case
    def cancel_at_the_moment_of_grant_leaks_no_slot(create: CreateLimiter) -> None:
        limiter = create(max_concurrent=1)
        with ThreadPoolExecutor(2) as pool:
            for _ in range(20):
                held = limiter.acquire(new_request())
                cancel = CancellationToken()
                waiter = queued(pool, limiter, new_request(), cancel)
                release = pool.submit(limiter.release, held)
                cancel.cancel()
                release.result(SOON_S)
                try:
                    lease = waiter.result(SOON_S)
                except ConcurrencyCancelledError:
                    pass
                else:
                    limiter.release(lease)  # granted before the cancel was seen: fine
                # Whatever won the race, the slot must be free again.
                again = limiter.acquire(new_request(timeout_ms=WAIT_MS))
                limiter.release(again)

    @case
    def waiters_are_served_in_arrival_order(create: CreateLimiter) -> None:
        limiter = create(max_concurrent=1)
        held = limiter.acquire(new_request())
        with ThreadPoolExecutor(5) as pool:
            waiters = [queued(pool, limiter, new_request()) for _ in range(5)]
            order: list[int] = []
            limiter.release(held)
            for _ in waiters:
                granted = first_done(waiters, order)
                order.append(granted)
                limiter.release(waiters[granted].result(SOON_S))
        assert order == [0, 1, 2, 3, 4], f"served out of arrival order: {order}"

    @case
    def reservations_are_never_lent(create: CreateLimiter) -> None:
        limiter = create(
            max_concurrent=4,
            workloads={"interactive": {"reserved": 1, "priority": 10}, "background": {}},
        )
        background = [limiter.acquire(new_request("background")) for _ in range(3)]
        assert_times_out(limiter, "background took the slot reserved for interactive", "background")
        interactive = limiter.acquire(new_request("interactive", timeout_ms=50))
        for lease in [*background, interactive]:
            limiter.release(lease)

    @case
    def priority_serves_the_higher_workload_first(create: CreateLimiter) -> None:
        limiter = create(
            max_concurrent=1, workloads={"high": {"priority": 10}, "low": {"priority": 0}}
        )
        held = limiter.acquire(new_request("low"))
        with ThreadPoolExecutor(2) as pool:
            low = queued(pool, limiter, new_request("low"))
            high = queued(pool, limiter, new_request("high"))
            limiter.release(held)
            first = high.result(SOON_S)
            assert not low.done(), "the low-priority waiter was served first"
            limiter.release(first)
            limiter.release(low.result(SOON_S))

    @case
    def a_workload_at_its_ceiling_never_blocks_another(create: CreateLimiter) -> None:
        limiter = create(
            max_concurrent=3, workloads={"background": {"max_concurrent": 1}, "interactive": {}}
        )
        held = limiter.acquire(new_request("background"))
        with ThreadPoolExecutor(1) as pool:
            blocked = queued(pool, limiter, new_request("background"))
            interactive = limiter.acquire(new_request("interactive", timeout_ms=50))
            limiter.release(interactive)
            limiter.release(held)
            limiter.release(blocked.result(SOON_S))

    @case
    def a_full_queue_rejects_new_requests(create: CreateLimiter) -> None:
        limiter = create(max_concurrent=1, max_queued=1)
        held = limiter.acquire(new_request())
        with ThreadPoolExecutor(1) as pool:
            waiting = queued(pool, limiter, new_request())
            why = "max_queued=1 let a second request wait"
            full = raises(
                ConcurrencyQueueFullError, why, limiter.acquire, new_request(timeout_ms=1000)
            )
            assert full.limiter == limiter.name
            limiter.release(held)
            limiter.release(waiting.result(SOON_S))

    @case
    def a_timed_out_request_leaves_the_queue(create: CreateLimiter) -> None:
        limiter = create(max_concurrent=1, workloads={"default": {"max_wait_ms": 100}})
        held = limiter.acquire(new_request())
        assert_times_out(
            limiter, "the workload's max_wait_ms did not bound the wait", "default", 60_000
        )
        stats = stats_of(limiter)
        assert stats is None or stats.queued == 0, f"the timed-out request still waits: {stats}"
        limiter.release(held)

    @case
    def an_unknown_workload_is_a_config_error(create: CreateLimiter) -> None:
        limiter = create(max_concurrent=1, workloads={"interactive": {}, "background": {}})
        why = "a request for an unknown workload was granted"
        exc = raises(ConcurrencyConfigError, why, limiter.acquire, new_request("batch"))
        assert "batch" in str(exc)

    return list(cases)


def first_done(waiters: list[Future[Lease]], taken: list[int]) -> int:
    wait([w for i, w in enumerate(waiters) if i not in taken], SOON_S, FIRST_COMPLETED)
    done = [i for i, w in enumerate(waiters) if i not in taken and w.done()]
    assert done, "no waiter was granted the released slot"
    assert len(done) == 1, f"several waiters granted one slot: {done}"
    return done[0]
