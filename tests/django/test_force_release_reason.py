"""A holder whose slot an operator force-released learns who did it: its
``ConcurrencyLeaseLostError`` and its ``lease-lost`` event say ``force-released by
<user>``, not that the lease "could not be renewed"."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from runcell_celery import ConcurrencyLeaseLostError, run, slot
from runcell_celery.postgres import PostgresConcurrencyLimiter
from runcell_django.force_release import force_release
from runcell_django.models import Lease
from tests.conftest import EventRecorder, wait_until

pytestmark = pytest.mark.django_db(transaction=True)


def _hold_until_lost(
    limiter: PostgresConcurrencyLimiter, run_id: str, outcome: list[BaseException]
) -> threading.Thread:
    def hold() -> None:
        try:
            with run(limiter=limiter, run_id=run_id), slot() as held:
                wait_until(lambda: held.aborted, "the holder learns it lost its slot", 20)
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=hold, name=run_id)
    thread.start()
    wait_until(lambda: Lease.objects.filter(run_id=run_id).exists(), "the slot is held")
    return thread


def test_a_force_released_holder_is_told_who_released_its_slot(
    pg_limiter: Callable[..., PostgresConcurrencyLimiter], events: EventRecorder
) -> None:
    limiter = pg_limiter(name="claude", max_concurrent=1, lease_ttl_ms=1_500)
    outcome: list[BaseException] = []
    holder = _hold_until_lost(limiter, "stuck-task", outcome)
    lease_id = str(Lease.objects.get(run_id="stuck-task").pk)

    assert [x.lease_id for x in force_release([lease_id], actor="alice")] == [lease_id]
    holder.join(20)

    [error] = outcome
    assert isinstance(error, ConcurrencyLeaseLostError)
    assert str(error) == f"lost slot {lease_id} of limiter 'claude': force-released by alice"
    [lost] = events.of("lease-lost")
    assert lost.reason == "force-released by alice"


def test_a_lease_lost_without_an_operator_still_could_not_be_renewed(
    pg_limiter: Callable[..., PostgresConcurrencyLimiter], events: EventRecorder
) -> None:
    limiter = pg_limiter(name="claude", max_concurrent=1, lease_ttl_ms=1_500)
    outcome: list[BaseException] = []
    holder = _hold_until_lost(limiter, "expired-task", outcome)
    Lease.objects.filter(run_id="expired-task").delete()  # gone, nobody said why
    holder.join(20)

    [error] = outcome
    assert "it could not be renewed" in str(error)
    assert [e.reason for e in events.of("lease-lost")] == ["renewal"]
