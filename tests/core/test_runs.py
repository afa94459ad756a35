"""Runs: lineage, nested runs, the time budget and cancellation, as the spec describes."""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import pytest

from runcell_celery import (
    CancellationToken,
    ConcurrencyCancelledError,
    ConcurrencyConfigError,
    ConcurrencyTimeoutError,
    Deadline,
    RunContext,
    create_concurrency_limiter,
    current_run,
    run,
    slot,
)

if TYPE_CHECKING:
    from tests.conftest import EventRecorder
    from tests.core.conftest import CustomLimiter

    CustomFactory = Callable[..., CustomLimiter]
    Full = Callable[..., Any]

SOON_S = 10.0


def claude(name: str = "claude", max_concurrent: int = 4, **options: Any) -> Any:
    return create_concurrency_limiter(
        max_concurrent,
        name=name,
        workloads={"interactive": {"reserved": 1, "priority": 10}, "background": {}},
        **options,
    )


def in_thread(func: Callable[[], Any]) -> Any:
    """Run ``func`` in a new thread with the caller's context; return its result."""
    context = contextvars.copy_context()
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(context.run, func).result(SOON_S)


# -- lineage -----------------------------------------------------------------------------------


def test_a_run_is_the_root_of_its_own_tree() -> None:
    assert current_run() is None
    with run() as root:
        assert current_run() is root
        assert root.root_run_id == root.run_id
        assert root.parent_run_id is None
    assert current_run() is None


def test_a_run_inside_another_is_its_child() -> None:
    with run(run_id="parent") as parent, run(run_id="child") as child:
        assert (child.run_id, child.parent_run_id, child.root_run_id) == (
            "child",
            "parent",
            "parent",
        )
        with run() as grandchild:
            assert grandchild.parent_run_id == "child"
            assert grandchild.root_run_id == "parent"
        assert current_run() is child
    assert parent.lineage.run_id == "parent"


def test_a_run_continued_in_another_process_takes_its_lineage_from_the_caller() -> None:
    with run(run_id="task-2", root_run_id="root-1", parent_run_id="task-1") as context:
        assert (context.root_run_id, context.parent_run_id) == ("root-1", "task-1")


def test_slot_events_carry_the_lineage_of_the_run(events: EventRecorder) -> None:
    limiter = create_concurrency_limiter(1, name="lineage")
    with run(limiter=limiter, run_id="parent"), run(run_id="child", name="summarize"), slot():
        pass
    acquired = events.of("acquired", limiter="lineage")[0]
    assert (acquired.run_id, acquired.parent_run_id, acquired.root_run_id) == (
        "child",
        "parent",
        "parent",
    )
    assert acquired.holder_name == "summarize"


def test_the_run_follows_asyncio_tasks_and_copied_contexts() -> None:
    async def main() -> tuple[RunContext | None, RunContext | None]:
        async with run(run_id="async-run"):
            task_run = await asyncio.create_task(asyncio.sleep(0, current_run()))
            thread_run = await asyncio.to_thread(current_run)
            return task_run, thread_run

    task_run, thread_run = asyncio.run(main())
    assert task_run is not None
    assert thread_run is not None
    assert task_run.run_id == thread_run.run_id == "async-run"


# -- nested runs: limiter and workload -----------------------------------------------------------


def test_a_child_inherits_the_parents_limiter_and_workload(events: EventRecorder) -> None:
    limiter = claude("inherit")
    with run(limiter=limiter, workload="background"), run() as child:
        assert child.limiter is limiter
        assert child.workload == "background"
        with slot():
            pass
    (acquired,) = events.of("acquired", limiter="inherit")
    assert acquired.workload == "background"


def test_a_child_that_selects_a_workload_uses_it() -> None:
    limiter = claude()
    with run(limiter=limiter, workload="background"), run(workload="interactive") as child:
        assert child.workload == "interactive"


def test_a_childs_own_default_workload_does_not_replace_the_parents() -> None:
    limiter = claude()
    with (
        run(limiter=limiter, workload="background"),
        run(default_workload="interactive") as child,
        run(limiter=limiter, default_workload="interactive") as same_limiter_child,
    ):
        assert child.workload == "background"
        assert same_limiter_child.workload == "background"


