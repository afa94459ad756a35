"""The cases every limiter must pass
(:func:`~runcell_celery.conformance.concurrency_conformance_cases`)."""

# Test code shipped in the package: it asserts on the exceptions it catches.

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

from ..cancellation import CancellationToken
from ..errors import (
    ConcurrencyCancelledError,
    ConcurrencyConfigError,
    ConcurrencyQueueFullError,
    ConcurrencyTimeoutError,
)
from ._support import (
    SOON_S,
    Cases,
    ConformanceCase,
    CreateLimiter,
    Queued,
    assert_idle,
    assert_times_out,
    new_request,
    raises,
    stats_of,
)


def concurrency_conformance_cases(create_limiter: CreateLimiter) -> list[ConformanceCase]:
    """The named cases every :class:`ConcurrencyLimiter` must pass."""
    create = create_limiter
    case = cases = Cases()

    @case
    def grants_up_to_max_concurrent_then_times_out() -> None:
        limiter = create(max_concurrent=3)
        leases = [limiter.acquire(new_request()) for _ in range(3)]
        why = "a fourth slot was granted with max_concurrent=3"
        exc = raises(ConcurrencyTimeoutError, why, limiter.acquire, new_request(timeout_ms=50))
        assert (exc.limiter, exc.workload) == (limiter.name, "default")
        for lease in leases:
            limiter.release(lease)
        assert_idle(limiter)

    @case
    def allocates_atomically_under_threads() -> None:
        limiter = create(max_concurrent=3)
        lock = threading.Lock()
        in_flight = 0
        most = 0
        full = threading.Event()

        def work() -> None:
            nonlocal in_flight, most
            for _ in range(15):
                lease = limiter.acquire(new_request())
                with lock:
                    in_flight += 1
                    most = max(most, in_flight)
                    if in_flight == 3:
                        full.set()
                # Hold a moment, and until the limit was reached once: a slow backend
                # (connections still opening) must still be seen at its limit.
                full.wait(0.05)
                time.sleep(0.001)
                with lock:
                    in_flight -= 1
                limiter.release(lease)

        with ThreadPoolExecutor(12) as pool:
            for future in [pool.submit(work) for _ in range(12)]:
                future.result(60)
        assert most <= 3, f"{most} holders at once with max_concurrent=3"
        assert most == 3, f"never reached the limit (most={most}); the test proves nothing"
        assert_idle(limiter)

    @case
    def leases_expire_without_renewal() -> None:
        limiter = create(max_concurrent=1, lease_ttl_ms=300)
        stale = limiter.acquire(new_request())
        fresh = limiter.acquire(new_request(timeout_ms=SOON_S * 1000))
        assert fresh.lease_id != stale.lease_id
        assert limiter.renew(stale) is None, "renewing an expired lease must answer None"
        limiter.release(stale)  # releasing an expired lease does nothing ...
        assert_times_out(limiter, "releasing an expired lease freed someone else's slot")
        limiter.release(fresh)
        assert_idle(limiter)

    @case
    def renewal_keeps_a_lease_alive() -> None:
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
        assert_idle(limiter)

    @case
    def release_is_idempotent() -> None:
        limiter = create(max_concurrent=1)
        first = limiter.acquire(new_request())
        limiter.release(first)
        limiter.release(first)
        second = limiter.acquire(new_request(timeout_ms=1000))
        limiter.release(first)
        assert_times_out(limiter, "a repeated release freed a slot twice")
        limiter.release(second)
        assert_idle(limiter)

    @case
    def lease_ids_are_never_reused_and_tokens_increase() -> None:
        limiter = create(max_concurrent=2)
        seen: set[str] = set()
        last_token = -1
        for _ in range(40):
            lease = limiter.acquire(new_request())
            assert lease.lease_id not in seen, f"lease id {lease.lease_id} was used twice"
            assert lease.fencing_token > last_token, "fencing tokens must increase"
            seen.add(lease.lease_id)
            last_token = lease.fencing_token
            limiter.release(lease)
        assert_idle(limiter)

    @case
    def cancel_stops_a_waiting_acquire() -> None:
        limiter = create(max_concurrent=1)
        held = limiter.acquire(new_request())
        cancel = CancellationToken()
        with ThreadPoolExecutor(1) as pool:
            waiter = Queued(pool, limiter, new_request(), cancel)
            cancel.cancel()
            raises(ConcurrencyCancelledError, "a cancelled acquire got a lease", waiter.lease)
        stats = stats_of(limiter)
        assert stats is None or stats.queued == 0, f"the cancelled request still waits: {stats}"
        limiter.release(held)
        assert_idle(limiter)

    @case
    def cancel_at_the_moment_of_grant_leaks_no_slot() -> None:
        limiter = create(max_concurrent=1)
        with ThreadPoolExecutor(2) as pool:
            for _ in range(20):
                held = limiter.acquire(new_request())
                cancel = CancellationToken()
                waiter = Queued(pool, limiter, new_request(), cancel)
                release = pool.submit(limiter.release, held)
                cancel.cancel()
                release.result(SOON_S)
                try:
                    lease = waiter.lease()
                except ConcurrencyCancelledError:
                    pass
                else:
                    limiter.release(lease)  # granted before the cancel was seen: fine
                # Whatever won the race, the slot must be free again.
                again = limiter.acquire(new_request(timeout_ms=SOON_S * 1000))
                limiter.release(again)
        assert_idle(limiter)

    @case
    def waiters_are_served_in_arrival_order() -> None:
        limiter = create(max_concurrent=1)
        held = limiter.acquire(new_request())
        with ThreadPoolExecutor(5) as pool:
            waiters = [Queued(pool, limiter, new_request()) for _ in range(5)]
            order: list[int] = []
            limiter.release(held)
            for _ in waiters:
                granted = first_done(waiters, order)
                order.append(granted)
                limiter.release(waiters[granted].lease())
        assert order == [0, 1, 2, 3, 4], f"served out of arrival order: {order}"
        assert_idle(limiter)

    @case
    def reservations_are_never_lent() -> None:
        limiter = create(
            max_concurrent=4,
            workloads={"interactive": {"reserved": 1, "priority": 10}, "background": {}},
        )
        background = [limiter.acquire(new_request("background")) for _ in range(3)]
        assert_times_out(limiter, "background took the slot reserved for interactive", "background")
        interactive = limiter.acquire(new_request("interactive", timeout_ms=50))
        for lease in [*background, interactive]:
            limiter.release(lease)
        assert_idle(limiter)

    @case
    def priority_serves_the_higher_workload_first() -> None:
        limiter = create(
            max_concurrent=1, workloads={"high": {"priority": 10}, "low": {"priority": 0}}
        )
        held = limiter.acquire(new_request("low"))
        with ThreadPoolExecutor(2) as pool:
            low = Queued(pool, limiter, new_request("low"))
            high = Queued(pool, limiter, new_request("high"))
            limiter.release(held)
            first = high.lease()
            assert not low.future.done(), "the low-priority waiter was served first"
            limiter.release(first)
            limiter.release(low.lease())
        assert_idle(limiter)

    @case
    def a_workload_at_its_ceiling_never_blocks_another() -> None:
        limiter = create(
            max_concurrent=3, workloads={"background": {"max_concurrent": 1}, "interactive": {}}
        )
        held = limiter.acquire(new_request("background"))
        with ThreadPoolExecutor(1) as pool:
            blocked = Queued(pool, limiter, new_request("background"))
            interactive = limiter.acquire(new_request("interactive", timeout_ms=50))
            limiter.release(interactive)
            limiter.release(held)
            limiter.release(blocked.lease())
        assert_idle(limiter)

    @case
    def a_full_queue_rejects_new_requests() -> None:
        limiter = create(max_concurrent=1, max_queued=1)
        held = limiter.acquire(new_request())
        with ThreadPoolExecutor(1) as pool:
            waiting = Queued(pool, limiter, new_request())
            why = "max_queued=1 let a second request wait"
            full = raises(
                ConcurrencyQueueFullError, why, limiter.acquire, new_request(timeout_ms=1000)
            )
            assert full.limiter == limiter.name
            limiter.release(held)
            limiter.release(waiting.lease())
        assert_idle(limiter)

    @case
    def a_timed_out_request_leaves_the_queue() -> None:
        limiter = create(max_concurrent=1, workloads={"default": {"max_wait_ms": 100}})
        held = limiter.acquire(new_request())
        assert_times_out(
            limiter, "the workload's max_wait_ms did not bound the wait", "default", 60_000
        )
        stats = stats_of(limiter)
        assert stats is None or stats.queued == 0, f"the timed-out request still waits: {stats}"
        limiter.release(held)
        assert_idle(limiter)

    @case
    def an_unknown_workload_is_a_config_error() -> None:
        limiter = create(max_concurrent=1, workloads={"interactive": {}, "background": {}})
        why = "a request for an unknown workload was granted"
        exc = raises(ConcurrencyConfigError, why, limiter.acquire, new_request("batch"))
        assert "batch" in str(exc)
        assert_idle(limiter)

    return list(cases)


def first_done(waiters: list[Queued], taken: list[int]) -> int:
    deadline = time.monotonic() + SOON_S
    while time.monotonic() < deadline:
        done = [i for i, w in enumerate(waiters) if i not in taken and w.future.done()]
        if done:
            assert len(done) == 1, f"several waiters granted one slot: {done}"
            return done[0]
        time.sleep(0.005)
    raise AssertionError("no waiter was granted the released slot")
