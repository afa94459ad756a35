"""A held slot's end: aborts happen once, the slot is released exactly once.

These tests drive a :class:`~runcell_celery.hold.Hold` directly, as the lease keeper
(naming each lease by its index) and a cancelling thread do, without handing it to the
keeper: every outcome comes from a call the test makes, never from waiting.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import pytest

from runcell_celery import (
    ConcurrencyCancelledError,
    ConcurrencyLeaseLostError,
    ConcurrencyTimeoutError,
    Deadline,
)
from runcell_celery.hold import Hold
from runcell_celery.request import build_request

if TYPE_CHECKING:
    from tests.conftest import EventRecorder
    from tests.core.conftest import CustomLimiter

    CustomFactory = Callable[..., CustomLimiter]


def _hold(limiter: CustomLimiter, *, max_hold: Deadline | None = None) -> Hold:
    asked = build_request(None, limiter)
    return Hold(asked, (limiter.acquire(asked.request),), max_hold=max_hold)


@pytest.mark.parametrize(
    ("body_raised", "outcome"),
    [
        (None, "success"),
        (ValueError("provider failed"), "error"),
        (KeyboardInterrupt(), "cancelled"),
    ],
)
def test_a_hold_is_released_once_with_the_outcome_of_its_body(
    custom_limiter: CustomFactory, body_raised: BaseException | None, outcome: str
) -> None:
    limiter = custom_limiter(1)
    hold = _hold(limiter)
    assert hold.end(body_raised) is None
    assert hold.end(None) is None
    assert limiter.released == [(hold.lease.lease_id, outcome)]
    assert hold.kept_lease(0) is None
    assert limiter.stats().active == 0


def test_the_first_abort_wins_and_its_callbacks_run_once(custom_limiter: CustomFactory) -> None:
    limiter = custom_limiter(1)
    hold = _hold(limiter)
    calls: list[str] = []
    hold.on_abort(lambda: calls.append("close the response"))
    hold.cancelled()
    hold.lease_lost(0, None)
    hold.abort("timed-out")
    assert calls == ["close the response"]
    assert hold.abort_reason == "cancelled"
    error = hold.end(None)
    assert isinstance(error, ConcurrencyCancelledError)
    assert error.request_id == hold.slot_request.request.request_id
    assert limiter.released == [(hold.lease.lease_id, "cancelled")]


def test_max_hold_after_an_earlier_abort_releases_at_once_and_never_again(
    custom_limiter: CustomFactory, events: EventRecorder
) -> None:
    limiter = custom_limiter(1)
    hold = _hold(limiter)
    hold.abort("timed-out")  # a sync body that cannot be stopped keeps running
    assert limiter.released == []
    hold.abort("max-hold")
    assert limiter.released == [(hold.lease.lease_id, "max-hold")]
    assert hold.kept_lease(0) is None
    assert isinstance(hold.end(None), ConcurrencyTimeoutError)
    assert limiter.released == [(hold.lease.lease_id, "max-hold")]
    (lost,) = events.of("lease-lost", limiter=limiter.name)
    assert lost.reason == "max-hold"


def test_an_abort_after_the_end_changes_nothing(custom_limiter: CustomFactory) -> None:
    limiter = custom_limiter(1)
    hold = _hold(limiter)
    calls: list[str] = []
    hold.on_abort(lambda: calls.append("late"))
    hold.end(None)
    hold.abort("max-hold")
    hold.lease_lost(0, None)
    assert calls == []
    assert not hold.aborted
    assert limiter.released == [(hold.lease.lease_id, "success")]


def test_a_passed_max_hold_aborts_as_a_lost_lease(custom_limiter: CustomFactory) -> None:
    limiter = custom_limiter(1)
    hold = _hold(limiter, max_hold=Deadline.after_ms(-1))
    assert hold.deadline_passed() is None
    assert hold.abort_reason == "max-hold"
    error = hold.end(None)
    assert isinstance(error, ConcurrencyLeaseLostError)
    assert "max_hold_ms" in error.message


def test_the_end_of_the_budget_aborts_and_leaves_max_hold_to_watch(
    custom_limiter: CustomFactory,
) -> None:
    limiter = custom_limiter(1)
    later = Deadline.after_ms(60_000)
    hold = _hold(limiter, max_hold=later)
    assert hold.deadline_passed() == later
    assert hold.abort_reason == "timed-out"
    assert hold.kept_lease(0) is not None  # still held until max_hold or the body ends
    assert isinstance(hold.end(None), ConcurrencyTimeoutError)
    assert limiter.released == [(hold.lease.lease_id, "timed-out")]


def test_a_renewed_lease_replaces_the_kept_one(custom_limiter: CustomFactory) -> None:
    limiter = custom_limiter(1)
    hold = _hold(limiter)
    renewed = limiter.renew(hold.lease)
    assert renewed is not None
    hold.lease_renewed(0, renewed, Deadline.after_ms(renewed.ttl_ms))
    assert hold.kept_lease(0) == (limiter, renewed)
    hold.end(None)


def test_a_lost_lease_fails_the_hold_and_is_still_released_once(
    custom_limiter: CustomFactory, events: EventRecorder
) -> None:
    limiter = custom_limiter(1)
    hold = _hold(limiter)
    hold.lease_lost(0, OSError("gone"))
    error = hold.end(None)
    assert isinstance(error, ConcurrencyLeaseLostError)
    assert "could not be renewed" in error.message
    assert limiter.released == [(hold.lease.lease_id, "lease-lost")]
    (lost,) = events.of("lease-lost", limiter=limiter.name)
    assert (lost.reason, lost.error) == ("renewal", "OSError: gone")


def test_cleanups_run_once_when_the_hold_ends(custom_limiter: CustomFactory) -> None:
    limiter = custom_limiter(1)
    hold = _hold(limiter)
    calls: list[str] = []
    hold.add_cleanup(lambda: calls.append("detach"))
    hold.end(None)
    hold.end(None)
    assert calls == ["detach"]
