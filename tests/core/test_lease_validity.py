"""A lease whose local validity has passed is lost, whoever looks first.

The process's lease keeper is replaced by one on a :class:`~tests.conftest.FakeClock`
whose loop is stopped before the test begins: it keeps the holds registered but never
ticks, as in a process resumed from a pause before its keeper thread runs. The
in-memory limiters run on the same fake clock, so a lease expires there when the
clock passes its TTL and another holder can take the slot. Every verdict here comes
from the body's own end or its own read of ``held.aborted``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pytest

from runcell_celery import (
    CancellationToken,
    ConcurrencyLeaseLostError,
    ConcurrencyLimiter,
    Deadline,
    InMemoryConcurrencyLimiter,
    Lease,
    create_concurrency_limiter,
    run,
    slot,
)
from runcell_celery.admission import Admission
from runcell_celery.background import DEFAULT_REGISTRY, ProcessLocal
from runcell_celery.hold import Hold
from runcell_celery.keeper import LeaseKeeper
from runcell_celery.protocol import OnWait
from runcell_celery.request import build_request
from runcell_celery.slot import preadmit
from tests.core.conftest import direct_request

if TYPE_CHECKING:
    from tests.conftest import EventRecorder, FakeClock

TTL_MS = 30_000
TTL_S = TTL_MS / 1000
SOON_S = 10.0


class _NothingHeld:
    """A holder that has already ended: the keeper forgets it at once."""

    def kept_lease(self, index: int) -> None:
        return None

    def lease_renewed(self, index: int, lease: Lease, valid_until: Deadline) -> None: ...
    def renewal_failed(self, index: int, error: BaseException) -> None: ...
    def lease_lost(self, index: int, error: BaseException | None) -> None: ...
    def deadline_passed(self) -> None: ...


@pytest.fixture
def keeper(fake_clock: FakeClock, monkeypatch: pytest.MonkeyPatch) -> Iterator[LeaseKeeper]:
    """This process's keeper for the test: on the fake clock, and stopped (its loop
    started once, then ended), so it never ticks."""
    stopped = LeaseKeeper(clock=fake_clock)
    nothing = _NothingHeld()
    stopped.forget(stopped.keep(nothing, 0, TTL_MS, None))  # starts its loop
    stopped.stop(SOON_S)
    monkeypatch.setitem(DEFAULT_REGISTRY._locals, "keeper.fallback", ProcessLocal(lambda: stopped))
    yield stopped
    assert stopped.held() == 0, "a hold was left with the keeper"


@pytest.fixture
def limiter(fake_clock: FakeClock, limiter_name: str) -> InMemoryConcurrencyLimiter:
    return create_concurrency_limiter(1, name=limiter_name, lease_ttl_ms=TTL_MS, clock=fake_clock)


def _lost_and_released(events: EventRecorder, name: str) -> tuple[list[Any], list[Any]]:
    return events.of("lease-lost", limiter=name), events.of("released", limiter=name)


def test_a_with_block_that_ends_after_its_lease_validity_passed_raises_lease_lost(
    keeper: LeaseKeeper,
    fake_clock: FakeClock,
    limiter: InMemoryConcurrencyLimiter,
    events: EventRecorder,
) -> None:
    taken: list[Lease] = []
    held = slot(limiter)

    def paused_past_its_lease() -> None:
        with held:
            fake_clock.advance(TTL_S)  # the keeper did not run meanwhile
            taken.append(limiter.acquire(direct_request()))  # another has the slot now

    with pytest.raises(ConcurrencyLeaseLostError) as caught:
        paused_past_its_lease()
    assert held.lease is not None
    lease_id = held.lease.lease_id
    assert keeper.held() == 0
    assert lease_id in str(caught.value)
    lost, released = _lost_and_released(events, limiter.name)
    assert [e.lease_id for e in lost] == [lease_id]
    assert [(e.lease_id, e.outcome) for e in released] == [(lease_id, "lease-lost")]
    assert limiter.stats().active == 1, "the expired lease's release freed the other's slot"
    limiter.release(taken[0])


def test_held_aborted_is_true_the_moment_the_lease_validity_passes(
    keeper: LeaseKeeper,
    fake_clock: FakeClock,
    limiter: InMemoryConcurrencyLimiter,
    events: EventRecorder,
) -> None:
    closed: list[str] = []
    reads: list[bool] = []

    def body() -> None:
        with slot(limiter) as held:
            held.on_abort(lambda: closed.append("response closed"))
            fake_clock.advance(TTL_S - 0.001)
            reads.append(held.aborted)
            fake_clock.advance(0.001)
            reads.append(held.aborted)
            reads.append(closed == ["response closed"])
            reads.append(len(events.of("lease-lost", limiter=limiter.name)) == 1)

    with pytest.raises(ConcurrencyLeaseLostError):
        body()
    assert reads == [False, True, True, True], "aborted, callback and event at the first read"
    lost, released = _lost_and_released(events, limiter.name)
    assert len(lost) == 1, "the end after the read says it once"
    assert [e.outcome for e in released] == ["lease-lost"]
    assert limiter.stats().active == 0


def test_a_hold_seen_lost_by_its_body_and_then_by_the_keeper_says_so_and_releases_once(
    keeper: LeaseKeeper,
    fake_clock: FakeClock,
    limiter: InMemoryConcurrencyLimiter,
    events: EventRecorder,
) -> None:
    asked = build_request(None, limiter)
    hold = Hold(asked, (limiter.acquire(asked.request),))
    hold.keep(None)
    fake_clock.advance(TTL_S)
    assert hold.aborted
    assert hold.abort_reason == "lease-lost"
    hold.lease_lost(0, None)  # what the keeper does when it runs at last
    assert isinstance(hold.end(None), ConcurrencyLeaseLostError)
    hold.lease_lost(0, None)
    lost, released = _lost_and_released(events, limiter.name)
    assert len(lost) == 1
    assert [e.outcome for e in released] == ["lease-lost"]


def test_a_renewal_the_keeper_reports_moves_the_validity_the_hold_reads(
    keeper: LeaseKeeper,
    fake_clock: FakeClock,
    limiter: InMemoryConcurrencyLimiter,
    events: EventRecorder,
) -> None:
    with slot(limiter) as held:
        fake_clock.advance(TTL_S / 2)
        lease = held.lease
        assert lease is not None
        renewed = limiter.renew(lease)
        assert renewed is not None
        hold = held._hold
        assert hold is not None
        hold.lease_renewed(0, renewed, Deadline(fake_clock.monotonic() + TTL_S))
        fake_clock.advance(TTL_S / 2 + 1)  # past the first validity, not the renewed one
        assert not held.aborted
    assert events.of("lease-lost", limiter=limiter.name) == []
    assert [e.outcome for e in events.of("released", limiter=limiter.name)] == ["success"]


def test_an_async_with_block_that_ends_after_its_lease_validity_passed_raises_lease_lost(
    keeper: LeaseKeeper,
    fake_clock: FakeClock,
    limiter: InMemoryConcurrencyLimiter,
    events: EventRecorder,
) -> None:
    async def body() -> bool:
        async with slot(limiter):
            fake_clock.advance(TTL_S)
        return True

    with pytest.raises(ConcurrencyLeaseLostError):
        asyncio.run(body())
    lost, released = _lost_and_released(events, limiter.name)
    assert len(lost) == 1
    assert [e.outcome for e in released] == ["lease-lost"]


def test_an_async_body_reads_aborted_as_soon_as_its_lease_validity_passes(
    keeper: LeaseKeeper,
    fake_clock: FakeClock,
    limiter: InMemoryConcurrencyLimiter,
    events: EventRecorder,
) -> None:
    first_read: list[bool] = []

    async def body() -> asyncio.Task[Any] | None:
        task = asyncio.current_task()
        try:
            async with slot(limiter) as held:
                fake_clock.advance(TTL_S)
                first_read.append(held.aborted)
        finally:
            assert task is not None
            assert not task.cancelling(), "the abort's cancellation leaked out"
        return task

    with pytest.raises(ConcurrencyLeaseLostError):
        asyncio.run(body())
    assert first_read == [True]
    lost, released = _lost_and_released(events, limiter.name)
    assert len(lost) == 1
    assert [e.outcome for e in released] == ["lease-lost"]


@pytest.fixture
def two_limiters(fake_clock: FakeClock, limiter_name: str) -> list[InMemoryConcurrencyLimiter]:
    """Two limiters whose leases live 30 s and 10 s."""
    return [
        create_concurrency_limiter(
            1, name=f"{limiter_name}-a", lease_ttl_ms=TTL_MS, clock=fake_clock
        ),
        create_concurrency_limiter(
            1, name=f"{limiter_name}-b", lease_ttl_ms=TTL_MS // 3, clock=fake_clock
        ),
    ]


def test_a_hold_over_several_limiters_is_lost_when_one_lease_validity_passes(
    keeper: LeaseKeeper,
    fake_clock: FakeClock,
    two_limiters: list[InMemoryConcurrencyLimiter],
    events: EventRecorder,
) -> None:
    first, second = two_limiters
    held = slot(first, second)
    seen: list[object] = []

    def body() -> None:
        with held:
            fake_clock.advance(TTL_S / 3)  # the second limiter's lease is past its validity
            seen.append(held.aborted)
            seen.append(first.stats().active)  # the other lease is released at once

    with pytest.raises(ConcurrencyLeaseLostError) as caught:
        body()
    assert seen == [True, 0]
    short = held.leases[1]
    assert repr(second.name) in str(caught.value)
    lost = events.of("lease-lost")
    assert [e.lease_id for e in lost if e.lease_id in {x.lease_id for x in held.leases}] == [
        short.lease_id
    ]
    assert [e.outcome for e in events.of("released", limiter=first.name)] == ["lease-lost"]
    assert first.stats().active == 0
    assert second.stats().active == 0


def test_a_hold_over_several_limiters_ending_after_a_lease_validity_passed_raises_lease_lost(
    keeper: LeaseKeeper,
    fake_clock: FakeClock,
    two_limiters: list[InMemoryConcurrencyLimiter],
    events: EventRecorder,
) -> None:
    first, second = two_limiters

    async def body() -> None:
        async with slot(first, second):
            fake_clock.advance(TTL_S / 3)

    with pytest.raises(ConcurrencyLeaseLostError), slot(first, second):
        fake_clock.advance(TTL_S / 3)
    with pytest.raises(ConcurrencyLeaseLostError):
        asyncio.run(body())
    assert len(events.of("lease-lost", limiter=first.name)) == 2
    assert [e.outcome for e in events.of("released", limiter=first.name)] == ["lease-lost"] * 2
    assert first.stats().active == 0
    assert second.stats().active == 0


def _admission(limiter: ConcurrencyLimiter, *, limiters: list[Any] | None = None) -> Admission:
    def acquire(
        members: Any, cancel: CancellationToken | None, on_wait: OnWait
    ) -> tuple[Lease, ...]:
        if len(members) == 1:
            return (members[0].limiter.acquire(members[0].request, cancel=cancel, on_wait=on_wait),)
        return tuple(m.limiter.acquire(m.request, cancel=cancel) for m in members)

    return Admission(acquire, limiters=limiters or (limiter,), request_id="delivery-1")


def test_a_pre_admitted_slot_past_its_validity_fails_the_first_slot_without_running_it(
    keeper: LeaseKeeper,
    fake_clock: FakeClock,
    limiter: InMemoryConcurrencyLimiter,
    events: EventRecorder,
) -> None:
    admission = _admission(limiter)
    ran: list[str] = []
    with run(limiter=limiter, admission=admission):
        preadmit(admission)
        fake_clock.advance(TTL_S)
        with pytest.raises(ConcurrencyLeaseLostError), slot():
            ran.append("body")
    assert ran == []
    assert len(events.of("lease-lost", limiter=limiter.name)) == 1
    assert limiter.stats().active == 0


def test_an_adopted_pre_admitted_slot_ends_with_lease_lost_once_its_validity_passed(
    keeper: LeaseKeeper,
    fake_clock: FakeClock,
    limiter: InMemoryConcurrencyLimiter,
    events: EventRecorder,
) -> None:
    admission = _admission(limiter)
    reads: list[bool] = []

    def body() -> None:
        with slot() as held:
            fake_clock.advance(TTL_S)
            reads.append(held.aborted)

    with run(limiter=limiter, admission=admission):
        preadmit(admission)
        with pytest.raises(ConcurrencyLeaseLostError):
            body()
    assert reads == [True]
    lost, released = _lost_and_released(events, limiter.name)
    assert len(lost) == 1
    assert [e.outcome for e in released] == ["lease-lost"]
    assert limiter.stats().active == 0


def test_slots_pre_admitted_over_several_limiters_past_a_validity_fail_the_first_slot(
    keeper: LeaseKeeper,
    fake_clock: FakeClock,
    two_limiters: list[InMemoryConcurrencyLimiter],
    events: EventRecorder,
) -> None:
    first, second = two_limiters
    admission = _admission(first, limiters=two_limiters)
    ran: list[str] = []
    with run(limiter=[first, second], admission=admission):
        preadmit(admission)
        fake_clock.advance(TTL_S / 3)
        with pytest.raises(ConcurrencyLeaseLostError), slot():
            ran.append("body")
    assert ran == []
    assert len(events.of("lease-lost", limiter=first.name)) == 1
    assert first.stats().active == 0
    assert second.stats().active == 0


def test_a_pre_admitted_slot_never_adopted_is_released_as_lost_once_its_validity_passed(
    keeper: LeaseKeeper,
    fake_clock: FakeClock,
    custom_limiter: Callable[..., Any],
) -> None:
    limiter = custom_limiter(1, lease_ttl_ms=TTL_MS, clock=fake_clock)
    admission = _admission(limiter)
    with run(limiter=limiter, admission=admission):
        preadmit(admission)
        fake_clock.advance(TTL_S)
        admission.end(None)  # the run's body ended without asking for a slot
    assert [outcome for _, outcome in limiter.released] == ["lease-lost"]
