"""``guard``: one slot per call of a provider function, stream or coroutine."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TYPE_CHECKING, Any

import pytest

from runcell_celery import (
    CancellationToken,
    ConcurrencyCancelledError,
    ConcurrencyLeaseLostError,
    ConcurrencyTimeoutError,
    create_concurrency_limiter,
    guard,
    run,
    slot,
)

if TYPE_CHECKING:
    from tests.conftest import EventRecorder

    Full = Callable[..., Any]


def test_guard_holds_a_slot_for_each_call_of_a_function(events: EventRecorder) -> None:
    limiter = create_concurrency_limiter(1, name="guarded")

    @guard(limiter=limiter)
    def complete(prompt: str) -> int:
        """Send ``prompt``."""
        return limiter.stats().active

    assert complete("hello") == 1
    assert complete("again") == 1
    assert limiter.stats().active == 0
    assert complete.__name__ == "complete"
    assert complete.__doc__ == "Send ``prompt``."
    acquired = events.of("acquired", limiter="guarded")
    assert len(acquired) == 2
    assert acquired[0].request_id != acquired[1].request_id


def test_guard_holds_a_slot_for_each_call_of_a_coroutine_function() -> None:
    limiter = create_concurrency_limiter(1)

    @guard(limiter=limiter)
    async def complete(prompt: str) -> int:
        await asyncio.sleep(0)
        return limiter.stats().active

    assert asyncio.run(complete("hello")) == 1
    assert limiter.stats().active == 0


def test_guard_holds_the_slot_until_a_stream_is_exhausted() -> None:
    limiter = create_concurrency_limiter(1)

    @guard(limiter=limiter)
    def stream(prompt: str) -> Iterator[int]:
        for _ in range(3):
            yield limiter.stats().active

    chunks = stream("hello")
    assert limiter.stats().active == 0  # nothing is held before iteration starts
    assert list(chunks) == [1, 1, 1]
    assert limiter.stats().active == 0


def test_guard_releases_the_slot_when_a_stream_is_closed_early() -> None:
    limiter = create_concurrency_limiter(1)

    @guard(limiter=limiter)
    def stream(prompt: str) -> Iterator[int]:
        yield from range(100)

    chunks = stream("hello")
    assert next(chunks) == 0
    assert limiter.stats().active == 1
    chunks.close()
    assert limiter.stats().active == 0


def test_guard_holds_the_slot_until_an_async_stream_is_exhausted_or_closed() -> None:
    limiter = create_concurrency_limiter(1)

    @guard(limiter=limiter)
    async def stream(prompt: str) -> AsyncIterator[int]:
        for _ in range(3):
            await asyncio.sleep(0)
            yield limiter.stats().active

    async def main() -> list[int]:
        seen = [chunk async for chunk in stream("hello")]
        seen.append(limiter.stats().active)
        chunks = stream("again")
        seen.append(await anext(chunks))
        await chunks.aclose()
        seen.append(limiter.stats().active)
        return seen

    assert asyncio.run(main()) == [1, 1, 1, 0, 1, 0]


def test_a_bare_guard_uses_the_runs_limiter_and_workload(events: EventRecorder) -> None:
    limiter = create_concurrency_limiter(
        2, name="bare", workloads={"interactive": {}, "background": {}}
    )

    @guard
    def complete(prompt: str) -> str:
        return prompt.upper()

    with run(limiter=limiter, workload="background"):
        assert complete("hi") == "HI"
    assert events.of("acquired", limiter="bare")[0].workload == "background"


def test_a_guard_can_select_a_workload(events: EventRecorder) -> None:
    limiter = create_concurrency_limiter(
        2, name="guard-workload", workloads={"interactive": {}, "background": {}}
    )

    @guard(limiter=limiter, workload="interactive")
    def complete() -> None:
        return None

    complete()
    assert events.of("acquired", limiter="guard-workload")[0].workload == "interactive"


def test_a_guarded_call_that_gets_no_slot_never_runs(limiter_full: Full) -> None:
    limiter = create_concurrency_limiter(1, workloads={"default": {"max_wait_ms": 10}})
    calls: list[str] = []

    @guard(limiter=limiter)
    def complete(prompt: str) -> None:
        calls.append(prompt)

    with limiter_full(limiter), pytest.raises(ConcurrencyTimeoutError):
        complete("hello")
    assert calls == []


async def consume(stream: AsyncIterator[int], pause_s: float, seen: list[int]) -> None:
    async for chunk in stream:
        seen.append(chunk)
        await asyncio.sleep(pause_s)  # the consumer's own work between chunks


@pytest.mark.parametrize(
    ("chunk_s", "pause_s"),
    [(0.001, 0.02), (0.02, 0.001)],
    ids=["lost-while-the-consumer-works", "lost-while-the-stream-reads"],
)
def test_an_async_stream_that_loses_its_slot_fails_its_consumer_with_the_loss(
    chunk_s: float, pause_s: float
) -> None:
    limiter = create_concurrency_limiter(1, max_hold_ms=60)

    @guard(limiter=limiter)
    async def stream() -> AsyncIterator[int]:
        for number in range(1_000):
            await asyncio.sleep(chunk_s)  # reading the provider's response
            yield number

    async def main() -> tuple[list[int], int]:
        seen: list[int] = []
        with pytest.raises(ConcurrencyLeaseLostError, match="max_hold_ms"):
            await consume(stream(), pause_s, seen)
        task = asyncio.current_task()
        assert task is not None
        await asyncio.sleep(0)  # the consumer's task was not left cancelled
        return seen, task.cancelling()

    seen, cancelling = asyncio.run(main())
    assert 0 < len(seen) < 1_000
    assert cancelling == 0
    assert limiter.stats().active == 0


# -- the interruptible window ----------------------------------------------------------------


def test_an_abort_outside_the_interruptible_window_leaves_the_task_running() -> None:
    limiter = create_concurrency_limiter(1)
    cancel = CancellationToken()
    seen: list[str] = []

    async def provider_call() -> None:
        async with slot(limiter, cancel=cancel) as held:
            with held.interruptible():
                await asyncio.sleep(0)
            cancel.cancel()  # the consumer's code runs now: not to be cancelled
            await asyncio.sleep(0.01)
            seen.append(f"aborted={held.aborted}")

    async def main() -> None:
        with pytest.raises(ConcurrencyCancelledError):
            await provider_call()

    asyncio.run(main())
    assert seen == ["aborted=True"]
    assert limiter.stats().active == 0


def test_an_abort_inside_the_interruptible_window_cancels_the_step() -> None:
    limiter = create_concurrency_limiter(1)
    cancel = CancellationToken()
    seen: list[str] = []

    async def provider_call() -> None:
        async with slot(limiter, cancel=cancel) as held:
            with held.interruptible():
                cancel.cancel()
                try:
                    await asyncio.sleep(10)  # reading the provider's response
                except asyncio.CancelledError:
                    seen.append("read cancelled")
                    raise

    async def main() -> None:
        with pytest.raises(ConcurrencyCancelledError):
            await provider_call()
        task = asyncio.current_task()
        assert task is not None
        seen.append(f"cancelling={task.cancelling()}")

    asyncio.run(main())
    assert seen == ["read cancelled", "cancelling=0"]


def test_a_slot_must_be_held_to_mark_a_window_interruptible() -> None:
    with pytest.raises(RuntimeError, match="held slot"):
        slot(create_concurrency_limiter(1)).interruptible()
