"""Building a slot's request: limiter, workload, request id and budget, before any wait.

:func:`build_request` decides without asking the limiter for anything but the
validation of a workload name, so these tests check that no request ever reached the
limiter: it is a pure function of the run and the ``slot()`` arguments.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pytest

from runcell_celery import (
    CancellationToken,
    ConcurrencyCancelledError,
    ConcurrencyConfigError,
    ConcurrencyLimiter,
    ConcurrencyTimeoutError,
    Deadline,
    Lease,
    RunContext,
    create_concurrency_limiter,
)
from runcell_celery.admission import Admission
from runcell_celery.context import RunProgress
from runcell_celery.request import build_request

if TYPE_CHECKING:
    from tests.core.conftest import CustomLimiter

    CustomFactory = Callable[..., CustomLimiter]


def _run(**fields: Any) -> RunContext:
    return RunContext(run_id="run-1", root_run_id="root-1", parent_run_id="parent-1", **fields)


def test_a_request_outside_any_run_is_a_run_of_its_own(custom_limiter: CustomFactory) -> None:
    limiter = custom_limiter(1)
    asked = build_request(None, limiter)
    request = asked.request
    assert asked.run is None
    assert asked.limiter is limiter
    assert request.lineage.run_id == request.lineage.root_run_id == request.request_id
    assert request.lineage.parent_run_id is None
    assert (request.workload, request.timeout_ms, request.in_progress) == ("default", None, False)
    assert limiter.requests == []


def test_a_request_inside_a_run_takes_its_limiter_workload_lineage_and_budget(
    custom_limiter: CustomFactory,
) -> None:
    limiter = custom_limiter(2, workloads={"batch": {}, "chat": {}}, default_workload="batch")
    context = _run(
        limiter=limiter, workload="chat", name="summarize", deadline=Deadline.after_ms(60_000)
    )
    request = build_request(context, request_id="req-7").request
    assert request.request_id == "req-7"
    assert request.workload == "chat"
    assert (request.lineage.run_id, request.lineage.root_run_id) == ("run-1", "root-1")
    assert request.lineage.parent_run_id == "parent-1"
    assert request.holder_name == "summarize"
    assert request.timeout_ms is not None
    assert 59_000 < request.timeout_ms <= 60_000
    assert limiter.requests == []


def test_a_request_of_a_run_that_already_took_a_slot_is_in_progress(
    custom_limiter: CustomFactory,
) -> None:
    limiter = custom_limiter(1)
    context = _run(limiter=limiter, progress=RunProgress(slots_taken=1))
    assert build_request(context).request.in_progress


def test_a_slot_naming_another_limiter_does_not_take_the_runs_workload(
    custom_limiter: CustomFactory,
) -> None:
    runs_limiter = custom_limiter(1, workloads={"chat": {}}, default_workload="chat")
    other = custom_limiter(1)
    request = build_request(_run(limiter=runs_limiter, workload="chat"), other).request
    assert request.workload == "default"


def test_a_request_with_no_limiter_anywhere_is_a_config_error_naming_the_run() -> None:
    with pytest.raises(ConcurrencyConfigError, match="no limiter") as caught:
        build_request(_run(), request_id="req-1")
    assert caught.value.limiter is None
    assert (caught.value.run_id, caught.value.request_id) == ("run-1", "req-1")


def test_an_unknown_workload_is_refused_before_the_limiter_is_asked(
    custom_limiter: CustomFactory,
) -> None:
    limiter = custom_limiter(1)
    with pytest.raises(ConcurrencyConfigError, match="did you mean 'default'") as caught:
        build_request(_run(limiter=limiter), workload="defualt", request_id="req-2")
    error = caught.value
    assert (error.limiter, error.workload, error.request_id) == (limiter.name, "defualt", "req-2")
    assert error.run_id == "run-1"
    assert limiter.requests == []


@pytest.mark.parametrize("whose", ["run", "slot"])
def test_a_cancelled_run_or_slot_is_refused_before_the_limiter_is_asked(
    custom_limiter: CustomFactory, whose: str
) -> None:
    limiter = custom_limiter(1)
    cancelled = CancellationToken()
    cancelled.cancel()
    context = _run(limiter=limiter, cancel=cancelled if whose == "run" else None)
    with pytest.raises(ConcurrencyCancelledError, match="before it asked") as caught:
        build_request(context, cancel=cancelled if whose == "slot" else None)
    assert caught.value.limiter == limiter.name
    assert limiter.requests == []


def test_a_spent_budget_is_refused_as_a_timeout_before_the_limiter_is_asked(
    custom_limiter: CustomFactory,
) -> None:
    limiter = custom_limiter(1)
    context = _run(limiter=limiter, deadline=Deadline.after_ms(-1))
    with pytest.raises(ConcurrencyTimeoutError, match="budget ended before") as caught:
        build_request(context)
    assert caught.value.limiter == limiter.name
    assert limiter.requests == []


def _admission(limiter: ConcurrencyLimiter, request_id: str) -> Admission:
    def acquire(*_: object) -> tuple[Lease, ...]:
        raise AssertionError("building a request must not acquire")

    return Admission(acquire, limiters=(limiter,), request_id=request_id)


def test_building_a_request_never_touches_the_runs_admission() -> None:
    # The first slot is decided before the body (runcell_celery.slot.preadmit) and
    # adopted by Slot; resolving a request neither acquires nor claims it.
    limiter = create_concurrency_limiter(1)
    admission = _admission(limiter, "delivery-1")
    context = _run(limiter=limiter, admission=admission)
    first = build_request(context)
    assert first.request.request_id != "delivery-1"
    assert admission.admitted is None
    assert build_request(context, request_id="chosen").request.request_id == "chosen"