def test_a_root_runs_default_workload_applies_when_it_selects_none() -> None:
    limiter = claude()
    with run(limiter=limiter, default_workload="interactive") as root:
        assert root.workload == "interactive"


def test_a_child_with_a_different_limiter_uses_that_limiter_and_its_own_workload(
    events: EventRecorder,
) -> None:
    parent_limiter = claude("parent-limiter")
    child_limiter = create_concurrency_limiter(
        1, name="child-limiter", workloads={"fast": {}, "slow": {}}, default_workload="slow"
    )
    with (
        run(limiter=parent_limiter, workload="background"),
        run(limiter=child_limiter) as child,
    ):
        assert child.limiter is child_limiter
        assert child.workload == "slow"
        with slot():
            pass
        with run(limiter=child_limiter, default_workload="fast") as other:
            assert other.workload == "slow"  # same limiter as its parent: inherited
    (acquired,) = events.of("acquired")
    assert (acquired.limiter, acquired.workload) == ("child-limiter", "slow")
    assert parent_limiter.stats().active == 0


def test_a_child_with_a_different_limiter_uses_its_own_default_workload() -> None:
    with (
        run(limiter=claude(), workload="background"),
        run(limiter=claude("gpt"), default_workload="interactive") as child,
    ):
        assert child.workload == "interactive"


def test_a_slot_for_another_limiter_inside_a_run_uses_that_limiters_workload(
    events: EventRecorder,
) -> None:
    other = create_concurrency_limiter(1, name="embeddings")
    with run(limiter=claude(), workload="background"), slot(other):
        pass
    assert events.of("acquired", limiter="embeddings")[0].workload == "default"


def test_a_run_that_selects_a_workload_without_a_limiter_is_a_config_error() -> None:
    with pytest.raises(ConcurrencyConfigError, match="has no limiter"), run(workload="batch"):
        pass


def test_config_errors_at_the_start_of_a_run_name_the_run() -> None:
    with (
        run(run_id="parent"),
        pytest.raises(ConcurrencyConfigError) as caught,
        run(limiter=claude(), workload="batch", run_id="child"),
    ):
        pass
    error = caught.value
    assert (error.limiter, error.workload) == ("claude", "batch")
    assert (error.run_id, error.root_run_id, error.parent_run_id) == ("child", "parent", "parent")


# -- nested runs: a parent waiting for a child holds no slot ---------------------------------------


def test_with_one_slot_a_parent_can_call_a_child_and_continue(events: EventRecorder) -> None:
    limiter = create_concurrency_limiter(1, name="one-slot")
    steps: list[str] = []

    def child_agent() -> None:
        with run(run_id="child"), slot():
            steps.append("child provider call")

    with run(limiter=limiter, run_id="parent", timeout_ms=SOON_S * 1000):
        with slot():
            steps.append("parent provider call")
        in_thread(child_agent)  # the tool runs the child and waits for it
        with slot():
            steps.append("parent resumes")
    assert steps == ["parent provider call", "child provider call", "parent resumes"]
    assert [e.run_id for e in events.of("acquired", limiter="one-slot")] == [
        "parent",
        "child",
        "parent",
    ]
    assert events.of("wait-started", limiter="one-slot") == []


def test_with_one_slot_an_async_parent_can_await_a_child() -> None:
    limiter = create_concurrency_limiter(1)
    steps: list[str] = []

    async def child_agent() -> None:
        async with run(), slot():
            steps.append("child")

    async def parent_agent() -> None:
        async with run(limiter=limiter, timeout_ms=SOON_S * 1000):
            async with slot():
                steps.append("parent")
            await asyncio.create_task(child_agent())
            async with slot():
                steps.append("parent again")

    asyncio.run(parent_agent())
    assert steps == ["parent", "child", "parent again"]


