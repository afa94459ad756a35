"""The in-memory limiter: leases, expiry, queue limits, stats, threads and asyncio."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import pytest

from runcell_celery import (
    AcquireRequest,
    CancellationToken,
    ConcurrencyCancelledError,
    ConcurrencyConfigError,
    ConcurrencyQueueFullError,
    ConcurrencyTimeoutError,
    InMemoryConcurrencyLimiter,
    Lease,
    Member,
    RunLineage,
    WorkloadStats,
    create_concurrency_limiter,
)

if TYPE_CHECKING:
    from tests.conftest import FakeClock

SOON_S = 10.0
_numbers = iter(range(1, 1_000_000))


async def acquire_async(
    limiter: InMemoryConcurrencyLimiter, request: AcquireRequest, **options: Any
) -> Lease:
    """One member asked without blocking the event loop."""
    return (await limiter.acquire_members_async((Member(limiter, request),), **options))[0]


def request(
    workload: str | None = "default", timeout_ms: float | None = None, run_id: str = "run-1"
) -> AcquireRequest:
    return AcquireRequest(
        request_id=f"request-{next(_numbers)}",
        workload=workload,  # type: ignore[arg-type]  # None: let the limiter pick
        lineage=RunLineage(run_id=run_id, root_run_id="root-1", parent_run_id="parent-1"),
        timeout_ms=timeout_ms,
    )


class Waiting:
    """A blocking ``acquire`` in a pool thread, known to be queued once constructed."""

    def __init__(
        self,
        pool: ThreadPoolExecutor,
        limiter: InMemoryConcurrencyLimiter,
        req: AcquireRequest,
        cancel: CancellationToken | None = None,
    ) -> None:
        self.queued = threading.Event()
        self.deadlines: list[float | None] = []

        def on_wait(deadline: float | None) -> None:
            self.deadlines.append(deadline)
            self.queued.set()

        self.future: Future[Lease] = pool.submit(
            limiter.acquire, req, cancel=cancel, on_wait=on_wait
        )
        assert self.queued.wait(SOON_S), "the request was not queued"

    def lease(self) -> Lease:
        return self.future.result(SOON_S)


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(4) as executor:
        yield executor


# -- leases and expiry, on a fake clock ---------------------------------------------------------


def test_a_lease_expires_after_its_ttl_without_renewal(fake_clock: FakeClock) -> None:
    limiter = create_concurrency_limiter(1, lease_ttl_ms=1_000, clock=fake_clock)
    lease = limiter.acquire(request())
    fake_clock.advance(0.999)
    assert limiter.stats().active == 1
    fake_clock.advance(0.001)
    assert limiter.stats().active == 0
    assert limiter.renew(lease) is None


def test_renewal_extends_a_lease_by_its_ttl_from_the_renewal(fake_clock: FakeClock) -> None:
    limiter = create_concurrency_limiter(1, lease_ttl_ms=1_000, clock=fake_clock)
    lease = limiter.acquire(request())
    for _ in range(5):  # five TTLs in all, renewed before each expiry
        fake_clock.advance(0.9)
        renewed = limiter.renew(lease)
        assert renewed is not None
        assert renewed.lease_id == lease.lease_id
    assert limiter.stats().active == 1
    fake_clock.advance(0.9)
    assert limiter.stats().active == 1
    fake_clock.advance(0.1)
    assert limiter.stats().active == 0


def test_renew_answers_none_after_release(fake_clock: FakeClock) -> None:
    limiter = create_concurrency_limiter(1, clock=fake_clock)
    lease = limiter.acquire(request())
    limiter.release(lease)
    assert limiter.renew(lease) is None
    assert limiter.stats().active == 0


def test_renew_answers_none_for_an_expired_lease_not_yet_reaped(fake_clock: FakeClock) -> None:
    limiter = create_concurrency_limiter(2, lease_ttl_ms=100, clock=fake_clock)
    lease = limiter.acquire(request())
    fake_clock.advance(0.1)
    # No stats() or acquire() has looked since: renew itself must notice the expiry.
    assert limiter.renew(lease) is None
    assert limiter.renew(lease) is None
    assert limiter.stats().active == 0


def test_an_expired_slot_is_granted_to_the_next_request(fake_clock: FakeClock) -> None:
    limiter = create_concurrency_limiter(1, lease_ttl_ms=500, clock=fake_clock)
    stale = limiter.acquire(request())
    with pytest.raises(ConcurrencyTimeoutError):
        limiter.acquire(request(timeout_ms=0))
    fake_clock.advance(0.5)
    fresh = limiter.acquire(request(timeout_ms=0))
    assert fresh.lease_id != stale.lease_id
    assert fresh.fencing_token > stale.fencing_token


def test_releasing_an_expired_lease_frees_nobody_elses_slot(fake_clock: FakeClock) -> None:
    limiter = create_concurrency_limiter(1, lease_ttl_ms=500, clock=fake_clock)
    stale = limiter.acquire(request())
    fake_clock.advance(0.6)
    fresh = limiter.acquire(request(timeout_ms=0))
    limiter.release(stale)
    limiter.release(stale)
    assert limiter.stats().active == 1
    with pytest.raises(ConcurrencyTimeoutError):
        limiter.acquire(request(timeout_ms=0))
    limiter.release(fresh)
    assert limiter.stats().active == 0


def test_reap_hands_an_expired_slot_to_a_waiter(fake_clock: FakeClock, pool: Any) -> None:
    limiter = create_concurrency_limiter(1, lease_ttl_ms=60_000, clock=fake_clock)
    limiter.acquire(request())
    waiter = Waiting(pool, limiter, request())
    assert limiter.stats().queued == 1
    fake_clock.advance(60)
    assert limiter.reap() == 1
    granted = waiter.lease()
    assert granted.workload == "default"
    assert (limiter.stats().active, limiter.stats().queued) == (1, 0)


def test_renew_many_renews_held_leases_and_reports_lost_ones(fake_clock: FakeClock) -> None:
    limiter = create_concurrency_limiter(3, lease_ttl_ms=1_000, clock=fake_clock)
    kept, released = limiter.acquire(request()), limiter.acquire(request())
    limiter.release(released)
    fake_clock.advance(0.9)
    results = limiter.renew_many([kept, released])
    assert results == {kept.lease_id: kept, released.lease_id: None}
    fake_clock.advance(0.9)
    assert limiter.stats().active == 1


def test_leases_carry_the_limiter_workload_request_and_ttl(fake_clock: FakeClock) -> None:
    limiter = create_concurrency_limiter(
        2, name="claude", lease_ttl_ms=5_000, workloads={"batch": {}}, clock=fake_clock
    )
    req = request("batch")
    lease = limiter.acquire(req)
    assert (lease.limiter, lease.workload, lease.request_id, lease.ttl_ms) == (
        "claude",
        "batch",
        req.request_id,
        5_000,
    )
    assert lease.lease_id.startswith("claude:")


def test_fencing_tokens_increase_with_every_grant() -> None:
    limiter = create_concurrency_limiter(3)
    tokens = []
    for _ in range(10):
        lease = limiter.acquire(request())
        tokens.append(lease.fencing_token)
        limiter.release(lease)
    assert tokens == sorted(set(tokens))


def test_lease_ids_differ_between_limiters_of_the_same_name() -> None:
    first, second = create_concurrency_limiter(1), create_concurrency_limiter(1)
    assert first.acquire(request()).lease_id != second.acquire(request()).lease_id


# -- stats, queue limits, deadlines ---------------------------------------------------------------


def test_stats_count_active_and_queued_in_total_and_per_workload(pool: Any) -> None:
    limiter = create_concurrency_limiter(
        3,
        workloads={"interactive": {"reserved": 1}, "background": {"max_concurrent": 2}},
    )
    assert limiter.stats().workloads == {
        "interactive": WorkloadStats(0, 0),
        "background": WorkloadStats(0, 0),
    }
    held = [limiter.acquire(request("background")) for _ in range(2)]
    held.append(limiter.acquire(request("interactive")))
    cancel = CancellationToken()
    Waiting(pool, limiter, request("background"), cancel)
    Waiting(pool, limiter, request("background"), cancel)
    Waiting(pool, limiter, request("interactive"), cancel)
    stats = limiter.stats()
    assert (stats.active, stats.queued) == (3, 3)
    assert stats.workloads == {
        "interactive": WorkloadStats(active=1, queued=1),
        "background": WorkloadStats(active=2, queued=2),
    }
    cancel.cancel()
    for lease in held:
        limiter.release(lease)
    # The waiters leave on their own threads; the pool fixture waits for them.


def test_a_full_queue_refuses_the_request_naming_it(pool: Any) -> None:
    limiter = create_concurrency_limiter(1, name="claude", max_queued=2)
    held = limiter.acquire(request())
    waiters = [Waiting(pool, limiter, request()) for _ in range(2)]
    refused = request(run_id="run-refused")
    with pytest.raises(ConcurrencyQueueFullError) as caught:
        limiter.acquire(refused)
    error = caught.value
    assert "max_queued=2" in str(error)
    assert error.fields() == {
        "limiter": "claude",
        "workload": "default",
        "run_id": "run-refused",
        "root_run_id": "root-1",
        "parent_run_id": "parent-1",
        "request_id": refused.request_id,
    }
    assert limiter.stats().queued == 2
    limiter.release(held)
    limiter.release(waiters[0].lease())
    limiter.release(waiters[1].lease())
    assert limiter.stats().active == 0


def test_max_queued_zero_refuses_every_request_that_would_wait() -> None:
    limiter = create_concurrency_limiter(1, max_queued=0)
    held = limiter.acquire(request())
    with pytest.raises(ConcurrencyQueueFullError):
        limiter.acquire(request(timeout_ms=60_000))
    limiter.release(held)
    limiter.release(limiter.acquire(request()))


def test_a_request_that_can_run_at_once_is_not_refused_by_a_full_queue(pool: Any) -> None:
    limiter = create_concurrency_limiter(
        2, max_queued=1, workloads={"background": {"max_concurrent": 1}, "interactive": {}}
    )
    held = limiter.acquire(request("background"))
    blocked = Waiting(pool, limiter, request("background"))
    lease = limiter.acquire(request("interactive", timeout_ms=0))
    assert lease.workload == "interactive"
    limiter.release(lease)
    limiter.release(held)
    limiter.release(blocked.lease())


def test_a_zero_max_wait_never_waits() -> None:
    limiter = create_concurrency_limiter(1, workloads={"default": {"max_wait_ms": 0}})
    held = limiter.acquire(request())
    with pytest.raises(ConcurrencyTimeoutError, match="within 0 ms"):
        limiter.acquire(request(timeout_ms=60_000))
    assert limiter.stats().queued == 0
    limiter.release(held)


@pytest.mark.parametrize(
    ("max_wait_ms", "timeout_ms", "bound"),
    [(30, 60_000, "30"), (60_000, 30, "30"), (None, 30, "30"), (30, None, "30")],
)
def test_a_request_waits_for_the_smaller_of_max_wait_and_the_run_budget(
    max_wait_ms: int | None, timeout_ms: float | None, bound: str
) -> None:
    limiter = create_concurrency_limiter(1, workloads={"default": {"max_wait_ms": max_wait_ms}})
    held = limiter.acquire(request())
    with pytest.raises(ConcurrencyTimeoutError, match=f"within {bound} ms"):
        limiter.acquire(request(timeout_ms=timeout_ms))
    assert limiter.stats().queued == 0
    limiter.release(held)
    limiter.release(limiter.acquire(request(timeout_ms=0)))


def test_the_wait_deadline_is_reported_as_wall_time(fake_clock: FakeClock, pool: Any) -> None:
    limiter = create_concurrency_limiter(
        1, workloads={"default": {"max_wait_ms": 5_000}}, clock=fake_clock
    )
    held = limiter.acquire(request())
    cancel = CancellationToken()
    waiter = Waiting(pool, limiter, request(timeout_ms=2_000), cancel)
    no_deadline = Waiting(pool, limiter, request("default"), cancel)
    assert waiter.deadlines == [fake_clock.time() + 2.0]
    assert no_deadline.deadlines == [fake_clock.time() + 5.0]
    cancel.cancel()
    limiter.release(held)


def test_an_unknown_workload_is_a_config_error_naming_the_request() -> None:
    limiter = create_concurrency_limiter(
        1, name="claude", workloads={"interactive": {}, "background": {}}
    )
    req = request("batch")
    with pytest.raises(ConcurrencyConfigError, match="no workload 'batch'") as caught:
        limiter.acquire(req)
    assert caught.value.request_id == req.request_id
    assert caught.value.limiter == "claude"
    assert limiter.stats().queued == 0


def test_a_request_without_a_workload_uses_the_default(fake_clock: FakeClock) -> None:
    limiter = create_concurrency_limiter(
        2, workloads={"interactive": {}, "background": {}}, default_workload="background"
    )
    assert limiter.acquire(request(None)).workload == "background"


# -- cancellation ---------------------------------------------------------------------------------


def test_a_cancelled_token_refuses_before_queueing() -> None:
    limiter = create_concurrency_limiter(1)
    cancel = CancellationToken()
    cancel.cancel()
    with pytest.raises(ConcurrencyCancelledError):
        limiter.acquire(request(), cancel=cancel)
    assert (limiter.stats().active, limiter.stats().queued) == (0, 0)


def test_cancelling_a_blocked_acquire_removes_it_from_the_queue(pool: Any) -> None:
    limiter = create_concurrency_limiter(1)
    held = limiter.acquire(request())
    cancel = CancellationToken()
    waiter = Waiting(pool, limiter, request(), cancel)
    cancel.cancel()
    with pytest.raises(ConcurrencyCancelledError):
        waiter.lease()
    assert limiter.stats().queued == 0
    limiter.release(held)
    assert limiter.stats().active == 0


def test_a_waiter_cancelled_as_its_slot_is_granted_gives_the_slot_back(pool: Any) -> None:
    limiter = create_concurrency_limiter(1)
    for _ in range(50):
        held = limiter.acquire(request())
        cancel = CancellationToken()
        waiter = Waiting(pool, limiter, request(), cancel)
        # Grant and cancel in the same instant, from the waiter's point of view.
        limiter.release(held)
        cancel.cancel()
        with contextlib.suppress(ConcurrencyCancelledError):
            limiter.release(waiter.lease())  # granted before the cancel was seen: fine
        assert (limiter.stats().active, limiter.stats().queued) == (0, 0)


# -- asyncio --------------------------------------------------------------------------------------


def test_an_async_acquire_does_not_block_the_event_loop() -> None:
    async def main() -> None:
        limiter = create_concurrency_limiter(1)
        held = limiter.acquire(request())
        queued = asyncio.Event()
        waiting = asyncio.create_task(
            acquire_async(limiter, request(), on_wait=lambda _d: queued.set())
        )
        await queued.wait()
        ticks = 0
        for _ in range(20):  # another coroutine keeps running while one waits
            await asyncio.sleep(0)
            ticks += 1
        assert ticks == 20
        assert not waiting.done()
        limiter.release(held)
        lease = await asyncio.wait_for(waiting, SOON_S)
        limiter.release(lease)
        assert limiter.stats().active == 0

    asyncio.run(main())


def test_an_async_waiter_is_woken_by_a_release_in_another_thread() -> None:
    async def main() -> None:
        limiter = create_concurrency_limiter(1)
        held = limiter.acquire(request())
        queued = asyncio.Event()
        waiting = asyncio.create_task(
            acquire_async(limiter, request(), on_wait=lambda _d: queued.set())
        )
        await queued.wait()
        await asyncio.to_thread(limiter.release, held)
        lease = await asyncio.wait_for(waiting, SOON_S)
        limiter.release(lease)

    asyncio.run(main())


def test_cancelling_a_waiting_async_acquire_leaves_no_queue_entry_and_no_slot() -> None:
    async def main() -> None:
        limiter = create_concurrency_limiter(1)
        held = limiter.acquire(request())
        queued = asyncio.Event()
        waiting = asyncio.create_task(
            acquire_async(limiter, request(), on_wait=lambda _d: queued.set())
        )
        await queued.wait()
        assert limiter.stats().queued == 1
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert limiter.stats().queued == 0
        limiter.release(held)
        assert limiter.stats().active == 0

    asyncio.run(main())


@pytest.mark.parametrize("turns", range(6))
def test_an_async_acquire_cancelled_as_it_is_granted_never_returns_a_lease(turns: int) -> None:
    """Release, let the loop turn ``turns`` times, cancel: cancelled means no lease."""

    async def main() -> None:
        limiter = create_concurrency_limiter(1)
        held = limiter.acquire(request())
        queued = asyncio.Event()
        waiting = asyncio.create_task(
            acquire_async(limiter, request(timeout_ms=60_000), on_wait=lambda _d: queued.set())
        )
        await queued.wait()
        limiter.release(held)
        for _ in range(turns):
            await asyncio.sleep(0)
        finished_first = waiting.done()
        waiting.cancel()
        try:
            lease = await waiting
        except asyncio.CancelledError:
            assert limiter.stats().active == 0, "the granted slot leaked"
        else:
            assert finished_first, "acquire_async swallowed the task's cancellation"
            limiter.release(lease)
        assert (limiter.stats().active, limiter.stats().queued) == (0, 0)

    asyncio.run(main())


def test_a_cancellation_token_stops_an_async_acquire() -> None:
    async def main() -> None:
        limiter = create_concurrency_limiter(1)
        held = limiter.acquire(request())
        cancel = CancellationToken()
        queued = asyncio.Event()
        waiting = asyncio.create_task(
            acquire_async(limiter, request(), cancel=cancel, on_wait=lambda _d: queued.set())
        )
        await queued.wait()
        await asyncio.to_thread(cancel.cancel, "user pressed stop")
        with pytest.raises(ConcurrencyCancelledError):
            await asyncio.wait_for(waiting, SOON_S)
        assert limiter.stats().queued == 0
        limiter.release(held)

    asyncio.run(main())


def test_an_async_acquire_times_out_and_leaves_the_queue() -> None:
    async def main() -> None:
        limiter = create_concurrency_limiter(1)
        held = limiter.acquire(request())
        with pytest.raises(ConcurrencyTimeoutError):
            await acquire_async(limiter, request(timeout_ms=20))
        assert limiter.stats().queued == 0
        limiter.release(held)

    asyncio.run(main())


def test_threads_and_coroutines_share_one_limiters_slots(pool: Any) -> None:
    limiter = create_concurrency_limiter(1)

    async def take() -> Lease:
        return await acquire_async(limiter, request(timeout_ms=SOON_S * 1000))

    held = limiter.acquire(request())
    result: Future[Lease] = pool.submit(asyncio.run, take())
    assert not result.done()
    limiter.release(held)
    lease = result.result(SOON_S)
    with pytest.raises(ConcurrencyTimeoutError):
        limiter.acquire(request(timeout_ms=0))
    limiter.release(lease)
