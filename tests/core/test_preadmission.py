"""A run's first slot decided before its body: held for the body's first ``slot()``.

:func:`~runcell_celery.slot.preadmit` asks through the run's
:class:`~runcell_celery.admission.Admission` (the Celery task does it before the body);
the body's first ``slot()`` adopts the granted lease, or gives it back when it names
another limiter or workload; a run that never adopts it releases it at its end. Real
in-memory limiters (behind :class:`~tests.core.conftest.CustomLimiter` where a test
counts requests or loses a lease) and the process's real lease keeper.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING

import pytest

from runcell_celery import (
    CancellationToken,
    ConcurrencyCancelledError,
    ConcurrencyLeaseLostError,
    ConcurrencyLimiter,
    Lease,
    run,
    slot,
)
from runcell_celery.admission import Admission, Deferred
from runcell_celery.keeper import get_keeper
from runcell_celery.protocol import Member, OnWait
from runcell_celery.slot import preadmit
from tests.conftest import EventRecorder, wait_until

if TYPE_CHECKING:
    from tests.core.conftest import CustomLimiter

    CustomFactory = Callable[..., CustomLimiter]

WORKLOADS = {"chat": {}, "batch": {}}


def _admission(limiter: ConcurrencyLimiter, request_id: str = "delivery-1") -> Admission:
    def acquire(
        members: tuple[Member, ...], cancel: CancellationToken | None, on_wait: OnWait
    ) -> tuple[Lease, ...]:
        return (members[0].limiter.acquire(members[0].request, cancel=cancel, on_wait=on_wait),)

    return Admission(acquire, limiters=(limiter,), request_id=request_id)


def _active(limiter: CustomLimiter) -> int:
    return limiter.stats().active


def test_the_first_slot_adopts_the_pre_admitted_lease_without_asking_again(
    custom_limiter: CustomFactory, events: EventRecorder
) -> None:
    limiter = custom_limiter(1)
    admission = _admission(limiter)
    with run(limiter=limiter, admission=admission):
        preadmit(admission)
        assert admission.admitted is not None
        pre_admitted = admission.admitted.lease
        assert _active(limiter) == 1
        assert events.of("acquired") == []  # the hold starts at the body's slot()
        with slot() as held:
            assert held.lease is not None
            assert held.lease.lease_id == pre_admitted.lease_id
            assert held.fencing_token == pre_admitted.fencing_token
            assert held.lease.request_id == "delivery-1"
        assert len(limiter.requests) == 1
        assert _active(limiter) == 0
        with slot() as second:  # acquired as usual, as a run's second call
            assert second.lease is not None
            assert second.lease.lease_id != pre_admitted.lease_id
    assert [r.in_progress for r in limiter.requests] == [False, True]
    acquired = events.of("acquired")
    assert next(e.lease_id for e in acquired) == pre_admitted.lease_id
    assert acquired[0].request_id == "delivery-1"
    assert [e.outcome for e in events.of("released")] == ["success", "success"]
    assert limiter.released[0] == (pre_admitted.lease_id, "success")


def test_an_async_first_slot_adopts_the_pre_admitted_lease(custom_limiter: CustomFactory) -> None:
    limiter = custom_limiter(1)
    admission = _admission(limiter)

    async def body() -> int | None:
        async with slot() as held:
            return held.fencing_token

    with run(limiter=limiter, admission=admission):
        preadmit(admission)
        assert admission.admitted is not None
        token = admission.admitted.lease.fencing_token
        assert asyncio.run(body()) == token
    assert len(limiter.requests) == 1
    assert _active(limiter) == 0


def test_a_first_slot_of_another_workload_gives_the_pre_admitted_slot_back_before_asking(
    custom_limiter: CustomFactory,
) -> None:
    # With one slot, keeping the pre-admitted one would make the run wait for itself.
    limiter = custom_limiter(1, workloads=WORKLOADS, default_workload="batch")
    admission = _admission(limiter)
    with run(limiter=limiter, workload="batch", admission=admission):
        preadmit(admission)
        assert admission.admitted is not None
        pre_admitted = admission.admitted.lease
        with slot(workload="chat") as held:
            assert held.lease is not None
            assert held.lease.lease_id != pre_admitted.lease_id
            assert _active(limiter) == 1
        with slot() as later:  # the pre-admitted slot is gone: asked as usual
            assert later.lease is not None
            assert later.lease.lease_id != pre_admitted.lease_id
    assert limiter.released[0] == (pre_admitted.lease_id, "cancelled")
    assert _active(limiter) == 0


def test_a_first_slot_of_another_limiter_gives_the_pre_admitted_slot_back(
    custom_limiter: CustomFactory,
) -> None:
    limiter, other = custom_limiter(1), custom_limiter(1)
    admission = _admission(limiter)
    with run(limiter=limiter, admission=admission):
        preadmit(admission)
        with slot(other):
            assert _active(limiter) == 0
            assert _active(other) == 1
    assert len(limiter.requests) == 1


def test_a_child_runs_first_slot_adopts_the_parents_pre_admitted_slot(
    custom_limiter: CustomFactory,
) -> None:
    limiter = custom_limiter(1)
    admission = _admission(limiter)
    with run(limiter=limiter, admission=admission):
        preadmit(admission)
        assert admission.admitted is not None
        token = admission.admitted.lease.fencing_token
        with run(timeout_ms=10_000), slot() as held:
            assert held.fencing_token == token
    assert len(limiter.requests) == 1


@pytest.mark.parametrize(("raised", "outcome"), [(None, "success"), (ValueError(), "error")])
def test_a_run_that_never_adopts_its_pre_admitted_slot_releases_it_at_its_end(
    custom_limiter: CustomFactory,
    events: EventRecorder,
    raised: BaseException | None,
    outcome: str,
) -> None:
    limiter = custom_limiter(1)
    admission = _admission(limiter)
    with run(limiter=limiter, admission=admission):
        preadmit(admission)
        assert _active(limiter) == 1
        assert get_keeper().held() >= 1
        admission.end(raised)
    assert admission.admitted is not None
    assert limiter.released == [(admission.admitted.lease.lease_id, outcome)]
    assert _active(limiter) == 0
    assert events.of("acquired") == []
    assert events.of("released") == []
    admission.end(None)  # once only
    assert len(limiter.released) == 1


def test_cancelling_the_run_releases_its_pre_admitted_slot(custom_limiter: CustomFactory) -> None:
    limiter = custom_limiter(1)
    admission = _admission(limiter)
    cancel = CancellationToken()
    with run(limiter=limiter, admission=admission, cancel=cancel):
        preadmit(admission)
        cancel.cancel("revoked")
        assert _active(limiter) == 0
        assert admission.admitted is not None
        assert limiter.released == [(admission.admitted.lease.lease_id, "cancelled")]
        with pytest.raises(ConcurrencyCancelledError), slot():
            pytest.fail("the body of a cancelled run's slot ran")


def test_the_end_of_the_budget_releases_a_pre_admitted_slot(custom_limiter: CustomFactory) -> None:
    limiter = custom_limiter(1)
    admission = _admission(limiter)
    with run(limiter=limiter, admission=admission, timeout_ms=200):
        preadmit(admission)
        wait_until(lambda: _active(limiter) == 0, "the keeper released the slot at the deadline")
    assert admission.admitted is not None
    assert limiter.released == [(admission.admitted.lease.lease_id, "timed-out")]


def test_a_pre_admitted_lease_lost_before_the_first_slot_fails_it_as_a_lost_lease(
    custom_limiter: CustomFactory, events: EventRecorder
) -> None:
    limiter = custom_limiter(1, lease_ttl_ms=300)  # renewed every 100 ms
    admission = _admission(limiter)
    guarded: list[str] = []
    with run(limiter=limiter, admission=admission):
        preadmit(admission)
        limiter.renew_mode = "lost"  # the limiter no longer holds it (force release)
        wait_until(lambda: limiter.renewals > 0, "the keeper tried to renew it")
        with pytest.raises(ConcurrencyLeaseLostError, match="could not be renewed"), slot():
            guarded.append("ran")
        assert guarded == []
    lost = events.of("lease-lost")
    assert admission.admitted is not None
    assert [e.lease_id for e in lost] == [admission.admitted.lease.lease_id]
    assert len(limiter.requests) == 1


def test_a_deferral_reaches_the_caller_of_preadmit_and_holds_nothing(
    custom_limiter: CustomFactory, events: EventRecorder
) -> None:
    limiter = custom_limiter(1)

    def park(*_: object) -> Deferred:
        return Deferred()

    admission = Admission(park, limiters=(limiter,), request_id="delivery-9")
    with run(limiter=limiter, admission=admission):
        assert preadmit(admission) == Deferred()
        assert admission.admitted is None
        with slot() as held:  # a later slot asks as usual (not via the admission)
            assert held.lease is not None
    assert len(limiter.requests) == 1
    assert events.of("timed-out") == events.of("limiter-error") == []