def test_a_child_gets_no_exemption_and_waits_in_the_same_queue(
    events: EventRecorder, limiter_full: Full
) -> None:
    limiter = create_concurrency_limiter(1, name="no-exemption")
    with (
        run(limiter=limiter),
        run(timeout_ms=30),
        limiter_full(limiter),
        pytest.raises(ConcurrencyTimeoutError),
        slot(),
    ):
        pass
    assert events.types(limiter="no-exemption") == ["wait-started", "timed-out"]


# -- time budget -----------------------------------------------------------------------------------


def test_a_childs_budget_is_cut_to_the_parents_remaining_budget() -> None:
    with run(timeout_ms=1_000) as parent:
        assert parent.deadline is not None
        with run(timeout_ms=60_000) as longer:
            assert longer.deadline == parent.deadline
        with run() as unbounded:
            assert unbounded.deadline == parent.deadline
        with run(timeout_ms=10) as shorter:
            assert shorter.deadline is not None
            assert shorter.deadline < parent.deadline


def test_a_budget_carried_from_another_process_is_honoured() -> None:
    with run(deadline_at=time.time() + 0.5) as carried:
        remaining = carried.remaining_ms()
        assert remaining is not None
        assert remaining <= 500
        stamp = carried.deadline_timestamp()
        assert stamp is not None
        assert stamp <= time.time() + 0.5
    with run(deadline_at=time.time() + 60, timeout_ms=100) as both:
        remaining = both.remaining_ms()
        assert remaining is not None
        assert remaining <= 100


def test_a_run_without_a_budget_has_no_deadline() -> None:
    with run() as context:
        assert context.deadline is None
        assert context.remaining_ms() is None
        assert context.deadline_timestamp() is None


@pytest.mark.parametrize(
    ("max_wait_ms", "timeout_ms", "bound_s"),
    [(60_000, 80, 0.08), (80, 60_000, 0.08), (None, 80, 0.08)],
)
def test_a_slot_waits_until_the_smaller_of_max_wait_and_the_remaining_budget(
    events: EventRecorder,
    limiter_full: Full,
    limiter_name: str,
    max_wait_ms: int | None,
    timeout_ms: int,
    bound_s: float,
) -> None:
    limiter = create_concurrency_limiter(
        1, name=limiter_name, workloads={"default": {"max_wait_ms": max_wait_ms}}
    )
    with (
        limiter_full(limiter),
        run(limiter=limiter, timeout_ms=timeout_ms),
        pytest.raises(ConcurrencyTimeoutError),
        slot(),
    ):
        pass
    started = events.of("wait-started", limiter=limiter_name)[0]
    assert started.deadline is not None
    assert started.timestamp < started.deadline <= started.timestamp + bound_s
    assert events.types(limiter=limiter_name) == ["wait-started", "timed-out"]


def test_waiting_for_a_slot_counts_against_the_budget(
    custom_limiter: CustomFactory, events: EventRecorder, limiter_full: Full
) -> None:
    limiter = custom_limiter(1)

    def provider_call() -> None:
        with slot():
            pass

    with run(limiter=limiter, timeout_ms=5_000), ThreadPoolExecutor(1) as pool:
        with limiter_full(limiter.inner):
            waiter = pool.submit(contextvars.copy_context().run, provider_call)
            events.wait_for("wait-started", limiter=limiter.name)
            time.sleep(0.1)  # the slot stays taken a while
        waiter.result(SOON_S)
        provider_call()  # the same run's next request
    first, second = limiter.requests
    waited = events.of("acquired", limiter=limiter.name)[0].wait_ms
    assert waited is not None
    assert waited >= 100
    assert first.timeout_ms is not None
    assert first.timeout_ms <= 5_000
    assert second.timeout_ms is not None
    assert second.timeout_ms <= first.timeout_ms - waited


def test_a_run_whose_budget_ended_does_not_ask_for_a_slot(
    custom_limiter: CustomFactory, events: EventRecorder
) -> None:
    limiter = custom_limiter(1)
    with run(limiter=limiter, timeout_ms=1) as context:
        while (context.remaining_ms() or 0) > 0:
            time.sleep(0.001)
        with pytest.raises(ConcurrencyTimeoutError, match="budget ended before"), slot():
            pass
    assert limiter.requests == []
    assert events.types(limiter=limiter.name) == ["timed-out"]


