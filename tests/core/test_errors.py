"""Every ConcurrencyError names its limiter, workload, run lineage and request."""

from __future__ import annotations

import pickle
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pytest

from runcell_celery import (
    CancellationToken,
    ConcurrencyCancelledError,
    ConcurrencyConfigError,
    ConcurrencyError,
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
    Full = Callable[..., Any]

Enter = Callable[[], None]


class StorageError(Exception):
    """What a failing backend raises (a stand-in for a database driver's error)."""


def wait_for_abort(held: Slot) -> bool:
    aborted = threading.Event()
    held.on_abort(aborted.set)
    return aborted.wait(10.0)


def timed_out(limiter: CustomLimiter, full: Full) -> Enter:
    def enter() -> None:
        with full(limiter.inner), run(timeout_ms=20), slot():
            pass

    return enter


def queue_full(limiter: CustomLimiter, full: Full) -> Enter:
    def enter() -> None:
        with full(limiter.inner), slot():
            pass

    limiter.inner = create_concurrency_limiter(1, name=limiter.name, max_queued=0)
    return enter


def cancelled_waiting(limiter: CustomLimiter, full: Full) -> Enter:
    def enter() -> None:
        cancel = CancellationToken()
        timer = threading.Timer(0.02, cancel.cancel)
        timer.start()
        with full(limiter.inner), slot(cancel=cancel):
            pass

    return enter


def cancelled_holding(limiter: CustomLimiter, full: Full) -> Enter:
    def enter() -> None:
        cancel = CancellationToken()
        with slot(cancel=cancel):
            cancel.cancel()

    return enter


def unknown_workload(limiter: CustomLimiter, full: Full) -> Enter:
    def enter() -> None:
        with slot(workload="batch"):
            pass

    return enter


def limiter_failed(limiter: CustomLimiter, full: Full) -> Enter:
    def enter() -> None:
        limiter.acquire_error = StorageError("down")
        with slot():
            pass

    return enter


def lease_lost(limiter: CustomLimiter, full: Full) -> Enter:
    limiter.inner = create_concurrency_limiter(1, name=limiter.name, lease_ttl_ms=60)

    def enter() -> None:
        limiter.renew_mode = "lost"
        with slot() as held:
            wait_for_abort(held)

    return enter


def held_too_long(limiter: CustomLimiter, full: Full) -> Enter:
    def enter() -> None:
        with slot(max_hold_ms=30) as held:
            wait_for_abort(held)

    return enter


def budget_ended_while_holding(limiter: CustomLimiter, full: Full) -> Enter:
    def enter() -> None:
        with run(timeout_ms=30), slot() as held:
            wait_for_abort(held)

    return enter


@pytest.mark.parametrize(
    ("scenario", "error_type"),
    [
        (timed_out, ConcurrencyTimeoutError),
        (queue_full, ConcurrencyQueueFullError),
        (cancelled_waiting, ConcurrencyCancelledError),
        (cancelled_holding, ConcurrencyCancelledError),
        (unknown_workload, ConcurrencyConfigError),
        (limiter_failed, ConcurrencyLimiterError),
        (lease_lost, ConcurrencyLeaseLostError),
        (held_too_long, ConcurrencyLeaseLostError),
        (budget_ended_while_holding, ConcurrencyTimeoutError),
    ],
    ids=lambda value: getattr(value, "__name__", ""),
)
def test_every_concurrency_error_names_limiter_workload_run_lineage_and_request(
    custom_limiter: CustomFactory,
    limiter_full: Full,
    events: EventRecorder,
    scenario: Callable[[CustomLimiter, Full], Enter],
    error_type: type[ConcurrencyError],
) -> None:
    limiter = custom_limiter(1)
    enter = scenario(limiter, limiter_full)
    with (
        run(limiter=limiter, run_id="parent-run") as parent,
        run(run_id="child-run") as child,
        pytest.raises(error_type) as caught,
    ):
        enter()
    error = caught.value
    fields = error.fields()
    assert None not in fields.values(), fields
    assert fields["limiter"] == limiter.name
    assert fields["workload"] in ("default", "batch")
    assert fields["root_run_id"] == parent.root_run_id == "parent-run"
    if fields["run_id"] == "child-run":
        assert fields["parent_run_id"] == parent.run_id
    else:  # the scenario started a run of its own inside the child
        assert fields["parent_run_id"] == child.run_id
    # The request id is the one this slot's events carry.
    of_this_run = [e for e in events.events if e.run_id == fields["run_id"]]
    assert of_this_run
    assert {e.request_id for e in of_this_run} == {fields["request_id"]}
    # And the fields survive pickling (Celery results, multiprocessing).
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error)
    assert copy.fields() == fields
    assert str(copy) == str(error)
