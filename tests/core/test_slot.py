"""The slot runtime: acquire, keep, abort and release one slot per provider request.

Renewal, ``max_hold_ms`` and aborts happen on the process's lease keeper thread, so
these tests use short TTLs and short real waits, always waiting for an outcome (an
event, a callback) rather than for a fixed time.

An aborted hold replaces whatever its body raised with the abort's error, so bodies
here record what they saw and the tests assert after the block.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import pytest

from runcell_celery import (
    CancellationToken,
    ConcurrencyCancelledError,
    ConcurrencyConfigError,
    ConcurrencyLeaseLostError,
    ConcurrencyLimiterError,
    ConcurrencyQueueFullError,
    ConcurrencyTimeoutError,
    Slot,
    create_concurrency_limiter,
    run,
    slot,
)

if TYPE_CHECKING:
    from tests.conftest import EventRecorder
    from tests.core.conftest import CustomLimiter

    CustomFactory = Callable[..., CustomLimiter]
    Full = Callable[..., contextlib.AbstractContextManager[Any]]

SOON_S = 10.0
#: A DSN with a password, as a database driver might put it in an error message.
SECRET_DSN = "postgresql://runcell:hunter2@db.internal:5432/prod"


class StorageError(Exception):
    """What a failing backend raises (a stand-in for a database driver's error)."""


def wait_for_abort(held: Slot) -> bool:
    """Block like a provider call until the hold is aborted; tell whether it was."""
    aborted = threading.Event()
    held.on_abort(aborted.set)
    return aborted.wait(SOON_S)


# -- holding and releasing ----------------------------------------------------------------


def test_a_slot_holds_one_slot_while_its_block_runs(events: EventRecorder) -> None:
    limiter = create_concurrency_limiter(2, name="held")
    with slot(limiter) as held:
        active = limiter.stats().active
        lease = held.lease
        token = held.fencing_token
    assert active == 1
    assert lease is not None
    assert token == lease.fencing_token
    assert not held.aborted
    assert limiter.stats().active == 0
    assert events.types(limiter="held") == ["acquired", "released"]
    acquired, released = events.of("acquired")[0], events.of("released")[0]
    assert (acquired.lease_id, acquired.fencing_token) == (lease.lease_id, token)
    assert (released.lease_id, released.outcome) == (lease.lease_id, "success")


def test_a_slot_is_released_when_its_block_raises(events: EventRecorder) -> None:
    limiter = create_concurrency_limiter(1, name="raises")
    with pytest.raises(ValueError, match="provider said no"), slot(limiter):
        raise ValueError("provider said no")
    assert limiter.stats().active == 0
    assert events.of("released", limiter="raises")[0].outcome == "error"


def test_an_async_slot_holds_one_slot_while_its_block_runs() -> None:
    limiter = create_concurrency_limiter(1)

    async def main() -> int:
        async with slot(limiter):
            await asyncio.sleep(0)
            return limiter.stats().active

    assert asyncio.run(main()) == 1
    assert limiter.stats().active == 0


def test_a_slot_is_used_once() -> None:
    limiter = create_concurrency_limiter(1)
    held = slot(limiter)
    with held:
        pass
    with pytest.raises(RuntimeError, match="used once"), held:
        pass
    assert limiter.stats().active == 0


def test_a_slot_with_no_limiter_and_no_run_is_a_config_error() -> None:
    with pytest.raises(ConcurrencyConfigError, match="no limiter") as caught, slot():
        pass
    assert caught.value.request_id is not None


def test_a_slot_outside_any_run_is_a_run_of_its_own(events: EventRecorder) -> None:
    limiter = create_concurrency_limiter(1, name="alone")
    with slot(limiter):
        pass
    acquired = events.of("acquired", limiter="alone")[0]
    assert acquired.run_id == acquired.root_run_id == acquired.request_id
    assert acquired.parent_run_id is None


def test_a_slot_uses_the_workload_it_selects(events: EventRecorder) -> None:
    limiter = create_concurrency_limiter(
        2, name="two", workloads={"interactive": {}, "background": {}}
    )
    with slot(limiter, workload="background"):
        active = limiter.stats().workloads["background"].active
    assert active == 1
    assert events.of("acquired", limiter="two")[0].workload == "background"


def test_an_unknown_workload_fails_before_waiting(
    events: EventRecorder, limiter_full: Full
) -> None:
    limiter = create_concurrency_limiter(1, name="typo", workloads={"interactive": {}})
    with (
        limiter_full(limiter, "interactive"),
        pytest.raises(ConcurrencyConfigError, match="did you mean 'interactive'"),
        slot(limiter, workload="interactve"),
    ):
        pass
    assert events.types(limiter="typo") == ["config-error"]
    (event,) = events.of("config-error", limiter="typo")
    assert event.workload == "interactve"
    assert event.error is not None
    assert "did you mean" in event.error


# -- failing to get a slot: the provider is not called ----------------------------------------


def test_a_slot_that_waits_past_the_budget_times_out_without_running(
    events: EventRecorder, limiter_full: Full
) -> None:
    limiter = create_concurrency_limiter(1, name="full")
    ran = []
    with (
        limiter_full(limiter),
        run(timeout_ms=30),
        pytest.raises(ConcurrencyTimeoutError),
        slot(limiter),
    ):
        ran.append("provider")
    assert ran == []
    assert limiter.stats().queued == 0
    assert events.types(limiter="full") == ["wait-started", "timed-out"]


def test_a_full_queue_fails_the_slot_without_running(
    events: EventRecorder, limiter_full: Full
) -> None:
    limiter = create_concurrency_limiter(1, name="queue", max_queued=0)
    ran = []
    with limiter_full(limiter), pytest.raises(ConcurrencyQueueFullError), slot(limiter):
        ran.append("provider")
    assert ran == []
    (event,) = events.of("queue-full", limiter="queue")
    assert event.wait_ms is not None


def test_a_failing_limiter_fails_closed(
    custom_limiter: CustomFactory, events: EventRecorder
) -> None:
    limiter = custom_limiter(1)
    limiter.acquire_error = StorageError(f"connection to {SECRET_DSN} refused")
    ran = []
    with pytest.raises(ConcurrencyLimiterError) as caught, slot(limiter):
        ran.append("provider")
    assert ran == []
    error = caught.value
    assert isinstance(error.__cause__, StorageError)
    assert "hunter2" not in str(error)
    assert error.limiter == limiter.name
    (event,) = events.of("limiter-error", limiter=limiter.name)
    assert event.error is not None
    assert event.error.startswith("StorageError: connection to postgresql://runcell:***@")
    assert "hunter2" not in event.error


def test_a_limiter_error_raised_by_the_limiter_is_passed_on_unchanged(
    custom_limiter: CustomFactory, events: EventRecorder
) -> None:
    limiter = custom_limiter(1)
    limiter.acquire_error = ConcurrencyLimiterError("database is read-only", limiter=limiter.name)
    with pytest.raises(ConcurrencyLimiterError) as caught, slot(limiter):
        pass
    assert caught.value is limiter.acquire_error
    assert events.types(limiter=limiter.name) == ["limiter-error"]


# -- cancellation ----------------------------------------------------------------------------


def test_a_cancellation_token_stops_a_waiting_slot(
    events: EventRecorder, limiter_full: Full
) -> None:
    limiter = create_concurrency_limiter(1, name="cancel-wait")
    cancel = CancellationToken()
    ran = []

    def provider_call() -> None:
        with slot(limiter, cancel=cancel):
            ran.append("provider")

    with limiter_full(limiter), ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(provider_call)
        events.wait_for("wait-started", limiter="cancel-wait")
        cancel.cancel("user pressed stop")
        with pytest.raises(ConcurrencyCancelledError):
            waiting.result(SOON_S)
    assert ran == []
    assert events.types(limiter="cancel-wait") == ["wait-started", "wait-cancelled"]
    assert events.of("wait-cancelled")[0].wait_ms is not None
    assert limiter.stats().queued == 0


def test_a_run_cancelled_before_it_asks_never_waits(events: EventRecorder) -> None:
    limiter = create_concurrency_limiter(1, name="cancelled-run")
    cancel = CancellationToken()
    cancel.cancel()
    with (
        run(limiter=limiter, cancel=cancel),
        pytest.raises(ConcurrencyCancelledError, match="before it asked"),
        slot(),
    ):
        pass
    assert events.types(limiter="cancelled-run") == ["wait-cancelled"]
    assert limiter.stats().active == 0


def test_cancelling_during_a_hold_fires_abort_callbacks_and_fails_the_block(
    events: EventRecorder,
) -> None:
    limiter = create_concurrency_limiter(1, name="cancel-hold")
    cancel = CancellationToken()
    seen: dict[str, bool] = {}

    def provider_call() -> str:
        with slot(limiter, cancel=cancel) as held:
            threading.Thread(target=cancel.cancel).start()
            seen["callback fired"] = wait_for_abort(held)
            seen["aborted"] = held.aborted
            return "a reply nobody may use"  # a sync body cannot be interrupted

    with pytest.raises(ConcurrencyCancelledError, match="cancelled while holding"):
        provider_call()
    assert seen == {"callback fired": True, "aborted": True}
    assert limiter.stats().active == 0
    assert events.of("released", limiter="cancel-hold")[0].outcome == "cancelled"


def test_an_abort_callback_added_after_the_abort_is_called_at_once() -> None:
    limiter = create_concurrency_limiter(1)
    cancel = CancellationToken()
    calls: list[str] = []

    def provider_call() -> None:
        with slot(limiter, cancel=cancel) as held:
            cancel.cancel()
            held.on_abort(lambda: calls.append("late"))

    with pytest.raises(ConcurrencyCancelledError):
        provider_call()
    assert calls == ["late"]


def test_a_failing_abort_callback_does_not_stop_the_others() -> None:
    limiter = create_concurrency_limiter(1)
    cancel = CancellationToken()
    calls: list[str] = []

    def broken() -> None:
        raise RuntimeError("close() failed")

    def provider_call() -> None:
        with slot(limiter, cancel=cancel) as held:
            held.on_abort(broken)
            held.on_abort(lambda: calls.append("second"))
            cancel.cancel()

    with pytest.raises(ConcurrencyCancelledError):
        provider_call()
    assert calls == ["second"]


def test_cancelling_during_an_async_hold_cancels_the_body(events: EventRecorder) -> None:
    limiter = create_concurrency_limiter(1, name="cancel-async")
    cancel = CancellationToken()
    seen: list[str] = []

    async def provider_call() -> None:
        async with slot(limiter, cancel=cancel):
            threading.Thread(target=cancel.cancel).start()
            try:
                await asyncio.sleep(SOON_S)  # the streaming provider call
            except asyncio.CancelledError:
                seen.append("body cancelled")
                raise
            seen.append("body finished")

    async def main() -> None:
        with pytest.raises(ConcurrencyCancelledError):
            await provider_call()
        # The cancellation was the slot's, to stop the body: the task goes on.
        task = asyncio.current_task()
        assert task is not None
        assert task.cancelling() == 0
        await asyncio.sleep(0)
        seen.append("task continued")

    asyncio.run(main())
    assert seen == ["body cancelled", "task continued"]
    assert limiter.stats().active == 0
    assert events.of("released", limiter="cancel-async")[0].outcome == "cancelled"


def test_cancelling_a_task_that_waits_for_a_slot_leaves_no_trace(
    events: EventRecorder, limiter_full: Full
) -> None:
    limiter = create_concurrency_limiter(1, name="task-cancel")
    ran = []

    async def provider_call() -> None:
        async with slot(limiter):
            ran.append("provider")

    async def main() -> None:
        task = asyncio.create_task(provider_call())
        await asyncio.to_thread(events.wait_for, "wait-started", limiter="task-cancel")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    with limiter_full(limiter):
        asyncio.run(main())
    assert ran == []
    assert events.types(limiter="task-cancel") == ["wait-started", "wait-cancelled"]
    assert (limiter.stats().active, limiter.stats().queued) == (0, 0)


def test_cancelling_a_task_that_waits_on_a_blocking_limiter_leaks_no_slot(
    custom_limiter: CustomFactory, limiter_full: Full
) -> None:
    limiter = custom_limiter(1)  # no acquire_async: the runtime waits in a thread

    async def provider_call() -> None:
        async with slot(limiter):
            await asyncio.sleep(0)

    async def main() -> None:
        for _ in range(20):
            with limiter_full(limiter.inner):
                task = asyncio.create_task(provider_call())
                while limiter.stats().queued == 0:
                    await asyncio.sleep(0.001)
            # The slot is free again; cancel at once: whoever wins, nothing leaks.
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            assert (limiter.stats().active, limiter.stats().queued) == (0, 0)

    asyncio.run(main())


# -- renewal and lost leases -------------------------------------------------------------------


def test_renewal_keeps_a_long_hold_alive_past_several_ttls(events: EventRecorder) -> None:
    limiter = create_concurrency_limiter(1, name="renewed", lease_ttl_ms=150)
    with slot(limiter) as held:
        time.sleep(0.6)  # four TTLs: without renewal the lease would be long gone
        active = limiter.stats().active
        renewed = limiter.renew(held.lease) if held.lease is not None else None
    assert active == 1
    assert renewed is not None
    assert not held.aborted
    assert events.of("lease-lost", limiter="renewed") == []
    assert events.of("released", limiter="renewed")[0].outcome == "success"


def test_a_lease_the_limiter_no_longer_holds_fails_the_hold(
    custom_limiter: CustomFactory, events: EventRecorder
) -> None:
    limiter = custom_limiter(1, lease_ttl_ms=90)
    limiter.renew_mode = "lost"
    seen: list[bool] = []

    def provider_call() -> str:
        with slot(limiter) as held:
            seen.append(wait_for_abort(held))
            return "a reply made without a valid slot"

    with pytest.raises(ConcurrencyLeaseLostError, match="could not be renewed"):
        provider_call()
    assert seen == [True]
    assert limiter.renewals == 1, "the hold outlived the renewal that found its lease gone"
    (lost,) = events.of("lease-lost", limiter=limiter.name)
    assert lost.reason == "renewal"
    assert lost.lease_id is not None
    assert lost.hold_ms is not None
    assert lost.hold_ms > 0
    assert events.of("released", limiter=limiter.name)[0].outcome == "lease-lost"
    assert limiter.stats().active == 0


def test_a_lost_lease_cancels_an_async_body(custom_limiter: CustomFactory) -> None:
    limiter = custom_limiter(1, lease_ttl_ms=90)
    limiter.renew_mode = "lost"
    seen: list[str] = []

    async def provider_call() -> str:
        async with slot(limiter):
            await asyncio.sleep(SOON_S)
            seen.append("body finished")
            return "a reply made without a valid slot"

    async def main() -> None:
        with pytest.raises(ConcurrencyLeaseLostError):
            await provider_call()

    asyncio.run(main())
    assert seen == []


def test_renewal_errors_emit_renewal_failed_then_lease_lost_after_expiry(
    custom_limiter: CustomFactory, events: EventRecorder
) -> None:
    limiter = custom_limiter(1, lease_ttl_ms=150)
    limiter.renew_mode = "fail"
    limiter.renew_error = StorageError(f"could not reach {SECRET_DSN}")
    holds: list[Slot] = []

    def provider_call() -> None:
        with slot(limiter) as held:
            holds.append(held)
            wait_for_abort(held)

    with pytest.raises(ConcurrencyLeaseLostError):
        provider_call()
    types = events.types(limiter=limiter.name)
    assert types[0] == "acquired"
    assert types[-2:] == ["lease-lost", "released"]
    assert set(types[1:-2]) == {"renewal-failed"}
    failures = events.of("renewal-failed", limiter=limiter.name)
    assert len(failures) >= 2, "renewal was not retried before the lease expired"
    lease = holds[0].lease
    assert lease is not None
    for failure in failures:
        assert failure.lease_id == lease.lease_id
        assert failure.error is not None
        assert failure.error.startswith("StorageError: could not reach postgresql://runcell:***@")
        assert "hunter2" not in failure.error


def test_a_transient_renewal_error_does_not_lose_the_lease(
    custom_limiter: CustomFactory, events: EventRecorder
) -> None:
    limiter = custom_limiter(1, lease_ttl_ms=300)
    limiter.renew_mode = "fail"
    limiter.renew_failures_left = 1
    with slot(limiter) as held:
        events.wait_for("renewal-failed", limiter=limiter.name)
        deadline = time.monotonic() + SOON_S
        while limiter.renewals < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert limiter.renewals >= 4
    assert not held.aborted
    assert events.of("lease-lost", limiter=limiter.name) == []


# -- max_hold_ms -------------------------------------------------------------------------------


def test_max_hold_ends_the_hold_and_frees_the_slot_while_the_body_still_runs(
    events: EventRecorder,
) -> None:
    limiter = create_concurrency_limiter(1, name="max-hold")
    other_ran = threading.Event()
    seen: dict[str, bool] = {}

    def other() -> None:
        with run(timeout_ms=SOON_S * 1000), slot(limiter):
            other_ran.set()

    def stuck_provider_call(pool: ThreadPoolExecutor) -> None:
        with slot(limiter, max_hold_ms=80) as held:
            waiting = pool.submit(other)
            seen["other ran meanwhile"] = other_ran.wait(SOON_S)
            seen["aborted"] = held.aborted
        waiting.result()

    with ThreadPoolExecutor(1) as pool, pytest.raises(ConcurrencyLeaseLostError, match="max_hold"):
        stuck_provider_call(pool)
    assert seen == {"other ran meanwhile": True, "aborted": True}
    (lost,) = events.of("lease-lost", limiter="max-hold")
    assert lost.reason == "max-hold"
    outcomes = [e.outcome for e in events.of("released", limiter="max-hold")]
    assert outcomes == ["max-hold", "success"]
    assert limiter.stats().active == 0


def test_the_limiters_max_hold_applies_when_the_slot_sets_none() -> None:
    limiter = create_concurrency_limiter(1, max_hold_ms=60)
    seen: list[int] = []

    def stuck_provider_call() -> None:
        with slot(limiter) as held:
            wait_for_abort(held)
            seen.append(limiter.stats().active)

    with pytest.raises(ConcurrencyLeaseLostError):
        stuck_provider_call()
    assert seen == [0]


def test_max_hold_frees_the_slot_even_after_the_run_budget_ended_during_the_hold() -> None:
    limiter = create_concurrency_limiter(1)
    other_ran = threading.Event()
    seen: dict[str, bool] = {}

    def other() -> None:
        with slot(limiter):
            other_ran.set()

    def stuck_provider_call(pool: ThreadPoolExecutor) -> None:
        with run(timeout_ms=40), slot(limiter, max_hold_ms=300) as held:
            seen["budget ended"] = wait_for_abort(held)  # a sync body cannot be stopped
            waiting = pool.submit(other)
            seen["other ran meanwhile"] = other_ran.wait(SOON_S)
        waiting.result()

    with ThreadPoolExecutor(1) as pool, pytest.raises(ConcurrencyTimeoutError):
        stuck_provider_call(pool)
    assert seen == {"budget ended": True, "other ran meanwhile": True}
    assert limiter.stats().active == 0


def test_max_hold_frees_the_slot_even_after_a_cancel_during_the_hold(
    events: EventRecorder,
) -> None:
    limiter = create_concurrency_limiter(1, name="cancel-then-max-hold")
    cancel = CancellationToken()
    other_ran = threading.Event()
    seen: dict[str, bool] = {}

    def other() -> None:
        with slot(limiter):
            other_ran.set()

    def stuck_provider_call(pool: ThreadPoolExecutor) -> None:
        with slot(limiter, max_hold_ms=100, cancel=cancel):
            cancel.cancel()
            waiting = pool.submit(other)
            seen["other ran meanwhile"] = other_ran.wait(SOON_S)
        waiting.result()

    with ThreadPoolExecutor(1) as pool, pytest.raises(ConcurrencyCancelledError):
        stuck_provider_call(pool)
    assert seen == {"other ran meanwhile": True}
    outcomes = [e.outcome for e in events.of("released", limiter="cancel-then-max-hold")]
    assert outcomes == ["max-hold", "success"]


# -- release failures ---------------------------------------------------------------------------


def test_a_failed_release_emits_release_failed_and_the_run_continues(
    custom_limiter: CustomFactory, events: EventRecorder
) -> None:
    limiter = custom_limiter(1)
    limiter.release_error = StorageError(f"lost connection to {SECRET_DSN}")

    def provider_call() -> str:
        with slot(limiter):
            return "reply"

    assert provider_call() == "reply"
    (failed,) = events.of("release-failed", limiter=limiter.name)
    assert failed.lease_id == limiter.released[0][0]
    assert failed.error is not None
    assert failed.error.startswith("StorageError: lost connection to postgresql://runcell:***@")
    assert events.of("released", limiter=limiter.name) == []


def test_a_failed_release_after_a_body_error_keeps_the_body_error(
    custom_limiter: CustomFactory,
) -> None:
    limiter = custom_limiter(1)
    limiter.release_error = StorageError("gone")
    with pytest.raises(ValueError, match="provider"), slot(limiter):
        raise ValueError("provider failed")
    assert limiter.released[0][1] == "error"