def test_the_end_of_the_budget_during_a_hold_aborts_it(events: EventRecorder) -> None:
    limiter = create_concurrency_limiter(1, name="budget-hold")
    seen: list[str] = []

    async def provider_call() -> None:
        async with run(limiter=limiter, timeout_ms=50), slot():
            await asyncio.sleep(SOON_S)
            seen.append("body finished")

    async def main() -> None:
        with pytest.raises(ConcurrencyTimeoutError, match="budget ended while holding"):
            await provider_call()

    asyncio.run(main())
    assert seen == []
    assert events.of("released", limiter="budget-hold")[0].outcome == "timed-out"
    assert limiter.stats().active == 0


# -- cancellation ----------------------------------------------------------------------------


def test_cancelling_the_parent_cancels_a_childs_waiting_slot(
    events: EventRecorder, limiter_full: Full
) -> None:
    limiter = create_concurrency_limiter(1, name="cancel-parent")
    parent_cancel = CancellationToken()

    def child_agent() -> None:
        with run(cancel=CancellationToken()), slot():
            pass

    with run(limiter=limiter, cancel=parent_cancel), limiter_full(limiter):
        context = contextvars.copy_context()
        with ThreadPoolExecutor(1) as pool:
            child = pool.submit(context.run, child_agent)
            events.wait_for("wait-started", limiter="cancel-parent")
            parent_cancel.cancel("the user closed the chat")
            with pytest.raises(ConcurrencyCancelledError):
                child.result(SOON_S)
    assert limiter.stats().queued == 0


def test_cancelling_a_child_does_not_cancel_its_parent() -> None:
    parent_cancel = CancellationToken()
    child_cancel = CancellationToken()
    with run(cancel=parent_cancel) as parent, run(cancel=child_cancel) as child:
        assert child.cancel is not None
        child_cancel.cancel()
        assert child.cancel.is_set()
    assert parent.cancel is parent_cancel
    assert not parent_cancel.is_set()


def test_a_child_inherits_the_parents_cancellation() -> None:
    parent_cancel = CancellationToken()
    with run(cancel=parent_cancel), run() as child:
        assert child.cancel is parent_cancel


def test_a_finished_child_stops_following_its_parents_cancellation() -> None:
    parent_cancel = CancellationToken()
    with run(cancel=parent_cancel):
        with run(cancel=CancellationToken()) as child:
            linked = child.cancel
        parent_cancel.cancel()
    assert linked is not None
    assert not linked.is_set()


# -- run options and deadlines -------------------------------------------------------------------


def test_a_runs_deadline_is_a_deadline_value_and_the_earliest_given_wins() -> None:
    given = Deadline.after_ms(5_000)
    with run(deadline=given) as context:
        assert context.deadline == given
    with run(deadline=given, timeout_ms=100) as shorter:
        assert shorter.deadline is not None
        assert shorter.deadline < given
    with run(deadline=given, deadline_at=time.time() + 1) as carried:
        assert carried.deadline is not None
        assert carried.deadline < given
        assert 0 < carried.deadline.remaining_ms() <= 1_000


@pytest.mark.parametrize("timeout_ms", [float("inf"), 1e300, float("nan"), 2**31])
def test_a_budget_past_the_longest_duration_is_rejected_naming_the_bound(
    timeout_ms: float,
) -> None:
    with pytest.raises(ConcurrencyConfigError, match=r"run\(timeout_ms\) = .* is invalid"):
        run(timeout_ms=timeout_ms)


def test_no_budget_is_none() -> None:
    with run(timeout_ms=None) as context:
        assert context.deadline is None
        assert context.remaining_ms() is None


def test_a_runs_options_are_kept_as_given_in_a_frozen_value() -> None:
    limiter = create_concurrency_limiter(1)
    opened = run(limiter=limiter, workload="default", timeout_ms=50, name="task")
    assert (opened.options.limiter, opened.options.workload) == (limiter, "default")
    assert (opened.options.timeout_ms, opened.options.name) == (50, "task")
    with pytest.raises(dataclasses.FrozenInstanceError):
        opened.options.name = "other"  # type: ignore[misc]
